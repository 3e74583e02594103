"""int8 for the logits path: dynamic quantisation, and static quantisation calibrated on validation images.

Only the weights of the linear layers are quantised (the transformer's cost): MatMul/Gemm, and the
fused `Attention` blocks (`serve.export.fusion`), which dynamic quantisation turns into `QAttention`; the
patch-embedding Conv, LayerNorm and softmax stay fp32, which keeps the accuracy. Static (QDQ)
quantisation has no `Attention` rule, so there only the other MatMuls are quantised. Both kinds
are tried and measured on the validation sample: agreement with the fp32 torch model, accuracy on
the labels, and batch-1 speed. Static wins when it agrees better with fp32, or as well and runs faster.

For the portable target (`serve.export.targets`) the graph is the explain graph, unfused: only the
MatMul/Gemm nodes with a constant weight are quantised, dynamically, into standard `MatMulInteger` ops,
never the attention products of two activations, so the maps it outputs stay close to fp32.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_dynamic, quantize_static

from serve.export import files
from serve.runtime.images import Preprocess
from vit.model import VisionTransformer

log = logging.getLogger(__name__)

QUANT_OPS = ["MatMul", "Gemm"]
DYNAMIC_QUANT_OPS = [*QUANT_OPS, "Attention"]


class _PixelReader(CalibrationDataReader):
    def __init__(self, pixels: np.ndarray, batch_size: int = 8):
        self.batches = iter([pixels[i : i + batch_size] for i in range(0, len(pixels), batch_size)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        batch = next(self.batches, None)
        return None if batch is None else {"pixels": batch}


def _session(model: onnx.ModelProto | bytes, threads: int = 1) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    data = model if isinstance(model, bytes) else model.SerializeToString()
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])


def _logits(session: ort.InferenceSession, pixels: np.ndarray, batch_size: int = 32) -> np.ndarray:
    return np.concatenate(
        [session.run(["logits"], {"pixels": pixels[i : i + batch_size]})[0] for i in range(0, len(pixels), batch_size)]
    )


def _ms_per_image(session: ort.InferenceSession, pixels: np.ndarray, budget_s: float = 0.5) -> float:
    one = pixels[:1]
    session.run(["logits"], {"pixels": one})  # warm-up
    times = []
    start = time.perf_counter()
    while time.perf_counter() - start < budget_s or len(times) < 3:
        t = time.perf_counter()
        session.run(["logits"], {"pixels": one})
        times.append(time.perf_counter() - t)
    return 1000 * float(np.median(times))


@contextlib.contextmanager
def _quiet_root_logger() -> Iterator[None]:
    """onnxruntime.quantization logs advice on the root logger for every tensor; keep errors only."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def weight_nodes(model: onnx.ModelProto) -> list[str]:
    """Names of the MatMul/Gemm nodes whose second input is a constant weight (an initializer)."""
    inits = {i.name for i in model.graph.initializer}
    return [n.name for n in model.graph.node if n.op_type in QUANT_OPS and len(n.input) > 1 and n.input[1] in inits]


def dynamic_int8(fast: onnx.ModelProto, portable: bool = False) -> onnx.ModelProto:
    """The logits graph with int8 MatMul/Gemm/Attention weights (per channel), activations quantised on the fly.

    With `portable`, only the constant-weight MatMul/Gemm nodes (`weight_nodes`), as `MatMulInteger`.
    """
    op_types = QUANT_OPS if portable else DYNAMIC_QUANT_OPS
    nodes = weight_nodes(fast) if portable else None
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp, "fp32.onnx"), Path(tmp, "dynamic.onnx")
        onnx.save(fast, src)
        with _quiet_root_logger():
            quantize_dynamic(
                src,
                dst,
                op_types_to_quantize=op_types,
                nodes_to_quantize=nodes,
                per_channel=True,
                weight_type=QuantType.QInt8,
            )
        return onnx.load(dst)


def static_int8(fast: onnx.ModelProto, calibration: np.ndarray) -> onnx.ModelProto | None:
    """QDQ int8 with activations calibrated on `calibration` pixels; None (with a warning) if it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        src, sta = Path(tmp, "fp32.onnx"), Path(tmp, "static.onnx")
        onnx.save(fast, src)
        try:
            with _quiet_root_logger():
                quantize_static(
                    src,
                    sta,
                    _PixelReader(calibration),
                    quant_format=QuantFormat.QDQ,
                    op_types_to_quantize=QUANT_OPS,
                    per_channel=True,
                    activation_type=QuantType.QUInt8,
                    weight_type=QuantType.QInt8,
                )
            return onnx.load(sta)
        except Exception as e:  # static calibration is the optional extra: report and go on with dynamic
            log.warning("static int8 quantisation failed, keeping dynamic: %s", e)
            return None


@contextlib.contextmanager
def scratch_folder() -> Iterator[Path]:
    """A folder in $TMPDIR for the quantisers' copies of the model, onnxruntime's own included (`tempfile.tempdir`
    points at it meanwhile: the export is single-threaded), removed afterwards. A kill leaves it behind, named as
    `serve.export.files` names a temporary: the next quantisation removes it (a model's copies each time, 350 MB
    for ViT-B/16)."""
    root = Path(tempfile.gettempdir())
    with contextlib.suppress(OSError):  # a $TMPDIR that cannot be listed: nothing to tidy, the export goes on
        files.remove_stale_temporaries(root)
    folder = root / files.temporary_name("quantize")
    folder.mkdir()
    saved, tempfile.tempdir = tempfile.tempdir, str(folder)
    try:
        yield folder
    finally:
        tempfile.tempdir = saved
        shutil.rmtree(folder, ignore_errors=True)


def quantize_int8(
    fast: onnx.ModelProto, sample: Any, net: VisionTransformer, preprocess: Preprocess, portable: bool = False
) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """Quantise the logits graph both ways and keep the better one.

    Args:
        fast: the fp32 logits graph (input `pixels`, output `logits`; other outputs are kept).
        sample: a `serve.export.parity.Sample` of validation pixels and labels.
        net: the fp32 torch network, the reference.
        preprocess: the serving preprocessing.
        portable: quantise only constant-weight MatMul/Gemm nodes, into standard ONNX ops.

    Returns:
        (the chosen int8 graph, report with "chosen" and per-candidate agreement, accuracy, speed).
    """
    pixels, labels = sample.pixels, sample.labels
    known = labels >= 0
    with torch.no_grad():
        reference = np.concatenate(
            [net(torch.from_numpy(preprocess.normalize(pixels[i : i + 32]))).numpy() for i in range(0, len(pixels), 32)]
        ).argmax(-1)
    fp32_ms = _ms_per_image(_session(fast), pixels)
    with scratch_folder():
        candidates = {"int8-dynamic": dynamic_int8(fast, portable)}
        # The portable file stays `MatMulInteger`: QDQ's DequantizeLinear has no implementation before opset 19
        # in onnx's reference evaluator, one of the runtimes that target is for, and a choice made by timing
        # would make the file differ from one export to the next.
        static = None if portable else static_int8(fast, pixels[:64])
    if static is not None:
        candidates["int8-static"] = static
    report: dict[str, Any] = {"fp32_ms_per_image": fp32_ms, "candidates": {}}
    for name, model in candidates.items():
        session = _session(model)
        pred = _logits(session, pixels).argmax(-1)
        ms = _ms_per_image(session, pixels)
        report["candidates"][name] = {
            "agreement": float((pred == reference).mean()),
            "accuracy": float((pred == labels)[known].mean()) if known.any() else None,
            "fp32_accuracy": float((reference == labels)[known].mean()) if known.any() else None,
            "ms_per_image": ms,
            "speedup": fp32_ms / ms,
        }
    c = report["candidates"]
    chosen = "int8-dynamic"
    if "int8-static" in c and (c["int8-static"]["agreement"], c["int8-static"]["speedup"]) > (
        c["int8-dynamic"]["agreement"],
        c["int8-dynamic"]["speedup"],
    ):
        chosen = "int8-static"
    report["chosen"] = chosen
    return candidates[chosen], report
