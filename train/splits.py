"""The splits of an image folder's files: train and val (stratified, seeded), calibration, and the user's own.

`stratified_split` splits each class of a pool by a seeded shuffle; `calibration_split` holds back a share of each
class's training images for `vit-export`'s calibration; `split_own` takes the user's own train/ and val/, less the
val images with a copy in train/. `train.folder_scan` calls them once it has found the files.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from pathlib import Path

from train.duplicates import Duplicates, follow_anchors, without_members

log = logging.getLogger(__name__)

# Below this many calibration images the temperature and thresholds rest on few images, and the finest
# coverage a prediction set can promise is 1 - 1/(n + 1): the scan says so (one warning).
FEW_CALIBRATION_IMAGES = 200


def stratified_split(
    files: dict[str, list[str]], val_fraction: float, seed: int
) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """Split each class separately so train and val keep the class proportions.

    Each class with at least 2 images gives at least 1 to val and keeps at least 1 for training.
    The same files, fraction and seed always give the same split.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    train, val = [], []
    for label, name in enumerate(sorted(files)):
        paths = sorted(str(p) for p in files[name])
        random.Random(f"{seed}/{name}").shuffle(paths)  # per-class seed: adding a class moves no other
        n_val = min(max(1, round(len(paths) * val_fraction)), len(paths) - 1) if len(paths) > 1 else 0
        val += [(p, label) for p in sorted(paths[:n_val])]
        train += [(p, label) for p in sorted(paths[n_val:])]
    if alone := [name for name in sorted(files) if len(files[name]) == 1]:
        log.warning(
            "%d class(es) have a single image (or copies of one), kept for training, so no validation image: %s. "
            "val/balanced_acc and the reports leave them out; add images to them", len(alone),
            ", ".join(map(repr, alone[:10])),
        )  # fmt: skip
    return train, val


def calibration_split(
    train: list[tuple[str, int]], classes: list[str], fraction: float, seed: int, copies: Counter | None = None
) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """Hold back `fraction` of each class's training images for calibration, stratified and seeded.

    Each class gives at least 1 image and keeps at least 1 for training. The validation split is made
    first and is untouched, so the checkpoint chosen on it does not depend on this fraction.

    Args:
        copies: each class's copies of its `train` images, left out of the draw (they follow their pictures):
            a refusal counts them.

    Returns:
        (train, calib), each a list of (path, label).

    Raises:
        ValueError: the fraction is outside [0, 1), or a class has too few training images to give one.
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"calib_fraction must be in [0, 1), got {fraction}; 0 holds back no calibration images")
    if fraction == 0.0:
        return train, []
    by_class: dict[int, list[str]] = {}
    for p, y in train:
        by_class.setdefault(y, []).append(p)
    kept, calib = [], []
    for y in sorted(by_class):
        paths = sorted(by_class[y])
        if len(paths) < 2:
            said = copies_said(len(paths), (copies or {}).get(y))
            raise ValueError(
                f"class {classes[y]!r} has {len(paths)} training image(s){f' ({said})' if said else ''}"
                ", too few to hold one back for calibration: add images, or set --data.calib_fraction 0 and "
                "calibrate at export (vit-export --calibrate DIR)"
            )
        random.Random(f"{seed}/calib/{classes[y]}").shuffle(paths)
        n = min(max(1, round(len(paths) * fraction)), len(paths) - 1)
        calib += [(p, y) for p in sorted(paths[:n])]
        kept += [(p, y) for p in sorted(paths[n:])]
    if len(calib) < FEW_CALIBRATION_IMAGES:
        log.warning(
            "only %d calibration images (calib_fraction %.2f): temperature and thresholds rest on few images, and "
            "prediction sets can promise a coverage of at most %.3f; hold back more or calibrate at export "
            "(vit-export --calibrate DIR)",
            len(calib), fraction, 1 - 1 / (len(calib) + 1),
        )  # fmt: skip
    return kept, calib


def copies_said(pictures: int, copies: int | None) -> str:
    """What a refusal that counts a class's images adds when some of them are copies ("" when none is)."""
    if not copies:
        return ""
    return (
        f"{pictures + copies} images but {pictures} different picture(s): copies of one picture stay together in "
        "one split, as --data.dedupe keeps them"
    )


def copies_in(drawn: list[tuple[str, int]], items: list[tuple[str, int]], anchors: dict[str, str]) -> Counter:
    """Each class's copies, among `items`, of the images `drawn` (`anchors`: member -> its group's first path)."""
    paths = {p for p, _ in drawn}
    return Counter(y for p, y in items if anchors.get(p) in paths)


def copies_hint(items: list[tuple[str, int]], dups: Duplicates | None, classes: list[str]) -> str:
    """For a refusal of a split without validation images: the first class whose images are copies of fewer than 2
    pictures ("" when none is)."""
    anchors, class_of = (dups.anchors() if dups else {}), dict(items)
    for y, name in enumerate(classes):
        paths = [p for p, label in items if label == y]
        pictures = sum(class_of.get(anchors.get(p)) != y for p in paths)  # another class's copy: a picture here
        if pictures < 2 and len(paths) > pictures:
            return f"; class {name!r} has {copies_said(pictures, len(paths) - pictures)}"
    return ""


def no_validation(scan) -> str:
    """The refusal of a scan (`FolderScan`) that gives no validation image, in fit and in prepare alike."""
    if scan.left_out:  # a root/val/ whose every image has a copy in train/
        return (
            f"{scan.root} gives no validation images: each of its {len(scan.left_out)} val/ images has a copy in "
            "train/, so no best.ckpt could be chosen; add images that are not in train/ to val/<class>/, or keep "
            "the copies with --data.dedupe none"
        )
    return (
        f"{scan.root} gives no validation images, so no best.ckpt could be chosen: give each class at least 2 "
        "images (--data.val_fraction holds some out), or add a root/val/<class>/ folder"
        + copies_hint(scan.train + scan.calib, scan.duplicates, scan.classes)
    )


def mixed_groups(dups: Duplicates | None, items: list[tuple[str, int]]) -> set[str]:
    """The paths of the copy groups whose images in `items` carry more than one class: the same picture under two
    labels, kept in training (validated or calibrated on, one of its labels would score it wrong)."""
    label = dict(items)
    return {p for g in (dups.groups if dups else []) if len({label[p] for p in g if p in label}) > 1 for p in g}


def split_pool(
    files: dict[str, list[str]], classes: list[str], dups: Duplicates | None, val_fraction: float,
    calib_fraction: float, seed: int,
) -> tuple[list, list, list]:  # fmt: skip
    """A pool's train, val and calib, drawn by copy group (`dups`): each group goes where its first image is
    drawn, and a group under several classes (`mixed_groups`) to training."""
    items = [(p, y) for y, c in enumerate(classes) for p in files[c]]
    anchors, mixed = dups.anchors() if dups else {}, mixed_groups(dups, items)
    reps = {c: [p for p in paths if p not in anchors and p not in mixed] for c, paths in files.items()}
    train, val = stratified_split(reps, val_fraction, seed)
    train, calib = calibration_split(train, classes, calib_fraction, seed, copies_in(train, items, anchors))
    train += [(p, y) for p, y in items if p in mixed and p not in anchors]
    return tuple(follow_anchors([train, val, calib], [it for it in items if it[0] in anchors], anchors))


def split_own(
    train: list[tuple[str, int]],
    val: list[tuple[str, int]],
    dups: Duplicates | None,
    classes: list[str],
    calib_fraction: float,
    seed: int,
) -> tuple[list, list, list, list[str]]:
    """The user's own train/ and val/: val less its copies of train images, calibration drawn by group.

    Returns:
        (train, val, calib, the val paths left out because a copy of them is in train/).
    """
    if dups is None:
        kept, calib = calibration_split(train, classes, calib_fraction, seed)
        return kept, val, calib, []
    in_train = {p for p, _ in train}
    anchors, left = {}, set()
    for group in dups.groups:
        mine = [p for p in group if p in in_train]
        anchors.update({p: mine[0] for p in mine[1:]})
        left.update(p for p in group if mine and p not in in_train)
    mixed = mixed_groups(dups, train)
    reps = [it for it in without_members(train, anchors) if it[0] not in mixed]
    kept, calib = calibration_split(reps, classes, calib_fraction, seed, copies_in(reps, train, anchors))
    kept += [(p, y) for p, y in train if p in mixed and p not in anchors]
    kept, calib = follow_anchors([kept, calib], [it for it in train if it[0] in anchors], anchors)
    if left:
        log.warning(
            "%d image(s) of %s have a copy in train/: left out of validation, so they do not inflate its accuracy "
            "(reports/duplicates.csv lists them; --data.dedupe none keeps them)", len(left), Path(val[0][0]).parents[1],
        )  # fmt: skip
    val_kept = [(p, y) for p, y in val if p not in left]
    if emptied := sorted({classes[y] for _, y in val} - {classes[y] for _, y in val_kept}):
        log.warning(
            "no validation image of %s is left (each has a copy in train/): the balanced accuracy that chooses "
            "best.ckpt averages the other classes only; add images that are not in train/ to val/%s/",
            ", ".join(map(repr, emptied)), emptied[0],
        )  # fmt: skip
    return kept, val_kept, calib, sorted(left)
