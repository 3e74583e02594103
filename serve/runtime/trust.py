"""What an exported file knows about its own reliability, applied to a batch: `Trust`.

`vit-export` stores it under the `calibration` metadata key (`serve.export.calibrate`):

    {"temperature": T, "images": n, "source": "...", "metrics": {"ece_before", "ece_after", "nll_before", ...},
     "confidence_map": {"confidence": [M], "accuracy": [M]},   # absent: temperature scaling alone
     "conformal": {"method": "lac" | "aps", "class_conditional": bool, "scores": [n ascending], "labels": [n]},
     "ood": {"score": "energy" | "max_softmax" | "mahalanobis", "threshold": t, "accept": 0.95,
             "means": [[K x D]], "precision": [[D x D]]},   # the last two for "mahalanobis" only
     "drift": {"confidence": {"edges", "fractions"}, "predicted": {"fractions"}, "ood_score": {"edges", "fractions"}}}

A file exported before calibration existed has no such key: `Trust.from_metadata` returns None, and
the classifier reports raw softmax, no sets, and `unknown` / `ood_score` as None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from serve.runtime import calibration as cal

# Shapes: B batch, K classes, D pre-logit feature width, n calibration images.

METADATA_KEY = "calibration"
FEATURES_OUTPUT = "features"  # the graph output Mahalanobis needs: the pooled, normalised pre-logits (B, D)


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
    def from_metadata(cls, metadata: dict[str, Any], num_classes: int) -> Trust | None:
        """The `calibration` entry of parsed metadata, or None for a file exported without one.

        Raises:
            ValueError: the entry is there but malformed (the file was edited).
        """
        entry = metadata.get(METADATA_KEY)
        if entry is None:
            return None
        try:
            conformal, ood = entry["conformal"], entry["ood"]
            gaussian = {k: np.asarray(ood[k], np.float64) for k in ("means", "precision") if k in ood}
            cmap = entry.get("confidence_map")
            knots = None if cmap is None else np.asarray([cmap["confidence"], cmap["accuracy"]], np.float64)
            trust = cls(
                float(entry["temperature"]),
                knots,
                str(conformal["method"]),
                np.asarray(conformal["scores"], np.float64),
                np.asarray(conformal["labels"], np.int64),
                bool(conformal.get("class_conditional", False)),
                str(ood["score"]),
                float(ood["threshold"]),
                num_classes,
                gaussian,
                dict(entry.get("drift", {})),
                dict(entry.get("metrics", {})),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"the file's calibration metadata is malformed ({type(e).__name__}: {e}); "
                "export it again with vit-export"
            ) from None
        if trust.method not in cal.CONFORMAL_METHODS or trust.ood_kind not in cal.OOD_SCORES:
            raise ValueError(f"unknown calibration method {trust.method!r} or OOD score {trust.ood_kind!r}")
        return trust

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
