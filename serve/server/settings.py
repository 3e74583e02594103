"""Every knob of the server in one typed object, with the reason for each default.

`ServeSettings` is a pydantic-settings model: each field can be set by the command line (`vit-serve`
turns ``max_batch_size`` into ``--max-batch-size``, see `serve.server.cli`), by an environment variable
(``VITSCOPE_MAX_BATCH_SIZE=16``, as container deployments expect), or in code. The command line wins
over the environment, the environment over the defaults. Each field's description below is its
`--help` text, so this file is the documentation of the server's limits.
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "VITSCOPE_"


UI_FORM_OVERHEAD = 64 * 1024  # multipart boundaries and headers around an uploaded file
UI_CALL_RESULT_BYTES = 512 * 1024  # what a UI call writes: two images at display size (256 px), under this


def consumer_url(url: str) -> urllib.parse.SplitResult:
    """`url` split, as the payload log's CloudEvents sink sends to it; `ServeSettings` checks it before the start.

    Raises:
        ValueError: unless `url` is an http:// or https:// address with a host (and a port in 1-65535).
    """
    try:
        parts = urllib.parse.urlsplit(url)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
    except ValueError:  # an unclosed IPv6 bracket, a port that is no number or out of range
        ok = False
    if not ok:
        raise ValueError(f"--payload-log-url must be an http:// or https:// URL, got {url!r}")
    return parts


class ServeSettings(BaseSettings):
    """Limits, batching and threading of one `vit-serve` process (see each field's description)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", frozen=True)

    host: str = Field("127.0.0.1", description="interface to bind; 127.0.0.1 keeps the server private to this machine")
    port: int = Field(7860, ge=0, le=65535, description="TCP port; 7860 is the port Gradio users expect (0: any free)")
    max_batch_size: int = Field(
        32,
        ge=1,
        description="most images in one v2 infer request and in one call of the explain path, and the largest "
        "batch size preferred_batch_size may be",
    )
    preferred_batch_size: int = Field(
        0,
        ge=0,
        description="the most images the batcher puts in one ONNX Runtime call (0: measured at warm-up, the "
        "smallest of 1, 2, 4, ... and max_batch_size whose time per image is within 3% of the best). Small "
        "batches keep the model and the HTTP event loop working at the same time: while one batch runs, the "
        "loop decodes the next requests. Bigger batches only pay off while they still amortise a per-call overhead",
    )
    max_delay_ms: float = Field(
        0.0,
        ge=0,
        description="how long a batch waits to fill up once there is concurrency. 0 (as in Triton's dynamic "
        "batcher): a batch is whatever is waiting when the model becomes free; under load requests queue up "
        "while the model runs, so batches fill by themselves, and at low load nobody waits for requests that "
        "are not coming",
    )
    queue_size: int = Field(
        256,
        ge=1,
        description="images allowed to wait for the model (a request of 8 images takes 8 places, all at once or "
        "none; at least max_batch_size); beyond it the server answers 503 with Retry-After instead of letting "
        "latency grow without bound",
    )
    retry_after_s: int = Field(1, ge=0, description="the Retry-After hint of a 503 (gRPC: grpc-retry-pushback-ms)")
    threads: int = Field(
        0,
        ge=0,
        description="intra-op threads for ONNX Runtime (0: by model size, see serve.runtime.classifier."
        "default_threads: one for small models, which leaves the other core to the event loop, every core for "
        "large ones); at most the cores vit-serve may run on (not checked with --ray: its replicas run on other nodes)",
    )
    max_bytes: int = Field(
        10 * 1024 * 1024,
        ge=1,
        description="largest accepted request body, 10 MiB: any phone photo (a KServe v2 JSON body takes many "
        "times its size while parsed, one per core at a time)",
    )
    inline_decode_bytes: int = Field(
        64 * 1024,
        ge=0,
        description="uploads up to this size (and 1 MP) are decoded where a core is free: on the event loop when "
        "onnxruntime runs on one thread, else on the model's thread right before their batch; larger ones are "
        "decoded in a thread of their own so that they never hold anything up",
    )
    max_pixels: int = Field(
        40_000_000,
        ge=1,
        description="largest accepted image, checked from the header before decoding. 40 MP takes the full "
        "resolution of most cameras (24-33 MP) and phones, and stops decompression bombs. It is no longer what "
        "bounds memory (decode_pixel_budget and reduced-size decoding do), so it is not lower: a lower limit "
        "would refuse real photos and save nothing",
    )
    decode_pixel_budget: int = Field(
        40_000_000,
        ge=1,
        description="pixels, summed over all requests, that may be decoding at once (an image over the budget "
        "waits for it alone). A small file can declare a huge image, and decoding costs bytes per declared "
        "pixel: 40 MP is one of the largest images at a time, about 200 MB at worst, and keeps a core free "
        "for the event loop. Ordinary photos decode many at once: large JPEGs are decoded "
        "at a reduced scale and count as such",
    )
    max_header_bytes: int = Field(
        64 * 1024,
        ge=1024,
        description="largest request head (request line and headers); beyond it the answer is 431. 64 KiB is "
        "several times what browsers send with cookies",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="time a client has to send the whole request head; then 408 and the connection closes "
        "(deadlines are checked every quarter of the shorter timeout, every second at most)",
    )
    body_timeout_s: float = Field(
        60.0,
        gt=0,
        description="time a client has to send the whole body once the head arrived (10 MiB at 1.5 Mbit/s), "
        "and to read again once its answers stopped draining; then the connection closes (a gRPC call whose "
        "message has not arrived gets DEADLINE_EXCEEDED). With header_timeout_s, "
        "a slow client cannot hold a connection forever",
    )
    keep_alive_s: int = Field(5, ge=1, description="how long an idle keep-alive connection stays open")
    max_connections: int = Field(
        2000,
        ge=1,
        description="open connections at most, HTTP and gRPC together (gRPC takes grpc_max_connections of it); a "
        "new HTTP one beyond it gets 503 and is closed at once, so the process never runs out of file descriptors "
        "(it is also kept below the process's file limit)",
    )
    discard_bytes: int = Field(
        128 * 1024 * 1024,
        ge=0,
        description="an oversized body is read and thrown away up to this many bytes before the 413 answer, so "
        "that a client which writes its whole body before reading gets the 413 rather than a reset connection",
    )
    api_key: SecretStr = Field(
        SecretStr(""),
        description="key (visible ASCII) every request must carry as 'Authorization: Bearer <key>' or "
        "'X-API-Key: <key>' (the UI asks for it as a password); health routes need none. Empty: no key. Prefer the "
        "environment variable to the option, which other users of the machine can read in the process list",
    )
    allowed_hosts: str = Field(
        "",
        description="comma-separated Host names the server answers (others get 400: this stops DNS rebinding). "
        "Empty: the bind host, localhost and 127.0.0.1. '*': any (only behind a proxy that checks it)",
    )
    ui_queue_size: int = Field(
        64, ge=1, description="UI calls allowed to wait; beyond it the UI says the server is busy"
    )
    ui_concurrency: int = Field(
        2, ge=1, description="UI calls running at once (each runs the model several times for its deletion score)"
    )
    ui_cache_s: int = Field(
        3600, ge=60, description="UI uploads and results older than this are deleted (checked as often)"
    )
    ui_cache_bytes: int = Field(
        1 << 30,
        ge=1 << 20,
        description="bytes the UI's uploads and results may take on disk together; an upload or call past it is "
        "refused (507) until older files are deleted (ui_cache_s). Each upload is bounded by max_bytes, and "
        "uploads need no key on a server without one: this bounds the disk they can fill (at least max_bytes and "
        "room for a call's results)",
    )
    top_k: int = Field(5, ge=1, description="predictions returned when the client does not ask for a number")
    deletion_steps: int = Field(
        16, ge=1, description="points on the deletion curve (patches removed in this many steps)"
    )
    request_timeout_s: float = Field(
        30.0,
        gt=0,
        description="how long a request waits for its result, from when its body is in (its decode's and parse's "
        "waits included), before the server gives up (504)",
    )
    graceful_timeout_s: float = Field(
        20.0, ge=0, description="on SIGTERM, how long in-flight requests may take to finish"
    )
    examples_dir: str = Field(
        "data/digits", description="folder of sample images offered as examples in the UI (skipped when absent)"
    )
    repository_poll_s: float = Field(
        0.0,
        ge=0,
        description="with a model repository folder: how often to scan it for new, changed and removed versions, "
        "in seconds (0: only at start and on POST /v2/repository/models/<name>/load). A new version is loaded and "
        "checked off to the side, then takes new requests while the old one drains",
    )
    exit_on_error: bool = Field(
        False,
        description="with a model repository folder: refuse to start when any model fails to load, as Triton's "
        "--exit-on-error does (off: start and serve the models that load; each one that failed is UNAVAILABLE in "
        "POST /v2/repository/index with its reason, and counted in /metrics). Off by default, unlike Triton: one "
        "corrupt file must not take down every other model",
    )
    default_model: str = Field(
        "",
        description="the model of the bare routes (/v1/classify) when a repository holds several "
        "(empty: the first by name of those that load at start-up). Fixed at start-up: a model loaded later never "
        "moves it; while it is not served the bare routes answer 503, and the server logs a warning",
    )
    probe_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="also answer /healthz, /readyz and /v2/health/* on this port, from a small process of their "
        "own, so that probes get their answer while the event loop is saturated (0: off). Point Kubernetes' probes "
        "here. One event loop serves it: a connection that sends no whole request within 2 s is closed, and a "
        "request head is at most 8 KiB",
    )
    probe_max_connections: int = Field(
        1024,
        ge=1,
        description="connections the probe port holds at once; at the cap the oldest is closed for the newest, so "
        "that a flood of idle connections never locks the kubelet out. Each costs a descriptor (the probe process "
        "raises its soft limit to fit, within the hard one) and a few kB",
    )
    opentelemetry: bool = Field(
        False,
        description="FastAPI's OpenTelemetry spans and metrics for every request, sent to the providers configured "
        "in this process (for example by opentelemetry-instrument). Off by default: /metrics covers the API, and "
        "checking for providers on every request costs a small model throughput "
        "(benchmarks.serve_ab)",
    )

    grpc_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="port of the Open Inference Protocol over gRPC (inference.GRPCInferenceService, what "
        "tritonclient.grpc and KServe's InferenceGRPCClient speak), on the same host, models, limits, API key and "
        "metrics as HTTP. 0: no gRPC (Triton's and KServe's own gRPC ports are 8001 and 8081)",
    )
    grpc_max_connections: int = Field(
        100,
        ge=1,
        description="gRPC connections open at once, taken out of max_connections (HTTP keeps the rest, at least "
        "half), so that both together stay below the process's file limit; a new one past it is closed at once. "
        "A gRPC client sends all its calls over one connection: 100 is a hundred clients",
    )
    grpc_max_streams: int = Field(
        100,
        ge=1,
        description="calls in flight on one gRPC connection (HTTP/2's SETTINGS_MAX_CONCURRENT_STREAMS; a client "
        "queues the rest itself). 100 is the fewest HTTP/2 (RFC 9113) advises a server to allow",
    )
    grpc_max_calls: int = Field(
        256,
        ge=1,
        description="gRPC calls in flight over all connections; past it a call gets RESOURCE_EXHAUSTED at once. "
        "Each may hold a message of up to max_bytes, so this bounds gRPC's memory; 256 is queue_size's default, "
        "past which calls would only wait for the batcher",
    )
    grpc_idle_timeout_s: float = Field(
        15.0,
        gt=0,
        description="a gRPC connection without a call for this long is closed (with GOAWAY), so that abandoned "
        "ones give their place back; a gRPC channel reconnects by itself on its next call. It bounds how long a "
        "flood of idle connections (each sends the HTTP/2 preface, then nothing) can hold all "
        "grpc_max_connections slots and lock new gRPC clients out; HTTP's connections are not among them. Pings "
        "do not count as calls: a client that pings an idle connection more often than every 10 s is disconnected",
    )
    payload_log: str = Field(
        "", description="file to record every inference request in, as JSON lines, rotated by size (empty: none)"
    )
    payload_log_url: str = Field(
        "",
        description="URL to send every inference request to, as CloudEvents in the format of KServe's inference "
        "logger (empty: none)",
    )
    payload_log_images: Literal["none", "digest", "image"] = Field(
        "none",
        description="what the payload log keeps of each image besides its predictions: none, its SHA-256 "
        "(digest) or the image itself (image: the upload's bytes, base64). Off by default: images can be personal "
        "data, and they are the bulk of the log",
    )
    payload_log_max_bytes: int = Field(
        100 * 1024 * 1024, ge=1024, description="size at which the payload log file is rotated (to FILE.1, ...)"
    )
    payload_log_backups: int = Field(
        5, ge=1, description="rotated payload log files kept (at least 1: with none to roll to, a file never rotates)"
    )
    payload_log_queue_size: int = Field(
        1000,
        ge=1,
        description="records each payload log sink may hold while it writes; beyond that they are dropped and "
        "counted (vitscope_payload_log_dropped_total), so that a slow or dead sink never slows a request",
    )
    payload_log_queue_bytes: int = Field(
        64 * 1024 * 1024,
        ge=1024,
        description="bytes of records (their images and probabilities) each payload log sink may hold while it "
        "writes; beyond that they are dropped and counted as queue_full. 64 MiB holds a few seconds of a stalled "
        "sink at a typical rate, or six of the largest uploads with --payload-log-images image, and keeps the "
        "log's memory bounded whatever the images weigh",
    )

    @field_validator("api_key")
    @classmethod
    def _key_clients_can_send(cls, key: SecretStr) -> SecretStr:
        """HTTP headers and gRPC metadata carry visible ASCII: any other key would match no client's."""
        if not re.fullmatch(r"[!-~]*", key.get_secret_value()):
            raise ValueError(
                "the API key must be visible ASCII (no spaces, tabs or accents): clients send it in "
                "HTTP headers and gRPC metadata"
            )
        return key

    @field_validator("payload_log_url")
    @classmethod
    def _consumer_url(cls, url: str) -> str:
        """Refused before the models load, not by the app's start-up, where it ended in a traceback."""
        if url:
            consumer_url(url)
        return url

    @model_validator(mode="after")
    def _batch_sizes_fit(self) -> ServeSettings:
        if self.preferred_batch_size > self.max_batch_size:
            raise ValueError(
                f"preferred_batch_size must be in 0..max_batch_size ({self.max_batch_size}) "
                f"(0: measured at warm-up), got {self.preferred_batch_size}"
            )
        if self.queue_size < self.max_batch_size:  # a request's images are queued all at once, or refused
            raise ValueError(
                f"queue_size ({self.queue_size}) must be at least max_batch_size ({self.max_batch_size}): a request "
                "of max_batch_size images could never fit the queue"
            )
        return self

    def check_ui_budget(self) -> None:
        """Refuse a UI disk budget that the largest request the UI takes cannot fit (checked where the UI runs).

        Raises:
            ValueError: what to raise or lower.
        """
        if self.ui_cache_bytes < (largest := self.max_bytes + UI_FORM_OVERHEAD + UI_CALL_RESULT_BYTES):
            raise ValueError(
                f"--ui-cache-bytes ({self.ui_cache_bytes:,}) must hold the largest request the UI takes: --max-bytes "
                f"({self.max_bytes:,}), its form and a call's results, {largest:,} in all; raise --ui-cache-bytes, "
                "lower --max-bytes, or serve without the UI (--no-ui)"
            )

    def request_limits(self) -> RequestLimits:
        """The limits the request path reads, and nothing else."""
        return RequestLimits(**{name: getattr(self, name) for name in RequestLimits.__dataclass_fields__})

    def connection_limits(self) -> ConnectionLimits:
        """The limits uvicorn's protocol reads (`serve.server.http.protocol`)."""
        return ConnectionLimits(**{name: getattr(self, name) for name in ConnectionLimits.__dataclass_fields__})


@dataclass(frozen=True)
class RequestLimits:
    """What a request may be and how long it may take: the part of `ServeSettings` the routes, uploads and
    error mapping read (each field is described there)."""

    max_bytes: int
    discard_bytes: int
    max_pixels: int
    inline_decode_bytes: int
    top_k: int
    max_batch_size: int
    deletion_steps: int
    request_timeout_s: float
    body_timeout_s: float  # gRPC's message, as HTTP's body (which the protocol times: `ConnectionLimits`)
    retry_after_s: int


@dataclass(frozen=True)
class ConnectionLimits:
    """What a connection may send and how slowly: the part of `ServeSettings` the protocol reads."""

    max_header_bytes: int
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int
