"""What the server benchmarks share: peers in child processes, the load generators, CPU accounting, and the
model and image they serve. `vit-serve` itself runs as `serve.server.testing.ServerProcess`.

`http_load` keeps connections posting one prebuilt request back to back (an asyncio protocol on uvloop, no
parsing beyond the status line and Content-Length), and reports its own CPU per request too, since it shares the
cores with the server; `grpc_load` is its counterpart through `grpc.aio`. `measured` adds the server's CPU time
(its whole session) per answered request.
"""

from __future__ import annotations

import asyncio
import http.client
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np

from serve.server.testing import cpu_seconds, noise_png, rss_mib, terminate, wait_until

# --- what is served --------------------------------------------------------------------------------------


def sample_image(data_dir: Path, size: tuple[int, int]) -> bytes:
    """PNG bytes of one sample image (a digit when the sample data exists, else noise of `size`)."""
    files = sorted(data_dir.glob("*/*.png")) if data_dir.is_dir() else []
    return files[0].read_bytes() if files else noise_png(0, size)


def random_model_file(variant: str, data_dir: Path, out_dir: Path, target: str = "onnxruntime") -> Path:
    """A vitscope .onnx of `variant` (for `target`) with random weights and one class per folder of `data_dir`."""
    import torch

    import vit
    from serve.export.cli import export_onnx
    from serve.runtime.images import Preprocess
    from train.checkpoint_format import META_KEY

    classes = sorted(p.name for p in data_dir.iterdir() if p.is_dir())
    torch.manual_seed(0)
    net = vit.create_model(variant, num_classes=len(classes))
    meta = {
        "model_config": dict(net.config),
        "class_names": classes,
        "preprocess": Preprocess(tuple(net.patch_embed.img_size)).to_dict(),
        "weights_prefix": "net.",
        "variant": variant,
    }
    ckpt = out_dir / f"{variant}.ckpt"
    torch.save({"state_dict": {f"net.{k}": v for k, v in net.state_dict().items()}, META_KEY: meta}, ckpt)
    out = out_dir / (f"{variant}.onnx" if target == "onnxruntime" else f"{variant}.{target}.onnx")
    return export_onnx(ckpt, out, val_dir=data_dir, parity_samples=32, gradients=False, target=target).path


# --- servers in child processes ---------------------------------------------------------------------------


class Child:
    """`cmd` in a child process of its own session, output to `log`; `wait_ready(url)` polls until 200."""

    def __init__(self, cmd: list[str], log: Path, env: dict | None = None):
        self.cmd, self.log = cmd, log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def _answers(self, url: str) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.cmd[:4]} exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_ready(self, url: str, timeout: float = 300.0) -> Child:
        try:
            wait_until(lambda: self._answers(url), timeout, f"{self.cmd[:4]} answering {url}", interval=0.25)
        except TimeoutError as e:
            raise TimeoutError(f"{e}\n{self.log.read_text()[-3000:]}") from None
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the child, then SIGKILL to whatever else of its session is left (Ray's actors have groups of
        their own); SIGKILL to the child after `timeout`."""
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


CPUS = sorted(os.sched_getaffinity(0))  # before `pin_apart` narrows this process's own


def pin_apart(pids: list[int]) -> None:
    """Every thread of each process in `pids` and of the processes they started, onto the first CPU; this process
    (the load generators) onto the others. Throughput then follows each server's CPU per request, not how the
    scheduler shares the cores between a server and its clients. Threads started later inherit the CPU.

    Raises:
        SystemExit: fewer than two CPUs.
    """
    cpus = CPUS
    if len(cpus) < 2:
        sys.exit("--pin needs two CPUs (one for the servers, one for the load generator)")
    for member in {m for pid in pids for m in (pid, *session_members(pid))}:
        try:
            tids = os.listdir(f"/proc/{member}/task")
        except OSError:
            continue  # it ended meanwhile
        for tid in tids:
            try:
                os.sched_setaffinity(int(tid), cpus[:1])
            except OSError:
                pass  # a thread that ended meanwhile (an idle worker of a thread pool)
    os.sched_setaffinity(0, cpus[1:])


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` and of every process in its session (workers it started)."""
    total = 0.0
    for member in {pid, *session_members(pid)}:
        try:
            total += cpu_seconds(member)
        except OSError:  # it ended meanwhile
            continue
    return total


def measured(load: Callable[[], dict], pid: int) -> dict:
    """`load()` and the server's CPU time per answered request over it (µs, `cpu_us`)."""
    cpu0 = tree_cpu_seconds(pid)
    out = load()
    out["cpu_us"] = (tree_cpu_seconds(pid) - cpu0) / max(1, out["requests"]) * 1e6
    return out


# --- requests and load generators ------------------------------------------------------------------------


def percentiles(seconds: list[float]) -> dict:
    """p50, p99 and mean of `seconds`, in milliseconds (NaN when there are none)."""
    if not seconds:
        return {"p50": float("nan"), "p99": float("nan"), "mean": float("nan")}
    a = np.asarray(seconds) * 1000.0
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "mean": float(a.mean())}


def http_request(path: str, body: bytes, content_type: str = "image/png", extra_headers: str = "") -> bytes:
    """The bytes of one `POST path` on a keep-alive connection."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n{extra_headers}"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def multipart_request(path: str, image: bytes, field: str = "file") -> bytes:
    """`POST path` with `image` as the one file of a multipart form (what browsers and most clients send)."""
    boundary = "vitscopebench"
    part = f'--{boundary}\r\nContent-Disposition: form-data; name="{field}"; filename="x.png"\r\n'
    body = (part + "Content-Type: image/png\r\n\r\n").encode() + image + f"\r\n--{boundary}--\r\n".encode()
    return http_request(path, body, f"multipart/form-data; boundary={boundary}")


class LoadConnection(asyncio.Protocol):
    """One keep-alive connection posting the same prebuilt request back to back until `end`."""

    def __init__(self, request: bytes, end: float, stats: dict, done: asyncio.Future):
        self.request, self.end, self.stats, self.done = request, end, stats, done
        self.buf, self.t0 = b"", 0.0

    def connection_made(self, transport):
        self.transport = transport
        self.send()

    def send(self):
        if time.perf_counter() >= self.end:
            self.transport.close()
            return
        self.buf, self.t0 = b"", time.perf_counter()
        self.transport.write(self.request)

    def data_received(self, data: bytes):
        self.buf += data
        head_end = self.buf.find(b"\r\n\r\n")
        if head_end < 0:
            return
        head = self.buf[:head_end].lower()
        at = head.find(b"content-length:")
        length = int(head[at + 15 :].split(b"\r\n", 1)[0]) if at >= 0 else 0
        if len(self.buf) - head_end - 4 < length:
            return  # the body is still coming
        if head.startswith(b"http/1.1 200 "):
            self.stats["latencies"].append(time.perf_counter() - self.t0)
        else:
            self.stats["errors"] += 1
        self.send()

    def connection_lost(self, exc):
        if time.perf_counter() < self.end:  # the server hung up mid-run: that is an error too
            self.stats["errors"] += 1
        if not self.done.done():
            self.done.set_result(None)


def load_summary(stats: dict, wall: float, cpu: float) -> dict:
    n = len(stats["latencies"])
    return {
        "requests": n,
        "errors": stats["errors"],
        "rps": n / wall,
        "client_us": cpu / max(n, 1) * 1e6,
        **percentiles(stats["latencies"]),
    }


async def _http_load(port: int, request: bytes, concurrency: int, seconds: float) -> dict:
    loop = asyncio.get_running_loop()
    stats: dict = {"latencies": [], "errors": 0}
    end = time.perf_counter() + seconds
    cpu0, t0 = time.process_time(), time.perf_counter()
    done = []
    for _ in range(concurrency):
        fut = loop.create_future()
        await loop.create_connection(lambda f=fut: LoadConnection(request, end, stats, f), "127.0.0.1", port)
        done.append(fut)
    try:  # a server that stops answering must not hang the benchmark
        await asyncio.wait_for(asyncio.gather(*done), seconds + 60)
    except asyncio.TimeoutError:
        stats["errors"] += sum(not f.done() for f in done)  # each stalled connection counts as an error
    return load_summary(stats, time.perf_counter() - t0, time.process_time() - cpu0)


def run_loop(coro):
    """Run `coro` on uvloop where installed (uvicorn's fast loop): less CPU for a client sharing the server's cores."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def http_load(port: int, request: bytes, concurrency: int, seconds: float) -> dict:
    """`concurrency` keep-alive connections posting `request` back to back for `seconds`.

    Returns:
        requests answered 200, errors (other answers, hang-ups, stalls), rps, the client's own CPU µs per request
        (`client_us`), and p50 / p99 / mean latency in ms.
    """
    return run_loop(_http_load(port, request, concurrency, seconds))


async def _grpc_load(port: int, method: str, message: bytes, concurrency: int, seconds: float) -> dict:
    import grpc

    stats: dict = {"latencies": [], "errors": 0}
    end = time.perf_counter() + seconds
    cpu0, t0 = time.process_time(), time.perf_counter()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(method)  # bytes in, bytes out: no (de)serialising in the client

        async def client() -> None:
            while time.perf_counter() < end:
                start = time.perf_counter()
                try:
                    await call(message, timeout=30)
                    stats["latencies"].append(time.perf_counter() - start)
                except grpc.aio.AioRpcError:
                    stats["errors"] += 1

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return load_summary(stats, time.perf_counter() - t0, time.process_time() - cpu0)


def grpc_load(port: int, method: str, message: bytes, concurrency: int, seconds: float) -> dict:
    """`concurrency` unary calls of `method` with the serialized `message` in flight on one `grpc.aio` channel for
    `seconds`; the same summary as `http_load` (errors: calls that ended with a status other than OK)."""
    return asyncio.run(_grpc_load(port, method, message, concurrency, seconds))


async def _crowd(port: int, request: bytes, clients: int, seconds: float) -> dict:
    counts = {"200": 0, "503 + Retry-After": 0, "other": 0, "broken": 0}
    end = time.monotonic() + seconds

    async def client() -> None:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            counts["broken"] += 1
            return
        try:
            while time.monotonic() < end:
                writer.write(request)
                status = (await reader.readline()).split(b" ")[1]
                length, retry = 0, False
                while (line := await reader.readline()) not in (b"\r\n", b""):
                    low = line.lower()
                    length = int(line.split(b":")[1]) if low.startswith(b"content-length:") else length
                    retry = retry or low.startswith(b"retry-after:")
                await reader.readexactly(length)
                key = "200" if status == b"200" else "503 + Retry-After" if status == b"503" and retry else "other"
                counts[key] += 1
                if status == b"503":
                    await asyncio.sleep(0.1)  # a client that honours the hint a little
        except (OSError, asyncio.IncompleteReadError, IndexError):
            counts["broken"] += 1
        finally:
            writer.close()

    await asyncio.gather(*(client() for _ in range(clients)))
    return counts


def crowd(port: int, request: bytes, clients: int, seconds: float) -> str:
    """`clients` keep-alive connections sending `request` as fast as they are answered for `seconds`: what they
    got, as `N 200, N 503 + Retry-After, N other, N broken` (broken: a client whose connection failed)."""
    counts = asyncio.run(_crowd(port, request, clients, seconds))
    return ", ".join(f"{n} {k}" for k, n in counts.items())


class Sampler(threading.Thread):
    """A thread that calls `sample()` every `every` s while the `with` block runs."""

    def __init__(self, every: float):
        super().__init__(daemon=True)
        self.every = every
        self.stopping = threading.Event()

    def sample(self) -> None:
        raise NotImplementedError

    def run(self) -> None:
        while not self.stopping.is_set():
            self.sample()
            time.sleep(self.every)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self.join(60)


class Prober(Sampler):
    """`method path` on a new connection every `every` s: each latency, and the probes that got no 200 within
    `timeout`.

        with Prober(port, "GET", "/healthz", timeout=1.0) as health:
            ...
        percentiles(health.latencies), health.failed
    """

    def __init__(self, port: int, method: str, path: str, body: bytes | None = None, every=0.05, timeout=30.0):
        super().__init__(every)
        self.port, self.method, self.path, self.body, self.timeout = port, method, path, body, timeout
        self.latencies: list[float] = []
        self.failed = 0

    def sample(self) -> None:
        t0 = time.perf_counter()
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
            conn.request(
                self.method, self.path, body=self.body, headers={"content-type": "image/png"} if self.body else {}
            )
            ok = conn.getresponse().status == 200
            conn.close()
        except OSError:
            ok = False
        elapsed = time.perf_counter() - t0
        self.latencies.append(elapsed)
        self.failed += not ok or elapsed > self.timeout


class PeakRss(Sampler):
    """The peak resident memory of process `pid` (MiB) while the `with` block runs, sampled every 20 ms."""

    def __init__(self, pid: int):
        super().__init__(0.02)
        self.pid = pid
        self.peak = rss_mib(pid)

    def sample(self) -> None:
        self.peak = max(self.peak, rss_mib(self.pid))
