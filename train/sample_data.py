"""The project's sample dataset: scikit-learn's bundled UCI handwritten digits as an image folder.

`vit-sample-data --out data/digits` writes `out/<digit>/<index>.png` (1,797 images, 10 classes)
with no network: the 8 x 8 scans ship inside scikit-learn. Digits are drawn as dark ink on white
paper and upscaled to 32 x 32, so a digit a user draws or photographs looks like the training data.
A `.complete` marker is written last; a second call with the marker present does nothing.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import numpy as np
from PIL import Image

log = logging.getLogger(__name__)

MARKER = ".complete"


def write_digits(out: str | Path, size: int = 32, force: bool = False) -> Path:
    """Write the digits as `out/<digit>/<index>.png`, dark ink on white, `size` x `size` pixels.

    Args:
        out: destination folder (created).
        size: output side in pixels (bicubic upscaling from 8 x 8).
        force: rewrite even when the folder is already complete.

    Returns:
        The output folder.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SystemExit(
            "vit-sample-data needs scikit-learn, which ships the digits: pip install 'vitscope[sample]'"
        ) from None

    out = Path(out)
    if (out / MARKER).is_file() and not force:
        log.info("%s is already complete", out)
        return out
    digits = load_digits()
    ink = digits.images.astype(np.float64) / 16.0  # (n, 8, 8) in [0, 1], 1 = full ink
    paper = np.clip(255.0 * (1.0 - ink) + 0.5, 0, 255).astype(np.uint8)  # dark ink on white
    for label in range(10):
        (out / str(label)).mkdir(parents=True, exist_ok=True)
    for i, (img, label) in enumerate(zip(paper, digits.target, strict=False)):
        Image.fromarray(img, "L").resize((size, size), Image.Resampling.BICUBIC).save(out / str(label) / f"{i:04d}.png")
    (out / MARKER).write_text(
        f"{len(paper)} images, 10 classes, {size} x {size} px, from sklearn.datasets.load_digits\n"
    )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="vit-sample-data",
        description="Write the UCI handwritten digits (bundled with scikit-learn) as an image folder.",
    )
    parser.add_argument("--out", default="data/digits", help="output folder (default: data/digits)")
    parser.add_argument("--size", type=int, default=32, help="image side in pixels (default: 32)")
    parser.add_argument("--force", action="store_true", help="rewrite even if the folder is complete")
    args = parser.parse_args(argv)
    out = write_digits(args.out, args.size, args.force)
    print(f"sample digits in {out}: train with vit-train fit --config configs/sample.yaml")


if __name__ == "__main__":
    main()
