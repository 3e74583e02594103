"""Copies and near-copies: how many the folder scan finds, how many distinct images it groups, whether a split
keeps each group on one side, and how the search time grows with the folder (`train.duplicates`).

A fixed draw of 10,000 Fashion-MNIST training images gets 2 % byte copies (200) and 2 % JPEG near-copies at
another size (100 enlarged to 40 px, 100 shrunk to 22 px; quality 75), each beside its source in the source's
class folder; 100 brightened (x1.15) and 100 cropped (a pixel off each side) JPEG copies of further sources are
harder edits, shown apart. Every source is drawn once. A copy is found when the scan puts it in its source's
group; the other images are those with nothing planted, and those the scan puts in a group are false groupings.
The folder is then split as `vit-train fit` splits it (`scan_folder`, val 0.2, calibration 0.1), with and
without `--data.dedupe`. The search timings use synthetic 64-bit hashes (uniform, plus 1,000 planted pairs a
few bits apart) and time the sub-quadratic band search against comparing every pair (estimated from a sample).

    sudo apt-get install dataset-fashion-mnist && vit-fashion-mnist --out data/fmnist
    nice -n 10 .venv/bin/python -m benchmarks.duplicates
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageEnhance

from benchmarks.common import Result, add_results_option
from train import duplicates
from train.folder_scan import scan_folder

EDITS = {  # name -> (how many, what makes the copy from the source's grey image), in planting order
    "byte copy": (200, None),
    "JPEG enlarged to 40 px": (100, lambda im: im.resize((40, 40), Image.Resampling.BICUBIC)),
    "JPEG shrunk to 22 px": (100, lambda im: im.resize((22, 22), Image.Resampling.BICUBIC)),
    "JPEG brightened x1.15": (100, lambda im: ImageEnhance.Brightness(im).enhance(1.15)),
    "JPEG cropped 1 px each side": (100, lambda im: im.crop((1, 1, im.width - 1, im.height - 1))),
}
SIZED = ("JPEG enlarged to 40 px", "JPEG shrunk to 22 px")  # the "JPEG at another size"


def build_folder(source: Path, out: Path, n: int, seed: int = 0) -> tuple[list[str], dict[str, list[tuple[str, str]]]]:
    """`out/<class>/`: `n` drawn images of `source` and the planted copies beside their sources.

    Returns:
        (the drawn images' paths in `out`, edit name -> [(source path, copy path)]).
    """
    files = sorted(source.glob("*/*.png"))
    drawn = random.Random(seed).sample(files, n)
    originals = []
    for f in drawn:
        (out / f.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, out / f.parent.name / f.name)
        originals.append(str(out / f.parent.name / f.name))
    planted, at = {}, 0
    for name, (count, edit) in EDITS.items():
        planted[name] = []
        for src in originals[at : at + count]:
            stem = Path(src).with_suffix("")
            if edit is None:
                dst = f"{stem}_copy.png"
                shutil.copyfile(src, dst)
            else:
                dst = f"{stem}_{len(planted[name])}_near.jpg"
                edit(Image.open(src).convert("L")).save(dst, quality=75)
            planted[name].append((src, dst))
        at += count
    return originals, planted


def quality(root: Path, originals: list[str], planted: dict) -> tuple[dict, dict]:
    """Recall per edit and the false groupings, from one `find_duplicates` pass timed phase by phase."""
    paths = sorted(str(p) for p in root.glob("*/*"))
    start = time.perf_counter()
    facts = duplicates.image_facts(paths)
    decoded = time.perf_counter()
    candidates = duplicates.band_pairs(facts.hashes, duplicates.MAX_HAMMING)
    searched = time.perf_counter()
    duplicates.pixel_distance(facts.smalls, facts.small_sizes, candidates)
    verified = time.perf_counter()
    dups = duplicates.group_duplicates(facts)  # the search and the check again, and the grouping
    grouped = time.perf_counter()
    group_of = {p: k for k, g in enumerate(dups.groups) for p in g}
    found = lambda a, b: a in group_of and group_of.get(a) == group_of.get(b)
    recall = {name: sum(found(a, b) for a, b in pairs) / len(pairs) for name, pairs in planted.items()}
    recall["JPEG at another size (both)"] = np.mean([found(a, b) for name in SIZED for a, b in planted[name]])
    sources = {a for pairs in planted.values() for a, _ in pairs}
    others = [p for p in originals if p not in sources]
    timing = {
        "images": len(paths),
        "others": len(others),
        "others grouped": sum(p in group_of for p in others),
        "groups": len(dups.groups),
        "candidate pairs": len(candidates),
        "decode s": decoded - start,
        "search s": searched - decoded,
        "pixel check s": verified - searched,
        "find_duplicates in all, s": decoded - start + grouped - verified,
    }
    return recall, timing


def straddling(root: Path, planted: dict) -> dict[str, int]:
    """Groups in two splits, and planted copies in another split than their source, with and without dedupe."""
    out = {}
    for dedupe in (True, False):
        scan = scan_folder(root, 0.2, seed=0, calib_fraction=0.1, dedupe=dedupe)
        split = {p: s for s in ("train", "val", "calib") for p, _ in getattr(scan, s)}
        if dedupe:
            out["groups"] = sum(len({split[p] for p in g}) > 1 for g in scan.duplicates.groups)
        out["auto" if dedupe else "none"] = sum(
            split[a] != split[b] for k in ("byte copy", *SIZED) for a, b in planted[k]
        )
    return out


def search_timing(n: int, seed: int = 0, planted: int = 1000) -> list:
    """One row of the search table: n synthetic hashes, `planted` of them copies of others a few bits apart."""
    rng = np.random.default_rng(seed)
    hashes = rng.integers(0, 2**64, n, dtype=np.uint64, endpoint=False)
    flips = rng.integers(1, duplicates.MAX_HAMMING + 1, planted)
    twins = hashes[:planted].copy()
    for k, f in enumerate(flips):
        twins[k] ^= np.bitwise_or.reduce(np.uint64(1) << rng.choice(64, f, replace=False).astype(np.uint64))
    hashes[n - planted :] = twins
    start = time.perf_counter()
    pairs = duplicates.band_pairs(hashes, duplicates.MAX_HAMMING)
    seconds = time.perf_counter() - start
    got = {(int(i), int(j)) for i, j in pairs}
    hit = np.array([(k, n - planted + k) in got for k in range(planted)])
    sample = rng.integers(0, n, (2, 2_000_000))
    per_pair = min(timed_pairs(hashes, sample) for _ in range(3))  # a brute-force search compares every pair
    return [n, duplicates.band_bits(n), seconds, float(hit[flips <= 4].mean()), float(hit[flips > 4].mean()),
            per_pair * n * (n - 1) / 2]  # fmt: skip


def timed_pairs(hashes: np.ndarray, sample: np.ndarray) -> float:
    start = time.perf_counter()
    np.flatnonzero(duplicates.hamming(hashes[sample[0]], hashes[sample[1]]) <= duplicates.MAX_HAMMING)
    return (time.perf_counter() - start) / sample.shape[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="data/fmnist/train", help="Fashion-MNIST's class folders")
    parser.add_argument("--images", type=int, default=10_000, help="images drawn from --source")
    parser.add_argument("--sizes", default="100000,1000000", help="comma-separated: synthetic hashes to search")
    args = add_results_option(parser).parse_args()
    with tempfile.TemporaryDirectory(prefix="duplicates_") as tmp:
        root = Path(tmp) / "folder"
        originals, planted = build_folder(Path(args.source), root, args.images)
        recall, timing = quality(root, originals, planted)
        apart = straddling(root, planted)
    setting = {"images": args.images, "max Hamming": duplicates.MAX_HAMMING, "blur": duplicates.BLUR,
               "max difference": duplicates.MAX_DIFF, "cores": os.cpu_count()}  # fmt: skip
    result = Result("duplicates", setting, ("numpy", "scipy", "pillow"), results=args.results)
    t = result.table(["planted", "copies", "found"], formats={"found": "{:.1%}"})
    for name, share in recall.items():
        t.add(name, sum(len(planted[k]) for k in SIZED) if name not in planted else len(planted[name]), share)
    t = result.table(["the folder", "value"])
    share = timing["others grouped"] / timing["others"]
    t.add(
        "other images (nothing planted) put in a group",
        f"{timing['others grouped']} of {timing['others']:,} ({share:.2%})",
    )
    t.add("groups in two splits after the scan's split", apart["groups"])
    t.add(
        "byte and resized copies in another split than their source", f"{apart['auto']} (file by file: {apart['none']})"
    )
    t.add(
        f"groups found among {timing['images']:,} images; candidate pairs",
        f"{timing['groups']}; {timing['candidate pairs']:,}",
    )
    t.add(
        "decode / search / pixel check / find_duplicates in all, s",
        " / ".join(f"{timing[k]:.1f}" for k in ("decode s", "search s", "pixel check s", "find_duplicates in all, s")),
    )
    t = result.table(["hashes", "band bits", "band search s", "planted found, 1-4 bits", "5-10 bits",
                      "every pair compared, s (estimated)"],
                     formats={"band search s": "{:.2f}", "planted found, 1-4 bits": "{:.1%}", "5-10 bits": "{:.1%}",
                              "every pair compared, s (estimated)": "{:,.0f}"})  # fmt: skip
    for n in [int(s) for s in args.sizes.split(",") if s]:
        t.add(*search_timing(n))
        print(t.rows[-1], flush=True)
    result.finish()


if __name__ == "__main__":
    main()
