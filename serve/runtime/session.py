"""onnxruntime sessions as vitscope runs them: the execution providers, the intra-op threads a model gets, the
session options. `serve.runtime.classifier` opens every served model with them, `serve.export.calibrate` its
calibration passes."""

from __future__ import annotations

import onnxruntime as ort

# Intra-op threads when the caller does not say:
# more threads speed up 224-px models, while a tiny model such as the digits sample gains nothing: its
# matmuls are too small to split, and a second thread only takes the core the server's event loop needs.
# So: one thread below SMALL_MODEL_GFLOPS, otherwise onnxruntime's default (every physical core).
SMALL_MODEL_GFLOPS = 0.25
PREFERRED_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")


def default_providers() -> list[str]:
    """TensorRT, then CUDA, when this onnxruntime build has them; the CPU always."""
    available = set(ort.get_available_providers())
    return [p for p in PREFERRED_PROVIDERS if p in available] or ["CPUExecutionProvider"]


def default_threads(metadata: dict[str, str]) -> int:
    """1 for a small model, 0 (onnxruntime's default: every physical core) for a large one; see above.

    The size is the export's `gflops_per_image` (`VisionTransformer.flops_per_image`); without it, 1.
    """
    try:
        gflops = float(metadata["gflops_per_image"])
    except (KeyError, TypeError, ValueError):
        return 1
    return 1 if gflops < SMALL_MODEL_GFLOPS else 0


def session_options(threads: int) -> ort.SessionOptions:
    """onnxruntime session options for `threads` intra-op threads (0: every physical core), as served.

    Idle intra-op threads keep onnxruntime's default spinning: capping the spin made ViT-Ti/16 at batch 1
    slower, because the threads fell asleep between the graph's
    many small parallel sections. Where the cores are shared with other busy processes, fewer threads is
    the better cure.
    """
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3  # `explain` is an input with a default on purpose: no warning about it
    return options
