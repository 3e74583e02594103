"""The HTTP API and the app factory: `build_app(classifier, settings)` returns the whole server.

Routes (the Gradio UI is mounted at `/`):

    POST /v1/classify          image as multipart field `file` or as the raw body; ?top_k=5&explain=true
    GET  /healthz, /readyz     live; ready once the model is loaded and warmed up
    GET  /v2/health/live|ready, /v2/models/<name>, POST /v2/models/<name>/infer   (KServe Open Inference v2)
    GET  /metrics              Prometheus

A request goes decode_request -> predict -> encode_response. Every failure is an `ApiError` value
with a code; `ERROR_STATUS` is the one place that maps codes to HTTP statuses, and every error
body is JSON: {"error": {"code": ..., "message": ...}}.
"""

from __future__ import annotations

import asyncio
import base64
import inspect
import io
import json
import logging
from collections.abc import Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from PIL import Image
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from serve.runtime.images import ImageError, load_image, open_image
from serve.server.batching import Engine, QueueFull, ShuttingDown
from serve.server.metrics import Metrics, MetricsMiddleware
from serve.server.settings import ServeSettings

log = logging.getLogger(__name__)

ERROR_STATUS = {
    "empty": 422,  # zero bytes
    "corrupt": 422,  # an image header, but the data is truncated or broken
    "bad_request": 422,  # a parameter or a tensor that does not fit
    "not_an_image": 415,  # no image header at all
    "unsupported": 415,  # an image mode or array we cannot use
    "unsupported_media_type": 415,  # a content type that cannot carry an image
    "too_large": 413,  # over the pixel limit (checked from the header)
    "body_too_large": 413,  # over max_bytes
    "not_found": 404,
    "method_not_allowed": 405,
    "queue_full": 503,
    "shutting_down": 503,
    "not_ready": 503,
    "timeout": 504,
    "internal": 500,
}
RAW_TYPES = ("image/", "application/octet-stream")


class ApiError(Exception):
    """A failed request as a value: a code from `ERROR_STATUS` and a message the user can act on."""

    def __init__(self, code: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.code, self.message, self.headers = code, message, headers or {}

    @property
    def status(self) -> int:
        return ERROR_STATUS[self.code]


def error_response(err: ApiError, settings: ServeSettings) -> JSONResponse:
    headers = {**err.headers, **({"Retry-After": str(settings.retry_after_s)} if err.status == 503 else {})}
    return JSONResponse({"error": {"code": err.code, "message": err.message}}, err.status, headers=headers)


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, refused with 413 as soon as it passes `max_bytes` (before reading it all)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError("body_too_large", f"the body is {int(declared):,} bytes, over the {max_bytes:,}-byte limit")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ApiError("body_too_large", f"the body is over the {max_bytes:,}-byte limit; send a smaller image")
        chunks.append(chunk)
    body = b"".join(chunks)
    request._body = body  # lets request.form() parse what was already read
    return body


async def decode_request(request: Request, settings: ServeSettings) -> tuple[bytes, dict[str, str]]:
    """The image bytes and any form fields, from a multipart upload or a raw image body."""
    body = await read_body(request, settings.max_bytes)
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype == "multipart/form-data":
        async with request.form() as form:  # closes spooled upload files when done
            upload = form.get("file")
            fields = {k: v for k, v in form.items() if isinstance(v, str)}
            if upload is None or isinstance(upload, str):
                raise ApiError("bad_request", "multipart uploads must carry the image in a file field named 'file'")
            return await upload.read(), fields
    if ctype and not ctype.startswith(RAW_TYPES):
        raise ApiError(
            "unsupported_media_type",
            f"content type {ctype!r} cannot carry an image: send the image bytes as image/* or "
            "application/octet-stream, or multipart/form-data with the field 'file'",
        )
    return body, {}


def open_upload(data: bytes, settings: ServeSettings) -> Image.Image:
    """The image's header only (size checked against `max_pixels`); `decode_image` decodes it."""
    with _as_api_error():
        return open_image(bytes(data), max_pixels=settings.max_pixels)


def decode_image(img: Image.Image, classifier, settings: ServeSettings) -> np.ndarray:
    """An opened image -> (H, W, 3) uint8 at the model's input size."""
    with _as_api_error():
        return classifier.preprocess.to_uint8(load_image(img, max_pixels=settings.max_pixels))


@contextmanager
def _as_api_error() -> Iterator[None]:
    """An `ImageError` becomes the `ApiError` of its kind."""
    try:
        yield
    except ImageError as e:
        raise ApiError(e.kind if e.kind in ERROR_STATUS else "corrupt", str(e)) from None


def encode_response(classifier, probs: np.ndarray, top_k: int, explanation: dict | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": classifier.name,
        "version": classifier.version,
        "predictions": [
            {"label": label, "score": score} for label, score in classifier.top_k(probs[None], max(1, top_k))[0]
        ],
    }
    if explanation is not None:
        out["explanation"] = explanation
    return out


def _parse_params(query, form: dict[str, str], settings: ServeSettings) -> dict[str, Any]:
    params = {**form, **dict(query)}
    try:
        top_k = int(params.get("top_k", settings.top_k))
        discard = float(params.get("discard_ratio", 0.0))
    except ValueError:
        raise ApiError("bad_request", "top_k must be an integer and discard_ratio a number") from None
    explain = str(params.get("explain", "false")).lower() in ("1", "true", "yes")
    fusion = params.get("head_fusion", "mean")
    if top_k < 1:
        raise ApiError("bad_request", f"top_k must be at least 1, got {top_k}")
    if fusion not in ("mean", "max", "min"):
        raise ApiError("bad_request", f"head_fusion must be mean, max or min, got {fusion!r}")
    if not 0.0 <= discard < 1.0:
        raise ApiError("bad_request", f"discard_ratio must be in [0, 1), got {discard}")
    return {"top_k": top_k, "explain": explain, "head_fusion": fusion, "discard_ratio": discard}


def build_app(classifier, settings: ServeSettings | None = None, with_ui: bool = True) -> FastAPI:
    """The server: API routes, metrics and (unless `with_ui` is False) the Gradio UI at `/`.

    Args:
        classifier: a loaded `serve.runtime.classifier.OnnxClassifier`.
        settings: limits and batching; defaults when None.
        with_ui: mount the Gradio Blocks at `/`.

    Returns:
        A FastAPI app whose lifespan starts the batcher, warms the model up and drains on shutdown.
    """
    from serve.server.ui import build_ui, explain_pixels, mean_fill_of

    settings = settings or ServeSettings()
    metrics = Metrics()
    engine = Engine(
        classifier,
        settings,
        on_batch=metrics.batch_size.observe,
        decode=lambda img: decode_image(img, classifier, settings),  # an upload from `open_upload`
    )
    metrics.queue_depth.set_function(lambda: engine.batcher.depth)
    # Decode small uploads where a core is free. With onnxruntime on one thread (small models) the
    # event loop has the other core: decoding there runs in parallel with the model. With onnxruntime
    # on every core there is no free core: decoding on the loop would fight its threads (ViT-Ti/16:
    # 0.72x of in-process throughput), while decoding on the model's thread just before each batch,
    # in series, as in-process code does, reached 0.89x (benchmarks/serve_bench.py).
    decode_on_worker = classifier.threads != 1
    fill = mean_fill_of(classifier)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await run_in_threadpool(engine.start)
        log.info("model %s warmed up; ready", classifier.name)
        try:
            yield
        finally:
            await run_in_threadpool(engine.stop)

    if settings.opentelemetry and "telemetry" not in inspect.signature(FastAPI).parameters:
        log.warning("--opentelemetry needs a FastAPI with native OpenTelemetry (telemetry=); this one has none")
    off = None if settings.opentelemetry else {"tracing": False, "metrics": False, "logs": False}
    app = FastAPI(title="vitscope", version=str(classifier.version), lifespan=lifespan, telemetry=off)
    app.state.engine, app.state.metrics, app.state.settings = engine, metrics, settings

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError):
        return error_response(err, settings)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, err: RequestValidationError):
        where = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        return error_response(ApiError("bad_request", f"invalid request: {where}"), settings)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException):
        # Starlette's own errors: its routing (404, 405) and its form parser (a malformed multipart body)
        code = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}.get(err.status_code, "bad_request")
        return error_response(ApiError(code, str(err.detail)), settings)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception):
        log.exception("unexpected error on %s", request.url.path)
        return error_response(
            ApiError("internal", f"internal error ({type(err).__name__}); see the server log"), settings
        )

    async def engine_call(work):
        """Await work queued on the model's worker; map its failures to API errors."""
        try:
            return await work
        except QueueFull as e:
            raise ApiError("queue_full", str(e)) from None
        except ShuttingDown as e:
            raise ApiError("shutting_down", str(e)) from None
        except (TimeoutError, asyncio.TimeoutError):  # distinct classes before Python 3.11
            raise ApiError("timeout", f"no result within {settings.request_timeout_s} s; retry later") from None

    async def predict(item) -> np.ndarray:
        return await engine_call(engine.predict(item))

    async def run(fn, *args):
        return await engine_call(engine.run(fn, *args))

    async def classify(request: Request):
        """Classify one image (multipart field `file` or raw body); `explain=true` adds the rollout map."""
        data, form = await decode_request(request, settings)
        params = _parse_params(request.query_params, form, settings)
        img = open_upload(data, settings)  # the header: not an image, or too many pixels, fails here
        small = len(data) <= settings.inline_decode_bytes and img.width * img.height <= INLINE_DECODE_PIXELS
        explanation = None
        if not params["explain"]:
            if not small:  # in a thread of its own, so that it never holds up the loop or a batch
                probs = await predict(await run_in_threadpool(decode_image, img, classifier, settings))
            elif decode_on_worker:  # on the model's thread, right before its batch runs
                probs = await predict(img)
            else:  # on the event loop, while the model runs on the other core
                probs = await predict(decode_image(img, classifier, settings))
        else:  # the explain pass computes the probabilities too: no second forward pass
            pixels = await run_in_threadpool(decode_image, img, classifier, settings)
            ex = await run(
                explain_pixels, classifier, pixels, params["head_fusion"], params["discard_ratio"], None, fill, settings
            )
            probs = ex["probs"]
            overlay = await run_in_threadpool(_overlay_png, pixels, ex["grid"])  # a few ms: off the loop
            explanation = {
                "head_fusion": params["head_fusion"],
                "discard_ratio": params["discard_ratio"],
                "grid": ex["grid"].round(5).tolist(),
                "overlay_png": overlay,
                "deletion": ex["deletion"].to_dict(),
            }
        return JSONResponse(encode_response(classifier, probs, params["top_k"], explanation))  # already plain JSON

    # A plain Starlette route: it takes the raw Request anyway, and FastAPI's per-request dependency
    # machinery cost about 5% of the server's throughput on the sample model (benchmarks/serve_bench.py).
    # So it is not in the generated OpenAPI schema; the README documents it.
    app.router.add_route("/v1/classify", classify, methods=["POST"])

    @app.get("/healthz")
    async def healthz():
        return {"status": "live"}

    @app.get("/readyz")
    async def readyz():
        if not engine.ready:
            raise ApiError("not_ready", "the model is loading or warming up (or the server is stopping)")
        return {
            "status": "ready",
            "model": classifier.name,
            "version": classifier.version,
            "batch_size": engine.batch_size,
        }

    @app.get("/metrics")
    async def prometheus():
        body, ctype = metrics.render()
        return Response(body, media_type=ctype)

    _add_v2_routes(app, classifier, engine, settings, predict)

    api_routes = list(app.router.routes)

    async def no_such_route(request: Request):
        """Any other /v1 or /v2 request: a JSON 404 or 405 (the UI at `/` would otherwise answer it)."""
        path = request.url.path
        allowed = sorted(
            {m for r in api_routes if r.matches(request.scope)[0] == Match.PARTIAL for m in getattr(r, "methods", ())}
        )
        if allowed:
            raise ApiError(
                "method_not_allowed",
                f"{path} takes {', '.join(allowed)}, not {request.method}",
                {"Allow": ", ".join(allowed)},
            )
        bare = {**request.scope, "path": path.rstrip("/")}
        if path.endswith("/") and any(r.matches(bare)[0] != Match.NONE for r in api_routes):
            raise ApiError("not_found", f"no route {path}: drop the trailing slash ({path.rstrip('/')})")
        raise ApiError("not_found", f"no route {path}: the API is POST /v1/classify and the KServe v2 paths under /v2")

    every_method = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
    for path in ("/v1", "/v1/{rest:path}", "/v2/{rest:path}"):  # /v2 itself is the server's metadata
        app.router.add_route(path, no_such_route, methods=every_method, include_in_schema=False)

    app.add_middleware(MetricsMiddleware, metrics=metrics, routes=("/v1", "/v2", "/healthz", "/readyz", "/gradio_api"))
    if with_ui:
        import gradio as gr

        ui = build_ui(classifier, engine, settings)
        app = gr.mount_gradio_app(app, ui, path="/", max_file_size=settings.max_bytes, ssr_mode=False)
    return app


# A small file can still declare a huge image (a flat 40 MP PNG compresses to kilobytes): only images
# up to 1 MP, a few milliseconds of decoding and resizing, are decoded on the loop or the model's thread.
INLINE_DECODE_PIXELS = 1_000_000


def _overlay_png(pixels: np.ndarray, grid: np.ndarray) -> str:
    """The rollout overlay in the UI's default colours, as base64 PNG."""
    from serve.server.ui import render_overlay

    buf = io.BytesIO()
    Image.fromarray(render_overlay(pixels, grid)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _add_v2_routes(app: FastAPI, classifier, engine: Engine, settings: ServeSettings, predict) -> None:
    """KServe Open Inference Protocol v2: health, model metadata and tensor inference.

    The input tensor is `image`, UINT8 of shape [B, H, W, 3] at the model's input size (resize and
    crop on the client, or use /v1/classify with encoded images); the output is `probs`, FP32 [B, K].
    """
    H, W = classifier.input_size
    K = len(classifier.labels)

    def check_name(name: str) -> None:
        if name != classifier.name:
            raise ApiError("not_found", f"unknown model {name!r}; this server serves {classifier.name!r}")

    @app.get("/v2")
    async def v2_server():
        return {"name": "vitscope", "version": str(classifier.version), "extensions": []}

    @app.get("/v2/health/live")
    async def v2_live():
        return {"live": True}

    @app.get("/v2/health/ready")
    async def v2_ready():
        if not engine.ready:
            raise ApiError("not_ready", "the model is loading or warming up (or the server is stopping)")
        return {"ready": True}

    @app.get("/v2/models/{name}/ready")
    async def v2_model_ready(name: str):
        check_name(name)
        return await v2_ready()

    @app.get("/v2/models/{name}")
    async def v2_metadata(name: str):
        check_name(name)
        return {
            "name": classifier.name,
            "versions": [str(classifier.version)],
            "platform": "onnxruntime_onnx",
            "inputs": [{"name": "image", "datatype": "UINT8", "shape": [-1, H, W, 3]}],
            "outputs": [{"name": "probs", "datatype": "FP32", "shape": [-1, K]}],
            "parameters": {"labels": list(classifier.labels), "preprocess": classifier.preprocess.to_dict()},
        }

    @app.post("/v2/models/{name}/infer")
    async def v2_infer(name: str, request: Request):
        check_name(name)
        body = await read_body(request, settings.max_bytes)
        # at most max_batch_size images per request, so one client cannot fill the whole queue
        pixels = await run_in_threadpool(_v2_tensor, body, (H, W), settings.max_batch_size)
        results = await asyncio.gather(*(predict(p) for p in pixels), return_exceptions=True)  # each joins the batches
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:  # every image has settled: nothing is left running or unobserved
            raise failed
        out = np.stack(results).astype(np.float32)  # (B, K)
        answer = {
            "model_name": classifier.name,
            "model_version": str(classifier.version),
            "outputs": [{"name": "probs", "datatype": "FP32", "shape": list(out.shape), "data": out.ravel().tolist()}],
        }
        req_id = request.headers.get("x-request-id")
        if req_id:
            answer["id"] = req_id
        return answer


def _v2_tensor(body: bytes, size: tuple[int, int], max_images: int) -> np.ndarray:
    """An inference request's JSON -> (B, H, W, 3) uint8, or an `ApiError` saying what does not fit."""
    H, W = size
    try:
        req = json.loads(body)
        tensor = req["inputs"][0]
        shape, dtype, data = list(tensor["shape"]), str(tensor["datatype"]).upper(), tensor["data"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ApiError(
            "bad_request",
            'send JSON {"inputs": [{"name": "image", "datatype": "UINT8", "shape": [B, H, W, 3], "data": [...]}]}',
        ) from None
    if dtype != "UINT8":
        raise ApiError("bad_request", f"input datatype must be UINT8 pixels, got {dtype}")
    if len(shape) != 4 or shape[1:] != [H, W, 3] or not 1 <= shape[0] <= max_images:
        raise ApiError(
            "bad_request",
            f"input shape must be [B, {H}, {W}, 3] with 1 <= B <= {max_images} "
            f"(split larger tensors into several requests), got {shape}",
        )
    try:
        arr = np.asarray(data, dtype=np.int64).reshape(shape)
    except (ValueError, TypeError, OverflowError):
        raise ApiError(
            "bad_request", f"input data must hold {int(np.prod(shape))} integers for shape {shape}"
        ) from None
    if arr.size and (arr.min() < 0 or arr.max() > 255):
        raise ApiError("bad_request", "UINT8 pixel values must be in 0..255")
    return arr.astype(np.uint8)
