"""What an exported file knows about its own reliability, applied to a batch: `Trust`.

`vit-export` stores it under the `calibration` metadata key (`serve.export.calibrate`):

    {"temperature": T, "images": n, "source": "...", "metrics": {"ece_before", "ece_after", "nll_before", ...},
     "confidence_map": {"confidence": [M], "accuracy": [M]},   # absent: temperature scaling alone
     "conformal": {"method": "lac" | "aps", "class_conditional": bool, "scores": [n ascending], "labels": [n]},
     "ood": {"score": "energy" | "max_softmax" | "mahalanobis", "threshold": t, "accept": 0.95,
             "means": [[K x D]], "precision": [[D x D]]},   # the last two for "mahalanobis" only
     "drift": {"confidence": {"edges", "fractions"}, "predicted": {"fractions"}, "ood_score": {"edges", "fractions"}}}

A file exported before calibration existed has no such key: `Trust.from_metadata` returns None, and
the classifier reports raw softmax, no sets, and `unknown` / `ood_score` as None. An entry that is there
is checked whole on load (`check`): an edited temperature of -1 would serve the least likely class, and a
NaN threshold would never say unknown, so such a file is refused rather than served.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from serve.runtime import calibration as cal
from serve.runtime.model_file import AGAIN, ModelFileError, shown

# Shapes: B batch, K classes, D pre-logit feature width, n calibration images.

METADATA_KEY = "calibration"
FEATURES_OUTPUT = "features"  # the graph output Mahalanobis needs: the pooled pre-logits (B, D), as the export chose


def _read(entry: Any, path: str, convert: Callable[[Any], Any], default: Any = ...) -> Any:
    """`convert` of the calibration entry's field at a dotted `path`, or `default` when it is absent.

    Raises:
        ModelFileError: the field is missing (and has no default), or `convert` refused it; the message names it.
    """
    value = entry
    try:
        for key in path.split("."):
            value = value[key]
    except (KeyError, TypeError, IndexError):
        if default is not ...:
            return default
        raise ModelFileError(f"the file's calibration metadata has no {path}; {AGAIN}") from None
    try:
        return convert(value)
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise ModelFileError(
            f"the file's calibration metadata has an invalid {path} {shown(value)} ({type(e).__name__}); {AGAIN}"
        ) from None


def _number(value: Any) -> float:
    """A JSON number as a float; a string or a boolean (which `float` would take) is a TypeError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError("not a number")
    return float(value)


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):  # bool("false") is True
        raise TypeError("not true or false")
    return value


def _whole_numbers(value: Any) -> np.ndarray:
    array = np.asarray(value)
    if array.size and array.dtype.kind not in "iu":  # np.int64 of 0.5 is 0
        raise TypeError("not whole numbers")
    return array.astype(np.int64)


def feature_width(outputs: dict[str, list | None]) -> int | None:
    """D, the width of the graph's features output (by output name, its shape), when the graph fixes it."""
    dims = list(outputs.get(FEATURES_OUTPUT) or [])[1:2]
    return dims[0] if len(dims) == 1 and isinstance(dims[0], int) else None


TEMPERATURE_RANGE = f"a number in [{cal.MIN_TEMPERATURE}, {cal.MAX_TEMPERATURE}], the range vit-export fits it in"
DRIFT = ("confidence", "predicted", "ood_score")  # the drift entry's histograms


def _histogram_ok(drift: dict[str, Any], name: str, num_classes: int) -> bool:
    """Whether the drift entry's histogram `name` (absent: fine) has finite sorted edges and a fraction per bin
    (per class for "predicted"): the drift gauge compares answers against it."""
    if name not in drift:
        return True
    try:
        h = drift[name]
        fractions = np.asarray(h["fractions"], np.float64)
        bins = num_classes if name == "predicted" else len(h["edges"]) - 1
        edges = np.asarray(h.get("edges", [0.0]), np.float64)
    except (KeyError, TypeError, ValueError):
        return False
    ok = edges.ndim == 1 and np.isfinite(edges).all() and (np.diff(edges) > 0).all()
    return bool(ok and fractions.shape == (bins,) and np.isfinite(fractions).all() and (fractions >= 0).all())


@dataclass
class Trust:
    """The file's temperature, conformal scores, OOD threshold and drift reference.

    Args:
        temperature: softmax(logits / temperature) are the temperature-scaled probabilities.
        confidence_map: (2, M) knots mapping their top-1 probability to the calibrated one, or None
            (`calibration.calibrated_softmax`).
        method: the conformal score, "lac" or "aps".
        scores: (n,) ascending calibration scores of the true labels.
        score_labels: (n,) the true label of each score (class-conditional sets use them).
        class_conditional: one threshold per class, each from that class's calibration images.
        ood_kind: the OOD score, one of `calibration.OOD_SCORES`.
        ood_threshold: scores above it are `unknown`.
        num_classes: K.
        gaussian: "means" (K, D) and "precision" (D, D) for the Mahalanobis score.
        drift: the calibration split's distributions (see the module docstring).
        metrics: ECE and NLL before and after scaling, as the export measured them.
    """

    temperature: float
    confidence_map: np.ndarray | None
    method: str
    scores: np.ndarray
    score_labels: np.ndarray
    class_conditional: bool
    ood_kind: str
    ood_threshold: float
    num_classes: int
    gaussian: dict[str, np.ndarray]
    drift: dict[str, Any]
    metrics: dict[str, Any]

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any], num_classes: int, features_dim: int | None = None) -> Trust | None:
        """The `calibration` entry of parsed metadata, or None for a file exported without one.

        Args:
            metadata: the file's parsed metadata.
            num_classes: K, the width of the graph's logits.
            features_dim: D, the width of the graph's features output when it is fixed (None: not checked).

        Raises:
            ModelFileError: the entry is there but malformed or inconsistent (the file was edited); the message
                names the field.
        """
        entry = metadata.get(METADATA_KEY)
        if entry is None:
            return None
        floats = lambda v: np.asarray(v, np.float64)  # noqa: E731
        ood = _read(entry, "ood", dict)
        cmap = _read(entry, "confidence_map", dict, None)
        knots = lambda c: floats([c["confidence"], c["accuracy"]])  # noqa: E731
        trust = cls(
            _read(entry, "temperature", _number),
            None if cmap is None else _read(entry, "confidence_map", knots),
            _read(entry, "conformal.method", str),
            _read(entry, "conformal.scores", floats),
            _read(entry, "conformal.labels", _whole_numbers),
            _read(entry, "conformal.class_conditional", _flag, False),
            _read(entry, "ood.score", str),
            _read(entry, "ood.threshold", _number),
            num_classes,
            {k: _read(entry, f"ood.{k}", floats) for k in ("means", "precision") if k in ood},
            _read(entry, "drift", dict, {}),
            _read(entry, "metrics", dict, {}),
        )
        problem = trust.problem(features_dim)
        if problem:
            raise ModelFileError(f"the file's calibration metadata is invalid: {problem}; {AGAIN}")
        return trust

    def problem(self, features_dim: int | None = None) -> str:
        """What is wrong with these values (the field and why), or "" when they can be served."""
        K, n = self.num_classes, len(self.scores)
        finite = lambda a: bool(np.isfinite(a).all())  # noqa: E731
        checks = [
            ("temperature", cal.MIN_TEMPERATURE <= self.temperature <= cal.MAX_TEMPERATURE, TEMPERATURE_RANGE),
            ("conformal.method", self.method in cal.CONFORMAL_METHODS, f"one of {cal.CONFORMAL_METHODS}"),
            ("conformal.scores", self.scores.ndim == 1 and n > 0 and finite(self.scores), "finite numbers"),
            ("conformal.scores", bool((np.diff(self.scores) >= 0).all()), "sorted, smallest first"),
            ("conformal.labels", self.score_labels.shape == (n,), f"one label per score ({n})"),
            ("conformal.labels", bool(((self.score_labels >= 0) & (self.score_labels < K)).all()), f"in [0, {K})"),
            ("ood.score", self.ood_kind in cal.OOD_SCORES, f"one of {cal.OOD_SCORES}"),
            ("ood.threshold", math.isfinite(self.ood_threshold), "a finite number"),
        ]
        if self.confidence_map is not None:
            c = self.confidence_map
            ok = c.ndim == 2 and c.shape[1] >= 1 and finite(c) and bool((np.diff(c[0]) > 0).all())
            ok = ok and bool(((c >= 0) & (c <= 1)).all())
            checks.append(("confidence_map", ok, "confidence and accuracy lists in [0, 1], confidence increasing"))
        if self.needs_features:
            means, precision = self.gaussian.get("means"), self.gaussian.get("precision")
            D = features_dim or (means.shape[-1] if means is not None and means.ndim == 2 else 0)
            ok = means is not None and means.shape == (K, D) and finite(means)
            checks.append(("ood.means", ok, f"finite numbers, (classes, features) = ({K}, {D or 'D'})"))
            ok = precision is not None and precision.shape == (D, D) and finite(precision)
            checks.append(("ood.precision", ok, f"finite numbers, ({D or 'D'}, {D or 'D'})"))
        checks += [(f"drift.{k}", _histogram_ok(self.drift, k, K), "matching edges and fractions") for k in DRIFT]
        for field, ok, expected in checks:
            if not ok:
                return f"{field} must be {expected}"
        return ""

    @property
    def needs_features(self) -> bool:
        return self.ood_kind == "mahalanobis"

    @property
    def images(self) -> int:
        return len(self.scores)

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """(B, K) logits -> (B, K) calibrated probabilities."""
        return cal.calibrated_softmax(logits, self.temperature, self.confidence_map)

    def thresholds(self, coverage: float) -> np.ndarray:
        """(K,) the score threshold of each class for `coverage` (all equal unless class-conditional).

        Raises:
            ValueError: coverage outside (0, 1) or finer than the calibration images (of the smallest class) allow.
        """
        if not self.class_conditional:
            return np.full(self.num_classes, cal.conformal_threshold(self.scores, coverage))
        out = np.empty(self.num_classes)
        for k in range(self.num_classes):
            own = self.scores[self.score_labels == k]
            if len(own) == 0:
                raise ValueError(f"class {k} has no calibration images: class-conditional sets cannot be built")
            out[k] = cal.conformal_threshold(own, coverage)
        return out

    def check_coverage(self, coverage: float) -> None:
        """Raise ValueError with a message for the caller unless sets can be built at `coverage`."""
        self.thresholds(coverage)

    def prediction_sets(self, probs: np.ndarray, coverage: float) -> list[list[int]]:
        """Per image, the classes of its prediction set, most probable first.

        With exchangeable images, the set holds the true class with probability at least `coverage` (and,
        for continuous scores, at most coverage + 1/(n+1)). A set can be empty: no class reaches the bar.
        """
        scores = cal.conformal_scores(probs, self.method)  # (B, K)
        inside = scores <= self.thresholds(coverage)[None, :]
        return [[j for j in row if ok[j]] for row, ok in zip(cal.ranked(probs), inside.tolist(), strict=True)]

    def ood_scores(self, logits: np.ndarray, probs: np.ndarray, features: np.ndarray | None) -> np.ndarray:
        """(B,) OOD scores, higher meaning less like the training images."""
        if self.needs_features and features is None:
            raise ValueError(f"the Mahalanobis OOD score needs the graph's {FEATURES_OUTPUT!r} output")
        return cal.ood_score(self.ood_kind, probs, logits, self.temperature, features=features, **self.gaussian)

    def unknown(self, ood_scores: np.ndarray) -> np.ndarray:
        """(B,) True where an image is unlike the training images (its score passes the threshold)."""
        return ood_scores > self.ood_threshold

    def summary(self) -> dict[str, Any]:
        """What a client should know: temperature, method, images, OOD score and threshold, metrics."""
        return {
            "calibrated": True,
            "temperature": self.temperature,
            "confidence_map": self.confidence_map is not None,
            "conformal_method": self.method,
            "class_conditional": self.class_conditional,
            "calibration_images": self.images,
            "max_coverage": round(self.images / (self.images + 1), 6),
            "ood_score": self.ood_kind,
            "ood_threshold": self.ood_threshold,
            "metrics": self.metrics,
        }


class Prediction(list):
    """One image's top-k [(label, probability), ...], highest first, and what the file knows of its reliability.

    Attributes:
        prediction_set: the labels of the conformal set at the asked coverage, most probable first; None when
            no coverage was asked (or the file carries no calibration).
        unknown: True when the image is unlike the training images (its OOD score passes the file's threshold);
            None for a file without calibration.
        ood_score: the OOD score, higher meaning less like the training images; None without calibration.
    """

    def __init__(self, top, prediction_set=None, unknown=None, ood_score=None):
        super().__init__(top)
        self.prediction_set: list[str] | None = prediction_set
        self.unknown: bool | None = unknown
        self.ood_score: float | None = ood_score


@dataclass
class Assessment:
    """A batch's answers: probs (B, K) (calibrated when the file is), logits (B, K), ood_scores and unknown (B,)
    or None (no calibration), sets (per image, class indices) or None (no coverage asked)."""

    probs: np.ndarray
    logits: np.ndarray
    ood_scores: np.ndarray | None
    unknown: np.ndarray | None
    sets: list[list[int]] | None


UNCALIBRATED = {
    "calibrated": False,
    "note": "this file carries no calibration: scores are raw softmax, no prediction sets and no unknown verdict; "
    "export it again with vit-export (from a run with a calibration split, or with --calibrate DIR)",
}
