"""The --out of `vit-train prepare`: checked before the scan, held by one prepare at a time, its write errors said.

    check_out_usable(out)          # a file, a link to nothing, a folder this user cannot write: refused at once
    with holding_out(out):         # made where missing, and locked until the prepare ends
        ...                        # scan, decode, write the chunks

Each check is for a local --out: an object store (s3://, gs://) has no folder to lock, and says what it refuses when
it is written.
"""

from __future__ import annotations

import errno
import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from serve.runtime.outputs import lock_folder

log = logging.getLogger(__name__)

OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)
_WORKER_ERROR = re.compile(r"^\w*Error: \[Errno (\d+)\] .*$", re.MULTILINE)  # a line of a worker's traceback


def check_out_usable(out: str) -> None:
    """A `ValueError` naming --out when the local `out` cannot take the chunks: a file, a link to nothing, or a folder
    (or, for a new one, the nearest folder above it) that this user cannot write or that is on a read-only disk.
    Each was found only after the whole scan and decode, in a line that did not name --out."""
    if "://" in out:
        return
    folder = Path(out)
    if folder.is_symlink() and not folder.exists():
        raise ValueError(
            f"--out {out} is a link to {os.readlink(folder)}, which does not exist (or loops): fix its target, "
            "or give another --out"
        )
    above = next(p for p in (folder, *folder.parents) if p.exists() or p.is_symlink())
    if not above.is_dir():
        where = "" if above == folder else f" ({above} is a file)"
        raise ValueError(f"--out {out} is not a folder{where}: give a new or empty folder, e.g. shards/<name>")
    if not os.access(above, os.W_OK | os.X_OK):
        raise ValueError(
            f"--out {out} cannot be written ({above} is read-only for this user, or on a read-only disk): give an "
            "--out in a folder this user can write"
        )


@contextmanager
def holding_out(out: str) -> Iterator[None]:
    """The local `out` made where missing and held by this prepare alone until the block ends (the kernel lets go
    however the process ends): two prepares into one folder both ended well, each having written over the other's
    chunks, and left a dataset fit cannot read. The folders the block made are removed if it leaves them empty (a
    prepare refused before it wrote anything).

    Raises:
        ValueError: another prepare holds `out` (before any work: nothing is made or removed then but its folders).
    """
    if "://" in out:
        yield
        return
    folder, made = Path(out), []
    for p in reversed([p for p in (folder, *folder.parents) if not p.exists()]):
        try:
            p.mkdir()
            made.insert(0, p)  # deepest first
        except FileExistsError:  # another prepare made it first
            pass
    busy = f"--out {out} is being written by another vit-train prepare: wait for it to end, or give another --out"
    held = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        lock_folder(held, busy, wait_s=0)
    except OSError as e:  # a file system without locks (some network ones): the prepare goes on, unguarded
        log.warning("--out %s cannot be locked on its file system (%s): run one prepare into it at a time", out, e)
    try:
        yield
    finally:
        for p in made:  # while still held: no other prepare has it yet
            try:
                p.rmdir()
            except OSError:  # it holds what the prepare wrote
                break
        os.close(held)


def write_failure(e: OSError | RuntimeError, out: str) -> str | None:
    """One line for an error writing `out` (None: `e` is a RuntimeError of something else). LitData raises a
    RuntimeError for a chunk its worker could not write, with the worker's OSError as its cause or as the text of its
    traceback (from another process); a full disk there ended the command in a traceback of some 70 lines. LitData
    writes each chunk in its cache folder first (under $TMPDIR), then copies it to `out`: either disk may be full."""
    cause = e if isinstance(e, OSError) else e.__cause__
    if isinstance(cause, OSError):
        code, said = cause.errno, str(cause)
    elif found := _WORKER_ERROR.search(str(e)):
        code, said = int(found[1]), found[0]
    else:
        return None
    if code not in OUT_OF_SPACE:
        return said
    return (
        f"no space left on a disk while writing {out} ({said}): free space on the disk of --out and of $TMPDIR, "
        "where LitData stages each chunk, and run the same command again"
    )
