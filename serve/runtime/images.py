"""The one image loader and evaluation preprocessing, shared by training and serving.

PIL and numpy only (no torch), so `serve.runtime.classifier` can use it in a torch-free process and the
training data pipeline can use it too: a phone photo becomes the same pixels in both.
"""

from __future__ import annotations

import io
import math
import re
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Union

import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

from serve.runtime.image_formats import first_bytes, unidentified

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".jfif", ".jpe", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")
# Linux file names are bytes: one that is not UTF-8 reaches Python as a str holding surrogates (PEP 383). Text files
# that list image paths (CSV reports, corrections) are written and read with this error handler: such a name is
# kept as its bytes, so each row still names its file, and a UTF-8 name is written as plain UTF-8.
FILE_NAME_ERRORS = "surrogateescape"


def is_utf8(name: str) -> bool:
    """Whether the file name `name` holds no byte that is not UTF-8 (none decoded as a surrogate escape)."""
    return not any("\udc80" <= c <= "\udcff" for c in name)


# The decoders PIL may use: the formats above (JPEG's includes the MPO files of many phones). Every other
# PIL plugin stays off for untrusted input (EPS, for one, would run Ghostscript).
FORMATS = ("JPEG", "PNG", "BMP", "GIF", "WEBP", "TIFF")
# What Pillow names a JPEG: "MPO" for one with the multi-picture extension (cameras' 3D and depth pictures),
# whose first picture is the one decoded, by the JPEG decoder, under the same limits and at the same scales
JPEG_FORMATS = ("JPEG", "MPO")
DEFAULT_MAX_PIXELS = 40_000_000  # 40 MP: a phone's usual photo and many cameras' (not 45-61 MP bodies); not a bomb
# Each scan of a progressive JPEG is decoded in full: encoders write about ten, a crafted 60 kB file thousands
MAX_JPEG_SCANS = 100  # (seconds of CPU); libjpeg-turbo's tools take such a cap as an option (djpeg -maxscans)
INTERPOLATIONS = {
    name: getattr(Image.Resampling, name.upper()) for name in ("bicubic", "bilinear", "nearest", "lanczos")
}
MIN_CROP_PCT = 0.1  # a smaller crop resizes the image past 10x its side to keep a sliver of it

ImageSource = Union[str, Path, bytes, bytearray, Image.Image, np.ndarray]


class ImageError(ValueError):
    """An input that cannot be used as an image. `kind` says why, for mapping to an HTTP status.

    Kinds: "empty" (no bytes), "not_an_image" (no known header), "corrupt" (truncated or
    undecodable), "too_large" (over the pixel limit), "unsupported" (a mode or array we cannot use),
    "non_finite" (NaN or infinite pixel values).
    """

    def __init__(self, message: str, kind: str = "corrupt"):
        super().__init__(message)
        self.kind = kind


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
        img = upright(img)
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
            if path.is_dir():
                raise ImageError(f"{path} is a folder, not an image file: give the images in it", "unsupported")
            if path.exists():  # reading a named pipe would wait for a writer for ever
                raise ImageError(f"{path} is not a regular file (a named pipe, socket or device)", "unsupported")
            raise FileNotFoundError(f"no such image file: {path}")
        if path.stat().st_size == 0:
            raise ImageError(f"{path} is empty (0 bytes)", "empty")
        fp, name = path, str(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(fp, formats=FORMATS)
    except UnidentifiedImageError:
        head = source[:16] if isinstance(source, (bytes, bytearray)) else first_bytes(Path(source))
        raise ImageError(*unidentified(name, head)) from None
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
        if "MAX_TEXT_CHUNK" in str(e):  # a PNG text chunk inflating past Pillow's bound: a bomb in the metadata
            message = (
                f"{name} holds text metadata that decompresses to over Pillow's limit: save the image again without "
                "its metadata"
            )
            raise ImageError(message, "corrupt") from None
        raise ImageError(f"{name} could not be read: {e}", "corrupt") from None
    _check_pixels(img, max_pixels)
    if img.format in JPEG_FORMATS and img.info.get("progressive"):
        _check_scans(img, source if isinstance(source, (bytes, bytearray)) else Path(source).read_bytes(), name)
    return img


def _check_scans(img: Image.Image, data: bytes | bytearray, name: str) -> None:
    scans = data.count(b"\xff\xda")  # each scan's start marker: JPEG escapes 0xFF in the data that follows
    if scans > MAX_JPEG_SCANS:
        img.close()
        raise ImageError(
            f"{name} is a progressive JPEG of {scans:,} scans, over the limit of {MAX_JPEG_SCANS} (encoders write "
            "about ten): save it again as a baseline JPEG or a PNG",
            "unsupported",
        )


def _check_pixels(img: Image.Image, max_pixels: int | None) -> None:
    W, H = img.size
    if max_pixels is not None and W * H > max_pixels:
        img.close()
        raise ImageError(
            f"image is {W} x {H} = {W * H:,} pixels, over the limit of {max_pixels:,}; resize it first", "too_large"
        )


class PixelBudget:
    """Pixels that may be decoding at once, across threads: decoding costs memory per declared pixel, and a
    file of a few bytes can declare 40 MP. An image larger than the whole budget waits for all of it.

    Args:
        pixels: the budget.
    """

    def __init__(self, pixels: int):
        self.total = self.free = pixels
        self._cond = threading.Condition()

    @contextmanager
    def hold(self, pixels: int) -> Iterator[None]:
        """Wait until `pixels` (at most the whole budget) are free, hold them while the block runs."""
        n = min(pixels, self.total)
        with self._cond:
            self._cond.wait_for(lambda: self.free >= n)
            self.free -= n
        try:
            yield
        finally:
            with self._cond:
                self.free += n
                self._cond.notify_all()


def load_reduced(
    source: ImageSource, cover: tuple[int, int], max_pixels: int | None, budget: PixelBudget | None = None
) -> Image.Image:
    """`load_image`, but a large image is decoded or reduced to no less than twice `cover` on each side.

    A model needs far fewer pixels than a photo has: JPEGs are decoded at 1/2, 1/4 or 1/8 scale by the
    decoder itself (`draft`), other formats are reduced by box averaging (`Image.reduce`) before any
    mode conversion. The 2x margin is Pillow's own `reducing_gap`: the final resize still has twice the
    pixels it keeps, so the result is as sharp. Images within 4x of `cover` decode exactly as `load_image`
    does.

    Args:
        source: as for `load_image`.
        cover: (w, h) the caller resizes to (aspect kept, the image covering it), before cropping.
        max_pixels: refuse images with more pixels than this (None: no limit).
        budget: held for the pixels being decoded (None: no budget).

    A PIL image given is closed once its pixels are taken: its full-size decode would outlive the budget's hold.
    """
    if isinstance(source, np.ndarray):
        return _from_array(source)
    img = source if isinstance(source, Image.Image) else open_image(source, max_pixels)
    _check_pixels(img, max_pixels)
    factor = _reduction(img.size, cover)
    if factor >= 2 and img.format in JPEG_FORMATS:
        img.draft("RGB", (-(-img.width // factor), -(-img.height // factor)))  # the decoder's own 1/2..1/8 scale
        factor = _reduction(img.size, cover)
    with budget.hold(img.width * img.height) if budget is not None else nullcontext():
        try:
            img.load()
            out = _to_rgb(_reduce(upright(img), factor) if factor >= 2 else upright(img))
        except ImageError:
            raise
        except Exception as e:  # as in load_image: any decoder error means a broken file
            raise ImageError(f"image data is corrupt or truncated: {e}", "corrupt") from None
    if out is not img:  # the full-size pixels go with the budget: a caller's reference (a request's) kept them
        img.close()
    return out


def upright(img: Image.Image) -> Image.Image:
    """`img` turned as its EXIF (or XMP) Orientation says; `img` itself when it says nothing to turn, where
    `ImageOps.exif_transpose` would copy every pixel."""
    if img.getexif().get(ExifTags.Base.Orientation, 1) not in range(2, 9):
        return img
    return ImageOps.exif_transpose(img)


def _reduction(size: tuple[int, int], cover: tuple[int, int]) -> int:
    """The integer factor that keeps at least twice `cover` on each side, in either orientation (EXIF may
    turn the image after decoding)."""
    (w, h), (cw, ch) = size, cover
    return max(1, min(w // (2 * max(cw, ch)), h // (2 * max(cw, ch))))


def _reduce(img: Image.Image, factor: int) -> Image.Image:
    """Box-average `img` by `factor`; modes `reduce` does not take (palette, 16-bit, 1-bit) are converted
    strip by strip, so that the wide copy of the whole image never exists."""
    if img.mode in ("L", "LA", "RGB", "RGBA", "I", "F", "CMYK", "PA"):
        return img.reduce(factor)
    wide = {"1": "L", "P": "RGBA" if "transparency" in img.info else "RGB"}.get(img.mode, "I")
    w, h = img.size
    out = Image.new(wide, (-(-w // factor), -(-h // factor)))
    step = factor * max(1, (1 << 22) // (w * factor))  # about 4 MP per strip
    for top in range(0, h, step):
        out.paste(img.crop((0, top, w, min(h, top + step))).convert(wide).reduce(factor), (0, top // factor))
    return out


def _to_rgb(img: Image.Image) -> Image.Image:
    mode = img.mode
    if mode == "RGB":
        return img
    if mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        a = np.asarray(img, dtype=np.float32)
        if not np.isfinite(a).all():
            raise ImageError("the image has NaN or infinite pixel values; send finite data", "non_finite")
        top = 65535.0 if a.max(initial=0) > 255 else 255.0  # 16-bit data, or 8-bit values stored wide
        if mode == "F" and a.min(initial=0) >= 0 and a.max(initial=0) <= 1.0:
            top = 1.0  # floating-point data in [0, 1], as scientific and HDR tools write it
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
    if a.size == 0:
        raise ImageError(f"the image array is empty (shape {a.shape})", "empty")
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
        if not all(isinstance(side, int) and side >= 1 for side in self.img_size):
            raise ValueError(f"img_size must be a positive number of pixels, got {list(self.img_size)}")
        self.mean, self.std = tuple(map(float, self.mean)), tuple(map(float, self.std))
        if len(self.mean) != 3 or not all(map(math.isfinite, self.mean)):
            raise ValueError(f"mean must be three finite numbers (R, G, B), got {list(self.mean)}")
        if len(self.std) != 3 or not all(math.isfinite(s) and s > 0 for s in self.std):
            raise ValueError(
                f"std must be three positive numbers (R, G, B): images are divided by it; got {list(self.std)}"
            )
        if self.interpolation not in INTERPOLATIONS:
            raise ValueError(f"interpolation must be one of {list(INTERPOLATIONS)}, got {self.interpolation!r}")
        if not MIN_CROP_PCT <= self.crop_pct <= 1.0:
            raise ValueError(f"crop_pct must be in [{MIN_CROP_PCT}, 1], got {self.crop_pct}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["img_size"], d["mean"], d["std"] = list(self.img_size), list(self.mean), list(self.std)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Preprocess:
        return cls(**{k: d[k] for k in ("img_size", "crop_pct", "interpolation", "mean", "std") if k in d})

    def resize_crop(self, img: Image.Image) -> Image.Image:
        """Resize (aspect kept) and centre-crop an RGB image to `img_size`.

        Only the part the crop keeps is resampled (Pillow's `box`): resizing the whole image first would make an
        image a million pixels tall and one wide a 28 x 28,000,000 intermediate, gigabytes for a 4 kB upload.
        """
        H, W = self.img_size
        w, h = img.size
        scale = max(H / self.crop_pct / h, W / self.crop_pct / w)
        new_w, new_h = max(W, math.floor(w * scale + 0.5)), max(H, math.floor(h * scale + 0.5))
        left, top = (new_w - W) // 2, (new_h - H) // 2
        if (new_w, new_h) == (w, h):  # the right size already: the crop alone
            return img if (w, h) == (W, H) else img.crop((left, top, left + W, top + H))
        sx, sy = w / new_w, h / new_h  # source pixels per resized pixel
        box = (left * sx, top * sy, (left + W) * sx, (top + H) * sy)  # the crop, in the source image
        return img.resize((W, H), INTERPOLATIONS[self.interpolation], box=box)

    @property
    def cover_size(self) -> tuple[int, int]:
        """(w, h) an image is resized to cover before the centre crop: the pixels the model can use."""
        H, W = self.img_size
        return math.ceil(W / self.crop_pct), math.ceil(H / self.crop_pct)

    def load_pixels(
        self, source: ImageSource, max_pixels: int | None = DEFAULT_MAX_PIXELS, budget: PixelBudget | None = None
    ) -> np.ndarray:
        """An image source -> (H, W, 3) uint8 for the model, large images decoded at reduced size (`load_reduced`)."""
        return self.to_uint8(load_reduced(source, self.cover_size, max_pixels, budget))

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
