"""The file's `metadata_props`: everything a client needs to use it, with no side files.

Class names, input size, preprocessing, patch grid, prefix tokens, depth, heads, variant, the
export target and the oldest onnxruntime that loads it, the checkpoint's sha256 and the versions used.
Values are written by `serve.export.merge.set_metadata` (strings as they are, the rest as JSON).
"""

from __future__ import annotations

from importlib import metadata as importlib_metadata
from typing import Any

import onnx
import onnxruntime as ort
import torch

from serve.export import targets
from serve.runtime.classifier import FORMAT_KEY, FORMAT_VERSION
from serve.runtime.images import Preprocess
from vit.model import VisionTransformer


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
    target: str = "onnxruntime",
) -> dict[str, Any]:
    """Everything a client needs to use the file, as `metadata_props` entries.

    `fused` counts the onnxruntime contrib ops (com.microsoft) in the logits path (`serve.export.fusion`).
    """
    H, W = preprocess.img_size
    P = net.patch_embed.patch_size[0]
    outputs = (
        "logits (B, K); attns (depth, B, nh, N, N) when explain=True; grads (same shape) when also "
        "gradients=True, d(logit of target[b])/d(attns); outputs not asked for are empty; features (B, F), the "
        "pooled pre-logits (and, for a patch-average head, that average before its norm)"
    )
    if target == "portable":
        outputs = (
            "logits (B, K), attns (depth, B, nh, N, N) and features (B, F), all always computed; "
            "no explain or gradients input"
        )
    return {
        FORMAT_KEY: FORMAT_VERSION,
        "class_names": list(meta["class_names"]),
        "input": "pixels: (B, H, W, 3) uint8 RGB, resized and centre-cropped as in 'preprocess'; normalised inside",
        "outputs": outputs,
        "target": target,
        "requires_onnxruntime": f">={targets.OLDEST_ONNXRUNTIME[opset]}",
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
        "explain_precision": "int8" if target == "portable" and quantization != "none" else "fp32",
        "contrib_ops": {k: v for k, v in (fused or {}).items() if v},
        "supports_gradients": gradients,
        "versions": versions(opset),
    }
