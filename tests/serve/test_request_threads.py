"""A request's blocking steps do not hold what other requests need: a slow upload does not keep a retired version
from draining, and requests waiting for a model load hold no thread that a KServe v2 request needs."""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import ServerProcess, png_bytes, quadrant_images, read_response, wait_until
from tests.serve.test_repository import add_model, drop_version

V2_BODY = json.dumps({"inputs": [{"name": "pixels", "datatype": "UINT8", "shape": [1, 32, 32, 3], "data": [0] * 3072}]})


@pytest.fixture(scope="module")
def repo(exported, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("threads") / "models"
    add_model(root, exported, "alpha", [1])
    add_model(root, exported, "beta", [1])
    return root


@pytest.fixture(scope="module")
def server(repo):
    args = ["--no-ui", "--preferred-batch-size", "1", "--graceful-timeout-s", "1", "--body-timeout-s", "30"]
    with ServerProcess(repo, *args, "--repository-poll-s", "0.1") as s:
        yield s


def test_a_slow_upload_across_a_rollout_is_answered_by_the_new_version(server, repo, exported):
    """The route held the version before it read the body: the drain gave up after --graceful-timeout-s and the
    upload, still in time for --body-timeout-s, got 503 "the server is shutting down"."""
    body = png_bytes(quadrant_images(1)[0][0])
    head = f"POST /v1/models/alpha/classify HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(head.encode() + body[:100])
        drop_version(repo / "alpha", 2, exported / "alpha" / "1" / "model.onnx")  # the policy serves the latest
        # drained, or (while the upload held it) given up after --graceful-timeout-s
        server.wait_for_output("version 1 of alpha unloaded", 30)
        s.sendall(body[100:])
        head, _, answer = read_response(s).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), answer
    assert json.loads(answer)["version"] == "2"
    assert "version 1 of alpha unloaded (drained)" in server.output


def test_requests_waiting_for_model_loads_leave_threads_for_v2_requests(server):
    """Loads and unloads waited for each other in Starlette's 40 shared threads: 80 clients changing a model took
    them all, and a small KServe v2 request waited for seconds behind them."""
    stop, changed = threading.Event(), []

    def change(client: httpx.Client, i: int) -> None:
        while not stop.is_set():
            started = time.perf_counter()
            client.post(f"/v2/repository/models/beta/{('load', 'unload')[i % 2]}")
            changed.append(time.perf_counter() - started)

    with httpx.Client(base_url=server.url, timeout=60, limits=httpx.Limits(max_connections=100)) as client:
        changers = [threading.Thread(target=change, args=(client, i)) for i in range(80)]
        for t in changers:
            t.start()
        try:
            wait_until(lambda: len(changed) >= 80, 60, "80 changes answered: the rest queue behind them")
            seconds = []
            for _ in range(5):
                started = time.perf_counter()
                r = client.post("/v2/models/alpha/infer", content=V2_BODY, headers={"content-type": "application/json"})
                seconds.append(time.perf_counter() - started)
                assert r.status_code == 200, r.text
        finally:
            stop.set()
            for t in changers:
                t.join(60)
    # in line with the changes it waited about as long as they did (0.6 s against 1.0 s); now it waits for none
    assert statistics.median(seconds) < statistics.median(changed) / 4, (seconds, statistics.median(changed))
