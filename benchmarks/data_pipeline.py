"""Does the input pipeline keep the model busy? Images per second the loader delivers vs the model trains.

Two cases, each through `ImageFolderDataModule` with the settings the run would use (workers picked from
the cores, batch augmentation, the uint8 cache where it fits):
  * Fashion-MNIST at 28 px (`vit-fashion-mnist --out data/fmnist` first), configs/small_images.yaml's model;
  * a 224-px JPEG folder generated here (camera-sized 1024 x 768 photos, so reduced-size decoding counts),
    vit_tiny_patch16_224.
"model" is training steps (forward, backward, AdamW) on batches already in memory; "loader" is iterating
the training DataLoader alone. The loader is not the bottleneck when loader >= model.

    .venv/bin/python -m benchmarks.data_pipeline [--fmnist data/fmnist] [--jpegs 512] [--threads 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from benchmarks.common import Result, Table, add_results_option
from train.datamodule import ImageFolderDataModule
from train.module import ViTClassifier
from train.transforms import Augment

SMALL_NET = dict(stem="conv", pos_embed="sincos", global_pool="avg", class_token=False, drop_path_rate=0.05)
SMALL_AUG = Augment(crop_scale=(0.8, 1.0), crop_ratio=(0.9, 1.1), hflip=0.5, rand_augment=None, re_prob=0.0)
BIG_AUG = Augment(rand_augment=None, re_prob=0.25)


def loader_rate(dm: ImageFolderDataModule, batches: int) -> float:
    """Images per second from the training DataLoader (after one warm-up batch)."""
    loader = dm.train_dataloader()
    batches = min(batches, len(loader) - 1)
    loader = iter(loader)
    next(loader)
    start, n = time.perf_counter(), 0
    for _ in range(batches):
        x, _ = next(loader)
        n += len(x)
    return n / (time.perf_counter() - start)


def model_rate(module: ViTClassifier, x: torch.Tensor, y: torch.Tensor, steps: int) -> float:
    """Images per second of training steps on one batch already in memory (after one warm-up step)."""
    net = module.net.train()
    opt = torch.optim.AdamW(module.param_groups(), lr=1e-3)
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    for i in range(steps + 1):
        if i == 1:
            start = time.perf_counter()
        loss = loss_fn(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return steps * len(x) / (time.perf_counter() - start)


def write_jpegs(root: Path, n: int, classes: int = 4) -> Path:
    """`n` 1024 x 768 JPEGs of smooth random colour fields, in `classes` class folders."""
    rng = np.random.default_rng(0)
    for i in range(n):
        folder = root / f"class{i % classes}"
        folder.mkdir(parents=True, exist_ok=True)
        small = rng.integers(0, 255, (12, 16, 3), dtype=np.uint8)
        Image.fromarray(small).resize((1024, 768), Image.Resampling.BILINEAR).save(folder / f"{i}.jpg", quality=90)
    return root


def case(table: Table, name: str, dm: ImageFolderDataModule, module: ViTClassifier, batches: int, steps: int) -> None:
    start = time.perf_counter()
    dm.setup("fit")
    setup = time.perf_counter() - start
    loader = loader_rate(dm, batches)
    x, y = next(iter(dm.train_dataloader()))
    model = model_rate(module, x, y, steps)
    verdict = "loader keeps up" if loader >= model else "LOADER IS THE BOTTLENECK"
    table.add(name, dm.batch_size, dm.workers, dm._cached, setup, loader, model, f"{loader / model:.1f} x: {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fmnist", default="data/fmnist", help="Fashion-MNIST image folder (vit-fashion-mnist)")
    parser.add_argument("--jpegs", type=int, default=512, help="JPEGs to generate for the 224-px case")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the training process")
    args = add_results_option(parser).parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    result = Result("data_pipeline", {"torch threads": args.threads}, packages=("torch",), results=args.results)
    columns = ["data, model", "batch", "workers", "cached", "setup s", "loader img/s", "model img/s", "loader / model"]
    formats = {"setup s": "{:.1f}", "loader img/s": "{:,.0f}", "model img/s": "{:,.0f}"}
    table = result.table(columns, formats=formats)
    if Path(args.fmnist).is_dir():
        dm = ImageFolderDataModule(args.fmnist, img_size=28, crop_pct=1.0, mean=(0.5,) * 3, std=(0.5,) * 3,
                                   augment=SMALL_AUG, batch_size=256, cache_images=True)  # fmt: skip
        net = ViTClassifier(10, 28, "vit_micro_patch4_32", SMALL_NET)
        case(table, "Fashion-MNIST 28 px, vit_micro conv stem", dm, net, batches=100, steps=10)
    with tempfile.TemporaryDirectory() as tmp:
        root = write_jpegs(Path(tmp) / "jpegs", args.jpegs)
        dm = ImageFolderDataModule(str(root), img_size=224, augment=BIG_AUG, batch_size=64, cache_images=False)
        case(table, "1024x768 JPEGs -> 224 px, vit_tiny", dm, ViTClassifier(4, 224), batches=6, steps=3)
    result.finish()


if __name__ == "__main__":
    main()
