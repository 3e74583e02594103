"""Flip test-time augmentation (`flip_tta`): outside training, each image and its mirror, averaged, maps included."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from vit import VisionTransformer, attention_rollout, flip  # noqa: E402
from vit.flip import mirror_order  # noqa: E402


def pair(config: dict, **overrides) -> tuple[VisionTransformer, VisionTransformer]:
    """The same weights without and with flip_tta, in eval mode."""
    torch.manual_seed(0)
    plain = VisionTransformer(**config, **overrides).eval()
    flipped = VisionTransformer(**config, **overrides, flip_tta=True).eval()
    flipped.load_state_dict(plain.state_dict())  # no parameters of its own: timm's names, the same weights
    return plain, flipped


@pytest.mark.parametrize("overrides", [{}, dict(global_pool="avg", class_token=False)], ids=["cls", "avg"])
def test_outside_training_the_answer_is_the_mean_of_the_image_and_its_mirror(tiny_config, overrides):
    plain, flipped = pair(tiny_config, **overrides)
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        expected = (plain(x) + plain(x.flip(-1))) / 2
        torch.testing.assert_close(flipped(x), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(flipped(x.flip(-1)), flipped(x), rtol=1e-5, atol=1e-5)  # a mirror: same answer
        torch.testing.assert_close(flipped(x, return_attn=True)[0], expected, rtol=1e-5, atol=1e-5)
        flipped.train()  # training sees one view
        plain.train()
        torch.testing.assert_close(flipped(x), plain(x))


def test_the_maps_are_the_two_views_merged_in_the_images_own_layout(tiny_config):
    plain, flipped = pair(tiny_config)
    x = torch.randn(2, 3, 32, 32)
    order = mirror_order(flipped.grid_size, flipped.num_prefix_tokens)  # (N,)
    with torch.no_grad():
        _, maps = flipped(x, return_attn=True)
        _, mirror_maps = flipped(x.flip(-1), return_attn=True)
        _, own = plain(x, return_attn=True)
        _, other = plain(x.flip(-1), return_attn=True)
    for m, m_mirror, a, b in zip(maps, mirror_maps, own, other, strict=True):
        assert m.shape == a.shape  # (B, nh, N, N)
        torch.testing.assert_close(m, (a + b[..., order, :][..., order]) / 2)
        torch.testing.assert_close(m.sum(-1), torch.ones_like(m.sum(-1)))  # still a softmax map, row by row
        torch.testing.assert_close(m_mirror, m[..., order, :][..., order], rtol=1e-5, atol=1e-6)
    rollout = attention_rollout(maps).view(2, *flipped.grid_size)  # (B, Gh, Gw), the image's own layout
    mirror_rollout = attention_rollout(mirror_maps).view(2, *flipped.grid_size)
    torch.testing.assert_close(mirror_rollout, rollout.flip(-1), rtol=1e-5, atol=1e-6)


def test_it_costs_two_views_and_is_saved_in_the_config(tiny_config):
    plain, flipped = pair(tiny_config)
    assert flipped.flops_per_image() == 2 * plain.flops_per_image()
    assert VisionTransformer(**flipped.config).flip_tta


def test_the_exported_answer_is_the_models_own_over_both_views(tiny_config):
    plain, flipped = pair(tiny_config, global_pool="avg", class_token=False)
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        logits, features = flip.logits_and_features(flipped, x)  # what the graphs and the review app answer
        torch.testing.assert_close(logits, flipped(x))
        one, mirror = (plain.logits_and_features(plain.forward_features(v))[1] for v in (x, x.flip(-1)))
        torch.testing.assert_close(features, (one + mirror) / 2)
