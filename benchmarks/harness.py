"""The pieces the side-by-side server benchmarks share: servers in child processes, light load generators,
CPU accounting and the result file.

- `Child`: a server command in a child process, ready once an HTTP URL answers 200 (or a gRPC server is
  ready), always stopped with SIGTERM; its output goes to a file, so that reading it costs this process nothing.
- `http_load`: keep-alive HTTP/1.1 connections posting one prebuilt request back to back (asyncio protocol,
  no parsing beyond the status line and Content-Length): multipart uploads or KServe v2 binary tensors alike.
- `grpc_load`: concurrent unary calls of one prebuilt, already serialized message on one grpc.aio channel.
- `cpu_seconds`: a process tree's user + system CPU time, from /proc.
- `write_result`: `benchmarks/results/NAME.json` (date, machine, command, rows) and the markdown table.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

from benchmarks.serve_bench import LoadConnection
from serve.server.testing import terminate

RESULTS = Path(__file__).resolve().parent / "results"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Child:
    """`cmd` in a child process (its own process group), output to `log`; `wait_ready(url)` polls until 200."""

    def __init__(self, cmd: list[str], log: Path, env: dict | None = None):
        self.cmd, self.log = cmd, log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_ready(self, url: str, timeout: float = 300.0) -> Child:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.cmd[:4]} exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}"
                )
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"{self.cmd[:4]} not ready after {timeout} s:\n{self.log.read_text()[-3000:]}")

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the child, then to whatever else of its session is left (Ray's actors have groups of their
        own); SIGKILL after `timeout`."""
        terminate(self.proc, timeout)
        for pid in session_members(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def session_members(sid: int) -> list[int]:
    """The processes of session `sid` (a child started with `start_new_session` and everything it started)."""
    members = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[3]) == sid:
                members.append(int(entry))
        except OSError:
            continue
    return members


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` and of every process in its session (workers it started)."""
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for member in {pid, *session_members(pid)}:
        try:
            fields = Path(f"/proc/{member}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def multipart_request(path: str, image: bytes, field: str = "file", extra_headers: str = "") -> bytes:
    boundary = "vitscopebench"
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="{field}"; filename="x.png"\r\n'
            "Content-Type: image/png\r\n\r\n"
        ).encode()
        + image
        + f"\r\n--{boundary}--\r\n".encode()
    )
    return http_request(path, body, f"multipart/form-data; boundary={boundary}", extra_headers)


def http_request(path: str, body: bytes, content_type: str, extra_headers: str = "") -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n{extra_headers}"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _http_load(port: int, request: bytes, concurrency: int, seconds: float) -> dict:
    loop = asyncio.get_running_loop()
    stats: dict = {"latencies": [], "errors": 0}
    end, t0 = time.perf_counter() + seconds, time.perf_counter()
    done = []
    for _ in range(concurrency):
        fut = loop.create_future()
        await loop.create_connection(lambda f=fut: LoadConnection(request, end, stats, f), "127.0.0.1", port)
        done.append(fut)
    try:
        await asyncio.wait_for(asyncio.gather(*done), seconds + 60)
    except asyncio.TimeoutError:
        stats["errors"] += sum(not f.done() for f in done)
    return summary(stats, time.perf_counter() - t0)


async def _grpc_load(target: str, method: str, message: bytes, concurrency: int, seconds: float) -> dict:
    import grpc

    stats: dict = {"latencies": [], "errors": 0}
    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.unary_unary(method)  # bytes in, bytes out: no (de)serialisation on this side
        end, t0 = time.perf_counter() + seconds, time.perf_counter()

        async def worker():
            while time.perf_counter() < end:
                started = time.perf_counter()
                try:
                    await call(message, timeout=30)
                    stats["latencies"].append(time.perf_counter() - started)
                except grpc.aio.AioRpcError:
                    stats["errors"] += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return summary(stats, time.perf_counter() - t0)


def summary(stats: dict, wall: float) -> dict:
    lat = np.asarray(stats["latencies"]) * 1000.0
    n = len(lat)
    p50, p99 = (float(np.percentile(lat, 50)), float(np.percentile(lat, 99))) if n else (0.0, 0.0)
    return {"requests": n, "errors": stats["errors"], "rps": n / wall, "p50": p50, "p99": p99}


def run(coro):
    """On uvloop where installed: less CPU for the load generator, which shares the cores with the servers."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def http_load(port: int, request: bytes, concurrency: int, seconds: float) -> dict:
    """`concurrency` keep-alive connections posting `request` back to back for `seconds`."""
    return run(_http_load(port, request, concurrency, seconds))


def grpc_load(target: str, method: str, message: bytes, concurrency: int, seconds: float) -> dict:
    """`concurrency` concurrent unary calls of the serialized `message` for `seconds` (asyncio's own loop: grpc.aio
    needs it)."""
    return asyncio.run(_grpc_load(target, method, message, concurrency, seconds))


def measured(load, pid: int) -> dict:
    """`load()` and the server's CPU time per answered request over it (µs)."""
    cpu0 = cpu_seconds(pid)
    out = load()
    out["cpu_us"] = (cpu_seconds(pid) - cpu0) / max(1, out["requests"]) * 1e6
    return out


def header() -> dict:
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()}-core {platform.machine()} ({platform.platform()})",
        "python": platform.python_version(),
        "command": " ".join([Path(sys.executable).name, "-m", *sys.argv]).replace(sys.argv[0], _module_name()),
    }


def _module_name() -> str:
    path = Path(sys.argv[0]).resolve()
    return f"benchmarks.{path.stem}" if path.parent == RESULTS.parent else sys.argv[0]


def write_result(name: str, head: dict, rows: list[dict], columns: list[tuple[str, str]]) -> None:
    """`benchmarks/results/NAME.json` and a markdown table of `columns` ((key, title) pairs) on stdout."""
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps({**head, "rows": rows}, indent=2) + "\n")
    print(f"# {name}: {head['machine']}, {head['date']}\n\n`{head['command']}`\n")
    print("| " + " | ".join(title for _, title in columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(_cell(row.get(key)) for key, _ in columns) + " |")


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"
    return "" if value is None else str(value)
