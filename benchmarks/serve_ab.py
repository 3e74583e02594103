"""Is one version of the server slower than another? Two source trees served side by side, rounds alternating.

Each tree (a checkout, e.g. a `git worktree` of an older commit) runs its own `vit-serve --no-ui` on the same
model, started one after the other so that neither times its batch sizes while the other does. Rounds of
`serve_bench.py`'s load generator (concurrency 16) then alternate between them, so both see the machine's
drift alike. Per tree: the median and best requests/s, and the server's CPU time per request (user + system,
from /proc), which a busy machine moves less than throughput.

    git worktree add /tmp/vitscope-before <commit>
    .venv/bin/python benchmarks/serve_ab.py /tmp/vitscope-before . --server-args="--preferred-batch-size 8"

`--variant vit_tiny_patch16_224` serves a production-size model (random weights, built once for both
trees) instead of the sample.

Pass a fixed `--preferred-batch-size`: otherwise each server picks its batch size from a few timed calls at
start-up, and on a busy machine that choice (1 to 8 for the sample model) moves throughput more than the code.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serve_bench import load, random_model_file, run_loop, sample_image  # noqa: E402

from tests.serve.process import ServerProcess  # noqa: E402


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pin(pid: int, cpus: list[int]) -> None:
    """Every thread of process `pid` (onnxruntime's and the batcher's, started already) onto `cpus`."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:
            pass  # a thread that ended meanwhile (an idle worker of the thread pool)


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
        help="each tree's server module (`python -m ...`): 'serve' before serve/ was split into rooms",
    )  # fmt: skip
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="serve_ab-"))
    try:
        model = random_model_file(args.variant, args.data, tmp) if args.variant else args.model.resolve()
        compare(args, model)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def compare(args: argparse.Namespace, model: Path) -> None:
    data = sample_image(args.data, (32, 32))
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
            cpus = sorted(os.sched_getaffinity(0))
            if len(cpus) < 2:
                sys.exit("serve_ab.py: --pin needs two CPUs (one for the servers, one for the load generator)")
            for _, server in servers:
                pin(server.proc.pid, cpus[:1])
            os.sched_setaffinity(0, cpus[1:])
        for _, server in servers:
            run_loop(load(server.port, data, args.concurrency, 1.0))  # warm the connection path
        rps: dict[Path, list[float]] = {tree: [] for tree, _ in servers}
        cost: dict[Path, list[float]] = {tree: [] for tree, _ in servers}
        p99: dict[Path, list[float]] = {tree: [] for tree, _ in servers}
        for _ in range(args.rounds):
            for tree, server in servers:
                cpu0 = cpu_seconds(server.proc.pid)
                out = run_loop(load(server.port, data, args.concurrency, args.duration))
                rps[tree].append(out["rps"])
                p99[tree].append(out["p99"])
                cost[tree].append((cpu_seconds(server.proc.pid) - cpu0) / max(1, out["requests"]) * 1e6)
    finally:
        for _, server in servers:
            server.stop()
    base = statistics.median(rps[servers[0][0]])
    pinned = ", servers pinned to one CPU" if args.pin else ""
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"# serve_ab: {args.rounds} alternating rounds of {args.duration:g} s, concurrency {args.concurrency}, "
          f"{model.name}, server args {args.server_args!r}{pinned}, {when}\n")  # fmt: skip
    print("| tree | req/s median (ratio) | best | each round | p99 latency (median) | server CPU per request |")
    print("|---|---:|---:|---|---:|---:|")
    for tree, values in rps.items():
        med = statistics.median(values)
        rounds = ", ".join(f"{v:,.0f}" for v in values)
        print(
            f"| {tree} | {med:,.0f} ({med / base:.2f}x) | {max(values):,.0f} | {rounds} | "
            f"{statistics.median(p99[tree]):.2f} ms | {statistics.median(cost[tree]):,.0f} µs |"
        )


if __name__ == "__main__":
    main()
