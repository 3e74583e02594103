"""Flip test-time augmentation: each image and its mirror image through the network, their outputs averaged.

For images whose class does not change in a mirror (clothes, animals, most photos; not digits or text), the
average of the two views' logits is a better answer than either: `VisionTransformer(flip_tta=True)` answers it
outside training, at twice the cost of an image. Training sees one view. The attention maps of the mirror image
are mirrored back (its patch tokens reordered column by column) before the two views' maps are averaged, so that
rollout reads one map per image, in the image's own layout, and every row still sums to 1.

    x2 = two_views(x)               # (2B, C, H, W): the images, then their mirrors
    logits = mean_of_views(net(x2))  # (B, K)
"""

from __future__ import annotations

import torch

# Shapes: B batch, C channels, H/W image, Gh/Gw patch grid, n prefix tokens, N = n + Gh*Gw tokens, nh heads.


def two_views(x: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (2B, C, H, W): the images, then each one mirrored left to right."""
    return torch.cat([x, x.flip(-1)])


def mean_of_views(t: torch.Tensor) -> torch.Tensor:
    """(2B, ...) -> (B, ...): the mean of each image's two views (logits, features)."""
    return t.unflatten(0, (2, -1)).mean(0)  # (2, B, ...) -> (B, ...)


def logits_and_features(net, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What an exported file answers for images x (B, C, H, W): logits (B, K) and features (B, F) of the
    `VisionTransformer` `net`, the mean over x and its mirror when `net.two_views`."""
    views = two_views(x) if net.two_views else x  # (B or 2B, C, H, W)
    logits, features = net.logits_and_features(net.forward_features(views, num_out_tokens=net._head_tokens))
    return (mean_of_views(logits), mean_of_views(features)) if net.two_views else (logits, features)


def mirror_order(grid: tuple[int, int], num_prefix_tokens: int) -> torch.Tensor:
    """(N,) token indices: the prefix tokens in place, each row of patches in reverse column order."""
    Gh, Gw = grid
    patches = torch.arange(Gh * Gw).view(Gh, Gw).flip(-1).flatten() + num_prefix_tokens
    return torch.cat([torch.arange(num_prefix_tokens), patches])


def merge_maps(maps: torch.Tensor, grid: tuple[int, int], num_prefix_tokens: int, reduce: str = "mean") -> torch.Tensor:
    """One block's maps of both views, (2B, nh, N, N) -> (B, nh, N, N), the mirror's mirrored back first.

    Args:
        maps: attention maps (or their gradients) of `two_views`' batch.
        grid: the patch grid (Gh, Gw) of the images.
        num_prefix_tokens: n.
        reduce: "mean" for attention maps (rows keep summing to 1); "sum" for the gradients of the mean of the two
            views' logits, which makes each view's half of the gradient whole again.
    """
    image, mirror = maps.unflatten(0, (2, -1)).unbind(0)  # (B, nh, N, N) each
    order = mirror_order(grid, num_prefix_tokens).to(maps.device)
    mirror = mirror.index_select(-2, order).index_select(-1, order)
    return (image + mirror) / 2 if reduce == "mean" else image + mirror
