"""Scale-out on Ray Serve: the same ONNX runtime and API (/v1, /v2, /metrics, health) over N model replicas.

    vit-serve artifacts/sample.onnx --ray --replicas 2 [--ray-address auto]   # see serve.server.ray.launch
    serve run serve.server.ray.deployment:app_builder model=artifacts/sample.onnx replicas=2

Two deployments behind Ray Serve's HTTP proxy:

    proxy -> VitscopeIngress (the app of `build_app`, no UI)  -> ModelReplica x N (ONNX, @serve.batch)
             decodes uploads, checks tensors, metrics            batches images, runs the logits pass

`ModelReplica` is what scales: Ray Serve's `@serve.batch` gathers the images sent to it, the batch runs
on the replica's one ONNX thread; Ray Serve replaces a replica that dies or fails `check_health`, and adds
or removes replicas between `--replicas` and `--max-replicas` by the requests in flight. The ingress
sends each image to a model replica (`RayEngine`) and, if that replica dies with the image in flight,
sends it again to another one: killing a model replica loses no accepted request. The ingress is light
(one replica by default, `ingress_replicas` for more); a request in flight on an ingress that dies fails
like a dropped connection. The explain path runs on the ingress's own copy of the model.

Every response names the model replica(s) that computed it in the `X-Vitscope-Replica` header (their Ray
actor names). `/metrics` is the answering ingress's own; Ray's metrics (`serve_batch_size`,
`serve_batch_queue_length`, per replica) cover the model replicas. The model path must exist on every
node. A model repository folder has deployments of its own (`serve.server.ray.repository`). The modules
of `serve.server.ray` are the only ones that import ray, an optional extra: `pip install 'vitscope[ray]'`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from typing import Any

import numpy as np
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, TaskCancelledError
from starlette.concurrency import run_in_threadpool

from serve.server.engine import Engine, choose_batch_size, forward_rows, time_batch_sizes
from serve.server.errors import ApiError
from serve.server.settings import ServeSettings

log = logging.getLogger(__name__)

APP_NAME = "vitscope"
INGRESS_NAME = "VitscopeIngress"
REPLICA_HEADER = "X-Vitscope-Replica"
# Ray Serve adds model replicas when each has more images in flight than this: a replica batches them
# (4 to 8 images per batch on the sample model), so a few batches' worth in flight means it is busy.
TARGET_ONGOING_REQUESTS = 16
# Attempts per image when model replicas die under it: one death is a crash, three in a row a cluster
# that is going down, which the client should hear about (503) rather than wait out.
ATTEMPTS = 3
# A log line per request costs each process a share of a small model's throughput; /metrics counts them
QUIET = {"enable_access_log": False, "log_level": "WARNING"}
HEALTH_TIMEOUT_S = 10.0  # a wedged ONNX thread, not a busy one: the sample model's batches take milliseconds
_SERVED_BY: ContextVar[list[str] | None] = ContextVar("served_by", default=None)


def replica_name() -> str:
    """This replica's Ray actor name (`ray.get_actor(name, namespace="serve")` finds it)."""
    return serve.get_replica_context().replica_id.to_full_id_str()


class ModelReplica:
    """One model replica: the ONNX session on one thread, fed by Ray Serve's `@serve.batch`.

    Args:
        model: path of the .onnx file (on this replica's node).
        settings: `ServeSettings` fields (`model_dump()`).
    """

    def __init__(self, model: str, settings: dict[str, Any]):
        from serve.runtime.classifier import OnnxClassifier

        self.settings = ServeSettings(**settings)
        self.classifier = OnnxClassifier(model, threads=self.settings.threads or None)
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="vitscope-onnx")  # the session's one thread
        self.name = replica_name()
        H, W = self.classifier.input_size
        forward = functools.partial(forward_rows, self.classifier)
        size = self.settings.preferred_batch_size
        if not size:  # measured as vit-serve measures it (serve.server.engine.choose_batch_size)
            size = choose_batch_size(time_batch_sizes(forward, (H, W, 3), self.settings.max_batch_size))
        self.forward.set_max_batch_size(size)
        self.forward.set_batch_wait_timeout_s(self.settings.max_delay_ms / 1000.0)

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.0)
    async def forward(self, images: list[np.ndarray]) -> list[tuple[np.ndarray, str]]:
        """Images (H, W, 3) uint8 -> per image, (its record of `forward_rows`, this replica's name)."""
        loop = asyncio.get_running_loop()
        out = await loop.run_in_executor(self.thread, forward_rows, self.classifier, np.stack(images))
        return [(row, self.name) for row in out]

    async def check_health(self) -> None:
        """Ray Serve calls this periodically; raising marks the replica unhealthy, and Ray replaces it.

        Healthy means the ONNX thread takes work: a no-op queued behind the running batch completes.
        """
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(loop.run_in_executor(self.thread, int), HEALTH_TIMEOUT_S)
        except (TimeoutError, asyncio.TimeoutError, RuntimeError):
            raise RuntimeError(f"the ONNX thread took no work for {HEALTH_TIMEOUT_S} s (stopped or wedged)") from None


class RayEngine(Engine):
    """The ingress's engine: each image goes to a model replica through a Ray Serve handle, and to
    another one if that replica dies first. `run` and `run_sync` (the explain path) stay local.

    Args:
        handle: the handle of the model replicas' deployment.
        version: the version to ask them for (a repository's `ModelVersions` hold several); None for a
            `ModelReplica`, which holds one file.
    """

    def __init__(self, classifier, settings, *, handle, version: str | None = None, **kwargs):
        super().__init__(classifier, settings, **kwargs)
        self.handle, self.version = handle, version

    def start(self) -> None:
        """No local warm-up: the model replicas measure their own batch size when they start."""
        self.batcher.start()
        self.ready = True

    async def infer(self, item: Any, timeout_s: float | None = None) -> np.ndarray:
        """(H, W, 3) uint8 (or an opened upload) -> its record of `forward_rows` from a model replica, within
        `timeout_s` (None: --request-timeout-s), its decode and every attempt included."""
        end = time.monotonic() + (self.settings.request_timeout_s if timeout_s is None else timeout_s)
        image = item if isinstance(item, np.ndarray) else await run_in_threadpool(self.batcher.prepare, item)
        for attempt in range(1, ATTEMPTS + 1):
            try:
                forward = self.handle.forward
                call = forward.remote(image) if self.version is None else forward.remote(image, self.version)
                row, name = await asyncio.wait_for(call, max(0.0, end - time.monotonic()))  # one time for all tries
            except (ActorDiedError, ActorUnavailableError) as e:  # died with the image in flight: send it again
                log.warning("model replica lost with an image in flight (attempt %d of %d): %s", attempt, ATTEMPTS, e)
                continue
            served = _SERVED_BY.get()
            if served is not None:
                served.append(name)
            if self.on_answers is not None:  # the trust metrics, which a local batcher would have fed
                self.on_answers(row[None])
            return row
        raise ApiError("shutting_down", f"{ATTEMPTS} model replicas in a row died under this request; retry")

    async def infer_all(self, items: Sequence[Any], timeout_s: float | None = None) -> list:
        """Each item's record (as `infer`) or its failure, from the model replicas, whose queues are their own."""
        return await asyncio.gather(*(self.infer(item, timeout_s) for item in items), return_exceptions=True)


class ReplicaHeader:
    """ASGI middleware: every response names the model replica(s) that computed it; a client that hung up during
    its body is an `http.disconnect`, as from uvicorn (a 499), not an error (it was a 500 with a traceback)."""

    def __init__(self, app, fallback: str):
        self.app, self.fallback = app, fallback

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        served: list[str] = []
        token = _SERVED_BY.set(served)  # tasks gathered below copy the context: they share this list

        async def send_named(message):
            if message["type"] == "http.response.start":
                value = ",".join(dict.fromkeys(served)) or self.fallback
                message = {
                    **message,
                    "headers": [*message.get("headers", []), (REPLICA_HEADER.lower().encode(), value.encode())],
                }
            await send(message)

        async def receive_or_disconnect():
            try:
                return await receive()
            except TaskCancelledError:  # how the proxy ends the body of a client that hung up: the ASGI way instead
                return {"type": "http.disconnect"}

        try:
            await self.app(scope, receive_or_disconnect, send_named)
        finally:
            _SERVED_BY.reset(token)


@serve.ingress()
class VitscopeIngress:
    """The API app of `build_app`, whose engine sends images to the `ModelReplica` deployment.

    Args:
        model_handle: the handle of the `ModelReplica` deployment (Ray passes it for the bound deployment).
        model: path of the .onnx file: the ingress reads labels, preprocessing and tensor names from it.
        settings: `ServeSettings` fields (`model_dump()`).
    """

    def __init__(self, model_handle, model: str, settings: dict[str, Any]):
        from serve.runtime.classifier import OnnxClassifier

        self.handle = model_handle
        self.settings = ServeSettings(**settings)
        self.classifier = OnnxClassifier(model, threads=1)
        self.engine: RayEngine | None = None

    def __serve_build_asgi_app__(self):
        from serve.server.app import build_app

        engine = functools.partial(RayEngine, handle=self.handle)
        app = build_app(self.classifier, self.settings, with_ui=False, engine_class=engine)
        self.engine = app.state.engine
        app.add_middleware(ReplicaHeader, fallback=replica_name())
        return app

    def check_health(self) -> None:
        if self.engine is None or not self.engine.ready or not self.engine.batcher.running:
            raise RuntimeError("the app has not started, or its worker thread has stopped")


def model_options(settings: ServeSettings, replicas: int, max_replicas: int | None, cpus: float) -> dict[str, Any]:
    """The Ray Serve options of a model replicas' deployment (`ModelReplica`, or a repository's `ModelVersions`).

    Raises:
        ValueError: `replicas` below 1 or above `max_replicas`; `cpus` not a finite number above 0.
    """
    high = replicas if max_replicas is None else max_replicas
    if not 1 <= replicas <= high:
        raise ValueError(f"replicas must be at least 1 and at most max_replicas, got {replicas} and {high}")
    if not (math.isfinite(cpus) and cpus > 0):  # inf failed inside Ray with a traceback, NaN as "cannot convert"
        raise ValueError(f"--replica-cpus must be a finite number above 0, got {cpus:g}")
    return {
        "autoscaling_config": {
            "min_replicas": replicas,
            "initial_replicas": replicas,
            "max_replicas": high,
            "target_ongoing_requests": TARGET_ONGOING_REQUESTS,
        },
        "max_ongoing_requests": 4 * settings.max_batch_size,  # room for a few batches; beyond, the ingress waits
        "ray_actor_options": {"num_cpus": cpus},
        "logging_config": QUIET,
        "health_check_period_s": 5.0,
        "graceful_shutdown_timeout_s": settings.graceful_timeout_s,
    }


def ingress_options(settings: ServeSettings, replicas: int = 1) -> dict[str, Any]:
    """The Ray Serve options of the ingress: it reserves no CPU, as it mostly waits on the model replicas.

    Past `queue_size` requests in each replica and as many waiting at the proxy, the proxy answers 503 with
    Retry-After at once, as `vit-serve` does past its queue (its body is Ray Serve's words, not our JSON): without
    a bound the proxy queued every request, and a flood was answered minutes late.
    """
    return {
        "name": INGRESS_NAME,
        "num_replicas": replicas,
        "max_ongoing_requests": settings.queue_size,  # as many requests as vit-serve's queue holds
        "max_queued_requests": settings.queue_size,
        "backpressure_config": {"status_code": 503, "retry_after_s": settings.retry_after_s},
        "ray_actor_options": {"num_cpus": 0},
        "logging_config": QUIET,
        "graceful_shutdown_timeout_s": settings.graceful_timeout_s,
    }


def deployment(
    model: str,
    settings: ServeSettings,
    replicas: int = 1,
    max_replicas: int | None = None,
    cpus: float = 1.0,
    ingress_replicas: int = 1,
):
    """The bound Ray Serve application: an ingress and `replicas` to `max_replicas` model replicas.

    Args:
        model: path of the .onnx file, on every node that may run a replica.
        settings: the server's settings (host and port are the proxy's, see `run`).
        replicas: the fewest model replicas, started at once.
        max_replicas: the most model replicas Ray Serve may scale up to (None: `replicas`, a fixed count).
        cpus: CPUs Ray reserves for each model replica (its onnxruntime threads should fit in them).
        ingress_replicas: replicas of the ingress (it reserves no CPU: it mostly waits on the model).
    """
    options = model_options(settings, replicas, max_replicas, cpus)
    models = serve.deployment(ModelReplica).options(name="ModelReplica", **options)
    ingress = serve.deployment(VitscopeIngress).options(**ingress_options(settings, ingress_replicas))
    dump = settings.model_dump()
    return ingress.bind(models.bind(str(model), dump), str(model), dump)


def app_builder(args: dict[str, str]):
    """For `serve run serve.server.ray.deployment:app_builder model=PATH [replicas=N] [max_replicas=M] [cpus=C]
    [ingress_replicas=I]`; any other key is a `ServeSettings` field (e.g. `max_batch_size=16`)."""
    args = dict(args)
    model = args.pop("model")
    replicas, max_replicas = int(args.pop("replicas", 1)), args.pop("max_replicas", None)
    cpus, ingress = float(args.pop("cpus", 1.0)), int(args.pop("ingress_replicas", 1))
    high = None if max_replicas is None else int(max_replicas)
    return deployment(model, ServeSettings(**args), replicas, high, cpus, ingress)
