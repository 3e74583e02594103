"""Files written whole or not at all, for `vit-export`'s model file (`serve.export.cli`), its Triton repository
(`serve.export.triton`) and its web page (`serve.export.web`), which a server may read while they are written.

Each file goes to a hidden temporary beside it (`TEMPORARY`: never a version number, never a folder of its own
in a repository), flushed to the disk, and is renamed over its target; the folder is flushed after. The
temporaries a killed export left are removed by the next one (`remove_stale_temporaries`).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

from serve.runtime.outputs import sync_folder

# A temporary's name: `.<name>.vit-export-<pid>-<start>-<random>`, the process id and its start time telling
# whether its export still runs. The start time tells a reused process id: an export killed in a container left
# `...-1-...`, and the next container's export, process 1 again, took it for its own (names from before the start
# time was written, `...-<pid>-<random>`, are told by the process id alone).
TEMPORARY = re.compile(r"\..+\.vit-export-([1-9][0-9]*)-(?:([0-9]+)-)?[0-9a-f]+")


def temporary_name(name: str) -> str:
    """A hidden name for a temporary that will become `name`, unique to this process (`TEMPORARY`)."""
    return f".{name}.vit-export-{os.getpid()}-{_start_time(os.getpid()) or 0}-{secrets.token_hex(4)}"


def _start_time(pid: int) -> str | None:
    """When process `pid` started, in clock ticks after boot (/proc's `starttime`); None where /proc does not say."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def write_new(path: Path, data: bytes) -> None:
    """Create `path` holding `data`, flushed to the disk; its mode is the umask's, as for any new file."""
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _running(pid: int, start: str | None) -> bool:
    """Whether the export that named a temporary `pid` (started at `start`, None: not written) still runs."""
    try:
        os.kill(pid, 0)  # signal 0 sends nothing: it asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    now = _start_time(pid)
    return start in (None, "0") or now is None or now == start  # the same process, or one cannot tell


def remove_stale_temporaries(folder: Path) -> None:
    """Remove the temporaries (`TEMPORARY`) in `folder` of exports that no longer run: those a kill left.

    A process id means nothing on another machine: an export writing into a shared folder from elsewhere may
    lose its temporary, and then fails at its rename, with its target left whole.
    """
    for path in folder.iterdir():
        match = TEMPORARY.fullmatch(path.name)
        if match is None or _running(int(match[1]), match[2]):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def write_pieces(pieces: dict[Path, bytes]) -> None:
    """Write every piece to a temporary first, then rename them into place in order: a full disk or an error
    replaces nothing, and a kill leaves at most the pieces before the last one renamed.

    The last piece is the one that puts the others to use (a Triton model's version file): when its folder is not
    there yet, that folder is built whole under a temporary name and renamed last. An OSError names the piece
    it failed on, not its temporary (a full disk's names none).
    """
    *files, (model, model_bytes) = pieces.items()
    version = model.parent
    remove_stale_temporaries(version.parent)
    staged: dict[Path, Path] = {}  # where each piece goes -> its temporary
    try:
        for path, data in files:
            staged[path] = path.with_name(temporary_name(path.name))
            with _naming(path):
                write_new(staged[path], data)
        if version.is_dir():  # its file is replaced: a folder cannot be renamed over one that holds files
            remove_stale_temporaries(version)
            staged[model] = model.with_name(temporary_name(model.name))
            with _naming(model):
                write_new(staged[model], model_bytes)
        else:
            staged[version] = version.with_name(temporary_name(version.name))
            with _naming(model):
                staged[version].mkdir()
                write_new(staged[version] / model.name, model_bytes)
                sync_folder(staged[version])
        for path, tmp in staged.items():
            with _naming(path):
                os.replace(tmp, path)
    finally:
        for tmp in staged.values():
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)
    sync_folder(version)
    sync_folder(version.parent)


@contextlib.contextmanager
def _naming(path: Path) -> Iterator[None]:
    """An OSError in the block names `path`, the piece being written, not its temporary (or nothing: a full disk)."""
    try:
        yield
    except OSError as e:
        e.filename, e.filename2 = str(path), None
        raise
