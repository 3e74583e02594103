"""The network as ONNX graphs: uint8 pixels in, normalisation inside, with a dynamic batch axis.

Three graphs of one network, combined into one file by `serve.export.merge`:
- the fast graph (`PixelModel`, `export_fast_graph`): fused attention, logits and features, its
  attention blocks and GELUs then fused into onnxruntime contrib ops (`serve.export.fusion`);
- the explain graph (`PixelModel(explain=True)`): the explicit softmax path, logits, maps and features;
- the gradient graph (`GradientModel`): also the gradient of a target logit with respect to
  every map, its backward pass traced to plain aten ops by `make_fx` before export.
Every graph also outputs `features` (B, F), the pooled, normalised pre-logits the head reads (with a patch-average
head, the average before its norm too: `VisionTransformer.logits_and_features`): the Mahalanobis unknown-input score
(`serve.runtime.trust`) measures distances there. A network with `flip_tta`
runs each image and its mirror in every graph and answers their mean (`vit.flip`), maps and gradients merged.
The portable target (`serve.export.targets`) ships the explain graph alone instead, and, for a
Triton repository, the fast graph unfused (`export_fast_graph(fuse=False)`): standard ONNX ops only.
"""

from __future__ import annotations

import io
import warnings
from contextlib import redirect_stdout

import onnx
import torch
from torch import nn

from serve.export.fusion import fuse_for_cpu
from serve.runtime.images import Preprocess
from vit import flip
from vit.model import VisionTransformer
from vit.rollout import attention_gradients

# Shapes: B batch, H/W image, K classes, D features, nh heads, N tokens, depth blocks.

FAST_OUTPUTS = ["logits", "features"]
EXPLAIN_OUTPUTS = ["logits", "attns", "features"]
GRADIENT_OUTPUTS = ["logits", "attns", "grads", "features"]

DEFAULT_OPSET = 18
# torch's exporter writes no older opset: asked for 17, it tried the onnx version converter, which fails on this
# graph and printed three tracebacks. The graphs are exported at 18 and `pin_versions` (`serve.export.targets`)
# brings them down to the asked opset, as it did after those failures.
TORCH_MIN_OPSET = 18


class PixelModel(nn.Module):
    """The network behind its input contract: uint8 NHWC pixels in, normalisation inside.

    The arithmetic is `Preprocess.normalize`'s, in the same order and precision, so torch on
    normalised floats and onnxruntime on pixels see identical inputs. The channels move first,
    while the pixels are still one byte each: per-channel constants then broadcast over whole
    (H, W) planes, which onnxruntime does several times faster than over a trailing axis of 3.

    Args:
        net: the trained network.
        mean: per-channel mean, RGB.
        std: per-channel standard deviation, RGB.
        explain: also return the stacked attention maps (the explicit softmax path).

    Returns `FAST_OUTPUTS` (or `EXPLAIN_OUTPUTS`) in that order.
    """

    def __init__(self, net: VisionTransformer, mean: tuple[float, ...], std: tuple[float, ...], explain: bool = False):
        super().__init__()
        self.net = net
        self.explain = explain
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1))

    def normalize(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, H, W, 3) uint8 -> (B, 3, H, W) float32, elementwise as `Preprocess.normalize`."""
        x = pixels.permute(0, 3, 1, 2).to(torch.float32) / 255.0  # (B, 3, H, W)
        return (x - self.mean) / self.std

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = self.normalize(pixels)  # (B, 3, H, W)
        net = self.net
        if not self.explain:
            return flip.logits_and_features(net, x)  # (B, K), (B, D)
        views = flip.two_views(x) if net.two_views else x  # (B or 2B, 3, H, W): with flip_tta, the mirrors too
        tokens, attns = net.forward_features(views, return_attn=True)
        logits, features = net.logits_and_features(tokens)  # (B or 2B, K), (B or 2B, D)
        if net.two_views:  # one row per image: the mean of its two views, the mirror's maps mirrored back
            logits, features, attns = flip.mean_of_views(logits), flip.mean_of_views(features), net.merge_maps(attns, x)
        return logits, torch.stack(attns), features  # (B, K), (depth, B, nh, N, N), (B, D)


class GradientModel(nn.Module):
    """Pixels and a target class per image -> logits, attention maps, and d(target logit)/d(map).

    Traced with its backward pass (`make_fx`) into plain aten ops, so the ONNX file can compute
    class-specific gradient rollout without torch.
    """

    def __init__(self, net: VisionTransformer, mean: tuple[float, ...], std: tuple[float, ...]):
        super().__init__()
        self.pixels = PixelModel(net, mean, std, explain=True)

    def forward(self, pixels: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`GRADIENT_OUTPUTS`: logits (B, K), attns and grads (depth, B, nh, N, N), features (B, D)."""
        x = self.pixels.normalize(pixels)  # (B, 3, H, W)
        logits, features, attns, grads = attention_gradients(self.pixels.net, x, target)
        return logits, torch.stack(attns), torch.stack(grads), features


def export_gradient_graph(
    net: VisionTransformer, preprocess: Preprocess, opset: int = DEFAULT_OPSET
) -> onnx.ModelProto:
    """Export `GradientModel`: trace forward and backward to aten ops, then export those with a dynamic batch."""
    from torch.fx.experimental.proxy_tensor import make_fx

    H, W = preprocess.img_size
    module = GradientModel(net, preprocess.mean, preprocess.std).eval()
    pixels = torch.randint(0, 256, (2, H, W, 3), dtype=torch.uint8)
    target = torch.zeros(2, dtype=torch.int64)
    requires = [p.requires_grad for p in net.parameters()]
    batch = torch.export.Dim("batch", min=1, max=4096)
    try:
        for p in net.parameters():
            p.requires_grad_(True)  # the maps need a graph to differentiate through
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            traced = make_fx(module, tracing_mode="symbolic", _allow_non_fake_inputs=True)(pixels, target)
        for p in net.parameters():
            p.requires_grad_(False)  # the backward pass is now explicit ops in `traced`
        with warnings.catch_warnings(), redirect_stdout(io.StringIO()), torch.no_grad():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                traced,
                (pixels, target),
                input_names=["pixels", "target"],
                output_names=GRADIENT_OUTPUTS,
                dynamic_shapes=({0: batch}, {0: batch}),
                opset_version=max(opset, TORCH_MIN_OPSET),
                dynamo=True,
                external_data=False,
                verbose=False,
            )
    finally:
        for p, r in zip(net.parameters(), requires, strict=True):
            p.requires_grad_(r)
    return program.model_proto


def export_graph(module: nn.Module, img_size: tuple[int, int], opset: int = DEFAULT_OPSET) -> onnx.ModelProto:
    """Export a `PixelModel` with the dynamo exporter and a dynamic batch axis."""
    H, W = img_size
    sample = torch.randint(0, 256, (2, H, W, 3), dtype=torch.uint8)
    names = EXPLAIN_OUTPUTS if getattr(module, "explain", False) else FAST_OUTPUTS
    with warnings.catch_warnings(), redirect_stdout(io.StringIO()), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module.eval(),
            (sample,),
            input_names=["pixels"],
            output_names=names,
            dynamic_shapes={"pixels": {0: torch.export.Dim("batch", min=1, max=4096)}},
            opset_version=max(opset, TORCH_MIN_OPSET),
            dynamo=True,
            external_data=False,
            verbose=False,
        )
    return program.model_proto


def export_fast_graph(
    net: VisionTransformer, preprocess: Preprocess, opset: int = DEFAULT_OPSET, fuse: bool = True
) -> tuple[onnx.ModelProto, dict[str, int]]:
    """The logits and features graph, its attention blocks and GELUs fused for onnxruntime (`serve.export.fusion`).

    Returns:
        (the graph, the count of each fused contrib op; all zero when `fuse` is False).
    """
    fast = export_graph(PixelModel(net, preprocess.mean, preprocess.std), preprocess.img_size, opset)
    if not fuse:
        return fast, {}
    num_heads = net.blocks[0].attn.num_heads if len(net.blocks) else 1
    return fuse_for_cpu(fast, num_heads)
