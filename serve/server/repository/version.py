"""One loaded model version: its classifier, its own batcher (`Engine`), and the checks it passed.

A version takes traffic only after `load_version` has read the file (onnxruntime and the file's own
metadata, which a truncated or half-copied file fails), compared the class names with the folder's
labels.txt, started its engine (the warm-up and the batch size measurement) and run one warm-up batch whose
outputs are finite (the OOD score only where the file has one). Each failure is a `LoadFailure` with a short
`kind` (the label counted in /metrics) and a message that says what to do.
"""

from __future__ import annotations

import gc
import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from serve.runtime.classifier import OnnxClassifier
from serve.runtime.faithfulness import mean_fill
from serve.server.engine import Engine
from serve.server.errors import ApiError

READY, UNAVAILABLE, LOADING, UNLOADING = "READY", "UNAVAILABLE", "LOADING", "UNLOADING"  # Triton's state names
WARM_UP_IMAGES = 2
HOLD_TRIES = 5  # a lookup meets a retired version only when a swap lands in between; five in a row: stopping


class LoadFailure(RuntimeError):
    """A version that must not take traffic; `kind` is one of unreadable, labels, warm_up, non_finite."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class Retired(ApiError):
    """The version has begun to drain: a request that resolved it just before a swap looks it up again
    (`hold_current`); one that meets only retired versions is answered 503 (the server is stopping)."""

    def __init__(self, mv: ModelVersion):
        super().__init__("not_ready", f"version {mv.version} of {mv.name} is being unloaded; retry")


def rss_bytes() -> int:
    """This process's resident memory (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@dataclass(eq=False)
class ModelVersion:
    """A version being served: the routes read `classifier`, `engine`, `fill` and `decode_on_worker`.

    `in_flight` counts the requests that resolved this version and have not finished (`held`): after a swap
    the old version is stopped only once they are done, so no request meets a closed batcher. HTTP and gRPC
    requests count on their own event loops, so the count takes a lock. `drain` marks the version `retired`
    under that lock before it waits, so a request that resolved it but had not counted itself yet is refused
    (`Retired`) rather than missed, and resolves again.
    """

    name: str
    version: str
    classifier: OnnxClassifier
    engine: Engine
    path: Path | None = None
    memory_bytes: int = 0
    stamp: tuple[int, int, int, int] | None = None
    in_flight: int = 0
    fill: np.ndarray | None = None
    decode_on_worker: bool = False
    loaded_at: float = field(default_factory=time.time)
    retired: bool = False
    # the (pixels, logits) specs of `serve.server.api.tensors.tensor_specs`, read by the first request that needs
    # them (this layer sits below the API's and cannot read them itself); HTTP's v2 and gRPC share them
    specs: tuple | None = None
    _count_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self):
        self.fill = mean_fill(self.classifier.preprocess.mean)
        # small uploads decode on the loop when onnxruntime runs one thread, else on the model's thread
        self.decode_on_worker = self.classifier.threads != 1

    def held(self) -> AbstractContextManager[ModelVersion]:
        """Count a request on this version while the block runs: `drain` waits for it.

        Raises:
            Retired: the version drains already; look it up again (`hold_current` does).
        """
        return hold_current(lambda: self, tries=1)

    def _count(self, step: int) -> None:
        with self._count_lock:
            if step > 0 and self.retired:
                raise Retired(self)
            self.in_flight += step

    def drain(self, timeout_s: float) -> bool:
        """Wait for the requests that hold this version (at most `timeout_s`), then stop its engine.

        Returns:
            True when every request finished in time and the batcher drained.
        """
        with self._count_lock:  # from here on no request can start holding it, so the count below only falls
            self.retired = True
        deadline = time.monotonic() + timeout_s
        while self.in_flight > 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        self.engine.stop()
        return self.in_flight == 0 and self.engine.drained


@contextmanager
def hold_current(lookup: Callable[[], ModelVersion], tries: int = HOLD_TRIES) -> Iterator[ModelVersion]:
    """The version `lookup` names, counted in flight while the block runs; one that began to drain since the
    lookup is looked up again (the table names its successor by then), at most `tries` times.

    Raises:
        Retired: every lookup met a version that drains.
    """
    for attempt in range(tries):
        served = lookup()
        try:
            served._count(+1)
            break
        except Retired:
            if attempt == tries - 1:
                raise
    try:
        yield served
    finally:
        served._count(-1)


def load_version(
    name: str,
    version: str,
    path: Path,
    make_engine: Callable[[OnnxClassifier, str, str], Engine],
    threads: int | None,
    labels: list[str] | None = None,
    lock: threading.Lock | None = None,
) -> ModelVersion:
    """Load, check and warm up one version file; it may take traffic once this returns.

    Args:
        name: the model's name (its folder).
        version: the version (its folder's number).
        path: the model.onnx file.
        make_engine: builds the version's engine from (classifier, name, version).
        threads: onnxruntime's intra-op threads (None: by model size).
        labels: the folder's labels.txt, which must match the file's class names (None: no such file).
        lock: held while loading, so that the memory figure counts this version alone.

    Raises:
        LoadFailure: the version must not take traffic; the message says why.
    """
    with lock or threading.Lock():
        before = rss_bytes()
        stamp = _stamp(path)
        try:
            classifier = OnnxClassifier(path, threads=threads)
        except (OSError, ValueError) as e:  # the path once: the runtime's messages mostly name it already
            raise LoadFailure("unreadable", str(e) if str(path) in str(e) else f"{path}: {e}") from None
        if labels is not None and labels != classifier.labels:
            raise LoadFailure(
                "labels", f"{path}: its class names differ from {path.parent.parent}/labels.txt; export both again"
            )
        engine = make_engine(classifier, name, version)
        try:
            _warm_up(engine, classifier, path, stamp)
            return ModelVersion(name, version, classifier, engine, path, max(0, rss_bytes() - before), stamp)
        except BaseException:
            engine.stop()  # whatever fails once the engine started, its thread and session must not outlive it
            raise


def _warm_up(engine: Engine, classifier: OnnxClassifier, path: Path, stamp: tuple[int, int, int, int]) -> None:
    """Start `engine`, check that one warm-up batch gives finite outputs and that the file did not change meanwhile.

    Raises:
        LoadFailure: the version must not take traffic (the caller stops the engine).
    """
    try:
        engine.start()
        H, W = classifier.input_size
        probe = np.random.default_rng(0).integers(0, 256, (WARM_UP_IMAGES, H, W, 3), dtype=np.uint8)
        out = engine.batcher.call(engine.forward, probe).result(60)  # (B,) records: logits, probs, features
    except Exception as e:
        raise LoadFailure("warm_up", f"{path}: the warm-up batch failed: {e}") from None
    # NaN in `ood` is the "no OOD score" of a file without calibration: absent, not broken
    finite = [f for f in out.dtype.names if f != "ood" or classifier.trust is not None]
    if not all(np.isfinite(out[f]).all() for f in finite):
        raise LoadFailure("non_finite", f"{path}: the warm-up batch gave NaN or infinite outputs; do not serve it")
    if stamp != _stamp(path):
        raise LoadFailure("unreadable", f"{path}: the file changed while it was loaded (still being copied?)")


def stamp_of(path: Path) -> tuple[int, int, int, int]:
    """(size, modification time, change time, inode) of a version file: a copy not finished yet, a file rewritten
    in place (as `vit-export --triton-repo` rewrites version 1) and one renamed over it each change it. The change
    time is the kernel's, moved by every write: a same-size rewrite that keeps its modification time (`rsync
    --inplace --times`, retrained weights of the same architecture) changes nothing else. A `chmod` or a hard link
    moves it too: then the file's bytes decide (`file_changed`)."""
    st = path.stat()
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def file_changed(served: ModelVersion, path: Path) -> bool:
    """Whether the file of a served version is no longer the one it was loaded from (False while it is gone). When
    its change time alone moved (a `chmod`, a hard link made or removed), its bytes decide, and a file that still
    holds them keeps serving, under its new stamp."""
    try:
        if served.path != path:
            return True
        stamp = stamp_of(path)
        if stamp == served.stamp:
            return False
        if metadata_only(stamp, served.stamp) and file_digest(path) == served.classifier.sha256:
            served.stamp = stamp  # hashed once, not at every poll
            return False
        return True
    except OSError:
        return False


def metadata_only(stamp, before) -> bool:
    """Whether two `stamp_of` stamps differ in their change time alone: the same size, modification time and inode."""
    return before is not None and (stamp[0], stamp[1], stamp[3]) == (before[0], before[1], before[3])


def file_digest(path: Path) -> str:
    """The SHA-256 of a file's bytes, as `OnnxClassifier.sha256` is of the bytes it loaded."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _stamp(path: Path) -> tuple[int, int, int, int]:
    try:
        return stamp_of(path)
    except OSError as e:
        raise LoadFailure("unreadable", f"{path}: {e}") from None


def freeze_heap(lock: threading.Lock) -> None:
    """Put every object alive now (a loaded version's session, metadata and calibration arrays, the app's routes,
    the modules) out of the cyclic garbage collector's reach (`gc.freeze`), after one last collection.

    A server builds these once and keeps them, yet each full collection walked them all again, stalling every
    request in flight: the p99 latency and the throughput of the sample both suffered (`benchmarks.serve_ab`).
    Frozen objects are still freed by reference counting; reference cycles among them (an `Engine` and its
    `MicroBatcher` make one) wait for `release_heap`.
    """
    with lock:
        gc.collect()
        gc.freeze()


def release_heap(lock: threading.Lock) -> None:
    """Collect the cycles of a retired version, then freeze what is left again (`freeze_heap`).

    A frozen cycle is never collected, so without this each retired version kept its session, its arrays and
    its threads for good. Unfreezing on retire frees any cycle, wherever it forms, for the price of one more
    full collection per rollout (a load pays one already); breaking the engine's one cycle would have left
    every future cycle to leak again. See the commit that added it for the measurement.
    """
    with lock:
        gc.unfreeze()
        gc.collect()
        gc.freeze()


def load_ready(classifier: OnnxClassifier, engine: Engine, name: str, version: str) -> ModelVersion:
    """An already loaded classifier (a plain .onnx file) as a version, warmed up and checked as a repository's
    versions are (`load_version`): a file whose answers are NaN was served, and every request failed with a 500.

    Raises:
        LoadFailure: it must not take traffic (`vit-serve FILE` does not start).
    """
    before = rss_bytes()
    try:
        _warm_up(engine, classifier, classifier.path, _stamp(classifier.path))
    except BaseException:
        engine.stop()
        raise
    return ModelVersion(name, version, classifier, engine, classifier.path, max(0, rss_bytes() - before))


def version_order(version: str) -> tuple[int, str]:
    """A sort key: versions by their number (a name that is none first)."""
    return (int(version), "") if version.isascii() and version.isdigit() else (0, version)


def described(e: Exception, limit: int = 500) -> str:
    """An unforeseen exception as a reason for the index: its type and message, cut to `limit` characters."""
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= limit else text[:limit] + "..."
