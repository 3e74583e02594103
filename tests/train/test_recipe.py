"""The automatic recipe: choices from the data and the machine, printed, saved, and overridable."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import yaml

from train.cli import main
from train.folder_scan import scan_folder
from train.recipe import Survey, auto_recipe_args, choose, survey


def test_small_images_get_the_small_recipe_at_their_own_side(shapes_folder: Path):
    s = survey(shapes_folder)
    assert (s.classes, s.train_images, s.median_side) == (3, 66, 32)
    config, why = choose(s)
    assert config["data"]["img_size"] == 32 and config["model"]["net_args"]["stem"] == "conv"
    assert config["data"]["batch_size"] <= 16  # a few batches an epoch, even for 72 images
    assert "compile" not in config["model"]  # a few hundred steps: a first compile would outlast the gain
    assert {"data.img_size", "data.batch_size", "model.variant", "trainer.max_epochs"} <= set(why)
    wanted = round(6000 / (s.train_images // config["data"]["batch_size"]))  # more epochs than the recipe runs
    assert f"100 epochs at most, though 6,000 steps would take {wanted} epochs" in why["trainer.max_epochs"]


def test_large_images_are_trained_small_on_cpu_and_at_224_on_a_gpu():
    cpu, why = choose(Survey(classes=100, train_images=500_000, median_side=375, gpu=False, cores=2))
    assert cpu["data"]["img_size"] == 64 and cpu["model"]["net_args"]["patch_size"] == 8
    assert cpu["trainer"]["callbacks"][0]["class_path"] == "train.budget.TimeBudget" and "CPU" in why["data.img_size"]
    gpu, _ = choose(Survey(classes=100, train_images=500_000, median_side=375, gpu=True, cores=16))
    assert gpu["data"]["img_size"] == 224 and gpu["model"]["variant"] == "vit_tiny_patch16_224"
    assert gpu["trainer"]["precision"] == "bf16-mixed" and gpu["data"]["batch_size"] == 128
    assert cpu["model"]["compile"] is True and "compile" not in gpu["model"]  # measured on CPU only


def test_the_survey_counts_the_images_as_the_data_module_splits_them(shapes_folder: Path):
    s = survey(shapes_folder, split=(0.2, 0.1, 42))
    scan = scan_folder(shapes_folder, 0.2, 42, verify=False, calib_fraction=0.1)
    assert (s.images, s.train_images, s.val_images, s.calib_images) == (
        90,
        *map(len, (scan.train, scan.val, scan.calib)),
    )


def test_the_printout_names_each_chosen_value_before_its_reason(shapes_folder: Path, tmp_path: Path, caplog):
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="train.recipe"):
        auto_recipe_args(["fit", "--data.root", str(shapes_folder), "--trainer.default_root_dir", str(run_dir)])
    setting = re.compile(r"  ([\w.]+): (.*)")  # "  data.batch_size: 16 (why)"
    printed = dict(m.groups() for m in map(setting.fullmatch, caplog.text.splitlines()) if m)
    config = yaml.safe_load((run_dir / "auto_recipe.yaml").read_text())
    assert printed["data.batch_size"].startswith(f"{config['data']['batch_size']} (")
    assert "66 training images" in printed["data.batch_size"]  # the images the split trains on, as the scan counts them
    assert printed["trainer.max_epochs"].startswith(f"{config['trainer']['max_epochs']} (")
    assert printed["model.lr"].startswith(f"{config['model']['lr']:g} (")
    assert printed["data.img_size"].startswith(f"{config['data']['img_size']} (")
    assert printed["early_stopping.patience"].startswith(f"{config['early_stopping']['patience']} (")
    assert all(line.endswith(")") for line in printed.values())
    assert "90 images in 3 classes: 66 to train on, 18 for validation and 6 for calibration" in caplog.text
    assert config["recipe"] == printed  # config.yaml keeps what was printed


def test_a_command_with_a_config_or_without_a_folder_is_left_alone(tmp_path: Path):
    with_config = ["fit", "--config", "configs/sample.yaml", "--data.root", str(tmp_path)]
    assert auto_recipe_args(with_config) == with_config
    assert auto_recipe_args(["fit", "--data.root", str(tmp_path / "missing")])[1] != "--config"


@pytest.mark.slow
def test_a_run_the_recipe_started_goes_on_with_that_recipe(shapes_folder: Path, tmp_path: Path):
    """A resume re-ran the recipe on the folder as it was that day (900 images: batch 32 and another learning
    rate recorded), and a fit the run directory then refused had already rewritten the run's recipe."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"")
    (run / "auto_recipe.yaml").write_text("data:\n  batch_size: 16\n")
    args = ["fit", "--data.root", str(shapes_folder), "--trainer.default_root_dir", str(run)]
    for more in (["--ckpt_path", "last"], []):  # a resume; a new fit, which the run directory refuses
        assert auto_recipe_args([*args, *more])[:3] == ["fit", "--config", str(run / "auto_recipe.yaml")]
        assert (run / "auto_recipe.yaml").read_text() == "data:\n  batch_size: 16\n"
    auto_recipe_args([*args, "--overwrite", "true"])  # replacing the run: a recipe for the folder as it is now
    assert "recipe:" in (run / "auto_recipe.yaml").read_text()


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


@pytest.mark.parametrize("where", ["in_the_images", "a_file"])
def test_a_run_directory_refused_is_refused_before_the_recipe_is_written(shapes_folder, tmp_path, where, capsys):
    """The recipe went into the run directory before it was checked: inside the image folder, it made a class
    folder that every later fit was refused for; a file there ended in a FileExistsError traceback."""
    run = shapes_folder / "myrun" if where == "in_the_images" else tmp_path / "afile"
    if where == "a_file":
        run.write_text("not a folder")
    with pytest.raises(SystemExit) as e:
        main(["fit", "--data.root", str(shapes_folder), "--trainer.default_root_dir", str(run)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("vit-train: ") and len(err.strip().splitlines()) == 1, err
    assert "outside --data.root" in err if where == "in_the_images" else "cannot write into the run directory" in err
    assert not (shapes_folder / "myrun").exists()
