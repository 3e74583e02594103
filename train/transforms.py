"""Training augmentation (timm's building blocks) and the evaluation transform (the serving one).

The evaluation transform is `serve.runtime.images.Preprocess.__call__`, nothing else: what the model is
validated on is, pixel for pixel, what the exported model will be served.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from timm.data import RandomResizedCropAndInterpolation, rand_augment_transform
from timm.data.random_erasing import RandomErasing
from torchvision import transforms as T

from serve.runtime.images import Preprocess

RE_MODES = ("const", "rand", "pixel")  # random erasing's fills (`random_erase`)


@dataclass
class Augment:
    """Training-time augmentation, applied to RGB images from `serve.runtime.images.load_image`.

    Args:
        crop_scale: random-resized-crop area range, as fractions of the image.
        crop_ratio: random-resized-crop aspect-ratio range.
        hflip: probability of a horizontal flip (0 for digits and text).
        vflip: probability of a vertical flip.
        rotate: random rotation range in degrees (plus or minus).
        translate: random shift range, as a fraction of the image side.
        scale: random zoom range of the affine step, e.g. (0.9, 1.1); None for none.
        fill: grey level (0-255) for pixels the affine step uncovers (255 for ink on white paper).
        rand_augment: timm RandAugment spec, e.g. "rand-m9-mstd0.5-inc1"; None disables it.
        color_jitter: brightness/contrast/saturation jitter strength; 0 disables it.
        re_prob: random-erasing probability.
        re_mode: random-erasing fill: "const", "rand" or "pixel".
    """

    crop_scale: tuple[float, float] = (0.08, 1.0)
    crop_ratio: tuple[float, float] = (0.75, 1.3333333333333333)
    hflip: float = 0.5
    vflip: float = 0.0
    rotate: float = 0.0
    translate: float = 0.0
    scale: tuple[float, float] | None = None
    fill: int = 0
    rand_augment: str | None = "rand-m9-mstd0.5-inc1"
    color_jitter: float = 0.0
    re_prob: float = 0.25
    re_mode: str = "pixel"

    def __post_init__(self):
        for name, top in (("crop_scale", 1.0), ("crop_ratio", math.inf)):  # a crop over the image: a centre crop
            low, high = getattr(self, name)
            if not 0 < low <= high <= top:
                bound = "" if top == math.inf else f" <= {top:g}"
                raise ValueError(
                    f"--data.augment.{name} must be [low, high] with 0 < low <= high{bound}, got {[low, high]}"
                )
        for name in ("hflip", "vflip", "re_prob"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"--data.augment.{name} is a probability, in [0, 1]; got {getattr(self, name)}")
        for name, high in (("rotate", 360.0), ("translate", 1.0), ("color_jitter", math.inf)):
            if not 0 <= getattr(self, name) <= high:
                raise ValueError(f"--data.augment.{name} must be in [0, {high:g}], got {getattr(self, name)}")
        if self.scale is not None and not (len(self.scale) == 2 and 0 < self.scale[0] <= self.scale[1] < math.inf):
            raise ValueError(
                f"--data.augment.scale must be [low, high] with 0 < low <= high (or null), got {self.scale}"
            )
        if not (isinstance(self.fill, int) and 0 <= self.fill <= 255):
            raise ValueError(f"--data.augment.fill is a grey level, 0 to 255; got {self.fill}")
        self.re_mode = self.re_mode.lower() or "const"  # as timm reads it: any case, and "" for a constant
        if self.re_mode not in RE_MODES:
            raise ValueError(f"--data.augment.re_mode must be one of {', '.join(RE_MODES)}, got {self.re_mode!r}")
        if self.rand_augment:
            try:
                rand_augment_transform(self.rand_augment, {})
            except Exception as e:  # timm asserts, or fails to read a number
                raise ValueError(
                    f"--data.augment.rand_augment {self.rand_augment!r} is not a RandAugment spec timm reads, such "
                    f"as 'rand-m9-mstd0.5-inc1' (or null for none)" + (f": {e}" if str(e) else "")
                ) from None


class EvalTransform:
    """RGB PIL image -> (3, H, W) float32 tensor via `Preprocess.__call__` (the serving transform).

    In two steps, so that a cache can keep the first one's small result: `resize` (resize and crop to
    (H, W, 3) uint8, the same every epoch), then normalisation; `__call__` takes either input.
    """

    def __init__(self, preprocess: Preprocess):
        self.preprocess = preprocess

    def resize(self, img: Image.Image) -> np.ndarray:
        return self.preprocess.to_uint8(img)

    def __call__(self, img: Image.Image | np.ndarray) -> torch.Tensor:
        pixels = img if isinstance(img, np.ndarray) else self.resize(img)
        return torch.from_numpy(self.preprocess.normalize(pixels))


def build_train_transform(aug: Augment, pre: Preprocess) -> T.Compose:
    """The training pipeline: crop, flips, affine, RandAugment, colour, tensor, normalise, erase.

    Args:
        aug: augmentation settings.
        pre: evaluation preprocessing; its size, interpolation, mean and std are reused.

    Returns:
        A transform from an RGB PIL image to a (3, H, W) float32 tensor.
    """
    H, W = pre.img_size
    steps: list = [
        RandomResizedCropAndInterpolation(
            (H, W), scale=aug.crop_scale, ratio=aug.crop_ratio, interpolation=pre.interpolation
        )
    ]
    if aug.hflip > 0:
        steps.append(T.RandomHorizontalFlip(aug.hflip))
    if aug.vflip > 0:
        steps.append(T.RandomVerticalFlip(aug.vflip))
    if aug.rotate > 0 or aug.translate > 0 or aug.scale is not None:
        steps.append(
            T.RandomAffine(
                degrees=aug.rotate,
                translate=(aug.translate, aug.translate) if aug.translate > 0 else None,
                scale=tuple(aug.scale) if aug.scale is not None else None,
                interpolation=T.InterpolationMode.BILINEAR,
                fill=(aug.fill,) * 3,
            )
        )
    if aug.rand_augment:
        img_mean = tuple(round(255 * m) for m in pre.mean)
        steps.append(
            rand_augment_transform(aug.rand_augment, dict(translate_const=int(min(H, W) * 0.45), img_mean=img_mean))
        )
    if aug.color_jitter > 0:
        steps.append(T.ColorJitter(aug.color_jitter, aug.color_jitter, aug.color_jitter))
    steps += [T.ToTensor(), T.Normalize(pre.mean, pre.std)]
    if aug.re_prob > 0:
        steps.append(RandomErasing(aug.re_prob, mode=aug.re_mode, device="cpu"))
    return T.Compose(steps)


class BatchTransform:
    """A batch of uint8 images -> normalised float32 tensors, augmented per sample in a few batched ops.

    Replaces the per-image PIL pipeline where that is the bottleneck (small images, few cores): one
    `grid_sample` draws every sample's random-resized crop, flips, rotation, shift and zoom; random
    erasing is one masked write. Without `aug` it only normalises, exactly as `Preprocess.normalize`.
    RandAugment and colour jitter are PIL-only: use the per-image pipeline for them.

    Args:
        pre: evaluation preprocessing; its mean and std are used.
        aug: training augmentation, or None for evaluation.
    """

    def __init__(self, pre: Preprocess, aug: Augment | None = None):
        if aug is not None and (aug.rand_augment or aug.color_jitter > 0):
            raise ValueError(
                "batch augmentation does not do RandAugment or colour jitter: set augment.rand_augment null and "
                "augment.color_jitter 0, or use per-image augmentation (data.batch_augment false)"
            )
        self.aug = aug
        self.mean = torch.tensor(pre.mean, dtype=torch.float32).view(1, 3, 1, 1)
        self.std = torch.tensor(pre.std, dtype=torch.float32).view(1, 3, 1, 1)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """Args:
            images: (B, H, W, 3) uint8.

        Returns:
            (B, 3, H, W) float32, normalised (and augmented when training).
        """
        x = images.permute(0, 3, 1, 2).float() / 255.0  # (B, 3, H, W) in [0, 1]
        if self.aug is not None:
            x = self._geometry(x)
        x = (x - self.mean.to(x.device)) / self.std.to(x.device)
        if self.aug is not None and self.aug.re_prob > 0:
            x = random_erase(x, self.aug.re_prob, self.aug.re_mode)
        return x.contiguous()

    def _geometry(self, x: torch.Tensor) -> torch.Tensor:
        aug = self.aug
        theta = random_affine(len(x), aug, x.device)  # (B, 2, 3)
        if theta is None:
            return x
        fill = aug.fill / 255.0
        grid = F.affine_grid(theta, list(x.shape), align_corners=False)  # (B, H, W, 2)
        # zeros outside the image, shifted by `fill`: uncovered pixels get the fill grey
        return F.grid_sample(x - fill, grid, mode="bilinear", padding_mode="zeros", align_corners=False) + fill


def random_affine(B: int, aug: Augment, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """Per-sample affine maps (output -> input coordinates in [-1, 1]) for `F.affine_grid`.

    Composes a random-resized crop (area in `crop_scale`, aspect in `crop_ratio`), flips, a rotation, a
    shift and a zoom. Returns None when `aug` asks for no geometric change at all.

    Returns:
        (B, 2, 3) float32, or None.
    """
    lo, hi = aug.crop_scale
    no_crop = lo >= 1.0 and aug.crop_ratio[0] == aug.crop_ratio[1] == 1.0
    if no_crop and not (aug.hflip or aug.vflip or aug.rotate or aug.translate or aug.scale):
        return None
    u = lambda a, b: torch.empty(B, device=device).uniform_(a, b)
    area = u(lo, hi)
    log_ratio = u(math.log(aug.crop_ratio[0]), math.log(aug.crop_ratio[1]))
    w = torch.sqrt(area * torch.exp(log_ratio)).clamp(max=1.0)  # crop width, as a fraction of the image
    h = torch.sqrt(area / torch.exp(log_ratio)).clamp(max=1.0)
    cx, cy = (1 - w) * u(-1, 1), (1 - h) * u(-1, 1)  # crop centre, kept inside the image
    sx = torch.where(torch.rand(B, device=device) < aug.hflip, -w, w)
    sy = torch.where(torch.rand(B, device=device) < aug.vflip, -h, h)
    if aug.scale is not None:
        zoom = u(*aug.scale)
        sx, sy = sx / zoom, sy / zoom
    angle = u(-aug.rotate, aug.rotate) * (math.pi / 180)
    cos, sin = torch.cos(angle), torch.sin(angle)
    tx, ty = 2 * aug.translate * u(-1, 1), 2 * aug.translate * u(-1, 1)
    theta = torch.stack(
        [torch.stack([sx * cos, -sx * sin, cx + tx], -1), torch.stack([sy * sin, sy * cos, cy + ty], -1)], 1
    )
    return theta  # (B, 2, 3)


def random_erase(x: torch.Tensor, prob: float, mode: str = "pixel") -> torch.Tensor:
    """Erase one random rectangle (2-33 % of the area, aspect 0.3-3.3) in each sample with probability `prob`.

    Args:
        x: (B, C, H, W) normalised images.
        prob: per-sample probability.
        mode: fill with "pixel" (per-pixel normal noise), "rand" (one normal colour per sample) or "const" (0).

    Returns:
        (B, C, H, W), a new tensor.
    """
    B, C, H, W = x.shape
    dev = x.device
    area = torch.empty(B, device=dev).uniform_(0.02, 1 / 3) * H * W
    ratio = torch.exp(torch.empty(B, device=dev).uniform_(math.log(0.3), math.log(1 / 0.3)))
    h = torch.sqrt(area * ratio).clamp(1, H)
    w = torch.sqrt(area / ratio).clamp(1, W)
    top = torch.rand(B, device=dev) * (H - h + 1)
    left = torch.rand(B, device=dev) * (W - w + 1)
    rows = torch.arange(H, device=dev).view(1, H, 1)
    cols = torch.arange(W, device=dev).view(1, 1, W)
    inside = (rows >= top.floor().view(B, 1, 1)) & (rows < (top + h).floor().view(B, 1, 1))
    inside = inside & (cols >= left.floor().view(B, 1, 1)) & (cols < (left + w).floor().view(B, 1, 1))
    mask = (inside & (torch.rand(B, 1, 1, device=dev) < prob)).unsqueeze(1)  # (B, 1, H, W)
    if mode == "pixel":
        noise = torch.randn_like(x)
    elif mode == "rand":
        noise = torch.randn(B, C, 1, 1, device=dev).expand_as(x)
    else:
        noise = torch.zeros_like(x)
    return torch.where(mask, noise, x)
