"""Fashion-MNIST (Debian's `dataset-fashion-mnist`) as an image folder, for the small-image benchmark.

    sudo apt-get install dataset-fashion-mnist
    vit-fashion-mnist --out data/fmnist

writes `out/train/<class>/<index>.png` (60,000) and `out/val/<class>/<index>.png` (the official 10,000
test images), 28 x 28 grey, from the gzip'd idx files the package installs. No network. A `.complete`
marker is written last; a second call with the marker present does nothing.
"""

from __future__ import annotations

import argparse
import gzip
import logging
import shlex
import struct
import sys
from pathlib import Path

import numpy as np
from PIL import Image

log = logging.getLogger(__name__)

DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"
CLASSES = ("tshirt_top", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle_boot")
SPLITS = {"train": "train", "val": "t10k"}  # our folder name -> the idx file prefix
MARKER = ".complete"
SIDE = 28  # pixels: every image is 28 x 28


def read_idx(path: str | Path) -> np.ndarray:
    """An idx file (gzip'd or not) as a uint8 array: (n,) labels or (n, 28, 28) images."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    zero, dtype, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype != 0x08:
        raise ValueError(f"{path} is not a uint8 idx file (magic {data[:4].hex()})")
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(shape)


def load_split(source: str | Path, prefix: str) -> tuple[np.ndarray, np.ndarray]:
    """(images (n, 28, 28) uint8, labels (n,) uint8) of `prefix` ("train" or "t10k") in `source`."""
    source = Path(source)
    images = read_idx(_find(source, f"{prefix}-images-idx3-ubyte"))
    labels = read_idx(_find(source, f"{prefix}-labels-idx1-ubyte"))
    if len(images) != len(labels):
        raise ValueError(f"{source}: {len(images)} {prefix} images but {len(labels)} labels")
    return images, labels


def _find(source: Path, stem: str) -> Path:
    for name in (stem + ".gz", stem):
        if (source / name).is_file():
            return source / name
    raise FileNotFoundError(
        f"{source / (stem + '.gz')} not found: install the dataset with `sudo apt-get install dataset-fashion-mnist` "
        "or pass --source DIR holding the four idx files"
    )


def write_fashion_mnist(out: str | Path, source: str | Path = DEBIAN_DIR, force: bool = False) -> Path:
    """Write `out/{train,val}/<class>/<index>.png`; val is the official test set.

    Args:
        out: destination folder (created).
        source: folder holding the idx files.
        force: rewrite even when the folder is already complete.

    Returns:
        The output folder.
    """
    out = Path(out)
    if (out / MARKER).is_file() and not force:
        log.info("%s is already complete", out)
        return out
    counts = {}
    for split, prefix in SPLITS.items():
        images, labels = load_split(source, prefix)
        for name in CLASSES:
            (out / split / name).mkdir(parents=True, exist_ok=True)
        for i, (img, label) in enumerate(zip(images, labels, strict=True)):
            Image.fromarray(img, "L").save(out / split / CLASSES[label] / f"{i:05d}.png")
        counts[split] = len(images)
    (out / MARKER).write_text(
        f"{counts['train']} train, {counts['val']} val (official test) images, {SIDE} x {SIDE} grey\n"
    )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="vit-fashion-mnist",
        description="Write Fashion-MNIST (apt-get install dataset-fashion-mnist) as a train/val image folder.",
    )
    parser.add_argument("--out", default="data/fmnist", help="output folder (default: data/fmnist)")
    parser.add_argument("--source", default=DEBIAN_DIR, help=f"folder of the idx files (default: {DEBIAN_DIR})")
    parser.add_argument("--force", action="store_true", help="rewrite even if the folder is complete")
    args = parser.parse_args(argv)
    try:
        out = write_fashion_mnist(args.out, args.source, args.force)
    except (FileNotFoundError, ValueError) as e:
        print(f"vit-fashion-mnist: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    # the guide's run (docs/guide/train.md): at the images' own 28 px, where the config's default is 32
    root = shlex.quote(str(out))
    train = f"vit-train fit --config configs/small_images.yaml --data.root {root} --data.img_size {SIDE}"
    print(f"Fashion-MNIST in {out}: train with {train} --trainer.default_root_dir runs/fmnist")


if __name__ == "__main__":
    main()
