"""Copies and near-copies: found by decoded pixels and perceptual hashes, and kept to one split."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageEnhance

from train.duplicates import BUCKET, MAX_HAMMING, band_bits, band_pairs, find_duplicates
from train.folder_scan import scan_folder


def smooth_image(seed: int, side: int = 64) -> Image.Image:
    """A photo-like image: random colour blobs, smooth at every scale."""
    rng = np.random.default_rng(seed)
    small = Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8), "RGB")
    return small.resize((side, side), Image.Resampling.BICUBIC)


def _folder(root: Path, classes: tuple[str, ...] = ("a", "b"), per_class: int = 10, start: int = 0) -> Path:
    for k, name in enumerate(classes):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            smooth_image(start + 100 * k + i).save(root / name / f"{i:03d}.png")
    return root


def _groups(paths: list[Path]):
    dups, _ = find_duplicates([str(p) for p in paths], workers=1)
    return dups


def test_copies_are_found_by_decoded_pixels_not_file_bytes(tmp_path: Path):
    _folder(tmp_path, per_class=4)
    a = tmp_path / "a"
    shutil.copy(a / "000.png", a / "byte_copy.png")
    Image.open(a / "000.png").save(a / "same_pixels.bmp")  # other bytes, the same pixels
    dups = _groups(sorted(tmp_path.glob("*/*")))
    assert dups.groups == [sorted(str(a / n) for n in ("000.png", "byte_copy.png", "same_pixels.bmp"))]
    assert {dups.kind(p) for p in dups.groups[0]} == {"exact"}
    assert dups.counts() == {"exact_groups": 1, "near_groups": 0}


def test_reencoded_resized_and_brightened_copies_are_near_copies(tmp_path: Path):
    _folder(tmp_path, per_class=6)
    a, base = tmp_path / "a", Image.open(tmp_path / "a" / "002.png")
    base.save(a / "reencoded.jpg", quality=70)
    base.resize((48, 48), Image.Resampling.BILINEAR).save(a / "smaller.jpg", quality=85)
    base.resize((96, 96), Image.Resampling.BICUBIC).save(a / "larger.png")
    ImageEnhance.Brightness(base).enhance(1.1).save(a / "brighter.png")
    dups = _groups(sorted(tmp_path.glob("*/*")))
    names = ["002.png", "brighter.png", "larger.png", "reencoded.jpg", "smaller.jpg"]
    assert dups.groups == [[str(a / n) for n in names]]
    assert {dups.kind(p) for p in dups.groups[0]} == {"near"}


def test_the_same_picture_in_another_colour_is_no_copy(tmp_path: Path):
    """Colourways (a red shirt and the same shirt in green) matched on their grey copies: a folder whose classes
    differ by colour alone was told that one label of each pair was wrong. A grey copy of the red shirt, a copy of
    the green one as much, would join them again: it is no copy of a colour picture either."""
    for name, colour in (("red", (200, 30, 30)), ("green", (30, 160, 30))):
        (tmp_path / name).mkdir()
        for i in range(3):
            im = Image.new("RGB", (64, 64), "white")
            ImageDraw.Draw(im).rectangle([12 + 10 * i, 16, 30 + 10 * i, 52], fill=colour)
            im.save(tmp_path / name / f"shirt{i}.png")
    Image.open(tmp_path / "red" / "shirt0.png").save(tmp_path / "red" / "resaved.jpg", quality=70)
    Image.open(tmp_path / "red" / "shirt1.png").convert("L").save(tmp_path / "red" / "grey.png")  # would bridge
    dups = _groups(sorted(tmp_path.glob("*/*")))
    assert dups.groups == [[str(tmp_path / "red" / "resaved.jpg"), str(tmp_path / "red" / "shirt0.png")]]


def _garment(pocket: bool = False, collar_drop: int = 0) -> Image.Image:
    """A 28 px garment-like silhouette, a little noisy, with an optional pocket or a lower collar."""
    im = Image.new("L", (28, 28), 0)
    draw = ImageDraw.Draw(im)
    draw.polygon([(8, 4), (20, 4), (22, 24), (6, 24)], fill=200)
    draw.rectangle([12, 2 + collar_drop, 16, 6 + collar_drop], fill=120)
    if pocket:
        draw.rectangle([12, 14, 15, 17], fill=60)
    noise = np.random.default_rng(collar_drop + 10 * pocket).integers(-6, 7, (28, 28))
    return Image.fromarray(np.clip(np.asarray(im, int) + noise, 0, 255).astype(np.uint8), "L")


def test_distinct_similar_images_of_a_class_are_not_grouped(tmp_path: Path):
    bars = tmp_path / "bars"
    bars.mkdir()
    rng = np.random.default_rng(0)
    for row in range(4, 26, 2):  # the same dark bar on white, each a little lower: alike, not copies
        a = np.full((32, 32), 255, np.uint8)
        a[row : row + 4, 4:-4] = 0
        noisy = np.clip(a.astype(int) + rng.integers(-20, 20, a.shape), 0, 255).astype(np.uint8)
        Image.fromarray(noisy, "L").save(bars / f"{row:02d}.png")
    garments = tmp_path / "garments"  # one garment, one with a pocket, one with its collar 2 px lower
    garments.mkdir()
    for name, im in {"plain": _garment(), "pocket": _garment(pocket=True), "collar": _garment(collar_drop=2)}.items():
        im.save(garments / f"{name}.png")
    blobs = _folder(tmp_path / "blobs", per_class=20)
    dups, facts = find_duplicates(
        [str(p) for p in sorted(bars.glob("*")) + sorted(garments.glob("*")) + sorted(blobs.glob("*/*"))], workers=1
    )
    assert dups.groups == []
    close = {tuple(sorted(Path(facts.paths[i]).stem for i in pair)) for pair in band_pairs(facts.hashes, MAX_HAMMING)}
    assert {("collar", "plain"), ("plain", "pocket")} <= close  # their hashes agree: the pixel check tells them apart


def test_band_search_finds_every_close_pair_without_comparing_all():
    rng = np.random.default_rng(0)
    n, m = 11_000, 500  # from about 10,000 hashes, the candidates fall under a tenth of all pairs
    hashes = rng.integers(0, 2**63, n, dtype=np.int64).astype(np.uint64) * np.uint64(2) + np.uint64(1)
    flips = rng.integers(0, 64, (m, 3)).astype(np.uint64)  # up to 3 bits: pigeonhole over 4 bands
    twins = hashes[:m].copy()
    for k in range(3):
        twins ^= np.uint64(1) << flips[:, k]
    pairs = band_pairs(np.concatenate([hashes, twins]))  # (P, 2)
    n_all = n + m
    found = pairs[:, 0].astype(np.int64) * n_all + pairs[:, 1]
    assert np.isin(np.arange(m) * n_all + n + np.arange(m), found).all()  # each source with its twin
    assert len(pairs) < 64 // band_bits(n_all) * n_all * BUCKET < n_all * n_all / 2 / 10  # candidates grow with n


def _copy_heavy_folder(root: Path) -> Path:
    _folder(root, per_class=20)
    for name in ("a", "b"):
        for i in range(10):  # every other image has a byte copy and a re-encoded near-copy
            shutil.copy(root / name / f"{i:03d}.png", root / name / f"{i:03d}_copy.png")
            Image.open(root / name / f"{i:03d}.png").save(root / name / f"{i:03d}_near.jpg", quality=80)
    return root


def _split_of(scan) -> dict[str, str]:
    return {p: s for s in ("train", "val", "calib") for p, _ in getattr(scan, s)}


def test_no_group_straddles_train_val_and_calib(tmp_path: Path):
    root = _copy_heavy_folder(tmp_path / "pool")
    plain = scan_folder(root, 0.3, seed=0, calib_fraction=0.3)
    scan = scan_folder(root, 0.3, seed=0, calib_fraction=0.3, dedupe=True)
    assert len(scan.duplicates.groups) == 20
    where, plain_where = _split_of(scan), _split_of(plain)
    assert len(where) == len(plain_where) == 80  # every image still used
    assert all(len({where[p] for p in g}) == 1 for g in scan.duplicates.groups)
    assert any(len({plain_where[p] for p in g}) > 1 for g in scan.duplicates.groups)  # a file-by-file split leaks


def test_copies_across_the_users_train_and_val_are_left_out_of_val_unless_dedupe_is_off(tmp_path: Path):
    root = tmp_path / "tv"
    _folder(root / "train", per_class=6)
    _folder(root / "val", per_class=3, start=50)
    leaked = root / "val" / "b" / "leak.jpg"
    Image.open(root / "train" / "a" / "001.png").save(leaked, quality=90)  # a near-copy, in another class
    scan = scan_folder(root, dedupe=True)
    assert scan.left_out == [str(leaked)]
    assert str(leaked) not in dict(scan.val) and len(scan.val) == 6
    kept = scan_folder(root, dedupe=False)
    assert str(leaked) in dict(kept.val) and kept.left_out == []


def test_a_file_that_fails_to_decode_is_skipped_and_reported_by_the_dedupe_pass(tmp_path: Path):
    _folder(tmp_path, per_class=4)
    good = (tmp_path / "a" / "000.png").read_bytes()
    (tmp_path / "a" / "cut.png").write_bytes(good[:80])  # header intact, pixels cut
    scan = scan_folder(tmp_path, 0.25, dedupe=True)
    assert [Path(b.path).name for b in scan.bad] == ["cut.png"]
    assert str(tmp_path / "a" / "cut.png") not in {p for p, _ in scan.train + scan.val}


@pytest.mark.parametrize("workers", [1, 2])
def test_the_process_pool_finds_what_one_process_finds(tmp_path: Path, workers: int, monkeypatch):
    import train.duplicates as duplicates

    monkeypatch.setattr(duplicates, "PARALLEL_FROM", 10)
    root = _copy_heavy_folder(tmp_path / "pool")
    dups, facts = find_duplicates(sorted(str(p) for p in root.glob("*/*")), workers=workers)
    assert len(dups.groups) == 20 and len(facts.paths) == 80


def test_a_class_whose_every_val_image_is_a_copy_of_a_train_image_is_said(tmp_path: Path, caplog):
    """Its validation images all left out, the class silently dropped out of the metric that chooses best.ckpt."""
    root = tmp_path / "tv"
    _folder(root / "train", per_class=6)
    _folder(root / "val", per_class=2, start=50)
    for i, f in enumerate(sorted((root / "val" / "b").iterdir())):
        shutil.copy(root / "train" / "b" / f"00{i}.png", f)
    with caplog.at_level("WARNING", logger="train.splits"):
        scan = scan_folder(root, dedupe=True)
    assert {y for _, y in scan.val} == {0}
    assert "no validation image of 'b' is left" in caplog.text and "val/b/" in caplog.text


@pytest.mark.parametrize("layout", ["pool", "train_val"])
@pytest.mark.parametrize("seed", range(6))
def test_a_class_made_of_copies_of_another_class_still_trains_on_them(tmp_path: Path, layout: str, seed: int):
    """A picture filed under two classes: its group is kept in training, where both labels are learnt (and the
    report counts the conflict), never in validation or calibration where the other label scores it wrong."""
    root = tmp_path / "d"
    base = root if layout == "pool" else root / "train"
    _folder(base, classes=("a", "c"), per_class=10)
    (base / "b").mkdir()
    for i in (5, 6):
        shutil.copy(base / "a" / f"00{i}.png", base / "b" / f"00{i}.png")
    if layout == "train_val":
        _folder(root / "val", classes=("a", "b", "c"), per_class=2, start=50)
    scan = scan_folder(root, 0.2, seed=seed, calib_fraction=0.2, dedupe=True)
    trained = {p for p, _ in scan.train}
    assert {y for _, y in scan.train} == {0, 1, 2}
    mixed = [g for g in scan.duplicates.groups if any("/b/" in p for p in g)]
    assert len(mixed) == 2 and all(set(g) <= trained for g in mixed)


def test_the_copies_hint_counts_a_copy_of_another_class_as_a_picture_of_its_own():
    """A class whose one image is a copy of another class's was said to have "1 images but 0 different pictures"."""
    from train.duplicates import Duplicates
    from train.splits import copies_hint

    dups = Duplicates(groups=[["a/1.png", "b/1.png"], ["c/1.png", "c/2.png", "c/3.png"]], exact=set())
    items = [("a/1.png", 0), ("b/1.png", 1), ("c/1.png", 2), ("c/2.png", 2), ("c/3.png", 2)]
    assert copies_hint(items, dups, ["a", "b", "c"]) == (
        "; class 'c' has 3 images but 1 different picture(s): copies of one picture stay together in one split, as "
        "--data.dedupe keeps them"
    )
