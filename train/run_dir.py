"""The run directory's rules: which checkpoint `--ckpt_path` may name, whose run a fit may continue.

Each refusal is one `SetupError` line that names what can be used instead. The checkpoints live in
`<run_dir>/checkpoints` (`CKPT_DIR`), and `check_run_dir` fails a read-only run directory, or one in the image
folder, before any work.

`--ckpt_path` (`resolve_ckpt_path`, `check_ckpt_owner`):
    last / best      this run's `checkpoints/last.ckpt` / `best.ckpt`; refused when missing, with the
                     files that are there
    a local file     refused when missing or damaged (its zip directory cannot be read, or a record fails
                     its checksum), naming the run's checkpoints that can be used instead
    a URL (http...)  loaded into memory with `weights_only=True`, like every other checkpoint
`fit --ckpt_path` into a run directory that holds checkpoints must resume that run's own checkpoint,
unless --overwrite true. One fit at a time writes a run directory (`lock_run_dir`).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import tempfile
import zipfile
from pathlib import Path
from typing import IO, Any

from serve.runtime.image_files import link_loop
from serve.runtime.images import is_utf8
from train.errors import SetupError, first_line

CKPT_DIR = "checkpoints"
LOCK_FILE = ".lock"  # held by the fit that writes the run directory (`lock_run_dir`)


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


def damaged_record(path: Path) -> str | None:
    """The first record of the `torch.save` file `path` whose bytes fail their zip checksum (None: all pass).

    torch.load reads records without checking them: bytes changed by a bad disk or copy load as wrong weights.

    Raises:
        Exception: a record the zip reader cannot read at all (a flipped method or flag byte raises
            NotImplementedError or RuntimeError, not only BadZipFile).
    """
    with zipfile.ZipFile(path) as z:
        return z.testzip()


def usable_checkpoints(ckpt_dir: Path, exclude: Path | None = None) -> list[Path]:
    """The intact `*.ckpt` files of `ckpt_dir` (sorted), leaving out `exclude`."""
    if not ckpt_dir.is_dir():
        return []
    skip = os.path.realpath(exclude) if exclude is not None else None  # realpath: a link loop raises nothing
    return [p for p in sorted(ckpt_dir.glob("*.ckpt")) if os.path.realpath(p) != skip and is_intact(p)]


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
    if path.suffix == ".onnx":  # not a zip file either: it would read as a damaged checkpoint
        raise SetupError(f"{path} is an exported model, which cannot be trained on; {_alternatives(ckpt_dir, path)}")
    if not is_intact(path):
        raise SetupError(f"{path} is damaged or truncated (not a whole checkpoint); {_alternatives(ckpt_dir, path)}")
    try:
        bad = damaged_record(path)
        why = f"its record {bad} fails its checksum" if bad else ""
    except Exception as e:
        why = f"a record cannot be read ({first_line(e)})"
    if why:
        raise SetupError(f"{path} is damaged: {why}; {_alternatives(ckpt_dir, path)}")
    return str(path.resolve())


def scored_ckpt_path(subcommand: str, ckpt_path: str | None, run_dir: Path, model: Any = None) -> str | None:
    """`--ckpt_path` for validate, test or predict: as given, else the run's best.ckpt ("best"). Without either they
    would score the untrained network, with exit 0; pretrained weights (`--model.pretrained`) are scored as they are.

    Raises:
        SetupError: no checkpoint given, none in the run, and no pretrained weights.
    """
    if ckpt_path or getattr(model, "hparams", {}).get("pretrained"):
        return ckpt_path
    if not (run_dir / CKPT_DIR / "best.ckpt").is_file():
        raise SetupError(
            f"vit-train {subcommand} scores trained weights, and {run_dir / CKPT_DIR} holds no best.ckpt: give "
            "--ckpt_path (a .ckpt file), or the --trainer.default_root_dir of a trained run"
        )
    return "best"


def held_run(run_dir: Path) -> list[str]:
    """What says `run_dir` holds a run: its checkpoints, or the summary.json of a fit that kept none ([]: no run)."""
    existing = [f"{CKPT_DIR}/{p.name}" for p in sorted((run_dir / CKPT_DIR).glob("*.ckpt"))]
    return existing or [name for name in ("summary.json",) if (run_dir / name).is_file()]


def check_ckpt_owner(ckpt_path: str | None, run_dir: Path, overwrite: bool) -> None:
    """Refuse to fit into a run directory that already holds a run (its checkpoints, or the summary.json of a fit
    without checkpoints), unless resuming it from one of its own checkpoints."""
    ckpt_dir, existing = run_dir / CKPT_DIR, held_run(run_dir)
    if not existing or overwrite:
        return
    where = f"{run_dir} already holds a run ({', '.join(existing)})"
    if not ckpt_path:
        resume = (
            "Resume it with --ckpt_path last, start" if existing != ["summary.json"] else "It kept no checkpoint: start"
        )
        raise SetupError(
            f"{where}; a new fit would replace them. {resume} a new run with "
            "--trainer.default_root_dir runs/<new name>, or replace it with --overwrite true"
        )
    own = not is_remote(ckpt_path) and Path(ckpt_path).resolve().parent == ckpt_dir.resolve()
    if not own:
        raise SetupError(
            f"{where}, and --ckpt_path {ckpt_path} is not one of its checkpoints: fitting from it would replace "
            "them. Give a new --trainer.default_root_dir, or replace this run with --overwrite true"
        )


def clear_replaced_run(run_dir: str | Path, ckpt_path: str | None) -> None:
    """`--overwrite true`, as training starts (`train.callbacks.ClearReplacedRun`): remove the run it replaces (its
    checkpoints and summary.json, `held_run`), but for the checkpoint the fit starts from. A fit stopped before its
    first checkpoint left the old run's model beside the new run's config and split, for `--ckpt_path last`."""
    run_dir, start = Path(run_dir), Path(ckpt_path).resolve() if ckpt_path and not is_remote(ckpt_path) else None
    for ckpt in (run_dir / CKPT_DIR).glob("*.ckpt"):
        if ckpt.resolve() != start:
            ckpt.unlink()
    (run_dir / "summary.json").unlink(missing_ok=True)


def lock_run_dir(run_dir: Path) -> IO[str] | None:
    """Hold `run_dir/.lock` until this process ends (however it ends: the kernel lets go of the lock): a second fit
    into the same run directory is refused at once, rather than both running and the last to write winning.

    DDP's other processes (a nonzero RANK, LOCAL_RANK or NODE_RANK) share the run of rank 0, which holds the lock.

    Raises:
        SetupError: another process holds it; the message says which, and what to do.
    """
    if any(os.environ.get(name, "0") != "0" for name in ("RANK", "LOCAL_RANK", "NODE_RANK")):
        return None
    f = open(run_dir / LOCK_FILE, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise SetupError(
            f"{run_dir} is in use by another fit ({holder}); wait for it to end, or give this one its own "
            "--trainer.default_root_dir"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"process {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    return f


def hold_run_dir(run_dir: Path, ckpt_path: str | None, overwrite: bool, check_owner: bool = True) -> IO[str] | None:
    """`lock_run_dir`, then `check_ckpt_owner` (unless not `check_owner`), letting go of the lock if it refuses."""
    lock = lock_run_dir(run_dir)
    try:
        if check_owner:
            check_ckpt_owner(resolve_ckpt_path(ckpt_path, run_dir), run_dir, overwrite)
    except SetupError:
        if lock is not None:
            lock.close()
        raise
    return lock


def check_utf8(run_dir: Path, data_root: str | None) -> None:
    """Refuse a run directory or an image folder whose path, as given, is not UTF-8 (relative ones under a folder
    so named work: TensorBoard and `config.yaml` hold them as given).

    Raises:
        SetupError: TensorBoard cannot write under such a run directory (a traceback, with `.lock` left behind),
            and the run's `config.yaml` holds such an image folder as an escape its own `--config` refuses.
    """
    if not is_utf8(str(run_dir)):  # the current folder, when no --trainer.default_root_dir is given
        raise SetupError(
            f"the run directory {os.fsencode(run_dir)!r} is not named in UTF-8, and TensorBoard cannot write under "
            "it: choose another --trainer.default_root_dir"
        )
    if data_root and not is_remote(data_root) and not is_utf8(data_root):
        raise SetupError(
            f"--data.root {os.fsencode(data_root)!r} is not named in UTF-8, and the run's config.yaml could not give "
            "it back: rename it, or give a link to it whose name is UTF-8"
        )


def check_run_dir(run_dir: Path, data_root: str | None, create: bool = True) -> None:
    """Create `run_dir` and a file in it now, so a read-only place fails in one line before any work; refuse it
    in the image folder `data_root`, where its reports (`confusion_matrix.png`) would be a class of the next scan.
    With `create` False, a `run_dir` not made yet stays so: a folder made and removed in its nearest existing parent
    tells whether it can be (`vit-train fit` checks so before it reads the images, and makes it after), and
    `check_utf8` refuses paths it could not write or give back."""
    given = [(run_dir, "--trainer.default_root_dir")] + ([(data_root, "--data.root")] if data_root else [])
    if why := next((f"{what} {loop}" for path, what in given if (loop := link_loop(Path(path).expanduser()))), None):
        raise SetupError(why)
    if not create:  # fit's checks: a path it writes, or that its config.yaml must give back, is UTF-8
        check_utf8(run_dir, data_root)
    images = None if not data_root or is_remote(data_root) else Path(data_root).expanduser().resolve()
    own = images is not None and (images / "train").is_dir() and (images / "val").is_dir()
    scanned = [images / "train", images / "val"] if own else [images] if images is not None else []
    if any(run_dir.resolve() == s or s in run_dir.resolve().parents for s in scanned):
        raise SetupError(
            f"--trainer.default_root_dir must be outside --data.root: {run_dir} is in the image folder {data_root}, "
            "whose next scan would read the run as a class; use e.g. runs/<name>"
        )
    if not create and not run_dir.exists():
        parent = next(p for p in [run_dir.absolute(), *run_dir.absolute().parents] if os.path.lexists(p))
        try:
            if not parent.exists():  # a link to nowhere, the run directory's or a folder's above it
                raise FileNotFoundError(errno.ENOENT, f"{parent} is a link to nowhere")
            os.rmdir(tempfile.mkdtemp(prefix=".write-test-", dir=parent))
        except OSError as e:
            raise SetupError(
                f"cannot write into the run directory {run_dir} (it cannot be made in {parent}: {e.strerror}); "
                "choose a writable --trainer.default_root_dir"
            ) from None
        return
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
