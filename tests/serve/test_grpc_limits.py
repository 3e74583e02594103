"""gRPC against hostile clients: a real `vit-serve --grpc-port` and real `grpcio` clients.

An unauthenticated call is refused before its message is read, connections and calls are capped, idle
connections are closed, and client text echoed in an error is cut short.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from serve.server.grpc import grpc_predict_v2_pb2 as pb
from tests.helpers import ServerProcess, free_port, read_metric, rss_mib

pytestmark = pytest.mark.slow
KEY = "grpc-limits-key"
AUTH = {"authorization": f"Bearer {KEY}"}
INFER = "/inference.GRPCInferenceService/ModelInfer"
LIVE = "/inference.GRPCInferenceService/ServerLive"


@pytest.fixture(scope="module")
def server(tiny_onnx):
    port = free_port()
    with ServerProcess(tiny_onnx, "--no-ui", "--grpc-port", str(port), "--api-key", KEY) as s:
        s.grpc_url = f"127.0.0.1:{port}"
        yield s


def large_infer(mib: int) -> bytes:
    """A well-formed ModelInferRequest of about `mib` MiB (the default --max-bytes is 10 MiB)."""
    request = pb.ModelInferRequest(model_name="any")
    request.inputs.add(name="pixels", datatype="UINT8", shape=[1, 1024, 1024 * mib])
    request.raw_input_contents.append(bytes(1024 * 1024 * mib))
    return request.SerializeToString()


def test_unauthenticated_large_calls_are_refused_before_they_are_read(server):
    # each on a connection of its own too: HTTP/2 lets a client send up to the receive window before the server
    # reads, and gRPC's window grows to several MiB per call unless the server fixes it
    body, calls = large_infer(8), 32
    channels = [grpc.insecure_channel(server.grpc_url) for _ in range(8)]
    live = channels[0].unary_unary(LIVE, pb.ServerLiveRequest.SerializeToString, pb.ServerLiveResponse.FromString)
    assert live(pb.ServerLiveRequest(), timeout=10).live  # a public RPC needs no key
    before = rss_mib(server.proc.pid)
    with ThreadPoolExecutor(calls) as pool:
        futures = [pool.submit(channels[i % 8].unary_unary(INFER), body, timeout=30) for i in range(calls)]
    for f in futures:
        with pytest.raises(grpc.RpcError) as e:
            f.result()
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value.details()
        assert "no API key" in e.value.details() and "authorization: Bearer" in e.value.details()
    grown = rss_mib(server.proc.pid) - before
    for c in channels:
        c.close()
    assert grown < 20, f"{calls} refused calls of 8 MiB grew the server by {grown:.0f} MiB"
    refused = read_metric(server.metrics(AUTH), "vitscope_requests_total", route=INFER, status="UNAUTHENTICATED")
    assert refused >= calls  # counted, as the handler counted them before
