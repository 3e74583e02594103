"""`--data.corrections FILE`: relabel or leave out images without touching the user's folder."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tests.helpers import write_shapes
from train.corrections import load_corrections
from train.folder_scan import scan_folder


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return write_shapes(tmp_path / "shapes", per_class=6)


def _csv(path: Path, rows: list[tuple[str, str]]) -> Path:
    path.write_text("path,label\n" + "".join(f"{p},{y}\n" for p, y in rows))
    return path


def _everything(scan) -> dict[str, str]:
    return {p: scan.classes[y] for p, y in scan.train + scan.val + scan.calib}


def test_corrections_relabel_and_leave_out_images_before_the_split(folder: Path, tmp_path: Path):
    moved, dropped = folder / "bar" / "000.png", folder / "square" / "002.png"
    file = _csv(tmp_path / "fix.csv", [(str(moved), "column"), ("square/002.png", "")])  # absolute and relative
    scan = scan_folder(folder, 0.25, seed=0, corrections=str(file))
    labels = _everything(scan)
    assert labels[str(moved)] == "column"
    assert str(dropped) not in labels
    assert len(labels) == 17
    assert scan.corrections == {"file": str(file.resolve()), "relabelled": 1, "left_out": 1, "not_found": 0}
    split = scan.to_split_dict()
    assert split["corrections"] == str(file.resolve())
    assert scan_folder(folder, 0.25, seed=0).to_split_dict()["corrections"] is None


def test_a_label_that_is_not_a_class_is_refused_in_one_line(folder: Path, tmp_path: Path):
    file = _csv(tmp_path / "fix.csv", [("bar/000.png", "column"), ("bar/001.png", "colum")])
    with pytest.raises(ValueError) as e:
        scan_folder(folder, corrections=str(file))
    message = str(e.value)
    assert "\n" not in message
    assert "line 3" in message and "'colum'" in message and "column" in message  # where, what, the choices
    assert "leave the label empty" in message


def test_a_file_without_a_path_and_label_header_is_refused(folder: Path, tmp_path: Path):
    file = tmp_path / "fix.csv"
    file.write_text("bar/000.png,column\n")
    with pytest.raises(ValueError, match="path,label"):
        scan_folder(folder, corrections=str(file))


def test_a_missing_corrections_file_is_refused(folder: Path, tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="corrections file not found"):
        scan_folder(folder, corrections=str(tmp_path / "nope.csv"))


def test_a_path_not_in_the_folder_is_warned_about_and_counted(folder: Path, tmp_path: Path, caplog):
    file = _csv(tmp_path / "fix.csv", [("bar/gone.png", ""), ("bar/000.png", "square")])
    with caplog.at_level(logging.WARNING, logger="train.corrections"):
        scan = scan_folder(folder, 0.25, seed=0, corrections=str(file))
    assert scan.corrections["not_found"] == 1 and scan.corrections["relabelled"] == 1
    assert any("gone.png" in r.getMessage() for r in caplog.records)


def test_the_last_row_for_a_path_wins(folder: Path, tmp_path: Path):
    rows = [("bar/000.png", ""), ("bar/000.png", "square")]  # left out, then relabelled: the later decision holds
    assert load_corrections(_csv(tmp_path / "fix.csv", rows), folder, ["bar", "column", "square"]) == {
        str((folder / "bar" / "000.png").resolve()): "square"
    }


def test_leaving_out_every_image_of_a_class_is_refused(folder: Path, tmp_path: Path):
    file = _csv(tmp_path / "fix.csv", [(f"bar/{i:03d}.png", "") for i in range(6)])
    with pytest.raises(ValueError, match="'bar'.*no images"):
        scan_folder(folder, corrections=str(file))


def test_corrections_apply_to_the_users_own_train_and_val(tmp_path: Path):
    root = tmp_path / "tv"
    write_shapes(root / "train", per_class=4, seed=1)
    write_shapes(root / "val", per_class=2, seed=2)
    file = _csv(tmp_path / "fix.csv", [("val/bar/000.png", "square"), ("train/column/001.png", "")])
    scan = scan_folder(root, corrections=str(file))
    val = {p: scan.classes[y] for p, y in scan.val}
    assert val[str(root / "val" / "bar" / "000.png")] == "square"
    assert str(root / "train" / "column" / "001.png") not in _everything(scan)
    assert json.loads(json.dumps(scan.to_split_dict()))["corrections"] == str(file.resolve())
