"""Our ViT against timm's, same config and weights, interleaved in one run.

Inference at batch 1 and 32 and a training step at batch 32 (fp32 on CPU, bf16 on CUDA), for ours, timm and a
second copy of timm (the noise floor). Where code lands in memory moves a process's speed for its whole life, so
each figure is the median over fresh processes of each one's best interleaved round.

    .venv/bin/python -m benchmarks.model_vs_timm [--models vit_tiny_patch16_224 vit_small_patch16_224] [--processes 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

import timm
import torch

import vit
from benchmarks.common import Result, add_results_option, spread, timed

MODELS = ("ours", "timm", "timm again")
TASKS = (("inference", 1), ("inference", 32), ("train step", 32))


def measure(name: str, device: torch.device, repeats: int, first: int) -> dict[str, dict[str, float]]:
    """One process's best seconds per call: {"task batch": {model: seconds}}; models are built from `first` on."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    weights = timm.create_model(name, pretrained=False).state_dict()
    models = {}
    for key in MODELS[first:] + MODELS[:first]:
        m = timm.create_model(name, pretrained=False)
        m.load_state_dict(weights)
        models[key] = (vit.from_timm(m) if key == "ours" else m).to(device)
    best = {}
    for task, B in TASKS:
        x = torch.randn(B, 3, 224, 224, device=device)
        y = torch.randint(0, 1000, (B,), device=device)
        steps = {}
        for key, m in models.items():
            if task == "inference":
                m.eval()

                def step(m=m, x=x):
                    with torch.inference_mode(), torch.autocast(device.type, dtype, enabled=dtype != torch.float32):
                        m(x)
            else:
                m.train()
                opt = torch.optim.AdamW(m.parameters(), lr=1e-4)

                def step(m=m, opt=opt, x=x, y=y):
                    with torch.autocast(device.type, dtype, enabled=dtype != torch.float32):
                        loss = torch.nn.functional.cross_entropy(m(x), y)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()

            steps[key] = step
            step()  # warm-up
        times = {k: [] for k in steps}
        for r in range(repeats):
            for key in MODELS[r % 3 :] + MODELS[: r % 3]:  # rotate who goes first
                times[key].append(timed(steps[key], sync))
        best[f"{task} {B}"] = {k: min(v) for k, v in times.items()}  # interference only slows a round
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["vit_tiny_patch16_224", "vit_small_patch16_224"])
    parser.add_argument("--processes", type=int, default=5, help="fresh processes per model; medians are reported")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timing rounds per process; the best counts")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)  # one process: build order
    args = add_results_option(parser).parse_args()
    if args.processes < 1 or args.repeats < 1:
        parser.error("--processes and --repeats must be at least 1")
    device = torch.device(args.device)
    if args.worker is not None:
        print(json.dumps(measure(args.models[0], device, args.repeats, args.worker)))
        return

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    setting = {"device": device.type, "threads": torch.get_num_threads(), "dtype": str(dtype)}
    setting |= {"processes": args.processes, "interleaved rounds": args.repeats}
    result = Result("model_vs_timm", setting, packages=("torch", "timm"), results=args.results)
    columns = ["model", "task", "batch", "ours img/s", "timm img/s", "ours/timm", "timm again/timm (noise)"]
    table = result.table(columns, formats={"ours img/s": "{:.1f}", "timm img/s": "{:.1f}"})
    # "timm again" is a second copy of timm's model timed the same way: timm/timm shows how far apart two
    # copies of the very same code land on this machine, so ours/timm can be read against that noise floor.
    table.notes.append(
        "img/s: the median over fresh processes, each the best of its interleaved rounds; ratios: median [range]"
    )
    for name in args.models:
        runs = []
        for p in range(args.processes):
            cmd = [sys.executable, "-m", "benchmarks.model_vs_timm", "--models", name, "--repeats", str(args.repeats)]
            cmd += ["--device", args.device, "--worker", str(p % 3)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"model_vs_timm: the worker for {name} failed:\n{proc.stderr}")
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        for task, B in TASKS:
            best = [run[f"{task} {B}"] for run in runs]
            rate = {k: statistics.median(B / b[k] for b in best) for k in MODELS}
            ratio = {k: [b["timm"] / b[k] for b in best] for k in ("ours", "timm again")}
            table.add(name, task, B, rate["ours"], rate["timm"], spread(ratio["ours"]), spread(ratio["timm again"]))
            print(f"{name} {task} {B}: ours/timm {spread(ratio['ours'])}", file=sys.stderr, flush=True)
    result.finish()


if __name__ == "__main__":
    main()
