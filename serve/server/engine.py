"""The engine: one model version behind its micro-batcher (`serve.server.batching`), and the batch size it runs at.

The batch size matters for throughput in a way that is easy to miss: while a batch runs, the event
loop decodes the next requests, so smaller batches keep both busy (a pipeline), whereas a batch as
large as the number of clients makes the loop and the model take turns. `Engine.start` therefore
measures the model and batches only as many images as it takes to amortise the per-call overhead
(`choose_batch_size`). `forward_rows` is the batched pass every route shares.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from serve.server.batching import Deadlines, MicroBatcher

log = logging.getLogger(__name__)


def time_batch_sizes(
    predict_batch: Callable[[np.ndarray], Any], image_shape: tuple[int, ...], max_batch_size: int, budget_s: float = 3.0
) -> dict[int, float]:
    """Seconds per image of `predict_batch` at batch 1, 2, 4, ... up to `max_batch_size`: the median of at
    least 5 calls and 50 ms each, after one untimed call. Not the best call: the server lives on sustained
    throughput, and on a busy machine the best of a few calls flatters small batches (ViT-Ti/16 on 2 cores:
    batch 2's best call was as fast per image as batch 8, its sustained rate clearly slower). Not the mean
    either, which one scheduling hiccup can tip.

    Skips the sizes that would overrun `budget_s`, so a large model on a slow CPU still starts quickly
    (its per-call overhead is small next to one image anyway).
    """
    sizes = [1 << i for i in range(max_batch_size.bit_length()) if 1 << i <= max_batch_size]
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    deadline = time.monotonic() + budget_s
    times: dict[int, float] = {}
    for bs in sizes:
        if times and time.monotonic() + 6 * bs * times[max(times)] > deadline:
            break  # this size's 6 calls or more would overrun the budget
        batch = np.zeros((bs, *image_shape), np.uint8)
        predict_batch(batch)  # the first call at a new shape allocates
        calls, started = [], time.perf_counter()
        while len(calls) < 5 or time.perf_counter() - started < 0.05:  # a fast model gets more calls: less noise
            t0 = time.perf_counter()
            predict_batch(batch)
            calls.append(time.perf_counter() - t0)
        times[bs] = float(np.median(calls)) / bs
    return times


def choose_batch_size(seconds_per_image: dict[int, float], tolerance: float = 0.03) -> int:
    """The smallest batch size whose time per image is within `tolerance` of the best one.

    3%, not more: each batch also costs the server a hand-over between the event loop and this
    thread, which the timing alone does not see: a smaller batch that times a few percent over the best
    costs more hand-overs per image under load.
    """
    best = min(seconds_per_image.values())
    return min(bs for bs, t in seconds_per_image.items() if t <= best * (1 + tolerance))


@functools.cache
def record_dtype(K: int, D: int) -> np.dtype:
    """The records of `forward_rows` (built once: parsing a structured dtype costs more than filling it)."""
    fields = [("logits", np.float32, (K,)), ("probs", np.float32, (K,)), ("features", np.float32, (D,))]
    return np.dtype([*fields, ("ood", np.float64)])


def forward_rows(classifier, batch: np.ndarray) -> np.ndarray:
    """The batched forward pass: (B, H, W, 3) uint8 -> (B,) records, each image's `logits` (K,), `probs` (K,),
    `features` (D,) (D is 0 unless the file's OOD score needs the pre-logit features) and `ood` (its OOD score;
    NaN for a file without calibration).

    All come from one pass: KServe v2 answers with the file's own `logits` (as Triton serving the file
    would), /v1 with probabilities, and a batch may mix requests of both kinds. The probabilities are
    calibrated exactly as `OnnxClassifier.predict_pixels` computes them (`OnnxClassifier.probabilities`), and
    the OOD scores are those of `OnnxClassifier.assess`, computed once per batch here rather than once per
    request on the event loop; `judge_rows` gives the unknown verdicts and sets. A record indexes like the batch:
    `rows[i]["probs"]` is one image's, `np.stack` of records a batch again.
    """
    logits, features = classifier.run_fast(np.ascontiguousarray(batch))  # (B, K), (B, D) or None
    (B, K), D = logits.shape, (0 if features is None else features.shape[1])
    rows = np.empty(B, record_dtype(K, D))
    rows["logits"], rows["probs"] = logits, classifier.probabilities(logits)
    if D:
        rows["features"] = features
    trust = classifier.trust
    rows["ood"] = np.nan if trust is None else trust.ood_scores(logits, rows["probs"], features)
    return rows


def judge_rows(classifier, rows: np.ndarray, coverage: float | None = None):
    """The `Assessment` (probabilities, unknown verdicts, OOD scores, sets at `coverage`) of (B,) records of
    `forward_rows`: nothing is computed again but the sets."""
    return classifier.judge(rows["logits"], coverage=coverage, probs=rows["probs"], ood_scores=rows["ood"])


class Engine:
    """The classifier behind the batcher: the only object that touches the ONNX session.

    Async callers (the API) await `predict` / `run`; sync callers (the Gradio handlers, which run
    in worker threads) use `run_sync`. Either way the session runs on the batcher's
    thread.

    Args:
        classifier: a `serve.runtime.classifier.OnnxClassifier`.
        settings: a `serve.server.settings.ServeSettings`.
        on_batch: called with each realised batch size.
        on_answers: called with the records of each batch the batcher ran for requests (`forward_rows`; not
            the warm-up calls), on the batcher's thread, before the requests get them (the trust metrics).
        decode: turns a submitted item that is not an array yet (an opened upload) into its
            (H, W, 3) uint8 image, on the worker thread (see `MicroBatcher`'s `prepare`).
    """

    def __init__(
        self,
        classifier,
        settings,
        on_batch: Callable[[int], None] | None = None,
        decode: Callable[[Any], np.ndarray] | None = None,
        on_answers: Callable[[np.ndarray], None] | None = None,
    ):
        self.classifier, self.settings = classifier, settings
        self.forward = lambda batch: forward_rows(classifier, batch)  # (B, H, W, 3) -> (B,) records
        self.on_answers = on_answers
        self.batcher = MicroBatcher(
            self._answer,
            max_batch_size=settings.max_batch_size,
            max_delay_ms=settings.max_delay_ms,
            queue_size=settings.queue_size,
            on_batch=on_batch,
            prepare=None if decode is None else (lambda item: item if isinstance(item, np.ndarray) else decode(item)),
        )
        self.deadlines = Deadlines(settings.request_timeout_s)
        self.ready = False
        self.drained = False  # set by stop(): whether the queued work finished in time

    def _answer(self, batch: np.ndarray) -> np.ndarray:
        rows = self.forward(batch)
        if self.on_answers is not None:
            self.on_answers(rows)
        return rows

    @property
    def batch_size(self) -> int:
        """The most images per ONNX Runtime call (chosen in `start`)."""
        return self.batcher.max_batch_size

    def start(self) -> None:
        """Start the worker, warm the session up and choose the batch size, then mark ready."""
        self.batcher.start()
        H, W = self.classifier.input_size
        preferred = self.settings.preferred_batch_size
        if preferred:
            for size in sorted({1, preferred}):  # the first call at each shape allocates
                self.batcher.call(self.forward, np.zeros((size, H, W, 3), np.uint8)).result(600)
        else:
            times = self.batcher.call(time_batch_sizes, self.forward, (H, W, 3), self.settings.max_batch_size).result(
                600
            )
            preferred = choose_batch_size(times)
            table = ", ".join(f"{bs}: {t * 1000:.3f}" for bs, t in times.items())
            log.info("batching up to %d images (ms per image by batch size: %s)", preferred, table)
        self.batcher.max_batch_size = preferred
        self.ready = True

    def stop(self) -> None:
        """Refuse new work, finish the queued requests, stop the worker."""
        self.ready = False
        self.drained = self.batcher.close(timeout=self.settings.graceful_timeout_s)

    async def infer(self, item: Any, timeout_s: float | None = None) -> np.ndarray:
        """(H, W, 3) uint8 (or an item for `decode`) -> its record of `forward_rows` (logits, probs, features,
        ood), batched with concurrent requests; `TimeoutError` after `timeout_s` (None: --request-timeout-s)."""
        future = self.batcher.submit(item, asyncio.get_running_loop().create_future())
        return await self.deadlines.watch(future, timeout_s)

    async def infer_all(self, items: Sequence[Any], timeout_s: float | None = None) -> list:
        """Each item's record (as `infer`) or its failure; queued all at once or not at all (`QueueFull`)."""
        loop = asyncio.get_running_loop()
        futures = self.batcher.submit_all(items, [loop.create_future() for _ in items])
        watched = [self.deadlines.watch(f, timeout_s) for f in futures]
        return await asyncio.gather(*watched, return_exceptions=True)

    async def predict(self, item: Any) -> np.ndarray:
        """(H, W, 3) uint8 (or an item for `decode`) -> (K,) probabilities, batched with concurrent requests."""
        return (await self.infer(item))["probs"]

    async def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> Any:
        """`fn(*args)` on the worker thread (for anything else that uses the session), as `infer` times out."""
        future = self.batcher.call(fn, *args, future=asyncio.get_running_loop().create_future())
        return await self.deadlines.watch(future, timeout_s)

    def run_sync(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self.batcher.call(fn, *args).result(timeout=self.settings.request_timeout_s)
