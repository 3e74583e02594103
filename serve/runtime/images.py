"""The one image loader and evaluation preprocessing, shared by training and serving.

PIL and numpy only (no torch), so `serve.runtime.classifier` can use it in a torch-free process and the
training data pipeline can use it too: a phone photo becomes the same pixels in both.
"""

from __future__ import annotations

import io
import math
import re
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Union

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")
# The decoders PIL may use: the formats above (JPEG's includes the MPO files of many phones). Every other
# PIL plugin stays off for untrusted input (EPS, for one, would run Ghostscript).
FORMATS = ("JPEG", "PNG", "BMP", "GIF", "WEBP", "TIFF")
DEFAULT_MAX_PIXELS = 40_000_000  # about 40 MP: any phone photo, well short of a decompression bomb
INTERPOLATIONS = {
    "bicubic": Image.Resampling.BICUBIC,
    "bilinear": Image.Resampling.BILINEAR,
    "nearest": Image.Resampling.NEAREST,
    "lanczos": Image.Resampling.LANCZOS,
}

ImageSource = Union[str, Path, bytes, bytearray, Image.Image, np.ndarray]


class ImageError(ValueError):
    """An input that cannot be used as an image. `kind` says why, for mapping to an HTTP status.

    Kinds: "empty" (no bytes), "not_an_image" (no known header), "corrupt" (truncated or
    undecodable), "too_large" (over the pixel limit), "unsupported" (a mode or array we cannot use).
    """

    def __init__(self, message: str, kind: str = "corrupt"):
        super().__init__(message)
        self.kind = kind


def is_image_file(path: str | Path) -> bool:
    """True for a visible file whose suffix (any case) is an image type we read."""
    p = Path(path)
    return p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith(".")


def load_image(source: ImageSource, max_pixels: int | None = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Decode an image to 8-bit RGB, upright.

    Applies the EXIF orientation; converts grayscale, palette, CMYK and 16-bit images; composites
    transparent images onto white. The pixel count is checked from the header before decoding.

    Args:
        source: a path, encoded bytes, a PIL image (such as one from `open_image`), or an
            (H, W) / (H, W, 3|4) uint8 array.
        max_pixels: refuse images with more pixels than this (None: no limit).

    Returns:
        An RGB PIL image.

    Raises:
        ImageError: with a message that says what is wrong.
        FileNotFoundError: for a path that does not exist.
    """
    if isinstance(source, np.ndarray):
        return _from_array(source)
    if isinstance(source, Image.Image):
        img = source
        _check_pixels(img, max_pixels)
    else:
        img = open_image(source, max_pixels)
    try:
        img.load()  # decode fully now, so truncation shows here and not later
        img = ImageOps.exif_transpose(img)
        return _to_rgb(img)
    except ImageError:
        raise
    except Exception as e:  # decoders of broken files raise anything (OSError, ValueError, OverflowError, ...)
        raise ImageError(f"image data is corrupt or truncated: {e}", "corrupt") from None


def open_image(source: str | Path | bytes | bytearray, max_pixels: int | None = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Read the header only: an image not decoded yet, its pixel count already checked.

    `img.size` tells the cost of decoding before paying it; `load_image(img)` then decodes it.

    Raises:
        ImageError: empty, not an image, or over `max_pixels`.
        FileNotFoundError: for a path that does not exist.
    """
    if isinstance(source, (bytes, bytearray)):
        if len(source) == 0:
            raise ImageError("the upload is empty (0 bytes): send the image file's contents", "empty")
        fp, name = io.BytesIO(source), "upload"
    else:
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"no such image file: {path}")
        if path.stat().st_size == 0:
            raise ImageError(f"{path} is empty (0 bytes)", "empty")
        fp, name = path, str(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(fp, formats=FORMATS)
    except UnidentifiedImageError:
        raise ImageError(
            f"{name} is not an image: no JPEG, PNG, GIF, BMP, WebP or TIFF header found", "not_an_image"
        ) from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        # Pillow's own, higher limit; the one that counts is ours: say that one
        found = re.search(r"\((\d+) pixels\)", str(e))
        pixels = int(found.group(1)) if found else None
        if max_pixels and pixels and pixels > max_pixels:
            message = f"{name} is {pixels:,} pixels, over the limit of {max_pixels:,}; resize it first"
        else:
            message = f"{name} is too large for Pillow to decode safely ({e}); resize it first"
        raise ImageError(message, "too_large") from None
    except Exception as e:  # a header PIL recognises but cannot parse: any error at all means a broken file
        raise ImageError(f"{name} could not be read: {e}", "corrupt") from None
    _check_pixels(img, max_pixels)
    return img


def _check_pixels(img: Image.Image, max_pixels: int | None) -> None:
    W, H = img.size
    if max_pixels is not None and W * H > max_pixels:
        img.close()
        raise ImageError(
            f"image is {W} x {H} = {W * H:,} pixels, over the limit of {max_pixels:,}; resize it first", "too_large"
        )


def _to_rgb(img: Image.Image) -> Image.Image:
    mode = img.mode
    if mode == "RGB":
        return img
    if mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        a = np.asarray(img, dtype=np.float64)
        top = 65535.0 if a.max(initial=0) > 255 else 255.0  # 16-bit data, or 8-bit values stored wide
        a = np.clip(a / top * 255.0 + 0.5, 0, 255).astype(np.uint8)
        return Image.fromarray(a, "L").convert("RGB")
    if mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    if mode in ("LA", "PA"):
        img = img.convert("RGBA")
    if img.mode == "RGBA":
        background = Image.new("RGBA", img.size, (255, 255, 255, 255))  # transparent -> white paper
        return Image.alpha_composite(background, img).convert("RGB")
    return img.convert("RGB")


def _from_array(a: np.ndarray) -> Image.Image:
    if a.dtype != np.uint8:
        raise ImageError(f"image arrays must be uint8 (0-255), got {a.dtype}", "unsupported")
    if a.ndim == 2:
        return Image.fromarray(a, "L").convert("RGB")
    if a.ndim == 3 and a.shape[2] in (3, 4):
        return _to_rgb(Image.fromarray(np.ascontiguousarray(a), "RGB" if a.shape[2] == 3 else "RGBA"))
    raise ImageError(f"image arrays must be (H, W), (H, W, 3) or (H, W, 4), got {a.shape}", "unsupported")


@dataclass
class Preprocess:
    """Evaluation preprocessing as data: it travels in checkpoints and in the ONNX metadata.

    Resize so the image covers `img_size / crop_pct` (aspect kept), centre-crop `img_size`,
    scale to [0, 1], normalise with `mean` and `std`. This is timm's evaluation transform.

    Args:
        img_size: (H, W) the model sees.
        crop_pct: fraction of the resized image kept by the centre crop (1.0: no crop margin).
        interpolation: "bicubic", "bilinear", "nearest" or "lanczos".
        mean: per-channel mean, RGB.
        std: per-channel standard deviation, RGB.
    """

    img_size: tuple[int, int] = (224, 224)
    crop_pct: float = 0.875
    interpolation: str = "bicubic"
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)

    def __post_init__(self):
        self.img_size = (self.img_size, self.img_size) if isinstance(self.img_size, int) else tuple(self.img_size)
        self.mean, self.std = tuple(map(float, self.mean)), tuple(map(float, self.std))
        if self.interpolation not in INTERPOLATIONS:
            raise ValueError(f"interpolation must be one of {list(INTERPOLATIONS)}, got {self.interpolation!r}")
        if not 0.0 < self.crop_pct <= 1.0:
            raise ValueError(f"crop_pct must be in (0, 1], got {self.crop_pct}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["img_size"], d["mean"], d["std"] = list(self.img_size), list(self.mean), list(self.std)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Preprocess:
        return cls(**{k: d[k] for k in ("img_size", "crop_pct", "interpolation", "mean", "std") if k in d})

    def resize_crop(self, img: Image.Image) -> Image.Image:
        """Resize (aspect kept) and centre-crop an RGB image to `img_size`."""
        H, W = self.img_size
        w, h = img.size
        scale = max(H / self.crop_pct / h, W / self.crop_pct / w)
        new_w, new_h = max(W, math.floor(w * scale + 0.5)), max(H, math.floor(h * scale + 0.5))
        if (new_w, new_h) != (w, h):
            img = img.resize((new_w, new_h), INTERPOLATIONS[self.interpolation])
        if (new_w, new_h) == (W, H):
            return img
        left, top = (new_w - W) // 2, (new_h - H) // 2
        return img.crop((left, top, left + W, top + H))

    def to_uint8(self, img: Image.Image) -> np.ndarray:
        """Resize and crop; returns (H, W, 3) uint8, the input of a graph that normalises inside."""
        return np.asarray(self.resize_crop(img), dtype=np.uint8)

    def normalize(self, hwc_uint8: np.ndarray) -> np.ndarray:
        """(..., H, W, 3) uint8 -> (..., 3, H, W) float32, normalised."""
        x = hwc_uint8.astype(np.float32) / 255.0
        x = (x - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)
        return np.moveaxis(x, -1, -3).astype(np.float32, copy=False)

    def __call__(self, img: Image.Image) -> np.ndarray:
        """One RGB image -> (3, H, W) float32, exactly what the model was evaluated on."""
        return self.normalize(self.to_uint8(img))
