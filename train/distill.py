"""Distillation from an earlier run (DeiT, Touvron et al. 2021): `--model.teacher`'s network, checked against this
run, and the hard distillation loss that trains the student's distillation head on the teacher's top class."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from serve.runtime.images import Preprocess
from train.checkpoint_format import load_network
from train.errors import SetupError, first_line
from vit.model import VisionTransformer


def student_net_args(net_args: dict[str, Any] | None, teacher: str | None, weight: float) -> dict[str, Any] | None:
    """`net_args` with a distillation token when there is a teacher; a token without one, or a weight outside
    [0, 1], is refused."""
    if not 0.0 < weight <= 1.0:  # at 0 the distillation head would learn nothing, and answer half of every call
        raise ValueError(f"distill_weight must be over 0 and at most 1, got {weight}")
    if teacher is None:
        if (net_args or {}).get("distilled"):
            raise ValueError(
                "net_args.distilled needs a teacher to learn from: give --model.teacher RUN/checkpoints/best.ckpt"
            )
        return net_args
    return {**(net_args or {}), "distilled": True}


def load_teacher(path: str, classes: list[str] | None, preprocess: dict[str, Any] | None) -> VisionTransformer:
    """The teacher network of `--model.teacher`, frozen in eval mode, refused when its classes or its input
    preprocessing differ from this run's (its top class would name another class, or read other pixels). A run
    directory stands for its best checkpoint."""
    if Path(path).is_dir():
        path = str(Path(path) / "checkpoints" / "best.ckpt")
    try:
        net, meta = load_network(path)
    except (OSError, ValueError) as e:  # load_checkpoint's one-line reasons: missing, damaged, not ours
        raise SetupError(f"--model.teacher: {first_line(e)}") from None
    if classes is not None and list(meta["class_names"]) != list(classes):
        raise SetupError(
            f"--model.teacher {path} was trained on the classes {list(meta['class_names'])}, this run's folder has "
            f"{list(classes)}: its top class would name the wrong class; give a teacher trained on this folder"
        )
    theirs = meta["preprocess"]
    if preprocess is not None:
        ours = Preprocess.from_dict(preprocess)
        if (theirs.img_size, theirs.mean, theirs.std) != (ours.img_size, ours.mean, ours.std):
            raise SetupError(
                f"--model.teacher {path} reads {theirs.img_size[0]} px images normalised with mean {theirs.mean} "
                f"and std {theirs.std}, this run {ours.img_size[0]} px with mean {ours.mean} and std {ours.std}: "
                "train the teacher with this run's --data.img_size, --data.mean and --data.std"
            )
    net.flip_tta = False  # it labels each augmented batch as it comes: its mirror images would double its cost
    return net.requires_grad_(False)


def distillation_loss(
    teacher: nn.Module,
    x: torch.Tensor,
    logits: tuple[torch.Tensor, torch.Tensor],
    y: torch.Tensor,
    class_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    weight: float,
) -> torch.Tensor:
    """DeiT's hard distillation: the class head learns the labels y by `class_loss`, the distillation head the
    teacher's top class on the same (augmented, mixed) images x (B, 3, H, W); `weight` is the second one's share."""
    head, head_dist = logits  # (B, K) each
    teacher.to(x.device)
    with torch.no_grad():
        taught = teacher(x).argmax(-1)  # (B,)
    return (1 - weight) * class_loss(head, y) + weight * nn.functional.cross_entropy(head_dist, taught)
