"""`--data.corrections FILE`: relabel images, or leave them out, without touching the user's folder.

The file is a CSV with the header `path,label`, one image a row:

    path,label
    /data/pets/cat/0042.jpg,dog        relabel: train it as a dog
    cat/0043.jpg,                      an empty label leaves the image out

A path is absolute (as in `split.json`, and as `vit-train review` writes it) or relative to the data root.
When a path comes twice, the later row holds: a review that changes its mind appends its new decision.
The scan applies the file before the split, so a relabelled image is split (and stratified) as its new class.
"""

from __future__ import annotations

import csv
import logging
import os
from pathlib import Path

from serve.runtime.images import FILE_NAME_ERRORS

log = logging.getLogger(__name__)

HEADER = ["path", "label"]


def _absolute(path: str, root: Path) -> str:
    """`path` as the scan writes it: absolute, the root resolved (relative paths are taken from `root`)."""
    p = Path(path).expanduser()
    return os.path.normpath(p if p.is_absolute() else root / p)


def load_corrections(file: str | Path, root: str | Path, classes: list[str]) -> dict[str, str | None]:
    """Read a corrections file.

    Args:
        file: the CSV (`path,label`).
        root: the data root that relative paths start from.
        classes: the class names a label must be one of.

    Returns:
        absolute path -> its new class name, or None to leave the image out.

    Raises:
        FileNotFoundError: `file` does not exist.
        ValueError: no `path,label` header, or a label that is not a class (one line: where, what, what to do).
    """
    file, root = Path(file).expanduser(), Path(root).expanduser().resolve()
    if not file.is_file():
        raise FileNotFoundError(f"corrections file not found: {file} (a CSV with the header path,label)")
    # utf-8-sig: spreadsheets save a byte-order mark
    with open(file, newline="", encoding="utf-8-sig", errors=FILE_NAME_ERRORS) as f:
        rows = list(csv.reader(f))
    if not rows or [c.strip().lower() for c in rows[0][:2]] != HEADER:
        found = ",".join(rows[0]) if rows else "an empty file"
        raise ValueError(f"{file} must start with the header line path,label (found {found!r})")
    known = set(classes)
    fixes: dict[str, str | None] = {}
    for line, row in enumerate(rows[1:], start=2):
        if not row or not row[0].strip():
            continue
        path, label = row[0].strip(), (row[1].strip() if len(row) > 1 else "")
        if label and label not in known:
            raise ValueError(
                f"{file} line {line}: label {label!r} is not a class (classes: {', '.join(classes)}); "
                "correct it, or leave the label empty to leave the image out"
            )
        fixes[_absolute(path, root)] = label or None
    return fixes


def apply_corrections(
    files: dict[str, list[str]], fixes: dict[str, str | None]
) -> tuple[dict[str, list[str]], dict[str, int], set[str]]:
    """Move relabelled images to their new class and drop the ones left out.

    Args:
        files: class name -> image paths (one part of the folder: the pool, or its train/ or val/).
        fixes: what `load_corrections` returned.

    Returns:
        (the corrected files, {"relabelled": n, "left_out": n}, the paths of `fixes` found in `files`).
    """
    out: dict[str, list[str]] = {name: [] for name in files}
    counts, seen = {"relabelled": 0, "left_out": 0}, set()
    for name, paths in files.items():
        for p in paths:
            if p not in fixes:
                out[name].append(p)
                continue
            seen.add(p)
            label = fixes[p]
            if label is None:
                counts["left_out"] += 1
            else:
                out[label].append(p)
                counts["relabelled"] += label != name
    return {name: sorted(paths) for name, paths in out.items()}, counts, seen


def report_unmatched(fixes: dict[str, str | None], seen: set[str], file: str | Path) -> int:
    """Warn about the corrected paths that are not in the folder; returns how many.

    A warning, not a refusal: a corrections file outlives the folder it was written for (an image since
    deleted, moved or found unreadable), and the run should not stop for an image it would not train on anyway.
    """
    missing = sorted(set(fixes) - seen)
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        log.warning(
            "%d path(s) in %s are not images of the folder, so their corrections do nothing: %s; "
            "paths are absolute or relative to --data.root", len(missing), file, shown,
        )  # fmt: skip
    return len(missing)


def correct_folder(
    parts: list[dict[str, list[str]]], file: str | Path, root: Path, classes: list[str]
) -> tuple[list[dict[str, list[str]]], dict]:
    """Apply the corrections `file` to each part of a folder (the pool, or train/ and val/).

    Returns:
        (the corrected parts, the record `split.json` and `reports/data.json` keep:
        {"file", "relabelled", "left_out", "not_found"}).

    Raises:
        ValueError: a class is left with no images.
    """
    fixes = load_corrections(file, root, classes)
    record = {"file": str(Path(file).expanduser().resolve()), "relabelled": 0, "left_out": 0}
    out, seen = [], set()
    for files in parts:
        corrected, counts, found = apply_corrections(files, fixes)
        out.append(corrected)
        seen |= found
        record = {**record, **{k: record[k] + v for k, v in counts.items()}}
        empty = [name for name, paths in corrected.items() if not paths]
        if empty:
            raise ValueError(
                f"after the corrections in {file}, class {empty[0]!r} has no images left: keep some of its images, "
                "or remove its folder"
            )
    record["not_found"] = report_unmatched(fixes, seen, file)
    return out, record
