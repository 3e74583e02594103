"""The image-folder scan and data module on messy, broken and well-formed folders."""

from __future__ import annotations

import csv
import json
import os
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from serve.runtime.images import ImageError, Preprocess, load_image
from tests.helpers import write_shapes
from train.datamodule import ImageFolderDataModule
from train.dataset import fill_cache
from train.ddp_scan import differs
from train.folder_scan import FolderScan, scan_folder
from train.held_split import hold_split, warn_if_validated_on_its_training
from train.transforms import Augment


def test_awkward_files_load_and_broken_ones_are_skipped_with_reasons(messy_folder: Path):
    scan = scan_folder(messy_folder, val_fraction=0.25, seed=0)
    assert scan.classes == ["cat", "dog"]  # hidden .ipynb_checkpoints is not a class
    names = {Path(p).name for p, _ in scan.train + scan.val}
    assert names == {
        "photo.jpg", "UPPER.JPG", "Shout.PNG", "gray.png", "palette.png", "rgba.png", "cmyk.jpg",
        "sixteen.png", "exif_rotated.jpg", "dog0.png", "dog1.png", "dog2.png", "truncated.jpg",
    }  # fmt: skip
    bad = {Path(b.path).name: b.reason for b in scan.bad}
    assert set(bad) == {"empty.png", "text.png"}  # the scan reads signatures: truncated.jpg fails when decoded
    assert "empty" in bad["empty.png"] and "not an image" in bad["text.png"]


def test_data_module_reports_bad_files_in_run_dir_and_yields_every_good_image(messy_folder: Path, tmp_path: Path):
    # no calibration split: its images are decoded at export, not here, and truncated.jpg could land in it
    dm = ImageFolderDataModule(
        str(messy_folder), val_fraction=0.25, calib_fraction=0.0, img_size=32, batch_size=4, num_workers=0
    )
    dm.setup("fit")
    dm.write_reports(tmp_path / "run")
    with open(tmp_path / "run" / "bad_files.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted(Path(r["file"]).name for r in rows) == ["empty.png", "text.png", "truncated.jpg"]
    assert all(r["reason"] for r in rows)
    seen = 0
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        for x, y in loader:
            assert x.shape[1:] == (3, 32, 32) and x.dtype == torch.float32 and torch.isfinite(x).all()
            seen += len(y)
    assert seen >= len(dm.scan.val) + len(dm.scan.train) - dm.batch_size  # train drops only a last partial batch


def test_exif_rotated_jpeg_is_trained_upright(messy_folder: Path):
    path = messy_folder / "cat" / "exif_rotated.jpg"
    assert load_image(path).size == (40, 48)  # stored 48 x 40, displayed (and trained) rotated


def test_validation_transform_is_the_serving_preprocessing(shapes_folder: Path):
    dm = ImageFolderDataModule(str(shapes_folder), img_size=32, crop_pct=0.875, num_workers=0)
    dm.setup("fit")
    path, label = dm.scan.val[0]
    x, y = dm.val_set[0]
    serving = Preprocess((32, 32), 0.875, "bicubic", dm.preprocess.mean, dm.preprocess.std)
    np.testing.assert_array_equal(x.numpy(), serving(load_image(path)))
    assert y == label


def test_empty_class_folder_stops_with_message_naming_it(shapes_folder: Path):
    (shapes_folder / "empty_class").mkdir()
    (shapes_folder / "empty_class" / ".DS_Store").write_bytes(b"\x00")
    with pytest.raises(ValueError, match="empty_class.*no readable images"):
        scan_folder(shapes_folder)


def test_fewer_than_two_classes_stops_with_message_naming_the_folder(tmp_path: Path):
    root = write_shapes(tmp_path / "one", classes=("only",))
    with pytest.raises(ValueError, match=f"{root}.*at least 2 class folders"):
        scan_folder(root)
    with pytest.raises(FileNotFoundError, match="missing"):
        scan_folder(tmp_path / "missing")


def test_classes_are_sorted_folder_names_and_labels_follow_them(tmp_path: Path):
    root = write_shapes(tmp_path / "s", per_class=4, classes=("zebra", "Apple", "mango"))
    scan = scan_folder(root)
    assert scan.classes == ["Apple", "mango", "zebra"]
    for p, y in scan.train + scan.val:
        assert Path(p).parent.name == scan.classes[y]


def test_a_class_of_one_image_is_said_to_have_no_validation_image(caplog):
    """Its one image went to training without a word, and balanced accuracy was the mean over the other classes."""
    from train.splits import stratified_split

    with caplog.at_level("WARNING", logger="train.splits"):
        train, val = stratified_split({"lone": ["a.png"], "many": ["b.png", "c.png", "d.png"]}, 0.3, seed=0)
    assert train[0] == ("a.png", 0) and {y for _, y in val} == {1}
    assert "1 class(es) have a single image (or copies of one), kept for training, so no validation image: 'lone'" in (
        caplog.text
    )


def test_same_seed_gives_same_stratified_split_and_another_seed_another(tmp_path: Path):
    root = write_shapes(tmp_path / "s", per_class=20)
    a, b, c = scan_folder(root, 0.25, seed=1), scan_folder(root, 0.25, seed=1), scan_folder(root, 0.25, seed=2)
    assert a.train == b.train and a.val == b.val
    assert a.val != c.val
    assert Counter(y for _, y in a.val) == {0: 5, 1: 5, 2: 5}  # 25 % of every class
    assert not {p for p, _ in a.train} & {p for p, _ in a.val}


def test_split_is_saved_as_json_with_absolute_paths(shapes_folder: Path, tmp_path: Path):
    dm = ImageFolderDataModule(str(shapes_folder), img_size=32, num_workers=0)
    dm.write_reports(tmp_path / "run")
    import json

    split = json.loads((tmp_path / "run" / "split.json").read_text())
    assert split["classes"] == ["bar", "column", "square"]
    assert {"path", "label"} == set(split["val"][0])
    assert all(Path(e["path"]).is_absolute() and Path(e["path"]).is_file() for e in split["train"] + split["val"])
    assert len(split["train"]) + len(split["val"]) + len(split["calib"]) == 90


def test_train_val_layout_keeps_the_users_split(tmp_path: Path):
    root = tmp_path / "tv"
    write_shapes(root / "train", per_class=6)
    write_shapes(root / "val", per_class=2, seed=1)
    scan = scan_folder(root, val_fraction=0.5)
    assert scan.layout == "train_val" and scan.classes == ["bar", "column", "square"]
    assert len(scan.train) == 18 and len(scan.val) == 6
    assert all("/val/" in p for p, _ in scan.val) and all("/train/" in p for p, _ in scan.train)
    shutil.rmtree(root / "val" / "square")
    with pytest.raises(ValueError, match="same class folders"):
        scan_folder(root)


@pytest.mark.parametrize("batch_augment", [True, False])
def test_training_batches_without_augmentation_match_the_serving_preprocessing(shapes_folder: Path, batch_augment):
    off = Augment(crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0), hflip=0.0, rand_augment=None, re_prob=0.0)
    dm = ImageFolderDataModule(
        str(shapes_folder), img_size=32, crop_pct=1.0, augment=off, num_workers=0, batch_augment=batch_augment
    )
    dm.setup("fit")
    x, _ = dm.train_dataloader().collate_fn([dm.train_set[i] for i in range(4)])  # (4, 3, 32, 32)
    for i in range(4):
        np.testing.assert_allclose(x[i].numpy(), dm.preprocess(load_image(dm.scan.train[i][0])), atol=1e-6)


def test_validation_batches_are_the_serving_preprocessing_pixel_for_pixel(shapes_folder: Path):
    no_pil_only = Augment(rand_augment=None)  # batch augmentation does no RandAugment
    dm = ImageFolderDataModule(
        str(shapes_folder), img_size=24, crop_pct=0.875, num_workers=0, batch_augment=True, augment=no_pil_only
    )
    dm.setup("fit")
    x, y = dm.val_dataloader().collate_fn([dm.val_set[i] for i in range(3)])
    for i in range(3):
        path, label = dm.scan.val[i]
        np.testing.assert_array_equal(x[i].numpy(), dm.preprocess(load_image(path)))
        assert y[i] == label


def test_the_cache_is_one_uint8_array_of_resized_images_and_gives_the_same_batches(shapes_folder: Path):
    plain = ImageFolderDataModule(str(shapes_folder), img_size=16, batch_size=4, cache_images=False, num_workers=0)
    cached = ImageFolderDataModule(str(shapes_folder), img_size=16, batch_size=4, cache_images=True, num_workers=0)
    plain.setup("fit")
    cached.setup("fit")
    pixels, readable = cached.val_set.cache
    assert pixels.dtype == np.uint8 and pixels.shape == (len(cached.scan.val), 16, 16, 3) and readable.all()
    for a, b in zip(plain.val_dataloader(), cached.val_dataloader(), strict=True):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_a_file_that_fails_to_decode_after_the_header_check_is_skipped_and_reported(shapes_folder, tmp_path):
    good = shapes_folder / "bar" / "000.png"
    (shapes_folder / "bar" / "broken.png").write_bytes(good.read_bytes()[:60])  # header intact, data cut
    assert not scan_folder(shapes_folder).bad  # the header reads
    dm = ImageFolderDataModule(str(shapes_folder), img_size=16, batch_size=8, cache_images=True, num_workers=0)
    dm.setup("fit")
    dm.write_reports(tmp_path / "run")
    assert "broken.png" in (tmp_path / "run" / "bad_files.csv").read_text()
    labels = [int(y) for loader in (dm.train_dataloader(), dm.val_dataloader()) for _, ys in loader for y in ys]
    assert len(labels) >= len(dm.scan.train) + len(dm.scan.val) - 8 - 1  # every readable image, broken one skipped


def test_a_file_that_fails_to_decode_when_cached_is_left_out_not_replaced_by_its_neighbour(shapes_folder, tmp_path):
    """Without the copy search (which decodes every image first), the cache found the broken file and the dataset
    gave the next image in its place: in validation, a neighbour (of another class, maybe) was scored twice."""
    good = shapes_folder / "bar" / "000.png"
    (shapes_folder / "bar" / "broken.png").write_bytes(good.read_bytes()[:60])  # header intact, data cut
    dm = ImageFolderDataModule(str(shapes_folder), img_size=16, cache_images=True, num_workers=0, dedupe="none")
    dm.setup("fit")
    listed = dm.scan.train + dm.scan.val
    assert str(shapes_folder.resolve() / "bar" / "broken.png") in {p for p, _ in listed}  # the split keeps its place
    assert len(dm.train_set) + len(dm.val_set) == len(listed) - 1
    assert "broken.png" not in {Path(p).name for p, _ in dm.train_set.items + dm.val_set.items}
    for dataset in (dm.train_set, dm.val_set):  # each image's own pixels, once the broken one's row is gone
        fresh, _, _ = fill_cache(dataset.items, dataset.fixed, (16, 16, 3), dataset.min_side, workers=1)
        assert np.array_equal(dataset.cache[0], fresh)


def test_a_validation_image_that_fails_to_decode_uncached_is_skipped_not_replaced_by_its_neighbour(shapes_folder):
    """Without the cache and the copy search, the dataset gave the next image in its place: a neighbour, of another
    class maybe, was scored twice in the metric that chooses best.ckpt."""
    dm = ImageFolderDataModule(
        str(shapes_folder), img_size=16, batch_size=64, cache_images=False, num_workers=0, dedupe="none"
    )
    dm.setup("fit")
    broken = Path(dm.scan.val[0][0])
    broken.write_bytes(broken.read_bytes()[:60])  # header intact, data cut: found only when decoded
    (_, labels), *more = list(dm.val_dataloader())
    assert not more and labels.tolist() == [y for _, y in dm.scan.val[1:]]
    # predict keeps one row per listed image: a missing row would shift every row after it
    assert sum(len(y) for _, y in dm.predict_dataloader()) == len(dm.scan.val) and dm.val_set.skip_broken


def test_a_ddp_rank_other_than_0_reads_class_names_from_folder_names_and_the_scan_from_rank_0(
    shapes_folder: Path, tmp_path: Path, monkeypatch
):
    scan = scan_folder(shapes_folder, 0.25, seed=3)
    scan.save(tmp_path / "scan.json")
    again = FolderScan.load(tmp_path / "scan.json")
    assert again.train == scan.train and again.val == scan.val and again.classes == scan.classes
    monkeypatch.setenv("LOCAL_RANK", "1")
    dm = ImageFolderDataModule(str(shapes_folder), img_size=16)
    assert dm.num_classes == 3 and dm._scan is None  # no scan on this rank before setup


@pytest.mark.parametrize(
    "splits, says",
    [
        (["train", "valid", "test"], "rename valid/ to val/"),  # Roboflow's and Kaggle's layout
        (["training", "validation"], "rename training/ to train/ and validation/ to val/"),
        (["train", "test"], "add a val/ folder with the same class folders, or give --data.root"),
    ],
)
def test_a_folder_of_split_folders_is_refused_rather_than_trained_as_classes(tmp_path: Path, splits, says):
    """train/ valid/ test/ trained a classifier of three classes, train, valid and test, with exit 0."""
    for split in splits:
        write_shapes(tmp_path / "data" / split, per_class=2)
    with pytest.raises(ValueError, match="holds the split folders .*, not class folders") as e:
        scan_folder(tmp_path / "data")
    assert says in str(e.value)


def test_jpegs_named_jfif_are_images_and_heic_photos_are_reported_not_passed_over(tmp_path: Path):
    """Chrome and Windows save web JPEGs as .jfif, and iPhones take .HEIC photos: both were left out in silence."""
    root = write_shapes(tmp_path / "data", per_class=4)
    Image.open(next((root / "bar").iterdir())).save(root / "bar" / "saved.jfif", "JPEG")
    (root / "bar" / "IMG_0001.HEIC").write_bytes(b"\x00\x00\x00\x18ftypheic" + bytes(64))
    (root / "bar" / "notes.bmp").write_bytes(b"BMW service notes, 2024\n")  # two letters alone make no BMP
    scan = scan_folder(root, 0.25, seed=0)
    assert sum(p.endswith("saved.jfif") for p, _ in scan.train + scan.val) == 1
    said = {Path(b.path).name: b.reason for b in scan.bad}
    assert "HEIC or HEIF image, which is not read" in said["IMG_0001.HEIC"] and "not an image" in said["notes.bmp"]


def test_classes_named_like_splits_that_hold_their_own_images_are_classes(tmp_path: Path):
    root = write_shapes(tmp_path / "data", per_class=2)
    (root / "bar").rename(root / "train")
    (root / "column").rename(root / "test")
    assert scan_folder(root).classes == ["square", "test", "train"]
    shutil.rmtree(root / "square")  # only the two, each with its images in a folder of its own
    for name, year in (("train", "2019"), ("test", "2020")):
        (root / name / year).mkdir()
        for image in (root / name).glob("*.png"):
            image.rename(root / name / year / image.name)
    assert scan_folder(root).classes == ["test", "train"]


def test_a_rank_that_scanned_the_folder_itself_may_train_on_rank_0s_split_unless_the_folder_changed(tmp_path: Path):
    root = write_shapes(tmp_path / "s", per_class=8)
    theirs = scan_folder(root, 0.25, seed=3)
    sent = FolderScan.from_dict(theirs.to_dict())  # as the process group carries it
    assert (sent.train, sent.val, sent.calib, sent.classes) == (theirs.train, theirs.val, theirs.calib, theirs.classes)
    assert differs(scan_folder(root, 0.25, seed=4), sent, 1) == ""  # another split of the same counts: rank 0's is used
    for path in sorted((root / "bar").iterdir())[:4]:  # images removed between the two ranks' scans
        path.unlink()
    reason = differs(scan_folder(root, 0.25, seed=3), sent, 1)
    assert "changed while the DDP processes scanned it: rank 1 found {'bar': 3" in reason
    assert "rank 0 {'bar': 6" in reason


def test_a_fit_from_another_runs_checkpoint_is_warned_when_it_validates_on_that_runs_training_images(
    tmp_path: Path, caplog
):
    """A new run started from another run's last.ckpt (epoch and optimizer restored) on the same folder grown a
    little made a new split: images that run trained on were validated on, with no word."""
    root = write_shapes(tmp_path / "data", per_class=6)
    (tmp_path / "base" / "checkpoints").mkdir(parents=True)
    scan_folder(root, 0.25, seed=0).write_split(tmp_path / "base" / "split.json")
    write_shapes(tmp_path / "more", per_class=4, seed=9)
    for path in (tmp_path / "more").glob("*/*.png"):  # the folder grows: the seeded split moves images around
        path.rename(root / path.parent.name / f"new_{path.name}")
    ckpt = str(tmp_path / "base" / "checkpoints" / "last.ckpt")
    grown = scan_folder(root, 0.25, seed=0)
    warn_if_validated_on_its_training(grown, ckpt, tmp_path / "run")
    said = [r.getMessage() for r in caplog.records if "validation images were training images" in r.getMessage()]
    assert len(said) == 1 and f"--data.split {tmp_path / 'base' / 'split.json'}" in said[0], caplog.text
    caplog.clear()
    warn_if_validated_on_its_training(grown, ckpt, tmp_path / "base")  # its own run resumed: its split is held
    warn_if_validated_on_its_training(hold_split(grown, tmp_path / "base" / "split.json"), ckpt, tmp_path / "run")
    split = json.loads((tmp_path / "base" / "split.json").read_text())  # another dataset of the same file names
    (tmp_path / "base" / "split.json").write_text(json.dumps({**split, "classes": ["cat", "dog", "fox"]}))
    warn_if_validated_on_its_training(grown, ckpt, tmp_path / "run")
    assert "validation images were training images" not in caplog.text


def test_calibration_split_is_stratified_seeded_and_apart_from_train_and_val(tmp_path: Path):
    root = write_shapes(tmp_path / "s", per_class=20)
    a = scan_folder(root, 0.25, seed=1, calib_fraction=0.2)
    b = scan_folder(root, 0.25, seed=1, calib_fraction=0.2)
    plain = scan_folder(root, 0.25, seed=1)
    assert a.calib == b.calib and a.train == b.train
    assert a.val == plain.val  # the validation split (and so best.ckpt) does not depend on calib_fraction
    assert Counter(y for _, y in a.calib) == {0: 3, 1: 3, 2: 3}  # 20 % of each class's 15 training images
    train, val, calib = ({p for p, _ in s} for s in (a.train, a.val, a.calib))
    assert not train & calib and not val & calib
    assert train | calib == {p for p, _ in plain.train}
    assert scan_folder(root, 0.25, seed=2, calib_fraction=0.2).calib != a.calib


def test_calibration_images_are_in_split_json_and_never_in_a_training_batch(shapes_folder: Path, tmp_path: Path):
    import json

    # dedupe none: shapes drawn at one position are near-copies, and a group split moves the exact counts
    dm = ImageFolderDataModule(str(shapes_folder), img_size=32, num_workers=0, calib_fraction=0.2, dedupe="none")
    dm.setup("fit")
    dm.write_reports(tmp_path / "run")
    split = json.loads((tmp_path / "run" / "split.json").read_text())
    calib = {e["path"] for e in split["calib"]}
    assert len(calib) == 3 * 5  # 20 % of each class's 24 training images
    assert not calib & {p for p, _ in dm.train_set.items} and not calib & {e["path"] for e in split["val"]}
    assert len(split["train"]) + len(split["val"]) + len(split["calib"]) == 90


def test_a_class_too_small_to_give_calibration_images_is_refused_in_one_line(tmp_path: Path):
    root = tmp_path / "tv"
    write_shapes(root / "train", per_class=1)
    write_shapes(root / "val", per_class=1, seed=1)
    with pytest.raises(ValueError, match=r"class 'bar' has 1 training image.*calib_fraction 0") as e:
        scan_folder(root, calib_fraction=0.1)
    assert "\n" not in str(e.value)
    assert scan_folder(root, calib_fraction=0.0).calib == []


def test_a_small_calibration_split_says_what_it_costs(shapes_folder: Path, caplog):
    with caplog.at_level("WARNING", logger="train.splits"):
        scan = scan_folder(shapes_folder, calib_fraction=0.1)
    assert len(scan.calib) == 6
    assert "only 6 calibration images" in caplog.text and "at most 0.857" in caplog.text


def test_a_pool_given_little_or_no_work_returns_at_once_every_time():
    # A pool terminated while its workers were still starting left one that nothing stopped: prepare() on a
    # folder the copy scan had already decoded (no work for the pool) hung a whole test run that way.
    from train.parallel import parallel_map

    for _ in range(30):
        assert parallel_map(abs, [], 4) == []
        assert parallel_map(abs, [-1], 4) == [1]
        assert parallel_map(abs, [-1, -2, -3], 2) == [1, 2, 3]
    with pytest.raises(ZeroDivisionError):
        parallel_map(_reciprocal, [1, 0], 2)  # a task's error reaches the caller, and the pool is gone


def _reciprocal(x: int) -> float:
    return 1 / x


def test_a_symlinked_folder_inside_a_class_is_followed_once_and_a_loop_ends(tmp_path: Path):
    """As torchvision's ImageFolder follows links: a linked sub-folder's 40 images were silently left out, while a
    real sub-folder's were in. A link back up the tree is walked once, not for ever."""
    from train.folder_scan import scan_folder

    root = tmp_path / "shapes"
    write_shapes(root, per_class=4)
    outside = tmp_path / "more"
    write_shapes(outside, per_class=3, seed=1)
    classes = sorted(p.name for p in root.iterdir())
    (root / classes[0] / "linked").symlink_to(outside / classes[0], target_is_directory=True)
    (root / classes[1] / "loop").symlink_to(root / classes[1], target_is_directory=True)
    scan = scan_folder(root, val_fraction=0.25, seed=0)
    per_class = Counter(y for _, y in scan.train + scan.val + scan.calib)
    assert per_class[0] == 4 + 3 and per_class[1] == 4  # the loop adds nothing


def test_a_root_one_folder_too_high_is_said_in_a_warning(tmp_path, caplog):
    """A folder of datasets given as --data.root trained on "classes" that were whole datasets, without a word."""
    for dataset in ("birds", "pets"):
        write_shapes(tmp_path / "datasets" / dataset, per_class=2, classes=("bar", "square"))
    scan_folder(tmp_path / "datasets", verify=False)
    warned = [r.getMessage() for r in caplog.records if "one folder too high" in r.getMessage()]
    assert warned and "birds" in warned[0] and "bar" in warned[0], caplog.text
    caplog.clear()
    scan_folder(tmp_path / "datasets" / "pets", verify=False)  # the right root: no warning
    assert "one folder too high" not in caplog.text


@pytest.mark.timeout(60)
def test_a_named_pipe_with_an_image_name_is_reported_not_waited_on(tmp_path: Path):
    """Reading its header waited for a writer for ever: the scan never ended."""
    root = write_shapes(tmp_path / "shapes", per_class=4)
    os.mkfifo(root / "bar" / "pipe.png")
    scan = scan_folder(root)
    assert [(Path(b.path).name, "not a regular file" in b.reason) for b in scan.bad] == [("pipe.png", True)]
    with pytest.raises(ImageError, match="not a regular file"):
        load_image(root / "bar" / "pipe.png")  # what training and vit-predict decode with


def test_a_class_whose_every_image_fails_to_decode_is_refused_with_the_reason(tmp_path: Path):
    """Files with a whole header but truncated further in were dropped by the decode, leaving a class of 0 images
    that trained with exit 0."""
    root = write_shapes(tmp_path / "shapes", per_class=4)
    for f in (root / "square").iterdir():
        f.write_bytes(f.read_bytes()[:60])
    with pytest.raises(ValueError, match=r"class folder .*square holds no readable images.*its files were skipped"):
        scan_folder(root, dedupe=True)


def test_a_link_up_to_the_data_root_or_to_another_class_is_reported_not_followed(tmp_path: Path):
    """`ln -s .. loop` inside a class folder gave that class the images of every class, under its label."""
    root = write_shapes(tmp_path / "shapes", per_class=4)
    (root / "square" / "loop").symlink_to("..")
    (root / "bar" / "columns").symlink_to(root / "column")
    (root / "column" / "more").symlink_to(write_shapes(tmp_path / "elsewhere", per_class=2, classes=("column",)))
    scan = scan_folder(root, val_fraction=0.25)
    counts = Counter(y for _, y in scan.train + scan.val)
    assert [counts[i] for i in range(3)] == [4, 6, 4]  # bar, column (and its 2 linked from outside), square
    assert sorted((Path(b.path).name, "not followed" in b.reason) for b in scan.bad) == [
        ("columns", True),
        ("loop", True),
    ]


def test_a_class_folder_that_is_a_link_to_another_class_is_refused_naming_both(tmp_path: Path):
    """`ln -s bar rods` trained every image of bar under two labels, and with duplicates checked it crashed with
    a KeyError in the duplicate finder."""
    root = write_shapes(tmp_path / "shapes", per_class=4)
    (root / "rods").symlink_to("bar")
    with pytest.raises(ValueError, match="class folders 'bar' and 'rods' of .* are links to one folder"):
        scan_folder(root, val_fraction=0.25)
    (root / "rods").unlink()
    (root / "all").symlink_to(".")  # a class folder that holds every other: its images would be two classes each
    with pytest.raises(ValueError, match="class folders 'all' and 'bar' of .* one inside the other"):
        scan_folder(root, val_fraction=0.25)


@pytest.mark.parametrize("target", ["/mnt/unmounted/cats", "cats"])  # a disk not mounted; a link to itself
def test_a_class_folder_that_is_a_link_to_nothing_is_refused_not_left_out(tmp_path: Path, target: str):
    """`ln -s /mnt/unmounted/cats cats` trained a model of the other classes, exit 0 and no word of cats."""
    root = write_shapes(tmp_path / "shapes", per_class=4)
    (root / "cats").symlink_to(target)
    with pytest.raises(ValueError, match=r"shapes/cats is a link to .*, which does not exist \(or loops\)"):
        scan_folder(root, val_fraction=0.25)


def test_a_link_to_nothing_named_as_a_file_is_said_and_the_scan_goes_on(tmp_path: Path, caplog):
    root = write_shapes(tmp_path / "shapes", per_class=4)
    (root / "README.md").symlink_to("../docs/README.md")
    with caplog.at_level("WARNING", logger="train.folder_scan"):
        scan = scan_folder(root, val_fraction=0.25)
    assert scan.classes == ["bar", "column", "square"] and "README.md is a link to ../docs/README.md" in caplog.text


def test_images_beside_the_class_folders_are_said_to_be_in_no_class(tmp_path: Path, caplog):
    """182 images in the root itself were left out of training without a word."""
    root = write_shapes(tmp_path / "shapes", per_class=4)
    for name in ("a.png", "b.jpg"):
        shutil.copy(next((root / "bar").iterdir()), root / name)
    with caplog.at_level("WARNING", logger="train.folder_scan"):
        scan = scan_folder(root, val_fraction=0.25)
    assert len(scan.train) + len(scan.val) == 12  # the classes' own images only
    said = [r.getMessage() for r in caplog.records if "in no class" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"2 image file(s) in {root} itself") and "(first: a.png)" in said[0]


def test_a_class_name_with_a_line_break_is_said_at_the_scan_not_first_at_the_triton_export(tmp_path, caplog):
    """It trained, and only `vit-export --triton-repo` refused it: "rename that class folder and train again"."""
    root = write_shapes(tmp_path / "shapes", per_class=4, classes=("bar", "col\numn", "square"))
    with caplog.at_level("WARNING", logger="train.folder_scan"):
        scan_folder(root, val_fraction=0.25)
    assert "class folder 'col\\numn' has a line break in its name" in caplog.text, caplog.text


def test_a_held_split_that_leaves_a_class_no_training_image_is_refused_and_no_val_image_is_said(tmp_path, caplog):
    from train.held_split import hold_split

    root = write_shapes(tmp_path / "shapes", per_class=6)
    first = scan_folder(root, val_fraction=0.34)
    first.write_split(tmp_path / "split.json")
    for p, y in first.val:
        if y == 0:
            os.unlink(p)  # every validation image of 'bar' is gone
    with caplog.at_level("WARNING", logger="train.held_split"):
        held = hold_split(scan_folder(root, val_fraction=0.34), tmp_path / "split.json")
    assert {y for _, y in held.val} == {1, 2} and "no validation image of 'bar' is left" in caplog.text
    for p, y in first.train:
        if y == 2:
            os.unlink(p)
    with pytest.raises(ValueError, match="no training image of class 'square' is left"):
        hold_split(scan_folder(root, val_fraction=0.34), tmp_path / "split.json")


def test_a_held_split_is_kept_when_the_folder_would_now_split_otherwise(tmp_path):
    """A run resumed after an image it never trained on was removed: the fresh split, which holding the run's split
    throws away, refused the run (a class now too small to give a calibration image)."""
    root = write_shapes(tmp_path / "shapes", per_class=3)
    first = scan_folder(root, val_fraction=0.34, calib_fraction=0.34)
    first.write_split(tmp_path / "split.json")
    gone = next(p for p, y in first.val if y == 0)
    os.unlink(gone)
    data = ImageFolderDataModule(
        root, img_size=32, val_fraction=0.34, calib_fraction=0.34, split=str(tmp_path / "split.json")
    )
    assert data.scan.train == first.train and data.scan.calib == first.calib
    assert data.scan.val == [it for it in first.val if it[0] != gone]


def test_a_half_made_train_and_val_split_says_what_is_missing(tmp_path):
    """A root with train/ alone read as one class named 'train'; an empty val/<class> was to be removed, which the
    next run refused (train/ and val/ must hold the same class folders)."""
    write_shapes(tmp_path / "one" / "train", per_class=2)
    with pytest.raises(ValueError, match=r"a train/ folder needs val/ beside it.*--data.root .*/one/train"):
        scan_folder(tmp_path / "one")
    write_shapes(tmp_path / "two" / "train", per_class=2)
    write_shapes(tmp_path / "two" / "val", per_class=1)
    for image in (tmp_path / "two" / "val" / "bar").iterdir():
        image.unlink()
    with pytest.raises(ValueError, match=r"val/bar holds no readable images.*; add images to it \(val/ holds"):
        scan_folder(tmp_path / "two")


def test_a_split_file_that_is_not_there_is_said_so(tmp_path):
    """The message was to move the file out of the run directory, to resume: wrong for a mistyped --data.split."""
    from train.held_split import hold_split

    scan = scan_folder(write_shapes(tmp_path / "shapes", per_class=4), val_fraction=0.25)
    with pytest.raises(ValueError, match=r"nothere.json: no such file; --data.split takes the split.json of a"):
        hold_split(scan, tmp_path / "nothere.json")


def test_in_the_users_own_train_and_val_a_link_from_train_into_val_is_not_followed(tmp_path: Path):
    """Only the class folders beside it were kept out: a link up into val/ trained on the validation images."""
    root = tmp_path / "tv"
    write_shapes(root / "train", per_class=4)
    write_shapes(root / "val", per_class=2, seed=1)
    (root / "val" / "square" / "deeper").mkdir()
    (root / "train" / "bar" / "more").symlink_to("../../val")
    (root / "train" / "column" / "sub").symlink_to(root / "val" / "square" / "deeper")
    scan = scan_folder(root)
    assert Counter(y for _, y in scan.train + scan.calib) == {0: 4, 1: 4, 2: 4}
    assert sorted(Path(b.path).name for b in scan.bad) == ["more", "sub"]
