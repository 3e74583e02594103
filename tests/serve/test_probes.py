"""The probe port's own process: readiness follows the server, liveness fails while the event loop is wedged
and comes back when it turns again, the process goes when the server is killed, a taken port is an error."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from serve.server.http.probes import MAX_CONNECTIONS, MAX_HEAD_BYTES, MAX_PIPELINED, ProbeServer
from serve.server.testing import free_port, wait_until


def status(port: int, path: str) -> int:
    return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=2).status_code


def answers(port: int) -> bool:
    """Whether /healthz answers 200 now (a refused or reset connection is a no, not an error)."""
    try:
        return status(port, "/healthz") == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def loop():
    """An event loop turning in a thread, as uvicorn's does."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def test_readiness_follows_the_server_and_liveness_fails_while_its_loop_is_wedged(loop):
    ready = threading.Event()
    probes = ProbeServer("127.0.0.1", 0, ready.is_set, loop=lambda: loop, stale_s=1.0).start()
    try:
        assert status(probes.port, "/healthz") == 200
        assert status(probes.port, "/readyz") == 503
        ready.set()
        wait_until(lambda: status(probes.port, "/v2/health/ready") == 200, 5, "readiness after the server is ready")
        loop.call_soon_threadsafe(time.sleep, 6)  # a callback that blocks the loop, as a wedged server would
        # both within the wedge (503 from about 1 s, stale_s, to 6 s), not live and so not ready either
        wedged = lambda: status(probes.port, "/healthz") == 503 and status(probes.port, "/readyz") == 503
        wait_until(wedged, 4, "liveness and readiness failing on the wedged loop")
        wait_until(lambda: status(probes.port, "/healthz") == 200, 8, "liveness once the loop turns again")
        assert httpx.get(f"http://127.0.0.1:{probes.port}/nowhere", timeout=2).status_code == 404
    finally:
        probes.stop()
    assert probes.proc.poll() is not None


def test_a_probe_process_slow_to_start_is_live_once_it_answers(loop, monkeypatch):
    """The state is stamped when the server builds its probes; a probe process that took longer than the stale time
    to start (a busy machine) answered its first /healthz with 503."""
    spawn = ProbeServer._spawn

    def slow_spawn(self) -> None:
        spawn(self)
        time.sleep(1.5)

    monkeypatch.setattr(ProbeServer, "_spawn", slow_spawn)
    probes = ProbeServer("127.0.0.1", 0, lambda: True, loop=lambda: loop, stale_s=1.0).start()
    try:
        assert status(probes.port, "/healthz") == 200
    finally:
        probes.stop()


def test_the_probe_process_and_its_state_go_when_the_server_is_killed(tmp_path):
    code = (
        "import sys, time\n"
        "from serve.server.http.probes import MAX_CONNECTIONS, ProbeServer\n"
        "p = ProbeServer('127.0.0.1', 0, lambda: True).start()\n"
        "print(p.port, p.proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # where the server's temporary files would go
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    port, child = map(int, server.stdout.readline().split())
    assert status(port, "/healthz") == 200
    server.send_signal(signal.SIGKILL)  # no chance to stop its probe process
    server.wait(10)

    def gone() -> bool:  # exited: no process, or a zombie that nobody has reaped yet
        try:
            with open(f"/proc/{child}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            return True

    wait_until(gone, 10, "the probe process exiting after its server")
    assert not list(tmp_path.iterdir())  # a pod killed a thousand times leaves no file behind


def test_a_client_that_pipelines_thousands_of_requests_gets_a_few_answers_and_is_dropped():
    """256 KiB of pipelined requests arrive in one read: the probe process answered all ~8,000 in one go, holding its
    one event loop (and every other probe) for over half a second on a busy machine."""
    probes = ProbeServer("127.0.0.1", 0, lambda: True).start()
    try:
        one = b"GET /healthz HTTP/1.1\r\nhost: a\r\n\r\n"
        flood = one * (256 * 1024 // len(one))
        with socket.create_connection(("127.0.0.1", probes.port), timeout=10) as c:
            got = b""
            try:
                c.sendall(flood)
                while chunk := c.recv(65536):  # until the probe process hangs up
                    got += chunk
            except ConnectionResetError:  # hung up with requests unread: the kernel resets, answers may be lost
                pass
        assert got.count(b"HTTP/1.1 200") <= MAX_PIPELINED
        with socket.create_connection(("127.0.0.1", probes.port), timeout=10) as c:  # a few more than the cap,
            c.sendall(one * (MAX_PIPELINED + 4))  # read whole: answered up to the cap, then closed
            got = b""
            while chunk := c.recv(65536):
                got += chunk
        assert got.count(b"HTTP/1.1 200") == MAX_PIPELINED
        assert answers(probes.port)
    finally:
        probes.stop()


def test_a_probe_port_in_use_is_a_clear_error():
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        with pytest.raises(RuntimeError, match=f"probe port 127.0.0.1:{port} did not open: .*in use"):
            ProbeServer("127.0.0.1", port, lambda: True).start()


def test_the_server_restarts_a_probe_process_that_died():
    """A probe process killed by anything (the OOM killer, a stray SIGKILL) would fail every probe until the
    kubelet restarts a healthy pod: the server notices and starts another on the same port."""
    probes = ProbeServer("127.0.0.1", 0, lambda: True).start()
    try:
        first = probes.proc.pid
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: probes.proc.pid != first and answers(probes.port), 10, "a new probe process answering")
    finally:
        probes.stop()
    assert probes.proc.poll() is not None


def test_a_stop_signal_to_the_whole_process_group_leaves_the_probe_process_to_the_server(caplog):
    """systemd's stop sends SIGTERM to every process of the service: the probe process died at once, and the server,
    still draining, logged an error and started another, which it then stopped."""
    probes = ProbeServer("127.0.0.1", 0, lambda: True).start()
    try:
        first = probes.proc.pid
        os.kill(first, signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):  # it does not exit (4 beats of the server's watch)
            probes.proc.wait(1.0)
        assert probes.proc.pid == first and answers(probes.port)
    finally:
        probes.stop()  # the server stops it once drained
    assert probes.proc.poll() is not None and "starting another" not in caplog.text


def test_an_accept_error_does_not_end_the_probe_process(capfd):
    """Out of descriptors (EMFILE), `accept` fails: the probe process says so, waits and answers again once
    descriptors are free, without a restart."""
    probes = ProbeServer("127.0.0.1", 0, lambda: True).start()
    pid, said = probes.proc.pid, []
    try:
        wait_until(lambda: answers(probes.port), 5, "/healthz")  # its event loop runs, with all it needs open
        soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (3, hard))  # stdio only: every accept now fails with EMFILE
        with socket.create_connection(("127.0.0.1", probes.port)):
            wait_until(lambda: said.append(capfd.readouterr().err) or "cannot accept" in "".join(said), 5, "an error")
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
            wait_until(lambda: answers(probes.port), 5, "/healthz once descriptors are free")
        assert probes.proc.pid == pid
    finally:
        probes.stop()


def _status_of_head(port: int, head: bytes, pieces: int) -> int | None:
    """The status the probe port answers to `head` sent in `pieces` writes (None: it closed without one)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        step = -(-len(head) // pieces)
        for i in range(0, len(head), step):
            s.sendall(head[i : i + step])
        answer = s.recv(65536)
    return int(answer.split(b" ")[1]) if answer else None


@pytest.mark.parametrize("pieces", [1, 2])
@pytest.mark.parametrize("pad", [b"a", b" "], ids=["letters", "spaces"])
def test_a_request_head_over_the_limit_is_refused_however_it_arrives(pieces, pad):
    """The limit holds for the whole head as sent, not only for a head still arriving: one that comes complete
    in one read (h11 bounds only an incomplete one) is refused too, with 431, also when most of it is the
    whitespace h11 strips from a header's value."""
    probes = ProbeServer("127.0.0.1", 0, lambda: True).start()
    try:
        small = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + pad * (MAX_HEAD_BYTES // 2) + b"a\r\n\r\n"
        assert _status_of_head(probes.port, small, pieces) == 200
        big = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + pad * (2 * MAX_HEAD_BYTES) + b"a\r\n\r\n"
        assert _status_of_head(probes.port, big, pieces) == 431
        assert answers(probes.port)  # and the port goes on answering
    finally:
        probes.stop()


def _threads_and_fds(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/status") as f:
        threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    return threads, len(os.listdir(f"/proc/{pid}/fd"))


def _flood(port: int, n: int) -> list[socket.socket]:
    """`n` connections opened at once, as a flood comes; half of them send half a request line, never finished."""
    held = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        held.append(s)
    with selectors.DefaultSelector() as sel:
        for s in held:
            sel.register(s, selectors.EVENT_WRITE)
        for i, (key, _) in enumerate(sel.select(timeout=5)):
            if i % 2:
                key.fileobj.send(b"GET /heal")
    return held


def _none_above(now: tuple[int, ...], then: tuple[int, ...]) -> bool:
    return all(a <= b for a, b in zip(now, then, strict=True))


@pytest.fixture
def room_for_a_flood():
    """This process's soft descriptor limit raised to hold a flood's sockets, and put back afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("cap", [MAX_CONNECTIONS, 50])
def test_healthz_answers_while_a_thousand_connections_are_held_open(cap, room_for_a_flood):
    """A flood of idle and half-sent connections, as a port scanner or a slowloris client makes, must not
    stop the kubelet's probe (it would restart a healthy pod), nor cost a thread or more descriptors than the cap.
    How fast it answers is `benchmarks.probes`' question; here it must answer, within a probe's deadline."""
    probes = ProbeServer("127.0.0.1", 0, lambda: True, max_connections=cap).start()
    held: list[socket.socket] = []
    try:
        assert status(probes.port, "/healthz") == 200
        before = _threads_and_fds(probes.proc.pid)
        held = _flood(probes.port, 1000)
        assert httpx.get(f"http://127.0.0.1:{probes.port}/healthz", timeout=5).status_code == 200  # one try
        threads, fds = _threads_and_fds(probes.proc.pid)
        assert threads <= before[0] and fds <= before[1] + cap + 1
        for s in held:
            s.close()
        held.clear()
        wait_until(lambda: _none_above(_threads_and_fds(probes.proc.pid), before), 10, "threads and fds coming back")
    finally:
        for s in held:
            s.close()
        probes.stop()


def test_a_wrong_method_gets_405_with_allow_and_garbage_a_json_400():
    """As the API port answers them: a method the path lacks is 405 naming the ones it has, and a request that
    is not HTTP gets a JSON error body, not an empty body labelled JSON."""
    probes = ProbeServer("127.0.0.1", 0, lambda: True).start()
    try:
        r = httpx.post(f"http://127.0.0.1:{probes.port}/healthz", timeout=2)
        assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD"
        assert r.json()["error"]["code"] == "method_not_allowed"
        with socket.create_connection(("127.0.0.1", probes.port), timeout=5) as s:
            s.sendall(b"\x16\x03\x01 not HTTP at all\r\n\r\n")  # a TLS hello, say
            head, _, body = s.recv(65536).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 ") and json.loads(body)["error"]["code"] == "malformed_request"
    finally:
        probes.stop()
