"""`vit-predict`: classify image files and folders with an exported model, no torch needed.

    vit-predict artifacts/sample.onnx photo.jpg data/digits/ --top-k 3 --format csv > predictions.csv
    vit-predict artifacts/sample.onnx data/digits/ --coverage 0.95 --format json
    vit-predict artifacts/sample.onnx data/digits/ --out preds.parquet   # a large job; again with --resume

Without --out, results go to stdout: `json` writes one JSON object per image per line (JSON Lines), `csv` one
row per image and rank; each prediction is a `label` and its `score` (the calibrated probability when
the file carries calibration, as the HTTP API names it; `null` in JSON when the model gives no finite
number). On stdout each image also gets `unknown` (unlike the training images) and `ood_score` (higher:
less like them), and with `--coverage` its `prediction_set`, the labels that hold the true one with that
probability (`serve.runtime.trust`); CSV adds the columns `in_set`, `unknown` and `ood_score`. Files that cannot be
read are reported on stderr, one per line, and the run goes on. Exit status: 0 when every image was
classified; 1 when some could not be read (every other image's result is still written), so scripts
notice; 2 for a bad model file or arguments, or when stdout cannot be written (a full disk). When
the reader of stdout goes away (`| head`), vit-predict stops quietly with 141, like a Unix tool
ended by SIGPIPE; Ctrl-C ends it with 130 (with --out, what it wrote is kept for --resume).

With --out (.parquet, .csv or .jsonl) the job is written in committed parts (`serve.runtime.outputs`) and a
killed run goes on with the same command plus --resume; inputs may then also be URIs and a --from-list
file, and decoding runs beside the model (`serve.runtime.jobs`). With --coverage the file also has the columns
`prediction_set` (a list; JSON text in CSV), `unknown` and `ood_score`. With --ray it runs on a Ray cluster
(`serve.cluster`).
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import numpy as np
from tqdm import tqdm

from serve.runtime.classifier import OnnxClassifier
from serve.runtime.image_files import link_loop
from serve.runtime.images import ImageError
from serve.runtime.interrupts import exit_code, sigterm_as_interrupt
from serve.runtime.jobs import (
    DEFAULT_PART_SIZE,
    collect_sources,
    is_uri,
    job_record,
    score_to_file,
    usable_cores,
    why_unreadable,
)
from serve.runtime.outputs import PARTS_SUFFIX
from serve.runtime.row_formats import csv_line
from serve.runtime.terminal import one_line
from serve.runtime.trust import Prediction

PROGRESS_MIN_FILES = 20  # a bar for a handful of files is noise
EXIT_BROKEN_PIPE = 128 + 13  # what a shell reports for a process ended by SIGPIPE
MAX_DECODE_THREADS = 256  # more than cores pays only for reads that wait (object storage); beyond this, memory
# a batch is held whole, and --out decodes up to 2 x --decode-threads of them ahead (`jobs.decoded_batches`): 1,024
# images of 224 x 224 are 150 MB of pixels a batch, 2.6 GB at 8 threads; 1e9 held every input in one batch
MAX_BATCH_SIZE = 1024


class OutputError(Exception):
    """stdout could not be written (a full disk, a closed file); `cause` is the OSError."""

    def __init__(self, cause: OSError):
        super().__init__(cause.strerror or str(cause))
        self.cause = cause


def collect_files(paths: list[Path], errors: TextIO) -> tuple[list[Path], int]:
    """Files as given, and the image files under folders, each once, as the --out job finds them
    (`jobs.collect_sources`).

    Returns:
        (files, problems): a missing path, a folder without images or one that cannot be listed is reported
        and counted.
    """
    sources, problems = collect_sources(paths, errors)
    return list(map(Path, sources)), problems


def _batches(files: list[Path], batch_size: int) -> Iterator[list[Path]]:
    for i in range(0, len(files), batch_size):
        yield files[i : i + batch_size]


def _score(prob: float) -> float | None:
    """A score for JSON: rounded, and None (null) for NaN or infinity, which JSON cannot hold."""
    return round(prob, 6) if math.isfinite(prob) else None


def result_row(path: str | Path, top: list[tuple[str, float]] | Prediction) -> dict:
    """One image's result as vit-predict writes it: the JSON Lines object, and a row of the --out file; a
    `Prediction` adds its prediction set, unknown verdict and OOD score."""
    row = {"path": str(path), "predictions": [{"label": label, "score": _score(prob)} for label, prob in top]}
    if isinstance(top, Prediction):
        ood = None if top.ood_score is None else _score(top.ood_score)
        row.update(prediction_set=top.prediction_set, unknown=top.unknown, ood_score=ood)
    return row


def template_row(k: int, coverage: float | None, calibrated: bool = True) -> dict:
    """A row of the columns and types `rows_for` writes, for the header of an output no image reached."""
    top, sure = [("", 0.0)] * k, (False, 0.0) if calibrated else (None, None)
    return result_row("", Prediction(top, None if coverage is None else [""], *sure))


def rows_for(clf: OnnxClassifier, top_k: int, coverage: float | None = None):
    """(paths, pixels (B, H, W, 3)) -> their result rows, the objects vit-predict prints: what `jobs.score_to_file`
    and the Ray job write. Each holds its unknown verdict and OOD score (null from an uncalibrated file) and, with
    `coverage`, its prediction set (`result_row`)."""
    clf.check_coverage(coverage)

    def rows(paths: list[str], pixels: np.ndarray) -> list[dict]:
        tops = clf.predictions(clf.assess(pixels, coverage), top_k)
        return [result_row(p, top) for p, top in zip(paths, tops, strict=True)]

    return rows


class _Writer:
    """Results to `out` as JSON Lines or CSV; write errors become `OutputError` (BrokenPipeError stays itself).

    A file name that is not UTF-8 (a str with surrogate escapes) goes into CSV as its own bytes, as the --out CSV
    writes it (`serve.runtime.outputs`); JSON writes the escape.
    """

    def __init__(self, fmt: str, out: TextIO):
        self.fmt, self.out = fmt, out
        if fmt == "csv":
            self._row(["path", "rank", "label", "score", "in_set", "unknown", "ood_score"])

    def write(self, path: Path, top: Prediction) -> None:
        if self.fmt == "csv":
            ood = "" if top.ood_score is None else _score(top.ood_score)
            unknown = "" if top.unknown is None else str(top.unknown).lower()
            for rank, (label, prob) in enumerate(top, start=1):
                in_set = "" if top.prediction_set is None else str(label in top.prediction_set).lower()
                self._row([str(path), rank, label, f"{prob:.6f}", in_set, unknown, "" if ood is None else ood])
        else:
            line = json.dumps(result_row(path, top), allow_nan=False)
            self._guard(self.out.write, line + "\n")

    def _row(self, row: list) -> None:
        line = csv_line(row)
        try:
            self._guard(self.out.write, line)
        except UnicodeEncodeError:  # a name's surrogate escapes: its own bytes, below the text layer
            buffer = getattr(self.out, "buffer", None)
            if buffer is None:
                raise
            self.flush()
            self._guard(buffer.write, line.encode(self.out.encoding, "surrogateescape"))

    def flush(self) -> None:
        self._guard(self.out.flush)

    @staticmethod
    def _guard(fn, *args) -> None:
        try:
            fn(*args)
        except BrokenPipeError:
            raise
        except OSError as e:
            raise OutputError(e) from None


def run(
    model: Path,
    paths: list[Path],
    top_k: int = 5,
    fmt: str = "json",
    batch_size: int = 32,
    threads: int | None = None,
    out: TextIO | None = None,
    errors: TextIO | None = None,
    coverage: float | None = None,
) -> tuple[int, int]:
    """Classify every image under `paths`, writing results to `out` and unreadable files to `errors`.

    With `coverage`, each image also gets its prediction set; a coverage the file cannot honour is a
    ValueError before any image is read.

    Returns:
        (classified, failed) counts; failed also counts missing paths and folders without images.
    """
    out, errors = out or sys.stdout, errors or sys.stderr
    clf = OnnxClassifier(model, threads=threads)
    clf.check_coverage(coverage)
    files, failed = collect_files(paths, errors)
    writer = _Writer(fmt, out)
    done = 0
    with tqdm(total=len(files), unit="img", file=sys.stderr, disable=len(files) < PROGRESS_MIN_FILES) as bar:
        for group in _batches(files, batch_size):
            ok, pixels = [], []
            for f in group:
                try:
                    pixels.append(clf.prepare(f))
                    ok.append(f)
                except (ImageError, OSError) as e:
                    failed += 1
                    tqdm.write(one_line(f"{f}: {why_unreadable(str(f), e)}"), file=errors)  # a line a file, path first
            if pixels:
                answers = clf.predictions(clf.assess(np.stack(pixels), coverage), top_k)
                for f, top in zip(ok, answers, strict=True):
                    writer.write(f, top)
                done += len(ok)
            writer.flush()
            bar.update(len(group))
    return done, failed


STDOUT_SUFFIX = {"json": ".jsonl", "csv": ".csv"}  # --format, and the --out suffix of the same rows


def build_parser() -> argparse.ArgumentParser:
    """vit-predict's arguments; `serve.cluster.cli` adds the Ray ones to the same parser."""
    p = argparse.ArgumentParser(prog="vit-predict", description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path, help="an .onnx file written by vit-export")
    p.add_argument(
        "paths", nargs="*", metavar="PATH", help="image files or folders (searched recursively); with --out also URIs"
    )
    p.add_argument("--top-k", type=int, default=5, help="classes per image (default 5)")
    p.add_argument(
        "--format",
        choices=list(STDOUT_SUFFIX),
        help="on standard output, json (the default): one object per line; csv: rows (--out: its suffix says)",
    )
    p.add_argument(
        "--batch-size", type=int, default=32, help=f"images per onnxruntime call (default 32, at most {MAX_BATCH_SIZE})"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="onnxruntime intra-op threads (default: 1 for small models, every core for large ones)",
    )
    p.add_argument(
        "--coverage",
        type=float,
        default=None,
        help="also give each image its prediction set: the labels that hold the true one with this probability, "
        "e.g. 0.95 (needs a calibrated file; with --out adds the columns prediction_set, unknown, ood_score)",
    )
    job = p.add_argument_group("large jobs (--out)")
    job.add_argument("--out", type=Path, help="write the results to this .parquet, .csv or .jsonl file, in parts")
    job.add_argument("--resume", action="store_true", help="finish the --out file a killed run left")
    job.add_argument("--from-list", type=Path, metavar="FILE", help="a text file of paths or URIs, one a line")
    job.add_argument("--decode-threads", type=int, default=None, help="threads decoding images (default: the cores)")
    job.add_argument(
        "--part-size", type=int, default=DEFAULT_PART_SIZE, help=f"images per part (default {DEFAULT_PART_SIZE})"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Command line entry point (`vit-predict`)."""
    p = build_parser()
    return run_args(p, p.parse_args(argv))


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse arguments no job can run with a usage error (exit 2), before any work; `serve.cluster.cli` checks a
    --ray job with it too, before Ray starts."""
    if args.top_k < 1 or args.batch_size < 1 or args.part_size < 1:
        p.error("--top-k, --batch-size and --part-size must be at least 1")
    if args.batch_size > MAX_BATCH_SIZE:
        p.error(f"--batch-size must be 1 to {MAX_BATCH_SIZE}, got {args.batch_size}")
    if not args.paths and not args.from_list:
        p.error("give image files or folders, or --from-list FILE")
    if args.out is None and (args.from_list or args.resume or any(is_uri(s) for s in args.paths)):
        p.error("--from-list, URIs and --resume need --out FILE")
    if args.out is not None:
        _check_out(p, args.out)
    if args.format is None:
        args.format = "json"
    elif args.out is not None and args.out.suffix.lower() != STDOUT_SUFFIX[args.format]:
        p.error(
            f"--format {args.format} is for standard output: --out is written in the format of its suffix; leave "
            "--format out, or name --out with the suffix of the format you want (.parquet, .csv or .jsonl)"
        )
    cores = usable_cores()
    if args.threads is not None and not 0 <= args.threads <= cores:  # 1,000 took a minute for one image
        p.error(f"--threads must be 0 (every core) to {cores} (this machine's cores), got {args.threads}")
    if args.decode_threads is not None and not 1 <= args.decode_threads <= MAX_DECODE_THREADS:
        p.error(f"--decode-threads must be 1 to {MAX_DECODE_THREADS}, got {args.decode_threads}")


def _check_out(p: argparse.ArgumentParser, out: Path) -> None:
    """Refuse an --out no job can write, before any work: a folder; a link that loops, or one to nothing (the job
    would replace the link with its table and write nothing where it points; a link to a file is an output that
    exists, refused without --resume as any is); a name the file system refuses (too long), in one line as an
    input's is."""
    if why := link_loop(out):
        p.error(f"--out {why}")
    try:
        is_dir, dangling = stat.S_ISDIR(out.stat().st_mode), False
    except OSError as e:  # not there (a new table), or a name too long, a folder this user cannot search
        if e.errno not in (errno.ENOENT, errno.ENOTDIR):
            p.exit(2, one_line(f"vit-predict: --out {out}: {e.strerror or e}; give another --out") + "\n")
        is_dir, dangling = False, out.is_symlink()
    if is_dir:
        p.error(f"--out {out} is a folder: give the table's file name (preds.parquet, preds.csv or preds.jsonl)")
    if dangling:
        p.error(
            one_line(
                f"--out {out} is a symbolic link to {os.readlink(out)}, which does not exist: vit-predict would "
                "replace the link with its table; remove the link, or give the file it should point at as --out"
            )
        )


def run_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Check the arguments `p` parsed (`check_args`), run the job (to stdout or to --out) and return the exit status."""
    check_args(p, args)
    try:
        with sigterm_as_interrupt():  # SIGTERM stops the job as Ctrl-C does, parts kept and said
            if args.out is not None:
                done, failed = _run_to_file(args)
            else:
                paths = [Path(s) for s in args.paths]
                done, failed = run(
                    args.model, paths, args.top_k, args.format, args.batch_size, args.threads, coverage=args.coverage
                )
    except (ValueError, FileNotFoundError) as e:
        print(one_line(f"vit-predict: {e}"), file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader left (`| head`): stop quietly, as other tools do
        _drop_stdout()
        return EXIT_BROKEN_PIPE
    except OutputError as e:
        _drop_stdout()
        print(f"vit-predict: cannot write the results to stdout: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the model, a list or the --out folder that cannot be read or written, a full disk
        kept = "; the parts written so far are kept: run it again with --resume" if _has_parts(args.out) else ""
        where = f"{e.filename}: " if e.filename else ""
        print(one_line(f"vit-predict: {where}{e.strerror or e}{kept}"), file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        kept = f": the parts written so far are kept, run the same command with --resume to finish {args.out}"
        print(f"vit-predict: {str(e) or 'interrupted'}{kept if _has_parts(args.out) else ''}", file=sys.stderr)
        return exit_code(e)
    if failed:
        print(f"vit-predict: classified {done} images; {failed} input(s) could not be read", file=sys.stderr)
    return 1 if failed or not done else 0


def _run_to_file(args: argparse.Namespace) -> tuple[int, int]:
    """The --out job on this machine: (classified, failed), missing inputs counted as failed."""
    clf = OnnxClassifier(args.model, threads=args.threads)
    sources, missing = collect_sources(args.paths, sys.stderr, args.from_list)
    done, failed = score_to_file(
        clf,
        sources,
        args.out,
        rows_for(clf, args.top_k, args.coverage),
        batch_size=args.batch_size,
        resume=args.resume,
        workers=args.decode_threads,
        part_size=args.part_size,
        job=job_record(clf.sha256, args.top_k, args.coverage),
        template=template_row(min(args.top_k, len(clf.labels)), args.coverage, clf.calibrated),
    )
    return done, failed + missing


def _has_parts(out: Path | None) -> bool:
    """Whether an --out job has committed parts that a --resume would go on from."""
    return out is not None and any(Path(f"{out}{PARTS_SUFFIX}").glob("part-*.json"))


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so that Python's own flush at exit does not fail a second time, loudly."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout that is no real file (tests capture it): nothing to drop
        pass


if __name__ == "__main__":
    sys.exit(main())
