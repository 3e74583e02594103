"""A split held from a `split.json`: a resumed run validates and calibrates on the images it did before.

The folder scan splits each class by a seeded shuffle of its files, so one image added to a class moves others
between train, val and calibration. A resumed fit (`--ckpt_path` in a run directory that holds a `split.json`)
therefore keeps the run's own split (`vit-train fit` passes it as `--data.split`): each image keeps its place,
matched by its path under the data root (so the same images mounted elsewhere match), and takes its label from the
folder and the corrections as they are now (a warning says so when they are not the corrections it started with).
Images the split does not list are left out of the run; images it lists that the folder no longer holds are
dropped. A warning gives both counts.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from train.folder_scan import FolderScan
from train.run_dir import CKPT_DIR, is_remote

log = logging.getLogger(__name__)
PLACES = ("train", "val", "calib")
ELSEWHERE = (
    "resume on the folder the run was trained on, or train a new run on this one (another --trainer.default_root_dir)"
)


def hold_split(scan: FolderScan, split_file: str | Path) -> FolderScan:
    """`scan` with its images in the places `split_file` gives them (see the module's docstring).

    Raises:
        ValueError: the file cannot be read as a split, lists other classes, or lists none of the folder's images.
    """
    root, classes, place, then = _read(Path(split_file))
    _say_corrections(then, (scan.corrections or {}).get("file"), split_file)
    if classes != scan.classes:
        raise ValueError(
            f"the run was trained on {len(classes)} classes {classes} ({split_file}), but the image folder has "
            f"{len(scan.classes)} classes {scan.classes}: {ELSEWHERE}"
        )
    parts: dict[str, list[tuple[str, int]]] = {where: [] for where in PLACES}
    new = 0
    for path, label in [*scan.train, *scan.val, *scan.calib]:
        where = place.get(os.path.relpath(path, scan.root))
        if where is None:
            new += 1
        else:
            parts[where].append((path, label))
    kept = sum(map(len, parts.values()))
    if not kept:
        raise ValueError(f"{split_file} lists none of the images of {scan.root}: {ELSEWHERE}")
    _check_classes(parts, scan.classes, split_file)
    if new or kept < len(place):
        log.warning(
            "the run keeps the split it started with (%s): %d image(s) it does not list (added since it started, or "
            "left out by the corrections it started with) are left out, and %d it lists are gone or left out; train a "
            "new run to use the folder as it is now",
            split_file, new, len(place) - kept,
        )  # fmt: skip
    scan.train, scan.val, scan.calib = (sorted(parts[where]) for where in PLACES)
    return scan


def _check_classes(parts: dict[str, list[tuple[str, int]]], classes: list[str], split_file) -> None:
    """A class the held split leaves with no training image is refused; one with no validation image is said."""
    for where in ("train", "val"):
        missing = sorted(set(range(len(classes))) - {y for _, y in parts[where]})
        if missing and where == "train":
            raise ValueError(f"{split_file}: no training image of class {classes[missing[0]]!r} is left; {ELSEWHERE}")
        if missing:
            log.warning(
                "%s: no validation image of %s is left, so the metric that chooses best.ckpt leaves it out",
                split_file, ", ".join(repr(classes[y]) for y in missing),
            )  # fmt: skip


def _say_corrections(then: str | None, now: str | None, split_file) -> None:
    """A warning when the run started with other corrections than it is given now: its labels change."""
    if then == now or (then and now and _same_file(Path(then), Path(now))):
        return
    if now is None:
        change = "this one gives none: the images they relabelled have their folders' classes again; give "
        change += f"--data.corrections {then} to keep their labels"
    else:
        change = f"this one gives {now}, which labels its images now"
    started = f"--data.corrections {then}" if then else "no --data.corrections"
    log.warning("the run started with %s (%s), and %s", started, split_file, change)


def _same_file(then: Path, now: Path) -> bool:
    """Whether the corrections now are those the run started with, moved (with the folder, say) or copied."""
    try:
        return not then.exists() or then.read_bytes() == now.read_bytes()
    except OSError:
        return False


def _read(path: Path) -> tuple[str, list[str], dict[str, str], str | None]:
    """(its root, its classes, each image's path under the root -> its place, the corrections file it started with)."""
    try:
        held = json.loads(path.read_text(encoding="utf-8"))
        root = str(held["root"])
        place = {os.path.relpath(str(e["path"]), root): where for where in PLACES for e in held.get(where, [])}
        return root, list(held["classes"]), place, held.get("corrections")
    except FileNotFoundError:  # --data.split FILE (a run's own split.json is looked for before it is read)
        raise ValueError(f"{path}: no such file; --data.split takes the split.json of a vit-train run") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"{path} cannot be read as the split vit-train wrote ({e}): move it out of the run directory to resume "
            "with a new split"
        ) from None


def run_split(run_dir: str | None) -> str | None:
    """The `split.json` of the run directory `run_dir` (None: the working directory), or None if it holds none."""
    split = Path(run_dir or os.getcwd()) / "split.json"
    return str(split) if split.is_file() else None


def evaluated_split(run_dir: str | None, data_root: str | None, ckpt_path: str | None) -> str | None:
    """The run's own `split.json` when `validate`, `test` or `predict` scores the run's checkpoint (`ckpt_path`
    None, best, last, or a file of its checkpoints/) on the folder it was trained on: it scores the images its fit
    held out, even after images were added (a new split could hold training images). Another folder (a hold-out
    set), or another run's checkpoint, is scanned and split anew."""
    split = run_split(run_dir)
    if split is None or data_root is None:
        return None
    checkpoints = (Path(split).parent / CKPT_DIR).resolve()
    if ckpt_path not in (None, "best", "last") and Path(ckpt_path).expanduser().resolve().parent != checkpoints:
        return None  # another run's checkpoint, or one given by URL
    try:
        root, _, _, _ = _read(Path(split))
    except ValueError:
        return split  # `hold_split` says what is wrong with it
    return split if os.path.realpath(root) == os.path.realpath(os.path.expanduser(data_root)) else None


def warn_if_validated_on_its_training(scan: FolderScan, ckpt_path: str | None, run_dir: Path) -> None:
    """Warn when a fit starts from another run's checkpoint, with the optimizer and epoch it had, and validates on
    images that run trained on: its scores, and so the choice of best.ckpt, would flatter the model."""
    if not ckpt_path or is_remote(ckpt_path) or scan.layout == "litdata":
        return
    other = Path(ckpt_path).resolve().parent.parent
    if other == run_dir.resolve() or not (other / "split.json").is_file():
        return
    try:
        _, classes, place, _ = _read(other / "split.json")
    except ValueError:
        return  # not a split this can read: nothing to compare
    if classes != scan.classes:
        return  # another folder: its images are not these, whatever their names
    seen = sum(place.get(os.path.relpath(path, scan.root)) == "train" for path, _ in scan.val)
    if seen:
        log.warning(
            "%d of this run's %d validation images were training images of the run its checkpoint comes from (%s): "
            "their scores, and so the choice of best.ckpt, would flatter the model. Give --data.split %s to keep that "
            "run's split (images it does not list are then left out)",
            seen, len(scan.val), other, other / "split.json",
        )  # fmt: skip
