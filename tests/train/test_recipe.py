"""The automatic recipe: choices from the data and the machine, printed, saved, and overridable."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from train.cli import main
from train.recipe import Survey, auto_recipe_args, choose, survey


def test_small_images_get_the_small_recipe_at_their_own_side(shapes_folder: Path):
    s = survey(shapes_folder)
    assert (s.classes, s.train_images, s.median_side) == (3, 72, 32)
    config, why = choose(s)
    assert config["data"]["img_size"] == 32 and config["model"]["net_args"]["stem"] == "conv"
    assert config["data"]["batch_size"] <= 16  # a few batches an epoch, even for 72 images
    assert "compile" not in config["model"]  # a few hundred steps: a first compile would outlast the gain
    assert {"data.img_size", "data.batch_size", "model.variant", "trainer.max_epochs"} <= set(why)


def test_large_images_are_trained_small_on_cpu_and_at_224_on_a_gpu():
    cpu, why = choose(Survey(classes=100, train_images=500_000, median_side=375, gpu=False, cores=2))
    assert cpu["data"]["img_size"] == 64 and cpu["model"]["net_args"]["patch_size"] == 8
    assert cpu["trainer"]["callbacks"][0]["class_path"] == "train.budget.TimeBudget" and "CPU" in why["data.img_size"]
    gpu, _ = choose(Survey(classes=100, train_images=500_000, median_side=375, gpu=True, cores=16))
    assert gpu["data"]["img_size"] == 224 and gpu["model"]["variant"] == "vit_tiny_patch16_224"
    assert gpu["trainer"]["precision"] == "bf16-mixed" and gpu["data"]["batch_size"] == 128
    assert cpu["model"]["compile"] is True and "compile" not in gpu["model"]  # measured on CPU only


def test_a_command_with_a_config_or_without_a_folder_is_left_alone(tmp_path: Path):
    with_config = ["fit", "--config", "configs/sample.yaml", "--data.root", str(tmp_path)]
    assert auto_recipe_args(with_config) == with_config
    assert auto_recipe_args(["fit", "--data.root", str(tmp_path / "missing")])[1] != "--config"


@pytest.mark.slow
def test_fit_without_a_config_trains_and_saves_its_choices_and_reasons_and_flags_override_them(
    shapes_folder: Path, tmp_path: Path
):
    run_dir = tmp_path / "run"
    main(
        [
            "fit", "--data.root", str(shapes_folder), "--trainer.default_root_dir", str(run_dir),
            "--trainer.max_epochs", "1", "--trainer.enable_progress_bar", "false", "--data.batch_size", "8",
        ]
    )  # fmt: skip
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["data"]["img_size"] == 32 and saved["data"]["batch_size"] == 8  # the flag beat the recipe
    assert saved["model"]["net_args"]["stem"] == "conv"
    assert "median image side 32 px" in saved["recipe"]["data.img_size"]
    assert (run_dir / "checkpoints" / "best.ckpt").is_file()
