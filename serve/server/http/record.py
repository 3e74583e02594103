"""The outermost ASGI layer: a record of every request, in the metrics and the access log.

Each request gets an ID (the client's `X-Request-Id` when it is sane, else a new one: `serve.server.auth.RequestIds`),
echoed in the response, written in one access log line (`serve.server.access_log`) and counted in the Prometheus
metrics under its route, with the status the client got: 499 when it went away first, the 400 of a malformed body
that the connection answered itself (`serve.server.http.protocol`). It sits outside the Host and key checks
(`serve.server.http.guard`), so that their refusals are counted and logged too.
"""

from __future__ import annotations

import logging
import time

from serve.server.access_log import ACCESS_LOG
from serve.server.auth import RequestIds
from serve.server.errors import ERROR_STATUS
from serve.server.http.errors import send_error
from serve.server.http.protocol import ANSWERED
from serve.server.metrics import CLIENT_CLOSED, Metrics

log = logging.getLogger(__name__)


class RequestRecord:
    """ASGI middleware: request ID, one access log line and metrics per request; an error no layer answered is a
    JSON 500, logged once with its traceback.

    Args:
        app: the ASGI app to wrap.
        metrics: where to count requests (None: nowhere).
        routes: path prefixes to count, each under its own prefix as the route label; other paths (the
            UI's assets) are logged but not counted.
    """

    def __init__(self, app, metrics: Metrics | None = None, routes: tuple[str, ...] = ()):
        self.app, self.metrics, self.routes = app, metrics, routes
        self.request_id = RequestIds()
        self.access_log = ACCESS_LOG

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status = time.perf_counter(), CLIENT_CLOSED
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = self.request_id(given)
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        gone = False  # the client disconnected: what fails after that is not a fault of the server

        async def receive_watching():
            nonlocal gone
            message = await receive()
            gone = gone or message["type"] == "http.disconnect"
            return message

        try:
            await self.app(scope, receive_watching, send_with_id)
        except Exception as e:
            if gone:  # e.g. Gradio's upload route, whose parser fails when the body stops: one line, no traceback
                log.info("client went away during %s %s before the answer", scope["method"], scope["path"])
            elif status == CLIENT_CLOSED:  # nothing sent yet: a JSON 500 (uvicorn's would be plain text)
                log.error("unexpected error on %s", scope["path"], exc_info=e)
                await send_error(send_with_id, "internal", f"internal error ({type(e).__name__}); see the server log")
            else:
                raise  # an answer already under way: uvicorn ends the connection and logs it
        finally:
            status = CLIENT_CLOSED if gone and status >= ERROR_STATUS["internal"] else status
            status = scope["state"].get(ANSWERED, status)  # a malformed body, refused below the app (`protocol`)
            path = scope["path"]
            route = next((r for r in self.routes if path == r or path.startswith(r + "/")), None)
            if self.metrics is not None and route is not None:
                self.metrics.observe(route, status, started)
            client = scope.get("client") or ("-", 0)
            ms = (time.perf_counter() - started) * 1000
            self.access_log.write(client[0], scope["method"], path, status, ms, request_id)
