"""Attention rollout against hand-computed results, its invariants, and gradient rollout."""

from __future__ import annotations

import pytest
import torch

from vit import attention_rollout, gradient_rollout, rollout_from_gradients


def maps(*rows_per_block) -> list[torch.Tensor]:
    """One (1, 1, N, N) map per block from nested lists."""
    return [torch.tensor(rows, dtype=torch.float64)[None, None] for rows in rows_per_block]


def test_two_blocks_by_hand():
    a1 = [[0.2, 0.6, 0.2], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]]
    a2 = [[0.4, 0.2, 0.4], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    # A1' = [[.6,.3,.1],[.05,.9,.05],[.15,.15,.7]], A2' row 0 = [.7,.1,.2]
    # (A2' A1') row 0 = [.455, .33, .215] -> patches [.33, .215] / .33
    out = attention_rollout(maps(a1, a2))
    torch.testing.assert_close(out, torch.tensor([[1.0, 0.215 / 0.33]], dtype=torch.float64))


def test_order_is_last_block_on_the_left():
    a1 = [[0.2, 0.6, 0.2], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]]
    a2 = [[0.4, 0.2, 0.4], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    assert not torch.allclose(attention_rollout(maps(a1, a2)), attention_rollout(maps(a2, a1)))


def test_discard_zeroes_the_weakest_patches_but_never_the_prefix():
    # CLS column is the smallest entry of row 0, yet it stays; 0.15 and 0.14 go (floor(0.5 * 4) = 2)
    row0 = [0.01, 0.4, 0.3, 0.15, 0.14]
    a = [row0] + [[0.2] * 5 for _ in range(4)]
    out = attention_rollout(maps(a), discard_ratio=0.5)
    # kept: [.01, .4, .3, 0, 0]; +I, /2 -> [.505, .2, .15, 0, 0]; patches / .2
    torch.testing.assert_close(out, torch.tensor([[1.0, 0.75, 0.0, 0.0]], dtype=torch.float64))


def test_renormalisation_keeps_rows_summing_to_one():
    # rows that do not sum to 1 after discarding must be renormalised row by row (keepdim)
    torch.manual_seed(0)
    a = torch.rand(5, 5, dtype=torch.float64).softmax(-1).tolist()  # distinct entries: no ties to break
    two = attention_rollout(maps(a, a), discard_ratio=0.5)
    # by hand: discard, add identity, halve, renormalise each row, square the matrix
    A = torch.tensor(a, dtype=torch.float64)
    for i in range(5):
        patch = A[i, 1:]
        patch[patch.argsort()[:2]] = 0
    A = (A + torch.eye(5, dtype=torch.float64)) / 2
    A = A / A.sum(dim=1, keepdim=True)
    R = A @ A
    expected = R[0, 1:] / R[0, 1:].max()
    torch.testing.assert_close(two[0], expected)


@pytest.mark.parametrize("fusion, reduce", [("mean", torch.mean), ("max", torch.amax), ("min", torch.amin)])
def test_head_fusion(fusion, reduce):
    torch.manual_seed(0)
    attns = [torch.rand(2, 3, 5, 5).softmax(-1) for _ in range(2)]
    fused_by_hand = [reduce(a, dim=1, keepdim=True) for a in attns]
    torch.testing.assert_close(
        attention_rollout(attns, head_fusion=fusion), attention_rollout(fused_by_hand, head_fusion="mean")
    )


def test_max_fusion_by_hand():
    h1 = [[0.5, 0.5, 0.0], [0, 1, 0], [0, 0, 1]]
    h2 = [[0.2, 0.0, 0.8], [0, 1, 0], [0, 0, 1]]
    attn = torch.tensor([h1, h2], dtype=torch.float64)[None]  # (1, 2, 3, 3)
    # max over heads row 0: [.5, .5, .8]; +I /2 -> [.75, .25, .4] / 1.4
    out = attention_rollout([attn], head_fusion="max")
    torch.testing.assert_close(out, torch.tensor([[0.25 / 0.4, 1.0]], dtype=torch.float64))


def test_register_tokens_are_prefix_columns():
    # N = CLS + 1 register + 2 patches; the register's column is left out of the map
    a = [[0.1, 0.5, 0.3, 0.1], [0.25] * 4, [0.25] * 4, [0.25] * 4]
    out = attention_rollout(maps(a), num_prefix_tokens=2)
    # row 0 after +I, /2: [.55, .25, .15, .05] -> patches [.15, .05] / .15
    torch.testing.assert_close(out, torch.tensor([[1.0, 1 / 3]], dtype=torch.float64))


def test_mean_query_for_models_without_cls():
    a = [[0.6, 0.4], [0.2, 0.8]]
    # A' = [[.8, .2], [.1, .9]], mean of rows = [.45, .55]
    out = attention_rollout(maps(a), num_prefix_tokens=0, query="mean")
    torch.testing.assert_close(out, torch.tensor([[0.45 / 0.55, 1.0]], dtype=torch.float64))


def test_uniform_attention_gives_a_uniform_map():
    N = 1 + 12
    attns = [torch.full((2, 4, N, N), 1.0 / N) for _ in range(6)]
    for fusion in ("mean", "max", "min"):
        out = attention_rollout(attns, head_fusion=fusion)
        torch.testing.assert_close(out, torch.ones(2, 12))


def test_images_in_a_batch_are_independent(tiny_model):
    x = torch.randn(3, 3, 32, 32)
    _, attns = tiny_model(x, return_attn=True)
    batch = attention_rollout(attns, discard_ratio=0.25)
    one = attention_rollout([a[1:2] for a in attns], discard_ratio=0.25)
    torch.testing.assert_close(batch[1:2], one)
    assert batch.shape == (3, 16) and torch.allclose(batch.amax(-1), torch.ones(3))


def test_non_square_grids(tiny_model):
    _, attns = tiny_model(torch.randn(2, 3, 16, 48), return_attn=True)
    assert attention_rollout(attns).shape == (2, 2 * 6)


def test_bad_arguments_are_refused():
    a = [torch.rand(1, 1, 3, 3)]
    with pytest.raises(ValueError, match="head_fusion"):
        attention_rollout(a, head_fusion="median")
    with pytest.raises(ValueError, match="discard_ratio"):
        attention_rollout(a, discard_ratio=1.0)
    with pytest.raises(ValueError, match="needs a CLS token"):
        attention_rollout(a, num_prefix_tokens=0)


def test_gradient_rollout_pairs_each_gradient_with_its_block():
    a1 = torch.tensor([[[0.5, 0.5], [0.5, 0.5]]], dtype=torch.float64)[:, None]  # (1, 1, 2, 2)
    a2 = torch.tensor([[[0.9, 0.1], [0.3, 0.7]]], dtype=torch.float64)[:, None]
    g1 = torch.tensor([[[1.0, -1.0], [0.0, 2.0]]], dtype=torch.float64)[:, None]
    g2 = torch.tensor([[[0.0, 2.0], [1.0, 1.0]]], dtype=torch.float64)[:, None]
    # Chefer: R1 = I + (g1*a1)^+ = [[1.5, 0], [0, 2]]; R2 = R1 + (g2*a2)^+ R1 = R1 + [[0, .2],[.3,.7]] R1
    # R2 row 0 = [1.5, 0] + [0, .4] = [1.5, .4]; patch column (n = 1): [.4] -> max-normalised 1
    out = rollout_from_gradients([a1, a2], [g1, g2], num_prefix_tokens=1)
    torch.testing.assert_close(out, torch.tensor([[1.0]], dtype=torch.float64))
    swapped = rollout_from_gradients([a1, a2], [g2, g1], num_prefix_tokens=0, query="mean")
    paired = rollout_from_gradients([a1, a2], [g1, g2], num_prefix_tokens=0, query="mean")
    # paired: R2 = [[1.5, .4], [.45, 3.4]]; read out R2 - I = [[.5, .4], [.45, 2.4]], row mean [.475, 1.4]
    torch.testing.assert_close(paired, torch.tensor([[0.475 / 1.4, 1.0]], dtype=torch.float64))
    assert not torch.allclose(swapped, paired)


def test_gradient_rollout_with_weak_gradients_still_spans_the_range():
    # tiny evidence on top of the identity: without leaving the identity out, every patch would read ~1
    a = torch.softmax(torch.randn(1, 2, 5, 5, generator=torch.Generator().manual_seed(0)), dim=-1)
    g = 1e-3 * torch.rand(1, 2, 5, 5, generator=torch.Generator().manual_seed(1))
    out = rollout_from_gradients([a, a], [g, g], num_prefix_tokens=0, query="mean")
    assert out.max() == 1.0 and out.min() < 0.8


def test_gradient_rollout_is_class_specific_and_per_image(tiny_model):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 32)
    maps_a, logits = gradient_rollout(tiny_model, x, target=0)
    maps_b, _ = gradient_rollout(tiny_model, x, target=3)
    assert maps_a.shape == (2, 16) and logits.shape == (2, 5)
    assert not torch.allclose(maps_a, maps_b)
    single, _ = gradient_rollout(tiny_model, x[1:], target=0)
    torch.testing.assert_close(maps_a[1:], single, atol=1e-5, rtol=1e-4)
    top, _ = gradient_rollout(tiny_model, x)  # default: each image's predicted class
    assert top.shape == (2, 16) and torch.all(top >= 0) and torch.allclose(top.amax(-1), torch.ones(2))
