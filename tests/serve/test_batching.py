"""serve.server.batching: the micro-batcher groups waiting requests, fails items alone, sheds load and
chooses its batch size; no server involved."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from serve.server.batching import Deadlines, MicroBatcher, QueueFull
from serve.server.engine import choose_batch_size, time_batch_sizes
from tests.helpers import wait_until


def holding(batcher: MicroBatcher) -> None:
    """Wait until the worker has taken the gate call off the queue and is held by it."""
    wait_until(lambda: batcher.depth == 0, 5, "the batcher's worker taking the gate call")


def test_a_lone_request_does_not_wait_for_the_batching_delay():
    batcher = MicroBatcher(lambda b: b[:, 0, 0, 0], max_batch_size=8, max_delay_ms=2000).start()
    t0 = time.perf_counter()
    assert batcher.submit(np.full((1, 1, 3), 5, np.uint8)).result(5) == 5
    assert time.perf_counter() - t0 < 1.0
    batcher.close()


def test_batcher_groups_waiting_requests_up_to_the_batch_size():
    sizes = []
    batcher = MicroBatcher(lambda b: b.reshape(len(b), -1).sum(axis=1), max_batch_size=4, max_delay_ms=200)
    batcher.on_batch = sizes.append
    batcher.start()
    gate = threading.Event()
    batcher.call(gate.wait, 5)  # hold the worker while six requests queue up
    holding(batcher)
    futures = [batcher.submit(np.full((2, 2, 3), i, np.uint8)) for i in range(6)]
    gate.set()
    assert [f.result(5) for f in futures] == [12 * i for i in range(6)]  # each gets its own row back
    batcher.close()
    assert sizes == [4, 2]


def test_an_item_that_fails_to_decode_fails_alone_and_its_batch_runs():
    def decode(item):
        if item == "corrupt":
            raise ValueError("image data is corrupt")
        return np.full((1, 1, 3), int(item), np.uint8)

    sizes = []
    batcher = MicroBatcher(lambda b: b[:, 0, 0, 0], max_batch_size=4, prepare=decode, on_batch=sizes.append).start()
    gate = threading.Event()
    batcher.call(gate.wait, 5)  # hold the worker while three items queue up
    holding(batcher)
    futures = [batcher.submit(x) for x in ("3", "corrupt", "5")]
    gate.set()
    assert futures[0].result(5) == 3 and futures[2].result(5) == 5
    with pytest.raises(ValueError, match="corrupt"):
        futures[1].result(5)
    batcher.close()
    assert sizes == [2]


def test_batcher_refuses_beyond_the_queue_and_drains_on_close():
    gate = threading.Event()
    batcher = MicroBatcher(lambda b: b[:, 0, 0, 0], max_batch_size=2, max_delay_ms=0, queue_size=2).start()
    batcher.call(gate.wait, 5)
    holding(batcher)
    queued = [batcher.submit(np.full((1, 1, 3), i, np.uint8)) for i in (1, 2)]
    with pytest.raises(QueueFull, match="retry"):
        batcher.submit(np.zeros((1, 1, 3), np.uint8))
    gate.set()
    batcher.close(timeout=5)
    assert [f.result(0) for f in queued] == [1, 2] and not batcher.running


def test_a_request_of_many_images_is_queued_whole_or_refused_whole(tiny_onnx):
    """Its images were queued one by one: with room for some, those ran and the request still got its 503, having
    waited for the model to compute answers it threw away."""
    from serve.runtime.classifier import OnnxClassifier
    from serve.server.engine import Engine
    from serve.server.errors import ApiError
    from serve.server.results import Deadline, batch_results
    from serve.server.settings import ServeSettings

    engine = Engine(OnnxClassifier(tiny_onnx), ServeSettings(preferred_batch_size=1, queue_size=4, max_batch_size=4))
    engine.start()
    gate, images = threading.Event(), np.zeros((4, 32, 32, 3), np.uint8)

    async def main():
        engine.batcher.call(gate.wait, 60)  # the worker is held: what is queued stays queued
        holding(engine.batcher)
        first = asyncio.ensure_future(engine.infer(images[0]))  # one of the queue's four places taken
        await asyncio.sleep(0)
        with pytest.raises(ApiError, match="4 images do not fit") as refused:
            await batch_results(engine, images, Deadline(5.0))  # four images, three places left
        depth = engine.batcher.depth
        gate.set()
        rows = await batch_results(engine, images[:3], Deadline(5.0))  # three fit
        return refused.value.code, depth, len(rows), await first

    try:
        code, depth, answered, _ = asyncio.run(main())
    finally:
        gate.set()
        engine.stop()
    assert code == "queue_full" and depth == 1 and answered == 3


def test_a_failing_batch_fails_its_requests_but_not_the_worker():
    calls = []

    def flaky(batch):
        calls.append(len(batch))
        if len(calls) == 1:
            raise RuntimeError("boom")
        return batch[:, 0, 0, 0]

    batcher = MicroBatcher(flaky, max_batch_size=1, max_delay_ms=0).start()
    with pytest.raises(RuntimeError, match="boom"):
        batcher.submit(np.zeros((1, 1, 3), np.uint8)).result(5)
    assert batcher.submit(np.full((1, 1, 3), 7, np.uint8)).result(5) == 7
    batcher.close()


def test_asyncio_futures_get_their_rows_and_a_cancelled_request_is_not_run():
    sizes, seen = [], []
    batcher = MicroBatcher(lambda b: (seen.extend(b[:, 0, 0, 0]), b[:, 0, 0, 0])[1], max_batch_size=8)
    batcher.on_batch = sizes.append
    batcher.prepare = lambda x: np.full((1, 1, 3), int(x), np.uint8)  # "bad" fails alone

    async def main():
        gate = threading.Event()
        batcher.call(gate.wait, 5)  # hold the worker while four requests queue up
        loop = asyncio.get_running_loop()
        futures = [batcher.submit(x, loop.create_future()) for x in ("1", "2", "bad", "4")]
        futures[1].cancel()  # its client went away
        gate.set()
        return await asyncio.gather(*futures, return_exceptions=True)

    batcher.start()
    one, two, bad, four = asyncio.run(main())
    batcher.close()
    assert (one, four) == (1, 4) and isinstance(two, asyncio.CancelledError) and isinstance(bad, ValueError)
    assert sizes == [2] and seen == [1, 4]  # one batch, without the cancelled or the broken item


def test_deadlines_fail_what_is_still_pending_and_leave_the_rest():
    deadlines = Deadlines(0.2)

    async def main():
        loop = asyncio.get_running_loop()
        late, quick = deadlines.watch(loop.create_future()), deadlines.watch(loop.create_future())
        quick.set_result("done")
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="no result within 0.2 s"):
            await late
        return time.monotonic() - started, quick.result()

    waited, quick = asyncio.run(main())
    assert 0.2 <= waited < 1.0 and quick == "done"
    assert not deadlines.waiting  # the sweep stops when nothing waits


def test_deadlines_time_out_the_futures_of_each_event_loop():
    deadlines = Deadlines(0.2)

    errors = []

    async def late():
        try:
            await deadlines.watch(asyncio.get_running_loop().create_future())
        except TimeoutError as e:
            errors.append(e)

    threads = [threading.Thread(target=asyncio.run, args=(late(),)) for _ in range(2)]  # two loops at once
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert len(errors) == 2 and not deadlines.waiting


def test_a_shorter_time_left_watched_later_fails_first():
    """The time a request has left (`serve.server.results.Deadline`): a future watched with less of it is failed by
    its own deadline, not the whole timeout of one watched before it."""
    deadlines = Deadlines(3.0)

    async def main():
        loop = asyncio.get_running_loop()
        whole, short = deadlines.watch(loop.create_future()), deadlines.watch(loop.create_future(), 0.3)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await short
        waited = time.monotonic() - started
        assert not whole.done()
        whole.set_result("done")
        return waited

    assert 0.3 <= asyncio.run(main()) < 2.0


class ModelClock:
    """The engine's clock, moved only by the modelled cost of each call: timing without a busy host's noise (a
    0.13 ms oversleep per call, on a loaded machine, read as per-call overhead worth batching for)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    monotonic = perf_counter


def test_batch_size_is_the_smallest_one_that_amortises_the_per_call_overhead(monkeypatch):
    assert choose_batch_size({1: 2.0, 2: 1.1, 4: 1.02, 8: 1.0, 16: 1.01}) == 4  # 1.02 is within 3% of 1.0
    assert choose_batch_size({1: 1.0, 2: 0.99, 4: 1.0}) == 1  # no overhead to amortise: batching only adds latency
    clock = ModelClock()
    monkeypatch.setattr("serve.server.engine.time", clock)

    def cost(per_call: float, per_image: float):
        def predict(batch):
            clock.now += per_call + per_image * len(batch)

        return predict

    assert choose_batch_size(time_batch_sizes(cost(0.0, 0.004), (1, 1, 3), 8)) == 1  # no per-call overhead
    times = time_batch_sizes(cost(0.02, 0.0002), (1, 1, 3), 8)  # nearly all of it per call
    assert list(times) == [1, 2, 4, 8] and choose_batch_size(times) == 8
    assert times[1] == pytest.approx(0.0202) and times[8] == pytest.approx(0.02 / 8 + 0.0002)
    # a big model on a slow CPU: start-up must not time batch 8 for a minute (batch 4 would overrun the budget)
    start = clock.now
    assert list(time_batch_sizes(cost(0.0, 0.05), (1, 1, 3), 8, budget_s=1.0)) == [1, 2]
    assert clock.now - start <= 1.0
