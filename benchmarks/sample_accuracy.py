"""How good and how fast is `configs/sample.yaml` from scratch on the embedded digits?

Runs the real command in a temporary run directory and prints one table:

    .venv/bin/python benchmarks/sample_accuracy.py [--config configs/sample.yaml] [--data data/digits]

Target: >= 98.5 % top-1 on the held-out digits in <= 3 minutes of training on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()}-core {platform.machine()} ({cpu}), {platform.system()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/sample.yaml")
    parser.add_argument("--data", default="data/digits", help="the digits folder (written if missing)")
    parser.add_argument("--keep", action="store_true", help="keep the run directory")
    args = parser.parse_args()

    bin_dir = Path(sys.executable).parent
    data = Path(args.data)
    if not (data / ".complete").is_file():
        subprocess.run([str(bin_dir / "vit-sample-data"), "--out", str(data)], check=True)
    run_dir = Path(tempfile.mkdtemp(prefix="vitscope-sample-"))
    cmd = [str(bin_dir / "vit-train"), "fit", "--config", args.config, "--data.root", str(data)]
    cmd += ["--trainer.default_root_dir", str(run_dir), "--trainer.enable_progress_bar", "false"]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    total = time.perf_counter() - start
    s = json.loads((run_dir / "summary.json").read_text())
    split = json.loads((run_dir / "split.json").read_text())
    with open(next((run_dir / "csv").glob("version_*/metrics.csv"))) as f:
        last_acc = [float(r["val/acc"]) for r in csv.DictReader(f) if r.get("val/acc")][-1]
    rows = [
        ("val accuracy (top-1), best.ckpt", f"{100 * s['best_val_acc']:.2f} % of {len(split['val'])} held-out digits"),
        ("val accuracy (top-1), last epoch", f"{100 * last_acc:.2f} %"),
        ("training wall time (fit)", f"{s['fit_seconds']:.1f} s"),
        ("command wall time (incl. start-up, scan)", f"{total:.1f} s"),
        ("epochs", str(s["epochs"])),
        ("training images/s", f"{s['train_images'] * s['epochs'] / s['fit_seconds']:.0f}"),
        ("train / val images", f"{len(split['train'])} / {len(split['val'])}"),
        ("machine", machine()),
        ("date", datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")),
        ("command", "vit-train fit --config " + args.config + " --trainer.default_root_dir <tmp>"),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"| {'metric':<{width}} | value |\n|{'-' * (width + 2)}|-------|")
    for k, v in rows:
        print(f"| {k:<{width}} | {v} |")
    if args.keep:
        print(f"run directory: {run_dir}")
    else:
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
