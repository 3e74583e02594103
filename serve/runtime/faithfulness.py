"""Deletion score: does removing the patches a map calls important make the prediction fall fast?

Patches are removed most-relevant-first, in `steps` steps, by filling them with the normalisation
mean (the colour that becomes exactly zero after normalisation, i.e. "no information"). The top class
probability after each step traces the deletion curve; its area (AUC, fraction removed on x) is
compared with the same area for random orders (seeded). A map is faithful to the model when its AUC
is lower than the random one: the model really relied on the patches the map highlights.

Everything runs through the ONNX model's `predict_pixels`; numpy only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

# Shapes: H/W image, Gh/Gw patch grid, L = Gh*Gw patches, S = steps + 1 points per curve, K classes.

_trapezoid = getattr(np, "trapezoid", None) or np.trapz  # numpy 2 renamed trapz


@dataclass
class DeletionScore:
    """A deletion curve for the map and for random orders, with their areas.

    Attributes:
        target: index of the class whose probability is tracked.
        fractions: (S,) fraction of patches removed at each point, 0 to 1.
        curve_map: (S,) target probability, patches removed most-relevant-first.
        curve_random: (S,) the same, averaged over the random orders.
        auc_map: area under `curve_map` (lower: more faithful map).
        auc_random: area under `curve_random`.
    """

    target: int
    fractions: list[float]
    curve_map: list[float]
    curve_random: list[float]
    auc_map: float
    auc_random: float

    @property
    def faithful(self) -> bool:
        """True when removing the map's patches hurts the prediction more than removing random ones."""
        return self.auc_map < self.auc_random

    def to_dict(self) -> dict:
        return {**asdict(self), "faithful": self.faithful}


def deletion_orders(saliency: np.ndarray, random_orders: int, seed: int) -> list[np.ndarray]:
    """Patch orders: the map's (most relevant first) followed by `random_orders` seeded permutations.

    Args:
        saliency: (Gh, Gw) relevance of each patch.
        random_orders: how many random permutations to add.
        seed: seed of the permutations.

    Returns:
        1 + random_orders arrays of (L,) patch indices.
    """
    flat = np.asarray(saliency, dtype=np.float64).ravel()  # (L,)
    rng = np.random.default_rng(seed)
    return [np.argsort(-flat, kind="stable")] + [rng.permutation(flat.size) for _ in range(random_orders)]


def masked_images(
    pixels: np.ndarray, grid: tuple[int, int], order: np.ndarray, counts: Sequence[int], fill: np.ndarray
) -> np.ndarray:
    """Copies of `pixels` with the first `counts[i]` patches of `order` filled with `fill`.

    Args:
        pixels: (H, W, 3) uint8 image, already at the model's input size.
        grid: (Gh, Gw) patch grid.
        order: (L,) patch indices in removal order.
        counts: patches removed in each copy.
        fill: (3,) uint8 colour of a removed patch.

    Returns:
        (len(counts), H, W, 3) uint8.
    """
    H, W, _ = pixels.shape
    Gh, Gw = grid
    ph, pw = H // Gh, W // Gw
    out = np.repeat(pixels[None], len(counts), axis=0)  # (S, H, W, 3)
    for i, k in enumerate(counts):
        for idx in order[:k]:
            r, c = divmod(int(idx), Gw)
            out[i, r * ph : (r + 1) * ph, c * pw : (c + 1) * pw] = fill
    return out


def deletion_score(
    predict: Callable[[np.ndarray], np.ndarray],
    pixels: np.ndarray,
    saliency: np.ndarray,
    fill: Sequence[int] | np.ndarray,
    target: int | None = None,
    steps: int = 16,
    random_orders: int = 3,
    seed: int = 0,
    chunk: int = 32,
) -> DeletionScore:
    """Deletion curves of a relevance map against random orders, with the model itself.

    Args:
        predict: (B, H, W, 3) uint8 -> (B, K) probabilities (the ONNX classifier's `predict_pixels`).
        pixels: (H, W, 3) uint8 image at the model's input size.
        saliency: (Gh, Gw) relevance of each patch (any scale; only the order matters).
        fill: (3,) uint8 colour of a removed patch, normally the normalisation mean x 255.
        target: class to track (default: the top class of the intact image).
        steps: points on each curve after the first (patches removed in `steps` equal steps).
        random_orders: random permutations averaged for the baseline.
        seed: seed of the random orders, so the score is reproducible.
        chunk: most images per `predict` call.

    Returns:
        The `DeletionScore`.
    """
    if pixels.ndim != 3 or pixels.shape[2] != 3 or pixels.dtype != np.uint8:
        raise ValueError(f"pixels must be (H, W, 3) uint8, got {pixels.shape} {pixels.dtype}")
    saliency = np.asarray(saliency)
    if saliency.ndim != 2:
        raise ValueError(f"saliency must be a (Gh, Gw) grid, got shape {saliency.shape}")
    Gh, Gw = saliency.shape
    L = Gh * Gw
    H, W, _ = pixels.shape
    if H % Gh or W % Gw:
        raise ValueError(f"image {H} x {W} does not split into a {Gh} x {Gw} patch grid")
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    counts = sorted({round(i * L / steps) for i in range(steps + 1)})  # removed patches per point
    fill = np.asarray(fill, dtype=np.uint8).reshape(3)
    orders = deletion_orders(saliency, random_orders, seed)
    images = np.concatenate([masked_images(pixels, (Gh, Gw), o, counts, fill) for o in orders])  # (O*S, H, W, 3)
    probs = np.concatenate([predict(images[i : i + chunk]) for i in range(0, len(images), chunk)])  # (O*S, K)
    if target is None:
        target = int(np.argmax(probs[0]))  # counts[0] == 0: the intact image
    curves = probs[:, target].reshape(len(orders), len(counts)).astype(np.float64)  # (O, S)
    x = np.asarray(counts, dtype=np.float64) / L
    curve_map, curve_random = curves[0], curves[1:].mean(axis=0) if random_orders else curves[0]
    return DeletionScore(
        target=int(target),
        fractions=x.tolist(),
        curve_map=curve_map.tolist(),
        curve_random=curve_random.tolist(),
        auc_map=float(_trapezoid(curve_map, x)),
        auc_random=float(_trapezoid(curve_random, x)),
    )


def mean_fill(mean: Sequence[float]) -> np.ndarray:
    """(3,) uint8 colour that normalises to (about) zero: the mean in 0-255."""
    return np.clip(np.round(np.asarray(mean, dtype=np.float64) * 255.0), 0, 255).astype(np.uint8)
