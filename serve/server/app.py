"""The app factory: `build_app(classifier_or_repository_folder, settings)` returns the whole server.

It wires the pieces, each in a module of its own: the micro-batching engine (`batching`), the `/v1`
and health routes (`v1`), KServe v2 (`v2`), the JSON error mapping (`errors`), Prometheus metrics
(`metrics`), the OpenAPI document (`openapi`), the Host and API-key checks (`guard`) and the request record
(`record`: request ID, metrics, access log) around it all, the payload log (`payload_log`), the gRPC service
on `--grpc-port` (`grpc`, started and stopped with the app), and, unless `with_ui` is False, the Gradio UI at
`/` (`ui`, the only module that imports gradio: an API-only server never loads it). Connection limits live
below the app, in uvicorn's protocol (`protocol`, set up by `cli`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from serve.runtime.classifier import OnnxClassifier
from serve.runtime.images import PixelBudget
from serve.server.api.openapi import describe
from serve.server.api.v1 import add_v1_routes, classify_endpoint, classify_openapi
from serve.server.api.v2 import v2_router
from serve.server.engine import Engine, judge_rows
from serve.server.http.errors import add_error_handlers, add_fallback_routes
from serve.server.http.guard import ApiKeyCheck, HostAllowList, allowed_hosts_of
from serve.server.http.protocol import connection_cap
from serve.server.http.record import RequestRecord
from serve.server.http.uploads import decode_image
from serve.server.metrics import Metrics
from serve.server.payload_log import CloudEventsSink, FileSink, PayloadLog
from serve.server.repository.layout import model_order, scan
from serve.server.repository.repository import ModelRepository
from serve.server.repository.version import LoadFailure
from serve.server.settings import ServeSettings
from serve.server.threads import Threads

log = logging.getLogger(__name__)


def build_app(
    models: OnnxClassifier | Path,
    settings: ServeSettings | None = None,
    with_ui: bool = True,
    engine_class: Callable[..., Engine] = Engine,
) -> FastAPI:
    """The server: API routes, metrics and (unless `with_ui` is False) the Gradio UI at `/`.

    Args:
        models: a loaded `serve.runtime.OnnxClassifier`, or a model repository folder
            (`serve.server.repository.layout`).
        settings: limits and batching; defaults when None.
        with_ui: mount the Gradio Blocks at `/`.
        engine_class: builds the engine that batches requests (the Ray Serve ingress passes its `RayEngine`).

    Returns:
        A FastAPI app whose lifespan loads and warms the models up, and drains them on shutdown; its
        `state.repository` holds the served versions.
    """
    settings = settings or ServeSettings()
    metrics = Metrics()

    single = models if isinstance(models, OnnxClassifier) else None
    repository = repository_of(models, single, settings, metrics, engine_class)
    payloads = open_payload_log(settings, metrics)
    grpc = grpc_server_of(repository, settings, metrics, payloads) if settings.grpc_port else None

    lifespan = lifespan_of(repository, grpc, payloads, settings.graceful_timeout_s)

    if settings.opentelemetry and "telemetry" not in inspect.signature(FastAPI).parameters:
        log.warning("--opentelemetry needs a FastAPI with native OpenTelemetry (telemetry=); this one has none")
    off = None if settings.opentelemetry else {"tracing": False, "metrics": False, "logs": False}
    app = FastAPI(title="vitscope", lifespan=lifespan, telemetry=off)
    app.state.repository, app.state.metrics, app.state.settings = repository, metrics, settings
    app.state.engine = repository.single_engine  # None for a repository folder: each version has its own
    add_error_handlers(app, settings.retry_after_s)
    limits = settings.request_limits()
    app.state.pixel_budget = budget = PixelBudget(settings.decode_pixel_budget)  # shared by the API and the UI
    threads = Threads()  # the app's own limits on blocking work (decodes, parses, model loads)
    classify = classify_endpoint(repository, limits, budget, payloads, threads)
    add_v1_routes(app.router, repository, metrics, classify)
    v2 = v2_router(repository, limits, metrics, payloads, threads)
    app.include_router(v2)
    add_fallback_routes(app, [*app.router.routes, *v2.routes])
    default, layout, names = ui_layout(models, single, settings.default_model, with_ui)
    describe(app, limits, default, auth=bool(settings.api_key.get_secret_value()), plain=classify_openapi())
    if with_ui:
        from serve.server.ui.blocks import mount_ui

        app = mount_ui(app, repository, layout, settings, budget, names)
    add_request_layers(app, settings, metrics)
    return app


def add_request_layers(app: FastAPI, settings: ServeSettings, metrics: Metrics) -> None:
    """The layers every request meets first, outermost first: `RequestRecord` (its ID, metrics and access log line,
    with the status the client got: the UI's 422 and not Gradio's 500, 400 for a wrong Host), `HostAllowList`, then
    `ApiKeyCheck`."""
    app.add_middleware(ApiKeyCheck, api_key=settings.api_key.get_secret_value())
    app.add_middleware(HostAllowList, allowed_hosts=allowed_hosts_of(settings.allowed_hosts, settings.host))
    app.add_middleware(RequestRecord, metrics=metrics, routes=("/v1", "/v2", "/healthz", "/readyz", "/gradio_api"))


def repository_of(models, single, settings: ServeSettings, metrics: Metrics, engine_class) -> ModelRepository:
    """The served models: one file (`single`) or a repository folder, each version with its own engine."""

    def make_engine(classifier, name: str, version: str) -> Engine:  # one batcher per model version
        return engine_class(
            classifier,
            settings,
            on_batch=metrics.batch_size.labels(name, version).observe,
            decode=lambda img: decode_image(img, classifier, settings.max_pixels),  # an upload, on the worker
            on_answers=lambda rows: metrics.trust.record(name, classifier.labels, judge_rows(classifier, rows)),
        )

    return ModelRepository(
        make_engine,
        metrics,
        root=None if single is not None else Path(models),
        single=single,
        default_model=settings.default_model,
        threads=settings.threads or None,
        poll_s=settings.repository_poll_s,
        drain_s=settings.graceful_timeout_s,
        exit_on_error=settings.exit_on_error,
    )


def lifespan_of(repository: ModelRepository, grpc, payloads, graceful_timeout_s: float):
    """Load and warm the models up (then start gRPC); on shutdown stop gRPC, drain the models, close the log.

    A start that fails (a model with `--exit-on-error`, a gRPC port taken) stops the same way whatever had started
    (engines, poller, payload-log threads) before the error leaves the lifespan.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.loop = asyncio.get_running_loop()  # the probe port's liveness watches it turn
        try:
            try:
                await run_in_threadpool(repository.start)
            except LoadFailure as e:  # --exit-on-error: `vit-serve` ends its output with the reason
                app.state.startup_error = e
                raise
            if repository.stopping:  # a signal came during the start-up, which then loaded no more models
                log.info(
                    "a stop was asked for during the start-up (%d models served): stopping", len(repository.serving)
                )
            else:
                log.info("models %s warmed up; ready", ", ".join(sorted(repository.serving)))
            if grpc is not None and not repository.stopping:
                await run_in_threadpool(grpc.start)
            yield
        finally:
            if grpc is not None:  # first: its calls in flight still need the engines
                await run_in_threadpool(grpc.stop, graceful_timeout_s)
            app.state.drained = await run_in_threadpool(repository.stop)
            if payloads is not None:
                await run_in_threadpool(payloads.close)

    return lifespan


def ui_layout(models, single, default_model: str | None, with_ui: bool):
    """(the default model's name, the classifier the UI is laid out from, the model names it offers)."""
    if single is not None:
        return single.name, single, [single.name]
    names = model_order(Path(models), default_model or "")
    if not with_ui:
        return names[0], None, names
    # laid out from the newest file of the first model that opens (a broken one must not stop the server); the
    # UI's calls go to the default model the repository fixes at start-up
    folders = scan(Path(models))
    for name in names:
        wanted = folders[name].wanted()
        try:
            return name, OnnxClassifier(wanted[max(wanted)], threads=1), names
        except Exception as e:  # any broken file: try the next model
            log.warning("the UI is not laid out from %s: %s", name, e)
    raise ValueError(f"no model of {models} has a file that opens: the UI needs one (or serve with --no-ui)")


def open_payload_log(settings: ServeSettings, metrics: Metrics) -> PayloadLog | None:
    """The payload log the settings ask for (`--payload-log`, `--payload-log-url`), or None."""
    sinks = []
    if settings.payload_log:
        sinks.append(FileSink(settings.payload_log, settings.payload_log_max_bytes, settings.payload_log_backups))
    if settings.payload_log_url:
        sinks.append(CloudEventsSink(settings.payload_log_url))
    if not sinks:
        return None
    on_drop = lambda sink, reason: metrics.payload_log_dropped.labels(sink, reason).inc()
    images, size = settings.payload_log_images, settings.payload_log_queue_size
    return PayloadLog(sinks, settings.top_k, images, size, on_drop, settings.payload_log_queue_bytes)


def grpc_server_of(repository: ModelRepository, settings: ServeSettings, metrics: Metrics, payloads: PayloadLog | None):
    """The gRPC server of the repository's models on `settings.grpc_port` (started by the app's lifespan)."""
    from serve.server.grpc.models import RepositoryModels
    from serve.server.grpc.server import GrpcLimits, GrpcServer
    from serve.server.grpc.service import Service

    models = RepositoryModels(repository)
    service = Service(models, settings.request_limits(), settings.api_key.get_secret_value(), metrics, payloads)
    limits = GrpcLimits(
        max_bytes=settings.max_bytes,
        max_connections=connection_shares(settings)[1],
        max_streams=settings.grpc_max_streams,
        max_calls=settings.grpc_max_calls,
        idle_timeout_s=settings.grpc_idle_timeout_s,
        handshake_timeout_s=settings.header_timeout_s,  # as long as an HTTP client has to send its head
    )
    return GrpcServer(service, settings.host, settings.grpc_port, limits)


def connection_shares(settings: ServeSettings) -> tuple[int, int]:
    """HTTP's and gRPC's connection caps: together at most `max_connections` and below the process's file limit
    (`connection_cap`), gRPC's `grpc_max_connections` (at most half) taken out of HTTP's when it is on."""
    total = connection_cap(settings.max_connections)
    grpc = max(1, min(settings.grpc_max_connections, total // 2)) if settings.grpc_port else 0
    return max(1, total - grpc), grpc
