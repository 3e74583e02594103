"""The handlers of `inference.GRPCInferenceService`: the same models, API key, limits and metrics as HTTP.

The API key (metadata `authorization: Bearer <key>` or `x-api-key: <key>`, as the HTTP headers) is checked by
an interceptor (`KeyCheck`) from the call's metadata, before its message is read; ServerLive and ServerReady
need none, as /v2/health needs none. Every RPC then goes through `Service.rpc`, which reads its one message
within `--body-timeout-s` (as HTTP reads a body), maps an `ApiError` to its gRPC status (`GRPC_STATUS`, beside
HTTP's table of the same codes) and counts the call in the server's Prometheus metrics under its method path,
with the status's name (`OK`, `INVALID_ARGUMENT`, ...) where HTTP has its code."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import time
from collections.abc import Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError

from serve.server.access_log import ACCESS_LOG
from serve.server.api.tensors import check_trust_request, output_tensors
from serve.server.auth import GRPC_KEY_HINT, SANE_REQUEST_ID, RequestIds, key_refusal
from serve.server.errors import ApiError, cut_echoes
from serve.server.grpc import grpc_predict_v2_pb2 as pb
from serve.server.grpc.codec import infer_response, metadata_response, parse_infer, typed_values, uint_values
from serve.server.grpc.models import Models, ServedModel
from serve.server.metrics import Metrics
from serve.server.payload_log import PayloadLog
from serve.server.results import Deadline, batch_results
from serve.server.threads import Threads, run_in

log = logging.getLogger(__name__)
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("grpc_request_id", default="-")

SERVICE = "inference.GRPCInferenceService"
SERVER_NAME, EXTENSIONS = "vitscope", ["binary_tensor_data"]
Code = grpc.StatusCode
GRPC_STATUS = {  # ApiError codes (serve.server.errors.ERROR_STATUS) -> gRPC; anything else: UNKNOWN
    **dict.fromkeys(["empty", "corrupt", "bad_request", "non_finite", "not_an_image"], Code.INVALID_ARGUMENT),
    **dict.fromkeys(["unsupported", "unsupported_media_type", "too_large"], Code.INVALID_ARGUMENT),
    "body_too_large": Code.RESOURCE_EXHAUSTED,
    "unauthorized": Code.UNAUTHENTICATED,
    "not_found": Code.NOT_FOUND,
    **dict.fromkeys(["queue_full", "too_many_connections", "shutting_down", "not_ready"], Code.UNAVAILABLE),
    "timeout": Code.DEADLINE_EXCEEDED,
    "internal": Code.INTERNAL,
}
INFER_ROUTE = f"/{SERVICE}/ModelInfer"
RPCS = {  # name -> the Service method that answers it, the request message
    "ServerLive": ("server_live", pb.ServerLiveRequest),
    "ServerReady": ("server_ready", pb.ServerReadyRequest),
    "ModelReady": ("model_ready", pb.ModelReadyRequest),
    "ServerMetadata": ("server_metadata", pb.ServerMetadataRequest),
    "ModelMetadata": ("model_metadata", pb.ModelMetadataRequest),
    "ModelInfer": ("model_infer", pb.ModelInferRequest),
}
PUBLIC = {f"/{SERVICE}/{name}" for name in ("ServerLive", "ServerReady")}  # no key needed, as the HTTP health routes
NOT_READY = "the model is loading or warming up (or the server is stopping)"
MESSAGE_CHARS = 1000  # the most of a message in a status
# The client's deadline passes first: the server counts its deadline from the headers' arrival, later by the time
# they took to reach it (past 1 ms on a busy machine: a call cut by its deadline was counted CANCELLED)
DEADLINE_SLACK_S = 0.1


class Service:
    """The RPCs over `models`, each answered on the gRPC server's event loop (pixels sent as typed values are
    converted in a thread).

    Args:
        models: which model answers a request (`serve.server.grpc.models`).
        limits: the request limits (`max_batch_size`, `request_timeout_s`).
        api_key: the key clients must send ("": none).
        metrics: where each call is counted.
        payloads: where each answered ModelInfer is recorded (None: nowhere).
    """

    def __init__(self, models: Models, limits, api_key: str, metrics: Metrics, payloads: PayloadLog | None = None):
        self.models, self.limits, self.metrics, self.payloads = models, limits, metrics, payloads
        self.api_key = api_key.encode("utf-8")
        self.new_id = RequestIds()
        self.access_log = ACCESS_LOG  # one line per call, as HTTP requests get
        self.routes = {f"/{SERVICE}/{name}" for name in RPCS}
        self.threads = Threads()  # of the gRPC server's loop: a limiter's waiters belong to one loop

    def handler(self) -> grpc.GenericRpcHandler:
        """The service's method handlers, for `grpc.aio.Server.add_generic_rpc_handlers`."""
        handlers = {  # unary RPCs, read as streams: `Service.rpc` waits for the one message under a deadline
            name: grpc.stream_unary_rpc_method_handler(
                self.rpc(name, getattr(self, method)),
                request_deserializer=message.FromString,
                response_serializer=_serialize,
            )
            for name, (method, message) in RPCS.items()
        }
        return grpc.method_handlers_generic_handler(SERVICE, handlers)

    def rpc(self, name: str, fn: Callable[..., Awaitable]) -> Callable[..., Awaitable]:
        """`fn` called with the call's one message, read within `body_timeout_s` as HTTP reads a body, with the
        status mapping and the metrics of every call.

        gRPC's unary handlers wait for their message without end: calls that sent their headers and never their
        message held every one of `grpc_max_calls` slots, with or without the API key (ServerLive needs none).
        """
        route = f"/{SERVICE}/{name}"

        async def call(requests, context: grpc.aio.ServicerContext):
            started, client, code = time.perf_counter(), client_of(context), Code.UNKNOWN
            try:
                response, code, message = await self.answer(fn, route, context)
                trailers = self.trailers(REQUEST_ID.get(), code)
                if code == Code.OK:
                    context.set_trailing_metadata(trailers)
                    return response
                # aborted here, where no frame holds the request: the abort's traceback keeps its frames until a
                # garbage collection, and a 10 MB request was held that long
                await context.abort(code, message, trailers)
            except asyncio.CancelledError:  # the client went away or its deadline passed
                left = context.time_remaining()  # None: no deadline; 0 once it has passed
                code = Code.DEADLINE_EXCEEDED if left is not None and left <= DEADLINE_SLACK_S else Code.CANCELLED
                raise
            finally:
                self.metrics.observe(route, code.name, started)
                ms = (time.perf_counter() - started) * 1000
                self.access_log.write(client, "gRPC", route, code.name, ms, REQUEST_ID.get())

        return call

    def trailers(self, request_id: str, code: grpc.StatusCode) -> tuple[tuple[str, str], ...]:
        """A call's trailing metadata: its request ID (HTTP echoes it in `X-Request-Id`) and, when the server is
        busy, starting or stopping (UNAVAILABLE, HTTP's 503), `grpc-retry-pushback-ms`, HTTP's `Retry-After`. Not
        with `--retry-after-s 0`: a pushback of 0 took over the client's own backoff (retries at once against a busy
        server), and grpcio's retrying client made no second attempt at all."""
        if code != Code.UNAVAILABLE or self.limits.retry_after_s <= 0:
            return (("x-request-id", request_id),)
        return ("x-request-id", request_id), ("grpc-retry-pushback-ms", str(self.limits.retry_after_s * 1000))

    async def answer(self, fn: Callable[..., Awaitable], route: str, context) -> tuple:
        """(the response, OK, "") of `fn` on the call's message, or (None, the status, its message), with the
        call's request ID in `REQUEST_ID` (its access-log line and its payload-log record share it)."""
        own = self.metadata_id(context.invocation_metadata())
        REQUEST_ID.set(own or self.new_id())  # a call that fails before its message is logged under it
        try:
            request = await self.message(context)
            given = getattr(request, "id", "")
            if not own and isinstance(given, str) and SANE_REQUEST_ID.fullmatch(given):
                REQUEST_ID.set(given)
            return await fn(request, context), Code.OK, ""
        except ApiError as err:
            return None, GRPC_STATUS.get(err.code, Code.UNKNOWN), status_message(err.message)
        except Exception as e:
            log.exception("unexpected error in %s", route)
            return None, Code.INTERNAL, f"internal error ({type(e).__name__}); see the server log"

    async def message(self, context: grpc.aio.ServicerContext):
        """The call's one request message, or `ApiError` when it does not come within `body_timeout_s`.

        The deadline is a timer that cancels this task, as `asyncio.timeout` does (Python 3.11 on): `asyncio.wait_for`
        runs the read in a task of its own, a cost each call paid (BENCHMARKS.md, "Peers: ... gRPC against HTTP v2").
        """
        timeout, task, fired = self.limits.body_timeout_s, asyncio.current_task(), []
        timer = asyncio.get_running_loop().call_later(timeout, lambda: fired.append(task.cancel()))
        try:
            request = await context.read()
        except DecodeError as e:  # not a message of this RPC: the client's mistake, not the server's
            raise ApiError("bad_request", f"the request message cannot be read ({e})") from None
        except asyncio.CancelledError:
            if not fired:  # the client went away, or the server stops
                raise
            getattr(task, "uncancel", lambda: None)()  # (Python 3.11 on: the cancel is handled here)
            raise ApiError(
                "timeout", f"the call's message did not arrive within {timeout:g} s (--body-timeout-s)"
            ) from None
        finally:
            timer.cancel()
        if request is grpc.aio.EOF:  # ended before its message: by the client, its deadline, or gRPC core (a
            raise asyncio.CancelledError  # message over max_bytes); what it was told, it was told already
        return request

    def request_id(self, metadata, given: str) -> str:
        """The client's `x-request-id` metadata or the request's own id when sane, else a new one."""
        return self.metadata_id(metadata) or self.new_id(given)

    @staticmethod
    def metadata_id(metadata) -> str:
        """The client's `x-request-id` metadata when sane, else ""."""
        for k, v in metadata or ():
            if k == "x-request-id" and isinstance(v, str) and SANE_REQUEST_ID.fullmatch(v):
                return v
        return ""

    def key_check(self) -> grpc.aio.ServerInterceptor:
        """The interceptor that refuses a call without the API key before its message is read."""
        return KeyCheck(self)

    def refusal(self, route: str, metadata, message: str) -> grpc.RpcMethodHandler:
        """A handler that answers UNAUTHENTICATED with `message` and never reads the call's message: a streaming
        handler's requests are read only when it iterates them, and a unary one's before it runs."""
        label = route if route in self.routes else "(unknown method)"  # bounded metric labels

        async def refuse(requests, context: grpc.aio.ServicerContext):
            self.metrics.observe(label, Code.UNAUTHENTICATED.name, time.perf_counter())
            rid = self.request_id(metadata, "")
            self.access_log.write(client_of(context), "gRPC", label, Code.UNAUTHENTICATED.name, 0.0, rid)
            await context.abort(Code.UNAUTHENTICATED, message, self.trailers(rid, Code.UNAUTHENTICATED))

        return grpc.stream_unary_rpc_method_handler(refuse)

    async def server_live(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def server_ready(self, request, context):
        return pb.ServerReadyResponse(ready=self.models.ready())

    async def model_ready(self, request, context):
        try:
            model = self.models.get(request.name, request.version)
        except ApiError:  # a probe of a model this server does not hold: not ready, as HTTP's 404 reads
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=model.engine.ready)

    async def server_metadata(self, request, context):
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=_version(), extensions=EXTENSIONS)

    async def model_metadata(self, request, context):
        m = self.models.get(request.name, request.version)
        versions = [m.version] if request.version else self.models.versions(m.name)  # as HTTP's metadata lists them
        return metadata_response(m.name, versions, m.pixels, m.logits)

    async def model_infer(self, request: pb.ModelInferRequest, context):
        deadline = Deadline(self.limits.request_timeout_s)  # the message is in: parsed before the method is called
        with self.models.hold(request.model_name, request.model_version) as m:
            return await self.infer_with(m, request, deadline)

    async def infer_with(self, m: ServedModel, request: pb.ModelInferRequest, deadline: Deadline):
        if not m.engine.ready:
            raise ApiError("not_ready", NOT_READY)
        # pixels sent as typed values are converted one by one (slow for a batch of large images): in a thread, so
        # that the loop answers other calls meanwhile, health checks among them
        typed = typed_values(request)
        converted = await run_in(self.threads.parses, uint_values, typed) if typed else None
        req = parse_infer(request, m.pixels, self.limits.max_batch_size, converted)
        del typed, converted  # 4 bytes a value, for the whole call: the request keeps its own uint8 copy
        check_trust_request(m.classifier, req)
        rows = await batch_results(m.engine, req.pixels, deadline)  # (B,) records
        if self.payloads is not None:
            images = [p.tobytes() for p in req.pixels] if self.payloads.wants_images else None
            model = (m.name, m.version, m.classifier.labels)
            self.payloads.record(REQUEST_ID.get(), INFER_ROUTE, model, rows["probs"], images)
        outputs = [(name, tensor) for name, tensor, _ in output_tensors(m.classifier, rows, req)]
        return infer_response(m.name, m.version, request.id, outputs)


class KeyCheck(grpc.aio.ServerInterceptor):
    """Checks the API key from a call's metadata alone, before gRPC reads or parses its message.

    The interceptor runs once the call's headers have arrived; a call without the key (or with a wrong one) gets
    `Service.refusal`, which answers UNAUTHENTICATED without ever asking for the message, so an unauthenticated
    client cannot make the server hold or parse a body. The public RPCs (`PUBLIC`) pass without a key.
    """

    def __init__(self, service: Service):
        self.service = service

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        expected, route = self.service.api_key, details.method
        if not expected or route in PUBLIC:
            return await continuation(details)
        metadata = details.invocation_metadata or ()
        latin = lambda text: text.encode("latin-1", "replace")
        headers = [(latin(k), latin(v)) for k, v in metadata if isinstance(v, str)]
        refused = key_refusal(expected, headers, GRPC_KEY_HINT)
        if refused is None:
            return await continuation(details)
        return self.service.refusal(route, metadata, refused)


def status_message(message: str) -> str:
    """`message` fit to send as a status: its quoted values cut (`cut_echoes`), and the whole to `MESSAGE_CHARS`.
    gRPC sends the message as a header, and a client refuses headers past its metadata limit (16 KiB at most): a
    long echo would turn the answer into RESOURCE_EXHAUSTED, hiding what was wrong."""
    short = cut_echoes(message)
    return short if len(short) <= MESSAGE_CHARS else short[: MESSAGE_CHARS - 1] + "…"


def _serialize(message) -> bytes:
    return message.SerializeToString()


@functools.cache
def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vitscope")
    except PackageNotFoundError:
        return "unknown"


def client_of(context) -> str:
    """The caller's address from gRPC's peer string (`ipv4:127.0.0.1:5000`, `ipv6:[::1]:5000`)."""
    peer = context.peer() or "-"
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rsplit(":", 1)[0].strip("[]")
    return peer
