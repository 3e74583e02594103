"""`vit-export`: a trained checkpoint -> one self-describing ONNX file, checked against torch.

    vit-export runs/sample/checkpoints/best.ckpt -o artifacts/sample.onnx [--quantize int8]

The file holds, with no side files:
- the graph: (B, H, W, 3) uint8 pixels in (resized and cropped by `Preprocess.to_uint8`),
  normalisation inside, logits out; an optional boolean `explain` input switches to the explain
  branch, which also outputs every block's attention maps (`serve.export.merge`); the logits path's
  attention blocks and GELUs are onnxruntime contrib ops (`Attention`, `BiasGelu`: `serve.export.fusion`);
- `metadata_props`: class names, input size, preprocessing, patch grid, prefix tokens, depth,
  heads, variant, the checkpoint's sha256 and the versions used (see `build_metadata`).

Before the file is written, the parity gate (`serve.export.parity`) runs torch and onnxruntime on
validation images and refuses the export when they disagree.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import tempfile
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort
import torch

from serve.export.merge import combine_fast_and_explain, set_metadata
from serve.export.trace import DEFAULT_OPSET, PixelModel, export_fast_graph, export_gradient_graph, export_graph
from serve.runtime.classifier import FORMAT_KEY, FORMAT_VERSION
from serve.runtime.images import Preprocess
from train.checkpoint import load_network
from vit.model import VisionTransformer

log = logging.getLogger(__name__)


def versions(opset: int) -> dict[str, str]:
    def v(pkg: str) -> str:
        try:
            return importlib_metadata.version(pkg)
        except importlib_metadata.PackageNotFoundError:
            return "unknown"

    return {
        "vitscope": v("vitscope"),
        "torch": str(torch.__version__),
        "onnx": onnx.__version__,
        "onnxruntime": ort.__version__,
        "opset": str(opset),
    }


def build_metadata(
    net: VisionTransformer,
    meta: dict[str, Any],
    preprocess: Preprocess,
    opset: int,
    quantization: str = "none",
    gradients: bool = False,
    fused: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Everything a client needs to use the file, as `metadata_props` entries.

    `fused` counts the onnxruntime contrib ops (com.microsoft) in the logits path (`serve.export.fusion`).
    """
    H, W = preprocess.img_size
    P = net.patch_embed.patch_size[0]
    return {
        FORMAT_KEY: FORMAT_VERSION,
        "class_names": list(meta["class_names"]),
        "input": "pixels: (B, H, W, 3) uint8 RGB, resized and centre-cropped as in 'preprocess'; normalised inside",
        "outputs": "logits (B, K); attns (depth, B, nh, N, N) when explain=True; grads (same shape) when also "
        "gradients=True, d(logit of target[b])/d(attns); outputs not asked for are empty",
        "input_size": [H, W],
        "preprocess": preprocess.to_dict(),
        "mean": list(preprocess.mean),
        "std": list(preprocess.std),
        "patch_size": P,
        "grid_size": [H // P, W // P],
        "num_prefix_tokens": net.num_prefix_tokens,
        "depth": len(net.blocks),
        "num_heads": net.blocks[0].attn.num_heads if len(net.blocks) else 0,
        "rollout_query": net.rollout_query,
        "gflops_per_image": round(net.flops_per_image() / 1e9, 4),
        "variant": str(meta.get("variant") or ""),
        "model_config": {
            k: v for k, v in net.config.items() if isinstance(v, (int, float, str, bool, list, tuple, type(None)))
        },
        "checkpoint_sha256": meta.get("sha256", ""),
        "quantization": quantization,
        "explain_precision": "fp32",
        "contrib_ops": {k: v for k, v in (fused or {}).items() if v},
        "supports_gradients": gradients,
        "versions": versions(opset),
    }


@dataclasses.dataclass
class ExportResult:
    """What `export_onnx` wrote and measured."""

    path: Path
    metadata: dict[str, Any]
    parity: dict[str, Any] | None = None
    quantization: dict[str, Any] | None = None


def export_onnx(
    checkpoint: str | Path,
    output: str | Path,
    *,
    quantize: str | None = None,
    opset: int = DEFAULT_OPSET,
    img_size: tuple[int, int] | None = None,
    val_dir: str | Path | None = None,
    parity_samples: int = 256,
    check_parity: bool = True,
    gradients: bool = True,
) -> ExportResult:
    """Export a checkpoint to one ONNX file, check it against torch, and write it.

    Args:
        checkpoint: a vitscope checkpoint (`best.ckpt`).
        output: the .onnx file to write.
        quantize: None for fp32, or "int8" (dynamic, or static when calibration on the validation
            images is better); the explain branch stays fp32.
        opset: ONNX opset.
        img_size: (H, W) to export at instead of the training size (multiples of the patch size).
        val_dir: an image folder (one subfolder per class) for the parity gate when the run has no split.json.
        parity_samples: at most this many validation images in the parity gate.
        check_parity: run the parity gate (only tests of the gate itself turn it off).
        gradients: include the gradient graph for class-specific gradient rollout (a larger
            file, `ls -l`; the logits path is unaffected).

    Returns:
        An `ExportResult`.

    Raises:
        ParityError: torch and onnxruntime disagree beyond the thresholds; nothing is written.
    """
    from serve.export import parity
    from serve.export import quantize as quant

    checkpoint, output = Path(checkpoint), Path(output)
    net, meta = load_network(checkpoint)
    preprocess = meta["preprocess"]
    if img_size is not None:
        P = net.patch_embed.patch_size[0]
        if img_size[0] % P or img_size[1] % P:
            raise ValueError(f"--img-size {img_size} must be multiples of the patch size {P}")
        preprocess = dataclasses.replace(preprocess, img_size=tuple(img_size))
    if quantize not in (None, "int8"):
        raise ValueError(f"quantize must be None or 'int8', got {quantize!r}")

    log.info("exporting %s at %s", checkpoint, preprocess.img_size)
    fast, fused = export_fast_graph(net, preprocess, opset)
    explain = export_graph(PixelModel(net, preprocess.mean, preprocess.std, explain=True), preprocess.img_size, opset)
    grads = export_gradient_graph(net, preprocess, opset) if gradients else None
    sample = parity.validation_sample(checkpoint, meta["class_names"], preprocess, val_dir, parity_samples)

    quant_report = None
    quantization = "none"
    if quantize == "int8":
        fast, quant_report = quant.quantize_int8(fast, sample, net, preprocess)
        quantization = quant_report["chosen"]

    model = combine_fast_and_explain(fast, explain, grads)
    metadata = build_metadata(net, meta, preprocess, opset, quantization, gradients=grads is not None, fused=fused)
    set_metadata(model, metadata)
    model.doc_string = f"vitscope {metadata['variant'] or 'ViT'} classifier, {len(meta['class_names'])} classes"
    onnx.checker.check_model(model)

    output.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".onnx", dir=output.parent, prefix=f".{output.stem}.")
    os.close(fd)
    tmp = Path(tmp)
    try:
        tmp.write_bytes(model.SerializeToString())
        report = None
        if check_parity:
            report = parity.check(net, tmp, sample, preprocess, int8=quantize == "int8")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it owner-only; a model file is for every reader
        os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)
    return ExportResult(output, metadata, report, quant_report)


def main(argv: list[str] | None = None) -> int:
    """Command line entry point (`vit-export`)."""
    from serve.export.parity import ParityError, format_report

    p = argparse.ArgumentParser(prog="vit-export", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", type=Path, help="a vitscope checkpoint, e.g. runs/sample/checkpoints/best.ckpt")
    p.add_argument("-o", "--output", type=Path, required=True, help="the .onnx file to write")
    p.add_argument("--quantize", choices=["int8"], default=None, help="int8 weights for the logits path")
    p.add_argument("--opset", type=int, default=DEFAULT_OPSET, help=f"ONNX opset (default {DEFAULT_OPSET})")
    p.add_argument("--img-size", type=int, nargs=2, metavar=("H", "W"), help="export at another input size")
    p.add_argument("--val-dir", type=Path, help="image folder for the parity gate when the run has no split.json")
    p.add_argument(
        "--no-gradients", action="store_true", help="leave out the gradient graph (smaller file, no gradient rollout)"
    )
    p.add_argument("--parity-samples", type=int, default=256, help="validation images in the parity gate")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    logging.getLogger("serve").setLevel(logging.INFO)  # our progress; the exporter's own INFO chatter stays quiet
    try:
        result = export_onnx(
            args.checkpoint,
            args.output,
            quantize=args.quantize,
            opset=args.opset,
            img_size=tuple(args.img_size) if args.img_size else None,
            val_dir=args.val_dir,
            parity_samples=args.parity_samples,
            gradients=not args.no_gradients,
        )
    except ParityError as e:
        print(format_report(e.report), file=sys.stderr)
        print(f"vit-export: parity gate FAILED, nothing written: {e}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError) as e:
        print(f"vit-export: {e}", file=sys.stderr)
        return 2
    print(format_report(result.parity, result.quantization))
    size_mb = result.path.stat().st_size / 1e6
    print(f"wrote {result.path} ({size_mb:.1f} MB, {len(result.metadata['class_names'])} classes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
