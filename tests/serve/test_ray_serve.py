"""`vit-serve --ray` on a local Ray cluster started here (a head and a worker node, one CPU each).

The same API answers through Ray Serve's proxy; requests spread over the model replicas (each reply
names its replica in `X-Vitscope-Replica`); killing a model replica under a steady stream of requests
loses none of them, and Ray starts a replacement.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import onnxruntime as ort
import pytest

from tests.helpers import CLASS_NAMES, LocalRayCluster, ServerProcess, png_bytes, quadrant_images, wait_until

ray = pytest.importorskip("ray")
tritonclient_http = pytest.importorskip("tritonclient.http")

pytestmark = pytest.mark.slow
HEADER = "x-vitscope-replica"


@pytest.fixture(scope="module")
def cluster():
    with LocalRayCluster(nodes=2, cpus_per_node=1) as c:
        yield c


@pytest.fixture(scope="module")
def server(cluster, tiny_onnx):
    args = ["--ray", "--replicas", "2", "--ray-address", cluster.address, "--preferred-batch-size", "4"]
    proc = ServerProcess(tiny_onnx, *args)
    try:
        yield proc.wait_ready(timeout=300)
    finally:
        code = proc.stop(timeout=60)
        assert code == 0, f"vit-serve --ray did not stop cleanly ({code}):\n{proc.output[-3000:]}"


@pytest.fixture(scope="module")
def driver(cluster):
    """This process joined to the cluster, to find and kill replicas."""
    ray.init(address=cluster.address, logging_level="WARNING")
    yield ray
    ray.shutdown()


def classify(client: httpx.Client, url: str, data: bytes) -> httpx.Response:
    return client.post(url + "/v1/classify", content=data, headers={"content-type": "image/png"})


def test_requests_spread_over_the_replicas(server):
    data = png_bytes(quadrant_images(1)[0][0])
    served: Counter = Counter()
    deadline = time.monotonic() + 60  # Ray's router learns of the second replica within seconds
    with httpx.Client(timeout=60) as client, ThreadPoolExecutor(8) as pool:
        while len(served) < 2 and time.monotonic() < deadline:
            replies = list(pool.map(lambda _: classify(client, server.url, data), range(80)))
            assert all(r.status_code == 200 for r in replies)
            served.update(r.headers[HEADER] for r in replies)
    assert len(served) == 2, served  # both model replicas answer, under concurrency
    assert all(name.startswith("SERVE_REPLICA::vitscope#ModelReplica#") for name in served)


def test_v1_v2_and_metrics_answer_through_ray(server, tiny_onnx):
    x, _ = quadrant_images(4, seed=3)
    model = httpx.get(server.url + "/readyz").json()["model"]
    client = tritonclient_http.InferenceServerClient(server.url.removeprefix("http://"), network_timeout=60)
    try:
        assert client.is_server_ready() and client.is_model_ready(model)
        inp = tritonclient_http.InferInput("pixels", list(x.shape), "UINT8")
        inp.set_data_from_numpy(x)
        logits = client.infer(model, [inp]).as_numpy("logits")
    finally:
        client.close()
    session = ort.InferenceSession(str(tiny_onnx), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(logits, session.run(["logits"], {"pixels": x})[0], rtol=1e-5, atol=1e-5)
    r = httpx.post(server.url + f"/v1/classify?top_k={len(CLASS_NAMES)}", files={"file": ("x.png", png_bytes(x[0]))})
    assert r.status_code == 200 and r.json()["predictions"][0]["label"] == CLASS_NAMES[0]
    explained = httpx.post(
        server.url + "/v1/classify?explain=true", files={"file": ("x.png", png_bytes(x[0]))}, timeout=60
    )
    assert explained.status_code == 200 and len(explained.json()["explanation"]["grid"]) == 4  # 32 px / patch 8
    bad = {"inputs": [{"name": "pixels", "datatype": "UINT8", "shape": [1, 32, 32, 3], "data": [True] * 3072}]}
    assert httpx.post(f"{server.url}/v2/models/{model}/infer", json=bad).status_code == 422
    assert "vitscope_requests_total" in httpx.get(server.url + "/metrics").text


def test_killing_a_model_replica_loses_no_request(server, driver):
    data = png_bytes(quadrant_images(1)[0][0])
    statuses, names, stop = Counter(), Counter(), threading.Event()

    def stream():
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                r = classify(client, server.url, data)
                statuses[r.status_code] += 1
                names[r.headers.get(HEADER)] += 1

    workers = [threading.Thread(target=stream) for _ in range(4)]
    for w in workers:
        w.start()
    try:
        wait_until(lambda: statuses.total() >= 20, 60, "20 answers before the kill")
        before = set(names)
        victim = max(before, key=names.get)
        driver.kill(driver.get_actor(victim, namespace="serve"), no_restart=True)
        wait_until(lambda: set(names) - before, 120, "a replacement replica answering", interval=0.5)
        answered = statuses.total()
        wait_until(lambda: statuses.total() >= answered + 20, 60, "20 more answers after the replacement")
    finally:
        stop.set()
        for w in workers:
            w.join(60)
    assert set(statuses) == {200}, statuses  # no retries in the client: none was needed
    assert set(names) - before, f"no replacement replica answered within 120 s: {names}"
