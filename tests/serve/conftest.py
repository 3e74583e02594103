"""Serving fixtures: a tiny trained checkpoint in the contract format and its exported ONNX file.

The checkpoint's network learns, in 600 plain-torch steps (a few seconds), which quadrant of a 32 x 32
image holds a bright square, so its predictions are confident and not uniform. The run folder
has a `split.json` pointing at real PNG files, as `vit-train` writes it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from serve.runtime.images import Preprocess

CLASS_NAMES = ["top_left", "top_right", "bottom_left", "bottom_right"]
TINY_NET = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=len(CLASS_NAMES))


def quadrant_images(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """n (32, 32, 3) uint8 images, each with a bright 12-pixel square in one quadrant, and their labels."""
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % len(CLASS_NAMES)
    images = rng.integers(0, 80, (n, 32, 32, 3), dtype=np.uint8)
    for img, label in zip(images, labels, strict=True):
        r, c = divmod(int(label), 2)
        y, x = 16 * r + rng.integers(0, 5), 16 * c + rng.integers(0, 5)
        img[y : y + 12, x : x + 12] = rng.integers(180, 256, 3, dtype=np.uint8)
    return images, labels


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """A run folder: checkpoints/best.ckpt (the contract format), split.json and its PNG files."""
    from vit import VisionTransformer

    root = tmp_path_factory.mktemp("tiny_run")
    preprocess = Preprocess(img_size=(32, 32), crop_pct=1.0, interpolation="bicubic")
    torch.manual_seed(0)
    net = VisionTransformer(**TINY_NET)
    images, labels = quadrant_images(256)
    x = torch.from_numpy(preprocess.normalize(images))
    y = torch.from_numpy(labels)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    net.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is several times faster on a busy 2-core machine
    for step in range(600):  # 300 left it at 21 of 24 on some CPUs: float kernels differ by processor
        idx = torch.randint(0, len(x), (32,), generator=torch.Generator().manual_seed(step))
        loss = torch.nn.functional.cross_entropy(net(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.set_num_threads(threads)
    net.eval()

    val_images, val_labels = quadrant_images(24, seed=1)
    val = []
    for i, (img, label) in enumerate(zip(val_images, val_labels, strict=True)):
        path = root / "data" / CLASS_NAMES[label] / f"{i:03d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(img).save(path)
        val.append({"path": str(path), "label": int(label)})
    (root / "split.json").write_text(json.dumps({"train": [], "val": val}))
    ckpt = {
        "state_dict": {"net." + k: v for k, v in net.state_dict().items()},
        "vitscope": {
            "model_config": net.config,
            "class_names": CLASS_NAMES,
            "preprocess": preprocess.to_dict(),
            "weights_prefix": "net.",
            "variant": "tiny_test",
            "versions": {"torch": str(torch.__version__)},
        },
    }
    (root / "checkpoints").mkdir()
    torch.save(ckpt, root / "checkpoints" / "best.ckpt")
    return root


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_run) -> Path:
    """A tiny trained checkpoint in the vitscope contract format (4 classes, 32 x 32 inputs)."""
    return tiny_run / "checkpoints" / "best.ckpt"


@pytest.fixture(scope="session")
def tiny_onnx(tiny_checkpoint, tmp_path_factory) -> Path:
    """The tiny checkpoint exported by `export_onnx` (fp32, parity-checked, with its metadata)."""
    from serve.export.cli import export_onnx

    out = tmp_path_factory.mktemp("tiny_onnx") / "tiny.onnx"
    export_onnx(tiny_checkpoint, out)
    return out
