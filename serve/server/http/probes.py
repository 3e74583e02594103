"""Health probes on a port of their own, answered from a thread: they hold while the event loop is saturated.

Under a thousand busy clients the event loop that serves the API has hundreds of callbacks ready at each
turn, and a probe on the API port waits its turn behind them (BENCHMARKS.md, hostile clients). This server
reads no request body and runs no user code: a thread of its own parses the request line, reads two
attributes and answers, so it needs the interpreter for microseconds at a time, not a turn of the loop.
Overload on the API port is still shed there, with 503 and Retry-After.

    GET|HEAD /healthz, /v2/health/live     200 while the process runs
    GET|HEAD /readyz, /v2/health/ready     200 when ready to take requests, else 503
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger(__name__)

LIVE = {"/healthz": {"status": "live"}, "/v2/health/live": {"live": True}}
READY = {
    "/readyz": ({"status": "ready"}, {"status": "not ready"}),
    "/v2/health/ready": ({"ready": True}, {"ready": False}),
}
PROBE_TIMEOUT_S = 5.0  # a probe client that sends nothing is dropped after this


class ProbeServer:
    """Liveness and readiness on `host:port` from a daemon thread; `ready()` is read on each readiness probe.

    Args:
        host: the interface to bind.
        port: the TCP port (0: any free one; `port` holds the real one after `start`).
        ready: whether the server takes requests now (cheap, called from the probe thread).
    """

    def __init__(self, host: str, port: int, ready: Callable[[], bool]):
        handler = type("ProbeHandler", (_ProbeHandler,), {"ready": staticmethod(ready)})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="vitscope-probes", daemon=True)

    def start(self) -> ProbeServer:
        self.thread.start()
        log.info("health probes on port %d", self.port)
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _ProbeHandler(BaseHTTPRequestHandler):
    ready: Callable[[], bool]
    timeout = PROBE_TIMEOUT_S
    protocol_version = "HTTP/1.1"  # keep-alive: a prober may reuse its connection
    server_version, sys_version = "vitscope", ""

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path in LIVE:
            self._send(200, LIVE[path])
        elif path in READY:
            ok = self.ready()
            self._send(200 if ok else 503, READY[path][0 if ok else 1])
        else:
            self._send(404, {"error": {"code": "not_found", "message": f"the probe port answers {[*LIVE, *READY]}"}})

    def do_HEAD(self) -> None:
        self.do_GET()

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def log_message(self, format: str, *args) -> None:  # probes every few seconds: no access line for each
        pass
