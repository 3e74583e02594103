"""What a vitscope checkpoint carries beyond weights, and how to rebuild the network from it.

Lightning writes the checkpoint; `ViTClassifier.on_save_checkpoint` adds a plain-data
``"vitscope"`` entry (no pickled objects), so `load_network` needs neither the YAML nor
Lightning, and loads with ``weights_only=True``:

    {"model_config": VisionTransformer kwargs, "class_names": [...], "preprocess": Preprocess.to_dict(),
     "weights_prefix": "net." or "ema.module.", "variant": str, "versions": {...}}
"""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path
from typing import Any

import torch

from serve.runtime.images import Preprocess
from vit.model import VisionTransformer

META_KEY = "vitscope"


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint with `weights_only=True` and check it is one of ours."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    with open(path, "rb") as f:
        head = f.read(4)
    if head[:2] != b"PK" and head[:1] != b"\x80":  # a zip (torch.save) or a legacy pickle
        onnx = (
            " (it is an ONNX model: export takes the .ckpt it came from; vit-export MODEL.onnx --web DIR packages a"
            " portable file for the browser)"
            if path.suffix == ".onnx"
            else ""
        )
        raise ValueError(
            f"{path} is not a PyTorch checkpoint{onnx}; give the .ckpt file vit-train wrote, "
            "e.g. runs/<run>/checkpoints/best.ckpt"
        )
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # say what is wrong in one line, not a traceback
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        if isinstance(e, pickle.UnpicklingError):  # objects beyond tensors and plain data: never loaded
            raise ValueError(
                f"{path} holds Python objects that a weights-only load refuses ({first}); vitscope checkpoints "
                "hold tensors and plain data only: give a .ckpt file written by vit-train"
            ) from None
        raise ValueError(f"{path} is damaged or truncated ({first}); train or copy it again") from None
    if not isinstance(ckpt, dict) or META_KEY not in ckpt or "state_dict" not in ckpt:
        raise ValueError(f"{path} is not a vitscope checkpoint (no '{META_KEY}' entry); train it with vit-train")
    return ckpt


def load_network(path: str | Path) -> tuple[VisionTransformer, dict[str, Any]]:
    """Rebuild the trained network (EMA weights when the run kept them) in eval mode.

    Returns:
        (net, meta): meta is the checkpoint's "vitscope" entry plus "sha256" of the file and
        "preprocess" as a `Preprocess`.
    """
    ckpt = load_checkpoint(path)
    meta = dict(ckpt[META_KEY])
    net = VisionTransformer(**meta["model_config"])
    prefix = meta.get("weights_prefix", "net.")
    state = {k[len(prefix) :]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}
    net.load_state_dict(state)
    meta["sha256"] = file_sha256(path)
    meta["preprocess"] = Preprocess.from_dict(meta["preprocess"])
    return net.eval(), meta


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
