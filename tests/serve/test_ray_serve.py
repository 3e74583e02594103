"""`vit-serve --ray` on a local Ray cluster started here (a head and a worker node, one CPU each).

A model file: the same API answers through Ray Serve's proxy; requests spread over the model replicas (each
reply names its replica in `X-Vitscope-Replica`); killing a model replica under a steady stream of requests
loses none of them, and Ray starts a replacement.

A model repository (`vit-serve DIR --ray`): each model's application answers its routes and versions with
the results of its own file, and a new version dropped into the folder rolls out, through Ray Serve's
rolling updates, under a client loop that sees no failed request and then only the new version's answers.
Bad models (labels.txt, config.pbtxt) beside good ones are refused alone, and a version file rewritten in
place rolls out as a new version does.
"""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import pytest

from serve.runtime.classifier import OnnxClassifier
from tests.helpers import (
    CLASS_NAMES,
    ClientLoop,
    LocalRayCluster,
    ServerProcess,
    png_bytes,
    quadrant_images,
    read_metric,
    wait_until,
)

ray = pytest.importorskip("ray")
tritonclient_http = pytest.importorskip("tritonclient.http")

pytestmark = pytest.mark.slow
HEADER = "x-vitscope-replica"


@pytest.fixture(scope="module")
def cluster():
    with LocalRayCluster(nodes=2, cpus_per_node=1) as c:
        yield c


class OneServer:
    """The module's `vit-serve --ray`, one at a time: a cluster has one Ray Serve proxy, and one application at
    `/`. A test that needs the other kind (a file, a repository) stops the running one first."""

    def __init__(self):
        self.kind: str | None = None
        self.proc: ServerProcess | None = None

    def get(self, kind: str, start: Callable[[], ServerProcess]) -> ServerProcess:
        if kind != self.kind:
            self.stop()
            proc = start()
            try:
                self.proc, self.kind = proc.wait_ready(timeout=300), kind
            except BaseException:
                proc.stop(timeout=60)
                raise
        return self.proc

    def stop(self) -> None:
        if self.proc is None:
            return
        proc, self.proc, self.kind = self.proc, None, None
        code = proc.stop(timeout=60)
        assert code == 0, f"vit-serve --ray did not stop cleanly ({code}):\n{proc.output[-3000:]}"


@pytest.fixture(scope="module")
def servers(cluster):
    one = OneServer()
    try:
        yield one
    finally:
        one.stop()


@pytest.fixture
def server(servers, cluster, tiny_onnx):
    args = ["--ray", "--replicas", "2", "--ray-address", cluster.address, "--preferred-batch-size", "4"]
    args += ["--max-batch-size", "8", "--queue-size", "8"]  # a queue a test can fill
    return servers.get("file", lambda: ServerProcess(tiny_onnx, *args))


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
    model = httpx.get(server.url + "/readyz", timeout=30).json()["model"]
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
    r = httpx.post(
        server.url + f"/v1/classify?top_k={len(CLASS_NAMES)}", files={"file": ("x.png", png_bytes(x[0]))}, timeout=30
    )
    assert r.status_code == 200 and r.json()["predictions"][0]["label"] == CLASS_NAMES[0]
    explained = httpx.post(
        server.url + "/v1/classify?explain=true", files={"file": ("x.png", png_bytes(x[0]))}, timeout=60
    )
    assert explained.status_code == 200 and len(explained.json()["explanation"]["grid"]) == 4  # 32 px / patch 8
    two = {"inputs": [{"name": "pixels", "datatype": "UINT8", "shape": [2, 32, 32, 3], "data": x[:2].ravel().tolist()}]}
    r = httpx.post(f"{server.url}/v2/models/{model}/infer", json=two, timeout=60)
    # the model replicas' answer: a request of several images ran on the ingress's own copy of the model
    assert r.status_code == 200 and r.headers[HEADER].startswith("SERVE_REPLICA::vitscope#ModelReplica#"), r.headers
    bad = {"inputs": [{"name": "pixels", "datatype": "UINT8", "shape": [1, 32, 32, 3], "data": [True] * 3072}]}
    assert httpx.post(f"{server.url}/v2/models/{model}/infer", json=bad, timeout=30).status_code == 422
    assert "vitscope_requests_total" in httpx.get(server.url + "/metrics", timeout=30).text


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


def test_past_its_queue_the_server_sheds_load_with_503_and_retry_after(server):
    """Past --queue-size requests in the ingress and as many waiting at Ray Serve's proxy, a request gets 503 with
    Retry-After at once, as from plain vit-serve. The proxy queued every request, unbounded: 600 explain requests
    at --queue-size 32 got no 503, and the slowest was answered after 80 s."""
    data = png_bytes(quadrant_images(1)[0][0])

    def explain(client: httpx.Client) -> tuple[int, str | None]:
        r = client.post(server.url + "/v1/classify?explain=true", content=data, headers={"content-type": "image/png"})
        return r.status_code, r.headers.get("retry-after")

    limits = httpx.Limits(max_connections=120)
    with httpx.Client(timeout=120, limits=limits) as client, ThreadPoolExecutor(120) as pool:
        answers = list(pool.map(lambda _: explain(client), range(120)))
    codes = Counter(code for code, _ in answers)
    assert codes[503] > 0 and set(codes) <= {200, 503}, codes
    assert {retry for code, retry in answers if code == 503} == {"1"}  # --retry-after-s
    assert classify(httpx.Client(timeout=60), server.url, data).status_code == 200  # and it serves on


def test_a_client_that_hangs_up_mid_body_is_a_499_not_a_server_error(server):
    """Ray Serve's proxy ends the body of a client that hung up with an exception, not with http.disconnect:
    a quarter of such requests were counted as 500 and logged with a traceback."""
    head = b"POST /v1/classify HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: image/png\r\nContent-Length: 200000\r\n\r\n"
    host, port = server.url.removeprefix("http://").rsplit(":", 1)

    def count(status: str) -> float:
        text = httpx.get(server.url + "/metrics", timeout=30).text
        return read_metric(text, "vitscope_requests_total", route="/v1", status=status, default=0)

    before = {status: count(status) for status in ("499", "500")}
    for _ in range(40):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(head + b"x" * 100_000)
            time.sleep(0.1)  # the proxy has passed the request on (one cancelled before it did is never counted)
    wait_until(lambda: count("499") >= before["499"] + 20, 60, "most of the 40 counted as 499")
    time.sleep(1)  # any late 500 would be counted by now
    assert count("500") == before["500"]


def test_an_idle_keep_alive_connection_is_closed_after_keep_alive_s(server):
    """As plain vit-serve closes one after --keep-alive-s (5 s): Ray Serve's proxy kept each for 90 s."""
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        s.settimeout(30)
        answer, chunk = b"", b"-"
        while chunk and not answer.endswith(b'{"status":"live"}'):
            chunk = s.recv(65536)
            answer += chunk
        started = time.monotonic()
        assert s.recv(65536) == b""  # closed by the server
    assert answer.startswith(b"HTTP/1.1 200") and time.monotonic() - started < 15


def reweighted(model: Path, out: Path) -> Path:
    """A copy of the file with its classifier head negated: the same metadata, other answers (another version)."""
    onnx = pytest.importorskip("onnx")
    numpy_helper = onnx.numpy_helper
    graph = onnx.load(model)
    for weights in graph.graph.initializer:
        if weights.name.startswith("net.head."):
            weights.CopyFrom(numpy_helper.from_array(-numpy_helper.to_array(weights), weights.name))
    onnx.save(graph, out)
    return out


def put_version(folder: Path, version: int, model: Path) -> None:
    """A version as a deployment writes one: copied beside the model's folder, then renamed into it."""
    incoming = folder / f".{version}.incoming"
    incoming.mkdir(parents=True)
    shutil.copy(model, incoming / "model.onnx")
    incoming.rename(folder / str(version))


def add_bad_models(root: Path, tiny_onnx: Path) -> None:
    """`badlabels` (a labels.txt that is not UTF-8) and `badconfig` (a config.pbtxt Triton refuses)."""
    for model in ("badlabels", "badconfig"):
        put_version(root / model, 1, tiny_onnx)
    (root / "badlabels" / "labels.txt").write_bytes(b"top_left\n\xff\xfe\n")
    (root / "badconfig" / "config.pbtxt").write_text("version_policy: { newest { } }\n")


@pytest.fixture(scope="module")
def repository(tmp_path_factory, tiny_onnx) -> Path:
    """`alpha` with versions 1 and 2 (other answers), both served (`all`); `beta` with version 1; two bad models
    beside them (`add_bad_models`), which the server refuses alone."""
    root = tmp_path_factory.mktemp("ray_repository") / "models"
    other = reweighted(tiny_onnx, root.parent / "other.onnx")
    put_version(root / "alpha", 1, tiny_onnx)
    put_version(root / "alpha", 2, other)
    (root / "alpha" / "config.pbtxt").write_text('name: "alpha"\nversion_policy: { all { } }\n')
    put_version(root / "beta", 1, tiny_onnx)
    add_bad_models(root, tiny_onnx)
    return root


@pytest.fixture
def repository_server(servers, cluster, repository):
    # 0.5 CPU per model replica: both models and the extra replica of a rolling update fit the 2 CPUs
    args = ["--ray", "--ray-address", cluster.address, "--replica-cpus", "0.5", "--preferred-batch-size", "4"]
    args += ["--repository-poll-s", "0.5"]
    # a relative path, as the guide gives it: the replicas do not run in the launcher's working directory
    return servers.get("repository", lambda: ServerProcess(repository.name, *args, cwd=repository.parent))


def expected(repository: Path, model: str, version: str, image: np.ndarray) -> list[dict]:
    """`/v1`'s predictions for `image` from the version's own file, in process."""
    classifier = OnnxClassifier(repository / model / version / "model.onnx", threads=1)
    (top,) = classifier.predict(png_bytes(image), len(CLASS_NAMES))
    return [{"label": label, "score": score} for label, score in top]


def test_each_model_and_version_of_a_repository_answers_with_its_own_file(repository_server, repository):
    url, image = repository_server.url, quadrant_images(1, seed=3)[0][0]
    models = httpx.get(url + "/v2/models", timeout=30).json()["models"]
    assert [m["name"] for m in models] == ["alpha", "beta"] and models[0]["versions"] == ["1", "2"]
    # the bad models are refused alone, each with its reason, and the server is ready with the good ones
    repository_server.wait_for_output("badlabels/labels.txt")
    repository_server.wait_for_output("badconfig/config.pbtxt")
    for path, model, version in [
        ("/v1/classify", "alpha", "2"),  # the default model (the first by name), its newest version
        ("/v1/models/alpha/classify", "alpha", "2"),
        ("/v1/models/alpha/versions/1/classify", "alpha", "1"),
        ("/v1/models/beta/classify", "beta", None),  # 1, or 2 once the rollout test has run
    ]:
        r = httpx.post(f"{url}{path}?top_k={len(CLASS_NAMES)}", files={"file": ("x.png", png_bytes(image))}, timeout=30)
        body = r.json()
        assert r.status_code == 200 and body["model"] == model and body["version"] == (version or body["version"])
        assert r.headers[HEADER].startswith(f"SERVE_REPLICA::vitscope-model-{model}#ModelVersions#")
        want = expected(repository, model, body["version"], image)
        assert [p["label"] for p in body["predictions"]] == [p["label"] for p in want]
        np.testing.assert_allclose([p["score"] for p in body["predictions"]], [p["score"] for p in want], atol=1e-6)
    x, _ = quadrant_images(2, seed=5)
    infer = {"inputs": [{"name": "pixels", "datatype": "UINT8", "shape": list(x.shape), "data": x.ravel().tolist()}]}
    for version in ("1", "2"):
        r = httpx.post(f"{url}/v2/models/alpha/versions/{version}/infer", json=infer, timeout=60).json()
        assert (r["model_name"], r["model_version"]) == ("alpha", version)
        logits = np.array(r["outputs"][0]["data"], np.float32).reshape(r["outputs"][0]["shape"])
        own = OnnxClassifier(repository / "alpha" / version / "model.onnx", threads=1).logits(x)
        np.testing.assert_allclose(logits, own, rtol=1e-5, atol=1e-5)
    assert httpx.get(url + "/v2/models/alpha/versions/1", timeout=30).json()["name"] == "alpha"
    assert httpx.get(url + "/v2/models/beta/ready", timeout=30).status_code == 200
    assert httpx.get(url + "/v2/models/beta/versions/9/ready", timeout=30).status_code == 404
    assert (
        httpx.post(
            url + "/v1/models/gamma/classify", files={"file": ("x.png", png_bytes(image))}, timeout=30
        ).status_code
        == 404
    )
    assert (
        httpx.get(url + "/readyz", timeout=30).status_code == 200
        and httpx.get(url + "/healthz", timeout=30).status_code == 200
    )
    assert httpx.get(url + "/v2/health/ready", timeout=30).json() == {"ready": True}


class ClassifyLoop(ClientLoop):
    """`clients` threads posting one image to `path` until stopped; each answer's status, version, top label
    and replica is kept (an exception as its class name), with no retries."""

    def __init__(self, url: str, path: str, image: np.ndarray, clients: int = 4):
        super().__init__(clients)
        self.url, self.path, self.data = url, path, png_bytes(image)

    def run(self, i: int) -> None:
        with httpx.Client(timeout=60) as client:
            while not self.stopping.is_set():
                try:
                    r = client.post(self.url + self.path, files={"file": ("x.png", self.data)})
                    body = r.json()
                    top = body["predictions"][0]["label"] if r.status_code == 200 else None
                    self.answers.append((r.status_code, body.get("version"), top, r.headers.get(HEADER)))
                except httpx.HTTPError as e:
                    self.answers.append((type(e).__name__, None, None, None))

    def answered(self, version: str, since: int = 0) -> int:
        return sum(1 for a in self.answers[since:] if a[1] == version)


def test_the_index_lists_the_refused_models_with_their_reasons_and_a_load_tells_them(repository_server):
    """As `vit-serve DIR` lists and tells them: under --ray the index left them out, and a load said 404 "the
    repository has no model" of a model right there in the folder."""
    url = repository_server.url

    def refused() -> dict[str, str]:
        index = httpx.post(url + "/v2/repository/index", timeout=30).json()
        return {row["name"]: row["reason"] for row in index if row["state"] == "UNAVAILABLE"}

    wait_until(lambda: {"badlabels", "badconfig"} <= set(refused()), 30, "the refused models in the index")
    reasons = refused()
    assert "labels.txt" in reasons["badlabels"] and "newest" in reasons["badconfig"], reasons
    loaded = httpx.post(url + "/v2/repository/models/badlabels/load", timeout=60)
    assert loaded.status_code == 400 and "labels.txt" in loaded.json()["error"], loaded.text
    assert httpx.post(url + "/v2/repository/models/nowhere/load", timeout=60).status_code == 404


def test_a_new_version_rolls_out_through_ray_serve_with_no_failed_request(repository_server, repository):
    url, image = repository_server.url, quadrant_images(1, seed=3)[0][0]
    old = expected(repository, "beta", "1", image)[0]["label"]
    new = expected(repository, "alpha", "2", image)[0]["label"]  # the file that becomes beta's version 2
    assert old != new  # the new version's answer tells it apart
    with ClassifyLoop(url, "/v1/models/beta/classify", image) as loop:
        wait_until(lambda: loop.answered("1") >= 20, 60, "20 answers from version 1")
        put_version(repository / "beta", 2, repository / "alpha" / "2" / "model.onnx")
        rolled = "beta: every replica holds versions ['2']"  # the last of its two rolling updates
        wait_until(lambda: rolled in repository_server.output, 300, "the rollout of version 2", interval=0.5)
        settled = len(loop.answers)
        wait_until(lambda: loop.answered("2", settled) >= 20, 60, "20 more answers after the rollout")
    failed = [a for a in loop.answers if a[0] != 200]
    assert not failed, f"{len(failed)} failed requests during the rollout, e.g. {failed[:3]}"
    assert {a[1] for a in loop.answers[settled:]} == {"2"}
    assert {(a[1], a[2]) for a in loop.answers} == {("1", old), ("2", new)}  # each version answers as its file
    before = {a[3] for a in loop.answers if a[1] == "1"}
    after = {a[3] for a in loop.answers[settled:]}
    assert not before & after  # new replicas answer: the rollout replaced them
    assert httpx.get(url + "/v2/models", timeout=30).json()["models"][1] == {
        "name": "beta",
        "versions": ["2"],
        "platform": "onnxruntime_onnx",
    }
    # the version served deleted: version 1 serves again (its new replicas could not load version 2, and the
    # update failed at every poll, the ingress sending requests to the version whose file was gone)
    switched = "beta: the ingress sends requests to versions ['1']"
    before = repository_server.output.count(switched)  # as at start
    shutil.rmtree(repository / "beta" / "2")
    wait_until(lambda: repository_server.output.count(switched) > before, 120, "version 1 back", interval=0.5)
    r = httpx.post(
        url + "/v1/models/beta/classify", content=png_bytes(image), headers={"content-type": "image/png"}, timeout=30
    )
    assert r.status_code == 200 and r.json()["version"] == "1" and r.json()["predictions"][0]["label"] == old


@pytest.fixture(scope="module")
def mixed_repository(tmp_path_factory, tiny_onnx) -> Path:
    """`good` beside the two bad models of `add_bad_models`."""
    root = tmp_path_factory.mktemp("ray_mixed") / "models"
    put_version(root / "good", 1, tiny_onnx)
    add_bad_models(root, tiny_onnx)
    return root


def test_exit_on_error_refuses_a_repository_with_a_bad_model(mixed_repository):
    from serve.server.ray.rollout import RepositoryRollout
    from serve.server.settings import ServeSettings

    rollout = RepositoryRollout(mixed_repository, ServeSettings(exit_on_error=True))
    with pytest.raises(ValueError, match="badconfig.*badlabels") as refused:
        rollout.deploy()  # refused by its checks, before anything reaches Ray
    assert "config.pbtxt" in str(refused.value) and "labels.txt" in str(refused.value)


def test_a_stop_between_two_rollouts_of_one_poll_starts_no_other(mixed_repository, monkeypatch):
    """Ctrl-C while one model's replicas were up and the next one's not yet asked for was noted, and the poll went
    on to the next model, whose replicas could wait for room for ever with nothing left to stop the wait."""
    from serve.server.ray import rollout as rollouts
    from serve.server.settings import ServeSettings

    rollout = rollouts.RepositoryRollout(mixed_repository, ServeSettings(), cpus=0.5)
    monkeypatch.setattr(rollouts.serve, "run", lambda *a, **k: pytest.fail("a rollout started after the stop"))
    rollout.stopping.set()  # as launch.run's handler does
    with pytest.raises(KeyboardInterrupt):
        rollout.deploy_model("good", {1: mixed_repository / "good" / "1" / "model.onnx"}, None)
    assert not rollout.placing.is_set() and "good" not in rollout.held


def test_only_the_models_that_serve_count_against_the_cpus(mixed_repository):
    """A refused model is not deployed: counting it refused a repository whose good models fit a local Ray."""
    from serve.server.ray.rollout import RepositoryRollout
    from serve.server.settings import ServeSettings

    assert RepositoryRollout(mixed_repository, ServeSettings(), cpus=0.5).cpus_needed() == 0.5  # `good` alone


@pytest.mark.parametrize("kind", ["missing", "cut short", "answers NaN"])
def test_a_model_file_that_cannot_load_is_one_line_before_ray_starts(tiny_onnx, tmp_path, kind):
    """Each replica failed to load it in a traceback of its own: 330 log lines and exit 1 after 15 s. A file whose
    answers are NaN was served, each request answered 500."""
    import subprocess
    import sys

    model = tmp_path / "model.onnx"
    if kind == "cut short":
        model.write_bytes(tiny_onnx.read_bytes()[:1000])
    if kind == "answers NaN":
        from tests.serve.broken_models import nan_head

        nan_head(tiny_onnx, model)
    args = [sys.executable, "-m", "serve.server", str(model), "--ray", "--port", "18999"]
    r = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith(f"vit-serve: cannot load {model}: "), r.stderr[-800:]
    assert len(r.stderr.splitlines()) == 1 and "Traceback" not in r.stderr


def test_a_payload_log_in_no_folder_is_one_line_before_a_ray_started_here(tiny_onnx, tmp_path):
    """Without --ray-address the replicas run on this machine, and write the log here: each failed in a traceback
    of its own, 242 lines and exit 1 after 18 s. (On a cluster joined, the log's folder is on the replicas' nodes.)"""
    import subprocess
    import sys

    log = tmp_path / "nowhere" / "payloads.jsonl"
    args = [sys.executable, "-m", "serve.server", str(tiny_onnx), "--ray", "--port", "18999", "--payload-log", str(log)]
    r = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith(f"vit-serve: --payload-log: the folder {log.parent} does not ")
    assert len(r.stderr.splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr[-800:]


def test_a_version_refused_for_its_labels_is_checked_again_once_labels_txt_is_fixed(tiny_onnx, tmp_path):
    """As `vit-serve DIR` checks it again: the launcher kept the refusal until the model file itself changed."""
    from serve.server.ray.rollout import RepositoryRollout
    from serve.server.settings import ServeSettings

    root = tmp_path / "models"
    put_version(root / "alpha", 1, tiny_onnx)
    labels = root / "alpha" / "labels.txt"
    labels.write_text("\n".join(["renamed", *CLASS_NAMES[1:]]) + "\n")
    rollout = RepositoryRollout(root, ServeSettings(preferred_batch_size=1))
    assert rollout.wanted()["alpha"][0] == {} and "labels" in rollout.reasons(["alpha"])
    labels.write_text("\n".join(CLASS_NAMES) + "\n")
    assert list(rollout.wanted()["alpha"][0]) == ["1"] and not rollout.failures


def test_the_launcher_rolls_out_a_changed_file_but_not_a_chmod(tiny_onnx, tmp_path):
    """A held version whose change time alone moved (a chmod) keeps its replicas: a rolling update restarts every
    one of them. A same-size rewrite that puts its modification time back is a new file."""
    pytest.importorskip("onnx", reason="rewrites the file's metadata")
    import os

    from serve.server.ray.rollout import RepositoryRollout
    from serve.server.settings import ServeSettings
    from tests.serve.broken_models import with_metadata

    root = tmp_path / "models"
    put_version(root / "alpha", 1, tiny_onnx)
    served = root / "alpha" / "1" / "model.onnx"
    rollout = RepositoryRollout(root, ServeSettings(preferred_batch_size=1))
    assert rollout.wanted()["alpha"][2] == {"1"}  # checked anew: its replicas would load it
    rollout.stamps["alpha"] = {"1": rollout.checked[("alpha", "1")]}  # as `deploy_model` records what they hold
    served.chmod(0o600)
    assert rollout.wanted()["alpha"][2] == set()
    before = served.stat()
    renamed = json.dumps([c.upper() for c in CLASS_NAMES])
    served.write_bytes(with_metadata(served, tmp_path / "new.onnx", class_names=renamed).read_bytes())
    os.utime(served, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert served.stat().st_size == before.st_size and rollout.wanted()["alpha"][2] == {"1"}


def test_a_version_rewritten_in_place_rolls_out(repository_server, repository):
    url, image = repository_server.url, quadrant_images(1, seed=3)[0][0]
    path = repository / "alpha" / "1" / "model.onnx"
    old = expected(repository, "alpha", "1", image)[0]["label"]
    new = expected(repository, "alpha", "2", image)[0]["label"]  # the file that replaces it
    assert old != new  # the rewritten file's answer tells it apart
    rolled = "alpha: every replica holds versions ['1', '2']"  # at start, then after the rewrite's update
    with ClassifyLoop(url, "/v1/models/alpha/versions/1/classify", image) as loop:
        wait_until(lambda: len(loop.answers) >= 20, 60, "20 answers from the first file")
        updates = repository_server.output.count(rolled)
        shutil.copyfile(repository / "alpha" / "2" / "model.onnx", path)  # in place: the same inode and path
        rewritten = len(loop.answers)
        wait_until(lambda: repository_server.output.count(rolled) > updates, 120, "the rewrite's update", interval=0.5)
        settled = len(loop.answers)
        wait_until(lambda: len(loop.answers) >= settled + 20, 60, "20 more answers after the rollout")
    failed = [a for a in loop.answers if a[0] != 200]
    assert not failed, f"{len(failed)} failed requests while the rewrite rolled out, e.g. {failed[:3]}"
    assert {a[1] for a in loop.answers} == {"1"}
    assert {a[2] for a in loop.answers[:rewritten]} == {old} and {a[2] for a in loop.answers[settled:]} == {new}


def test_replicas_that_cannot_fit_are_refused_or_waited_for_until_ctrl_c(
    servers, cluster, driver, tiny_onnx, repository_server, repository
):
    """Ray waits for ever for replicas no node has room for: vit-serve --ray hung 12 minutes, deaf to Ctrl-C and
    SIGTERM. On a cluster started here it is refused at once; on one joined (which may add nodes) Ctrl-C stops,
    at start and when a later poll rolls out a model with no room (it was deaf to Ctrl-C there still)."""
    import signal

    from ray import serve

    from serve.server.ray.launch import check_room, serve_controller
    from serve.server.ray.repository import model_app_name

    def interrupted(joined: ServerProcess, waiting: Callable[[], bool], why: str) -> None:
        try:
            wait_until(waiting, 120, why, interval=0.5)
            joined.proc.send_signal(signal.SIGINT)
            # 130, or the signal's own end (-2), which a shell reports as 130 too: once, after its clean-up had run
            # and logged, the process ended by the SIGINT itself, somewhere in Ray's shutdown (checked below). The
            # clean-up deletes the ingress and five models' applications one by one: on a loaded machine (the whole
            # suite on 2 cores) it once took over 60 s; the bug this catches was a process deaf to Ctrl-C for good
            assert joined.proc.wait(timeout=180) in (130, -signal.SIGINT), joined.output[-2000:]
        finally:
            joined.stop()
        assert serve_controller() is None or not serve.status().applications  # half-deployed applications went

    # the repository's two models take 1 of the 2 CPUs (0.5 each): two more fit, the third waits for room (the
    # module's last test: its repository and server are not used again)
    for model in ("gamma", "delta", "epsilon"):
        put_version(repository / model, 1, tiny_onnx)
    # two new ones running and one waiting for room it never gets: whichever one that is (one poll may see all
    # three, and roll them out by name, or see gamma first); the one being placed when the signal comes
    statuses = lambda: [serve.status().applications.get(model_app_name(m)) for m in ("gamma", "delta", "epsilon")]
    full = lambda: sorted(a.status.value if a else "" for a in statuses()) == ["DEPLOYING", "RUNNING", "RUNNING"]
    servers.proc = servers.kind = None  # this test stops it, with Ctrl-C
    interrupted(repository_server, full, "the third new model's rollout")
    joined = ServerProcess(tiny_onnx, "--ray", "--ray-address", cluster.address, "--replica-cpus", "64")
    interrupted(joined, lambda: "waiting for it to add nodes" in joined.output, "the warning")
    with pytest.raises(ValueError, match=r"reserve 64 CPUs .* Ray has \d+: lower --replicas or --replica-cpus"):
        check_room(64, None)  # what `run` asks of a Ray it started (this process's, joined to the cluster)


@pytest.mark.parametrize("cpus", ["inf", "nan", "0"])
def test_replica_cpus_that_are_no_finite_positive_number_are_one_line_before_ray_starts(
    tiny_onnx, cpus, monkeypatch, capsys
):
    """--replica-cpus inf failed inside Ray's option checks with a traceback, NaN as "cannot convert float NaN to
    integer", after Ray had started."""
    from serve.server.cli import main

    monkeypatch.setattr(ray, "init", lambda *a, **kw: pytest.fail("Ray started for arguments it cannot run"))
    assert main([str(tiny_onnx), "--ray", "--replica-cpus", cpus]) == 2
    said = f"--replica-cpus must be a finite number above 0, got {float(cpus):g}"
    assert capsys.readouterr().err == f"vit-serve: {said}\n"


def test_a_port_in_use_or_a_cluster_nothing_answers_at_is_one_line_before_ray_starts(tiny_onnx, monkeypatch, capsys):
    """A port another program held failed inside Ray Serve's proxy, 66 lines of tracebacks after Ray had started;
    an address nothing answers at was retried by Ray for minutes."""
    import socket

    from serve.server.cli import main

    monkeypatch.setattr(ray, "init", lambda *a, **kw: pytest.fail("Ray started for a server that cannot run"))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert main([str(tiny_onnx), "--ray", "--port", str(port)]) == 2
    assert (
        capsys.readouterr().err
        == f"vit-serve: port {port} on 127.0.0.1 is in use: stop what listens there, or give --port another\n"
    )
    assert main([str(tiny_onnx), "--ray", "--port", str(port), "--ray-address", "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vit-serve: cannot reach a Ray cluster at 127.0.0.1:1") and len(err.splitlines()) == 1
