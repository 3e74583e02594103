"""Payload logs: a real `vit-serve` recording into a JSON-lines file and a real CloudEvents sink on 127.0.0.1.

The sink is a tiny HTTP server in this file that records what it gets, and can be told to stall (hold every
request until released) or die (stop listening). Whatever the sink does, every request is answered, and
what the log lost is counted in /metrics.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import sys
import threading
import time

import httpx
import numpy as np
import pytest

from serve.server.payload_log import CloudEventsSink, FileSink, PayloadLog
from tests.helpers import ServerProcess, json_lines, png_bytes, quadrant_images

pytestmark = pytest.mark.slow
QUEUE_SIZE = 4


class Sink(http.server.ThreadingHTTPServer):
    """Records each POST's headers and JSON body; while `stalled` is set, holds every request until it is cleared."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _SinkHandler)
        self.events: list[tuple[dict, dict]] = []
        self.stalled, self.released, self.dead = threading.Event(), threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/events"

    def die(self) -> None:
        """Stop listening, and hang up on open connections at their next request."""
        self.dead.set()
        self.released.set()
        self.shutdown()
        self.server_close()


class _SinkHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.server.dead.is_set():
            self.close_connection = True  # no answer: the client sees the connection drop
            return
        if self.server.stalled.is_set():
            self.server.released.wait(30)
        self.server.events.append(({k.lower(): v for k, v in self.headers.items()}, json.loads(body)))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def wait_for(condition, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {timeout} s")


def dropped(server, sink: str, reason: str) -> float:
    for line in httpx.get(server.url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(f'vitscope_payload_log_dropped_total{{reason="{reason}",sink="{sink}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="module")
def sink():
    s = Sink()
    yield s
    s.released.set()
    s.shutdown()


@pytest.fixture(scope="module")
def server(tiny_onnx, sink, tmp_path_factory):
    log = tmp_path_factory.mktemp("payloads") / "payloads.jsonl"
    args = ("--no-ui", "--payload-log", str(log), "--payload-log-url", sink.url, "--payload-log-images", "digest")
    with ServerProcess(tiny_onnx, *args, "--payload-log-queue-size", str(QUEUE_SIZE), "--top-k", "3") as s:
        s.payload_log = log
        yield s


def classify(server, img: np.ndarray) -> httpx.Response:
    r = httpx.post(server.url + "/v1/classify?top_k=2", files={"file": ("x.png", png_bytes(img))}, timeout=30)
    assert r.status_code == 200, r.text
    return r


def records(server) -> dict[str, dict]:
    return {r["id"]: r for r in json_lines(server.payload_log)}


def test_each_request_reaches_the_file_and_the_sink_as_kserve_cloudevents(server, sink):
    images, _ = quadrant_images(3, seed=3)
    answers = {classify(server, img).headers["x-request-id"]: img for img in images}
    events = wait_for(lambda: len(sink.events) >= 6 and sink.events, what="6 events")
    by_type = {(h["ce-id"], h["ce-type"]): (h, data) for h, data in events}
    for rid, img in answers.items():
        head, request = by_type[(rid, "org.kubeflow.serving.inference.request")]
        _, response = by_type[(rid, "org.kubeflow.serving.inference.response")]
        assert head["ce-specversion"] == "1.0" and head["content-type"] == "application/json"
        assert head["ce-inferenceservicename"] == request["model"] and head["ce-time"].endswith("Z")
        assert request["image_sha256"] == [hashlib.sha256(png_bytes(img)).hexdigest()]
        assert len(response["predictions"][0]) == 3  # the server's --top-k, not the request's
    logged = wait_for(lambda: (r := records(server)) and answers.keys() <= r.keys() and r, what="the file's lines")
    for rid in answers:
        assert logged[rid]["route"] == "/v1/classify" and logged[rid]["predictions"][0][0]["score"] > 0.25


def test_a_stalled_sink_drops_and_counts_but_every_request_is_answered(server, sink):
    sink.stalled.set()
    try:
        images, _ = quadrant_images(24, seed=4)
        ids = [classify(server, img).headers["x-request-id"] for img in images]  # each asserts its 200
        assert wait_for(lambda: dropped(server, "url", "queue_full"), what="queue_full drops") >= 1
        assert wait_for(lambda: set(ids) <= records(server).keys(), what="the file's lines")  # the file is not held up
    finally:
        sink.released.set()
        sink.stalled.clear()


def test_a_dead_sink_loses_records_without_failing_requests(server, sink):
    sink.die()
    before = dropped(server, "url", "write_failed")
    images, _ = quadrant_images(3, seed=5)
    for img in images:
        classify(server, img)
    assert wait_for(lambda: dropped(server, "url", "write_failed") > before, what="write_failed drops")
    assert httpx.get(server.url + "/readyz", timeout=30).status_code == 200


@pytest.mark.parametrize("where", ["missing/payloads.jsonl", "."])
def test_a_payload_log_in_a_missing_folder_or_on_a_folder_is_refused_in_one_line(where, tiny_onnx, tmp_path, capsys):
    """The guide's `--payload-log /var/log/vitscope/payloads.jsonl` on a machine without that folder: a traceback."""
    from serve.server.cli import main

    assert main([str(tiny_onnx), "--no-ui", "--payload-log", str(tmp_path / where)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vit-serve: --payload-log") and len(err.splitlines()) == 1, err
    assert ("mkdir -p" if "missing" in where else "is a folder") in err


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--payload-log-url", "ftp://x"], "--payload-log-url must be an http:// or https:// URL, got 'ftp://x'"),
        (["--payload-log", "p.jsonl", "--payload-log-backups", "0"], "payload_log_backups"),
    ],
)
def test_a_payload_log_that_would_fail_or_never_rotate_is_refused_in_one_line(args, said, tiny_onnx, tmp_path, capsys):
    """A URL of another scheme ended the start in a traceback (exit 1); no backups kept the file from ever rotating
    (Python's handler rolls over only with backups to roll to): 116 kB and growing under a 1 kB limit."""
    from serve.server.cli import main

    args = [str(tmp_path / a) if a == "p.jsonl" else a for a in args]
    assert main([str(tiny_onnx), "--no-ui", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vit-serve: ") and said in err and len(err.splitlines()) == 1, err


def test_a_line_still_being_written_is_not_read_as_a_record(tmp_path):
    path = tmp_path / "p.jsonl"
    assert json_lines(path) == []
    path.write_text('{"id":"a"}\n{"id"')  # what a reader saw once, mid-write, in a test that then failed
    assert json_lines(path) == [{"id": "a"}]


def test_the_file_rotates_by_size(tmp_path):
    path = tmp_path / "p.jsonl"
    log = PayloadLog([FileSink(str(path), max_bytes=2048, backups=2)], top_k=2)
    probs = np.array([[0.7, 0.2, 0.1]])
    for i in range(60):
        log.record(f"id{i}", "/v1/classify", ("m", "1", ["a", "b", "c"]), probs)
        time.sleep(0.001)  # the queue holds 1000: nothing is dropped here
    log.close()
    files = [path, path.with_name("p.jsonl.1"), path.with_name("p.jsonl.2")]
    assert all(f.exists() and f.stat().st_size <= 2048 for f in files)
    assert not path.with_name("p.jsonl.3").exists()
    last = [json.loads(line) for line in path.read_text().splitlines()]
    assert last[-1]["id"] == "id59" and last[-1]["predictions"] == [
        [{"label": "a", "score": 0.7}, {"label": "b", "score": 0.2}]
    ]


def test_a_full_disk_counts_every_lost_record_as_dropped_without_a_traceback(tmp_path, capfd):
    drops: list[tuple[str, str]] = []
    log = PayloadLog([FileSink("/dev/full", max_bytes=1 << 20, backups=1)], on_drop=lambda *d: drops.append(d))
    for i in range(20):
        log.record(f"id{i}", "/v1/classify", ("m", "1", ["a", "b"]), np.array([[0.6, 0.4]]))
    log.close()
    assert drops == [("file", "write_failed")] * 20
    assert "Traceback" not in capfd.readouterr().err


def test_a_full_file_system_under_a_real_server_counts_each_lost_record_and_answers_every_request(tiny_onnx, tmp_path):
    """The server's own payload log file meets a failed write (a file size limit stands in for a full disk: the same
    OSError from the same write): every request is answered, every record is in the file or counted as dropped, and
    the server's log holds no traceback. Such failures once printed a traceback each and were counted nowhere."""
    limit_kib = 4
    python = tmp_path / "python"  # /bin/sh's ulimit -f counts 512-byte blocks (POSIX): 4 KiB at most
    python.write_text(f'#!/bin/sh\nulimit -f {limit_kib * 2}\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    log, sent = tmp_path / "payloads.jsonl", 40
    with ServerProcess(tiny_onnx, "--no-ui", "--payload-log", str(log), python=str(python)) as s:
        s.payload_log = log
        images, _ = quadrant_images(sent, seed=6)
        for img in images:
            classify(s, img)  # each asserts its 200

        def accounted() -> tuple[float, int] | None:
            lost, kept = dropped(s, "file", "write_failed"), len(records(s))
            return (lost, kept) if lost >= 1 and lost + kept >= sent else None

        lost, kept = wait_for(accounted, what=f"all {sent} records in the file or counted as dropped")
        assert lost + kept == sent and kept >= 1, (lost, kept)  # none counted twice
        assert log.stat().st_size <= limit_kib * 1024
        assert "Traceback" not in s.caught_up()


def test_the_queue_is_bounded_in_bytes_and_what_is_past_it_is_dropped_and_counted():
    sink = Sink()
    sink.stalled.set()  # the sink holds its first record: the rest wait in the queue
    drops: list[tuple[str, str]] = []
    image = bytes(200_000)
    log = PayloadLog(
        [CloudEventsSink(sink.url)], images="image", queue_bytes=1_000_000, on_drop=lambda *d: drops.append(d)
    )
    try:
        for i in range(20):  # 4 MB of images against a budget of 1 MB; the record count (1000) never binds
            log.record(f"id{i}", "/v1/classify", ("m", "1", ["a", "b"]), np.array([[0.6, 0.4]]), [image])
        assert 20 - 1 - 1_000_000 // 200_000 <= len(drops) < 20 and set(drops) == {("url", "queue_full")}
        sink.released.set()
        log.close()
        written = {data["id"] for _, data in sink.events}
        assert len(written) == 20 - len(drops) and "id0" in written
    finally:
        sink.released.set()
        sink.shutdown()


def test_a_model_name_outside_ascii_reaches_the_sink_percent_encoded_and_spoils_no_later_record():
    """A header value http.client cannot encode failed the record, and left the connection mid-request so that the
    next record failed too: every record of such a model, and one more, were lost."""
    sink, drops = Sink(), []
    log = PayloadLog([CloudEventsSink(sink.url)], on_drop=lambda *d: drops.append(d))
    try:
        for name in ("模型", "plain"):
            log.record(f"id-{name}", "/v1/classify", (name, "1", ["a", "b"]), np.array([[0.6, 0.4]]), [b"x"])
        log.close()
        assert not drops
        heads = {data["model"]: head for head, data in sink.events}  # the body keeps the name as it is
        assert heads["模型"]["ce-source"] == "/vitscope/models/%E6%A8%A1%E5%9E%8B"
        assert heads["模型"]["ce-inferenceservicename"] == "%E6%A8%A1%E5%9E%8B" and "plain" in heads
    finally:
        sink.shutdown()


def test_a_queued_record_keeps_its_probabilities_not_the_whole_answer_they_came_from():
    """The probabilities the routes pass are a view into the model's answer, features included: queued as they
    were, they kept all of it alive while the byte budget counted only them."""
    import weakref

    sink = Sink()
    sink.stalled.set()  # records wait in the queue
    log = PayloadLog([CloudEventsSink(sink.url)])
    try:
        answer = np.zeros(2, dtype=[("probs", np.float32, (2,)), ("features", np.float32, (100_000,))])
        held = weakref.ref(answer)
        log.record("id", "/v2/models/m/infer", ("m", "1", ["a", "b"]), answer["probs"])
        del answer
        assert held() is None, "the queued record holds the whole answer"
    finally:
        sink.released.set()
        log.close()
        sink.shutdown()
