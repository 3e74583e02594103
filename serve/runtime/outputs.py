"""Result files written in parts, so that a killed `vit-predict --out` run resumes where it stopped.

    store = PartStore(Path("preds.parquet"))
    done, failed = store.committed()               # what earlier runs finished: skip those inputs
    store.commit(rows, failures)                   # one part, atomically
    store.finish()                                 # parts -> preds.parquet, the parts folder removed

While a run is under way its parts live in `preds.parquet.parts/`. A part is two files: the rows
(`part-00007.parquet`, in the output's own format) and its manifest (`part-00007.json`: the paths it holds
and the inputs that could not be read, with the reason). Each is written to a temporary name, flushed to
disk and renamed, and the folder is flushed after the rename, so that the rename itself survives a power cut;
the manifest's rename is the commit. A run killed at any instant leaves whole committed parts and, at most, an
uncommitted one that the next run deletes: nothing is lost or written twice.

The first run also writes `job.json` in the parts folder: what decides the rows (the model file's content, the
options that change columns or values; `serve.runtime.jobs.job_record`). A run that resumes reads it back, and its
caller refuses to go on under another model or other options: the parts it would add would not fit those there.

The end is ordered so that a kill at any step leaves something `--resume` completes: the parts are merged into
`preds.parquet.tmp`, which is renamed to `preds.parquet`; then the whole parts folder is renamed out of the way
(`preds.parquet.parts.old/`) in one step and only then deleted. Until that rename, `--resume` merges the same
parts again; after it, the output is complete. Deleting the parts in place could be cut off between a part's
rows and its manifest, and the next merge would miss those rows.

The job writes only what it creates: a parts folder or a temporary file that is a symbolic link is refused
(the clean-up would delete or overwrite what the link points at).

The rows' formats (`.parquet`, `.csv`, `.jsonl`) and how each keeps any file name: `serve.runtime.row_formats`.
"""

from __future__ import annotations

import csv
import errno
import fcntl
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, BinaryIO

from serve.runtime.row_formats import encode_rows, merge_parquet, output_format, require_pyarrow, rows_in

PARTS_SUFFIX = ".parts"
DONE_SUFFIX = ".old"  # the parts folder of a merged output, renamed before it is deleted
JOB_FILE = "job.json"  # in the parts folder: what decides the rows, so that a resume can check it is the same job
_PART = re.compile(r"part-(\d{5,})(\.[a-z]+)$")  # a part's data file or manifest: `part-00007.jsonl`, `.json`


def _part_number(path: Path) -> int:
    """A part's number, `part-00007.jsonl` -> 7 (-1 for a name that is not a part's)."""
    found = _PART.match(path.name)
    return int(found.group(1)) if found else -1


def _refuse_link(path: Path) -> None:
    if path.is_symlink():
        raise ValueError(
            f"{path} is a symbolic link: vit-predict keeps its parts and temporary files in place and deletes them "
            "when done, so it will not follow a link; remove the link (or choose another --out)"
        )


def _create(path: Path):
    """`path` opened for writing from empty, never through a symbolic link (ValueError if it is one)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            _refuse_link(path)
        raise
    return os.fdopen(fd, "wb")


def create_anew(path: Path, mode: str = "wb", **text: Any) -> IO:
    """`path` made anew and opened for writing (`mode` "w" takes `open`'s encoding, errors and newline), never through
    a symbolic link: what stands at the name goes first (a stale temporary file, or a link planted there by whoever
    else can write the folder: removing a link removes the link alone), then O_EXCL | O_NOFOLLOW create the file,
    and fail rather than follow a link planted in between. For a temporary name kept to one writer (by a lock, or a
    process id in it): the file another writer holds under it would be removed too."""
    path.unlink(missing_ok=True)
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666), mode, **text)


def sync_folder(folder: Path) -> None:
    """Flush a folder's entries to disk, so that a rename or a new file in it survives a power cut."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_durably(tmp: Path, path: Path) -> None:
    os.replace(tmp, path)
    sync_folder(path.parent)


def _write_atomic(path: Path, data: bytes) -> None:
    """Write `data` under a temporary name, flush it to disk and rename: `path` is whole or absent."""
    tmp = path.with_name(path.name + ".tmp")
    with _writing(tmp) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    _replace_durably(tmp, path)


WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a full disk, a quota, a file size limit


@contextmanager
def _writing(tmp: Path) -> Iterator[BinaryIO]:
    """`tmp` opened for writing (`_create`), deleted if the block or the close that flushes it fails (a full disk):
    it would hold on to the space the user must free, and none but a resume would ever remove it. Such an error is
    given the file's name, so that the message says which disk is full."""
    f = _create(tmp)
    try:
        with f:
            yield f
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename is None and e.errno in WRITE_ERRNOS:
            e.filename = str(tmp)
        raise


def lock_folder(fd: int, busy: str, wait_s: float = 0.2) -> int:
    """`fd`, an open folder, locked for this process alone (the kernel lets go however the process ends). A lock held
    for less than `wait_s` is waited for: a second run's `PartStore.check_not_in_use` holds it for a moment.

    Raises:
        ValueError: `busy`, when another process holds the lock (`fd` is then closed).
    """
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise ValueError(busy) from None
            time.sleep(0.01)


class PartStore:
    """The parts of one output file: commit them one by one, read back what was done, merge at the end.

    Args:
        out: the final file (`preds.parquet`, `.csv` or `.jsonl`); the parts go to `out` + ".parts/".
    """

    def __init__(self, out: Path):
        self.out = Path(out)
        self.fmt = output_format(self.out)
        self.dir = self.out.with_name(self.out.name + PARTS_SUFFIX)
        self.old_dir = self.dir.with_name(self.dir.name + DONE_SUFFIX)
        self.finished_record = self.out.with_name(f".{self.out.name}.{JOB_FILE}")  # the job of the merged table
        self.next_index = 0
        self._held: int | None = None  # the parts folder, while `lock` holds it
        _refuse_link(self.dir)

    def lock(self) -> None:
        """Make the parts folder and hold it until `unlock` (or until this process ends, however it ends: the kernel
        lets go): a second run on the same output, a retry while the first still goes, would delete the other's
        temporary files.

        Raises:
            ValueError: another run holds it.
        """
        self._make_folder()
        self._held = lock_folder(os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY), self._busy())

    def _make_folder(self) -> None:
        """The parts folder (with --out's own folders), made where it is missing and synced into its folder.

        Raises:
            ValueError: it cannot be made (`--out /proc/x.csv`, a read-only disk), in one line that says so.
        """
        try:
            _refuse_link(self.dir)
            if self.dir.is_dir():
                return
            self.dir.mkdir(parents=True, exist_ok=True)  # exist_ok: a second run started at once is `lock`'s to refuse
            sync_folder(self.dir.parent)
        except OSError as e:  # a parent this user cannot search or write, a read-only disk, /proc
            raise ValueError(
                f"cannot make {self.dir}, the folder of the parts of {self.out} while the run goes on "
                f"({e.strerror or e}): give an --out in a folder this user can write"
            ) from None

    def check_not_in_use(self) -> None:
        """Refuse, as `lock` would, when another run holds the parts folder; hold nothing either way.

        Raises:
            ValueError: another run is writing `out`.
        """
        try:
            fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:  # no parts folder (a finished table, or none yet): nobody writes it
            return
        os.close(lock_folder(fd, self._busy()))

    def _busy(self) -> str:
        return (
            f"another vit-predict is writing {self.out} (its parts folder {self.dir} is in use): wait for it to "
            "end, or give this run another --out"
        )

    def unlock(self) -> None:
        """Let go of the parts folder `lock` took (whether the run finished, failed or was stopped)."""
        if self._held is not None:
            os.close(self._held)
            self._held = None

    def exists(self) -> bool:
        """True when an earlier run left the output or its parts."""
        return self.out.exists() or self.dir.exists()

    def record(self, job: dict[str, Any]) -> dict[str, Any]:
        """Make the parts folder and record `job` in it (what decides the rows), or read what an earlier run recorded.

        Returns:
            The job the parts were written under, as JSON reads it back, to compare with this run's: `job` itself
            on a first run, and on a folder without a record (a run killed before it wrote one, which committed no
            part, or a vitscope from before records, whose parts cannot be checked).
        """
        self._make_folder()
        path = self.dir / JOB_FILE
        if not path.exists():
            _write_atomic(path, json.dumps(job).encode())
        try:
            return json.loads(path.read_text())
        except ValueError as e:
            raise ValueError(f"{path} is damaged ({e}): remove {self.dir} to score the inputs again") from None

    def committed(self) -> tuple[set[str], list[tuple[str, str]]]:
        """Clear away an unfinished part, then read the committed manifests.

        Returns:
            (done, failed): the paths already classified, and (path, reason) for those that could not be read.
        """
        self._make_folder()
        done: set[str] = set()
        failed: list[tuple[str, str]] = []
        indices = []
        for manifest in sorted(self.dir.glob("part-*.json"), key=_part_number):
            found = _PART.match(manifest.name)
            if not found or found.group(2) != ".json":
                continue
            entry = _manifest(manifest)
            if entry is None or (
                entry["paths"] and rows_in(self.dir / f"{manifest.stem}{self.fmt}", self.fmt) != len(entry["paths"])
            ):
                manifest.unlink()  # its rows are gone or cut short (a damaged or half-copied folder): score them again
                continue
            done.update(entry["paths"])
            failed.extend((p, reason) for p, reason in entry["failed"])
            indices.append(int(found.group(1)))
        for f in self.dir.iterdir():  # a data file without its manifest was never committed
            stem = f.name.split(".")[0]
            if f.name.endswith(".tmp") or (f.suffix != ".json" and not (self.dir / f"{stem}.json").exists()):
                f.unlink()
        self.next_index = max(indices, default=-1) + 1
        return done, failed

    def commit(
        self, rows: list[dict[str, Any]], failed: Iterable[tuple[str, str]], keys: list[str] | None = None
    ) -> None:
        """Write one part: its rows (if any), then its manifest, whose rename commits the part.

        Args:
            keys: what names each row's input wherever the run is resumed from (absolute paths); None: the paths.
        """
        name = f"part-{self.next_index:05d}"
        if rows:
            _write_atomic(self.dir / f"{name}{self.fmt}", encode_rows(rows, self.fmt))
        manifest = {"paths": keys or [r["path"] for r in rows], "failed": [list(f) for f in failed]}
        _write_atomic(self.dir / f"{name}.json", json.dumps(manifest).encode())
        self.next_index += 1

    def output_paths(self) -> list[str]:
        """The `path` of each row of the finished `out` file, as the rows name their inputs."""
        if self.fmt == ".parquet":
            return require_pyarrow().parquet.read_table(self.out, columns=["path"]).column("path").to_pylist()
        if self.fmt == ".jsonl":
            with open(self.out, "rb") as f:
                return [json.loads(line)["path"] for line in f]
        limit = csv.field_size_limit(sys.maxsize)  # a prediction set of thousands of classes is one long field
        try:
            with open(self.out, newline="", encoding="utf-8", errors="surrogateescape") as f:
                return [row["path"] for row in csv.DictReader(f)]
        finally:
            csv.field_size_limit(limit)

    def data_files(self) -> list[Path]:
        """The committed parts' data files, in the order they were written."""
        committed = [p for p in self.dir.glob(f"part-*{self.fmt}") if (self.dir / f"{p.stem}.json").exists()]
        return sorted(committed, key=_part_number)  # by number: `part-100000` comes after `part-99999`

    def finish(self, template: dict[str, Any] | None = None) -> None:
        """Merge the parts into `out` (written under a temporary name, flushed, then renamed) and remove the
        parts: the folder is renamed away in one step before it is deleted, so a kill leaves it whole or gone.

        Args:
            template: a row of the job's columns and types: the header of a table no image reached.
        """
        _refuse_link(self.dir)
        tmp = self.out.with_name(self.out.name + ".tmp")
        parts = self.data_files()
        with _writing(tmp) as dst:
            if self.fmt == ".parquet":
                merge_parquet(parts, dst, template)
            elif not parts and template is not None and self.fmt == ".csv":
                dst.write(encode_rows([template], self.fmt).splitlines(keepends=True)[0])  # the header alone
            else:
                for i, part in enumerate(parts):
                    with open(part, "rb") as src:
                        if self.fmt == ".csv" and i > 0:
                            src.readline()  # one header, from the first part
                        shutil.copyfileobj(src, dst)
            dst.flush()
            os.fsync(dst.fileno())
        if (self.dir / JOB_FILE).exists():  # kept beside the table, for a --resume of it to check (`finished_job`)
            _write_atomic(self.finished_record, (self.dir / JOB_FILE).read_bytes())
        _replace_durably(tmp, self.out)  # the output is complete: from here on the parts are not needed
        self.remove_old_parts()
        os.rename(self.dir, self.old_dir)
        sync_folder(self.dir.parent)
        self.remove_old_parts()

    def finished_job(self) -> dict[str, Any] | None:
        """The job the merged `out` was scored under (None: no record beside it, or an unreadable one)."""
        try:
            return json.loads(self.finished_record.read_bytes())
        except (OSError, ValueError):
            return None

    def remove_old_parts(self) -> None:
        """Delete the parts folder of an output already merged, if a killed run left it, or while another run (a
        `--resume` started during this one's clean-up) deletes it too."""
        while self.old_dir.exists() or self.old_dir.is_symlink():
            _refuse_link(self.old_dir)
            try:
                shutil.rmtree(self.old_dir)
            except FileNotFoundError:  # the other run deleted a file first: go on with what is left
                continue


def _manifest(path: Path) -> dict[str, Any] | None:
    """A part's manifest, or None when it is damaged (then its part was never committed, as far as a run can tell)."""
    try:
        entry = json.loads(path.read_bytes())
        return entry if isinstance(entry.get("paths"), list) and isinstance(entry.get("failed"), list) else None
    except (ValueError, AttributeError):
        return None
