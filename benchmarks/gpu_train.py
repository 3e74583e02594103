"""Training throughput on one GPU: our ViT-B/16 vs timm's, bf16, on synthetic tensors and on an image folder.

Two questions in one run, each answered for both models side by side:
  1. synthetic: (B, 3, 224, 224) tensors already on the GPU; forward, backward and AdamW under
     bf16 autocast, channels-last. Images/s and model FLOP utilisation (MFU): 3 x forward FLOPs
     per image (forward + backward) x images/s / the GPU's dense bf16 peak.
  2. image folder: a generated JPEG folder through the real training path (`ImageFolderDataModule`
     with the vit_base.yaml augmentation, `ViTClassifier`, Lightning `Trainer`, bf16-mixed).

    python -m benchmarks.gpu_train                # ViT-B/16, ours and timm's, on the first GPU
    python -m benchmarks.gpu_train --compile      # also torch.compile both models
    python -m benchmarks.gpu_train --dry-run      # CPU, tiny sizes: checks the script itself

Without CUDA (and without --dry-run) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch import Callback

from benchmarks.common import Result, add_results_option

# dense bf16 peak, FLOP/s, by device-name fragment (tensor cores, no sparsity)
PEAK_BF16 = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
    "L4": 121e12,
    "4090": 165e12,
}


def peak_flops(name: str, override: float | None) -> float | None:
    if override:
        return override * 1e12
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def build(kind: str, variant: str, img_size: int, num_classes: int) -> torch.nn.Module:
    if kind == "ours":
        from vit import create_model

        return create_model(variant, img_size=img_size, num_classes=num_classes)
    import timm

    return timm.create_model(variant, img_size=img_size, num_classes=num_classes)


def synthetic(kind: str, args, device: torch.device) -> float:
    """Images/s of fwd + bwd + AdamW on tensors already on the device."""
    torch.manual_seed(0)
    model = build(kind, args.variant, args.img_size, 1000).to(device).to(memory_format=torch.channels_last)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    step_fn = torch.compile(model) if args.compile else model
    x = torch.randn(args.batch_size, 3, args.img_size, args.img_size, device=device).contiguous(
        memory_format=torch.channels_last
    )
    y = torch.randint(0, 1000, (args.batch_size,), device=device)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = torch.nn.functional.cross_entropy(step_fn(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    sync(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync(device)
    rate = args.steps * args.batch_size / (time.perf_counter() - start)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rate


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def write_folder(root: Path, n: int, classes: int, side: int) -> None:
    """`n` JPEGs of `side` px in `classes` folders: coloured noise with a class-coloured square."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"class_{c:02d}").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        c = i % classes
        a = rng.integers(0, 255, (side, side, 3), dtype=np.uint8)
        a[side // 4 : side // 2, side // 4 : side // 2] = (25 * c) % 255
        Image.fromarray(a).save(root / f"class_{c:02d}" / f"{i:05d}.jpg", quality=90)


class Throughput(Callback):
    """Images/s over the training steps after the first `skip`."""

    def __init__(self, skip: int, batch_size: int):
        self.skip, self.batch_size = skip, batch_size
        self.t0 = self.t1 = None
        self.n = self.calls = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.calls == self.skip:  # counted across epochs: batch_idx restarts every epoch
            sync(pl_module.device)
            self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.calls >= self.skip:
            self.n += self.batch_size
            sync(pl_module.device)
            self.t1 = time.perf_counter()
        self.calls += 1

    @property
    def rate(self) -> float:
        return self.n / (self.t1 - self.t0) if self.t0 is not None and self.t1 > self.t0 else float("nan")


def folder(kind: str, args, root: Path, device: torch.device, log_dir: str) -> float:
    """Images/s of the real training path on the generated folder."""
    from lightning.pytorch import Trainer

    from train.datamodule import ImageFolderDataModule
    from train.module import ViTClassifier
    from train.transforms import Augment

    dm = ImageFolderDataModule(
        str(root),
        img_size=args.img_size,
        batch_size=args.batch_size,
        num_workers=args.workers,
        augment=Augment(rand_augment="rand-m9-mstd0.5-inc1", re_prob=0.25),
        verify_images=False,
    )
    torch.manual_seed(0)
    module = ViTClassifier(
        num_classes=dm.num_classes,
        img_size=args.img_size,
        variant=args.variant,
        channels_last=True,
        compile=args.compile,
        mixup_alpha=0.8,
        cutmix_alpha=1.0,
    )
    if kind == "timm":  # same module, timm's network inside
        module.net = build("timm", args.variant, args.img_size, dm.num_classes)
    timer = Throughput(args.warmup, args.batch_size)
    trainer = Trainer(
        accelerator=device.type,
        devices=1,
        precision="bf16-mixed" if device.type == "cuda" else "32-true",
        max_steps=args.warmup + args.folder_steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
        default_root_dir=log_dir,
    )
    trainer.fit(module, dm)
    return timer.rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="vit_base_patch16_224")
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30, help="timed synthetic steps")
    parser.add_argument("--folder-steps", type=int, default=30, help="timed image-folder steps")
    parser.add_argument("--folder-images", type=int, default=8192)
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak, if the GPU is not known")
    parser.add_argument("--skip-folder", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: exercise the script")
    args = add_results_option(parser).parse_args()

    if args.dry_run:
        args.variant, args.img_size, args.batch_size = "vit_tiny_patch16_224", 32, 8
        args.warmup, args.steps, args.folder_steps, args.folder_images, args.workers = 2, 2, 2, 64, 0
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("benchmarks.gpu_train needs a CUDA GPU and none is visible; nothing was measured.")
        print("Run it on a GPU machine, or add --dry-run to check the script on the CPU.")
        return
    else:
        device = torch.device("cuda")
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    import warnings

    warnings.filterwarnings("ignore")
    from vit import create_model

    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (dry run)"
    peak = peak_flops(name, args.peak_tflops)
    flops = create_model(args.variant, img_size=args.img_size, num_classes=1000).flops_per_image()
    t0 = time.perf_counter()
    rows = []
    for kind in ("ours", "timm"):
        rate = synthetic(kind, args, device)
        rows.append(("synthetic tensors", kind, rate, 100 * 3 * flops * rate / peak if peak else None))
    if not args.skip_folder:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp) / "images"
            t = time.perf_counter()
            write_folder(root, args.folder_images, 10, 256 if not args.dry_run else 40)
            made = time.perf_counter() - t
            for kind in ("ours", "timm"):
                rate = folder(kind, args, root, device, tmp)
                mfu = 100 * 3 * flops * rate / peak if peak else None
                rows.append((f"image folder ({args.folder_images} JPEGs, {args.workers} workers)", kind, rate, mfu))
    total = time.perf_counter() - t0
    setting = {"variant": args.variant, "img size": args.img_size, "batch": args.batch_size, "dtype": "bf16"}
    setting |= {"channels-last": True, "compile": args.compile, "device": name}
    result = Result("gpu_train", setting, packages=("torch", "timm", "lightning"), results=args.results)
    table = result.table(["input", "model", "images/s", "MFU %"], formats={"images/s": "{:,.0f}", "MFU %": "{:.1f}"})
    for row in rows:
        table.add(*row)
    table.notes.append(
        f"forward GFLOPs/image {flops / 1e9:.2f}; peak {peak / 1e12:.0f} TFLOP/s" if peak else "peak unknown: no MFU"
    )
    if not args.skip_folder:
        table.notes.append(f"(folder generated in {made:.0f} s)")
    print(f"total {total:.0f} s", file=sys.stderr)
    result.finish()


if __name__ == "__main__":
    main()
