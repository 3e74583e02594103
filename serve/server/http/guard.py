"""The outermost ASGI layer: who may ask, and a record of every request (metrics and `access_log`).

Each request gets an ID (the client's `X-Request-Id` when it is sane, else a new one), echoed in the
response, written in one access log line and counted in the Prometheus metrics under its route, with the
status the client got (499 when it went away first). Before anything else runs, the `Host` header is checked
against an allow-list (a page on another site that rebinds its DNS name to 127.0.0.1 sends its own
name as the Host, so it gets 400 and never reaches the API or the UI) and, when the server has an API
key, the key is checked in constant time. Health routes answer without either check: load balancers
and orchestrators probe them by IP, and they tell nothing.
"""

from __future__ import annotations

import logging
import time

from serve.server.access_log import ACCESS_LOG
from serve.server.auth import RequestIds, key_refusal
from serve.server.http.errors import send_error
from serve.server.metrics import CLIENT_CLOSED, Metrics

log = logging.getLogger(__name__)

HEALTH_PATHS = ("/healthz", "/readyz", "/v2/health/live", "/v2/health/ready")
API_PREFIXES = ("/v1", "/v2", "/metrics", "/openapi.json", "/docs", "/redoc")
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def allowed_hosts_of(setting: str, bind_host: str) -> frozenset[str] | None:
    """The Host names to accept: `setting` (comma-separated; "*" for any) or the bind host and loopback.

    Returns:
        Lower-case names without ports, or None for any host.
    """
    names = [h.strip().lower() for h in setting.split(",") if h.strip()]
    if "*" in names:
        return None
    if not names:
        names = [bind_host.lower(), *LOOPBACK_HOSTS]
    return frozenset(h.strip("[]") for h in names if h not in ("0.0.0.0", "::", ""))


def host_name(value: str) -> str:
    """`example.com:8080` -> `example.com`, `[::1]:80` -> `::1`."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class RequestGuard:
    """ASGI middleware: request ID, Host allow-list, API key, one access log line and metrics per request.

    Args:
        app: the ASGI app to wrap.
        api_key: the key clients must send (empty: no key needed).
        allowed_hosts: Host names to accept (None: any).
        metrics: where to count requests (None: nowhere).
        routes: path prefixes to count, each under its own prefix as the route label; other paths (the
            UI's assets) are logged but not counted.
    """

    def __init__(
        self,
        app,
        api_key: str = "",
        allowed_hosts: frozenset[str] | None = None,
        metrics: Metrics | None = None,
        routes: tuple[str, ...] = (),
    ):
        self.app, self.allowed_hosts, self.metrics, self.routes = app, allowed_hosts, metrics, routes
        self.api_key = api_key.encode("utf-8")
        self.request_id = RequestIds()
        self.access_log = ACCESS_LOG

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket":  # none of ours; refused like any request if it breaks the rules
            if self.refusal(scope["path"], dict(scope["headers"])) is not None:
                return await send({"type": "websocket.close", "code": 1008})
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status = time.perf_counter(), CLIENT_CLOSED
        headers = dict(scope["headers"])
        given = headers.get(b"x-request-id", b"").decode("latin-1")
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
            refusal = self.refusal(scope["path"], headers)
            if refusal is None:
                await self.app(scope, receive_watching, send_with_id)
            else:
                await send_error(send_with_id, *refusal)
        except Exception:
            if not gone:
                status = 500 if status == CLIENT_CLOSED else status
                raise
            # e.g. Gradio's upload route, whose parser fails when the body stops: one line, not two tracebacks
            log.info("client went away during %s %s before the answer", scope["method"], scope["path"])
        finally:
            status = CLIENT_CLOSED if gone and status >= 500 else status
            path = scope["path"]
            route = next((r for r in self.routes if path == r or path.startswith(r + "/")), None)
            if self.metrics is not None and route is not None:
                self.metrics.observe(route, status, started)
            client = scope.get("client") or ("-", 0)
            ms = (time.perf_counter() - started) * 1000
            self.access_log.write(client[0], scope["method"], path, status, ms, request_id)

    def refusal(self, path: str, headers: dict[bytes, bytes]) -> tuple[str, str, dict[str, str]] | None:
        """(code, message, headers) of a request refused before the app sees it, or None."""
        if path in HEALTH_PATHS:
            return None
        host = host_name(headers.get(b"host", b"").decode("latin-1"))
        if self.allowed_hosts is not None and host not in self.allowed_hosts:
            return (
                "bad_host",
                f"Host {host!r} is not served here; start vit-serve with --allowed-hosts {host or 'NAME'} "
                "if this name is meant to reach it",
                {},
            )
        refused = key_refusal(self.api_key, headers)
        if refused is not None:
            challenge = (
                'Bearer realm="vitscope"'
                if path.startswith(API_PREFIXES)
                else 'Basic realm="vitscope", charset="UTF-8"'
            )
            return "unauthorized", refused, {"WWW-Authenticate": challenge}
        return None
