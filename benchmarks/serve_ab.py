"""Is one version of the server slower than another? Two source trees served side by side, rounds alternating.

Each tree (a checkout, e.g. a `git worktree` of an older commit) runs its own `vit-serve --no-ui` on the same
model, started one after the other so that neither times its batch sizes while the other does. Rounds of
`benchmarks.servers`' load generator (concurrency 16) then alternate between them, so both see the machine's
drift alike. Per tree: the median and best requests/s, and the server's CPU time per request (user + system,
from /proc), which a busy machine moves less than throughput.

    git worktree add /tmp/vitscope-before <commit>
    .venv/bin/python -m benchmarks.serve_ab /tmp/vitscope-before . --server-args="--preferred-batch-size 8"

`--variant vit_tiny_patch16_224` serves a production-size model (random weights, built once for both
trees) instead of the sample.

Pass a fixed `--preferred-batch-size`: otherwise each server picks its batch size from a few timed calls at
start-up, and on a busy machine that choice moves throughput more than the code does.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from pathlib import Path

from benchmarks.common import Result, add_results_option, interleaved
from benchmarks.servers import http_load, http_request, measured, pin_apart, random_model_file, sample_image
from serve.server.testing import ServerProcess


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trees", nargs=2, type=Path, help="two source trees (the first is the baseline)")
    p.add_argument("--model", type=Path, default=Path("artifacts/sample.onnx"))
    p.add_argument("--variant", help="instead of --model: this vit.create_model variant with random weights")
    p.add_argument("--data", type=Path, default=Path("data/digits"), help="sample images (one is posted)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--duration", type=float, default=3.0, help="seconds per round")
    p.add_argument("--concurrency", type=int, default=16, help="connections posting back to back")
    p.add_argument("--server-args", default="", help="extra vit-serve options for both")
    p.add_argument(
        "--pin", action="store_true",
        help="run each server (all its threads) on the first CPU and the load generator on the others: "
        "throughput then follows the server's CPU per request, not how the scheduler shares the cores",
    )  # fmt: skip
    p.add_argument(
        "--modules", nargs=2, default=["serve.server", "serve.server"],
        help="each tree's server module (`python -m ...`): 'serve' before serve/ was split into sub-packages",
    )  # fmt: skip
    args = add_results_option(p).parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="serve_ab-"))
    try:
        model = random_model_file(args.variant, args.data, tmp) if args.variant else args.model.resolve()
        compare(args, model)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def compare(args: argparse.Namespace, model: Path) -> None:
    request = http_request("/v1/classify", sample_image(args.data, (32, 32)))
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    servers = []
    try:
        for i, tree in enumerate(args.trees):
            tree = tree.resolve()
            env = dict(os.environ, PYTHONPATH=str(tree))
            log = logs / f"serve_ab-{i}.log"
            extra = args.server_args.split()
            server = ServerProcess(model, "--no-ui", *extra, cwd=tree, env=env, log_file=log, module=args.modules[i])
            servers.append((tree, server.wait_ready()))
        if args.pin:
            pin_apart([server.proc.pid for _, server in servers])
        for _, server in servers:
            http_load(server.port, request, args.concurrency, 1.0)  # warm the connection path
        # named as given on the command line (the same tree twice: the noise), not by this machine's absolute paths
        names = [f"{i + 1}. {given}" for i, given in enumerate(args.trees)]
        p99: dict[str, list[float]] = {name: [] for name in names}
        cost: dict[str, list[float]] = {name: [] for name in names}

        def side(name: str, server: ServerProcess):
            def one_round(_: int) -> float:
                out = measured(
                    lambda: http_load(server.port, request, args.concurrency, args.duration), server.proc.pid
                )
                p99[name].append(out["p99"])
                cost[name].append(out["cpu_us"])
                return out["rps"]

            return one_round

        rps = interleaved(
            args.rounds, {name: side(name, server) for name, (_, server) in zip(names, servers, strict=True)}
        )
    finally:
        for _, server in servers:
            server.stop()
    setting = {
        "rounds": args.rounds,
        "duration s": args.duration,
        "concurrency": args.concurrency,
        "model": model.name,
        "server args": args.server_args,
        "pinned": args.pin,
    }
    result_name = f"serve_ab_{args.variant}" if args.variant else "serve_ab"  # one result per model
    result = Result(result_name, setting, packages=("onnxruntime", "uvicorn"), results=args.results)
    columns = ["tree", "req/s median", "ratio", "best", "each round", "p99 ms (median)", "server CPU µs per request"]
    table = result.table(columns, formats={"req/s median": "{:,.0f}", "ratio": "{:.2f}x", "best": "{:,.0f}"})
    table.formats.update({"p99 ms (median)": "{:.2f}", "server CPU µs per request": "{:,.0f}"})
    base = statistics.median(rps[names[0]])
    for name, values in rps.items():
        med = statistics.median(values)
        each = ", ".join(f"{v:,.0f}" for v in values)
        table.add(name, med, med / base, max(values), each, statistics.median(p99[name]), statistics.median(cost[name]))
    result.data = {"rps": rps}
    result.finish()


if __name__ == "__main__":
    main()
