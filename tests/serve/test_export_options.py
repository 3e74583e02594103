"""The small-data options of the model (shifted patch tokens, locality self-attention, a distillation token, flip
test-time augmentation) export like the rest: both targets, the parity gate, rollout and gradient rollout."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from serve.runtime.classifier import OnnxClassifier
from tests.helpers import quadrant_images, write_tiny_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def options_run(tmp_path_factory) -> Path:
    pytest.importorskip("torch")
    # the small-images recipe's pooling (the patches' mean, no CLS token): the distillation token is the one prefix
    options = dict(
        stem="shifted", attn_score="lsa", distilled=True, global_pool="avg", class_token=False, flip_tta=True
    )
    return write_tiny_run(tmp_path_factory.mktemp("options"), steps=300, **options)


def test_shifted_patches_locality_attention_distillation_and_flip_tta_export_to_both_targets_through_the_parity_gate(
    options_run,
):
    import torch

    from serve.export.cli import main
    from train.checkpoint_format import load_network

    checkpoint = options_run / "checkpoints" / "best.ckpt"
    files = {target: options_run / f"{target}.onnx" for target in ("onnxruntime", "portable")}
    for target, out in files.items():  # main answers 1 when the parity gate fails
        assert main([str(checkpoint), "-o", str(out), "--target", target]) == 0
    net, _ = load_network(checkpoint)
    assert net.patch_embed.stem_type == "shifted" and net.blocks[0].attn.attn_score == "lsa" and net.distilled
    pixels, _ = quadrant_images(5, seed=3)  # (5, 32, 32, 3) uint8
    fused, portable = OnnxClassifier(files["onnxruntime"]), OnnxClassifier(files["portable"])
    np.testing.assert_allclose(portable.predict_pixels(pixels), fused.predict_pixels(pixels), atol=1e-4)
    (_, maps), (_, portable_maps) = fused.rollout(pixels), portable.rollout(pixels)
    np.testing.assert_allclose(maps, portable_maps, atol=1e-4)
    assert maps.shape == (5, 4, 4) and np.isfinite(maps).all()
    with torch.no_grad():  # the maps the file draws are the network's own: no token attends to itself
        _, attns = net(torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255, return_attn=True)
    assert all(float(a.diagonal(dim1=-2, dim2=-1).abs().max()) == 0 for a in attns)
    assert fused.num_prefix_tokens == 1 and fused.rollout_query == "mean"
    assert fused.supports_gradients
    grad_maps = fused.gradient_rollout(pixels)[1]
    assert grad_maps.shape == (5, 4, 4) and np.isfinite(grad_maps).all() and np.ptp(grad_maps) > 0
    mirror = pixels[:, :, ::-1].copy()  # flip_tta: an image and its mirror get one answer, and mirrored maps
    np.testing.assert_allclose(fused.predict_pixels(mirror), fused.predict_pixels(pixels), atol=1e-5)
    for target, clf in (("onnxruntime", fused), ("portable", portable)):
        assert clf.metadata["model_config"]["flip_tta"], target
        np.testing.assert_allclose(clf.rollout(mirror)[1], clf.rollout(pixels)[1][:, :, ::-1], atol=1e-4)
    np.testing.assert_allclose(fused.gradient_rollout(mirror)[1], grad_maps[:, :, ::-1], atol=1e-4)
