"""`vit-serve` in a child process, for integration tests and benchmarks: started on a free port,
ready once `/readyz` answers 200, always stopped with SIGTERM (the graceful drain) on exit.
`read_response` reads one whole answer from a raw socket, for tests that speak HTTP by hand.

    with ServerProcess("artifacts/sample.onnx", "--no-ui") as server:
        urllib.request.urlopen(server.url + "/readyz")
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path


def read_response(s: socket.socket) -> bytes:
    """One whole HTTP response with a Content-Length from a raw socket: its head and body may arrive in
    separate segments, so one `recv` is not enough."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"the connection closed before a whole response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
    while len(body) < length and (chunk := s.recv(65536)):
        body += chunk
    assert len(body) == length, f"the body is not Content-Length ({length}) bytes: {body!r}"
    return head + b"\r\n\r\n" + body


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m serve.server MODEL --port <free>` with its output collected; a context manager that always stops it.

    Args:
        model: the .onnx file.
        args: extra `vit-serve` options.
        cwd: the child's working directory (relative paths such as `--examples-dir` resolve there).
        env: the child's environment (default: this process's).
        python: the interpreter to run it with (default: this one), e.g. another venv's.
        module: the module that runs the server (`python -m MODULE`); an older tree may name another.
        log_file: write the child's output to this file instead of a pipe read by a thread here (benchmarks:
            reading an access line per request would cost the load generator's process the CPU it measures with).
    """

    def __init__(
        self,
        model: str | Path,
        *args: str,
        cwd: str | Path | None = None,
        env: dict | None = None,
        python: str = sys.executable,
        log_file: str | Path | None = None,
        module: str = "serve.server",
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [python, "-m", module, str(model), "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.log_file = Path(log_file) if log_file is not None else None
        out = open(self.log_file, "w") if self.log_file is not None else subprocess.PIPE
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True, bufsize=1)
        self._lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        if self.log_file is None:
            self._reader.start()
        else:
            out.close()  # the child holds its own copy

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.append(line.rstrip("\n"))

    @property
    def lines(self) -> list[str]:
        """The child's output so far, line by line."""
        if self.log_file is not None:
            return self.log_file.read_text(errors="replace").splitlines()
        return self._lines

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_ready(self, timeout: float = 180.0) -> ServerProcess:
        """Block until `/readyz` answers 200; raise with the server's output if it exits or takes too long."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vit-serve exited with {self.proc.returncode}:\n{self.output}")
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):  # not listening yet, or 503 while warming up
                pass
            time.sleep(0.2)
        raise TimeoutError(f"vit-serve not ready after {timeout} s:\n{self.output}")

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait for the drain (kill after `timeout`); returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self._reader.is_alive():
            self._reader.join(5)
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self.wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()
