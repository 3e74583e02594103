"""FastLane: the requests that carry the load (POST /v1/classify and its per-model paths) go straight to their
handler, past FastAPI's exception middleware, exit stacks, router and route wrappers.

Those layers cost the sample 7 % of the server's CPU per request, and the lane answered 1.10x the requests per
second (`benchmarks.serve_ab` against the plain Starlette routes it replaced; BENCHMARKS.md, the repository server). The
lane sits just inside `RequestGuard`, so each request still gets its ID, its Host and API-key checks, its
access-log line and its metrics, and an error gets the answer FastAPI's handlers give it (`response_for`).
FastAPI's routes of the same paths stay: they describe them in the OpenAPI document, and they answer the requests
the lane does not see (with --opentelemetry, whose spans FastAPI names by route, the lane is left out; behind a
root path, the paths do not match it).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import compile_path

from serve.server.http.errors import response_for

Handler = Callable[..., Awaitable[Response]]


class FastLane:
    """ASGI middleware: a POST whose path matches one of `routes` is answered by its handler, called with the
    `Request` and the path's parameters; everything else goes on to `app`.

    Args:
        app: the ASGI app to wrap.
        routes: (path in Starlette's syntax, e.g. "/v1/models/{name}/classify", handler) pairs.
        retry_after_s: the Retry-After of a 503 answer.
    """

    def __init__(self, app, routes: Sequence[tuple[str, Handler]], retry_after_s: int):
        self.app, self.retry_after_s = app, retry_after_s
        self.routes = [(compile_path(path)[0], handler) for path, handler in routes]

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            for pattern, handler in self.routes:
                if (found := pattern.match(scope["path"])) is not None:
                    return await self.answer(handler, found.groupdict(), scope, receive, send)
        await self.app(scope, receive, send)

    async def answer(self, handler: Handler, params: dict[str, str], scope, receive, send) -> None:
        request = Request(scope, receive, send)
        try:
            response = await handler(request, **params)
        except Exception as e:  # as FastAPI's handlers answer it (`add_error_handlers`)
            response = response_for(e, request, self.retry_after_s)
        await response(scope, receive, send)
