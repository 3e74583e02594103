"""The review's decisions, kept in `RUN_DIR/corrections.csv` (`path,label`) the moment each is made.

The file is what `vit-train fit --data.corrections` reads (`train.corrections`): one row per image, an empty label
leaving the image out. Each decision rewrites the whole file beside itself, flushes it to disk and renames it over
the old one, so a crash or a power cut leaves either the old file or the new one, never half of either.
"""

from __future__ import annotations

import csv
import fcntl
import io
import logging
import os
import threading
from pathlib import Path

from serve.runtime.images import FILE_NAME_ERRORS
from serve.runtime.outputs import sync_folder
from train.corrections import HEADER

CORRECTIONS_FILE = "corrections.csv"
log = logging.getLogger(__name__)


def read_decisions(path: str | Path) -> dict[str, str | None]:
    """path -> label (None: left out) from a corrections file; the latest row of a path wins, as in `fit`.

    A missing file is no decisions yet.
    """
    path = Path(path)
    if not path.is_file():
        return {}
    with open(path, newline="", encoding="utf-8-sig", errors=FILE_NAME_ERRORS) as f:
        rows = list(csv.reader(f))
    if rows and [c.strip().lower() for c in rows[0][:2]] != HEADER:
        raise ValueError(f"{path} must start with the header line path,label: fix or move it, then review again")
    return {r[0].strip(): (r[1].strip() if len(r) > 1 else "") or None for r in rows[1:] if r and r[0].strip()}


class Decisions:
    """The decisions of one review, kept in memory and in `file` alike.

    Args:
        file: the corrections CSV; the decisions it already holds are the review's starting point.
        earlier: where a first review starts when `file` does not exist yet: the corrections the run was trained
            with (absolute path -> label), written into `file` at once. Corrections then add up from one round
            to the next: a fit on `file` keeps every earlier round's, not only this review's.
    """

    def __init__(self, file: str | Path, earlier: dict[str, str | None] | None = None):
        self.file = Path(file)
        self._lock = threading.Lock()  # Gradio runs each click on a thread of its own
        if earlier and not self.file.exists():
            try:
                _write_atomically(self.file, earlier)
            except OSError as e:  # a read-only run: the page opens, and each click says it cannot record
                log.warning("cannot write %s (%s): the review shows the run's corrections, records nothing", file, e)
        self._decided = read_decisions(self.file) if self.file.exists() else dict(earlier or {})

    def get(self, path: str) -> tuple[bool, str | None]:
        """(whether `path` was decided, its label: None when left out)."""
        with self._lock:
            return path in self._decided, self._decided.get(path)

    def all(self) -> dict[str, str | None]:
        with self._lock:
            return dict(self._decided)

    def decide(self, path: str, label: str | None) -> None:
        """Record `label` for `path` (None: leave it out), on disk before this returns.

        The file is read again, under a lock other processes honour too, and this decision added to what it
        holds: a row added by hand, or another review's decisions on the same run, stay.
        """
        with self._lock:
            folder = os.open(self.file.parent, os.O_RDONLY)  # the lock: the file itself is replaced at each write
            try:
                fcntl.flock(folder, fcntl.LOCK_EX)
                decided = {**read_decisions(self.file), path: label}
                _write_atomically(self.file, decided)
                self._decided = decided
            finally:
                os.close(folder)  # and the lock with it


def _write_atomically(file: Path, decided: dict[str, str | None]) -> None:
    """Write-then-rename with fsync of the file and of its folder (the rename itself must reach the disk)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(HEADER)
    writer.writerows([p, label or ""] for p, label in decided.items())
    tmp = file.with_name(f".{file.name}.tmp")
    with open(tmp, "w", encoding="utf-8", errors=FILE_NAME_ERRORS, newline="") as f:
        f.write(buf.getvalue())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, file)
    sync_folder(file.parent)
