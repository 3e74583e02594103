"""Calibrate the exported graph on held-back labelled images: the file's `calibration` metadata entry.

The images are the run's calibration split (`split.json` "calib", held back by `vit-train
--data.calib_fraction`), or a labelled folder given as `vit-export --calibrate DIR` (DIR/<class>/<image>).
Their logits come from the built graph through onnxruntime, so an int8 file is calibrated as it answers.
On them the export fits, with the formulas of `serve.runtime.calibration`:

- the temperature (1-D search on NLL) and, on at least `calibration.MAP_MIN_IMAGES` images, the confidence
  map (isotonic; `serve.runtime.calibration.calibrated_softmax`), with ECE (15 bins) and NLL before and
  after, and a reliability diagram;
- split-conformal scores of the true labels (LAC or APS), sorted, so the runtime builds a set at any coverage;
- the OOD score's threshold at which `accept` of these in-distribution images are accepted; for the
  Mahalanobis score (the default), the class means and shared precision of the graph's `features` output,
  the threshold taken on cross-fitted distances (each fold scored by a Gaussian fitted without it, as a
  new image is scored by one fitted without it);
- the distributions of top-1 confidence, predicted class and OOD score, the reference for drift.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from serve.export.preflight import MIN_IMAGES, calibration_entries
from serve.runtime import calibration as cal
from serve.runtime.image_files import path_argument
from serve.runtime.images import ImageError, Preprocess, load_image
from serve.runtime.session import session_options
from serve.runtime.trust import FEATURES_OUTPUT, METADATA_KEY, Trust

log = logging.getLogger(__name__)

# Shapes: n calibration images, H/W image, K classes.

DEFAULT_METHOD = "lac"  # benchmarks/trust.py: the smallest sets at the asked coverage (docs/benchmarks/trust.md)
# benchmarks/trust.py: AUROC 0.96-0.97 against far OOD images and 0.95 against held-out classes, where energy
# gives 0.90-0.99 and 0.74 and max-softmax 0.71-0.93 (docs/benchmarks/trust.md)
DEFAULT_OOD_SCORE = "mahalanobis"
FOLDS = 5  # cross-fitting of the Mahalanobis threshold
ACCEPT = 0.95  # share of in-distribution calibration images the OOD threshold accepts
CONFIDENCE_EDGES = np.linspace(0.0, 1.0, 11)  # 10 equal bins of top-1 confidence, for drift
COVERAGE_CHECK = 0.9  # the coverage whose per-class figure the report shows
OOD_BINS = 10  # OOD-score bins for drift: the calibration deciles, so each holds a tenth of its images


def load_pixels(entries: list, preprocess: Preprocess) -> tuple[np.ndarray, np.ndarray]:
    """(pixels (n, H, W, 3) uint8, labels (n,)); unreadable files are skipped with a warning."""
    pixels, labels = [], []
    for p, y in entries:
        try:
            pixels.append(preprocess.to_uint8(load_image(p)))
            labels.append(y)
        except (ImageError, OSError) as e:
            log.warning("calibration: skipping %s (%s)", p, e)
    if len(pixels) < MIN_IMAGES:
        raise ValueError(f"{len(pixels)} readable calibration images: at least {MIN_IMAGES} are needed")
    return np.stack(pixels), np.asarray(labels, np.int64)


def graph_outputs(model_bytes: bytes, pixels: np.ndarray, batch_size: int = 256) -> tuple[np.ndarray, Any]:
    """The built graph's logits (n, K) and features (n, D) (None without that output), through onnxruntime
    (its fast path, as served)."""
    session = ort.InferenceSession(model_bytes, session_options(1), providers=["CPUExecutionProvider"])
    names = [n for n in ("logits", FEATURES_OUTPUT) if n in {o.name for o in session.get_outputs()}]
    starts = range(0, len(pixels), batch_size)
    out = [session.run(names, {"pixels": pixels[i : i + batch_size]}) for i in starts]
    logits = np.concatenate([o[0] for o in out])
    return logits, (np.concatenate([o[1] for o in out]) if len(names) == 2 else None)


def crossfit_mahalanobis(features: np.ndarray, labels: np.ndarray, num_classes: int, folds: int = FOLDS) -> np.ndarray:
    """(n,) each image's Mahalanobis score under a Gaussian fitted on the other folds (seeded folds)."""
    fold = np.random.default_rng(0).permutation(len(labels)) % folds
    out = np.empty(len(labels))
    for f in range(folds):
        held = fold == f
        means, precision = cal.fit_gaussian(features[~held], labels[~held], num_classes)
        out[held] = cal.mahalanobis(features[held], means, precision)
    return out


def fit(
    logits: np.ndarray,
    labels: np.ndarray,
    features: np.ndarray | None = None,
    *,
    method: str = DEFAULT_METHOD,
    class_conditional: bool = False,
    ood_kind: str = DEFAULT_OOD_SCORE,
    accept: float = ACCEPT,
    source: str = "",
) -> dict[str, Any]:
    """The `calibration` metadata entry (see `serve.runtime.trust`) fitted on (n, K) logits, (n,) labels and,
    for the Mahalanobis score, (n, D) features."""
    if ood_kind == "mahalanobis" and features is None:
        raise ValueError(
            f"the Mahalanobis OOD score needs the graph's {FEATURES_OUTPUT!r} output, which this graph lacks; "
            "choose --ood-score energy"
        )
    if not np.isfinite(logits).all():
        raise ValueError("the model gives non-finite logits on calibration images: nothing can be calibrated")
    K = logits.shape[1]
    T = cal.fit_temperature(logits, labels)
    raw, probs = cal.softmax(logits), cal.softmax(logits, T)
    entry: dict[str, Any] = {"temperature": round(T, 6), "images": len(labels), "source": source}
    if len(labels) >= cal.MAP_MIN_IMAGES:
        knots = cal.fit_confidence_map(probs.max(-1), probs.argmax(-1) == labels, K)
    if len(labels) >= cal.MAP_MIN_IMAGES and knots.shape[1] >= 2:  # one knot would give every image one score
        probs = cal.calibrated_softmax(logits, T, knots)
        entry["confidence_map"] = {"confidence": knots[0].tolist(), "accuracy": knots[1].tolist()}
    entry["metrics"] = {
        "accuracy": round(float((probs.argmax(-1) == labels).mean()), 6),
        "ece_before": round(cal.ece(raw, labels), 6),
        "ece_after": round(cal.ece(probs, labels), 6),
        "nll_before": round(cal.nll(raw, labels), 6),
        "nll_after": round(cal.nll(probs, labels), 6),
        "ece_temperature_only": round(cal.ece(cal.softmax(logits, T), labels), 6),
    }
    true = cal.conformal_scores(probs, method)[np.arange(len(labels)), labels]
    order = np.argsort(true, kind="stable")
    entry["conformal"] = {
        "method": method,
        "class_conditional": class_conditional,
        "scores": [float(f"{v:.7g}") for v in true[order].tolist()],  # 7 digits: 1e-12 stays 1e-12
        "labels": labels[order].tolist(),
    }
    entry["metrics"]["per_class_coverage"] = per_class_coverage(true, labels, K)
    if ood_kind == "mahalanobis" and (spread := len(labels) - len(np.unique(labels))) < len(labels) / 2:
        log.warning(
            "the Mahalanobis unknown-input score needs 2 or more calibration images per class on average, to "
            "measure how a class's images vary: these %d images of %d classes give %d beyond one per class, so the "
            "score is energy instead (give more calibration images for Mahalanobis)",
            len(labels), len(np.unique(labels)), spread,
        )  # fmt: skip
        ood_kind = "energy"  # one image per class has no spread: a precision of 1e24 and scores of 1e22
    entry["ood"], ood = _ood_entry(ood_kind, logits, probs, T, features, labels, accept)
    entry["drift"] = _drift_reference(probs, ood)
    return entry


def per_class_coverage(true: np.ndarray, labels: np.ndarray, K: int, coverage: float = COVERAGE_CHECK) -> dict | None:
    """How often each class's true label is in its prediction set at `coverage`, on images the thresholds never saw.

    The calibration images are split in two halves, stratified by class: the thresholds fitted on one half are
    checked on the other, and the other way round. `marginal` is the one threshold of the default sets;
    `class_conditional` gives each class its own (`--class-conditional`), None for a class with too few images in
    a half to fit one. None when the images are too few for a half to fit the threshold at all.

    Args:
        true: (n,) the conformal score of each image's true label.
        labels: (n,) the true labels.
    """
    fold = np.zeros(len(labels), dtype=np.int64)
    rng = np.random.default_rng(0)
    for k in range(K):
        own = np.flatnonzero(labels == k)
        fold[rng.permutation(own)] = np.arange(len(own)) % 2
    half = min(int((fold == f).sum()) for f in (0, 1))
    if half / (half + 1) < coverage:
        return None
    images, marginal, conditional = np.bincount(labels, minlength=K), np.zeros(K), np.zeros(K)
    fits = np.ones(K, dtype=bool)
    for f in (0, 1):
        ref, held = fold != f, fold == f
        covered = true <= cal.conformal_threshold(np.sort(true[ref]), coverage)
        marginal += np.bincount(labels[held & covered], minlength=K)
        for k in range(K):
            own = np.sort(true[ref & (labels == k)])
            if len(own) / (len(own) + 1) < coverage:
                fits[k] = False
                continue
            conditional[k] += (true[held & (labels == k)] <= cal.conformal_threshold(own, coverage)).sum()
    share = lambda hits, k: round(float(hits[k] / images[k]), 4) if images[k] else None
    return {
        "coverage": coverage,
        "images": images.tolist(),
        "marginal": [share(marginal, k) for k in range(K)],
        "class_conditional": [share(conditional, k) if fits[k] else None for k in range(K)],
    }


def _ood_entry(kind, logits, probs, T, features, labels, accept) -> tuple[dict[str, Any], np.ndarray]:
    """The `ood` entry (score, threshold, and the Gaussian for Mahalanobis) and the (n,) scores it rests on."""
    entry: dict[str, Any] = {"score": kind}
    if kind == "mahalanobis":
        K = logits.shape[1]
        means, precision = cal.fit_gaussian(features, labels, K)
        entry.update(means=means.astype(np.float32).tolist(), precision=precision.astype(np.float32).tolist())
        ood = crossfit_mahalanobis(features, labels, K)
    else:
        ood = cal.ood_score(kind, probs, logits, T)
    entry.update(threshold=float(np.quantile(ood, accept)), accept=accept)
    return entry, ood


def _drift_reference(probs: np.ndarray, ood: np.ndarray) -> dict[str, Any]:
    """The calibration split's distributions of top-1 confidence, predicted class and OOD score."""
    n, K = probs.shape
    frac = lambda counts: (counts / n).round(6).tolist()
    ood_edges = np.quantile(ood, np.linspace(0, 1, OOD_BINS + 1))
    return {
        "confidence": {
            "edges": CONFIDENCE_EDGES.tolist(),
            "fractions": frac(cal.histogram(probs.max(-1), CONFIDENCE_EDGES)),
        },
        "predicted": {"fractions": frac(np.bincount(probs.argmax(-1), minlength=K))},
        "ood_score": {"edges": ood_edges.tolist(), "fractions": frac(cal.histogram(ood, ood_edges))},
    }


def write_reliability_png(logits: np.ndarray, labels: np.ndarray, entry: dict[str, Any], path: Path) -> None:
    """Reliability diagram, before and after calibration (`entry`): accuracy against confidence per bin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 4.4), sharey=True)
    edges = np.linspace(0, 1, cal.ECE_BINS + 1)
    trust = Trust.from_metadata({METADATA_KEY: entry}, logits.shape[1])
    after = f"after (T = {trust.temperature:.3f}" + (", confidence map)" if trust.confidence_map is not None else ")")
    for ax, (name, probs) in zip(
        axes, (("before", cal.softmax(logits)), (after, trust.probabilities(logits))), strict=True
    ):
        conf, acc, count = cal.reliability(probs, labels)
        full = count > 0
        ax.bar(edges[:-1][full], acc[full], width=1 / cal.ECE_BINS, align="edge", edgecolor="black", label="accuracy")
        ax.plot([0, 1], [0, 1], "--", color="grey", label="perfect calibration")
        ax.scatter(conf[full], acc[full], color="red", s=12, zorder=3, label="mean confidence")
        ax.set_title(f"{name}: ECE {cal.ece(probs, labels):.2%}, NLL {cal.nll(probs, labels):.3f}")
        ax.set(xlabel="top-1 confidence", xlim=(0, 1), ylim=(0, 1))
    axes[0].set_ylabel("accuracy")
    axes[0].legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def calibrate(
    model_bytes: bytes,
    checkpoint: Path,
    class_names: list[str],
    preprocess: Preprocess,
    calib_dir: Path | None,
    **options,
) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
    """The `calibration` entry for a built graph: images found, logits run, everything fitted.

    Args:
        model_bytes: the serialised graph (metadata not yet set).
        checkpoint: the checkpoint, whose run's split.json holds the calibration split.
        class_names: the model's classes.
        preprocess: the serving preprocessing.
        calib_dir: a labelled folder to calibrate on instead of the split.
        options: `fit`'s keyword arguments.

    Returns:
        (entry, logits (n, K), labels (n,)): the logits and labels it was fitted on, for the reliability diagram.
    """
    entries, source = calibration_entries(checkpoint, class_names, calib_dir, warn=False)  # said at the preflight
    pixels, labels = load_pixels(entries, preprocess)
    logits, features = graph_outputs(model_bytes, pixels)
    if features is None and options.get("ood_kind", DEFAULT_OOD_SCORE) == "mahalanobis":
        options["ood_kind"] = "energy"  # a graph without features (built elsewhere): the best score the logits give
    return fit(logits, labels, features, source=source, **options), logits, labels


def for_export(
    model, checkpoint: Path, output: Path, class_names, preprocess, wanted, calib_dir, **options
) -> tuple[dict[str, Any] | None, Callable[[], Path | None]]:
    """`vit-export`'s calibration: the entry (None: an uncalibrated file), and what writes the reports once the model
    is in place (a stopped export leaves the old ones): the run's reports/ calibration.json and reliability.png; it
    returns the diagram's path (None, with a warning, when they cannot be written, or for an uncalibrated file).

    Args:
        wanted: False writes an uncalibrated file; True requires calibration images; None calibrates when it
            finds them and warns when not.
    """
    if wanted is False:
        return None, lambda: None
    run_dir = checkpoint.resolve().parent.parent
    reports = run_dir / "reports" if (run_dir / "split.json").is_file() else None
    png = (reports / "reliability.png") if reports is not None else output.with_suffix(".reliability.png")
    try:
        entry, logits, labels = calibrate(
            model.SerializeToString(), checkpoint, class_names, preprocess, calib_dir, **options
        )
    except ValueError as e:
        if wanted or calib_dir is not None:
            raise
        log.warning("writing an UNCALIBRATED file (raw softmax, no prediction sets, no unknown verdict): %s", e)
        return None, lambda: None

    def write_reports() -> Path | None:
        try:  # side reports: the model is the product, and a run folder may be read-only or full
            write_reliability_png(logits, labels, entry, png)
            if reports is not None:
                summary = {k: v for k, v in entry.items() if k not in ("conformal", "drift")}
                summary["ood"] = {k: v for k, v in entry["ood"].items() if k not in ("means", "precision")}
                (reports / "calibration.json").write_text(json.dumps(summary, indent=1))
        except OSError as e:
            why = f"{e.strerror or e}: {e.filename or png}"
            log.warning("could not write the calibration reports to %s (%s); the model is written all the same, "
                        "with its calibration", png.parent, why)  # fmt: skip
            return None
        return png

    return entry, write_reports


def _coverage_lines(entry: dict[str, Any], names: list[str]) -> list[str]:
    """The per-class coverage check as report lines: the least covered class of each kind of sets, and advice."""
    per = entry["metrics"].get("per_class_coverage")
    if per is None:
        return ["  per-class coverage                    too few images to check on held-out halves"]
    lines, target = [], per["coverage"]
    kinds = (("marginal", f"coverage at {target:.2f}, worst class"), ("class_conditional", "  a threshold per class"))
    for kind, label in kinds:
        known = [(v, k) for k, v in enumerate(per[kind]) if v is not None]
        if not known:
            continue
        v, k = min(known)
        skipped = len(per[kind]) - len(known)
        lines.append(
            f"  {label:<38}{v:.1%} ({names[k]}, {per['images'][k]} images; held-out halves)"
            + (f"; {skipped} classes too small to fit" if skipped else "")
        )
    lowest = min(v for v in per["marginal"] if v is not None)
    if not entry["conformal"]["class_conditional"] and lowest < target - 0.05:
        lines.append("  a class is under-covered: --class-conditional gives each class its own threshold")
    return lines


def format_report(entry: dict[str, Any] | None, names: list[str] | None = None) -> str:
    """The calibration's figures as a few lines for the terminal (`names`: the class names, for per-class lines)."""
    if entry is None:
        return "calibration: none: raw softmax scores, no prediction sets, no unknown verdict"
    m = entry["metrics"]
    return "\n".join(
        [
            f"calibration on {entry['images']} images from {entry['source']}:",
            f"  temperature                           {entry['temperature']:.4f}"
            + (" and a confidence map" if "confidence_map" in entry else ""),
            f"  ECE (15 bins, these images) before / after {m['ece_before']:.2%} / {m['ece_after']:.2%}",
            f"  NLL before / after                    {m['nll_before']:.4f} / {m['nll_after']:.4f}",
            f"  prediction sets                       {entry['conformal']['method']}, any coverage up to "
            f"{entry['images'] / (entry['images'] + 1):.4f}",
            f"  unknown inputs                        {entry['ood']['score']} > {entry['ood']['threshold']:.4f} "
            f"({entry['ood']['accept']:.0%} of calibration images accepted)",
            *(_coverage_lines(entry, names) if names else []),
        ]
    )


def add_args(p: argparse.ArgumentParser) -> None:
    """`vit-export`'s calibration options (`check_args` refuses those --no-calibration would leave unused)."""
    p.add_argument(
        "--calibrate",
        type=path_argument,
        metavar="DIR",
        help="calibrate on this labelled folder (DIR/<class>/<image>) instead of the run's calibration split",
    )
    p.add_argument(
        "--no-calibration", action="store_true", help="write an uncalibrated file: raw softmax, no sets, no unknown"
    )
    p.add_argument("--conformal", choices=["lac", "aps"], help=f"the prediction-set score (default {DEFAULT_METHOD})")
    p.add_argument(
        "--class-conditional", action="store_true", help="one prediction-set threshold per class (imbalanced folders)"
    )
    p.add_argument(
        "--ood-score",
        choices=["mahalanobis", "energy", "max_softmax"],
        help="unknown-input score: the pre-logit features' distance to the nearest class (default), or from the logits",
    )


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse calibration options with --no-calibration: the file would be written uncalibrated, without a word of
    them (an exit 0 that looked as if `--conformal aps` had been applied)."""
    given = {"--calibrate": args.calibrate, "--conformal": args.conformal, "--ood-score": args.ood_score}
    unused = [name for name, value in given.items() if value is not None]
    unused += ["--class-conditional"] if args.class_conditional else []
    if args.no_calibration and unused:
        parser.error(
            f"--no-calibration writes an uncalibrated file: {', '.join(unused)} would change nothing; drop them, or "
            "drop --no-calibration"
        )


__all__ = ["METADATA_KEY", "add_args", "calibrate", "check_args", "fit", "for_export", "format_report"]
