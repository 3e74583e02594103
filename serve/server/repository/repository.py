"""`ModelRepository`: the models and versions a server holds, and the rollout of new ones without downtime.

A request resolves and holds its version once, at its start (`hold`): a dict lookup in a table that is replaced
whole, never edited, so a swap is atomic for the routes; a version that began to drain between the lookup and the
hold refuses it (`Retired`), and the request looks up the new table. A new version (found by `sync`, which the
poller runs every `poll_s` seconds, or asked for by `load`), or a served one whose file changed on disk (its
`stamp_of`), is loaded and checked off to the side (`load_version`); only then does the table name it, and new
requests go to it. A version that leaves the table drains: it is stopped once the requests that
resolved it have finished, and its series leave /metrics (the model's own too, with its last version). A version
that fails its checks never enters the table; it is logged, counted in /metrics and listed in `index` with its
reason, and tried again when its file or labels.txt changes (a copy that was not finished) or when `load` asks.

Whatever one model's folder holds (a truncated or garbage file, a labels.txt that is not text, a config that
cannot be read, a file that makes the loader raise anything at all), it is that model's failure and no one
else's: `sync` goes on with the other models, at start-up too. `exit_on_error` follows Triton's flag of that
name, but is off by default where Triton's is on: one corrupt file dropped into a shared repository must not
take down every other model with it, on the next restart or in every replica at once. Turn it on where a
missing model is worse than a server that does not start.

Readiness: a model is ready while it has a version that takes requests (a model that failed to load is not,
and its ready route answers 404). The server is ready once started, while it serves at least one model and
every model it should serve and that has not failed is ready (one still loading keeps it unready), and not
while it stops. A model that failed does not make the server unready: its reason is in the index and
/metrics, and the good models keep their traffic; this differs from Triton's strict readiness for the same
reason as `exit_on_error`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from serve.runtime.classifier import OnnxClassifier
from serve.server.engine import Engine
from serve.server.metrics import Metrics
from serve.server.repository.layout import ModelFolder, scan
from serve.server.repository.version import (
    READY,
    UNAVAILABLE,
    LoadFailure,
    ModelVersion,
    described,
    file_changed,
    freeze_heap,
    hold_current,
    load_ready,
    load_version,
    release_heap,
    stamp_of,
    version_order,
)

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
        default_model: the model of the bare routes (`/v1/classify`); empty: the first by name of those that
            loaded at start-up (or the first to load after it, when none did). It never moves to another model;
            when it is not served the bare routes answer 503, and each change is logged as a warning.
        threads: onnxruntime's intra-op threads per version (None: by model size).
        poll_s: how often the folder is scanned for new and removed versions (0: never).
        drain_s: how long a version that leaves the table waits for the requests it holds.
        exit_on_error: `start` fails when any model fails to load (else it serves the others).
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
        exit_on_error: bool = False,
    ):
        if (root is None) == (single is None):
            raise ValueError("give the repository a folder or one classifier")
        self.make_engine, self.metrics, self.root, self.single = make_engine, metrics, root, single
        self.default_model, self.threads, self.poll_s, self.drain_s = default_model, threads, poll_s, drain_s
        self.exit_on_error = exit_on_error
        self.serving: dict[str, dict[str, ModelVersion]] = {}  # model -> version -> loaded, replaced whole
        self.routes: dict[tuple[str | None, str | None], ModelVersion] = {}  # (model, version) -> version
        # (model, version or "" for the whole model) -> (what failed: a file stamp or the reason, the failure)
        self.failures: dict[tuple[str, str], tuple[object, LoadFailure]] = {}
        self.expected: set[str] = set()  # models that should be served (found on disk, not unloaded)
        self.unloaded: dict[str, list[str]] = {}  # unloaded through the API (the versions it served): left alone
        self.elsewhere: dict[tuple[str, str], str] = {}  # (model, version) -> why checks run elsewhere refused it
        # (all expected models not failed are served, the index's failure rows): `ready` reads it on other threads
        self._settled: tuple[bool, tuple[dict, ...]] = (False, ())
        self.started = self.stopping = False
        self._change, self._loading, self._heap = threading.RLock(), threading.Lock(), threading.Lock()
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        # a single classifier's engine exists from the start (`single_engine`), as the app's one engine did
        self.single_engine = None if single is None else make_engine(single, single.name, single.version)

    @property
    def ready(self) -> bool:
        """Started, not stopping, serving a model, and every expected model that has not failed has a version."""
        return self.started and not self.stopping and self._settled[0]

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

    def hold(self, name: str | None = None, version: str | None = None, lookup=None) -> AbstractContextManager:
        """`resolve(name, version)` (or a route's wrapper of it, `lookup`), counted in flight while the block runs:
        use this, not `resolve` then `held`, which missed a drain that began between the two (`hold_current`).

        Raises:
            UnknownModel: no such model or version is served now (from `lookup`).
            Retired: every lookup met a version that drains (the server is stopping): a 503.
        """
        return hold_current(lambda: (lookup or self.resolve)(name, version))

    def start(self) -> None:
        """Load every model (the one classifier, or the folder's), then poll the folder if asked to.

        Raises:
            LoadFailure: with `exit_on_error`, a model or version failed to load (the message gives each reason).
        """
        with self._change:
            if self.started:
                return
            if self.single is not None:
                self._add(load_ready(self.single, self.single_engine, self.single.name, self.single.version))
                self.expected = {self.single.name}
            else:
                self.sync()
                failed = [e for _, e in self.failures.values()]
                if failed and self.exit_on_error:
                    self.stop()
                    reasons = "; ".join(map(str, failed))
                    raise LoadFailure(failed[0].kind, f"--exit-on-error and a model failed to load: {reasons}")
                if failed:
                    names = sorted({m for m, _ in self.failures})
                    log.warning("serving %s; not serving %s (reasons in the index)", sorted(self.serving), names)
            # fixed now, so that a model loaded later whose name sorts first does not move the bare routes
            self.default_model = self.default_model or min(self.serving, default="")
            self._publish()
            log.info("the bare routes (/v1/classify) go to the default model %s", self.default_model or "(none yet)")
            self.started = True
        if self.root is not None and self.poll_s > 0 and not self.stopping:  # not after a signal in the start-up
            self._poller = threading.Thread(target=self._poll, name="vitscope-repository", daemon=True)
            self._poller.start()

    def sync(self, only: str | None = None, retry: bool = False) -> None:
        """Load the versions the policies want, drain the others; `retry`: failed files too, changed or not."""
        with self._change:
            folders = scan(self.root)
            self.unloaded = {m: vs for m, vs in self.unloaded.items() if m in folders}  # a folder gone: forgot
            known = set(folders) | set(self.serving) | {m for m, _ in self.failures}
            for name in [only] if only is not None else sorted(known):
                if self.stopping and not self.started:  # SIGTERM during the start-up: the rest would go at once
                    break
                if name in self.unloaded or name not in folders:
                    self.expected.discard(name)
                    self._forget(name, keep=set())
                    self._remove(name, set(self.serving.get(name, {})))
                    continue
                self.expected.add(name)
                self._settle()
                try:
                    self._sync_model(folders[name], retry)
                except Exception as e:  # one model's folder, whatever it holds, never stops the others' sync
                    self._fail(name, "", LoadFailure("unreadable", f"{folders[name].folder}: {described(e)}"))

    def _sync_model(self, folder: ModelFolder, retry: bool) -> None:
        name = folder.name
        error = getattr(folder, "error", "")
        if error:  # its config.pbtxt cannot be read: keep what is loaded, load nothing new
            self._fail(name, "", LoadFailure("config", error))
            return
        try:
            labels = folder.labels()
        except (OSError, ValueError) as e:
            self._fail(name, "", LoadFailure("labels", f"{folder.folder}/labels.txt: {described(e)}"))
            return
        wanted = {str(v): p for v, p in folder.wanted().items()}
        if not wanted and not self.serving.get(name):
            self._forget(name, keep={""})  # a version no longer wanted is no longer a failure
            self._fail(name, "", LoadFailure("unreadable", f"{folder.folder} has no version file to serve"))
            return
        self._forget(name, keep=set(wanted))  # nor is the model's own failure ("") once it has a version
        for version, path in sorted(wanted.items(), key=lambda kv: int(kv[0])):
            served = self.serving.get(name, {}).get(version)
            if served is None or file_changed(served, path):
                self._try_load(name, version, path, labels, retry)
        old = set(self.serving.get(name, {})) - set(wanted)
        if self.serving.get(name, {}).keys() - old:  # never leave a model with nothing to serve
            self._remove(name, old)

    def load(self, name: str) -> None:
        """Load (or reload) one model from the folder, as the v2 repository extension asks; versions that failed
        are tried again even if their files did not change (polling waits for a change), listed as failed meanwhile.

        Raises:
            UnknownModel: the folder has no such model, by `scan`'s rule (a hidden or staging folder, `..` or a name
                too long for a path is none: no path is built from `name`).
            LoadFailure: none of its wanted versions passed the checks.
        """
        with self._change:
            try:
                found = self.root is not None and name in scan(self.root)
            except (OSError, ValueError):  # no folder, or no model in it
                found = False
            if not found and name not in {m for m, _ in self.elsewhere}:
                raise UnknownModel(f"the repository has no model {name!r}")
            self.unloaded.pop(name, None)  # settled by the sync, which takes it up at once
            self.sync(only=name, retry=True)  # asked for: its failed versions are tried again, changed or not
            failed = [e for (m, _), (_, e) in self.failures.items() if m == name]
            failed += [LoadFailure("unreadable", why) for (m, _), why in self.elsewhere.items() if m == name]
            if failed or not self.serving.get(name):
                reasons = "; ".join(map(str, failed))
                raise LoadFailure(failed[0].kind if failed else "unreadable", reasons or f"{name} has no version file")

    def unload(self, name: str) -> None:
        """Stop serving a model: new requests get 404, the ones it holds finish first."""
        with self._change:
            if name not in self.serving and name not in self.expected:
                raise UnknownModel(f"model {name!r} is not loaded")
            self.unloaded[name] = sorted(self.serving.get(name, {}), key=version_order) or [""]
            self.expected.discard(name)
            self._forget(name, keep=set())  # its failures too: nothing of it is tried now
            self._remove(name, set(self.serving.get(name, {})))

    def refused_elsewhere(self, reasons: dict[tuple[str, str], str]) -> None:
        """Why the Ray launcher's checks refused a model (version "") or version: `index` lists it, `load` tells it."""
        with self._change:
            self.elsewhere = dict(reasons)
            self._settle()

    def index(self) -> list[dict]:
        """Triton's repository index: name, version, state, reason (memory when served; unloaded models too)."""
        rows = [
            {"name": m, "version": v, "state": READY, "reason": "", "memory_bytes": mv.memory_bytes}
            for m, versions in sorted(self.serving.items())
            for v, mv in sorted(versions.items())
        ]
        return rows + list(self._settled[1])

    def stop(self) -> bool:
        """Stop polling and drain every version; True when all of them drained in time."""
        self.stopping = True
        self._stop.set()
        with self._change:
            versions = [mv for vs in self.serving.values() for mv in vs.values()]
            return all([mv.drain(self.drain_s) for mv in versions])

    def _poll(self) -> None:
        failing = ""  # why the last scan failed: an emptied or unmounted folder fails every poll alike, said once
        while not self._stop.wait(self.poll_s):
            try:
                self.sync()
            except Exception as e:  # keep serving what is loaded: a volume mounted late or a folder being replaced
                why = described(e)
                if why != failing:
                    expected = isinstance(e, (OSError, ValueError))  # no folder, or no model in it: no traceback
                    log.error("cannot scan the repository (%s); serving what is loaded", e, exc_info=not expected)
                failing = why
                continue
            if failing:
                log.info("the repository %s can be scanned again", self.root)
            failing = ""

    def _try_load(self, name: str, version: str, path: Path, labels: list[str] | None, retry: bool) -> None:
        try:  # what is tried: the file, and the labels.txt it must match
            stamp = (stamp_of(path), None if labels is None else tuple(labels))
        except OSError:
            return  # gone again
        failed = self.failures.get((name, version))
        if failed is not None and failed[0] == stamp and not retry:
            return  # the same file and labels failed before: try again when either changes (or `load` asks)
        try:
            mv = load_version(name, version, path, self.make_engine, self.threads, labels, self._loading)
        except LoadFailure as e:
            self._fail(name, version, e, stamp)
            return
        except Exception as e:  # what the checks did not foresee is still this version's failure alone
            self._fail(name, version, LoadFailure("unreadable", f"{path}: {described(e)}"), stamp)
            return
        self.failures.pop((name, version), None)
        self._add(mv)  # which settles the state (`_publish`)
        log.info("version %s of %s takes requests (%.1f MB)", version, name, mv.memory_bytes / 1e6)

    def _fail(self, name: str, version: str, e: LoadFailure, stamp: object = None) -> None:
        """Record, count and log a failure (a model's own when `version` is ""), once for each file or reason."""
        e = LoadFailure(e.kind, str(e))  # kept and logged without its traceback, whose frames hold the load's session
        stamp = str(e) if stamp is None else stamp
        known = self.failures.get((name, version))
        if known is not None and known[0] == stamp:
            return  # the poller meets the same failure again: counted once
        self.failures[(name, version)] = (stamp, e)
        self._settle()
        self.metrics.load_failures.labels(name, version, e.kind).inc()
        what = f"version {version} of {name}" if version else f"model {name}"
        log.error("%s does not take traffic: %s", what, e)

    def _forget(self, name: str, keep: set[str]) -> None:
        """Drop the failures of `name` but those of the versions in `keep` (a model's own "" is dropped too)."""
        for key in [k for k in self.failures if k[0] == name and k[1] not in keep]:
            del self.failures[key]
        self._settle()

    def _settle(self) -> None:
        """What `ready` and `index` read on other threads, computed under `_change` each time the state changes."""
        failed = {m for m, _ in self.failures}
        why = self.elsewhere | {k: str(e) for k, (_, e) in self.failures.items()}
        why |= {(m, v): "unloaded" for m, vs in self.unloaded.items() for v in vs}  # per version, as Triton lists them
        rows = [{"name": m, "version": v, "state": UNAVAILABLE, "reason": r} for (m, v), r in sorted(why.items())]
        self._settled = (bool(self.serving) and all(self.serving.get(m) for m in self.expected - failed), tuple(rows))

    def _add(self, mv: ModelVersion) -> None:
        replaced = self.serving.get(mv.name, {}).get(mv.version)  # the same version before its file changed
        self.serving = {**self.serving, mv.name: {**self.serving.get(mv.name, {}), mv.version: mv}}
        freeze_heap(self._heap)
        self.metrics.model_memory.labels(mv.name, mv.version).set(mv.memory_bytes)
        self.metrics.queue_depth.labels(mv.name, mv.version).set_function(lambda: mv.engine.batcher.depth)
        self._publish()  # from here on, new requests go to `mv`
        if replaced is not None:
            self._drain_in_background(replaced)

    def _remove(self, name: str, versions: set[str]) -> None:
        if not versions:
            return
        kept = {v: mv for v, mv in self.serving.get(name, {}).items() if v not in versions}
        gone = [self.serving[name][v] for v in versions]
        self.serving = {**{m: vs for m, vs in self.serving.items() if m != name}, **({name: kept} if kept else {})}
        self._publish()  # from here on, new requests go elsewhere
        for mv in gone:
            self._drain_in_background(mv)

    def _drain_in_background(self, mv: ModelVersion) -> None:
        # the thread gets the version in a list it empties, so that nothing of it holds the version afterwards
        threading.Thread(target=self._retire, args=([mv],), name="vitscope-drain", daemon=True).start()

    def _retire(self, box: list[ModelVersion]) -> None:
        mv = box.pop()
        drained = mv.drain(self.drain_s)
        name, version = mv.name, mv.version
        with self._change:  # so that no load (under the same lock) adds a series between the check and the removal
            if self.serving.get(name, {}).get(version) is None:  # not reloaded under the same number meanwhile
                self.metrics.forget_version(name, version)
            if name not in self.serving:  # its last version: the model's own series go too
                self.metrics.forget_model(name)
        del mv  # the last reference: what reference counting can free goes now, its cycles below
        release_heap(self._heap)
        log.info("version %s of %s unloaded (%s)", version, name, "drained" if drained else "drain timed out")

    def _publish(self) -> None:
        routes: dict[tuple[str | None, str | None], ModelVersion] = {}
        for name, versions in self.serving.items():
            for v, mv in versions.items():
                routes[(name, v)] = mv
            routes[(name, None)] = versions[max(versions, key=version_order)]
        if self.started and not self.default_model and self.serving:  # none served at start-up: the first one
            self.default_model = min(self.serving)
            log.warning("the default model is now %s, the first served since start-up", self.default_model)
        default = self.default_model
        if default in self.serving:
            routes[(None, None)] = routes[(default, None)]
        if self.started and ((None, None) in routes) != ((None, None) in self.routes):
            if (None, None) in routes:
                log.warning("the default model %s serves the bare routes (/v1/classify) again", default)
            else:
                log.warning("the default model %s is no longer served: the bare routes answer 503 until it is", default)
        for name in self.serving:  # the drift reference: the latest version's, once it takes requests
            if routes[(name, None)] is not self.routes.get((name, None)):
                self.metrics.trust.watch(name, routes[(name, None)].classifier.trust)
        self.routes = routes  # one assignment: a request sees the old table or the new one
        self._settle()
