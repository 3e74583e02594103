"""What does a training step cost beyond the model, next to a plain PyTorch loop?

Each comparison alternates the plain loop and the Lightning run over `--rounds` rounds and compares their median
time per step, timed from the end of one batch to the end of the next (so fetching the batch counts):
1. Lightning alone: `ViTClassifier.training_step` under a `Trainer` with the shipped loggers, against a plain loop
   with the same model, pre-made random batches, AdamW groups, schedule and clipping.
2. vit-train: what `vit-train fit --config configs/small_images.yaml --data.img_size 28` builds (cached uint8
   images, batch augmentation, EMA, the run's callbacks and loggers) on the first Fashion-MNIST images (random grey
   PNGs without `dataset-fashion-mnist`), against a plain loop over the same images pre-loaded as tensors, without
   and with the same batch augmentation. An epoch outlasts the run, so no validation or checkpoint is timed. Both
   sides run eager (`--model.compile false`); `benchmarks.train_precision` measures the compiled step.

    .venv/bin/python -m benchmarks.train_overhead [--steps 60] [--vit-steps 30] [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from itertools import islice
from pathlib import Path

import numpy as np
import torch
import yaml
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from PIL import Image
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.common import Result, Table, add_results_option, interleaved
from train.cli import build_cli
from train.dataset import BatchCollate
from train.fashion_mnist import CLASSES, DEBIAN_DIR, load_split
from train.module import ViTClassifier
from train.transforms import BatchTransform

REPO = Path(__file__).resolve().parents[1]
WARMUP = 5  # steps left out of the timing on both sides


class StepTimer(Callback):
    """The end time of every training batch."""

    def __init__(self):
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.ends.append(time.perf_counter())

    def per_step(self) -> float:
        """Seconds per step after the first WARMUP (from the end of step WARMUP - 1 to the end of the last)."""
        return (self.ends[-1] - self.ends[WARMUP - 1]) / (len(self.ends) - WARMUP)


def plain_round(module: ViTClassifier, batches, steps: int, transform=None) -> float:
    """Seconds per step of a plain loop: what `training_step`, clipping and the module's EMA do, nothing else
    (and `transform` on each batch, when given)."""
    net = module.net.train()
    opt = torch.optim.AdamW(module.param_groups(), lr=module.hparams.lr, betas=module.hparams.betas)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    start = time.perf_counter()
    for i, (x, y) in enumerate(islice(batches, steps)):
        if transform is not None:
            x = transform(x)
        loss = module.train_loss(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        sched.step()
        if module.ema is not None:
            module.ema.update(net, step=i)
        if i == WARMUP - 1:
            start = time.perf_counter()
    return (time.perf_counter() - start) / (steps - WARMUP)


def make_module(num_classes: int) -> ViTClassifier:
    torch.manual_seed(0)
    return ViTClassifier(num_classes=num_classes, img_size=32, variant="vit_micro_patch4_32", warmup_epochs=0.0)


def lightning_round(loader: DataLoader, steps: int, num_classes: int, log_dir: str) -> float:
    timer = StepTimer()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        max_steps=steps,
        limit_val_batches=0,
        gradient_clip_val=1.0,
        log_every_n_steps=10,
        logger=[TensorBoardLogger(log_dir, name="tb"), CSVLogger(log_dir, name="csv")],
        callbacks=[timer],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(make_module(num_classes), loader)
    return timer.per_step()


def write_small_images(root: Path, n_train: int, n_val: int) -> str:
    """`root/{train,val}/<class>/*.png`, 28 x 28 grey: Fashion-MNIST's first images, or random ones without it."""
    try:
        splits = {"train": load_split(DEBIAN_DIR, "train"), "val": load_split(DEBIAN_DIR, "t10k")}
        source = "Fashion-MNIST"
    except FileNotFoundError:
        rng = np.random.default_rng(0)
        n = n_train + n_val
        images, labels = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), rng.integers(0, 10, n)
        splits = {"train": (images[:n_train], labels[:n_train]), "val": (images[n_train:], labels[n_train:])}
        source = "random grey PNGs"
    for split, count in (("train", n_train), ("val", n_val)):
        images, labels = splits[split]
        for name in CLASSES:
            (root / split / name).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            Image.fromarray(images[i], "L").save(root / split / CLASSES[labels[i]] / f"{i:05d}.png")
    return source


def vit_train_args(root: Path, run_dir: Path, steps: int, threads: int) -> list[str]:
    """`vit-train fit` arguments, less the subcommand (the objects are built, then fitted here)."""
    return [
        "--config", str(REPO / "configs" / "small_images.yaml"), "--data.root", str(root), "--data.img_size", "28",
        "--trainer.default_root_dir", str(run_dir), "--trainer.max_steps", str(steps), "--trainer.accelerator", "cpu",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--num_threads", str(threads), "--model.compile", "false",  # eager as the plain loop: train_precision compiles
    ]  # fmt: skip


def vit_train_round(root: Path, run_dir: Path, steps: int, threads: int) -> float:
    cli = build_cli(vit_train_args(root, run_dir, steps, threads), run=False)
    timer = StepTimer()
    cli.trainer.callbacks.append(timer)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return timer.per_step()


def pre_loaded_round(root: Path, run_dir: Path, steps: int, threads: int, augment: bool) -> float:
    """The plain loop on vit-train's model over its training images batched up front: normalised, or as uint8
    that vit-train's batch augmentation and normalisation (`BatchTransform`) then take on each step."""
    cli = build_cli(vit_train_args(root, run_dir, steps, threads), run=False)
    dm = cli.datamodule
    dm.setup("fit")
    collate = BatchCollate(lambda images: images) if augment else BatchCollate(BatchTransform(dm.preprocess))
    loader = DataLoader(dm.train_set, dm.batch_size, shuffle=True, collate_fn=collate, drop_last=True)
    transform = BatchTransform(dm.preprocess, dm.augment) if augment else None
    return plain_round(cli.model, list(islice(loader, steps)), steps, transform=transform)


def compare(table: Table, rows: list[tuple[str, list[float]]]) -> None:
    """Rows of per-step times (the plain loop first) into `table`, with their ratio as its note."""
    for name, times in rows:
        table.add(name, 1e3 * statistics.median(times), ", ".join(f"{1e3 * t:.1f}" for t in times))
    ratio = statistics.median(rows[1][1]) / statistics.median(rows[0][1])
    table.notes.append(f"{rows[1][0].split(' (')[0]} / plain = {ratio:.3f}  ({100 * (ratio - 1):+.1f} %)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="steps per round, Lightning alone")
    parser.add_argument("--vit-steps", type=int, default=30, help="steps per round, vit-train (the config's batches)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64, help="batch size, Lightning alone")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, both comparisons")
    args = add_results_option(parser).parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    num_classes = 10
    g = torch.Generator().manual_seed(0)
    n = args.steps * args.batch_size
    data = TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, num_classes, (n,), generator=g))
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=False)
    with tempfile.TemporaryDirectory() as tmp:
        lightning = interleaved(args.rounds, {
            "plain": lambda r: plain_round(make_module(num_classes), loader, args.steps),
            "lightning": lambda r: lightning_round(loader, args.steps, num_classes, tmp),
        })  # fmt: skip
        root, steps = Path(tmp) / "images", args.vit_steps
        batch = yaml.safe_load(Path("configs/small_images.yaml").read_text())["data"]["batch_size"]
        source = write_small_images(root, (steps + 1) * batch, 500)  # an epoch outlasts the run
        run = lambda kind, r: Path(tmp) / f"{kind}{r}"  # noqa: E731  (a run directory per round)
        vit_train = interleaved(args.rounds, {
            "preloaded": lambda r: pre_loaded_round(root, run("plain", r), steps, args.threads, augment=False),
            "augmented": lambda r: pre_loaded_round(root, run("aug", r), steps, args.threads, augment=True),
            "vit-train": lambda r: vit_train_round(root, run("vit", r), steps, args.threads),
        })  # fmt: skip
    setting = {"torch threads": args.threads, "rounds": args.rounds}
    result = Result("train_overhead", setting, packages=("torch", "lightning"), results=args.results)
    columns, formats = ["loop", "ms/step (median)", "rounds (ms/step)"], {"ms/step (median)": "{:.1f}"}
    title = (f"1. Lightning alone: vit_micro_patch4_32 (32 px), batch {args.batch_size} of random tensors, "
             f"{args.steps - WARMUP} timed steps a round")  # fmt: skip
    rows = [("plain PyTorch", lightning["plain"]), ("Lightning (ViTClassifier + Trainer)", lightning["lightning"])]
    compare(result.table(columns, title, formats), rows)
    vit = ("vit-train (data module + Lightning)", vit_train["vit-train"])
    title = (f"2. vit-train: configs/small_images.yaml at 28 px, batch {batch}, {source} ({(steps + 1) * batch} "
             f"training images), {steps - WARMUP} timed steps a round")  # fmt: skip
    preloaded = ("plain PyTorch (pre-loaded tensors)", vit_train["preloaded"])
    compare(result.table(columns, title, formats), [preloaded, vit])
    title = "The same vit-train step against a plain loop that augments its pre-loaded batches as vit-train does:"
    augmented = ("plain PyTorch + the same batch augmentation", vit_train["augmented"])
    compare(result.table(columns, title, formats), [augmented, vit])
    result.data = {"lightning": lightning, "vit_train": vit_train}
    result.finish()


if __name__ == "__main__":
    main()
