"""Large vit-predict jobs on one machine: many inputs, decoding beside inference, results in resumable parts.

    sources, problems = collect_sources(["photos/", "s3://bucket/night/"], from_list=None, errors=sys.stderr)
    done, failed = score_to_file(clf, sources, Path("preds.parquet"), rows_for, resume=True)

Inputs are local files and folders (searched recursively), and URIs (`s3://...`, `gs://...`, `https://...`)
read through fsspec when it is installed, a prefix standing for every image file below it. Decoding runs
in a pool of threads a few batches ahead of the model, so while onnxruntime classifies one batch (it
releases the GIL) the next ones are being read, decoded and resized: the model, not the loader, sets the pace.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TextIO

import numpy as np
from tqdm import tqdm

from serve.runtime.images import ImageError, is_image_file
from serve.runtime.outputs import PartStore

# Shapes: B batch, H/W the model's input, K classes.

PROGRESS_MIN_FILES = 20  # a bar for a handful of files is noise
DEFAULT_PART_SIZE = 4096  # images per committed part: a killed run redoes at most this many
Source = str  # a local path as given, or a URI
RowsFor = Callable[[list[str], np.ndarray], list[dict[str, Any]]]  # (paths, (B, H, W, 3) pixels) -> rows


def is_uri(source: str) -> bool:
    """True for `scheme://...` (object storage, HTTP); a plain path otherwise (`file://` counts as a URI)."""
    return "://" in source


def _fsspec():
    try:
        import fsspec
    except ImportError:
        raise ValueError("reading URIs needs fsspec: pip install 'vitscope[batch]' (and s3fs or gcsfs)") from None
    return fsspec


def _expand_uri(uri: str) -> list[str]:
    """A URI to one file, or every image file under a prefix (sorted); [] when nothing is there."""
    fs, path = _fsspec().core.url_to_fs(uri)
    if fs.isdir(path):
        return sorted(fs.unstrip_protocol(p) for p in fs.find(path) if is_image_file(p))
    return [uri] if fs.exists(path) else []


def collect_sources(
    paths: Sequence[str | Path], errors: TextIO, from_list: Path | None = None
) -> tuple[list[Source], int]:
    """Files as given, image files under folders and URI prefixes, and the lines of `from_list`.

    Args:
        paths: local files, folders and URIs.
        errors: where a missing path or an empty folder is reported, one line each.
        from_list: a text file of paths or URIs, one a line (blank lines and `#` comments skipped).

    Returns:
        (sources, problems): each input once, in order; problems counts the missing and empty ones.
    """
    items = [str(p) for p in paths]
    if from_list is not None:
        lines = Path(from_list).read_text().splitlines()
        items += [s.strip() for s in lines if s.strip() and not s.lstrip().startswith("#")]
    sources: dict[str, None] = {}  # ordered and each input once: a file named twice is still one row
    problems = 0
    for item in items:
        if is_uri(item):
            found = _expand_uri(item)
            if not found:
                print(f"{item}: no such object, or no image files under this prefix", file=errors)
        elif Path(item).is_dir():
            found = sorted(str(f) for f in Path(item).rglob("*") if f.is_file() and is_image_file(f))
            if not found:
                print(f"{item}: no image files in this folder", file=errors)
        elif Path(item).exists():
            found = [item]
        else:
            found = []
            print(f"{item}: no such file or folder", file=errors)
        problems += not found
        sources.update(dict.fromkeys(found))
    return list(sources), problems


def read_source(source: Source) -> str | bytes:
    """What `OnnxClassifier.prepare` takes: the path itself, or a URI's bytes."""
    if not is_uri(source):
        return source
    with _fsspec().open(source, "rb") as f:
        return f.read()


def decoded_batches(
    sources: Sequence[Source], prepare: Callable[[Any], np.ndarray], batch_size: int, workers: int
) -> Iterator[tuple[list[Source], np.ndarray | None, list[tuple[Source, str]]]]:
    """Batches decoded by `workers` threads, up to 2 * workers batches ahead of the consumer, in order.

    Yields:
        (ok, pixels (B, H, W, 3) uint8 or None when none of them decoded, failed [(source, reason)]).
    """

    def decode(group: Sequence[Source]):
        ok, pixels, failed = [], [], []
        for s in group:
            try:
                pixels.append(prepare(read_source(s)))
                ok.append(s)
            except (ImageError, OSError) as e:  # OSError: unreadable, vanished, or a storage error
                failed.append((s, str(e)))
        return ok, (np.stack(pixels) if pixels else None), failed

    groups = (sources[i : i + batch_size] for i in range(0, len(sources), batch_size))
    with ThreadPoolExecutor(workers, thread_name_prefix="decode") as pool:
        pending: list[Future] = []
        for group in groups:
            pending.append(pool.submit(decode, group))
            if len(pending) > 2 * workers:
                yield pending.pop(0).result()
        for future in pending:
            yield future.result()


def default_decode_workers() -> int:
    """Decoding threads: one per core, at most 8 (beyond that the model is the bottleneck anyway)."""
    return max(1, min(8, os.cpu_count() or 1))


def score_to_file(
    clf,
    sources: Sequence[Source],
    out: Path,
    rows_for: RowsFor,
    batch_size: int = 32,
    resume: bool = False,
    workers: int | None = None,
    part_size: int = DEFAULT_PART_SIZE,
    errors: TextIO | None = None,
) -> tuple[int, int]:
    """Classify `sources` into `out` in committed parts; with `resume`, only those no earlier run finished.

    Args:
        clf: an `OnnxClassifier` (anything with `prepare`).
        rows_for: (paths, pixels (B, H, W, 3)) -> one output row per path, as vit-predict prints them (it runs
            the model: `serve.runtime.predict.rows_for`).
        resume: continue the parts an earlier run left; without it, an existing output is an error.
        workers: decoding threads (None: `default_decode_workers`).
        part_size: images per part.

    Returns:
        (classified, failed): over the whole job, earlier runs included.

    Raises:
        ValueError: `out` exists without `resume`, or names no known format.
    """
    errors = errors or sys.stderr
    store = PartStore(out)
    if store.exists() and not resume:
        raise ValueError(f"{out} (or its parts) exists: add --resume to finish that run, or remove it to start over")
    if resume and store.out.exists() and not store.dir.exists():
        store.remove_old_parts()  # a run killed after its merge, while it deleted its parts
        print(f"{out} is complete: nothing to resume (remove it to score again)", file=errors)
        return store.count_rows(), 0
    done, failed = store.committed()
    for source, reason in failed:  # an earlier run's unreadable files, reported again with this run's result
        print(f"{source}: {reason}", file=errors)
    finished = done | {s for s, _ in failed}
    todo = [s for s in sources if s not in finished]
    classified = len(done)
    rows: list[dict[str, Any]] = []
    part_failed: list[tuple[str, str]] = []
    show = len(sources) >= PROGRESS_MIN_FILES
    with tqdm(total=len(sources), initial=len(sources) - len(todo), unit="img", file=errors, disable=not show) as bar:
        for ok, pixels, bad in decoded_batches(todo, clf.prepare, batch_size, workers or default_decode_workers()):
            for source, reason in bad:
                tqdm.write(f"{source}: {reason}", file=errors)  # one line per file, path first
            if pixels is not None:
                rows.extend(rows_for(ok, pixels))
            part_failed.extend(bad)
            if len(rows) + len(part_failed) >= part_size:
                store.commit(rows, part_failed)
                classified += len(rows)
                failed.extend(part_failed)
                rows, part_failed = [], []
            bar.update(len(ok) + len(bad))
    store.commit(rows, part_failed)
    store.finish()
    return classified + len(rows), len(failed) + len(part_failed)
