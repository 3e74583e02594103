"""What does a crash-safe checkpoint save cost? Lightning's save against vit-train's atomic one, interleaved.

    .venv/bin/python -m benchmarks.checkpoint_save [--repeats 5] [--dirs /tmp /dev/shm]

Lightning's `TorchCheckpointIO` serialises into memory, writes a temporary file in $TMPDIR and moves it
over the target (a copy when the run directory is on another filesystem). `train.checkpoint_io.AtomicCheckpointIO`
writes a temporary file beside the target, fsyncs it, renames it and fsyncs the folder. The checkpoints are
shaped like vit-train's for ViT-Ti/16 and ViT-S/16 (weights, EMA copy and two AdamW moments: 4 float32
copies of the parameters). Each cell is the median of the interleaved rounds, in seconds per save.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from benchmarks.common import Result, add_results_option, interleaved, timed
from train.checkpoint_io import AtomicCheckpointIO
from vit.model import create_model


def fake_checkpoint(variant: str) -> dict:
    state = create_model(variant, num_classes=1000).state_dict()
    copies = {f"{kind}.{k}": v.clone() for kind in ("ema", "exp_avg", "exp_avg_sq") for k, v in state.items()}
    return {"state_dict": {**state, **copies}, "epoch": 0, "global_step": 0}


def saver(io, ckpt: dict, path: Path):
    """One round: seconds for `io` to save `ckpt` to `path`."""
    return lambda _round: timed(lambda: io.save_checkpoint(ckpt, path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dirs", nargs="+", default=["/tmp", "/dev/shm"])
    parser.add_argument("--variants", nargs="+", default=["vit_tiny_patch16_224", "vit_small_patch16_224"])
    opts = add_results_option(parser).parse_args()
    tmp_dev = os.stat(tempfile.gettempdir()).st_dev
    result = Result("checkpoint_save", {"repeats": opts.repeats}, packages=("torch", "lightning"), results=opts.results)
    columns = ["checkpoint", "MB", "run dir (same fs as $TMPDIR?)", "Lightning s", "atomic s", "atomic/Lightning"]
    formats = {"MB": "{:.0f}", "Lightning s": "{:.3f}", "atomic s": "{:.3f}", "atomic/Lightning": "{:.2f}"}
    table = result.table(columns, formats=formats)
    for variant in opts.variants:
        ckpt = fake_checkpoint(variant)
        for base in opts.dirs:
            with tempfile.TemporaryDirectory(dir=base) as folder:
                path = Path(folder) / "last.ckpt"
                sides = {
                    "lightning": saver(TorchCheckpointIO(), ckpt, path),
                    "atomic": saver(AtomicCheckpointIO(), ckpt, path),
                }
                times = interleaved(opts.repeats, sides)  # the machine's drift hits both alike
                mb = path.stat().st_size / 1e6
                same = "same" if os.stat(folder).st_dev == tmp_dev else "other"
                light, atomic = statistics.median(times["lightning"]), statistics.median(times["atomic"])
                table.add(variant, mb, f"{base} ({same})", light, atomic, atomic / light)
    result.finish()


if __name__ == "__main__":
    main()
