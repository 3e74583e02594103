"""The exported file at work, with onnxruntime, numpy and Pillow only (never torch).

`images` is the one image loader and `Preprocess`, the transform training follows too; `model_file` reads
and checks the file; `classifier` holds `OnnxClassifier`; `rollout` and `faithfulness` explain its answers;
`predict` is `vit-predict`, with `jobs` and `outputs` for large jobs written in resumable parts.

`OnnxClassifier` is imported on first use, so that training and `vit.rollout`, which need only the loader
and the rollout arithmetic, do not load onnxruntime.
"""

from serve.runtime.images import ImageError, Preprocess, load_image

__all__ = ["ImageError", "OnnxClassifier", "Preprocess", "load_image"]


def __getattr__(name: str):
    if name == "OnnxClassifier":
        from serve.runtime.classifier import OnnxClassifier

        return OnnxClassifier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
