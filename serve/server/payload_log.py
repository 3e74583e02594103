"""Payload logs: a record of what was asked and answered, for whatever consumes the traffic downstream.

For each answered inference request (/v1/classify, v2 infer over HTTP and gRPC) one record: the request
ID, the time, the model and its version, the route it came in by, the top-k predictions of each image and, only
when asked for (`images`), each image's SHA-256 or the image itself (the upload's bytes; over v2, the
pixel tensor's). Two kinds of sink:

- `FileSink`: JSON lines, rotated by size (logging's `RotatingFileHandler`);
- `CloudEventsSink`: each record as two CloudEvents in HTTP binary mode, in the format of KServe's
  inference logger (`ce-type: org.kubeflow.serving.inference.request`, then `...response`, both with the
  request ID as `ce-id`, and its `ce-inferenceservicename`, `ce-component`, `ce-endpoint` extensions), so
  that consumers of KServe's logger (message dumpers, drift detectors) read them unchanged.

Bounded: the request path only puts a tuple on each sink's queue (`queue.Queue(maxsize)`, `put_nowait`);
a thread per sink formats and writes. Each queue is bounded twice: in records (`queue_size`) and in bytes
(`queue_bytes`, the images and probabilities a record holds until it is written), because a record that keeps
its image can weigh as much as the largest upload. A record past either bound is dropped ("queue_full"), a
failed write (a full disk, a dead consumer) drops it too ("write_failed"), and both are counted
(`on_drop(sink, reason)`), so a slow or dead sink never slows or fails a request, and one sink's stall never
holds up another. A failing sink logs one warning when it starts failing and one line when it writes again,
not a traceback per record. Not logging's `QueueListener`: it would build a `LogRecord` per
request on the request path and share one queue between the sinks.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import logging
import logging.handlers
import queue
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from datetime import datetime, timezone

import numpy as np

from serve.server.settings import consumer_url

log = logging.getLogger(__name__)

REQUEST_EVENT = "org.kubeflow.serving.inference.request"
RESPONSE_EVENT = "org.kubeflow.serving.inference.response"
IMAGE_MODES = ("none", "digest", "image")
_STOP = object()
RECORD_OVERHEAD = 512  # bytes a record holds besides its images and probabilities: the tuple, its strings


class _Budget:
    """Bytes a sink's queue may hold, taken by the request path and given back once the record is written."""

    def __init__(self, limit: int):
        self.limit, self.used, self.lock = limit, 0, threading.Lock()

    def take(self, n: int) -> bool:
        with self.lock:
            if self.used + n > self.limit:
                return False
            self.used += n
            return True

    def give(self, n: int) -> None:
        with self.lock:
            self.used -= n


class _RaisingRotatingFileHandler(logging.handlers.RotatingFileHandler):
    """logging's rotating file, but a failed write raises to the caller, which counts it, rather than
    printing a traceback to stderr for every record."""

    def handleError(self, record: logging.LogRecord) -> None:
        stream, self.stream = self.stream, None  # the next record opens the file again (emit() does)
        if stream is not None:
            try:
                stream.close()  # its unwritten bytes are lost with this record
            except OSError:
                pass
        raise  # the error emit() is handling


class FileSink:
    """JSON lines in `path`, rotated to `path.1`, `path.2`, ... once a file passes `max_bytes`."""

    name = "file"

    def __init__(self, path: str, max_bytes: int, backups: int):
        self.handler = _RaisingRotatingFileHandler(path, maxBytes=max_bytes, backupCount=backups)
        self.handler.setFormatter(logging.Formatter("%(message)s"))

    def write(self, record: dict) -> None:
        self.handler.emit(logging.makeLogRecord({"msg": json.dumps(record, separators=(",", ":"))}))

    def close(self) -> None:
        self.handler.close()


class CloudEventsSink:
    """Each record POSTed to `url` as a request and a response CloudEvent (HTTP binary mode), on one
    keep-alive connection that is opened again after a failure.

    Args:
        url: http:// or https:// address of the consumer.
        timeout_s: how long one POST may take before the record is dropped.
    """

    name = "url"

    def __init__(self, url: str, timeout_s: float = 2.0):
        parts = consumer_url(url)
        self.parts, self.timeout_s = parts, timeout_s
        self.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.conn: http.client.HTTPConnection | None = None

    def write(self, record: dict) -> None:
        request = {k: v for k, v in record.items() if k != "predictions"}
        response = {k: record[k] for k in ("id", "model", "version", "predictions")}
        for kind, data in ((REQUEST_EVENT, request), (RESPONSE_EVENT, response)):
            self._post(kind, record, json.dumps(data, separators=(",", ":")).encode())

    def _post(self, kind: str, record: dict, body: bytes) -> None:
        model = _ce_value(record["model"])
        headers = {
            "Content-Type": "application/json",
            "ce-specversion": "1.0",
            "ce-id": _ce_value(record["id"]),
            "ce-type": kind,
            "ce-source": f"/vitscope/models/{model}",
            "ce-time": record["time"],
            "ce-inferenceservicename": model,
            "ce-component": "predictor",
            "ce-endpoint": "default",  # KServe's predictor endpoint (default or canary); one here
        }
        try:
            if self.conn is None:
                cls = http.client.HTTPSConnection if self.parts.scheme == "https" else http.client.HTTPConnection
                self.conn = cls(self.parts.hostname, self.parts.port, timeout=self.timeout_s)
            self.conn.request("POST", self.path, body, headers)
            answer = self.conn.getresponse()
            answer.read()
        except Exception:
            self.close()  # a fresh connection for the next record: this one may be left mid-request
            raise
        if answer.status >= 300:
            raise OSError(f"the payload sink answered {answer.status} {answer.reason}")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def _ce_value(text: str) -> str:
    """`text` as a CloudEvents header value: percent-encoded outside printable ASCII, and for space, `"` and `%`
    (the HTTP binding's rule), so that a model named outside ASCII reaches the sink."""
    return urllib.parse.quote(text, safe=CE_SAFE)


CE_SAFE = "".join(c for c in map(chr, range(0x21, 0x7F)) if c not in '"%')


class PayloadLog:
    """Records requests into `sinks`, each behind a bounded queue and a writer thread of its own.

    Args:
        sinks: where records go (`FileSink`, `CloudEventsSink`).
        top_k: predictions kept per image.
        images: "none", "digest" (each image's SHA-256) or "image" (the image itself, base64).
        queue_size: records each sink may hold while it writes; beyond that they are dropped.
        queue_bytes: bytes of images and probabilities each sink may hold (the record being written included);
            beyond that they are dropped.
        on_drop: called with (sink name, "queue_full" or "write_failed") for every dropped record.
    """

    def __init__(
        self,
        sinks: Sequence,
        top_k: int = 5,
        images: str = "none",
        queue_size: int = 1000,
        on_drop: Callable[[str, str], None] | None = None,
        queue_bytes: int = 64 * 1024 * 1024,
    ):
        if images not in IMAGE_MODES:
            raise ValueError(f"images must be one of {', '.join(IMAGE_MODES)}, got {images!r}")
        self.top_k, self.images, self.on_drop = top_k, images, on_drop or (lambda sink, reason: None)
        self.wants_images = images != "none"
        self.queues = [(sink, queue.Queue(maxsize=queue_size), _Budget(queue_bytes)) for sink in sinks]
        self.threads = [
            threading.Thread(target=self._write, args=(sink, q, b), name=f"payload-log-{sink.name}", daemon=True)
            for sink, q, b in self.queues
        ]
        for t in self.threads:
            t.start()

    def record(
        self,
        request_id: str,
        route: str,
        model: tuple[str, str, Sequence[str]],
        probs: np.ndarray,
        images: Sequence[bytes] | None = None,
    ) -> None:
        """One answered request; never blocks.

        Args:
            request_id: the request's ID, as its response and the access log carry it.
            route: where it came in (a path, or the gRPC method).
            model: the model's name, version and labels.
            probs: (B, K) probabilities, one row per image.
            images: one bytes object per image (read only when the log keeps images).
        """
        images = images if self.wants_images else None
        probs = probs.copy()  # a view into the model's answer would keep all of it (features too) while queued
        size = RECORD_OVERHEAD + probs.nbytes + sum(map(len, images or ()))
        item = (time.time(), request_id, route, model, probs, images)
        for sink, q, budget in self.queues:
            if not budget.take(size):
                self.on_drop(sink.name, "queue_full")
                continue
            try:
                q.put_nowait((size, item))
            except queue.Full:
                budget.give(size)
                self.on_drop(sink.name, "queue_full")

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued (for up to `timeout` seconds), then close the sinks."""
        deadline = time.monotonic() + timeout
        for (_, q, _), t in zip(self.queues, self.threads, strict=True):
            try:
                q.put(_STOP, timeout=max(0.0, deadline - time.monotonic()))
            except queue.Full:
                continue  # a stalled sink: its thread is a daemon and ends with the process
            t.join(max(0.0, deadline - time.monotonic()))

    def _write(self, sink, q: queue.Queue, budget: _Budget) -> None:
        failing = False
        while (entry := q.get()) is not _STOP:
            size, item = entry
            try:
                sink.write(self.format(*item))
            except Exception as e:  # a sink that fails loses this record, never the thread
                if not failing:
                    log.warning("payload log %s: %s; records are dropped until it writes again", sink.name, e)
                failing = True
                self.on_drop(sink.name, "write_failed")
            else:
                if failing:
                    log.info("payload log %s writes again", sink.name)
                failing = False
            finally:
                budget.give(size)
        sink.close()

    def format(self, t: float, request_id: str, route: str, model: tuple, probs: np.ndarray, images) -> dict:
        """The record of one request as JSON-ready data."""
        name, version, labels = model
        k = min(self.top_k, probs.shape[-1])
        best = np.argsort(-probs, axis=-1)[:, :k]  # (B, k)
        record = {
            "id": request_id,
            "time": datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "model": name,
            "version": version,
            "route": route,
            "predictions": [
                [{"label": labels[i], "score": float(row[i])} for i in idx]
                for row, idx in zip(probs, best, strict=True)
            ],
        }
        if images is not None and self.images == "digest":
            record["image_sha256"] = [hashlib.sha256(img).hexdigest() for img in images]
        elif images is not None:
            record["image_base64"] = [base64.b64encode(img).decode("ascii") for img in images]
        return record
