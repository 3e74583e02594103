"""The exported file at work, with onnxruntime, numpy and Pillow only (never torch).

`images` is the one image loader and `Preprocess`, the transform training follows too; `model_file` reads
and checks the file; `classifier` holds `OnnxClassifier`; `rollout` and `faithfulness` explain its answers;
`predict` is `vit-predict`.
"""

from serve.runtime.classifier import OnnxClassifier
from serve.runtime.images import ImageError, Preprocess, load_image

__all__ = ["ImageError", "OnnxClassifier", "Preprocess", "load_image"]
