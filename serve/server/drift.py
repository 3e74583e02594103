"""What the served answers say about the images coming in: Prometheus collectors per model, and drift.

    vitscope_confidence{model}           histogram of the calibrated top-1 probability
    vitscope_ood_score{model}            histogram of the OOD score (higher: less like the training images)
    vitscope_unknown_total{model}        answers whose image was unlike the training images
    vitscope_predicted_total{model, label}
    vitscope_drift_psi{model, signal}    population stability index of the last `window` answers against the
                                         calibration split's distribution (signal: confidence, ood_score, predicted)

A PSI over 0.25 is the usual sign of a shift (`DRIFT_ALERT`; docs/guide/trust.md has an alert rule). The gauge
reads 0 until `min_answers` answers are in the window: a PSI of a handful of answers is noise.
"""

from __future__ import annotations

import threading
from collections import deque
from contextlib import suppress

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from serve.runtime import calibration as cal
from serve.runtime.trust import Assessment, Trust

DRIFT_ALERT = 0.25  # PSI above this: the recent images no longer look like the calibration images
DRIFT_WINDOW = 200  # answers the drift gauge compares
DRIFT_MIN_ANSWERS = 50
CONFIDENCE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
SIGNALS = ("confidence", "ood_score", "predicted")


class DriftWindow:
    """The last `window` answers (confidence, predicted class, OOD score) and their PSI against the file's reference.

    Thread-safe: the batchers record from their threads while Prometheus reads on the event loop.
    """

    def __init__(self, trust: Trust, window: int = DRIFT_WINDOW, min_answers: int = DRIFT_MIN_ANSWERS):
        self.ref = trust.drift
        self.num_classes = trust.num_classes
        self.min_answers = min_answers
        self._rows: deque[tuple[float, int, float]] = deque(maxlen=window)
        self._lock = threading.Lock()

    def add(self, confidence: np.ndarray, predicted: np.ndarray, ood: np.ndarray) -> None:
        with self._lock:
            self._rows.extend(zip(confidence.tolist(), predicted.tolist(), ood.tolist(), strict=True))

    def psi(self, signal: str) -> float:
        """The PSI of one signal over the window (0 until it holds `min_answers`)."""
        with self._lock:
            rows = np.array(self._rows, np.float64).reshape(-1, 3)
        if len(rows) < self.min_answers:
            return 0.0
        if signal == "predicted":
            counts = np.bincount(rows[:, 1].astype(int), minlength=self.num_classes)
            return cal.psi(self.ref["predicted"]["fractions"], counts)
        column = 0 if signal == "confidence" else 2
        ref = self.ref[signal]
        return cal.psi(ref["fractions"], cal.histogram(rows[:, column], np.asarray(ref["edges"])))


class TrustMetrics:
    """The per-model collectors above, in the app's registry."""

    def __init__(self, registry: CollectorRegistry):
        self.confidence = Histogram(
            "vitscope_confidence",
            "Calibrated probability of the top class, per answer",
            ["model"],
            buckets=CONFIDENCE_BUCKETS,
            registry=registry,
        )
        self.ood = Histogram(
            "vitscope_ood_score",
            "OOD score per answer (higher: less like the training images)",
            ["model"],
            buckets=(-20, -10, -5, -2, 0, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 10000),  # energy or Mahalanobis
            registry=registry,
        )
        self.unknown = Counter(
            "vitscope_unknown", "Answers whose image was unlike the training images", ["model"], registry=registry
        )
        self.predicted = Counter(
            "vitscope_predicted", "Answers by predicted class", ["model", "label"], registry=registry
        )
        self.drift = Gauge(
            "vitscope_drift_psi",
            f"PSI of the last answers against the calibration split (alert above {DRIFT_ALERT})",
            ["model", "signal"],
            registry=registry,
        )
        self.windows: dict[str, DriftWindow] = {}
        self._cache: dict[tuple, tuple] = {}

    def watch(self, model: str, trust: Trust | None, window: int = DRIFT_WINDOW) -> None:
        """Start the drift gauges of one model (for a file without calibration: none, and its last file's go)."""
        if trust is None or not trust.drift:
            self.windows.pop(model, None)
            for signal in SIGNALS:
                with suppress(KeyError):  # prometheus-client before 0.21 raises for a series never made
                    self.drift.remove(model, signal)
            return
        w = self.windows[model] = DriftWindow(trust, window)
        for signal in SIGNALS:
            self.drift.labels(model, signal).set_function(lambda s=signal: w.psi(s))

    def forget(self, model: str) -> None:
        """Drop one model's series and its drift window (it serves no version now)."""
        self.windows.pop(model, None)
        series = [(self.drift, (model, signal)) for signal in SIGNALS]
        series += [(c, (model,)) for c in (self.confidence, self.ood, self.unknown)]
        # the labels each version of it counted under; a copy of the keys: batcher threads add theirs meanwhile
        for key in [k for k in list(self._cache) if k[0] == model]:
            del self._cache[key]
            series += [(self.predicted, (model, label)) for label in key[1]]
        for collector, labels in series:
            with suppress(KeyError):  # prometheus-client before 0.21 raises for a series never made
                collector.remove(*labels)

    def record(self, model: str, labels: list[str], answers: Assessment) -> None:
        """Count a batch of answers (on the batcher's thread, once per batch)."""
        top = answers.probs.max(axis=-1)
        predicted = answers.probs.argmax(axis=-1)
        confidence, ood, unknown, by_class = self._children(model, labels)
        for p, k in zip(top.tolist(), predicted.tolist(), strict=True):
            confidence.observe(p)
            by_class[k].inc()
        if answers.ood_scores is None:
            return
        for s in answers.ood_scores.tolist():
            ood.observe(s)
        if (n := int(answers.unknown.sum())) > 0:
            unknown.inc(n)
        if model in self.windows:
            self.windows[model].add(top, predicted, answers.ood_scores)

    def _children(self, model: str, labels: list[str]) -> tuple:
        """One model's collectors, looked up once (`labels()` takes a lock and builds a key each time)."""
        key = (model, tuple(labels))
        if key not in self._cache:
            by_class = [self.predicted.labels(model, label) for label in labels]
            self._cache[key] = (
                self.confidence.labels(model),
                self.ood.labels(model),
                self.unknown.labels(model),
                by_class,
            )
        return self._cache[key]
