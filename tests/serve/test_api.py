"""The API in process (FastAPI's TestClient runs the real lifespan, batcher and ONNX session)."""

from __future__ import annotations

import base64
import io
import json
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from serve.runtime.classifier import OnnxClassifier
from serve.server.api import v1
from serve.server.app import build_app
from serve.server.settings import ServeSettings
from tests.helpers import bright_square, encoded, huge_png_header, png_bytes, read_metric, wait_until

LOCAL = "http://localhost"  # the Host the server answers by default (TestClient's own, testserver, is refused)


@pytest.fixture(scope="module")
def classifier(tiny_onnx):
    return OnnxClassifier(tiny_onnx)


@pytest.fixture(scope="module")
def client(classifier):
    settings = ServeSettings(
        max_bytes=64 * 1024, max_pixels=1_000_000, preferred_batch_size=16, max_delay_ms=20, examples_dir=""
    )
    with TestClient(build_app(classifier, settings), raise_server_exceptions=False, base_url=LOCAL) as c:
        yield c


def counter(client, name: str, **labels) -> float:
    """A metric from the app's /metrics now (a missing one raises)."""
    return read_metric(client.get("/metrics").text, name, **labels)


def test_health_and_readiness_after_warm_up(client):
    assert client.get("/healthz").json() == {"status": "live"}
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    assert client.get("/v2/health/live").json() == {"live": True}
    assert client.get("/v2/health/ready").json() == {"ready": True}


def test_the_documentation_answers_beside_the_ui(client):
    """FastAPI's documentation routes answer, before the UI's mount at `/` that would answer every path after it."""
    assert "/v1/classify" in client.get("/openapi.json").json()["paths"]
    docs = client.get("/docs")
    assert docs.status_code == 200 and "swagger-ui" in docs.text
    assert client.get("/docs/oauth2-redirect").status_code == 200
    redoc = client.get("/redoc")
    assert redoc.status_code == 200 and "redoc" in redoc.text


def test_readyz_is_503_before_the_lifespan_has_warmed_the_model(classifier):
    app = build_app(classifier, ServeSettings(examples_dir=""), with_ui=False)
    c = TestClient(app, base_url=LOCAL)  # not entered: the lifespan (load, warm-up) has not run
    r = c.get("/readyz")
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "not_ready"


@pytest.mark.parametrize("quadrant", [0, 3])
def test_classify_multipart_upload_matches_the_in_process_model(client, classifier, quadrant):
    data = png_bytes(bright_square(quadrant))
    r = client.post("/v1/classify", files={"file": ("sq.png", data, "image/png")})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == classifier.name and body["version"] == classifier.version
    (label, prob), *_ = classifier.predict(data)[0]
    assert body["predictions"][0]["label"] == label
    assert body["predictions"][0]["score"] == pytest.approx(prob, abs=1e-5)
    scores = [p["score"] for p in body["predictions"]]
    assert scores == sorted(scores, reverse=True) and sum(scores) == pytest.approx(1.0, abs=1e-4)


def test_classify_raw_body_honours_top_k(client):
    r = client.post(
        "/v1/classify?top_k=2", content=encoded(bright_square(1), "JPEG"), headers={"content-type": "image/jpeg"}
    )
    assert r.status_code == 200
    assert len(r.json()["predictions"]) == 2


def test_rgba_and_grayscale_uploads_match_their_rgb_version(client):
    rgb = bright_square(2)
    rgba = np.concatenate([rgb, np.full((32, 32, 1), 255, np.uint8)], axis=-1)
    gray = np.repeat(rgb[..., :1], 3, axis=-1)  # the square image is already gray
    expected = client.post("/v1/classify", content=png_bytes(rgb), headers={"content-type": "image/png"}).json()
    for data in (png_bytes(rgba, "RGBA"), png_bytes(gray[..., 0], "L")):
        r = client.post("/v1/classify", content=data, headers={"content-type": "image/png"})
        assert r.status_code == 200 and r.json()["predictions"] == expected["predictions"]


def test_explain_returns_the_rollout_grid_overlay_and_deletion_score(client, classifier):
    r = client.post(
        "/v1/classify?explain=true&head_fusion=max&discard_ratio=0.5",
        files={"file": ("sq.png", png_bytes(bright_square(0)), "image/png")},
    )
    assert r.status_code == 200, r.text
    ex = r.json()["explanation"]
    grid = np.array(ex["grid"])
    assert grid.shape == classifier.grid_size and grid.max() == pytest.approx(1.0, abs=1e-4)
    overlay = Image.open(io.BytesIO(base64.b64decode(ex["overlay_png"])))
    assert overlay.format == "PNG" and overlay.mode == "RGB"
    d = ex["deletion"]
    assert d["target"] == classifier.labels.index(r.json()["predictions"][0]["label"])
    assert 0 <= d["auc_map"] <= 1 and 0 <= d["auc_random"] <= 1
    assert d["faithful"] == (d["auc_map"] < d["auc_random"])


BAD_INPUTS = {
    "garbage bytes": (b"\x00\x01garbage" * 10, "application/octet-stream", 415, "not_an_image"),
    "zero bytes": (b"", "image/png", 422, "empty"),
    "truncated jpeg": (encoded(bright_square(0), "JPEG")[:200], "image/jpeg", 422, "corrupt"),
    "text named png": ("file", ("notes.png", b"this is text, not a picture", "image/png"), 415, "not_an_image"),
    "huge dimensions": (huge_png_header(), "image/png", 413, "too_large"),
    "oversized body": (b"\x89PNG" + b"0" * (65 * 1024), "image/png", 413, "body_too_large"),
    "wrong content type": (b'{"image": "cat"}', "application/json", 415, "unsupported_media_type"),
    "multipart without file": ("top_k", (None, "3"), 422, "bad_request"),
    "multipart without boundary": (b"--x\r\nnot a form\r\n", "multipart/form-data", 422, "bad_request"),
    "top_k not a number": (png_bytes(bright_square(0)), "image/png?top_k=x", 422, "bad_request"),
    "bad head fusion": (png_bytes(bright_square(0)), "image/png?explain=true&head_fusion=median", 422, "bad_request"),
    "explain not a boolean": (png_bytes(bright_square(0)), "image/png?explain=banana", 422, "bad_request"),
    "NaN pixels": (
        encoded(np.where(np.eye(32) > 0, np.nan, 0.5).astype(np.float32), "TIFF"),
        "image/tiff",
        422,
        "non_finite",
    ),
}


def test_a_bad_form_field_is_refused_even_when_the_query_gives_a_good_one(client):
    form = {"discard_ratio": "1.5", "explain": "true"}
    files = {"file": ("a.png", png_bytes(bright_square(0)), "image/png")}
    r = client.post("/v1/classify?discard_ratio=0&explain=true", files=files, data=form)
    assert r.status_code == 422 and "discard_ratio" in r.json()["error"]["message"]


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_gets_a_json_4xx_and_the_server_keeps_serving(client, case):
    data, ctype, status, code = BAD_INPUTS[case]
    if isinstance(data, str):  # a multipart form field
        r = client.post("/v1/classify", files={data: ctype})
    else:
        ctype, _, query = ctype.partition("?")
        r = client.post("/v1/classify" + (f"?{query}" if query else ""), content=data, headers={"content-type": ctype})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and len(err["message"]) > 10
    ok = client.post("/v1/classify", content=png_bytes(bright_square(0)), headers={"content-type": "image/png"})
    assert ok.status_code == 200 and client.get("/readyz").status_code == 200


def test_v2_metadata_lists_labels_and_input_shape(client, classifier):
    meta = client.get(f"/v2/models/{classifier.name}").json()
    assert meta["parameters"]["labels"] == classifier.labels
    assert meta["inputs"][0]["shape"] == [-1, *classifier.input_size, 3] and meta["inputs"][0]["datatype"] == "UINT8"
    assert client.get("/v2/models/nope").status_code == 404


def test_v2_infer_matches_the_in_process_model(client, classifier):
    x = np.stack([bright_square(1), bright_square(2)])  # (2, 32, 32, 3)
    req = {"inputs": [{"name": "pixels", "datatype": "UINT8", "shape": list(x.shape), "data": x.ravel().tolist()}]}
    r = client.post(f"/v2/models/{classifier.name}/infer", json=req)
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    assert out["name"] == "logits" and out["shape"] == [2, len(classifier.labels)]
    (logits,) = classifier.session.run(["logits"], {"pixels": x})
    np.testing.assert_allclose(np.array(out["data"]).reshape(out["shape"]), logits, atol=1e-5)


@pytest.mark.parametrize(
    "tensor",
    [
        {"name": "pixels", "datatype": "FP32", "shape": [1, 32, 32, 3], "data": [0.0] * 3072},
        {"name": "pixels", "datatype": "UINT8", "shape": [1, 16, 16, 3], "data": [0] * 768},
        {"name": "pixels", "datatype": "UINT8", "shape": [1, 32, 32, 3], "data": [0] * 5},
        {"name": "pixels", "datatype": "UINT8", "shape": [1, 32, 32, 3], "data": [300] * 3072},
        {"name": "pixels", "datatype": "UINT8", "shape": [33, 32, 32, 3], "data": []},  # over max_batch_size (32)
        {"name": "image", "datatype": "UINT8", "shape": [1, 32, 32, 3], "data": [0] * 3072},  # not the graph's name
    ],
)
def test_v2_infer_refuses_tensors_that_do_not_fit(client, classifier, tensor):
    r = client.post(f"/v2/models/{classifier.name}/infer", json={"inputs": [tensor]})
    assert r.status_code == 422 and r.json()["code"] == "bad_request" and r.json()["error"]  # KServe: error is text


def test_concurrent_requests_share_batches_and_metrics_move(client):
    metrics = client.get("/metrics").text  # the test may be the module's first: no sample yet is 0
    before = read_metric(metrics, "vitscope_requests_total", route="/v1", status="200", default=0)
    batches_before = read_metric(metrics, "vitscope_batch_size_count", default=0)
    data = png_bytes(bright_square(3))

    def post(_):
        return client.post("/v1/classify", content=data, headers={"content-type": "image/png"}).status_code

    engine = client.app.state.engine
    gate = threading.Event()
    engine.batcher.call(gate.wait, 10)  # hold the worker so that requests are sure to overlap
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(post, i) for i in range(32)]
        wait_until(lambda: engine.batcher.depth >= 8, 10, "eight requests waiting in the batcher", interval=0.01)
        gate.set()
        statuses = [f.result() for f in futures]
    assert statuses == [200] * 32
    assert counter(client, "vitscope_requests_total", route="/v1", status="200") == before + 32
    batches = counter(client, "vitscope_batch_size_count") - batches_before
    assert 1 <= batches < 32  # at least some requests shared a forward pass
    assert counter(client, "vitscope_request_latency_seconds_count", route="/v1") >= 32


def test_full_queue_answers_503_with_retry_after(classifier):
    settings = ServeSettings(queue_size=1, max_batch_size=1, examples_dir="", retry_after_s=2)
    with TestClient(build_app(classifier, settings, with_ui=False), base_url=LOCAL) as c:
        engine = c.app.state.engine
        gate = threading.Event()
        blocker = engine.batcher.call(gate.wait, 10)  # the worker is busy ...
        wait_until(lambda: engine.batcher.depth == 0, 5, "the worker taking the gate call")
        queued = engine.batcher.submit(bright_square(0))  # ... and the one queue slot is taken
        r = c.post("/v1/classify", content=png_bytes(bright_square(0)), headers={"content-type": "image/png"})
        gate.set()
        blocker.result(5), queued.result(5)
        assert r.status_code == 503 and r.headers["retry-after"] == "2"
        assert r.json()["error"]["code"] == "queue_full"
        ok = c.post("/v1/classify", content=png_bytes(bright_square(0)), headers={"content-type": "image/png"})
        assert ok.status_code == 200


def test_a_grpc_port_already_taken_fails_the_start_and_leaves_no_thread_running(classifier, tmp_path):
    """The models, the payload log and the poller started before gRPC are stopped when gRPC cannot bind."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        before = set(threading.enumerate())
        settings = ServeSettings(grpc_port=port, payload_log=str(tmp_path / "payloads.jsonl"), examples_dir="")
        app = build_app(classifier, settings, with_ui=False)
        refused = f"cannot serve gRPC on 127.0.0.1:{port}: .* pick another --grpc-port"
        with pytest.raises(OSError, match=refused), TestClient(app, base_url=LOCAL):
            pass
    # gRPC's asyncio poller is one per process, ended when the garbage collector frees the server object
    left = lambda: [t.name for t in set(threading.enumerate()) - before if "_poll_wrapper" not in t.name]
    wait_until(lambda: not left(), 10, "the threads the failed start left behind to end")


def test_a_fault_in_the_classify_route_is_a_json_500_logged_with_its_traceback(classifier, monkeypatch, caplog):
    """A bug in /v1/classify answers a JSON 500 with its request ID, is counted and logged once, and the server
    keeps serving."""
    with TestClient(build_app(classifier, ServeSettings(examples_dir=""), with_ui=False), base_url=LOCAL) as c:
        healthy = v1.encode_response
        monkeypatch.setattr(v1, "encode_response", lambda *a: {}["a bug"])
        path = f"/v1/models/{classifier.name}/classify"
        r = c.post(path, content=png_bytes(bright_square(1)), headers={"content-type": "image/png"})
        monkeypatch.setattr(v1, "encode_response", healthy)
        ok = c.post("/v1/classify", content=png_bytes(bright_square(1)), headers={"content-type": "image/png"})
        failed = counter(c, "vitscope_requests_total", route="/v1", status="500")
    assert r.status_code == 500 and r.json()["error"] == {
        "code": "internal",
        "message": "internal error (KeyError); see the server log",
    }
    assert r.headers["x-request-id"] and failed == 1 and ok.status_code == 200
    logged = [rec for rec in caplog.records if rec.getMessage() == f"unexpected error on {path}"]
    assert len(logged) == 1 and logged[0].exc_info[0] is KeyError


def test_a_model_that_does_not_answer_in_time_gives_504_and_the_server_recovers(classifier):
    settings = ServeSettings(request_timeout_s=0.4, examples_dir="")
    with TestClient(build_app(classifier, settings, with_ui=False), base_url=LOCAL) as c:
        gate = threading.Event()
        blocker = c.app.state.engine.batcher.call(gate.wait, 10)  # the model hangs ...
        started = time.monotonic()
        r = c.post("/v1/classify", content=png_bytes(bright_square(1)), headers={"content-type": "image/png"})
        waited = time.monotonic() - started
        gate.set()  # ... and comes back
        blocker.result(5)
        ok = c.post("/v1/classify", content=png_bytes(bright_square(1)), headers={"content-type": "image/png"})
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    assert 0.4 <= waited < 3, waited  # the deadline, kept to within a quarter of it (plus a busy machine)
    assert ok.status_code == 200


@pytest.mark.parametrize("explain", [False, True])
def test_a_large_upload_waits_one_request_timeout_for_its_decode_and_its_model_together(classifier, explain):
    """Its wait for the pixel budget and its wait for the model each had the whole --request-timeout-s: 1.5 s for
    the budget and a model that hangs answered the 504 after 3.5 s, not 2."""
    settings = ServeSettings(request_timeout_s=2.0, examples_dir="")
    big = png_bytes(np.zeros((1000, 1100, 3), np.uint8))  # 1.1 MP: decoded in a thread, under the pixel budget
    with TestClient(build_app(classifier, settings, with_ui=False), base_url=LOCAL) as c:
        budget, held, free = c.app.state.pixel_budget, threading.Event(), threading.Event()

        def hold_the_budget():
            with budget.hold(budget.total):
                held.set()
                free.wait(1.5)

        holder = threading.Thread(target=hold_the_budget)
        holder.start()
        held.wait(5)
        gate = threading.Event()
        blocker = c.app.state.engine.batcher.call(gate.wait, 20)  # the model hangs
        started = time.monotonic()
        r = c.post(f"/v1/classify?explain={explain}", content=big, headers={"content-type": "image/png"})
        waited = time.monotonic() - started
        gate.set()
        blocker.result(5)
        holder.join(5)
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout", r.text
    assert 2.0 <= waited < 3.2, waited  # the one deadline, kept to within a quarter of it (plus a busy machine)


def test_with_onnxruntime_on_every_core_uploads_are_decoded_on_the_models_thread(tiny_onnx, classifier):
    two_threads = OnnxClassifier(tiny_onnx, threads=2)  # no free core: decoding moves off the event loop
    image = bright_square(2)
    with TestClient(build_app(two_threads, ServeSettings(examples_dir=""), with_ui=False), base_url=LOCAL) as c:
        ok = c.post("/v1/classify?top_k=1", content=png_bytes(image), headers={"content-type": "image/png"})
        bad = c.post("/v1/classify", content=png_bytes(image)[:60], headers={"content-type": "image/png"})
        again = c.post("/v1/classify", content=png_bytes(image), headers={"content-type": "image/png"})
    label, score = classifier.predict(image, top_k=1)[0][0]
    assert ok.status_code == 200 and ok.json()["predictions"][0]["label"] == label
    assert ok.json()["predictions"][0]["score"] == pytest.approx(score, abs=1e-5)
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "corrupt"  # header fine, data cut short
    assert again.status_code == 200


def test_the_server_measures_its_batch_size_at_warm_up(classifier):
    settings = ServeSettings(max_batch_size=8, examples_dir="")
    with TestClient(build_app(classifier, settings, with_ui=False), base_url=LOCAL) as c:
        chosen = c.get("/readyz").json()["batch_size"]
        assert chosen in (1, 2, 4, 8) and c.app.state.engine.batcher.max_batch_size == chosen


def test_settings_refuse_nonsense_with_the_field_name():
    with pytest.raises(ValueError, match="max_batch_size"):
        ServeSettings(max_batch_size=0)
    with pytest.raises(ValueError, match="preferred_batch_size"):
        ServeSettings(max_batch_size=8, preferred_batch_size=16)
    with pytest.raises(ValueError, match="max_delay_ms"):
        ServeSettings(max_delay_ms=-1)


SPANS_SCRIPT = """
import json
import sys
from fastapi.testclient import TestClient
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from serve.server.app import build_app
from serve.runtime.classifier import OnnxClassifier
from serve.server.settings import ServeSettings
from tests.helpers import bright_square, encoded, huge_png_header, png_bytes, read_metric, wait_until

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
settings = ServeSettings(opentelemetry=sys.argv[2] == "on", preferred_batch_size=1)
with TestClient(build_app(OnnxClassifier(sys.argv[1]), settings, with_ui=False), base_url="http://localhost") as client:
    assert client.get("/healthz").status_code == 200
    png = png_bytes(bright_square(1))
    assert client.post("/v1/classify", content=png, headers={"content-type": "image/png"}).status_code == 200
print(json.dumps([span.name for span in exporter.get_finished_spans()]))
"""


@pytest.mark.parametrize("flag", ["on", "off"])
def test_opentelemetry_spans_only_when_asked_for(tiny_onnx, flag):
    import inspect

    from fastapi import FastAPI

    if "telemetry" not in inspect.signature(FastAPI).parameters:
        pytest.skip("this FastAPI has no native OpenTelemetry")
    pytest.importorskip("opentelemetry.sdk")  # the in-memory exporter: in the dev extra
    # in a process of its own: the global tracer provider can be set once per process
    out = subprocess.run(
        [sys.executable, "-c", SPANS_SCRIPT, str(tiny_onnx), flag], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    spans = json.loads(out.stdout.splitlines()[-1])
    if flag == "off":
        assert spans == []
    else:  # each request's span is named by its route
        assert "GET /healthz" in spans and "POST /v1/classify" in spans, spans


def test_boolean_settings_are_on_off_flags():
    from serve.server.cli import build_parser, settings_from

    def parse(argv):
        return settings_from(build_parser().parse_args(argv))

    assert parse(["m.onnx"]).opentelemetry is False
    assert parse(["m.onnx", "--opentelemetry"]).opentelemetry is True
    assert parse(["m.onnx", "--opentelemetry", "--no-opentelemetry"]).opentelemetry is False


def test_a_queue_smaller_than_a_request_is_refused_at_start_up():
    """A request's images are queued all at once or refused: a v2 request of max_batch_size images on a smaller
    queue would be answered 503 with Retry-After for ever, however idle the server."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"queue_size \(8\) must be at least max_batch_size \(32\)"):
        ServeSettings(queue_size=8)


def test_settings_come_from_the_environment_and_the_command_line_wins(monkeypatch):
    from serve.server.cli import build_parser, settings_from

    monkeypatch.setenv("VITSCOPE_MAX_BATCH_SIZE", "4")
    monkeypatch.setenv("VITSCOPE_QUEUE_SIZE", "9")
    settings = settings_from(build_parser().parse_args(["m.onnx", "--queue-size", "5"]))
    assert settings.max_batch_size == 4 and settings.queue_size == 5
