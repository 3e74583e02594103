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
import tempfile
import threading
from pathlib import Path

from benchmarks.common import Result, add_results_option
from benchmarks.servers import http_load, measured, multipart_request, random_model_file, sample_image
from serve.server.testing import ServerProcess


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", default="vit_micro_patch4_32", help="vit.create_model variant (random weights)")
    p.add_argument("--data", type=Path, default=Path("data/digits"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--duration", type=float, default=4.0)
    p.add_argument("--concurrency", type=int, default=16)
    args = add_results_option(p).parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="payload_log_bench-"))
    sink = StalledSink()
    configs = {
        "no payload log": [],
        "JSON-lines file": ["--payload-log", str(tmp / "payloads.jsonl")],
        # a small queue, so that it is full within the first round and every later record is dropped
        "stalled CloudEvents sink": ["--payload-log-url", sink.url, "--payload-log-queue-size", "64"],
    }
    servers: dict[str, ServerProcess] = {}
    try:
        model = random_model_file(args.variant, args.data, tmp)
        request = multipart_request("/v1/classify", sample_image(args.data, (32, 32)))
        for name, extra in configs.items():
            log = tmp / f"{len(servers)}.log"
            server = ServerProcess(model, "--no-ui", "--preferred-batch-size", "8", "--log-level", "warning", *extra,
                                   log_file=log)  # fmt: skip
            servers[name] = server.wait_ready()
        for server in servers.values():
            http_load(server.port, request, args.concurrency, 1.0)  # warm-up
        runs: dict[str, list[dict]] = {name: [] for name in servers}
        for _ in range(args.rounds):
            for name, server in servers.items():
                load = lambda s=server: http_load(s.port, request, args.concurrency, args.duration)  # noqa: E731
                runs[name].append(measured(load, server.proc.pid))
        drops = {name: s.metric("vitscope_payload_log_dropped_total", default=0.0) for name, s in servers.items()}
    finally:
        for server in servers.values():
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    setting = {"model": f"{args.variant} (random weights)", "concurrency": args.concurrency, "rounds": args.rounds}
    result = Result("payload_log_bench", setting | {"duration s": args.duration}, ("onnxruntime", "uvicorn"),
                    results=args.results)  # fmt: skip
    table = result.table(
        ["server", "req/s (median)", "vs no log", "p99 ms", "server CPU µs/req", "records dropped", "errors",
         "req/s each round"],
        formats={"req/s (median)": "{:,.1f}", "vs no log": "{:.2f}x", "p99 ms": "{:,.0f}",
                 "server CPU µs/req": "{:,.0f}"},
    )  # fmt: skip
    base = statistics.median(r["rps"] for r in runs["no payload log"])
    for name, rounds in runs.items():
        rps, p99, cpu = (statistics.median(r[k] for r in rounds) for k in ("rps", "p99", "cpu_us"))
        each = ", ".join(f"{r['rps']:.0f}" for r in rounds)
        table.add(name, rps, rps / base, p99, cpu, int(drops[name]), sum(r["errors"] for r in rounds), each)
    result.data = {"rounds": runs}
    result.finish()


if __name__ == "__main__":
    main()
