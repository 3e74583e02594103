"""Waiting for the model's answers, for every transport: the failures of the batcher (a full queue, a server
that stops, a deadline) become the `ApiError` of their kind.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable

import numpy as np

from serve.server.batching import QueueFull, ShuttingDown
from serve.server.errors import ApiError


class Deadline:
    """A request's --request-timeout-s, counted from when its body is in: its waits for a decode or a parse and
    for the model all come out of it. Each had the whole timeout before: a large upload that waited for the
    pixel budget could then wait for the model as long again (an explain request, twice more)."""

    def __init__(self, timeout_s: float):
        self.timeout_s, self.at = timeout_s, time.monotonic() + timeout_s

    def left(self) -> float:
        """The seconds left; the 504's `ApiError` once none are."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise api_error(TimeoutError(), self.timeout_s)
        return left


async def model_result(work: Awaitable, timeout_s: float):
    """Await work queued on the model's worker; its failures become the `ApiError` of their kind."""
    try:
        return await work
    except (QueueFull, ShuttingDown, TimeoutError, asyncio.TimeoutError) as e:  # distinct timeouts before 3.11
        raise api_error(e, timeout_s) from None


def api_error(e: BaseException, timeout_s: float) -> BaseException:
    """The `ApiError` of a failure of the model's worker (any other exception as it is)."""
    if isinstance(e, QueueFull):
        return ApiError("queue_full", str(e))
    if isinstance(e, ShuttingDown):
        return ApiError("shutting_down", str(e))
    if isinstance(e, (TimeoutError, asyncio.TimeoutError)):
        return ApiError("timeout", f"no result within {timeout_s} s; retry later")
    return e


async def batch_results(engine, images, deadline: Deadline) -> np.ndarray:
    """The (B,) records of `engine.infer` for a request's B images, each joining the batches, all queued or none
    (503), by the request's `deadline` (504); the first failure is raised once every image has settled (nothing is
    left running or unobserved). One image, the common case, is awaited directly."""
    timeout_s, left = deadline.timeout_s, deadline.left()
    if len(images) == 1:
        return (await model_result(engine.infer(images[0], left), timeout_s))[None]
    results = await model_result(engine.infer_all(images, left), timeout_s)
    failed = next((r for r in results if isinstance(r, BaseException)), None)
    if failed is not None:
        raise api_error(failed, timeout_s) from None
    return np.stack(results)
