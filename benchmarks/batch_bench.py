"""Does `vit-predict --out` keep up with the model, and does a killed run resume with every image once?

    .venv/bin/python -m benchmarks.batch_bench --variant vit_tiny_patch16_224 --n 1000
    .venv/bin/python -m benchmarks.batch_bench --variant vit_micro_patch4_32 --n 100000 --kill-at 0.5

On `--n` generated 64 x 64 PNGs and a `--variant` with random weights: the model alone on decoded images,
`OnnxClassifier.predict` on the paths, and `vit-predict DIR --out` as a process. With `--kill-at F` the process is
killed once F of the parts are committed, resumed with `--resume`, and the output checked for every image once.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from benchmarks.common import Result, add_results_option
from benchmarks.servers import random_model_file
from serve.runtime.classifier import OnnxClassifier

ROOT = Path(__file__).resolve().parents[1]


def make_images(folder: Path, n: int) -> list[Path]:
    """n small PNGs in 100 sub-folders."""
    rng = np.random.default_rng(0)
    paths = []
    for i in range(n):
        img = rng.integers(0, 80, (64, 64, 3), dtype=np.uint8)
        y, x = rng.integers(0, 40, 2)
        img[y : y + 24, x : x + 24] = 220
        path = folder / f"{i % 100:02d}" / f"{i:06d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(img).save(path, compress_level=1)
        paths.append(path)
    return paths


def vit_predict(model: Path, folder: Path, out: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "serve.cluster.cli", str(model), str(folder), "--out", str(out), *extra]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def timed_cli(model: Path, folder: Path, out: Path) -> float:
    t0 = time.perf_counter()
    assert vit_predict(model, folder, out).wait() == 0
    return time.perf_counter() - t0


def kill_and_resume(model: Path, folder: Path, out: Path, n: int, part_size: int, at: float) -> dict:
    """Kill a run once `at` of its parts are committed, resume it, and count each path in the output."""
    import pyarrow.parquet as pq

    parts = out.with_name(out.name + ".parts")
    args = ("--part-size", str(part_size))
    proc = vit_predict(model, folder, out, *args)
    target = int(at * n / part_size)
    while len(list(parts.glob("part-*.json"))) < target and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    committed = sum(len(json.loads(p.read_text())["paths"]) for p in parts.glob("part-*.json"))
    t0 = time.perf_counter()
    assert vit_predict(model, folder, out, *args, "--resume").wait() == 0
    resume_s = time.perf_counter() - t0
    paths = pq.read_table(out, columns=["path"]).column("path").to_pylist()
    return {
        "images": n,
        "committed_when_killed": committed,
        "rows": len(paths),
        "distinct_paths": len(set(paths)),
        "exactly_once": len(paths) == len(set(paths)) == n,
        "resume_s": resume_s,
    }


def speed_rows(clf: OnnxClassifier, model: Path, files: list[Path], folder: Path, out: Path) -> list[tuple]:
    """The three runs of the module docstring, one after another on the same images: (name, seconds, images/s,
    the model alone's time over this one's)."""
    pixels = np.stack([clf.prepare(f) for f in files])
    t0 = time.perf_counter()
    for i in range(0, len(pixels), 32):
        clf.predict_pixels(pixels[i : i + 32])
    model_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    clf.predict(files, top_k=5, batch_size=32)
    serial_s = time.perf_counter() - t0
    cli_s = timed_cli(model, folder, out)
    runs = [
        ("OnnxClassifier.predict_pixels, decoded beforehand (the model alone)", model_s),
        ("OnnxClassifier.predict(paths): decode, then the model", serial_s),
        ("vit-predict DIR --out preds.parquet (process, start to exit)", cli_s),
    ]
    return [(name, s, len(files) / s, model_s / s) for name, s in runs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", default="vit_tiny_patch16_224")
    p.add_argument("--n", type=int, default=1000, help="images to generate")
    p.add_argument("--kill-at", type=float, default=None, help="kill the run at this fraction, then --resume")
    p.add_argument("--part-size", type=int, default=4096)
    p.add_argument("--data", type=Path, default=ROOT / "data" / "digits", help="class folders (for the labels)")
    args = add_results_option(p).parse_args()
    with tempfile.TemporaryDirectory(prefix="batch_bench") as tmp:
        tmp = Path(tmp)
        model = random_model_file(args.variant, args.data, tmp)
        files = make_images(tmp / "images", args.n)
        clf = OnnxClassifier(model)
        setting = {"variant": args.variant, "images": args.n, "threads": clf.threads}
        if args.kill_at is not None:
            setting |= {"part size": args.part_size, "kill at": args.kill_at}
            result = Result("batch_bench_resume", setting, ("onnxruntime", "pyarrow"), results=args.results)
            columns = ["images", "committed when killed", "rows in preds.parquet", "distinct paths", "exactly once"]
            table = result.table([*columns, "resume s"], formats={"resume s": "{:.1f}"})
            table.add(*kill_and_resume(model, tmp / "images", tmp / "resumed.parquet", args.n, args.part_size,
                                       args.kill_at).values())  # fmt: skip
        else:
            result = Result("batch_bench", setting, ("onnxruntime", "pyarrow"), results=args.results)
            formats = {"s": "{:.2f}", "images/s": "{:,.1f}", "vs the model alone": "{:.3f}"}
            table = result.table(["run", "s", "images/s", "vs the model alone"], formats=formats)
            for row in speed_rows(clf, model, files, tmp / "images", tmp / "preds.parquet"):
                table.add(*row)
    result.finish()


if __name__ == "__main__":
    main()
