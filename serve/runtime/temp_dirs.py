"""Temporary folders a server owns while it runs, and those an earlier server was killed before it could remove.

`vit-serve` and `vit-train review` keep their pages' uploads and results in a folder of their own
(`GRADIO_TEMP_DIR`), and the Ray ingress its repository view; each removes its folder when it stops. A SIGKILL (an
orchestrator's after the grace period, the OOM killer, Ray replacing a replica) leaves it behind, uploads included,
and a server restarted in a loop would fill the disk. So each folder holds an exclusive `flock` on its `.lock` file
for as long as its server lives: the kernel lets go of it however the process ends, and the next folder of the same
prefix that this user makes in the same temporary folder removes every one whose lock it can take. A process ID
would not tell: in a container every server is PID 1.
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
        self.path, self._fd = Path(tempfile.mkdtemp(prefix=prefix, dir=parent)), None
        try:
            new = self.path / (LOCK + ".new")
            self._fd = os.open(new, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            os.rename(new, self.path / LOCK)  # `.lock` appears already held: no sweep takes a folder being made
        except BaseException:
            if self._fd is not None:
                os.close(self._fd)
            shutil.rmtree(self.path, ignore_errors=True)
            raise

    def remove(self) -> None:
        """Delete the folder and let go of its lock (a second call does nothing). `.lock` goes last, and only with
        the rest gone: a folder that could not be emptied stays for the next server's sweep to try again."""
        if self._fd is None:
            return
        try:
            for entry in self.path.iterdir():
                if entry.name == LOCK:
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
            if [p.name for p in self.path.iterdir()] == [LOCK]:
                (self.path / LOCK).unlink()
                self.path.rmdir()
        except FileNotFoundError:  # removed meanwhile (a clean-up of /tmp, an operator)
            pass
        finally:
            os.close(self._fd)
            self._fd = None


def remove_orphans(prefix: str, parent: Path) -> list[Path]:
    """Remove each folder `parent/<prefix>*` of this user whose `.lock` no live process holds.

    Folders without a `.lock` (another program's, or made before the lock existed), symbolic links and other users'
    folders are left.

    Returns:
        The folders removed.
    """
    removed = []
    for folder in sorted(parent.glob(glob.escape(prefix) + "*")):
        try:
            folder_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:  # not a folder (a symbolic link planted in a shared /tmp), or removed meanwhile
            continue
        try:
            if os.fstat(folder_fd).st_uid == os.getuid() and _lock_is_free(folder_fd):
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
                log.info("removed %s: its server ended without removing it (killed, or out of memory)", folder)
        finally:
            os.close(folder_fd)
    return removed


def _lock_is_free(folder_fd: int) -> bool:
    """Whether the `.lock` file in the folder open as `folder_fd` is a plain file that no process holds."""
    try:
        fd = os.open(LOCK, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder_fd)
    except OSError:  # none: not a folder of ours
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True  # no server comes back to a folder: a new one makes its own
    except BlockingIOError:  # its server runs
        return False
    finally:
        os.close(fd)
