"""Wrong labels: confident learning on known probabilities, and `reports/label_issues.csv` from a real fit."""

from __future__ import annotations

import csv
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.helpers import REPO
from train.cli import build_cli
from train.label_issues import baseline_issues, class_thresholds, find_label_issues


def _noisy_probs(seed: int = 0):
    """Three classes; class 2 is hard (0.5 on itself, 0.47 on class 1), and 8 labels are flipped.

    Returns (probs (N, 3), given labels (N,), true labels (N,), flipped indices).
    """
    rng = np.random.default_rng(seed)
    true = np.repeat([0, 1, 2], 40)  # (N,)
    probs = np.full((len(true), 3), 0.02)
    probs[true == 0, 0] = probs[true == 1, 1] = 0.96
    probs[true == 2, 2], probs[true == 2, 1] = 0.5, 0.47
    probs += rng.uniform(0, 0.002, probs.shape)
    given = true.copy()
    flipped = np.array([3, 7, 45, 50, 81, 90, 99, 110])
    given[flipped] = [1, 2, 0, 2, 0, 0, 0, 0]  # never 2 -> 1: the model cannot tell those apart
    return probs, given, true, flipped


def _colour_folder(root: Path, per_class: int) -> Path:
    """root/<red|green|blue>/NNN.png: noisy 16 x 16 images of one colour each (classes a tiny model learns at once)."""
    rng = np.random.default_rng(0)
    for k, name in enumerate(("red", "green", "blue")):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 90, (16, 16, 3))
            pixels[..., k] += 160
            Image.fromarray(pixels.astype(np.uint8), "RGB").save(root / name / f"{i:03d}.png")
    return root


def test_thresholds_are_each_class_mean_self_confidence_and_an_empty_class_is_never_confident():
    probs = np.array([[0.8, 0.2, 0.0], [0.6, 0.4, 0.0], [0.3, 0.7, 0.0]])
    t = class_thresholds(probs, np.array([0, 0, 1]))
    assert t[:2] == pytest.approx([0.7, 0.7]) and t[2] > 1.0


def test_every_flip_is_found_with_its_true_class_and_no_clean_image_is_flagged():
    probs, given, true, flipped = _noisy_probs()
    issues = find_label_issues(probs, given)
    assert sorted(issues.index.tolist()) == flipped.tolist()
    assert issues.suggested.tolist() == true[issues.index].tolist()
    assert np.all(np.diff(issues.score) <= 0) and np.all((issues.score > 0.9) & (issues.score <= 1.0))


def test_a_hard_class_must_be_contradicted_harder_than_an_easy_one():
    probs, given, _, _ = _noisy_probs()
    probs = np.vstack([probs, [0.03, 0.9, 0.07], [0.03, 0.9, 0.07]])  # labelled 0, then labelled 2
    given = np.append(given, [0, 2])
    flagged = set(find_label_issues(probs, given).index.tolist())
    assert len(probs) - 2 in flagged  # 0.03 is under 0.06 of class 0's usual 0.87
    assert len(probs) - 1 not in flagged  # but not of class 2's usual 0.5
    assert {len(probs) - 2, len(probs) - 1} <= set(baseline_issues(probs, given).index.tolist())


def test_most_confidently_wrong_comes_first():
    probs = np.array([[0.9, 0.1]] * 4 + [[0.03, 0.97], [0.01, 0.99], [0.1, 0.9], [0.1, 0.9]])
    issues = find_label_issues(probs, np.array([0, 0, 0, 0, 0, 0, 1, 1]))
    assert issues.index.tolist() == [5, 4] and issues.suggested.tolist() == [1, 1]


def test_no_images_no_issues():
    assert len(find_label_issues(np.zeros((0, 3)), np.zeros(0, np.int64)).index) == 0


@pytest.mark.slow
def test_fit_writes_label_issues_with_the_moved_images_first(tmp_path: Path):
    """A user's folder with 4 images in the wrong class folder: the run lists them, and them only. A file broken
    past its header (read by no scan with --data.dedupe none) was scored with the next image's pixels, and missing
    from bad_files.csv when no cache decoded it first."""
    root = _colour_folder(tmp_path / "colours", per_class=24)
    broken = root / "blue" / "zz_broken.png"
    broken.write_bytes((root / "red" / sorted(os.listdir(root / "red"))[0]).read_bytes()[:60])
    moved = []
    for n, (src, dst) in enumerate((("red", "green"), ("green", "blue"), ("blue", "red"), ("red", "blue"))):
        image = sorted((root / src).glob("*.png"))[n]
        target = root / dst / f"moved_from_{src}_{image.name}"
        shutil.move(image, target)
        moved.append(str(target))
    run = tmp_path / "run"
    args = ["fit", "--config", str(REPO / "configs" / "sample.yaml"), "--data.root", str(root)]
    args += ["--trainer.default_root_dir", str(run), "--trainer.max_epochs", "6", "--data.batch_size", "16"]
    args += ["--trainer.enable_progress_bar", "false", "--model.warmup_epochs", "1.0", "--model.ema_decay", "0.9"]
    build_cli([*args, "--data.dedupe", "none", "--data.cache_images", "false"])
    with open(run / "reports" / "label_issues.csv") as f:
        rows = list(csv.DictReader(f))
    assert str(broken) not in [r["path"] for r in rows]
    with open(run / "bad_files.csv") as f:
        assert [r["file"] for r in csv.DictReader(f)] == [str(broken)]
    assert rows and list(rows[0]) == ["path", "given", "suggested", "score"]
    paths = [r["path"] for r in rows]
    assert set(moved) <= set(paths[: len(moved) + 1]), paths  # at most one clean image among the first
    assert len(rows) <= len(moved) + 2
    first = next(r for r in rows if r["path"] == moved[0])
    assert (first["given"], first["suggested"]) == ("green", "red")
    assert [float(r["score"]) for r in rows] == sorted((float(r["score"]) for r in rows), reverse=True)
