"""Batch augmentation on uint8 tensors, reduced-size JPEG decoding, worker choice."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from serve.runtime.images import Preprocess
from train.datamodule import auto_workers
from train.dataset import decode
from train.transforms import Augment, BatchTransform

PRE = Preprocess(16, 1.0, "bilinear", (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
NONE = dict(crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0), hflip=0.0, rand_augment=None, re_prob=0.0)


def _images(B: int = 6, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (B, 16, 16, 3), dtype=np.uint8))


def test_batch_normalisation_is_the_serving_normalisation_bit_for_bit():
    images = _images()
    np.testing.assert_array_equal(BatchTransform(PRE)(images).numpy(), PRE.normalize(images.numpy()))


def test_no_augmentation_leaves_the_batch_as_evaluated():
    images = _images()
    out = BatchTransform(PRE, Augment(**NONE))(images)
    np.testing.assert_allclose(out.numpy(), PRE.normalize(images.numpy()), atol=1e-5)


def test_certain_horizontal_flip_mirrors_every_image_exactly():
    images = _images()
    out = BatchTransform(PRE, Augment(**{**NONE, "hflip": 1.0}))(images)
    np.testing.assert_allclose(out.numpy(), PRE.normalize(images.flip(2).numpy()), atol=1e-5)


def test_zooming_out_fills_uncovered_pixels_with_the_fill_grey():
    images = _images()
    out = BatchTransform(PRE, Augment(**{**NONE, "scale": (0.5, 0.5), "fill": 255}))(images)
    white = (1.0 - 0.5) / 0.25
    assert torch.allclose(out[:, :, 0, 0], torch.full((6, 3), white))
    assert torch.allclose(out[:, :, -1, -1], out[:, :, 0, 0])


def test_random_crops_differ_per_sample_and_keep_the_shape():
    images = _images(1).expand(8, -1, -1, -1)  # the same image 8 times
    out = BatchTransform(PRE, Augment(**{**NONE, "crop_scale": (0.3, 1.0), "rotate": 20.0}))(images)
    assert out.shape == (8, 3, 16, 16) and out.dtype == torch.float32
    assert len({tuple(o.flatten()[:32].tolist()) for o in out}) == 8


def test_random_erasing_erases_some_samples_and_leaves_the_others():
    torch.manual_seed(0)
    images = _images(64)
    clean = BatchTransform(PRE)(images)
    out = BatchTransform(PRE, Augment(**{**NONE, "re_prob": 0.5, "re_mode": "const"}))(images)
    changed = (out != clean).flatten(1).any(1)
    assert 10 < int(changed.sum()) < 54
    assert (out[changed] == 0).flatten(1).sum(1).min() >= 1


def test_batch_augmentation_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="rand_augment null"):
        BatchTransform(PRE, Augment(rand_augment="rand-m9-mstd0.5"))


def test_large_jpeg_is_decoded_at_reduced_size_but_never_below_the_model_side(tmp_path: Path):
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (600, 800, 3), dtype=np.uint8)).save(tmp_path / "big.jpg")
    Image.fromarray(rng.integers(0, 255, (600, 800, 3), dtype=np.uint8)).save(tmp_path / "big.png")
    small = decode(tmp_path / "big.jpg", min_side=64)
    assert small.mode == "RGB" and 64 <= min(small.size) < 600 and small.size[0] / small.size[1] == 800 / 600
    assert decode(tmp_path / "big.jpg").size == (800, 600)
    assert decode(tmp_path / "big.png", min_side=64).size == (800, 600)  # only JPEG decodes at reduced size
    # a JPEG with the multi-picture extension, which Pillow names MPO, as one without it
    Image.open(tmp_path / "big.jpg").save(tmp_path / "big.mpo", "MPO", save_all=True, append_images=[small])
    assert decode(tmp_path / "big.mpo", min_side=64).size == small.size


def test_workers_leave_one_core_to_the_trainer_and_none_for_a_cached_two_core_run():
    assert auto_workers(2, cached=True) == 0
    assert auto_workers(2, cached=False) == 1
    assert auto_workers(64, cached=False) == 8


def test_a_randaugment_spec_timm_cannot_read_is_refused_without_an_empty_reason():
    """timm refuses "foo" with a bare assert: the message ended in ": " and nothing after it."""
    with pytest.raises(ValueError) as e:
        Augment(rand_augment="foo")
    assert str(e.value).endswith("such as 'rand-m9-mstd0.5-inc1' (or null for none)"), str(e.value)
