"""Imbalanced folders: the balancing losses' maths, the class-balanced sampler, the per-class report, and a real
fit whose best checkpoint is chosen by balanced accuracy and which early stopping ends."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from torch.nn import functional as F

from tests.helpers import REPO, write_shapes
from train.balance import METHOD, BalancedLoss, balanced_sampler, resolve_balance
from train.checkpoint_format import load_checkpoint, load_network
from train.cli import build_cli, main
from train.datamodule import ImageFolderDataModule
from train.reports import per_class_scores

COUNTS = [90, 10]


def test_logit_adjusted_loss_is_the_cross_entropy_of_logits_plus_log_prior():
    # equal logits: the prior alone decides, so the rare class's loss is -log(its share)
    loss = BalancedLoss(COUNTS, "logit_adjusted")
    assert float(loss(torch.zeros(1, 2), torch.tensor([1]))) == pytest.approx(-math.log(0.1), rel=1e-5)
    logits, y = torch.randn(8, 2, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1] * 4)
    prior = torch.tensor(COUNTS) / sum(COUNTS)
    torch.testing.assert_close(loss(logits, y), F.cross_entropy(logits + prior.log(), y))


def test_balanced_softmax_is_the_logit_adjusted_loss_at_tau_one():
    logits, y = torch.randn(16, 2, generator=torch.Generator().manual_seed(1)), torch.randint(0, 2, (16,))
    softmax, adjusted = BalancedLoss(COUNTS, "balanced_softmax"), BalancedLoss(COUNTS, "logit_adjusted")
    torch.testing.assert_close(softmax(logits, y), adjusted(logits, y))


def test_reweight_weighs_each_image_by_its_inverse_class_frequency():
    logits, y = torch.randn(8, 2, generator=torch.Generator().manual_seed(2)), torch.tensor([0, 1] * 4)
    weights = torch.tensor([100 / (2 * 90), 100 / (2 * 10)])  # N / (K n_k): 1 on average over the training set
    expected = (weights[y] * F.cross_entropy(logits, y, reduction="none")).mean()
    torch.testing.assert_close(BalancedLoss(COUNTS, "reweight")(logits, y), expected)


@pytest.mark.parametrize("method", ["reweight", "logit_adjusted", "balanced_softmax"])
def test_hard_labels_with_smoothing_equal_their_soft_targets(method: str):
    """Mixup and cutmix hand the loss smoothed soft targets; plain batches hand it labels and the smoothing."""
    logits, y = torch.randn(6, 3, generator=torch.Generator().manual_seed(3)), torch.tensor([0, 1, 2, 2, 1, 0])
    soft = F.one_hot(y, 3).float() * 0.9 + 0.1 / 3
    loss = BalancedLoss([50, 20, 5], method, label_smoothing=0.1)
    torch.testing.assert_close(loss(logits, y), loss(logits, soft))
    mixed = 0.7 * soft + 0.3 * soft.roll(1, 0)  # a mixup pair's target: the loss is linear in it
    torch.testing.assert_close(loss(logits, mixed), 0.7 * loss(logits, soft) + 0.3 * loss(logits, soft.roll(1, 0)))


def test_an_unknown_method_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="reweight, logit_adjusted, balanced_softmax"):
        BalancedLoss(COUNTS, "focal")


def test_the_sampler_draws_every_class_about_equally():
    labels = [0] * 90 + [1] * 10
    torch.manual_seed(0)
    drawn = [labels[i] for _ in range(20) for i in balanced_sampler(labels, 2)]
    assert len(drawn) == 2000 and 0.45 < sum(drawn) / len(drawn) < 0.55


def test_auto_acts_from_ratio_three_and_none_never():
    assert resolve_balance("auto", [30, 10]) == METHOD and resolve_balance("auto", [29, 10]) is None
    assert resolve_balance("none", [1000, 1]) is None


def test_per_class_scores_from_a_known_confusion_matrix():
    confmat = np.array([[8, 2], [1, 1]])  # rows true, columns predicted
    precision, recall, f1 = per_class_scores(confmat)
    np.testing.assert_allclose(precision, [8 / 9, 1 / 3])
    np.testing.assert_allclose(recall, [0.8, 0.5])
    np.testing.assert_allclose(f1, [2 * 8 / 9 * 0.8 / (8 / 9 + 0.8), 0.4])


BALANCE_FLAGS = ["--data.balance", "auto"] if hasattr(ImageFolderDataModule, "balance_method") else []


@pytest.fixture(scope="module")
def imbalanced_fit(tmp_path_factory):
    """A real fit on 3 classes of 40, 12 and 8 images, early stopping that cannot see an improvement."""
    tmp = tmp_path_factory.mktemp("imbalanced")
    root = write_shapes(tmp / "shapes", per_class=8)
    write_shapes(tmp / "more", per_class=32, classes=("bar",), seed=1)
    for i, f in enumerate(sorted((tmp / "more" / "bar").iterdir())):
        f.rename(root / "bar" / f"more{i}.png")
    write_shapes(tmp / "more", per_class=4, classes=("column",), seed=2)
    for i, f in enumerate(sorted((tmp / "more" / "column").iterdir())):
        f.rename(root / "column" / f"more{i}.png")
    run = tmp / "run"
    args = ["fit", "--config", str(REPO / "configs" / "sample.yaml"), "--data.root", str(root)]
    args += ["--trainer.default_root_dir", str(run), "--trainer.max_epochs", "8", "--data.batch_size", "8"]
    args += ["--trainer.enable_progress_bar", "false", "--model.warmup_epochs", "0.0", "--model.mixup_alpha", "0.2"]
    args += ["--early_stopping.patience", "2", "--early_stopping.min_delta", "1.0", *BALANCE_FLAGS]
    return build_cli(args), run


def _epochs(run: Path) -> list[dict[str, str]]:
    with open(next((run / "csv").glob("version_*/metrics.csv"))) as f:
        return [r for r in csv.DictReader(f) if r.get("val/acc")]


def test_balanced_accuracy_and_macro_f1_are_logged_and_choose_best_ckpt(imbalanced_fit):
    cli, run = imbalanced_fit
    epochs = _epochs(run)
    assert all(r["val/balanced_acc"] and r["val/macro_f1"] for r in epochs)
    best = max(epochs, key=lambda r: float(r["val/balanced_acc"]))  # the first of equals, as ModelCheckpoint keeps
    assert load_checkpoint(run / "checkpoints" / "best.ckpt")["epoch"] == int(best["epoch"])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["monitor"] == "val/balanced_acc"
    assert summary["best_score"] == pytest.approx(float(best["val/balanced_acc"]))
    assert summary["best_val_acc"] == pytest.approx(float(best["val/acc"]))  # the accuracy of best.ckpt itself
    with open(run / "reports" / "per_class.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["class"] for r in rows] == ["bar", "column", "square"]
    assert np.mean([float(r["recall"]) for r in rows]) == pytest.approx(float(best["val/balanced_acc"]), abs=1e-4)


def test_early_stopping_ends_the_run_after_its_patience(imbalanced_fit):
    cli, run = imbalanced_fit
    # min_delta 1.0: only the first validation counts as an improvement, then 2 more without one
    assert len(_epochs(run)) == 3 and cli.trainer.should_stop


@pytest.mark.skipif(not BALANCE_FLAGS, reason="the data module has no --data.balance")
def test_auto_balance_reaches_the_model_and_leaves_inference_a_plain_argmax(imbalanced_fit):
    cli, run = imbalanced_fit
    counts = cli.datamodule.class_counts
    assert cli.model.hparams.balance == METHOD and cli.model.hparams.class_counts == counts
    assert max(counts) / min(counts) >= 3
    net, _ = load_network(run / "checkpoints" / "last.ckpt")  # what vit-export rebuilds: the plain network
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(net(x), cli.model.eval()(x), rtol=1e-5, atol=1e-5)


def test_the_automatic_recipe_stops_early_on_balanced_accuracy(shapes_folder: Path, tmp_path: Path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--data.root", str(shapes_folder), "--trainer.default_root_dir", str(tmp_path), "--print_config"])
    assert exit_info.value.code in (0, None)
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["early_stopping"]["patience"] >= 5  # watching what picks best.ckpt (linked, so not printed)
    assert resolved["checkpoint"]["monitor"] == "val/balanced_acc"
    assert "balanced accuracy" in resolved["recipe"]["early_stopping.patience"]


@pytest.mark.skipif(not BALANCE_FLAGS, reason="the data module has no --data.balance")
def test_the_sampler_method_draws_the_training_batches_class_balanced(tmp_path: Path, monkeypatch):
    root = write_shapes(tmp_path / "shapes", per_class=4)
    write_shapes(tmp_path / "more", per_class=36, classes=("bar",), seed=1)
    for i, f in enumerate(sorted((tmp_path / "more" / "bar").iterdir())):
        f.rename(root / "bar" / f"more{i}.png")
    monkeypatch.setattr("train.balance.METHOD", "sampler")
    dm = ImageFolderDataModule(str(root), img_size=32, batch_size=8, num_workers=0, balance="auto", dedupe="none")
    dm.setup("fit")
    torch.manual_seed(0)
    labels = [int(label) for _ in range(10) for _, batch in dm.train_dataloader() for label in batch]
    assert dm.balance_method == "sampler" and 0.2 < labels.count(0) / len(labels) < 0.5  # bar: 80 % of the images


def test_the_model_takes_a_loss_method_with_mixup_and_refuses_one_without_counts():
    from train.module import ViTClassifier

    kwargs = {"num_classes": 2, "img_size": 32, "variant": "vit_micro_patch4_32", "mixup_alpha": 0.2}
    model = ViTClassifier(**kwargs, balance="logit_adjusted", class_counts=[90, 10])
    assert isinstance(model.train_loss, BalancedLoss) and model.train_loss.method == "logit_adjusted"
    with pytest.raises(ValueError, match="needs class_counts"):
        ViTClassifier(**kwargs, balance="reweight")
