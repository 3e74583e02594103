"""Scan an image folder: classes, files, broken images, and a stratified, seeded split.

Two layouts are recognised:
    root/<class>/*                        one pool, split into train and val here
    root/train/<class>/* + root/val/<class>/*   the split is the user's

Either way, `calib_fraction` of each class's training images can be held back as a calibration split
(`calibration_split`): used neither for gradient steps nor for choosing the best checkpoint, it is what
`vit-export` fits the temperature, the prediction sets and the unknown-input threshold on.

Classes are the sorted names of the class folders. Hidden files and folders (`.DS_Store`,
`.ipynb_checkpoints`) and files without an image suffix are ignored; files with an image suffix
that are empty or carry no image signature are skipped and reported as `BadFile(path, reason)`. Only
the first bytes of each file are read here, by a pool of processes on large folders, so a million
files scan in about a minute; a file broken further in (truncated, corrupt, too many pixels) is
skipped and reported when it is decoded.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import time
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

from serve.runtime.image_files import LINK_NOT_FOLLOWED as SKIPPED_LINK
from serve.runtime.image_files import is_image_file, walk_image_files
from serve.runtime.image_formats import NOT_AN_IMAGE, signature_format, unread_format
from serve.runtime.images import is_utf8
from serve.runtime.outputs import create_anew
from train.corrections import correct_folder
from train.data_report import image_stats
from train.duplicates import Duplicates, find_duplicates
from train.parallel import parallel_map
from train.splits import split_own, split_pool

log = logging.getLogger(__name__)

PARALLEL_FROM = 5_000  # files; fewer are checked in this process (a pool costs more than it saves)
# the names tools give a dataset's splits (Roboflow and Kaggle write train/, valid/, test/): ours are train/, val/
SPLIT_NAMES = {"train": ("training",), "val": ("valid", "validation", "dev"), "test": ("testing",)}
FILE_SUFFIX = re.compile(r"\.[A-Za-z0-9]{1,5}$")  # README.md, x.png: a file's name, not a class folder's


@dataclass(frozen=True)
class BadFile:
    path: str
    reason: str


@dataclass
class FolderScan:
    """What a folder holds. `train` and `val` are lists of (absolute path, label)."""

    root: Path
    classes: list[str]
    train: list[tuple[str, int]]
    val: list[tuple[str, int]]
    bad: list[BadFile] = field(default_factory=list)
    layout: str = "pool"
    seconds: float = 0.0
    calib: list[tuple[str, int]] = field(default_factory=list)  # held back from training (`calibration_split`)
    corrections: dict | None = None  # {"file", "relabelled", "left_out", "not_found"} when a file was applied
    duplicates: Duplicates | None = None  # copies and near-copies, when the scan looked for them
    image_stats: dict | None = None  # sizes and modes seen, when the scan decoded the images
    left_out: list[str] = field(default_factory=list)  # val images left out: a copy of them is in train/

    def to_split_dict(self) -> dict:
        """The split as plain data: what `split.json` holds in the run directory."""
        return {
            "root": str(self.root),
            "layout": self.layout,
            "classes": list(self.classes),
            "train": [{"path": p, "label": y} for p, y in self.train],
            "val": [{"path": p, "label": y} for p, y in self.val],
            "calib": [{"path": p, "label": y} for p, y in self.calib],
            "corrections": None if self.corrections is None else self.corrections["file"],
        }

    def write_split(self, path: str | Path) -> None:
        """Write `split.json` atomically: a kill leaves the old file or the new one, which a resume reads."""
        tmp = Path(path).with_suffix(".tmp")
        with create_anew(tmp, "w") as f:  # never through a link planted at the name
            f.write(json.dumps(self.to_split_dict(), indent=1))
        os.replace(tmp, path)

    def to_dict(self) -> dict:
        """The whole scan (split, bad files, time) as plain data, which `from_dict` reads."""
        d = {**self.to_split_dict(), "bad": [[b.path, b.reason] for b in self.bad], "seconds": self.seconds}
        return {**d, "corrections": self.corrections}

    @classmethod
    def from_dict(cls, d: dict) -> FolderScan:
        pairs = lambda key: [(e["path"], e["label"]) for e in d[key]]
        bad = [BadFile(p, r) for p, r in d.get("bad", [])]
        scan = cls(Path(d["root"]), d["classes"], pairs("train"), pairs("val"), bad, d["layout"], d.get("seconds", 0.0))
        scan.calib, scan.corrections = (pairs("calib") if "calib" in d else []), d.get("corrections")
        return scan

    def save(self, path: str | Path) -> None:
        """Write the whole scan as JSON, atomically (a temporary file of this process's own, then a rename)."""
        tmp = Path(path).with_suffix(f".{os.getpid()}.tmp")
        with create_anew(tmp, "w") as f:
            f.write(json.dumps(self.to_dict()))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path) -> FolderScan:
        """The scan `save` wrote."""
        return cls.from_dict(json.loads(Path(path).read_text()))


def _visible(p: Path) -> bool:
    return not p.name.startswith(".")


def class_dirs(folder: Path) -> list[Path]:
    """The class folders of `folder`, sorted by name; hidden folders are not classes. A link to nothing (an unmounted
    disk, a loop) named as a folder is refused, as a class behind it would be left out; one named as a file, said."""
    entries = [d for d in folder.iterdir() if _visible(d)]
    for gone in (d for d in entries if d.is_symlink() and not d.exists()):
        what = f"{gone} is a link to {os.readlink(gone)}, which does not exist (or loops)"
        if not FILE_SUFFIX.search(gone.name):
            raise ValueError(f"{what}: a class folder behind it would be left out; fix its target, or remove the link")
        log.warning("%s: skipped", what)
    return sorted((d for d in entries if d.is_dir()), key=lambda d: d.name)


def find_image_files(folder: Path, bad: list[BadFile] | None = None, root: Path | None = None) -> list[str]:
    """Absolute paths of the visible files with an image suffix under `folder`, sorted (`walk_image_files`: linked
    folders followed once). A subfolder that cannot be listed would hide its images silently: it goes to `bad`.

    A link to a folder that holds `folder` (`ln -s ..`), or to any other folder under the data `root` (another
    class, val/), is not followed and goes to `bad`: it would give this class images that are another class's, or
    the validation images. Links out of the root (more images mounted elsewhere) are followed.
    """
    folder = folder.resolve()
    top = None if root is None else root.resolve()

    def leave(real: str) -> bool:
        p = Path(real)
        return p in folder.parents or (top is not None and p.is_relative_to(top) and not p.is_relative_to(folder))

    found, errors = walk_image_files(folder, leave)
    if bad is not None:
        bad += [
            BadFile(os.path.abspath(e.filename), LINK_NOT_FOLLOWED)
            if e.strerror == SKIPPED_LINK
            else BadFile(str(Path(e.filename).resolve()), f"folder cannot be read: {e.strerror}")
            for e in errors
        ]
    return found


LINK_NOT_FOLLOWED = "a link to a folder that holds this class folder, or to another class folder: not followed"


def header_error(path: str) -> str | None:
    """Why `path` is not an image we read, from its first 16 bytes; None when it looks like one.

    Only the signature is read: a file broken further in (truncated, corrupt, too many pixels) is found
    when it is decoded, and skipped and reported then.
    """
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # reading a named pipe would wait for a writer for ever
            return f"{path} is not a regular file (a named pipe, socket or device)"
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError as e:
        return f"{path} could not be read: {e}"
    if not head:
        return f"{path} is empty (0 bytes)"
    if kind := unread_format(head):
        return f"{path} is a {kind} image, which is not read: convert it to JPEG or PNG"
    if not signature_format(head):
        return f"{path} is {NOT_AN_IMAGE}"
    return None


def _header_errors(paths: list[str]) -> list[tuple[str, str]]:
    return [(p, e) for p in paths if (e := header_error(p)) is not None]


def check_headers(paths: list[str], workers: int | None = None, chunk: int = 2_000) -> list[tuple[str, str]]:
    """Check every file's image signature (not its pixels), in a process pool for large lists.

    Returns:
        (path, reason) of each file that is empty, unreadable or not an image.
    """
    from train.dataset import usable_cores

    workers = workers or usable_cores()
    if len(paths) < PARALLEL_FROM or workers < 2:
        return _header_errors(paths)
    chunks = [paths[i : i + chunk] for i in range(0, len(paths), chunk)]
    return [e for part in parallel_map(_header_errors, chunks, workers) for e in part]


def _scan_classes(
    folder: Path, classes: list[str] | None, verify: bool, bad: list[BadFile], root: Path
) -> dict[str, list[str]]:
    dirs = class_dirs(folder)
    names = [d.name for d in dirs]
    if loose := sorted(e.name for e in folder.iterdir() if _visible(e) and is_image_file(e.name) and e.is_file()):
        log.warning(
            "%d image file(s) in %s itself, beside its class folders, are in no class and not used (first: %s): "
            "move each into the folder of its class", len(loose), folder, loose[0],
        )  # fmt: skip
    # a class name is the label the model answers, in JSON and in the ONNX metadata: text, not stray bytes (PEP 383)
    if strays := [n for n in names if not is_utf8(n)]:
        what = f"the class folder {os.fsencode(strays[0])!r} in {folder} is not named in UTF-8"
        raise ValueError(f"{what} (its name is the label the model answers): rename it")
    if classes is None and (broken := next((n for n in names if n.splitlines() != [n]), None)):  # said once
        msg = "class folder %r has a line break in its name: a model repository's labels.txt (Triton, vit-serve DIR) "
        log.warning(msg + "cannot hold it, and --triton-repo refuses it: rename the folder to serve from one", broken)
    if classes is not None and names != classes:
        raise ValueError(
            f"{folder} has class folders {names}, but the training folder has {classes}; "
            "train/ and val/ must hold the same class folders"
        )
    if classes is None:
        refuse_split_folders(folder, names)
    if len(dirs) < 2:
        split = names[0] if names in (["train"], ["val"]) else None  # the user's own split, one half of it missing
        raise ValueError(
            f"{folder} must hold at least 2 class folders (one folder of images per class), found {len(dirs)}"
            + (f": {names}" if names else "")
            + (f"; a {split}/ folder needs {'val' if split == 'train' else 'train'}/ beside it, with the same "
               f"class folders (or give --data.root {folder / split} to hold validation images out of it)"
               if split else "")
        )  # fmt: skip
    # a class folder that is a link to another, to a folder inside one or to one holding others: images of both
    real = sorted((f"{d.resolve()}{os.sep}", d.name) for d in dirs)  # a folder sorts just before what it holds
    for (outer, a), (inner, b) in pairwise(real):
        if inner.startswith(outer):
            raise ValueError(
                f"class folders {a!r} and {b!r} of {folder} are links to one folder or one inside the other "
                f"({outer.rstrip(os.sep)}), so images would be in both classes: remove the link, or copy the images"
            )
    files = {d.name: find_image_files(d, bad, root) for d in dirs}
    if verify:
        errors = check_headers([p for paths in files.values() for p in paths])
        bad += [BadFile(p, reason) for p, reason in errors]
        failed = {p for p, _ in errors}
        files = {name: [p for p in paths if p not in failed] for name, paths in files.items()} if failed else files
    refuse_empty(files, folder, bad)
    if classes is None and all(Path(p).parent != d.resolve() for d in dirs for p in files[d.name]):
        inner = sorted({Path(p).relative_to(d.resolve()).parts[0] for d in dirs[:1] for p in files[d.name]})
        log.warning(
            "no class folder of %s holds images of its own: %s keeps them in %s. If those are the classes, the "
            "folder is one folder too high: give --data.root %s",
            folder, dirs[0].name, ", ".join(inner[:5]), dirs[0],
        )  # fmt: skip
    return files


def refuse_split_folders(folder: Path, names: list[str]) -> None:
    """`ValueError` when the class folders of `folder` are a split's (train/, valid/, test/ ... each holding class
    folders): trained on, the model would tell the splits apart, not the classes."""
    ours = {alias: name for name, aliases in SPLIT_NAMES.items() for alias in (name, *aliases)}
    trained = [n for n in names if ours.get(n) == "train"]
    if len(names) < 2 or not trained or not set(names) <= set(ours) or not _same_class_folders(folder, names):
        return
    renames = [f"{n}/ to {ours[n]}/" for n in names if ours[n] != n and ours[n] != "test"]
    fix = (
        f"rename {' and '.join(renames)}"
        if any(ours[n] == "val" for n in names)
        else (
            f"add a val/ folder with the same class folders, or give --data.root {folder / trained[0]} to hold "
            "validation images out of it"
        )
    )
    raise ValueError(
        f"{folder} holds the split folders {', '.join(names)}, not class folders: vit-train reads "
        f"root/train/<class> and root/val/<class> (a test/ folder is left alone); {fix}"
    )


def _same_class_folders(folder: Path, names: list[str]) -> bool:
    """Whether the folders `names` of `folder` hold folders and no image of their own, the same folder names in
    each: a split's class folders, not classes named so whose images are sorted in folders of their own."""
    held = []
    for name in names:
        entries = [e for e in os.scandir(folder / name) if not e.name.startswith(".")]
        if any(is_image_file(e.name) for e in entries if not e.is_dir()):
            return False
        held.append({e.name for e in entries if e.is_dir()})
    return bool(set.intersection(*held))


def refuse_empty(files: dict[str, list[str]], folder: Path, bad: list[BadFile]) -> None:
    """`ValueError` naming the first class of `files` ({class: paths} of `folder`) left with no image, and why."""
    for name, paths in files.items():
        if not paths:
            why = next((b.reason for b in bad if Path(b.path).is_relative_to((folder / name).resolve())), None)
            own_val = folder.name == "val" and (folder.parent / "train").is_dir()  # removing it is refused then
            fix = "add images to it (val/ holds the class folders of train/)" if own_val else ""
            raise ValueError(
                f"class folder {folder / name} holds no readable images (jpg, png, webp, bmp, gif or tiff)"
                + (f"; its files were skipped (first: {why})" if why else "")
                + f"; {fix or 'add images or remove the folder'}"
            )


def scan_folder(
    root: str | Path,
    val_fraction: float = 0.2,
    seed: int = 42,
    verify: bool = True,
    calib_fraction: float = 0.0,
    corrections: str | Path | None = None,
    dedupe: bool = False,
) -> FolderScan:
    """Find classes and images under `root` and make (or read) the train/val split.

    Args:
        root: the image folder.
        val_fraction: share of each class held out for validation (pool layout only).
        seed: seed of the split.
        verify: read every image's header now, so files that are not images are skipped and reported
            before training (files broken further in are found when decoded).
        calib_fraction: share of each class's training images held back for calibration (`calibration_split`).
        corrections: a `path,label` CSV applied before the split (`train.corrections`).
        dedupe: decode every image to find copies and near-copies (`train.duplicates`): the pool is then split
            by group, so no group straddles train, val and calib; of the user's own train/ and val/, the val
            images with a copy in train/ are left out. Files that fail to decode are skipped and reported.

    Returns:
        A `FolderScan`.

    Raises:
        FileNotFoundError: `root` or the corrections file does not exist.
        ValueError: fewer than 2 classes, an empty class folder (the message names it), a class too small
            to give calibration images, or a corrections file that names no class or empties one.
    """
    start, root = time.perf_counter(), _image_root(root)
    bad: list[BadFile] = []
    pool = not ((root / "train").is_dir() and (root / "val").is_dir())
    parts = [_scan_classes(root if pool else root / "train", None, verify, bad, root)]
    classes = sorted(parts[0])
    if not pool:
        parts.append(_scan_classes(root / "val", classes, verify, bad, root))
    record = None
    if corrections is not None:
        parts, record = correct_folder(parts, corrections, root, classes)
    dups = stats = None
    if dedupe:  # decoding may leave a class with no image
        parts, dups, stats = _dedupe(parts, bad)
        for files, folder in zip(parts, [root] if pool else [root / "train", root / "val"], strict=True):
            refuse_empty(files, folder, bad)
    left_out: list[str] = []
    if pool:
        train, val, calib = split_pool(parts[0], classes, dups, val_fraction, calib_fraction, seed)
    else:
        items = [[(p, y) for y, c in enumerate(classes) for p in files[c]] for files in parts]
        train, val, calib, left_out = split_own(items[0], items[1], dups, classes, calib_fraction, seed)
    scan = FolderScan(root, classes, train, val, bad, "pool" if pool else "train_val", calib=calib)
    scan.corrections, scan.duplicates, scan.image_stats, scan.left_out = record, dups, stats, left_out
    return _done(scan, start)


def _image_root(root: str | Path, resolve: bool = True) -> Path:
    root = Path(root).expanduser().resolve() if resolve else Path(root).expanduser()
    if root.is_file():
        raise ValueError(f"{root} is a file: give the image folder that holds it (root/<class>/<image> files)")
    if not root.is_dir():
        raise FileNotFoundError(f"image folder not found: {root} (expected root/<class>/<image> files)")
    return root


def _dedupe(parts: list[dict[str, list[str]]], bad: list[BadFile]) -> tuple[list, Duplicates, dict]:
    """Decode every file of `parts` ({class: paths} per split) once: (parts less the files that failed to decode,
    which join `bad`, the copies found, the image sizes and modes seen)."""
    dups, facts = find_duplicates([p for files in parts for paths in files.values() for p in paths])
    bad += [BadFile(p, reason) for p, reason in facts.broken]
    broken = {p for p, _ in facts.broken}
    parts = [{c: [p for p in paths if p not in broken] for c, paths in files.items()} for files in parts]
    return parts, dups, image_stats(facts.sizes, facts.modes)


def _done(scan: FolderScan, start: float) -> FolderScan:
    scan.seconds = time.perf_counter() - start
    log.info(
        "scanned %s in %.1f s: %d classes, %d train, %d val and %d calibration images, %d unreadable",
        scan.root, scan.seconds, len(scan.classes), len(scan.train), len(scan.val), len(scan.calib), len(scan.bad),
    )  # fmt: skip
    return scan


def folder_classes(root: str | Path) -> list[str]:
    """The class names of an image folder from its folder names alone (no file is read)."""
    root = _image_root(root, resolve=False)
    base = root / "train" if (root / "train").is_dir() and (root / "val").is_dir() else root
    return [d.name for d in class_dirs(base)]
