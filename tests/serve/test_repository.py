"""vit-serve over a model repository written by `vit-export --triton-repo`: several models and versions,
a version swapped under load with no failed request, a broken file that never takes traffic, the v2
repository extension, and probes on a port of their own."""

from __future__ import annotations

import http.client
import os
import shutil
import time
from pathlib import Path

import grpc
import httpx
import pytest

from serve.server.grpc import grpc_predict_v2_pb2 as pb
from serve.server.repository.layout import VersionPolicy, parse_version_policy, scan
from tests.helpers import CLASS_NAMES, ClientLoop, ServerProcess, free_port, png_bytes, quadrant_images

KEY = "repository-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def add_model(repo: Path, exported: Path, name: str, versions: list[int], policy: str = "") -> None:
    """`repo/name` holding the exported file as each of `versions` (a model folder copied and renamed)."""
    src = exported / "alpha"
    folder = repo / name
    folder.mkdir(parents=True)
    shutil.copy(src / "labels.txt", folder)
    config = (src / "config.pbtxt").read_text().replace('name: "alpha"', f'name: "{name}"')
    (folder / "config.pbtxt").write_text(config + policy)
    for v in versions:
        drop_version(folder, v, src / "1" / "model.onnx")


def drop_version(folder: Path, version: int | str, model: Path | bytes) -> None:
    """A new version as a deployment writes one: copied beside the repository, then renamed into it."""
    tmp = folder / f".{version}.incoming"
    tmp.mkdir()
    if isinstance(model, bytes):
        (tmp / "model.onnx").write_bytes(model)
    else:
        shutil.copy(model, tmp / "model.onnx")
    tmp.rename(folder / str(version))


def classify(url: str, path: str = "/v1/classify", seed: int = 0) -> httpx.Response:
    images, _ = quadrant_images(1, seed=seed)
    return httpx.post(
        url + path, files={"file": ("a.png", png_bytes(images[0]), "image/png")}, headers=AUTH, timeout=30
    )


def wait_for(what, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = what()
        if result:
            return result
        time.sleep(0.1)
    raise TimeoutError(f"not within {timeout} s: {what}")


def test_version_policies_read_as_tritons():
    assert parse_version_policy('name: "m"') == VersionPolicy("latest", 1)
    assert parse_version_policy("version_policy: { latest: { num_versions: 2 } }").select([3, 1, 2]) == [2, 3]
    assert parse_version_policy("version_policy: { all { } }").select([2, 1]) == [1, 2]
    assert parse_version_policy("version_policy { specific { versions: [1, 3] } }").select([1, 2, 3]) == [1, 3]
    with pytest.raises(ValueError, match="version_policy must be"):
        parse_version_policy("version_policy: { newest { } }")


def test_a_folder_whose_name_reads_as_another_once_escaped_fails_both(tmp_path):
    """A folder named `m\\xff` in plain text and one whose name holds the byte 0xff: the one scanned last took the
    other's place, a good model dropped without a word, or a bad one's "rename it" never said."""
    for names in ([os.fsdecode(b"m\xff"), "m\\xff"], ["n\nx", "n\\nx"], ["line\u2028break"]):
        for name in names:
            (tmp_path / name / "1").mkdir(parents=True)
            (tmp_path / name / "1" / "model.onnx").write_bytes(b"")
    folders = scan(tmp_path)
    assert sorted(folders) == ["line\\u2028break", "m\\xff", "n\\nx"]
    assert all("rename" in f.error and not f.wanted() for f in folders.values())


def test_two_models_and_two_versions_are_served_side_by_side(exported, tmp_path):
    repo = tmp_path / "models"
    add_model(repo, exported, "alpha", [1, 2], "version_policy: { all { } }\n")
    add_model(repo, exported, "beta", [1])
    assert sorted(scan(repo)) == ["alpha", "beta"]
    port = free_port()
    with ServerProcess(repo, "--no-ui", "--preferred-batch-size", "2", "--grpc-port", str(port), env=_env()) as server:
        url = server.url
        models = httpx.get(url + "/v2/models", headers=AUTH, timeout=30).json()["models"]
        assert [(m["name"], m["versions"]) for m in models] == [("alpha", ["1", "2"]), ("beta", ["1"])]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # gRPC's metadata lists them as HTTP's does
            path, answer = "/inference.GRPCInferenceService/ModelMetadata", pb.ModelMetadataResponse.FromString
            meta = channel.unary_unary(path, pb.ModelMetadataRequest.SerializeToString, answer)
            for version, listed in [("", ["1", "2"]), ("1", ["1"])]:
                asked = pb.ModelMetadataRequest(name="alpha", version=version)
                assert meta(asked, metadata=[("authorization", AUTH["Authorization"])], timeout=10).versions == listed
        for path, model, version in [
            ("/v1/classify", "alpha", "2"),
            ("/v1/models/alpha/classify", "alpha", "2"),
            ("/v1/models/alpha/versions/1/classify", "alpha", "1"),
            ("/v1/models/beta/classify", "beta", "1"),
        ]:
            body = classify(url, path).json()
            assert (body["model"], body["version"]) == (model, version)
            assert body["predictions"][0]["label"] in CLASS_NAMES
        images, _ = quadrant_images(2, seed=3)
        infer = {
            "inputs": [
                {"name": "pixels", "datatype": "UINT8", "shape": [2, 32, 32, 3], "data": images.ravel().tolist()}
            ]
        }
        r = httpx.post(url + "/v2/models/alpha/versions/1/infer", json=infer, headers=AUTH, timeout=30).json()
        assert (r["model_name"], r["model_version"], r["outputs"][0]["shape"]) == ("alpha", "1", [2, len(CLASS_NAMES)])
        assert httpx.get(url + "/v2/models/beta/versions/1/ready", headers=AUTH, timeout=30).status_code == 200
        missing = classify(url, "/v1/models/gamma/classify")
        assert missing.status_code == 404 and "alpha" in missing.json()["error"]["message"]
        assert httpx.get(url + "/v2/models/beta/versions/7/ready", headers=AUTH, timeout=30).status_code == 404
        index = httpx.post(url + "/v2/repository/index", headers=AUTH, timeout=30).json()
        assert [(r["name"], r["version"], r["state"]) for r in index] == [
            ("alpha", "1", "READY"),
            ("alpha", "2", "READY"),
            ("beta", "1", "READY"),
        ]
        assert all(r["memory_bytes"] > 0 for r in index)
        metrics = httpx.get(url + "/metrics", headers=AUTH, timeout=30).text
        assert 'vitscope_model_memory_bytes{model="beta",version="1"}' in metrics
        assert 'vitscope_batch_size_count{model="alpha",version="1"}' in metrics
        assert httpx.post(url + "/v2/repository/index", timeout=30).status_code == 401  # the extension needs the key


def _env() -> dict:
    import os

    return {**os.environ, "VITSCOPE_API_KEY": KEY}


class Load(ClientLoop):
    """`clients` threads classifying in a loop until stopped; every answer's status and version is kept, with the
    time its request was sent (answers are kept in the order they come back)."""

    def __init__(self, url: str, path: str, clients: int = 8):
        super().__init__(clients)
        self.url, self.path = url, path

    def run(self, seed: int) -> None:
        with httpx.Client(headers=AUTH, timeout=30) as client:
            images, _ = quadrant_images(1, seed=seed)
            files = {"file": ("a.png", png_bytes(images[0]), "image/png")}
            while not self.stopping.is_set():
                sent = time.monotonic()
                try:
                    r = client.post(self.url + self.path, files=files)
                    self.answers.append((r.status_code, r.json().get("version"), sent))
                except httpx.HTTPError as e:
                    self.answers.append((type(e).__name__, None, sent))

    def saw(self, version: str) -> bool:
        return any(v == version for _, v, _ in self.answers[-50:])


class GrpcLoad(Load):
    """The same, over gRPC with tritonclient (model `beta`, whichever version serves it now)."""

    def run(self, seed: int) -> None:
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        client = grpcclient.InferenceServerClient(self.url)
        pixels = quadrant_images(1, seed=seed)[0][:1]  # (1, 32, 32, 3) uint8
        inp = grpcclient.InferInput("pixels", list(pixels.shape), "UINT8")
        inp.set_data_from_numpy(pixels)
        try:
            while not self.stopping.is_set():
                sent = time.monotonic()
                try:
                    r = client.infer("beta", [inp], headers={"authorization": f"Bearer {KEY}"}, client_timeout=30)
                    self.answers.append((200, r.get_response().model_version, sent))
                except InferenceServerException as e:
                    self.answers.append((e.status(), None, sent))
        finally:
            client.close()


@pytest.mark.slow
def test_new_versions_roll_out_under_load_without_a_failed_request_and_a_broken_one_never_serves(exported, tmp_path):
    """HTTP and gRPC clients classify while versions 2 and 3 are dropped in, then a half-copied 4."""
    pytest.importorskip("tritonclient.grpc")
    repo = tmp_path / "models"
    add_model(repo, exported, "beta", [1])
    model = exported / "alpha" / "1" / "model.onnx"
    grpc_port = free_port()
    args = ("--no-ui", "--preferred-batch-size", "4", "--repository-poll-s", "0.2", "--grpc-port", str(grpc_port))
    with (
        ServerProcess(repo, *args, env=_env()) as server,
        Load(server.url, "/v1/models/beta/classify", clients=6) as load,
        GrpcLoad(f"127.0.0.1:{grpc_port}", "", clients=2) as grpc_load,
    ):
        wait_for(lambda: load.saw("1") and grpc_load.saw("1"))
        for version in (2, 3):
            drop_version(repo / "beta", version, model)
            wait_for(lambda v=str(version): load.saw(v) and grpc_load.saw(v))
        broken = model.read_bytes()[: model.stat().st_size // 2]  # a half-copied file
        drop_version(repo / "beta", 4, broken)
        index = wait_for(lambda: [r for r in _index(server.url) if r["version"] == "4"])
        assert index[0]["state"] == "UNAVAILABLE" and "model.onnx" in index[0]["reason"]
        settled = time.monotonic()  # version 3 serves, and 4 was refused
        wait_for(lambda: len(load.sent_after(settled)) > 50 and len(grpc_load.sent_after(settled)) > 20)
    for answers in (load.answers, grpc_load.answers):
        failed = [a for a in answers if a[0] != 200]
        assert not failed, f"failed requests during the swaps: {failed[:5]}"
        assert "4" not in {v for _, v, _ in answers}  # the broken file never took a request
    # by their send time: a request sent before version 3 came may come back from 2 after the first answer of 3
    for client in (load, grpc_load):
        assert {v for _, v, _ in client.sent_after(settled)} == {"3"}
    assert {"1", "2", "3"} <= {v for _, v, _ in grpc_load.answers}  # gRPC calls went through every swap
    server.wait_for_output("does not take traffic")


def _index(url: str) -> list[dict]:
    return httpx.post(url + "/v2/repository/index", headers=AUTH, timeout=30).json()


def test_the_repository_extension_unloads_and_loads_a_model(exported, tmp_path):
    repo = tmp_path / "models"
    add_model(repo, exported, "alpha", [1])
    add_model(repo, exported, "beta", [1])
    with ServerProcess(repo, "--no-ui", "--preferred-batch-size", "1", env=_env()) as server:
        url = server.url
        assert httpx.post(url + "/v2/repository/models/beta/unload", headers=AUTH, timeout=30).status_code == 200
        assert classify(url, "/v1/models/beta/classify").status_code == 404
        assert httpx.get(url + "/v2/models/beta/ready", headers=AUTH, timeout=30).status_code == 404
        assert (
            httpx.get(url + "/readyz", timeout=30).status_code == 200
        )  # an unloaded model is not expected to be ready
        index = httpx.post(url + "/v2/repository/index", headers=AUTH, timeout=30).json()
        unloaded = {"name": "beta", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}  # per version
        assert unloaded in index and {r["name"] for r in index} == {"alpha", "beta"}  # it was missing, as if gone
        (repo / "beta" / "1" / "model.onnx").write_bytes(b"\x08\x07not a model")
        refused = httpx.post(url + "/v2/repository/models/beta/load", headers=AUTH, timeout=60)
        assert refused.status_code == 400 and "beta" in refused.json()["error"]
        drop_version(repo / "beta", 2, exported / "alpha" / "1" / "model.onnx")
        assert httpx.post(url + "/v2/repository/models/beta/load", headers=AUTH, timeout=60).status_code == 200
        assert classify(url, "/v1/models/beta/classify").json()["version"] == "2"
        index = httpx.post(url + "/v2/repository/index", headers=AUTH, timeout=30).json()
        assert unloaded not in index and {"beta", "2", "READY"} <= set(
            next(r for r in index if r["version"] == "2").values()
        )
        gone = httpx.post(url + "/v2/repository/models/nope/load", headers=AUTH, timeout=30)
        assert gone.status_code == 404
        metrics = httpx.get(url + "/metrics", headers=AUTH, timeout=30).text
        assert 'vitscope_model_load_failures_total{model="beta",reason="unreadable",version="1"} 1.0' in metrics
        for name in ("alpha", "beta"):  # /readyz then said a model was "loading or warming up"
            assert httpx.post(url + f"/v2/repository/models/{name}/unload", headers=AUTH, timeout=30).status_code == 200
        for path in ("/readyz", "/v2/health/ready"):
            none = httpx.get(url + path, headers=AUTH, timeout=30)
            assert none.status_code == 503 and "no model is served" in none.text and "/load" in none.text, none.text
        index = httpx.post(url + "/v2/repository/index", headers=AUTH, timeout=30).json()
        assert [(r["name"], r["version"], r["reason"]) for r in index] == [
            ("alpha", "1", "unloaded"),
            ("beta", "2", "unloaded"),
        ]
        shutil.rmtree(repo / "beta")  # an unloaded model whose folder goes is forgotten at the next scan
        assert httpx.post(url + "/v2/repository/models/alpha/load", headers=AUTH, timeout=60).status_code == 200
        index = httpx.post(url + "/v2/repository/index", headers=AUTH, timeout=30).json()
        assert [(r["name"], r["state"]) for r in index] == [("alpha", "READY")], index


@pytest.mark.slow
def test_probes_on_their_own_port_answer_within_a_second_while_the_api_is_overloaded(tiny_onnx):
    probe_port = free_port()
    args = ("--no-ui", "--probe-port", str(probe_port), "--queue-size", "4", "--max-batch-size", "4")
    args += ("--preferred-batch-size", "1")
    with ServerProcess(tiny_onnx, *args) as server:
        probe = f"http://127.0.0.1:{probe_port}"
        with Load(server.url, "/v1/classify", clients=48) as load:
            wait_for(lambda: any(s == 503 for s, _, _ in load.answers))  # the API sheds load
            for _ in range(20):
                assert httpx.get(probe + "/healthz", timeout=1.0).json() == {"status": "live"}
                assert httpx.get(probe + "/readyz", timeout=1.0).status_code == 200
        assert httpx.get(probe + "/v2/health/ready", timeout=1.0).json() == {"ready": True}


@pytest.fixture(scope="module")
def polled(exported, tmp_path_factory):
    """A server on a repository of alpha, beta and gamma (version 1 each) that it scans every 0.1 s."""
    repo = tmp_path_factory.mktemp("polled") / "models"
    for name in ("alpha", "beta", "gamma"):
        add_model(repo, exported, name, [1])
    args = ("--no-ui", "--preferred-batch-size", "1", "--repository-poll-s", "0.1")
    with ServerProcess(repo, *args, env=_env()) as server:
        server.repo = repo
        yield server


@pytest.mark.parametrize(
    "name", ["a" * 300, "..", ".", ".staging", "%2E%2E"], ids=["too-long", "parent", "itself", "hidden", "escaped"]
)
def test_loading_a_name_that_is_no_model_of_the_repository_is_a_404(polled, exported, name):
    """The scan's rule, not a path built from the name: no parent, hidden or staging folder, no name too long
    for the file system."""
    if not (polled.repo / ".staging").exists():
        add_model(polled.repo, exported, ".staging", [1])  # a model folder a deployment has not renamed into place
    conn = http.client.HTTPConnection("127.0.0.1", int(polled.url.rsplit(":", 1)[1]), timeout=30)
    conn.request("POST", f"/v2/repository/models/{name}/load", headers=AUTH)  # ".." as it is, not normalised away
    r = conn.getresponse()
    body = r.read().decode()
    conn.close()
    assert (r.status, "the repository has no model" in body) == (404, True), body[:200]
    assert httpx.post(polled.url + "/v2/repository/models/alpha/load", headers=AUTH, timeout=60).status_code == 200


def series_of(url: str, model: str) -> list[str]:
    """The /metrics samples labelled with `model`."""
    text = httpx.get(url + "/metrics", headers=AUTH, timeout=30).text
    return [line for line in text.splitlines() if f'model="{model}"' in line and not line.startswith("#")]


def test_retired_versions_and_removed_models_leave_no_series_in_the_metrics(polled, exported):
    """As Triton drops a model's metrics on unload: rollouts and removals must not grow /metrics for good."""
    url, repo = polled.url, polled.repo
    for name in ("alpha", "beta", "gamma"):
        assert classify(url, f"/v1/models/{name}/classify").status_code == 200  # each model's answer series
    assert any('version="1"' in line for line in series_of(url, "alpha"))
    drop_version(repo / "alpha", 2, exported / "alpha" / "1" / "model.onnx")
    wait_for(lambda: not any('version="1"' in line for line in series_of(url, "alpha")), 10)
    kept = series_of(url, "alpha")
    assert any(line.startswith("vitscope_confidence_count") for line in kept), kept  # alpha still serves
    assert any(line.startswith("vitscope_batch_size_count") and 'version="2"' in line for line in kept), kept
    shutil.rmtree(repo / "beta")
    assert httpx.post(url + "/v2/repository/models/gamma/unload", headers=AUTH, timeout=30).status_code == 200
    wait_for(lambda: not series_of(url, "beta") and not series_of(url, "gamma"), 10)
