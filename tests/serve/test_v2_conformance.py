"""KServe v2 conformance: the real `tritonclient.http` client against a real `vit-serve` on 127.0.0.1.

The same client code works against Triton serving the same file (README, "Production"): tensor names,
datatypes and shapes are the graph's own, and both JSON and binary tensors are spoken.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import onnxruntime as ort
import pytest

from serve.runtime.classifier import OnnxClassifier, softmax
from serve.server.testing import free_port
from tests.helpers import CLASS_NAMES, ServerProcess, png_bytes, quadrant_images

tritonclient_http = pytest.importorskip("tritonclient.http")
InferenceServerException = pytest.importorskip("tritonclient.utils").InferenceServerException

pytestmark = pytest.mark.slow
MAX_BYTES = 1024 * 1024


@pytest.fixture(scope="module")
def server(tiny_onnx):
    port = free_port()
    with ServerProcess(tiny_onnx, "--no-ui", "--grpc-port", str(port), "--max-bytes", str(MAX_BYTES)) as s:
        s.grpc_url = f"127.0.0.1:{port}"
        yield s


@pytest.fixture(scope="module")
def client(server):
    c = tritonclient_http.InferenceServerClient(server.url.removeprefix("http://"), network_timeout=30)
    yield c
    c.close()


@pytest.fixture(scope="module")
def session(tiny_onnx) -> ort.InferenceSession:
    """The file in onnxruntime itself: the names, types and logits that Triton would serve."""
    return ort.InferenceSession(str(tiny_onnx), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def model(server) -> str:
    return httpx.get(server.url + "/readyz", timeout=30).json()["model"]


def infer(client, model: str, x: np.ndarray, binary: bool, outputs: tuple[str, ...] = ()):
    inp = tritonclient_http.InferInput("pixels", list(x.shape), "UINT8")
    inp.set_data_from_numpy(x, binary_data=binary)
    wanted = [tritonclient_http.InferRequestedOutput(n, binary_data=binary) for n in outputs] or None
    return client.infer(model, [inp], outputs=wanted)


def test_health_and_readiness_answer_as_kserve(client, model):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(model)
    assert not client.is_model_ready("no_such_model")
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]


def test_metadata_names_the_graphs_own_tensors(client, model, session):
    meta = client.get_model_metadata(model)
    assert meta["platform"] == "onnxruntime_onnx"
    assert meta["inputs"] == [{"name": "pixels", "datatype": "UINT8", "shape": [-1, 32, 32, 3]}]
    assert meta["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, len(CLASS_NAMES)]}]
    assert meta["parameters"]["labels"] == CLASS_NAMES
    assert [(i.name, i.type) for i in session.get_inputs()] == [("pixels", "tensor(uint8)")]
    assert ("logits", "tensor(float)") in [(o.name, o.type) for o in session.get_outputs()]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("batch", [1, 4])
def test_infer_returns_the_files_logits_by_default(client, model, session, batch, binary):
    x, _ = quadrant_images(batch, seed=batch)  # (B, 32, 32, 3) uint8
    result = infer(client, model, x, binary)
    assert [o["name"] for o in result.get_response()["outputs"]] == ["logits"]  # Triton's default: every output
    logits = result.as_numpy("logits")
    assert logits.dtype == np.float32 and logits.shape == (batch, len(CLASS_NAMES))
    np.testing.assert_allclose(logits, session.run(["logits"], {"pixels": x})[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_softmax_of_v2_logits_equals_the_v1_scores(client, model, server, tiny_onnx, binary):
    x, _ = quadrant_images(4, seed=7)
    result = infer(client, model, x, binary, outputs=("logits", "probs"))
    temperature = OnnxClassifier(tiny_onnx).trust.temperature  # both report calibrated probabilities
    probs = softmax(result.as_numpy("logits") / temperature)
    np.testing.assert_allclose(result.as_numpy("probs"), probs, atol=1e-6)
    for img, row in zip(x, probs, strict=True):
        r = httpx.post(
            server.url + f"/v1/classify?top_k={len(CLASS_NAMES)}", files={"file": ("x.png", png_bytes(img))}, timeout=30
        )
        scores = {p["label"]: p["score"] for p in r.json()["predictions"]}
        np.testing.assert_allclose([scores[c] for c in CLASS_NAMES], row, atol=1e-6)


def test_wrong_datatype_and_shape_are_refused_with_a_message(client, model):
    x = np.zeros((1, 32, 32, 3), np.float32)
    as_fp32 = tritonclient_http.InferInput("pixels", [1, 32, 32, 3], "FP32")
    as_fp32.set_data_from_numpy(x)
    small = tritonclient_http.InferInput("pixels", [1, 16, 32, 3], "UINT8")
    small.set_data_from_numpy(np.zeros((1, 16, 32, 3), np.uint8))
    too_many = tritonclient_http.InferInput("pixels", [33, 32, 32, 3], "UINT8")  # max_batch_size is 32
    too_many.set_data_from_numpy(np.zeros((33, 32, 32, 3), np.uint8))
    for inp, words in [(as_fp32, "datatype UINT8"), (small, "shape"), (too_many, "split larger batches")]:
        with pytest.raises(InferenceServerException) as e:
            client.infer(model, [inp])
        assert e.value.status() == "422" and words in e.value.message()


@pytest.mark.parametrize(
    "data",
    [["255"] * 3072, [True] * 3072, [0.7] * 3072, [256] * 3072, [-1] * 3072, [[[[0] * 3] * 32] * 32] + [0]],
    ids=["string", "bool", "float", "over-255", "negative", "ragged"],
)
def test_uint8_json_takes_only_integers_0_to_255(server, model, data):
    req = {"inputs": [{"name": "pixels", "datatype": "UINT8", "shape": [1, 32, 32, 3], "data": data}]}
    r = httpx.post(f"{server.url}/v2/models/{model}/infer", json=req, timeout=30)
    assert r.status_code == 422 and r.json()["code"] == "bad_request" and "pixels" in r.json()["error"]


@pytest.mark.parametrize("depth", [500, 100_000])
def test_deeply_nested_json_is_a_422_not_a_crash(server, model, depth):
    nested = "[" * depth + "]" * depth
    head = '{"inputs": [{"name": "pixels", "datatype": "UINT8", "shape": [1, 32, 32, 3], "data": '
    for text in (head + nested + "}]}", nested, "[" * depth):
        r = httpx.post(f"{server.url}/v2/models/{model}/infer", content=text, timeout=30)
        assert r.status_code == 422 and r.headers["content-type"] == "application/json", r.text
    assert httpx.get(server.url + "/readyz", timeout=30).status_code == 200


def test_binary_sizes_that_do_not_add_up_are_refused(server, model):
    header = (
        b'{"inputs": [{"name": "pixels", "datatype": "UINT8", "shape": [1, 32, 32, 3], '
        b'"parameters": {"binary_data_size": 3072}}]}'
    )
    n = str(len(header)).encode()
    superscript_two = "\u00b2".encode("latin-1")  # a digit to str.isdigit, not to int()
    for extra, length in [(3071, n), (3073, n), (3072, b"1000000"), (3072, superscript_two), (3072, b"-5")]:
        r = httpx.post(
            f"{server.url}/v2/models/{model}/infer",
            content=header + b"\0" * extra,
            headers={"Inference-Header-Content-Length": length},
            timeout=30,
        )
        assert r.status_code == 422, r.text


def infer_body(outputs: list[dict], binary: bool) -> tuple[bytes, dict]:
    """A one-image infer request asking for `outputs`, its pixels as binary data or JSON."""
    tensor = {"name": "pixels", "datatype": "UINT8", "shape": [1, 32, 32, 3]}
    if not binary:
        return json.dumps({"inputs": [{**tensor, "data": [0] * 3072}], "outputs": outputs}).encode(), {}
    head = json.dumps({"inputs": [{**tensor, "parameters": {"binary_data_size": 3072}}], "outputs": outputs}).encode()
    return head + bytes(3072), {"Inference-Header-Content-Length": str(len(head))}


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_an_output_asked_for_twice_is_refused_not_answered_twice(server, model, binary):
    """As Triton refuses it: 2,000 copies of logits would otherwise be 2,000 answers from one small request."""
    body, headers = infer_body([{"name": "logits", "parameters": {"binary_data": binary}}] * 2000, binary)
    r = httpx.post(f"{server.url}/v2/models/{model}/infer", content=body, headers=headers, timeout=30)
    assert r.status_code == 422 and r.json()["code"] == "bad_request"
    assert "'logits'" in r.json()["error"] and "more than once" in r.json()["error"]
    assert len(r.content) < 1000


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_an_output_the_model_lacks_is_refused_naming_the_ones_it_has(server, model, binary):
    body, headers = infer_body([{"name": "logits"}, {"name": "feature_map"}], binary)
    r = httpx.post(f"{server.url}/v2/models/{model}/infer", content=body, headers=headers, timeout=30)
    assert r.status_code == 422 and "'feature_map'" in r.json()["error"] and "'probs'" in r.json()["error"]


@pytest.mark.parametrize("parameters", [5, True, "binary_data", [1], False, 0, "", []])
def test_output_parameters_that_are_not_an_object_are_a_422(server, model, parameters):
    """A number or a boolean there was a 500 with a traceback in the log; a string was taken as no parameters."""
    body, headers = infer_body([{"name": "logits", "parameters": parameters}], False)
    r = httpx.post(f"{server.url}/v2/models/{model}/infer", content=body, headers=headers, timeout=30)
    assert r.status_code == 422 and r.json()["error"] == 'the "parameters" of an output must be an object'


def test_a_server_of_one_file_neither_unloads_nor_loads_its_model(server, model):
    """Unloading the one model of `vit-serve FILE` could not be undone (its load answered 404: no repository), and
    the server answered 503 until restarted."""
    for action in ("unload", "load"):
        r = httpx.post(f"{server.url}/v2/repository/models/{model}/{action}", timeout=30)
        assert r.status_code == 400 and "vit-serve DIR" in r.json()["error"], r.text
    assert httpx.get(server.url + "/readyz", timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/v2/models/{model}/ready", timeout=10).status_code == 200


def test_grpc_refuses_an_output_asked_for_twice_or_one_the_model_lacks(server, model):
    grpcclient = pytest.importorskip("tritonclient.grpc")
    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        inp = grpcclient.InferInput("pixels", [1, 32, 32, 3], "UINT8")
        inp.set_data_from_numpy(np.zeros((1, 32, 32, 3), np.uint8))
        for names, says in [(["logits"] * 2000, "more than once"), (["logits", "feature_map"], "'probs'")]:
            with pytest.raises(InferenceServerException) as e:
                c.infer(model, [inp], outputs=[grpcclient.InferRequestedOutput(n) for n in names])
            assert e.value.status() == "StatusCode.INVALID_ARGUMENT" and says in e.value.message()


@pytest.mark.parametrize("path", ["/v2/repository/index", "/v2/repository/models/{model}/load",
                                  "/v2/repository/models/{model}/unload"])  # fmt: skip
def test_repository_routes_refuse_a_body_over_max_bytes(server, model, path):
    url = server.url + path.format(model=model)
    r = httpx.post(url, content=b" " * (MAX_BYTES + 1), headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413 and "body_too_large" in r.text
    assert httpx.post(server.url + "/v2/repository/index", json={"ready": True}, timeout=30).status_code == 200


def test_a_header_length_of_thousands_of_digits_is_a_422_not_a_crash(server, model):
    """Python's int() refuses strings over 4,300 digits: such a header is a client's mistake, as a -5 is."""
    for length in ("9" * 5000, "0" * 5000 + "5"):
        r = httpx.post(
            f"{server.url}/v2/models/{model}/infer",
            content=b"{}",
            headers={"Inference-Header-Content-Length": length},
            timeout=30,
        )
        assert r.status_code == 422 and "Inference-Header-Content-Length" in r.json()["error"], r.text


@pytest.mark.parametrize("coverage", [10**400, -(10**400), 10**4000], ids=["huge", "huge-negative", "4000-digits"])
def test_a_coverage_too_large_for_a_float_is_a_422_not_a_crash(server, model, coverage):
    req = {"inputs": [{"name": "pixels", "datatype": "UINT8", "shape": [1, 32, 32, 3], "data": [0] * 3072}]}
    body = json.dumps({**req, "parameters": {"coverage": coverage}, "outputs": [{"name": "in_set"}]})
    r = httpx.post(f"{server.url}/v2/models/{model}/infer", content=body, timeout=30)
    assert r.status_code == 422 and r.json()["code"] == "bad_request", r.text
    assert "coverage must be a number between 0 and 1" in r.json()["error"]


def test_the_classification_extension_is_refused_alike_over_http_and_grpc(server, client, model):
    """tritonclient's `class_count` asks for Triton's top classes; neither transport may answer raw logits to it."""
    grpcclient = pytest.importorskip("tritonclient.grpc")
    x = np.zeros((1, 32, 32, 3), np.uint8)
    with pytest.raises(InferenceServerException) as over_http:
        inp = tritonclient_http.InferInput("pixels", [1, 32, 32, 3], "UINT8")
        inp.set_data_from_numpy(x)
        client.infer(model, [inp], outputs=[tritonclient_http.InferRequestedOutput("logits", class_count=3)])
    with grpcclient.InferenceServerClient(server.grpc_url) as c, pytest.raises(InferenceServerException) as over_grpc:
        inp = grpcclient.InferInput("pixels", [1, 32, 32, 3], "UINT8")
        inp.set_data_from_numpy(x)
        c.infer(model, [inp], outputs=[grpcclient.InferRequestedOutput("logits", class_count=3)])
    assert (
        over_http.value.status() == "422" and "classification extension is not supported" in over_http.value.message()
    )
    assert over_grpc.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert over_grpc.value.message() == over_http.value.message()


def test_pixels_named_in_shared_memory_are_refused_by_name_alike_over_http_and_grpc(server, client, model):
    """An input read from a shared-memory region got "must hold 3072 numbers" or "needs 3072 values": true, but
    it named neither the region nor what to do instead."""
    grpcclient = pytest.importorskip("tritonclient.grpc")
    with pytest.raises(InferenceServerException) as over_http:
        inp = tritonclient_http.InferInput("pixels", [1, 32, 32, 3], "UINT8")
        inp.set_shared_memory("pixels_region", 3072)
        client.infer(model, [inp])
    with grpcclient.InferenceServerClient(server.grpc_url) as c, pytest.raises(InferenceServerException) as over_grpc:
        inp = grpcclient.InferInput("pixels", [1, 32, 32, 3], "UINT8")
        inp.set_shared_memory("pixels_region", 3072)
        c.infer(model, [inp])
    assert over_http.value.status() == "422" and "shared memory is not supported" in over_http.value.message()
    assert "shared_memory_region" in over_http.value.message()
    assert over_grpc.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert over_grpc.value.message() == over_http.value.message()


def test_a_long_value_the_client_sent_comes_back_cut_in_the_error(server, model):
    """gRPC cut the names it echoes in an error; HTTP echoed 20 kB of name, data type or parameter whole."""
    long = "n" * 20_000
    pixels = {"name": "pixels", "datatype": "UINT8", "shape": [1, 32, 32, 3], "data": [0] * 3072}
    requests = {
        "model name": (f"/v2/models/{long}/infer", {"inputs": [pixels]}),
        "input name": (f"/v2/models/{model}/infer", {"inputs": [{**pixels, "name": long}]}),
        "data type": (f"/v2/models/{model}/infer", {"inputs": [{**pixels, "datatype": long}]}),
        "output name": (f"/v2/models/{model}/infer", {"inputs": [pixels], "outputs": [{"name": long}]}),
        "parameter": (f"/v2/models/{model}/infer", {"inputs": [pixels], "parameters": {"coverage": long}}),
        "v1 model name": (f"/v1/models/{long}/classify", None),
    }
    for what, (path, body) in requests.items():
        r = (
            httpx.post(server.url + path, json=body, timeout=30)
            if body
            else httpx.post(server.url + path, content=b"x", timeout=30)
        )
        assert r.status_code in (404, 422), (what, r.status_code)
        said = json.dumps(r.json(), ensure_ascii=False)
        assert len(r.content) < 1000 and "n" * 100 in said and "n…'" in said, (what, said[:300])


@pytest.mark.timeout(30)  # a pass per quote takes minutes on these
@pytest.mark.parametrize(
    "message",
    ["model " + "\\'" * 100_000, "'" * 200_000, " 'a" * 70_000, '"' + " '" * 100_000, f"no route '/{'x' * 200_000}'"],
    ids=["escaped-quotes", "quotes", "openings", "unclosed", "long-path"],
)
def test_cutting_the_echoes_of_a_long_message_takes_one_pass(message):
    """Cutting with a regular expression took 3.5 s for 32 kB of escaped quotes, on the event loop."""
    from serve.server.errors import ApiError

    assert len(ApiError("bad_request", message).message) <= len(message)
