"""The time budget: the learning rate anneals on time spent, and the run stops, validated, when it is spent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import REPO
from train.budget import TimeBudget
from train.cli import build_cli


@pytest.mark.slow
def test_a_run_with_a_time_budget_stops_annealed_and_validated_long_before_max_epochs(
    shapes_folder: Path, tmp_path: Path
):
    run_dir = tmp_path / "run"
    cli = build_cli(
        [
            "fit", "--config", str(REPO / "configs" / "small_images.yaml"), "--data.root", str(shapes_folder),
            "--trainer.default_root_dir", str(run_dir), "--trainer.max_epochs", "1000",
            "--trainer.enable_progress_bar", "false", "--data.batch_size", "16", "--trainer.accelerator", "cpu",
            "--trainer.callbacks.minutes", "0.1", "--model.compile", "false",  # a first compile outlasts 6 s
        ]
    )  # fmt: skip
    trainer = cli.trainer
    budgets = [cb for cb in trainer.callbacks if isinstance(cb, TimeBudget)]
    assert len(budgets) == 1 and budgets[0].budget == 6.0 and budgets[0].elapsed() >= 6.0
    assert 1 <= trainer.current_epoch < 1000
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    assert lr <= 0.05 * cli.model.hparams.lr  # annealed to (near) min_lr when the budget ran out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["best_val_acc"] is not None


def test_a_budget_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        TimeBudget(0)
