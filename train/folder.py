"""Scan an image folder: classes, files, broken images, and a stratified, seeded split.

Two layouts are recognised:
    root/<class>/*                        one pool, split into train and val here
    root/train/<class>/* + root/val/<class>/*   the split is the user's

Classes are the sorted names of the class folders. Hidden files and folders (`.DS_Store`,
`.ipynb_checkpoints`) and files without an image suffix are ignored; files with an image suffix
that do not decode are skipped and reported as `BadFile(path, reason)`.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

from serve.runtime.images import ImageError, is_image_file, load_image


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

    def to_split_dict(self) -> dict:
        """The split as plain data: what `split.json` holds in the run directory."""
        return {
            "root": str(self.root),
            "layout": self.layout,
            "classes": list(self.classes),
            "train": [{"path": p, "label": y} for p, y in self.train],
            "val": [{"path": p, "label": y} for p, y in self.val],
        }

    def write_split(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_split_dict(), indent=1))


def _visible(p: Path) -> bool:
    return not p.name.startswith(".")


def class_dirs(folder: Path) -> list[Path]:
    """The class folders of `folder`, sorted by name; hidden folders are not classes."""
    return sorted((d for d in folder.iterdir() if d.is_dir() and _visible(d)), key=lambda d: d.name)


def unreadable_folders(folder: Path) -> list[BadFile]:
    """Visible subfolders of `folder` that cannot be listed: `rglob` would skip their images silently."""
    errors: list[OSError] = []
    for _ in os.walk(folder, onerror=errors.append):
        pass
    visible = [e for e in errors if _visible_path(Path(e.filename).relative_to(folder))]
    return [BadFile(str(Path(e.filename).resolve()), f"folder cannot be read: {e.strerror}") for e in visible]


def _visible_path(rel: Path) -> bool:
    return not any(part.startswith(".") for part in rel.parts)


def list_images(folder: Path, verify: bool, bad: list[BadFile]) -> list[Path]:
    """Image files under `folder` (recursively, hidden parts skipped), sorted; broken files and folders go to `bad`."""
    bad.extend(unreadable_folders(folder))
    found = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).parts
        if any(part.startswith(".") for part in rel) or not p.is_file() or not is_image_file(p):
            continue
        if verify:
            try:
                load_image(p)
            except ImageError as e:
                bad.append(BadFile(str(p.resolve()), str(e)))
                continue
        found.append(p.resolve())
    return found


def _scan_classes(folder: Path, classes: list[str] | None, verify: bool, bad: list[BadFile]) -> dict[str, list[Path]]:
    dirs = class_dirs(folder)
    names = [d.name for d in dirs]
    if classes is not None and names != classes:
        raise ValueError(
            f"{folder} has class folders {names}, but the training folder has {classes}; "
            "train/ and val/ must hold the same class folders"
        )
    if len(dirs) < 2:
        raise ValueError(
            f"{folder} must hold at least 2 class folders (one folder of images per class), found {len(dirs)}"
            + (f": {names}" if names else "")
        )
    files = {}
    for d in dirs:
        files[d.name] = list_images(d, verify, bad)
        if not files[d.name]:
            raise ValueError(
                f"class folder {d} holds no readable images (jpg, png, webp, bmp, gif or tiff); "
                "add images or remove the folder"
            )
    return files


def stratified_split(
    files: dict[str, list[Path]], val_fraction: float, seed: int
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
    return train, val


def scan_folder(root: str | Path, val_fraction: float = 0.2, seed: int = 42, verify: bool = True) -> FolderScan:
    """Find classes and images under `root` and make (or read) the train/val split.

    Args:
        root: the image folder.
        val_fraction: share of each class held out for validation (pool layout only).
        seed: seed of the split.
        verify: decode every image now, so broken files are skipped and reported before training.

    Returns:
        A `FolderScan`.

    Raises:
        FileNotFoundError: `root` does not exist.
        ValueError: fewer than 2 classes, or an empty class folder (the message names it).
    """
    root = Path(root).expanduser().resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"image folder not found: {root} (expected root/<class>/<image> files)")
    bad: list[BadFile] = []
    if (root / "train").is_dir() and (root / "val").is_dir():
        train_files = _scan_classes(root / "train", None, verify, bad)
        classes = sorted(train_files)
        val_files = _scan_classes(root / "val", classes, verify, bad)
        train = [(str(p), y) for y, c in enumerate(classes) for p in train_files[c]]
        val = [(str(p), y) for y, c in enumerate(classes) for p in val_files[c]]
        return FolderScan(root, classes, train, val, bad, layout="train_val")
    files = _scan_classes(root, None, verify, bad)
    train, val = stratified_split(files, val_fraction, seed)
    return FolderScan(root, sorted(files), train, val, bad, layout="pool")
