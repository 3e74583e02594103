"""vit-train parses every shipped config, and runs each one on a tiny folder."""

from __future__ import annotations

import logging
import shlex
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import CONFIGS
from train.cli import build_cli, main


def test_configs_exist():
    assert {p.name for p in CONFIGS} >= {
        "sample.yaml",
        "vit_tiny.yaml",
        "vit_small.yaml",
        "vit_base.yaml",
        "finetune_timm.yaml",
    }


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_config_parses_and_links_num_classes_and_img_size_from_the_data(config: Path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code in (0, None)
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert "num_classes" not in resolved["model"] and "img_size" not in resolved["model"]  # linked, never typed
    assert resolved["checkpoint"]["filename"] == "best" and resolved["checkpoint"]["monitor"] == "val/balanced_acc"


def _strings_that_look_like_numbers(node, where=""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _strings_that_look_like_numbers(v, f"{where}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _strings_that_look_like_numbers(v, f"{where}[{i}]")
    elif isinstance(node, str):
        try:
            float(node)
            yield where
        except ValueError:
            pass


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_config_numbers_are_yaml_numbers_not_strings(config: Path):
    assert list(_strings_that_look_like_numbers(yaml.safe_load(config.read_text()))) == []


def _tiny_timm_checkpoint(path: Path) -> Path:
    import timm
    from safetensors.torch import save_file

    torch.manual_seed(0)
    save_file(timm.create_model("vit_tiny_patch16_224", num_classes=7).state_dict(), str(path))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_fast_dev_run_of_each_config_on_a_tiny_folder(config: Path, shapes_folder: Path, tmp_path: Path):
    args = ["fit", "--config", str(config), "--data.root", str(shapes_folder), "--trainer.fast_dev_run", "1"]
    args += ["--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.precision", "32-true"]
    args += ["--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.enable_progress_bar", "false"]
    args += ["--data.img_size", "32", "--data.batch_size", "4", "--data.num_workers", "0", "--model.compile", "false"]
    if "pretrained: " in config.read_text():
        weights = _tiny_timm_checkpoint(tmp_path / "vit_tiny.safetensors")
        args += ["--model.pretrained", str(weights), "--model.variant", "vit_tiny_patch16_224"]
    cli = build_cli(args)
    net = cli.model.net
    assert net.num_classes == 3 and net.head.out_features == 3  # linked from the folder's classes
    assert net.patch_embed.img_size == (32, 32)  # linked from data.img_size
    assert cli.trainer.state.finished


@pytest.mark.slow
@pytest.mark.parametrize(
    ("options", "said"),
    [
        (
            ["--trainer.max_steps", "2", "--trainer.max_epochs", "3"],
            "no validation ran: --trainer.max_steps 2 ended the fit inside an epoch (8 steps each)",
        ),
        (["--trainer.max_epochs", "1", "--checkpoint.every_n_epochs", "3"], "validation ran, but --checkpoint."),
    ],
    ids=["max_steps", "every_n_epochs"],
)
def test_a_fit_that_chose_no_best_checkpoint_says_why_and_how_to_export_the_last(
    options, said, shapes_folder, tmp_path, caplog
):
    """--trainer.max_steps inside the first epoch: no validation ran, so no best.ckpt, and the run only said
    "Training finished." (a user's next step, vit-export of best.ckpt, then failed on a missing file). The command
    is ready to paste: a run directory with a space in its name split it in two."""
    run = tmp_path / "my run"
    args = ["fit", "--config", "configs/sample.yaml", "--data.root", str(shapes_folder), "--data.batch_size", "8"]
    with caplog.at_level(logging.INFO, logger="train"):
        build_cli([*args, "--trainer.default_root_dir", str(run), "--trainer.enable_progress_bar", "false", *options])
    last = run / "checkpoints" / "last.ckpt"
    assert last.is_file() and not (run / "checkpoints" / "best.ckpt").exists()
    assert f"no best.ckpt was chosen: {said}" in caplog.text
    assert f"last checkpoint: {last}" in caplog.text
    command = next(line for line in caplog.text.splitlines() if line.strip().startswith("vit-export "))
    assert shlex.split(command) == ["vit-export", str(last), "-o", "model.onnx"]


@pytest.mark.slow
def test_flip_tta_without_flips_in_training_is_said(shapes_folder: Path, tmp_path: Path, caplog):
    args = ["fit", "--config", "configs/small_images.yaml", "--data.root", str(shapes_folder), "--data.img_size", "32"]
    args += ["--trainer.fast_dev_run", "1", "--trainer.default_root_dir", str(tmp_path / "run"), "--model.compile"]
    args += ["false", "--trainer.enable_progress_bar", "false", "--data.num_workers", "0", "--data.augment.hflip", "0"]
    with caplog.at_level(logging.WARNING, logger="train.options"):
        cli = build_cli(args)
    assert cli.model.net.flip_tta and "set flip_tta false" in caplog.text  # digits: mirrored, a 2 is no 2


def test_a_warm_up_as_long_as_the_run_is_said(shapes_folder: Path, tmp_path: Path, caplog):
    args = ["fit", "--config", "configs/sample.yaml", "--data.root", str(shapes_folder), "--model.warmup_epochs", "3"]
    args += ["--trainer.max_epochs", "3", "--trainer.default_root_dir", str(tmp_path / "run")]
    with caplog.at_level(logging.WARNING, logger="train.options"), pytest.raises(SystemExit):
        main([*args, "--data.num_workers", "-1"])  # refused once the warning is out: no run needed to see it
    assert "warmup_epochs 3 is as long as the run's 3 epochs" in caplog.text


@pytest.mark.slow
def test_resuming_a_finetune_does_not_need_the_pretrained_weights_again(shapes_folder: Path, tmp_path: Path):
    weights = _tiny_timm_checkpoint(tmp_path / "vit_tiny.safetensors")
    args = ["fit", "--config", str(Path("configs/finetune_timm.yaml").resolve()), "--data.root", str(shapes_folder)]
    args += ["--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.precision", "32-true"]
    args += ["--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.enable_progress_bar", "false"]
    args += ["--data.img_size", "32", "--data.batch_size", "8", "--data.num_workers", "0", "--model.compile", "false"]
    args += ["--model.pretrained", str(weights), "--model.variant", "vit_tiny_patch16_224"]
    args += ["--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1"]
    build_cli([*args, "--trainer.max_epochs", "1"])
    weights.unlink()  # offline and the original file gone: the checkpoint must be enough
    cli = build_cli([*args, "--trainer.max_epochs", "2", "--ckpt_path", "last"])
    assert cli.trainer.current_epoch == 2 and cli.trainer.state.finished


def test_a_missing_data_folder_is_one_line_not_a_traceback(tmp_path: Path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "configs/sample.yaml", "--data.root", str(tmp_path / "nope"),
              "--trainer.default_root_dir", str(tmp_path / "run")])  # fmt: skip
    err = capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing made for a run that cannot start
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert err.startswith("vit-train: image folder not found: ") and "root/<class>/<image>" in err


def test_a_class_too_small_for_the_calibration_split_is_refused_in_one_line(tmp_path: Path, capsys):
    from tests.train.conftest import write_shapes

    write_shapes(tmp_path / "tv" / "train", per_class=1)
    write_shapes(tmp_path / "tv" / "val", per_class=1, seed=1)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "configs/sample.yaml", "--data.root", str(tmp_path / "tv"), "--data.img_size", "32",
              "--trainer.default_root_dir", str(tmp_path / "run")])  # fmt: skip
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err and err.count("\n") == 1
    assert err.startswith("vit-train: class 'bar' has 1 training image(s)") and "--data.calib_fraction 0" in err


def test_a_run_directory_a_fit_cannot_use_is_refused_before_the_folder_is_scanned(
    shapes_folder: Path, tmp_path: Path, capsys, monkeypatch
):
    """The folder was scanned (every image decoded, minutes on a large one) before a run directory that already
    held a run, or that another fit held, was refused."""
    import train.datamodule
    from train.run_dir import lock_run_dir

    scans, scan = [], train.datamodule.scan_folder
    monkeypatch.setattr(train.datamodule, "scan_folder", lambda *a, **k: scans.append(a) or scan(*a, **k))
    held, busy = tmp_path / "held", tmp_path / "busy"
    held.mkdir()
    (held / "summary.json").write_text("{}")  # a fit that kept no checkpoint
    busy.mkdir()
    lock = lock_run_dir(busy)  # another fit's, as the kernel sees it
    try:
        for run, says in ((held, "already holds a run"), (busy, "is in use by another fit")):
            argv = ["fit", "--config", "configs/sample.yaml", "--data.root", str(shapes_folder)]
            with pytest.raises(SystemExit) as exit_info:
                main([*argv, "--trainer.default_root_dir", str(run)])
            assert exit_info.value.code == 2 and says in capsys.readouterr().err
    finally:
        lock.close()
    assert not scans


@pytest.mark.slow
def test_fit_refuses_to_replace_an_existing_run_unless_told(shapes_folder: Path, tmp_path: Path, capsys):
    run = tmp_path / "run"
    args = ["fit", "--config", "configs/sample.yaml", "--data.root", str(shapes_folder)]
    args += ["--trainer.default_root_dir", str(run), "--trainer.enable_progress_bar", "false"]
    args += ["--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1"]
    args += ["--data.num_workers", "0", "--model.compile", "false"]
    main(args)
    best = run / "checkpoints" / "best.ckpt"
    before = best.stat().st_mtime_ns
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "already holds a run" in err and "--ckpt_path last" in err
    assert best.stat().st_mtime_ns == before  # nothing was touched
    main([*args, "--overwrite", "true"])
    assert best.stat().st_mtime_ns > before  # written again
    assert yaml.safe_load((run / "config.yaml").read_text())["overwrite"] is False  # the permission is not saved


def test_a_second_fit_into_a_run_directory_in_use_is_refused_at_once(shapes_folder: Path, tmp_path: Path, capsys):
    """Two fits started into one fresh run directory both ran, and the last to write won: one run's checkpoints,
    split and reports were silently the other's. The run directory is locked while a fit holds it."""
    import fcntl

    run = tmp_path / "run"
    run.mkdir()
    with open(run / ".lock", "a+") as other_fit:  # as the first fit holds it
        fcntl.flock(other_fit, fcntl.LOCK_EX | fcntl.LOCK_NB)
        args = ["fit", "--config", "configs/sample.yaml", "--data.root", str(shapes_folder)]
        with pytest.raises(SystemExit) as exit_info:
            main([*args, "--trainer.default_root_dir", str(run), "--trainer.max_epochs", "1"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "in use by another fit" in err and "--trainer.default_root_dir" in err
    assert sorted(p.name for p in run.iterdir()) == [".lock"]  # nothing of its own was written


@pytest.mark.parametrize(
    "option, value, named",
    [
        ("--model.ema_decay", "1.5", "ema_decay"),  # trained on, to a NaN validation loss and a chance-level model
        ("--model.label_smoothing", "2", "label_smoothing"),
        ("--data.img_size", "0", "img_size"),
        ("--data.img_size", "-4", "img_size"),
        ("--data.augment.crop_scale", "[0.9, 0.1]", "crop_scale"),
        ("--data.augment.crop_scale", "[2, 3]", "0 < low <= high <= 1"),  # each crop fell back to a centre crop
        ("--trainer.gradient_clip_val", ".nan", "--trainer.gradient_clip_val must be"),  # "use only one of them"
        # augmentation values torchvision or timm refuse only once the transform is built or first drawn, in a worker
        ("--data.augment.rotate", "-10", "rotate"),
        ("--data.augment.translate", "1.5", "translate"),
        ("--data.augment.scale", "[1.2, 0.8]", "scale"),
        ("--data.augment.scale", "[0, 1]", "scale"),
        ("--data.augment.fill", "300", "fill"),  # wrapped round to 44 in a uint8 image
        ("--data.augment.color_jitter", "-0.2", "color_jitter"),
        ("--data.augment.re_mode", "blur", "re_mode"),
        ("--data.augment.rand_augment", "rand-q9", "rand_augment"),
        ("--data.std", "[0, 0.2, 0.2]", "std"),  # a division by zero: a NaN loss blamed on the learning rate
        ("--data.mean", "[0.5, .nan, 0.5]", "mean"),
        ("--trainer.max_epochs", "-5", "max_epochs"),
        ("--trainer.max_epochs", "0", "max_epochs"),  # "Training finished." with no checkpoint
        ("--model.net_args", "{drop_path_rat: 0.1}", "drop_path_rat"),  # a typo
        # each was a traceback, or trained to a wrong or NaN result
        ("--model.net_args", "{in_chans: 1}", "loaded as RGB"),  # conv2d's channel mismatch on the first batch
        ("--checkpoint.monitor", "val/loss", "--checkpoint.mode min"),  # best.ckpt was the highest loss
        ("--trainer.max_epochs", "-1", "--trainer.max_steps"),  # OverflowError building the schedule
        ("--trainer.precision", "16-true", "16-mixed"),  # NaN at any learning rate, blamed on --model.lr
        ("--trainer.limit_train_batches", "0.01", "Try at least `limit_train_batches="),  # Lightning's traceback
        ("--model.pretrained", "runs/old/checkpoints/best.ckpt", "--model.teacher"),  # "needs model_name="
        ("--model.pretrained", "gone.safetensors", "gone.safetensors: no such file"),  # "Unknown model (vit_micro…)"
    ],
)
def test_an_option_out_of_its_range_is_one_line_before_any_work(option, value, named, shapes_folder, tmp_path, capsys):
    _refused_before_any_work([option, value], named, shapes_folder, tmp_path, capsys)


def test_colour_jitter_asked_of_batch_augmentation_is_one_line_before_any_work(shapes_folder, tmp_path, capsys):
    """The automatic recipe batch-augments: adding colour jitter to it failed with a traceback once the loaders
    were built, after the scan and with the run directory written."""
    options = ["--data.batch_augment", "true", "--data.augment.color_jitter", "0.4"]
    _refused_before_any_work(options, "--data.batch_augment false", shapes_folder, tmp_path, capsys)


def test_an_exported_model_given_as_the_checkpoint_to_resume_is_named_so(shapes_folder, tmp_path, capsys):
    """It was "damaged or truncated (not a whole checkpoint)": a user would export it again."""
    model = tmp_path / "model.onnx"
    model.write_bytes(b"\x08\x07" + bytes(100))  # the file's contents do not matter: it is no zip file
    _refused_before_any_work(["--ckpt_path", str(model)], "is an exported model", shapes_folder, tmp_path, capsys)


def test_a_run_without_checkpoints_is_not_replaced_unless_told(tmp_path):
    """A fit with --trainer.enable_checkpointing false left no .ckpt: the next fit into its directory replaced its
    config.yaml, summary.json, split and reports without a word."""
    from train.errors import SetupError
    from train.run_dir import check_ckpt_owner

    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(SetupError, match=r"already holds a run \(summary.json\).*--overwrite true") as refused:
        check_ckpt_owner(None, tmp_path, overwrite=False)
    assert "--ckpt_path last" not in str(refused.value)  # there is no last.ckpt to resume from
    check_ckpt_owner(None, tmp_path, overwrite=True)


def test_an_image_size_in_net_args_that_is_not_the_runs_is_said_not_applied(caplog):
    """It was dropped without a word, and config.yaml recorded it; the same value as the run's is fine (a run
    saved with it must still resume)."""
    from train.options import check_net_args

    with caplog.at_level("WARNING", logger="train.options"):
        check_net_args({"img_size": 28, "depth": 2}, img_size=28, num_classes=10)
        assert caplog.text == ""
        check_net_args({"img_size": 64}, img_size=28, num_classes=10)
    assert "--model.net_args.img_size 64 is not applied: the run's is 28 (--data.img_size)" in caplog.text


def _refused_before_any_work(options: list[str], named: str, shapes_folder, tmp_path, capsys) -> None:
    run = tmp_path / "run"
    args = ["fit", "--config", "configs/sample.yaml", "--data.root", str(shapes_folder)]
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--trainer.default_root_dir", str(run), *options])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and named in err and "Traceback" not in err, err
    assert not (run / "checkpoints").exists()
