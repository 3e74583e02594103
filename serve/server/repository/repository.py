"""`ModelRepository`: the models and versions a server holds, and the rollout of new ones without downtime.

A request resolves its version once, at its start (`resolve`): a dict lookup in a table that is replaced
whole, never edited, so a swap is atomic for the routes. A new version (found by `sync`, which the poller
runs every `poll_s` seconds, or asked for by `load`) is loaded and checked off to the side
(`load_version`); only then does the table name it, and new requests go to it. A version that leaves the
table drains: it is stopped once the requests that resolved it have finished. A version that fails its
checks never enters the table; it is logged, counted in /metrics and listed in `index` with its reason, and
tried again when its file changes (a copy that was not finished).

Readiness follows Triton's: a model is ready while it has a version that takes requests; the server is
ready once started and every model it should serve is ready, and not while it stops.
"""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Callable
from pathlib import Path

from serve.runtime.classifier import OnnxClassifier
from serve.server.engine import Engine
from serve.server.metrics import Metrics
from serve.server.repository.layout import file_stamp, scan
from serve.server.repository.version import READY, UNAVAILABLE, LoadFailure, ModelVersion, load_version, rss_bytes

log = logging.getLogger("vitscope.repository")

EngineFactory = Callable[[OnnxClassifier, str, str], Engine]


class UnknownModel(LookupError):
    """No such model or version is served; the message names the ones that are."""


class ModelRepository:
    """The served model versions, from a repository folder or from one classifier.

    Args:
        make_engine: builds a version's engine from (classifier, model name, version).
        metrics: where the per-version gauges and the failed loads are counted.
        root: the repository folder (None: `single` is the only model).
        single: one classifier already loaded (a plain .onnx file, served as today).
        default_model: the model of the bare routes (`/v1/classify`); empty: the first by name.
        threads: onnxruntime's intra-op threads per version (None: by model size).
        poll_s: how often the folder is scanned for new and removed versions (0: never).
        drain_s: how long a version that leaves the table waits for the requests it holds.
    """

    def __init__(
        self,
        make_engine: EngineFactory,
        metrics: Metrics,
        root: Path | None = None,
        single: OnnxClassifier | None = None,
        default_model: str = "",
        threads: int | None = None,
        poll_s: float = 0.0,
        drain_s: float = 20.0,
    ):
        if (root is None) == (single is None):
            raise ValueError("give the repository a folder or one classifier")
        self.make_engine, self.metrics, self.root, self.single = make_engine, metrics, root, single
        self.default_model, self.threads, self.poll_s, self.drain_s = default_model, threads, poll_s, drain_s
        self.serving: dict[str, dict[str, ModelVersion]] = {}  # model -> version -> loaded, replaced whole
        self.routes: dict[tuple[str | None, str | None], ModelVersion] = {}  # (model, version) -> version
        self.failures: dict[tuple[str, str], tuple[tuple[int, int] | None, str]] = {}  # -> (stamp, reason)
        self.expected: set[str] = set()  # models that should be served (found on disk, not unloaded)
        self.unloaded: set[str] = set()  # unloaded through the API: the poller leaves them alone
        self.started = self.stopping = False
        self._change, self._loading, self._heap = threading.RLock(), threading.Lock(), threading.Lock()
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        # a single classifier's engine exists from the start (`single_engine`), as the app's one engine did
        self.single_engine = None if single is None else make_engine(single, single.name, single.version)

    @property
    def ready(self) -> bool:
        """Triton's server readiness: started, not stopping, and every expected model has a ready version."""
        serving = self.serving
        return self.started and not self.stopping and all(serving.get(m) for m in self.expected)

    def resolve(self, name: str | None = None, version: str | None = None) -> ModelVersion:
        """The version a request goes to: the default model's latest (no name), a model's latest, or one version.

        Raises:
            UnknownModel: no such model or version is served now.
        """
        found = self.routes.get((name, version))
        if found is not None:
            return found
        served = {m: sorted(v) for m, v in self.serving.items()}
        if name is not None and name in served and version is not None:
            raise UnknownModel(f"version {version!r} of {name!r} is not served; served versions: {served[name]}")
        raise UnknownModel(f"model {name!r} is not served; served models and versions: {served}")

    def start(self) -> None:
        """Load every model (the one classifier, or the folder's), then poll the folder if asked to.

        Raises:
            LoadFailure: a model has no version that passed its checks (the message gives each reason).
        """
        with self._change:
            if self.started:
                return
            if self.single is not None:
                c = self.single
                self._add(load_ready(c, self.single_engine, c.name, c.version))
                self.expected = {c.name}
            else:
                self.sync()
                missing = sorted(m for m in self.expected if not self.serving.get(m))
                if missing:
                    reasons = "; ".join(r for (m, _), (_, r) in self.failures.items() if m in missing)
                    self.stop()
                    raise LoadFailure("unreadable", f"no servable version of {', '.join(missing)}: {reasons}")
            self.started = True
        if self.root is not None and self.poll_s > 0:
            self._poller = threading.Thread(target=self._poll, name="vitscope-repository", daemon=True)
            self._poller.start()

    def sync(self, only: str | None = None) -> None:
        """Bring the table in line with the folder: load the versions the policies want, drain the others."""
        with self._change:
            folders = scan(self.root)
            names = [only] if only is not None else sorted(set(folders) | set(self.serving))
            for name in names:
                if name in self.unloaded or name not in folders:
                    self.expected.discard(name)
                    self._remove(name, set(self.serving.get(name, {})))
                    continue
                self.expected.add(name)
                folder = folders[name]
                wanted = {str(v): p for v, p in folder.wanted().items()}
                for version, path in sorted(wanted.items(), key=lambda kv: int(kv[0])):
                    if version not in self.serving.get(name, {}):
                        self._try_load(name, version, path, folder.labels())
                old = set(self.serving.get(name, {})) - set(wanted)
                if self.serving.get(name, {}).keys() - old:  # never leave a model with nothing to serve
                    self._remove(name, old)

    def load(self, name: str) -> None:
        """Load (or reload) one model from the folder, as the v2 repository extension asks.

        Raises:
            UnknownModel: the folder has no such model.
            LoadFailure: none of its wanted versions passed the checks.
        """
        if self.root is None or not (self.root / name).is_dir():
            raise UnknownModel(f"the repository has no model {name!r}")
        with self._change:
            self.unloaded.discard(name)
            self.sync(only=name)
            if not self.serving.get(name):
                reasons = "; ".join(r for (m, _), (_, r) in self.failures.items() if m == name)
                raise LoadFailure("unreadable", reasons or f"{name} has no version file to load")

    def unload(self, name: str) -> None:
        """Stop serving a model: new requests get 404, the ones it holds finish first."""
        with self._change:
            if name not in self.serving and name not in self.expected:
                raise UnknownModel(f"model {name!r} is not loaded")
            self.unloaded.add(name)
            self.expected.discard(name)
            self._remove(name, set(self.serving.get(name, {})))

    def index(self) -> list[dict]:
        """The repository index of Triton's extension: name, version, state and reason, plus memory."""
        rows = [
            {"name": m, "version": v, "state": READY, "reason": "", "memory_bytes": mv.memory_bytes}
            for m, versions in sorted(self.serving.items())
            for v, mv in sorted(versions.items())
        ]
        rows += [
            {"name": m, "version": v, "state": UNAVAILABLE, "reason": reason}
            for (m, v), (_, reason) in sorted(self.failures.items())
        ]
        return rows

    def stop(self) -> bool:
        """Stop polling and drain every version; True when all of them drained in time."""
        self.stopping = True
        self._stop.set()
        with self._change:
            versions = [mv for vs in self.serving.values() for mv in vs.values()]
            return all([mv.drain(self.drain_s) for mv in versions])

    def _poll(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.sync()
            except Exception:  # a folder removed under us, a bad config: keep serving what is loaded
                log.exception("scanning the repository %s failed; serving what is loaded", self.root)

    def _try_load(self, name: str, version: str, path: Path, labels: list[str] | None) -> None:
        try:
            stamp = file_stamp(path)
        except OSError:
            return  # gone again
        failed = self.failures.get((name, version))
        if failed is not None and failed[0] == stamp:
            return  # the same file failed before: try again when it changes
        try:
            mv = load_version(name, version, path, self.make_engine, self.threads, labels, self._loading)
        except LoadFailure as e:
            self.failures[(name, version)] = (stamp, str(e))
            self.metrics.load_failures.labels(name, version, e.kind).inc()
            log.error("version %s of %s does not take traffic: %s", version, name, e)
            return
        self.failures.pop((name, version), None)
        self._add(mv)
        log.info("version %s of %s takes requests (%.1f MB)", version, name, mv.memory_bytes / 1e6)

    def _add(self, mv: ModelVersion) -> None:
        self.serving = {**self.serving, mv.name: {**self.serving.get(mv.name, {}), mv.version: mv}}
        freeze_heap(self._heap)
        self.metrics.model_memory.labels(mv.name, mv.version).set(mv.memory_bytes)
        self.metrics.queue_depth.labels(mv.name, mv.version).set_function(lambda: mv.engine.batcher.depth)
        self._publish()

    def _remove(self, name: str, versions: set[str]) -> None:
        if not versions:
            return
        kept = {v: mv for v, mv in self.serving.get(name, {}).items() if v not in versions}
        gone = [self.serving[name][v] for v in versions]
        self.serving = {**{m: vs for m, vs in self.serving.items() if m != name}, **({name: kept} if kept else {})}
        self._publish()  # from here on, new requests go elsewhere
        for mv in gone:
            # the thread gets the version in a list it empties, so that nothing of it holds the version afterwards
            threading.Thread(target=self._retire, args=([mv],), name="vitscope-drain", daemon=True).start()

    def _retire(self, box: list[ModelVersion]) -> None:
        mv = box.pop()
        drained = mv.drain(self.drain_s)
        name, version = mv.name, mv.version
        if self.serving.get(name, {}).get(version) is None:  # not reloaded under the same number meanwhile
            for gauge in (self.metrics.model_memory, self.metrics.queue_depth):
                try:
                    gauge.remove(name, version)
                except KeyError:
                    pass
        del mv  # the last reference: what reference counting can free goes now, its cycles below
        release_heap(self._heap)
        log.info("version %s of %s unloaded (%s)", version, name, "drained" if drained else "drain timed out")

    def _publish(self) -> None:
        routes: dict[tuple[str | None, str | None], ModelVersion] = {}
        for name, versions in self.serving.items():
            for v, mv in versions.items():
                routes[(name, v)] = mv
            routes[(name, None)] = versions[max(versions, key=_order)]
        default = self.default_model or min(self.serving, default=None)
        if default in self.serving:
            routes[(None, None)] = routes[(default, None)]
        self.routes = routes  # one assignment: a request sees the old table or the new one


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


def _order(version: str) -> tuple[int, str]:
    return (int(version), "") if version.isdigit() else (0, version)


def load_ready(classifier: OnnxClassifier, engine: Engine, name: str, version: str) -> ModelVersion:
    """An already loaded classifier (a plain .onnx file) as a version: its engine warmed up, as today."""
    before = rss_bytes()
    engine.start()
    return ModelVersion(name, version, classifier, engine, classifier.path, max(0, rss_bytes() - before))
