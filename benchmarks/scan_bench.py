"""How long does the folder scan take on a million small images?

Writes N small PNGs (distinct 16 x 16 noise images, 100 per file template, in `--classes` class folders)
into a temporary folder, times `train.folder_scan.scan_folder` on it (listing, header check in a process pool,
split), and deletes the folder afterwards.

    .venv/bin/python -m benchmarks.scan_bench [--n 1000000] [--classes 100] [--dir /tmp]

Target: 1,000,000 files scanned in under 2 minutes on the 2-core reference machine.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from benchmarks.common import Result, add_results_option
from train.dataset import usable_cores
from train.folder_scan import scan_folder


def write_folder(root: Path, n: int, classes: int) -> None:
    rng = np.random.default_rng(0)
    templates = []
    for _ in range(100):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (16, 16), dtype=np.uint8), "L").save(buf, "PNG")
        templates.append(buf.getvalue())
    per_class = -(-n // classes)
    written = 0
    for c in range(classes):
        folder = root / f"class{c:04d}"
        folder.mkdir(parents=True)
        for i in range(min(per_class, n - written)):
            with open(folder / f"{i:07d}.png", "wb") as f:
                f.write(templates[i % 100])
        written += min(per_class, n - written)
    # one broken file among them, which the scan must report
    (root / "class0000" / "broken.png").write_bytes(b"not a png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000, help="files to write")
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--dir", default=None, help="where to make the temporary folder (default: the temp dir)")
    args = add_results_option(parser).parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="scan_bench_", dir=args.dir))
    try:
        start = time.perf_counter()
        write_folder(tmp / "images", args.n, args.classes)
        written = time.perf_counter() - start
        os.sync()
        scan = scan_folder(tmp / "images", val_fraction=0.1)
        files = len(scan.train) + len(scan.val)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    setting = {"files": args.n, "classes": args.classes, "usable cores": usable_cores()}
    result = Result("scan_bench", setting, results=args.results)
    table = result.table(["files", "classes", "unreadable", "scan s", "files/s", "target"])
    table.formats = {"scan s": "{:.1f}", "files/s": "{:,.0f}"}
    verdict = "met" if scan.seconds < 120 else "MISSED"
    table.add(files, len(scan.classes), len(scan.bad), scan.seconds, files / scan.seconds, f"< 120 s: {verdict}")
    table.notes.append(f"{args.n:,} files written in {written:.0f} s (not timed)")
    result.finish()


if __name__ == "__main__":
    main()
