"""A real `vit-serve` process on 127.0.0.1: health, classify, v2, bad inputs, load, SIGTERM draining."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.helpers import ServerProcess, free_port, noise_png, read_response, server_has_read, wait_until

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(tiny_onnx):
    with ServerProcess(tiny_onnx, "--max-delay-ms", "10", "--max-bytes", "1048576", "--no-ui") as s:
        yield s


@pytest.mark.slow
def test_the_url_is_printed_once_ready(server):
    # without the UI, / is a 404: the line says where the API is instead
    # /readyz answers after the line is written, but this process's reader thread may not have read it yet
    server.wait_for_output(f"vitscope is ready: {server.url}/ (no UI: POST /v1/classify, the API's pages at /docs)")
    assert httpx.get(server.url + "/docs", timeout=30).status_code == 200


@pytest.mark.slow
def test_classify_and_v2_infer_over_http(server, tiny_onnx):
    r = httpx.post(server.url + "/v1/classify?top_k=3", files={"file": ("a.png", noise_png(), "image/png")}, timeout=30)
    assert r.status_code == 200 and len(r.json()["predictions"]) == 3
    name = r.json()["model"]
    meta = httpx.get(f"{server.url}/v2/models/{name}", timeout=30).json()
    x = np.zeros((1, *meta["inputs"][0]["shape"][1:]), np.uint8)
    req = {
        "inputs": [{"name": "pixels", "datatype": "UINT8", "shape": list(x.shape), "data": x.ravel().tolist()}],
        "outputs": [{"name": "probs"}],
    }
    out = httpx.post(f"{server.url}/v2/models/{name}/infer", json=req, timeout=30).json()["outputs"][0]
    assert out["shape"] == [1, len(meta["parameters"]["labels"])]
    assert sum(out["data"]) == pytest.approx(1.0, abs=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize(
    "body, ctype, status",
    [
        (b"\xff\xd8\xff\xe0garbage", "image/jpeg", 422),
        (b"", "application/octet-stream", 422),
        (b"plain text", "text/plain", 415),
        (b"\x00" * (1024 * 1024 + 1), "image/png", 413),
    ],
)
def test_bad_inputs_over_http_leave_the_server_healthy(server, body, ctype, status):
    r = httpx.post(server.url + "/v1/classify", content=body, headers={"content-type": ctype}, timeout=30)
    assert r.status_code == status and "error" in r.json()
    assert httpx.get(server.url + "/readyz", timeout=30).status_code == 200
    assert httpx.post(server.url + "/v1/classify", content=noise_png(), timeout=30).status_code == 200


@pytest.mark.slow
def test_bounded_load_has_no_errors_and_batches_requests(server):
    duration, clients = 10.0, 16
    images_before = server.metric("vitscope_batch_size_sum")
    batches_before = server.metric("vitscope_batch_size_count")
    data = [noise_png(i) for i in range(4)]

    def client(i: int) -> tuple[int, int]:
        ok = bad = 0
        end = time.monotonic() + duration
        with httpx.Client(base_url=server.url, timeout=30) as c:
            while time.monotonic() < end:
                r = c.post("/v1/classify", content=data[i % 4], headers={"content-type": "image/png"})
                ok, bad = (ok + 1, bad) if r.status_code == 200 else (ok, bad + 1)
        return ok, bad

    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(client, range(clients)))
    ok, bad = sum(r[0] for r in results), sum(r[1] for r in results)
    assert bad == 0 and ok > clients
    images = server.metric("vitscope_batch_size_sum") - images_before
    batches = server.metric("vitscope_batch_size_count") - batches_before
    assert images == ok and batches < images  # some forward passes served more than one request
    assert server.metric("vitscope_requests_total", route="/v1", status="200") >= ok
    assert server.metric("vitscope_queue_depth") == 0  # every request answered: nothing left waiting


@pytest.mark.slow
def test_sigterm_drains_requests_in_flight_then_exits(tiny_onnx):
    """Six uploads are in the server's hands, all but their last byte, when SIGTERM arrives: each is still read
    to its end, classified (batched together, with a long batching delay) and answered 200, then it exits 0.
    From the signal on, the probe port's /readyz says 503, so that no new request is sent here (it said ready
    for the whole drain)."""
    probes = free_port()
    args = ("--max-delay-ms", "500", "--max-batch-size", "64", "--no-ui", "--probe-port", str(probes))
    s = ServerProcess(tiny_onnx, *args)
    ready = lambda: httpx.get(f"http://127.0.0.1:{probes}/readyz", timeout=5).status_code
    try:
        s.wait_ready()
        # the probe port learns readiness from the server's next beat (four a second), a moment after the API does
        wait_until(lambda: ready() == 200, 10, "the probe's /readyz saying 200 once the server is ready")
        uploads = []
        for i in range(6):
            body = noise_png(i)
            head = "POST /v1/classify HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: image/png\r\n"
            head += f"Content-Length: {len(body)}\r\n\r\n"
            conn = socket.create_connection(("127.0.0.1", s.port))
            conn.sendall(head.encode() + body[:-1])
            uploads.append((conn, body[-1:]))
        try:
            wait_until(lambda: server_has_read(s.port, 6), 10, "the server reading the six uploads")
            assert ready() == 200  # six uploads in the server's hands change nothing
            s.proc.send_signal(signal.SIGTERM)
            wait_until(lambda: ready() == 503, 5, "the probe's /readyz saying 503 while the server drains")
            for conn, last in uploads:
                conn.sendall(last)
            heads = [read_response(conn).split(b"\r\n", 1)[0] for conn, _ in uploads]
        finally:
            for conn, _ in uploads:
                conn.close()
        assert heads == [b"HTTP/1.1 200 OK"] * 6
        assert s.proc.wait(30) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(s.url + "/healthz", timeout=2)
    finally:
        s.stop()


@pytest.mark.slow
def test_a_drain_that_runs_out_of_time_exits_1(tiny_onnx):
    s = ServerProcess(tiny_onnx, "--no-ui", "--graceful-timeout-s", "0.5")
    try:
        s.wait_ready()
        with socket.create_connection(("127.0.0.1", s.port)) as upload:  # half an upload, still in flight
            upload.sendall(b"POST /v1/classify HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\nxx")
            wait_until(lambda: server_has_read(s.port), 10, "the server reading the half upload")
            s.proc.send_signal(signal.SIGTERM)
            assert s.proc.wait(30) == 1
        s.wait_for_output("the drain did not finish")
    finally:
        s.stop()


@pytest.mark.slow
def test_a_missing_model_file_fails_fast_with_a_clear_message(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "serve.server", str(tmp_path / "nope.onnx")], cwd=ROOT, capture_output=True, text=True
    )
    assert r.returncode == 2 and "nope.onnx" in r.stderr and "not found" in r.stderr


def test_more_threads_than_cores_is_refused_before_the_model_loads(tiny_onnx):
    """1,000 intra-op threads started 1,008 threads and made one request take 3.4 s on two cores."""
    cores = len(os.sched_getaffinity(0))
    r = subprocess.run(
        [sys.executable, "-m", "serve.server", str(tiny_onnx), "--threads", str(cores + 1), "--no-ui", "--port", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-500:]
    assert f"threads: must be 0 (by model size) to {cores} (this machine's cores), got {cores + 1}" in r.stderr


def test_a_ui_disk_budget_smaller_than_one_request_is_refused_at_start(tiny_onnx, capsys):
    """--ui-cache-bytes under --max-bytes started, then refused every large upload with 507 and "retry once older
    files go", which no wait could ever satisfy."""
    from serve.server.cli import main
    from serve.server.settings import ServeSettings

    assert main([str(tiny_onnx), "--ui-cache-bytes", "3000000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vit-serve: --ui-cache-bytes (3,000,000) must hold the largest request the UI takes")
    assert "lower --max-bytes, or serve without the UI (--no-ui)" in err and len(err.splitlines()) == 1
    ServeSettings(max_bytes=2 << 30)  # the budget binds the UI alone: an API-only server takes larger bodies
