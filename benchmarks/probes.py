"""Health probes under overload: `/healthz` on the API port and on `--probe-port`, while `--crowd` keep-alive
clients classify as fast as they are answered (hostile_bench's 1,000-client test).

The crowd runs in a process of its own. Each probe is a new connection with a 1 s timeout, as Kubernetes'
default probe is, every 50 ms from a thread of its own. Reported per port: probes, p50/p99 latency, probes
that got no 200 within 1 s; and what the crowd got (200, 503 with Retry-After, other, broken connections).

    .venv/bin/python -m benchmarks.probes artifacts/sample.onnx --crowd 1000 --seconds 20
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import multiprocessing
import threading
import time
from pathlib import Path

from benchmarks.rollout import sample_png
from benchmarks.server_runs import Server, free_port, ms, write_result

PROBE_TIMEOUT_S = 1.0


class Prober:
    """GET `path` on `port` every `every` s until stopped; latencies, and the probes that failed or timed out."""

    def __init__(self, port: int, path: str = "/healthz", every: float = 0.05):
        self.port, self.path, self.every = port, path, every
        self.latencies: list[float] = []
        self.failed = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            t0 = time.perf_counter()
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=PROBE_TIMEOUT_S)
                conn.request("GET", self.path)
                ok = conn.getresponse().status == 200
                conn.close()
            except OSError:
                ok = False
            elapsed = time.perf_counter() - t0
            self.latencies.append(elapsed)
            self.failed += not ok or elapsed > PROBE_TIMEOUT_S
            time.sleep(self.every)


async def crowd(port: int, clients: int, seconds: float) -> dict:
    body = sample_png((64, 64))
    request = (
        "POST /v1/classify HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: image/png\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
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


def run_crowd(port: int, clients: int, seconds: float) -> dict:
    return asyncio.run(crowd(port, clients, seconds))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("--crowd", type=int, default=1000)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--server-args", default="")
    args = p.parse_args()
    probe_port = free_port()
    server_args = ["--no-ui", "--probe-port", str(probe_port), *args.server_args.split()]
    with Server(args.model, *server_args) as server:
        probers = {"API port": Prober(server.port), "--probe-port": Prober(probe_port)}
        for prober in probers.values():
            prober.thread.start()
        # the crowd in a process of its own: in this one it would hold the interpreter the probers time with
        with multiprocessing.Pool(1) as pool:
            counts = pool.apply(run_crowd, (server.port, args.crowd, args.seconds))
        for prober in probers.values():
            prober.stop.set()
            prober.thread.join(5)
    crowd_text = ", ".join(f"{n} {k}" for k, n in counts.items())
    rows = [
        {
            "/healthz on": name,
            "probes": len(pr.latencies),
            "p50 ms": ms(pr.latencies, 50),
            "p99 ms": ms(pr.latencies, 99),
            "no 200 within 1 s": pr.failed,
            "crowd got": crowd_text,
        }
        for name, pr in probers.items()
    ]
    write_result("probes", rows, crowd=args.crowd, seconds=args.seconds)


if __name__ == "__main__":
    main()
