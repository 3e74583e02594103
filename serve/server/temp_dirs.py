"""Temporary folders a server owns while it runs, and those an earlier server was killed before it could remove.

`vit-serve` keeps the UI's uploads and results in a folder of its own (`GRADIO_TEMP_DIR`), and the Ray ingress its
repository view; each removes its folder when it stops. A SIGKILL (an orchestrator's after the grace period, the
OOM killer, Ray replacing a replica) leaves it behind, uploads included, and a server restarted in a loop would fill
the disk. So each folder holds an exclusive `flock` on its `.lock` file for as long as its server lives: the kernel
lets go of it however the process ends, and the next folder of the same prefix made on this machine removes every
one whose lock it can take. A process ID would not tell: in a container every server is PID 1.
"""

from __future__ import annotations

import fcntl
import glob
import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)
LOCK = ".lock"


class OwnedTempDir:
    """A new folder `<system temp>/<prefix>XXXXXXXX`, locked until `remove` (or this process's end); folders of
    the same prefix whose owners died first are removed (`remove_orphans`).

    Args:
        prefix: the folders' name prefix, one per kind of folder (``vitscope-ui-``).
        parent: where the folders are (None: the system's temporary folder, as `tempfile` picks it).
    """

    def __init__(self, prefix: str, parent: Path | None = None):
        parent = Path(parent or tempfile.gettempdir())
        remove_orphans(prefix, parent)
        self.path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        new = self.path / (LOCK + ".new")
        self._fd: int | None = os.open(new, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        os.rename(new, self.path / LOCK)  # `.lock` appears already held: no sweep can take a folder being made

    def remove(self) -> None:
        """Delete the folder and let go of its lock (a second call does nothing)."""
        if self._fd is None:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._fd)
        self._fd = None


def remove_orphans(prefix: str, parent: Path) -> list[Path]:
    """Remove each folder `parent/<prefix>*` of this user whose `.lock` no live process holds.

    Folders without a `.lock` (another program's, or made before the lock existed) and other users' are left.

    Returns:
        The folders removed.
    """
    removed = []
    for folder in sorted(parent.glob(glob.escape(prefix) + "*")):
        try:
            info = folder.lstat()
            fd = os.open(folder / LOCK, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:  # not a folder with our lock file in it, or removed meanwhile
            continue
        try:
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # its server runs
                continue
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
            log.info("removed %s: its server ended without removing it (killed, or out of memory)", folder)
        finally:
            os.close(fd)
    return removed
