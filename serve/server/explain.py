"""Explanations for the API and the UI alike, without gradio: rollout maps with their deletion score, the
raw attention of one head, overlays rendered over the image, and the deletion score said in words.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import matplotlib
import numpy as np
from PIL import Image

from serve.runtime.faithfulness import DeletionScore, deletion_score
from serve.server.settings import RequestLimits

COLORMAPS = ("inferno", "jet", "viridis", "magma", "turbo")
DISPLAY_SIZE = 256  # the input crop is tiny for small models: show it large enough to see


def render_overlay(
    pixels: np.ndarray, grid: np.ndarray, opacity: float = 0.5, colormap: str = "inferno", size: int = DISPLAY_SIZE
) -> np.ndarray:
    """Blend a relevance grid over the image.

    Args:
        pixels: (H, W, 3) uint8, the model's input crop.
        grid: (Gh, Gw) relevance, any scale (stretched to its own min-max range here).
        opacity: weight of the heat map, 0 (image only) to 1 (map only).
        colormap: a matplotlib colormap name.
        size: longer side of the result in pixels.

    Returns:
        (h, w, 3) uint8.
    """
    H, W, _ = pixels.shape
    scale = size / max(H, W)
    w, h = max(1, round(W * scale)), max(1, round(H * scale))
    base = np.asarray(Image.fromarray(pixels).resize((w, h), Image.Resampling.BICUBIC), np.float32)  # (h, w, 3)
    g = np.asarray(grid, np.float32)
    span = float(g.max() - g.min())
    g = (g - g.min()) / span if span > 1e-8 else np.zeros_like(g)  # min-max: the contrast within this map
    heat = np.asarray(Image.fromarray(g).resize((w, h), Image.Resampling.BILINEAR), np.float32)  # (h, w)
    rgb = matplotlib.colormaps[colormap](np.clip(heat, 0.0, 1.0))[..., :3] * 255.0  # (h, w, 3)
    return np.clip((1.0 - opacity) * base + opacity * rgb, 0, 255).astype(np.uint8)


def overlay_png(pixels: np.ndarray, grid: np.ndarray) -> str:
    """The rollout overlay in the UI's default colours, as base64 PNG."""
    buf = io.BytesIO()
    Image.fromarray(render_overlay(pixels, grid)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def explain_pixels(
    classifier, pixels: np.ndarray, head_fusion: str, discard_ratio: float, blocks, fill, limits: RequestLimits
) -> dict[str, Any]:
    """Rollout map and deletion score of one image. Runs on the batcher's thread, so it does the model's
    work only: the caller renders the overlay (`render_overlay`) in its own colours.

    Returns:
        {"probs": (K,), "grid": (Gh, Gw), "deletion": DeletionScore}.
    """
    probs, maps = classifier.rollout(pixels[None], head_fusion=head_fusion, discard_ratio=discard_ratio, blocks=blocks)
    grid = np.asarray(maps[0], np.float32)  # (Gh, Gw)
    return with_deletion(classifier, pixels, probs[0], grid, fill, limits)


def with_deletion(classifier, pixels, probs, grid, fill, limits: RequestLimits, target=None) -> dict[str, Any]:
    """`{"probs", "grid", "deletion"}`: the map with its deletion score for `target` (default: the top class)."""
    score = deletion_score(
        classifier.predict_pixels,
        pixels,
        grid,
        fill,
        target=int(np.argmax(probs)) if target is None else target,
        steps=limits.deletion_steps,
        chunk=limits.max_batch_size,
    )
    return {"probs": np.asarray(probs), "grid": grid, "deletion": score}


def cls_attention(classifier, pixels: np.ndarray, block: int, head: int) -> tuple[np.ndarray, np.ndarray]:
    """Raw attention of one block and head: the CLS query's row over the patches, as a grid.

    Returns:
        (probs (K,), grid (Gh, Gw)); for models read out by the patch mean (no CLS token), the mean
        over the patch queries.
    """
    probs, attns = classifier.attentions(pixels[None])  # attns (depth, 1, nh, N, N)
    P, (Gh, Gw) = classifier.num_prefix_tokens, classifier.grid_size
    a = np.asarray(attns[block, 0, head])  # (N, N)
    row = a[0, P:] if classifier.rollout_query == "cls" else a[P:, P:].mean(axis=0)  # (L,)
    return probs[0], row.reshape(Gh, Gw)


def deletion_text(score: DeletionScore, labels) -> str:
    verdict = (
        "**faithful**: removing the highlighted patches hurts the prediction faster than removing random ones"
        if score.faithful
        else "**not better than random**: treat this map with suspicion"
    )
    return (
        f"Deletion score for *{labels[score.target]}* (area under the probability curve as patches are removed; "
        f"lower is better): map **{score.auc_map:.3f}** vs random order **{score.auc_random:.3f}**. {verdict}."
    )
