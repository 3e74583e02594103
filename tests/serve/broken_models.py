"""Models that went wrong in ways a user can meet: a checkpoint whose weights hold NaN, edited metadata."""

from __future__ import annotations

import shutil
from pathlib import Path


def nan_checkpoint(checkpoint: Path, folder: Path) -> Path:
    """A copy of `checkpoint` whose head bias is NaN (a diverged run), in its own run folder with the split."""
    import torch

    ckpt = torch.load(checkpoint, map_location="cpu", weights_only=True)
    ckpt["state_dict"]["net.head.bias"] = torch.full_like(ckpt["state_dict"]["net.head.bias"], float("nan"))
    (folder / "checkpoints").mkdir(parents=True, exist_ok=True)
    shutil.copy(checkpoint.parent.parent / "split.json", folder / "split.json")
    out = folder / "checkpoints" / "best.ckpt"
    torch.save(ckpt, out)
    return out


def with_metadata(model: Path, out: Path, **entries: str) -> Path:
    """A copy of an exported file with some `metadata_props` values replaced (as raw strings)."""
    import onnx

    m = onnx.load(model)
    for p in m.metadata_props:
        if p.key in entries:
            p.value = entries[p.key]
    onnx.save(m, out)
    return out


def nan_head(model: Path, out: Path) -> Path:
    """A copy of an exported file whose head's weights are NaN (a diverged run): it loads, and answers NaN."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    m = onnx.load(model)
    head = [w for w in m.graph.initializer if w.name.startswith("net.head.")]
    assert head, f"{model} has no net.head weights"
    for weights in head:
        nan = np.full_like(numpy_helper.to_array(weights), np.nan)
        weights.CopyFrom(numpy_helper.from_array(nan, weights.name))
    onnx.save(m, out)
    return out
