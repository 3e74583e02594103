"""The review's decisions, kept in `RUN_DIR/corrections.csv` (`path,label`) the moment each is made.

The file is what `vit-train fit --data.corrections` reads (`train.corrections`), and the review reads it by the same
rules: one row per image (absolute, or relative to the data root), an empty label leaving the image out, labels and
paths as written. Each decision rewrites the whole file beside itself, flushes it to disk and renames it over the
old one, so a crash or a power cut leaves either the old file or the new one, never half of either. The file beside
it is made anew each time (`create_anew`): a link planted at its name is removed, never written through.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from serve.runtime.images import FILE_NAME_ERRORS
from serve.runtime.outputs import create_anew, sync_folder
from serve.runtime.row_formats import csv_line
from train.corrections import HEADER, CorrectionsTable, absolute_path, read_corrections

CORRECTIONS_FILE = "corrections.csv"
log = logging.getLogger(__name__)


class Decisions:
    """The decisions of one review, kept in memory and in `file` alike.

    Args:
        file: the corrections CSV; the decisions it already holds are the review's starting point.
        root: the data root, which relative paths in `file` start from (as in `fit`).
        classes: the class names a label must be one of.
        earlier: where a first review starts when `file` does not exist yet: the corrections the run was trained
            with (absolute path -> label), written into `file` at once. Corrections then add up from one round
            to the next: a fit on `file` keeps every earlier round's, not only this review's.

    Raises:
        ValueError: `file` is not a corrections file `fit` would read (one line: where, what, what to do).
    """

    def __init__(
        self, file: str | Path, root: str | Path, classes: list[str], earlier: dict[str, str | None] | None = None
    ):
        self.file, self.root, self.classes = Path(file), Path(root).expanduser().resolve(), list(classes)
        self._earlier = dict(earlier or {})
        self._lock = threading.Lock()  # Gradio runs each click on a thread of its own
        if earlier and not self.file.exists():
            try:
                with self._folder_locked():  # two reviews opening at once: one temporary file at a time
                    _write_atomically(self.file, self._read())
            except OSError:  # a read-only run: the page opens saying so (`cannot_save`), and shows the run's
                pass
        self._table = self._read()
        self.cannot_save = self._cannot_save()  # None: decisions can be saved
        if self.cannot_save:
            log.warning("%s", self.cannot_save)

    def _cannot_save(self) -> str | None:
        """Why a decision could not be saved, found by making the write a decision makes (nothing is changed)."""
        try:
            with self._folder_locked():
                create_anew(_temporary(self.file)).close()
                _temporary(self.file).unlink()
        except OSError as e:
            return (
                f"decisions cannot be saved in {self.file} ({e}): make the run folder writable, then start the "
                "review again"
            )
        return None

    @contextmanager
    def _folder_locked(self) -> Iterator[None]:
        """The decisions file's folder locked, against other processes too (the file itself is replaced at each
        write, so the lock is on its folder)."""
        folder = os.open(self.file.parent, os.O_RDONLY)
        try:
            fcntl.flock(folder, fcntl.LOCK_EX)
            yield
        finally:
            os.close(folder)  # and the lock with it

    def get(self, path: str) -> tuple[bool, str | None]:
        """(whether `path` was decided, its label: None when left out)."""
        key = absolute_path(path, self.root)
        with self._lock:
            return key in self._table.labels, self._table.labels.get(key)

    def all(self) -> dict[str, str | None]:
        """Absolute path -> label (None: left out), as `fit` would read the file."""
        with self._lock:
            return dict(self._table.labels)

    def reload(self) -> None:
        """Read the file again: what another review of the run, or a hand edit, decided since shows too."""
        table = self._read()
        with self._lock:
            self._table = table

    def decide(self, path: str, label: str | None) -> None:
        """Record `label` for `path` (None: leave it out), on disk before this returns.

        The file is read again, under a lock other processes honour too, and this decision added to what it
        holds: a row added by hand, or another review's decisions on the same run, stay. The image's earlier row
        (however it names the image) goes, and the decision is the file's last row, keeping that row's further
        columns (a note); a new image's are empty.
        """
        with self._lock, self._folder_locked():
            table = self._read()
            key = absolute_path(path, self.root)
            extra = table.rows.pop(key, [])[2:]
            row = [written_path(key, self.root), label or "", *extra]
            table.rows[key] = row + [""] * (len(table.header) - len(row))
            table.labels[key] = label
            _write_atomically(self.file, table)
            self._table = table

    def _read(self) -> CorrectionsTable:
        """The file as `fit` reads it; the decisions the review starts from when there is no file (yet)."""
        if not self.file.exists():
            rows = {p: [written_path(p, self.root), label or ""] for p, label in self._earlier.items()}
            return CorrectionsTable(list(HEADER), rows, dict(self._earlier))
        return read_corrections(self.file, self.root, self.classes)


def written_path(path: str, root: Path) -> str:
    """`path` relative to the data root when it lies under it, so that the file follows the images to another
    mount (`fit` reads relative paths from its --data.root); a path outside the root as it is."""
    relative = os.path.relpath(path, root)
    return path if relative == ".." or relative.startswith(f"..{os.sep}") else relative


def _write_atomically(file: Path, table: CorrectionsTable) -> None:
    """Write-then-rename with fsync of the file and of its folder (the rename itself must reach the disk)."""
    text = "".join(csv_line(row) for row in [table.header, *table.rows.values()])
    tmp = _temporary(file)
    with create_anew(tmp, "w", encoding="utf-8", errors=FILE_NAME_ERRORS, newline="") as f:  # never through a link
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, file)
    sync_folder(file.parent)


def _temporary(file: Path) -> Path:
    """Where `file` is written before it is renamed into place."""
    return file.with_name(f".{file.name}.tmp")
