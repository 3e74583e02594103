"""End to end: a real tiny training run, its run directory, its checkpoints, DDP (resume after a kill:
test_resume_safety.py)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from serve.runtime.images import load_image
from tests.helpers import REPO, write_shapes
from train.checkpoint_format import load_checkpoint, load_network
from train.cli import build_cli
from train.shards import prepare

SAMPLE = str(REPO / "configs" / "sample.yaml")


def fit_args(root: Path, run_dir: Path, epochs: int, *extra: str) -> list[str]:
    return [
        "fit", "--config", SAMPLE, "--data.root", str(root), "--trainer.default_root_dir", str(run_dir),
        "--trainer.max_epochs", str(epochs), "--trainer.enable_progress_bar", "false",
        "--data.batch_size", "8", "--model.warmup_epochs", "1.0", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 15-epoch run of configs/sample.yaml on 3 easy classes, EMA on."""
    tmp = tmp_path_factory.mktemp("e2e")
    root = write_shapes(tmp / "shapes")
    run_dir = tmp / "run"
    cli = build_cli(fit_args(root, run_dir, 15, "--model.ema_decay", "0.9"))
    return cli, run_dir


@pytest.mark.slow
def test_tiny_training_beats_chance_clearly(trained):
    cli, _ = trained
    assert float(cli.trainer.checkpoint_callback.best_model_score) >= 0.8  # chance is 1/3


@pytest.mark.slow
def test_run_dir_holds_checkpoints_config_logs_split_and_reports(trained):
    _, run = trained
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["best.ckpt", "last.ckpt"]
    for name in ("config.yaml", "split.json", "bad_files.csv", "reports/confusion_matrix.png"):
        assert (run / name).is_file(), name
    assert list((run / "tensorboard").rglob("events.out.tfevents.*"))
    assert list((run / "csv").rglob("metrics.csv"))
    split = json.loads((run / "split.json").read_text())
    # 20 % of 90 images, less the near-copies that follow their group into train (the shapes repeat positions)
    val = len(split["val"])
    assert split["classes"] == ["bar", "column", "square"] and 14 <= val <= 18
    with open(run / "reports" / "per_class.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["class"] for r in rows] == ["bar", "column", "square"] and sum(int(r["images"]) for r in rows) == val
    with open(run / "reports" / "confusion_matrix.csv") as f:
        assert sum(int(v) for row in list(csv.reader(f))[1:] for v in row[1:]) == val


@pytest.mark.slow
def test_checkpoint_carries_what_export_needs_and_loads_with_weights_only(trained):
    cli, run = trained
    ckpt = load_checkpoint(run / "checkpoints" / "best.ckpt")  # torch.load(weights_only=True)
    meta = ckpt["vitscope"]
    assert meta["class_names"] == ["bar", "column", "square"]
    assert meta["preprocess"] == cli.datamodule.preprocess.to_dict()
    assert meta["weights_prefix"] == "ema.module."
    assert meta["model_config"]["num_classes"] == 3 and meta["variant"] == "vit_micro_patch4_32"
    last = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["vitscope"]
    assert last["best_val"]["score"] == pytest.approx(cli.model.best_score)  # a resumed run compares against it


@pytest.mark.slow
def test_load_network_gives_the_logits_of_the_trained_module(trained):
    cli, run = trained
    module = cli.model.eval()
    net, meta = load_network(run / "checkpoints" / "last.ckpt")
    split = json.loads((run / "split.json").read_text())
    x = torch.stack([torch.from_numpy(meta["preprocess"](load_image(e["path"]))) for e in split["val"]])
    with torch.no_grad():
        torch.testing.assert_close(net(x), module(x), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(net(x), module.net.eval()(x))  # it is the EMA copy, not the raw weights


@pytest.mark.slow
@pytest.mark.parametrize("prepared", [False, True], ids=["folder", "prepared"])
def test_ddp_on_two_cpu_processes_keeps_the_ranks_in_step_and_validates_each_image_once(tmp_path: Path, prepared: bool):
    # One DDP run checks all (each run starts two processes that import torch and Lightning): the ranks end
    # with identical weights, and a rank that gets less than a batch of the validation images still
    # validates its share, each image once; streamed, each rank trains on chunks of its own. From a folder,
    # the third epoch's batches are NaN on rank 1 only: every process stops, none is left waiting for it.
    folder = write_shapes(tmp_path / "shapes", per_class=4)  # a quarter held out: 3 images for 2 ranks, batches of 8
    root, extra = folder, []
    if prepared:  # small chunks, several to share out; unaugmented, so that an image looks the same on any rank
        prepare(str(folder), str(tmp_path / "shards"), val_fraction=0.25, workers=1, chunk_bytes="4kb")
        root = tmp_path / "shards"
        extra = ["--data.augment.crop_scale", "[1.0, 1.0]", "--data.augment.crop_ratio", "[1.0, 1.0]"]
        extra += ["--data.augment.hflip", "0.0", "--trainer.callbacks+=tests.train.rank_weights.SaveRankSamples"]
    else:
        extra = ["--trainer.callbacks+=tests.train.faults.PoisonBatch", "--trainer.callbacks.epoch", "2"]
        extra += ["--trainer.callbacks.rank", "1", "--trainer.max_epochs", "3"]
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "train", *fit_args(root, run, 2, "--data.val_fraction", "0.25")]
    cmd += ["--data.batch_size", "4", "--data.eval_batch_size", "8", "--data.num_workers", "0"]
    cmd += ["--data.calib_fraction", "0"]  # what is measured is validation: 3 images for 2 ranks
    cmd += ["--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu"]
    cmd += ["--trainer.callbacks+=tests.train.rank_weights.SaveRankValImages"]
    cmd += ["--trainer.callbacks+=tests.train.rank_weights.SaveRankWeights", *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    if prepared:
        assert result.returncode == 0, result.stderr[-3000:]
    else:  # a rank left waiting for the other would have hung until the timeout
        assert result.returncode == 1 and "the training loss is not finite on another process" in result.stderr
        # the folder is scanned once: rank 1 reads rank 0's scan, and rank 0 keeps the one it built the model on
        assert result.stderr.count("scanned ") == 1, result.stderr[-3000:]
        assert json.loads((run / "scan.json").read_text())["val"] == json.loads((run / "split.json").read_text())["val"]
    per_rank = [torch.load(run / f"val{r}.pt", weights_only=True) for r in (0, 1)]
    assert [a + b for a, b in zip(*per_rank, strict=True)] == [3, 3]  # each epoch: every image once, none repeated
    assert all(n > 0 for counts in per_rank for n in counts)  # every rank had its share
    w0, w1 = (torch.load(run / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    initial = build_cli(fit_args(folder, tmp_path / "unused", 1)[1:], run=False).model.net.state_dict()
    assert w0.keys() == w1.keys()
    for k in w0:
        torch.testing.assert_close(w0[k], w1[k], rtol=0, atol=0)
    assert any(not torch.equal(w0[k], initial[k]) for k in w0)  # they trained, and stayed in step
    if prepared:
        seen0, seen1 = (torch.load(run / f"samples{r}.pt", weights_only=True) for r in (0, 1))
        assert seen0 and seen1 and not set(seen0) & set(seen1)  # each rank streams its own chunks
    assert load_checkpoint(run / "checkpoints" / "last.ckpt")["epoch"] == 1  # the poisoned epoch saved nothing
