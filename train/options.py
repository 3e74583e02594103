"""The model's and the data's options, checked before anything is built: a value out of its range is one line that
names the option (vit-train prints it without a traceback), not a run that trains to NaN or fails deep in torch."""

from __future__ import annotations

import datetime
import inspect
import logging
import math
import os
from pathlib import Path
from typing import Any

from train.balance import LOSS_METHODS, METHODS
from train.errors import SetupError
from vit.model import VARIANTS, VisionTransformer
from vit.patch_embed import too_many_patches

log = logging.getLogger(__name__)
# what `--checkpoint.monitor` (and early stopping) can watch: the metrics `ViTClassifier` logs
MONITORED = ("val/balanced_acc", "val/acc", "val/acc5", "val/macro_f1", "val/loss", "train/loss")
# net_args keys the run sets itself: another value given there is not applied
SET_ELSEWHERE = {"img_size": "--data.img_size", "num_classes": "the number of class folders"}
WEIGHTS_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin")  # timm weights files (`vit.timm_compat`)
MAX_WORKERS = 64  # DataLoader workers a machine with few cores may still ask for (data on slow storage)

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
    "layer_decay": (0.0, 1.0, True),  # each block's share of the next one's rate (0: off)
}
# the network's options (--model.net_args): (lowest, highest, whether the highest itself is allowed)
NET_RANGES = {
    **{k: (0.0, 1.0, False) for k in ("drop_rate", "pos_drop_rate", "proj_drop_rate", "attn_drop_rate")},
    "drop_path_rate": (0.0, 1.0, False),  # 1 drops every block: the network would be its stem and head
    **{k: (1, math.inf, False) for k in ("patch_size", "embed_dim", "depth", "num_heads")},
    "mlp_ratio": (math.ulp(0.0), math.inf, False),
}


def check_pretrained(pretrained: str) -> None:
    """Refuse a `--model.pretrained` that names our own files (a checkpoint or an exported model: timm would ask
    for a `model_name` the command line has no option for) or a weights file that is not there."""
    path = Path(pretrained)  # as the loader reads it (no ~)
    if path.suffix in (".ckpt", ".onnx"):
        what = "a vit-train checkpoint" if path.suffix == ".ckpt" else "an exported model"
        raise ValueError(
            f"--model.pretrained {pretrained} is {what}; it takes timm weights ({', '.join(WEIGHTS_SUFFIXES)}) or a "
            "timm model name. To go on training a run give its checkpoint to --ckpt_path (the same classes), or "
            "to learn from it give it to --model.teacher"
        )
    if path.suffix in WEIGHTS_SUFFIXES and not path.is_file():
        raise ValueError(f"--model.pretrained {pretrained}: no such file")


def check_model_options(lr: float, min_lr: float, betas: tuple[float, float] = (0.9, 0.999), **ranged: float) -> None:
    """Refuse a learning rate that is not positive, a floor above it, betas outside [0, 1), and any of `RANGES`
    outside its range."""
    if not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"--model.lr must be a positive number, got {lr}")
    if not (math.isfinite(min_lr) and 0 <= min_lr <= lr):
        raise ValueError(f"--model.min_lr must be zero or a positive number up to --model.lr ({lr}), got {min_lr}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"--model.betas must be two numbers in [0, 1), as AdamW's (0.9, 0.999), got {list(betas)}")
    for name, value in ranged.items():
        _check_range(f"--model.{name}", value, RANGES[name])


def _check_range(option: str, value: float, bounds: tuple[float, float, bool]) -> None:
    low, high, high_ok = bounds
    if not (low <= value < high or (high_ok and value == high)):
        raise ValueError(f"{option} must be in [{low:g}, {high:g}{']' if high_ok else ')'}, got {value}")


def check_balance(balance: str | None, class_counts: list[int] | None, num_classes: int) -> None:
    """Refuse an unknown `--model.balance`, or a loss-based one without the class counts it weighs by."""
    if balance is not None and balance not in METHODS:
        raise ValueError(f"balance must be one of {', '.join(METHODS)} or None, got {balance!r}")
    if balance in LOSS_METHODS and (not class_counts or len(class_counts) != num_classes):
        raise ValueError(f"balance {balance!r} needs class_counts of {num_classes} classes, got {class_counts}")


def check_net_args(
    net_args: dict[str, Any] | None,
    img_size: int | None = None,
    num_classes: int | None = None,
    variant: str | None = None,
    pretrained: str | None = None,
) -> None:
    """Refuse a `--model.net_args` key the network does not take (a typo), naming the ones it takes, channels
    other than RGB's, and an `img_size` that `variant`'s patches (or net_args' `patch_size`) do not tile; say when
    an `img_size` or `num_classes` given there is not the run's (the run's is applied). A `pretrained` timm model
    name brings its own patch size, checked by the network itself."""
    known = set(inspect.signature(VisionTransformer).parameters)
    unknown = sorted(set(net_args or {}) - known)
    if unknown:
        takes = ", ".join(sorted(known))
        raise ValueError(f"--model.net_args: no option {', '.join(unknown)}; the network takes {takes}")
    for name, value in (net_args or {}).items():
        if name == "in_chans" and value != 3:
            raise ValueError(
                f"--model.net_args.in_chans {value}: every image is loaded as RGB (3), a grayscale one too"
            )
        run = {"img_size": img_size, "num_classes": num_classes}.get(name)
        if name in SET_ELSEWHERE and run is not None and value != run:
            log.warning(
                "--model.net_args.%s %s is not applied: the run's is %s (%s)", name, value, run, SET_ELSEWHERE[name]
            )
        if name in NET_RANGES:
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"--model.net_args.{name} must be a number, got {value!r}")
            _check_range(f"--model.net_args.{name}", value, NET_RANGES[name])
    if img_size is not None and (pretrained is None or Path(pretrained).suffix in WEIGHTS_SUFFIXES):
        check_img_size(img_size, (net_args or {}).get("patch_size"), variant)


def check_img_size(img_size: int, patch_size: int | None, variant: str | None) -> None:
    """Refuse an `img_size` the patches do not tile (the network said so in its own words, naming no option), or of
    more patches than a model runs (`--data.img_size 100000` was a traceback from allocating 40 GB)."""
    patch = patch_size or VARIANTS.get(variant or "", {}).get("patch_size")
    if patch and (why := too_many_patches((img_size, img_size), patch)):
        raise ValueError(f"--data.img_size {img_size}: {why}; give a smaller size")
    if not patch or img_size % patch == 0:
        return
    where = "--model.net_args.patch_size" if patch_size else variant
    fits = [n for n in (img_size // patch * patch, (img_size // patch + 1) * patch) if n > 0]
    raise ValueError(
        f"--data.img_size {img_size} is not a multiple of the patch size {patch} ({where}): use "
        f"{' or '.join(map(str, fits))}"
    )


def check_data_settings(config: Any) -> None:
    """Refuse data settings that would fail deep inside training (an empty batch, negative workers)."""
    for key in ("data.batch_size", "data.eval_batch_size"):
        value = config.get(key)
        if value is not None and value < 1:
            raise SetupError(f"--{key} must be at least 1, got {value}")
    workers, cores = config.get("data.num_workers"), len(os.sched_getaffinity(0))
    if workers is not None and workers < 0:
        raise SetupError(f"--data.num_workers must be 0 or more, got {workers}")
    if workers is not None and workers > max(MAX_WORKERS, 8 * cores):  # each a process with its own memory
        raise SetupError(f"--data.num_workers {workers} is far more than this machine's {cores} cores can use")


def check_monitor(monitor: str | None, mode: str | None = "max") -> None:
    """Refuse a `--checkpoint.monitor` the run never logs (Lightning finds out after the first epoch, saving
    nothing), and one whose `--checkpoint.mode` keeps its worst epoch (a loss with "max", the default)."""
    if monitor is None:
        return
    if monitor not in MONITORED:
        raise SetupError(f"--checkpoint.monitor {monitor!r} is no metric the run logs: give one of {MONITORED}")
    better = "min" if monitor.endswith("loss") else "max"
    if mode != better:
        raise SetupError(
            f"--checkpoint.monitor {monitor} is better when {'lower' if better == 'min' else 'higher'}, and "
            f"--checkpoint.mode {mode} would keep its worst epoch as best.ckpt: add --checkpoint.mode {better}"
        )


def check_trainer_settings(trainer: Any, fit: bool) -> None:
    """Refuse `--trainer.*` counts that Lightning divides by, which fail deep inside a run otherwise, and a `fit` that
    would take no training step."""
    for key in ("accumulate_grad_batches", "check_val_every_n_epoch"):
        value = trainer.get(key)
        if value is not None and value < 1:
            raise SetupError(f"--trainer.{key} must be at least 1, got {value}")
    clip = trainer.get("gradient_clip_val")
    if isinstance(clip, (int, float)) and not (math.isfinite(clip) and clip >= 0):  # NaN: "use only one of them"
        raise SetupError(f"--trainer.gradient_clip_val must be a finite number, 0 or more (0: no clipping), got {clip}")
    if fit and trainer.get("limit_train_batches") == 0:
        raise SetupError("--trainer.limit_train_batches 0 trains nothing: give a share in (0, 1] or a count")
    epochs, steps = trainer.get("max_epochs"), trainer.get("max_steps")
    if fit and epochs == 0:  # Lightning stops at the first limit reached, whatever max_steps says
        raise SetupError("--trainer.max_epochs 0 trains nothing: give 1 or more (or -1 with --trainer.max_steps)")
    if fit and steps == 0:
        raise SetupError("--trainer.max_steps 0 trains nothing: give 1 or more (-1: no limit by steps)")
    if fit and _seconds(trainer.get("max_time")) == 0:
        raise SetupError("--trainer.max_time of no time trains nothing: give DD:HH:MM:SS of at least a second")
    if fit and epochs == -1 and (steps is None or steps < 0):
        raise SetupError(
            "--trainer.max_epochs -1 trains without end, and the learning-rate schedule needs a length: give a "
            "number of epochs (with --trainer.max_time to stop sooner on the clock) or --trainer.max_steps"
        )
    if fit and str(trainer.get("precision")) == "16-true":
        raise SetupError(
            "--trainer.precision 16-true keeps the weights and AdamW's state in float16, where its updates underflow "
            "and the loss turns NaN at any learning rate: use 16-mixed or bf16-mixed (bf16-true also trains)"
        )


def _seconds(max_time: Any) -> float | None:
    """Lightning's `max_time` ("DD:HH:MM:SS", {"days": .., "hours": ..} or a timedelta) in seconds; None when unset
    or not read here (Lightning says what is wrong with it)."""
    try:
        if isinstance(max_time, str):
            days, hours, minutes, seconds = (float(part) for part in max_time.split(":"))
            return ((days * 24 + hours) * 60 + minutes) * 60 + seconds
        if isinstance(max_time, dict):
            return datetime.timedelta(**max_time).total_seconds()
        if isinstance(max_time, datetime.timedelta):
            return max_time.total_seconds()
    except (TypeError, ValueError):
        return None
    return None


def warn_on_doubtful_settings(config: Any) -> None:
    """Say which settings run but would not train as the user likely meant (each check below)."""
    warn_on_mirrors_never_trained(config)
    warn_on_warmup_past_the_run(config)


def warn_on_mirrors_never_trained(config: Any) -> None:
    """Say when the model will answer each image with its mirror (`flip_tta`) but trains on no mirror images."""
    augment = config.get("data.augment")
    hflip = getattr(augment, "hflip", None) if not isinstance(augment, dict) else augment.get("hflip")
    if (config.get("model.net_args") or {}).get("flip_tta") and hflip == 0:
        log.warning(
            "--model.net_args.flip_tta is on but --data.augment.hflip is 0: the model will answer each image with "
            "its mirror image, unlike anything it trained on; for digits or text set flip_tta false"
        )


def warn_on_warmup_past_the_run(config: Any) -> None:
    """Say when the warm-up is as long as the run: the learning rate would rise until the last step, never anneal."""
    warmup, epochs = config.get("model.warmup_epochs"), config.get("trainer.max_epochs")
    if warmup and epochs and epochs > 0 and warmup >= epochs and not config.get("trainer.fast_dev_run"):
        log.warning(
            "--model.warmup_epochs %g is as long as the run's %d epochs: the learning rate would rise until the last "
            "step and never anneal; give a warm-up shorter than --trainer.max_epochs",
            warmup,
            epochs,
        )
