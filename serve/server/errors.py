"""What every transport shares about failures: `ApiError` values with a code, and `ERROR_STATUS`, the one place
that maps codes to HTTP statuses (gRPC maps the same codes in `serve.server.grpc.service`). Every error body is
JSON: {"error": {"code": ..., "message": ...}}, but for the /v2 routes' own, in the KServe v2 protocol's shape
{"error": "message", "code": "..."} (`serve.server.api.v2`).
"""

from __future__ import annotations

import json
import re
import reprlib
from collections.abc import Iterator
from contextlib import contextmanager

from serve.runtime.images import ImageError

ERROR_STATUS = {
    "empty": 422,  # zero bytes
    "corrupt": 422,  # an image header, but the data is truncated or broken
    "bad_request": 422,  # a parameter or a tensor that does not fit
    "non_finite": 422,  # NaN or infinite pixel values
    "bad_host": 400,  # a Host header not in --allowed-hosts
    "malformed_request": 400,  # not a request HTTP/1.1 can parse
    "bad_upload": 400,  # a UI upload Gradio cannot read (Gradio's own status for a malformed one)
    "unauthorized": 401,  # no API key, or a wrong one
    "not_an_image": 415,  # no image header at all
    "unsupported": 415,  # an image mode or array we cannot use
    "unsupported_media_type": 415,  # a content type that cannot carry an image
    "too_large": 413,  # over the pixel limit (checked from the header)
    "body_too_large": 413,  # over max_bytes
    "length_required": 411,  # a UI upload without Content-Length
    "forbidden": 403,  # a file the UI does not serve (Gradio's own refusal)
    "not_found": 404,
    "load_failed": 400,  # a model version that failed its checks on load (Triton's status for it)
    "model_control": 400,  # load or unload on a server of one file (Triton's status where it has no model control)
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
    "insufficient_storage": 507,  # the UI's upload folder is at --ui-cache-bytes
    "not_implemented": 501,  # a transfer coding other than chunked
}


ECHO_CHARS = 200  # the most of a quoted value (a name or parameter a client sent, echoed back) in a message


class _Echo(reprlib.Repr):
    """`echo`'s repr: lists cut to 8 items, strings to their start (`cut_echoes` then cuts them to `ECHO_CHARS`
    with an ellipsis, as every quoted value in a message)."""

    def repr_str(self, x: str, level: int) -> str:
        return repr(x[: self.maxstring])


ECHO = _Echo()
ECHO.maxlist = ECHO.maxtuple = ECHO.maxdict = ECHO.maxset = 8
ECHO.maxstring = ECHO.maxother = 2 * ECHO_CHARS
ECHO.fillvalue = "…"

# a quote that opens a value: not an apostrophe (can't), not escaped
OPENING = {q: re.compile(rf"(?<![\w'\"\\]){q}") for q in "'\""}


def echo(value: object) -> str:
    """`repr(value)` for a message, its lists cut to 8 items and its strings to `ECHO_CHARS` as it is written: a
    shape of ten million dimensions costs a few items' formatting, not seconds and tens of MB."""
    return ECHO.repr(value)


def cut_echoes(message: str) -> str:
    """`message` with each quoted value over `ECHO_CHARS` (as `repr` quotes one) cut to its start and an ellipsis:
    a client that sends a 20 kB name gets an error that names its start, not 20 kB back. One pass over the text."""
    out, i, ahead = [], 0, {}  # quote -> where its next opening is (-1: none), from a search not yet passed
    while True:
        for q, pattern in OPENING.items():
            at = ahead.get(q)
            if at is None or 0 <= at < i:  # not looked for yet, or passed inside a value of the other kind
                m = pattern.search(message, i)
                ahead[q] = -1 if m is None else m.start()
        starts = [at for at in ahead.values() if at >= 0]
        if not starts:
            break
        start = min(starts)
        end = _closing(message, start + 1, message[start])
        if end < 0:  # never closed, nor will a later one of this kind be: look for the other kind only
            ahead[message[start]] = -1
            continue
        value = message[start : end + 1]
        out += [message[i:start], value if len(value) <= ECHO_CHARS + 2 else value[: ECHO_CHARS + 1] + "…" + value[0]]
        i = end + 1
    return "".join(out) + message[i:]


def _closing(text: str, start: int, quote: str) -> int:
    """The index of the first `quote` from `start` that no backslash escapes, or -1."""
    k = text.find(quote, start)
    while k >= 0:
        backslashes = 0
        while k - 1 - backslashes >= start and text[k - 1 - backslashes] == "\\":
            backslashes += 1
        if backslashes % 2 == 0:
            return k
        k = text.find(quote, k + 1)
    return -1


class ApiError(Exception):
    """A failed request as a value: a code from `ERROR_STATUS` and a message the user can act on (the values it
    quotes cut, `cut_echoes`)."""

    def __init__(self, code: str, message: str, headers: dict[str, str] | None = None):
        message = cut_echoes(message)
        super().__init__(message)
        self.code, self.message, self.headers = code, message, headers or {}

    @property
    def status(self) -> int:
        return ERROR_STATUS[self.code]


def error_body(code: str, message: str) -> bytes:
    """The one JSON error body, as bytes: every layer (protocol, guard, routes, UI glue) sends this."""
    return json.dumps({"error": {"code": code, "message": message}}).encode()


@contextmanager
def image_errors_as_api_errors() -> Iterator[None]:
    """An `ImageError` becomes the `ApiError` of its kind."""
    try:
        yield
    except ImageError as e:
        raise ApiError(e.kind if e.kind in ERROR_STATUS else "corrupt", str(e)) from None
