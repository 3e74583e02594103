"""Validation reports written into the run directory: confusion matrix (CSV, PNG) and per-class precision, recall
and F1."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np


def write_confusion_csv(confmat: np.ndarray, classes: list[str], out_dir: Path) -> None:
    """Write `confusion_matrix.csv` (rows: true class, columns: predicted).

    Args:
        confmat: (K, K) counts, rows true, columns predicted.
        classes: the K class names.
        out_dir: the folder to write into (created).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "confusion_matrix.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["true \\ predicted", *classes])
        for name, row in zip(classes, confmat, strict=False):
            w.writerow([name, *map(int, row)])


def per_class_scores(confmat: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Precision, recall and F1 of each class, each (K,), from (K, K) counts (rows true, columns predicted).

    A class never predicted has precision 0, one without images recall 0, as torchmetrics counts them.
    """
    correct = np.diag(confmat).astype(float)  # (K,)
    predicted, support = confmat.sum(axis=0), confmat.sum(axis=1)  # (K,), (K,)
    precision = np.divide(correct, predicted, out=np.zeros_like(correct), where=predicted > 0)
    recall = np.divide(correct, support, out=np.zeros_like(correct), where=support > 0)
    both = precision + recall
    f1 = np.divide(2 * precision * recall, both, out=np.zeros_like(correct), where=both > 0)
    return precision, recall, f1


def write_per_class_csv(confmat: np.ndarray, classes: list[str], out_dir: Path) -> None:
    """Write `per_class.csv`: `class,precision,recall,f1,images` (images: the class's validation images).

    Recall is the class's accuracy; its mean over the classes is the balanced accuracy.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    precision, recall, f1 = per_class_scores(confmat)
    with open(out_dir / "per_class.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["class", "precision", "recall", "f1", "images"])
        for row in zip(classes, precision, recall, f1, confmat.sum(axis=1), strict=False):
            w.writerow([row[0], *(f"{v:.4f}" for v in row[1:4]), int(row[4])])


def write_confusion_png(confmat: np.ndarray, classes: list[str], path: Path, title: str = "") -> None:
    """Draw the confusion matrix, normalised per true class, with counts in the cells."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    K = len(classes)
    rates = confmat / np.maximum(confmat.sum(axis=1, keepdims=True), 1)
    side = min(4 + 0.45 * K, 40)
    fig, ax = plt.subplots(figsize=(side, side))
    ax.imshow(rates, cmap="Blues", vmin=0, vmax=1)
    ax.set_xticks(range(K), classes, rotation=90 if K > 10 else 0)
    ax.set_yticks(range(K), classes)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(title)
    if K <= 30:
        for i in range(K):
            for j in range(K):
                if confmat[i, j]:
                    color = "white" if rates[i, j] > 0.5 else "black"
                    ax.text(j, i, int(confmat[i, j]), ha="center", va="center", color=color, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
