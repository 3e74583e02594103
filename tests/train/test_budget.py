"""The time budget: the learning rate anneals on time spent, and the run stops, validated, when it is spent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

from tests.helpers import REPO
from train.budget import TimeBudget
from train.cli import build_cli


@pytest.mark.slow
@pytest.mark.parametrize("val_every", [1, 1000], ids=["validating-each-epoch", "validating-every-1000-epochs"])
def test_a_run_with_a_time_budget_stops_annealed_and_validated_long_before_max_epochs(
    shapes_folder: Path, tmp_path: Path, val_every: int
):
    # validating every 1000 epochs, the run stops long before a validation epoch comes: it still ends validated
    run_dir = tmp_path / "run"
    cli = build_cli(
        [
            "fit", "--config", str(REPO / "configs" / "small_images.yaml"), "--data.root", str(shapes_folder),
            "--trainer.default_root_dir", str(run_dir), "--trainer.max_epochs", "1000",
            "--trainer.enable_progress_bar", "false", "--data.batch_size", "16", "--trainer.accelerator", "cpu",
            "--trainer.callbacks.minutes", "0.1", "--model.compile", "false",  # a first compile outlasts 6 s
            "--trainer.check_val_every_n_epoch", str(val_every),
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


@pytest.mark.slow
@pytest.mark.parametrize("end", [["--trainer.max_epochs", "2"], ["--trainer.max_steps", "3"]], ids=["epochs", "steps"])
def test_a_run_that_ends_between_validation_epochs_still_ends_validated(shapes_folder: Path, tmp_path: Path, end):
    run_dir = tmp_path / "run"  # the recipe validates every 5th epoch: a 2-epoch or 3-step run ends before one
    build_cli(
        [
            "fit", "--config", str(REPO / "configs" / "small_images.yaml"), "--data.root", str(shapes_folder),
            "--trainer.default_root_dir", str(run_dir), *end, "--trainer.enable_progress_bar", "false",
            "--data.batch_size", "16", "--trainer.accelerator", "cpu", "--model.compile", "false",
        ]
    )  # fmt: skip
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["best_val_acc"] is not None and (run_dir / "checkpoints" / "best.ckpt").is_file()


class LastAtEachEpochStart(Callback):
    """The epoch held in last.ckpt when each training epoch starts (None before there is one)."""

    def __init__(self):
        self.seen: list[int | None] = []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        last = Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt"
        self.seen.append(torch.load(last, weights_only=True)["epoch"] if last.is_file() else None)


@pytest.mark.slow
def test_last_ckpt_is_written_after_every_epoch_between_validation_epochs(shapes_folder: Path, tmp_path: Path):
    cli = build_cli(  # the recipe validates every 5th epoch: a run killed at epoch 3 resumes from epoch 3, not 0
        [
            "fit", "--config", str(REPO / "configs" / "small_images.yaml"), "--data.root", str(shapes_folder),
            "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.max_epochs", "3",
            "--trainer.enable_progress_bar", "false", "--data.batch_size", "16", "--trainer.accelerator", "cpu",
            "--model.compile", "false", "--trainer.callbacks+=tests.train.test_budget.LastAtEachEpochStart",
        ]
    )  # fmt: skip
    (watch,) = [c for c in cli.trainer.callbacks if isinstance(c, LastAtEachEpochStart)]
    assert watch.seen == [None, 0, 1]


def test_a_budget_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        TimeBudget(0)


@pytest.mark.slow
def test_ddp_ranks_share_rank_0s_clock_and_stop_at_the_same_step_with_the_same_weights(
    shapes_folder: Path, tmp_path: Path
):
    # Rank 1 starts 3 s late, so its own clock runs 3 s ahead of rank 0's: on its own clock it would anneal
    # faster than rank 0 (the weights drift apart) and decide to stop on its own.
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "train", "fit", "--config", str(REPO / "configs" / "small_images.yaml")]
    cmd += ["--data.root", str(shapes_folder), "--trainer.default_root_dir", str(run), "--model.compile", "false"]
    cmd += ["--trainer.max_epochs", "1000", "--trainer.enable_progress_bar", "false", "--data.batch_size", "4"]
    cmd += ["--data.num_workers", "0", "--data.calib_fraction", "0", "--trainer.callbacks.minutes", "0.15"]
    cmd += ["--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu"]
    cmd += ["--trainer.callbacks+=tests.train.faults.LateStart", "--trainer.callbacks.seconds", "3"]
    cmd += ["--trainer.callbacks+=tests.train.rank_weights.SaveRankWeights"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    w0, w1 = (torch.load(run / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    for k in w0:
        torch.testing.assert_close(w0[k], w1[k], rtol=0, atol=0)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["best_val_acc"] is not None
