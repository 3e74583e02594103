"""Errors as HTTP answers: the JSON body of `serve.server.errors` sent through ASGI or FastAPI, FastAPI's and
Starlette's own errors in the same shape, and the JSON 404/405 of paths the API does not have.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import BaseRoute, Match, Route

from serve.server.errors import ERROR_STATUS, ApiError, error_body

log = logging.getLogger(__name__)


async def send_error(send, code: str, message: str, headers: dict[str, str] | None = None) -> None:
    """Send the error answer through a raw ASGI `send` (the layers outside FastAPI: guard, UI glue)."""
    body = error_body(code, message)
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": ERROR_STATUS[code], "headers": raw})
    await send({"type": "http.response.body", "body": body})


def error_response(err: ApiError, retry_after_s: int) -> Response:
    """The answer for `err`, with Retry-After on a 503."""
    headers = {**err.headers, **({"Retry-After": str(retry_after_s)} if err.status == 503 else {})}
    return Response(error_body(err.code, err.message), err.status, headers=headers, media_type="application/json")


def add_error_handlers(app: FastAPI, retry_after_s: int) -> None:
    """Our errors, FastAPI's validation errors and Starlette's routing errors, all as the JSON body above (anything
    unexpected: `serve.server.http.record.RequestRecord`)."""

    @app.exception_handler(ApiError)
    @app.exception_handler(ClientDisconnect)
    async def _raised(request: Request, err: Exception):
        return response_for(err, request, retry_after_s)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, err: RequestValidationError):
        where = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        return error_response(ApiError("bad_request", f"invalid request: {where}"), retry_after_s)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException):
        # Starlette's own errors: its routing (404, 405) and its form parser (a malformed multipart body)
        code = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}.get(err.status_code, "bad_request")
        return error_response(ApiError(code, str(err.detail)), retry_after_s)


def response_for(err: Exception, request: Request, retry_after_s: int) -> Response:
    """The answer to a request whose route raised `err`: an `ApiError`'s own, or 499 (logged, counted, never sent)
    when the client went away. Anything else is answered by `serve.server.http.record.RequestRecord`."""
    if isinstance(err, ClientDisconnect):  # the client's own doing, not a fault here: one line at info level
        log.info("client went away during %s %s before the answer", request.method, request.url.path)
        return Response(status_code=ERROR_STATUS["client_closed"])
    return error_response(err, retry_after_s)


def add_fallback_routes(app: FastAPI, api_routes: list[BaseRoute]) -> None:
    """Any other /v1 or /v2 request gets a JSON 404 or 405 (the UI at `/` would otherwise answer it).

    Args:
        app: the app, which holds `api_routes` already.
        api_routes: the API's routes: the paths that exist, and the methods they take (any other entry, such as
            an included router, is passed over).
    """
    api_routes = [route for route in api_routes if isinstance(route, Route)]

    async def no_such_route(request: Request):
        path = request.url.path
        allowed = sorted(
            {m for r in api_routes if r.matches(request.scope)[0] == Match.PARTIAL for m in getattr(r, "methods", ())}
        )
        if allowed:
            raise ApiError(
                "method_not_allowed",
                f"{path!r} takes {', '.join(allowed)}, not {request.method}",
                {"Allow": ", ".join(allowed)},
            )
        bare = {**request.scope, "path": path.rstrip("/")}
        if path.endswith("/") and any(r.matches(bare)[0] != Match.NONE for r in api_routes):
            raise ApiError("not_found", f"no route {path!r}: drop the trailing slash ({path.rstrip('/')!r})")
        api = "the API is POST /v1/classify and the KServe v2 paths under /v2"
        raise ApiError("not_found", f"no route {path!r}: {api}")

    async def any_method(scope, receive, send):  # a plain ASGI app: Starlette routes every method to it
        await no_such_route(Request(scope, receive))

    endpoint = _AsgiEndpoint(any_method)
    for path in ("/v1", "/v1/{rest:path}", "/v2", "/v2/{rest:path}", "/healthz", "/readyz", "/metrics"):
        app.router.add_route(path, endpoint, include_in_schema=False)


class _AsgiEndpoint:
    """An ASGI callable that is not a function, so that its route passes it every method (TRACE too)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        await self.app(scope, receive, send)
