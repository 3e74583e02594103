"""Real runs that are resumed, killed, starved of disk or poisoned: the run directory always stays usable."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, wait_until, write_shapes
from train.checkpoint_format import load_checkpoint
from train.cli import build_cli, main

SAMPLE = str(REPO / "configs" / "sample.yaml")
CONSTANT_LR = ["--model.warmup_epochs", "0.0", "--model.lr", "2.0e-3", "--model.min_lr", "2.0e-3"]
FAULTS = "--trainer.callbacks+=tests.train.faults."


def fit_args(root: Path, run_dir: Path | str, epochs: int, *extra: str) -> list[str]:
    return [
        "fit", "--config", SAMPLE, "--data.root", str(root), "--trainer.default_root_dir", str(run_dir),
        "--trainer.max_epochs", str(epochs), "--trainer.enable_progress_bar", "false", "--data.batch_size", "8",
        *CONSTANT_LR, *extra,
    ]  # fmt: skip


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def exit_code(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code


@pytest.fixture
def shapes(tmp_path: Path) -> Path:
    return write_shapes(tmp_path / "shapes", per_class=12)


def val_losses(run_dir: Path) -> dict[int, float]:
    losses = {}
    for log in sorted((run_dir / "csv").glob("version_*/metrics.csv")):
        with open(log) as f:
            losses |= {int(r["epoch"]): float(r["val/loss"]) for r in csv.DictReader(f) if r.get("val/loss")}
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1])
def test_a_run_resumed_at_an_epoch_boundary_reproduces_the_uninterrupted_run(workers, shapes, tmp_path):
    loader = ["--data.num_workers", str(workers)]
    build_cli(fit_args(shapes, tmp_path / "straight", 4, *loader))
    build_cli(fit_args(shapes, tmp_path / "split", 2, *loader))
    build_cli(fit_args(shapes, tmp_path / "split", 4, *loader, "--ckpt_path", "last"))
    straight, split = val_losses(tmp_path / "straight"), val_losses(tmp_path / "split")
    assert sorted(straight) == [0, 1, 2, 3]
    assert split == straight  # bit for bit: same shuffles, augmentations and drop-path masks


@pytest.mark.slow
def test_the_best_score_survives_a_resume_with_the_run_directory_spelled_differently(shapes, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    build_cli(fit_args(shapes, "run", 1))  # relative
    ckpts = tmp_path / "run" / "checkpoints"
    last = torch.load(ckpts / "last.ckpt", weights_only=True)
    for state in last["callbacks"].values():
        if state.get("best_model_score") is not None:
            state["best_model_score"] = torch.tensor(1.0)  # a best score no next epoch can beat
            state["dirpath"] = "run/checkpoints"  # relative, as checkpoints written before this fix hold it
    torch.save(last, ckpts / "last.ckpt")
    best = sha(ckpts / "best.ckpt")
    cli = build_cli(fit_args(shapes, tmp_path / "run", 2, "--ckpt_path", "last"))  # absolute
    assert float(cli.trainer.checkpoint_callback.best_model_score) == 1.0
    assert sha(ckpts / "best.ckpt") == best  # not replaced by a worse epoch


def _places(run_dir: Path) -> dict[str, str]:
    """Each image of the run's split.json (relative to its root) -> train, val or calib."""
    split = json.loads((run_dir / "split.json").read_text())
    return {os.path.relpath(e["path"], split["root"]): k for k in ("train", "val", "calib") for e in split[k]}


@pytest.mark.slow
def test_a_resumed_run_keeps_its_split_when_the_folder_gained_lost_or_moved_images(shapes, tmp_path, caplog):
    """Adding one image reshuffled its class: a resume validated and calibrated on images it had trained on."""
    run = tmp_path / "run"
    build_cli(fit_args(shapes, run, 1, "--data.calib_fraction", "0.2"))
    before = _places(run)
    moved = shutil.copytree(shapes, tmp_path / "moved")  # the same images, mounted elsewhere
    shutil.copy(moved / "bar" / "000.png", moved / "bar" / "zzz_new.png")
    gone = [next(p for p, k in sorted(before.items()) if k == where) for where in ("train", "val")]
    for p in gone:
        (moved / p).unlink()
    cli = build_cli(fit_args(moved, run, 2, "--ckpt_path", "last", "--data.calib_fraction", "0.3", "--data.seed", "7"))
    scan = cli.datamodule.scan
    after = {os.path.relpath(p, moved): k for k in ("train", "val", "calib") for p, _ in getattr(scan, k)}
    assert after == {p: k for p, k in before.items() if p not in gone}
    assert _places(run) == before  # the file stays whole: images a resume misses come back to the next one
    assert "1 image(s) it does not list (added since it started, or left out by the corrections" in caplog.text
    assert "are left out, and 2 it lists are gone" in caplog.text
    saved = (run / "config.yaml").read_text()  # refitting it into a new run splits anew, and starts the run
    assert "split: null" in saved and "ckpt_path: null" in saved


@pytest.mark.slow
def test_a_run_directory_moved_and_resumed_names_its_own_best_checkpoint(shapes, tmp_path):
    """The restored best path was the old directory's: summary.json and the export hint named a file gone."""
    build_cli(fit_args(shapes, tmp_path / "first", 1))
    moved = tmp_path / "moved"
    shutil.move(tmp_path / "first", moved)
    cli = build_cli(fit_args(shapes, moved, 2, "--ckpt_path", "last"))
    best = json.loads((moved / "summary.json").read_text())["best_checkpoint"]
    assert Path(best).parent == (moved / "checkpoints").resolve() and Path(best).is_file()
    assert Path(cli.trainer.checkpoint_callback.best_model_path).is_file()


@pytest.mark.slow
def test_a_non_finite_loss_stops_the_run_and_keeps_the_best_checkpoint(shapes, tmp_path, capsys):
    run = tmp_path / "run"
    code = exit_code(fit_args(shapes, run, 4, f"{FAULTS}PoisonBatch", "--trainer.callbacks.epoch", "1"))
    err = capsys.readouterr().err
    assert code == 1 and "vit-train: the training loss is nan at epoch 1" in err and "Training finished" not in err
    ckpts = run / "checkpoints"
    assert load_checkpoint(ckpts / "best.ckpt")["epoch"] == 0  # written by the finite epoch, never since
    last = load_checkpoint(ckpts / "last.ckpt")
    assert last["epoch"] == 0 and all(torch.isfinite(v).all() for v in last["state_dict"].values())


@pytest.mark.slow
def test_resuming_on_a_folder_with_other_classes_or_with_another_network_or_size_is_refused(shapes, tmp_path, capsys):
    run = tmp_path / "run"
    build_cli(fit_args(shapes, run, 1))
    kept = {name: sha(run / name) for name in ("config.yaml", "split.json")}  # what `--config RUN/config.yaml` reads
    renamed = write_shapes(tmp_path / "renamed", per_class=12, classes=("bar", "column", "circle"))
    more = write_shapes(tmp_path / "more", per_class=12, classes=("bar", "column", "square", "zigzag"))
    for root, count in ((renamed, 3), (more, 4)):
        assert exit_code(fit_args(root, run, 2, "--ckpt_path", "last")) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and "was trained on 3 classes" in err  # said by the run's split
        assert f"the image folder has {count} classes" in err
    # another network failed with a hundred size-mismatch lines; another image size trained on, and the new
    # checkpoints said the old size (export and serving would resize to it)
    for option, said in [
        (["--model.net_args", "{depth: 2}"], "depth 4 (this run: 2)"),
        (["--data.img_size", "24"], "img_size [28, 28] (this run: [24, 24])"),
        (["--data.img_size", "24", "--overwrite", "true", "--data.seed", "7"], "img_size [28, 28] (this run:"),
        (["--model.layer_decay", "0.75"], "optimizer has 2 parameter groups, and this run's has"),  # a traceback
    ]:
        assert exit_code(fit_args(shapes, run, 2, "--ckpt_path", "last", *option)) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and said in err and "--config RUN/config.yaml" in err, err[-600:]
        # refused, the run is as it was: its config and split were rewritten with the refused settings first
        assert {name: sha(run / name) for name in kept} == kept, option
    assert load_checkpoint(run / "checkpoints" / "last.ckpt")["epoch"] == 0
    from train.module import ViTClassifier

    ViTClassifier.load_from_checkpoint(run / "checkpoints" / "last.ckpt")  # no run around it: nothing to differ from


@pytest.fixture
def other_fs_dir():
    """A folder on another filesystem than $TMPDIR (where Lightning staged its saves): /dev/shm."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    folder = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="vitscope-"))
    if os.stat(folder).st_dev == os.stat(tempfile.gettempdir()).st_dev:
        shutil.rmtree(folder)
        pytest.skip("/dev/shm is on the same filesystem as $TMPDIR")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _child(argv: list[str], tmpdir: Path | None = None, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), **({"TMPDIR": str(tmpdir)} if tmpdir else {})}
    cmd = [sys.executable, "-m", "train", *argv]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **kw)


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {e.name: (e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(folder)}


@pytest.mark.slow
def test_kill_9_while_a_checkpoint_is_written_leaves_the_previous_ones_loadable(shapes, other_fs_dir):
    run = other_fs_dir / "run"
    build_cli(fit_args(shapes, run, 1))
    ckpts = run / "checkpoints"
    before = _snapshot(ckpts)
    proc = _child([*fit_args(shapes, run, 3, "--ckpt_path", "last"), f"{FAULTS}SlowSave"], start_new_session=True)
    try:

        def saving() -> bool:  # the first byte of the next save lands in the checkpoint folder
            assert proc.poll() is None, "the resumed run stopped before it saved"
            return _snapshot(ckpts) != before

        wait_until(saving, 180, "the resumed run starting a save", interval=0.001)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for name in ("best.ckpt", "last.ckpt"):
        assert load_checkpoint(ckpts / name)["epoch"] in (0, 1), name  # the old file or the whole new one
    done_epochs = load_checkpoint(ckpts / "last.ckpt")["epoch"] + 1
    build_cli(fit_args(shapes, run, 3, "--ckpt_path", "last"))  # resumes, and clears the killed save's leftovers
    assert sorted(p.name for p in ckpts.iterdir()) == ["best.ckpt", "last.ckpt"]
    logs = sorted((run / "csv").glob("version_*/metrics.csv"))
    assert len(logs) == 3  # the first run's and the killed run's logs are kept beside the resumed run's
    with open(logs[-1]) as f:
        assert min(int(r["epoch"]) for r in csv.DictReader(f)) == done_epochs  # continued, not restarted


def _limit_file_size(limit: int):
    def preexec() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return preexec


@pytest.fixture
def full_disk(other_fs_dir):
    """(run directory, extra Popen kwargs) where a 64 MB checkpoint cannot be written.

    Where this process may mount one, the run directory is a 32 MB tmpfs and $TMPDIR has room: a real full disk.
    Elsewhere the child gets RLIMIT_FSIZE of 32 MB, on another filesystem than $TMPDIR (the limit also stops a
    file staged in $TMPDIR, so the test then checks the message and the leftovers, not a truncation).
    """
    mnt = other_fs_dir / "small"
    mnt.mkdir()
    if (
        shutil.which("mount") is None
        or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mnt)], capture_output=True).returncode
    ):
        yield other_fs_dir / "run", {"preexec_fn": _limit_file_size(32 << 20)}
        return
    try:
        yield mnt / "run", {}
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


@pytest.mark.slow
def test_a_full_disk_during_a_save_keeps_the_previous_checkpoints(shapes, full_disk, tmp_path):
    run, popen_kw = full_disk
    tmpdir = tmp_path / "tmpdir"  # the child's $TMPDIR, on another filesystem than the run directory
    tmpdir.mkdir()
    build_cli(fit_args(shapes, run, 1))
    ckpts = run / "checkpoints"
    before = {name: sha(ckpts / name) for name in ("best.ckpt", "last.ckpt")}
    proc = _child(
        [*fit_args(shapes, run, 3, "--ckpt_path", "last"), f"{FAULTS}SlowSave", "--trainer.callbacks.mb", "64"],
        tmpdir,
        **popen_kw,
    )
    _, err = proc.communicate(timeout=240)
    err = err.decode()
    assert proc.returncode == 1, err[-3000:]
    assert "vit-train: could not write the checkpoint" in err and "Traceback" not in err, err[-3000:]
    full = not popen_kw  # a real full disk: said so, where torch's zip writer says "unexpected pos"
    assert ("the disk is full" in err) == full, err[-3000:]  # and only then (not for a file-size limit)
    assert {name: sha(ckpts / name) for name in before} == before  # untouched, and still loadable:
    assert load_checkpoint(ckpts / "last.ckpt")["epoch"] == 0
    assert sorted(p.name for p in ckpts.iterdir()) == ["best.ckpt", "last.ckpt"]  # no partial file left
    assert [p for p in tmpdir.rglob("*") if p.stat().st_size > 1 << 20] == []  # and no orphan in $TMPDIR
