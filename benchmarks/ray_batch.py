"""Does `vit-predict --ray` scale from one actor to two, and what does Ray cost an actor against one process?

    make sample && .venv/bin/python -m benchmarks.ray_batch --variant vit_tiny_patch16_224 --n 600

Generates `--n` PNG images (`benchmarks.batch_bench.make_images`) and a model of `--variant` with random
weights (speed does not depend on training), starts one local Ray (`--cpus`, default every core), and then,
side by side in one run:
  1. in-process `OnnxClassifier.predict(paths)` with one intra-op thread: what one actor's work costs
     without Ray (decoding, then the model);
  2. `serve.cluster.ray_job.run_ray` (what `vit-predict --ray` runs) on one batch of 32 images: the fixed
     cost of a job (Ray Data's planning, an actor's start-up and model load, the write);
  3. `run_ray` with 1 and then 2 actors of one CPU each, from its call to the Parquet directory written,
     and the same less the fixed cost: the per-actor rate a long job settles at, against (1).
Writes benchmarks/results/ray_batch.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from benchmarks import common
from benchmarks.batch_bench import make_images
from benchmarks.servers import random_model_file
from serve.runtime.classifier import OnnxClassifier

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", default="vit_tiny_patch16_224")
    p.add_argument("--n", type=int, default=600, help="images to generate")
    p.add_argument("--cpus", type=int, default=os.cpu_count(), help="CPUs of the local Ray")
    p.add_argument("--data", type=Path, default=ROOT / "data" / "digits", help="class folders (for the labels)")
    common.add_results_option(p)
    args = p.parse_args()

    import ray

    from serve.cluster.ray_job import run_ray

    result = common.Result(
        "ray_batch",
        {"variant": args.variant, "images": args.n, "ray cpus": args.cpus},
        packages=("ray", "onnxruntime"),
        results=args.results,
    )
    table = result.table(
        ["run", "actors", "s", "images/s", "per actor images/s", "per actor / one process"],
        formats={"s": "{:.1f}", "images/s": "{:.1f}", "per actor images/s": "{:.1f}",
                 "per actor / one process": "{:.2f}"},
    )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="ray_batch") as tmp:
        tmp = Path(tmp)
        model = random_model_file(args.variant, args.data, tmp)
        files = make_images(tmp / "images", args.n)
        clf = OnnxClassifier(model, threads=1)
        clf.predict(files[:8])  # warm-up
        t0 = time.perf_counter()
        clf.predict(files, top_k=5, batch_size=32)
        alone = time.perf_counter() - t0
        table.add("OnnxClassifier.predict, one process, 1 thread", 0, alone, args.n / alone, args.n / alone, 1.0)
        ray.init(num_cpus=args.cpus, log_to_driver=False, include_dashboard=False, logging_level="WARNING")
        try:
            few = [str(f) for f in files[:32]]  # one batch: what a job costs beyond its images
            run_ray(model, few, tmp / "cold.parquet", workers=1)  # the first job also warms Ray Data up
            t0 = time.perf_counter()
            run_ray(model, few, tmp / "few.parquet", workers=1)
            fixed = time.perf_counter() - t0
            table.add("run_ray on 32 images (one batch: the fixed cost)", 1, fixed, 32 / fixed, None, None)
            for workers in (1, 2):
                t0 = time.perf_counter()
                out = tmp / f"preds-{workers}.parquet"
                done, failed = run_ray(model, [str(f) for f in files], out, workers=workers)
                seconds = time.perf_counter() - t0
                assert (done, failed) == (args.n, 0), (done, failed)
                table.add("run_ray (vit-predict --ray)", workers, seconds, args.n / seconds, None, None)
                marginal = (args.n - 32) / max(seconds - fixed, 1e-9) / workers  # the images beyond the fixed cost
                table.add("  the same, beyond the fixed cost", workers, seconds - fixed, marginal * workers, marginal,
                          marginal / (args.n / alone))  # fmt: skip
        finally:
            ray.shutdown()
    result.finish()


if __name__ == "__main__":
    main()
