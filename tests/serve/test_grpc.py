"""The Open Inference Protocol over gRPC: the real `tritonclient.grpc` client against a real `vit-serve --grpc-port`.

The same server answers HTTP, so each result is compared with what /v1/classify says of the same image
and with onnxruntime running the file itself; the API key and the limits are HTTP's.
"""

from __future__ import annotations

import threading
import time

import grpc
import httpx
import numpy as np
import onnxruntime as ort
import pytest
from fastapi.testclient import TestClient

from serve.runtime.classifier import OnnxClassifier, softmax
from serve.server.app import build_app
from serve.server.grpc import grpc_predict_v2_pb2 as pb
from serve.server.settings import ServeSettings
from serve.server.testing import free_port, read_metric
from tests.helpers import CLASS_NAMES, ServerProcess, json_lines, png_bytes, quadrant_images, wait_until

grpcclient = pytest.importorskip("tritonclient.grpc")
InferenceServerException = pytest.importorskip("tritonclient.utils").InferenceServerException

pytestmark = pytest.mark.slow
KEY = "grpc-test-key"
AUTH = {"authorization": f"Bearer {KEY}"}
MAX_BYTES = 200_000  # 65 images of 32 x 32 x 3: an oversized message is cheap to send


@pytest.fixture(scope="module")
def server(tiny_onnx, tmp_path_factory):
    port, log = free_port(), tmp_path_factory.mktemp("grpc") / "payloads.jsonl"
    args = ("--no-ui", "--grpc-port", str(port), "--max-bytes", str(MAX_BYTES), "--api-key", KEY)
    with ServerProcess(tiny_onnx, *args, "--payload-log", str(log)) as s:
        s.grpc_url, s.payload_log = f"127.0.0.1:{port}", log
        yield s


@pytest.fixture(scope="module")
def client(server):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    yield c
    c.close()


@pytest.fixture(scope="module")
def model(server) -> str:
    return httpx.get(server.url + "/readyz", headers=AUTH, timeout=30).json()["model"]


def infer(client, model: str, x: np.ndarray, outputs=("logits",), name="pixels", datatype="UINT8", **kwargs):
    inp = grpcclient.InferInput(name, list(x.shape), datatype)
    inp.set_data_from_numpy(x)  # raw_input_contents, as tritonclient.grpc sends it
    wanted = [grpcclient.InferRequestedOutput(n) for n in outputs]
    return client.infer(model, [inp], outputs=wanted, headers=kwargs.pop("headers", AUTH), **kwargs)


def infer_to_shared_memory(client, model: str, x: np.ndarray):
    inp = grpcclient.InferInput("pixels", list(x.shape), "UINT8")
    inp.set_data_from_numpy(x)
    out = grpcclient.InferRequestedOutput("logits")
    out.set_shared_memory("logits_region", 4 * 1024)
    return client.infer(model, [inp], outputs=[out], headers=AUTH)


def refusal(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as e:
        call()
    return e.value


def test_live_ready_and_metadata_answer_as_triton(client, model):
    assert client.is_server_live() and client.is_server_ready()  # health: no key needed
    assert client.is_model_ready(model, headers=AUTH)
    assert not client.is_model_ready("no_such_model", headers=AUTH)
    assert "binary_tensor_data" in client.get_server_metadata(headers=AUTH).extensions
    meta = client.get_model_metadata(model, headers=AUTH, as_json=True)
    assert meta["platform"] == "onnxruntime_onnx"
    assert meta["inputs"] == [{"name": "pixels", "datatype": "UINT8", "shape": ["-1", "32", "32", "3"]}]
    assert meta["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": ["-1", str(len(CLASS_NAMES))]}]


@pytest.mark.parametrize("batch", [1, 4])
def test_infer_equals_the_file_and_v1_classify(client, model, server, tiny_onnx, batch):
    x, _ = quadrant_images(batch, seed=batch)  # (B, 32, 32, 3) uint8
    result = infer(client, model, x, outputs=("logits", "probs"), request_id=f"req-{batch}")
    assert result.get_response().id == f"req-{batch}"
    logits, probs = result.as_numpy("logits"), result.as_numpy("probs")
    assert logits.dtype == np.float32 and logits.shape == (batch, len(CLASS_NAMES))
    session = ort.InferenceSession(str(tiny_onnx), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(logits, session.run(["logits"], {"pixels": x})[0], rtol=1e-5, atol=1e-5)
    temperature = OnnxClassifier(tiny_onnx).trust.temperature  # probs are calibrated, as /v1's scores
    np.testing.assert_allclose(probs, softmax(logits / temperature), atol=1e-6)
    for img, row in zip(x, probs, strict=True):  # 32 x 32 PNGs: /v1 decodes them to the very same pixels
        r = httpx.post(
            server.url + f"/v1/classify?top_k={len(CLASS_NAMES)}",
            files={"file": ("x.png", png_bytes(img))},
            headers=AUTH,
            timeout=30,
        )
        scores = {p["label"]: p["score"] for p in r.json()["predictions"]}
        np.testing.assert_allclose([scores[c] for c in CLASS_NAMES], row, atol=1e-6)


def test_the_api_key_is_checked_as_over_http(client, model):
    x, _ = quadrant_images(1)
    assert infer(client, model, x, headers={"x-api-key": KEY}).as_numpy("logits").shape == (1, 4)
    for headers, words in [({}, "no API key"), ({"authorization": "Bearer wrong"}, "a wrong API key")]:
        e = refusal(lambda h=headers: infer(client, model, x, headers=h))
        assert e.status() == "StatusCode.UNAUTHENTICATED" and words in e.message()


def test_bad_requests_get_the_right_status_and_say_what_to_do(client, model):
    ok = np.zeros((1, 32, 32, 3), np.uint8)
    cases = [
        (lambda: infer(client, model, np.zeros((1, 16, 32, 3), np.uint8)), "INVALID_ARGUMENT", "must have shape"),
        (lambda: infer(client, model, np.zeros((33, 32, 32, 3), np.uint8)), "INVALID_ARGUMENT", "split larger"),
        (lambda: infer(client, model, ok.astype(np.float32), datatype="FP32"), "INVALID_ARGUMENT", "datatype UINT8"),
        (lambda: infer(client, model, ok, name="image"), "INVALID_ARGUMENT", "takes one input, 'pixels'"),
        (lambda: infer(client, model, ok, outputs=("scores",)), "INVALID_ARGUMENT", "unknown output 'scores'"),
        (lambda: infer(client, "no_such_model", ok), "NOT_FOUND", "model 'no_such_model' is not served"),
        (lambda: infer(client, model, ok, model_version="99"), "NOT_FOUND", "version '99' of"),
        (lambda: infer(client, model, np.zeros((70, 32, 32, 3), np.uint8)), "RESOURCE_EXHAUSTED", str(MAX_BYTES)),
        # answered in raw_output_contents, while the client read its region: never written
        (lambda: infer_to_shared_memory(client, model, ok), "INVALID_ARGUMENT", "shared memory is not supported"),
    ]
    for call, status, words in cases:
        e = refusal(call)
        assert (e.status(), words in e.message()) == (f"StatusCode.{status}", True), e.message()
    assert client.is_server_ready()  # none of it hurt the server


def http_infer(server, model: str, x: np.ndarray, outputs, parameters: dict | None = None) -> httpx.Response:
    tensor = {"name": "pixels", "datatype": "UINT8", "shape": list(x.shape), "data": x.ravel().tolist()}
    body = {"inputs": [tensor], "outputs": [{"name": n} for n in outputs], "parameters": parameters or {}}
    return httpx.post(f"{server.url}/v2/models/{model}/infer", json=body, headers=AUTH, timeout=30)


def test_the_calibration_outputs_and_the_coverage_parameter_are_answered_as_over_http(client, model, server):
    # tritonclient sends a float parameter as double_param: once read as no parameter at all, and the
    # calibration outputs HTTP answers (unknown, ood_score, in_set) were refused as unknown over gRPC
    x, labels = quadrant_images(6, seed=13)
    outputs = ("probs", "in_set", "unknown", "ood_score")
    result = infer(client, model, x, outputs=outputs, parameters={"coverage": 0.9})
    over_http = {o["name"]: o for o in http_infer(server, model, x, outputs, {"coverage": 0.9}).json()["outputs"]}
    for name in outputs:
        got = result.as_numpy(name)
        assert got.dtype == np.float32 and list(got.shape) == over_http[name]["shape"], name
        np.testing.assert_allclose(got.ravel(), over_http[name]["data"], atol=1e-6, err_msg=name)
    assert result.as_numpy("in_set")[np.arange(6), labels].mean() >= 0.8
    for parameters, words in [
        ({}, 'the output "in_set" needs the request parameter "coverage"'),
        ({"coverage": 1.5}, "between 0 and 1"),
        ({"coverage": "0.9"}, 'the parameter "coverage" must be a number such as 0.95'),
        ({"coverage": True}, 'the parameter "coverage" must be a number such as 0.95'),
    ]:
        e = refusal(lambda p=parameters: infer(client, model, x, outputs=("in_set",), parameters=p))
        assert e.status() == "StatusCode.INVALID_ARGUMENT" and words in e.message(), e.message()
        assert words in http_infer(server, model, x, ("in_set",), parameters).json()["error"]


def raw_infer(target: str) -> grpc.UnaryUnaryMultiCallable:
    """ModelInfer with grpcio alone: its calls show the trailing metadata, which tritonclient does not."""
    channel = grpc.insecure_channel(target)
    return channel.unary_unary(
        "/inference.GRPCInferenceService/ModelInfer",
        pb.ModelInferRequest.SerializeToString,
        pb.ModelInferResponse.FromString,
    )


def infer_request(model: str, x: np.ndarray) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="pixels", datatype="UINT8", shape=x.shape)
    request.raw_input_contents.append(x.tobytes())
    return request


def test_each_call_answers_its_request_id_in_the_trailing_metadata_as_http_echoes_it(server, model):
    call, ok = raw_infer(server.grpc_url), infer_request(model, np.zeros((1, 32, 32, 3), np.uint8))
    _, answered = call.with_call(ok, metadata=[*AUTH.items(), ("x-request-id", "grpc-echoed")])
    assert ("x-request-id", "grpc-echoed") in answered.trailing_metadata()
    _, answered = call.with_call(ok, metadata=list(AUTH.items()))  # none given: the one the access log names
    given = dict(answered.trailing_metadata())["x-request-id"]
    wait_until(lambda: f"id={given}" in server.output, 20, "the access log line of the generated ID")
    for metadata in [[*AUTH.items(), ("x-request-id", "grpc-refused")], [("x-request-id", "grpc-refused")]]:
        with pytest.raises(grpc.RpcError) as e:  # a bad shape, then no key: refusals carry it too
            call(infer_request(model, np.zeros((1, 16, 32, 3), np.uint8)), metadata=metadata)
        assert ("x-request-id", "grpc-refused") in e.value.trailing_metadata(), e.value.code()


def test_a_key_sent_twice_in_the_metadata_is_refused_as_over_http(server, model):
    call, ok = raw_infer(server.grpc_url), infer_request(model, np.zeros((1, 32, 32, 3), np.uint8))
    for twice in ([*AUTH.items(), ("authorization", "Bearer wrong")], [("x-api-key", "wrong"), ("x-api-key", KEY)]):
        with pytest.raises(grpc.RpcError) as e:
            call(ok, metadata=twice, timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "sent twice" in e.value.details()


@pytest.mark.parametrize("retry_after_s", [2, 0])
def test_a_full_queue_is_unavailable_with_a_retry_pushback_as_http_sends_retry_after(tiny_onnx, retry_after_s):
    port, limits = free_port(), {"queue_size": 1, "max_batch_size": 1, "retry_after_s": retry_after_s}
    settings = ServeSettings(**limits, examples_dir="", grpc_port=port)
    with TestClient(build_app(OnnxClassifier(tiny_onnx), settings, with_ui=False), base_url="http://localhost") as c:
        engine, gate = c.app.state.engine, threading.Event()
        blocker = engine.batcher.call(gate.wait, 10)  # the worker is busy ...
        wait_until(lambda: engine.batcher.depth == 0, 5, "the worker taking the gate call")
        queued = engine.batcher.submit(np.zeros((32, 32, 3), np.uint8))  # ... and the one queue slot is taken
        model = c.get("/readyz").json()["model"]
        try:
            with pytest.raises(grpc.RpcError) as e:
                raw_infer(f"127.0.0.1:{port}")(infer_request(model, np.zeros((1, 32, 32, 3), np.uint8)), timeout=10)
        finally:
            gate.set()
            blocker.result(5), queued.result(5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "busy" in e.value.details()
    pushback = dict(e.value.trailing_metadata()).get("grpc-retry-pushback-ms")
    # gRPC's retry policy waits that long; 0 would replace the client's own backoff (grpcio's then never retried)
    assert pushback == ("2000" if retry_after_s else None)


def test_grpc_calls_are_counted_in_the_metrics(client, model, server):
    answers = lambda: read_metric(server.metrics(AUTH), "vitscope_confidence_count", default=0.0)  # trust metrics
    before = answers()
    infer(client, model, np.zeros((2, 32, 32, 3), np.uint8))
    assert answers() == before + 2  # gRPC answers feed the drift gauges as HTTP ones do
    refusal(lambda: infer(client, model, np.zeros((1, 16, 32, 3), np.uint8)))
    text = httpx.get(server.url + "/metrics", headers=AUTH, timeout=30).text
    route = "/inference.GRPCInferenceService/ModelInfer"
    assert f'vitscope_requests_total{{route="{route}",status="OK"}}' in text
    assert f'vitscope_requests_total{{route="{route}",status="INVALID_ARGUMENT"}}' in text


def test_grpc_answers_are_in_the_payload_log(client, model, server):
    infer(client, model, np.zeros((2, 32, 32, 3), np.uint8), headers={**AUTH, "x-request-id": "grpc-logged"})
    logged = wait_until(
        lambda: [r for r in json_lines(server.payload_log) if r["id"] == "grpc-logged"], 20, "the gRPC record"
    )
    assert logged[0]["route"] == "/inference.GRPCInferenceService/ModelInfer"
    assert logged[0]["model"] == model and len(logged[0]["predictions"]) == 2


def test_grpc_calls_get_an_access_log_line_with_their_status_and_request_id(client, model, server):
    infer(client, model, np.zeros((1, 32, 32, 3), np.uint8), headers={**AUTH, "x-request-id": "grpc-access"})
    refusal(
        lambda: infer(client, model, np.zeros((1, 16, 32, 3), np.uint8), headers={**AUTH, "x-request-id": "grpc-bad"})
    )
    route = "/inference.GRPCInferenceService/ModelInfer"
    wanted = [f'"gRPC {route}" OK', f'"gRPC {route}" INVALID_ARGUMENT']
    deadline = time.monotonic() + 20  # the access log is written by a thread of its own
    while time.monotonic() < deadline and not all(i in server.output for i in ("id=grpc-access", "id=grpc-bad")):
        time.sleep(0.05)
    lines = [line for line in server.output.splitlines() if "vitscope.access: 127.0.0.1" in line]
    assert sum(wanted[0] in line and line.endswith("id=grpc-access") for line in lines) == 1  # once, not twice
    assert sum(wanted[1] in line and line.endswith("id=grpc-bad") for line in lines) == 1, server.output[-2000:]


def test_sigterm_stops_a_grpc_server_at_once_when_no_call_is_in_flight(tiny_onnx):
    # the gRPC loop used to end with its server and close under the stop call, which then waited out the
    # whole drain (graceful_timeout_s, 20 s) plus 5 s: a pod with Kubernetes' 30 s grace period was nearly killed
    port = free_port()
    with ServerProcess(tiny_onnx, "--no-ui", "--grpc-port", str(port)) as server:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        assert client.is_server_live()
        client.close()
        started = time.monotonic()
        assert server.stop() == 0
        took = time.monotonic() - started
    assert took < 10, f"the server took {took:.1f} s to stop with nothing in flight:\n{server.output[-2000:]}"
    assert "Task was destroyed" not in server.output
