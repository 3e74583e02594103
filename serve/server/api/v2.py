"""KServe Open Inference Protocol v2: health, model metadata and tensor inference, as a router of its own.

    GET  /v2, /v2/health/live|ready
    GET  /v2/models/<name>[/versions/<version>], .../ready
    POST /v2/models/<name>[/versions/<version>]/infer
    GET  /v2/models                                          the served models and versions
    POST /v2/repository/index, /v2/repository/models/<name>/load|unload   Triton's repository extension

The tensors are the ONNX file's own, as Triton serving the same file shows them: the input `pixels`,
UINT8 [B, H, W, 3] at the model's input size (resize and crop on the client as the metadata's
`preprocess` says, or use /v1/classify with encoded images), and the output `logits`, FP32 [B, K].
A request may also ask for `probs` by name (the calibrated probabilities: what /v1/classify scores), and,
from a calibrated file, `unknown` [B] (1: unlike the training images) and `ood_score` [B]; with the request
parameter `coverage` (`"parameters": {"coverage": 0.95}`), `in_set` [B, K] (1: the class is in the image's
prediction set). All FP32.
JSON and binary tensors are both spoken (`serve.server.api.tensors`), so `tritonclient.http` works
against this server as against Triton. Errors have the protocol's shape, {"error": "<message>"}
(which tritonclient shows), plus the `code` every other route puts in its error object.
"""

from __future__ import annotations

import functools

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from serve.server.api.tensors import (
    HEADER_LENGTH,
    OUTPUT,
    PROBS,
    TRUST_OUTPUTS,
    TensorSpec,
    check_trust_request,
    encode_infer_response,
    output_tensors,
    parse_infer_request,
    read_json,
    tensor_specs,
)
from serve.server.api.v1 import not_ready, request_id_of, resolve
from serve.server.errors import ApiError
from serve.server.http.errors import error_response
from serve.server.http.uploads import read_body
from serve.server.metrics import Metrics
from serve.server.payload_log import PayloadLog
from serve.server.repository.repository import ModelRepository, UnknownModel
from serve.server.repository.version import LoadFailure, ModelVersion
from serve.server.results import Deadline, batch_results
from serve.server.settings import RequestLimits
from serve.server.threads import Threads, run_in

EXTENSIONS = ["binary_tensor_data"]


INFER_BODY = {
    "required": True,
    "content": {
        "application/json": {"schema": {"type": "object", "description": "an inference request: inputs, outputs"}},
        "application/octet-stream": {
            "schema": {"type": "string", "format": "binary"},
            "description": "the binary tensor extension: a JSON inference request of Inference-Header-Content-Length "
            "bytes, then the tensors' bytes",
        },
    },
}


def kserve_errors(retry_after_s: int):
    """Wraps a route so that its `ApiError`s answer as KServe v2 errors: {"error": message, "code": code}."""

    def wrap(route):
        @functools.wraps(route)  # FastAPI reads the route's parameters through the wrapper
        async def wrapper(*args, **kwargs):
            try:
                return await route(*args, **kwargs)
            except ApiError as err:
                usual = error_response(err, retry_after_s)  # its status and headers (Retry-After, Allow)
                headers = {k: v for k, v in usual.headers.items() if k not in ("content-length", "content-type")}
                return JSONResponse({"error": err.message, "code": err.code}, err.status, headers=headers)

        return wrapper

    return wrap


def v2_router(
    repository: ModelRepository,
    limits: RequestLimits,
    metrics: Metrics,
    payloads: PayloadLog | None = None,
    threads: Threads | None = None,
) -> APIRouter:
    """The v2 routes, and the repository extension, over the repository's versions; each answered infer is
    recorded in `payloads` (None: nowhere); bodies are parsed and models loaded under `threads`' limits."""
    threads = threads or Threads()
    router = APIRouter(prefix="/v2")
    errors = kserve_errors(limits.retry_after_s)

    def check_ready() -> None:
        if not repository.ready:
            raise not_ready(repository)

    @router.get("")
    async def v2_server():
        try:
            version = repository.resolve().version
        except UnknownModel:  # the default model is unloaded: the server still answers what it is
            version = ""
        return {"name": "vitscope", "version": version, "extensions": EXTENSIONS}

    @router.get("/health/live")
    async def v2_live():
        return {"live": True}

    @router.get("/health/ready")
    @errors
    async def v2_ready():
        check_ready()
        return {"ready": True}

    add_model_routes(router, repository, errors)
    add_infer_routes(router, repository, limits, metrics, payloads, errors, threads)
    add_repository_routes(router, repository, limits, errors, threads)
    return router


def specs_of(served: ModelVersion) -> tuple[TensorSpec, TensorSpec]:
    """A served version's (pixels, logits) tensor specs, read from its session once and kept on it (`specs`)."""
    if served.specs is None:
        served.specs = tensor_specs(served.classifier)
    return served.specs


def add_infer_routes(
    router: APIRouter, repository: ModelRepository, limits: RequestLimits, metrics: Metrics, payloads, errors, threads
) -> None:
    """`POST /v2/models/{name}[/versions/{ver}]/infer`: binary or JSON tensors in, the asked outputs back."""

    extra = {"requestBody": INFER_BODY}  # read by the route itself, JSON or binary tensors
    infer_route = functools.partial(router.post, summary="Run the model on tensors", openapi_extra=extra)

    @infer_route("/models/{name}/infer")
    @infer_route("/models/{name}/versions/{ver}/infer")
    @errors
    async def v2_infer(request: Request, name: str, ver: str | None = None):
        encoding = request.headers.get("content-encoding", "identity").lower()
        if encoding != "identity":
            raise ApiError("unsupported_media_type", f"send the request uncompressed (Content-Encoding {encoding!r})")
        resolve(repository, name, ver)  # an unknown model is told so before its body is read
        body = await read_body(request, limits)  # before the hold: a slow body must not keep a version from draining
        deadline = Deadline(limits.request_timeout_s)
        with repository.hold(name, ver, lambda n, v: resolve(repository, n, v)) as served:
            return await infer_with(served, request, body, deadline)

    async def infer_with(served: ModelVersion, request: Request, body: bytes, deadline: Deadline):
        # at most max_batch_size images per request, so one client cannot fill the whole queue
        header_length = request.headers.get(HEADER_LENGTH)
        pixels, _ = specs_of(served)
        outputs = [OUTPUT, PROBS, *TRUST_OUTPUTS]
        req = await run_in(
            threads.parses, parse_infer_request, body, header_length, pixels, outputs, limits.max_batch_size
        )
        classifier = served.classifier
        check_trust_request(classifier, req)
        rows = await batch_results(served.engine, req.pixels, deadline)  # (B,) records: logits, probs, features, ood
        head = {"model_name": served.name, "model_version": served.version}
        req_id = req.id or request.headers.get("x-request-id")
        if req_id:
            head["id"] = req_id
        if payloads is not None:
            images = [p.tobytes() for p in req.pixels] if payloads.wants_images else None
            model = (served.name, served.version, classifier.labels)
            payloads.record(request_id_of(request), request.url.path, model, rows["probs"], images)
        content, headers = encode_infer_response(head, output_tensors(classifier, rows, req))
        return Response(content, headers=headers)


def add_model_routes(router: APIRouter, repository: ModelRepository, errors) -> None:
    """The model index, each model's readiness and its metadata (inputs, outputs, labels, preprocessing)."""

    @router.get("/models")
    async def v2_models():
        return {"models": [model_entry(name, versions) for name, versions in sorted(repository.serving.items())]}

    @router.get("/models/{name}/ready")
    @router.get("/models/{name}/versions/{ver}/ready")
    @errors
    async def v2_model_ready(name: str, ver: str | None = None):
        resolve(repository, name, ver)
        if repository.stopping:
            raise ApiError("not_ready", "the server is stopping")
        return {"name": name, "ready": True}

    @router.get("/models/{name}")
    @router.get("/models/{name}/versions/{ver}")
    @errors
    async def v2_metadata(name: str, ver: str | None = None):
        served = resolve(repository, name, ver)
        pixels, logits = specs_of(served)
        versions = sorted(repository.serving.get(name, {})) if ver is None else [ver]
        return {
            **model_entry(name, {v: served for v in versions}),
            "inputs": [pixels.to_dict()],
            "outputs": [logits.to_dict()],
            "parameters": {
                "labels": list(served.classifier.labels),
                "preprocess": served.classifier.preprocess.to_dict(),
            },
        }


def model_entry(name: str, versions: dict) -> dict:
    return {"name": name, "versions": sorted(versions), "platform": "onnxruntime_onnx"}


ONE_FILE = (
    "this server serves one file (vit-serve FILE), which is neither loaded nor unloaded here: serve a repository "
    "folder (vit-serve DIR) to load and unload models"
)


def add_repository_routes(
    router: APIRouter, repository: ModelRepository, limits: RequestLimits, errors, threads: Threads
) -> None:
    """Triton's model repository extension: the index, and loading and unloading a model (API key: as /v2).

    Each body is read through `read_body`, bounded by `--max-bytes` like every other, and must be JSON when
    there is one; the load and unload options it may carry (Triton's `parameters`) are not used here.
    """

    async def options(request: Request) -> object:
        body = await read_body(request, limits)
        return read_json(body, "request body") if body.strip() else None

    def model_control() -> None:  # as Triton refuses load and unload where it has no model control
        if repository.root is None:
            raise ApiError("model_control", ONE_FILE)

    @router.post("/repository/index")
    @errors
    async def v2_repository_index(request: Request):
        ready_only = await options(request) == {"ready": True}
        rows = repository.index()
        return [r for r in rows if r["state"] == "READY"] if ready_only else rows

    @router.post("/repository/models/{name}/load")
    @errors
    async def v2_repository_load(name: str, request: Request):
        await options(request)
        model_control()
        try:
            await run_in(threads.changes, repository.load, name)
        except UnknownModel as e:
            raise ApiError("not_found", str(e)) from None
        except LoadFailure as e:
            raise ApiError("load_failed", f"failed to load {name!r}: {e}") from None
        return {}

    @router.post("/repository/models/{name}/unload")
    @errors
    async def v2_repository_unload(name: str, request: Request):
        await options(request)
        model_control()
        try:
            await run_in(threads.changes, repository.unload, name)
        except UnknownModel as e:
            raise ApiError("not_found", str(e)) from None
        return {}
