"""Every failure is an `ApiError` value with a code; `ERROR_STATUS` is the one place that maps codes to HTTP
statuses, and every error body is JSON: {"error": {"code": ..., "message": ...}}.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager

import numpy as np
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match, Route

from serve.runtime.images import ImageError
from serve.server.batching import QueueFull, ShuttingDown

log = logging.getLogger(__name__)

ERROR_STATUS = {
    "empty": 422,  # zero bytes
    "corrupt": 422,  # an image header, but the data is truncated or broken
    "bad_request": 422,  # a parameter or a tensor that does not fit
    "non_finite": 422,  # NaN or infinite pixel values
    "bad_host": 400,  # a Host header not in --allowed-hosts
    "bad_upload": 400,  # a UI upload Gradio cannot read (Gradio's own status for a malformed one)
    "unauthorized": 401,  # no API key, or a wrong one
    "not_an_image": 415,  # no image header at all
    "unsupported": 415,  # an image mode or array we cannot use
    "unsupported_media_type": 415,  # a content type that cannot carry an image
    "too_large": 413,  # over the pixel limit (checked from the header)
    "body_too_large": 413,  # over max_bytes
    "length_required": 411,  # a UI upload without Content-Length
    "not_found": 404,
    "load_failed": 400,  # a model version that failed its checks on load (Triton's status for it)
    "method_not_allowed": 405,
    "request_timeout": 408,  # the request head or body did not arrive in time
    "headers_too_large": 431,  # over max_header_bytes
    "client_closed": 499,  # the client went away before the answer (logged and counted, never sent)
    "queue_full": 503,
    "too_many_connections": 503,  # over max_connections
    "shutting_down": 503,
    "not_ready": 503,
    "timeout": 504,
    "internal": 500,
}


class ApiError(Exception):
    """A failed request as a value: a code from `ERROR_STATUS` and a message the user can act on."""

    def __init__(self, code: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.code, self.message, self.headers = code, message, headers or {}

    @property
    def status(self) -> int:
        return ERROR_STATUS[self.code]


def error_body(code: str, message: str) -> bytes:
    """The one JSON error body, as bytes: every layer (protocol, guard, routes, UI glue) sends this."""
    return json.dumps({"error": {"code": code, "message": message}}).encode()


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


@contextmanager
def image_errors_as_api_errors() -> Iterator[None]:
    """An `ImageError` becomes the `ApiError` of its kind."""
    try:
        yield
    except ImageError as e:
        raise ApiError(e.kind if e.kind in ERROR_STATUS else "corrupt", str(e)) from None


async def model_result(work: Awaitable, timeout_s: float):
    """Await work queued on the model's worker; its failures become the `ApiError` of their kind."""
    try:
        return await work
    except QueueFull as e:
        raise ApiError("queue_full", str(e)) from None
    except ShuttingDown as e:
        raise ApiError("shutting_down", str(e)) from None
    except (TimeoutError, asyncio.TimeoutError):  # distinct classes before Python 3.11
        raise ApiError("timeout", f"no result within {timeout_s} s; retry later") from None


async def batch_results(engine, images, timeout_s: float) -> np.ndarray:
    """The (B,) records of `engine.infer` for a request's B images, each joining the batches; the first
    failure is raised once every image has settled (nothing is left running or unobserved). One image, the
    common case, is awaited directly: a task per image costs more than the whole answer of a small model."""
    if len(images) == 1:
        return (await model_result(engine.infer(images[0]), timeout_s))[None]
    work = (model_result(engine.infer(image), timeout_s) for image in images)
    results = await asyncio.gather(*work, return_exceptions=True)
    failed = next((r for r in results if isinstance(r, BaseException)), None)
    if failed is not None:
        raise failed
    return np.stack(results)


def add_error_handlers(app: FastAPI, retry_after_s: int) -> None:
    """Our errors, FastAPI's validation errors, Starlette's routing errors and anything unexpected, all as
    the JSON body above."""

    @app.exception_handler(ApiError)
    @app.exception_handler(ClientDisconnect)
    @app.exception_handler(Exception)
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
    """The answer to a request whose route raised `err`: an `ApiError`'s own, 499 (logged, counted, never sent)
    when the client went away, and 500 with a line in the log for anything unexpected."""
    if isinstance(err, ApiError):
        return error_response(err, retry_after_s)
    if isinstance(err, ClientDisconnect):  # the client's own doing, not a fault here: one line at info level
        log.info("client went away during %s %s before the answer", request.method, request.url.path)
        return Response(status_code=ERROR_STATUS["client_closed"])
    log.error("unexpected error on %s", request.url.path, exc_info=err)
    internal = ApiError("internal", f"internal error ({type(err).__name__}); see the server log")
    return error_response(internal, retry_after_s)


def add_fallback_routes(app: FastAPI, routers: list[APIRouter]) -> None:
    """Any other /v1 or /v2 request gets a JSON 404 or 405 (the UI at `/` would otherwise answer it).

    Args:
        app: the app, which holds `routers` already.
        routers: the API's routers: their routes are the paths that exist, and the methods they take.
    """
    api_routes = [route for router in routers for route in router.routes]

    async def no_such_route(request: Request):
        path = request.url.path
        allowed = sorted(
            {m for r in api_routes if r.matches(request.scope)[0] == Match.PARTIAL for m in getattr(r, "methods", ())}
        )
        if allowed:
            raise ApiError(
                "method_not_allowed",
                f"{path} takes {', '.join(allowed)}, not {request.method}",
                {"Allow": ", ".join(allowed)},
            )
        bare = {**request.scope, "path": path.rstrip("/")}
        if path.endswith("/") and any(r.matches(bare)[0] != Match.NONE for r in api_routes):
            raise ApiError("not_found", f"no route {path}: drop the trailing slash ({path.rstrip('/')})")
        raise ApiError("not_found", f"no route {path}: the API is POST /v1/classify and the KServe v2 paths under /v2")

    async def any_method(scope, receive, send):  # a plain ASGI app: Starlette routes every method to it
        await no_such_route(Request(scope, receive))

    endpoint = _AsgiEndpoint(any_method)
    for path in ("/v1", "/v1/{rest:path}", "/v2", "/v2/{rest:path}", "/healthz", "/readyz", "/metrics"):
        app.router.routes.append(Route(path, endpoint, include_in_schema=False))


class _AsgiEndpoint:
    """An ASGI callable that is not a function, so that a `Route` passes it every method (TRACE too)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        await self.app(scope, receive, send)
