"""`vit-predict --ray`: score images on a Ray cluster with Ray Data and write a Parquet directory of parts.

    vit-predict model.onnx photos/ --ray --workers 2 --cpus-per-worker 1 --out preds.parquet

Ray Data holds the list of inputs in blocks and feeds them, a batch of `--batch-size` paths at a time, to
a pool of `--workers` actors. Each actor holds one onnxruntime session with `--cpus-per-worker` intra-op
threads, and reads and decodes its images as the local job does (`serve.runtime.jobs.decoded_batches`: local
paths or fsspec URIs, an unreadable one reported with the same reason), then classifies them. Rows are the ones
the local run writes (`serve.runtime.predict.rows_for`, flattened by `serve.runtime.row_formats.table_row`);
`write_parquet` writes them as the parts of `--out`.

Paths travel to the actors as the file system's bytes and come back as text the way the local Parquet output
writes them (a byte that is not UTF-8 as `\\xff`): Arrow holds neither a str with surrogate escapes nor bytes
as text, and a block it cannot convert is pickled, so that one part's `path` would be binary and the table
unreadable.

Fault tolerance is Ray Data's: an actor that dies is restarted and its batch given again, and a batch's
rows are kept only once it finished, so nothing is lost or written twice. The results (not the images)
are materialised once, so that the unreadable inputs can be reported and left out of the table: a few
hundred bytes per image, held in the object store. The parts are written beside --out and renamed into place
once all are on disk (`serve.cluster.output`): a run stopped while it writes leaves no table with rows missing.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import TextIO

import numpy as np

from serve.cluster.output import OutputFolder
from serve.runtime.classifier import OnnxClassifier
from serve.runtime.interrupts import Terminated, sigterm_as_interrupt
from serve.runtime.jobs import decoded_batches
from serve.runtime.predict import rows_for, template_row
from serve.runtime.row_formats import parquet_text, table_row
from serve.runtime.terminal import one_line

ERROR = "error"  # the column that carries an unreadable input's reason until the table is written


class Scorer:
    """One actor: one onnxruntime session, fed batches of {"path": [file system bytes, ...]} by Ray Data.

    Args:
        model: the .onnx file's bytes (shipped through the object store, so workers need no shared disk).
        threads: onnxruntime intra-op threads (the actor's CPUs).
        top_k: classes per image.
        coverage: also each image's prediction set at this coverage, its unknown verdict and OOD score.
    """

    def __init__(self, model: bytes, threads: int, top_k: int, coverage: float | None = None):
        with tempfile.NamedTemporaryFile(suffix=".onnx", delete=False) as f:
            f.write(model)
        try:
            self.clf = OnnxClassifier(f.name, threads=threads)
        finally:
            os.unlink(f.name)
        self.rows = rows_for(self.clf, top_k, coverage)
        H, W = self.clf.input_size
        probe = self.rows([""], np.zeros((1, H, W, 3), np.uint8))[0]
        self.columns = [*table_row(probe), ERROR]  # every batch has them all, even one of failures only

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        sources = [os.fsdecode(p) for p in batch["path"].tolist()]
        rows = []
        for ok, pixels, failed in decoded_batches(sources, self.clf.prepare, max(1, len(sources)), workers=1):
            rows += [{"path": source, ERROR: reason} for source, reason in failed]
            if pixels is not None:
                rows += [{**table_row(r), ERROR: None} for r in self.rows(ok, pixels)]
        return {k: [parquet_text(r.get(k)) for r in rows] for k in self.columns}


def run_ray(
    model: Path,
    sources: list[str],
    out: Path,
    top_k: int = 5,
    batch_size: int = 32,
    workers: int = 1,
    cpus_per_worker: float = 1,
    address: str | None = None,
    errors: TextIO | None = None,
    coverage: float | None = None,
) -> tuple[int, int]:
    """Classify `sources` on Ray and write `out` as a directory of Parquet parts, renamed into place once whole
    (`serve.cluster.output`); with no sources, Ray is not started and `out` holds the columns alone.

    Args:
        address: a cluster to join ("auto": the one `ray start` runs here); None starts a local Ray.
        workers: actors, each with one session; cpus_per_worker: CPUs each reserves (its threads).
        coverage: add each image's prediction set, unknown verdict and OOD score (as the local run does).

    Returns:
        (classified, failed).

    Raises:
        ValueError: `out` exists, is not named .parquet, or another run is writing it.
    """
    errors = errors or sys.stderr
    folder = OutputFolder(out)
    clf = OnnxClassifier(model, threads=1)  # loads once here: a bad file or coverage fails early
    clf.check_coverage(coverage)
    folder.take(errors)
    try:
        done, failed = (0, 0)
        if sources:
            scorer = (clf.path.read_bytes(), max(1, int(cpus_per_worker)), top_k, coverage)  # `Scorer`'s arguments
            done, failed = _score(sources, folder.tmp, scorer, batch_size, workers, cpus_per_worker, address, errors)
        folder.publish(template_row(min(top_k, len(clf.labels)), coverage, clf.calibrated))
    finally:
        folder.release()
    return done, failed


def _score(
    sources: list[str],
    folder: Path,
    scorer: tuple,
    batch_size: int,
    workers: int,
    cpus_per_worker: float,
    address: str | None,
    errors: TextIO,
) -> tuple[int, int]:
    """`run_ray`'s work on Ray: the rows of the images `Scorer(*scorer)` classified, written into `folder`.

    Returns:
        (classified, failed).
    """
    import ray
    import ray.data

    started = not ray.is_initialized()
    try:
        if started:
            _start(ray, address)
        with sigterm_as_interrupt():  # SIGTERM as Ctrl-C again: ray.init set a handler that exits 15 silently
            have = ray.cluster_resources().get("CPU", 0.0)
            if cpus_per_worker > have:  # Ray would wait for such a node for ever
                why = f"a worker reserves {cpus_per_worker:g} CPUs (--cpus-per-worker) and Ray has {have:g}"
                if started and address is None and not os.environ.get("RAY_ADDRESS"):  # a Ray of this run's own
                    raise ValueError(f"{why}: lower --cpus-per-worker")
                print(f"vit-predict: {why}: waiting for the cluster to add a node (Ctrl-C stops)", file=errors)
            ctx = ray.data.DataContext.get_current()
            ctx.enable_progress_bars = True
            blocks = max(1, min(len(sources) // batch_size, 64 * workers))
            ds = ray.data.from_items([{"path": os.fsencode(s)} for s in sources], override_num_blocks=blocks)
            scored = ds.map_batches(
                Scorer,
                fn_constructor_args=scorer,
                batch_size=batch_size,
                compute=ray.data.ActorPoolStrategy(size=workers),
                num_cpus=cpus_per_worker,  # Ray Data's actors restart and retry their batch without end by default
            ).materialize()
            failed = scored.filter(lambda r: r[ERROR] is not None).take_all()
            for row in failed:
                print(one_line(f"{row['path']}: {row[ERROR]}"), file=errors)  # a line each, as `jobs` prints them
            done = scored.count() - len(failed)
            if done:  # none: `publish` writes the columns, which Ray cannot know from no rows
                scored.filter(lambda r: r[ERROR] is None).drop_columns([ERROR]).write_parquet(str(folder.resolve()))
            return done, len(failed)
    finally:
        if started:
            ray.shutdown()


def _start(ray, address: str | None) -> None:
    """`ray.init`, with a SIGTERM during it stopping the run as one after it does (Ray's own handler, set first thing
    in `init`, exits 15 without a word)."""
    try:
        ray.init(address=address, log_to_driver=False, include_dashboard=False, logging_level="WARNING")
    except SystemExit as e:
        if e.code == signal.SIGTERM:
            raise Terminated("terminated") from None
        raise
