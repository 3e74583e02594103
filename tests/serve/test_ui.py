"""The Gradio UI: its documented api_names called with gradio_client against a real server, and its helpers."""

from __future__ import annotations

import base64
import io
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from serve.runtime.temp_dirs import LOCK
from serve.server.explain import cls_attention, render_overlay
from serve.server.ui.blocks import example_files
from tests.helpers import ServerProcess, peak_mib, reset_peak, server_has_read, wait_until
from tests.serve.test_repository import add_model, drop_version


@pytest.fixture(scope="module")
def ui_server(tiny_onnx):
    # the UI keeps event streams open; a short grace period keeps the teardown quick
    with ServerProcess(tiny_onnx, "--examples-dir", "", "--graceful-timeout-s", "3") as s:
        yield s


@pytest.fixture
def image_file(tmp_path):
    img = np.full((32, 32, 3), 30, np.uint8)
    img[4:14, 18:28] = 230  # bright square, top right
    path = tmp_path / "square.png"
    Image.fromarray(img).save(path)
    return path


@pytest.mark.slow
def test_gradio_client_classify_returns_labels_overlay_and_deletion_score(ui_server, image_file, tiny_onnx, ui_client):
    from gradio_client import handle_file

    from serve.runtime.classifier import OnnxClassifier

    clf = OnnxClassifier(tiny_onnx)
    client = ui_client(ui_server.url + "/")
    names = set(client.view_api(print_info=False, return_format="dict")["named_endpoints"])
    assert {"/classify", "/attention", "/gradient_rollout"} <= names

    label, overlay, text, seen = client.predict(
        handle_file(str(image_file)), "mean", 0.0, 0, clf.depth, 0.5, "inferno", api_name="/classify"
    )
    expected = clf.predict(image_file, top_k=1)[0][0][0]
    assert label["label"] == expected
    assert {c["label"] for c in label["confidences"]} <= set(clf.labels)
    assert np.asarray(Image.open(overlay)).shape[2] == 3
    assert Image.open(seen).size == Image.open(overlay).size
    assert "Deletion score" in text and "random order" in text

    attn, attn_text = client.predict(
        handle_file(str(image_file)), clf.depth - 1, clf.num_heads - 1, 0.7, "jet", api_name="/attention"
    )
    assert Image.open(attn).size[0] > 0 and "Deletion score" in attn_text


@pytest.mark.slow
def test_identical_results_fetched_while_another_call_writes_them_arrive_whole(ui_server, image_file, ui_client):
    """Gradio rewrote a result file named by its content in place at each identical call: a client fetching it
    meanwhile got a cut-off file (`Response content shorter than Content-Length`, a dropped connection)."""
    from gradio_client import handle_file

    def calls(_):
        client = ui_client(ui_server.url + "/")
        for _ in range(6):
            _, overlay, _, seen = client.predict(handle_file(str(image_file)), api_name="/classify")
            Image.open(overlay).load(), Image.open(seen).load()  # whole images, or PIL raises

    lines = len(ui_server.lines)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(calls, range(4)))
    ui_server.caught_up()
    assert not any("Content-Length" in line for line in ui_server.lines[lines:])


@pytest.mark.slow
def test_gradient_rollout_for_a_chosen_class_or_a_clear_reason_why_not(ui_server, image_file, tiny_onnx, ui_client):
    from gradio_client import handle_file

    from serve.runtime.classifier import OnnxClassifier

    clf = OnnxClassifier(tiny_onnx)
    client = ui_client(ui_server.url + "/")
    args = (handle_file(str(image_file)), clf.labels[-1], 0.5, "inferno")
    if not clf.supports_gradients:
        with pytest.raises(Exception, match="no gradient graph"):
            client.predict(*args, api_name="/gradient_rollout")
        return
    overlay, text = client.predict(*args, api_name="/gradient_rollout")
    assert Image.open(overlay).size[0] > 0
    assert f"Deletion score for *{clf.labels[-1]}*" in text  # the chosen class, not the top one


@pytest.mark.slow
def test_gradio_client_gets_a_clear_error_for_a_bad_block_range(ui_server, image_file, ui_client):
    from gradio_client import handle_file

    client = ui_client(ui_server.url + "/")
    with pytest.raises(Exception, match="block range"):
        client.predict(handle_file(str(image_file)), "mean", 0.0, 1, 1, 0.5, "inferno", api_name="/classify")
    assert client.predict(handle_file(str(image_file)), "max", 0.5, 0, 1, 0.5, "inferno", api_name="/classify")


@pytest.mark.parametrize("call", ["classify", "trust"])
def test_a_ui_call_that_resolved_a_retiring_version_runs_on_the_new_one(
    exported,
    tiny_onnx,
    tmp_path,
    image_file,
    call,
):
    """A UI call resolves version 1; a rollout lands before the call holds it, so the drain sees no call and stops
    version 1's engine. The call must be answered (by version 2), not meet a stopped engine."""
    from serve.server.app import build_app
    from serve.server.settings import ServeSettings
    from serve.server.ui.blocks import UiActions

    repo = tmp_path / "models"
    add_model(repo, exported, "alpha", [])
    drop_version(repo / "alpha", 1, tiny_onnx)  # with the attention outputs the UI explains from
    settings = ServeSettings(preferred_batch_size=1, graceful_timeout_s=1, examples_dir="")
    repository = build_app(repo, settings, with_ui=False).state.repository
    repository.start()
    try:
        on, looked_up, swaps = UiActions(repository, repository.resolve().classifier, settings), repository.resolve, []

        def resolve_then_roll_out(name=None, version=None):
            served = looked_up(name, version)
            if not swaps:  # once: version 2 takes over and version 1 drains between this lookup and the hold
                swaps.append(served)
                drop_version(repo / "alpha", 2, tiny_onnx)
                repository.sync()
                wait_until(lambda: served.engine.drained, 10, "version 1 drained and stopped")
            return served

        repository.resolve = resolve_then_roll_out
        if call == "classify":
            label = on.classify(str(image_file), "mean", 0.0, 0, on.depth, 0.5, "inferno")[0]
            assert set(label) == set(on.labels)
        else:
            assert "Calibrated confidence" in on.trust(str(image_file), 0.9)
        assert [s.version for s in swaps] == ["1"]
    finally:
        repository.stop()


def test_overlay_keeps_the_image_at_zero_opacity_and_is_the_map_at_full():
    pixels = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    grid = np.zeros((4, 4), np.float32)
    grid[0, 0] = 1.0
    plain = render_overlay(pixels, grid, opacity=0.0, size=32)
    np.testing.assert_array_equal(plain, pixels)
    full = render_overlay(pixels, grid, opacity=1.0, colormap="inferno", size=64)
    assert full.shape == (64, 64, 3)
    assert full[:8, :8].mean() > full[-8:, -8:].mean()  # the hot corner is brighter in inferno


def test_cls_attention_rows_are_distributions_over_patches(tiny_onnx):
    from serve.runtime.classifier import OnnxClassifier

    clf = OnnxClassifier(tiny_onnx)
    pixels = np.random.default_rng(1).integers(0, 256, (*clf.input_size, 3), dtype=np.uint8)
    probs, grid = cls_attention(clf, pixels, clf.depth - 1, 0)
    assert grid.shape == clf.grid_size and (grid >= 0).all()
    assert grid.sum() <= 1.0 + 1e-5  # the CLS row sums to 1 over all tokens, prefix included
    assert probs.shape == (len(clf.labels),)


def test_examples_take_one_image_per_class_folder(tmp_path):
    for cls in ("0", "1", "2"):
        (tmp_path / cls).mkdir()
        for i in range(3):
            Image.fromarray(np.zeros((8, 8), np.uint8)).save(tmp_path / cls / f"{i}.png")
    (tmp_path / "1" / "notes.txt").write_text("not an image")
    found = example_files(tmp_path, limit=2)
    assert [p.split("/")[-2:] for p in found] == [["0", "0.png"], ["1", "0.png"]]
    assert example_files(tmp_path / "missing") == [] and example_files("") == []


@pytest.mark.slow
@pytest.mark.parametrize(
    "method, path, status, code",
    [
        ("GET", "/v1/classify", 405, "method_not_allowed"),
        ("POST", "/v1/clasify", 404, "not_found"),
        ("POST", "/v2/models/tiny_test", 405, "method_not_allowed"),
        ("GET", "/v2/health/nope", 404, "not_found"),
        ("GET", "/v1", 404, "not_found"),
        ("POST", "/v1/classify/", 404, "not_found"),
    ],
)
def test_api_paths_answer_json_errors_even_with_the_ui_mounted_at_the_root(ui_server, method, path, status, code):
    import httpx

    r = httpx.request(method, ui_server.url + path, timeout=10)
    assert r.status_code == status and r.json()["error"]["code"] == code
    if status == 405:
        assert r.headers["allow"] in r.json()["error"]["message"]
    if path.endswith("/"):
        assert "drop the trailing slash" in r.json()["error"]["message"]
    assert httpx.get(ui_server.url + "/", timeout=10).status_code == 200  # the UI itself is still there


@pytest.fixture(scope="module")
def small_ui(tiny_onnx):
    """A UI server with a tiny queue and upload limit; stopped by the last test that uses it."""
    args = ("--examples-dir", "", "--graceful-timeout-s", "3", "--ui-queue-size", "2", "--ui-concurrency", "1")
    with ServerProcess(tiny_onnx, *args, "--max-bytes", "200000") as s:
        yield s


def upload(url: str, data: bytes) -> str:
    import httpx

    r = httpx.post(url + "/gradio_api/upload", files=[("files", ("a.png", data, "image/png"))], timeout=30)
    assert r.status_code == 200, r.text
    return r.json()[0]


@pytest.mark.slow
def test_ui_call_routes_refuse_bodies_over_max_bytes_before_gradio_reads_them(small_ui):
    import httpx

    big = b'{"data": ["' + b"x" * 400_000 + b'"]}'  # over --max-bytes and its form overhead
    for route in ("/gradio_api/call/classify", "/gradio_api/queue/join", "/gradio_api/run/predict"):
        r = httpx.post(small_ui.url + route, content=big, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", (route, r.text[:200])
        assert r.json()["error"]["message"].startswith("a request of 400,"), r.text[:200]  # ours, said once


@pytest.mark.slow
def test_ui_uploads_over_the_limit_in_total_are_refused(small_ui):
    import httpx

    files = [("files", (f"{i}.png", b"\x89PNG" + b"\0" * 150_000, "image/png")) for i in range(5)]
    r = httpx.post(small_ui.url + "/gradio_api/upload", files=files, timeout=30)  # each file fits, all do not
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert r.json()["error"]["message"].startswith("a request of "), r.text[:200]  # not wrapped in another message


@pytest.mark.slow
def test_the_ui_queue_is_bounded_and_says_so(small_ui, image_file):
    import httpx

    path = upload(small_ui.url, image_file.read_bytes())
    call = {"data": [{"path": path, "meta": {"_type": "gradio.FileData"}}, "mean", 0, 0, 2, 0.5, "inferno"]}
    answers = []
    for _ in range(5):  # 16 calls at once fill a queue of 2, unless a slow host sends them slower than one runs
        with ThreadPoolExecutor(16) as pool:
            answers += pool.map(
                lambda _: httpx.post(small_ui.url + "/gradio_api/call/classify", json=call, timeout=30), range(16)
            )
        if 503 in (statuses := [r.status_code for r in answers]):
            break
    assert 503 in statuses and 200 in statuses and set(statuses) <= {200, 503}, statuses
    full = next(r for r in answers if r.status_code == 503)  # Gradio's own {"detail": ...}, with no Retry-After
    assert full.json()["error"]["code"] == "queue_full" and "retry" in full.json()["error"]["message"], full.text
    assert full.headers["retry-after"] == "1"


@pytest.mark.slow
def test_malformed_calls_and_uploads_get_a_json_4xx_not_500(small_ui):
    import httpx

    calls = [
        ("/run/classify", {"data": [1, 2]}),  # too few inputs
        ("/run/classify", {"data": [{"path": 5}, "mean", 0, 0, 2, 0.5, "inferno"]}),  # a value of the wrong type
        ("/call/v2/classify", {"head_fusion": "mean"}),  # no image
        ("/call/v2/no_such_endpoint", {}),
        ("/call/no_such_endpoint", {"data": []}),
        ("/queue/join", {"data": [], "session_hash": "s", "fn_index": 999}),  # what the browser sends, malformed
    ]
    for route, body in calls:
        r = httpx.post(small_ui.url + "/gradio_api" + route, json=body, timeout=30)
        assert r.status_code == 422 and r.json()["error"]["code"] == "bad_request", (route, r.text)
    r = httpx.post(small_ui.url + "/gradio_api/upload", files={"files": (None, "a field, not a file")}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_upload"
    assert "named `files` with a filename" in r.json()["error"]["message"]
    # a route for recordings, which the page has none of, wrote what it got to $TMPDIR, outside every limit
    r = httpx.post(small_ui.url + "/gradio_api/process_recording", files={"video": ("a.webm", b"x" * 1000)}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


@pytest.mark.slow
@pytest.mark.parametrize(
    "method, route, body, status, code, said",
    [
        ("GET", "/file=/etc/passwd", None, 403, "forbidden", "File not allowed: /etc/passwd"),
        ("POST", "/upload", {"content": b"x", "headers": {"content-type": "text/plain"}}, 400, "bad_upload", "type"),
        ("POST", "/queue/join", {"json": {}}, 422, "bad_request", "body.data: Field required"),
        ("GET", "/no_such_route", None, 404, "not_found", "Not Found"),
        ("TRACE", "/call/classify/0", None, 405, "method_not_allowed", "Method Not Allowed"),  # with its Allow
    ],
)
def test_gradios_own_refusals_answer_our_json_error_body(small_ui, method, route, body, status, code, said):
    """Gradio answered these `{"detail": ...}`, where the README promises `{"error": {"code", "message"}}`."""
    r = httpx.request(method, small_ui.url + "/gradio_api" + route, **(body or {}), timeout=30)
    assert r.status_code == status and r.json()["error"]["code"] == code, r.text
    assert said in r.json()["error"]["message"], r.text
    assert status != 405 or "GET" in r.headers["allow"]


@pytest.mark.slow
def test_the_stream_of_an_unknown_event_ends_cleanly_with_its_error(small_ui):
    import httpx

    for path in ("/gradio_api/call/classify/no-such-event", "/gradio_api/queue/data?session_hash=no-such-session"):
        r = httpx.get(small_ui.url + path, timeout=30)  # a stream cut off mid-chunk raises RemoteProtocolError
        assert r.status_code == 200 and "404" in r.text  # Gradio's protocol: the error is the stream's event
    assert not any("Exception in ASGI application" in line for line in small_ui.lines)


@pytest.mark.slow
def test_an_abandoned_ui_upload_is_one_info_line_and_counted_as_499(small_ui):
    import socket

    head = b"POST /gradio_api/upload HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000\r\n"
    part = b'--xx\r\nContent-Disposition: form-data; name="files"; filename="a.png"\r\n\r\n' + b"x" * 1000
    with socket.create_connection(("127.0.0.1", small_ui.port)) as s:
        s.sendall(head + b"Content-Type: multipart/form-data; boundary=xx\r\n\r\n" + part)
        wait_until(lambda: server_has_read(small_ui.port), 10, "the server reading the first part of the upload")
    went_away = lambda: any("client went away during POST /gradio_api/upload" in line for line in small_ui.lines)
    wait_until(went_away, 10, "a line saying the client went away")
    assert small_ui.metric("vitscope_requests_total", route="/gradio_api", status="499") == 1
    assert 'route="/gradio_api",status="500"' not in small_ui.metrics()
    assert not any("Exception in ASGI application" in line or "unexpected error" in line for line in small_ui.lines)


@pytest.mark.slow
def test_the_partial_file_of_an_upload_dropped_midway_goes_once_stale(small_ui, image_file):
    """Gradio's clean-up removes the files it finished: a client that left mid-body left its partial file in the UI
    folder for good, counted against --ui-cache-bytes, until the folder refused every upload."""
    uploaded = Path(upload(small_ui.url, image_file.read_bytes()))
    folder = next(p for p in uploaded.parents if p.name.startswith("vitscope-ui-"))
    files = lambda: {p for p in folder.iterdir() if p.is_file()}
    before = files()
    part = b'--b\r\nContent-Disposition: form-data; name="files"; filename="a.bin"\r\n\r\n' + bytes(150_000)
    head = "POST /gradio_api/upload HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: multipart/form-data; boundary=b\r\n"
    with socket.create_connection(("127.0.0.1", small_ui.port)) as conn:
        conn.sendall(f"{head}Content-Length: {len(part) + 30_000}\r\n\r\n".encode() + part)
        partial = wait_until(lambda: files() - before, 10, "the upload's partial file")
    stale = time.time() - 2 * 3600  # past --ui-cache-s (an hour)

    def swept_once_stale() -> bool:  # the server may still write (and date) the file as it sees the client gone
        for p in partial & files():
            os.utime(p, (stale, stale))
        upload(small_ui.url, image_file.read_bytes())  # the next upload's check sweeps the folder
        return not partial & files()

    wait_until(swept_once_stale, 10, "the stale partial file removed by the next upload's check")


def test_ui_uploads_live_in_a_folder_of_the_servers_own_removed_at_exit(small_ui, image_file):
    path = Path(upload(small_ui.url, image_file.read_bytes()))
    folder = next(p for p in path.parents if p.name.startswith("vitscope-ui-"))
    assert path.is_file()
    assert small_ui.stop() == 0
    assert not folder.exists()


@pytest.mark.slow
@pytest.mark.parametrize("upload", ["data_url", "not_an_image"])
def test_an_image_is_checked_from_its_header_before_gradio_decodes_it(ui_server, upload):
    """A 16000 x 10000 PNG sent as a data: URL (a few hundred kB) was decoded whole by Gradio, 1.5 GB, before the
    pixel limit refused it; a file that is no image got Gradio's error, naming the server's temporary path."""
    import base64
    import io

    import httpx

    if upload == "data_url":
        buf = io.BytesIO()
        Image.new("L", (16000, 10000)).save(buf, "PNG")  # 160 MP: over the 40 MP limit, under Pillow's own
        image, said = {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}, "over the limit"
    else:
        path = httpx.post(
            ui_server.url + "/gradio_api/upload", files={"files": ("a.png", b"no image")}, timeout=30
        ).json()[0]
        image, said = {"path": path}, "not an image"
    reset_peak(ui_server.proc.pid)
    base = peak_mib(ui_server.proc.pid)
    data = [{**image, "meta": {"_type": "gradio.FileData"}}, "mean", 0.0, 0, 2, 0.5, "inferno"]
    event = httpx.post(ui_server.url + "/gradio_api/call/classify", json={"data": data}, timeout=60).json()
    stream = httpx.get(f"{ui_server.url}/gradio_api/call/classify/{event['event_id']}", timeout=120).text
    assert "event: error" in stream and said in stream and "/tmp" not in stream, stream[:500]
    assert peak_mib(ui_server.proc.pid) - base < 300  # MiB: the header read, not the pixels


@pytest.mark.slow
@pytest.mark.parametrize(
    "api, args, said",
    [
        ("classify", ["mean", 0.0, 0, 2, float("nan"), "inferno"], "opacity"),  # an all-black overlay
        ("classify", ["mean", 0.0, 0.5, 2, 0.5, "inferno"], "whole number"),  # silently block 0
        ("attention", [float("nan"), 0, 0.5, "inferno"], "whole number"),  # "cannot convert float NaN to integer"
        ("classify", ["mean", 0.0, 0, 2, 0.5, None], "colormap must be one of"),  # matplotlib's KeyError, 200 names
        ("attention", [0, 0, 0.5, ["inferno"]], "colormap must be one of"),  # "unhashable type: 'list'"
        ("classify", [None, 0.0, 0, 2, 0.5, "inferno"], "head fusion must be one of"),  # a bare ValueError
        ("classify", ["mean", float("nan"), 0, 2, 0.5, "inferno"], "discard ratio must be in"),  # a bare ValueError
    ],
)
def test_a_value_the_ui_cannot_use_is_refused_saying_which(ui_server, image_file, api, args, said):
    import json

    import httpx

    lines = len(ui_server.lines)
    path = httpx.post(
        ui_server.url + "/gradio_api/upload", files={"files": ("a.png", image_file.read_bytes())}, timeout=30
    ).json()
    data = json.dumps({"data": [{"path": path[0], "meta": {"_type": "gradio.FileData"}}, *args]})  # NaN as JSON has it
    headers = {"Content-Type": "application/json"}
    event = httpx.post(f"{ui_server.url}/gradio_api/call/{api}", content=data, headers=headers, timeout=60).json()
    stream = httpx.get(f"{ui_server.url}/gradio_api/call/{api}/{event['event_id']}", timeout=120).text
    assert "event: error" in stream and said in stream, stream[:400]
    ui_server.caught_up()
    assert not any("Traceback" in line for line in ui_server.lines[lines:])  # the caller's mistake: no server fault


@pytest.mark.slow
def test_uploads_and_calls_past_the_ui_cache_cap_are_refused_until_old_ones_go(tiny_onnx, tmp_path):
    """Each upload was bounded by --max-bytes and kept an hour, with no bound on the folder: a client could fill
    the disk at the request rate. --ui-cache-bytes bounds it."""
    import httpx

    args = ["--examples-dir", "", "--graceful-timeout-s", "3", "--ui-cache-bytes", "3000000", "--max-bytes", "2000000"]
    with ServerProcess(tiny_onnx, *args) as server:
        post = lambda i: httpx.post(
            server.url + "/gradio_api/upload", files={"files": (f"{i}.bin", bytes(1_000_000))}, timeout=30
        )
        assert [post(i).status_code for i in range(2)] == [200, 200]
        for i in range(2, 6):  # results the UI wrote may share the folder: a few more, until it is full
            if (r := post(i)).status_code != 200:
                break
        assert r.status_code == 507 and "--ui-cache-bytes" in r.json()["error"]["message"], r.text
        post = lambda i: httpx.post(
            server.url + "/gradio_api/upload", files={"files": (f"{i}.bin", bytes(400_000))}, timeout=30
        )
        while post(i := i + 1).status_code == 200:  # within 400 kB of the cap
            assert i < 20
        # a call writes its results (and its data: URL images) into the same folder: refused as well, where each
        # distinct setting of an uploaded image's overlay added a file past the cap
        data = {"data": [{"url": "data:image/png;base64,", "meta": {"_type": "gradio.FileData"}}]}
        r = httpx.post(server.url + "/gradio_api/call/classify", json=data, timeout=30)
        assert r.status_code == 507 and "--ui-cache-bytes" in r.json()["error"]["message"], r.text
        assert httpx.get(server.url + "/healthz", timeout=30).status_code == 200


def test_the_page_names_no_server_path_and_carries_no_calibration_arrays(ui_server):
    """The Model tab put the file's whole calibration in the page: the path it was fitted from, and 370 kB of
    arrays that Gradio copied into the state of each of up to 10,000 sessions."""
    page = httpx.get(ui_server.url + "/config", timeout=30).text
    assert '"temperature"' in page and '"source"' not in page and '"means"' not in page and '"scores"' not in page
    assert len(page) < 60_000, len(page)


def png(size: tuple[int, int], mode: str = "L") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size).save(buf, "PNG")
    return buf.getvalue()


def data_url(*images: bytes) -> str:
    return "data:image/png;base64," + ",".join(base64.b64encode(i).decode() for i in images)


def call(server, api: str, image: dict, *args) -> str:
    data = [{**image, "meta": {"_type": "gradio.FileData"}}, *args]
    event = httpx.post(f"{server.url}/gradio_api/call/{api}", json={"data": data}, timeout=60).json()
    return httpx.get(f"{server.url}/gradio_api/call/{api}/{event['event_id']}", timeout=120).text


@pytest.mark.slow
@pytest.mark.parametrize(
    "sent, said",
    [
        ("two images in one data: URL", "one image"),  # Gradio decoded the last, 160 MP, where the check read the first
        ("a URL", "not one uploaded"),  # Gradio downloads it, from the server's network, of any size
        ("the server's lock", "not one uploaded"),  # Gradio took it, and its clean-up deleted it
        ("the server's lock, named with //", "not one uploaded"),
        ("the model file", "not one uploaded"),  # Gradio's refusal named the model's path and the server's code
        ("a relative path", "not one uploaded"),  # Gradio's refusal named the server's working directory
    ],
)
def test_the_ui_takes_only_an_upload_or_one_data_url_image(ui_server, tiny_onnx, sent, said):
    uploaded = httpx.post(ui_server.url + "/gradio_api/upload", files={"files": ("a.png", png((8, 8)))}, timeout=30)
    folder = next(p for p in Path(uploaded.json()[0]).parents if p.name.startswith("vitscope-ui-"))
    image = {
        "two images in one data: URL": None,  # made below: a 160 MP PNG takes a second or two to write
        "a URL": {"path": "http://127.0.0.1:9/a.png", "url": "http://127.0.0.1:9/a.png"},
        "the server's lock": {"path": str(folder / LOCK)},
        "the server's lock, named with //": {"path": "/" + str(folder / LOCK)},  # a path Gradio resolves alike
        "the model file": {"path": str(tiny_onnx)},
        "a relative path": {"path": "a.png"},
    }[sent] or {"url": data_url(png((8, 8)), png((16000, 10000)))}
    reset_peak(ui_server.proc.pid)
    base = peak_mib(ui_server.proc.pid)
    stream = call(ui_server, "classify", image, "mean", 0.0, 0, 2, 0.5, "inferno")
    assert "event: error" in stream and said in stream, stream[:500]
    assert "/tmp" not in stream and "/work" not in stream and str(Path.cwd()) not in stream, stream[:500]
    assert peak_mib(ui_server.proc.pid) - base < 300  # MiB: no image decoded whole
    assert (folder / LOCK).exists()


@pytest.mark.slow
def test_an_image_in_a_data_url_is_classified_and_a_cut_one_refused(ui_server):
    img = np.full((32, 32, 3), 30, np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "PNG")
    wrapped = "DATA:image/png;BASE64," + base64.encodebytes(buf.getvalue()).decode()  # in lines, as tools write it
    for url in (data_url(buf.getvalue()), wrapped):
        stream = call(ui_server, "trust", {"url": url}, 0.9)
        assert "event: complete" in stream, stream[:500]
    lines = len(ui_server.lines)
    stream = call(ui_server, "trust", {"url": data_url(buf.getvalue()[:-30])}, 0.9)
    assert "event: error" in stream and "truncated" in stream and "Original error" not in stream, stream[:500]
    ui_server.caught_up()
    assert not any("Traceback" in line for line in ui_server.lines[lines:])  # the caller's mistake: no server fault


def test_the_pages_events_share_one_concurrency_limit(tiny_onnx):
    """--ui-concurrency bounded each of the page's events on its own (Gradio's default): with 11 that call the model,
    22 calls could decode images at once where the flag said 2."""
    from serve.runtime.classifier import OnnxClassifier
    from serve.server.app import build_app
    from serve.server.settings import ServeSettings
    from serve.server.ui.blocks import build_ui

    settings = ServeSettings(preferred_batch_size=1, examples_dir="")
    classifier = OnnxClassifier(tiny_onnx)
    demo = build_ui(build_app(classifier, settings, with_ui=False).state.repository, classifier, settings)
    groups = {fn.fn.__name__: fn.concurrency_id for fn in demo.fns.values() if hasattr(fn.fn, "__name__")}
    model = {groups[name] for name in ("classify", "reclassify", "trust", "attention", "gradient")}
    assert len(model) == 1 and groups["restyle"] not in model  # a restyle only redraws: it waits for no model call
