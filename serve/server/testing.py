"""What tests and benchmarks need to drive a real server: `vit-serve` in a child process, a local Ray
cluster, PNG bytes and a hostile GIF, the Prometheus text and a payload log read back, a process's memory
and CPU time, and a poll under a deadline. The server never imports it; it uses the standard library, numpy
and Pillow only, so it runs in the `[serve]`-only install too.

    with ServerProcess("artifacts/sample.onnx", "--no-ui") as server:
        urllib.request.urlopen(server.url + "/readyz")
        server.metric("vitscope_queue_depth")

`ServerProcess` starts the server on a free port, is ready once `/readyz` answers 200, and always stops it
with SIGTERM (the graceful drain) on exit.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
from PIL import Image

from serve.runtime import ports

T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Call `condition` until it returns something true, and return that; raise TimeoutError naming `what`
    after `timeout` seconds. An exception from `condition` ends the wait at once (it is not retried)."""
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout:g} s: {what}")
        time.sleep(interval)
    return result


def json_lines(path: Path) -> list[dict]:
    """The records of a JSON-lines file that another process may be appending to, [] before it exists.
    Only lines that end in a newline count: a reader can see a line in part while it is written (even one
    write() reaches a reader in two pieces when it crosses a page boundary), as log shippers know."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


def png_bytes(pixels: np.ndarray, mode: str | None = None) -> bytes:
    """`pixels` ((H, W, 3), (H, W, 4) or (H, W) uint8) encoded as PNG."""
    buf = io.BytesIO()
    Image.fromarray(pixels, mode).save(buf, format="PNG")
    return buf.getvalue()


def noise_png(seed: int = 0, size: tuple[int, int] = (48, 40)) -> bytes:
    """A PNG of random RGB pixels, `size` (H, W): a valid upload that needs no data set."""
    return png_bytes(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8))


def tiny_gif(width: int = 65535, height: int = 610) -> bytes:
    """A valid GIF of 35 bytes: a `width` x `height` screen (40 MP by default) holding a 1 x 1 frame."""
    screen = struct.pack("<HHBBB", width, height, 0x80, 0, 0) + b"\x00\x00\x00\xff\xff\xff"  # 2-colour palette
    frame = b"," + struct.pack("<HHHHB", 0, 0, 1, 1, 0) + b"\x02\x02\x44\x01\x00;"
    return b"GIF89a" + screen + frame


def rss_mib(pid: int) -> float:
    """The resident memory of process `pid` now, in MiB (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise ProcessLookupError(f"no VmRSS for process {pid}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def read_metric(text: str, name: str, *, default: float | None = None, **labels: str) -> float:
    """The sum of the samples of metric `name` with these labels in a Prometheus text exposition.

    Raises:
        LookupError: no sample matches and `default` is None (a misspelt or renamed metric must not read as 0).
    """
    found = []
    quote = lambda v: v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')  # as the text format does
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if (head == name or head.startswith(name + "{")) and all(
            f'{k}="{quote(v)}"' in head for k, v in labels.items()
        ):
            found.append(float(value))
    if not found:
        if default is not None:
            return default
        raise LookupError(f"no sample of {name} with labels {labels} in the metrics")
    return sum(found)


_GIVEN: set[int] = set()  # the ports `free_port` handed out


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, and never one this process was given before: two
    calls before either server binds (a gRPC port, then the HTTP one) could otherwise get the same port."""
    while True:
        port = ports.free_port()
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def terminate(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    """SIGTERM `proc` unless it has exited, wait up to `timeout` for it (SIGKILL after); returns its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


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
        self._markers = itertools.count()
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

    def wait_for_output(self, text: str, timeout: float = 10.0) -> str:
        """The output once it holds `text`: a line the child has written may not have been read here yet. Raises
        with the output's end once `timeout` runs out, or at once when the child has exited and all is read."""

        def holds() -> str | None:
            if text in (output := self.output):
                return output
            if self.proc.poll() is not None and not self._reader.is_alive():
                raise RuntimeError(f"vit-serve exited with {self.proc.returncode} without writing {text!r}")
            return None

        try:
            return wait_until(holds, timeout, f"{text!r} in the output")
        except (TimeoutError, RuntimeError) as e:
            raise type(e)(f"{e}; its output ends:\n{self.output[-3000:]}") from None

    def caught_up(self) -> str:
        """The output once every line the server wrote before this call is read: a `/healthz` with an ID of its
        own, and its access line waited for (the server writes its log lines in order, on one thread). A check
        that a line is *not* there reads this, not `output`."""
        marker = f"caught-up-{next(self._markers)}"
        req = urllib.request.Request(self.url + "/healthz", headers={"x-request-id": marker})
        with urllib.request.urlopen(req, timeout=30):
            pass
        return self.wait_for_output(f"id={marker}", 30)

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"vit-serve exited with {self.proc.returncode}:\n{self.output}")
        try:
            with urllib.request.urlopen(self.url + "/readyz", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):  # not listening yet, or 503 while warming up
            return False

    def wait_ready(self, timeout: float = 180.0) -> ServerProcess:
        """Block until `/readyz` answers 200; raise with the server's output if it exits or takes too long."""
        try:
            wait_until(self._ready, timeout, "vit-serve answering /readyz with 200", interval=0.2)
        except TimeoutError as e:
            raise TimeoutError(f"{e}\n{self.output}") from None
        return self

    def metrics(self, headers: dict | None = None) -> str:
        """The text of `/metrics` now."""
        req = urllib.request.Request(self.url + "/metrics", headers=headers or {})
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.read().decode()

    def metric(self, name: str, *, default: float | None = None, **labels: str) -> float:
        """One metric read from `/metrics` now (`read_metric`: a missing one raises unless `default` is given)."""
        return read_metric(self.metrics(), name, default=default, **labels)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait for the drain (kill after `timeout`); returns the exit code."""
        terminate(self.proc, timeout)
        if self._reader.is_alive():
            self._reader.join(5)
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self.wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()


RAY_ADDRESS = re.compile(r"ray start --address='([0-9.]+:[0-9]+)'")


def ray_node_ip(i: int) -> str:
    """The loopback address of node `i` (127.0.0.1 itself is the one address Ray will not keep)."""
    return f"127.0.0.{i + 2}"


class LocalRayCluster:
    """`nodes` Ray nodes on this machine (the first is the head, on a free port), each with `cpus_per_node` CPUs.

        with LocalRayCluster(nodes=2, cpus_per_node=1) as cluster:
            ServerProcess(model, "--ray", "--ray-address", cluster.address, ...)

    Each `ray start --block` runs in a session of its own, and stopping sends SIGKILL to exactly those
    sessions' process groups: `ray stop` would stop every Ray process on the machine, other users' too.
    Every node gets a loopback address of its own (127.0.0.2, 127.0.0.3, ...): Ray replaces 127.0.0.1 with
    the machine's network address, and the traffic stays on loopback. The dashboard is off and the object
    store small, as befits a small shared machine. Token authentication is off (RAY_AUTH_MODE=disabled, also
    for the processes started while the cluster runs): once any local `ray.init()` has written
    ~/.ray/auth_token, `ray start` would turn it on, and a driver joining by address would then be refused.
    """

    def __init__(self, nodes: int = 2, cpus_per_node: float = 1):
        self.nodes, self.cpus = nodes, cpus_per_node
        self.tmp = tempfile.mkdtemp(prefix="vray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
        self.procs: list[subprocess.Popen] = []
        self.address: str | None = None
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
        self._auth_mode = os.environ.get("RAY_AUTH_MODE")

    def _start(self, *args: str, log: str) -> subprocess.Popen:
        ray = str(Path(sys.executable).with_name("ray"))
        common = ["--num-cpus", str(self.cpus), "--disable-usage-stats", "--block"]
        with open(os.path.join(self.tmp, log), "w") as out:
            proc = subprocess.Popen(
                [ray, "start", *args, *common],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=self.env,
            )
        self.procs.append(proc)
        return proc

    def _head_address(self) -> str | None:
        found = RAY_ADDRESS.search(Path(self.tmp, "head.log").read_text())
        if not found and self.procs[0].poll() is not None:
            raise RuntimeError(f"ray head exited:\n{self.log('head.log')}")
        return found and found.group(1)

    def start(self, timeout: float = 120.0) -> LocalRayCluster:
        os.environ["RAY_AUTH_MODE"] = "disabled"  # drivers started from here join without a token
        head_args = ["--head", "--port=0", f"--node-ip-address={ray_node_ip(0)}", "--include-dashboard=false"]
        head_args += ["--temp-dir", self.tmp]
        self._start(*head_args, "--object-store-memory", str(100 * 2**20), log="head.log")
        self.address = wait_until(self._head_address, timeout, "the ray head printing its address", interval=0.5)
        for i in range(1, self.nodes):
            node = ["--address", self.address, f"--node-ip-address={ray_node_ip(i)}"]
            self._start(*node, "--object-store-memory", str(80 * 2**20), log=f"node{i}.log")
        return self

    def log(self, name: str) -> str:
        return Path(self.tmp, name).read_text(errors="replace")

    def stop(self) -> None:
        """SIGKILL the process groups of the nodes started here (the head last), then remove the temp dir. Ray's
        worker processes, each in a process group of its own within its node's session, exit with their raylet."""
        for proc in reversed(self.procs):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(30)
        shutil.rmtree(self.tmp, ignore_errors=True)
        if self._auth_mode is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = self._auth_mode

    def __enter__(self) -> LocalRayCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
