"""One folder scan for every DDP rank: with `--data.dedupe auto`, a scan decodes every image.

- Rank 0 scans when the CLI builds the model. Before DDP starts the other processes of its machine, it
  writes that scan into the run directory (`scan.json`) and names the file in the environment they inherit
  (`hand_over`): they read it (`handed_scan`) instead of scanning the folder again.
- Ranks started another way (torchrun, SLURM, on another node) scan for themselves. In `setup`, every rank takes
  rank 0's split, sent through the process group (`rank_0_split`). When one found other classes or counts, on
  which it built its model's loss, all of them stop with the reason (`differs`).
"""

from __future__ import annotations

import os
from pathlib import Path

from train.data_report import class_counts
from train.errors import SetupError
from train.folder_scan import FolderScan

SCAN_FILE = "scan.json"  # in the run directory: rank 0's scan, read by the processes it starts
SCAN_ENV = "VITSCOPE_DDP_SCAN"  # that file, named to them (in rank 0's environment until its `setup`)


def launched_rank() -> int:
    """This process's rank as the DDP launcher set it in the environment (0 for the first or only process)."""
    return max(int(os.environ.get(k, "0") or 0) for k in ("LOCAL_RANK", "NODE_RANK", "RANK"))


def hand_over(scan: FolderScan, run_dir: Path) -> None:
    """On global rank 0, before DDP starts the other processes: write `scan` and name it in the environment."""
    run_dir.mkdir(parents=True, exist_ok=True)
    scan.save(run_dir / SCAN_FILE)
    os.environ[SCAN_ENV] = str((run_dir / SCAN_FILE).resolve())


def handed_scan(root: Path) -> FolderScan | None:
    """The scan of `root` rank 0 handed to this process when it started it, or None."""
    path = os.environ.get(SCAN_ENV, "") if launched_rank() > 0 else ""
    scan = FolderScan.load(path) if path and Path(path).is_file() else None
    return scan if scan is not None and scan.root == root.expanduser().resolve() else None


def rank_0_split(scan: FolderScan, strategy) -> FolderScan:
    """Rank 0's scan on every rank (rank 0 keeps its own object, with what its reports need).

    Raises:
        SetupError: on every rank, when one's own `scan` has other classes or counts than rank 0's.
    """
    os.environ.pop(SCAN_ENV, None)  # the processes it named the file to have started: no later one inherits it
    rank = strategy.global_rank
    theirs = FolderScan.from_dict(strategy.broadcast(scan.to_dict() if rank == 0 else None, src=0))
    reason = differs(scan, theirs, rank)
    if strategy.reduce_boolean_decision(not reason, all=True):
        return scan if rank == 0 else theirs
    raise SetupError(
        reason or f"{scan.root} changed while the DDP processes scanned it: see the other processes' errors"
    )


def differs(mine: FolderScan, theirs: FolderScan, rank: int) -> str:
    """Why `mine` (rank `rank`'s) cannot train on rank 0's split `theirs`, or "" when it can."""
    counts = lambda scan: dict(zip(scan.classes, class_counts(scan), strict=True))
    if counts(mine) == counts(theirs):
        return ""
    return (
        f"{mine.root} changed while the DDP processes scanned it: rank {rank} found {counts(mine)} training images per "
        f"class, rank 0 {counts(theirs)}. Keep the folder unchanged during a run, and start it again"
    )
