"""The `/v1` API and the health routes: a request goes decode_request -> predict -> encode_response.

POST /v1/classify          image as multipart field `file` or as the raw body; ?top_k=5&explain=true&coverage=0.95
                           (scores are calibrated probabilities; the answer says `unknown` and `ood_score`, and
                           with `coverage` gives the `prediction_set`: see serve.runtime.trust)
POST /v1/models/<name>[/versions/<version>]/classify   the same, for one model (its latest version) or version
GET  /healthz, /readyz     live; ready once the model is loaded and warmed up
GET  /metrics              Prometheus
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any, Literal

from anyio import from_thread
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import ClientDisconnect

from serve.runtime.images import PixelBudget
from serve.runtime.rollout import HEAD_FUSIONS
from serve.runtime.trust import Assessment
from serve.server.engine import judge_rows
from serve.server.errors import ApiError
from serve.server.explain import explain_pixels, overlay_png
from serve.server.http.guard import authorized
from serve.server.http.uploads import decode_image, decode_request, open_upload
from serve.server.metrics import Metrics
from serve.server.payload_log import PayloadLog
from serve.server.repository.repository import ModelRepository, UnknownModel
from serve.server.repository.version import ModelVersion
from serve.server.results import Deadline, model_result
from serve.server.settings import RequestLimits
from serve.server.threads import Threads, run_in

# A small file can still declare a huge image (a flat 40 MP PNG compresses to kilobytes): only images
# up to 1 MP, a few milliseconds of decoding and resizing, are decoded on the loop or the model's thread.
INLINE_DECODE_PIXELS = 1_000_000
BINARY = {"type": "string", "format": "binary"}
IMAGE_BODY = {  # read by the route itself: a multipart field or the raw body
    "required": True,
    "content": {
        "multipart/form-data": {"schema": {"type": "object", "required": ["file"], "properties": {"file": BINARY}}},
        "image/*": {"schema": BINARY},
        "application/octet-stream": {"schema": BINARY},
    },
}
LOAD_HINT = "load one with POST /v2/repository/models/<name>/load"
NO_DEFAULT = f"the default model has no version loaded (unloaded?): {LOAD_HINT}"


def encode_response(served, answers: Assessment, top_k: int, explanation: dict | None = None) -> dict[str, Any]:
    """One image's answer: its calibrated top-k, prediction set (None without coverage), unknown and OOD score."""
    (p,) = served.classifier.predictions(answers, max(1, top_k))
    out: dict[str, Any] = {
        "model": served.name,
        "version": served.version,
        "predictions": [{"label": label, "score": score} for label, score in p],
        "prediction_set": p.prediction_set,
        "unknown": p.unknown,
        "ood_score": None if p.ood_score is None else round(p.ood_score, 6),
    }
    if explanation is not None:
        out["explanation"] = explanation
    return out


def not_ready(repository: ModelRepository) -> ApiError:
    """The 503 of a server that is not ready, saying why: starting, stopping, a model loading, or none served."""
    if not repository.started or repository.stopping:
        return ApiError("not_ready", "the models are loading or warming up (or the server is stopping)")
    if not repository.serving:
        return ApiError("not_ready", f"no model is served: each was unloaded or failed to load ({LOAD_HINT})")
    return ApiError("not_ready", "a model is still loading (POST /v2/repository/index lists each model's state)")


def request_id_of(request: Request) -> str:
    """The ID `serve.server.http.record.RequestRecord` gave the request ("" without it)."""
    return request.scope.get("state", {}).get("request_id", "")


def resolve(repository: ModelRepository, name: str | None, version: str | None) -> ModelVersion:
    """The version a request goes to; the 404 that names what is served, or a 503 while the default model
    (asked for by no name) has no version loaded."""
    try:
        return repository.resolve(name, version)
    except UnknownModel as e:
        if name is None:
            raise ApiError("not_ready", NO_DEFAULT) from None
        raise ApiError("not_found", str(e)) from None


class ClassifyParams(BaseModel):
    """The parameters of a classify request, from the query string or from the multipart form's text fields
    (the query string wins where both give one; a bad value is refused wherever it is)."""

    model_config = ConfigDict(extra="ignore")  # other form fields (a client's own) are no business of ours

    top_k: int | None = Field(None, ge=1, description="how many classes to answer (default: the server's --top-k)")
    explain: bool = Field(False, description="add the attention rollout map, its overlay and its deletion score")
    head_fusion: Literal[HEAD_FUSIONS] = Field(HEAD_FUSIONS[0], description="how the rollout fuses the heads")
    discard_ratio: float = Field(0.0, ge=0.0, lt=1.0, description="the share of weakest attention the rollout drops")
    coverage: float | None = Field(  # its range is the runtime's to check (`check_coverage`), with its message
        None, description="in (0, 1): answer the prediction set that holds the true label with this probability"
    )


class Prediction(BaseModel):
    label: str
    score: float = Field(description="the calibrated probability")


class Predictions(BaseModel):
    """One image's answer."""

    model: str
    version: str
    predictions: list[Prediction] = Field(description="the top classes, best first")
    prediction_set: list[str] | None = Field(
        description="with coverage: the labels that hold the true one with that probability; else null"
    )
    unknown: bool | None = Field(
        description="true when the image is unlike the training images; null for an uncalibrated file"
    )
    ood_score: float | None = Field(description="higher: less like the training images; null for an uncalibrated file")
    explanation: dict[str, Any] | None = Field(
        None, description="with explain=true: the rollout grid, its overlay (base64 PNG) and deletion score"
    )


DEFAULT_PARAMS = ClassifyParams()


def classify_params(query: Mapping[str, str], form: dict[str, str]) -> ClassifyParams:
    """The request's parameters, checked: `ApiError("bad_request")` says what is wrong and where.

    The route validates them itself rather than declaring them to FastAPI: they come from the query string or
    from the form fields the route reads itself, and one model checks both.
    """
    if not query and not form:  # the common case: every default
        return DEFAULT_PARAMS
    if form:
        validated(form, "form field")  # a bad form value is refused even where the query string overrides it
    return validated({**form, **query}, "query")


def validated(given: Mapping[str, str], where: str) -> ClassifyParams:
    try:
        return ClassifyParams.model_validate(given)
    except ValidationError as e:
        what = "; ".join(f"{where} {'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise ApiError("bad_request", f"invalid request: {what}") from None


def query_parameters() -> list[dict[str, Any]]:
    """`ClassifyParams` as the OpenAPI document's query parameters, from its own JSON schema."""
    fields = ClassifyParams.model_json_schema()["properties"]
    return [
        {"name": k, "in": "query", "required": False, "schema": v, "description": v.get("description", "")}
        for k, v in fields.items()
    ]


def check_attention(classifier) -> None:
    """`ApiError("bad_request")` (422) unless the file can explain (its attention output)."""
    try:
        classifier.check_attention()
    except ValueError as e:
        raise ApiError("bad_request", str(e)) from None


def check_coverage(classifier, coverage: float | None) -> None:
    """`ApiError("bad_request")` (422) unless the file can build prediction sets at `coverage`."""
    try:
        classifier.check_coverage(coverage)
    except ValueError as e:
        raise ApiError("bad_request", str(e)) from None


CLASSIFY_ROUTES = {  # path: (summary, OpenAPI operation ID)
    "/v1/classify": ("Classify one image with the default model", "classify"),
    "/v1/models/{name}/classify": ("Classify one image with a model's latest version", "classify_model"),
    "/v1/models/{name}/versions/{version}/classify": ("Classify one image with one version", "classify_version"),
}
REF = "#/components/schemas/"


def classify_endpoint(
    repository: ModelRepository,
    limits: RequestLimits,
    budget: PixelBudget | None = None,
    payloads: PayloadLog | None = None,
    threads: Threads | None = None,
) -> Callable[..., Awaitable[Response]]:
    """`classify(request, name=None, version=None)`: the answer to a classify request for a model's version (None:
    the default model, its latest version); large uploads hold `budget` while they decode; each answer is recorded
    in `payloads` (None: nowhere); large decodes run under `threads`' limit. The routes of `add_v1_routes` call it."""
    threads = threads or Threads()

    async def classify(request: Request, name: str | None = None, version: str | None = None) -> Response:
        resolve(repository, name, version)  # an unknown model is told so before its upload is read
        # the upload is read before the version is held: a slow one must not keep a retired version from draining
        data, form = await decode_request(request, limits)
        deadline = Deadline(limits.request_timeout_s)
        with repository.hold(name, version, lambda n, v: resolve(repository, n, v)) as served:
            classifier, engine = served.classifier, served.engine
            model = (served.name, served.version, classifier.labels)  # as the payload log names it
            params = classify_params(request.query_params, form)
            top_k, coverage = params.top_k or limits.top_k, params.coverage
            check_coverage(classifier, coverage)
            if params.explain:
                check_attention(classifier)
            img = open_upload(data, limits.max_pixels)  # the header: not an image, or too many pixels, fails here
            if params.explain:  # the explain pass computes the probabilities too: no second forward pass
                answers, explanation, rows = await explained(
                    request, served, img, limits, deadline, budget, threads, params
                )
            else:
                item = await decoded(request, served, img, limits, deadline, budget, threads, len(data))
                # its record: logits, probs, features, ood
                rows = await model_result(engine.infer(item, deadline.left()), deadline.timeout_s)
                answers, explanation = judge_rows(classifier, rows[None], coverage), None
            if payloads is not None:
                payloads.record(request_id_of(request), "/v1/classify", model, rows["probs"][None], [data])
            return JSONResponse(encode_response(served, answers, top_k, explanation))

    return classify


def add_v1_routes(
    router: APIRouter, repository: ModelRepository, metrics: Metrics, classify: Callable[..., Awaitable[Response]]
) -> None:
    """`/v1/classify` (the default model), `/v1/models/<name>[/versions/<version>]/classify` answered by `classify`
    (`classify_endpoint`), `/healthz`, `/readyz` and `/metrics` over the repository's versions, on `router` (the
    app's own: a router included in it costs each request one more lookup).

    The classify paths are plain Starlette routes, each the only route of its path: the route reads its body and
    parameters itself, so FastAPI's parameter machinery would have nothing to do there but cost the request
    (BENCHMARKS.md, "The server against an older one": `bebd696` had FastAPI's routes). `classify_openapi`
    describes them.
    """

    async def classify_route(request: Request) -> Response:
        return await classify(request, request.path_params.get("name"), request.path_params.get("version"))

    for path in CLASSIFY_ROUTES:
        router.add_route(path, classify_route, methods=["POST"])
    add_status_routes(router, repository, metrics)


def classify_openapi() -> tuple[dict[str, Any], dict[str, Any]]:
    """(the classify routes' OpenAPI path items, the schemas they refer to): FastAPI writes its own routes only."""
    predictions = Predictions.model_json_schema(ref_template=REF + "{model}", mode="serialization")
    schemas = {**predictions.pop("$defs", {}), "Predictions": predictions}
    answer = {"application/json": {"schema": {"$ref": REF + "Predictions"}}}
    paths = {}
    for path, (summary, operation_id) in CLASSIFY_ROUTES.items():
        in_path = [
            {"name": name, "in": "path", "required": True, "schema": {"type": "string", "title": name.title()}}
            for name in re.findall(r"{(\w+)}", path)
        ]
        paths[path] = {
            "post": {
                "summary": summary,
                "description": "An image (JPEG, PNG, GIF, BMP, WebP or TIFF) as the multipart field `file` or as the "
                "raw body.",
                "operationId": operation_id,
                "parameters": in_path + query_parameters(),
                "requestBody": IMAGE_BODY,
                "responses": {"200": {"description": "the top classes, best first", "content": answer}},
            }
        }
    return paths, schemas


async def decoded(
    request: Request, served: ModelVersion, img, limits: RequestLimits, deadline: Deadline, budget, threads, size: int
):
    """Decode small uploads where a core is free: on the event loop when onnxruntime runs on one thread
    (small models: the loop has the other core), on the model's thread right before its batch when
    onnxruntime uses every core (decoding on the loop would fight its threads)."""
    small = size <= limits.inline_decode_bytes and img.width * img.height <= INLINE_DECODE_PIXELS
    if not small:  # in a thread of its own, so that it never holds up the loop or a batch
        return await decoded_in_turn(request, served, img, limits, deadline, budget, threads)
    if served.decode_on_worker:  # on the model's thread, right before its batch runs
        return img
    return decode_image(img, served.classifier, limits.max_pixels)  # on the loop, the model on the other core


async def decoded_in_turn(
    request: Request, served: ModelVersion, img, limits: RequestLimits, deadline: Deadline, budget, threads: Threads
):
    """A large upload decoded in a thread of `threads.decodes` once one is free and its pixels fit `budget`; not at
    all when the request waited for its turn past --request-timeout-s (504) or its client left meanwhile
    (`ClientDisconnect`, 499), as told once its pixels are held, right before the decode. A flood of 40 MP uploads
    from clients that had given up kept a core decoding for half a minute after they had gone, and its last
    requests were answered long past their timeout."""

    def still_wanted() -> None:  # in the decoding thread
        deadline.left()  # the 504 once the time is up
        if from_thread.run(request.is_disconnected):
            raise ClientDisconnect()

    checked = CheckedBudget(budget, still_wanted)
    return await run_in(threads.decodes, decode_image, img, served.classifier, limits.max_pixels, checked)


class CheckedBudget:
    """`budget` (None: none), whose hold calls `check` once the pixels are held: a decode that waited for them is
    still wanted."""

    def __init__(self, budget: PixelBudget | None, check: Callable[[], None]):
        self.budget, self.check = budget, check

    @contextmanager
    def hold(self, pixels: int) -> Iterator[None]:
        with self.budget.hold(pixels) if self.budget is not None else nullcontext():
            self.check()
            yield


async def explained(
    request: Request, served: ModelVersion, img, limits: RequestLimits, deadline: Deadline, budget, threads, params
):
    """/v1/classify?explain=true: (the answers, the explanation's JSON, the fast path's record). A client that left
    while its image decoded gets no explain pass (`ClientDisconnect`: logged and counted as 499): abandoned explain
    requests kept a server busy for seconds after their clients had gone."""
    classifier, engine = served.classifier, served.engine
    pixels = await decoded_in_turn(request, served, img, limits, deadline, budget, threads)
    if await request.is_disconnected():
        raise ClientDisconnect()
    fusion, discard = params.head_fusion, params.discard_ratio
    work = engine.run(
        explain_pixels, classifier, pixels, fusion, discard, None, served.fill, limits, timeout_s=deadline.left()
    )
    ex = await model_result(work, deadline.timeout_s)
    explanation = {
        "head_fusion": fusion,
        "discard_ratio": discard,
        "grid": ex["grid"].round(5).tolist(),
        "overlay_png": await run_in(threads.renders, overlay_png, pixels, ex["grid"]),  # not behind the decodes
        "deletion": ex["deletion"].to_dict(),
    }
    # the unknown verdict needs the logits: one more pass of the fast path, small beside the explain one
    rows = await model_result(engine.infer(pixels, deadline.left()), deadline.timeout_s)
    return judge_rows(classifier, rows[None], params.coverage), explanation, rows


def add_status_routes(router: APIRouter, repository: ModelRepository, metrics: Metrics) -> None:
    """`/healthz`, `/readyz` and `/metrics`."""

    # Plain async and no I/O: never queued behind the model. HEAD too (load balancers probe with it),
    # out of the OpenAPI document, where it would repeat GET under the same operation ID.
    @router.get("/healthz")
    @router.head("/healthz", include_in_schema=False)
    async def healthz():
        return {"status": "live"}

    @router.get("/readyz", responses={503: {"description": "loading, warming up or stopping"}})
    @router.head("/readyz", include_in_schema=False)
    async def readyz(request: Request):
        """Ready or not (`ModelRepository.ready`); with the API key (or on a server without one) also the default
        model's name, version and batch size (null while it is unloaded). Probes send no key, and what the server
        runs is not theirs to learn."""
        if not repository.ready:
            raise not_ready(repository)
        if not authorized(request.scope):
            return {"status": "ready"}
        try:  # the server is ready while it serves any model, also when the default one was unloaded
            served = repository.resolve(None, None)
        except UnknownModel:
            return {"status": "ready", "model": None, "version": None, "batch_size": None}
        return {
            "status": "ready",
            "model": served.name,
            "version": served.version,
            "batch_size": served.engine.batch_size,
        }

    @router.get("/metrics")
    async def prometheus():
        body, ctype = metrics.render()
        return Response(body, media_type=ctype)
