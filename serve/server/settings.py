"""Every knob of the server in one typed object, with the reason for each default.

`vit-serve` turns each field into a command-line option (``max_batch_size`` -> ``--max-batch-size``),
so the help text below is the documentation of the server's limits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any


@dataclass
class ServeSettings:
    """Limits, batching and threading of one `vit-serve` process.

    Args:
        host: interface to bind; 127.0.0.1 keeps the server private to this machine.
        port: TCP port; 7860 is the port Gradio users expect.
        max_batch_size: most images in one v2 infer request and in one call of the explain path, and
            the largest batch size `preferred_batch_size` may be.
        preferred_batch_size: the most images the batcher puts in one ONNX Runtime call (0: measured
            at warm-up, the smallest of 1, 2, 4, ... and `max_batch_size` whose time per image is
            within 3% of the best). Small batches keep the model and the HTTP event loop working at
            the same time: while one batch runs, the loop decodes the next requests. Bigger batches
            only pay off while they still amortise a per-call overhead.
        max_delay_ms: how long a batch waits to fill up once there is concurrency. 0 (as in Triton's
            dynamic batcher): a batch is whatever is waiting when the model becomes free; under load
            requests queue up while the model runs, so batches fill by themselves, and at low load
            nobody waits for requests that are not coming.
        queue_size: requests allowed to wait for the model; beyond it the server answers 503
            with Retry-After instead of letting latency grow without bound.
        retry_after_s: the Retry-After hint sent with a 503.
        threads: intra-op threads for ONNX Runtime (0: by model size, see `serve.runtime.classifier.default_threads`:
            one for small models, which leaves the other core to the event loop, every core for large ones).
        max_bytes: largest accepted request body, 10 MiB: any phone photo, far below a memory problem.
        inline_decode_bytes: uploads up to this size (and 1 MP) are decoded where a core is free: on the
            event loop when onnxruntime runs on one thread, else on the model's thread right before their
            batch; larger ones are decoded in a thread of their own so that they never hold anything up.
        max_pixels: largest accepted image, checked from the header before decoding: 40 MP is any
            camera photo and stops decompression bombs.
        top_k: predictions returned when the client does not ask for a number.
        deletion_steps: points on the deletion curve (patches removed in this many steps).
        request_timeout_s: how long a request waits for its result before the server gives up (504).
        graceful_timeout_s: on SIGTERM, how long in-flight requests may take to finish.
        examples_dir: folder of sample images offered as examples in the UI (skipped when absent).
        opentelemetry: FastAPI's OpenTelemetry spans and metrics for every request, sent to the
            providers configured in this process (for example by `opentelemetry-instrument`). Off by
            default: /metrics covers the API, and checking for providers on every request alone cost
            about 4% of the sample model's throughput (benchmarks/serve_bench.py).
    """

    host: str = "127.0.0.1"
    port: int = 7860
    max_batch_size: int = 32
    preferred_batch_size: int = 0
    max_delay_ms: float = 0.0
    queue_size: int = 256
    retry_after_s: int = 1
    threads: int = 0
    max_bytes: int = 10 * 1024 * 1024
    inline_decode_bytes: int = 64 * 1024
    max_pixels: int = 40_000_000
    top_k: int = 5
    deletion_steps: int = 16
    request_timeout_s: float = 30.0
    graceful_timeout_s: float = 20.0
    examples_dir: str = "data/digits"
    opentelemetry: bool = False

    def __post_init__(self):
        positive = ("max_batch_size", "queue_size", "max_bytes", "max_pixels", "top_k", "deletion_steps")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.preferred_batch_size <= self.max_batch_size:
            raise ValueError(
                f"preferred_batch_size must be in 0..max_batch_size ({self.max_batch_size}) "
                f"(0: measured at warm-up), got {self.preferred_batch_size}"
            )
        if self.max_delay_ms < 0:
            raise ValueError(f"max_delay_ms must be >= 0, got {self.max_delay_ms}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0: the runtime's default), got {self.threads}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")

    def replace(self, **changes: Any) -> ServeSettings:
        return dataclasses.replace(self, **changes)


def field_help() -> dict[str, str]:
    """The help text of each field, parsed from the class docstring's Args section."""
    doc = ServeSettings.__doc__ or ""
    out: dict[str, str] = {}
    current = None
    for line in doc.split("Args:", 1)[-1].splitlines():
        stripped = line.strip()
        name, sep, rest = stripped.partition(":")
        if sep and name in {f.name for f in fields(ServeSettings)}:
            current, out[name] = name, rest.strip()
        elif current and stripped:
            out[current] += " " + stripped
    return out
