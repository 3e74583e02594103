"""What Ray Serve costs and buys on one machine: plain `vit-serve` against `vit-serve --ray` with 1 and 2
model replicas, side by side in one run, with the same load generator as `serve_bench.py`.

A throwaway local Ray cluster (a head and a worker node, one CPU each, as in tests/serve/test_ray_serve.py)
serves both Ray configurations; plain `vit-serve` is measured first and again last, so that the machine's
drift over the run shows. Each configuration gets a warm-up and `--rounds` rounds of `--duration` seconds
at `--concurrency` keep-alive connections posting one PNG to /v1/classify; the table has the best round.

    .venv/bin/python benchmarks/ray_bench.py artifacts/sample.onnx [--duration 5] [--rounds 2]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_bench import load, run_loop, sample_image  # noqa: E402

from serve.runtime.classifier import OnnxClassifier  # noqa: E402
from tests.serve.process import ServerProcess  # noqa: E402
from tests.serve.ray_cluster import LocalRayCluster  # noqa: E402


def measure(model: Path, args: list[str], data: bytes, opts: argparse.Namespace) -> list[dict]:
    """Start `vit-serve model *args`, warm it up, and return one `load` result per round."""
    server = ServerProcess(model, "--no-ui", *args)
    try:
        server.wait_ready(300)  # a Ray deployment takes tens of seconds
        run_loop(load(server.port, data, opts.concurrency, 2.0))  # connections, first batches, Ray's routing
        return [run_loop(load(server.port, data, opts.concurrency, opts.duration)) for _ in range(opts.rounds)]
    finally:
        server.stop(60)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", type=Path, help="the .onnx file (e.g. artifacts/sample.onnx)")
    p.add_argument("--data", type=Path, default=Path("data/digits"), help="sample images (one is posted)")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per round")
    p.add_argument("--rounds", type=int, default=2, help="rounds per configuration (the best is reported)")
    p.add_argument("--concurrency", type=int, default=16)
    opts = p.parse_args(argv)
    data = sample_image(opts.data, OnnxClassifier(opts.model).input_size)
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
            rounds = measure(opts.model, args, data, opts)
            rows.append((name, rounds))
            each = ", ".join(f"{r['rps']:,.0f}" for r in rounds)
            print(f"{name}: {each} req/s", file=sys.stderr, flush=True)
    print(
        f"# ray_bench: {opts.model}, concurrency {opts.concurrency}, {opts.rounds} x {opts.duration:g} s rounds, "
        f"on {platform.machine()} ({platform.platform()}), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n"
    )
    print("| server | req/s (best round; each round) | p50 ms | p99 ms | errors |")
    print("|---|---:|---:|---:|---:|")
    for name, rounds in rows:
        best = max(rounds, key=lambda r: r["rps"])
        each = ", ".join(f"{r['rps']:,.0f}" for r in rounds)
        errors = sum(r["errors"] for r in rounds)
        print(f"| {name} | {best['rps']:,.0f} ({each}) | {best['p50']:.1f} | {best['p99']:.1f} | {errors} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
