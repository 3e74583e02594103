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

Formats, chosen by the suffix of `--out`: `.parquet` (needs pyarrow: `pip install 'vitscope[batch]'`),
`.csv` and `.jsonl`. A row is the JSON object vit-predict prints (`path`, `predictions: [{label, score}]`
and whatever other fields the run adds); the table formats flatten it to one row per image with columns
`path, label_1, score_1, ..., label_k, score_k` and the other fields as they are (nested values as JSON
text in CSV). Ray's writer (`serve.cluster`) uses the same `table_row`, so both give the same columns.

File names on Linux are bytes, and Python holds one that is not UTF-8 as a str with surrogate escapes ('\\udcff'
for the byte 0xff). Each format keeps such a path and every other row: JSON Lines writes the escape (`"\\udcff"`,
which `json.loads` gives back as the same str, and `os.fsencode` as the same bytes); CSV writes the name's own
bytes, as `ls` does (read it back with `open(..., errors="surrogateescape")`, or pandas'
`encoding_errors="surrogateescape"`, to get the same str); Parquet, whose strings must be UTF-8, writes each such
byte as the four characters `\\xff` (Python's backslashreplace: readable, but a name that holds a real backslash
followed by `x` and two hex digits reads the same).
"""

from __future__ import annotations

import csv
import errno
import fcntl
import io
import json
import os
import re
import shutil
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

FORMATS = (".parquet", ".csv", ".jsonl")
PARTS_SUFFIX = ".parts"
DONE_SUFFIX = ".old"  # the parts folder of a merged output, renamed before it is deleted
JOB_FILE = "job.json"  # in the parts folder: what decides the rows, so that a resume can check it is the same job
_PART = re.compile(r"part-(\d{5,})\.json$")


def output_format(out: Path) -> str:
    """The format named by the suffix of `out` ('.parquet', '.csv' or '.jsonl').

    Raises:
        ValueError: any other suffix.
    """
    suffix = out.suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"--out {out}: name the file .parquet, .csv or .jsonl to choose its format")
    if suffix == ".parquet":
        require_pyarrow()
    return suffix


def require_pyarrow():
    """pyarrow, imported on first use, or an error that says how to install it."""
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise ValueError(
            "writing .parquet needs pyarrow: pip install 'vitscope[batch]' (or name the output .csv or .jsonl)"
        ) from None
    return pyarrow


def table_row(row: dict[str, Any]) -> dict[str, Any]:
    """A vit-predict row flattened for a table: `predictions` becomes label_1, score_1, label_2, ..."""
    flat: dict[str, Any] = {}
    for key, value in row.items():
        if key == "predictions":
            for rank, pred in enumerate(value, start=1):
                flat[f"label_{rank}"] = pred["label"]
                flat[f"score_{rank}"] = pred["score"]
        else:
            flat[key] = value
    return flat


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
    with _create(tmp) as f, _removed_on_error(tmp):
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    _replace_durably(tmp, path)


@contextmanager
def _removed_on_error(tmp: Path) -> Iterator[None]:
    """Delete the temporary file this block writes if the block fails (a full disk): it would hold on to the space
    the user must free, and none but a resume would ever remove it."""
    try:
        yield
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def parquet_text(value: Any) -> Any:
    """A str as valid UTF-8 for Parquet: the bytes of a file name that is not UTF-8 as `\\xff` (backslashreplace)."""
    if isinstance(value, str):
        return value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return value


def encode_rows(rows: list[dict[str, Any]], fmt: str, header: bool = True) -> bytes:
    """Rows in the format's bytes (one part's data file); a path that is not UTF-8 as the module says."""
    if fmt == ".jsonl":
        return "".join(json.dumps(r, allow_nan=False) + "\n" for r in rows).encode()
    flat = [table_row(r) for r in rows]
    if fmt == ".csv":
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=list(flat[0]), lineterminator="\n")
        # the "\n" terminator leaves a carriage return in a file name unquoted, which readers take for a line break
        quoted = csv.DictWriter(text, fieldnames=list(flat[0]), lineterminator="\n", quoting=csv.QUOTE_ALL)
        if header:
            writer.writeheader()
        for r in flat:
            row = {k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in r.items()}
            (quoted if "\r" in str(row["path"]) else writer).writerow(row)
        return text.getvalue().encode("utf-8", "surrogateescape")  # a name's own bytes, as the file system has them
    pa = require_pyarrow()
    sink = pa.BufferOutputStream()
    pa.parquet.write_table(pa.Table.from_pylist([{k: parquet_text(v) for k, v in r.items()} for r in flat]), sink)
    return sink.getvalue().to_pybytes()


def lock_folder(fd: int, busy: str) -> int:
    """`fd`, an open folder, locked for this process alone (the kernel lets go however the process ends).

    Raises:
        ValueError: `busy`, when another process holds the lock (`fd` is then closed).
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ValueError(busy) from None
    return fd


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
        _refuse_link(self.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        busy = (
            f"another vit-predict is writing {self.out} (its parts folder {self.dir} is in use): wait for it to "
            "end, or give this run another --out"
        )
        self._held = lock_folder(os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY), busy)

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
        _refuse_link(self.dir)
        if not self.dir.exists():
            self.dir.mkdir(parents=True)
            sync_folder(self.dir.parent)
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
        _refuse_link(self.dir)
        if not self.dir.exists():
            self.dir.mkdir(parents=True)
            sync_folder(self.dir.parent)
        done: set[str] = set()
        failed: list[tuple[str, str]] = []
        indices = []
        for manifest in sorted(self.dir.glob("part-*.json")):
            found = _PART.match(manifest.name)
            if not found:
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
        return sorted(p for p in self.dir.glob(f"part-*{self.fmt}") if (self.dir / f"{p.stem}.json").exists())

    def finish(self, template: dict[str, Any] | None = None) -> None:
        """Merge the parts into `out` (written under a temporary name, flushed, then renamed) and remove the
        parts: the folder is renamed away in one step before it is deleted, so a kill leaves it whole or gone.

        Args:
            template: a row of the job's columns and types: the header of a table no image reached.
        """
        _refuse_link(self.dir)
        tmp = self.out.with_name(self.out.name + ".tmp")
        parts = self.data_files()
        with _create(tmp) as dst, _removed_on_error(tmp):
            if self.fmt == ".parquet":
                _merge_parquet(parts, dst, template)
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
        _replace_durably(tmp, self.out)  # the output is complete: from here on the parts are not needed
        self.remove_old_parts()
        os.rename(self.dir, self.old_dir)
        sync_folder(self.dir.parent)
        self.remove_old_parts()

    def remove_old_parts(self) -> None:
        """Delete the parts folder of an output already merged, if a killed run left it."""
        if self.old_dir.exists() or self.old_dir.is_symlink():
            _refuse_link(self.old_dir)
            shutil.rmtree(self.old_dir)


def _manifest(path: Path) -> dict[str, Any] | None:
    """A part's manifest, or None when it is damaged (then its part was never committed, as far as a run can tell)."""
    try:
        entry = json.loads(path.read_bytes())
        return entry if isinstance(entry.get("paths"), list) and isinstance(entry.get("failed"), list) else None
    except (ValueError, AttributeError):
        return None


def rows_in(path: Path, fmt: str) -> int | None:
    """The rows of a part's data file, or None when it is missing or cut short (an error reading it is raised: the
    part may be whole, and a network disk's hiccup must not throw its work away)."""
    if not path.is_file():
        return None
    if fmt == ".parquet":
        try:
            return require_pyarrow().parquet.read_metadata(path).num_rows
        except ValueError:  # pyarrow's ArrowInvalid: no footer, cut short
            return None
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):  # cut off mid-row
        return None
    if fmt == ".csv":  # a row ends at a line break outside quotes (a file name may hold line breaks)
        data = re.sub(rb'"[^"]*"', b"", data)  # each quoted field, its doubled quotes too
        if b'"' in data:  # a quote left open: cut inside a quoted field
            return None
    return data.count(b"\n") - (fmt == ".csv")


def _merge_parquet(parts: list[Path], dest, template: dict[str, Any] | None) -> None:
    """Parquet parts -> one file, part by part, under the schema they all fit (a part of nulls fits any); no
    parts: no rows, under the `template` row's columns."""
    pa = require_pyarrow()
    pq = pa.parquet
    if not parts:
        empty = pa.table({"path": pa.array([], pa.string())})
        pq.write_table(empty if template is None else pa.Table.from_pylist([table_row(template)]).slice(0, 0), dest)
        return
    schema = pa.unify_schemas([pq.read_schema(p) for p in parts], promote_options="permissive")
    with pq.ParquetWriter(dest, schema) as writer:
        for part in parts:
            writer.write_table(pq.read_table(part).cast(schema))
