"""`--data.corrections FILE`: relabel images, or leave them out, without touching the user's folder.

The file is a CSV with the header `path,label`, one image a row:

    path,label
    /data/pets/cat/0042.jpg,dog        relabel: train it as a dog
    cat/0043.jpg,                      an empty label leaves the image out

A path is absolute (as in `split.json`, and as `vit-train review` writes it) or relative to the data root; the
same image named both ways, or through a linked folder (a data root or class folder that is a link), is one
image. When an image comes twice, the later row holds: a review that changes its mind appends its new decision.
Further columns (a note) are allowed, and kept by the review.
A label and a path are read exactly as written, so a class folder named `dog ` keeps its space; spaces typed
around a value (`cat/0043.jpg, dog`) are dropped only where the exact value names no class, or no file.
A row that is not a path and a label (no label column, no path, a value running over several lines because of a
stray quote) is refused with its line, as is a label that is no class; a value quoted as the csv module writes it
may hold a newline (a file name can), and a path that names no file is warned about, as any other.
The scan applies the file before the split, so a relabelled image is split (and stratified) as its new class.
"""

from __future__ import annotations

import csv
import logging
import os
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from serve.runtime.images import FILE_NAME_ERRORS

log = logging.getLogger(__name__)

HEADER = ["path", "label"]
STRAY_QUOTE = 'a field that starts with a quote (") runs to the next quote, across lines: close or remove it'


@dataclass
class CorrectionsTable:
    """A corrections file as read.

    Attributes:
        header: its first row as written: `path,label` and any further columns.
        rows: absolute path -> the latest row naming that image, as written, in the order of those rows.
        labels: absolute path -> its class name, or None to leave the image out.
    """

    header: list[str]
    rows: dict[str, list[str]]
    labels: dict[str, str | None]


def absolute_path(path: str, root: Path, folders: dict[str, str] | None = None) -> str:
    """`path` as the scan writes it: absolute (relative paths are taken from `root`), its folders resolved (each
    once with `folders`, as `resolved_folder`)."""
    p = Path(path).expanduser()
    return resolved_folder(os.path.normpath(p if p.is_absolute() else root / p), folders)


def resolved_folder(path: str, folders: dict[str, str] | None = None) -> str:
    """An absolute path with the links among its folders resolved and its own name kept, so that two names of one
    image compare alike: the scan follows linked folders (a data root or a class folder linked into place) and
    lists an image that is a link under its own name. `folders` keeps each folder's resolved path for the next."""
    head, name = os.path.split(path)
    if folders is None:
        return os.path.join(os.path.realpath(head), name)
    if head not in folders:
        folders[head] = os.path.realpath(head)
    return os.path.join(folders[head], name)


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
        ValueError: no `path,label` header, a row that is not a path and a label, or a label that is not a class
            (one line: where, what, what to do).
    """
    return read_corrections(file, root, classes).labels


def read_corrections(file: str | Path, root: str | Path, classes: list[str]) -> CorrectionsTable:
    """Read a corrections file, its rows as written beside what they mean (see `load_corrections`)."""
    file, root = Path(file).expanduser(), Path(root).expanduser().resolve()
    if not file.exists():
        raise FileNotFoundError(f"corrections file not found: {file} (a CSV with the header path,label)")
    if not file.is_file():
        raise ValueError(f"{file} is not a file: give a CSV with the header path,label, or move it away")
    rows = _read_rows(file)
    if not rows or [c.strip().lower() for c in rows[0][2][:2]] != HEADER:
        found = _shown(",".join(rows[0][2])) if rows else "an empty file"
        raise ValueError(f"{file} must start with the header line path,label (found {found})")
    # a label typed in another Unicode form than the folder's name (macOS writes names decomposed) is the class
    known = {**{_nfc(c): c for c in classes}, **{c: c for c in classes}}
    table, folders = CorrectionsTable(rows[0][2], {}, {}), {}  # each folder resolved once: the rows share a few
    for start, end, row, well_formed in rows[1:]:
        if not any(c.strip() for c in row):
            continue
        where = f"{file} line {start}"
        runs = f"; the row runs to line {end}: {STRAY_QUOTE}" if end > start and not well_formed else ""
        path, label = _parse(row, root, known, where, runs, folders)
        if label is False:
            raise ValueError(
                f"{where}: label {_shown(row[1])} is not a class (classes: {', '.join(map(repr, classes))}){runs}; "
                "correct it, or leave the label empty to leave the image out"
            )
        table.rows.pop(path, None)  # an image's place is that of its latest row
        table.rows[path], table.labels[path] = row, label
    return table


def _read_rows(file: Path) -> list[tuple[int, int, list[str], bool]]:
    """(first line, last line, row, whether it is well-formed CSV: its quotes closed, each just before a comma or the
    row's end) of each row of `file`; what the csv module cannot read is a ValueError."""
    out, start, lines = [], 1, []
    # utf-8-sig: spreadsheets save a byte-order mark
    with open(file, newline="", encoding="utf-8-sig", errors=FILE_NAME_ERRORS) as f:
        reader = csv.reader(lines.append(line) or line for line in f)  # each row's text too: it reads line by line
        while True:
            try:
                row = next(reader)
            except StopIteration:
                return out
            except csv.Error as e:  # a field over the csv module's limit: a quote left open long before
                raise ValueError(f"{file} line {start}: cannot read it as CSV ({e}): {STRAY_QUOTE}") from None
            end = reader.line_num
            out.append((start, end, row, end == start or _well_formed("".join(lines), row)))
            start, lines[:] = end + 1, []


def _well_formed(text: str, row: list[str]) -> bool:
    """Whether `text` reads as `row` with no leniency: a row over several lines then holds a quoted value with a
    newline, as the csv module writes one (`"new\\nline.png",label`: a file name may hold a newline). A stray quote
    that ran on into the rows after it is open to the end of the file, or closes at a quote followed by more text
    (`"a.png,b\\n"c.png,d`), which only the lenient reading takes. A value over several lines that holds a comma is
    rows a stray quote swallowed up to another (`"a.png,b\\nc.png",d`), unless it names a file (`_parse`)."""
    if "\n" in row[0] and "," in row[0]:
        return False
    try:
        return list(csv.reader([text], strict=True)) == [row]
    except csv.Error:
        return False


def _parse(
    row: list[str], root: Path, known: dict[str, str], where: str, runs: str, folders: dict[str, str]
) -> tuple[str, str | None | bool]:
    """(absolute path, class name: None to leave the image out, False when no class) of a row that is not blank.

    `where` names the row's file and line, `runs` says how far it runs when that is over several lines, and `folders`
    keeps the folders resolved so far (`resolved_folder`).
    """
    if not row[0].strip():
        raise ValueError(f"{where}: no path before the label {_shown(row[1])}{runs}; write path,label")
    if len(row) < 2:
        quoted = runs or (f"; {STRAY_QUOTE}" if "," in row[0] else "")  # a comma inside one field: it was quoted
        raise ValueError(
            f"{where}: no label column after {_shown(row[0])}{quoted}; write path,class to relabel the image, or "
            "path, (the label empty) to leave it out"
        )
    path = _image_path(row[0], root, folders)
    if "\n" in row[0] and runs and not os.path.isfile(path):  # a stray quote ran on, unless this names a file
        raise ValueError(f"{where}: the path {_shown(row[0])} names no file{runs}")
    for label in (row[1], row[1].strip()):
        if not label:
            return path, None
        if (name := known.get(label, known.get(_nfc(label)))) is not None:
            return path, name
    return path, False


def _nfc(text: str) -> str:
    return unicodedata.normalize("NFC", text)


def _image_path(text: str, root: Path, folders: dict[str, str]) -> str:
    """`text` as an absolute path; the text less its outer spaces only where that names a file and `text` not."""
    exact = absolute_path(text, root, folders)
    if not os.path.isfile(exact):  # the path typed in another Unicode form than the file's name
        exact = next((p for form in ("NFD", "NFC") if os.path.isfile(p := unicodedata.normalize(form, exact))), exact)
    if text.strip() == text or os.path.isfile(exact):
        return exact
    stripped = absolute_path(text.strip(), root, folders)
    return stripped if os.path.isfile(stripped) else exact


def _shown(text: str, most: int = 80) -> str:
    """`text` quoted on one line, cut to `most` characters."""
    return repr(text[:most]) + (f" (and {len(text) - most} more characters)" if len(text) > most else "")


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
    counts, seen, folders = {"relabelled": 0, "left_out": 0}, set(), {}
    by_form = {_nfc(k): k for k in fixes}  # a path typed in another Unicode form (macOS's file systems take both)
    for name, paths in files.items():
        for p in paths:
            key = resolved_folder(p, folders)  # a folder linked inside a class folder is listed as reached
            key = key if key in fixes else by_form.get(_nfc(key), key)
            if key not in fixes:
                out[name].append(p)
                continue
            seen.add(key)
            label = fixes[key]
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
    A file none of whose paths matches is refused before this (`correct_folder`).
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
        ValueError: a class is left with no images, or the file names none of the folder's images.
    """
    fixes = load_corrections(file, root, classes)
    record = {"file": str(Path(file).expanduser().resolve()), "relabelled": 0, "left_out": 0}
    out, seen = [], set()
    for files in parts:
        corrected, counts, found = apply_corrections(files, fixes)
        out.append(corrected)
        seen |= found
        record = {**record, **{k: record[k] + v for k, v in counts.items()}}
    for side, corrected in enumerate(out):
        if empty := [name for name, paths in corrected.items() if not paths]:
            # of the user's own train/ and val/, the class may keep images on the other side: then it stays
            where = f" in {'val' if side else 'train'}/" if any(part[empty[0]] for part in out) else ""
            fix = f"keep some of its images{where}" if where else "keep some of its images, or remove its folder"
            raise ValueError(f"after the corrections in {file}, class {empty[0]!r} has no images left{where}: {fix}")
    if fixes and not seen:  # not one image moved on: the file names another folder, or the same one mounted elsewhere
        raise ValueError(
            f"none of the {len(fixes)} images in {file} is in {root}: it was written for another folder or mount "
            "(its paths are absolute, or relative to --data.root), or its images are gone; give the corrections "
            "of this folder, or train without --data.corrections"
        )
    record["not_found"] = report_unmatched(fixes, seen, file)
    return out, record
