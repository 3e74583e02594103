"""The runtime against torch: the served preprocessing equals the training transform, and the ONNX file's
predictions, rollout and gradient rollout equal the torch model's; the numpy rollout follows the torch math."""

from __future__ import annotations

import numpy as np
import pytest

from serve.runtime.classifier import OnnxClassifier
from serve.runtime.images import load_image
from serve.runtime.rollout import attention_rollout, rollout_from_gradients
from tests.helpers import mixed_images

torch = pytest.importorskip("torch")


def test_preprocessing_equals_the_training_evaluation_transform(tiny_onnx, tiny_checkpoint):
    from train.checkpoint_format import load_network
    from train.transforms import EvalTransform

    clf = OnnxClassifier(tiny_onnx)
    _, meta = load_network(tiny_checkpoint)
    evaluate = EvalTransform(meta["preprocess"])
    for img in mixed_images():
        served = clf.preprocess.normalize(clf.prepare(img))  # (3, H, W): what the graph computes inside
        trained = evaluate(load_image(img)).numpy()
        np.testing.assert_array_equal(served, trained)


def test_predictions_agree_with_the_torch_model(tiny_onnx, tiny_checkpoint, tiny_run):
    from train.checkpoint_format import load_network

    net, meta = load_network(tiny_checkpoint)
    clf = OnnxClassifier(tiny_onnx)
    paths = sorted((tiny_run / "data").rglob("*.png"))
    pixels = np.stack([clf.prepare(p) for p in paths])
    with torch.no_grad():
        logits = net(torch.from_numpy(meta["preprocess"].normalize(pixels)))
    expected = (logits / clf.trust.temperature).softmax(-1).numpy()  # calibrated probabilities
    np.testing.assert_allclose(clf.predict_pixels(pixels), expected, atol=1e-5)
    np.testing.assert_allclose(clf.logits(pixels), logits.numpy(), atol=1e-4)  # the raw logits stay available
    assert clf.predict_pixels(pixels).max(-1).mean() > 0.8  # a trained model, not a uniform one


def test_rollout_maps_match_torch_rollout_of_the_same_model(tiny_onnx, tiny_checkpoint):
    from train.checkpoint_format import load_network
    from vit import attention_rollout as torch_rollout

    net, meta = load_network(tiny_checkpoint)
    clf = OnnxClassifier(tiny_onnx)
    pixels = np.stack([clf.prepare(img) for img in mixed_images(2)])
    with torch.no_grad():
        _, attns = net(torch.from_numpy(meta["preprocess"].normalize(pixels)), return_attn=True)
    expected = torch_rollout(attns, head_fusion="max", num_prefix_tokens=1).numpy()
    probs, maps = clf.rollout(pixels, head_fusion="max")
    assert maps.shape == (len(pixels), *clf.grid_size)
    np.testing.assert_allclose(maps.reshape(len(pixels), -1), expected, atol=1e-5)
    assert maps.max() == pytest.approx(1.0) and maps.min() >= 0.0


def test_gradient_rollout_from_the_file_matches_torch_for_any_target(tiny_onnx, tiny_checkpoint):
    from train.checkpoint_format import load_network
    from vit import gradient_rollout as torch_gradient_rollout

    net, meta = load_network(tiny_checkpoint)
    clf = OnnxClassifier(tiny_onnx)
    assert clf.supports_gradients
    pixels = np.stack([clf.prepare(img) for img in mixed_images(4)])
    x = torch.from_numpy(meta["preprocess"].normalize(pixels))
    for target in (None, 2, [0, 1, 2, 3, 0]):
        expected, logits = torch_gradient_rollout(net, x, None if target is None else torch.tensor(target))
        probs, maps = clf.gradient_rollout(pixels, target=target)
        assert maps.shape == (len(pixels), *clf.grid_size)
        np.testing.assert_allclose(maps.reshape(len(pixels), -1), expected.numpy(), atol=1e-4)
        np.testing.assert_allclose(probs, (logits / clf.trust.temperature).softmax(-1).numpy(), atol=1e-5)
    with pytest.raises(ValueError, match="target classes"):
        clf.gradient_rollout(pixels, target=7)


@pytest.mark.parametrize("head_fusion", ["mean", "max", "min"])
@pytest.mark.parametrize("discard_ratio", [0.0, 0.4])
@pytest.mark.parametrize("query,prefix", [("cls", 1), ("cls", 3), ("mean", 0)])
def test_numpy_rollout_follows_the_torch_math(head_fusion, discard_ratio, query, prefix):
    from vit import attention_rollout as torch_rollout

    g = torch.Generator().manual_seed(0)
    attns = [torch.randn(2, 3, prefix + 9, prefix + 9, generator=g).softmax(-1) for _ in range(3)]
    kw = dict(head_fusion=head_fusion, discard_ratio=discard_ratio, num_prefix_tokens=prefix, query=query)
    expected = torch_rollout(attns, **kw).numpy()
    got = attention_rollout(np.stack([a.numpy() for a in attns]), **kw)
    np.testing.assert_allclose(got, expected, atol=1e-6)


def test_numpy_gradient_rollout_follows_the_torch_math():
    from vit import rollout_from_gradients as torch_grad_rollout

    g = torch.Generator().manual_seed(1)
    attns = [torch.randn(2, 2, 10, 10, generator=g).softmax(-1) for _ in range(2)]
    grads = [torch.randn(2, 2, 10, 10, generator=g) for _ in range(2)]
    expected = torch_grad_rollout(attns, grads, num_prefix_tokens=1).numpy()
    got = rollout_from_gradients([a.numpy() for a in attns], [g_.numpy() for g_ in grads], num_prefix_tokens=1)
    np.testing.assert_allclose(got, expected, atol=1e-6)


def test_thread_default_follows_model_size(tiny_onnx):
    from serve.runtime.classifier import OnnxClassifier
    from serve.runtime.session import default_threads
    from vit import create_model

    sample = create_model("vit_micro_patch4_32")  # ~0.02 GFLOP: one thread
    vit_small = create_model("vit_small_patch16_224")  # ~9 GFLOP: every core
    assert default_threads({"gflops_per_image": str(sample.flops_per_image() / 1e9)}) == 1
    assert default_threads({"gflops_per_image": str(vit_small.flops_per_image() / 1e9)}) == 0
    assert default_threads({}) == 1  # no usable metadata: the cautious choice
    clf = OnnxClassifier(tiny_onnx)
    assert float(clf.metadata["gflops_per_image"]) > 0 and clf.threads == 1
    assert OnnxClassifier(tiny_onnx, threads=2).threads == 2
