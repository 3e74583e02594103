"""How vit-train writes and reads checkpoint files: atomically, and never running pickled code.

Writing: Lightning's own save stages the file in $TMPDIR and moves it; when the run directory is on
another filesystem the move copies over the old file, so a kill or a full disk during a save leaves a
truncated `last.ckpt`. `AtomicCheckpointIO` writes a temporary file beside the target, flushes and
fsyncs it, renames it over the target (`os.replace`, atomic within a filesystem) and fsyncs the
directory: a reader sees the old file or the new one, never a mix. A failed save removes its
temporary file; one left by a kill is removed by `remove_partial_saves` when the next run starts.

Reading: every checkpoint, local or remote (http, s3, ...), is loaded with `weights_only=True`
(Lightning loads URLs with `weights_only=False`, which runs any code the file's pickle names).
"""

from __future__ import annotations

import errno
import io
import logging
import os
import pickle
import shutil
import urllib.request
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem

from serve.runtime.outputs import create_anew, sync_folder
from train.checkpoint_format import META_KEY
from train.errors import SetupError, TrainingError, first_line
from train.run_dir import is_remote, usable_checkpoints

log = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".partial"  # `.<name>.<pid>.partial`: never matches the run's `*.ckpt` globs
DISK_FULL = (
    "the disk is full: free some space (or move the run directory to a disk with room), "
    "then resume with --ckpt_path last"
)


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    """`torch.save(obj, path)` that leaves either the old file or the whole new one, whatever happens.

    Raises:
        TrainingError: the file could not be written (a full disk, a read-only folder); the old file is kept.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}{PARTIAL_SUFFIX}")
    try:
        with create_anew(tmp) as f:  # never through a link planted at the name
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        sync_folder(path.parent)
    except (OSError, RuntimeError) as e:  # torch's zip writer reports a failed write (ENOSPC, EFBIG) as RuntimeError
        out_of_space = isinstance(e, RuntimeError) or e.errno in (errno.ENOSPC, errno.EDQUOT)
        why = DISK_FULL if out_of_space and disk_full(path.parent) else first_line(e)  # before the partial goes
        tmp.unlink(missing_ok=True)
        kept = " (the previous one is kept)" if path.exists() else ""
        raise TrainingError(f"could not write the checkpoint {path}{kept}: {why}") from None


def disk_full(folder: Path) -> bool:
    """Whether the filesystem of `folder` has (next to) no space left: what a write that failed there ran into, where
    torch's zip writer says only "unexpected pos ..."."""
    try:
        return shutil.disk_usage(folder).free < 1 << 20
    except OSError:
        return False


def remove_partial_saves(ckpt_dir: Path) -> list[Path]:
    """Delete the temporary files of saves that were killed half-way; returns what was removed."""
    removed = []
    for p in ckpt_dir.glob(f".*{PARTIAL_SUFFIX}") if ckpt_dir.is_dir() else []:
        p.unlink(missing_ok=True)
        removed.append(p)
    if removed:
        log.info("removed %d unfinished checkpoint file(s) of an interrupted save in %s", len(removed), ckpt_dir)
    return removed


def _read_bytes(url: str) -> bytes:
    if url.startswith(("http://", "https://")):
        with urllib.request.urlopen(url, timeout=60) as r:  # noqa: S310 (the scheme is checked above)
            return r.read()
    fs = get_filesystem(url)  # s3://, gs://, ... through fsspec, when its package is installed
    with fs.open(url, "rb") as f:
        return f.read()


def load_weights_only(path: str | Path, map_location: Any = "cpu") -> dict[str, Any]:
    """Load a checkpoint (a local path or a URL) with `weights_only=True`.

    Raises:
        SetupError: a one-line reason: not found, unreachable, damaged, or holding Python objects
            that a weights-only load refuses; local paths also list the usable checkpoints beside them.
    """
    try:
        if is_remote(path):
            return torch.load(io.BytesIO(_read_bytes(str(path))), map_location=map_location, weights_only=True)
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 (every failure becomes one line naming the file)
        raise load_error(path, e) from None


def load_error(path: str | Path, e: Exception) -> SetupError:
    """The one-line error for a checkpoint that failed to load; a local one's lists the usable files beside it."""
    if isinstance(e, pickle.UnpicklingError):
        reason = (
            f"holds Python objects that a weights-only load refuses ({first_line(e)}); vit-train loads "
            "tensors and plain data only, from local files and URLs alike"
        )
    elif isinstance(e, OSError):
        reason = f"cannot be read ({first_line(e)})"
    else:
        reason = f"is damaged or truncated ({first_line(e)})"
    hint = ""
    if not is_remote(path):
        usable = usable_checkpoints(Path(path).parent, exclude=Path(path))
        hint = "; usable checkpoints beside it: " + ", ".join(str(p) for p in usable) if usable else ""
    return SetupError(f"checkpoint {path} {reason}{hint}")


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint IO with atomic local saves and weights-only loads from any source."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if is_remote(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options for local files")
        atomic_torch_save(checkpoint, path)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        # weights_only is True whatever the caller asks: a checkpoint is data, never code to run
        ckpt = load_weights_only(path, map_location or (lambda storage, loc: storage))
        missing = [
            k
            for k in ("state_dict", "pytorch-lightning_version", META_KEY)
            if not isinstance(ckpt, dict) or k not in ckpt
        ]
        if missing:
            raise SetupError(
                f"checkpoint {path} is not one vit-train wrote (no {', '.join(repr(k) for k in missing)}); give a "
                "runs/<run>/checkpoints/*.ckpt file"
            )
        return ckpt
