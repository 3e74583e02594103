"""decode_request: an HTTP request -> image bytes and form fields -> an opened image -> model pixels.

The body is read once, refused with 413 as soon as it passes the byte limit; the image header is
checked against the pixel limit before anything is decoded.
"""

from __future__ import annotations

import numpy as np
from fastapi import Request
from PIL import Image
from starlette.requests import ClientDisconnect

from serve.runtime.images import PixelBudget, open_image
from serve.server.http.errors import ApiError, image_errors_as_api_errors
from serve.server.settings import RequestLimits

RAW_TYPES = ("image/", "application/octet-stream")


async def read_body(request: Request, limits: RequestLimits) -> bytes:
    """The request body, refused with 413 once it passes `limits.max_bytes`.

    The rest of an oversized body is read and thrown away (up to `limits.discard_bytes` in all) before
    the 413 goes out: a client that writes its whole body before reading the answer (Python's urllib
    does) would otherwise find the connection reset under it instead. Read from `request.receive` in a
    plain loop: `request.stream()`, an async generator, costs the event loop a hook call per request.
    """
    max_bytes, discard_bytes = limits.max_bytes, limits.discard_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        if int(declared) <= discard_bytes:
            await _discard(request, discard_bytes)
        raise ApiError("body_too_large", f"the body is {int(declared):,} bytes, over the {max_bytes:,}-byte limit")
    chunks, size, more = [], 0, True
    while more:
        chunk, more = await _next_chunk(request)
        size += len(chunk)
        if size > max_bytes:
            if more:  # after the last piece, another read would wait for the client to hang up
                await _discard(request, discard_bytes - size)
            raise ApiError("body_too_large", f"the body is over the {max_bytes:,}-byte limit; send a smaller image")
        chunks.append(chunk)
    return b"".join(chunks)


async def _next_chunk(request: Request) -> tuple[bytes, bool]:
    """(the next piece of the body, whether more follows); `ClientDisconnect` when the client went away."""
    message = await request.receive()
    if message["type"] == "http.disconnect":
        raise ClientDisconnect()
    return message.get("body", b""), message.get("more_body", False)


async def _discard(request: Request, budget: int) -> None:
    """Read and drop the rest of the body, `budget` bytes at most (beyond that, the answer goes out anyway).

    Call it only while more of the body is to come: once the last piece is in, `receive` waits for a disconnect.
    """
    more = True
    while more and budget >= 0:
        chunk, more = await _next_chunk(request)
        budget -= len(chunk)


async def decode_request(request: Request, limits: RequestLimits) -> tuple[bytes, dict[str, str]]:
    """The image bytes and any form fields, from a multipart upload or a raw image body."""
    body = await read_body(request, limits)
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype == "multipart/form-data":
        async with _replay(request, body).form(max_files=1) as form:  # closes spooled upload files when done
            upload = form.get("file")
            fields = {k: v for k, v in form.items() if isinstance(v, str)}
            if upload is None or isinstance(upload, str):
                raise ApiError("bad_request", "multipart uploads must carry the image in a file field named 'file'")
            return await upload.read(), fields
    if ctype and not ctype.startswith(RAW_TYPES):
        raise ApiError(
            "unsupported_media_type",
            f"content type {ctype!r} cannot carry an image: send the image bytes as image/* or "
            "application/octet-stream, or multipart/form-data with the field 'file'",
        )
    return body, {}


def _replay(request: Request, body: bytes) -> Request:
    """A request over the same scope whose body is `body`, already read within the limit, so that the
    form parser reads it again from memory rather than from the socket."""

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    return Request(request.scope, receive)


def open_upload(data: bytes, max_pixels: int) -> Image.Image:
    """The image's header only (size checked against `max_pixels`); `decode_image` decodes it."""
    with image_errors_as_api_errors():
        return open_image(bytes(data), max_pixels=max_pixels)


def decode_image(img: Image.Image, classifier, max_pixels: int, budget: PixelBudget | None = None) -> np.ndarray:
    """An opened image -> (H, W, 3) uint8 at the model's input size, decoded at reduced size when large.

    Args:
        budget: held for the pixels being decoded; None for small images decoded where no one may wait
            (the event loop, the model's thread).
    """
    with image_errors_as_api_errors():
        return classifier.preprocess.load_pixels(img, max_pixels, budget)
