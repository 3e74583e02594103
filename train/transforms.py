"""Training augmentation (timm's building blocks) and the evaluation transform (the serving one).

The evaluation transform is `serve.runtime.images.Preprocess.__call__`, nothing else: what the model is
validated on is, pixel for pixel, what the exported model will be served.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from timm.data import RandomResizedCropAndInterpolation, rand_augment_transform
from timm.data.random_erasing import RandomErasing
from torchvision import transforms as T

from serve.runtime.images import Preprocess


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
