"""What vit-export refuses before the slow export starts, in one line and exit 2: an output that would replace the
checkpoint or is a folder, options that would leave the parity gate on random images, and a checkpoint whose
metadata does not fit its weights. The side reports in the run's folder are best effort: the model is the product."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import shutil
import signal
import stat
from pathlib import Path

import pytest
from PIL import Image

torch = pytest.importorskip("torch")

from serve.export import targets  # noqa: E402  (after the skip: the [serve]-only venv has no torch)
from serve.export.cli import main  # noqa: E402
from tests.helpers import CLASS_NAMES  # noqa: E402


def _refused(capsys, argv: list[str]) -> str:
    """Run vit-export with `argv`; it must answer 2 with one line and no traceback. Returns that line."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("vit-export: ") and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("spelling", ["same", "dotted", "symlink"])
def test_an_output_that_is_the_checkpoint_itself_is_refused_and_the_checkpoint_kept(
    own_run, capsys, no_export, spelling
):
    checkpoint = own_run / "checkpoints" / "best.ckpt"
    before = _sha256(checkpoint)
    output = {
        "same": checkpoint,
        "dotted": own_run / "checkpoints" / ".." / "checkpoints" / "best.ckpt",
        "symlink": own_run / "best.onnx",
    }[spelling]
    if spelling == "symlink":
        output.symlink_to(checkpoint)
    line = _refused(capsys, [str(checkpoint), "-o", str(output)])
    assert "is the checkpoint itself" in line and "best.onnx" in line  # and where to write instead
    assert _sha256(checkpoint) == before


def test_an_output_that_is_a_folder_is_refused_before_the_export(own_run, tmp_path, capsys, no_export):
    folder = tmp_path / "artifacts"
    folder.mkdir()
    line = _refused(capsys, [str(own_run / "checkpoints" / "best.ckpt"), "-o", str(folder)])
    assert f"-o {folder} is a folder" in line and str(folder / "model.onnx") in line
    assert list(folder.iterdir()) == []


@pytest.mark.parametrize("other", ["split.json", "checkpoints/last.ckpt"])
def test_an_output_that_would_replace_a_file_that_is_no_model_is_refused(own_run, capsys, no_export, other):
    """-o split.json or -o last.ckpt replaced the run's split or its other checkpoint with the model."""
    checkpoint, target = own_run / "checkpoints" / "best.ckpt", own_run / other
    if not target.exists():
        shutil.copy(checkpoint, target)
    before = _sha256(target)
    line = _refused(capsys, [str(checkpoint), "-o", str(target)])
    assert "is not an ONNX model" in line and _sha256(target) == before


@pytest.mark.parametrize("link", [False, True], ids=["fifo", "link_to_a_fifo"])
def test_an_output_that_is_no_regular_file_is_refused_and_left_as_it_is(own_run, tmp_path, capsys, no_export, link):
    """-o /dev/null (as root), a FIFO or a link to one was replaced by a regular file: the rename took its place."""
    fifo = tmp_path / "pipe.onnx"
    os.mkfifo(fifo)
    output = fifo
    if link:
        output = tmp_path / "link.onnx"
        output.symlink_to(fifo)
    line = _refused(capsys, [str(own_run / "checkpoints" / "best.ckpt"), "-o", str(output)])
    assert f"-o {output} is a FIFO" in line and "not a regular file" in line
    assert stat.S_ISFIFO(fifo.stat().st_mode) and output.is_symlink() == link


def _edited(checkpoint: Path, folder: Path, edit, whole: bool = False) -> Path:
    """A copy of `checkpoint` (in a run folder with its split) with `edit(meta)` applied to its "vitscope" entry
    (`whole`: `edit(checkpoint)` to the checkpoint itself)."""
    ckpt = torch.load(checkpoint, map_location="cpu", weights_only=True)
    ckpt["vitscope"] = copy.deepcopy(ckpt["vitscope"])
    edit(ckpt if whole else ckpt["vitscope"])
    out = folder / "checkpoints" / "best.ckpt"
    torch.save(ckpt, out)
    return out


EDITS = {  # what was done to the checkpoint's metadata -> what the one line must say
    "another_architecture": (lambda m: m["model_config"].update(embed_dim=48), "weights do not fit"),
    "no_model_config": (lambda m: m.pop("model_config"), "no 'model_config' entry"),
    "unknown_argument": (lambda m: m["model_config"].update(bogus_kw=1), "unexpected keyword argument 'bogus_kw'"),
    # a ZeroDivisionError traceback, exit 1: the code of a failed parity gate
    "zero_patch_size": (lambda m: m["model_config"].update(patch_size=0), "model_config cannot build a network"),
    "no_preprocess": (lambda m: m.pop("preprocess"), "no 'preprocess' entry"),
    "fewer_names": (lambda m: m.update(class_names=["a", "b"]), "2 class names, but its head has 4 outputs"),
    "more_names": (lambda m: m.update(class_names=[*CLASS_NAMES, "extra"]), "5 class names, but its head has 4"),
    "no_names": (lambda m: m.pop("class_names"), "no 'class_names' entry"),
    "repeated_name": (lambda m: m.update(class_names=["a", "b", "a", "c"]), "names 'a' more than once"),
    "empty_name": (lambda m: m.update(class_names=["a", "", "b", "c"]), "class name 2 of 4 is empty"),
    "name_not_text": (lambda m: m.update(class_names=["a", 1, "b", "c"]), "class name 2 of 4 is not text"),
    # exported at timm's default 224 x 224 for a 32 x 32 network, with exit 0
    "preprocess_not_mapping": (lambda m: m.update(preprocess="abc"), "'vitscope.preprocess' entry is a str, not"),
    "preprocess_bad_mean": (lambda m: m["preprocess"].update(mean="abc"), "'preprocess' entry cannot be read"),
}
WHOLE_EDITS = {  # edits of the checkpoint itself -> what the one line must say
    "metadata_not_mapping": (lambda c: c.update(vitscope="abc"), "'vitscope' entry is a str, not a mapping"),
    "weights_not_mapping": (lambda c: c.update(state_dict=[1]), "'state_dict' entry is a list, not a mapping"),
}


def test_an_export_stopped_by_sigterm_says_so_in_one_line_and_exits_143(own_run, tmp_path, capsys, monkeypatch):
    """`timeout` or a pipeline's stop killed the export mid-write, leaving a hidden temporary by the output; Ctrl-C,
    handled the same way now, printed a traceback."""

    def stopped(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # raised at the next bytecode, as the signal arrives
        raise AssertionError("SIGTERM did not stop the export")

    monkeypatch.setattr(targets, "build", stopped)
    before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "out" / "model.onnx"
    assert main([str(own_run / "checkpoints" / "best.ckpt"), "-o", str(out)]) == 143
    err = capsys.readouterr().err
    assert err.startswith("vit-export: terminated: nothing was written") and "Traceback" not in err, err
    assert not out.exists() and signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("case", [*EDITS, *WHOLE_EDITS])
def test_a_checkpoint_whose_metadata_does_not_fit_its_weights_is_refused_in_one_line(
    own_run, tmp_path, capsys, no_export, case
):
    edit, says = EDITS[case] if case in EDITS else WHOLE_EDITS[case]
    checkpoint = _edited(own_run / "checkpoints" / "best.ckpt", own_run, edit, whole=case in WHOLE_EDITS)
    out = tmp_path / "out" / "model.onnx"
    line = _refused(capsys, [str(checkpoint), "-o", str(out)])
    assert says in line and str(checkpoint) in line
    assert not out.parent.exists()  # refused before the output folder was made


@pytest.mark.parametrize(
    "option, says",
    [
        (["--parity-samples", "0"], "--parity-samples must be at least 1, got 0"),
        (["--parity-samples", "-5"], "--parity-samples must be at least 1, got -5"),
        (["--val-dir", "/nonexistent"], "--val-dir /nonexistent: no such folder"),
        (["--calibrate", "/nonexistent"], "--calibrate /nonexistent: no such folder"),
    ],
    ids=["no_parity_images", "negative_parity_images", "missing_val_dir", "missing_calibrate_dir"],
)
def test_options_that_would_leave_the_parity_gate_or_calibration_without_images_are_refused_before_the_export(
    own_run, tmp_path, capsys, no_export, option, says
):
    out = tmp_path / "out" / "model.onnx"
    line = _refused(capsys, [str(own_run / "checkpoints" / "best.ckpt"), "-o", str(out), *option])
    assert line.startswith(f"vit-export: {says}")
    assert not out.parent.exists()


def test_a_split_whose_validation_images_are_all_unreadable_is_refused_before_the_export(
    own_run, tmp_path, capsys, no_export
):
    """The parity gate fell back to random noise, passed, and the export went on, exit 0."""
    split = json.loads((own_run / "split.json").read_text())
    for i, entry in enumerate(split["val"]):
        entry["path"] = str(tmp_path / f"gone-{i}.png")  # the images moved or deleted since the run
    (tmp_path / "gone-0.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    (own_run / "split.json").write_text(json.dumps(split))
    out = tmp_path / "out" / "model.onnx"
    line = _refused(capsys, [str(own_run / "checkpoints" / "best.ckpt"), "-o", str(out)])
    assert f"none of the {len(split['val'])} parity images of {own_run / 'split.json'} could be read" in line
    assert not out.exists()


def test_a_val_dir_without_images_is_refused_before_the_export(own_run, tmp_path, capsys, no_export):
    """The parity gate fell back to random images, and passed, on a --val-dir whose class folders were empty."""
    (tmp_path / "val" / "top_left").mkdir(parents=True)
    (tmp_path / "val" / "top_left" / "notes.txt").write_text("not an image")
    out = tmp_path / "out" / "model.onnx"
    argv = [str(own_run / "checkpoints" / "best.ckpt"), "-o", str(out), "--val-dir", str(tmp_path / "val")]
    assert "holds no image files" in _refused(capsys, argv) and not out.parent.exists()


def test_a_calibration_folder_of_other_classes_is_refused_before_the_export(own_run, tmp_path, capsys, no_export):
    (tmp_path / "calib" / "cats").mkdir(parents=True)
    out = tmp_path / "out" / "model.onnx"
    line = _refused(
        capsys, [str(own_run / "checkpoints" / "best.ckpt"), "-o", str(out), "--calibrate", str(tmp_path / "calib")]
    )
    assert "folder 'cats' is not one of the model's classes" in line


def test_a_triton_name_changed_to_fit_a_folder_is_said(own_run, tmp_path, caplog, no_export):
    """`modèle` became `mod_le` without a word, and clients asked Triton for a model it did not have."""
    argv = [str(own_run / "checkpoints" / "best.ckpt"), "-o", str(tmp_path / "model.onnx")]
    with caplog.at_level(logging.WARNING, logger="serve.export.triton"), pytest.raises(AssertionError, match="export"):
        main([*argv, "--triton-repo", str(tmp_path / "models"), "--triton-name", "modèle"])
    assert "the Triton model is named 'mod_le' (from 'modèle'" in caplog.text


def test_a_calibration_folder_of_too_few_images_is_refused_before_the_export(own_run, tmp_path, capsys, no_export):
    """It was refused after the whole export (about 25 s on the sample), the model built for nothing."""
    for name in CLASS_NAMES[:2]:
        (tmp_path / "calib" / name).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (32, 32), (i, 0, 0)).save(tmp_path / "calib" / name / f"{i}.png")
    out = tmp_path / "out" / "model.onnx"
    argv = [str(own_run / "checkpoints" / "best.ckpt"), "-o", str(out), "--calibrate", str(tmp_path / "calib")]
    assert "6 image files, and calibration needs at least 20" in _refused(capsys, argv)


def test_a_calibration_folder_whose_images_mostly_do_not_decode_is_refused_before_the_export(
    own_run, tmp_path, capsys, no_export
):
    """Enough files, too few of them images: refused after the whole export, the model built for nothing."""
    for name in CLASS_NAMES[:2]:
        (tmp_path / "calib" / name).mkdir(parents=True)
        for i in range(12):
            path = tmp_path / "calib" / name / f"{i}.png"
            path.write_bytes(b"\x89PNG\r\n\x1a\n cut short") if i >= 4 else Image.new("RGB", (32, 32)).save(path)
    out = tmp_path / "out" / "model.onnx"
    argv = [str(own_run / "checkpoints" / "best.ckpt"), "-o", str(out), "--calibrate", str(tmp_path / "calib")]
    assert "8 of its 24 image files decode, and calibration needs at least 20" in _refused(capsys, argv)


def test_a_calibration_folder_of_one_class_is_refused_before_the_export(own_run, tmp_path, capsys, no_export):
    """Calibrated on 183 images of one class: ECE 0.00 %, overconfident scores, and that class always 'unknown'."""
    (tmp_path / "calib" / "top_left").mkdir(parents=True)
    for i in range(25):
        Image.new("RGB", (32, 32), (i, 0, 0)).save(tmp_path / "calib" / "top_left" / f"{i}.png")
    out = tmp_path / "out" / "model.onnx"
    argv = [str(own_run / "checkpoints" / "best.ckpt"), "-o", str(out), "--calibrate", str(tmp_path / "calib")]
    assert "its images are of one class (top_left)" in _refused(capsys, argv)


@pytest.mark.parametrize("slot", ["version_is_a_file", "model_is_a_folder", "o_is_the_version"])
def test_a_triton_slot_the_export_would_fail_on_or_overwrite_is_refused_before_the_export(
    own_run, tmp_path, capsys, no_export, slot
):
    """A version 1 that was a file failed after labels.txt and config.pbtxt were replaced (new labels beside the old
    model); -o naming Triton's own model file replaced the logits-only graph with the full one, exit 0."""
    repo, out = tmp_path / "models", tmp_path / "out" / "model.onnx"
    (repo / "model").mkdir(parents=True)
    if slot == "version_is_a_file":
        (repo / "model" / "1").write_text("")
    elif slot == "model_is_a_folder":
        (repo / "model" / "1" / "model.onnx").mkdir(parents=True)
    else:
        out = repo / "model" / "1" / "model.onnx"
    line = _refused(capsys, [str(own_run / "checkpoints" / "best.ckpt"), "-o", str(out), "--triton-repo", str(repo)])
    assert ("is the model file --triton-repo writes" if slot == "o_is_the_version" else "is there but is no") in line


@pytest.mark.parametrize("name", ["top\rleft", "top\u2028left", "top\x1cleft", "top\udcffleft"])
def test_class_names_labels_txt_cannot_hold_are_refused_before_the_export(own_run, tmp_path, capsys, no_export, name):
    """A server splits labels.txt at any line break and refused the model; a name that is not UTF-8 failed after
    the export, and left an empty model folder in the repository."""
    names = [name, *CLASS_NAMES[1:]]
    checkpoint = _edited(own_run / "checkpoints" / "best.ckpt", own_run, lambda m: m.update(class_names=names))
    split = json.loads((own_run / "split.json").read_text())
    (own_run / "split.json").write_text(json.dumps({**split, "classes": names}))
    out, repo = tmp_path / "out" / "model.onnx", tmp_path / "models"
    line = _refused(capsys, [str(checkpoint), "-o", str(out), "--triton-repo", str(repo)])
    assert f"--triton-repo: class name 1 of 4, {name!r}, " in line and "export without --triton-repo" in line
    assert not out.parent.exists() and not repo.exists()


def test_a_triton_model_with_another_version_is_refused_before_the_export(own_run, tmp_path, capsys, no_export):
    """Version 1 was rewritten beside a version 2 rolled out by hand, which Triton serves in its place."""
    folder = tmp_path / "models" / "tiny"
    for version in ("1", "2", "02"):  # 02 is no version to Triton
        (folder / version).mkdir(parents=True)
        (folder / version / "model.onnx").write_bytes(b"")
    out = tmp_path / "tiny.onnx"
    line = _refused(
        capsys, [str(own_run / "checkpoints" / "best.ckpt"), "-o", str(out), "--triton-repo", str(folder.parent)]
    )
    assert f"--triton-repo: {folder} holds version 2 beside the version 1" in line and "--triton-name" in line
    assert sorted(p.name for p in folder.iterdir()) == ["02", "1", "2"] and not out.exists()


SPLITS = {  # what another run's split.json beside the checkpoint holds -> what the one line must say
    "other_classes": (lambda d: d.update(classes=[str(i) for i in range(10)]), "is another run's: its classes ['0'"),
    "label_out_of_range": (lambda d: d["calib"][0].update(label=7), "labels an image 7, not one of the checkpoint's"),
    "not_a_split": (lambda d: d.update(calib="calib.txt"), "is not a split.json that vit-train writes"),
}


@pytest.mark.parametrize("case", SPLITS)
def test_another_runs_split_beside_the_checkpoint_is_refused_before_the_export(
    own_run, tmp_path, capsys, no_export, case
):
    """The parity gate and the calibration ran on another run's split: a wrong temperature, or an IndexError."""
    edit, says = SPLITS[case]
    split = json.loads((own_run / "split.json").read_text())
    edit(split)
    (own_run / "split.json").write_text(json.dumps(split))
    out = tmp_path / "out" / "model.onnx"
    line = _refused(capsys, [str(own_run / "checkpoints" / "best.ckpt"), "-o", str(out)])
    assert f"{own_run / 'split.json'} " in line and says in line and "--val-dir DIR and --calibrate DIR" in line
    assert not out.parent.exists()


def test_calibration_reports_the_run_folder_cannot_take_are_a_warning_and_the_calibration_is_kept(
    own_run, tiny_onnx, tmp_path, caplog
):
    import onnx

    from serve.export import calibrate as calib
    from train.checkpoint_format import load_network

    # root ignores permissions, so the run's reports/ is made unwritable by what it is: a file
    (own_run / "reports").write_text("not a folder")
    checkpoint = own_run / "checkpoints" / "best.ckpt"
    _, meta = load_network(checkpoint)
    model = onnx.load(tiny_onnx)  # the graph the export built: calibration runs it
    with caplog.at_level(logging.WARNING, logger="serve.export"):
        entry, write_reports = calib.for_export(
            model, checkpoint, tmp_path / "model.onnx", meta["class_names"], meta["preprocess"], None, None
        )
        png = write_reports()
    assert entry is not None and entry["temperature"] > 0 and png is None
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert f"could not write the calibration reports to {own_run / 'reports'}" in warning
    assert "the model is written all the same" in warning


def test_the_run_reports_are_written_only_when_the_export_asks_once_its_model_is_in_place(own_run, tiny_onnx, tmp_path):
    """An export stopped after its calibration (a failed parity gate, SIGTERM) said "nothing was written", yet the
    run's calibration.json and reliability.png already described a model that was never written."""
    import onnx

    from serve.export import calibrate as calib
    from train.checkpoint_format import load_network

    checkpoint = own_run / "checkpoints" / "best.ckpt"
    _, meta = load_network(checkpoint)
    entry, write_reports = calib.for_export(
        onnx.load(tiny_onnx), checkpoint, tmp_path / "model.onnx", meta["class_names"], meta["preprocess"], None, None
    )
    assert entry is not None and not (own_run / "reports").exists()
    assert write_reports() == own_run / "reports" / "reliability.png"
    assert json.loads((own_run / "reports" / "calibration.json").read_text())["temperature"] == entry["temperature"]


def test_the_random_image_warning_says_where_it_looked_for_validation_images(own_run, tmp_path, caplog):
    from serve.export import parity
    from serve.runtime.images import Preprocess

    (own_run / "split.json").write_text('{"train": [], "val": [], "calib": []}')
    (tmp_path / "empty").mkdir()
    with caplog.at_level(logging.WARNING, logger="serve.export.parity"):
        sample = parity.validation_sample(
            own_run / "checkpoints" / "best.ckpt", CLASS_NAMES, Preprocess(img_size=(32, 32)), tmp_path / "empty"
        )
    (said,) = [r.getMessage() for r in caplog.records if "no validation images found" in r.getMessage()]
    assert f"in {own_run / 'split.json'}'s val split or {tmp_path / 'empty'}" in said and "no split.json" not in said
    assert sample.source == "random images"


def test_a_run_without_split_json_is_told_to_give_calibrate_and_no_flag_is_claimed(tmp_path):
    """A run on a prepared LitData dataset keeps no split.json: the message told it to train with the default it had
    used, and the report blamed a --no-calibration nobody passed."""
    from serve.export.calibrate import format_report
    from serve.export.preflight import calibration_entries

    checkpoint = tmp_path / "run" / "checkpoints" / "best.ckpt"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_bytes(b"")
    with pytest.raises(ValueError, match=r"split\.json is not there .*--calibrate DIR"):
        calibration_entries(checkpoint, CLASS_NAMES, None)
    assert "--no-calibration" not in format_report(None)


def test_a_val_dir_of_linked_class_folders_is_the_parity_gates_sample(tmp_path):
    """The check followed the links and passed; the gate did not, and ran on random images."""
    from serve.export.parity import validation_sample
    from serve.runtime.images import Preprocess
    from tests.helpers import write_shapes

    real = write_shapes(tmp_path / "real", per_class=2, classes=("bar", "square"))
    for name in ("bar", "square"):
        (tmp_path / "val" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "val" / name).symlink_to(real / name)
    checkpoint = tmp_path / "run" / "checkpoints" / "best.ckpt"  # no split.json beside it
    sample = validation_sample(checkpoint, ["bar", "square"], Preprocess((32, 32), 1.0), tmp_path / "val")
    assert sample.source == str(tmp_path / "val") and sorted(sample.labels.tolist()) == [0, 0, 1, 1]


def test_an_image_size_of_more_patches_than_a_model_runs_is_refused_before_the_export(own_run, capsys, no_export):
    """`--img-size 100000 100000` grew to 21 GB until the kernel killed the export (exit 137)."""
    checkpoint = own_run / "checkpoints" / "best.ckpt"
    line = _refused(capsys, [str(checkpoint), "-o", str(own_run / "m.onnx"), "--img-size", "100000", "100000"])
    assert "--img-size: 100000 x 100000 at patch 8 is 156,250,000 patches, over the 16,384 a model runs" in line, line
    assert "export at a smaller --img-size" in line and not (own_run / "m.onnx").exists()


@pytest.mark.parametrize("where", ["checkpoint", "-o", "--triton-repo", "--web"])
def test_a_path_that_is_a_link_loop_is_one_line(own_run, tmp_path, capsys, no_export, where):
    """Python 3.11's Path.resolve raised "RuntimeError: Symlink loop from ..." (exit 1) for any of them."""
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    loop, checkpoint = str(tmp_path / "a"), str(own_run / "checkpoints" / "best.ckpt")
    argv = {
        "checkpoint": [loop, "-o", str(tmp_path / "m.onnx")],
        "-o": [checkpoint, "-o", loop],
        "--triton-repo": [checkpoint, "-o", str(tmp_path / "m.onnx"), "--triton-repo", loop],
        "--web": [checkpoint, "--web", loop],
    }[where]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and f"{loop} is a symbolic link that loops" in err and "Traceback" not in err, err


def test_a_val_dir_beside_the_runs_own_validation_images_is_said_and_taken_when_they_cannot_be_read(
    own_run, tmp_path, caplog
):
    """The gate ran on the run's split.json and said nothing of the --val-dir given; and when none of the split's
    images could be read, it said "give --val-dir DIR", which it then passed over again."""
    from serve.export.parity import validation_sample
    from serve.runtime.images import Preprocess
    from tests.helpers import write_shapes

    other = write_shapes(tmp_path / "other", per_class=2, classes=("cat", "dog"))
    checkpoint, preprocess = own_run / "checkpoints" / "best.ckpt", Preprocess((32, 32), 1.0)
    with caplog.at_level("WARNING", logger="serve.export.parity"):
        sample = validation_sample(checkpoint, CLASS_NAMES, preprocess, other)
    assert sample.source == str(own_run / "split.json")
    said = f"--val-dir {other} is used only if none of the run's own validation images ({own_run / 'split.json'})"
    assert said in caplog.text, caplog.text
    split = json.loads((own_run / "split.json").read_text())
    gone = [{**e, "path": str(tmp_path / "gone" / Path(e["path"]).name)} for e in split["val"]]
    (own_run / "split.json").write_text(json.dumps({**split, "val": gone}))
    assert validation_sample(checkpoint, CLASS_NAMES, preprocess, other).source == str(other)
    with pytest.raises(ValueError, match="could be read, the first .*: restore them, or give --val-dir DIR"):
        validation_sample(checkpoint, CLASS_NAMES, preprocess)


def test_calibration_images_the_run_trained_on_are_left_out_and_said(own_run, tmp_path, caplog):
    """`--calibrate` on the run's own training folder fitted the temperature, the sets and the threshold on images
    the model had learnt, and said nothing."""
    from serve.export.preflight import calibration_entries
    from tests.helpers import quadrant_images

    images, labels = quadrant_images(30)
    paths = []
    for i, (image, label) in enumerate(zip(images, labels, strict=True)):
        path = tmp_path / "folder" / CLASS_NAMES[label] / f"{i}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(path)
        paths.append({"path": str(path), "label": int(label)})
    split = json.loads((own_run / "split.json").read_text())
    checkpoint = own_run / "checkpoints" / "best.ckpt"
    (own_run / "split.json").write_text(json.dumps({**split, "train": paths[:10]}))
    with caplog.at_level("WARNING", logger="serve.export.preflight"):
        entries, _ = calibration_entries(checkpoint, CLASS_NAMES, tmp_path / "folder")
    assert sorted(str(p) for p, _ in entries) == sorted(e["path"] for e in paths[10:])
    assert "10 of its 30 images are training images of this run" in caplog.text, caplog.text
    (own_run / "split.json").write_text(json.dumps({**split, "train": paths}))  # all of them
    with pytest.raises(ValueError, match=r"0 image files \(30 of 30 left out as the run's training images\)"):
        calibration_entries(checkpoint, CLASS_NAMES, tmp_path / "folder")
    others = [e for e in paths if e["label"] != 0]  # every image but class 0's trained on: one class is left
    (own_run / "split.json").write_text(json.dumps({**split, "train": others}))
    for i in range(30, 50):  # enough images of that class
        Image.fromarray(images[0]).save(tmp_path / "folder" / CLASS_NAMES[0] / f"{i}.png")
    with pytest.raises(ValueError, match=r"its images are of one class \("):
        calibration_entries(checkpoint, CLASS_NAMES, tmp_path / "folder")
