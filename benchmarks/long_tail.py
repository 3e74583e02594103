"""Which `--data.balance` method trains best on a long tail: Fashion-MNIST cut to imbalance ratio 100.

Class k (in the dataset's label order) keeps round(6000 * 0.01^(k/9)) training images, from 6,000 T-shirts down
to 60 ankle boots; the official (balanced) test set is the validation folder. Each method trains
`configs/small_images.yaml` for the same number of epochs (no time budget), and its last checkpoint is scored by
balanced accuracy (mean per-class recall) on the test set, with the recall of the five smallest classes.
`none` is `--data.balance none`; each other method is what `--data.balance auto` does with `train.balance.METHOD`
set to it. `balanced_softmax` is left out by default: at tau = 1 it is the logit-adjusted loss itself (a softmax
ignores the constant between their shifts; tests/train/test_balance.py pins the two together). The table keeps
earlier runs' rows, replacing those of the same method and epochs.

    sudo apt-get install dataset-fashion-mnist && vit-fashion-mnist --out data/fmnist
    nice -n 10 .venv/bin/python -m benchmarks.long_tail --epochs 8
    nice -n 10 .venv/bin/python -m benchmarks.long_tail --epochs 25 --methods none,logit_adjusted
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import Result, add_results_option, previous
from serve.runtime.images import load_image
from train.balance import METHODS
from train.checkpoint_format import load_network
from train.fashion_mnist import CLASSES

REPO = Path(__file__).resolve().parents[1]
RATIO = 100
SMALLEST = 5  # classes whose recall is shown


def kept(k: int) -> int:
    """Training images class k keeps: the exponential profile of imbalance ratio `RATIO` over 10 classes."""
    return round(6000 * (1 / RATIO) ** (k / 9))


def build_folder(source: Path, out: Path) -> dict[str, int]:
    """`out/train` (the long-tail cut of `source/train`) and `out/val` (all of `source/val`), hard-linked."""
    counts = {name: kept(k) for k, name in enumerate(CLASSES)}
    if (out / "counts.json").is_file() and json.loads((out / "counts.json").read_text()) == counts:
        return counts
    shutil.rmtree(out, ignore_errors=True)
    for split in ("train", "val"):
        for name in CLASSES:
            files = sorted((source / split / name).glob("*.png"))
            if split == "train":
                files = files[: counts[name]]
            (out / split / name).mkdir(parents=True)
            for f in files:
                os.link(f, out / split / name / f.name)
    (out / "counts.json").write_text(json.dumps(counts))
    return counts


def train_one(method: str, data: Path, run_dir: Path, epochs: int) -> None:
    """Train one method in this process: `train.balance.METHOD` is what `--data.balance auto` applies."""
    import train.balance
    from train.cli import main as vit_train

    if method != "none":
        train.balance.METHOD = method
    args = ["fit", "--config", "configs/small_images.yaml", "--data.root", str(data), "--data.img_size", "28"]
    args += ["--trainer.max_epochs", str(epochs), "--trainer.callbacks", "[]", "--trainer.default_root_dir"]
    args += [str(run_dir), "--trainer.enable_progress_bar", "false", "--overwrite", "true"]
    args += ["--data.balance", "none" if method == "none" else "auto", "--data.dedupe", "none"]
    args += ["--trainer.check_val_every_n_epoch", "1", "--model.net_args.flip_tta", "false"]  # as measured
    vit_train([*args, "--model.compile", "false"])  # eager, as its figures were measured: they are of accuracy


def score(run_dir: Path, data: Path, checkpoint: str = "last.ckpt", one_view: bool = False) -> np.ndarray:
    """Per-class recall (K,) of the run's `checkpoint` on every image of `data/val` (`one_view`: without the
    network's flip test-time augmentation, if it has it)."""
    net, meta = load_network(run_dir / "checkpoints" / checkpoint)
    net.flip_tta = net.flip_tta and not one_view
    names = meta["class_names"]
    correct, total = np.zeros(len(names)), np.zeros(len(names))
    for k, name in enumerate(names):
        files = sorted((data / "val" / name).glob("*.png"))
        x = torch.from_numpy(np.stack([meta["preprocess"](load_image(f)) for f in files]))  # (n, 3, H, W)
        with torch.no_grad():
            pred = torch.cat([net(b).argmax(-1) for b in x.split(500)])  # (n,)
        correct[k], total[k] = int((pred == k).sum()), len(files)
    return correct / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="data/fmnist", help="the Fashion-MNIST folder (vit-fashion-mnist)")
    parser.add_argument("--data", default="data/fmnist_long_tail", help="where the long-tail folder is made")
    parser.add_argument("--runs", default="runs/long_tail", help="one run directory per method under it")
    parser.add_argument("--epochs", type=int, default=25)
    default = ",".join(m for m in ("none", *METHODS) if m != "balanced_softmax")
    parser.add_argument("--methods", default=default, help="comma-separated: none and train.balance.METHODS")
    parser.add_argument("--train-one", default=None, help=argparse.SUPPRESS)
    args = add_results_option(parser).parse_args()
    data, runs = Path(args.data), Path(args.runs)
    if args.train_one:
        return train_one(args.train_one, data, runs / f"{args.train_one}_{args.epochs}", args.epochs)
    counts = build_folder(Path(args.source), data)
    old = previous("long_tail", args.results) or {}
    rows = {(r[0], r[1]): r for r in (old.get("tables") or [{}])[0].get("rows", [])}
    smallest = sorted(counts, key=counts.get)[:SMALLEST]
    for method in args.methods.split(","):
        start = time.perf_counter()
        cmd = [sys.executable, "-m", "benchmarks.long_tail", "--train-one", method, "--epochs", str(args.epochs)]
        subprocess.run([*cmd, "--data", str(data), "--runs", str(runs)], check=True, cwd=REPO)
        minutes = (time.perf_counter() - start) / 60
        recall = dict(zip(CLASSES, score(runs / f"{method}_{args.epochs}", data), strict=True))
        rows[(method, args.epochs)] = [method, args.epochs, float(np.mean(list(recall.values())))]
        rows[(method, args.epochs)] += [recall[c] for c in smallest] + [minutes]
        print(f"{method}: balanced accuracy {rows[(method, args.epochs)][2]:.4f} ({minutes:.1f} min)", flush=True)
    setting = {"ratio": RATIO, "train images": sum(counts.values()), "epochs": args.epochs}
    result = Result("long_tail", setting, ("torch", "lightning"), results=args.results)
    columns = ["method", "epochs", "balanced accuracy"] + [f"{c} ({counts[c]})" for c in smallest] + ["minutes"]
    table = result.table(columns, formats={c: "{:.1%}" for c in columns[2:-1]} | {"minutes": "{:.1f}"})
    for key in sorted(rows, key=lambda k: (k[1], -rows[k][2])):
        table.add(*rows[key])
    result.data = {"class_counts": counts}
    result.finish()


if __name__ == "__main__":
    main()
