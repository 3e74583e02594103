"""Does the payload log slow requests down? vit-serve without it, with a JSON-lines file, and with a CloudEvents
sink that has stalled (accepts connections and never answers), all up at once, in alternating rounds.

The stalled sink is the worst case for the bound: its queue fills at once and every later record is dropped
and counted, while requests must go on as if there were no log. Each round gives every server `--duration`
seconds of `--concurrency` clients posting one PNG upload to /v1/classify; the table has the median req/s
(and its ratio to the server without a log), p99 latency, server CPU per request, and the records dropped.

    .venv/bin/python -m benchmarks.payload_log_bench [--rounds 5] [--duration 4]
"""

from __future__ import annotations

import argparse
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

from benchmarks.harness import Child, free_port, header, http_load, measured, multipart_request, write_result
from benchmarks.serve_bench import random_model_file, sample_image


class StalledSink:
    """A TCP listener on 127.0.0.1 that accepts every connection and never answers (nor reads)."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}/events"

    def _accept(self) -> None:
        while True:
            conn, _ = self.sock.accept()
            self.held.append(conn)


def dropped(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    lines = [line for line in text.splitlines() if line.startswith("vitscope_payload_log_dropped_total{")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", default="vit_micro_patch4_32", help="vit.create_model variant (random weights)")
    p.add_argument("--data", type=Path, default=Path("data/digits"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--duration", type=float, default=4.0)
    p.add_argument("--concurrency", type=int, default=16)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="payload_log_bench-"))
    sink = StalledSink()
    configs = {
        "no payload log": [],
        "JSON-lines file": ["--payload-log", str(tmp / "payloads.jsonl")],
        # a small queue, so that it is full within the first round and every later record is dropped
        "stalled CloudEvents sink": ["--payload-log-url", sink.url, "--payload-log-queue-size", "64"],
    }
    servers: dict[str, tuple[Child, int]] = {}
    try:
        model = random_model_file(args.variant, args.data, tmp)
        png = sample_image(args.data, (32, 32))
        request = multipart_request("/v1/classify", png)
        for name, extra in configs.items():
            port = free_port()
            cmd = [sys.executable, "-m", "serve.server", str(model), "--no-ui", "--port", str(port),
                   "--preferred-batch-size", "8", "--log-level", "warning", *extra]  # fmt: skip
            log = tmp / f"{len(servers)}.log"
            servers[name] = (Child(cmd, log).wait_ready(f"http://127.0.0.1:{port}/readyz"), port)
        for _, port in servers.values():
            http_load(port, request, args.concurrency, 1.0)  # warm-up
        runs: dict[str, list[dict]] = {name: [] for name in servers}
        for _ in range(args.rounds):
            for name, (child, port) in servers.items():
                runs[name].append(measured(lambda p=port: http_load(p, request, args.concurrency, args.duration),
                                           child.proc.pid))  # fmt: skip
        drops = {name: dropped(port) for name, (_, port) in servers.items()}
    finally:
        for child, _ in servers.values():
            child.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    base = statistics.median(r["rps"] for r in runs["no payload log"])
    rows = []
    for name, results in runs.items():
        med = {k: statistics.median(r[k] for r in results) for k in ("rps", "p99", "cpu_us")}
        each, errors = [round(r["rps"]) for r in results], sum(r["errors"] for r in results)
        ratio = f"{med['rps'] / base:.2f}x"
        rows.append(
            {"server": name, **med, "ratio": ratio, "dropped": int(drops[name]), "errors": errors, "each_round": each}
        )
    head = header() | {"model": f"{args.variant} (random weights)", "concurrency": args.concurrency,
                       "rounds": args.rounds, "duration_s": args.duration}  # fmt: skip
    write_result("payload_log_bench", head, rows, [
        ("server", "server"), ("rps", "req/s (median)"), ("ratio", "vs no log"), ("p99", "p99 ms"),
        ("cpu_us", "server CPU µs/req"), ("dropped", "records dropped"), ("errors", "errors"),
    ])  # fmt: skip


if __name__ == "__main__":
    main()
