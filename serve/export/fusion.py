"""Fuse the exported logits graph into onnxruntime's CPU contrib ops: exact rewrites, no approximation.

The dynamo exporter writes attention and GELU as dozens of small ops (reshapes, slices,
transposes, an Erf chain). onnxruntime fuses none of them at session load, and its own
transformer optimizer (`onnxruntime.transformers.optimizer`, model_type "vit") does not
recognise this attention pattern. So the two patterns are matched here, strictly, and replaced:

    LayerNorm -> MatMul(W_qkv) -> Add(b) -> Reshape -> Transpose -> Slice/Squeeze x3
        -> q * c, (k^T) * c -> MatMul -> Softmax -> MatMul(v) -> Transpose -> Reshape
    becomes  Attention(x, W_qkv, b, num_heads=nh, scale=c * c)                      (com.microsoft)

    MatMul -> Add(b) -> Div(sqrt 2) -> Erf -> Add(1) -> Mul(0.5) -> Mul(x)
    becomes  MatMul -> BiasGelu(., b)                                              (com.microsoft, exact erf)

Both are the same arithmetic up to float rounding (well inside the parity gate's 1e-4), and
dynamic int8 quantisation turns `Attention` into `QAttention`. A pattern that does not match
exactly (another attention score, qk-norm, no bias, or the last block of a CLS-token model, which
computes the CLS token's row alone) is left as it is. Only the fast branch is
fused: the explain and gradient branches must output the attention maps, so they stay plain ONNX.
Residual Add + LayerNormalization is deliberately not fused: onnxruntime's CPU
SkipLayerNormalization measured several times slower than the two ops it replaces.
"""

from __future__ import annotations

import collections
import math

import numpy as np
import onnx
from onnx import helper, numpy_helper

CONTRIB_DOMAIN = "com.microsoft"


class _Graph:
    """Producer and consumer lookups over one graph, and its constant initializers."""

    def __init__(self, graph: onnx.GraphProto):
        self.graph = graph
        self.inits = {i.name: i for i in graph.initializer}
        self.producer = {o: n for n in graph.node for o in n.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = collections.defaultdict(list)
        for n in graph.node:
            for i in n.input:
                self.consumers[i].append(n)

    def prod(self, name: str, op: str) -> onnx.NodeProto | None:
        n = self.producer.get(name)
        return n if n is not None and n.op_type == op else None

    def only_consumer(self, name: str, op: str) -> onnx.NodeProto | None:
        users = self.consumers.get(name, [])
        return users[0] if len(users) == 1 and users[0].op_type == op else None

    def const(self, name: str) -> np.ndarray | None:
        return numpy_helper.to_array(self.inits[name]) if name in self.inits else None

    def scalar(self, name: str) -> float | None:
        c = self.const(name)
        return float(c.item()) if c is not None and c.size == 1 else None


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _qkv_slice(g: _Graph, name: str) -> tuple[str, int] | None:
    """`Squeeze(Slice(t, [i], [i + 1], axes=[0]))` -> (t, i): one of q, k, v taken from the stacked projection."""
    sq = g.prod(name, "Squeeze")
    sl = sq and g.prod(sq.input[0], "Slice")
    if sl is None or len(sl.input) < 4:
        return None
    start, end, axes = (g.const(x) for x in sl.input[1:4])
    if start is None or end is None or axes is None or list(axes) != [0] or int(end[0]) != int(start[0]) + 1:
        return None
    return sl.input[0], int(start[0])


def _match_attention(g: _Graph, softmax: onnx.NodeProto, num_heads: int) -> tuple[onnx.NodeProto, str] | None:
    """The `Attention` node replacing the block around `softmax`, and the name of the output it takes over."""
    if _attr(softmax, "axis", -1) != -1:
        return None
    scores = g.prod(softmax.input[0], "MatMul")  # (B, nh, N, N)
    mix = g.only_consumer(softmax.output[0], "MatMul")  # (B, nh, N, hd)
    if scores is None or mix is None or mix.input[0] != softmax.output[0]:
        return None
    q_mul, k_mul = g.prod(scores.input[0], "Mul"), g.prod(scores.input[1], "Mul")
    if q_mul is None or k_mul is None:
        return None
    cq, ck = g.scalar(q_mul.input[1]), g.scalar(k_mul.input[1])
    if cq is None or ck is None:
        return None
    # k^T: (B, nh, N, hd) -> Reshape (B * nh, N, hd) -> Transpose(0, 2, 1) -> Reshape (B, nh, hd, N)
    r2 = g.prod(k_mul.input[0], "Reshape")
    tr = r2 and g.prod(r2.input[0], "Transpose")
    r1 = tr and g.prod(tr.input[0], "Reshape")
    if r1 is None or list(_attr(tr, "perm", [])) != [0, 2, 1]:
        return None
    q, k, v = _qkv_slice(g, q_mul.input[0]), _qkv_slice(g, r1.input[0]), _qkv_slice(g, mix.input[1])
    if q is None or k is None or v is None or not q[0] == k[0] == v[0] or (q[1], k[1], v[1]) != (0, 1, 2):
        return None
    stacked = g.prod(q[0], "Transpose")  # (B, N, 3, nh, hd) -> (3, B, nh, N, hd)
    split = stacked and g.prod(stacked.input[0], "Reshape")
    if split is None or list(_attr(stacked, "perm", [])) != [2, 0, 3, 1, 4]:
        return None
    shape = g.const(split.input[1])
    if shape is None or len(shape) != 5 or shape[2] != 3 or shape[3] != num_heads:
        return None
    add = g.prod(split.input[0], "Add")
    proj = g.prod(add.input[0], "MatMul") if add is not None else None
    if proj is None or proj.input[1] not in g.inits or add.input[1] not in g.inits:
        return None
    weight, bias = g.const(proj.input[1]), g.const(add.input[1])
    if weight.ndim != 2 or bias.shape != (weight.shape[1],) or weight.shape[1] != 3 * weight.shape[0]:
        return None
    merge = g.only_consumer(mix.output[0], "Transpose")  # (B, nh, N, hd) -> (B, N, nh, hd)
    out = merge and g.only_consumer(merge.output[0], "Reshape")  # -> (B, N, D)
    if out is None or list(_attr(merge, "perm", [])) != [0, 2, 1, 3]:
        return None
    merged = g.const(out.input[1])  # Attention outputs (B, N, D): the reshape must say the same
    if merged is None or len(merged) != 3 or merged[2] != weight.shape[0]:
        return None
    node = helper.make_node(
        "Attention",
        [proj.input[0], proj.input[1], add.input[1]],
        [out.output[0]],
        name=f"{softmax.name}/fused_attention",
        domain=CONTRIB_DOMAIN,
        num_heads=num_heads,
        scale=cq * ck,  # the exporter scales q and k by sqrt(scale) each
    )
    return node, out.output[0]


def _match_bias_gelu(g: _Graph, erf: onnx.NodeProto) -> tuple[onnx.NodeProto, str] | None:
    """The `BiasGelu` node replacing x * (0.5 * (erf((MatMul + b) / sqrt 2) + 1)), and the output it takes over."""
    div = g.prod(erf.input[0], "Div")
    one = g.only_consumer(erf.output[0], "Add")
    half = one and g.only_consumer(one.output[0], "Mul")
    out = half and g.only_consumer(half.output[0], "Mul")
    if div is None or out is None:
        return None
    add = g.prod(div.input[0], "Add")
    if add is None or add.input[1] not in g.inits or g.prod(add.input[0], "MatMul") is None:
        return None
    x = add.output[0]
    others = {
        "sqrt2": g.scalar(div.input[1]),
        "one": g.scalar(next((i for i in one.input if i != erf.output[0]), None)),
        "half": g.scalar(next((i for i in half.input if i != one.output[0]), None)),
    }
    if None in others.values() or set(out.input) != {x, half.output[0]}:
        return None
    if not (
        math.isclose(others["sqrt2"], math.sqrt(2), rel_tol=1e-6) and others["one"] == 1.0 and others["half"] == 0.5
    ):
        return None
    if {id(n) for n in g.consumers[x]} != {id(div), id(out)} or g.const(add.input[1]).ndim != 1:
        return None
    node = helper.make_node(
        "BiasGelu", [add.input[0], add.input[1]], [out.output[0]], name=f"{erf.name}/bias_gelu", domain=CONTRIB_DOMAIN
    )
    return node, out.output[0]


def fuse_for_cpu(model: onnx.ModelProto, num_heads: int) -> tuple[onnx.ModelProto, dict[str, int]]:
    """Rewrite the logits graph's attention blocks and GELUs into onnxruntime contrib ops.

    Args:
        model: the fast (logits-only) graph from `serve.export.trace.export_graph`, functions inlined.
        num_heads: nh of every block.

    Returns:
        (a new model, {"Attention": count, "BiasGelu": count}); unmatched patterns stay as they were.
    """
    model = onnx.inliner.inline_local_functions(model) if model.functions else _copy(model)
    g = _Graph(model.graph)
    replaced: dict[str, onnx.NodeProto] = {}  # output name -> the fused node producing it
    counts = {"Attention": 0, "BiasGelu": 0}
    for node in list(model.graph.node):
        match = None
        if node.op_type == "Softmax":
            match, kind = _match_attention(g, node, num_heads), "Attention"
        elif node.op_type == "Erf":
            match, kind = _match_bias_gelu(g, node), "BiasGelu"
        if match is not None:
            fused, output = match
            replaced[output] = fused
            counts[kind] += 1
    if not replaced:
        return model, counts
    nodes = [replaced.get(n.output[0], n) if len(n.output) == 1 else n for n in model.graph.node]
    _keep_live(model.graph, nodes)
    if not any(o.domain == CONTRIB_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(CONTRIB_DOMAIN, 1))
    return model, counts


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def _keep_live(graph: onnx.GraphProto, nodes: list[onnx.NodeProto]) -> None:
    """Set the graph's nodes to those the outputs depend on (in order), and drop initializers nothing reads."""
    needed = {o.name for o in graph.output}
    live = []
    for n in reversed(nodes):
        if any(o in needed for o in n.output):
            live.append(n)
            needed.update(n.input)
    del graph.node[:]
    graph.node.extend(reversed(live))
    used = {i for n in graph.node for i in n.input}
    inits = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(inits)
