"""Health probes on a port of their own, answered by a small process of its own: they hold while the server is
saturated, and liveness fails when the server's event loop stops turning.

Under a thousand busy clients the event loop that serves the API has hundreds of callbacks ready at each
turn, and a probe on the API port waits its turn behind them (`benchmarks.probes`). A thread in
the server process does better but still needs the interpreter lock, which the loop and the batcher hold
most of the time (BENCHMARKS.md, "/healthz under 1,000 busy clients"). So the
probes are answered by a process that does nothing else (`python -m serve.server.http.probes`, the standard
library and h11 (uvicorn's HTTP/1.1 parser), about 10 MB), which the kernel schedules as soon as a probe
arrives.

Its bounds, so that no flood of connections makes a kubelet restart a healthy pod: one asyncio event loop and
no thread per connection; at most `max_connections` open connections (`--probe-max-connections`), and at the
cap the oldest is closed for the newest, so a prober's fresh connection is always answered; a connection that
has not sent a whole request within PROBE_TIMEOUT_S of connecting (or of its last answer) is closed; a request
head past MAX_HEAD_BYTES is refused; a client that reads no answers is no longer read. The process raises
its soft descriptor limit to fit the cap, within the hard limit (the cap shrinks to fit when it cannot).

The server tells it two things through a 16-byte shared file with no name (so nothing is left behind, however
the server ends), four times a second: when its event loop last ran a callback (a thread asks the loop to stamp
the time, so a wedged loop stops the stamps), and whether it is ready. The probe process exits when the server
does (it ignores SIGINT and SIGTERM, which a stop may send to the whole process group: the server, draining,
stops it last), and the server starts another on the same port when it dies (the OOM killer, a kill); a failed
accept (out of descriptors, a connection reset before it was accepted) is logged and skipped,
never the end of the process.

    GET|HEAD /healthz, /v2/health/live     200 while the loop turned within LIVENESS_STALE_S, else 503
    GET|HEAD /readyz, /v2/health/ready     200 when live and ready to take requests, else 503
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import mmap
import os
import resource
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from http import HTTPStatus

import h11

log = logging.getLogger(__name__)

LIVE = {"/healthz": ({"status": "live"}, {"status": "not live"}), "/v2/health/live": ({"live": True}, {"live": False})}
READY = {
    "/readyz": ({"status": "ready"}, {"status": "not ready"}),
    "/v2/health/ready": ({"ready": True}, {"ready": False}),
}
PROBE_TIMEOUT_S = 2.0  # a connection that has not sent a whole request within this is dropped
MAX_CONNECTIONS = 1024  # connections held at once; at the cap the oldest is closed for the newest
MAX_HEAD_BYTES = 8192  # a request line and headers past this are refused
MAX_PIPELINED = 16  # requests answered from one read; a client that sends more before reading is dropped
BACKLOG = 1024  # connections the kernel queues before we accept them: a flood waits there, costing no descriptor
FD_RESERVE = 32  # descriptors beside the connections: the listening socket, the event loop, stdio
BEAT_S = 0.25  # how often the server stamps the shared state
LIVENESS_STALE_S = 10.0  # a loop that has not turned for this long is not live: restart the server
RESTART_BACKOFF_S = 1.0  # a probe process that failed to start is tried again after this
ACCEPT_BACKOFF_S = 0.1  # out of descriptors: wait this long before the next accept, rather than spin
ERROR_LOG_S = 1.0  # accept errors are logged at most once per this
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
        max_connections: connections the probe process holds at once; at the cap it closes the oldest.
    """

    def __init__(
        self,
        host: str,
        port: int,
        ready: Callable[[], bool],
        loop: Callable[[], object | None] | None = None,
        stale_s: float = LIVENESS_STALE_S,
        max_connections: int = MAX_CONNECTIONS,
    ):
        self.host, self.port, self.ready, self.loop, self.stale_s = host, port, ready, loop, stale_s
        self.max_connections = max_connections
        # shared with the probe process by descriptor, never by name: the file has none, so a server killed by
        # anything (SIGKILL, the OOM killer) leaves nothing behind
        self._state_file = tempfile.TemporaryFile(prefix="vitscope-probes-")
        os.ftruncate(self._state_file.fileno(), STATE.size)
        self._state = mmap.mmap(self._state_file.fileno(), STATE.size)
        self._stamp()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one of stop and a restart at a time
        self._beat = threading.Thread(target=self._beat_loop, name="vitscope-probe-beat", daemon=True)
        self.proc: subprocess.Popen | None = None

    def start(self) -> ProbeServer:
        """Start the probe process and the beat; return once the port is bound (RuntimeError if it is not)."""
        try:
            self._spawn()
        except RuntimeError:
            self._close_state()
            raise
        self._stamp()  # the stale time counts from now: a start slowed by a busy machine is not a dead loop
        self._beat.start()
        log.info("health probes on port %d (process %d)", self.port, self.proc.pid)
        return self

    def stop(self) -> None:
        with self._lock:  # not while the beat starts another process
            self._stop.set()
            if self.proc is not None and self.proc.poll() is None:
                self.proc.kill()  # it ignores SIGTERM (`_serve`), and has nothing to save
                self.proc.wait(10)
        self._close_state()

    def _spawn(self) -> None:
        """Start a probe process on `self.port`; once it has bound the port, `self.port` is the real one."""
        fd = self._state_file.fileno()
        args = [self.host, str(self.port), str(fd), str(os.getpid()), str(self.stale_s), str(self.max_connections)]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "serve.server.http.probes", *args], stdout=subprocess.PIPE, text=True, pass_fds=[fd]
        )
        line = self.proc.stdout.readline().strip()  # "port N", or why not
        self.proc.stdout.close()
        if not line.startswith("port "):
            self.proc.wait(10)
            raise RuntimeError(f"the probe port {self.host}:{self.port} did not open: {line or 'the process exited'}")
        self.port = int(line.split()[1])

    def _restart(self) -> None:
        """The probe process died (the OOM killer, a stray kill, a bug): every probe would fail until the kubelet
        restarted this healthy pod, so start another on the same port."""
        with self._lock:
            if self._stop.is_set():
                return
            log.error("the probe process %d exited (%s): starting another", self.proc.pid, self.proc.returncode)
            try:
                self._spawn()
            except RuntimeError as e:
                log.error("%s; trying again in %g s", e, RESTART_BACKOFF_S)
                self._stop.wait(RESTART_BACKOFF_S)
                return
        log.info("health probes on port %d again (process %d)", self.port, self.proc.pid)

    def _stamp(self) -> None:  # on the event loop once it runs: the loop turned just now
        STATE.pack_into(self._state, 0, time.monotonic(), 1.0 if self.ready() else 0.0)

    def _beat_loop(self) -> None:
        while not self._stop.wait(BEAT_S):
            self._beat_once()
            if self.proc.poll() is not None:
                self._restart()

    def _beat_once(self) -> None:
        loop = self.loop() if self.loop is not None else None
        if loop is None:
            self._stamp()  # not serving yet (or no loop to watch): the process is alive
            return
        try:
            loop.call_soon_threadsafe(self._stamp)
        except RuntimeError:  # the loop closed: the server is shutting down
            self._stamp()

    def _close_state(self) -> None:  # the mapping stays: a beat already queued on the loop may still stamp it
        self._state_file.close()


def _answer(method: bytes, target: bytes, state: mmap.mmap, stale_s: float) -> tuple[int, dict]:
    """The status and JSON body for one probe request, from the state the server last stamped."""
    if method not in (b"GET", b"HEAD"):
        return 405, {"error": {"code": "method_not_allowed", "message": "the probe port answers GET and HEAD only"}}
    path = target.split(b"?", 1)[0].decode("ascii", "replace")
    beat, ready = STATE.unpack_from(state, 0)
    live = time.monotonic() - beat < stale_s
    if path in LIVE:
        return (200 if live else 503), LIVE[path][0 if live else 1]
    if path in READY:
        ok = live and ready == 1.0
        return (200 if ok else 503), READY[path][0 if ok else 1]
    return 404, {"error": {"code": "not_found", "message": f"the probe port answers {[*LIVE, *READY]}"}}


class _ProbeConnection(asyncio.Protocol):
    """One probe connection: HTTP/1.1 parsed by h11 (keep-alive and pipelining included), dropped when it has
    not sent a whole request within PROBE_TIMEOUT_S of connecting or of its last answer."""

    def __init__(self, open_connections: dict, state: mmap.mmap, stale_s: float):
        self.open, self.state, self.stale_s = open_connections, state, stale_s
        self.http = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.open[self] = None
        self.deadline = asyncio.get_running_loop().call_later(PROBE_TIMEOUT_S, transport.abort)

    def connection_lost(self, exc: Exception | None) -> None:
        self.deadline.cancel()
        self.open.pop(self, None)

    def pause_writing(self) -> None:  # a client that sends requests but reads no answers: stop reading it
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        self.http.receive_data(data)
        answered = 0  # one read of 256 KiB held ~8,000 pipelined requests: answering them all stalled the loop
        try:
            while True:
                unread = len(self.http.trailing_data[0])
                if (event := self.http.next_event()) is h11.NEED_DATA:
                    break
                # the head's bytes as sent (h11 bounds only a head still arriving, and strips what it parses)
                if isinstance(event, h11.Request) and unread - len(self.http.trailing_data[0]) > MAX_HEAD_BYTES:
                    raise h11.RemoteProtocolError("request head too large", error_status_hint=431)
                if isinstance(event, h11.Request) and answered == MAX_PIPELINED:
                    self.transport.close()  # what was answered is still sent
                    return
                if isinstance(event, h11.Request):
                    self._respond(event)  # a body, if any, is read and ignored
                    answered += 1
                elif isinstance(event, h11.EndOfMessage):
                    if not self._next_cycle():
                        return
                elif event is h11.PAUSED or isinstance(event, h11.ConnectionClosed):
                    self.transport.close()
                    return
        except h11.RemoteProtocolError as e:  # not HTTP, or a head past MAX_HEAD_BYTES
            if self.http.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                code = "headers_too_large" if e.error_status_hint == 431 else "malformed_request"
                self._send(e.error_status_hint, json.dumps({"error": {"code": code, "message": str(e)}}).encode())
            self.transport.close()

    def _respond(self, request: h11.Request) -> None:
        status, body = _answer(request.method, request.target, self.state, self.stale_s)
        self._send(status, json.dumps(body).encode(), head=request.method == b"HEAD")

    def _send(self, status: int, data: bytes, head: bool = False) -> None:
        """Write one answer; to HEAD, its headers only (h11 frames a HEAD answer without a body)."""
        headers = [("content-type", "application/json"), ("content-length", str(len(data))), ("server", "vitscope")]
        if status == 405:
            headers.append(("allow", "GET, HEAD"))
        out = self.http.send(h11.Response(status_code=status, headers=headers, reason=HTTPStatus(status).phrase))
        if data and not head:
            out += self.http.send(h11.Data(data=data))
        self.transport.write(out + self.http.send(h11.EndOfMessage()))

    def _next_cycle(self) -> bool:
        """After an answer: wait for the next request on this connection (True), or close it (False)."""
        if self.http.our_state is not h11.DONE or self.http.their_state is not h11.DONE:
            self.transport.close()  # HTTP/1.0 or "connection: close"
            return False
        self.http.start_next_cycle()
        self.deadline.cancel()
        self.deadline = asyncio.get_running_loop().call_later(PROBE_TIMEOUT_S, self.transport.abort)
        return True


async def _accept(sock: socket.socket, state: mmap.mmap, stale_s: float, cap: int, parent: int) -> None:
    """Accept connections one at a time; at `cap` open ones, close the oldest first, so that a flood never
    holds more than `cap` descriptors and the newest connection (the prober's) is always answered.

    A failed accept never ends the loop (it would end the process): a connection reset before it was accepted
    is skipped, and out of descriptors or buffers (EMFILE, ENFILE, ENOBUFS, ENOMEM) the oldest connection is
    closed and the loop waits ACCEPT_BACKOFF_S before the next try, the queued connections staying in the
    kernel's backlog meanwhile."""
    loop = asyncio.get_running_loop()
    open_connections: dict[_ProbeConnection, None] = {}  # oldest first
    loop.create_task(_exit_when_orphaned(parent))
    sock.setblocking(False)
    errors = _ErrorLog()
    while True:
        conn = None
        try:
            conn, _ = await loop.sock_accept(sock)
            while len(open_connections) >= cap:
                _close_oldest(open_connections)
            await loop.connect_accepted_socket(lambda: _ProbeConnection(open_connections, state, stale_s), conn)
        except OSError as e:
            if conn is not None:
                conn.close()
            errors.note(e)
            if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                if open_connections:
                    _close_oldest(open_connections)
                await asyncio.sleep(ACCEPT_BACKOFF_S)


def _close_oldest(open_connections: dict[_ProbeConnection, None]) -> None:
    oldest = next(iter(open_connections))
    del open_connections[oldest]
    oldest.transport.abort()


class _ErrorLog:
    """Logs accept errors at most once per ERROR_LOG_S, with how many there were since the last line: a flood
    that keeps failing must not flood the log too."""

    def __init__(self):
        self.last, self.count = -ERROR_LOG_S, 0

    def note(self, e: OSError) -> None:
        self.count += 1
        now, n = time.monotonic(), self.count
        if now - self.last >= ERROR_LOG_S:
            log.warning("probe port: cannot accept a connection (%s); %d such errors since the last line", e, n)
            self.last, self.count = now, 0


async def _exit_when_orphaned(parent: int) -> None:  # the server died without stopping us (SIGKILL): go too
    while os.getppid() == parent:
        await asyncio.sleep(0.5)
    os._exit(0)


def _fd_budget(cap: int) -> int:
    """Raise this process's soft descriptor limit to fit `cap` connections where the hard limit allows, and
    return the cap that fits."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = cap + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < want:
        soft = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return cap if soft == resource.RLIM_INFINITY else max(1, min(cap, soft - FD_RESERVE))


def _serve(host: str, port: int, state_fd: int, parent: int, stale_s: float, max_connections: int) -> int:
    """The probe process: bind, say the port on stdout, answer until the server process is gone."""
    state = mmap.mmap(state_fd, STATE.size, access=mmap.ACCESS_READ)
    os.close(state_fd)  # the mapping keeps the state: one descriptor more for the connections
    cap = _fd_budget(max_connections)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, backlog=BACKLOG)
    except OSError as e:
        print(f"{e.strerror or e} (is another process on port {port}?)", flush=True)
        return 1
    # Ctrl-C, and systemd's stop (SIGTERM), reach the whole process group: the server stops us once it has drained
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(f"port {sock.getsockname()[1]}", flush=True)
    asyncio.run(_accept(sock, state, stale_s, cap, parent))
    return 0


if __name__ == "__main__":
    host, port, state_fd, parent, stale_s, max_connections = sys.argv[1:7]
    sys.exit(_serve(host, int(port), int(state_fd), int(parent), float(stale_s), int(max_connections)))
