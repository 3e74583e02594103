"""DeiT's distillation token in training: the second head learns the teacher's answers, the teacher is never saved,
and a teacher for other classes or other pixels is refused before the first step."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from serve.runtime.images import Preprocess
from tests.helpers import TINY_NET
from train.checkpoint_format import load_network
from train.cli import build_cli, main
from vit import VisionTransformer

SHAPES = ["bar", "column", "square"]  # `shapes_folder`'s classes
RECIPE = Preprocess(img_size=(32, 32), crop_pct=1.0, mean=(0.5,) * 3, std=(0.5,) * 3)  # small_images.yaml at 32 px


def write_teacher(path: Path, classes: list[str] = SHAPES, preprocess: Preprocess = RECIPE) -> Path:
    """An untrained network saved as a vit-train checkpoint: its top class is still an answer to learn."""
    torch.manual_seed(1)
    net = VisionTransformer(**{**TINY_NET, "num_classes": len(classes)})
    meta = {"model_config": net.config, "class_names": classes, "preprocess": preprocess.to_dict()}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": {"net." + k: v for k, v in net.state_dict().items()}, "vitscope": meta}, path)
    return path


class HeadsAtStart(pl.Callback):
    """Keeps both heads' weights as the first step finds them."""

    def on_train_start(self, trainer, module):
        self.head = module.net.head.weight.detach().clone()
        self.head_dist = module.net.head_dist.weight.detach().clone()


def fit_args(folder: Path, run: Path, *extra: str) -> list[str]:
    args = ["fit", "--config", "configs/small_images.yaml", "--data.root", str(folder), "--data.img_size", "32"]
    args += ["--trainer.default_root_dir", str(run), "--trainer.enable_progress_bar", "false"]
    args += ["--trainer.max_epochs", "1", "--trainer.limit_train_batches", "3", "--data.batch_size", "16"]
    args += ["--model.compile", "false"]  # three steps: a first compile would take ten times longer
    return [*args, *extra]


@pytest.mark.slow
def test_the_distillation_head_learns_the_teacher_and_the_checkpoint_holds_the_student_alone(shapes_folder, tmp_path):
    teacher = write_teacher(tmp_path / "teacher" / "best.ckpt")
    # all of the loss on the teacher's answers and no weight decay: the class head gets no gradient and stays put
    extra = ["--model.teacher", str(teacher), "--model.distill_weight", "1.0", "--model.weight_decay", "0.0"]
    extra += ["--trainer.callbacks+=tests.train.test_distillation.HeadsAtStart"]
    cli = build_cli(fit_args(shapes_folder, tmp_path / "run", *extra))
    net, (start,) = cli.model.net, [c for c in cli.trainer.callbacks if isinstance(c, HeadsAtStart)]
    assert net.distilled and net.num_prefix_tokens == 1 and cli.trainer.global_step == 3  # avg pooling: no CLS
    assert torch.equal(net.head.weight, start.head)  # the labels taught nothing
    assert not torch.equal(net.head_dist.weight, start.head_dist)  # the teacher did
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert any(k.startswith("net.head_dist.") for k in state) and not any("teacher" in k for k in state)
    student, meta = load_network(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert student.distilled and meta["model_config"]["distilled"]
    x = torch.randn(2, 3, 32, 32)
    student.flip_tta = False  # the recipe's mirror images aside: one view, the two heads
    with torch.no_grad():  # evaluated, the student answers with the mean of its two heads
        tokens = student.forward_features(x)
        pooled = student.fc_norm(tokens[:, 1:].mean(1))
        mean = (student.head(pooled) + student.head_dist(student.fc_norm(tokens[:, 0]))) / 2
        torch.testing.assert_close(student(x), mean)


@pytest.mark.parametrize(
    "teacher, says",
    [
        (dict(classes=["bar", "column", "circle"]), "trained on the classes ['bar', 'column', 'circle']"),
        (dict(preprocess=Preprocess(img_size=(32, 32), crop_pct=1.0)), "normalised with mean (0.485, 0.456, 0.406)"),
        (None, "--model.teacher: checkpoint not found"),
        ("half", "is damaged or truncated"),  # a copy cut short
    ],
    ids=["other-classes", "other-normalisation", "missing", "half-written"],
)
def test_a_teacher_that_does_not_fit_the_run_is_refused_in_one_line(shapes_folder, tmp_path, capsys, teacher, says):
    path = tmp_path / "teacher.ckpt"
    if teacher == "half":
        whole = write_teacher(tmp_path / "whole.ckpt").read_bytes()
        path.write_bytes(whole[: len(whole) // 2])
    elif teacher is not None:
        write_teacher(path, **teacher)
    with pytest.raises(SystemExit) as exit_info:
        main(fit_args(shapes_folder, tmp_path / "run", "--model.teacher", str(path)))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err and err.count("\n") == 1
    assert says in err, err


def test_a_run_directory_as_the_teacher_stands_for_its_best_checkpoint(shapes_folder, tmp_path, capsys):
    """`--model.teacher runs/base` said "checkpoint not found", though a run directory names its best model."""
    write_teacher(tmp_path / "base" / "checkpoints" / "best.ckpt", classes=["bar", "column", "circle"])
    with pytest.raises(SystemExit) as exit_info:  # read: refused for its classes, not for its path
        main(fit_args(shapes_folder, tmp_path / "run", "--model.teacher", str(tmp_path / "base")))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "trained on the classes ['bar', 'column', 'circle']" in err, err


@pytest.mark.parametrize(
    "args, says",
    [
        (["--model.net_args.distilled", "true"], "--model.teacher"),
        (["--model.teacher", "t.ckpt", "--model.distill_weight", "0"], "distill_weight must be over 0"),
    ],
    ids=["token-without-teacher", "weight-0"],
)
def test_a_distillation_that_cannot_learn_is_refused_in_one_line(shapes_folder, tmp_path, capsys, args, says):
    with pytest.raises(SystemExit) as exit_info:
        main(fit_args(shapes_folder, tmp_path / "run", *args))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and says in err, err
