"""The pre-norm transformer encoder block and its parts (names follow timm)."""

from __future__ import annotations

import torch
from torch import nn

from vit.attention import Attention

# Shapes: B batch, N tokens, D embed_dim, nh heads.


class Mlp(nn.Module):
    """Two linear layers with a GELU between (timm's `Mlp`)."""

    def __init__(self, dim: int, hidden_dim: int, drop: float = 0.0, bias: bool = True):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim, bias=bias)
        self.act = nn.GELU()
        self.drop1 = nn.Dropout(drop)
        self.norm = nn.Identity()
        self.fc2 = nn.Linear(hidden_dim, dim, bias=bias)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc1(x)  # (B, N, hidden)
        # without autograd, GELU overwrites fc1's fresh output: no second (B, N, hidden) buffer to fill
        x = self.act(x) if torch.is_grad_enabled() else torch.ops.aten.gelu_(x)
        return self.drop2(self.fc2(self.norm(self.drop1(x))))


class LayerScale(nn.Module):
    """Per-channel learned scale on a residual branch (CaiT)."""

    def __init__(self, dim: int, init_values: float = 1e-5):
        super().__init__()
        self.gamma = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class DropPath(nn.Module):
    """Stochastic depth: drop a whole residual branch per sample while training."""

    def __init__(self, drop_prob: float = 0.0):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep = 1.0 - self.drop_prob
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)  # (B, 1, 1)
        return x * mask / keep

    def extra_repr(self) -> str:
        return f"drop_prob={self.drop_prob}"


class Block(nn.Module):
    """x + attn(norm1(x)), then x + mlp(norm2(x)), each branch with optional LayerScale and drop path.

    Without autograd (inference), the residual sums and the MLP's GELU are written in place into
    tensors the block itself just made, never into its input. A forward hook on a module inside the
    block (`attn`, `mlp` and their layers, `ls1`, `drop_path2`, ...) may therefore see its output
    updated afterwards; clone it in the hook to keep it.

    Args:
        dim: token width D.
        num_heads: attention heads nh.
        mlp_ratio: MLP hidden width as a multiple of D.
        qkv_bias: bias on the q, k, v projection.
        qk_norm: LayerNorm on q and k.
        proj_drop: dropout after the attention projection and in the MLP.
        attn_drop: dropout on attention weights.
        init_values: LayerScale initial value; None disables LayerScale.
        drop_path: stochastic depth rate for this block.
        attn_score: attention scoring function (see `vit.attention`).
        norm_layer: normalisation layer.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        qk_norm: bool = False,
        proj_drop: float = 0.0,
        attn_drop: float = 0.0,
        init_values: float | None = None,
        drop_path: float = 0.0,
        attn_score: str = "scaled_dot",
        norm_layer: type[nn.Module] = nn.LayerNorm,
    ):
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = Attention(dim, num_heads, qkv_bias, qk_norm, attn_drop, proj_drop, attn_score, norm_layer)
        self.ls1 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=proj_drop)
        self.ls2 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(
        self, x: torch.Tensor, return_attn: bool = False, num_queries: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Args:
            x: tokens (B, N, D).
            return_attn: also return this block's attention map.
            num_queries: Nq; compute only the first Nq tokens' outputs (they still attend to all N).
                None: every token, Nq = N.

        Returns:
            (x, attn): x is (B, Nq, D); attn is (B, nh, Nq, N) or None.
        """
        y, attn = self.attn(self.norm1(x), return_attn, num_queries)  # (B, Nq, D)
        if num_queries is not None:
            x = x[:, :num_queries]  # (B, Nq, D)
        x = residual(x, self.drop_path1(self.ls1(y)))
        x = residual(x, self.drop_path2(self.ls2(self.mlp(self.norm2(x)))))
        return x, attn


def residual(x: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    """x + branch. Without autograd, the sum is written into `branch` (a fresh tensor of the block's own)
    when that keeps x's dtype: one buffer fewer to fill. Under autocast a bf16 branch is added out of place,
    so the residual stream stays in x's precision."""
    if torch.is_grad_enabled() or branch.dtype != x.dtype:
        return x + branch
    return branch.add_(x)
