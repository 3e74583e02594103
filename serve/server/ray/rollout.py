"""`vit-serve DIR --ray`: keep a model repository's Ray Serve applications in step with its folder.

Each model of `DIR` (or of `--models`) is an application of its own, and one ingress answers every route
(`serve.server.ray.repository`). At start, and then every `--repository-poll-s` seconds, the launcher
reads the folder as `vit-serve DIR` does (`scan`, the version policies), checks each new version file once
(`load_version`: one that fails is logged, never deployed, and tried again when its file changes), checks
again a held version whose file was rewritten in place (its size, modification or change time, or inode
changed: the replicas hold it as it was, and roll out the new file as a new version once it passes), and takes each
changed model to its wanted versions in three steps:

1. widen: its application is redeployed holding the versions the ingress sends requests to and the wanted
   ones (`serve.run`: Ray Serve's rolling update, each new replica up and healthy before an old one stops);
2. switch: every ingress replica loads the wanted versions, sends new requests to them, and waits for the
   requests on the others to finish (`RepositoryIngress.route`, by `DeploymentHandle.broadcast`);
3. narrow: the application is redeployed with the wanted versions only (a second rolling update).

So every replica holds every version the ingress may send it an image for, at every moment of both
rolling updates, and no request fails for a rollout. A model whose folder goes leaves the ingress first;
then its application is deleted. An unchanged model's application is left alone. Whatever one model's
folder holds, it is that model's failure alone (`wanted`), at start too unless `--exit-on-error` is set.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from ray import serve

from serve.server.engine import Engine
from serve.server.ray.deployment import APP_NAME, INGRESS_NAME, model_options
from serve.server.ray.repository import (
    BROADCAST_TIMEOUT_S,
    MODEL_APP_PREFIX,
    by_number,
    ingress_app,
    model_app,
    model_app_name,
)
from serve.server.repository.layout import LABELS_FILE, ModelFolder, scan
from serve.server.repository.version import LoadFailure, file_digest, load_version, metadata_only, stamp_of
from serve.server.settings import ServeSettings

log = logging.getLogger(__name__)

Versions = dict[str, str]  # version -> path of its model.onnx
TELL_TIMEOUT_S = 10.0  # `tell_refusals`: a poll waits no longer for the ingress
Stamp = tuple[int, int, int, int]  # a file's size, modification and change times and inode (`stamp_of`)


class RepositoryRollout:
    """The launcher's side of a repository on Ray Serve: what each model's replicas hold and what the
    ingress routes to, moved to what the folder wants by `deploy` (at start) and `sync` (each poll).

    Args:
        root: the repository folder (the same path on every node).
        settings: the server's settings.
        models: the models to serve (None: every model in the folder, and those added later).
        replicas: the fewest replicas of each model, started at once.
        max_replicas: the most replicas of each model when autoscaling (None: `replicas`).
        cpus: CPUs Ray reserves for each model replica; a rolling update needs twice a model's share.

    Raises:
        ValueError: no model in the folder, a model in `models` or `--default-model` that it lacks, or
            replica counts that do not fit.
    """

    def __init__(
        self,
        root: Path,
        settings: ServeSettings,
        models: list[str] | None = None,
        replicas: int = 1,
        max_replicas: int | None = None,
        cpus: float = 1.0,
    ):
        root = root.absolute()  # the replicas' working directory is not this one
        folders = scan(root)
        missing = sorted(set(models or ()) - set(folders))
        if missing:
            raise ValueError(f"--models names {', '.join(missing)}, not in {root}; it holds {', '.join(folders)}")
        chosen = models or sorted(folders)
        if settings.default_model and settings.default_model not in chosen:
            raise ValueError(f"--default-model {settings.default_model!r} is not among the models served: {chosen}")
        model_options(settings, replicas, max_replicas, cpus)  # the counts, checked before Ray starts
        self.root, self.settings, self.models = root, settings, models
        self.replicas, self.max_replicas, self.cpus = replicas, max_replicas, cpus
        self.held: dict[str, Versions] = {}  # model -> the versions every replica of its application holds
        self.routed: dict[str, Versions] = {}  # model -> the versions an ingress replica may send requests to
        # (model, version or "" for the whole model) -> (what failed: a file stamp or the reason, the reason)
        self.failures: dict[tuple[str, str], tuple[object, str]] = {}
        self.checked: dict[tuple[str, str], Stamp] = {}  # (model, version) -> the stamp of its file that passed
        self.stamps: dict[str, dict[str, Stamp | None]] = {}  # model -> version -> the file its replicas hold
        self.digests: dict[Stamp, str] = {}  # the stamp of a file that passed -> the digest of its bytes
        self.deploying: set[str] = set()  # the models whose application was given to Ray, held or not yet
        self.placing = threading.Event()  # set while serve.run waits for a model's new replicas
        self.stopping = threading.Event()  # set by Ctrl-C or SIGTERM (`launch.run`): no rollout starts after it
        self.check_settings = settings.model_copy(update={"preferred_batch_size": 1})  # a check, not a measurement

    def describe(self) -> str:
        """The ready line's summary."""
        failed = ", ".join(sorted({m for m, _ in self.failures} - set(self.held)))
        each = f"{self.replicas} replica{'s' * (self.replicas > 1)} each"
        return f"models {', '.join(sorted(self.held))}, {each}" + (f"; not serving {failed}" if failed else "")

    def cpus_needed(self) -> float:
        """The CPUs the model replicas reserve at start: `replicas` x `cpus` for each model that has a version to
        serve (the checks' verdicts are kept: `deploy` does not repeat them)."""
        servable = [model for model, (versions, _, _) in self.wanted().items() if versions]
        return len(servable) * self.replicas * self.cpus

    def deploy(self) -> None:
        """Deploy each model's application, then the ingress, which finds them. A model with no version that
        passes its checks is logged with its reasons and not deployed; the others serve.

        Raises:
            ValueError: no model has a version that passes its checks, or, with `exit_on_error`, any model or
                version failed (the message gives each reason).
        """
        wanted = self.wanted()
        servable = {m for m, (versions, _, _) in wanted.items() if versions}
        empty = sorted(set(wanted) - servable)
        failed = sorted({m for m, _ in self.failures} | set(empty))
        if failed and self.settings.exit_on_error:
            raise ValueError(f"--exit-on-error and a model failed: {', '.join(failed)}: {self.reasons(failed)}")
        if not servable:
            raise ValueError(f"no servable version of {', '.join(empty)}: {self.reasons(empty)}")
        if empty:
            log.error("not serving %s (%s); serving the others", ", ".join(empty), self.reasons(empty))
        for app in serve.status().applications:  # left by an earlier run on this cluster
            if app.startswith(MODEL_APP_PREFIX) and app.removeprefix(MODEL_APP_PREFIX) not in servable:
                serve.delete(app)
        for model, (versions, labels, _) in wanted.items():
            if versions:
                self.deploy_model(model, versions, labels)
        serve.run(ingress_app(self.settings), name=APP_NAME, route_prefix="/")
        self.routed = {model: dict(versions) for model, versions in self.held.items()}
        self.tell_refusals()

    def reasons(self, models: list[str]) -> str:
        """Why each of `models` (or one of its versions) does not serve, for a log line or an error."""
        found = [r for (m, _), (_, r) in sorted(self.failures.items()) if m in models]
        return "; ".join(found) or "no version file"

    def sync(self) -> None:
        """One poll: roll each changed model out, add the new ones, remove the ones whose folder went."""
        wanted = self.wanted()
        for model, (versions, labels, fresh) in wanted.items():
            if versions:  # none passes its checks: what serves keeps serving, as with vit-serve DIR
                self.roll(model, versions, labels, fresh)
        self.failures = {key: failed for key, failed in self.failures.items() if key[0] in wanted}  # folder gone
        gone = sorted(set(self.held) - set(wanted))
        if gone and len(gone) == len(self.held):
            log.warning("no model to serve is left in %s; still serving %s", self.root, ", ".join(gone))
            gone = []
        for model in gone:
            self.route(model, {})
            serve.delete(model_app_name(model))
            del self.held[model], self.stamps[model]
            self.deploying.discard(model)
            self.routed.pop(model, None)
            log.info("%s: removed from the repository, its application deleted", model)
        self.tell_refusals()

    def tell_refusals(self) -> None:
        """Give every ingress replica the reason each refused model or version does not serve, for its index and
        its loads; each poll, so that a replica Ray restarted learns them too. Best effort: an ingress that does
        not answer within `TELL_TIMEOUT_S` (restarting, or busy with a load) is told at the next poll."""
        rows = [(model, version, reason) for (model, version), (_, reason) in sorted(self.failures.items())]
        try:
            ingress = serve.get_deployment_handle(INGRESS_NAME, APP_NAME)
            ingress.broadcast("refused", rows).results(timeout_s=TELL_TIMEOUT_S)
        except Exception as e:  # never the poll's failure: the rollouts go on
            log.warning("the ingress did not take the refused models' reasons (%s); telling it again", type(e).__name__)

    def roll(self, model: str, versions: Versions, labels: list[str] | None, fresh: set[str] = frozenset()) -> None:
        """Take one model to `versions`: widen, switch, narrow (the module's docstring); each step only if needed.
        A version in `fresh` (a file its replicas do not hold yet, such as one rewritten in place) is rolled out
        as a new one is, and the ingress reloads its copy."""
        held, routed = self.held.get(model, {}), self.routed.get(model, {})
        if fresh or not versions.keys() <= held.keys():
            gone = sorted(v for v, path in routed.items() if v not in versions and not Path(path).is_file())
            if gone:  # a new replica could not load it: the update would fail at every poll
                log.warning(
                    "%s: the file of version(s) %s, which the ingress sends requests to, is gone; the new replicas "
                    "hold %s only, and requests sent to the old versions while they start may fail",
                    model, ", ".join(gone), by_number(versions),
                )  # fmt: skip
            self.deploy_model(model, {**{v: p for v, p in routed.items() if v not in gone}, **versions}, labels)
        if fresh or versions.keys() != routed.keys():
            self.route(model, versions)
        keep = {v: path for v, path in self.held[model].items() if v in versions or v in self.routed.get(model, {})}
        if keep.keys() != self.held[model].keys():
            self.deploy_model(model, keep, labels)

    def deploy_model(self, model: str, versions: Versions, labels: list[str] | None) -> None:
        """Deploy `model`'s application holding `versions`; returns once every old replica has stopped."""
        log.info("%s: rolling out replicas with versions %s", model, by_number(versions))
        app = model_app(model, versions, labels, self.settings, self.replicas, self.max_replicas, self.cpus)
        self.deploying.add(model)  # `delete` deletes it even if stopped while Ray waits for its replicas
        self.placing.set()  # Ray may wait here for room no node has: Ctrl-C then stops the wait (`launch.run`)
        try:
            if self.stopping.is_set():  # a Ctrl-C between two models' rollouts of one poll: nothing would stop this
                raise KeyboardInterrupt
            serve.run(app, name=model_app_name(model), route_prefix=None)
        finally:
            self.placing.clear()
        self.held[model] = dict(versions)
        self.stamps[model] = {v: self.checked.get((model, v)) for v in versions}
        log.info("%s: every replica holds versions %s", model, by_number(versions))

    def route(self, model: str, versions: Versions) -> None:
        """Have every ingress replica serve `versions` of `model`, and learn what they serve now."""
        ingress = serve.get_deployment_handle(INGRESS_NAME, APP_NAME)
        served = ingress.broadcast("route", model, versions).results(timeout_s=BROADCAST_TIMEOUT_S)
        now = set().union(*served)
        if now != versions.keys():
            wanted = by_number(versions)
            log.warning("%s: the ingress serves versions %s, not %s (its log says why)", model, by_number(now), wanted)
        self.routed[model] = {v: self.held[model][v] for v in now}
        log.info("%s: the ingress sends requests to versions %s", model, by_number(now))

    def delete(self) -> None:
        """Delete the ingress, then each model's application."""
        serve.delete(APP_NAME)
        for model in sorted(set(self.held) | self.deploying):
            serve.delete(model_app_name(model))

    def wanted(self) -> dict[str, tuple[Versions, list[str] | None, set[str]]]:
        """Per model to serve: the versions its policy wants that pass their checks, its labels, and those of the
        versions whose file passed its checks anew (new, or changed on disk since its replicas loaded it).

        Whatever a model's folder holds (a config that cannot be read, a labels.txt that is not text, a file that
        makes the checks raise anything at all), it is that model's failure alone: it has no version here, and
        its reason is in `failures`.
        """
        folders = scan(self.root)
        out = {}
        for model in self.models or sorted(folders):
            folder = folders.get(model)
            if folder is None:
                continue
            try:
                out[model] = self.check_model(folder)
            except Exception as e:  # one model's folder never stops the others' rollout
                self.fail(model, "", f"{folder.folder}: {type(e).__name__}: {e}")
                out[model] = ({}, None, set())
        return out

    def check_model(self, folder: ModelFolder) -> tuple[Versions, list[str] | None, set[str]]:
        """One model's part of `wanted`: its versions that pass, its labels and the versions checked anew."""
        model = folder.name
        if folder.error:  # its config.pbtxt cannot be read: what serves keeps serving, nothing new
            self.fail(model, "", folder.error)
            return {}, None, set()
        try:
            labels = folder.labels()
        except (OSError, ValueError) as e:
            self.fail(model, "", f"{folder.folder}/{LABELS_FILE}: {e}")
            return {}, None, set()
        files = {str(v): path for v, path in folder.wanted().items()}
        for key in [k for k in self.failures if k[0] == model and k[1] not in files]:
            del self.failures[key]  # the model's own failure, and those of versions no longer wanted
        versions, fresh = {}, set()
        for version, path in files.items():
            verdict = self.check(model, version, path, labels)
            if verdict is not None:
                versions[version] = str(path)
            if verdict:
                fresh.add(version)
        return versions, labels, fresh

    def check(self, model: str, version: str, path: Path, labels: list[str] | None) -> bool | None:
        """Whether a version file may be held: True when it passed the checks of `vit-serve DIR` (`load_version`)
        and its replicas do not hold it yet (a new version, or a file rewritten in place: its `stamp_of` changed),
        False when they hold it already (a new file that failed leaves the one they
        loaded serving), None when it may not. Each file is checked once."""
        key, held = (model, version), self.stamps.get(model, {}).get(version)
        try:
            stamp = stamp_of(path)
        except OSError:
            return None if held is None else False  # gone again
        if stamp == held:
            return False
        if metadata_only(stamp, held) and self.same_bytes(path, held):  # a chmod, a hard link: the file it holds
            self.stamps[model][version] = self.checked[key] = stamp
            self.digests[stamp] = self.digests[held]
            return False
        if stamp != self.checked.get(key) and not self.passes(model, version, path, labels, stamp):
            return None if held is None else False
        return True

    def same_bytes(self, path: Path, held: Stamp) -> bool:
        """Whether the file at `path` holds the bytes of the one that passed its checks with the stamp `held`."""
        try:
            return held in self.digests and file_digest(path) == self.digests[held]
        except OSError:
            return False

    def passes(self, model: str, version: str, path: Path, labels: list[str] | None, stamp: Stamp) -> bool:
        """Run `load_version`'s checks on a file with this stamp, unless the same file and labels failed them before
        (a labels.txt fixed since is checked again, as by `vit-serve DIR`)."""
        failed, tried = self.failures.get((model, version)), (stamp, None if labels is None else tuple(labels))
        if failed is not None and failed[0] == tried:
            return False  # the same file failed before: try again when it or the labels change
        make_engine = lambda classifier, _model, _version: Engine(classifier, self.check_settings)  # noqa: E731
        try:
            checked = load_version(model, version, path, make_engine, 1, labels)
        except LoadFailure as e:
            self.fail(model, version, str(e), tried)
            return False
        except Exception as e:  # what the checks did not foresee is still this version's failure alone
            self.fail(model, version, f"{path}: {type(e).__name__}: {e}", tried)
            return False
        checked.engine.stop()
        self.failures.pop((model, version), None)
        self.checked[(model, version)] = stamp
        self.digests[stamp] = checked.classifier.sha256
        return True

    def fail(self, model: str, version: str, reason: str, stamp: object = None) -> None:
        """Keep and log why a model (`version` "") or a version does not serve, once for each file or reason."""
        stamp = reason if stamp is None else stamp
        known = self.failures.get((model, version))
        if known is not None and known[0] == stamp:
            return
        self.failures[(model, version)] = (stamp, reason)
        log.error("%s does not take traffic: %s", f"version {version} of {model}" if version else model, reason)
