"""What Ray Serve costs and buys on one machine: plain `vit-serve` against `vit-serve --ray` with 1 and 2
model replicas, side by side in one run.

A throwaway local Ray cluster (`serve.server.testing.LocalRayCluster`: a head and a worker node, one CPU
each, as the Ray tests use) serves both Ray configurations; plain `vit-serve` is measured first and again
last, so that the machine's drift over the run shows. Each configuration gets a warm-up and `--rounds`
rounds of `--duration` seconds at `--concurrency` keep-alive connections posting one PNG to /v1/classify
(serve_bench's load generator, `benchmarks.servers.http_load`); the table has the best round.

    .venv/bin/python -m benchmarks.ray_bench artifacts/sample.onnx [--duration 5] [--rounds 2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.common import Result, add_results_option
from benchmarks.servers import http_load, http_request, sample_image
from serve.runtime.classifier import OnnxClassifier
from serve.server.testing import LocalRayCluster, ServerProcess


def measure(model: Path, args: list[str], request: bytes, opts: argparse.Namespace) -> list[dict]:
    """Start `vit-serve model *args`, warm it up, and return one `load` result per round."""
    server = ServerProcess(model, "--no-ui", *args)
    try:
        server.wait_ready(300)  # a Ray deployment takes tens of seconds
        http_load(server.port, request, opts.concurrency, 2.0)  # connections, first batches, Ray's routing
        return [http_load(server.port, request, opts.concurrency, opts.duration) for _ in range(opts.rounds)]
    finally:
        server.stop(60)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", type=Path, help="the .onnx file (e.g. artifacts/sample.onnx)")
    p.add_argument("--data", type=Path, default=Path("data/digits"), help="sample images (one is posted)")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per round")
    p.add_argument("--rounds", type=int, default=2, help="rounds per configuration (the best is reported)")
    p.add_argument("--concurrency", type=int, default=16)
    opts = add_results_option(p).parse_args(argv)
    request = http_request("/v1/classify", sample_image(opts.data, OnnxClassifier(opts.model).input_size))
    rows = []
    with LocalRayCluster(nodes=2, cpus_per_node=1) as cluster:
        ray = ["--ray", "--ray-address", cluster.address]
        configs = [
            ("vit-serve (one process)", []),
            ("vit-serve --ray, 1 model replica", [*ray, "--replicas", "1"]),
            ("vit-serve --ray, 2 model replicas", [*ray, "--replicas", "2"]),
            ("vit-serve (one process), again", []),
        ]
        for name, args in configs:
            rounds = measure(opts.model, args, request, opts)
            rows.append((name, rounds))
            each = ", ".join(f"{r['rps']:,.0f}" for r in rounds)
            print(f"{name}: {each} req/s", file=sys.stderr, flush=True)
    setting = {"model": str(opts.model), "concurrency": opts.concurrency, "rounds": opts.rounds}
    result = Result("ray_bench", {**setting, "duration s": opts.duration}, ("ray", "uvicorn"), results=opts.results)
    columns = ["server", "req/s (best round)", "each round", "p50 ms", "p99 ms", "errors"]
    formats = {"req/s (best round)": "{:,.0f}", "p50 ms": "{:.1f}", "p99 ms": "{:.1f}"}
    table = result.table(columns, formats=formats)
    for name, rounds in rows:
        best = max(rounds, key=lambda r: r["rps"])
        each = ", ".join(f"{r['rps']:,.0f}" for r in rounds)
        table.add(name, best["rps"], each, best["p50"], best["p99"], sum(r["errors"] for r in rounds))
    result.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
