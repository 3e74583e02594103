"""Fixtures for training tests: tiny real image folders written into tmp_path."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.helpers import write_shapes


@pytest.fixture
def shapes_folder(tmp_path: Path) -> Path:
    """root/<class>/*.png: 3 easy classes (bar, column, square) x 30 images of 32 x 32."""
    return write_shapes(tmp_path / "shapes")


def _jpeg_bytes(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", **kw)
    return buf.getvalue()


@pytest.fixture
def messy_folder(tmp_path: Path) -> Path:
    """Two classes holding every awkward and broken kind of file a real folder has.

    Good images (9 in "cat", 3 in "dog"): RGB JPEG, upper-case .JPG and .PNG, grayscale, palette,
    RGBA, CMYK JPEG, 16-bit PNG, EXIF-rotated JPEG. Broken (3): truncated JPEG, zero-byte .png,
    text named .png. Ignored: .DS_Store, hidden images, .ipynb_checkpoints, notes.txt, README.md.
    """
    root = tmp_path / "messy"
    cat, dog = root / "cat", root / "dog"
    for d in (cat, dog, root / ".ipynb_checkpoints", cat / ".ipynb_checkpoints"):
        d.mkdir(parents=True)
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8), "RGB")
    rgb.save(cat / "photo.jpg")
    rgb.save(cat / "UPPER.JPG")
    rgb.save(cat / "Shout.PNG")
    rgb.convert("L").save(cat / "gray.png")
    rgb.convert("P").save(cat / "palette.png")
    rgba = rgb.convert("RGBA")
    rgba.putalpha(128)
    rgba.save(cat / "rgba.png")
    rgb.convert("CMYK").save(cat / "cmyk.jpg")
    Image.fromarray(rng.integers(0, 65535, (40, 48), dtype=np.uint16)).save(cat / "sixteen.png")
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    rgb.save(cat / "exif_rotated.jpg", exif=exif.tobytes())
    (cat / "truncated.jpg").write_bytes(_jpeg_bytes(rgb)[:300])
    (cat / "empty.png").write_bytes(b"")
    (cat / "text.png").write_text("this is not a picture\n")
    (cat / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    rgb.save(cat / ".hidden.png")
    rgb.save(cat / ".ipynb_checkpoints" / "photo-checkpoint.png")
    (cat / "notes.txt").write_text("label notes\n")
    rgb.save(root / ".ipynb_checkpoints" / "stray.png")
    (root / "README.md").write_text("my dataset\n")
    (root / ".DS_Store").write_bytes(b"\x00")
    for i in range(3):
        rgb.rotate(90 * i).save(dog / f"dog{i}.png")
    return root
