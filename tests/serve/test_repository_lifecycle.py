"""The model repository over a server's life: versions loaded and retired again and again give their memory and
threads back, one bad model never keeps the others from serving, an uncalibrated file serves, a file rewritten
in place is reloaded without a failed request, and the default model stays where start-up put it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import (
    CLASS_NAMES,
    ClientLoop,
    ServerProcess,
    free_port,
    png_bytes,
    quadrant_images,
    rss_mib,
    thread_name,
    wait_until,
)
from tests.serve.test_repository import add_model, classify, drop_version

FAST = ("--no-ui", "--preferred-batch-size", "1", "--graceful-timeout-s", "1")


def threads_of(pid: int) -> int:
    """The number of threads of process `pid` now (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise ProcessLookupError(f"no Threads line for process {pid}")


def draining(pid: int) -> int:
    """How many of process `pid`'s threads are draining a retired version now."""
    return sum(thread_name(task) == "vitscope-drain" for task in Path(f"/proc/{pid}/task").iterdir())


def versions_of(url: str, name: str) -> list[str]:
    """The versions of `name` the server takes requests for now ([] when none)."""
    models = httpx.get(url + "/v2/models", timeout=10).json()["models"]
    return next((m["versions"] for m in models if m["name"] == name), [])


def cycle(url: str, name: str) -> None:
    """Unload `name`, then load it again, through the v2 repository extension."""
    assert httpx.post(f"{url}/v2/repository/models/{name}/unload", timeout=30).status_code == 200
    loaded = httpx.post(f"{url}/v2/repository/models/{name}/load", timeout=60)
    assert loaded.status_code == 200, loaded.text


@pytest.mark.slow
def test_retired_versions_give_their_memory_and_threads_back(exported, tmp_path):
    """50 unload/load cycles and 50 rollouts picked up by polling: RSS and threads come back to where they were."""
    repo = tmp_path / "models"
    add_model(repo, exported, "alpha", [1])
    add_model(repo, exported, "beta", [1])
    model = exported / "alpha" / "1" / "model.onnx"
    with ServerProcess(repo, *FAST, "--repository-poll-s", "0.05") as server:
        pid, url = server.proc.pid, server.url
        for _ in range(5):  # the allocator's and onnxruntime's first growth is not a leak
            cycle(url, "beta")
        wait_until(lambda: not draining(pid), 10, "the retired versions drained")
        threads, rss = threads_of(pid), rss_mib(pid)
        for _ in range(50):
            cycle(url, "beta")
        for version in range(2, 52):
            drop_version(repo / "beta", version, model)
            wait_until(lambda v=str(version): versions_of(url, "beta") == [v], 30, f"beta version {version} serving")
        settled = lambda: not draining(pid) and threads_of(pid) <= threads  # noqa: E731
        wait_until(settled, 10, f"the threads back to {threads} (now {threads_of(pid)})")
        assert rss_mib(pid) < rss + 30, f"RSS grew from {rss:.0f} to {rss_mib(pid):.0f} MiB over 100 retired versions"


def bad_models(repo: Path, exported: Path) -> dict[str, str]:
    """Models a user can meet beside good ones: a truncated file, garbage bytes, a labels.txt that is not text, a
    config.pbtxt that cannot be read. Returns {model: a word its reason must hold}."""
    model = (exported / "alpha" / "1" / "model.onnx").read_bytes()
    add_model(repo, exported, "aaa_truncated", [])
    drop_version(repo / "aaa_truncated", 1, model[: len(model) // 3])
    add_model(repo, exported, "garbage", [])
    drop_version(repo / "garbage", 1, bytes(range(256)) * 64)
    add_model(repo, exported, "latin1_labels", [1])
    (repo / "latin1_labels" / "labels.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    add_model(repo, exported, "misconfigured", [1])
    (repo / "misconfigured" / "config.pbtxt").write_text('name: "misconfigured"\nversion_policy: { newest { } }\n')
    # folder names Linux allows and nothing else carries: one not UTF-8 made /readyz, /metrics and the index
    # answer 500 (a kubelet restarts such a pod) and each log line a traceback; a newline forged a log line
    for name in (os.fsdecode(b"bytes\xff"), "new\nline"):
        (repo / name).mkdir()
        drop_version(repo / name, 1, model)
    reasons = {"aaa_truncated": "model.onnx", "garbage": "model.onnx", "latin1_labels": "labels.txt"}
    return {**reasons, "misconfigured": "config.pbtxt", "bytes\\xff": "rename it", "new\\nline": "rename it"}


def unavailable(url: str) -> dict[str, str]:
    """{model: reason} of the index's UNAVAILABLE rows."""
    rows = httpx.post(url + "/v2/repository/index", timeout=10).json()
    return {r["name"]: r["reason"] for r in rows if r["state"] == "UNAVAILABLE"}


def test_bad_models_are_refused_at_start_up_and_the_good_one_serves(exported, tmp_path):
    repo = tmp_path / "models"
    add_model(repo, exported, "beta", [1])
    bad = bad_models(repo, exported)
    with ServerProcess(repo, *FAST) as server:
        url = server.url
        assert httpx.get(url + "/readyz", timeout=30).status_code == 200  # the models that loaded keep a version
        assert versions_of(url, "beta") == ["1"]
        reasons = unavailable(url)
        assert sorted(reasons) == sorted(bad)
        for name, word in bad.items():
            assert word in reasons[name] and reasons[name].count(str(repo)) == 1, reasons[name]  # the path once
            assert server.metric("vitscope_model_load_failures_total", model=name) == 1
            assert httpx.get(f"{url}/v2/models/{name}/ready", timeout=30).status_code == 404
        refused = httpx.post(url + "/v2/repository/models/garbage/load", timeout=60)
        assert refused.status_code == 400 and "model.onnx" in refused.json()["error"], refused.text
        for name in ("latin1_labels", "misconfigured"):
            refused = httpx.post(f"{url}/v2/repository/models/{name}/load", timeout=60)
            assert refused.status_code == 400 and bad[name] in refused.json()["error"], refused.text
        assert server.metric("vitscope_model_load_failures_total", model="misconfigured", reason="config") == 1
        assert "Traceback" not in server.caught_up() and not any(line.startswith("line") for line in server.lines)


CALIBRATION_EDITS = {  # model: (its file's calibration entry changed, a word its reason must hold)
    "cold": (lambda entry: entry.update(temperature=-1.0), "temperature"),  # served the least likely class
    "blind": (lambda entry: entry["ood"].update(threshold=float("nan")), "ood.threshold"),  # never said unknown
    "unsorted": (lambda entry: entry["conformal"].update(scores=entry["conformal"]["scores"][::-1]), "conformal"),
}


def test_calibration_configs_and_version_folders_are_read_per_model_by_a_running_server(exported, tmp_path):
    """What a user's repository may hold, served as Triton would: a file whose calibration does not hold together
    is that model's failure with its reason (a temperature of -1 served the least likely class, a NaN threshold
    never said unknown); a comment that mentions `version_policy` is a comment (the file was unreadable, or the
    policy changed); version folders `²` and `١` are no versions (one failed the scan of every model)."""
    pytest.importorskip("onnx")  # edits an exported file's metadata
    from tests.serve.test_model_files import with_calibration

    repo = tmp_path / "models"
    add_model(repo, exported, "beta", [1])
    for name, (edit, _) in CALIBRATION_EDITS.items():
        add_model(repo, exported, name, [])
        drop_version(repo / name, 1, with_calibration(exported / "alpha" / "1" / "model.onnx", tmp_path / name, edit))
    policy = "\n# version_policy: { latest { num_versions: 1 } } was the old policy\n"
    add_model(repo, exported, "commented", [1, 2], policy + "version_policy { specific { versions: [1] } }  # not 2\n")
    add_model(repo, exported, "digits", [1])
    for odd in ("\u00b2", "\u0661"):  # superscript two, Arabic-Indic one: digits to str.isdigit, not to Triton
        drop_version(repo / "digits", odd, exported / "alpha" / "1" / "model.onnx")
    with ServerProcess(repo, *FAST) as server:
        url = server.url
        reasons = unavailable(url)
        assert sorted(reasons) == sorted(CALIBRATION_EDITS), reasons
        for name, (_, word) in CALIBRATION_EDITS.items():
            assert "calibration" in reasons[name] and word in reasons[name], reasons[name]
            assert httpx.get(f"{url}/v2/models/{name}/ready", timeout=30).status_code == 404
        assert versions_of(url, "commented") == ["1"] and versions_of(url, "digits") == ["1"]
        assert versions_of(url, "beta") == ["1"] and classify(url, "/v1/models/digits/classify").status_code == 200
        assert "Traceback" not in server.caught_up()


def test_a_good_model_beside_bad_ones_is_picked_up_by_polling(exported, tmp_path):
    repo = tmp_path / "models"
    add_model(repo, exported, "beta", [1])
    with ServerProcess(repo, *FAST, "--repository-poll-s", "0.05") as server:
        bad = bad_models(repo, exported)
        add_model(repo, exported, "zeta", [1])  # sorts after every bad one: a sync that stops early misses it
        wait_until(lambda: versions_of(server.url, "zeta") == ["1"], 30, "the good new model serving")
        wait_until(lambda: sorted(unavailable(server.url)) == sorted(bad), 10, "every bad model in the index")
        assert httpx.get(server.url + "/readyz", timeout=30).status_code == 200


def test_exit_on_error_refuses_to_start_with_a_bad_model(exported, tmp_path):
    repo = tmp_path / "models"
    add_model(repo, exported, "beta", [1])
    add_model(repo, exported, "garbage", [])
    drop_version(repo / "garbage", 1, b"\x08\x07not a model")
    with pytest.raises(RuntimeError, match="garbage"):
        ServerProcess(repo, *FAST, "--exit-on-error").wait_ready(120)


def test_exit_on_error_says_why_in_one_line_and_exits_3(exported, tmp_path):
    """A bad file is the user's to fix, not a fault of the server: its reason ends the output, without a
    Python traceback, and the exit status is uvicorn's for a failed start-up (3), as for a port in use."""
    repo = tmp_path / "models"
    add_model(repo, exported, "beta", [1])
    add_model(repo, exported, "garbage", [])
    drop_version(repo / "garbage", 1, b"\x08\x07not a model")
    probe_port = free_port()
    args = [sys.executable, "-m", "serve.server", str(repo), *FAST, "--exit-on-error", "--port", "0"]
    run = subprocess.run([*args, "--probe-port", str(probe_port)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 3
    with pytest.raises(OSError):  # its probe process went with it
        socket.create_connection(("127.0.0.1", probe_port), timeout=2).close()
    out = run.stdout + run.stderr
    assert "Traceback" not in out
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("vit-serve: did not start:") and "garbage" in last and "--exit-on-error" in last


def test_a_model_file_whose_answers_are_nan_is_refused_at_start_as_in_a_repository(exported, tmp_path):
    """`vit-serve FILE` served it, and answered every request 500 "internal error (ValueError)"; a repository
    refuses the same file at its warm-up."""
    pytest.importorskip("onnx", reason="edits the file's weights: not in the [serve]-only install")
    from tests.serve.broken_models import nan_head

    model = nan_head(exported / "alpha" / "1" / "model.onnx", tmp_path / "diverged.onnx")
    args = [sys.executable, "-m", "serve.server", str(model), *FAST, "--port", "0"]
    run = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert run.returncode == 3 and "Traceback" not in run.stdout + run.stderr, run.stderr[-2000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("vit-serve: did not start:") and "NaN or infinite outputs" in last, last


@pytest.mark.slow
def test_sigterm_during_the_start_up_loads_no_more_models_and_exits_at_once(exported, tmp_path):
    """SIGTERM once the first of a repository's 20 models had loaded: the server loaded and warmed up all 20 before
    it stopped (8 s on 2 cores). A large repository would outlast a pod's grace period and be killed."""
    repo, n = tmp_path / "models", 48  # about 15 ms each to load here: the signal comes while most wait
    for i in range(n):
        add_model(repo, exported, f"m{i:02d}", [1])
    server = ServerProcess(repo, *FAST)
    try:
        server.wait_for_output("takes requests", 120)
        server.proc.terminate()
        assert server.proc.wait(60) == 0
    finally:
        server.stop()
    loaded, said = server.output.count("takes requests"), "a stop was asked for during the start-up"
    assert loaded < n and said in server.output and "warmed up; ready" not in server.output, server.output[-3000:]
    assert "Traceback" not in server.output


def test_a_port_in_use_is_named_in_the_last_line(exported, tmp_path):
    """The last line of a server that did not start says why, whatever stopped it: here another process's port, said
    before any model loads (a repository of large models took minutes to load and warm up, then found it taken)."""
    repo = tmp_path / "models"
    add_model(repo, exported, "beta", [1])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = [sys.executable, "-m", "serve.server", str(repo), *FAST, "--port", str(port)]
        run = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert run.returncode == 3
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("vit-serve: did not start:") and str(port) in last and "in use" in last
    assert "warmed up" not in run.stderr and "takes requests" not in run.stderr, run.stderr


def test_any_exception_in_one_load_is_that_models_failure(exported, tmp_path):
    """An error the loader did not foresee (here from the engine factory) is one model's LoadFailure."""
    from serve.server.engine import Engine
    from serve.server.metrics import Metrics
    from serve.server.repository.repository import ModelRepository
    from serve.server.settings import ServeSettings

    repo = tmp_path / "models"
    for name in ("alpha", "beta", "gamma"):
        add_model(repo, exported, name, [1])
    settings = ServeSettings(preferred_batch_size=1, graceful_timeout_s=1)

    def make_engine(classifier, name: str, version: str) -> Engine:
        if name == "beta":
            raise RecursionError("maximum recursion depth exceeded")
        return Engine(classifier, settings)

    repository = ModelRepository(make_engine, Metrics(), root=repo, drain_s=1)
    repository.start()
    try:
        assert sorted(repository.serving) == ["alpha", "gamma"] and repository.ready
        failed = [r for r in repository.index() if r["state"] == "UNAVAILABLE"]
        assert [r["name"] for r in failed] == ["beta"] and "RecursionError" in failed[0]["reason"]
    finally:
        repository.stop()


def test_readiness_and_the_index_are_read_while_the_poller_changes_the_failures(exported, tmp_path):
    """/readyz, gRPC ServerReady and the index read the failures on their own threads while `sync` adds and drops
    them: iterating them there raised "changed size during iteration" (a 500 from /readyz)."""
    import sys
    import threading

    from serve.server.engine import Engine
    from serve.server.metrics import Metrics
    from serve.server.repository.repository import ModelRepository
    from serve.server.settings import ServeSettings

    repo = tmp_path / "models"
    add_model(repo, exported, "alpha", [1])
    settings = ServeSettings(preferred_batch_size=1, graceful_timeout_s=1)
    repository = ModelRepository(lambda c, n, v: Engine(c, settings), Metrics(), root=repo, drain_s=1)
    repository.start()
    errors, done = [], threading.Event()

    def read() -> None:
        while not done.is_set():
            try:
                repository.ready, repository.index()  # noqa: B018 (reading them is the test)
            except Exception as e:
                errors.append(e)
                return

    reader, interval = threading.Thread(target=read), sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, as a loaded server does
    reader.start()
    try:
        for _ in range(15):
            for i in range(30):
                (repo / f"bad{i}" / "1").mkdir(parents=True)  # no model.onnx: each is that model's failure
            repository.sync()
            for i in range(30):
                (repo / f"bad{i}" / "1").rmdir()
                (repo / f"bad{i}").rmdir()
            repository.sync()
    finally:
        done.set()
        reader.join()
        sys.setswitchinterval(interval)
        repository.stop()
    assert not errors, errors[0]


def test_a_file_removed_while_it_loads_stops_the_engine_it_started(exported, tmp_path):
    """The file changed check after the warm-up raised on a file removed meanwhile, leaving the started engine's
    thread and session running with nothing to stop them."""
    from serve.server.engine import Engine
    from serve.server.metrics import Metrics
    from serve.server.repository.repository import ModelRepository
    from serve.server.settings import ServeSettings

    repo = tmp_path / "models"
    add_model(repo, exported, "alpha", [1])
    settings, engines = ServeSettings(preferred_batch_size=1, graceful_timeout_s=1), []

    class RemovedMidLoad(Engine):
        def start(self) -> None:
            super().start()
            (repo / "alpha" / "1" / "model.onnx").unlink()  # a deployment removes it during the warm-up
            engines.append(self)

    repository = ModelRepository(lambda c, n, v: RemovedMidLoad(c, settings), Metrics(), root=repo, drain_s=1)
    repository.start()
    repository.stop()
    assert [r["name"] for r in repository.index() if r["state"] == "UNAVAILABLE"] == ["alpha"]
    assert len(engines) == 1 and not engines[0].ready, "the engine of the failed load still runs"


def test_a_failed_load_keeps_no_session_alive(exported, tmp_path):
    """The failure kept the exception it was raised with, whose traceback held the load's frames: the failed
    version's classifier (its onnxruntime session and memory) stayed alive as long as the failure was listed."""
    import gc
    import weakref

    from serve.server.engine import Engine
    from serve.server.metrics import Metrics
    from serve.server.repository.repository import ModelRepository
    from serve.server.settings import ServeSettings

    repo = tmp_path / "models"
    add_model(repo, exported, "alpha", [1])
    settings, classifiers = ServeSettings(preferred_batch_size=1, graceful_timeout_s=1), []

    class NoThreadLeft(Engine):
        def start(self) -> None:
            raise RuntimeError("can't start new thread")

    def make_engine(classifier, name: str, version: str) -> Engine:
        classifiers.append(weakref.ref(classifier))
        return NoThreadLeft(classifier, settings)

    repository = ModelRepository(make_engine, Metrics(), root=repo, drain_s=1)
    repository.start()
    try:
        assert [r["state"] for r in repository.index()] == ["UNAVAILABLE"]
        gc.collect()
        assert len(classifiers) == 1 and classifiers[0]() is None, "the failed version's classifier is still alive"
    finally:
        repository.stop()


def test_a_failed_version_is_tried_again_once_its_labels_are_fixed_or_a_load_asks(exported, tmp_path):
    """Failures were known by the version file alone: a labels.txt put right (or a warm-up that timed out on a busy
    machine) stayed failed, for polling and for an explicit load alike, until the file itself changed."""
    from serve.server.engine import Engine
    from serve.server.metrics import Metrics
    from serve.server.repository.repository import ModelRepository
    from serve.server.repository.version import LoadFailure
    from serve.server.settings import ServeSettings

    repo = tmp_path / "models"
    add_model(repo, exported, "alpha", [1])
    add_model(repo, exported, "beta", [1])
    labels = repo / "alpha" / "labels.txt"
    good = labels.read_text()
    labels.write_text(good.replace(CLASS_NAMES[0], "renamed"))
    settings, busy, ready_meanwhile = ServeSettings(preferred_batch_size=1, graceful_timeout_s=1), [False], []

    class Busy(Engine):
        def start(self) -> None:
            ready_meanwhile.append(repository.ready)
            if busy[0]:
                raise TimeoutError("the warm-up batch took over 60 s")
            super().start()

    make = lambda c, n, v: Busy(c, settings) if n == "alpha" else Engine(c, settings)  # noqa: E731
    repository = ModelRepository(make, Metrics(), root=repo, drain_s=1)
    repository.start()
    try:
        assert "labels.txt" in repository.index()[-1]["reason"] and list(repository.serving) == ["beta"]
        labels.write_text(good)
        repository.sync()  # as the poller does
        assert list(repository.serving.get("alpha", {})) == ["1"]
        repository.unload("alpha")
        busy[0] = True
        with pytest.raises(LoadFailure, match="warm-up"):
            repository.load("alpha")
        busy[0] = False
        ready_meanwhile.clear()
        repository.load("alpha")  # the same file, asked for again
        assert list(repository.serving.get("alpha", {})) == ["1"] and repository.index()[0]["state"] == "READY"
        assert ready_meanwhile == [True]  # still listed as failed while it loads: beta's traffic is not stopped
    finally:
        repository.stop()


def test_a_repository_emptied_under_the_poller_keeps_serving_and_says_so_once(exported, tmp_path, caplog):
    """Each poll of an emptied (or unmounted) folder logged the same traceback again, forever."""
    import logging

    from serve.server.engine import Engine
    from serve.server.metrics import Metrics
    from serve.server.repository.repository import ModelRepository
    from serve.server.settings import ServeSettings

    class Counted(ModelRepository):
        syncs = 0

        def sync(self, only: str | None = None) -> None:
            self.syncs += 1
            super().sync(only)

    repo = tmp_path / "models"
    add_model(repo, exported, "alpha", [1])
    settings = ServeSettings(preferred_batch_size=1, graceful_timeout_s=1)
    repository = Counted(lambda c, n, v: Engine(c, settings), Metrics(), root=repo, drain_s=1, poll_s=0.02)
    caplog.set_level(logging.INFO, logger="vitscope.repository")
    repository.start()
    try:
        (repo / "alpha").rename(repo / ".alpha.away")  # the folder now holds no model
        polls = repository.syncs
        wait_until(lambda: repository.syncs > polls + 10, 10, "ten polls of the empty folder")
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "holds no model" in errors[0].getMessage() and not errors[0].exc_info
        assert list(repository.serving) == ["alpha"] and repository.ready
        (repo / ".alpha.away").rename(repo / "alpha")
        wait_until(lambda: "can be scanned again" in caplog.text, 10, "the scan working again")
    finally:
        repository.stop()


@pytest.fixture(scope="module")
def uncalibrated(request, tmp_path_factory) -> Path:
    """A repository from `vit-export --triton-repo --no-calibration`: model `plain`, version 1, no OOD score."""
    pytest.importorskip("onnx", reason="the exporter: not in the [serve]-only install")
    from serve.export.cli import main as export_main

    root = tmp_path_factory.mktemp("uncalibrated")
    args = ["-o", str(root / "plain.onnx"), "--triton-repo", str(root / "models"), "--no-gradients", "--no-calibration"]
    assert export_main([str(request.getfixturevalue("tiny_checkpoint")), *args]) == 0
    return root / "models"


def strict_json(text: str):
    """JSON that refuses NaN and Infinity, which are no JSON (a client's parser may reject the whole answer)."""
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"the answer holds {c}: {text[:200]}"))


def test_an_uncalibrated_file_serves_with_a_null_ood_score(uncalibrated):
    """The warm-up check read the NaN that stands for "no OOD score" as a broken model and refused the file."""
    images, _ = quadrant_images(2, seed=5)
    pixels = {"name": "pixels", "datatype": "UINT8", "shape": [2, 32, 32, 3], "data": images.ravel().tolist()}
    with ServerProcess(uncalibrated, *FAST) as server:
        url = server.url
        answer = httpx.post(
            url + "/v1/classify", files={"file": ("a.png", png_bytes(images[0]), "image/png")}, timeout=30
        )
        assert answer.status_code == 200, answer.text
        assert strict_json(answer.text)["ood_score"] is None
        v2 = httpx.post(url + "/v2/models/plain/infer", json={"inputs": [pixels]}, timeout=30)
        assert v2.status_code == 200, v2.text
        assert [o["name"] for o in strict_json(v2.text)["outputs"]] == ["logits"]
        asked = {"inputs": [pixels], "outputs": [{"name": "logits"}, {"name": "ood_score"}]}
        refused = httpx.post(url + "/v2/models/plain/infer", json=asked, timeout=30)  # no OOD score to answer with
        assert refused.status_code == 422, refused.text  # naming the file and only the output it lacks
        assert "model.onnx carries no calibration: it has no ['ood_score'] outputs" in refused.json()["error"]


class Labels(ClientLoop):
    """`clients` threads classifying with model `name` until stopped; each answer's status and top label is kept,
    with the time its request was sent (answers are kept in the order they come back)."""

    def __init__(self, url: str, name: str, clients: int = 2):
        super().__init__(clients)
        self.url, self.name = url, name

    def run(self, seed: int) -> None:
        images, _ = quadrant_images(1, seed=seed)
        files = {"file": ("a.png", png_bytes(images[0]), "image/png")}
        with httpx.Client(timeout=30) as client:
            while not self.stopping.is_set():
                sent = time.monotonic()
                try:
                    r = client.post(f"{self.url}/v1/models/{self.name}/classify", files=files)
                    label = r.json()["predictions"][0]["label"] if r.is_success else r.text
                    self.answers.append((r.status_code, label, sent))
                except httpx.HTTPError as e:
                    self.answers.append((type(e).__name__, str(e), sent))

    def label_now(self) -> str | None:
        return self.answers[-1][1] if self.answers else None


@pytest.mark.parametrize("how", ["poll", "post"])
def test_a_file_rewritten_in_place_is_reloaded_without_a_failed_request(exported, tmp_path, how):
    """vit-export --triton-repo rewrites version 1 in place: its new class names must be served, by polling and
    by POST .../load, while requests keep being answered."""
    pytest.importorskip("onnx", reason="rewrites the file's metadata: not in the [serve]-only install")
    from tests.serve.broken_models import with_metadata

    repo = tmp_path / "models"
    add_model(repo, exported, "alpha", [1])
    (repo / "alpha" / "labels.txt").unlink()  # the new file's class names differ
    renamed = [f"new_{c}" for c in CLASS_NAMES]
    new = with_metadata(exported / "alpha" / "1" / "model.onnx", tmp_path / "new.onnx", class_names=json.dumps(renamed))
    args = (*FAST, "--repository-poll-s", "0.05") if how == "poll" else FAST
    with ServerProcess(repo, *args) as server, Labels(server.url, "alpha") as load:
        wait_until(lambda: load.label_now() in CLASS_NAMES, 30, "answers with the old class names")
        (repo / "alpha" / "1" / "model.onnx").write_bytes(new.read_bytes())  # in place: same path, new content
        if how == "post":
            loaded = httpx.post(server.url + "/v2/repository/models/alpha/load", timeout=60)
            assert loaded.status_code == 200, loaded.text
        wait_until(lambda: load.label_now() in renamed, 30, "answers with the new class names")
        swapped = time.monotonic()
        wait_until(lambda: len(load.sent_after(swapped)) > 20, 30, "more answers after the swap")
    failed = [a for a in load.answers if a[0] != 200]
    assert not failed, f"{len(failed)} of {len(load.answers)} requests failed during the swap: {failed[:3]}"
    # by their send time: the other client's request sent before the swap may come back with an old name after the
    # first new one (seen under load)
    assert {label for _, label, _ in load.sent_after(swapped)} <= set(renamed), load.sent_after(swapped)


def test_a_same_size_rewrite_that_keeps_its_modification_time_is_reloaded(exported, tmp_path):
    """`rsync --inplace --times` (or `cp` and `touch -r`) rewrites a version in place with its size, inode and
    modification time as they were: the retrained weights of one architecture are the same size. Polling kept
    serving the old file."""
    pytest.importorskip("onnx", reason="rewrites the file's metadata: not in the [serve]-only install")
    from serve.server.engine import Engine
    from serve.server.metrics import Metrics
    from serve.server.repository.repository import ModelRepository
    from serve.server.settings import ServeSettings
    from tests.serve.broken_models import with_metadata

    repo = tmp_path / "models"
    add_model(repo, exported, "alpha", [1])
    (repo / "alpha" / "labels.txt").unlink()  # the class names come from the file
    served_file = repo / "alpha" / "1" / "model.onnx"
    swapped = [name.upper() for name in CLASS_NAMES]  # the same length: the same file size
    new = with_metadata(served_file, tmp_path / "new.onnx", class_names=json.dumps(swapped)).read_bytes()
    before = served_file.stat()
    assert len(new) == before.st_size
    settings = ServeSettings(preferred_batch_size=1, graceful_timeout_s=1)
    repository = ModelRepository(lambda c, n, v: Engine(c, settings), Metrics(), root=repo, drain_s=1)
    repository.start()
    try:
        assert repository.resolve("alpha", None).classifier.labels == CLASS_NAMES
        with open(served_file, "r+b") as f:  # in place, as rsync --inplace writes
            f.write(new)
        os.utime(served_file, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert served_file.stat().st_ino == before.st_ino and served_file.stat().st_mtime_ns == before.st_mtime_ns
        repository.sync()
        assert repository.resolve("alpha", None).classifier.labels == swapped
    finally:
        repository.stop()


def test_a_chmod_or_a_hard_link_moves_the_change_time_but_reloads_nothing(exported, tmp_path):
    """The change time moves with metadata too: only the file's bytes decide then, hashed once."""
    from serve.server.engine import Engine
    from serve.server.metrics import Metrics
    from serve.server.repository.repository import ModelRepository
    from serve.server.settings import ServeSettings

    repo = tmp_path / "models"
    add_model(repo, exported, "alpha", [1])
    served_file = repo / "alpha" / "1" / "model.onnx"
    settings = ServeSettings(preferred_batch_size=1, graceful_timeout_s=1)
    repository = ModelRepository(lambda c, n, v: Engine(c, settings), Metrics(), root=repo, drain_s=1)
    repository.start()
    try:
        served = repository.resolve("alpha", None)
        stamp = served.stamp
        served_file.chmod(0o600)
        os.link(served_file, tmp_path / "backup.onnx")  # as `cp -al` makes a backup
        assert served_file.stat().st_ctime_ns != stamp[2]
        repository.sync()
        assert repository.resolve("alpha", None) is served and served.stamp != stamp  # the new stamp, kept
    finally:
        repository.stop()


@pytest.mark.parametrize("route", ["/v1/models/alpha/classify", "/v2/models/alpha/infer"])
def test_a_request_that_resolved_a_retiring_version_runs_on_the_new_one(exported, tmp_path, route):
    """A request resolves version 1; a rollout lands before it holds that version, so the drain sees no request,
    stops version 1, and the request met a stopped engine (503). It must be answered by version 2 instead."""
    from fastapi.testclient import TestClient

    from serve.server.app import build_app
    from serve.server.settings import ServeSettings

    repo = tmp_path / "models"
    add_model(repo, exported, "alpha", [1])
    app = build_app(repo, ServeSettings(preferred_batch_size=1, graceful_timeout_s=1, examples_dir=""), with_ui=False)
    repository, swaps = app.state.repository, []
    looked_up = repository.resolve

    def resolve_then_roll_out(name=None, version=None):
        served = looked_up(name, version)
        if not swaps:  # once: version 2 takes over and version 1 drains between this lookup and the hold
            swaps.append(served)
            drop_version(repo / "alpha", 2, exported / "alpha" / "1" / "model.onnx")
            repository.sync()
            wait_until(lambda: served.engine.drained, 10, "version 1 drained and stopped")
        return served

    images, _ = quadrant_images(1, seed=3)
    files = {"file": ("a.png", png_bytes(images[0]), "image/png")}
    pixels = {"name": "pixels", "datatype": "UINT8", "shape": [1, 32, 32, 3], "data": images.ravel().tolist()}
    with TestClient(app, base_url="http://localhost") as client:
        repository.resolve = resolve_then_roll_out
        r = client.post(route, files=files) if "v1" in route else client.post(route, json={"inputs": [pixels]})
    assert [s.version for s in swaps] == ["1"] and r.status_code == 200, r.text
    assert (r.json()["model_version"] if "v2" in route else r.json()["version"]) == "2"


def bare_model(url: str) -> str | int:
    """The model that answers the bare /v1/classify now (its status code when none does)."""
    images, _ = quadrant_images(1, seed=7)
    r = httpx.post(url + "/v1/classify", files={"file": ("a.png", png_bytes(images[0]), "image/png")}, timeout=30)
    return r.json()["model"] if r.is_success else r.status_code


def test_the_default_model_stays_where_start_up_put_it_and_a_change_is_logged(exported, tmp_path):
    repo = tmp_path / "models"
    add_model(repo, exported, "beta", [1])
    with ServerProcess(repo, *FAST, "--repository-poll-s", "0.05") as server:
        url = server.url
        assert bare_model(url) == "beta"
        add_model(tmp_path / "incoming", exported, "alpha", [1])
        (tmp_path / "incoming" / "alpha").rename(repo / "alpha")  # sorts first, and is picked up by polling
        wait_until(lambda: versions_of(url, "alpha") == ["1"], 30, "alpha serving")
        assert bare_model(url) == "beta"
        assert httpx.post(url + "/v2/repository/models/beta/unload", timeout=30).status_code == 200
        assert bare_model(url) == 503  # never silently alpha
        ready = httpx.get(url + "/readyz", timeout=10)  # alpha still serves: the server stays in rotation
        assert ready.status_code == 200 and ready.json()["model"] is None
        wait_until(lambda: "WARNING" in server.output and "default model beta" in server.output, 10, "a warning")
        assert httpx.post(url + "/v2/repository/models/beta/load", timeout=60).status_code == 200
        assert bare_model(url) == "beta"


def test_a_version_that_fails_its_warm_up_leaves_the_drift_reference_of_the_one_served(
    exported,
    uncalibrated,
    tmp_path,
):
    """The drift gauges compare answers with the reference of the version that answers them. A version whose
    warm-up failed had already replaced that reference (the engine factory set it), so the version still serving
    was judged against a file that never served; and an uncalibrated version kept its predecessor's."""
    from serve.server.app import repository_of
    from serve.server.engine import Engine
    from serve.server.metrics import Metrics
    from serve.server.settings import ServeSettings

    repo = tmp_path / "models"
    add_model(repo, exported, "alpha", [1])

    class ChangedMidLoad(Engine):
        def start(self) -> None:
            super().start()
            if self.classifier.path.parent.name == "2":  # a deployment rewrites version 2 during its warm-up
                self.classifier.path.write_bytes(self.classifier.path.read_bytes())

    settings, metrics = ServeSettings(preferred_batch_size=1, graceful_timeout_s=1), Metrics()
    repository = repository_of(repo, None, settings, metrics, ChangedMidLoad)
    repository.start()
    try:
        served = repository.resolve("alpha")
        assert metrics.trust.windows["alpha"].ref is served.classifier.trust.drift
        drop_version(repo / "alpha", 2, exported / "alpha" / "1" / "model.onnx")
        repository.sync()
        assert [r["version"] for r in repository.index() if r["state"] == "UNAVAILABLE"] == ["2"]
        assert repository.resolve("alpha") is served
        assert metrics.trust.windows["alpha"].ref is served.classifier.trust.drift, "judged against version 2"
        drop_version(repo / "alpha", 3, uncalibrated / "plain" / "1" / "model.onnx")
        repository.sync()
        assert repository.resolve("alpha").version == "3" and "alpha" not in metrics.trust.windows
    finally:
        repository.stop()
