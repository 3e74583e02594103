"""`reports/data.json` and `reports/duplicates.csv`: what the folder holds, written when the data is set up."""

from __future__ import annotations

import csv
import json
import logging
import os
import shutil
from pathlib import Path

import lightning.pytorch as pl
import pytest
from PIL import Image

from tests.train.test_duplicates import smooth_image
from train.balance import resolve_balance
from train.datamodule import ImageFolderDataModule
from train.shards import prepare


@pytest.fixture
def long_tail(tmp_path: Path) -> Path:
    """cat: 80 images (one a byte copy), dog: 6 (one an L-mode PNG), bird: 20; all 40 x 40 but one 48 x 48."""
    root = tmp_path / "tail"
    for k, (name, n) in enumerate((("cat", 80), ("dog", 6), ("bird", 20))):
        (root / name).mkdir(parents=True)
        for i in range(n):
            smooth_image(1000 * k + i, 40).save(root / name / f"{i:03d}.png")
    shutil.copy(root / "cat" / "000.png", root / "cat" / "copy.png")
    smooth_image(999, 48).convert("L").save(root / "dog" / "grey.png")
    return root


def _setup(root: Path, run: Path, **kw) -> ImageFolderDataModule:
    dm = ImageFolderDataModule(str(root), img_size=16, num_workers=0, calib_fraction=0.1, **kw)
    dm.trainer = pl.Trainer(default_root_dir=str(run), logger=False, enable_progress_bar=False, accelerator="cpu")
    dm.setup("fit")
    dm.write_reports(run)  # what vit-train does as the fit starts (`train.callbacks.RunDirConfig`)
    return dm


def test_data_json_and_duplicates_csv_are_written_with_the_split(long_tail: Path, tmp_path: Path, caplog):
    fixes = tmp_path / "fix.csv"
    fixes.write_text("path,label\ncat/001.png,dog\ncat/002.png,\n")
    with caplog.at_level(logging.INFO, logger="train.data_report"):
        dm = _setup(long_tail, tmp_path / "run", corrections=str(fixes))
    report = json.loads((tmp_path / "run" / "reports" / "data.json").read_text())
    counts = dm.class_counts
    assert report["class_counts"] == dict(zip(dm.classes, counts, strict=True))
    assert sum(counts) == len(dm.scan.train) and counts[dm.classes.index("dog")] < 10
    assert report["imbalance_ratio"] == max(counts) / min(counts)
    assert report["balance"] == {"requested": "auto", "method": resolve_balance("auto", counts)}
    assert report["balance"]["method"] is not None and dm.balance_method == report["balance"]["method"]
    assert report["duplicates"] == {
        "searched": True, "exact_groups": 1, "near_groups": 0, "across_splits": 0, "left_out_of_val": 0,
        "conflicting_labels": 0,
    }  # fmt: skip
    assert report["image_modes"] == {"RGB": 106, "L": 1}  # one image left out by the corrections
    assert report["image_sizes"]["most_common"] == {"40x40": 106, "48x48": 1}
    assert report["corrections"]["relabelled"] == 1 and report["corrections"]["left_out"] == 1
    assert report["small_classes"] == ["bird", "dog"]
    with open(tmp_path / "run" / "reports" / "duplicates.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(Path(r["path"]).name, r["kind"]) for r in rows] == [("000.png", "exact"), ("copy.png", "exact")]
    assert rows[0]["group"] == rows[1]["group"] == "1" and rows[0]["split"] == rows[1]["split"] != ""
    assert json.loads((tmp_path / "run" / "split.json").read_text())["corrections"] == str(fixes.resolve())
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "imbalance ratio" in text and report["balance"]["method"] in text
    assert "'dog'" in text and "configs/finetune_timm.yaml" in text


def test_balance_none_and_dedupe_none_do_nothing_and_decode_nothing(long_tail: Path, tmp_path: Path, monkeypatch):
    import train.duplicates

    monkeypatch.setattr(train.duplicates, "image_facts", lambda *a, **k: pytest.fail("dedupe none decoded images"))
    dm = _setup(long_tail, tmp_path / "run", balance="none", dedupe="none")
    report = json.loads((tmp_path / "run" / "reports" / "data.json").read_text())
    assert dm.balance_method is None and report["balance"] == {"requested": "none", "method": None}
    assert report["duplicates"]["searched"] is False and report["duplicates"]["exact_groups"] == 0
    assert sum(report["image_modes"].values()) == sum(dm.class_counts) + len(dm.scan.val) + len(dm.scan.calib)


def test_unknown_balance_or_dedupe_is_refused_in_one_line(long_tail: Path):
    for kw in ({"dedupe": "yes"}, {"balance": "always"}):
        with pytest.raises(ValueError, match="must be one of auto, none") as e:
            ImageFolderDataModule(str(long_tail), **kw)
        assert "\n" not in str(e.value)


def test_prepare_applies_corrections_and_keeps_the_report_for_fit(long_tail: Path, tmp_path: Path):
    fixes = tmp_path / "fix.csv"
    fixes.write_text("path,label\ncat/002.png,\n")
    Image.open(long_tail / "cat" / "003.png").save(long_tail / "cat" / "near.jpg", quality=90)
    out = tmp_path / "shards"
    meta = prepare(str(long_tail), str(out), 0.25, 0, workers=1, chunk_bytes="1MB", corrections=str(fixes))
    assert meta["train"] + meta["val"] == 108 and meta["report"]["corrections"]["left_out"] == 1
    assert meta["report"]["duplicates"]["near_groups"] == 1
    with open(out / "duplicates.csv") as f:
        assert len(list(csv.DictReader(f))) == 4
    dm = _setup(out, tmp_path / "run")
    assert sum(dm.class_counts) == meta["train"]
    report = json.loads((tmp_path / "run" / "reports" / "data.json").read_text())
    assert report["balance"]["method"] == dm.balance_method and report["corrections"]["left_out"] == 1
    with pytest.raises(ValueError, match="vit-train prepare --data.corrections"):
        ImageFolderDataModule(str(out), corrections=str(fixes))


def test_file_names_that_are_not_utf8_are_reported_as_they_are_on_disk(long_tail: Path, tmp_path: Path):
    """Linux file names are bytes: a copied image named b'bad\\xff.png' ended training before its first step,
    writing duplicates.csv; an unreadable one left bad_files.csv holding its header alone."""
    cat = os.fsencode(long_tail / "cat")
    shutil.copy(long_tail / "cat" / "001.png", os.fsdecode(cat + b"/copy\xff.png"))  # a copy: in duplicates.csv
    Path(os.fsdecode(cat + b"/broken\xfe.png")).write_bytes(b"not an image")  # in bad_files.csv
    _setup(long_tail, tmp_path / "run")
    with open(tmp_path / "run" / "bad_files.csv", newline="", encoding="utf-8", errors="surrogateescape") as f:
        bad = [row["file"] for row in csv.DictReader(f)]
    with open(
        tmp_path / "run" / "reports" / "duplicates.csv", newline="", encoding="utf-8", errors="surrogateescape"
    ) as f:
        copies = [row["path"] for row in csv.DictReader(f)]
    assert [os.fsencode(Path(p).name) for p in bad] == [b"broken\xfe.png"] and all(map(os.path.exists, bad))
    assert b"copy\xff.png" in [os.fsencode(Path(p).name) for p in copies] and all(map(os.path.exists, copies))


def test_a_class_folder_whose_name_is_not_utf8_is_refused_naming_it(long_tail: Path, tmp_path: Path):
    """Its name is the label the model answers, in JSON and in the ONNX file's metadata: text, so UTF-8."""
    os.rename(long_tail / "dog", os.fsdecode(os.fsencode(long_tail) + b"/caf\xe9"))
    with pytest.raises(ValueError, match=r"caf\\xe9.*rename"):
        _setup(long_tail, tmp_path / "run")


def test_the_same_image_under_two_classes_is_reported_as_conflicting_labels(long_tail: Path, tmp_path: Path, caplog):
    """Copies that disagree on their class were reported as mere copies: one of the two labels is wrong."""
    for i in range(3):
        shutil.copy(long_tail / "cat" / f"{10 + i:03d}.png", long_tail / "dog" / f"from_cat_{i}.png")
    with caplog.at_level(logging.INFO, logger="train.data_report"):
        _setup(long_tail, tmp_path / "run")
    report = json.loads((tmp_path / "run" / "reports" / "data.json").read_text())
    assert report["duplicates"]["conflicting_labels"] == 3
    with open(tmp_path / "run" / "reports" / "duplicates.csv") as f:
        rows = list(csv.DictReader(f))
    groups = {}
    for r in rows:
        groups.setdefault(r["group"], set()).add(r["label"])
    assert sorted(map(sorted, groups.values())).count(["cat", "dog"]) == 3
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "3 copy groups" in text and "vit-train review" in text
