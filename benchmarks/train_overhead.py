"""What does Lightning cost per training step, next to a plain PyTorch loop?

Same model, same batches (pre-made tensors), same AdamW groups and schedule, same gradient
clipping, one thread; the two loops run interleaved, several rounds, and the median time per step
of each is compared. The Lightning side is `ViTClassifier.training_step` under a `Trainer` with
the shipped defaults (CSV and TensorBoard loggers, `self.log` every step, logging every 10 steps);
checkpointing, validation and the progress bar are off because they are not part of a step.

    .venv/bin/python benchmarks/train_overhead.py [--steps 60] [--rounds 3] [--batch-size 64]

Target: Lightning at most 5 % slower than the plain loop.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import tempfile
import time
import warnings

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset

from train.module import ViTClassifier

WARMUP = 5  # steps left out of the timing on both sides


class StepTimer(Callback):
    def __init__(self):
        self.start = self.end = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == WARMUP:
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.end = time.perf_counter()


def make_module(num_classes: int) -> ViTClassifier:
    torch.manual_seed(0)
    return ViTClassifier(num_classes=num_classes, img_size=32, variant="vit_micro_patch4_32", warmup_epochs=0.0)


def lightning_round(loader: DataLoader, steps: int, num_classes: int, log_dir: str) -> float:
    module = make_module(num_classes)
    timer = StepTimer()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        max_steps=steps,
        limit_val_batches=0,
        gradient_clip_val=1.0,
        log_every_n_steps=10,
        logger=[TensorBoardLogger(log_dir, name="tb"), CSVLogger(log_dir, name="csv")],
        callbacks=[timer],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)
    return (timer.end - timer.start) / (steps - WARMUP)


def plain_round(loader: DataLoader, steps: int, num_classes: int) -> float:
    module = make_module(num_classes)
    net = module.net.train()
    opt = torch.optim.AdamW(module.param_groups(), lr=module.hparams.lr, betas=module.hparams.betas)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=module.hparams.label_smoothing)
    start = None
    for i, (x, y) in enumerate(loader):
        if i == steps:
            break
        if i == WARMUP:
            start = time.perf_counter()
        loss = loss_fn(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        sched.step()
    return (time.perf_counter() - start) / (steps - WARMUP)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    num_classes = 10
    g = torch.Generator().manual_seed(0)
    n = args.steps * args.batch_size
    data = TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, num_classes, (n,), generator=g))
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=False)
    plain, light = [], []
    with tempfile.TemporaryDirectory() as log_dir:
        for r in range(args.rounds):
            if r % 2 == 0:  # alternate who goes first, so drift in machine speed hits both
                plain.append(plain_round(loader, args.steps, num_classes))
                light.append(lightning_round(loader, args.steps, num_classes, log_dir))
            else:
                light.append(lightning_round(loader, args.steps, num_classes, log_dir))
                plain.append(plain_round(loader, args.steps, num_classes))
    p, lt = statistics.median(plain), statistics.median(light)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"model vit_micro_patch4_32 (32 px), batch {args.batch_size}, {args.steps - WARMUP} timed steps")
    print(f"x {args.rounds} rounds, {args.threads} thread(s), {when}\n")
    print("| loop | ms/step (median) | rounds (ms/step) |\n|---|---|---|")
    print(f"| plain PyTorch | {1e3 * p:.1f} | {', '.join(f'{1e3 * t:.1f}' for t in plain)} |")
    print(f"| Lightning (ViTClassifier + Trainer) | {1e3 * lt:.1f} | {', '.join(f'{1e3 * t:.1f}' for t in light)} |")
    print(f"\nLightning / plain = {lt / p:.3f}  ({100 * (lt / p - 1):+.1f} %; target <= +5 %)")


if __name__ == "__main__":
    main()
