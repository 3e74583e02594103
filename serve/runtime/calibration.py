"""How far a score can be trusted, in numpy alone: the one place these formulas are written.

`vit-export` fits them on the calibration split (`serve.export.calibrate`); the runtime applies them
(`serve.runtime.trust`). Both call these functions, so a formula never drifts between the two.

- temperature scaling (Guo et al. 2017): probabilities softmax(logits / T), T fitted by a 1-D search on NLL;
- then, where the calibration split is large enough, a confidence map: an isotonic regression of being right
  on the temperature-scaled top-1 confidence, applied by giving each image the temperature t at which its
  top-1 probability is the mapped one (`calibrated_softmax`): class order and argmax are kept, the
  probabilities still sum to 1, and what a single T cannot fix (a label-smoothed model, overconfident in the
  middle and calibrated at the top) is fixed;
- expected calibration error over 15 equal-width confidence bins, and the negative log-likelihood;
- split-conformal prediction sets (Vovk; Angelopoulos & Bates): LAC (score 1 - p_y) and APS (randomised
  cumulative mass), with the finite-sample quantile ceil((n + 1) * coverage) / n;
- out-of-distribution scores, higher meaning less like the training images: max-softmax, energy
  (Liu et al. 2020) and Mahalanobis distance on pre-logit features (Lee et al. 2018; Fort et al. 2021);
- the population stability index of observed counts against stored fractions (drift).
"""

from __future__ import annotations

import math
import numbers
import zlib

import numpy as np

# Shapes: B batch, K classes, D pre-logit feature width, n calibration images, E bin edges.

ECE_BINS = 15
CONFORMAL_METHODS = ("lac", "aps")
OOD_SCORES = ("max_softmax", "energy", "mahalanobis")
PSI_FLOOR = 1e-4  # an empty bin counts as this fraction: log(0) would make one empty bin infinite drift


def softmax(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """(B, K) logits -> (B, K) float32 probabilities of softmax(logits / temperature)."""
    z = logits.astype(np.float64) / temperature
    z -= z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)


SMALL_RANKING = 64  # classes up to which `ranked` sorts in Python


def ranked(probs: np.ndarray, k: int | None = None) -> list[list[int]]:
    """(B, K) -> per image, its classes most probable first (the first k), ties in class order and NaN last:
    the order of `np.argsort(-probs, kind="stable")`.

    Up to `SMALL_RANKING` classes the rows are sorted in Python: numpy's sort lets go of the interpreter lock
    even for ten values, and a server thread that lets go of it waits for the model's thread to hand it
    back, which costs more than the sort.
    """
    if probs.shape[-1] > SMALL_RANKING:
        return np.argsort(-probs, axis=-1, kind="stable")[:, :k].tolist()
    out = []
    for row in probs.tolist():
        key = [-p if p == p else math.inf for p in row]  # p != p: NaN, ranked last
        out.append(sorted(range(len(row)), key=key.__getitem__)[:k])
    return out


BISECTION_STEPS = 32  # for the per-image temperature: log u in a bracket of width 14, to 3e-9 of it
BRACKET = 7.0  # the per-image 1/t lies within e^-7 .. e^7 times 1/T (clamped there when the target is beyond)
MAP_MIN_IMAGES = 1000  # a confidence map rests on at least this many calibration images (else temperature only)


def fit_confidence_map(confidence: np.ndarray, correct: np.ndarray, num_classes: int) -> np.ndarray:
    """Knots (2, M) of an increasing piecewise-linear map from top-1 confidence to the chance of being right.

    Isotonic regression (pool adjacent violators) of `correct` (n,) on `confidence` (n,); the knots are the
    pooled blocks' mean confidence and accuracy, blended with 0.1 % of the identity so that the map is
    strictly increasing (distinct confidences stay distinct: no ties for the prediction sets), and kept
    inside (1/K, 1).
    """
    order = np.argsort(confidence, kind="stable")
    x, y = confidence[order].astype(np.float64), correct[order].astype(np.float64)
    blocks: list[list[float]] = []  # [sum of y, sum of x, count]
    for xi, yi in zip(x.tolist(), y.tolist(), strict=True):
        blocks.append([yi, xi, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][2] >= blocks[-1][0] / blocks[-1][2]:
            last = blocks.pop()
            blocks[-1] = [a + b for a, b in zip(blocks[-1], last, strict=True)]
    kx = np.array([b[1] / b[2] for b in blocks])
    ky = 0.999 * np.array([b[0] / b[2] for b in blocks]) + 0.001 * kx
    kx, first = np.unique(kx, return_index=True)
    ky = np.clip(ky[first], 1.0 / num_classes + 1e-4, 1.0 - 1e-6)
    return np.stack([kx, ky])


def calibrated_softmax(logits: np.ndarray, temperature: float, knots: np.ndarray | None = None) -> np.ndarray:
    """(B, K) logits -> (B, K) float32 calibrated probabilities: softmax(logits / T) and, with a confidence map
    `knots` (2, M), softmax(logits / t) where each image's t makes its top-1 probability the mapped one.

    t is found by bisection on log(1/t) within e^-7 .. e^7 of 1/T: the top-1 probability grows with 1/t, so
    the search always converges and never overflows (no term exceeds exp(0)); `serve.export.triton` and the
    browser page run the same steps.
    """
    if knots is None or knots.shape[1] < 2:
        return softmax(logits, temperature)
    z = logits.astype(np.float64)
    d = z.max(axis=-1, keepdims=True) - z  # (B, K) gaps to the top logit, >= 0
    top = lambda log_u: 1.0 / np.exp(-d * np.exp(log_u)).sum(axis=-1, keepdims=True)  # (B, 1)
    base = np.full((len(z), 1), -math.log(temperature))
    want = np.interp(top(base), knots[0], knots[1])  # the mapped top-1 probability
    lo, hi = base - BRACKET, base + BRACKET
    for _ in range(BISECTION_STEPS):
        mid = (lo + hi) / 2
        below = top(mid) < want
        lo, hi = np.where(below, mid, lo), np.where(below, hi, mid)
    return softmax(z * np.exp((lo + hi) / 2))


def nll(probs: np.ndarray, labels: np.ndarray) -> float:
    """Mean negative log-likelihood of the true labels; probs (n, K), labels (n,)."""
    p = probs[np.arange(len(labels)), labels].astype(np.float64)
    return float(-np.log(np.clip(p, 1e-12, 1.0)).mean())


def ece(probs: np.ndarray, labels: np.ndarray, bins: int = ECE_BINS) -> float:
    """Expected calibration error: the mean |accuracy - confidence| of equal-width top-1 confidence bins,
    weighted by the share of images in each bin."""
    conf, acc, count = reliability(probs, labels, bins)
    n = count.sum()
    return float(np.sum(count / max(n, 1) * np.abs(acc - conf)))


def reliability(probs: np.ndarray, labels: np.ndarray, bins: int = ECE_BINS) -> tuple[np.ndarray, ...]:
    """Per equal-width confidence bin: (mean confidence, accuracy, image count), each (bins,); empty bins 0."""
    top = probs.max(axis=-1).astype(np.float64)
    right = (probs.argmax(axis=-1) == labels).astype(np.float64)
    which = np.clip((top * bins).astype(int), 0, bins - 1)  # (1/bins)-wide bins, 1.0 in the last
    count = np.bincount(which, minlength=bins).astype(np.float64)
    safe = np.maximum(count, 1)
    conf = np.bincount(which, top, minlength=bins) / safe
    acc = np.bincount(which, right, minlength=bins) / safe
    return conf, acc, count


MIN_TEMPERATURE, MAX_TEMPERATURE = 0.05, 20.0  # the search range of `fit_temperature`; a file's is checked against it


def fit_temperature(
    logits: np.ndarray, labels: np.ndarray, lo: float = MIN_TEMPERATURE, hi: float = MAX_TEMPERATURE
) -> float:
    """The temperature that minimises the NLL of `labels`: golden-section search on log T in [lo, hi].

    The NLL of a temperature-scaled softmax is convex in 1/T, so a 1-D search finds its minimum.
    """
    f = lambda log_t: nll(softmax(logits, math.exp(log_t)), labels)
    a, b = math.log(lo), math.log(hi)
    g = (math.sqrt(5) - 1) / 2
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(60):  # the bracket shrinks by 0.618 a step: far below 1e-6 in log T
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    return float(math.exp((a + b) / 2))


def image_uniforms(probs: np.ndarray) -> np.ndarray:
    """One number in [0, 1) per image, drawn from its own probabilities: APS's randomisation, repeatable.

    The same image always gets the same set, and different images get independent-looking draws.
    """
    rows = np.ascontiguousarray(probs, dtype=np.float32)
    return np.array([zlib.crc32(r.tobytes()) / 2**32 for r in rows])


def conformal_scores(probs: np.ndarray, method: str, u: np.ndarray | None = None) -> np.ndarray:
    """Every class's nonconformity score: (B, K), lower meaning more plausible.

    Args:
        probs: (B, K) calibrated probabilities.
        method: "lac" (1 - p_k) or "aps" (the mass of the classes ranked above k, plus u * p_k).
        u: (B,) APS draws in [0, 1); None takes `image_uniforms(probs)`.
    """
    if method == "lac":
        p = probs.astype(np.float64)
        scores = 1.0 - p
        # The top class's 1 - p_k as the sum of the others' probabilities: a confident image's p_k rounds to
        # 1.0 in float32, and ties at 0 would make the sets cover more than asked.
        rows, top = np.arange(len(p)), p.argmax(axis=-1)
        others = p.copy()
        others[rows, top] = 0.0
        scores[rows, top] = others.sum(axis=-1)
        return scores
    if method != "aps":
        raise ValueError(f"conformal method must be one of {', '.join(CONFORMAL_METHODS)}, got {method!r}")
    u = image_uniforms(probs) if u is None else u
    order = np.argsort(-probs, axis=-1, kind="stable")  # (B, K) classes by rank
    ranked = np.take_along_axis(probs.astype(np.float64), order, axis=-1)
    above = np.cumsum(ranked, axis=-1) - ranked  # (B, K) mass ranked strictly above each rank
    by_rank = above + u[:, None] * ranked
    scores = np.empty_like(by_rank)
    np.put_along_axis(scores, order, by_rank, axis=-1)
    return scores


def quantile_index(n: int, coverage: float) -> int:
    """The 1-based rank of the sorted calibration scores that gives `coverage`: ceil((n + 1) * coverage).

    Raises:
        ValueError: coverage outside (0, 1), or finer than n calibration scores can honour.
    """
    # compared, not converted: math.isfinite(10**400) overflows, and the bounds already refuse inf and NaN; any real
    # number type (numpy's floats too), but no bool
    real = isinstance(coverage, numbers.Real) and not isinstance(coverage, (bool, np.bool_))
    if not (real and 0.0 < coverage < 1.0):
        raise ValueError(f"coverage must be a number between 0 and 1 (exclusive), e.g. 0.9 or 0.95; got {coverage!r}")
    k = math.ceil((n + 1) * coverage - 1e-9)
    if k > n:
        raise ValueError(
            f"coverage {coverage} is finer than the {n} calibration images can honour: the most they allow is "
            f"{n / (n + 1):.4f} (1 - 1/(n+1)); ask for less, or calibrate on more images"
        )
    return max(k, 1)


def conformal_threshold(sorted_scores: np.ndarray, coverage: float) -> float:
    """The split-conformal threshold on ascending calibration scores, with the finite-sample correction."""
    return float(sorted_scores[quantile_index(len(sorted_scores), coverage) - 1])


def energy(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """(B, K) -> (B,) energy -T * logsumexp(logits / T): high when no class stands out."""
    z = logits.astype(np.float64) / temperature
    m = z.max(axis=-1)
    return -temperature * (m + np.log(np.exp(z - m[:, None]).sum(axis=-1)))


def mahalanobis(features: np.ndarray, means: np.ndarray, precision: np.ndarray) -> np.ndarray:
    """(B, D) features -> (B,) squared distance to the nearest class mean (K, D) under a shared precision (D, D)."""
    f = features.astype(np.float64)
    fp = f @ precision  # (B, D)
    mp = means @ precision  # (K, D)
    d = (fp * f).sum(-1)[:, None] - 2 * fp @ means.T + (mp * means).sum(-1)[None, :]  # (B, K)
    return d.min(axis=-1)


def fit_gaussian(features: np.ndarray, labels: np.ndarray, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """Class means (K, D) and the precision (D, D) of the shared covariance of (n, D) features.

    The covariance is shrunk towards a multiple of the identity by the Ledoit-Wolf formula, so that a few
    hundred images in a wide feature space still give a well-conditioned precision (a plain inverse would
    weigh directions the images never varied in without bound).
    """
    f = features.astype(np.float64)
    means = np.stack([f[labels == k].mean(axis=0) if (labels == k).any() else f.mean(0) for k in range(num_classes)])
    x = f - means[labels]  # (n, D) centred on each image's class mean
    n, D = x.shape
    cov = x.T @ x / n
    mu = np.trace(cov) / D
    d2 = np.sum((cov - mu * np.eye(D)) ** 2)  # how far the covariance is from mu * I
    b2 = (np.sum(np.sum(x**2, axis=1) ** 2) / n - np.sum(cov**2)) / n  # how noisy its estimate is
    shrink = min(b2, d2) / d2 if d2 > 0 else 1.0
    cov = shrink * mu * np.eye(D) + (1 - shrink) * cov
    return means, np.linalg.inv(cov + 1e-12 * max(mu, 1e-12) * np.eye(D))


def ood_score(kind: str, probs: np.ndarray, logits: np.ndarray, temperature: float, **gaussian) -> np.ndarray:
    """(B,) out-of-distribution scores of one kind, higher meaning less like the training images.

    Args:
        kind: "max_softmax" (1 - the top calibrated probability), "energy" or "mahalanobis".
        probs: (B, K) calibrated probabilities.
        logits: (B, K) raw logits.
        temperature: the file's temperature (energy uses it).
        gaussian: for "mahalanobis": features (B, D), means (K, D), precision (D, D).
    """
    if kind == "max_softmax":
        return 1.0 - probs.max(axis=-1).astype(np.float64)
    if kind == "energy":
        return energy(logits, temperature)
    if kind == "mahalanobis":
        return mahalanobis(gaussian["features"], gaussian["means"], gaussian["precision"])
    raise ValueError(f"OOD score must be one of {', '.join(OOD_SCORES)}, got {kind!r}")


def histogram(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Counts of `values` in the bins between E edges (E - 1 bins); values beyond the ends go to the end bins."""
    inner = np.asarray(edges, np.float64)[1:-1]
    return np.bincount(np.searchsorted(inner, values, side="right"), minlength=len(edges) - 1).astype(np.float64)


def psi(expected: np.ndarray, observed: np.ndarray) -> float:
    """Population stability index of observed counts against expected fractions (same bins).

    sum (o - e) * ln(o / e) over bins; by a common rule of thumb, under 0.1 is stable and over 0.25 a shift.
    """
    e = np.maximum(np.asarray(expected, np.float64), PSI_FLOOR)
    o = np.asarray(observed, np.float64)
    o = np.maximum(o / max(o.sum(), 1.0), PSI_FLOOR)
    e, o = e / e.sum(), o / o.sum()
    return float(np.sum((o - e) * np.log(o / e)))
