"""Blocking steps of a request, run off the event loop, each kind under a thread limit of its own.

Starlette's `run_in_threadpool` shares anyio's 40 threads between every route. A step that may wait there holds
its thread while it waits: a large image waits for its share of the pixel budget (`serve.runtime.images.
PixelBudget`), a model load or unload waits for the one before it. Forty such requests left no thread for any
other step, and a small KServe v2 request took seconds. Here each kind of step has its own `CapacityLimiter`:
past it, requests wait on the event loop and hold no thread.

    decodes  large uploads decoding: one per core, as the budget lets them run
    renders  the explain overlay of a request whose model pass is done: one per core. On `decodes` it waited
             behind every decode queued before it, so under a burst no explain was answered until the last
             image had decoded
    parses   KServe v2 JSON bodies: one per core; each takes many times its size in memory while it is parsed
    changes  repository loads and unloads: one at a time, as the repository makes them anyway
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from anyio import CapacityLimiter, to_thread

from serve.runtime.jobs import usable_cores

T = TypeVar("T")


class Threads:
    """The limiters of one app: `build_app` makes them, its routes share them (a limiter's waiters belong to the
    event loop they wait in, so two apps, each on its own loop, must not share one).

    Args:
        cores: decodes, renders and parses at a time (None: the cores this process may use).
    """

    def __init__(self, cores: int | None = None):
        cores = cores or usable_cores()
        self.decodes, self.renders, self.parses = CapacityLimiter(cores), CapacityLimiter(cores), CapacityLimiter(cores)
        self.changes = CapacityLimiter(1)


async def run_in(limiter: CapacityLimiter, fn: Callable[..., T], *args) -> T:
    """`fn(*args)` in a worker thread once `limiter` has room; waiting for it holds no thread."""
    return await to_thread.run_sync(fn, *args, limiter=limiter)
