"""Shared fixtures: tiny real data and a tiny model. Markers: slow, gpu (auto-skipped), browser."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


TINY = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)


@pytest.fixture
def tiny_config() -> dict:
    """Constructor arguments of a tiny ViT: 4 x 4 grid, 2 blocks, 2 heads."""
    return dict(TINY)


@pytest.fixture
def tiny_model():
    from vit import VisionTransformer

    torch.manual_seed(0)
    return VisionTransformer(**TINY).eval()
