"""The handlers of `inference.GRPCInferenceService`: the same models, API key, limits and metrics as HTTP.

Every RPC goes through `Service.rpc`, which checks the API key (metadata `authorization: Bearer <key>` or
`x-api-key: <key>`, as the HTTP headers; ServerLive and ServerReady need none, as /v2/health needs none),
maps an `ApiError` to its gRPC status (`GRPC_STATUS`, beside HTTP's table of the same codes) and counts the
call in the server's Prometheus metrics under its method path, with the status's name (`OK`,
`INVALID_ARGUMENT`, ...) where HTTP has its code.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import time
from collections.abc import Awaitable, Callable

import grpc

from serve.server.access_log import ACCESS_LOG
from serve.server.auth import SANE_REQUEST_ID, RequestIds, key_refusal
from serve.server.errors import ApiError
from serve.server.grpc import grpc_predict_v2_pb2 as pb
from serve.server.grpc.codec import infer_response, metadata_response, parse_infer
from serve.server.grpc.models import Models, ServedModel
from serve.server.metrics import Metrics
from serve.server.payload_log import PayloadLog
from serve.server.results import batch_results

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
PUBLIC = ("ServerLive", "ServerReady")  # answered without the API key, as the HTTP health routes
NOT_READY = "the model is loading or warming up (or the server is stopping)"


class Service:
    """The RPCs over `models`, each answered on the gRPC server's event loop.

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

    def handler(self) -> grpc.GenericRpcHandler:
        """The service's method handlers, for `grpc.aio.Server.add_generic_rpc_handlers`."""
        rpcs = {
            "ServerLive": (self.server_live, pb.ServerLiveRequest),
            "ServerReady": (self.server_ready, pb.ServerReadyRequest),
            "ModelReady": (self.model_ready, pb.ModelReadyRequest),
            "ServerMetadata": (self.server_metadata, pb.ServerMetadataRequest),
            "ModelMetadata": (self.model_metadata, pb.ModelMetadataRequest),
            "ModelInfer": (self.model_infer, pb.ModelInferRequest),
        }
        handlers = {
            name: grpc.unary_unary_rpc_method_handler(
                self.rpc(name, fn), request_deserializer=message.FromString, response_serializer=_serialize
            )
            for name, (fn, message) in rpcs.items()
        }
        return grpc.method_handlers_generic_handler(SERVICE, handlers)

    def rpc(self, name: str, fn: Callable[..., Awaitable]) -> Callable[..., Awaitable]:
        """`fn` with the API-key check, the status mapping and the metrics of every call."""
        route, public = f"/{SERVICE}/{name}", name in PUBLIC

        async def call(request, context: grpc.aio.ServicerContext):
            started, code = time.perf_counter(), Code.OK
            given = getattr(request, "id", "")
            rid = self.request_id(context, given if isinstance(given, str) else "")
            REQUEST_ID.set(rid)  # the payload log records the call under the same ID as its access-log line
            try:
                if not public and self.api_key:
                    self.check_key(context.invocation_metadata())
                return await fn(request, context)
            except ApiError as err:
                code = GRPC_STATUS.get(err.code, Code.UNKNOWN)
                await context.abort(code, err.message)
            except asyncio.CancelledError:  # the client went away or its deadline passed
                code = Code.CANCELLED
                raise
            except Exception as e:
                log.exception("unexpected error in %s", route)
                code = Code.INTERNAL
                await context.abort(code, f"internal error ({type(e).__name__}); see the server log")
            finally:
                self.metrics.observe(route, code.name, started)
                ms = (time.perf_counter() - started) * 1000
                self.access_log.write(client_of(context), "gRPC", route, code.name, ms, rid)

        return call

    def request_id(self, context, given: str) -> str:
        """The client's `x-request-id` metadata or the request's own id when sane, else a new one."""
        for k, v in context.invocation_metadata() or ():
            if k == "x-request-id" and SANE_REQUEST_ID.fullmatch(v):
                return v
        return self.new_id(given)

    def check_key(self, metadata) -> None:
        headers = {k.encode("latin-1"): v.encode("latin-1") for k, v in metadata or () if isinstance(v, str)}
        refused = key_refusal(self.api_key, headers)
        if refused is not None:
            raise ApiError("unauthorized", refused.replace("'Authorization", "metadata 'authorization"))

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
        return metadata_response(m.name, m.version, m.pixels, m.logits)

    async def model_infer(self, request: pb.ModelInferRequest, context):
        m = self.models.get(request.model_name, request.model_version)
        with m.held():  # a swapped-out version drains only once this call is done with it
            return await self.infer_with(m, request, context)

    async def infer_with(self, m: ServedModel, request: pb.ModelInferRequest, context):
        if not m.engine.ready:
            raise ApiError("not_ready", NOT_READY)
        pixels, wanted = parse_infer(request, m.pixels, self.limits.max_batch_size)
        rows = await batch_results(m.engine, pixels, self.limits.request_timeout_s)  # (B,) records
        by_name = {"logits": rows["logits"], "probs": rows["probs"]}
        if self.payloads is not None:
            images = [p.tobytes() for p in pixels] if self.payloads.wants_images else None
            model = (m.name, m.version, m.classifier.labels)
            self.payloads.record(REQUEST_ID.get(), INFER_ROUTE, model, rows["probs"], images)
        return infer_response(m.name, m.version, request.id, [(n, by_name[n]) for n in wanted])


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
