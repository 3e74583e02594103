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


def test_corrections_the_review_wrote_follow_the_folder_to_another_mount_and_none_matching_is_refused(
    folder: Path, tmp_path: Path
):
    """The review wrote absolute paths: with the images mounted elsewhere every row was "not found", and the run
    trained on the uncorrected labels with only a warning."""
    import shutil

    from train.review_store import Decisions

    file = tmp_path / "corrections.csv"
    decisions = Decisions(file, folder, ["bar", "column", "square"])
    decisions.decide(str(folder / "bar" / "000.png"), "column")
    decisions.decide(str(folder / "square" / "002.png"), None)
    mounted = shutil.copytree(folder, tmp_path / "mnt" / "shapes")  # the same images, another path
    scan = scan_folder(mounted, 0.25, seed=0, corrections=str(file))
    assert scan.corrections["relabelled"] == 1 and scan.corrections["left_out"] == 1, scan.corrections
    elsewhere = _csv(tmp_path / "elsewhere.csv", [("/data/pets/cat/1.png", "bar"), ("/data/pets/cat/2.png", "")])
    with pytest.raises(ValueError, match=r"none of the 2 images in .*elsewhere\.csv is in .*--data\.root"):
        scan_folder(mounted, corrections=str(elsewhere))


def test_the_last_row_for_a_path_wins(folder: Path, tmp_path: Path):
    rows = [("bar/000.png", ""), ("bar/000.png", "square")]  # left out, then relabelled: the later decision holds
    assert load_corrections(_csv(tmp_path / "fix.csv", rows), folder, ["bar", "column", "square"]) == {
        str((folder / "bar" / "000.png").resolve()): "square"
    }


def test_leaving_out_every_image_of_a_class_is_refused(folder: Path, tmp_path: Path):
    file = _csv(tmp_path / "fix.csv", [(f"bar/{i:03d}.png", "") for i in range(6)])
    with pytest.raises(ValueError, match="'bar'.*no images"):
        scan_folder(folder, corrections=str(file))


def test_leaving_out_every_val_image_of_a_class_names_val_and_not_the_class_folder(tmp_path: Path):
    """It said "class 'bar' has no images left: keep some of its images, or remove its folder", of a class that kept
    all its training images: removing its folder was the wrong fix."""
    root = tmp_path / "own"
    write_shapes(root / "train", per_class=6)
    write_shapes(root / "val", per_class=2)
    file = _csv(tmp_path / "fix.csv", [("val/bar/000.png", ""), ("val/bar/001.png", "")])
    with pytest.raises(ValueError, match=r"class 'bar' has no images left in val/: keep some of its images in val/$"):
        scan_folder(root, corrections=str(file))
    every = _csv(tmp_path / "all.csv", [(f"{side}/bar/{i:03d}.png", "") for side, n in (("train", 6), ("val", 2))
                                        for i in range(n)])  # fmt: skip
    with pytest.raises(ValueError, match=r"class 'bar' has no images left: keep some of its images, or remove its"):
        scan_folder(root, corrections=str(every))


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


def test_labels_and_paths_are_read_as_written_and_spaces_typed_around_them_are_forgiven(folder: Path, tmp_path: Path):
    """A class folder 'bar ': the trailing space was stripped from its label, and fit refused the review's own
    file ("label 'bar' is not a class"). Spaces a person types after a comma still work."""
    (folder / "bar").rename(folder / "bar ")
    spaced = folder.resolve() / "bar " / "000.png"
    file = tmp_path / "fix.csv"
    file.write_text(f"path,label\n{spaced},bar \ncolumn/000.png, square\n square/001.png ,column\n")
    assert load_corrections(file, folder, ["bar ", "column", "square"]) == {
        str(spaced): "bar ",
        str(folder.resolve() / "column" / "000.png"): "square",
        str(folder.resolve() / "square" / "001.png"): "column",
    }


def _stray_quote(file: Path, folder: Path, rows: int) -> Path:
    """`rows` rows, the third of which opens a quote it never closes (line 4)."""
    paths = [str(folder.resolve() / "column" / f"{i:03d}.png") for i in range(6)]
    lines = ["path,label"] + [f"{paths[i % 6]}{'/.' * 20},square" for i in range(rows)]
    lines[3] = '"' + lines[3]
    file.write_text("\n".join(lines) + "\n")
    return file


@pytest.mark.parametrize("rows", [20, 3000], ids=["rows-swallowed", "field-over-csv-limit"])
def test_a_stray_quote_is_refused_with_the_file_and_line(folder: Path, tmp_path: Path, rows: int):
    """The rows after a `"` became one path, whose image was then "not found" (a warning), or, past 128 kB, the
    csv module raised an error that no caller reported."""
    file = _stray_quote(tmp_path / "fix.csv", folder, rows)
    with pytest.raises(ValueError) as e:
        load_corrections(file, folder, ["bar", "column", "square"])
    message = str(e.value)
    assert message.startswith(f"{file} line 4") and 'quote (")' in message and "\n" not in message


def test_a_corrections_file_over_the_csv_field_limit_stops_fit_in_one_line(folder: Path, tmp_path: Path, capsys):
    from train.cli import main

    file = _stray_quote(tmp_path / "fix.csv", folder, 3000)
    args = ["--data.root", str(folder), "--data.corrections", str(file), "--trainer.default_root_dir", str(tmp_path)]
    with pytest.raises(SystemExit) as e:
        main(["fit", "--config", "configs/sample.yaml", *args])
    err = capsys.readouterr().err  # after Lightning's "Seed set to 0"
    assert e.value.code == 2 and "csv.Error" not in err
    assert err.splitlines()[-1].startswith(f"vit-train: {file} line 4") and 'quote (")' in err


@pytest.mark.parametrize(
    "row, line, says",
    [
        ("bar/000.png\n", 2, "no label"),  # a leave-out is `path,` with the comma
        (",square\n", 2, "no path"),
        ('bar/000.png,"square\nbar/001.png,\n', 2, 'quote (")'),  # over two lines: a stray quote
        ('"bar/000.png,square\nbar/"001.png,column\n', 2, 'quote (")'),  # closed by another, the row swallowed
        ('"bar/000.png,square\nbar/001.png",column\n', 2, 'quote (")'),  # closed before a comma: rows swallowed
    ],
    ids=["no-label-column", "no-path", "label-over-lines", "path-over-lines", "rows-in-one-path"],
)
def test_a_row_that_is_not_path_and_label_is_refused_with_what_to_fix(folder, tmp_path, row, line, says):
    file = tmp_path / "fix.csv"
    file.write_text("path,label\n" + row)
    with pytest.raises(ValueError) as e:
        load_corrections(file, folder, ["bar", "column", "square"])
    assert str(e.value).startswith(f"{file} line {line}") and says in str(e.value) and "\n" not in str(e.value)


def test_corrections_name_images_through_linked_folders_as_the_scan_does(folder: Path, tmp_path: Path):
    """A data root or a class folder that is a link (a /data mount linked into place): the scan keeps such folders
    resolved, the rows were taken as written, and each of their corrections was "not an image of the folder"."""
    link = tmp_path / "link"
    link.symlink_to(folder)  # the data root, linked into place
    (folder / "square").rename(tmp_path / "square")
    (folder / "square").symlink_to(tmp_path / "square")  # a class folder on another disk
    write_shapes(tmp_path / "extra", per_class=2, classes=("more",), seed=3)
    (folder / "column" / "more").symlink_to(tmp_path / "extra" / "more")  # a linked folder inside a class
    (folder / "bar" / "linked.png").symlink_to(tmp_path / "extra" / "more" / "001.png")  # a linked image
    rows = [
        (str(link / "bar" / "000.png"), "column"),  # absolute, through the linked root
        ("square/001.png", ""),  # relative, in the linked class folder
        (str(link / "column" / "more" / "000.png"), "bar"),
        ("bar/linked.png", "square"),  # the link is the image, as in the scan, not the file it points to
    ]
    scan = scan_folder(link, 0.25, seed=0, corrections=str(_csv(tmp_path / "fix.csv", rows)))
    assert {k: scan.corrections[k] for k in ("relabelled", "left_out", "not_found")} == {
        "relabelled": 3, "left_out": 1, "not_found": 0
    }  # fmt: skip
    labels = _everything(scan)
    assert labels[str(folder / "bar" / "000.png")] == "column"
    assert str(tmp_path / "square" / "001.png") not in labels
    assert labels[str(folder / "bar" / "linked.png")] == "square"


def test_labels_and_paths_typed_in_another_unicode_form_than_the_folders_names_are_those_names(tmp_path: Path):
    """A class folder named café on macOS (decomposed, NFD) and the label café typed in the CSV (composed, NFC) read
    "label 'café' is not a class (classes: 'café', 'tea')"."""
    import unicodedata

    root = write_shapes(tmp_path / "drinks", per_class=6, classes=("a", "b"))
    cafe_nfd, cafe_nfc = unicodedata.normalize("NFD", "café"), unicodedata.normalize("NFC", "café")
    (root / "a").rename(root / cafe_nfd)
    (root / "b").rename(root / "tea")
    file = _csv(tmp_path / "fix.csv", [("tea/000.png", cafe_nfc), (f"{cafe_nfc}/001.png", "tea")])
    labels = _everything(scan_folder(root, 0.25, seed=0, corrections=str(file)))
    assert labels[str(root / "tea" / "000.png")] == cafe_nfd
    assert labels[str(root / cafe_nfd / "001.png")] == "tea"


def test_a_row_kept_in_another_unicode_form_than_the_scan_lists_its_image_still_applies(tmp_path: Path):
    """On macOS the file system finds a composed (NFC) path typed in the CSV, so the row kept that form, while the
    scan lists the name as the folder holds it (decomposed, NFD): the row matched no image."""
    import unicodedata

    from train.corrections import apply_corrections

    listed = str(tmp_path / unicodedata.normalize("NFD", "café") / "001.png")
    typed = unicodedata.normalize("NFC", listed)
    corrected, counts, seen = apply_corrections({"café": [listed], "tea": []}, {typed: "tea"})
    assert corrected == {"café": [], "tea": [listed]} and counts["relabelled"] == 1 and seen == {typed}


@pytest.mark.parametrize("again", ["none", "other"])
def test_a_resumed_run_without_the_corrections_it_started_with_is_warned(folder, tmp_path, again, caplog):
    """Resumed without `--data.corrections`, a run went back to the folder's labels without a word, and counted the
    images its corrections had left out as added to the folder since."""
    from train.held_split import hold_split

    file = _csv(tmp_path / "fix.csv", [("bar/000.png", "column"), ("square/002.png", "")])
    scan_folder(folder, 0.25, seed=0, corrections=str(file)).write_split(tmp_path / "split.json")
    other = None if again == "none" else str(_csv(tmp_path / "other.csv", [("bar/001.png", "column")]))
    with caplog.at_level(logging.WARNING, logger="train.held_split"):
        hold_split(scan_folder(folder, 0.25, seed=0, corrections=other), tmp_path / "split.json")
    assert f"the run started with --data.corrections {file.resolve()}" in caplog.text
    assert "added to the folder" not in caplog.text
    caplog.clear()
    moved = tmp_path / "moved.csv"  # the same file, moved (with the folder, say): nothing changed
    with caplog.at_level(logging.WARNING, logger="train.held_split"):
        hold_split(scan_folder(folder, 0.25, seed=0, corrections=str(file)), tmp_path / "split.json")
        file.rename(moved)
        hold_split(scan_folder(folder, 0.25, seed=0, corrections=str(moved)), tmp_path / "split.json")
    assert caplog.text == ""
