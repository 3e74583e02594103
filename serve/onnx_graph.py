"""Graph surgery for the exported file: two graphs in one model, sharing their weights.

The fast graph (fused attention, logits only) and the explain graph (explicit softmax, logits and
every block's attention maps) are exported separately, then become the two branches of one `If`
node on a boolean `explain` input. Weights are stored once, in the outer graph, where both
branches can read them (ONNX outer-scope references). `explain` is also an initializer with value
False, so it is an optional input: a client that only sends `pixels` gets the fast branch and
never pays for the attention maps.

    pixels (B, H, W, 3) uint8 --+--> If(explain) --then--> explain graph -> logits (B, K), attns (depth, B, nh, N, N)
    explain () bool [False] ----+                 --else--> fast graph    -> logits (B, K), attns (0, 0, 0, 0, 0)
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

EXPLAIN_INPUT = "explain"


def combine_fast_and_explain(fast: onnx.ModelProto, explain: onnx.ModelProto) -> onnx.ModelProto:
    """One model whose `explain` input picks the fast graph or the explain graph.

    Args:
        fast: a model with one input `pixels` and one output `logits`.
        explain: a model with input `pixels` and outputs `logits`, `attns`.

    Returns:
        A model with inputs `pixels`, optional `explain`, and outputs `logits`, `attns`.
    """
    shared: dict[str, onnx.TensorProto] = {}
    then_graph = _as_branch(explain, "explain", shared)
    else_graph = _as_branch(fast, "fast", shared)
    # the fast branch outputs an empty attns tensor, since both branches must give the same outputs
    empty = helper.make_node(
        "ConstantOfShape",
        [_const(else_graph, "fast/empty_shape", [0, 0, 0, 0, 0])],
        ["fast/attns"],
        value=helper.make_tensor("v", TensorProto.FLOAT, [1], [0.0]),
    )
    else_graph.node.append(empty)
    else_graph.output.append(helper.make_tensor_value_info("fast/attns", TensorProto.FLOAT, None))

    pixels = fast.graph.input[0]
    logits_type = explain.graph.output[0].type
    attns_type = explain.graph.output[1].type
    if_node = helper.make_node(
        "If",
        [EXPLAIN_INPUT],
        ["logits", "attns"],
        name="explain_or_fast",
        then_branch=then_graph,
        else_branch=else_graph,
    )
    explain_default = numpy_helper.from_array(np.array(False), EXPLAIN_INPUT)
    graph = helper.make_graph(
        [if_node],
        "vitscope",
        [pixels, helper.make_tensor_value_info(EXPLAIN_INPUT, TensorProto.BOOL, [])],
        [_value_info("logits", logits_type), _value_info("attns", attns_type)],
        initializer=[explain_default, *shared.values()],
    )
    model = helper.make_model(graph, opset_imports=list(fast.opset_import), ir_version=fast.ir_version)
    model.producer_name = "vitscope"
    onnx.checker.check_model(model, full_check=False)
    return model


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


def _as_branch(model: onnx.ModelProto, prefix: str, shared: dict[str, onnx.TensorProto]) -> onnx.GraphProto:
    """The model's graph as an If branch: no inputs, its names prefixed, its weights moved to `shared`.

    `shared` maps a content digest to the tensor: identical tensors (same dtype, shape and
    bytes) from both graphs are stored once.
    """
    if model.functions:
        model = onnx.inliner.inline_local_functions(model)
    g = model.graph
    outer = {i.name for i in g.input}  # read from the outer graph, not renamed
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
    """Write `metadata` into `metadata_props`: strings as they are, everything else as JSON."""
    del model.metadata_props[:]
    for k, v in metadata.items():
        p = model.metadata_props.add()
        p.key, p.value = k, v if isinstance(v, str) else json.dumps(v)
