"""The automatic recipe: `vit-train fit --data.root DIR` without `--config` picks settings from the data and machine.

It looks at the folder (classes, images per class, the sizes of a sample of image headers) and the machine
(GPU or not, usable cores), writes what it chose as a config file, `<run_dir>/auto_recipe.yaml`, and puts
that file first on the command line, so every flag the user gave still overrides it. Each choice and its
reason is printed and kept under `recipe:` in the run's `config.yaml`.
"""

from __future__ import annotations

import logging
import random
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from serve.runtime.images import ImageError, open_image
from train.dataset import usable_cores
from train.folder_scan import class_dirs, find_image_files

log = logging.getLogger(__name__)

SMALL_SIDE = 64  # pixels: up to here the small-image recipe works at the images' own size
CPU_SIDE = 64  # larger images are trained at this side on CPU (a 224-px ViT from scratch takes days there)
TARGET_STEPS = 6_000  # optimizer steps the schedule aims for, whatever the dataset size
CPU_MINUTES = 25.0  # time budget on CPU: the run anneals and stops by then (train.budget)
PATIENCE_SHARE = 4  # early stopping waits a quarter of the epochs (at least MIN_PATIENCE) for balanced accuracy
MIN_PATIENCE = 5
# torch.compile on CPU: a first compile of about 30 s, then steps about 10 % faster (benchmarks.train_precision), so
# it pays back after some 300 s of steps, about 3,000 of the small model's (0.1 s a step on one core)
COMPILE_MIN_STEPS = 3_000


@dataclass
class Survey:
    """What the recipe knows about the data and the machine."""

    classes: int
    train_images: int
    median_side: int  # median of min(width, height) over sampled headers
    gpu: bool
    cores: int


def survey(root: str | Path, sample: int = 256, seed: int = 0) -> Survey:
    """Count classes and images and read up to `sample` image headers (no pixels) from `root`."""
    root = Path(root).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"image folder not found: {root} (expected root/<class>/<image> files)")
    split = (root / "train").is_dir() and (root / "val").is_dir()
    base = root / "train" if split else root
    files = [f for d in class_dirs(base) for f in find_image_files(d)]
    sides = []
    for path in random.Random(seed).sample(files, min(sample, len(files))):
        try:
            img = open_image(path)
            sides.append(min(img.size))
            img.close()
        except (ImageError, OSError):
            continue
    train_images = len(files) if split else int(0.8 * len(files))
    return Survey(
        classes=len(class_dirs(base)),
        train_images=train_images,
        median_side=int(statistics.median(sides)) if sides else 224,
        gpu=torch.cuda.is_available(),
        cores=usable_cores(),
    )


def choose(s: Survey) -> tuple[dict[str, Any], dict[str, str]]:
    """The recipe for survey `s`: (config in `vit-train`'s YAML layout, {setting: why}).

    Small images (median side <= 64 px), or any images on CPU: a 64-wide, 4-block ViT with a conv stem
    at the images' side (at most 64 px), batches of 64, batch augmentation, cached uint8 images. Larger images on a GPU:
    ViT-Ti/16 at 224 px in bf16.
    """
    why: dict[str, str] = {}
    small = s.median_side <= SMALL_SIDE or not s.gpu
    side = min(s.median_side, SMALL_SIDE if s.median_side <= SMALL_SIDE else CPU_SIDE) if small else 224
    patch = 4 if side <= 48 else 8 if small else 16
    side = max(2 * patch, side // patch * patch)
    why["data.img_size"] = f"median image side {s.median_side} px -> {side}, {patch}-px patches" + (
        " (CPU: at most 64 px)" if small and s.median_side > SMALL_SIDE else ""
    )
    batch = int(min(64 if small else 128, max(16, 2 ** int(s.train_images // 20).bit_length() // 2)))
    why["data.batch_size"] = f"{s.train_images} training images: about 20 batches an epoch at least, at most " + (
        "64 (on CPU, more steps in the same time learn more than larger batches)" if small else "128"
    )
    steps_per_epoch = max(1, s.train_images // batch)
    epochs = int(min(100, max(10, round(TARGET_STEPS / steps_per_epoch))))
    why["trainer.max_epochs"] = f"about {TARGET_STEPS} steps at {steps_per_epoch} a step per epoch, 10-100 epochs"
    lr = round(2.0e-3 * min(1.0, batch / 64) if small else 1.0e-3 * batch / 128, 6)
    patience = max(MIN_PATIENCE, epochs // PATIENCE_SHARE)
    why["early_stopping.patience"] = (
        f"stop when balanced accuracy (what picks best.ckpt) has not improved for {patience} epochs, "
        f"a quarter of the {epochs} (at least {MIN_PATIENCE})"
    )
    why["model.lr"] = "2e-3 at batch 64, scaled down linearly for smaller batches" if small else "1e-3 at 128"
    variant, net = _network(small, patch, why)
    trainer = _trainer(s, epochs, why)
    augment = {"crop_scale": [0.8, 1.0] if small else [0.25, 1.0], "crop_ratio": [0.9, 1.1], "hflip": 0.5}
    augment |= {"fill": 0, "rand_augment": None, "re_prob": 0.0 if small else 0.25}
    why["data.augment"] = "batch augmentation on uint8 tensors: crops and flips (set hflip 0 for text and digits)"
    config = {
        "seed_everything": 0,
        "trainer": trainer,
        "early_stopping": {"patience": patience},
        "model": {
            "variant": variant, "net_args": net, "lr": lr, "min_lr": 1.0e-5, "weight_decay": 0.05,
            "warmup_epochs": 1.0 if small else 5.0, "label_smoothing": 0.1, "ema_decay": 0.99 if small else None,
        },
        "data": {
            "img_size": side, "crop_pct": 1.0 if small else 0.875, "mean": [0.5] * 3 if small else None,
            "std": [0.5] * 3 if small else None, "batch_size": batch, "batch_augment": True, "augment": augment,
        },
    }  # fmt: skip
    steps = epochs * steps_per_epoch
    if not s.gpu and steps >= COMPILE_MIN_STEPS:
        config["model"]["compile"] = True
        why["model.compile"] = (
            f"CPU, {steps} steps: torch.compile's steps are about 10 % faster, which pays back its "
            f"first compile of about 30 s after some {COMPILE_MIN_STEPS} steps"
        )
    config["data"] = {k: v for k, v in config["data"].items() if v is not None}
    return config, why


def _network(small: bool, patch: int, why: dict[str, str]) -> tuple[str, dict[str, Any]]:
    """The timm variant and its `net_args`: a small conv-stem ViT for small images or CPU, else ViT-Ti/16."""
    if not small:
        why["model.variant"] = "large images on a GPU: ViT-Ti/16 at 224 px"
        return "vit_tiny_patch16_224", {"drop_path_rate": 0.1}
    net: dict[str, Any] = {"stem": "conv", "pos_embed": "sincos", "global_pool": "avg"}
    net |= {"class_token": False, "patch_size": patch}
    if patch == 4:  # a full-resolution conv first: a 4-px patch holds few pixels (benchmarks.small_images_ablation)
        net["stem_widths"] = [16, 32, 64]
    why["model.variant"] = "small images: 64-wide, 4-block ViT with a conv stem (learns fast from few pixels)"
    return "vit_micro_patch4_32", net


def _trainer(s: Survey, epochs: int, why: dict[str, str]) -> dict[str, Any]:
    """The `trainer:` section: bf16 on a GPU; on CPU, full precision under a wall-clock budget."""
    trainer: dict[str, Any] = {"max_epochs": epochs, "gradient_clip_val": 1.0, "log_every_n_steps": 50}
    if s.gpu:
        why["trainer.precision"] = "a CUDA GPU: bf16 mixed precision"
        return trainer | {"accelerator": "gpu", "devices": 1, "precision": "bf16-mixed"}
    why["trainer.callbacks"] = f"CPU ({s.cores} cores): anneal and stop within {CPU_MINUTES:.0f} minutes"
    trainer |= {"accelerator": "cpu", "devices": 1, "precision": "32-true"}
    trainer["callbacks"] = [{"class_path": "train.budget.TimeBudget", "init_args": {"minutes": CPU_MINUTES}}]
    return trainer


def auto_recipe_args(args: list[str]) -> list[str]:
    """`args` with the automatic recipe's config file put first, for `fit --data.root DIR` without `--config`.

    Any other command line is returned unchanged. The user's own flags come after the recipe, so they win.
    """
    if not args or args[0] != "fit" or any(a == "--config" or a.startswith("--config=") for a in args):
        return args
    root, run_dir = _flag(args, "--data.root"), _flag(args, "--trainer.default_root_dir") or "runs/auto"
    if root is None or not Path(root).expanduser().is_dir() or any(a in ("-h", "--help") for a in args):
        return args  # a missing folder is reported by the data module, as with a config
    config, why = choose(survey(root))
    config["recipe"] = why
    path = Path(run_dir) / "auto_recipe.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    header = "# chosen by vit-train from the data and the machine; see `recipe:` for why\n"
    path.write_text(header + yaml.safe_dump(config, sort_keys=False))
    lines = [f"No --config: the automatic recipe for {root} ({path}):"]
    lines += [f"  {key}: {why_}" for key, why_ in why.items()]
    log.info("\n".join(lines + ["  (any flag overrides these, e.g. --data.img_size 32)"]))
    extra = [] if _flag(args, "--trainer.default_root_dir") else ["--trainer.default_root_dir", run_dir]
    return ["fit", "--config", str(path), *extra, *args[1:]]


def _flag(args: list[str], name: str) -> str | None:
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None
