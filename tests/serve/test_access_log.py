"""The access log writes every line, in the root handler's format, in bursts through logging's queue listener,
and a request cannot write a line of its own into it."""

from __future__ import annotations

import logging

import httpx

from serve.server.access_log import AccessLog
from tests.helpers import ServerProcess, wait_until


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


def test_a_control_character_in_the_path_cannot_forge_a_line(tiny_onnx):
    forged = '1.2.3.4 "GET /admin" 200 0.1ms id=forged'
    path = "/nowhere%0a%0d" + forged.replace(" ", "%20").replace('"', "%22") + "%1b[2J"
    with ServerProcess(tiny_onnx, "--no-ui") as server:
        rid = httpx.get(server.url + path).headers["x-request-id"]
        line = wait_until(lambda: [x for x in server.output.splitlines() if f"id={rid}" in x], 10, "the access line")
        assert len(line) == 1 and "\\x0a\\x0d1.2.3.4" in line[0] and "\\x1b[2J" in line[0], line
        assert not any(x.startswith(forged) or "\x1b" in x for x in server.output.splitlines())
