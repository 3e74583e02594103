"""Our ViT against timm's, same config and weights, interleaved in one run.

Rows: inference images/s at batch 1 and 32, and a training step (forward, backward, AdamW) at
batch 32; on CPU in fp32, and on CUDA in bf16 when a GPU is present. ratio = ours / timm.

    .venv/bin/python benchmarks/model_vs_timm.py [--models vit_tiny_patch16_224 vit_small_patch16_224] [--repeats 7]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time

import timm
import torch

import vit


def timed(fn, sync) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["vit_tiny_patch16_224", "vit_small_patch16_224"])
    parser.add_argument("--repeats", type=int, default=9, help="interleaved timing rounds; the best is reported")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    cpu = platform.processor() or platform.machine()
    print(
        f"# model_vs_timm: {datetime.date.today()}, {device.type} ({cpu}, {torch.get_num_threads()} threads), "
        f"{dtype}, torch {torch.__version__}, timm {timm.__version__}, best of {args.repeats} interleaved rounds"
    )
    # "timm again" is a second copy of timm's model timed the same way: timm/timm shows how far apart two
    # runs of the very same code land on this machine, so ours/timm can be read against that noise floor.
    print("| model | task | batch | ours img/s | timm img/s | ours/timm | timm again/timm (noise) |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models:
        torch.manual_seed(0)
        theirs = timm.create_model(name, pretrained=False).to(device)
        ours = vit.from_timm(theirs).to(device)
        again = timm.create_model(name, pretrained=False).to(device)
        again.load_state_dict(theirs.state_dict())
        models = {"ours": ours, "timm": theirs, "timm again": again}
        for task, B in (("inference", 1), ("inference", 32), ("train step", 32)):
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
            for _ in range(args.repeats):
                order = list(steps)[_ % 3 :] + list(steps)[: _ % 3]  # rotate who goes first
                for key in order:
                    times[key].append(timed(steps[key], sync))
            rate = {k: B / min(v) for k, v in times.items()}  # the best round: interference only slows a round
            print(
                f"| {name} | {task} | {B} | {rate['ours']:.1f} | {rate['timm']:.1f} | "
                f"{rate['ours'] / rate['timm']:.3f} | {rate['timm again'] / rate['timm']:.3f} |"
            )


if __name__ == "__main__":
    main()
