"""Micro-batching: one worker thread owns the ONNX session and runs concurrent requests together.

Requests put (H, W, 3) uint8 images on a bounded queue with a future: the server's is an asyncio future
of its event loop, settled with the rest of its batch in one callback; other callers get a
`concurrent.futures.Future`. The worker takes the first waiting image and everything already queued
behind it; when that shows concurrency (more than one image now, or in the last batch) it may wait up
to `max_delay_ms` for more (by default it does not), until `max_batch_size`. A lone request runs at once: under no load,
waiting only adds latency. Then it decodes whatever arrived still encoded (`prepare`), stacks the
images and runs one forward pass. Decoding here rather than on the event loop (as LitServe decodes in
its workers) never has a decode compete with onnxruntime's threads for the cores; the API does so
when onnxruntime uses every core (`serve.server.api.v1`).

Other work that needs the session (rollout maps, deletion curves) is queued as a plain call and runs
alone, on the same thread, so the session is never used from two threads or from the event loop. The
model behind it, its batch size and its forward pass are `serve.server.engine`'s.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """The bounded queue is full: the caller should retry later (HTTP 503 + Retry-After)."""


class ShuttingDown(RuntimeError):
    """The batcher is draining after a stop request and takes no new work."""


@dataclass
class _Image:
    item: Any  # (H, W, 3) uint8, or what `prepare` turns into it
    future: Future | asyncio.Future


@dataclass
class _Call:
    fn: Callable[..., Any]
    args: tuple
    future: Future | asyncio.Future


class MicroBatcher:
    """Runs `predict_batch` on batches of queued images from one worker thread.

    Args:
        predict_batch: (B, H, W, 3) uint8 -> (B, ...) array, one row per image.
        max_batch_size: most images in one call of `predict_batch`.
        max_delay_ms: how long a batch waits for more images once there is concurrency.
        queue_size: most items waiting; `submit` raises `QueueFull` beyond it.
        on_batch: called with the realised batch size after each batch (for metrics).
        prepare: turns a submitted item into its (H, W, 3) uint8 image on the worker thread, right
            before its batch runs (for example, decodes an upload); an item it fails on fails its
            own request only. None: items are images already.
    """

    def __init__(
        self,
        predict_batch: Callable[[np.ndarray], np.ndarray],
        max_batch_size: int = 16,
        max_delay_ms: float = 0.0,
        queue_size: int = 256,
        on_batch: Callable[[int], None] | None = None,
        prepare: Callable[[Any], np.ndarray] | None = None,
    ):
        self.predict_batch = predict_batch
        self.prepare = prepare
        self.max_batch_size = max_batch_size
        self.max_delay = max_delay_ms / 1000.0
        self.on_batch = on_batch
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._admit = threading.RLock()  # held by each producer from its check for room to its last put
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_batch = 1

    @property
    def depth(self) -> int:
        """Items waiting in the queue (not counting the batch being run)."""
        return self._queue.qsize()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> MicroBatcher:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="vitscope-batcher", daemon=True)
            self._thread.start()
        return self

    def submit(self, item: Any, future: asyncio.Future | None = None) -> Future | asyncio.Future:
        """Queue one (H, W, 3) uint8 image (or an item for `prepare`); the future resolves to its row of the output.

        Args:
            future: an asyncio future of the caller's event loop to resolve, rather than a new
                `concurrent.futures.Future`: a batch then wakes the loop once, not once per request.
        """
        return self._put(_Image(item, Future() if future is None else future))

    def submit_all(self, items: Sequence[Any], futures: Sequence[asyncio.Future]) -> Sequence[asyncio.Future]:
        """Queue every item (as `submit`, each resolving its future), or none: `QueueFull` when they do not all fit
        now. A request's images queued in part would run, to be thrown away with the 503 of the rest."""
        with self._admit:
            if self._stopping.is_set():
                raise ShuttingDown("the server is shutting down; send the request to another replica or retry")
            if len(items) > self._queue.maxsize - self._queue.qsize():
                raise QueueFull(f"the server is busy: the request's {len(items)} images do not fit its queue now")
            for item, future in zip(items, futures, strict=True):
                self._put(_Image(item, future))
        return futures

    def call(self, fn: Callable[..., Any], *args: Any, future: asyncio.Future | None = None) -> Future | asyncio.Future:
        """Queue `fn(*args)` to run alone on the worker thread; the future (as for `submit`) resolves to its result."""
        return self._put(_Call(fn, args, Future() if future is None else future))

    def _put(self, item: _Image | _Call) -> Future:
        if self._stopping.is_set():
            raise ShuttingDown("the server is shutting down; send the request to another replica or retry")
        if self._thread is None:
            raise RuntimeError("the batcher is not started; call start() first")
        try:
            with self._admit:  # not between `submit_all`'s check and its puts
                self._queue.put_nowait(item)
        except queue.Full:
            raise QueueFull(f"the server is busy ({self._queue.maxsize} images waiting); retry shortly") from None
        return item.future

    def close(self, timeout: float | None = 30.0) -> bool:
        """Stop taking work, finish everything already queued, then stop the worker thread.

        Returns:
            True when the queue drained within `timeout`.
        """
        with self._admit:  # not between `submit_all`'s check and its puts: all of a request's images, or none
            self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("batcher still busy after %.1f s; abandoning the remaining work", timeout)
                return False
        return True

    def _loop(self) -> None:
        pending: _Image | _Call | None = None
        while True:
            item = pending
            pending = None
            if item is None:
                try:
                    item = self._queue.get(timeout=0.05)
                except queue.Empty:
                    if self._stopping.is_set():
                        return  # drained: nothing queued and no new work accepted
                    continue
            if isinstance(item, _Call):
                _run_call(item)
                continue
            batch = [item]
            deadline = None
            while len(batch) < self.max_batch_size:
                try:
                    nxt = self._queue.get_nowait()  # whatever is already waiting joins at no cost
                except queue.Empty:
                    if deadline is None:
                        if len(batch) == 1 and self._last_batch == 1:
                            break  # a lone request with no sign of concurrency: waiting would only add latency
                        deadline = time.monotonic() + self.max_delay
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    try:
                        nxt = self._queue.get(timeout=remaining)
                    except queue.Empty:
                        break
                if isinstance(nxt, _Call):
                    pending = nxt  # run it after this batch, in arrival order
                    break
                batch.append(nxt)
            self._last_batch = len(batch)
            self._run_batch(batch)

    def _run_batch(self, batch: list[_Image]) -> None:
        outcomes: list[tuple[Any, Any, BaseException | None]] = []  # (future, result, error), settled together
        live, images = [], []
        for b in batch:
            if not _claim(b.future):
                continue
            try:
                images.append(b.item if self.prepare is None else self.prepare(b.item))
            except Exception as e:  # e.g. a corrupt upload: only its own request fails
                outcomes.append((b.future, None, e))
                continue
            live.append(b)
        if live:
            try:
                out = self.predict_batch(np.stack(images))  # (B, ...)
            except Exception as e:  # one bad batch fails its requests, never the worker
                log.exception("batch of %d failed", len(live))
                outcomes += [(b.future, None, e) for b in live]
            else:
                if self.on_batch is not None:
                    self.on_batch(len(live))
                outcomes += [(b.future, row, None) for b, row in zip(live, out, strict=True)]
        _settle(outcomes)


def _claim(future: Future | asyncio.Future) -> bool:
    """Whether the future still wants its result: not cancelled (the client went away) nor timed out."""
    return future.set_running_or_notify_cancel() if isinstance(future, Future) else not future.done()


def _settle(outcomes: list[tuple[Any, Any, BaseException | None]]) -> None:
    """Give each future its result or error: a `concurrent.futures.Future` here, the asyncio futures of a
    batch in one callback on their event loop (one wake-up of the loop per batch, not one per request)."""
    on_loops: dict[asyncio.AbstractEventLoop, list] = {}
    for future, result, error in outcomes:
        if isinstance(future, Future):
            _set(future, result, error)
        else:
            on_loops.setdefault(future.get_loop(), []).append((future, result, error))
    for loop, group in on_loops.items():
        try:
            loop.call_soon_threadsafe(_settle_on_loop, group)
        except RuntimeError:  # the loop is closed: the server is gone and no one waits for these
            pass


def _settle_on_loop(group: list[tuple[asyncio.Future, Any, BaseException | None]]) -> None:
    for future, result, error in group:
        if not future.done():  # cancelled or timed out while its batch ran
            _set(future, result, error)


def _set(future: Future | asyncio.Future, result: Any, error: BaseException | None) -> None:
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


class Deadlines:
    """Fails the asyncio futures still pending `timeout_s` (or the time a request has left) after `watch`, with
    `TimeoutError`.

    One sweep a few times a second rather than a timer per request (`asyncio.wait_for` arms and cancels
    one per call on the event loop). A deadline is kept to within a quarter of `timeout_s`, 1 s at most.
    Each event loop has its own heap of deadlines and sweep, run on that loop.
    """

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.every = min(1.0, timeout_s / 4)
        # per event loop, (deadline, tie-breaker, future) in a heap; a loop's entry lives while it sweeps
        self.waiting: dict[asyncio.AbstractEventLoop, list[tuple[float, int, asyncio.Future]]] = {}
        self._order = itertools.count()

    def watch(self, future: asyncio.Future, timeout_s: float | None = None) -> asyncio.Future:
        """`future`, failed if still pending after `timeout_s` (None: the whole timeout)."""
        loop = future.get_loop()
        waiting = self.waiting.get(loop)
        if waiting is None:
            waiting = self.waiting[loop] = []
            loop.call_later(self.every, self._sweep, loop)
        left = self.timeout_s if timeout_s is None else min(timeout_s, self.timeout_s)
        heapq.heappush(waiting, (loop.time() + left, next(self._order), future))
        return future

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        now, waiting = loop.time(), self.waiting[loop]
        while waiting and (waiting[0][2].done() or waiting[0][0] <= now):
            *_, future = heapq.heappop(waiting)
            if not future.done():
                future.set_exception(TimeoutError(f"no result within {self.timeout_s} s"))
        if waiting:
            loop.call_later(self.every, self._sweep, loop)
        else:
            del self.waiting[loop]


def _run_call(item: _Call) -> None:
    if not _claim(item.future):
        return
    try:
        result, error = item.fn(*item.args), None
    except Exception as e:
        result, error = None, e
    _settle([(item.future, result, error)])
