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

A server may poll the repository while it is written (Triton's `--model-control-mode=poll`, `vit-serve DIR`),
so each piece is written whole or not at all, and all of them before any is put in place: labels.txt,
config.pbtxt and the model each go to a temporary file first (the version, when new, to a folder built under a
temporary name), then they are renamed into place, labels.txt and config.pbtxt first and the version last. A
full disk or an error replaces nothing, a reader never sees a version without its config, and a new model's
folder that could not be filled is removed again (Triton would take it for a broken model). Temporaries are
hidden names, never a version number, and never a folder of the repository itself (Triton takes every folder
there, hidden or not, for a model): `serve.export.files`.
"""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
from google.protobuf import text_format
from onnx import helper, numpy_helper

from serve.export import files
from serve.export.merge import set_metadata
from serve.runtime import calibration as cal
from serve.runtime.outputs import sync_folder

log = logging.getLogger(__name__)

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
# The fields an export writes from the model itself: in a config being rewritten, the others (a version pin,
# instance groups, a batching policy tuned by hand, parameters) are kept, and these replaced.
WRITTEN = {"name", "platform", "backend", "runtime", "input", "output", "default_model_filename"}
# fields that describe the old model's tensors (warm-up requests of its input shape): left out, with a warning
STALE = {"model_warmup"}
PAIRS = {"{": "}", "<": ">", "[": "]"}  # protobuf text format's brackets
# Triton's scheduling choice, one of them per config: a kept one replaces the export's dynamic batching
SCHEDULING = {"dynamic_batching", "sequence_batching", "ensemble_scheduling"}


def model_name(name: str) -> str:
    """A Triton model name (a folder name) from a file stem or variant: letters, digits, '_', '-', '.'."""
    cleaned = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._")
    if not cleaned:
        raise ValueError(f"--triton-name {name!r} has no usable characters; use letters, digits, '_' or '-'")
    if cleaned != name:  # clients call the model by this name: say it
        log.warning("the Triton model is named %r (from %r: letters, digits, '_', '-' and '.' only)", cleaned, name)
    return cleaned


def check_labels(class_names: list[str]) -> None:
    """Refuse class names that labels.txt cannot hold one a line: a line break of any kind (a server splits the
    file as `str.splitlines` does: \\r, \\x0b, \\x85, \\u2028, ...) or text that is not UTF-8 (a surrogate escape,
    from a class folder whose name was not UTF-8).

    Raises:
        ValueError: the first such name, in one line.
    """
    for i, name in enumerate(class_names, 1):
        try:
            name.encode()
        except UnicodeEncodeError:
            what = "is not UTF-8 text (a class folder whose name was not UTF-8?)"
        else:
            if name.splitlines() == [name]:
                continue
            what = "holds a line break"
        raise ValueError(
            f"--triton-repo: class name {i} of {len(class_names)}, {name!r}, {what}: labels.txt holds one UTF-8 "
            "name a line, and a server reading it would refuse the model; export without --triton-repo, or rename "
            "that class folder and train again"
        )


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


def config_pbtxt(model: onnx.ModelProto, name: str, kept: Sequence[str] = ()) -> str:
    """`config.pbtxt` for a logits-only model (one input, one output, batch axis first), with the fields of
    `kept` (a hand-edited config's own, `check_model_folder`): a kept `max_batch_size` or scheduling replaces
    the default one."""
    g = model.graph
    inits = {i.name for i in g.initializer}
    inputs = [i for i in g.input if i.name not in inits]
    inputs_text = ",\n".join(_tensor(i) for i in inputs)
    outputs_text = ",\n".join(_tensor(o, label_file=o.name in ("logits", "probs")) for o in g.output)
    names = {field.split(maxsplit=1)[0] for field in kept}
    defaults = [] if "max_batch_size" in names else [f"max_batch_size: {DEFAULT_MAX_BATCH_SIZE}\n"]
    if not names & SCHEDULING:
        defaults.append(f"dynamic_batching {{\n  max_queue_delay_microseconds: {MAX_QUEUE_DELAY_US}\n}}\n")
    return (
        f'name: "{name}"\n'
        'platform: "onnxruntime_onnx"\n'
        f"input [\n{inputs_text}\n]\n"
        f"output [\n{outputs_text}\n]\n" + "".join(defaults) + "".join(f"{field}\n" for field in kept)
    )


def check_model_folder(folder: Path) -> list[str]:
    """Check the model folder an export would rewrite, and return the top-level fields of its config.pbtxt
    (protobuf text, one field each): `write_repo` keeps all but those it writes from the graph (`WRITTEN`) and
    those of the old model (`STALE`), so that what a user tuned by hand (a version pin, instances, batching)
    survives a new export.

    Raises:
        ValueError: a version other than 1 is there (Triton serves the newest by default, and every version
            shares the labels.txt and config.pbtxt the export rewrites), a config.pbtxt that cannot be read, or
            one whose `max_batch_size: 0` would make the batch axis part of every tensor's dims.
    """
    if not folder.is_dir():
        return []
    slot = folder / "1"
    for path, must_be in ((slot, "folder"), (slot / "model.onnx", "file")):
        if path.exists() and path.is_dir() != (must_be == "folder"):
            raise ValueError(
                f"--triton-repo: {path} is there but is no {must_be}, where the export writes version 1's "
                "model: it would fail after labels.txt and config.pbtxt were replaced; move it away and export again"
            )
    others = sorted(int(d.name) for d in folder.iterdir() if _is_version(d.name) and d.name != "1" and d.is_dir())
    if others:
        raise ValueError(
            f"--triton-repo: {folder} holds version {', '.join(map(str, others))} beside the version 1 vit-export "
            "writes, and every version shares the labels.txt and config.pbtxt it rewrites (Triton serves the newest "
            "by default): move the other versions out of that folder, or name a new model with --triton-name"
        )
    config = folder / "config.pbtxt"
    try:
        fields = _top_level_fields(config.read_text()) if config.is_file() else []
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(
            f"--triton-repo: {config} cannot be read ({e}), and what was set in it by hand would be lost: fix it "
            "or remove it, and export again"
        ) from None
    sizes = [f.split()[-1] for f in fields if f.split()[:2] == ["max_batch_size", ":"]]
    if any(_int_or_none(size) == 0 for size in sizes):
        raise ValueError(
            f"--triton-repo: {config} sets max_batch_size: 0 (no batch axis), and the exported model batches on "
            "its first axis: remove that line (the export writes 32) or set the largest batch Triton may form"
        )
    return fields


def _int_or_none(text: str) -> int | None:
    """A protobuf text integer (`8`, `-0`, `0x0`), or None."""
    try:
        return int(text, 0)
    except ValueError:
        return None


def check_output_apart(output: Path, folder: Path) -> None:
    """A `ValueError` when -o names the model file the export writes into the Triton model `folder`: the full graph
    written there would replace Triton's logits-only one."""
    if output.resolve() == (folder / "1" / "model.onnx").resolve():
        raise ValueError(f"-o {output} is the model file --triton-repo writes: give -o another path")


def _is_version(name: str) -> bool:
    """A version folder's name, as Triton reads it: ASCII digits without a leading zero."""
    return name.isascii() and name.isdigit() and not name.startswith("0")


def _top_level_fields(config: str) -> list[str]:
    """Each top-level field of a config.pbtxt (`name: value`, `name { ... }`, `name [ ... ]`), its tokens as
    protobuf text format reads them (comments, strings and nesting as Triton sees them) joined by spaces."""
    tokens = text_format.Tokenizer(config.splitlines())
    fields: list[list[str]] = []
    opened: list[str] = []  # the brackets open in the value being read
    value_done = True  # the field being read has its value (or there is none yet)
    while not tokens.AtEnd():
        token, depth = tokens.token, len(opened)
        opening, closing = token in PAIRS, token in PAIRS.values()
        if depth == 0 and value_done and token in (",", ";"):  # an optional separator between fields
            pass
        elif depth == 0 and value_done and not (token.startswith(('"', "'")) and fields):
            if not (token[:1].isalpha() or token[:1] == "_"):
                raise ValueError(f"{token!r} where a field name should be")
            fields.append([token])
            value_done = False
        else:  # the field's value, or a string continuing the last one ("a" "b" is "ab")
            fields[-1].append(token)
            if opening:
                opened.append(token)
            elif closing and (not opened or PAIRS[opened.pop()] != token):
                raise ValueError(f"an unmatched {token!r}")
            value_done = not opened and token != ":" and (closing or not opening)
        tokens.NextToken()
    if opened or not value_done:
        raise ValueError(f"an unclosed {opened[-1]!r}" if opened else f"the field {fields[-1][0]!r} has no value")
    return [" ".join(field) for field in fields]


class _Builder:
    """Nodes and constants appended to a graph, every name under `probs/`."""

    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []
        self.consts: dict[str, np.ndarray] = {}

    def const(self, name: str, value, dtype=np.float32) -> str:
        self.consts[f"probs/{name}"] = np.asarray(value, dtype)
        return f"probs/{name}"

    def op(self, kind: str, inputs: list[str], name: str, **attrs) -> str:
        self.nodes.append(helper.make_node(kind, inputs, [f"probs/{name}"], name=f"probs/{name}", **attrs))
        return f"probs/{name}"


def add_probabilities(model: onnx.ModelProto, temperature: float, knots: np.ndarray | None = None) -> None:
    """Append the output `probs` (B, K), the calibrated probabilities, to a logits-only model, in place.

    softmax(logits / temperature), or with a confidence map `knots` (2, M) the per-image temperature of
    `serve.runtime.calibration.calibrated_softmax`, its bisection steps unrolled (sums as MatMuls with ones and
    the top logit from TopK, which every opset we export reads alike).
    """
    g = model.graph
    b = _Builder()
    if knots is None:
        scale = b.op("Div", ["logits", b.const("temperature", temperature)], "scaled")
    else:
        K = next(o for o in g.output if o.name == "logits").type.tensor_type.shape.dim[-1].dim_value
        scale = b.op("Mul", ["logits", _per_image_inverse_temperature(b, K, temperature, knots)], "scaled")
    b.nodes.append(helper.make_node("Softmax", [scale], ["probs"], name="probs/softmax", axis=-1))
    g.node.extend(b.nodes)
    g.initializer.extend(numpy_helper.from_array(v, k) for k, v in b.consts.items())
    probs = onnx.ValueInfoProto()
    probs.CopyFrom(next(o for o in g.output if o.name == "logits"))
    probs.name = "probs"
    g.output.append(probs)


def _per_image_inverse_temperature(b: _Builder, K: int, temperature: float, knots: np.ndarray) -> str:
    """Nodes computing u = 1/t (B, 1) of `calibrated_softmax`: the mapped top-1 probability, then the bisection."""
    x, y = np.asarray(knots[0], np.float64), np.asarray(knots[1], np.float64)
    ones = b.const("ones", np.ones((K, 1)))
    b.nodes.append(
        helper.make_node("TopK", ["logits", b.const("k", [1], np.int64)], ["probs/top", "probs/top_index"], axis=-1)
    )
    d = b.op("Sub", ["probs/top", "logits"], "gaps")  # (B, K) >= 0

    def top(log_u: str, name: str) -> str:  # (B, 1) the top-1 probability of softmax(logits * exp(log_u))
        e = b.op(
            "Exp",
            [b.op("Neg", [b.op("Mul", [d, b.op("Exp", [log_u], f"u_{name}")], f"du_{name}")], f"n_{name}")],
            f"e_{name}",
        )
        return b.op("Reciprocal", [b.op("MatMul", [e, ones], f"s_{name}")], f"p_{name}")

    base = -np.log(temperature)
    p0 = top(b.const("base", [[base]]), "base")
    # np.interp as a sum of clipped ramps: y0 + sum_i slope_i * min(relu(p0 - x_i), x_{i+1} - x_i)
    w = np.maximum(np.diff(x), 1e-12)
    ramp = b.op("Min", [b.op("Relu", [b.op("Sub", [p0, b.const("x", x[:-1])], "dx")], "rdx"), b.const("w", w)], "ramp")
    rise = b.op("MatMul", [ramp, b.const("slopes", (np.diff(y) / w)[:, None])], "rise")
    want = b.op("Add", [rise, b.const("y0", [[y[0]]])], "want")
    lo, hi, half = b.const("lo0", [[base - cal.BRACKET]]), b.const("hi0", [[base + cal.BRACKET]]), b.const("half", 0.5)
    for i in range(cal.BISECTION_STEPS):
        mid = b.op("Mul", [b.op("Add", [lo, hi], f"sum{i}"), half], f"mid{i}")
        below = b.op("Less", [top(mid, str(i)), want], f"below{i}")
        lo, hi = b.op("Where", [below, mid, lo], f"lo{i + 1}"), b.op("Where", [below, hi, mid], f"hi{i + 1}")
    return b.op("Exp", [b.op("Mul", [b.op("Add", [lo, hi], "sum"), half], "log_u")], "u")


def finish_model(model: onnx.ModelProto, metadata: dict, calibration: dict | None, quantization: str) -> None:
    """The Triton model's calibrated `probs` output and its own metadata (no maps, no gradients)."""
    if calibration is not None:
        cmap = calibration.get("confidence_map")
        knots = None if cmap is None else np.array([cmap["confidence"], cmap["accuracy"]])
        add_probabilities(model, calibration["temperature"], knots)
    outputs = "logits (B, K), features (B, D)" + (", probs (B, K): calibrated probabilities" if calibration else "")
    only = {"outputs": outputs, "supports_gradients": False, "explain_precision": "none"}
    set_metadata(model, {**metadata, **only, "quantization": quantization})


def write_repo(
    model: onnx.ModelProto,
    class_names: list[str],
    repo: str | Path,
    name: str,
) -> Path:
    """Write `repo/<name>/` (config, labels, version 1 of the model), each piece whole, and return that folder.

    What was set by hand in the config there (a version pin, instances, batching) is kept; a model folder holding
    another version is refused (`check_model_folder`).

    Args:
        model: the logits-only model, input `pixels` (B, H, W, 3) uint8, outputs `logits` (B, K) first, then
            `features` (B, D) and, when calibrated, `probs` (B, K).
        class_names: K names, in logit order.
        repo: the model repository (created if missing; other models in it are left alone).
        name: the model's name in Triton.

    Raises:
        ValueError: the model is not the logits-only graph, a class name labels.txt cannot hold, or a model
            folder this export would break (`check_model_folder`).
    """
    outputs = [o.name for o in model.graph.output]
    if outputs[:1] != ["logits"] or not set(outputs) <= {"logits", "features", "probs"}:
        raise ValueError(f"the Triton model must be the logits-only graph (logits, features, probs), not {outputs}")
    check_labels(class_names)
    folder = Path(repo) / name
    fields = check_model_folder(folder)  # again: the repository may have changed during the export
    names = [field.split(maxsplit=1)[0] for field in fields]
    if replaced := [n for n in names if n in WRITTEN | STALE and n not in ("name", "platform", "input", "output")]:
        log.warning("%s: %s written anew or left out (they describe the model, which the export replaces)",
                    folder / "config.pbtxt", ", ".join(replaced))  # fmt: skip
    kept = [field for field, n in zip(fields, names, strict=True) if n not in WRITTEN | STALE]
    pieces = {  # renamed into place in this order: the version last (vit-serve checks it against the labels)
        folder / "labels.txt": "".join(f"{c}\n" for c in class_names).encode(),
        folder / "config.pbtxt": config_pbtxt(model, name, kept).encode(),
        folder / "1" / "model.onnx": model.SerializeToString(),
    }
    created = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        files.write_pieces(pieces)
    except BaseException:
        if created:  # a model folder without its files: Triton would take it for a broken model
            shutil.rmtree(folder, ignore_errors=True)
        raise
    sync_folder(folder.parent)
    return folder
