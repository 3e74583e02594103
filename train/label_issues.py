"""Images whose given label looks wrong: `reports/label_issues.csv`, written at the end of `vit-train fit`.

The evaluated network (the EMA copy when there is one) scores every image of the run's split (train, val and
calib) unaugmented, through the serving transform; a temperature fitted on the calibration split (when it has
images) calibrates the probabilities. Then confident learning (Northcutt et al. 2021), written here in numpy:

- each class k gets a threshold t_k, the mean probability of k over the images labelled k (its self-confidence);
- an image's confident class is its most probable class among those whose probability reaches their threshold;
- an image is flagged when it has a confident class and that class is not its given label.

Per-class thresholds adapt to how hard each class is: a Shirt the model calls a Shirt at 0.6 is no issue when
Shirts average 0.6, while a flat threshold flags it or misses a wrong label elsewhere. Flagged images are ranked
by the normalised margin: `score = (1 + max_{k != given} p_k - p_given) / 2`, in [0, 1], higher meaning more
likely wrong (0.5: another class ties with the given one). How it compares with a plain threshold on the
calibrated probabilities is in BENCHMARKS.md ("Wrong labels").

Shapes: N images, K classes.
"""

from __future__ import annotations

import csv
import logging
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader

from serve.runtime.calibration import fit_temperature, softmax
from train.dataset import ImageListDataset
from train.transforms import EvalTransform

log = logging.getLogger(__name__)

FILE = "label_issues.csv"  # in the run directory's reports/
COLUMNS = ("path", "given", "suggested", "score")


@dataclass
class LabelIssues:
    """The flagged images of one scoring, most likely wrong first.

    Attributes:
        index: (M,) indices into the scored images.
        suggested: (M,) the confident class of each.
        score: (M,) normalised margin in [0, 1], higher meaning more likely wrong; sorted descending.
    """

    index: np.ndarray
    suggested: np.ndarray
    score: np.ndarray


def class_thresholds(probs: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """(N, K) probabilities, (N,) given labels -> (K,) mean probability of each class over its own images.

    A class with no images gets a threshold of 1.0 plus a hair: no image is ever confidently put in it, as
    nothing says what its images look like to the model.
    """
    N, K = probs.shape
    sums = np.bincount(labels, weights=probs[np.arange(N), labels], minlength=K)  # (K,)
    counts = np.bincount(labels, minlength=K)  # (K,)
    return np.divide(sums, counts, out=np.full(K, 1.0 + 1e-6), where=counts > 0)


def normalised_margin_score(probs: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """(N,) `(1 + max_{k != given} p_k - p_given) / 2`: 0 sure of the given label, 1 sure of another."""
    N = len(labels)
    given = probs[np.arange(N), labels]  # (N,)
    others = probs.copy()
    others[np.arange(N), labels] = -np.inf
    return (1.0 + others.max(axis=1) - given) / 2.0


def find_label_issues(probs: np.ndarray, labels: np.ndarray) -> LabelIssues:
    """Confident learning's flagged images (the off-diagonal of the confident joint), most likely wrong first.

    Args:
        probs: (N, K) calibrated probabilities of unaugmented images.
        labels: (N,) given labels.

    Returns:
        The flagged images, their confident classes and scores, sorted by score (highest first).
    """
    probs = np.asarray(probs, dtype=np.float64)
    labels = np.asarray(labels, dtype=np.int64)
    if len(labels) == 0:
        return LabelIssues(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0))
    above = probs >= class_thresholds(probs, labels)[None, :]  # (N, K)
    confident = np.where(above, probs, -np.inf).argmax(axis=1)  # (N,) the most probable class above threshold
    flagged = np.flatnonzero(above.any(axis=1) & (confident != labels))  # (M,)
    score = normalised_margin_score(probs[flagged], labels[flagged])
    order = np.argsort(-score, kind="stable")
    return LabelIssues(flagged[order], confident[flagged][order], score[order])


def baseline_issues(probs: np.ndarray, labels: np.ndarray, floor: float = 0.1) -> LabelIssues:
    """The plain rule to compare against: the given label under `floor` and another class the most probable."""
    probs = np.asarray(probs, dtype=np.float64)
    N = len(labels)
    top = probs.argmax(axis=1)  # (N,)
    flagged = np.flatnonzero((probs[np.arange(N), labels] < floor) & (top != labels))
    score = normalised_margin_score(probs[flagged], labels[flagged])
    order = np.argsort(-score, kind="stable")
    return LabelIssues(flagged[order], top[flagged][order], score[order])


@torch.no_grad()
def predict_logits(module: pl.LightningModule, dm, items: list[tuple[str, int]]) -> np.ndarray:
    """(N, K) float32 logits of the module's evaluated network on `items`, unaugmented (the eval transform)."""
    evaluate = EvalTransform(dm.preprocess)
    dataset = ImageListDataset(items, evaluate.resize, evaluate)
    loader = DataLoader(dataset, batch_size=dm.eval_batch_size, shuffle=False, num_workers=dm.workers)
    was_training = module.training
    module.eval()
    try:
        out = [module(x.to(module.device)).float().cpu() for x, _ in loader]  # each (B, K)
    finally:
        module.train(was_training)
    return torch.cat(out).numpy() if out else np.zeros((0, module.hparams.get("num_classes", 0)), np.float32)


def calibrated_probs(logits: np.ndarray, labels: np.ndarray, calib: np.ndarray) -> np.ndarray:
    """(N, K) softmax at the temperature fitted on the images where `calib` (N,) is true (1.0 without any)."""
    T = fit_temperature(logits[calib], labels[calib]) if calib.any() else 1.0
    return softmax(logits, T)


def write_label_issues(path: Path, items: list[tuple[str, int]], classes: list[str], issues: LabelIssues) -> None:
    """Write `path,given,suggested,score` rows (class names, score to 4 decimals), most likely wrong first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for i, k, s in zip(issues.index.tolist(), issues.suggested.tolist(), issues.score.tolist(), strict=True):
            p, y = items[i]
            w.writerow([p, classes[y], classes[k], f"{s:.4f}"])


class LabelIssuesReport(pl.Callback):
    """At the end of a fit (rank 0), score every image of the split and write `reports/label_issues.csv`."""

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        dm = getattr(trainer, "datamodule", None)
        scan = getattr(dm, "scan", None)
        if not trainer.is_global_zero or trainer.fast_dev_run or scan is None:
            return
        if scan.layout == "litdata":
            log.info("label issues: not looked for in a prepared (LitData) dataset; train on the image folder")
            return
        items = [*scan.train, *scan.val, *scan.calib]
        labels = np.array([y for _, y in items], dtype=np.int64)
        calib = np.arange(len(items)) >= len(scan.train) + len(scan.val)
        logits = predict_logits(pl_module, dm, items)
        issues = find_label_issues(calibrated_probs(logits, labels, calib), labels)
        path = Path(trainer.default_root_dir) / "reports" / FILE
        write_label_issues(path, items, list(scan.classes), issues)
        log.info("label issues: %d of %d images may be wrongly labelled: %s", len(issues.index), len(items), path)
