"""Do bf16 autocast or `torch.compile` make a CPU training step of the small-image model faster?

The model of `configs/small_images.yaml` (vit_micro_patch4_32, conv stem 16/32/64, 32 px), batches of 64 random
tensors, AdamW: forward, backward and step, as the bare loop of `benchmarks.train_overhead` runs them. Three sides
in interleaved rounds: fp32 eager, fp32 under `torch.autocast("cpu", torch.bfloat16)` (Lightning's
`--trainer.precision bf16-mixed`), and fp32 through `torch.compile` (as shipped), whose one-off compilation is
timed apart.

    .venv/bin/python -m benchmarks.train_precision [--rounds 7] [--steps 40] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.common import Result, add_results_option, interleaved
from vit import create_model

BATCH = 64
NET = dict(stem="conv", stem_widths=[16, 32, 64], global_pool="avg", class_token=False, pos_embed="sincos")


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return set()


def training_step(mode: str) -> tuple[Callable[[], None], float]:
    """A step of a fresh seeded model in `mode` (fp32, bf16, compile), and its warm-up seconds (5 steps)."""
    torch.manual_seed(0)
    model = create_model("vit_micro_patch4_32", img_size=32, num_classes=10, **NET)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    forward = torch.compile(model) if mode == "compile" else model
    x, y = torch.randn(BATCH, 3, 32, 32), torch.randint(0, 10, (BATCH,))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16"):
            loss = F.cross_entropy(forward(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    t0 = time.perf_counter()
    for _ in range(5):
        step()
    return step, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=40, help="timed steps per side and round")
    p.add_argument("--threads", type=int, default=1)
    args = add_results_option(p).parse_args()
    torch.set_num_threads(args.threads)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")  # compiled cold, as a first run is
    bf16_isa = "avx512_bf16" in cpu_flags() or "amx_bf16" in cpu_flags()
    setting = {"threads": args.threads, "batch": BATCH, "rounds": args.rounds, "bf16 instructions": bf16_isa}
    result = Result("train_precision", setting, packages=("torch",), results=args.results)
    steps, warmups = {}, {}
    for mode in ("fp32", "bf16", "compile"):
        steps[mode], warmups[mode] = training_step(mode)

    def side(mode: str) -> Callable[[int], float]:
        def images_per_s(_round: int) -> float:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                steps[mode]()
            return args.steps * BATCH / (time.perf_counter() - t0)

        return images_per_s

    figures = interleaved(args.rounds, {mode: side(mode) for mode in steps})
    base = statistics.median(figures["fp32"])
    names = {"fp32": "fp32, eager", "bf16": "bf16 autocast", "compile": "torch.compile, fp32 (shipped)"}
    table = result.table(["step", "images/s (median)", "x fp32", "rounds (images/s)", "first 5 steps, s"])
    for mode, values in figures.items():
        med = statistics.median(values)
        table.add(names[mode], f"{med:.0f}", f"{med / base:.2f}", ", ".join(f"{v:.0f}" for v in values),
                  f"{warmups[mode]:.1f}")  # fmt: skip
    result.notes.append(
        "Interleaved rounds of the same step; the last column is the five untimed steps before them, which for "
        "`torch.compile` include compiling with an empty cache, as on a machine's first run."
    )
    result.data = {"images_per_s": figures, "warmup_s": warmups}
    result.finish()


if __name__ == "__main__":
    main()
