"""Shared fixtures: the tiny ViT's constructor arguments. Markers: slow, gpu (skipped without CUDA), browser.

No torch at import time: the runtime and server tests also run in the `[serve]`-only install (`make
test-serve-only`), where torch is absent; a test that needs it imports it or skips (`pytest.importorskip`).
"""

from __future__ import annotations

import os

import pytest

# One OpenMP thread for PyTorch in the test processes and the training runs they start: three workers on two
# cores, each with its own threads spinning for work, mostly waited on one another (tests/train and
# test_pipeline.py: 203 s and 308 s of CPU this way, 216 s and 338 s with PyTorch's default of a thread per
# core; 2-core VM, 2026-12-03). onnxruntime keeps its own thread pools, which the tests set themselves.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# The longest files, longest first (test durations on the 2-core VM, 2026-12-03: 137 s down to 78 s each). The test
# workers take whole files in collection order, where these came last (tests/train sorts after tests/serve): the
# suite ended with one worker running its longest file while the others were done. Any file may be missing.
LONGEST_FIRST = (
    "train/test_shards.py",
    "serve/test_export_targets.py",
    "test_pipeline.py",
    "train/test_resume_safety.py",
    "serve/test_ray_serve.py",
    "train/test_train_e2e.py",
    "serve/test_export.py",
)


def _file_rank(item) -> int:
    path = item.path.as_posix()
    return next((i for i, name in enumerate(LONGEST_FIRST) if path.endswith("tests/" + name)), len(LONGEST_FIRST))


def pytest_collection_modifyitems(config, items):
    items.sort(key=_file_rank)  # stable: each file's tests stay together and in order
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items or _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in gpu_items:
        item.add_marker(skip_gpu)


TINY = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)


@pytest.fixture
def tiny_config() -> dict:
    """Constructor arguments of a tiny ViT: 4 x 4 grid, 2 blocks, 2 heads."""
    return dict(TINY)


@pytest.fixture
def tiny_model():
    """The tiny ViT with seeded random weights, in eval mode."""
    torch = pytest.importorskip("torch")
    from vit import VisionTransformer

    torch.manual_seed(0)
    return VisionTransformer(**TINY).eval()
