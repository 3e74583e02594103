"""A Triton Inference Server model repository for the logits-only graph (`vit-export --triton-repo DIR`).

    DIR/<name>/config.pbtxt     platform onnxruntime_onnx, inputs and outputs spelled out, dynamic batching
    DIR/<name>/labels.txt       the class names, one per line, in logit order
    DIR/<name>/1/model.onnx     pixels (B, H, W, 3) uint8 -> logits (B, K), features (B, D) float32,
                                and probs (B, K) when the file is calibrated

`probs` are the calibrated probabilities (the temperature and confidence map folded into the graph), so a
Triton client reads them as vit-serve answers them, without knowing the calibration; `logits` stay raw.
Triton gets the logits path alone: its auto-complete misreads the explain outputs (rank 5, batch on the
second axis), and a server answers classification requests. The config is written out in full
from the graph itself (names, datatypes, dims without the batch axis), so Triton needs no guessing.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from serve.runtime import calibration as cal

# Shapes: B batch, H/W image, K classes, D features.

TRITON_DTYPES = {
    onnx.TensorProto.UINT8: "TYPE_UINT8",
    onnx.TensorProto.INT64: "TYPE_INT64",
    onnx.TensorProto.FLOAT: "TYPE_FP32",
    onnx.TensorProto.FLOAT16: "TYPE_FP16",
}
DEFAULT_MAX_BATCH_SIZE = 32
# How long Triton may hold a request to batch it with others: 0.5 ms is small next to one image's
# inference on a CPU, and lets concurrent requests share one onnxruntime call.
MAX_QUEUE_DELAY_US = 500


def model_name(name: str) -> str:
    """A Triton model name (a folder name) from a file stem or variant: letters, digits, '_', '-', '.'."""
    cleaned = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._")
    if not cleaned:
        raise ValueError(f"--triton-name {name!r} has no usable characters; use letters, digits, '_' or '-'")
    return cleaned


def _tensor(value: onnx.ValueInfoProto, label_file: bool = False) -> str:
    """One `input`/`output` entry: the graph's name, datatype and dims after the batch axis."""
    t = value.type.tensor_type
    if t.elem_type not in TRITON_DTYPES:
        raise ValueError(f"tensor {value.name} has an ONNX type ({t.elem_type}) this config writer does not map")
    dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim][1:]  # the batch axis is Triton's
    lines = [
        f'    name: "{value.name}"',
        f"    data_type: {TRITON_DTYPES[t.elem_type]}",
        f"    dims: [ {', '.join(str(d) for d in dims)} ]",
    ]
    if label_file:
        lines.append('    label_filename: "labels.txt"')
    return "  {\n" + "\n".join(lines) + "\n  }"


def config_pbtxt(model: onnx.ModelProto, name: str, max_batch_size: int = DEFAULT_MAX_BATCH_SIZE) -> str:
    """`config.pbtxt` for a logits-only model (one input, one output, batch axis first)."""
    g = model.graph
    inits = {i.name for i in g.initializer}
    inputs = [i for i in g.input if i.name not in inits]
    inputs_text = ",\n".join(_tensor(i) for i in inputs)
    outputs_text = ",\n".join(_tensor(o, label_file=o.name in ("logits", "probs")) for o in g.output)
    return (
        f'name: "{name}"\n'
        'platform: "onnxruntime_onnx"\n'
        f"max_batch_size: {max_batch_size}\n"
        f"input [\n{inputs_text}\n]\n"
        f"output [\n{outputs_text}\n]\n"
        f"dynamic_batching {{\n  max_queue_delay_microseconds: {MAX_QUEUE_DELAY_US}\n}}\n"
    )


def add_probabilities(model: onnx.ModelProto, temperature: float, knots: np.ndarray | None = None) -> None:
    """Append the output `probs` (B, K), the calibrated probabilities, to a logits-only model, in place.

    softmax(logits / temperature), or with a confidence map `knots` (2, M) the per-image temperature of
    `serve.runtime.calibration.calibrated_softmax`, its Newton steps unrolled (sums as MatMuls with ones and
    the top logit from TopK, which every opset we export reads alike).
    """
    g = model.graph
    K = next(o for o in g.output if o.name == "logits").type.tensor_type.shape.dim[-1].dim_value
    consts: dict[str, np.ndarray] = {}

    def const(name: str, value) -> str:
        consts[f"probs/{name}"] = np.asarray(value, np.float32)
        return f"probs/{name}"

    nodes: list[onnx.NodeProto] = []

    def op(kind: str, inputs: list[str], name: str, **attrs) -> str:
        nodes.append(helper.make_node(kind, inputs, [f"probs/{name}"], name=f"probs/{name}", **attrs))
        return f"probs/{name}"

    if knots is None:
        op("Softmax", [op("Div", ["logits", const("temperature", temperature)], "scaled")], "out", axis=-1)
    else:
        x, y = np.asarray(knots[0], np.float64), np.asarray(knots[1], np.float64)
        ones = const("ones", np.ones((K, 1)))
        consts["probs/k"] = np.array([1], np.int64)
        nodes.append(helper.make_node("TopK", ["logits", "probs/k"], ["probs/top", "probs/top_index"], axis=-1))
        d = op("Sub", ["probs/top", "logits"], "gaps")  # (B, K) >= 0
        u = const("u0", np.full((1, 1), 1.0 / temperature))
        p0 = op(
            "Reciprocal",
            [op("MatMul", [op("Exp", [op("Neg", [op("Mul", [d, u], "du0")], "ndu0")], "e0"), ones], "s0")],
            "p0",
        )
        w = np.maximum(np.diff(x), 1e-12)
        run = op("Min", [op("Relu", [op("Sub", [p0, const("x", x[:-1])], "dx")], "rdx"), const("w", w)], "seg")
        want = op(
            "Add",
            [op("MatMul", [run, const("slopes", (np.diff(y) / w)[:, None])], "rise"), const("y0", [[y[0]]])],
            "want",
        )
        log_want = op("Log", [want], "log_want")
        for i in range(cal.NEWTON_STEPS):
            e = op("Exp", [op("Neg", [op("Mul", [d, u], f"du{i + 1}")], f"ndu{i + 1}")], f"e{i + 1}")
            S = op("MatMul", [e, ones], f"S{i}")
            slope = op(
                "Neg",
                [op("Div", [op("MatMul", [op("Mul", [d, e], f"de{i}"), ones], f"sde{i}"), S], f"q{i}")],
                f"slope{i}",
            )
            slope = op("Min", [slope, const("floor", [[-1e-12]])], f"slope_floor{i}")
            step = op("Div", [op("Add", [op("Log", [S], f"logS{i}"), log_want], f"f{i}"), slope], f"step{i}")
            u = op("Sub", [u, step], f"u{i + 1}")
        op("Softmax", [op("Mul", ["logits", u], "scaled")], "out", axis=-1)
    nodes[-1].output[0] = "probs"
    g.node.extend(nodes)
    g.initializer.extend(numpy_helper.from_array(v, k) for k, v in consts.items())
    logits = next(o for o in g.output if o.name == "logits")
    probs = onnx.ValueInfoProto()
    probs.CopyFrom(logits)
    probs.name = "probs"
    g.output.append(probs)


def write_repo(
    model: onnx.ModelProto,
    class_names: list[str],
    repo: str | Path,
    name: str,
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
) -> Path:
    """Write `repo/<name>/` (config, labels, version 1 of the model) and return that folder.

    Args:
        model: the logits-only model, input `pixels` (B, H, W, 3) uint8, outputs `logits` (B, K) first, then
            `features` (B, D) and, when calibrated, `probs` (B, K).
        class_names: K names, in logit order.
        repo: the model repository (created if missing; other models in it are left alone).
        name: the model's name in Triton.
        max_batch_size: the largest batch Triton may form.
    """
    outputs = [o.name for o in model.graph.output]
    if outputs[:1] != ["logits"] or not set(outputs) <= {"logits", "features", "probs"}:
        raise ValueError(f"the Triton model must be the logits-only graph (logits, features, probs), not {outputs}")
    if any("\n" in c for c in class_names):
        raise ValueError("class names with line breaks cannot be written to labels.txt")
    folder = Path(repo) / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "1" / "model.onnx").write_bytes(model.SerializeToString())
    (folder / "labels.txt").write_text("".join(f"{c}\n" for c in class_names), encoding="utf-8")
    (folder / "config.pbtxt").write_text(config_pbtxt(model, name, max_batch_size), encoding="utf-8")
    return folder
