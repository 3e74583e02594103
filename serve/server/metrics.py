"""Prometheus metrics of one app: requests by status, latency; per model version batch sizes, queue depth,
memory; per model what the answers say about the images (`serve.server.drift`); payload-log drops.

Each app gets its own registry, so several apps (as in tests) never share counters. Requests are counted
by `serve.server.http.record.RequestRecord`, the layer that sees what each client got. A version's series go when
it is retired, and a model's when it serves no version any more (`forget_version`, `forget_model`).
"""

from __future__ import annotations

import time
from contextlib import suppress

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from serve.server.drift import TrustMetrics

CLIENT_CLOSED = 499  # nginx's code for a client that went away before the answer: never sent, only counted
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class Metrics:
    """The server's Prometheus collectors; per model version, the queue depth is read at scrape time."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "vitscope_requests",
            "Requests by route (HTTP path prefix or gRPC method) and status (HTTP code or gRPC status name)",
            ["route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "vitscope_request_latency_seconds",
            "Time from request to response, by route",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        version = ["model", "version"]
        self.batch_size = Histogram(
            "vitscope_batch_size",
            "Images per ONNX Runtime call",
            version,
            buckets=BATCH_BUCKETS,
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "vitscope_queue_depth", "Requests waiting for the model version", version, registry=self.registry
        )
        self.model_memory = Gauge(
            "vitscope_model_memory_bytes",
            "Resident memory the process grew by while loading and warming up the version",
            version,
            registry=self.registry,
        )
        self.load_failures = Counter(
            "vitscope_model_load_failures",
            "Versions that failed their checks and took no traffic, by reason",
            [*version, "reason"],
            registry=self.registry,
        )
        self._children: dict[tuple, tuple] = {}
        self.trust = TrustMetrics(self.registry)  # calibrated confidence, OOD score, unknown, classes, drift
        self.payload_log_dropped = Counter(
            "vitscope_payload_log_dropped",
            "Payload log records lost, by sink (file, url) and reason (queue_full, write_failed)",
            ["sink", "reason"],
            registry=self.registry,
        )

    def observe(self, route: str, status: int | str, started: float) -> None:
        """Count one finished request; `started` is its `time.perf_counter()` at arrival."""
        key = (route, status)
        children = self._children.get(key)
        if children is None:  # `labels()` takes a lock and builds its key on every call: once per route and status
            children = self._children[key] = (self.requests.labels(route, str(status)), self.latency.labels(route))
        children[0].inc()
        children[1].observe(time.perf_counter() - started)

    def forget_version(self, model: str, version: str) -> None:
        """Drop the series of a version that serves no more (its batch sizes, queue depth and memory): else each
        rollout would leave its version's series in /metrics for good."""
        for collector in (self.batch_size, self.queue_depth, self.model_memory):
            with suppress(KeyError):  # prometheus-client before 0.21 raises for a series never made
                collector.remove(model, version)

    def forget_model(self, model: str) -> None:
        """Drop the per-model series of a model that serves no version (unloaded or deleted), as Triton drops a
        model's metrics on unload."""
        self.trust.forget(model)

    def render(self) -> tuple[bytes, str]:
        """The text exposition format and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
