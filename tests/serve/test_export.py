"""vit-export: the exported file, its metadata, the parity gate, int8."""

from __future__ import annotations

import numpy as np

from serve.runtime import OnnxClassifier


def test_exported_model_predicts_the_quadrant_of_its_validation_images(tiny_onnx, tiny_run):
    import json

    clf = OnnxClassifier(tiny_onnx)
    val = json.loads((tiny_run / "split.json").read_text())["val"]
    top = clf.predict([v["path"] for v in val], top_k=2)
    accuracy = np.mean([clf.labels.index(t[0][0]) == v["label"] for t, v in zip(top, val, strict=True)])
    assert accuracy >= 0.9
