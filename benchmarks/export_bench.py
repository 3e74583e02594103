"""Is the exported model fast, and close to the hardware? One run, side by side, interleaved repeats.

    .venv/bin/python -m benchmarks.export_bench [--repeats 5] [--models vit_tiny vit_small sample]

For ViT-Ti/16 and ViT-S/16 at 224 px (random weights, nothing downloaded) and the sample model
(`runs/sample/checkpoints/best.ckpt`, or a same-shaped random one), at batch 1 and 32, with 1 and
2 intra-op threads:
- torch eager: our model, `torch.inference_mode()`, fused attention;
- ORT fp32: the vit-export file (uint8 pixels in, the `If` switch, fast branch with its attention
  blocks and GELUs fused into onnxruntime contrib ops, `serve.export.fusion`);
- ORT plain: the same logits graph exported alone (no `If`, no explain branch), to show the
  switch costs nothing;
- ORT unfused: the logits graph as the exporter writes it, before `serve.export.fusion`;
- ORT int8: the vit-export int8 logits path (dynamic quantisation, `QAttention` in the blocks);
- timm ORT: timm's VisionTransformer of the same shape exported the plain way (float NCHW in).
Each cell is the best of the interleaved rounds (batch 32: at most 3 rounds). Ratios are speed-ups
over torch eager at the same batch and thread count. Then the achieved GFLOP/s of ViT-S/16 fp32
at batch 1 against the fp32 MatMul peak of onnxruntime, sampled before, between and after the
models in the same run (best sample), and the int8 accuracy change on the held-out digits when
the sample run exists.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

from benchmarks.common import Result, add_results_option, interleaved, mean_time
from serve.export.merge import combine_fast_and_explain
from serve.export.quantize import dynamic_int8
from serve.export.trace import PixelModel, export_fast_graph, export_graph
from serve.runtime.classifier import session_options
from serve.runtime.images import Preprocess, load_image
from vit import create_model

ROOT = Path(__file__).resolve().parents[1]

SAMPLE_CKPT = ROOT / "runs/sample/checkpoints/best.ckpt"
MODELS = {"vit_tiny": "vit_tiny_patch16_224", "vit_small": "vit_small_patch16_224", "sample": "vit_micro_patch4_32"}
ENGINES = ("torch eager", "ORT fp32", "ORT plain", "ORT unfused", "ORT int8", "timm ORT")


def session(model: onnx.ModelProto | Path, threads: int) -> ort.InferenceSession:
    """A CPU session with the options `serve.runtime.classifier.OnnxClassifier` uses."""
    options = session_options(threads)
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])


def timm_plain_export(net, img_size: tuple[int, int], path: Path) -> Path:
    """timm's VisionTransformer with our net's shape, exported the way its docs and users do it."""
    import timm

    cfg = net.config
    model = timm.models.vision_transformer.VisionTransformer(
        img_size=img_size,
        patch_size=cfg["patch_size"],
        embed_dim=cfg["embed_dim"],
        depth=cfg["depth"],
        num_heads=cfg["num_heads"],
        mlp_ratio=cfg["mlp_ratio"],
        num_classes=cfg["num_classes"],
    ).eval()
    x = torch.randn(2, 3, *img_size)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (x,),
            str(path),
            input_names=["input"],
            output_names=["logits"],
            dynamic_shapes={"x": {0: torch.export.Dim("batch", min=1, max=4096)}},
            dynamo=True,
            external_data=False,
            verbose=False,
        )
    return path


def build(name: str, tmp: Path) -> dict:
    """The torch net and every ONNX variant of one model."""
    note = ""
    if name == "sample" and SAMPLE_CKPT.is_file():
        from train.checkpoint_format import load_network

        net, meta = load_network(SAMPLE_CKPT)
        pre = meta["preprocess"]
        note = f"trained: {SAMPLE_CKPT.relative_to(ROOT)}"
    else:
        torch.manual_seed(0)
        net = create_model(MODELS[name], num_classes=10 if name == "sample" else 1000).eval()
        pre = Preprocess(img_size=net.patch_embed.img_size, mean=(0.5,) * 3, std=(0.5,) * 3)
        meta = None
        if name == "sample":
            note = "random weights: runs/sample/checkpoints/best.ckpt not found (run `make train`)"
    size = tuple(pre.img_size)
    t = time.perf_counter()
    fast, fused = export_fast_graph(net, pre)
    unfused, _ = export_fast_graph(net, pre, fuse=False)
    explain = export_graph(PixelModel(net, pre.mean, pre.std, explain=True), size)
    int8 = dynamic_int8(fast)
    fusions = ", ".join(f"{k} x{v}" for k, v in fused.items())
    note = "; ".join(filter(None, [note, f"fast graph fused: {fusions}"]))
    files = {
        "ORT fp32": combine_fast_and_explain(fast, explain),
        "ORT plain": fast,
        "ORT unfused": unfused,
        "ORT int8": combine_fast_and_explain(int8, explain),
        "timm ORT": timm_plain_export(net, size, tmp / f"{name}_timm.onnx"),
    }
    print(f"  built {name} in {time.perf_counter() - t:.0f} s {note}", file=sys.stderr, flush=True)
    return {"net": net, "pre": pre, "meta": meta, "files": files, "note": note, "size": size}


def runners(model: dict, threads: int) -> dict:
    net, size = model["net"], model["size"]
    sessions = {k: session(v, threads) for k, v in model["files"].items()}

    def make(engine: str, batch: int):
        rng = np.random.default_rng(batch)
        pixels = rng.integers(0, 256, (batch, *size, 3), dtype=np.uint8)
        if engine == "torch eager":
            x = torch.from_numpy(model["pre"].normalize(pixels))

            def run():
                with torch.inference_mode():
                    net(x)

            return run
        s = sessions[engine]
        feed = {"input": model["pre"].normalize(pixels)} if engine == "timm ORT" else {"pixels": pixels}
        return lambda: s.run(None, feed)

    return make


THREAD_ENGINES = ("torch eager", "ORT fp32", "ORT int8")  # the 2-thread comparison: the engines that matter


def bench_model(model: dict, repeats: int, batches=(1, 32)) -> list[dict]:
    """Every engine with 1 thread; torch, ORT fp32 and int8 again with 2 threads."""
    rows = []
    for threads, engines in ((1, ENGINES), (2, THREAD_ENGINES)):
        torch.set_num_threads(threads)
        make = runners(model, threads)
        for batch in batches:
            fns = {e: make(e, batch) for e in engines}
            for fn in fns.values():
                fn()  # warm-up
            # calls per repeat so one repeat takes roughly 0.3 s or more
            calls = {e: max(1, int(0.3 / max(mean_time(fn, 1), 1e-4))) for e, fn in fns.items()}
            sides = {e: (lambda r, fn=fn, n=calls[e]: mean_time(fn, n)) for e, fn in fns.items()}
            times = interleaved(repeats if batch == 1 else min(repeats, 3), sides)  # every engine once per round
            # best round: on a shared machine the slow rounds measure the neighbours, not the engine
            base = min(times["torch eager"])
            for e in engines:
                ms = 1000 * min(times[e])
                rows.append(
                    dict(threads=threads, batch=batch, engine=e, ms=ms, ips=batch * 1000 / ms, x=base * 1000 / ms)
                )
    return rows


def matmul_peak(threads: int, n: int = 1024, repeats: int = 5) -> float:
    """fp32 GFLOP/s of onnxruntime's MatMul on (n, n) @ (n, n), the best of `repeats` interleaved rounds."""
    from onnx import TensorProto, helper

    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, [n, n])
    b = helper.make_tensor_value_info("b", TensorProto.FLOAT, [n, n])
    c = helper.make_tensor_value_info("c", TensorProto.FLOAT, [n, n])
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "mm", [a, b], [c])
    s = session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), threads)
    rng = np.random.default_rng(0)
    feed = {"a": rng.standard_normal((n, n), dtype=np.float32), "b": rng.standard_normal((n, n), dtype=np.float32)}
    s.run(None, feed)
    best = min(mean_time(lambda: s.run(None, feed), 5) for _ in range(repeats))
    return 2 * n**3 / best / 1e9


def digits_accuracy(model: dict) -> str | None:
    """fp32 vs int8 accuracy on the sample run's held-out images (its split.json)."""
    split = SAMPLE_CKPT.parent.parent / "split.json"
    if model["meta"] is None or not split.is_file():
        return None
    names = model["meta"]["class_names"]
    val = json.loads(split.read_text())["val"]
    pre = model["pre"]
    pixels = np.stack(
        [pre.to_uint8(load_image(ROOT / e["path"] if not Path(e["path"]).exists() else e["path"])) for e in val]
    )
    labels = np.array([names.index(e["label"]) if isinstance(e["label"], str) else int(e["label"]) for e in val])
    acc = {}
    with torch.inference_mode():
        acc["torch fp32"] = float(
            (model["net"](torch.from_numpy(pre.normalize(pixels))).argmax(-1).numpy() == labels).mean()
        )
    for e in ("ORT fp32", "ORT int8"):
        s = session(model["files"][e], 2)
        logits = np.concatenate(
            [s.run(["logits"], {"pixels": pixels[i : i + 64]})[0] for i in range(0, len(pixels), 64)]
        )
        acc[e] = float((logits.argmax(-1) == labels).mean())
    loss = 100 * (acc["ORT fp32"] - acc["ORT int8"])
    return (
        f"held-out digits ({len(labels)} images): torch fp32 {acc['torch fp32']:.2%}, ORT fp32 {acc['ORT fp32']:.2%}, "
        f"ORT int8 {acc['ORT int8']:.2%} -> int8 loses {loss:.2f} points (target <= 0.5)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds per measurement (best reported)")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = add_results_option(p).parse_args()
    logging.getLogger().setLevel(logging.ERROR)  # onnxruntime.quantization's advice to pre-process, every time
    setting = {"repeats": args.repeats, "models": " ".join(args.models)}
    result = Result("export_bench", setting, packages=("torch", "onnxruntime", "onnx", "timm"), results=args.results)
    t0 = time.perf_counter()
    notes, results = [], {}
    peaks: dict[int, list[float]] = {1: [], 2: []}

    def sample_peak() -> None:  # between the models, so the peak sees the same neighbours as they do
        for threads in peaks:
            peaks[threads].append(matmul_peak(threads))

    sample_peak()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            model = build(name, Path(tmp))
            if model["note"]:
                notes.append(f"{name}: {model['note']}")
            results[name] = (model, bench_model(model, args.repeats))
            sample_peak()
            print(f"  measured {name} at {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

        title = "One intra-op thread; ms per batch (speed-up over torch eager)"
        one_thread = result.table(["model", "batch", *ENGINES], title)
        for name, (_, rows) in results.items():
            for batch in (1, 32):
                cells = {r["engine"]: r for r in rows if r["threads"] == 1 and r["batch"] == batch}
                one_thread.add(name, batch, *(f"{cells[e]['ms']:.2f} ({cells[e]['x']:.2f}x)" for e in ENGINES))

        title = "Two intra-op threads; ms per batch (speed-up over the same engine with one thread)"
        two_threads = result.table(["model", "batch", *THREAD_ENGINES], title)
        for name, (_, rows) in results.items():
            for batch in (1, 32):
                one = {r["engine"]: r["ms"] for r in rows if r["threads"] == 1 and r["batch"] == batch}
                two = {r["engine"]: r["ms"] for r in rows if r["threads"] == 2 and r["batch"] == batch}
                two_threads.add(name, batch, *(f"{two[e]:.2f} ({one[e] / two[e]:.2f}x)" for e in THREAD_ENGINES))

        title = "Each engine at its best thread count, batch 1 (targets: ORT fp32 >= 1.3x, ORT int8 >= 2.5x)"
        columns = ["model", "torch eager ms", "ORT fp32 ms", "fp32 speed-up", "ORT int8 ms", "int8 speed-up"]
        formats = {c: "{:.2f}" for c in columns[1:]} | {"fp32 speed-up": "{:.2f}x", "int8 speed-up": "{:.2f}x"}
        best_threads = result.table(columns, title, formats)
        for name, (_, rows) in results.items():
            best = {
                e: min(r["ms"] for r in rows if r["engine"] == e and r["batch"] == 1)
                for e in ("torch eager", "ORT fp32", "ORT int8")
            }
            eager = best["torch eager"]
            fp32, int8 = best["ORT fp32"], best["ORT int8"]
            best_threads.add(name, eager, fp32, eager / fp32, int8, eager / int8)

        if "vit_small" in results:
            model, rows = results["vit_small"]
            flops = model["net"].flops_per_image()
            notes.append(f"ViT-S/16 fp32 at batch 1: {flops / 1e9:.2f} GFLOP per image (model.flops_per_image())")
            for threads in (1, 2):
                ms = next(
                    r["ms"] for r in rows if r["engine"] == "ORT fp32" and r["batch"] == 1 and r["threads"] == threads
                )
                ms32 = next(
                    r["ms"] for r in rows if r["engine"] == "ORT fp32" and r["batch"] == 32 and r["threads"] == threads
                )
                peak = max(peaks[threads])
                achieved, achieved32 = flops / ms / 1e6, 32 * flops / ms32 / 1e6
                notes.append(
                    f"{threads} thread(s): achieved {achieved:.1f} GFLOP/s at batch 1 "
                    f"({achieved32:.1f} at batch 32); "
                    f"MatMul peak (1024^3, best of {len(peaks[threads])} samples) {peak:.1f} GFLOP/s; "
                    f"ratio {achieved / peak:.0%} (batch 32: {achieved32 / peak:.0%})"
                )

        if "sample" in results:
            line = digits_accuracy(results["sample"][0])
            notes.append(line or "int8 accuracy on held-out digits: skipped (no runs/sample/checkpoints/best.ckpt)")
    best_threads.notes += notes
    result.data = {name: rows for name, (_, rows) in results.items()} | {"matmul_peaks": peaks}
    result.finish()
    print(f"total {time.perf_counter() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
