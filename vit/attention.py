"""Multi-head self-attention with selectable scoring functions.

Five scores, chosen per model with `attn_score`:

- ``scaled_dot``: softmax(q k^T / sqrt(hd)) v (Vaswani et al. 2017); the default.
- ``dot``: softmax(q k^T) v, no scaling (Luong et al. 2015).
- ``bilinear``: softmax(q W k^T) v with a learned W per head ("general" score, Luong et al. 2015).
- ``additive``: softmax(v_a^T tanh(W_a q + U_a k)) v per head (Bahdanau et al. 2015).
- ``lsa``: locality self-attention (Lee et al. 2021): softmax(q k^T * t_h) v with a learned temperature t_h per
  head (starting at 1 / sqrt(hd)) and the diagonal masked out, so that each token attends to the others.

The fused path (`F.scaled_dot_product_attention`) and the explicit softmax path live side by side
in one `forward`; the explicit one runs only when the caller asks for the attention map.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# Shapes: B batch, N tokens, D embed_dim, nh heads, hd = D // nh head dim, da additive hidden dim.

ATTN_SCORES = ("scaled_dot", "dot", "additive", "bilinear", "lsa")


class Attention(nn.Module):
    """Multi-head self-attention; module names match timm's `Attention` so weights load directly.

    Args:
        dim: token width D.
        num_heads: nh; D must be a multiple of it.
        qkv_bias: bias on the fused q, k, v projection.
        qk_norm: LayerNorm on q and k per head.
        attn_drop: dropout on the attention weights.
        proj_drop: dropout after the output projection.
        attn_score: one of "scaled_dot", "dot", "additive", "bilinear", "lsa".
        norm_layer: normalisation used for `qk_norm`.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        qkv_bias: bool = True,
        qk_norm: bool = False,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        attn_score: str = "scaled_dot",
        norm_layer: type[nn.Module] = nn.LayerNorm,
    ):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed_dim {dim} is not divisible by num_heads {num_heads}")
        if attn_score not in ATTN_SCORES:
            raise ValueError(f"attn_score must be one of {ATTN_SCORES}, got {attn_score!r}")
        self.num_heads = num_heads
        self.head_dim = hd = dim // num_heads
        self.attn_score = attn_score
        self.scale = hd**-0.5 if attn_score == "scaled_dot" else 1.0
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.q_norm = norm_layer(hd) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(hd) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        if attn_score == "bilinear":
            # starts as scaled dot product: W = I / sqrt(hd)
            self.score_weight = nn.Parameter(torch.eye(hd).repeat(num_heads, 1, 1) * hd**-0.5)  # (nh, hd, hd)
        elif attn_score == "lsa":
            # log of the temperature, per head: it stays positive, and decay leaves it alone (1-d)
            self.score_log_scale = nn.Parameter(torch.full((num_heads,), math.log(hd**-0.5)))  # (nh,)
        elif attn_score == "additive":
            self.score_q = nn.Parameter(torch.empty(num_heads, hd, hd))  # W_a: (nh, hd, da)
            self.score_k = nn.Parameter(torch.empty(num_heads, hd, hd))  # U_a: (nh, hd, da)
            self.score_v = nn.Parameter(torch.empty(num_heads, hd))  # v_a: (nh, da)
            self.reset_score_parameters()

    def reset_score_parameters(self) -> None:
        """Initialise the additive score's own weights (the model-wide init leaves them alone)."""
        if self.attn_score == "additive":
            hd = self.head_dim
            nn.init.normal_(self.score_q, std=hd**-0.5)
            nn.init.normal_(self.score_k, std=hd**-0.5)
            nn.init.normal_(self.score_v, std=hd**-0.5)

    def forward(
        self, x: torch.Tensor, return_attn: bool = False, num_queries: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Args:
            x: tokens (B, N, D).
            return_attn: also return the softmax weights; runs the explicit path.
            num_queries: Nq; only the first Nq tokens query (keys and values still come from all N).
                None: every token, Nq = N.

        Returns:
            (out, attn): out is (B, Nq, D); attn is (B, nh, Nq, N) before dropout, or None.
        """
        B, N, D = x.shape
        nh, hd = self.num_heads, self.head_dim
        q, k, v = self.qkv(x).reshape(B, N, 3, nh, hd).permute(2, 0, 3, 1, 4)  # 3 x (B, nh, N, hd)
        if num_queries is not None:
            q = q[:, :, :num_queries]  # (B, nh, Nq, hd)
        Nq = q.shape[2]
        q, k = self.q_norm(q), self.k_norm(k)
        if self.attn_score == "bilinear":
            q = torch.einsum("bhnd,hde->bhne", q, self.score_weight)  # q W: (B, nh, N, hd)

        if self.attn_score == "lsa":
            q = q * self.score_log_scale.exp()[:, None, None]  # the learned temperature: (B, nh, Nq, hd)
        if not return_attn and self.attn_score != "additive":
            others = ~self_mask(Nq, N, x.device) if self.attn_score == "lsa" else None  # (Nq, N), True: attend
            x = F.scaled_dot_product_attention(
                q, k, v, attn_mask=others, dropout_p=self.attn_drop.p if self.training else 0.0, scale=self.scale
            )  # (B, nh, Nq, hd)
            attn = None
        else:
            attn = self.scores(q, k).softmax(dim=-1)  # (B, nh, Nq, N), rows sum to 1
            x = self.attn_drop(attn) @ v  # (B, nh, Nq, hd)

        x = x.transpose(1, 2).reshape(B, Nq, D)  # (B, Nq, D)
        x = self.proj_drop(self.proj(x))
        return x, attn

    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Attention logits before softmax.

        Args:
            q: (B, nh, Nq, hd), already multiplied by W for the bilinear score.
            k: (B, nh, N, hd).

        Returns:
            (B, nh, Nq, N).
        """
        if self.attn_score == "lsa":  # q carries the temperature (`forward`); a token never attends to itself
            return (q @ k.transpose(-2, -1)).masked_fill(self_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
        if self.attn_score != "additive":
            return (q * self.scale) @ k.transpose(-2, -1)  # (B, nh, Nq, N)
        wq = torch.einsum("bhnd,hde->bhne", q, self.score_q)  # (B, nh, Nq, da)
        uk = torch.einsum("bhmd,hde->bhme", k, self.score_k)  # (B, nh, N, da)
        # every query against every key: (B, nh, Nq, 1, da) + (B, nh, 1, N, da)
        hidden = torch.tanh(wq.unsqueeze(3) + uk.unsqueeze(2))  # (B, nh, Nq, N, da)
        return torch.einsum("bhnme,he->bhnm", hidden, self.score_v)  # (B, nh, Nq, N)


def self_mask(Nq: int, N: int, device: torch.device) -> torch.Tensor:
    """(Nq, N) bool, True where query i meets key i (the first Nq tokens query)."""
    return torch.arange(Nq, device=device)[:, None] == torch.arange(N, device=device)[None, :]
