"""Can the model server roll out a new version every day for months? N polled rollouts under load.

`vit-serve DIR --repository-poll-s` serves a one-model repository under `--concurrency` keep-alive clients while
`--rollouts` new versions are copied in (beside the folder, then renamed in), each awaited until it serves, and
the version two back removed. Reported: failed requests, the server's RSS (start, end, peak) and threads.

    .venv/bin/python -m benchmarks.rollout_soak [MODEL] [--rollouts 200] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from benchmarks.common import Result, add_results_option
from benchmarks.servers import PeakRss, http_load, http_request, sample_image
from serve.server.testing import ServerProcess, rss_mib, wait_until

NAME = "soak"


def threads_of(pid: int) -> int:
    """The number of threads of process `pid` (from /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))


def add_version(folder: Path, version: int, model: Path) -> None:
    """Version `version` of the model: copied beside the folder, then renamed in, so the poll never sees half."""
    incoming = folder.parent / f".{folder.name}-{version}.incoming"
    incoming.mkdir()
    shutil.copy(model, incoming / "model.onnx")
    incoming.rename(folder / str(version))


def serves(port: int, version: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/{NAME}/versions/{version}/ready", timeout=5):
            return True
    except OSError:
        return False


class Load(threading.Thread):
    """`http_load` in back-to-back chunks of `chunk` seconds until stopped: every chunk's summary."""

    def __init__(self, port: int, request: bytes, concurrency: int, chunk: float = 5.0):
        super().__init__(daemon=True)
        self.port, self.request, self.concurrency, self.chunk = port, request, concurrency, chunk
        self.chunks: list[dict] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            self.chunks.append(http_load(self.port, self.request, self.concurrency, self.chunk))


def soak(server: ServerProcess, folder: Path, model: Path, request: bytes, args: argparse.Namespace) -> dict:
    """The rollouts under load, and what the server's memory and threads did meanwhile."""
    pid = server.proc.pid
    http_load(server.port, request, args.concurrency, args.warmup)  # allocations settle before the baseline
    rss0, threads0 = rss_mib(pid), threads_of(pid)
    load, done, t0 = Load(server.port, request, args.concurrency), 0, time.perf_counter()
    with PeakRss(pid) as peak:
        load.start()
        try:
            for version in range(2, args.rollouts + 2):
                add_version(folder, version, model)
                wait_until(lambda v=version: serves(server.port, v), args.timeout, f"version {version} serving")
                shutil.rmtree(folder / str(version - 2), ignore_errors=True)
                done += 1
        finally:
            load.stopping.set()
            load.join()
    seconds = time.perf_counter() - t0
    requests = sum(c["requests"] for c in load.chunks)
    failed = sum(c["errors"] for c in load.chunks)
    try:  # the last retired version's threads may take a moment to end; a leak keeps them
        wait_until(lambda: threads_of(pid) <= threads0, 10, "the retired versions' threads ending", interval=0.2)
    except TimeoutError:
        pass
    return {"done": done, "requests": requests, "failed": failed, "rps": requests / seconds, "seconds": seconds,
            "rss": (rss0, rss_mib(pid), peak.peak), "threads": (threads0, threads_of(pid))}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path, nargs="?", default=Path("artifacts/sample.onnx"), help="the .onnx to roll out")
    p.add_argument("--rollouts", type=int, default=200, help="new versions copied in, one after another")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--poll-s", type=float, default=0.5, help="the server's --repository-poll-s")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds of load before the baseline is read")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a version may take to serve")
    p.add_argument("--data", type=Path, default=Path("data/digits"), help="sample images (one is posted)")
    p.add_argument("--server-args", default="--preferred-batch-size 8", help="extra vit-serve options")
    args = add_results_option(p).parse_args()
    model = args.model.resolve()
    with tempfile.TemporaryDirectory(prefix="rollout_soak-") as tmp:
        folder = Path(tmp) / "models" / NAME
        folder.mkdir(parents=True)
        (folder / "config.pbtxt").write_text(f'name: "{NAME}"\nplatform: "onnxruntime_onnx"\n')
        add_version(folder, 1, model)
        request = http_request(f"/v1/models/{NAME}/classify", sample_image(args.data, (64, 64)))
        options = ["--no-ui", "--repository-poll-s", str(args.poll_s), *args.server_args.split()]
        with ServerProcess(folder.parent, *options, log_file=Path(tmp) / "server.log") as server:
            got = soak(server, folder, model, request, args)
    setting = {"model": args.model.name, "rollouts": args.rollouts, "concurrency": args.concurrency}
    result = Result("rollout_soak", setting | {"poll s": args.poll_s}, ("onnxruntime", "uvicorn"), results=args.results)
    columns = ["rollouts done", "requests", "failed", "req/s", "RSS MiB start / end / peak", "threads start / end"]
    table = result.table(columns, formats={"requests": "{:,}", "req/s": "{:,.0f}"})
    rss, threads = got["rss"], got["threads"]
    memory = f"{rss[0]:.0f} / {rss[1]:.0f} / {rss[2]:.0f} ({rss[1] - rss[0]:+.0f})"
    table.add(got["done"], got["requests"], got["failed"], got["rps"], memory, f"{threads[0]} / {threads[1]}")
    result.data = got
    result.finish()


if __name__ == "__main__":
    main()
