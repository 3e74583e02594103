"""Rules that keep a run directory safe: which checkpoint a command may load, and the one-line errors.

    SetupError      a run that cannot start as asked (exit 2): a bad setting, a missing or damaged
                    checkpoint, another run's checkpoint in the way
    TrainingError   a run that stopped because going on would be wrong (exit 1): a non-finite loss,
                    a checkpoint that could not be written

`--ckpt_path` rules (`resolve_ckpt_path`, `check_ckpt_owner`):
    last / best      this run's `checkpoints/last.ckpt` / `best.ckpt`; refused when missing, with the
                     files that are there
    a local file     refused when missing or damaged (its zip directory cannot be read), naming the
                     run's checkpoints that can be used instead
    a URL (http...)  loaded into memory with `weights_only=True`, like every other checkpoint
`fit --ckpt_path` into a run directory that holds checkpoints must resume that run's own checkpoint,
unless --overwrite true.
"""

from __future__ import annotations

import os
import random
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from train.checkpoint_format import META_KEY

CKPT_DIR = "checkpoints"
RNG_KEY = "rng_states"


class SetupError(Exception):
    """A run that cannot start as asked: a missing folder, a bad setting, an existing run in the way."""


class TrainingError(Exception):
    """A run that had to stop: continuing (or saving) would have produced a wrong model."""


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none), at most 200 characters."""
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def is_remote(path: str | os.PathLike) -> bool:
    """A URL (http://, s3://, ...) rather than a local file path."""
    return "://" in str(path) and not str(path).startswith("file://")


def is_intact(path: Path) -> bool:
    """Whether `path` is a whole `torch.save` file: its zip directory (written last) can be read."""
    try:
        with zipfile.ZipFile(path) as z:
            return bool(z.namelist())
    except (OSError, zipfile.BadZipFile, ValueError):
        return False


def usable_checkpoints(ckpt_dir: Path, exclude: Path | None = None) -> list[Path]:
    """The intact `*.ckpt` files of `ckpt_dir` (sorted), leaving out `exclude`."""
    if not ckpt_dir.is_dir():
        return []
    skip = exclude.resolve() if exclude is not None else None
    return [p for p in sorted(ckpt_dir.glob("*.ckpt")) if p.resolve() != skip and is_intact(p)]


def _alternatives(ckpt_dir: Path, exclude: Path | None = None) -> str:
    usable = usable_checkpoints(ckpt_dir, exclude)
    if not usable:
        return f"{ckpt_dir} holds no usable checkpoint: start without --ckpt_path"
    return "usable checkpoints: " + ", ".join(str(p) for p in usable) + " (pass one to --ckpt_path)"


def resolve_ckpt_path(ckpt_path: str | None, run_dir: Path) -> str | None:
    """Turn `--ckpt_path` into a checked absolute path (or the URL as given).

    Raises:
        SetupError: "last"/"best" with no such file in the run, or a local file missing or damaged;
            the message lists the run's checkpoints that can be used.
    """
    if not ckpt_path or is_remote(ckpt_path):
        return ckpt_path
    ckpt_dir = run_dir / CKPT_DIR
    if ckpt_path in ("last", "best"):
        path = ckpt_dir / f"{ckpt_path}.ckpt"
        if not path.is_file():
            raise SetupError(f"--ckpt_path {ckpt_path}: there is no {path}; {_alternatives(ckpt_dir)}")
    else:
        path = Path(ckpt_path).expanduser()
        if not path.is_file():
            raise SetupError(f"checkpoint not found: {path}; {_alternatives(ckpt_dir)}")
    if not is_intact(path):
        raise SetupError(f"{path} is damaged or truncated (not a whole checkpoint); {_alternatives(ckpt_dir, path)}")
    return str(path.resolve())


def check_ckpt_owner(ckpt_path: str | None, run_dir: Path, overwrite: bool) -> None:
    """Refuse to fit another run's checkpoint into a run directory that already holds checkpoints."""
    ckpt_dir = run_dir / CKPT_DIR
    existing = sorted(p.name for p in ckpt_dir.glob("*.ckpt"))
    if not existing or overwrite:
        return
    where = f"{run_dir} already holds a run ({', '.join(existing)} in {ckpt_dir})"
    if not ckpt_path:
        raise SetupError(
            f"{where}; a new fit would replace them. Resume it with --ckpt_path last, start a new run with "
            "--trainer.default_root_dir runs/<new name>, or replace it with --overwrite true"
        )
    own = not is_remote(ckpt_path) and Path(ckpt_path).resolve().parent == ckpt_dir.resolve()
    if not own:
        raise SetupError(
            f"{where}, and --ckpt_path {ckpt_path} is not one of its checkpoints: fitting from it would replace "
            "them. Give a new --trainer.default_root_dir, or replace this run with --overwrite true"
        )


def check_writable(run_dir: Path) -> None:
    """Create `run_dir` and a file in it now, so a read-only place fails in one line before any work."""
    probe = run_dir / f".write-test-{os.getpid()}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise SetupError(
            f"cannot write into the run directory {run_dir} ({first_line(e)}); "
            "choose a writable --trainer.default_root_dir"
        ) from None


def check_data_settings(config: Any) -> None:
    """Refuse data settings that would fail deep inside training (an empty batch, negative workers)."""
    for key in ("data.batch_size", "data.eval_batch_size"):
        value = config.get(key)
        if value is not None and value < 1:
            raise SetupError(f"--{key} must be at least 1, got {value}")
    workers = config.get("data.num_workers")
    if workers is not None and workers < 0:
        raise SetupError(f"--data.num_workers must be 0 or more, got {workers}")


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


def check_class_names(meta: dict[str, Any] | None, data_classes: list[str] | None) -> list[str]:
    """The class names a checkpoint's "vitscope" entry holds, refused when they differ from the folder's.

    Raises:
        SetupError: not a vitscope checkpoint, or other classes (its outputs would be labelled wrongly).
    """
    if meta is None or "class_names" not in meta:
        raise SetupError(f"not a vitscope checkpoint (no '{META_KEY}' entry with class names): train it with vit-train")
    saved = list(meta["class_names"])
    if data_classes is not None and saved != list(data_classes):
        raise SetupError(
            f"the checkpoint was trained on {len(saved)} classes {saved}, but the image folder has "
            f"{len(data_classes)} classes {list(data_classes)}; its outputs would be labelled wrongly. Use the "
            "folder it was trained on (the same class folders), or train a new run without --ckpt_path"
        )
    return saved


def rng_states() -> dict[str, Any]:
    """The random states that decide shuffling, augmentation and dropout, as weights-only-loadable data.

    These are the main process's. DataLoader workers need none saved: they seed each batch from the run's
    seed and the batch's indices (`train.dataset.ImageListDataset.__getitems__`), and the indices come
    from the main process's stream.
    """
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (str(kind), torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what `rng_states` saved, so a resumed run draws the numbers the uninterrupted run drew."""
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available() and len(states["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(states["cuda"])
