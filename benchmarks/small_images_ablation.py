"""What makes the small-image recipe learn: one choice at a time, on Fashion-MNIST, in a plain PyTorch loop.

Each run trains `vit_micro_patch4_32` at 28 px from scratch on the training images held as one tensor (AdamW,
cosine schedule) and tests on the official 10,000 after each epoch. It is one row of the table (`--tag` names
it): the result keeps earlier runs' rows and replaces the one of the same options.

    sudo apt-get install dataset-fashion-mnist
    .venv/bin/python -m benchmarks.small_images_ablation --stem-widths 16,32,64 --epochs 3 --tag "16, 32, 64 wide"
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import Result, add_results_option, previous
from train.fashion_mnist import DEBIAN_DIR, load_split
from vit import ATTN_SCORES, create_model


def tensors(source: str, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, 1, 28, 28) float in [-1, 1] and (N,) labels."""
    x, y = load_split(source, prefix)
    return torch.tensor(x).float().div(127.5).sub(1.0)[:, None], torch.tensor(y).long()


def augment(x: torch.Tensor) -> torch.Tensor:
    """Flip half the batch, then one random 28-px crop of the batch padded by 2 px (black)."""
    flip = torch.rand(x.shape[0]) < 0.5
    x = torch.where(flip[:, None, None, None], x.flip(3), x)
    x = F.pad(x, (2, 2, 2, 2), value=-1.0)
    dx, dy = torch.randint(0, 5, (2,)).tolist()
    return x[:, :, dy : dy + 28, dx : dx + 28]


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    right = sum((model(x[i : i + 1000]).argmax(1) == y[i : i + 1000]).sum().item() for i in range(0, len(x), 1000))
    model.train()
    return right / len(x)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(DEBIAN_DIR), help="the folder of Fashion-MNIST's idx files")
    p.add_argument("--stem", default="conv", choices=["conv", "patch", "shifted"], help="shifted: SPT")
    p.add_argument("--attn-score", default="scaled_dot", choices=ATTN_SCORES, help="lsa: locality self-attention")
    p.add_argument("--stem-widths", default="none", help="comma-separated widths, or none for the default")
    p.add_argument("--head-only", action="store_true", help="no transformer: stem, average pool, linear")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--no-augment", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tag", default="", help="what the row tests, in words (default: its options)")
    args = add_results_option(p).parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x_train, y_train = tensors(args.data, "train")
    x_test, y_test = tensors(args.data, "t10k")
    widths = None if args.stem_widths == "none" else [int(w) for w in args.stem_widths.split(",")]
    net_args = dict(global_pool="avg", class_token=False, pos_embed="sincos", stem=args.stem, stem_widths=widths)
    net_args["attn_score"] = args.attn_score
    model = create_model("vit_micro_patch4_32", img_size=28, in_chans=1, num_classes=10, **net_args)
    if args.head_only:  # the convolutional stem alone, as a small CNN
        stem, width = model.patch_embed.stem, model.patch_embed.proj.in_channels
        model = nn.Sequential(stem, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10))
    params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=args.lr)
    per_epoch = len(x_train) // args.batch
    total, warmup = args.epochs * per_epoch, per_epoch // 2

    def factor(step: int) -> float:
        return min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(step, total) / total))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    result = Result("small_images_ablation", {"threads": args.threads}, packages=("torch",), results=args.results)
    cpu0, wall0, accs = time.process_time(), time.perf_counter(), []
    for epoch in range(args.epochs):
        order = torch.randperm(len(x_train))
        for i in range(per_epoch):
            idx = order[i * args.batch : (i + 1) * args.batch]
            x = x_train[idx] if args.no_augment else augment(x_train[idx])
            loss = F.cross_entropy(model(x), y_train[idx], label_smoothing=args.label_smoothing)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        acc = accuracy(model, x_test, y_test)
        accs.append(100 * acc)
        print(f"epoch {epoch + 1}: test accuracy {100 * acc:.2f} %", file=sys.stderr, flush=True)
    options = shlex.join(options_of(sys.argv[1:]))
    row = [args.tag or options, options, params, ", ".join(f"{a:.2f}" for a in accs), cpu, result.header["date"][:10]]
    images = args.epochs * per_epoch * args.batch
    result.data = {"last run": {"options": options, "images/s": images / wall, "wall s": wall, "accuracy %": accs}}
    record(result, row, args.results)


COLUMNS = ["run", "options", "parameters", "test accuracy % after each epoch", "CPU s", "measured"]


def options_of(argv: list[str]) -> list[str]:
    """The command-line options that choose what is tested: without --tag, --data, --results and their values."""
    out, args = [], iter(argv)
    for arg in args:
        if arg.split("=", 1)[0] in ("--tag", "--data", "--results"):
            if "=" not in arg:
                next(args, None)
            continue
        out.append(arg)
    return out


def record(result: Result, row: list, folder) -> None:
    """The table of every run so far with this run's row in it (replacing the last run of the same options)."""
    earlier = previous(result.name, folder)
    rows = earlier["tables"][0]["rows"] if earlier else []
    table = result.table(COLUMNS, formats={"CPU s": "{:.0f}"})
    table.rows = [r for r in rows if r[1] != row[1]] + [row]
    result.finish()


if __name__ == "__main__":
    main()
