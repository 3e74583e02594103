"""What makes the small-image recipe learn: one choice at a time, on Fashion-MNIST, at the same wall-clock budget.

Each run trains `vit_micro_patch4_32` at 28 px from scratch for `--minutes` on one thread, in a plain PyTorch loop
over the training images held as one tensor (AdamW, warm-up and cosine on the clock), and then tests on the official
10,000 (with `--flip-tta`, each test image with its mirror). A faster option sees more images in the same time; a
teacher for distillation is trained inside the same budget. It is one row of the table (`--tag` names it): the result
keeps earlier runs' rows and replaces the one of the same options.

    sudo apt-get install dataset-fashion-mnist
    .venv/bin/python -m benchmarks.small_images_ablation --stem-widths 16,32,64 --tag "16, 32, 64 wide"
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import Result, add_results_option, previous
from train.distill import distillation_loss
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


def build(args: argparse.Namespace, distilled: bool = False) -> nn.Module:
    """The model a row trains: `vit_micro_patch4_32` at 28 px with the row's options (or its stem alone as a CNN)."""
    widths = None if args.stem_widths == "none" else [int(w) for w in args.stem_widths.split(",")]
    net_args = dict(global_pool="avg", class_token=False, pos_embed="sincos", stem=args.stem, stem_widths=widths)
    net_args.update(attn_score=args.attn_score, distilled=distilled, flip_tta=args.flip_tta)
    model = create_model("vit_micro_patch4_32", img_size=28, in_chans=1, num_classes=10, **net_args)
    if args.head_only:  # the convolutional stem alone, as a small CNN
        stem, width = model.patch_embed.stem, model.patch_embed.proj.in_channels
        model = nn.Sequential(stem, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10))
    return model


def train(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, args: argparse.Namespace, seconds: float, teacher=None
) -> int:
    """AdamW for `seconds` of wall-clock time: a warm-up over the first 5 %, then a cosine to zero by the end,
    both on the clock (as `train.budget.TimeBudget` anneals `vit-train`). With a teacher, DeiT's hard distillation:
    half the loss on the labels, half on the teacher's top class, the teacher's forward pass inside the budget.
    Returns the images trained on."""
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=args.lr)
    if teacher is not None:
        model.distilled_training = True
        teacher.eval()
    model.train()

    def labels_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, labels, label_smoothing=args.label_smoothing)

    start, images = time.perf_counter(), 0
    while (t := (time.perf_counter() - start) / seconds) < 1.0:
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, t / 0.05) * 0.5 * (1 + math.cos(math.pi * t))
        idx = torch.randint(0, len(x), (args.batch,))
        xb = x[idx] if args.no_augment else augment(x[idx])
        out = model(xb)
        if teacher is None:
            loss = labels_loss(out, y[idx])
        else:  # vit-train's own distillation loss, DeiT's weight 0.5
            loss = distillation_loss(teacher, xb, out, y[idx], labels_loss, 0.5)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        images += len(idx)
    return images


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(DEBIAN_DIR), help="the folder of Fashion-MNIST's idx files")
    p.add_argument("--stem", default="conv", choices=["conv", "patch", "shifted"], help="shifted: SPT")
    p.add_argument("--attn-score", default="scaled_dot", choices=ATTN_SCORES, help="lsa: locality self-attention")
    p.add_argument("--stem-widths", default="none", help="comma-separated widths, or none for the default")
    p.add_argument("--head-only", action="store_true", help="no transformer: stem, average pool, linear")
    p.add_argument(
        "--teacher-share",
        type=float,
        default=0.0,
        help="distillation: train a teacher (the same options) for this share of the budget first, then the "
        "student with a distillation token for the rest (0: no distillation)",
    )
    p.add_argument(
        "--flip-tta", action="store_true", help="test each image with its mirror (vit.flip); training is the same"
    )
    p.add_argument("--minutes", type=float, default=4.0, help="the wall-clock budget of the row, a teacher included")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--no-augment", action="store_true")
    p.add_argument("--compile", action="store_true", help="compile the model; its first compile counts in the budget")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tag", default="", help="what the row tests, in words (default: its options)")
    args = add_results_option(p).parse_args()
    if not 0.0 <= args.teacher_share < 1.0:
        p.error(f"--teacher-share must be at least 0 and under 1, got {args.teacher_share}")
    if args.teacher_share and args.head_only:
        p.error("--head-only has no distillation token: leave out --teacher-share")
    if args.flip_tta and args.head_only:
        p.error("--head-only has no transformer to answer with flip_tta: leave out --flip-tta")
    if args.teacher_share and args.compile:
        p.error("--compile trains one network: leave out --teacher-share")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x_train, y_train = tensors(args.data, "train")
    x_test, y_test = tensors(args.data, "t10k")
    result = Result("small_images_ablation", {"threads": args.threads}, packages=("torch",), results=args.results)
    budget, cpu0, wall0, data = 60 * args.minutes, time.process_time(), time.perf_counter(), {}
    teacher = None
    if args.teacher_share > 0:
        teacher = build(args)
        data["teacher images"] = train(teacher, x_train, y_train, args, args.teacher_share * budget)
        data["teacher accuracy %"] = 100 * accuracy(teacher, x_test, y_test)  # outside the budget, as the student's
        print(f"teacher: test accuracy {data['teacher accuracy %']:.2f} %", file=sys.stderr, flush=True)
    model = build(args, distilled=teacher is not None)
    wall_teacher = time.perf_counter() - wall0
    stepped = torch.compile(model) if args.compile else model  # compiled at its first step, inside the budget
    images = train(stepped, x_train, y_train, args, (1 - args.teacher_share) * budget, teacher)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    acc = 100 * accuracy(model, x_test, y_test)
    if args.flip_tta:  # the same network on one view, for the gain of the mirror alone
        model.flip_tta = False
        data["accuracy of one view %"] = 100 * accuracy(model, x_test, y_test)
        model.flip_tta = True
    print(f"test accuracy {acc:.2f} % after {images} images", file=sys.stderr, flush=True)
    params = sum(p.numel() for p in model.parameters())
    options = shlex.join(options_of(sys.argv[1:]))
    epochs = (images + data.get("teacher images", 0)) / len(x_train)
    row = [args.tag or options, options, params, f"{acc:.2f}", f"{epochs:.2f}", cpu, result.header["date"][:10]]
    data.update({"options": options, "images": images, "wall s": wall, "teacher wall s": wall_teacher})
    result.data = {"last run": {**data, "accuracy %": acc}}
    record(result, row, args.results)


COLUMNS = ["run", "options", "parameters", "test accuracy %", "epochs of training images", "CPU s", "measured"]


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
    """The table of every run so far with this run's row in it (replacing the last run of the same options). Rows
    run side by side (one thread each) finish in any order: the file is locked while it is read and rewritten."""
    from filelock import FileLock

    Path(folder).mkdir(parents=True, exist_ok=True)
    with FileLock(Path(folder) / f".{result.name}.lock"):
        earlier = previous(result.name, folder)
        same = earlier and earlier["tables"][0]["columns"] == COLUMNS  # rows measured some other way are dropped
        rows = earlier["tables"][0]["rows"] if same else []
        table = result.table(COLUMNS, formats={"CPU s": "{:.0f}"})
        table.rows = [r for r in rows if r[1] != row[1]] + [row]
        result.finish()


if __name__ == "__main__":
    main()
