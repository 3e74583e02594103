"""The automatic recipe: `vit-train fit --data.root DIR` without `--config` picks settings from the data and machine.

It looks at the folder (classes, images per class, the sizes of a sample of image headers) and the machine
(GPU or not, usable cores), writes what it chose as a config file, `<run_dir>/auto_recipe.yaml`, and puts
that file first on the command line, so every flag the user gave still overrides it. Each choice and its
reason is printed and kept under `recipe:` in the run's `config.yaml`.
"""

from __future__ import annotations

import inspect
import logging
import random
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from serve.runtime.images import ImageError, open_image
from train.datamodule import ImageFolderDataModule
from train.dataset import usable_cores
from train.folder_scan import class_dirs, find_image_files
from train.run_dir import check_run_dir, held_run
from train.splits import calibration_split, stratified_split
from train.splits import log as split_log

log = logging.getLogger(__name__)

SMALL_SIDE = 64  # pixels: up to here the small-image recipe works at the images' own size
CPU_SIDE = 64  # larger images are trained at this side on CPU (a 224-px ViT from scratch takes days there)
TARGET_STEPS = 6_000  # optimizer steps the schedule aims for, whatever the dataset size
FEWEST_EPOCHS, MOST_EPOCHS = 10, 100
CPU_MINUTES = 25.0  # time budget on CPU: the run anneals and stops by then (train.budget)
PATIENCE_SHARE = 4  # early stopping waits a quarter of the epochs (at least MIN_PATIENCE) for balanced accuracy
MIN_PATIENCE = 5
# torch.compile on CPU: its faster steps pay back the first compile after some 3,000 of the small model's steps
# (BENCHMARKS.md, "bf16 and `torch.compile` on the CPU": the first compile's time, the step's time and speed-up)
COMPILE_MIN_STEPS = 3_000


@dataclass
class Survey:
    """What the recipe knows about the data and the machine."""

    classes: int
    train_images: int  # what the data module's split trains on: the images less validation and calibration
    median_side: int  # median of min(width, height) over sampled headers
    gpu: bool
    cores: int
    images: int = 0  # every image file found
    val_images: int = 0
    calib_images: int = 0


def survey(root: str | Path, sample: int = 256, seed: int = 0, split: tuple[float, float, int] | None = None) -> Survey:
    """Count classes and images and read up to `sample` image headers (no pixels) from `root`.

    Args:
        root: the image folder (root/<class>/<image>, or root/train and root/val).
        sample: how many image headers to read for the median side.
        seed: seed of that sample.
        split: the data module's (val_fraction, calib_fraction, seed), its defaults if None: the images are
            counted as its split counts them, before its check of headers and duplicates.
    """
    root = Path(root).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"image folder not found: {root} (expected root/<class>/<image> files)")
    own_val = (root / "train").is_dir() and (root / "val").is_dir()
    base = root / "train" if own_val else root
    by_class = {d.name: find_image_files(d) for d in class_dirs(base)}
    files = [f for paths in by_class.values() for f in paths]
    sides = []
    for path in random.Random(seed).sample(files, min(sample, len(files))):
        try:
            img = open_image(path)
            sides.append(min(img.size))
            img.close()
        except (ImageError, OSError):
            continue
    val_files = [f for d in class_dirs(root / "val") for f in find_image_files(d)] if own_val else None
    train, val, calib = _split_counts(by_class, val_files, *(split or _split_flags([])))
    return Survey(
        classes=len(by_class),
        train_images=train,
        median_side=int(statistics.median(sides)) if sides else 224,
        gpu=torch.cuda.is_available(),
        cores=usable_cores(),
        images=len(files) + len(val_files or []),
        val_images=val,
        calib_images=calib,
    )


def _split_counts(
    by_class: dict[str, list[Path]], val_files: list[Path] | None, val_fraction: float, calib_fraction: float, seed: int
) -> tuple[int, int, int]:
    """(train, val, calibration) image counts of the data module's split (`train.splits`); `val_files` are
    those of the user's own val/ folder, if any."""
    classes = sorted(by_class)
    level = split_log.level
    split_log.setLevel(logging.ERROR)  # a warning about few calibration images comes from the scan itself, later
    try:
        if val_files is not None:
            train, val = [(str(p), y) for y, c in enumerate(classes) for p in by_class[c]], val_files
        else:
            train, val = stratified_split(by_class, val_fraction, seed)
        kept, calib = calibration_split(train, classes, calib_fraction, seed)
    except ValueError:  # a fraction out of range, or a class too small to give an image: the scan says which
        return sum(map(len, by_class.values())), len(val_files or []), 0
    finally:
        split_log.setLevel(level)
    return len(kept), len(val), len(calib)


def choose(s: Survey) -> tuple[dict[str, Any], dict[str, str]]:
    """The recipe for survey `s`: (config in `vit-train`'s YAML layout, {setting: "value (why)"}).

    Small images (median side <= 64 px), or any images on CPU: a 64-wide, 4-block ViT with a conv stem
    at the images' side (at most 64 px), batches of 16 to 64, batch augmentation, cached uint8 images. Larger
    images on a GPU: ViT-Ti/16 at 224 px in bf16.
    """
    why: dict[str, str] = {}
    small = s.median_side <= SMALL_SIDE or not s.gpu
    side = min(s.median_side, SMALL_SIDE if s.median_side <= SMALL_SIDE else CPU_SIDE) if small else 224
    patch = 4 if side <= 48 else 8 if small else 16
    side = max(2 * patch, side // patch * patch)
    cap = " at most 64 px on CPU;" if small and s.median_side > SMALL_SIDE else ""
    _say(why, "data.img_size", side, f"median image side {s.median_side} px;{cap} {patch}-px patches")
    batch, epochs, steps_per_epoch = _schedule(s.train_images, small, why)
    lr = round(2.0e-3 * min(1.0, batch / 64) if small else 1.0e-3 * batch / 128, 6)
    patience = max(MIN_PATIENCE, epochs // PATIENCE_SHARE)
    _say(
        why, "early_stopping.patience", patience,
        f"stop when balanced accuracy, which picks best.ckpt, has not improved for {patience} epochs: "
        f"a quarter of the {epochs}, at least {MIN_PATIENCE}",
    )  # fmt: skip
    base, base_batch = ("2e-3", 64) if small else ("1e-3", 128)
    scaled = f", scaled linearly to batch {batch}" if batch != base_batch else ""
    _say(why, "model.lr", f"{lr:g}", f"{base} at batch {base_batch}{scaled}")
    variant, net = _network(small, patch, why)
    trainer = _trainer(s, epochs, why)
    augment = {"crop_scale": [0.8, 1.0] if small else [0.25, 1.0], "crop_ratio": [0.9, 1.1], "hflip": 0.5}
    augment |= {"fill": 0, "rand_augment": None, "re_prob": 0.0 if small else 0.25}
    erase = "" if small else ", random erasing of a quarter of the images"
    crops = f"random crops of {augment['crop_scale'][0]:.0%} to 100% of the image area"
    _say(
        why, "data.augment", f"{crops}, horizontal flips half the time{erase}",
        "batch augmentation on uint8 tensors; --data.augment.hflip 0 for text and digits",
    )  # fmt: skip
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
        _say(
            why, "model.compile", "true",
            f"CPU, {steps:,} steps: torch.compile's faster steps pay back its first compile after some "
            f"{COMPILE_MIN_STEPS:,} steps",
        )  # fmt: skip
    config["data"] = {k: v for k, v in config["data"].items() if v is not None}
    return config, why


def _say(why: dict[str, str], key: str, value: Any, reason: str) -> None:
    """Record the choice for `key` as it is printed: `value (reason)`."""
    why[key] = f"{value} ({reason})"


def _schedule(train_images: int, small: bool, why: dict[str, str]) -> tuple[int, int, int]:
    """(batch size, epochs, steps an epoch): the largest power-of-two batch that gives at least 20 batches an
    epoch (16 at least, at most 64 for small images or CPU, 128 else), and epochs for about TARGET_STEPS steps
    (10 to 100)."""
    most = 64 if small else 128
    fits = 2 ** int(train_images // 20).bit_length() // 2  # the largest power of two <= train_images / 20
    batch = int(min(most, max(16, fits)))
    steps_per_epoch = max(1, train_images // batch)
    made = f"{train_images} training images make {steps_per_epoch} batches an epoch"
    if fits < 16:
        reason = f"the smallest batch the recipe uses, though it aims for 20 batches an epoch: {made}"
    elif fits > most:
        more = "; on CPU, more steps in the same time learn more than larger batches" if small else ""
        reason = f"the largest batch the recipe uses{' for small images or CPU' if small else ''}: {made}{more}"
    else:
        reason = f"the largest power of two that gives at least 20 batches an epoch: {made}"
    _say(why, "data.batch_size", batch, reason)
    wanted = round(TARGET_STEPS / steps_per_epoch)
    epochs = int(min(MOST_EPOCHS, max(FEWEST_EPOCHS, wanted)))
    take = f"{TARGET_STEPS:,} steps would take {wanted} epochs at {steps_per_epoch} steps an epoch"
    if wanted > epochs:
        reason = f"the recipe runs {MOST_EPOCHS} epochs at most, though {take}"
    elif wanted < epochs:
        reason = f"the recipe runs {FEWEST_EPOCHS} epochs at least, though {take}"
    else:
        reason = f"{steps_per_epoch} steps an epoch: about {TARGET_STEPS:,} steps in all"
    _say(why, "trainer.max_epochs", epochs, reason)
    return batch, epochs, steps_per_epoch


def _network(small: bool, patch: int, why: dict[str, str]) -> tuple[str, dict[str, Any]]:
    """The timm variant and its `net_args`: a small conv-stem ViT for small images or CPU, else ViT-Ti/16."""
    if not small:
        _say(why, "model.variant", "vit_tiny_patch16_224", "large images on a GPU: ViT-Ti/16 at 224 px")
        return "vit_tiny_patch16_224", {"drop_path_rate": 0.1}
    net: dict[str, Any] = {"stem": "conv", "pos_embed": "sincos", "global_pool": "avg"}
    net |= {"class_token": False, "patch_size": patch}
    if patch == 4:  # a full-resolution conv first: a 4-px patch holds few pixels (benchmarks.small_images_ablation)
        net["stem_widths"] = [16, 32, 64]
    _say(
        why, "model.variant", f"vit_micro_patch4_32 with a conv stem and {patch}-px patches",
        "small images, or any on CPU: a 64-wide, 4-block ViT learns fast from few pixels",
    )  # fmt: skip
    return "vit_micro_patch4_32", net


def _trainer(s: Survey, epochs: int, why: dict[str, str]) -> dict[str, Any]:
    """The `trainer:` section: bf16 on a GPU; on CPU, full precision under a wall-clock budget."""
    trainer: dict[str, Any] = {"max_epochs": epochs, "gradient_clip_val": 1.0, "log_every_n_steps": 50}
    if s.gpu:
        _say(why, "trainer.precision", "bf16-mixed", "a CUDA GPU")
        return trainer | {"accelerator": "gpu", "devices": 1, "precision": "bf16-mixed"}
    _say(
        why, "trainer.callbacks", f"TimeBudget of {CPU_MINUTES:.0f} minutes",
        f"CPU, {s.cores} cores: the run anneals and stops within that time",
    )  # fmt: skip
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
    path = Path(run_dir) / "auto_recipe.yaml"
    extra = [] if _flag(args, "--trainer.default_root_dir") else ["--trainer.default_root_dir", run_dir]
    if path.is_file() and held_run(Path(run_dir)) and (_flag(args, "--overwrite") or "").lower() != "true":
        # a resume goes on as the run started (batch size, learning rate), not with a recipe for today's folder;
        # a fit the run directory will refuse leaves the recipe as it was
        log.info("No --config: %s holds a run, which goes on with its recipe, %s", run_dir, path)
        return ["fit", "--config", str(path), *extra, *args[1:]]
    check_run_dir(Path(run_dir), root, create=False)  # refused before the recipe is written into it
    s = survey(root, split=_split_flags(args))
    config, why = choose(s)
    config["recipe"] = why
    path.parent.mkdir(parents=True, exist_ok=True)
    header = "# chosen by vit-train from the data and the machine; see `recipe:` for why\n"
    path.write_text(header + yaml.safe_dump(config, sort_keys=False))
    lines = [f"No --config: the automatic recipe for {root}, saved as {path}:"]
    lines.append(
        f"  {s.images} images in {s.classes} classes: {s.train_images} to train on, {s.val_images} for validation "
        f"and {s.calib_images} for calibration\n  (the data module's split: keeping copies in one split and skipping "
        "unreadable files can move a few)"
    )
    lines += [f"  {key}: {choice}" for key, choice in why.items()]
    log.info("\n".join(lines + ["  (any flag overrides these, e.g. --data.img_size 32)"]))
    return ["fit", "--config", str(path), *extra, *args[1:]]


def _split_flags(args: list[str]) -> tuple[float, float, int]:
    """(val_fraction, calib_fraction, seed) of the data module: its defaults, or the command line's flags."""
    defaults = inspect.signature(ImageFolderDataModule.__init__).parameters
    split = []
    for name, kind in (("val_fraction", float), ("calib_fraction", float), ("seed", int)):
        try:
            split.append(kind(_flag(args, f"--data.{name}") or defaults[name].default))
        except ValueError:  # the data module refuses it, with its own message
            split.append(defaults[name].default)
    return split[0], split[1], split[2]


def _flag(args: list[str], name: str) -> str | None:
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None
