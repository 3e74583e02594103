"""Attention rollout in numpy: the one implementation of the arithmetic.

The torch-free runtime calls it on the maps the ONNX file outputs; `vit.rollout` adapts torch tensors to
it, so the model, the exporter's parity gate and the server all compute the same map.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

# Shapes: B batch, nh heads, n prefix tokens, L patches, N = n + L tokens.

HEAD_FUSIONS = ("mean", "max", "min")  # how the heads of one block are combined


def attention_rollout(
    attns: Sequence[np.ndarray] | np.ndarray,
    *,
    head_fusion: str = "mean",
    discard_ratio: float = 0.0,
    num_prefix_tokens: int = 1,
    query: str = "cls",
) -> np.ndarray:
    """Roll attention out through the blocks: how much each patch feeds the output token.

    Args:
        attns: per-block softmax maps, first block first: a sequence of (B, nh, N, N) or one
            (depth, B, nh, N, N) array.
        head_fusion: "mean", "max" or "min" over heads.
        discard_ratio: share of patch columns, per row, set to 0 (the smallest ones).
        num_prefix_tokens: n, the CLS and register tokens in front of the patches.
        query: "cls" reads the CLS token's row; "mean" averages the patch rows.

    Returns:
        (B, L) relevance per patch (float32; float64 for float64 maps), each image scaled so its maximum is 1.
    """
    if head_fusion not in HEAD_FUSIONS:
        raise ValueError(f"head_fusion must be one of {HEAD_FUSIONS}, got {head_fusion!r}")
    if not 0.0 <= discard_ratio < 1.0:
        raise ValueError(f"discard_ratio must be in [0, 1), got {discard_ratio}")
    _check_query(query, num_prefix_tokens)
    if len(attns) == 0:
        raise ValueError("attention_rollout needs at least one attention map")
    B, _, N, _ = attns[0].shape
    n = num_prefix_tokens
    L = N - n
    dtype = _float_dtype(attns[0])
    eye = np.eye(N, dtype=dtype)  # (N, N)
    rollout = np.broadcast_to(eye, (B, N, N))
    k = math.floor(discard_ratio * L)
    for attn in attns:
        a = _fuse_heads(np.asarray(attn, dtype=dtype), head_fusion)  # (B, N, N)
        if k > 0:
            patch_cols = a[..., n:].copy()  # (B, N, L)
            weakest = np.argpartition(patch_cols, k - 1, axis=-1)[..., :k]  # (B, N, k)
            np.put_along_axis(patch_cols, weakest, 0.0, axis=-1)
            a = np.concatenate([a[..., :n], patch_cols], axis=-1)  # (B, N, N)
        a = (a + eye) / 2  # residual path
        a = a / a.sum(axis=-1, keepdims=True)  # rows sum to 1
        rollout = a @ rollout  # (B, N, N): this block after everything before it
    return _read_out(rollout, n, query)


def rollout_from_gradients(
    attns: Sequence[np.ndarray] | np.ndarray,
    grads: Sequence[np.ndarray] | np.ndarray,
    *,
    num_prefix_tokens: int = 1,
    query: str = "cls",
) -> np.ndarray:
    """Gradient-weighted rollout (Chefer et al. 2021): R <- R + mean_h((dy/dA * A)^+) R, block by block,
    from R = I; read out from R - I.

    Args:
        attns: per-block maps (B, nh, N, N), first block first.
        grads: the gradient of the target score with respect to each map, same shapes.
        num_prefix_tokens: n.
        query: "cls" or "mean".

    Returns:
        (B, L) relevance per patch (float32; float64 for float64 maps), maximum 1 per image.
    """
    if len(attns) != len(grads) or len(attns) == 0:
        raise ValueError(f"need one gradient per attention map, got {len(attns)} maps and {len(grads)} gradients")
    _check_query(query, num_prefix_tokens)
    B, _, N, _ = attns[0].shape
    eye = np.eye(N, dtype=_float_dtype(attns[0]))  # (N, N)
    relevance = np.broadcast_to(eye, (B, N, N))
    for attn, grad in zip(attns, grads, strict=True):
        if grad.shape != attn.shape:
            raise ValueError(f"gradient shape {tuple(grad.shape)} does not match its map {tuple(attn.shape)}")
        a = np.clip(grad * attn, 0, None).mean(axis=1)  # (B, N, N): positive, class-specific evidence
        relevance = relevance + a @ relevance
    # Read out what the attention added, without the identity (each token's relevance to itself): Chefer
    # et al. leave the CLS token's own column out; for query="mean" the identity adds the same 1/L to
    # every patch, which after max-scaling flattens small models' maps to 0.98-1.
    return _read_out(relevance - eye, num_prefix_tokens, query)


def _float_dtype(a) -> np.dtype:
    """float64 maps stay float64 (exact tests); anything else is computed in float32."""
    return np.dtype(np.float64) if np.asarray(a).dtype == np.float64 else np.dtype(np.float32)


def _check_query(query: str, n: int) -> None:
    if query not in ("cls", "mean"):
        raise ValueError(f"query must be 'cls' or 'mean', got {query!r}")
    if query == "cls" and n < 1:
        raise ValueError("query='cls' needs a CLS token; use query='mean' for models without one")


def _fuse_heads(attn: np.ndarray, how: str) -> np.ndarray:
    if how == "mean":
        return attn.mean(axis=1)  # (B, N, N)
    if how == "max":
        return attn.max(axis=1)
    return attn.min(axis=1)


def _read_out(rollout: np.ndarray, n: int, query: str) -> np.ndarray:
    if query == "cls":
        out = rollout[:, 0, n:]  # (B, L): the CLS row, patch columns
    else:
        out = rollout[:, n:, n:].mean(axis=1)  # (B, L): mean over patch rows
    dtype = out.dtype if out.dtype == np.float64 else np.float32
    peak = np.maximum(out.max(axis=-1, keepdims=True), np.finfo(dtype).tiny)
    return (out / peak).astype(dtype)
