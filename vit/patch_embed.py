"""Image to patch tokens."""

from __future__ import annotations

import torch
from torch import nn

# Shapes: B batch, C channels, H/W image, P patch, Gh/Gw grid, L = Gh*Gw patches, D embed_dim.


class PatchEmbed(nn.Module):
    """Split an image into non-overlapping patches and project each one to `embed_dim`.

    A Conv2d with kernel = stride = patch size is a linear map applied to every patch.

    Args:
        img_size: the (H, W) the model is built for; sets the default position grid.
        patch_size: side of a square patch, in pixels.
        in_chans: input channels.
        embed_dim: token width D.
        bias: whether the projection has a bias.
    """

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        embed_dim: int = 768,
        bias: bool = True,
    ):
        super().__init__()
        self.img_size = _pair(img_size)
        self.patch_size = (patch_size, patch_size)
        H, W = self.img_size
        if H % patch_size or W % patch_size:
            raise ValueError(f"img_size {self.img_size} is not a multiple of patch_size {patch_size}")
        self.grid_size = (H // patch_size, W // patch_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args:
            x: images, (B, C, H, W) with H and W multiples of the patch size.

        Returns:
            Patch tokens (B, Gh, Gw, D), channels last so the grid stays visible.
        """
        B, C, H, W = x.shape
        P = self.patch_size[0]
        if not torch.jit.is_tracing() and not torch.compiler.is_compiling() and (H % P or W % P):
            raise ValueError(f"image size ({H}, {W}) is not a multiple of the patch size {P}")
        return self.proj(x).permute(0, 2, 3, 1)  # (B, D, Gh, Gw) -> (B, Gh, Gw, D)


def _pair(x: int | tuple[int, int]) -> tuple[int, int]:
    return (x, x) if isinstance(x, int) else (int(x[0]), int(x[1]))
