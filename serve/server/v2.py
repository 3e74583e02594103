"""KServe Open Inference Protocol v2: health, model metadata and tensor inference, as a router of its own.

    GET  /v2, /v2/health/live|ready, /v2/models/<name>, /v2/models/<name>/ready
    POST /v2/models/<name>/infer

The input tensor is `image`, UINT8 of shape [B, H, W, 3] at the model's input size (resize and crop on
the client, or use /v1/classify with encoded images); the output is `probs`, FP32 [B, K].
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from serve.server.batching import Engine
from serve.server.errors import ApiError, model_result
from serve.server.settings import ServeSettings
from serve.server.uploads import read_body


def v2_router(classifier, engine: Engine, settings: ServeSettings) -> APIRouter:
    """The v2 routes for one classifier behind one engine."""
    router = APIRouter(prefix="/v2")
    H, W = classifier.input_size
    K = len(classifier.labels)

    def check_name(name: str) -> None:
        if name != classifier.name:
            raise ApiError("not_found", f"unknown model {name!r}; this server serves {classifier.name!r}")

    @router.get("")
    async def v2_server():
        return {"name": "vitscope", "version": str(classifier.version), "extensions": []}

    @router.get("/health/live")
    async def v2_live():
        return {"live": True}

    @router.get("/health/ready")
    async def v2_ready():
        if not engine.ready:
            raise ApiError("not_ready", "the model is loading or warming up (or the server is stopping)")
        return {"ready": True}

    @router.get("/models/{name}/ready")
    async def v2_model_ready(name: str):
        check_name(name)
        return await v2_ready()

    @router.get("/models/{name}")
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

    @router.post("/models/{name}/infer")
    async def v2_infer(name: str, request: Request):
        check_name(name)
        body = await read_body(request, settings.max_bytes)
        # at most max_batch_size images per request, so one client cannot fill the whole queue
        pixels = await run_in_threadpool(parse_tensor, body, (H, W), settings.max_batch_size)
        work = (model_result(engine.predict(p), settings) for p in pixels)  # each joins the batches
        results = await asyncio.gather(*work, return_exceptions=True)
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

    return router


def parse_tensor(body: bytes, size: tuple[int, int], max_images: int) -> np.ndarray:
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
