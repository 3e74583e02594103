"""Attention rollout (Abnar & Zuidema 2020) and gradient-weighted rollout (Chefer et al. 2021) for torch.

Both turn per-block attention maps into one relevance value per patch: where the model looked. The
arithmetic lives once, in numpy, in `serve.runtime.rollout` (the exported model's torch-free runtime
uses it too); these functions adapt tensors to it, so the two can never drift apart.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from serve.runtime import rollout as np_rollout
from serve.runtime.rollout import HEAD_FUSIONS
from vit import flip

# Shapes: B batch, nh heads, n prefix tokens, L patches, N = n + L tokens.

__all__ = ["HEAD_FUSIONS", "attention_gradients", "attention_rollout", "gradient_rollout", "rollout_from_gradients"]


def attention_rollout(
    attns: Sequence[torch.Tensor],
    *,
    head_fusion: str = "mean",
    discard_ratio: float = 0.0,
    num_prefix_tokens: int = 1,
    query: str = "cls",
) -> torch.Tensor:
    """Roll attention out through the blocks: how much each patch feeds the output token.

    Per block: fuse heads, optionally zero the weakest patch links in every row, add the identity
    for the residual path, renormalise rows; then multiply the blocks together, last on the left.

    Args:
        attns: per-block softmax maps, first block first, each (B, nh, N, N).
        head_fusion: "mean", "max" or "min" over heads.
        discard_ratio: share of patch columns, per row, set to 0 (the smallest ones); prefix
            columns are never discarded.
        num_prefix_tokens: n, the CLS and register tokens in front of the patches.
        query: "cls" reads the CLS token's row; "mean" averages the patch rows (for
            average-pooled models without a CLS token).

    Returns:
        (B, L) relevance per patch on the maps' device (float32; float64 for float64 maps), each
        image scaled so its maximum is 1.
    """
    out = np_rollout.attention_rollout(
        _numpy(attns),
        head_fusion=head_fusion,
        discard_ratio=discard_ratio,
        num_prefix_tokens=num_prefix_tokens,
        query=query,
    )
    return _like(out, attns)


def rollout_from_gradients(
    attns: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    *,
    num_prefix_tokens: int = 1,
    query: str = "cls",
) -> torch.Tensor:
    """Gradient-weighted rollout (Chefer et al. 2021): R <- R + mean_h((dy/dA * A)^+) R, block by block,
    from R = I; read out from R - I.

    Args:
        attns: per-block maps (B, nh, N, N), first block first.
        grads: the gradient of the target score with respect to each map, same shapes, same order.
        num_prefix_tokens: n.
        query: "cls" or "mean", as in `attention_rollout`.

    Returns:
        (B, L) relevance per patch (float32; float64 for float64 maps) for the class the gradients
        came from, maximum 1 per image.
    """
    out = np_rollout.rollout_from_gradients(
        _numpy(attns), _numpy(grads), num_prefix_tokens=num_prefix_tokens, query=query
    )
    return _like(out, attns)


def gradient_rollout(
    model: nn.Module,
    images: torch.Tensor,
    target: int | torch.Tensor | None = None,
    *,
    query: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Class-specific relevance maps for a batch, by gradient-weighted rollout.

    Args:
        model: a `VisionTransformer`.
        images: (B, C, H, W).
        target: class index for every image, (B,) indices, or None for each image's top class.
        query: "cls" or "mean"; defaults to the model's `rollout_query` (how its head pools).

    Returns:
        (maps, logits): maps (B, L) with maximum 1 per image, logits (B, K).
    """
    query = query or model.rollout_query
    logits, _, attns, grads = attention_gradients(model, images, target)
    maps = rollout_from_gradients(attns, grads, num_prefix_tokens=model.num_prefix_tokens, query=query)
    return maps, logits


def attention_gradients(
    model: nn.Module, images: torch.Tensor, target: int | torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """What gradient rollout reads, for a `VisionTransformer` on `images` (B, C, H, W).

    Returns:
        logits (B, K), features (B, D), every block's maps (B, nh, N, N) and the gradient of each image's `target`
        logit (None: its top class) with respect to them; with `flip_tta`, each view's maps and gradients are
        taken, then merged (`vit.flip.merge_maps`).
    """
    flipping = model.two_views
    with torch.enable_grad():
        tokens, attns = model.forward_features(flip.two_views(images) if flipping else images, return_attn=True)
        logits, features = model.logits_and_features(tokens)  # (B or 2B, K), (B or 2B, D)
        if flipping:
            logits, features = flip.mean_of_views(logits), flip.mean_of_views(features)
        if target is None:
            target = logits.argmax(dim=-1)
        target = torch.as_tensor(target, device=logits.device).expand(logits.shape[0])  # (B,)
        score = logits.gather(1, target[:, None]).sum()  # images are independent: one backward for all
        grads = list(torch.autograd.grad(score, attns))
    attns = [a.detach() for a in attns]
    if flipping:  # each view has half the mean's gradient: their sum is the mean of the views' own
        attns, grads = model.merge_maps(attns, images), model.merge_maps(grads, images, reduce="sum")
    return logits.detach(), features.detach(), attns, grads


def _numpy(maps: Sequence[torch.Tensor]) -> list[np.ndarray]:
    return [m.detach().cpu().numpy() if m.dtype == torch.float64 else m.detach().float().cpu().numpy() for m in maps]


def _like(out: np.ndarray, maps: Sequence[torch.Tensor]) -> torch.Tensor:
    device = maps[0].device if len(maps) else "cpu"
    return torch.from_numpy(out).to(device)
