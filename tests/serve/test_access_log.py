"""The access log writes every line, in the root handler's format, in bursts through logging's queue listener,
and a request cannot write a line of its own into it."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from serve.server.access_log import AccessLog
from tests.helpers import ServerProcess, free_port, png_bytes, quadrant_images, wait_until


def test_every_line_reaches_the_root_handlers_file_in_its_format_once_the_log_stops(tmp_path):
    path = tmp_path / "server.log"
    root = logging.getLogger()
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    saved, level = root.handlers[:], root.level
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)  # setLevel, not .level: loggers cache whether INFO is on
    try:
        access = AccessLog()
        for i in range(500):
            access.write("127.0.0.1", "POST", "/v1/classify", 200, 1.25, f"id{i}")
        access.stop()
    finally:
        root.handlers[:] = saved
        root.setLevel(level)
        handler.close()
    lines = path.read_text().splitlines()
    assert lines == [f'INFO vitscope.access: 127.0.0.1 "POST /v1/classify" 200 1.2ms id=id{i}' for i in range(500)]


class StuckHandler(logging.Handler):
    """A log that cannot be written while `stuck` is set (a full pipe nobody reads), then keeps what it gets."""

    def __init__(self):
        super().__init__()
        self.stuck, self.lines = threading.Event(), []
        self.stuck.set()

    def emit(self, record: logging.LogRecord) -> None:
        while self.stuck.is_set():
            time.sleep(0.01)
        self.lines.append(record.getMessage())


def test_a_log_that_cannot_be_written_holds_a_bounded_queue_and_says_what_it_dropped():
    """stderr into a pipe nobody read: every request's line waited in memory, 0.5 kB a request for ever."""
    root, handler = logging.getLogger(), StuckHandler()
    saved, level = root.handlers[:], root.level
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    try:
        access = AccessLog(max_lines=100)
        for i in range(1000):
            access.write("127.0.0.1", "GET", "/healthz", 200, 0.1, f"id{i}")
        assert access.queue.qsize() <= 100
        handler.stuck.clear()
        access.stop()
    finally:
        root.handlers[:] = saved
        root.setLevel(level)
    dropped = [line for line in handler.lines if "dropped" in line]
    written = len(handler.lines) - len(dropped)
    # one note, or a few when the listener wrote one as the queue filled: together they count every line lost
    assert dropped and sum(int(line.split()[0].replace(",", "")) for line in dropped) == 1000 - written, dropped


@pytest.fixture(scope="module")
def server(tiny_onnx):
    with ServerProcess(tiny_onnx, "--no-ui") as server:
        yield server


def access_line(server: ServerProcess, path: str) -> str:
    """The one access-log line of a GET of `path`."""
    rid = httpx.get(server.url + path, timeout=30).headers["x-request-id"]
    lines = wait_until(lambda: [x for x in server.output.splitlines() if f"id={rid}" in x], 10, "the access line")
    assert len(lines) == 1, lines
    return lines[0]


def test_a_control_character_in_the_path_cannot_forge_a_line(server):
    forged = '1.2.3.4 "GET /admin" 200 0.1ms id=forged'
    line = access_line(server, "/nowhere%0a%0d" + forged.replace(" ", "%20").replace('"', "%22") + "%1b[2J")
    assert "\\x0a\\x0d1.2.3.4" in line and "\\x1b[2J" in line, line
    assert not any(x.startswith(forged) or "\x1b" in x for x in server.output.splitlines())


def test_a_quote_or_a_backslash_in_the_path_cannot_change_the_line(server):
    """A `"` would close the quoted request field early, and a literal backslash makes `\\x0a` in a URL read as
    an escaped newline: both are written as `\\xNN` too, so the line parses one way only."""
    line = access_line(server, "/nowhere%22%20200%20%5Cx0a")
    assert '"GET /nowhere\\x22 200 \\x5cx0a" 404' in line and line.count('"') == 2, line


def test_a_stalled_log_never_stops_the_server_answering(tiny_onnx, tmp_path):
    """Every log line but the access log's was written on the event loop: with stdout and stderr piped to a reader
    that stopped, about 1,500 malformed requests (uvicorn warns of each) filled the pipe, and the next write
    blocked the loop, so that /healthz and every request after it hung."""
    port = free_port()
    args = [sys.executable, "-m", "serve.server", str(tiny_onnx), "--no-ui", "--port", str(port)]
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the UI's folder, which a killed server cannot delete
    child = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)  # a pipe nobody reads
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: healthy(url), 60, "the server up")
        for _ in range(3000):  # about 100 kB of warnings: more than a pipe's 64 kB
            with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
                c.sendall(b"NOT HTTP\r\n\r\n")
                assert c.recv(100).startswith(b"HTTP/1.1 400"), "a malformed request went unanswered"
        assert httpx.get(url + "/healthz", timeout=5).status_code == 200
        image = {"file": ("a.png", png_bytes(quadrant_images(1)[0][0]), "image/png")}
        assert httpx.post(url + "/v1/classify", files=image, timeout=10).status_code == 200
    finally:
        child.kill()
        child.wait()
        child.stdout.close()


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
