"""A model repository on Ray Serve: one application per model, and one ingress that answers every route.

    vit-serve artifacts/models --ray [--models alpha,beta] [--replicas N] [--repository-poll-s 2]

    proxy -> VitscopeIngress (app "vitscope", at /)  -> ModelVersions (app "vitscope-model-<name>", one per model)
             the app of `build_app(DIR)`: /v1, /v2,      every version the launcher deployed, each checked
             health, metrics, explain; one RayEngine     (`load_version`) and batched (`Engine`) on every replica
             per version, asking for that version

Why an application per model, and not Ray Serve's model multiplexing: multiplexing (`serve.multiplexed`)
shares one pool of replicas among many models of one shape, each used now and then, and loads a model
on the replica a request lands on. A repository holds few models, each with steady traffic, and a new
version must be loaded and checked before it takes a request, not on the first one. So each model gets
deployments of its own (its own replica count, autoscaling and health checks), and each deployment an
application of its own, because an application is Ray Serve's unit of upgrade: `serve.run` of one
application leaves the others' replicas running (`serve.run` gives every deployment of the application
it deploys a new code version, so one application for all models would restart them all). Versions are
not deployments: Triton and `vit-serve DIR` serve all of a model's versions from one model instance, and
so does a `ModelVersions` replica.

The ingress serves `build_app` over a `RepositoryView`: a folder of its own, in the repository's layout,
linking only to the versions that the model replicas hold, so that it never sends an image to a replica
that lacks its version. The launcher (`serve.server.ray.rollout`) changes it by `route`, broadcast to every
ingress replica; an ingress replica that starts asks the model replicas what they hold (`held_versions`).
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
from ray import serve
from starlette.concurrency import run_in_threadpool

from serve.runtime.temp_dirs import OwnedTempDir
from serve.server.engine import Engine
from serve.server.ray.deployment import (
    HEALTH_TIMEOUT_S,
    RayEngine,
    ReplicaHeader,
    ingress_options,
    model_options,
    replica_name,
)
from serve.server.repository.layout import CONFIG_FILE, LABELS_FILE, MODEL_FILE
from serve.server.repository.version import load_version
from serve.server.settings import ServeSettings

MODEL_APP_PREFIX = "vitscope-model-"
MODEL_DEPLOYMENT = "ModelVersions"
BROADCAST_TIMEOUT_S = 120.0  # loading and checking a version on the ingress, then draining the old one


def model_app_name(model: str) -> str:
    """The Ray Serve application of one model of the repository."""
    return MODEL_APP_PREFIX + model


def by_number(versions) -> list[str]:
    """Version names, oldest first."""
    return sorted(versions, key=int)


class ModelVersions:
    """One model's versions on every replica, each loaded, checked and warmed up as `vit-serve DIR` does
    (`load_version`: the file's metadata, its class names against labels.txt, a finite warm-up batch) and
    batched by its own `Engine`. A version that fails its checks fails the replica's start.

    Args:
        name: the model's name (its folder).
        versions: version -> path of its model.onnx (on every node that may run a replica).
        labels: the lines of the model's labels.txt (None: it has none).
        settings: `ServeSettings` fields (`model_dump()`).
    """

    def __init__(self, name: str, versions: dict[str, str], labels: list[str] | None, settings: dict[str, Any]):
        self.name, self.settings = name, ServeSettings(**settings)
        self.replica = replica_name()
        threads = self.settings.threads or None
        make_engine = lambda classifier, _name, _version: Engine(classifier, self.settings)  # noqa: E731
        self.versions = {
            v: load_version(name, v, Path(versions[v]), make_engine, threads, labels) for v in by_number(versions)
        }

    async def forward(self, image: np.ndarray, version: str) -> tuple[np.ndarray, str]:
        """(H, W, 3) uint8 -> (its record of `forward_rows` from `version`, this replica's name)."""
        served = self.versions.get(version)
        if served is None:  # the ingress asks only for versions every replica holds: a bug if it happens
            held = by_number(self.versions)
            raise LookupError(f"version {version} of {self.name} is not on this replica; it holds {held}")
        return await served.engine.infer(image), self.replica

    def holds(self) -> dict[str, str]:
        """Version -> path of the file, for every version this replica serves."""
        return {v: str(mv.path) for v, mv in self.versions.items()}

    async def check_health(self) -> None:
        """Healthy means every version's worker thread takes work: a no-op queued behind its batch completes."""
        for version, served in self.versions.items():
            try:
                await asyncio.wait_for(served.engine.run(int), HEALTH_TIMEOUT_S)
            except Exception:
                raise RuntimeError(f"version {version}'s worker took no work for {HEALTH_TIMEOUT_S} s") from None


class RepositoryView:
    """A folder in the layout of `serve.server.repository.layout` whose version files are links to the ones
    the model replicas hold; its config serves them all, as the launcher has already applied the policies."""

    def __init__(self, root: Path):
        self.root = root

    def write(self, model: str, versions: dict[str, str]) -> None:
        """Make `model`'s folder link to exactly `versions` (version -> model.onnx path); none removes it."""
        folder = self.root / model
        if not versions:
            shutil.rmtree(folder, ignore_errors=True)
            return
        folder.mkdir(parents=True, exist_ok=True)
        (folder / CONFIG_FILE).write_text("version_policy: { all { } }\n", encoding="utf-8")
        for version, path in versions.items():
            link = folder / version / MODEL_FILE
            link.parent.mkdir(exist_ok=True)
            link.unlink(missing_ok=True)
            link.symlink_to(path)
        labels, source = folder / LABELS_FILE, Path(next(iter(versions.values()))).parent.parent / LABELS_FILE
        labels.unlink(missing_ok=True)
        if source.is_file():
            labels.symlink_to(source)
        for old in folder.iterdir():
            if old.is_dir() and old.name not in versions:
                shutil.rmtree(old)


def view_engine(classifier, settings: ServeSettings, **kwargs) -> RayEngine:
    """A version's engine on the ingress: its images go to its model's `ModelVersions`, asking for it. The
    view's layout names both: the classifier's file is `<view>/<model>/<version>/model.onnx`."""
    version = classifier.path.parent
    handle = serve.get_deployment_handle(MODEL_DEPLOYMENT, model_app_name(version.parent.name))
    return RayEngine(classifier, settings, handle=handle, version=version.name, **kwargs)


async def held_versions() -> dict[str, dict[str, str]]:
    """Per model application on the cluster, the versions that every one of its running replicas holds."""
    applications = await asyncio.to_thread(lambda: serve.status().applications)
    table = {}
    for app, status in applications.items():
        if not app.startswith(MODEL_APP_PREFIX) or status.status == "DELETING":
            continue
        handle = serve.get_deployment_handle(MODEL_DEPLOYMENT, app)
        held = await handle.broadcast("holds").results_async(timeout_s=BROADCAST_TIMEOUT_S)
        common = set.intersection(*(set(h) for h in held)) if held else set()
        table[app.removeprefix(MODEL_APP_PREFIX)] = {v: held[0][v] for v in common}
    return table


@serve.ingress()
class RepositoryIngress:
    """The API app of `build_app` over a `RepositoryView`, each version's engine a `RayEngine` (`view_engine`).

    Args:
        settings: `ServeSettings` fields (`model_dump()`); the launcher sets one onnxruntime thread (the
            ingress's copy of each version serves the explain path and the checks) and no polling.
    """

    def __init__(self, settings: dict[str, Any]):
        self.settings = ServeSettings(**settings)
        self.folder = OwnedTempDir("vitscope-view-")  # removed by the next replica if Ray kills this one
        self.view = RepositoryView(self.folder.path)
        self.repository = None

    async def __serve_build_asgi_app__(self):
        from serve.server.app import build_app

        for model, versions in (await held_versions()).items():
            self.view.write(model, versions)
        app = build_app(self.view.root, self.settings, with_ui=False, engine_class=view_engine)
        self.repository = app.state.repository
        app.add_middleware(ReplicaHeader, fallback=replica_name())
        return app

    async def route(self, model: str, versions: dict[str, str]) -> list[str]:
        """Serve exactly `versions` of `model` (version -> path; none: stop serving it), as `vit-serve DIR` swaps
        versions: the new ones load and pass their checks first, then take new requests; this returns once the
        requests held by the versions that left have finished (or `graceful_timeout_s` ran out).

        Returns:
            The versions of `model` served now (a version that failed its checks here is not among them).
        """
        return await run_in_threadpool(self._route, model, versions)

    def _route(self, model: str, versions: dict[str, str]) -> list[str]:
        before = dict(self.repository.serving.get(model, {}))
        self.view.write(model, versions)
        self.repository.sync(only=model)
        now = self.repository.serving.get(model, {})
        gone = [mv for v, mv in before.items() if v not in now]
        deadline = time.monotonic() + self.settings.graceful_timeout_s
        while any(mv.in_flight for mv in gone) and time.monotonic() < deadline:
            time.sleep(0.01)
        return by_number(now)

    def refused(self, rows: list[tuple[str, str, str]]) -> None:
        """The launcher's verdicts, (model, version or "", reason) each: models and versions that never reach the
        view, listed by the index and told by a load as `vit-serve DIR` lists and tells them."""
        self.repository.refused_elsewhere({(model, version): reason for model, version, reason in rows})

    def check_health(self) -> None:
        if self.repository is None or not self.repository.ready:
            raise RuntimeError("the app has not started, or a model it should serve has no version loaded")

    def __del__(self):
        self.folder.remove()


def model_app(
    model: str,
    versions: dict[str, str],
    labels: list[str] | None,
    settings: ServeSettings,
    replicas: int = 1,
    max_replicas: int | None = None,
    cpus: float = 1.0,
):
    """The bound application of one model: its `ModelVersions`, `replicas` to `max_replicas` of them.

    Redeploying it with other versions is Ray Serve's rolling update, every new replica started (and
    healthy) before an old one stops (`max_surge_percent=100`): it needs the CPUs of twice the replicas
    while it runs, and waits for them.
    """
    options = model_options(settings, replicas, max_replicas, cpus)
    deployment = serve.deployment(ModelVersions).options(name=MODEL_DEPLOYMENT, max_surge_percent=100, **options)
    return deployment.bind(model, versions, labels, settings.model_dump())


def ingress_app(settings: ServeSettings):
    """The bound ingress application; it finds the models and versions on the model applications."""
    ingress = settings.model_copy(update={"threads": 1, "repository_poll_s": 0.0})
    return serve.deployment(RepositoryIngress).options(**ingress_options(settings)).bind(ingress.model_dump())
