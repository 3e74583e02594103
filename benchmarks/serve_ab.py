"""Is one version of the server slower than another? Two or three source trees served side by side, rounds alternating.

Each tree (a checkout of an older commit, say) runs its own `vit-serve --no-ui` on the same model, and rounds of
`benchmarks.servers.http_load` alternate between them. Per tree: the median req/s, the ratio's range over the
rounds (the noise a difference must stand out from), p99, and the server's CPU per request. `--variant` serves a
model of that variant with random weights; `--in-process` adds `OnnxClassifier` decoding the same PNG and
classifying batches of `--batch` in this process, on the same cores (one tree alone compares with that only).
Pass a fixed `--preferred-batch-size`, or each server picks one from a few timed calls at start-up.

    git worktree add /tmp/vitscope-before <commit>
    .venv/bin/python -m benchmarks.serve_ab /tmp/vitscope-before . --server-args="--preferred-batch-size 8"
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from pathlib import Path

import numpy as np

from benchmarks import common
from benchmarks.common import Result, add_results_option, interleaved
from benchmarks.servers import http_load, http_request, measured, pin_apart, random_model_file, sample_image
from serve.runtime.classifier import OnnxClassifier
from serve.server.testing import ServerProcess

IN_PROCESS = "in-process OnnxClassifier (decode + batch of {})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trees", nargs="+", type=Path, help="one to three source trees (the first is the baseline)")
    p.add_argument("--model", type=Path, default=Path("artifacts/sample.onnx"))
    p.add_argument("--variant", help="instead of --model: this vit.create_model variant with random weights")
    p.add_argument("--data", type=Path, default=Path("data/digits"), help="sample images (one is posted)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--duration", type=float, default=3.0, help="seconds per round")
    p.add_argument("--concurrency", type=int, default=16, help="connections posting back to back")
    p.add_argument("--server-args", default="", help="extra vit-serve options for both")
    p.add_argument("--in-process", action="store_true", help="also time the model in this process (see above)")
    p.add_argument("--batch", type=int, default=8, help="images per in-process call")
    p.add_argument(
        "--pin", action="store_true",
        help="run each server (all its threads) on the first CPU and the load generator on the others: "
        "throughput then follows the server's CPU per request, not how the scheduler shares the cores",
    )  # fmt: skip
    p.add_argument("--name", help="the result's name (default: serve_ab[_VARIANT][_pinned])")
    p.add_argument(
        "--modules", nargs="+", default=["serve.server"] * 3,
        help="each tree's server module (`python -m ...`): 'serve' before serve/ was split into sub-packages",
    )  # fmt: skip
    args = add_results_option(p).parse_args()
    if len(args.trees) > 3 or (len(args.trees) == 1 and not args.in_process):
        p.error("give two or three trees, or one tree with --in-process")
    if args.pin and args.in_process:
        p.error("--in-process shares the cores with the server; it cannot run --pin (one core for the servers)")
    tmp = Path(tempfile.mkdtemp(prefix="serve_ab-"))
    try:
        model = random_model_file(args.variant, args.data, tmp) if args.variant else args.model.resolve()
        compare(args, model)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def in_process_side(model: Path, png: bytes, batch: int, seconds: float):
    """A round of the model alone: images/s of decoding `png` and classifying batches of `batch` in this process."""
    clf = OnnxClassifier(model)

    def work() -> None:
        clf.predict_pixels(np.stack([clf.prepare(png) for _ in range(batch)]))

    return lambda _: common.rate(work, batch, seconds)


def server_side(server: ServerProcess, request: bytes, args: argparse.Namespace, p99: list, cost: list):
    def one_round(_: int) -> float:
        out = measured(lambda: http_load(server.port, request, args.concurrency, args.duration), server.proc.pid)
        p99.append(out["p99"])
        cost.append(out["cpu_us"])
        return out["rps"]

    return one_round


def compare(args: argparse.Namespace, model: Path) -> None:
    png = sample_image(args.data, (32, 32))
    request = http_request("/v1/classify", png)
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    servers = []
    try:
        for i, tree in enumerate(args.trees):
            tree = tree.resolve()
            env = dict(os.environ, PYTHONPATH=str(tree))
            log = logs / f"serve_ab-{i}.log"
            extra = args.server_args.split()
            server = ServerProcess(model, "--no-ui", *extra, cwd=tree, env=env, log_file=log, module=args.modules[i])
            servers.append(server.wait_ready())
        if args.pin:
            pin_apart([server.proc.pid for server in servers])
        for server in servers:
            http_load(server.port, request, args.concurrency, 1.0)  # warm the connection path
        # named as given on the command line (the same tree twice: the noise), not by this machine's absolute paths
        names = [f"{i + 1}. {given}" for i, given in enumerate(args.trees)]
        p99: dict[str, list[float]] = {name: [] for name in names}
        cost: dict[str, list[float]] = {name: [] for name in names}
        pairs = zip(names, servers, strict=True)
        sides = {name: server_side(s, request, args, p99[name], cost[name]) for name, s in pairs}
        if args.in_process:
            sides[IN_PROCESS.format(args.batch)] = in_process_side(model, png, args.batch, args.duration)
        rps = interleaved(args.rounds, sides)
    finally:
        for server in servers:
            server.stop()
    report(args, model, rps, p99, cost)


def report(args: argparse.Namespace, model: Path, rps: dict, p99: dict, cost: dict) -> None:
    setting = {
        "rounds": args.rounds,
        "duration s": args.duration,
        "concurrency": args.concurrency,
        "model": model.name,
        "server args": args.server_args,
        "pinned": args.pin,
    }
    variant, pinned = f"_{args.variant}" if args.variant else "", "_pinned" if args.pin else ""
    result_name = args.name or f"serve_ab{variant}{pinned}"  # one result per model and mode, unless named
    result = Result(result_name, setting, packages=("onnxruntime", "uvicorn"), results=args.results)
    columns = ["side", "req/s median", "ratio", "ratio range", "each round", "p99 ms (median)", "server CPU µs/req"]
    formats = {"req/s median": "{:,.0f}", "ratio": "{:.2f}x", "p99 ms (median)": "{:.2f}"}
    table = result.table(columns, formats=formats | {"server CPU µs/req": "{:,.0f}"})
    base = list(rps.values())[0]
    for name, values in rps.items():
        med = statistics.median(values)
        ratios = [v / b for v, b in zip(values, base, strict=True)]
        each = ", ".join(f"{v:,.0f}" for v in values)
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
        tail, cpu = (statistics.median(p99[name]), statistics.median(cost[name])) if name in p99 else (None, None)
        table.add(name, med, med / statistics.median(base), spread, each, tail, cpu)
    if args.in_process:
        alone = statistics.median(rps[IN_PROCESS.format(args.batch)])
        last = list(p99)[-1]
        table.notes.append(f"{last} / in-process: {statistics.median(rps[last]) / alone:.2f}x the images/s")
    result.data = {"rps": rps}
    result.finish()


if __name__ == "__main__":
    main()
