"""Prometheus metrics of one app: requests by status, latency, realised batch sizes, queue depth.

Each app gets its own registry, so several apps (as in tests) never share counters.
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CLIENT_CLOSED = 499
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class Metrics:
    """The server's Prometheus collectors (the queue depth is read at scrape time: `queue_depth.set_function`)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "vitscope_requests", "HTTP requests by route and status code", ["route", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "vitscope_request_latency_seconds",
            "Time from request to response, by route",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.batch_size = Histogram(
            "vitscope_batch_size", "Images per ONNX Runtime call", buckets=BATCH_BUCKETS, registry=self.registry
        )
        self.queue_depth = Gauge("vitscope_queue_depth", "Requests waiting for the model", registry=self.registry)

    def observe(self, route: str, status: int, started: float) -> None:
        """Count one finished request; `started` is its `time.perf_counter()` at arrival."""
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route).observe(time.perf_counter() - started)

    def render(self) -> tuple[bytes, str]:
        """The text exposition format and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class MetricsMiddleware:
    """ASGI middleware timing the API routes; other paths (the UI's assets) are not counted.

    Args:
        app: the ASGI app to wrap.
        metrics: where to record.
        routes: path prefixes to count, each reported under its own prefix as the route label.
    """

    def __init__(self, app, metrics: Metrics, routes: tuple[str, ...]):
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = next((r for r in self.routes if path == r or path.startswith(r + "/")), None)
        if route is None:
            return await self.app(scope, receive, send)
        started, status, gone = time.perf_counter(), 500, False

        async def send_wrapper(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        async def receive_wrapper():
            nonlocal gone
            message = await receive()
            gone = gone or message["type"] == "http.disconnect"
            return message

        try:
            await self.app(scope, receive_wrapper, send_wrapper)
        finally:
            # a client that left counts as 499 (nginx's code), whatever failed after it did
            self.metrics.observe(route, CLIENT_CLOSED if gone and status >= 500 else status, started)
