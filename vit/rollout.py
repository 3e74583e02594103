"""Attention rollout (Abnar & Zuidema 2020) and gradient-weighted rollout (Chefer et al. 2021).

Both turn per-block attention maps into one relevance value per patch: where the model looked.
"""

from __future__ import annotations

import math

import torch
from torch import nn

# Shapes: B batch, nh heads, n prefix tokens, L patches, N = n + L tokens.

HEAD_FUSIONS = ("mean", "max", "min")


def attention_rollout(
    attns: list[torch.Tensor] | tuple[torch.Tensor, ...],
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
        (B, L) relevance per patch, each image scaled so its maximum is 1.
    """
    if head_fusion not in HEAD_FUSIONS:
        raise ValueError(f"head_fusion must be one of {HEAD_FUSIONS}, got {head_fusion!r}")
    if not 0.0 <= discard_ratio < 1.0:
        raise ValueError(f"discard_ratio must be in [0, 1), got {discard_ratio}")
    if query not in ("cls", "mean"):
        raise ValueError(f"query must be 'cls' or 'mean', got {query!r}")
    if query == "cls" and num_prefix_tokens < 1:
        raise ValueError("query='cls' needs a CLS token; use query='mean' for models without one")
    if len(attns) == 0:
        raise ValueError("attention_rollout needs at least one attention map")
    B, _, N, _ = attns[0].shape
    n = num_prefix_tokens
    L = N - n
    eye = torch.eye(N, dtype=attns[0].dtype, device=attns[0].device)  # (N, N)
    rollout = eye.expand(B, N, N)
    for attn in attns:
        a = _fuse_heads(attn, head_fusion)  # (B, N, N)
        k = math.floor(discard_ratio * L)
        if k > 0:
            patch_cols = a[..., n:]  # (B, N, L)
            weakest = patch_cols.topk(k, dim=-1, largest=False).indices  # (B, N, k)
            a = torch.cat([a[..., :n], patch_cols.scatter(-1, weakest, 0.0)], dim=-1)  # (B, N, N)
        a = (a + eye) / 2  # residual path
        a = a / a.sum(dim=-1, keepdim=True)  # rows sum to 1
        rollout = a @ rollout  # (B, N, N): this block after everything before it
    return _read_out(rollout, n, query)


def rollout_from_gradients(
    attns: list[torch.Tensor] | tuple[torch.Tensor, ...],
    grads: list[torch.Tensor] | tuple[torch.Tensor, ...],
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
        (B, L) relevance per patch for the class the gradients came from, maximum 1 per image.
    """
    if len(attns) != len(grads) or len(attns) == 0:
        raise ValueError(f"need one gradient per attention map, got {len(attns)} maps and {len(grads)} gradients")
    B, _, N, _ = attns[0].shape
    eye = torch.eye(N, dtype=attns[0].dtype, device=attns[0].device)  # (N, N)
    relevance = eye.expand(B, N, N)
    for attn, grad in zip(attns, grads, strict=True):
        if grad.shape != attn.shape:
            raise ValueError(f"gradient shape {tuple(grad.shape)} does not match its map {tuple(attn.shape)}")
        a = (grad * attn).clamp(min=0).mean(dim=1)  # (B, N, N): positive, class-specific evidence
        relevance = relevance + a @ relevance
    # Read out what the attention added, without the identity (each token's relevance to itself): Chefer
    # et al. leave the CLS token's own column out; for query="mean" the identity adds the same 1/L to
    # every patch, which after max-scaling flattens small models' maps to 0.98-1.
    return _read_out(relevance - eye, num_prefix_tokens, query)


def gradient_rollout(
    model: nn.Module,
    images: torch.Tensor,
    target: int | torch.Tensor | None = None,
    *,
    query: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Class-specific relevance maps for a batch, by gradient-weighted rollout.

    Args:
        model: a `VisionTransformer` (anything with `forward(x, return_attn=True)` and `num_prefix_tokens`).
        images: (B, C, H, W).
        target: class index for every image, (B,) indices, or None for each image's top class.
        query: "cls" or "mean"; defaults to the model's `rollout_query` (how its head pools).

    Returns:
        (maps, logits): maps (B, L) with maximum 1 per image, logits (B, K).
    """
    n = model.num_prefix_tokens
    query = query or model.rollout_query
    with torch.enable_grad():
        logits, attns = model(images, return_attn=True)
        B = logits.shape[0]
        if target is None:
            target = logits.argmax(dim=-1)
        target = torch.as_tensor(target, device=logits.device).expand(B)  # (B,)
        score = logits.gather(1, target[:, None]).sum()  # images are independent: one backward for all
        grads = torch.autograd.grad(score, attns)
    maps = rollout_from_gradients([a.detach() for a in attns], grads, num_prefix_tokens=n, query=query)
    return maps, logits.detach()


def _fuse_heads(attn: torch.Tensor, how: str) -> torch.Tensor:
    if how == "mean":
        return attn.mean(dim=1)  # (B, N, N)
    if how == "max":
        return attn.amax(dim=1)
    return attn.amin(dim=1)


def _read_out(rollout: torch.Tensor, n: int, query: str) -> torch.Tensor:
    if query == "cls":
        out = rollout[:, 0, n:]  # (B, L): the CLS row, patch columns
    else:
        out = rollout[:, n:, n:].mean(dim=1)  # (B, L): mean over patch rows
    return out / out.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(out.dtype).tiny)
