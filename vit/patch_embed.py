"""Image to patch tokens: one strided convolution (a linear map of each patch), a convolutional stem, or
shifted patch tokens.

The conv stem follows Xiao et al. 2021, "Early convolutions help transformers see better": a few
3 x 3 stride-2 convolutions (BatchNorm, ReLU) then a 1 x 1 projection replace the patchify layer, with
the same token grid. It trains faster and more stably on small data; the rest of the model is unchanged.

Shifted patch tokens (SPT, Lee et al. 2021, "Vision Transformer for Small-Size Datasets") give each token its
neighbours' pixels too: the image and four copies shifted half a patch diagonally are stacked as channels, and
each patch of the stack is flattened, layer-normalised and projected. The token grid is the same again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Shapes: B batch, C channels, H/W image, P patch, Gh/Gw grid, L = Gh*Gw patches, D embed_dim.

STEMS = ("patch", "conv", "shifted")
# 2048 x 2048 at patch 16: attention over N patches holds N x N scores per head and image (1 GiB at this limit)
MAX_PATCHES = 16_384


def too_many_patches(img_size: tuple[int, int], patch: int) -> str | None:
    """Why a model cannot run at `img_size` (H, W) with `patch`-pixel patches, or None when it can."""
    n = (img_size[0] // patch) * (img_size[1] // patch)
    if n <= MAX_PATCHES:
        return None
    return (
        f"{img_size[0]} x {img_size[1]} at patch {patch} is {n:,} patches, over the {MAX_PATCHES:,} a model runs "
        f"(their attention would hold {n * n * 4 / 2**30:,.0f} GiB of scores per head and image)"
    )


class PatchEmbed(nn.Module):
    """Split an image into non-overlapping patches and project each one to `embed_dim`.

    A Conv2d with kernel = stride = patch size is a linear map applied to every patch.

    Args:
        img_size: the (H, W) the model is built for; sets the default position grid.
        patch_size: side of a square patch, in pixels.
        in_chans: input channels.
        embed_dim: token width D.
        bias: whether the projection has a bias.
        stem: "patch" (one conv, kernel = stride = P; timm's layout), "conv" (log2(P) 3 x 3 stride-2
            convolutions, each doubling the width up to embed_dim / 2, then a 1 x 1 projection) or "shifted"
            (shifted patch tokens: the image and 4 half-patch diagonal shifts, each patch flattened,
            layer-normalised and projected by a linear layer).
        stem_widths: the conv stem's widths, one per 3 x 3 convolution (None: the doubling above). The
            last log2(P) convolutions have stride 2; any before them keep the full resolution (stride 1),
            which helps on tiny images, where a patch holds few pixels.
    """

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        embed_dim: int = 768,
        bias: bool = True,
        stem: str = "patch",
        stem_widths: list[int] | tuple[int, ...] | None = None,
    ):
        super().__init__()
        if stem not in STEMS:
            raise ValueError(f"stem must be one of {', '.join(STEMS)}, got {stem!r}")
        if stem_widths is not None and stem != "conv":
            raise ValueError(f"stem_widths is for stem='conv', got stem={stem!r}")
        self.img_size = _pair(img_size)
        self.patch_size = (patch_size, patch_size)
        H, W = self.img_size
        if H % patch_size or W % patch_size:
            raise ValueError(f"img_size {self.img_size} is not a multiple of patch_size {patch_size}")
        if why := too_many_patches(self.img_size, patch_size):  # its position table alone could take gigabytes
            raise ValueError(why)
        self.grid_size = (H // patch_size, W // patch_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.stem_type = stem
        if stem == "shifted":
            self.stem = ShiftedPatches(patch_size, in_chans)
            self.proj = nn.Linear(self.stem.norm.normalized_shape[0], embed_dim, bias=bias)
        elif stem == "patch":
            self.stem = nn.Identity()
            self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size, bias=bias)
        else:
            self.stem = conv_stem(in_chans, embed_dim, patch_size, stem_widths)
            self.proj = nn.Conv2d(self.stem[-3].out_channels, embed_dim, kernel_size=1, bias=bias)

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
        x = self.stem(x)  # conv: (B, C', Gh, Gw); shifted: (B, Gh, Gw, 5 C P P); patch: unchanged
        if self.stem_type == "shifted":
            return self.proj(x)  # (B, Gh, Gw, D)
        return self.proj(x).permute(0, 2, 3, 1)  # (B, D, Gh, Gw) -> (B, Gh, Gw, D)


class ShiftedPatches(nn.Module):
    """The image and its 4 half-patch diagonal shifts (zero-filled), cut into patches, each flattened and
    layer-normalised: (B, C, H, W) -> (B, Gh, Gw, 5 C P P). The projection to D is `PatchEmbed.proj`."""

    def __init__(self, patch_size: int, in_chans: int):
        super().__init__()
        if patch_size < 2:
            raise ValueError(f"shifted patch tokens need patch_size >= 2 (a half-patch shift), got {patch_size}")
        self.patch_size = patch_size
        self.norm = nn.LayerNorm(5 * in_chans * patch_size * patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x.shape
        P, s = self.patch_size, self.patch_size // 2
        padded = F.pad(x, (s, s, s, s))  # (B, C, H + 2s, W + 2s); each crop below is the image moved by (+-s, +-s)
        shifts = [padded[..., : -2 * s, : -2 * s], padded[..., : -2 * s, 2 * s :]]
        shifts += [padded[..., 2 * s :, : -2 * s], padded[..., 2 * s :, 2 * s :]]
        x = torch.cat([x, *shifts], dim=1)  # (B, 5C, H, W)
        Gh, Gw = H // P, W // P
        x = x.reshape(B, 5 * C, Gh, P, Gw, P).permute(0, 2, 4, 1, 3, 5)  # (B, Gh, Gw, 5C, P, P)
        return self.norm(x.reshape(B, Gh, Gw, 5 * C * P * P))


def conv_stem(
    in_chans: int, embed_dim: int, patch_size: int, widths: list[int] | tuple[int, ...] | None = None
) -> nn.Sequential:
    """3 x 3 conv + BatchNorm + ReLU layers: (B, C, H, W) -> (B, C', H/P, W/P).

    The last log2(P) layers have stride 2, any before them stride 1. By default there are log2(P) layers
    whose widths double from embed_dim / 2^k to embed_dim / 2, so the last is the widest, as in the paper.
    """
    k = patch_size.bit_length() - 1
    if patch_size < 2 or 2**k != patch_size:
        raise ValueError(f"the conv stem needs a power-of-2 patch_size (2, 4, 8, 16), got {patch_size}")
    widths = [max(8, embed_dim // 2 ** (k - i)) for i in range(k)] if widths is None else list(widths)
    if len(widths) < k or min(widths) < 1:
        raise ValueError(f"a {patch_size}-px patch needs at least {k} positive stem widths, got {widths}")
    layers: list[nn.Module] = []
    c_in = in_chans
    for i, c_out in enumerate(widths):
        stride = 2 if i >= len(widths) - k else 1
        layers += [nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()]
        c_in = c_out
    return nn.Sequential(*layers)


def _pair(x: int | tuple[int, int]) -> tuple[int, int]:
    return (x, x) if isinstance(x, int) else (int(x[0]), int(x[1]))
