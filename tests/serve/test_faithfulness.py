"""Deletion scores: the math on arrays with a transparent model, then with the real ONNX model."""

from __future__ import annotations

import numpy as np
import pytest

from serve.runtime.faithfulness import deletion_orders, deletion_score, masked_images, mean_fill

FILL = np.array([0, 0, 0], np.uint8)


def corner_model(batch: np.ndarray) -> np.ndarray:
    """Class 0's probability is the share of bright pixels in the top-left 8 x 8 corner of a 16 x 16 image."""
    bright = (batch[:, :8, :8].mean(axis=-1) > 128).mean(axis=(1, 2))  # (B,)
    p = 0.05 + 0.9 * bright
    return np.stack([p, 1 - p], axis=1).astype(np.float32)  # (B, 2)


@pytest.fixture
def white_image() -> np.ndarray:
    return np.full((16, 16, 3), 255, np.uint8)


def test_map_on_the_evidence_scores_below_random(white_image):
    saliency = np.zeros((4, 4))
    saliency[:2, :2] = 1.0  # the 4 patches of the corner the model reads
    score = deletion_score(corner_model, white_image, saliency, FILL, steps=16, random_orders=4)
    assert score.target == 0
    assert score.auc_map < score.auc_random
    assert score.faithful


def test_map_away_from_the_evidence_scores_above_random(white_image):
    saliency = np.ones((4, 4))
    saliency[:2, :2] = 0.0  # points everywhere except where the model looks
    score = deletion_score(corner_model, white_image, saliency, FILL, steps=16, random_orders=4)
    assert score.auc_map > score.auc_random
    assert not score.faithful


def test_curves_run_from_the_intact_image_to_all_patches_removed(white_image):
    score = deletion_score(corner_model, white_image, np.random.default_rng(1).random((4, 4)), FILL, steps=4)
    assert score.fractions[0] == 0.0 and score.fractions[-1] == 1.0
    assert score.curve_map[0] == pytest.approx(0.95)  # intact: all bright
    assert score.curve_map[-1] == pytest.approx(0.05) and score.curve_random[-1] == pytest.approx(0.05)
    assert len(score.curve_map) == len(score.curve_random) == len(score.fractions) == 5


def test_random_baseline_is_reproducible_with_its_seed(white_image):
    sal = np.random.default_rng(2).random((4, 4))
    a = deletion_score(corner_model, white_image, sal, FILL, seed=3)
    b = deletion_score(corner_model, white_image, sal, FILL, seed=3)
    assert a.auc_random == b.auc_random
    orders = deletion_orders(sal, 2, seed=3)
    assert sorted(orders[1].tolist()) == list(range(16)) and not np.array_equal(orders[1], orders[2])


def test_masked_images_fill_exactly_the_chosen_patches(white_image):
    out = masked_images(white_image, (4, 4), np.array([5, 0, 15]), [0, 1, 2], np.array([7, 8, 9], np.uint8))
    assert out.shape == (3, 16, 16, 3)
    assert (out[0] == 255).all()
    # patch 5 is row 1, column 1: pixels 4..8 in both directions
    assert (out[1, 4:8, 4:8] == [7, 8, 9]).all() and (out[1] != 255).any(axis=-1).sum() == 16
    assert (out[2, 0:4, 0:4] == [7, 8, 9]).all() and (out[2] != 255).any(axis=-1).sum() == 32


def test_mean_fill_is_the_colour_that_normalises_to_zero():
    mean = (0.485, 0.456, 0.406)
    fill = mean_fill(mean)
    assert fill.dtype == np.uint8
    assert np.abs(fill / 255.0 - np.array(mean)).max() <= 0.5 / 255


@pytest.mark.parametrize(
    "pixels, saliency, match",
    [
        (np.zeros((16, 16), np.uint8), np.ones((4, 4)), "pixels must be"),
        (np.zeros((16, 16, 3), np.float32), np.ones((4, 4)), "pixels must be"),
        (np.zeros((16, 16, 3), np.uint8), np.ones(16), "saliency must be"),
        (np.zeros((15, 16, 3), np.uint8), np.ones((4, 4)), "does not split"),
    ],
)
def test_bad_inputs_get_clear_errors(pixels, saliency, match):
    with pytest.raises(ValueError, match=match):
        deletion_score(corner_model, pixels, saliency, FILL)


def test_deletion_score_with_the_onnx_model_tracks_its_own_probability(tiny_onnx):
    from serve.runtime.classifier import OnnxClassifier

    clf = OnnxClassifier(tiny_onnx)
    H, W = clf.input_size
    pixels = np.random.default_rng(0).integers(0, 256, (H, W, 3), dtype=np.uint8)
    probs, maps = clf.rollout(pixels[None])
    score = deletion_score(clf.predict_pixels, pixels, maps[0], mean_fill(clf.preprocess.mean), steps=4)
    assert score.target == int(np.argmax(probs[0]))
    assert score.curve_map[0] == pytest.approx(float(probs[0].max()), abs=1e-5)
    assert score.curve_map[-1] == pytest.approx(score.curve_random[-1], abs=1e-6)  # both fully masked
    assert 0.0 <= score.auc_map <= 1.0 and 0.0 <= score.auc_random <= 1.0
