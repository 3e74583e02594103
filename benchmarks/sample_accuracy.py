"""How good and how fast is `configs/sample.yaml` from scratch on the embedded digits?

Runs the real command in a temporary run directory and prints one table:

    .venv/bin/python -m benchmarks.sample_accuracy [--config configs/sample.yaml] [--data data/digits]

Target: >= 98.5 % top-1 on the held-out digits in <= 3 minutes of training on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import Result, add_results_option

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/sample.yaml")
    parser.add_argument("--data", default="data/digits", help="the digits folder (written if missing)")
    parser.add_argument("--keep", action="store_true", help="keep the run directory")
    args = add_results_option(parser).parse_args()

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
    result = Result("sample_accuracy", {"config": args.config}, ("torch", "lightning"), results=args.results)
    table = result.table(["metric", "value"])
    best, epochs, fit = s["best_val_acc"], s["epochs"], s["fit_seconds"]
    table.add("val accuracy (top-1), best.ckpt", f"{100 * best:.2f} % of {len(split['val'])} held-out digits")
    table.add("val accuracy (top-1), last epoch", f"{100 * last_acc:.2f} %")
    table.add("training wall time (fit)", f"{fit:.1f} s")
    table.add("command wall time (incl. start-up, scan)", f"{total:.1f} s")
    table.add("epochs", epochs)
    table.add("training images/s", f"{s['train_images'] * epochs / fit:.0f}")
    table.add("train / val images", f"{len(split['train'])} / {len(split['val'])}")
    result.data = {"best_val_acc": best, "last_val_acc": last_acc, "fit_seconds": fit, "command_seconds": total}
    result.finish()
    if args.keep:
        print(f"run directory: {run_dir}")
    else:
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
