"""The model's and the data's options, checked before anything is built: a value out of its range is one line that
names the option (vit-train prints it without a traceback), not a run that trains to NaN or fails deep in torch."""

from __future__ import annotations

import inspect
import logging
import math
from typing import Any

from train.balance import LOSS_METHODS, METHODS
from train.errors import SetupError
from vit.model import VisionTransformer

log = logging.getLogger(__name__)

# option: (lowest, highest, whether the highest itself is allowed); every lowest is allowed
RANGES = {
    "ema_decay": (0.0, 1.0, False),  # 1 never moves the average, above 1 it diverges (0: no EMA)
    "label_smoothing": (0.0, 1.0, False),
    "mix_prob": (0.0, 1.0, True),
    "distill_weight": (0.0, 1.0, True),
    "weight_decay": (0.0, math.inf, False),
    "mixup_alpha": (0.0, math.inf, False),
    "cutmix_alpha": (0.0, math.inf, False),
    "warmup_epochs": (0.0, math.inf, False),
}


def check_model_options(lr: float, min_lr: float, **ranged: float) -> None:
    """Refuse a learning rate that is not positive, and any of `RANGES` outside its range."""
    if not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a positive number, got {lr}")
    if not (math.isfinite(min_lr) and 0 <= min_lr):
        raise ValueError(f"min_lr must be zero or a positive number, got {min_lr}")
    for name, value in ranged.items():
        low, high, high_ok = RANGES[name]
        if not (low <= value < high or (high_ok and value == high)):
            raise ValueError(f"--model.{name} must be in [{low:g}, {high:g}{']' if high_ok else ')'}, got {value}")


def check_balance(balance: str | None, class_counts: list[int] | None, num_classes: int) -> None:
    """Refuse an unknown `--model.balance`, or a loss-based one without the class counts it weighs by."""
    if balance is not None and balance not in METHODS:
        raise ValueError(f"balance must be one of {', '.join(METHODS)} or None, got {balance!r}")
    if balance in LOSS_METHODS and (not class_counts or len(class_counts) != num_classes):
        raise ValueError(f"balance {balance!r} needs class_counts of {num_classes} classes, got {class_counts}")


def check_net_args(net_args: dict[str, Any] | None) -> None:
    """Refuse a `--model.net_args` key the network does not take (a typo), naming the ones it takes."""
    known = set(inspect.signature(VisionTransformer).parameters)
    unknown = sorted(set(net_args or {}) - known)
    if unknown:
        takes = ", ".join(sorted(known))
        raise ValueError(f"--model.net_args: no option {', '.join(unknown)}; the network takes {takes}")


def check_data_settings(config: Any) -> None:
    """Refuse data settings that would fail deep inside training (an empty batch, negative workers)."""
    for key in ("data.batch_size", "data.eval_batch_size"):
        value = config.get(key)
        if value is not None and value < 1:
            raise SetupError(f"--{key} must be at least 1, got {value}")
    workers = config.get("data.num_workers")
    if workers is not None and workers < 0:
        raise SetupError(f"--data.num_workers must be 0 or more, got {workers}")


def warn_on_mirrors_never_trained(config: Any) -> None:
    """Say when the model will answer each image with its mirror (`flip_tta`) but trains on no mirror images."""
    augment = config.get("data.augment")
    hflip = getattr(augment, "hflip", None) if not isinstance(augment, dict) else augment.get("hflip")
    if (config.get("model.net_args") or {}).get("flip_tta") and hflip == 0:
        log.warning(
            "--model.net_args.flip_tta is on but --data.augment.hflip is 0: the model will answer each image with "
            "its mirror image, unlike anything it trained on; for digits or text set flip_tta false"
        )
