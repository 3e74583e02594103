"""What the UI's callbacks accept from a page or a raw API call: each refusal a `Refused` that names the widget.

Gradio hands a callback whatever a raw call sends (NaN, 0.5 for a slider of whole numbers, null or a list for a
dropdown); these checks turn each into a message the caller can act on. `uploads_only` does the same for the image.
"""

from __future__ import annotations

import base64
import math
import os
from pathlib import Path
from typing import Any

import gradio as gr
from gradio.exceptions import InvalidPathError

from serve.runtime.images import ImageError, open_image
from serve.server.ui.images import cached_bytes

NOT_AN_UPLOAD = "the image is not one uploaded to this server: upload it, or send it in the call as a data: URL"


class Refused(gr.Error):
    """A `gr.Error` for input the caller can fix: the message goes to them, and no traceback to the server's log
    (Gradio prints one for every `gr.Error` unless told not to)."""

    def __init__(self, message: str):
        super().__init__(message, print_exception=False)


def whole(value: Any, name: str) -> int:
    """A slider's block or head index: a whole number, or `Refused` naming it (Gradio passes NaN and 0.5 on)."""
    number = float(value) if isinstance(value, (int, float)) else math.nan  # a JSON number, as sliders send
    if not (math.isfinite(number) and number == int(number)):
        raise Refused(f"the {name} must be a whole number, got {value}")
    return int(number)


def share(value: Any, name: str = "opacity", most: float = 1.0) -> float:
    """A value in [0, `most`], or `Refused` naming it (NaN drew an all-black overlay)."""
    number = float(value) if isinstance(value, (int, float)) else math.nan  # a JSON number, as sliders send
    if not 0.0 <= number <= most:
        raise Refused(f"the {name} must be in [0, {most}], got {value}")
    return number


def choice(value: Any, options: tuple[str, ...], name: str) -> str:
    """One of a dropdown's `options`, or `Refused` naming it (null or a list reached matplotlib and the rollout)."""
    if not (isinstance(value, str) and value in options):
        raise Refused(f"the {name} must be one of {', '.join(options)}, got {value!r}")
    return value


def uploads_only(demo: gr.Blocks, image: gr.Image, max_pixels: int) -> None:
    """Have the "filepath" input `image` of `demo` take an image uploaded to this server, or sent in the call as one
    base64 data: URL, and nothing else; each is checked from its header as the API checks one (`open_image`: an
    image, within `max_pixels`) before anything decodes it. What Gradio does otherwise:

    - it decodes a data: URL's image whole and re-encodes it before any of our limits (a few hundred kB of PNG can
      be 160 MP, 1.5 GB), and it reads the last of several comma-separated parts, where a check reads the first;
    - it downloads an http(s) URL a call names, from the server's network, of any size, past every limit;
    - it takes any file at the top of its upload folder: an upload still arriving, or the server's lock, which its
      clean-up then deletes;
    - it names a path it refuses back in its error, made absolute (with the server's working directory).

    A refusal is our message, as a `Refused`.
    """
    folder = os.path.realpath(gr.utils.get_upload_folder())
    move, preprocess, preprocess_data = image.async_move_resource_to_block_cache, image.preprocess, demo.preprocess_data

    async def move_upload(path):
        name = str(path or "")
        real = os.path.realpath(name)  # as Gradio resolves it: `//tmp/...` and links name the same file
        hashed = os.path.dirname(os.path.dirname(real)) == folder  # `<folder>/<hash>/<file>`: uploads and results
        if "://" in name or not hashed:  # the server's lock and partial uploads lie at the top: never taken
            raise Refused(NOT_AN_UPLOAD)
        return await move(path)

    def checked(payload):
        if payload is None:
            return None
        url = getattr(payload, "url", None) or ""
        try:
            if url[:5].lower() == "data:":
                return _data_url_file(image, url, max_pixels)
            # the header only, from the bytes (at most --max-bytes): an error then names no server path
            open_image(Path(payload.path or "").read_bytes(), max_pixels).close()
        except Refused:
            raise
        except ImageError as e:
            raise Refused(str(e)) from None
        except (OSError, ValueError):  # a path gone from the cache, a data: URL that is not base64
            raise Refused("the upload could not be read: upload the image again") from None
        return preprocess(payload)

    async def paths_unsaid(*args, **kwargs):
        try:
            return await preprocess_data(*args, **kwargs)
        except InvalidPathError:
            raise Refused(NOT_AN_UPLOAD) from None

    image.async_move_resource_to_block_cache, image.preprocess = move_upload, checked
    demo.preprocess_data = paths_unsaid


def _data_url_file(image: gr.Image, url: str, max_pixels: int) -> str:
    """The image of a data: URL, checked from its header and saved as it came, in the UI's folder."""
    head, _, text = url.partition(",")
    text = "".join(text.split())  # base64 as tools wrap it, in lines
    one = "send one image in a base64 data: URL (data:image/png;base64,...), or upload the file"
    if not head.lower().endswith(";base64") or "," in text:
        raise Refused(one)
    try:
        data = base64.b64decode(text, validate=True)
    except ValueError:  # binascii.Error
        raise Refused(f"the data: URL is not base64: {one}") from None
    with open_image(data, max_pixels) as im:
        name = f"image.{(im.format or 'bin').lower()}"
    path = cached_bytes(data, name)
    image.temp_files.add(path)  # deleted with the UI's other files, after --ui-cache-s
    return path
