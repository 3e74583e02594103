"""LitData: `vit-train prepare` writes the folder as chunks, and training streams them."""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, wait_until, write_shapes
from tests.train.rank_weights import fingerprints
from train.cli import build_cli, main
from train.folder_scan import scan_folder
from train.shards import check_out_fresh, is_streaming_root, prepare, read_meta


def test_prepare_keeps_the_split_classes_and_reports_every_broken_file(messy_folder, tmp_path, monkeypatch):
    """Also: LitData's `optimize` set the process's multiprocessing start method to spawn for good, so a training
    run in the same process (a notebook, a script) started each DataLoader worker as a fresh interpreter, seconds
    each, where fork takes milliseconds; and its cache folders stayed in the temporary folder, shared with (and
    emptied by) every other prepare on the machine."""
    out, temp = tmp_path / "shards", tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    environ, set_handler = dict(os.environ), signal.signal
    method = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method("forkserver", force=True)  # not LitData's choice, whatever ran before
    try:
        meta = prepare(str(messy_folder), str(out), val_fraction=0.25, seed=0, workers=1)
        assert multiprocessing.get_start_method() == "forkserver"
    finally:
        multiprocessing.set_start_method(method, force=True)
    assert tempfile.gettempdir() == str(temp) and not list(temp.iterdir())
    assert dict(os.environ) == environ and signal.signal is set_handler  # LitData set DATA_OPTIMIZER_NUM_WORKERS
    scan = scan_folder(messy_folder, val_fraction=0.25, seed=0)
    assert meta["classes"] == scan.classes == ["cat", "dog"]
    assert {Path(b["path"]).name for b in meta["bad"]} == {"truncated.jpg", "empty.png", "text.png"}
    assert meta["train"] + meta["val"] == 12 and is_streaming_root(out) and read_meta(str(out)) == meta
    assert "truncated.jpg" in (out / "bad_files.csv").read_text()
    assert (out / "train" / "index.json").is_file() and (out / "val" / "index.json").is_file()


def test_a_prepare_that_stops_half_way_over_an_earlier_one_leaves_a_folder_fit_refuses(messy_folder, tmp_path, capsys):
    """Prepared again into the same --out and stopped while writing its chunks, the folder held the new chunks beside
    the old vitscope.json: fit trained on them under the old classes, exit 0, every label wrong."""
    out = tmp_path / "shards"
    prepare(str(messy_folder), str(out), workers=1)
    (out / "train").rename(tmp_path / "old-train")
    (out / "train").write_text("")  # the chunks cannot be written: the prepare stops where they start
    with pytest.raises(Exception):  # noqa: B017 (whatever LitData raises for it)
        prepare(str(messy_folder), str(out), workers=1)
    (out / "train").unlink()
    (tmp_path / "old-train").rename(out / "train")  # chunks, as a prepare killed half-way leaves them
    assert not (out / "vitscope.json").exists() and is_streaming_root(out)
    with pytest.raises(SystemExit):
        main(
            [
                "fit",
                "--config",
                "configs/sample.yaml",
                "--data.root",
                str(out),
                "--trainer.default_root_dir",
                str(tmp_path / "run"),
            ]
        )
    assert "has chunks but no vitscope.json: its `vit-train prepare` did not finish" in capsys.readouterr().err


def test_prepare_says_what_is_wrong_in_one_line_with_exit_code_2(tmp_path: Path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["prepare", "--data.root", str(tmp_path / "missing"), "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and "image folder not found" in capsys.readouterr().err
    (tmp_path / "images").mkdir()
    paths = ["--data.root", str(tmp_path / "images"), "--out", str(tmp_path / "out")]
    for option, value in [
        ("--chunk_bytes", "abc"),
        ("--chunk_bytes", "1000"),
        ("--chunk_bytes", "0MB"),
        ("--workers", "-1"),
    ]:
        with pytest.raises(SystemExit) as e:  # LitData's traceback after the whole scan, and an empty out/train
            main(["prepare", *paths, option, value])
        assert e.value.code == 2 and option in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["the folder", "inside it", "around it"])
def test_prepare_refuses_an_out_that_overlaps_the_image_folder_before_any_work(tmp_path: Path, capsys, where):
    root = tmp_path / "images" / "train"
    write_shapes(root, per_class=2)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    out = {"the folder": root, "inside it": root / "shards", "around it": tmp_path / "images"}[where]
    with pytest.raises(SystemExit) as e:  # it used to write train/, val/ and chunks into the images
        main(["prepare", "--data.root", str(root), "--out", str(out), "--workers", "1"])
    assert e.value.code == 2 and "--out must be a folder outside --data.root" in capsys.readouterr().err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_vit_train_help_lists_prepare_beside_the_trainer_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    listed = re.findall(r"^ {4}(\w+) +\S", out, re.M)  # "    fit    Runs the full ..."
    assert e.value.code == 0 and listed == ["fit", "validate", "test", "predict", "prepare", "review"]
    assert re.search(r"prepare +Write an image folder as LitData chunks", out)


def test_prepare_help_describes_each_option(capsys):
    with pytest.raises(SystemExit) as e:
        main(["prepare", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("usage: vit-train prepare")
    for option, words in [
        ("--data.root ROOT", "the image folder"),
        ("--out OUT", "output folder"),
        ("--data.val_fraction VAL_FRACTION", "share of each class held out"),
        ("--data.seed SEED", "seed of that split"),
        ("--chunk_bytes CHUNK_BYTES", "size of each chunk"),
        ("--workers WORKERS", "processes"),
        ("--data.dedupe {auto,none}", "auto: find copies"),
    ]:
        assert re.search(rf"^  {re.escape(option)}\s+{words}", out, re.M | re.S), option
    assert "<function" not in out  # a type given as a lambda (choices=) was printed as one


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """The shapes folder prepared once by `vit-train prepare` (72 train and 18 val images in chunks of 4 kB); tests
    only read it. What the command printed is in `prepared.txt` beside it."""
    root = tmp_path_factory.mktemp("shards")
    write_shapes(root / "shapes")
    # dedupe none: shapes drawn at one position are near-copies, and a group split moves the exact counts
    args = ["--out", "~/shards", "--chunk_bytes", "4kb", "--workers", "1", "--data.dedupe", "none"]
    with contextlib.redirect_stdout(io.StringIO()) as printed, pytest.MonkeyPatch.context() as env:
        env.setenv("HOME", str(root))  # `~` as a config file gives it (no shell expands it there)
        main(["prepare", "--data.root", "~/shapes", *args])
    (root / "prepared.txt").write_text(printed.getvalue())
    return root / "shards"


def test_prepare_command_writes_chunks_of_chunk_bytes(shards: Path):
    assert "72 train and 18 val images, 3 classes" in (shards.parent / "prepared.txt").read_text()
    assert len(json.loads((shards / "train" / "index.json").read_text())["chunks"]) > 1


@pytest.mark.parametrize("batch_augment", [True, False])
def test_a_prepared_dataset_gives_the_same_batches_shape_as_the_folder(shards, batch_augment, monkeypatch):
    from train.datamodule import ImageFolderDataModule
    from train.transforms import Augment

    monkeypatch.setenv("HOME", str(shards.parent))  # `~/shards` was found prepared, then opened as ./~/shards
    dm = ImageFolderDataModule(
        "~/shards", img_size=16, batch_size=8, num_workers=0, batch_augment=batch_augment,
        augment=Augment(rand_augment=None, re_prob=0.25),
    )  # fmt: skip
    assert dm.classes == ["bar", "column", "square"]
    dm.setup("fit")
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        x, y = next(iter(loader))
        assert x.shape[1:] == (3, 16, 16) and len(x) in (8, 16) and x.dtype.is_floating_point and y.max() < 3


def test_a_prepared_dataset_whose_vitscope_json_is_cut_short_says_to_prepare_again(shards, tmp_path):
    """It said only "Expecting ',' delimiter: line 1 column 54", naming no file."""
    from train.datamodule import ImageFolderDataModule

    copy = shutil.copytree(shards, tmp_path / "shards")
    meta = copy / "vitscope.json"
    meta.write_bytes(meta.read_bytes()[:50])
    with pytest.raises(ValueError, match=r"vitscope\.json cannot be read .*run its `vit-train prepare` again"):
        ImageFolderDataModule(str(copy), img_size=16, num_workers=0).scan  # noqa: B018 (reading it is the test)
    assert not list(shards.glob(".*.partial"))  # written whole, then renamed into place


def test_split_and_cache_settings_a_prepared_dataset_does_not_apply_are_said(shards, caplog):
    """--data.val_fraction, calib_fraction and cache_images were taken and silently not applied."""
    from train.datamodule import ImageFolderDataModule

    with caplog.at_level("WARNING", logger="train.shards"):
        ImageFolderDataModule(str(shards), img_size=16, num_workers=0)
        assert "not applied" not in caplog.text  # the defaults: nothing was asked
        ImageFolderDataModule(str(shards), img_size=16, num_workers=0, val_fraction=0.3, cache_images=True)
    assert "--data.val_fraction 0.3, --data.cache_images True is not applied" in caplog.text


def test_a_streamed_training_set_smaller_than_one_batch_still_trains(shards):
    # the training loader drops each rank's last partial batch: with 72 images and batches of 128 it gave none,
    # and `fit` ended "done" with the initial weights
    from train.datamodule import ImageFolderDataModule

    dm = ImageFolderDataModule(str(shards), img_size=16, batch_size=128, num_workers=0)
    dm.setup("fit")
    assert sum(len(y) for _, y in dm.train_dataloader()) == dm.train_images == 72


def _stream_fit_args(shards: Path, run: Path, *extra: str) -> list[str]:
    """Two epochs of 9 steps (39 training images, batches of 4), unaugmented so a sample looks the same each time."""
    return [
        "fit", "--config", str(REPO / "configs" / "small_images.yaml"), "--data.root", str(shards),
        "--trainer.default_root_dir", str(run), "--trainer.max_epochs", "2", "--trainer.accelerator", "cpu",
        "--data.batch_size", "4", "--data.eval_batch_size", "4", "--data.num_workers", "0",
        "--trainer.enable_progress_bar", "false", "--data.augment.crop_scale", "[1.0, 1.0]",
        "--data.augment.crop_ratio", "[1.0, 1.0]", "--data.augment.hflip", "0.0",
        "--trainer.callbacks+=tests.train.rank_weights.LogSamples", "--model.compile", "false", *extra,
    ]  # fmt: skip


def _samples(log: Path, before_step: int | None = None) -> dict[int, list[str]]:
    """Epoch -> the fingerprints `LogSamples` wrote for it, in order (only steps before `before_step`, if given)."""
    epochs: dict[int, list[str]] = {}
    for line in log.read_text().splitlines():
        epoch, step, *prints = line.split()
        if before_step is None or int(step) < before_step:
            epochs.setdefault(int(epoch), []).extend(prints)
    return epochs


@pytest.mark.slow
def test_a_killed_streaming_run_resumes_mid_epoch_and_sees_each_sample_of_it_once_from_a_moved_folder(tmp_path: Path):
    shards, run = tmp_path / "shards", tmp_path / "run"
    shapes = write_shapes(tmp_path / "shapes", per_class=16)
    (shapes / "bar" / "broken.png").write_bytes((shapes / "bar" / "000.png").read_bytes()[:60])  # left out, reported
    prepare(str(shapes), str(shards), workers=1, chunk_bytes="4kb")
    cmd = [sys.executable, "-m", "train", *_stream_fit_args(shards, run, "--last.every_n_train_steps", "2")]
    cmd += ["--trainer.callbacks+=tests.train.faults.HangAfter", "--trainer.callbacks.step", "5"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:

        def hung() -> bool:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            return (run / "hung").exists()

        wait_until(hung, 120, "the run reaching step 5", interval=0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # no chance to save anything more
        proc.wait()
    killed = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert (killed["epoch"], killed["global_step"]) == (0, 4)  # mid-epoch: the 5th step was lost with the process
    kept = _samples((run / "samples.log").rename(tmp_path / "killed.log"), before_step=4)[0]  # what last.ckpt holds

    # resumed from another place: the prepared folder moved (a new disk, another mount), given as the new --data.root
    # (the loader's saved position named the old path, and LitData refused it in a traceback)
    shards = shards.rename(tmp_path / "moved-shards")
    resumed = build_cli(_stream_fit_args(shards, run, "--last.every_n_train_steps", "2", "--ckpt_path", "last"))
    assert resumed.trainer.state.finished and resumed.trainer.global_step == 18
    seen = _samples(run / "samples.log")
    dm = build_cli(_stream_fit_args(shards, tmp_path / "unused")[1:], run=False).datamodule
    dm.setup("fit")
    loader = dm.train_dataloader()
    expected = [[p for x, _ in loader for p in fingerprints(x)] for _epoch in range(2)]  # never stopped
    assert len(expected[0]) == 36 and len(set(expected[0])) == 36  # 9 steps of 4 distinct samples
    assert kept == expected[0][:16]
    assert seen[0] == expected[0][16:]  # resumed at the 17th sample of the epoch: none repeated, none skipped
    assert seen[1] == expected[1]  # and the next epoch whole, as if nothing had happened
    summary = json.loads((run / "summary.json").read_text())
    assert summary["epochs"] == 2 and summary["best_val_acc"] is not None
    assert "broken.png" in (run / "bad_files.csv").read_text()  # the prepared dataset's bad files, in the run


def test_an_out_beside_the_images_is_not_refused(tmp_path):
    """--out ds/pets for images in ds/pets/images writes ds/pets/train and val beside them: no harm, no refusal."""
    from train.shards import check_out_apart

    (tmp_path / "pets" / "images").mkdir(parents=True)
    check_out_apart(str(tmp_path / "pets" / "images"), str(tmp_path / "pets"))


def test_prepare_refuses_an_out_that_holds_other_files_and_leaves_them_as_they_were(tmp_path: Path, capsys):
    """An image folder given as --out (a slip between two datasets) got train/, val/ and vitscope.json beside its
    class folders, exit 0: a fit on it then streamed the other dataset's images under its name."""
    root, other = write_shapes(tmp_path / "images", per_class=2), write_shapes(tmp_path / "other", per_class=2)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as e:
        main(["prepare", "--data.root", str(root), "--out", str(other), "--workers", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"--out {other} holds files vit-train prepare did not write" in err
    assert "give a new or empty folder" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    (tmp_path / "empty").mkdir()  # an empty folder is written into, and is then an earlier prepare's folder
    main(["prepare", "--data.root", str(root), "--out", str(tmp_path / "empty"), "--workers", "1"])
    assert read_meta(str(tmp_path / "empty"))["classes"] == sorted(p.name for p in root.iterdir())
    check_out_fresh(str(tmp_path / "empty"))


def test_a_first_prepare_stopped_before_its_chunks_leaves_a_folder_fit_calls_unfinished(
    messy_folder, tmp_path, capsys, monkeypatch
):
    """Killed before LitData wrote train/index.json, a new --out read as an image folder: fit said it "must hold at
    least 2 class folders", not that the prepare did not finish."""
    import litdata

    def stopped(*args, output_dir: str, **kwargs):  # Ctrl-C as the first chunk is being written
        Path(output_dir).mkdir(parents=True)
        (Path(output_dir) / "chunk-0-0.bin").write_bytes(b"half a chunk")
        raise KeyboardInterrupt

    out = tmp_path / "shards"
    monkeypatch.setattr(litdata, "optimize", stopped)
    with pytest.raises(KeyboardInterrupt):
        prepare(str(messy_folder), str(out), workers=1)
    monkeypatch.undo()
    assert is_streaming_root(out)
    with pytest.raises(SystemExit):
        main(["fit", "--config", "configs/sample.yaml", "--data.root", str(out), "--trainer.default_root_dir",
              str(tmp_path / "run")])  # fmt: skip
    assert "has chunks but no vitscope.json: its `vit-train prepare` did not finish" in capsys.readouterr().err


def test_prepare_refuses_a_split_without_validation_images_before_writing_a_chunk(tmp_path: Path, capsys):
    """Every val/ image a copy of a train/ one: the training chunks were written, then LitData failed on the empty
    validation set ("The provided inputs should be non empty"), and each new try failed the same way."""
    root = tmp_path / "images"
    write_shapes(root / "train", per_class=3)
    for folder in (root / "train").iterdir():
        (root / "val" / folder.name).mkdir(parents=True)
        first = sorted(folder.iterdir())[0]
        shutil.copy(first, root / "val" / folder.name / first.name)
    with pytest.raises(SystemExit) as e:
        main(["prepare", "--data.root", str(root), "--out", str(tmp_path / "shards"), "--workers", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "gives no validation images: each of its 3 val/ images has a copy in train/" in err
    assert "--data.dedupe none" in err and not (tmp_path / "shards").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stop", "code", "said"), [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")]
)
def test_a_prepare_stopped_by_a_signal_says_so_and_leaves_no_worker_running(tmp_path: Path, stop, code, said):
    """SIGTERM ended the prepare without a word, exit 143, and LitData's two workers and its resource tracker went
    on running, orphaned, for a minute or more (one survived a second SIGTERM). Ctrl-C (SIGINT to the whole process
    group, as a terminal sends it) exited 0, as if the prepare had finished: LitData's own handler. Either way,
    LitData's pickled list of the items stayed in the temporary folder, one more file per stopped prepare."""
    shapes = write_shapes(tmp_path / "shapes", per_class=300)
    out = tmp_path / "shards"
    cmd = [sys.executable, "-m", "train", "prepare", "--data.root", str(shapes), "--out", str(out)]
    cmd += ["--workers", "2", "--chunk_bytes", "4kb", "--data.dedupe", "none"]
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(temp)}
    # with Ctrl-C as a terminal leaves it: a child of a process that ignores SIGINT (a pytest-xdist worker) would
    # ignore it too, and finish
    default_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=default_sigint
    )
    try:
        wait_until(lambda: list(out.glob("train/chunk-*")) or proc.poll() is not None, 180, "the first chunk")
        assert proc.poll() is None, "the prepare finished before it could be stopped: give it more images"
        if stop == signal.SIGINT:
            os.killpg(proc.pid, stop)
        else:
            proc.send_signal(stop)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)

    def none_left() -> bool:
        try:
            os.killpg(proc.pid, 0)  # any process of its session: its workers, LitData's resource tracker
        except ProcessLookupError:
            return True
        return False

    assert proc.returncode == code and f"vit-train prepare: {said}: {out} is not finished" in err, err[-2000:]
    try:
        wait_until(none_left, 10, "no process of the prepare left")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert is_streaming_root(out)  # and fit says it did not finish
    assert not list(temp.iterdir())  # LitData's list of the items (70 kB a thousand), its cache folders


def test_an_out_holding_only_what_a_fresh_disk_or_an_earlier_stopped_prepare_holds_is_written_into(tmp_path: Path):
    """A mount point's lost+found, a .DS_Store, or the chunks of a prepare stopped before its first index by a
    version that wrote no mark were refused as "files vit-train prepare did not write"."""
    for held in ("lost+found/", ".DS_Store", "train/chunk-0-0.bin"):
        out = tmp_path / held.split("/")[0].replace(".", "_") / "out"
        if held.endswith("/"):
            (out / held).mkdir(parents=True)
        else:
            (out / held).parent.mkdir(parents=True)
            (out / held).write_bytes(b"")
        check_out_fresh(str(out))  # no refusal
    (tmp_path / "other" / "train").mkdir(parents=True)
    (tmp_path / "other" / "train" / "notes.txt").write_text("not a chunk")
    with pytest.raises(ValueError, match="holds files vit-train prepare did not write"):
        check_out_fresh(str(tmp_path / "other"))


def test_prepare_never_writes_through_a_link_planted_in_its_out(tmp_path: Path):
    """Whoever could write a shared --out could plant `.vitscope.json.partial` as a link: prepare wrote the dataset's
    metadata into the link's target, then renamed the link to vitscope.json (every file prepare writes in --out goes
    through `_write_text`)."""
    from train.shards import META, _write_text

    out, victim = tmp_path / "shards", tmp_path / "precious.txt"
    out.mkdir()
    victim.write_text("keep me\n")
    (out / f".{META}.partial").symlink_to(victim)
    _write_text(str(out), META, "{}")
    assert victim.read_text() == "keep me\n" and (out / META).read_text() == "{}"
    assert not any(p.is_symlink() for p in out.iterdir())


def test_a_second_prepare_into_an_out_being_written_is_refused_before_any_work(tmp_path: Path, monkeypatch):
    """Two prepares into one --out both ended with exit 0 and left an index.json with no chunks, or the other's chunks
    beside it: a dataset fit could not read. The second is now refused at once; the lock goes with the first."""
    import train.shards
    from train.prepare_out import holding_out

    root, out, refusals = write_shapes(tmp_path / "images", per_class=5), tmp_path / "shards", []

    def second_prepare_while_scanning(*args, **kwargs):  # the first prepare holds --out by now
        with pytest.raises(ValueError) as refused:
            prepare(str(root), str(out), workers=1, dedupe="none")
        refusals.append(str(refused.value))
        raise KeyboardInterrupt("the first stops here: the rest of a prepare is tested elsewhere")

    monkeypatch.setattr(train.shards, "scan_folder", second_prepare_while_scanning)
    with pytest.raises(KeyboardInterrupt):
        prepare(str(root), str(out), workers=1, dedupe="none")
    assert refusals == [
        f"--out {out} is being written by another vit-train prepare: wait for it to end, or give another --out"
    ]
    with holding_out(str(out)):  # let go with the first
        pass


@pytest.mark.parametrize("kind", ["a file", "in a file", "a link to nothing", "read-only"])
def test_an_out_that_cannot_be_written_is_refused_before_the_scan(tmp_path: Path, capsys, monkeypatch, kind):
    """Each was found after the whole scan and decode, as "[Errno 20] Not a directory: 'afile/vitscope.json'", "[Errno
    17] File exists" or "[Errno 30] Read-only file system", in a line that did not say it was about --out."""
    import train.shards

    monkeypatch.setattr(train.shards, "scan_folder", lambda *a, **k: pytest.fail("scanned before refusing --out"))
    (tmp_path / "afile").write_text("")
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    (tmp_path / "locked").mkdir(mode=0o555)
    if kind == "read-only" and os.access(tmp_path / "locked", os.W_OK):
        pytest.skip("this user (root) can write a read-only folder")
    out = {"a file": "afile", "in a file": "afile/shards", "a link to nothing": "gone", "read-only": "locked/s"}[kind]
    with pytest.raises(SystemExit) as e:
        main(["prepare", "--data.root", str(tmp_path / "images"), "--out", str(tmp_path / out)])
    said = {"a file": "is not a folder", "in a file": "is not a folder", "a link to nothing": "which does not exist",
            "read-only": "cannot be written"}[kind]  # fmt: skip
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"vit-train prepare: --out {tmp_path / out} ") and said in err, err
    assert len(err.splitlines()) == 1 and not (tmp_path / "nowhere").exists()


def test_a_full_disk_while_chunks_are_written_is_one_line(tmp_path: Path, capsys, monkeypatch):
    """LitData reports a chunk its worker could not write as a RuntimeError holding the worker's traceback as text: a
    full disk ended the command in some 70 lines. (Tested by hand on a 24 kB tmpfs.)"""
    import litdata

    def disk_full(*args, **kwargs):
        raise RuntimeError(
            'We found the following error Traceback (most recent call last):\n  File "writer.py", line 752\n'
            "OSError: [Errno 28] No space left on device\nThe above exception was the direct cause of ...\n"
        )

    monkeypatch.setattr(litdata, "optimize", disk_full)
    out = tmp_path / "shards"
    with pytest.raises(SystemExit) as e:
        main(["prepare", "--data.root", str(write_shapes(tmp_path / "images", per_class=5)), "--out", str(out),
              "--workers", "1", "--data.dedupe", "none"])  # fmt: skip
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.startswith(f"vit-train prepare: no space left on a disk while writing {out} (OSError: [Errno 28] No ")
    assert err.endswith("free space on the disk of --out and of $TMPDIR, where LitData stages each chunk, and run the "
                        "same command again\n")  # fmt: skip


def test_an_out_on_a_file_system_without_locks_is_written_with_a_warning(tmp_path: Path, monkeypatch, caplog):
    """Some network file systems refuse a lock (ENOLCK): prepare, which wrote there before it took one, goes on."""
    import errno
    import logging

    import train.prepare_out

    def no_locks(fd, busy, wait_s=0.2):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(train.prepare_out, "lock_folder", no_locks)
    with caplog.at_level(logging.WARNING), train.prepare_out.holding_out(str(tmp_path / "out")):
        (tmp_path / "out" / "chunk").write_text("written")
    assert "cannot be locked on its file system" in caplog.text and (tmp_path / "out" / "chunk").exists()
