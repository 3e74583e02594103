"""What does the portable target cost? Batch-1 latency of each export target, side by side, interleaved.

    .venv/bin/python -m benchmarks.targets_bench [--model vit_tiny_patch16_224] [--rounds 5] [--threads 1]

One network (random weights, nothing downloaded), exported for both targets (fp32, no gradient graph):
- onnxruntime / logits: the default file's fast path (fused contrib ops), what vit-predict and vit-serve run;
- onnxruntime / maps: the same file with `explain=True` (logits and every block's attention maps);
- portable / ORT: the portable file in onnxruntime (it always computes logits and maps);
- portable / OpenVINO: the portable file in OpenVINO's CPU plugin, fp32 (`INFERENCE_PRECISION_HINT f32`).
Each cell is the best round's median ms per call; rounds interleave the engines, as the machine is shared.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from benchmarks.common import Result, add_results_option, interleaved, median_time
from serve.export.parity import Sample
from serve.export.targets import build
from serve.runtime.classifier import session_options
from serve.runtime.images import Preprocess
from vit import create_model


def engines(model_name: str, threads: int, tmp: Path) -> dict:
    """One callable per engine, each running one (1, H, W, 3) image."""
    torch.manual_seed(0)
    net = create_model(model_name, num_classes=1000).eval()
    pre = Preprocess(img_size=net.patch_embed.img_size, mean=(0.5,) * 3, std=(0.5,) * 3)
    H, W = pre.img_size
    pixels = np.random.default_rng(0).integers(0, 256, (1, H, W, 3), dtype=np.uint8)
    sample = Sample(pixels, np.array([-1]), "random")
    files = {}
    for target in ("onnxruntime", "portable"):
        graphs = build(net, pre, target=target, opset=18, sample=sample, gradients=False)
        files[target] = tmp / f"{target}.onnx"
        files[target].write_bytes(graphs.model.SerializeToString())
    options = session_options(threads)
    fused = ort.InferenceSession(str(files["onnxruntime"]), options, providers=["CPUExecutionProvider"])
    portable = ort.InferenceSession(str(files["portable"]), options, providers=["CPUExecutionProvider"])
    runs = {
        "onnxruntime / logits": lambda: fused.run(["logits"], {"pixels": pixels}),
        "onnxruntime / maps": lambda: fused.run(["logits", "attns"], {"pixels": pixels, "explain": np.array(True)}),
        "portable / ORT": lambda: portable.run(["logits", "attns"], {"pixels": pixels}),
    }
    try:
        import openvino as ov

        core = ov.Core()
        config = {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": threads or 0}
        compiled = core.compile_model(core.read_model(str(files["portable"])), "CPU", config)
        request = compiled.create_infer_request()
        runs["portable / OpenVINO"] = lambda: request.infer({"pixels": pixels})
    except ImportError:
        print("  openvino not installed: pip install -e '.[dev]'", file=sys.stderr)
    return runs


def median_ms(fn, calls: int = 20) -> float:
    return 1000 * median_time(fn, calls)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="vit_tiny_patch16_224")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = add_results_option(p).parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = engines(args.model, args.threads, Path(tmp))
        rounds = interleaved(args.rounds, {name: (lambda r, fn=fn: median_ms(fn)) for name, fn in runs.items()})
        best = {name: min(ms) for name, ms in rounds.items()}
    setting = {"threads": args.threads, "batch": 1, "model": args.model, "rounds": args.rounds}
    result = Result("targets_bench", setting, packages=("onnxruntime", "openvino", "torch"), results=args.results)
    table = result.table(["engine", "ms per call", "vs onnxruntime / logits"], formats={"ms per call": "{:.2f}"})
    table.formats["vs onnxruntime / logits"] = "{:.2f}x"
    table.notes.append("each cell: the best round's median of 20 calls")
    base = best["onnxruntime / logits"]
    for name, ms in best.items():
        table.add(name, ms, ms / base)
    result.data = {"rounds_ms": rounds}
    result.finish()


if __name__ == "__main__":
    main()
