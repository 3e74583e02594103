"""`parallel_map`: the process pool of the passes that decode a whole folder (scan, copies, cache, report, prepare)."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from typing import Any


def parallel_map(fn: Callable[[Any], Any], tasks: list, workers: int) -> list:
    """`[fn(t) for t in tasks]` in up to `workers` forked processes (here, for under two tasks or workers).

    On success the pool is closed and joined, never terminated: terminating a pool while its handler thread is
    still starting workers can leave a worker that nothing stops, and the caller waits for it forever (a pool
    given no work at all, terminated at once, hung a test run that way). Only an error terminates it.
    """
    workers = min(workers, len(tasks))
    if workers < 2:
        return [fn(t) for t in tasks]
    pool = mp.get_context("fork").Pool(workers)
    try:
        out = pool.map(fn, tasks)
    except BaseException:
        pool.terminate()
        raise
    else:
        pool.close()
    finally:
        pool.join()
    return out
