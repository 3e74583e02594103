"""Stop a run whose loss or weights are no longer finite, before it saves a broken model.

`ViTClassifier` checks the loss of every training step before its backward pass (so the weights stay
finite), and every weight before a checkpoint is written. Either raises `TrainingError`, which vit-train
reports as one line saying what to change.
"""

from __future__ import annotations

from typing import Any

import torch

from train.errors import TrainingError


def _lr_hint(lr: float) -> str:
    return (
        f"lower --model.lr (now {lr}) in a new run (a resumed run keeps its checkpoint's learning rate), or check "
        "the images; checkpoints/last.ckpt, if there is one, holds the last finished epoch"
    )


def check_finite_loss(loss: torch.Tensor, trainer: Any, lr: float) -> None:
    """Stop on a NaN or infinite training loss; under DDP every rank stops together (no rank left waiting).

    Raises:
        TrainingError: the loss is not finite on some rank.
    """
    finite = bool(torch.isfinite(loss))
    if trainer.strategy.reduce_boolean_decision(finite, all=True):
        return
    value = loss.item() if not finite else "not finite on another process"
    raise TrainingError(
        f"the training loss is {value} at epoch {trainer.current_epoch}, step {trainer.global_step}; training "
        f"stopped and nothing was saved from it: {_lr_hint(lr)}"
    )


def check_finite_weights(module: torch.nn.Module, lr: float) -> None:
    """Refuse to save a model with a NaN or infinite weight.

    Raises:
        TrainingError: naming the first such weight.
    """
    bad = [name for name, p in module.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        raise TrainingError(
            f"{len(bad)} weight tensor(s) are NaN or infinite (first: {bad[0]}); the checkpoint was not written: "
            f"{_lr_hint(lr)}"
        )
