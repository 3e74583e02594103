"""`reports/data.json` and `reports/duplicates.csv`: what the folder holds, written before the first training step.

The data module writes them on rank 0, next to `split.json`, and logs a few plain lines: the class counts, the
imbalance ratio and what `--data.balance` does about it, the copies found, and any class too small to learn
from scratch. Each field is explained in docs/guide/reports.md.
"""

from __future__ import annotations

import csv
import json
import logging
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import numpy as np
from PIL import Image

from serve.runtime.images import FILE_NAME_ERRORS
from train.balance import AUTO_RATIO, imbalance_ratio, resolve_balance
from train.parallel import parallel_map

if TYPE_CHECKING:
    from train.folder_scan import FolderScan

log = logging.getLogger(__name__)

REPORTS = "reports"
# Below this many training images a class is hard to learn from scratch; pretrained weights need far fewer.
SMALL_CLASS = 50
FINETUNE_CONFIG = "configs/finetune_timm.yaml"
PARALLEL_FROM = 5_000  # images; fewer have their headers read in this process


def image_stats(sizes: np.ndarray, modes: list[str]) -> dict:
    """`image_sizes` and `image_modes` of data.json from (n, 2) widths and heights and the stored modes."""
    if len(sizes) == 0:
        return {"image_sizes": {}, "image_modes": {}}
    spread = lambda a: {"min": int(a.min()), "median": float(np.median(a)), "max": int(a.max())}
    common = Counter(f"{w}x{h}" for w, h in sizes.tolist()).most_common(5)
    return {
        "image_sizes": {"width": spread(sizes[:, 0]), "height": spread(sizes[:, 1]), "most_common": dict(common)},
        "image_modes": dict(Counter(modes).most_common()),
    }


def _headers(paths: list[str]) -> list[tuple[int, int, str]]:
    out = []
    for p in paths:
        try:
            with Image.open(p) as img:  # the header only: no pixel is decoded
                out.append((*img.size, img.mode))
        except Exception:  # noqa: BLE001 - a broken file is reported when it is decoded, not here
            continue
    return out


def header_stats(paths: list[str], workers: int | None = None, chunk: int = 2_000) -> dict:
    """`image_stats` from the files' headers alone (when the scan did not decode them)."""
    from train.dataset import usable_cores

    workers = workers or usable_cores()
    if len(paths) < PARALLEL_FROM or workers < 2:
        rows = _headers(paths)
    else:
        parts = parallel_map(_headers, [paths[i : i + chunk] for i in range(0, len(paths), chunk)], workers)
        rows = [r for part in parts for r in part]
    return image_stats(np.array([r[:2] for r in rows], np.int64).reshape(-1, 2), [r[2] for r in rows])


def class_counts(scan: FolderScan) -> list[int]:
    """Training images per class, index = class index."""
    return np.bincount([y for _, y in scan.train], minlength=len(scan.classes)).tolist()


def _split_of(scan: FolderScan) -> dict[str, str]:
    where = {p: "left_out" for p in scan.left_out}
    for name in ("train", "val", "calib"):
        where.update({p: name for p, _ in getattr(scan, name)})
    return where


def write_duplicates_csv(scan: FolderScan, f: TextIO) -> dict[str, int]:
    """Write `group,path,kind,split,label` for every image in a group to `f`; returns `across_splits` (the groups
    the folder itself put in two splits: the user's train/ and val/, `left_out` counting as val) and
    `conflicting_labels` (the groups whose images carry different classes: one of the labels is wrong)."""
    where, across, conflicting = _split_of(scan), 0, 0
    label = {p: scan.classes[y] for name in ("train", "val", "calib") for p, y in getattr(scan, name)}
    w = csv.writer(f)
    w.writerow(["group", "path", "kind", "split", "label"])
    for g, group in enumerate(scan.duplicates.groups if scan.duplicates else [], start=1):
        splits = {where.get(p, "") for p in group}
        across += len({"val" if s == "left_out" else s for s in splits}) > 1
        labels = [label.get(p, Path(p).parent.name) for p in group]  # one left out of val: its folder's class
        conflicting += len(set(labels)) > 1
        w.writerows((g, p, scan.duplicates.kind(p), where.get(p, ""), y) for p, y in zip(group, labels, strict=True))
    return {"across_splits": across, "conflicting_labels": conflicting}


def build_report(scan: FolderScan, balance: str, dedupe: str) -> dict:
    """What `reports/data.json` holds (docs/guide/reports.md explains each field)."""
    counts = class_counts(scan)
    dups = scan.duplicates.counts() if scan.duplicates else {"exact_groups": 0, "near_groups": 0}
    stats = scan.image_stats or header_stats([p for p, _ in scan.train + scan.val + scan.calib])
    corrections = scan.corrections or {"file": None, "relabelled": 0, "left_out": 0, "not_found": 0}
    return {
        "class_counts": dict(zip(scan.classes, counts, strict=True)),
        "splits": {"train": len(scan.train), "val": len(scan.val), "calib": len(scan.calib)},
        "imbalance_ratio": imbalance_ratio(counts),
        "balance": {"requested": balance, "method": resolve_balance(balance, counts)},
        "duplicates": {
            "searched": dedupe != "none",
            **dups,
            "across_splits": 0,
            "left_out_of_val": len(scan.left_out),
            "conflicting_labels": 0,
        },
        **stats,
        "corrections": corrections,
        "unreadable": len(scan.bad),
        "small_classes": [c for c, n in zip(scan.classes, counts, strict=True) if n < SMALL_CLASS],
    }


def write_data_report(scan: FolderScan, run_dir: Path, balance: str, dedupe: str) -> dict:
    """Write `reports/data.json` and `reports/duplicates.csv` into `run_dir`, log the summary, and return the report."""
    out = run_dir / REPORTS
    out.mkdir(parents=True, exist_ok=True)
    report = build_report(scan, balance, dedupe)
    with open(out / "duplicates.csv", "w", newline="", encoding="utf-8", errors=FILE_NAME_ERRORS) as f:
        report["duplicates"].update(write_duplicates_csv(scan, f))
    (out / "data.json").write_text(json.dumps(report, indent=1))
    for line in summary_lines(report):
        log.info(line)
    return report


def summary_lines(report: dict) -> list[str]:
    """The plain lines a run prints about its data."""
    counts, ratio = report["class_counts"], report["imbalance_ratio"]
    small, large = min(counts, key=counts.get), max(counts, key=counts.get)
    s = report["splits"]
    lines = [
        f"data: {len(counts)} classes; {s['train']} train, {s['val']} val, {s['calib']} calibration images; "
        f"largest class {large!r} {counts[large]}, smallest {small!r} {counts[small]} (imbalance ratio {ratio:.1f})"
    ]
    method, requested = report["balance"]["method"], report["balance"]["requested"]
    if method is not None:
        lines.append(f"imbalance: ratio {ratio:.1f} is {AUTO_RATIO:g} or more, so training uses {method}")
    elif requested == "none":
        lines.append("imbalance: --data.balance none, so training treats every image alike")
    else:
        lines.append(f"imbalance: ratio under {AUTO_RATIO:g}, nothing to correct")
    d = report["duplicates"]
    if d["exact_groups"] or d["near_groups"]:
        lines.append(
            f"copies: {d['exact_groups']} groups of exact copies and {d['near_groups']} of near-copies "
            f"(reports/duplicates.csv); each group is kept to one split"
            + (f"; {d['left_out_of_val']} val image(s) with a copy in train/ left out" if d["left_out_of_val"] else "")
        )
    if d.get("conflicting_labels"):  # a report of an older version has none
        lines.append(
            f"conflicting labels: {d['conflicting_labels']} copy groups hold the same image under different classes "
            "(the label column of reports/duplicates.csv), so one label of each is wrong: correct them with "
            "vit-train review RUN_DIR, or --data.corrections"
        )
    if report["small_classes"]:
        named = ", ".join(f"{c!r} ({counts[c]})" for c in report["small_classes"][:5])
        more = len(report["small_classes"]) - 5
        lines.append(
            f"small classes: {named}{f' and {more} more' if more > 0 else ''} have under {SMALL_CLASS} training "
            f"images, too few to learn from scratch: add images, or fine-tune pretrained weights "
            f"(--config {FINETUNE_CONFIG})"
        )
    return lines
