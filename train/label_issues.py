"""Images whose given label looks wrong: `reports/label_issues.csv`, written at the end of `vit-train fit`.

The evaluated network (the EMA copy when there is one) scores every image of the run's split (train, val and
calib) unaugmented, through the serving transform; a temperature fitted on the calibration split (when it has
images) calibrates the probabilities. Then, with confident learning's per-class thresholds (Northcutt et al.
2021), written here in numpy:

- each class k gets a threshold t_k, the mean probability of k over the images labelled k (its self-confidence);
- an image is flagged when its given label's probability is under `RELATIVE_FLOOR` times that label's threshold
  and another class is the most probable; that class is the suggestion;
- `score = 1 - p_given / t_given`, in [0, 1], higher meaning more likely wrong; flagged images come highest first.

The floor is relative, so a class the model finds hard (low t_k) must be contradicted harder before its images
are flagged. Confident learning's own rule (flag when the most probable class above its threshold is not the
given one: `confident_joint_issues`) and ranking by the margin over the given label both found fewer of the
flipped labels, at a lower precision, than this rule: `benchmarks/label_noise.py` measures all three.
The floor is where precision and recall meet there, on the config's 30-epoch run.

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
from torch.utils.data import DataLoader, Dataset

from serve.runtime.calibration import fit_temperature, softmax
from serve.runtime.images import FILE_NAME_ERRORS, ImageError, Preprocess
from train.dataset import ImageListDataset, decode
from train.transforms import EvalTransform

log = logging.getLogger(__name__)

RELATIVE_FLOOR = 0.06  # of the given class's mean self-confidence: chosen on benchmarks/label_noise.py
FILE = "label_issues.csv"  # in the run directory's reports/
COLUMNS = ("path", "given", "suggested", "score")


@dataclass
class LabelIssues:
    """The flagged images of one scoring, most likely wrong first.

    Attributes:
        index: (M,) indices into the scored images.
        suggested: (M,) the class suggested for each.
        score: (M,) in [0, 1], higher meaning more likely wrong; sorted descending.
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


def _ranked(flagged: np.ndarray, suggested: np.ndarray, score: np.ndarray) -> LabelIssues:
    order = np.argsort(-score, kind="stable")
    return LabelIssues(flagged[order], suggested[order], score[order])


def find_label_issues(probs: np.ndarray, labels: np.ndarray, floor: float = RELATIVE_FLOOR) -> LabelIssues:
    """Images whose given label gets under `floor` times its class's mean self-confidence, another class winning.

    Args:
        probs: (N, K) calibrated probabilities of unaugmented images.
        labels: (N,) given labels.
        floor: the share of the given class's threshold under which a label is doubted.

    Returns:
        The flagged images, their most probable classes and scores, sorted by score (highest first).
    """
    probs = np.asarray(probs, dtype=np.float64)
    labels = np.asarray(labels, dtype=np.int64)
    if len(labels) == 0:
        return LabelIssues(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0))
    N = len(labels)
    relative = probs[np.arange(N), labels] / class_thresholds(probs, labels)[labels]  # (N,)
    top = probs.argmax(axis=1)  # (N,)
    flagged = np.flatnonzero((relative < floor) & (top != labels))  # (M,)
    return _ranked(flagged, top[flagged], 1.0 - relative[flagged])


def confident_joint_issues(probs: np.ndarray, labels: np.ndarray) -> LabelIssues:
    """Confident learning's rule, for comparison: the most probable class reaching its threshold is not the label."""
    probs = np.asarray(probs, dtype=np.float64)
    t = class_thresholds(probs, labels)  # (K,)
    above = probs >= t[None, :]  # (N, K)
    confident = np.where(above, probs, -np.inf).argmax(axis=1)  # (N,)
    flagged = np.flatnonzero(above.any(axis=1) & (confident != labels))
    return _ranked(flagged, confident[flagged], 1.0 - probs[flagged, labels[flagged]] / t[labels[flagged]])


def baseline_issues(probs: np.ndarray, labels: np.ndarray, floor: float = 0.1) -> LabelIssues:
    """The plain rule to compare against: the given label under `floor` and another class the most probable."""
    probs = np.asarray(probs, dtype=np.float64)
    given = probs[np.arange(len(labels)), labels]  # (N,)
    top = probs.argmax(axis=1)
    flagged = np.flatnonzero((given < floor) & (top != labels))
    return _ranked(flagged, top[flagged], 1.0 - given[flagged])


@torch.no_grad()
def predict_logits(
    net: torch.nn.Module, preprocess: Preprocess, items: list[tuple[str, int]], batch_size: int, workers: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """(N, K) float32 logits of `net` on `items`, unaugmented (the serving transform), in eval mode, and (N,) bool
    whether each image could be decoded (its logits are then the logits of zeros: leave them out).

    Args:
        net: images (B, 3, H, W) -> logits (B, K); a `ViTClassifier` runs its evaluated network.
        preprocess: the data module's evaluation preprocessing.
        items: (path, label) pairs.
        batch_size: images per forward pass.
        workers: DataLoader worker processes that decode.
    """
    evaluate = EvalTransform(preprocess)
    images = _EachItsOwn(ImageListDataset(items, evaluate.resize, evaluate), (3, *preprocess.img_size))
    loader = DataLoader(images, batch_size, num_workers=workers)
    weight = next(net.parameters())  # its device and dtype (--trainer.precision bf16-true or 64-true: not float32)
    was_training = net.training
    net.eval()
    try:
        batches = [(net(x.to(weight.device, weight.dtype)).float().cpu(), readable) for x, readable in loader]
    finally:
        net.train(was_training)
    return torch.cat([b for b, _ in batches]).numpy(), torch.cat([r for _, r in batches]).numpy()  # (N, K), (N,)


class _EachItsOwn(Dataset):
    """Each image's own evaluated pixels and whether it could be decoded (zeros where not): training's dataset
    gives the next image in place of one it cannot decode, which would score one image with another's pixels."""

    def __init__(self, images: ImageListDataset, shape: tuple[int, int, int]):
        self.images, self.shape = images, shape

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, bool]:
        try:
            return self.images.transform(self.images.load(i)), True
        except (ImageError, OSError):
            return torch.zeros(self.shape), False


def calibrated_probs(logits: np.ndarray, labels: np.ndarray, calib: np.ndarray) -> np.ndarray:
    """(N, K) softmax at the temperature fitted on the images where `calib` (N,) is true (1.0 without any)."""
    T = fit_temperature(logits[calib], labels[calib]) if calib.any() else 1.0
    return softmax(logits, T)


def write_label_issues(path: Path, items: list[tuple[str, int]], classes: list[str], issues: LabelIssues) -> None:
    """Write `path,given,suggested,score` rows (class names, score to 4 decimals), most likely wrong first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8", errors=FILE_NAME_ERRORS) as f:
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
        if not items:
            return
        labels = np.array([y for _, y in items], dtype=np.int64)
        calib = np.arange(len(items)) >= len(scan.train) + len(scan.val)
        logits, readable = predict_logits(pl_module, dm.preprocess, items, dm.eval_batch_size, dm.workers)
        if not readable.all():  # broken past their header: training skipped them too
            add_bad_files(
                Path(trainer.default_root_dir) / "bad_files.csv",
                [p for (p, _), ok in zip(items, readable, strict=True) if not ok],
            )
            keep = np.flatnonzero(readable)
            items, labels, calib, logits = [items[i] for i in keep], labels[keep], calib[keep], logits[keep]
        issues = find_label_issues(calibrated_probs(logits, labels, calib), labels)
        path = Path(trainer.default_root_dir) / "reports" / FILE
        write_label_issues(path, items, list(scan.classes), issues)
        log.info("label issues: %d of %d images may be wrongly labelled: %s", len(issues.index), len(items), path)


def add_bad_files(path: Path, failed: list[str]) -> None:
    """Add to the run's `bad_files.csv` the files of `failed` it does not list yet, each with why it cannot be
    decoded: with no cache and no copy search, nothing decoded them before training, which skipped them."""
    listed = set()
    if path.is_file():
        with open(path, newline="", encoding="utf-8", errors=FILE_NAME_ERRORS) as f:
            listed = {row[0] for row in csv.reader(f) if row}
    with open(path, "a", newline="", encoding="utf-8", errors=FILE_NAME_ERRORS) as f:
        if not listed:
            csv.writer(f).writerow(["file", "reason"])
        new = [p for p in failed if p not in listed]
        csv.writer(f).writerows([p, _decode_error(p)] for p in new)
    if new:
        log.warning("%d image(s) could not be decoded, and were not trained on: listed in %s", len(new), path)


def _decode_error(path: str) -> str:
    try:
        decode(path)
    except (ImageError, OSError) as e:
        return str(e)
    return "could not be decoded during the run (it decodes now: changed since?)"
