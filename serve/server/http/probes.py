"""Health probes on a port of their own, answered by a small process of its own: they hold while the server is
saturated, and liveness fails when the server's event loop stops turning.

Under a thousand busy clients the event loop that serves the API has hundreds of callbacks ready at each
turn, and a probe on the API port waits its turn behind them (`benchmarks.probes`). A thread in
the server process does better but still needs the interpreter lock, which the loop and the batcher hold
most of the time: its p99 was 270 ms under that load on 2 cores (docs/benchmarks/model-server.md). So the
probes are answered by a process that does nothing else (`python -m serve.server.http.probes`, the standard
library only, about 10 MB), which the kernel schedules as soon as a probe arrives.

The server tells it two things through a 16-byte shared file, four times a second: when its event loop
last ran a callback (a thread asks the loop to stamp the time, so a wedged loop stops the stamps), and
whether it is ready. The probe process exits when the server does.

    GET|HEAD /healthz, /v2/health/live     200 while the loop turned within LIVENESS_STALE_S, else 503
    GET|HEAD /readyz, /v2/health/ready     200 when live and ready to take requests, else 503
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger(__name__)

LIVE = {"/healthz": ({"status": "live"}, {"status": "not live"}), "/v2/health/live": ({"live": True}, {"live": False})}
READY = {
    "/readyz": ({"status": "ready"}, {"status": "not ready"}),
    "/v2/health/ready": ({"ready": True}, {"ready": False}),
}
PROBE_TIMEOUT_S = 5.0  # a probe client that sends nothing is dropped after this
BEAT_S = 0.25  # how often the server stamps the shared state
LIVENESS_STALE_S = 10.0  # a loop that has not turned for this long is not live: restart the server
STATE = struct.Struct("dd")  # (time.monotonic() when the loop last turned, 1.0 when ready)


class ProbeServer:
    """Liveness and readiness on `host:port`, answered by a child process from state this process stamps.

    Args:
        host: the interface to bind.
        port: the TCP port (0: any free one; `port` holds the real one after `start`).
        ready: whether the server takes requests now (cheap, called from a thread four times a second).
        loop: returns the event loop that serves the API once it runs (None before): its turning is the
            liveness signal; without it, the process being alive is.
        stale_s: liveness fails once the loop has not turned for this long.
    """

    def __init__(
        self,
        host: str,
        port: int,
        ready: Callable[[], bool],
        loop: Callable[[], object | None] | None = None,
        stale_s: float = LIVENESS_STALE_S,
    ):
        self.host, self.port, self.ready, self.loop, self.stale_s = host, port, ready, loop, stale_s
        fd, self.state_path = tempfile.mkstemp(prefix="vitscope-probes-")
        os.ftruncate(fd, STATE.size)
        self._state = mmap.mmap(fd, STATE.size)
        os.close(fd)
        self._stamp()
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._beat_loop, name="vitscope-probe-beat", daemon=True)
        self.proc: subprocess.Popen | None = None

    def start(self) -> ProbeServer:
        """Start the probe process and the beat; return once the port is bound (RuntimeError if it is not)."""
        args = [self.host, str(self.port), self.state_path, str(os.getpid()), str(self.stale_s)]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "serve.server.http.probes", *args], stdout=subprocess.PIPE, text=True
        )
        line = self.proc.stdout.readline().strip()  # "port N", or why not
        if not line.startswith("port "):
            self.proc.wait(10)
            self._close_state()
            raise RuntimeError(f"the probe port {self.host}:{self.port} did not open: {line or 'the process exited'}")
        self.proc.stdout.close()
        self.port = int(line.split()[1])
        self._beat.start()
        log.info("health probes on port %d (process %d)", self.port, self.proc.pid)
        return self

    def stop(self) -> None:
        self._stop.set()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self._close_state()

    def _stamp(self) -> None:  # on the event loop once it runs: the loop turned just now
        STATE.pack_into(self._state, 0, time.monotonic(), 1.0 if self.ready() else 0.0)

    def _beat_loop(self) -> None:
        while not self._stop.wait(BEAT_S):
            loop = self.loop() if self.loop is not None else None
            if loop is None:
                self._stamp()  # not serving yet (or no loop to watch): the process is alive
                continue
            try:
                loop.call_soon_threadsafe(self._stamp)
            except RuntimeError:  # the loop closed: the server is shutting down
                self._stamp()

    def _close_state(self) -> None:
        try:
            os.unlink(self.state_path)
        except FileNotFoundError:
            pass


class _ProbeHandler(BaseHTTPRequestHandler):
    state: mmap.mmap
    stale_s: float
    timeout = PROBE_TIMEOUT_S
    protocol_version = "HTTP/1.1"  # keep-alive: a prober may reuse its connection
    server_version, sys_version = "vitscope", ""

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        beat, ready = STATE.unpack_from(self.state, 0)
        live = time.monotonic() - beat < self.stale_s
        if path in LIVE:
            self._send(200 if live else 503, LIVE[path][0 if live else 1])
        elif path in READY:
            ok = live and ready == 1.0
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


def _serve(host: str, port: int, state_path: str, parent: int, stale_s: float) -> int:
    """The probe process: bind, say the port on stdout, answer until the server process is gone."""
    with open(state_path, "rb") as f:
        state = mmap.mmap(f.fileno(), STATE.size, access=mmap.ACCESS_READ)
    handler = type("ProbeHandler", (_ProbeHandler,), {"state": state, "stale_s": stale_s})
    try:
        httpd = ThreadingHTTPServer((host, port), handler)
    except OSError as e:
        print(f"{e.strerror or e} (is another process on port {port}?)", flush=True)
        return 1
    httpd.daemon_threads = True

    def orphaned() -> None:  # the server died without stopping us (SIGKILL): go too
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=orphaned, daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the server stops us
    print(f"port {httpd.server_address[1]}", flush=True)
    httpd.serve_forever()
    return 0


if __name__ == "__main__":
    host, port, state_path, parent, stale_s = sys.argv[1:6]
    sys.exit(_serve(host, int(port), state_path, int(parent), float(stale_s)))
