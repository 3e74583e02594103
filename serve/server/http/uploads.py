"""decode_request: an HTTP request -> image bytes and form fields -> an opened image -> model pixels.

The body is read once, refused with 413 as soon as it passes the byte limit; the image header is
checked against the pixel limit before anything is decoded.
"""

from __future__ import annotations

import numpy as np
from fastapi import Request
from PIL import Image
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect

from serve.runtime.images import PixelBudget, open_image
from serve.server.errors import ApiError, image_errors_as_api_errors
from serve.server.settings import RequestLimits

RAW_TYPES = ("image/", "application/octet-stream")


async def read_body(request: Request, limits: RequestLimits) -> bytes:
    """The request body, refused with 413 once it passes `limits.max_bytes`: every route of the API reads its body
    here, so none reads more than that.

    The rest of an oversized body is read and thrown away (up to `limits.discard_bytes` in all) before
    the 413 goes out: a client that writes its whole body before reading the answer (Python's urllib
    does) would otherwise find the connection reset under it instead. A client that declared a body over
    the limit and expects 100-continue (curl does, for large bodies) gets the 413 at once, in place of the 100.
    Read from `request.receive` in a plain loop: `request.stream()`, an async generator, costs the event loop a
    hook call per request.
    """
    max_bytes, discard_bytes = limits.max_bytes, limits.discard_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > max_bytes:
        # a client that expects 100-continue sends nothing before it is asked to (a read would ask it)
        if int(declared) <= discard_bytes and request.headers.get("expect", "").lower() != "100-continue":
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
        return parse_multipart(body, request.headers["content-type"])
    if ctype and not ctype.startswith(RAW_TYPES):
        raise ApiError(
            "unsupported_media_type",
            f"content type {ctype!r} cannot carry an image: send the image bytes as image/* or "
            "application/octet-stream, or multipart/form-data with the field 'file'",
        )
    return body, {}


def parse_multipart(body: bytes, content_type: str) -> tuple[bytes, dict[str, str]]:
    """A multipart/form-data body already in memory -> (the bytes of the file field `file`, the text fields).

    Parsed by python-multipart, with Starlette's limits (one file, 1,000 fields, 1 MiB a text field), straight from
    the bytes `read_body` has bounded: Starlette's own form parser reads the stream again and spools the file to a
    temporary file.
    """
    _, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if not boundary:
        raise ApiError("bad_request", "the multipart body has no boundary in its Content-Type")
    return parse_parts(body, boundary)


def parse_parts(body: bytes, boundary: bytes) -> tuple[bytes, dict[str, str]]:
    """A multipart body through python-multipart's parser (`parse_multipart`)."""
    parts: list[_Part] = []
    header: list[bytes] = [b"", b""]  # the name and value of the part's header being read

    def on_header_end() -> None:
        if header[0].lower() == b"content-disposition":
            parts[-1].disposition = header[1]
        header[:] = [b"", b""]

    def on_part_data(data: bytes, start: int, end: int) -> None:
        part = parts[-1]
        part.data += memoryview(data)[start:end]
        if not part.is_file and len(part.data) > MAX_FIELD_BYTES:
            raise ApiError("bad_request", f"a multipart text field is over {MAX_FIELD_BYTES:,} bytes")

    callbacks = {
        "on_part_begin": lambda: parts.append(_Part()),
        "on_header_field": lambda data, start, end: header.__setitem__(0, header[0] + data[start:end]),
        "on_header_value": lambda data, start, end: header.__setitem__(1, header[1] + data[start:end]),
        "on_header_end": on_header_end,
        "on_headers_finished": lambda: parts[-1].start(parts),
        "on_part_data": on_part_data,
    }
    try:
        parser = MultipartParser(boundary, callbacks)
        parser.write(body)
        parser.finalize()
    except FormParserError as e:
        raise ApiError("bad_request", f"the multipart body cannot be parsed: {e}") from None
    files = [p for p in parts if p.is_file and p.name == "file"]
    if not files:
        raise ApiError("bad_request", "multipart uploads must carry the image in a file field named 'file'")
    fields = {p.name: p.data.decode("utf-8", "replace") for p in parts if not p.is_file}
    return bytes(files[0].data), fields


MAX_FIELD_BYTES = 1024 * 1024  # Starlette's limit for a text field
MAX_FIELDS = 1000  # Starlette's


class _Part:
    """One part of a multipart body as it is read."""

    def __init__(self):
        self.disposition, self.data, self.name, self.is_file = b"", bytearray(), "", False

    def start(self, parts: list[_Part]) -> None:
        """Its headers are in: its name, and whether it is a file (one file and `MAX_FIELDS` fields at most)."""
        _, options = parse_options_header(self.disposition)
        if b"name" not in options:
            raise ApiError("bad_request", "a multipart part has no name in its Content-Disposition header")
        self.name, self.is_file = options[b"name"].decode("utf-8", "replace"), b"filename" in options
        if self.is_file and sum(p.is_file for p in parts) > 1:
            raise ApiError("bad_request", "a multipart upload carries one file, in the field named 'file'")
        if not self.is_file and len(parts) > MAX_FIELDS:
            raise ApiError("bad_request", f"a multipart upload has over {MAX_FIELDS:,} fields")


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
