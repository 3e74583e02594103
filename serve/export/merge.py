"""Graph surgery for the onnxruntime target's file: two (or three) graphs in one model, sharing their weights.

The fast graph (fused attention, logits only) and the explain graph (explicit softmax, logits and
every block's attention maps) are exported separately, then become the two branches of one `If`
node on a boolean `explain` input. Weights are stored once, in the outer graph, where both
branches can read them (ONNX outer-scope references). `explain` is also an initializer with value
False, so it is an optional input: a client that only sends `pixels` gets the fast branch and
never pays for the attention maps.

    pixels (B, H, W, 3) uint8 --+--> If(explain) --else--> fast graph -> logits, features; attns, grads empty
    explain () bool [False] ----+                 --then--> If(gradients) --else--> explain graph -> + attns
    gradients () bool [False] --+                             --then--> gradient graph -> + attns, grads
    target (B,) int64 [empty] --+

logits are (B, K), features (B, D) (every branch computes them), attns and grads (depth, B, nh, N, N).
The gradient graph (optional) holds the backward pass of the target logit down to every attention map,
traced to plain ONNX ops at export time.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from serve.runtime.classifier import FORMAT_KEY
from serve.runtime.model_file import MAX_METADATA_VALUE_CHARS

EXPLAIN_INPUT = "explain"
GRADIENTS_INPUT = "gradients"
TARGET_INPUT = "target"
OUTPUTS = ["logits", "attns", "grads", "features"]  # of the combined model, and of every branch, in this order


def combine_fast_and_explain(
    fast: onnx.ModelProto, explain: onnx.ModelProto, gradients: onnx.ModelProto | None = None
) -> onnx.ModelProto:
    """One model whose `explain` (and `gradients`) inputs pick the fast, explain or gradient graph.

    Args:
        fast: a model with one input `pixels` and outputs `logits`, `features`.
        explain: a model with input `pixels` and outputs `logits`, `attns`, `features`.
        gradients: optional, a model with inputs `pixels`, `target` and outputs `logits`, `attns`,
            `grads` (the gradient of each image's target logit with respect to every attention map), `features`.

    Returns:
        A model with inputs `pixels`, optional `explain` (and, with a gradient graph, optional
        `gradients` and `target`), and `OUTPUTS`; maps a branch does not compute are empty.
    """
    shared: dict[str, onnx.TensorProto] = {}
    outer = {"pixels", TARGET_INPUT}
    explain_graph = _as_branch(explain, "explain", shared, outer)
    _pad_outputs(explain_graph, "explain", ["grads"])
    fast_graph = _as_branch(fast, "fast", shared, outer)
    _pad_outputs(fast_graph, "fast", ["attns", "grads"])
    for g, prefix in ((explain_graph, "explain"), (fast_graph, "fast")):
        _order_outputs(g, prefix)
    inputs = [fast.graph.input[0], helper.make_tensor_value_info(EXPLAIN_INPUT, TensorProto.BOOL, [])]
    defaults = [numpy_helper.from_array(np.array(False), EXPLAIN_INPUT)]
    then_graph = explain_graph
    if gradients is not None:
        then_graph, grad_inputs, grad_defaults = _gradients_or_maps(gradients, explain_graph, shared, outer)
        inputs, defaults = inputs + grad_inputs, defaults + grad_defaults
    if_node = helper.make_node(
        "If",
        [EXPLAIN_INPUT],
        OUTPUTS,
        name="explain_or_fast",
        then_branch=then_graph,
        else_branch=fast_graph,
    )
    types = {o.name: o.type for o in fast.graph.output}
    # attns and grads: rank 5 with unknown sizes, since a branch that skips them outputs (0, 0, 0, 0, 0)
    maps = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [None] * 5) for n in ("attns", "grads")]
    graph = helper.make_graph(
        [if_node],
        "vitscope",
        inputs,
        [_value_info("logits", types["logits"]), *maps, _value_info("features", types["features"])],
        initializer=[*defaults, *shared.values()],
    )
    model = helper.make_model(graph, opset_imports=list(fast.opset_import), ir_version=fast.ir_version)
    model.producer_name = "vitscope"
    onnx.checker.check_model(model, full_check=False)
    return model


def _gradients_or_maps(
    gradients: onnx.ModelProto, explain_graph: onnx.GraphProto, shared: dict[str, onnx.TensorProto], outer: set[str]
) -> tuple[onnx.GraphProto, list[onnx.ValueInfoProto], list[onnx.TensorProto]]:
    """The explain branch with an inner If on `gradients`: (that branch, its extra inputs, their defaults)."""
    grad_graph = _as_branch(gradients, "grad", shared, outer)
    names = [f"select/{n}" for n in OUTPUTS]
    inner = helper.make_node(
        "If", [GRADIENTS_INPUT], names, name="gradients_or_maps", then_branch=grad_graph, else_branch=explain_graph
    )
    branch = helper.make_graph(
        [inner], "explain_select", [], [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names]
    )
    inputs = [
        helper.make_tensor_value_info(GRADIENTS_INPUT, TensorProto.BOOL, []),
        helper.make_tensor_value_info(TARGET_INPUT, TensorProto.INT64, [None]),
    ]
    defaults = [
        numpy_helper.from_array(np.array(False), GRADIENTS_INPUT),
        numpy_helper.from_array(np.zeros(0, np.int64), TARGET_INPUT),
    ]
    return branch, inputs, defaults


def _pad_outputs(graph: onnx.GraphProto, prefix: str, names: list[str]) -> None:
    """Append empty (0, 0, 0, 0, 0) float outputs: every branch of an If gives the same outputs."""
    shape = _const(graph, f"{prefix}/empty_shape", [0, 0, 0, 0, 0])
    for name in names:
        value = helper.make_tensor("v", TensorProto.FLOAT, [1], [0.0])
        graph.node.append(helper.make_node("ConstantOfShape", [shape], [f"{prefix}/{name}"], value=value))
        graph.output.append(helper.make_tensor_value_info(f"{prefix}/{name}", TensorProto.FLOAT, None))


def _order_outputs(graph: onnx.GraphProto, prefix: str) -> None:
    """Put a branch's outputs (named `prefix/<name>`) in the order of `OUTPUTS`: an If matches them by position."""
    by_name = {o.name.removeprefix(f"{prefix}/"): o for o in graph.output}
    if sorted(by_name) != sorted(OUTPUTS):
        raise ValueError(f"the {prefix} graph outputs {sorted(by_name)}, expected {OUTPUTS}")
    ordered = [by_name[n] for n in OUTPUTS]
    del graph.output[:]
    graph.output.extend(ordered)


def _value_info(name: str, type_proto: onnx.TypeProto) -> onnx.ValueInfoProto:
    vi = onnx.ValueInfoProto()
    vi.name = name
    vi.type.CopyFrom(type_proto)
    return vi


def _const(graph: onnx.GraphProto, name: str, values: list[int]) -> str:
    graph.node.append(
        helper.make_node(
            "Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [len(values)], values)
        )
    )
    return name


def _as_branch(
    model: onnx.ModelProto, prefix: str, shared: dict[str, onnx.TensorProto], outer: set[str]
) -> onnx.GraphProto:
    """The model's graph as an If branch: no inputs, its names prefixed, its weights moved to `shared`.

    `shared` maps a content digest to the tensor: identical tensors (same dtype, shape and
    bytes) from both graphs are stored once.
    """
    if model.functions:
        model = onnx.inliner.inline_local_functions(model)
    g = model.graph
    outer = outer & {i.name for i in g.input}  # the model's inputs: read from the outer graph, not renamed
    rename: dict[str, str] = {}
    for init in g.initializer:
        digest = hashlib.sha1(bytes([init.data_type]) + str(list(init.dims)).encode())
        digest.update(numpy_helper.to_array(init).tobytes())
        key = digest.hexdigest()[:16]
        if key not in shared:  # same content, same tensor: the first name it was seen under
            t = onnx.TensorProto()
            t.CopyFrom(init)
            t.name = f"{init.name.split('/')[-1]}@{key}"
            shared[key] = t
        rename[init.name] = shared[key].name

    def new(name: str) -> str:
        if not name or name in outer:
            return name
        return rename.setdefault(name, f"{prefix}/{name}")

    nodes = []
    for i, node in enumerate(g.node):
        n = onnx.NodeProto()
        n.CopyFrom(node)
        n.name = f"{prefix}/{node.name or node.op_type + str(i)}"
        n.input[:] = [new(x) for x in node.input]
        n.output[:] = [new(x) for x in node.output]
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute):
            raise ValueError("exported graphs with nested subgraphs are not supported")
        nodes.append(n)
    outputs = [_value_info(new(o.name), o.type) for o in g.output]
    return helper.make_graph(nodes, f"{prefix}_branch", [], outputs)


def set_metadata(model: onnx.ModelProto, metadata: dict[str, Any]) -> None:
    """Write `metadata` into `metadata_props`: strings as they are, everything else as JSON, the format entry last
    (the file's last bytes: a copy cut short between two entries has lost it, and the runtime refuses it).

    Raises:
        ValueError: a value longer than the runtime reads (`MAX_METADATA_VALUE_CHARS`): the file would be refused.
    """
    del model.metadata_props[:]
    last = {FORMAT_KEY: metadata[FORMAT_KEY]} if FORMAT_KEY in metadata else {}  # a copy cut short loses it first
    for k, v in ({k: v for k, v in metadata.items() if k != FORMAT_KEY} | last).items():
        p = model.metadata_props.add()
        p.key, p.value = k, v if isinstance(v, str) else json.dumps(v)
        if len(p.value) > MAX_METADATA_VALUE_CHARS:  # the Mahalanobis Gaussian of a wide model with many classes
            raise ValueError(
                f"the file's {k!r} metadata would be {len(p.value):,} characters, over the "
                f"{MAX_METADATA_VALUE_CHARS:,} the runtime reads; export with --ood-score energy, which keeps no "
                "Gaussian in the file"
            )
