"""Waiting for the model's answers, for every transport: the failures of the batcher (a full queue, a server
that stops, a deadline) become the `ApiError` of their kind.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import numpy as np

from serve.server.batching import QueueFull, ShuttingDown
from serve.server.errors import ApiError


async def model_result(work: Awaitable, timeout_s: float):
    """Await work queued on the model's worker; its failures become the `ApiError` of their kind."""
    try:
        return await work
    except QueueFull as e:
        raise ApiError("queue_full", str(e)) from None
    except ShuttingDown as e:
        raise ApiError("shutting_down", str(e)) from None
    except (TimeoutError, asyncio.TimeoutError):  # distinct classes before Python 3.11
        raise ApiError("timeout", f"no result within {timeout_s} s; retry later") from None


async def batch_results(engine, images, timeout_s: float) -> np.ndarray:
    """The (B,) records of `engine.infer` for a request's B images, each joining the batches; the first
    failure is raised once every image has settled (nothing is left running or unobserved). One image, the
    common case, is awaited directly."""
    if len(images) == 1:
        return (await model_result(engine.infer(images[0]), timeout_s))[None]
    work = (model_result(engine.infer(image), timeout_s) for image in images)
    results = await asyncio.gather(*work, return_exceptions=True)
    failed = next((r for r in results if isinstance(r, BaseException)), None)
    if failed is not None:
        raise failed
    return np.stack(results)
