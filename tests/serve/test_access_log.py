"""The access log writes every line, in the root handler's format, in bursts through logging's queue listener."""

from __future__ import annotations

import logging

from serve.server.access_log import AccessLog


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
