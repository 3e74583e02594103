"""The UI's result images, and the images calls send as data: URLs, written into Gradio's cache whole before they
get their name.

Gradio saves an image a callback returns under a folder named by its content, rewriting the file in place at each
identical result (`processing_utils.save_pil_to_cache`): a client fetching the result of one call while another
call wrote the same one got a cut-off file. Here the file is written under a temporary name and renamed into place,
once; the folder is named by the same content hash that Gradio's own copy step (`save_file_to_cache`) looks for,
so Gradio finds the file already there and hands it out as it is.
"""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path

import numpy as np
from gradio import processing_utils, utils
from PIL import Image


def cached_image(image: np.ndarray, format: str = "webp") -> str:
    """The path of `image` (H, W, 3) uint8 as a `format` file in Gradio's cache, for a `gr.Image` output."""
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format=format)
    return cached_bytes(buf.getvalue(), f"image.{format}")


def cached_bytes(data: bytes, name: str) -> str:
    """The path of a file `name` holding `data` in Gradio's cache, in the folder named by its content."""
    folder = Path(utils.get_upload_folder()) / processing_utils.hash_bytes(data)
    path = folder / name
    try:
        os.utime(path)  # handed out again: the cache's age limit counts from now, as Gradio's copy step does
        return str(path)
    except FileNotFoundError:
        pass  # new, or the cache just aged it out
    for last in (False, True):  # the UI folder's walk removes an empty hash folder: made again, once
        folder.mkdir(parents=True, exist_ok=True)
        try:
            fd, staging = tempfile.mkstemp(dir=folder, prefix=f".{name}.")
        except FileNotFoundError:
            if last:
                raise
            continue
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(staging, path)
        except BaseException:
            Path(staging).unlink(missing_ok=True)
            raise
        return str(path)
