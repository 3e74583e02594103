"""Export targets: which graphs go into the file, and which ONNX opset and IR version it declares.

- `onnxruntime` (the default): the fast logits path fused into onnxruntime's contrib ops
  (`serve.export.fusion`), the explain and gradient graphs behind optional inputs and an `If`
  (`serve.export.merge`). Fastest on onnxruntime; other runtimes cannot read it.
- `portable`: standard ONNX ops only (no `com.microsoft` domain), no `If`, no optional inputs: one
  plain graph, `pixels` in, `logits` and `attns` out, both always computed (the explicit softmax path,
  whose maps cost one copy per block). It runs in onnxruntime, OpenVINO and `onnx.reference`; no
  gradient graph (its backward pass needs a `target` input that every call would have to send).

A file declares the IR version of the oldest onnx release that knows its opset, so that the
oldest onnxruntime for that opset (`OLDEST_ONNXRUNTIME`) loads it: onnxruntime refuses a newer IR
version than its own even when nothing in the file needs it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import onnx
from onnx import helper

from serve.export.merge import combine_fast_and_explain
from serve.export.trace import PixelModel, export_fast_graph, export_gradient_graph, export_graph
from serve.runtime.images import Preprocess
from vit.model import VisionTransformer

# Shapes: B batch, H/W image, K classes, nh heads, N tokens, depth blocks.

TARGETS = ("onnxruntime", "portable")
# LayerNormalization is opset 17, so nothing older; the newest is the newest we export and test.
OPSETS = range(17, 22)
# The oldest onnxruntime that runs each opset, for both targets (the contrib ops in the onnxruntime
# target are older than all of these). 1.15 is the oldest wheel for Python 3.11; it has no opset-19
# kernels for Shape or If, which 1.16 has.
OLDEST_ONNXRUNTIME = {17: "1.15", 18: "1.15", 19: "1.16", 20: "1.17", 21: "1.18"}


@dataclasses.dataclass
class Graphs:
    """What `build` made: the file's model, the logits-only model (for Triton) and how they were made."""

    model: onnx.ModelProto
    logits_only: onnx.ModelProto | None
    fused: dict[str, int]
    quantization: str = "none"
    quant_report: dict[str, Any] | None = None
    logits_only_quantization: str = "none"  # the portable logits-only graph is quantised on its own


def build(
    net: VisionTransformer,
    preprocess: Preprocess,
    *,
    target: str,
    opset: int,
    sample: Any,
    quantize: str | None = None,
    gradients: bool = True,
    logits_only: bool = False,
) -> Graphs:
    """Export the graphs a target needs and put them together, at exactly `opset`.

    Args:
        net: the trained network.
        preprocess: the serving preprocessing (input size, mean, std).
        target: "onnxruntime" or "portable".
        opset: the ONNX opset, in `OPSETS`.
        sample: a `serve.export.parity.Sample`, to calibrate and choose int8.
        quantize: None or "int8".
        gradients: include the gradient graph (onnxruntime target only).
        logits_only: also make the logits-only model (the Triton model), in the target's ops.
    """
    if target not in TARGETS:
        raise ValueError(f"--target {target!r} is not one of {', '.join(TARGETS)}")
    check_opset(opset)
    int8 = quantize == "int8"
    if target == "portable":
        explain = PixelModel(net, preprocess.mean, preprocess.std, explain=True)
        model, report = _finish(
            portable(export_graph(explain, preprocess.img_size, opset)), opset, int8, sample, net, preprocess
        )
        fast, fast_report = None, None
        if logits_only:
            fast, _ = export_fast_graph(net, preprocess, opset, fuse=False)
            fast, fast_report = _finish(fast, opset, int8, sample, net, preprocess)
        chosen = report["chosen"] if report else "none"
        return Graphs(model, fast, {}, chosen, report, fast_report["chosen"] if fast_report else "none")
    fast, fused = export_fast_graph(net, preprocess, opset)
    fast, report = _finish(fast, opset, int8, sample, net, preprocess, portable_ops=False)
    explain = export_graph(PixelModel(net, preprocess.mean, preprocess.std, explain=True), preprocess.img_size, opset)
    grads = export_gradient_graph(net, preprocess, opset) if gradients else None
    parts = [pin_versions(g, opset) for g in (explain, grads) if g is not None]
    model = pin_versions(combine_fast_and_explain(fast, *parts), opset)
    chosen = report["chosen"] if report else "none"
    return Graphs(model, fast if logits_only else None, fused, chosen, report, chosen)


def _finish(
    model: onnx.ModelProto,
    opset: int,
    int8: bool,
    sample: Any,
    net: VisionTransformer,
    preprocess: Preprocess,
    portable_ops: bool = True,
) -> tuple[onnx.ModelProto, dict[str, Any] | None]:
    """Quantise when asked, then declare `opset`; for the portable target, check for standard ops."""
    from serve.export import quantize as quant

    report = None
    if int8:
        model, report = quant.quantize_int8(model, sample, net, preprocess, portable=portable_ops)
    model = pin_versions(drop_unused_domains(model), opset)
    if portable_ops:
        check_standard_ops(model)
    return model, report


def check_opset(opset: int) -> None:
    """Raise ValueError unless `opset` is one we export."""
    if opset not in OPSETS:
        oldest = ", ".join(f"{o}: {v}" for o, v in OLDEST_ONNXRUNTIME.items())
        raise ValueError(
            f"--opset {opset} is not supported: choose {OPSETS[0]} to {OPSETS[-1]} "
            f"(the oldest onnxruntime for each: {oldest})"
        )


def default_opset(model: onnx.ModelProto) -> int:
    """The version of the standard ONNX domain the model imports."""
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def pin_versions(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    """Make the model declare exactly `opset` and the oldest IR version that holds it.

    The torch exporter writes its own newest IR version and, below its native opset, converts the
    graph down when it can; a graph that came back at another opset is converted here, and refused
    when onnx cannot convert it.

    Raises:
        ValueError: the graph cannot be expressed at `opset`.
    """
    if default_opset(model) != opset:
        try:
            model = onnx.version_converter.convert_version(model, opset)
        except Exception as e:  # onnx's converter raises RuntimeError with a C++ assertion text
            first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise ValueError(
                f"--opset {opset}: the graph cannot be written at this opset ({first}); "
                f"choose {OPSETS[0]} to {OPSETS[-1]}"
            ) from None
        if opset < 18:
            _drop_opset18_reduce_attribute(model)
    model.ir_version = helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True)
    return model


# Reductions whose `axes` became an input at opset 18, with the `noop_with_empty_axes` attribute beside it
_AXES_INPUT_AT_18 = {
    f"Reduce{op}" for op in ("L1", "L2", "LogSum", "LogSumExp", "Max", "Mean", "Min", "Prod", "SumSquare")
}


def _drop_opset18_reduce_attribute(model: onnx.ModelProto) -> None:
    """Remove `noop_with_empty_axes` that onnx's 18 -> 17 converter leaves on reductions.

    The converter turns the `axes` input back into an attribute but keeps the opset-18 attribute,
    which opset 17 does not know: the checker refuses the file (seen on the pooled ViT's ReduceMean).
    At its default (0) the attribute changes nothing; set, it has no opset-17 spelling.
    """
    for n in all_nodes([model.graph, *model.functions]):
        if n.op_type not in _AXES_INPUT_AT_18 or n.domain not in ("", "ai.onnx"):
            continue
        for i, a in enumerate(n.attribute):
            if a.name == "noop_with_empty_axes":
                if a.i:
                    raise ValueError(f"--opset 17: {n.op_type} {n.name!r} needs noop_with_empty_axes (opset 18)")
                del n.attribute[i]
                break


def all_nodes(graphs: list) -> Iterator[onnx.NodeProto]:
    """Every node of `graphs` (graphs or functions) and of the subgraphs inside them (If, Loop, Scan bodies)."""
    stack = list(graphs)
    while stack:
        for n in stack.pop().node:
            yield n
            stack.extend(a.g for a in n.attribute if a.type == onnx.AttributeProto.GRAPH)
            stack.extend(sub for a in n.attribute if a.type == onnx.AttributeProto.GRAPHS for sub in a.graphs)


def portable(explain: onnx.ModelProto) -> onnx.ModelProto:
    """The explain graph as the whole portable file: local functions inlined, standard ops only.

    Args:
        explain: a model with input `pixels` (B, H, W, 3) uint8 and outputs `logits` (B, K),
            `attns` (depth, B, nh, N, N).

    Returns:
        A model with the same inputs and outputs and no functions.

    Raises:
        ValueError: a node outside the standard ONNX domain.
    """
    model = onnx.inliner.inline_local_functions(explain) if explain.functions else explain
    check_standard_ops(model)
    model.producer_name = "vitscope"
    return model


def check_standard_ops(model: onnx.ModelProto) -> None:
    """Raise ValueError if any node (in any subgraph) or opset import is outside the standard ONNX domain."""
    domains = {o.domain for o in model.opset_import} - {"", "ai.onnx"}
    domains |= {n.domain for n in all_nodes([model.graph])} - {"", "ai.onnx"}
    if domains:
        raise ValueError(f"the portable target must use standard ONNX ops only, found domains {sorted(domains)}")


def drop_unused_domains(model: onnx.ModelProto) -> onnx.ModelProto:
    """Remove opset imports of domains no node uses (onnxruntime's quantizer always adds its own)."""
    used = {n.domain for n in model.graph.node} | {"", "ai.onnx"}
    keep = [o for o in model.opset_import if o.domain in used]
    del model.opset_import[:]
    model.opset_import.extend(keep)
    return model
