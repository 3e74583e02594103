"""Checkpoint -> ONNX: trace the graphs (`trace`), fuse them for onnxruntime (`fusion`), merge them into one
file with its metadata (`merge`), quantise (`quantize`) and check against torch (`parity`); `cli` is `vit-export`.

This package needs torch; it may import `vit` and `train` (to load a checkpoint). Nothing outside it imports it.
"""
