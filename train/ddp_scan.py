"""One folder scan for every DDP rank: with `--data.dedupe auto`, a scan decodes every image.

- Rank 0 scans when the CLI builds the model. Before a DDP fit starts the other processes of its machine, it
  writes that scan into the run directory (`scan.json`) and names the file in the environment they inherit
  (`hand_over`): they read it (`handed_scan`) instead of scanning the folder again.
- In `prepare_data`, rank 0 writes the file again. Ranks started by another launcher (torchrun, or on another
  node) have scanned for themselves: in `setup` each takes rank 0's split (`agree`). It stops, with the reason,
  when it found other classes or counts, because its model's loss was built on them.
"""

from __future__ import annotations

import os
from pathlib import Path

from train.data_report import class_counts
from train.folder_scan import FolderScan

SCAN_FILE = "scan.json"  # in the run directory: rank 0's scan, read by the other ranks
SCAN_ENV = "VITSCOPE_DDP_SCAN"  # that file, named to the processes rank 0 starts


def launched_rank() -> int:
    """This process's rank as the DDP launcher set it in the environment (0 for the first or only process)."""
    return max(int(os.environ.get(k, "0") or 0) for k in ("LOCAL_RANK", "NODE_RANK", "RANK"))


def hand_over(scan: FolderScan, run_dir: Path) -> None:
    """On rank 0, before DDP starts the other processes: write `scan` for them and name it in the environment."""
    if launched_rank() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        scan.save(run_dir / SCAN_FILE)
        os.environ[SCAN_ENV] = str((run_dir / SCAN_FILE).resolve())


def handed_scan() -> FolderScan | None:
    """The scan rank 0 handed to this process when it started it, or None (rank 0, or another launcher)."""
    path = os.environ.get(SCAN_ENV, "") if launched_rank() > 0 else ""
    return FolderScan.load(path) if path and Path(path).is_file() else None


def agree(mine: FolderScan | None, shared: Path, rank: int) -> FolderScan:
    """Rank 0's scan (`shared`), for a rank that has `mine` (None: not scanned yet).

    Raises:
        ValueError: `mine` has other classes or training images per class than rank 0's.
    """
    theirs = FolderScan.load(shared)
    counts = dict(zip(theirs.classes, class_counts(theirs), strict=True))
    if mine is not None and (own := dict(zip(mine.classes, class_counts(mine), strict=True))) != counts:
        raise ValueError(
            f"{mine.root} changed while the DDP processes scanned it: rank {rank} found {own} training images per "
            f"class, rank 0 {counts}. Keep the folder unchanged during a run, and start it again"
        )
    return theirs
