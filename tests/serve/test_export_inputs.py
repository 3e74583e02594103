"""vit-export given paths and options a pipeline gets wrong: each is one line naming the real cause, exit 2, and an
export that stops leaves no folder of its own behind."""

from __future__ import annotations

import logging
import os
import warnings
import zipfile

import pytest

torch = pytest.importorskip("torch")

from serve.export import targets  # noqa: E402  (after the skip: the [serve]-only venv has no torch)
from serve.export.cli import main  # noqa: E402


def test_a_link_loop_among_a_folders_checkpoints_is_no_checkpoint_and_the_one_asked_for_is_not_there(
    tmp_path, capsys, no_export
):
    """`Path.resolve` raised on the loop, and the export said the weights did not fit the network."""
    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / "b.ckpt").symlink_to("a.ckpt")
    (folder / "a.ckpt").symlink_to("b.ckpt")
    assert main([str(folder / "best.ckpt"), "-o", str(tmp_path / "m.onnx")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"vit-export: checkpoint not found: {folder / 'best.ckpt'}", err
    assert main([str(folder), "-o", str(tmp_path / "m.onnx")]) == 2
    assert "is a folder with no usable .ckpt file" in capsys.readouterr().err


def test_a_checkpoint_that_is_a_device_or_has_a_name_too_long_is_said_as_such(tmp_path, capsys, no_export):
    """/dev/null was "checkpoint not found", and a name over the file system's limit "could not write the model"."""
    assert main(["/dev/null", "-o", str(tmp_path / "m.onnx")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "vit-export: /dev/null is not a regular file: give the .ckpt file vit-train wrote", err
    long = tmp_path / ("a" * 300 + ".ckpt")
    assert main([str(long), "-o", str(tmp_path / "m.onnx")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"vit-export: cannot read the checkpoint {long}: File name too long"), err
    assert "could not write" not in err


def test_a_checkpoint_edited_to_more_patches_than_a_model_runs_is_refused_before_its_network_is_built(
    own_run, tmp_path, capsys, no_export, monkeypatch
):
    """An img_size of 100,000 in the model_config allocated 40 GB for the position table before anything said no."""
    checkpoint = own_run / "checkpoints" / "best.ckpt"
    ckpt = torch.load(checkpoint, map_location="cpu", weights_only=True)
    ckpt["vitscope"]["model_config"]["img_size"] = 1040  # 130 x 130 patches of 8: 16,900, over 16,384
    torch.save(ckpt, checkpoint)
    assert main([str(checkpoint), "-o", str(tmp_path / "m.onnx")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"vit-export: {checkpoint}: its 'vitscope' model_config cannot build a network"), err
    assert "1040 x 1040 at patch 8 is 16,900 patches, over the 16,384 a model runs" in err


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--no-calibration", "--conformal", "aps"], "--conformal"),
        (["--no-calibration", "--class-conditional"], "--class-conditional"),
        (["--no-calibration", "--ood-score", "energy"], "--ood-score"),
        (["--no-calibration", "--calibrate", "DIR"], "--calibrate"),
        (["--triton-name", "alpha"], "--triton-name"),
    ],
)
def test_options_another_option_would_leave_unused_are_refused(own_run, tmp_path, capsys, no_export, extra, says):
    """`--no-calibration --conformal aps` exported an uncalibrated file with exit 0 and no word of the option."""
    extra = [str(tmp_path) if e == "DIR" else e for e in extra]
    with pytest.raises(SystemExit) as exited:
        main([str(own_run / "checkpoints" / "best.ckpt"), "-o", str(tmp_path / "m.onnx"), *extra])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and says in err.splitlines()[-1] and "Traceback" not in err, err
    assert "would change nothing" in err


def test_an_export_stopped_before_it_writes_leaves_none_of_the_folders_it_made(own_run, tmp_path, capsys, monkeypatch):
    """The folders of -o and --triton-repo were made before the export, and stayed after "nothing was written"."""

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(targets, "build", interrupted)
    (tmp_path / "kept").mkdir()
    out, repo = tmp_path / "kept" / "new" / "deep" / "m.onnx", tmp_path / "kept" / "repo" / "models"
    assert main([str(own_run / "checkpoints" / "best.ckpt"), "-o", str(out), "--triton-repo", str(repo)]) == 130
    assert "nothing was written" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path / "kept")) == []  # the folder that was there stays, empty as it was


def test_an_output_under_a_file_says_that_file_is_no_folder(own_run, tmp_path, capsys, no_export):
    """It said "cannot write to afile: File exists"."""
    (tmp_path / "afile").write_text("mine")
    assert main([str(own_run / "checkpoints" / "best.ckpt"), "-o", str(tmp_path / "afile" / "m.onnx")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{tmp_path / 'afile'} is a file, not a folder" in err, err
    assert (tmp_path / "afile").read_text() == "mine"


@pytest.mark.parametrize("kind", ["folder", "empty", "checkpoint"])
def test_a_model_for_the_page_that_is_a_folder_empty_or_a_checkpoint_is_said_as_such(tmp_path, capsys, kind):
    """As `vit-serve` and `vit-predict` say it: a checkpoint renamed .onnx was "not a readable ONNX file
    (DecodeError)" here."""
    model = tmp_path / "m.onnx"
    if kind == "folder":
        model.mkdir()
    elif kind == "empty":
        model.write_bytes(b"")
    else:  # torch.save writes a zip archive
        with zipfile.ZipFile(model, "w") as z:
            z.writestr("archive/data.pkl", b"not a model")
    code = main([str(model), "--web", str(tmp_path / "site")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in err, err
    said = {
        "folder": f"{model} is a folder, not a model file",
        "empty": f"{model} is empty (0 bytes)",
        "checkpoint": f"{model} is a zip archive, as a PyTorch or Lightning checkpoint is, not an ONNX file",
    }[kind]
    assert said in err, err
    assert not (tmp_path / "site").exists()


@pytest.mark.parametrize("kind", ["folder", "dangling_link", "fifo"])
def test_a_split_json_that_is_no_file_is_refused_not_taken_for_no_split(own_run, tmp_path, capsys, no_export, kind):
    """A split.json that was a folder was passed over as absent: the gate ran on random images, with exit 0. A FIFO
    must be refused unread: reading one waits for a writer for ever."""
    split = own_run / "split.json"
    split.unlink()
    {"folder": split.mkdir, "dangling_link": lambda: split.symlink_to(tmp_path / "gone.json"),
     "fifo": lambda: os.mkfifo(split)}[kind]()  # fmt: skip
    assert main([str(own_run / "checkpoints" / "best.ckpt"), "-o", str(tmp_path / "m.onnx")]) == 2
    err = capsys.readouterr().err.strip()
    said = {"folder": "a folder", "dangling_link": "a link to nothing", "fifo": "not a regular file"}[kind]
    assert err.startswith(f"vit-export: {split} is {said}, not the split.json vit-train writes"), err


def test_an_output_name_refused_after_its_folder_was_made_leaves_no_folder(own_run, tmp_path, capsys, no_export):
    """The folder check made the folder, then refused the name (too long for its temporary): the folder stayed."""
    out = tmp_path / "new" / "deeper" / ("a" * 250 + ".onnx")
    assert main([str(own_run / "checkpoints" / "best.ckpt"), "-o", str(out)]) == 2
    assert "the name is too long" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_an_export_whose_folder_another_exports_failure_removed_still_writes(tiny_onnx, tmp_path):
    """Export A made artifacts/ and failed, removing it, while export B, started into it meanwhile, ran: B then
    failed at its very end ("No such file or directory"), after its whole export."""
    import onnx

    from serve.export import preflight
    from serve.export.cli import _write_checked

    out_a, out_b = tmp_path / "artifacts" / "a.onnx", tmp_path / "artifacts" / "b.onnx"
    with pytest.raises(KeyboardInterrupt), preflight.writable_folders(out_a, None):
        with preflight.writable_folders(out_b, None):  # B starts: the folder is there, and not B's
            pass
        raise KeyboardInterrupt  # A stops: the folder it made goes
    assert not out_b.parent.exists()
    with _write_checked(onnx.load(str(tiny_onnx)), out_b, lambda path: None):
        pass
    assert out_b.is_file()


def test_the_random_image_warning_is_a_log_line_not_a_python_warning(own_run, tmp_path, caplog, monkeypatch):
    """It came out as Python's warning: the source file and line, "UserWarning:", and the line of code under it
    (the command prints its log lines as they are, on stderr)."""

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(targets, "build", interrupted)
    (own_run / "split.json").unlink()
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        checkpoint = own_run / "checkpoints" / "best.ckpt"
        assert main([str(checkpoint), "-o", str(tmp_path / "m.onnx"), "--no-calibration"]) == 130
    assert not [w for w in caught if "random images" in str(w.message)]
    said = [r.getMessage() for r in caplog.records if "random images" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("no validation images found (no split.json"), said
