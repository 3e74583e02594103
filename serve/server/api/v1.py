"""The `/v1` API and the health routes: a request goes decode_request -> predict -> encode_response.

POST /v1/classify          image as multipart field `file` or as the raw body; ?top_k=5&explain=true&coverage=0.95
                           (scores are calibrated probabilities; the answer says `unknown` and `ood_score`, and
                           with `coverage` gives the `prediction_set`: see serve.runtime.trust)
POST /v1/models/<name>[/versions/<version>]/classify   the same, for one model (its latest version) or version
GET  /healthz, /readyz     live; ready once the model is loaded and warmed up
GET  /metrics              Prometheus
"""

from __future__ import annotations

from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from serve.runtime.images import PixelBudget
from serve.runtime.rollout import HEAD_FUSIONS
from serve.runtime.trust import Assessment
from serve.server.engine import judge_rows
from serve.server.explain import explain_pixels, overlay_png
from serve.server.http.errors import ApiError, model_result
from serve.server.http.uploads import decode_image, decode_request, open_upload
from serve.server.metrics import Metrics
from serve.server.payload_log import PayloadLog
from serve.server.repository.repository import ModelRepository, UnknownModel
from serve.server.repository.version import ModelVersion
from serve.server.settings import RequestLimits

# A small file can still declare a huge image (a flat 40 MP PNG compresses to kilobytes): only images
# up to 1 MP, a few milliseconds of decoding and resizing, are decoded on the loop or the model's thread.
INLINE_DECODE_PIXELS = 1_000_000
TRUE, FALSE = ("1", "true", "yes"), ("0", "false", "no")
NO_DEFAULT = "the default model has no version loaded (unloaded?): load one with POST /v2/repository/models/<name>/load"


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


def request_id_of(request: Request) -> str:
    """The ID `serve.server.http.guard.RequestGuard` gave the request ("" without the guard)."""
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


def parse_params(query, form: dict[str, str], default_top_k: int) -> dict[str, Any]:
    """The query string's and the form's parameters, checked: `ApiError("bad_request")` says what is wrong.

    The query string wins where both give a parameter, but a bad value is refused wherever it is.
    """
    if form:
        parse_params(form, {}, default_top_k)  # the form alone, as if it were the query
    params = {**form, **dict(query)}
    try:
        top_k = int(params.get("top_k", default_top_k))
        discard = float(params.get("discard_ratio", 0.0))
        coverage = None if params.get("coverage") in (None, "") else float(params["coverage"])
    except ValueError:
        raise ApiError("bad_request", "top_k must be an integer, discard_ratio and coverage numbers") from None
    explain = str(params.get("explain", "false")).lower()
    fusion = params.get("head_fusion", "mean")
    if explain not in TRUE + FALSE:
        raise ApiError("bad_request", f"explain must be true or false, got {explain!r}")
    if top_k < 1:
        raise ApiError("bad_request", f"top_k must be at least 1, got {top_k}")
    if fusion not in HEAD_FUSIONS:
        raise ApiError("bad_request", f"head_fusion must be one of {', '.join(HEAD_FUSIONS)}, got {fusion!r}")
    if not 0.0 <= discard < 1.0:
        raise ApiError("bad_request", f"discard_ratio must be in [0, 1), got {discard}")
    return {
        "top_k": top_k,
        "explain": explain in TRUE,
        "head_fusion": fusion,
        "discard_ratio": discard,
        "coverage": coverage,
    }


def check_coverage(classifier, coverage: float | None) -> None:
    """`ApiError("bad_request")` (422) unless the file can build prediction sets at `coverage`."""
    try:
        classifier.check_coverage(coverage)
    except ValueError as e:
        raise ApiError("bad_request", str(e)) from None


def v1_router(
    repository: ModelRepository,
    metrics: Metrics,
    limits: RequestLimits,
    budget: PixelBudget | None = None,
    payloads: PayloadLog | None = None,
) -> APIRouter:
    """`/v1/classify` (the default model), `/v1/models/<name>[/versions/<version>]/classify`, `/healthz`,
    `/readyz` and `/metrics` over the repository's versions; large uploads hold `budget` while they decode;
    each answer is recorded in `payloads` (None: nowhere)."""
    router = APIRouter()

    async def classify(request: Request):
        """Classify one image (multipart field `file` or raw body); `explain=true` adds the rollout map."""
        path = request.path_params
        served = resolve(repository, path.get("name"), path.get("version"))
        with served.held():  # the version drains only once this request is done with it
            return await classify_with(served, request)

    async def classify_with(served: ModelVersion, request: Request):
        classifier, engine = served.classifier, served.engine
        model = (served.name, served.version, classifier.labels)  # as the payload log names it
        data, form = await decode_request(request, limits)
        params = parse_params(request.query_params, form, limits.top_k)
        coverage = params["coverage"]
        check_coverage(classifier, coverage)
        img = open_upload(data, limits.max_pixels)  # the header: not an image, or too many pixels, fails here
        small = len(data) <= limits.inline_decode_bytes and img.width * img.height <= INLINE_DECODE_PIXELS
        if params["explain"]:  # the explain pass computes the probabilities too: no second forward pass
            answers, explanation, rows = await explained(served, img, params, coverage, limits, budget, answer)
            if payloads is not None:
                payloads.record(request_id_of(request), "/v1/classify", model, rows["probs"][None], [data])
            return JSONResponse(encode_response(served, answers, params["top_k"], explanation))
        # Decode small uploads where a core is free: on the event loop when onnxruntime runs on one thread
        # (small models: the loop has the other core), on the model's thread right before its batch when
        # onnxruntime uses every core (decoding on the loop would fight its threads; BENCHMARKS.md, serving).
        if not small:  # in a thread of its own, so that it never holds up the loop or a batch
            item = await run_in_threadpool(decode_image, img, classifier, limits.max_pixels, budget)
        elif served.decode_on_worker:  # on the model's thread, right before its batch runs
            item = img
        else:  # on the event loop, while the model runs on the other core
            item = decode_image(img, classifier, limits.max_pixels)
        rows = await model_result(engine.infer(item), limits.request_timeout_s)  # logits, probs, features
        if payloads is not None:
            payloads.record(request_id_of(request), "/v1/classify", model, rows["probs"][None], [data])
        return JSONResponse(encode_response(served, answer(served, rows, coverage), params["top_k"]))

    def answer(served: ModelVersion, rows: np.ndarray, coverage: float | None) -> Assessment:
        # the trust metrics counted this answer on the batcher's thread (serve.server.app's `on_answers`)
        return judge_rows(served.classifier, rows[None], coverage)

    # A plain Starlette route: it takes the raw Request anyway, and FastAPI's per-request dependency
    # machinery costs a few percent of a small model's throughput (BENCHMARKS.md, serving). So FastAPI
    # does not see it; serve.server.api.openapi describes it.
    for route in ("/v1/classify", "/v1/models/{name}/classify", "/v1/models/{name}/versions/{version}/classify"):
        router.add_route(route, classify, methods=["POST"])

    add_status_routes(router, repository, metrics)
    return router


async def explained(served: ModelVersion, img, params: dict, coverage, limits: RequestLimits, budget, answer):
    """/v1/classify?explain=true: (the answers, the explanation's JSON, the fast path's record)."""
    classifier, engine = served.classifier, served.engine
    pixels = await run_in_threadpool(decode_image, img, classifier, limits.max_pixels, budget)
    fusion, discard = params["head_fusion"], params["discard_ratio"]
    work = engine.run(explain_pixels, classifier, pixels, fusion, discard, None, served.fill, limits)
    ex = await model_result(work, limits.request_timeout_s)
    explanation = {
        "head_fusion": fusion,
        "discard_ratio": discard,
        "grid": ex["grid"].round(5).tolist(),
        "overlay_png": await run_in_threadpool(overlay_png, pixels, ex["grid"]),  # a few ms: off the loop
        "deletion": ex["deletion"].to_dict(),
    }
    # the unknown verdict needs the logits: one more pass of the fast path, small beside the explain one
    rows = await model_result(engine.infer(pixels), limits.request_timeout_s)
    return answer(served, rows, coverage), explanation, rows


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
    async def readyz():
        if not repository.ready:
            raise ApiError("not_ready", "a model is loading or warming up (or the server is stopping)")
        served = resolve(repository, None, None)
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
