"""Hostile clients against a real `vit-serve` with its UI: the exploits of the security audit, replayed.

Each test sends the attack itself to a server on 127.0.0.1 and checks that it fails, with a clear answer.
"""

from __future__ import annotations

import base64
import json
import logging
import re
import socket
import time

import httpx
import pytest

from serve.server.auth import key_of, key_refusal
from serve.server.cli import _warn_if_exposed
from serve.server.http.guard import allowed_hosts_of
from serve.server.settings import ServeSettings
from tests.helpers import ServerProcess, read_response, wait_until

KEY = "test-key-9f2c"
AUTH = {"Authorization": f"Bearer {KEY}"}
HTTP_KEY_HINT = (
    "send it as 'Authorization: Bearer <key>' or 'X-API-Key: <key>' (in a browser, as the password of the login prompt)"
)
# a FileData naming a file the client never uploaded, as the audit sent it to the UI's classify call
STOLEN = "/etc/passwd"
CALL = {"data": [{"path": STOLEN, "meta": {"_type": "gradio.FileData"}}, "mean", 0, 0, 2, 0.5, "inferno"]}


def test_allowed_hosts_default_to_the_bind_host_and_loopback():
    assert allowed_hosts_of("", "10.1.2.3") == {"10.1.2.3", "localhost", "127.0.0.1", "::1"}
    assert allowed_hosts_of("", "0.0.0.0") == {"localhost", "127.0.0.1", "::1"}  # no name means "every interface"
    assert allowed_hosts_of(" vit.example.org, Localhost ", "127.0.0.1") == {"vit.example.org", "localhost"}
    assert allowed_hosts_of("*", "127.0.0.1") is None


def test_the_key_is_read_from_bearer_x_api_key_or_basic_auth():
    assert key_of({b"authorization": b"Bearer abc"}) == "abc"
    assert key_of({b"x-api-key": b"abc"}) == "abc"
    assert key_of({b"authorization": b"Basic " + base64.b64encode(b"anyone:abc")}) == "abc"
    assert key_of({b"authorization": b"Basic !!!"}) is None and key_of({}) is None


def test_a_key_header_twice_is_refused_only_where_a_key_is_needed():
    basic = b"Basic " + base64.b64encode(b"anyone:k")
    for name, value in ((b"x-api-key", b"k"), (b"authorization", b"Bearer k"), (b"authorization", basic)):
        assert key_refusal(b"k", [(name, value)], "hint") is None
        assert key_refusal(b"k", [(name, value), (name, value)], "hint") == f"{name.decode()!r} sent twice: hint"
        assert key_refusal(b"", [(name, b"x"), (name, value)], "hint") is None  # no key, nothing to check


@pytest.mark.parametrize("key", ["clé-secrète", "two words", "tab\there"])
def test_a_key_no_client_can_send_is_refused_at_start_up(key, capsys):
    """HTTP headers and gRPC metadata carry visible ASCII: a key with 'é' was taken, then no client's key
    matched it, and gRPC could not send it at all."""
    from serve.server.cli import main

    assert main(["model.onnx", "--api-key", key]) == 2
    err = capsys.readouterr().err
    assert "api_key" in err and "visible ASCII" in err
    assert ServeSettings(api_key="k3y-of_visible.ASCII~+/=").api_key.get_secret_value()


def test_binding_beyond_loopback_without_a_key_warns(caplog):
    with caplog.at_level(logging.WARNING):
        _warn_if_exposed(ServeSettings(host="0.0.0.0"))
    assert "without an API key" in caplog.text and "--allowed-hosts" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        _warn_if_exposed(ServeSettings(host="127.0.0.1"))
    assert caplog.text == ""


@pytest.fixture(scope="module")
def server(tiny_onnx):
    args = ["--api-key", KEY, "--examples-dir", "", "--graceful-timeout-s", "3", "--header-timeout-s", "1.5"]
    with ServerProcess(tiny_onnx, *args, "--max-connections", "40") as s:
        yield s


def gradio_call(url: str, body: dict, headers: dict) -> str:
    """A Gradio call over its two-step HTTP API: the event stream of its answer, as text."""
    r = httpx.post(url + "/gradio_api/call/classify", json=body, headers=headers, timeout=10)
    r.raise_for_status()
    stream = httpx.get(f"{url}/gradio_api/call/classify/{r.json()['event_id']}", headers=headers, timeout=20)
    return stream.text


@pytest.mark.slow
def test_the_ui_refuses_to_read_a_file_the_client_did_not_upload(server):
    events = gradio_call(server.url, CALL, AUTH)
    assert "event: error" in events and "not one uploaded to this server" in events
    assert "root:" not in events
    # no path the answer names (a cached copy, say) serves the file either
    for path in re.findall(r"/[^\s\"'\\]+", events):
        assert "root:" not in httpx.get(f"{server.url}/gradio_api/file={path}", headers=AUTH, timeout=10).text
    r = httpx.get(f"{server.url}/gradio_api/file={STOLEN}", headers=AUTH, timeout=10)
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden" and "root:" not in r.text


@pytest.mark.slow
def test_a_foreign_host_header_is_refused_so_dns_rebinding_reaches_nothing(server):
    for path in ("/", "/v1/classify", "/gradio_api/info", "/config"):
        r = httpx.get(server.url + path, headers={**AUTH, "Host": "attacker.example:7860"}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["code"] == "bad_host"
        assert "--allowed-hosts" in r.json()["error"]["message"]
    assert (
        httpx.get(server.url + "/healthz", headers={"Host": "10.0.0.7"}, timeout=30).status_code == 200
    )  # probes by IP
    for host in ("localhost:7860", "LOCALHOST", "[::1]:7860", "127.0.0.1"):  # the loopback names, port or none
        assert (
            httpx.get(server.url + "/v2/models/tiny_test", headers={**AUTH, "Host": host}, timeout=30).status_code
            == 200
        )


@pytest.mark.slow
@pytest.mark.parametrize("hosts", [("127.0.0.1", "attacker.example"), ("attacker.example", "127.0.0.1")])
def test_a_request_with_two_host_headers_is_refused(server, hosts):
    """RFC 9112 asks for a 400: a proxy that reads the other one would route what the allow-list never saw."""
    key = "".join(f"{k}: {v}\r\n" for k, v in AUTH.items())
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(f"GET /v2/models/tiny_test HTTP/1.1\r\nHost: {hosts[0]}\r\nHost: {hosts[1]}\r\n{key}\r\n".encode())
        answer = read_response(s)
    assert answer.startswith(b"HTTP/1.1 400 ") and b"more than one Host header" in answer


@pytest.mark.slow
def test_a_request_without_host_is_refused_in_http_1_1_and_served_in_http_1_0(server):
    """RFC 9112 makes Host mandatory in HTTP/1.1 only; HTTP/1.0 clients (old health checkers) send none, and no
    browser, so no DNS-rebinding page, ever omits it. Both got a 400 that told them to admit the name ''."""
    key = "".join(f"{k}: {v}\r\n" for k, v in AUTH.items())
    answers = {}
    for version in ("1.0", "1.1"):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(f"GET /v2/models/tiny_test HTTP/{version}\r\n{key}\r\n".encode())
            answers[version] = read_response(s)
    assert answers["1.0"].startswith(b"HTTP/1.1 200 ")
    assert answers["1.1"].startswith(b"HTTP/1.1 400 ") and b"no Host header" in answers["1.1"]


@pytest.mark.slow
def test_readyz_tells_the_model_only_to_a_client_with_the_key(server):
    """Probes send no key: /readyz answers them its status alone, not which model and version the server runs."""
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(server.url + "/readyz", headers=headers, timeout=30)
        assert r.status_code == 200 and r.json() == {"status": "ready"}
    full = httpx.get(server.url + "/readyz", headers=AUTH, timeout=30).json()
    assert full["status"] == "ready" and full["model"] == "tiny_test" and full["version"]


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/", "/config", "/v1/classify", "/v2/models/tiny_test", "/metrics"])
def test_without_the_api_key_api_and_ui_answer_401(server, path):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-API-Key": KEY + "x"}):
        r = httpx.get(server.url + path, headers=headers, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
        which = "a wrong API key" if headers else "no API key"
        assert r.json()["error"]["message"] == f"{which}: {HTTP_KEY_HINT}"  # HTTP's wording: headers, the browser
        assert "WWW-Authenticate" in r.headers


@pytest.mark.slow
def test_the_api_key_is_taken_as_bearer_x_api_key_or_a_browser_password(server):
    for headers in (AUTH, {"X-API-Key": KEY}):
        assert httpx.get(server.url + "/v2/models/tiny_test", headers=headers, timeout=30).status_code == 200
    assert httpx.get(server.url + "/", auth=("anyone", KEY), timeout=10).status_code == 200
    assert httpx.get(server.url + "/healthz", timeout=30).status_code == 200  # health needs no key
    assert httpx.get(server.url + "/readyz", timeout=30).status_code == 200


@pytest.mark.slow
def test_a_key_header_sent_twice_is_refused_whichever_copy_holds_the_key(server):
    """A request with two keys has no one key to check: the last one passed, so a proxy that added its own key
    before the client's let any client choose which was checked."""
    for name, value in (("X-API-Key", KEY), ("Authorization", f"Bearer {KEY}")):
        for pair in ((value, "wrong"), ("wrong", value), (value, value)):
            r = httpx.get(server.url + "/v2/models/tiny_test", headers=[(name, v) for v in pair], timeout=10)
            assert r.status_code == 401, (name, pair)
            assert r.json()["error"]["message"] == f"{name.lower()!r} sent twice: {HTTP_KEY_HINT}"


@pytest.mark.slow
def test_every_answer_carries_a_request_id_and_a_log_line(server):
    r = httpx.get(server.url + "/healthz", headers={"X-Request-Id": "abc-123"}, timeout=30)
    assert r.headers["x-request-id"] == "abc-123"
    odd = httpx.get(server.url + "/healthz", headers={"X-Request-Id": "no spaces\tor tabs"}, timeout=30)
    generated = odd.headers["x-request-id"]
    assert generated != "no spaces\tor tabs" and len(generated) == 32
    logged = lambda: any("GET /healthz" in line and "id=abc-123" in line for line in server.lines)
    wait_until(logged, 5, "an access log line with the request ID")  # the lines are written in batches


@pytest.mark.slow
def test_the_ui_config_names_no_library_versions(server):
    config = httpx.get(server.url + "/config", headers=AUTH, timeout=10).json()
    assert "." not in config["version"]  # the major only: gradio_client needs it
    gradio_openapi = httpx.get(server.url + "/gradio_api/openapi.json", headers=AUTH, timeout=10).json()
    assert "." not in gradio_openapi["info"]["version"]
    assert "versions" not in json.dumps(config)
    assert "server" not in httpx.get(server.url + "/healthz", timeout=30).headers


@pytest.mark.slow
def test_a_huge_request_head_gets_431_and_the_server_stays_small(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        try:
            for _ in range(64):  # up to 4 MiB of one header, in 64 KiB pieces
                s.sendall(b"X-Big: " + b"a" * 65536 + b"\r\n")
        except OSError:
            pass  # the server closed the connection under us: what it should do
        answer = s.recv(65536)
    assert answer.startswith(b"HTTP/1.1 431") and b"headers_too_large" in answer
    assert httpx.get(server.url + "/healthz", timeout=30).status_code == 200


def test_a_head_over_the_limit_in_one_piece_gets_431_before_the_app_sees_it(server):
    head = b"GET /v1/nothing HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Big: " + b"a" * 100_000 + b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(head)  # 100 kB, over the 64 KiB limit, complete in one write
        answer = s.recv(65536)
    assert answer.startswith(b"HTTP/1.1 431") and b"headers_too_large" in answer
    assert httpx.get(server.url + "/healthz", timeout=30).status_code == 200
    assert "/v1/nothing" not in server.caught_up()  # refused in the protocol: no access line, no route


@pytest.mark.parametrize("fields", [100, 101, 6000])
def test_a_head_of_more_than_100_header_fields_gets_431(server, fields):
    """Only the head's bytes were counted: 6,000 tiny headers fit 64 KiB and took about 800 kB of the server's
    memory each, for every connection that sent them (Apache's LimitRequestFields is 100 too)."""
    head = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"".join(b"a%d: b\r\n" % i for i in range(fields - 1))
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(head + b"\r\n")
        answer = read_response(s) if fields <= 100 else s.recv(65536)
    if fields <= 100:
        assert answer.startswith(b"HTTP/1.1 200")
    else:
        assert answer.startswith(b"HTTP/1.1 431") and b"over 100 header fields" in answer


@pytest.mark.slow
def test_a_slow_client_is_cut_off_with_408(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the blank line
        started = time.monotonic()
        answer = s.recv(65536)
        waited = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408") and waited < 5


@pytest.mark.slow
def test_a_slow_second_request_on_a_kept_alive_connection_gets_408_too(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        first = read_response(s)
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the blank line
        started = time.monotonic()
        answer = s.recv(65536)
        waited = time.monotonic() - started
    assert first.startswith(b"HTTP/1.1 200")
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer and waited < 5


@pytest.mark.slow
def test_connections_over_the_cap_get_503_and_the_server_keeps_serving(server):
    idle = []
    try:
        for _ in range(45):  # 40 allowed
            idle.append(socket.create_connection(("127.0.0.1", server.port), timeout=10))
        refused = idle[-1].recv(4096)
        assert refused.startswith(b"HTTP/1.1 503") and b"too_many_connections" in refused
    finally:
        for s in idle:
            s.close()
    healthy = lambda: httpx.get(server.url + "/healthz", timeout=30).status_code == 200
    wait_until(healthy, 10, "/healthz answering 200 once the idle connections are closed")


@pytest.mark.slow
def test_gradio_client_works_with_the_key_in_its_headers(server, tmp_path, ui_client):
    import numpy as np
    from gradio_client import handle_file
    from PIL import Image

    image = tmp_path / "square.png"
    Image.fromarray(np.full((32, 32, 3), 200, np.uint8)).save(image)
    client = ui_client(server.url + "/", headers={"X-API-Key": KEY})
    label, *_ = client.predict(handle_file(str(image)), "mean", 0.0, 0, 2, 0.5, "inferno", api_name="/classify")
    assert label["label"] in {"top_left", "top_right", "bottom_left", "bottom_right"}
