"""Large vit-predict jobs on one machine: many inputs, decoding beside inference, results in resumable parts.

    sources, problems = collect_sources(["photos/", "s3://bucket/night/"], from_list=None, errors=sys.stderr)
    done, failed = score_to_file(clf, sources, Path("preds.parquet"), rows_for, resume=True)

Inputs are local files and folders (searched recursively), and URIs (`s3://...`, `gs://...`, `https://...`)
read through fsspec when it is installed, a prefix standing for every image file below it. Decoding runs
in a pool of threads a few batches ahead of the model, so while onnxruntime classifies one batch (it
releases the GIL) the next ones are being read, decoded and resized: the model, not the loader, sets the pace.

A folder is searched as training searches one (`train.folder_scan.find_image_files`): hidden files and folders
(`.DS_Store`, `.ipynb_checkpoints/`) are not inputs, and a link whose target is gone is one, so that reading it
reports it like any other unreadable image.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TextIO

import numpy as np
from tqdm import tqdm

from serve.runtime.image_files import is_image_file, walk_image_files
from serve.runtime.images import ImageError, PixelBudget
from serve.runtime.input_lists import listed_inputs
from serve.runtime.outputs import PartStore
from serve.runtime.row_formats import output_format, parquet_text
from serve.runtime.terminal import one_line

# Shapes: B batch, H/W the model's input, K classes.

PROGRESS_MIN_FILES = 20  # a bar for a handful of files is noise
DEFAULT_PART_SIZE = 4096  # images per committed part: a killed run redoes at most this many
ROW_FIELDS = "path, predictions, prediction_set, unknown, ood_score"  # what every row holds (`job_record`)
# pixels decoding at once across the decode threads, as the server's --decode-pixel-budget: a 90 kB PNG can declare
# 40 MP of 16-bit pixels, hundreds of MB to decode, and 8 threads each decoding one at once would hold gigabytes
DECODE_PIXEL_BUDGET = 40_000_000
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
    try:
        fs, path = _fsspec().core.url_to_fs(uri)
    except ImportError as e:  # the scheme's backend: s3fs for s3://, aiohttp for http:// (fsspec says which)
        raise ValueError(f"{uri}: {e}") from None
    except ValueError as e:  # fsspec's "Protocol not known: s4": say which input has it
        raise ValueError(f"{uri}: {e} (a typo in the scheme, or a file system fsspec has no backend for)") from None
    if fs.isdir(path):
        return sorted(fs.unstrip_protocol(p) for p in fs.find(path) if is_image_file(p))
    return [uri] if fs.exists(path) else []


def find_images(folder: str | Path, errors: TextIO) -> tuple[list[str], int]:
    """The image files under `folder` (recursive, sorted), hidden files and folders left out, as training finds them.

    A link whose target is gone (or that loops), and an entry that is no regular file (a named pipe, a socket),
    stay in: reading one fails without waiting (`serve.runtime.images.open_image`), and it is reported with the
    reason, as a broken image is, rather than dropped without a word.

    Returns:
        (files, problems): a folder that cannot be listed would hide its images, so it is reported on `errors`
        and counted.
    """
    found, unlisted = walk_image_files(folder)
    for e in unlisted:
        print(one_line(f"{e.filename}: folder cannot be read: {e.strerror}"), file=errors)
    return found, len(unlisted)


def collect_sources(
    paths: Sequence[str | Path], errors: TextIO, from_list: Path | None = None
) -> tuple[list[Source], int]:
    """Files as given, image files under folders and URI prefixes, and the lines of `from_list`.

    Args:
        paths: local files, folders and URIs.
        errors: where a missing path, an empty folder or one that cannot be listed is reported, one line each.
        from_list: a text file of paths or URIs, one a line (`serve.runtime.input_lists`).

    Returns:
        (sources, problems): each input once, in order; problems counts the missing, empty and unlisted ones.
    """
    items = [str(p) for p in paths] + ([] if from_list is None else listed_inputs(Path(from_list), errors))
    sources: dict[str, str] = {}  # ordered and each input once: a file named twice (`a/x.png`, `./a/x.png`) is one row
    problems = 0
    for item in items:
        unlisted = 0
        if is_uri(item):
            try:
                found = _expand_uri(item)
            except ValueError:  # the scheme's storage backend is not installed: every such URI would fail alike
                raise
            except Exception as e:  # a host that refuses, does not resolve or answers 403: this input's, not the run's
                found = []
                why = (str(e).strip().splitlines() or [type(e).__name__])[0]
                print(one_line(f"{item}: cannot be reached or listed ({why})"), file=errors)
            else:
                if not found:
                    print(one_line(f"{item}: no such object, or no image files under this prefix"), file=errors)
        elif Path(item).is_dir():
            found, unlisted = find_images(item, errors)
            if not found and not unlisted:
                print(one_line(f"{item}: no image files in this folder"), file=errors)
        elif Path(item).exists():
            found = [item]
        else:
            found = []
            print(one_line(f"{item}: no such file or folder"), file=errors)
        problems += unlisted or not found
        for f in found:
            sources.setdefault(source_key(f), f)
    return list(sources.values()), problems


def source_key(source: Source) -> str:
    """What names the same input however it is written: a URI as it is, a path made absolute and normal."""
    return source if is_uri(source) else os.path.abspath(source)


def why_unreadable(source: Source, error: Exception) -> str:
    """The reason reported for an input that could not be read: the error's, or for a link to nothing, that."""
    if not is_uri(source) and os.path.islink(source) and not os.path.exists(source):
        return f"a symbolic link to {os.readlink(source)}, which does not exist (or loops)"
    return str(error)


def read_source(source: Source) -> str | bytes:
    """What `OnnxClassifier.prepare` takes: the path itself (a `file://` URI's too: a named pipe is refused, not
    waited on for ever, as for a plain path), or a URI's bytes."""
    if not is_uri(source):
        return source
    fs, path = _fsspec().core.url_to_fs(source)
    from fsspec.implementations.local import LocalFileSystem  # installed: _fsspec said so

    if isinstance(fs, LocalFileSystem):
        return path
    try:
        with fs.open(path, "rb") as f:
            return f.read()
    except OSError:
        raise
    except Exception as e:  # the backend's own errors (aiohttp's for an HTTP 503 or 429): this input's, not the run's
        raise OSError(f"cannot be read ({type(e).__name__}: {e})") from e


def decoded_batches(
    sources: Sequence[Source], prepare: Callable[[Any, PixelBudget], np.ndarray], batch_size: int, workers: int
) -> Iterator[tuple[list[Source], np.ndarray | None, list[tuple[Source, str]]]]:
    """Batches decoded by `workers` threads, up to 2 * workers batches ahead of the consumer, in order; the threads
    share one budget of pixels decoding at once (`DECODE_PIXEL_BUDGET`).

    Yields:
        (ok, pixels (B, H, W, 3) uint8 or None when none of them decoded, failed [(source, reason)]).
    """
    budget = PixelBudget(DECODE_PIXEL_BUDGET)

    def decode(group: Sequence[Source]):
        ok, pixels, failed = [], [], []
        for s in group:
            try:
                pixels.append(prepare(read_source(s), budget))
                ok.append(s)
            except (ImageError, OSError) as e:  # OSError: unreadable, vanished, or a storage error
                failed.append((s, why_unreadable(s, e)))
        return ok, (np.stack(pixels) if pixels else None), failed

    groups = (sources[i : i + batch_size] for i in range(0, len(sources), batch_size))
    pool = ThreadPoolExecutor(workers, thread_name_prefix="decode")
    try:
        pending: list[Future] = []
        for group in groups:
            pending.append(pool.submit(decode, group))
            if len(pending) > 2 * workers:
                yield pending.pop(0).result()
        for future in pending:
            yield future.result()
    finally:  # stopped early (Ctrl-C, a full disk): the batches not yet started are dropped, not decoded
        pool.shutdown(cancel_futures=True)


def usable_cores() -> int:
    """CPU cores this process may run on (the affinity mask where the OS has one, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def default_decode_workers() -> int:
    """Decoding threads: one per core, at most 8 (beyond that the model is the bottleneck anyway)."""
    return max(1, min(8, usable_cores()))


def job_record(model_sha256: str, top_k: int, coverage: float | None) -> dict[str, Any]:
    """What decides a job's rows, kept with its parts so that --resume can refuse to go on under another.

    The model is known by its content (`OnnxClassifier.sha256`, of the bytes the run loaded), not its name or time:
    a model exported again in place gives other answers, a copy of it the same ones. --top-k sets the columns and
    --coverage fills some. The format is the suffix of --out, which names the parts folder itself; --batch-size,
    --threads, --decode-threads and --part-size change no row, so a resume may change them. `row fields` names the
    fields each row has: parts written before rows had unknown and ood_score without --coverage are refused, not
    merged with rows of other columns.
    """
    return {"model_sha256": model_sha256, "--top-k": top_k, "--coverage": coverage, "row fields": ROW_FIELDS}


def _difference(model: Path, was: dict[str, Any], now: dict[str, Any]) -> str:
    """What differs between the job `was` and this run's `now`, the model first, in a few words."""
    key = next(k for k in [*now, *was] if was.get(k) != now.get(k))
    option = lambda value: f"no {key}" if value is None else f"{key} {value}"
    if key == "model_sha256":
        return f"another model file (sha256 {str(was.get(key))[:12]}; {model} is now {str(now[key])[:12]})"
    return f"{option(was.get(key))}, this run has {option(now.get(key))}"


def _mismatch(out: Path, parts: Path, model: Path, was: dict[str, Any], now: dict[str, Any]) -> str:
    """One line: what differs between the job the parts were written under and this run's, and what to do."""
    what = _difference(model, was, now)
    return (
        f"--resume: {out} was started with {what}: resume it with the model and options it started with, or run "
        f"without --resume and with a new --out (or remove {parts}) to start over"
    )


def _open_parts(out: Path, resume: bool, errors: TextIO, job: dict[str, Any] | None, model: Path) -> PartStore | None:
    """The parts of `out` this run goes on with, checked before any input is read; None when `out` is complete.

    Raises:
        ValueError: another run is writing `out`; `out` exists without `resume`, names no known format, or is
            complete under another `job` or with no record of its job.
    """
    store = PartStore(out)
    store.check_not_in_use()  # a retry while the first run still writes: --resume would not help it
    if store.exists() and not resume:
        raise ValueError(f"{out} (or its parts) exists: add --resume to finish that run, or remove it to start over")
    if resume and store.out.exists() and not store.dir.exists():
        store.remove_old_parts()  # a run killed after its merge, while it deleted its parts
        was, now = store.finished_job(), json.loads(json.dumps(job))
        if job is not None and was is None:  # moved or copied without its record, or not ours: no telling
            raise ValueError(
                f"--resume: {out} has no readable record of the model and options that scored it "
                f"({store.finished_record.name} beside it: moved or copied without it, damaged, written by a "
                "vit-predict from before the record, or not a vit-predict table): remove it to score again, or give "
                "a new --out"
            )
        if job is not None and was != now:  # a pipeline's rerun under a new model
            what = _difference(model, was, now)
            raise ValueError(
                f"--resume: {out} is complete, scored with {what}: remove it to score again, or give a new --out"
            )
        print(f"{out} is complete: nothing to resume (remove it to score again)", file=errors)
        return None
    return store


def _check_job(store: PartStore, job: dict[str, Any] | None, model: Path) -> None:
    """Record `job` with a first run's parts, or refuse to go on with parts written under another."""
    if job is not None and (was := store.record(job)) != (now := json.loads(json.dumps(job))):
        raise ValueError(_mismatch(store.out, store.dir, model, was, now))


def _not_done(sources: Sequence[Source], finished: set[str], out: Path, errors: TextIO) -> list[Source]:
    """The sources no earlier run finished, however either names them (`photos/a.png`, `./photos//a.png`)."""
    finished, keys = {source_key(s) for s in finished}, [source_key(s) for s in sources]  # each path made absolute once
    if others := len(finished - set(keys)):
        print(f"{out}: {others:,} earlier result(s) are of inputs this run was not given; they stay in it", file=errors)
    return [s for s, key in zip(sources, keys, strict=True) if key not in finished]


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
    job: dict[str, Any] | None = None,
    template: dict[str, Any] | None = None,
) -> tuple[int, int]:
    """Classify `sources` into `out` in committed parts; with `resume`, only those no earlier run finished.

    Args:
        clf: an `OnnxClassifier` (anything with `prepare`, and the `path` of its model file).
        rows_for: (paths, pixels (B, H, W, 3)) -> one output row per path, as vit-predict prints them (it runs
            the model: `serve.runtime.predict.rows_for`).
        resume: continue the parts an earlier run left; without it, an existing output is an error.
        workers: decoding threads (None: `default_decode_workers`).
        part_size: images per part.
        job: what decides the rows (`job_record`), recorded by the first run; a resume under another is refused
            before any input is read: its rows would not fit those of the parts, or would mix two models.
        template: a row of the columns and types `rows_for` gives, for the header of a job no image reached.

    Returns:
        (classified, failed): the inputs classified over the whole job, earlier runs included, and those that could
        not be read in this run (an earlier run's are tried again).

    Raises:
        ValueError: `out` exists without `resume`, names no known format, or was started under another `job`.
    """
    errors = errors or sys.stderr
    store = _open_parts(out, resume, errors, job, clf.path)
    if store is None:  # finished by an earlier run: an input with no row in it is not passed off as done
        paths = PartStore(out).output_paths()
        have = set(paths) | {source_key(p) for p in paths}  # as the rows name them, or where that is from here
        named = parquet_text if output_format(out) == ".parquet" else str  # as the rows write a name not UTF-8
        if missing := [s for s in sources if named(s) not in have and named(source_key(s)) not in have]:
            print(
                one_line(
                    f"{out}: {len(missing):,} of this run's inputs have no row in it (unreadable then, or given "
                    f"since), such as {missing[0]}: remove it, or give another --out, to score them"
                ),
                file=errors,
            )
        return len(paths), len(missing)
    store.lock()
    try:
        _check_job(store, job, clf.path)
        return _fill(store, clf.prepare, sources, rows_for, batch_size, workers, part_size, errors, template)
    finally:  # finished, refused, failed or stopped: the next run may go on
        store.unlock()


def _fill(store: PartStore, prepare, sources, rows_for: RowsFor, batch_size, workers, part_size, errors, template):
    """`score_to_file`'s work, on the locked `store`: (classified, failed) over the whole job."""
    done, _ = store.committed()  # an earlier run's unreadable inputs are tried again: a copy may have finished since
    todo = _not_done(sources, done, store.out, errors)
    classified = len(done)
    rows: list[dict[str, Any]] = []
    failed: list[tuple[str, str]] = []
    part_failed: list[tuple[str, str]] = []
    show = len(sources) >= PROGRESS_MIN_FILES
    with tqdm(total=len(sources), initial=len(sources) - len(todo), unit="img", file=errors, disable=not show) as bar:
        for ok, pixels, bad in decoded_batches(todo, prepare, batch_size, workers or default_decode_workers()):
            for source, reason in bad:
                tqdm.write(one_line(f"{source}: {reason}"), file=errors)  # one line per file, path first
            if pixels is not None:
                rows.extend(rows_for(ok, pixels))
            part_failed.extend(bad)
            if len(rows) + len(part_failed) >= part_size:
                store.commit(rows, part_failed, [source_key(r["path"]) for r in rows])
                classified += len(rows)
                failed.extend(part_failed)
                rows, part_failed = [], []
            bar.update(len(ok) + len(bad))
    store.commit(rows, part_failed, [source_key(r["path"]) for r in rows])  # keys: resumed from anywhere, the same
    store.finish(template)
    return classified + len(rows), len(failed) + len(part_failed)
