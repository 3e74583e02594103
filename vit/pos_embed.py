"""Position encodings: a learned table (resampled for other grids) or fixed 2-D sin-cos."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# Shapes: Gh/Gw grid, L = Gh*Gw, D embed_dim, n prefix tokens that carry a position.


def resample_pos_embed(
    pos_embed: torch.Tensor,
    new_grid: tuple[int, int],
    old_grid: tuple[int, int],
    num_prefix_tokens: int = 0,
    antialias: bool = False,
) -> torch.Tensor:
    """Interpolate a learned position table to another patch grid.

    In the forward pass: bicubic without antialias, which exports to ONNX. Converting weights once
    (`from_timm`) uses antialias, as timm does, so the result matches timm's own resize.

    Args:
        pos_embed: (1, n + Gh*Gw, D) with `num_prefix_tokens` leading prefix positions.
        new_grid: target (Gh', Gw').
        old_grid: the (Gh, Gw) the table was learned for.
        num_prefix_tokens: leading positions that belong to prefix tokens and are kept as they are.
        antialias: PyTorch's antialiased bicubic (a = -0.5, like PIL) instead of a = -0.75.

    Returns:
        (1, n + Gh'*Gw', D).
    """
    if tuple(new_grid) == tuple(old_grid):
        return pos_embed
    prefix, grid = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    D = grid.shape[-1]
    grid = grid.reshape(1, old_grid[0], old_grid[1], D).permute(0, 3, 1, 2)  # (1, D, Gh, Gw)
    grid = F.interpolate(grid.float(), size=new_grid, mode="bicubic", align_corners=False, antialias=antialias).to(
        pos_embed.dtype
    )
    grid = grid.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], D)  # (1, Gh'*Gw', D)
    return torch.cat([prefix, grid], dim=1)


def sincos_2d(grid: tuple[int, int], dim: int, temperature: float = 10000.0) -> torch.Tensor:
    """Fixed 2-D sin-cos position encoding (MAE / "Simple ViT").

    Half of the channels encode the row, half the column, each as sin and cos at geometric frequencies.

    Args:
        grid: (Gh, Gw).
        dim: D, a multiple of 4.
        temperature: base of the frequency ladder.

    Returns:
        (1, Gh*Gw, D), row-major over the grid like the patch tokens.
    """
    if dim % 4:
        raise ValueError(f"sin-cos position encoding needs embed_dim divisible by 4, got {dim}")
    Gh, Gw = grid
    y, x = torch.meshgrid(torch.arange(Gh, dtype=torch.float32), torch.arange(Gw, dtype=torch.float32), indexing="ij")
    omega = 1.0 / temperature ** (torch.arange(dim // 4, dtype=torch.float32) / (dim // 4))  # (D/4,)
    y = y.reshape(-1, 1) * omega  # (L, D/4)
    x = x.reshape(-1, 1) * omega  # (L, D/4)
    pe = torch.cat([x.sin(), x.cos(), y.sin(), y.cos()], dim=1)  # (L, D)
    return pe.unsqueeze(0)


def grid_from_tokens(num_tokens: int) -> tuple[int, int]:
    """The square grid holding `num_tokens` patches (used for checkpoints that carry no grid)."""
    side = math.isqrt(num_tokens)
    if side * side != num_tokens:
        raise ValueError(f"{num_tokens} position embeddings do not form a square grid; pass img_size explicitly")
    return side, side
