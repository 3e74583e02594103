"""Image folders as LitData streaming datasets: `vit-train prepare`, and `--data.root` pointing at one.

    vit-train prepare --data.root data/fmnist --out shards/fmnist      # or --out s3://bucket/fmnist
    vit-train fit --config configs/small_images.yaml --data.root shards/fmnist

`prepare` scans the folder exactly as training does (same split, classes, header check), decodes every
image once to find the broken ones (listed in `bad_files.csv`), and writes the encoded files, untouched,
into LitData's chunked format: `out/train/`, `out/val/` and `out/vitscope.json` (classes, split, counts).
Training streams the chunks (`litdata.StreamingDataset`): each DDP rank reads its own chunks, and the
`StreamingDataLoader`'s position is saved in checkpoints, so a run resumed from a mid-epoch `last.ckpt`
(`--last.every_n_train_steps N` writes one every N steps) continues from the next sample of its epoch.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from jsonargparse import ArgumentParser

from serve.runtime.images import FILE_NAME_ERRORS, ImageError, load_image
from serve.runtime.interrupts import exit_code, sigterm_as_interrupt
from serve.runtime.outputs import create_anew
from train.balance import resolve_balance
from train.data_report import REPORTS, build_report, class_counts, write_duplicates_csv
from train.dataset import ignore_sigterm, usable_cores
from train.folder_scan import BadFile, FolderScan, scan_folder
from train.optimize import optimizing
from train.parallel import parallel_map
from train.prepare_out import check_out_usable, holding_out, write_failure
from train.splits import no_validation

log = logging.getLogger(__name__)

META = "vitscope.json"
MARK = ".vitscope-prepare"  # written first: a folder with it is a prepare's, finished (with META) or not
FORMAT = "vitscope-litdata/1"


def warn_fixed_by_prepare(root: str | Path, given: dict) -> None:
    """Say which data settings `given` ({name: value}, each set away from its default) a prepared dataset at `root`
    does not apply: its split is fixed in its chunks by `vit-train prepare`, and it is read as streamed."""
    if given and is_streaming_root(root):
        unapplied = ", ".join(f"--data.{k} {v}" for k, v in given.items())
        log.warning(
            "%s is a prepared (streamed) dataset: its split was fixed by vit-train prepare, and it is read as "
            "streamed, so %s is not applied (prepare it again with another split)", root, unapplied
        )  # fmt: skip


def expand_local(path: str) -> str:
    """`~` expanded in a local path (a config file passes it as written: no shell expands it there); a URL as it is."""
    return path if "://" in path else os.path.expanduser(path)


def is_streaming_root(root: str | Path) -> bool:
    """True for a local folder `prepare` wrote, or any remote URL (s3://, gs://): those are streamed."""
    text = str(root)
    folder = Path(text).expanduser()
    made = [folder / META, folder / MARK, folder / "train" / "index.json"]  # finished, or stopped half-way
    return "://" in text or any(p.is_file() for p in made)


def _decode_errors(paths: list[str]) -> list[tuple[str, str]]:
    errors = []
    for p in paths:
        try:
            load_image(p)
        except (ImageError, OSError) as e:
            errors.append((p, str(e)))
    return errors


def _sample(item: tuple[str, int]) -> dict[str, Any]:
    path, label = item
    return {"image": Path(path).read_bytes(), "label": int(label)}


def prepare(
    root: str,
    out: str,
    val_fraction: float = 0.2,
    seed: int = 42,
    workers: int | None = None,
    chunk_bytes="64MB",
    corrections: str | None = None,
    dedupe: str = "auto",
) -> dict:
    """Convert the image folder `root` into LitData chunks of `chunk_bytes` under `out` (a folder or s3:// / gs:// URL).

    `corrections` and `dedupe` act as in fit (`ImageFolderDataModule`): the chunks hold the corrected, grouped
    split, and `out/duplicates.csv` and the report in `out/vitscope.json` travel with them. A local `out` is checked
    before the scan, and held by this prepare alone until it ends (`train.prepare_out`).

    Returns:
        What `out/vitscope.json` holds: format, classes, layout, counts, bad files, class counts, data report.
    """
    from litdata import optimize

    root, out = expand_local(root), expand_local(out)
    check_out_apart(root, out)
    check_chunk_bytes(chunk_bytes)
    if workers is not None and workers < 1:
        raise ValueError(f"--workers must be at least 1 (or left out: the usable cores), got {workers}")
    check_out_usable(out)  # before the scan: a file, a link to nothing, a folder this user cannot write
    with holding_out(out):  # one prepare at a time: a second into the same folder is refused
        check_out_fresh(out)
        scan = scan_folder(root, val_fraction, seed, verify=True, corrections=corrections, dedupe=dedupe != "none")
        if not scan.val:  # before any chunk: LitData would write train/, then fail on an empty val/
            raise ValueError(no_validation(scan))
        workers = workers or usable_cores()
        paths = [p for p, _ in scan.train + scan.val] if scan.duplicates is None else []  # dedupe decoded them all
        chunks = [paths[i : i + 1000] for i in range(0, len(paths), 1000)]
        errors = [e for part in parallel_map(_decode_errors, chunks, workers) for e in part]
        broken = {p for p, _ in errors}
        bad = [(b.path, b.reason) for b in scan.bad] + errors
        meta = {"format": FORMAT, "root": str(scan.root), "layout": scan.layout, "classes": scan.classes}
        with optimizing():
            _remove_meta(out)  # before any chunk is rewritten: a prepare stopped half-way must not pair them with it
            _write_text(out, MARK, "")  # and a first one stopped before its index is still known as a prepare's
            for split, items in (("train", scan.train), ("val", scan.val)):
                items = [it for it in items if it[0] not in broken]
                optimize(fn=_sample, inputs=items, output_dir=f"{out.rstrip('/')}/{split}", chunk_bytes=chunk_bytes,
                         num_workers=workers, mode="overwrite")  # fmt: skip
                meta[split] = len(items)
        meta["bad"] = [{"path": p, "reason": r} for p, r in bad]
        meta["class_counts"] = class_counts(scan)
        meta["report"] = build_report(scan, "auto", dedupe)
        buf = io.StringIO()
        meta["report"]["duplicates"].update(write_duplicates_csv(scan, buf))
        _write_text(out, "duplicates.csv", buf.getvalue())
        _write_text(out, META, json.dumps(meta, indent=1))
        buf = io.StringIO()
        csv.writer(buf).writerows([["file", "reason"], *bad])
        _write_text(out, "bad_files.csv", buf.getvalue())
        return meta


def check_out_apart(root: str, out: str) -> None:
    """A `ValueError` when the local `out` is `root` or inside it, or `root` is in `out/train` or `out/val`: the chunks
    would be written into the image folder, and the next scan would read them as classes."""
    if "://" in out:
        return
    images, chunks = Path(root).expanduser().resolve(), Path(out).expanduser().resolve()
    written = [chunks / "train", chunks / "val"]  # what `optimize` overwrites: the images must not be in either
    if images == chunks or images in chunks.parents or any(w == images or w in images.parents for w in written):
        raise ValueError(
            f"--out must be a folder outside --data.root: {out} would write the chunks into {root}; "
            "choose another folder, e.g. shards/<name>"
        )


def check_out_fresh(out: str) -> None:
    """A `ValueError` when the local `out` holds files and is not an earlier prepare's folder: an image folder given
    by mistake would get train/ and val/ beside its classes, and stream as the other dataset from then on."""
    folder = Path(out)
    if "://" in out or not folder.is_dir() or is_streaming_root(folder) or _chunks_only(folder):
        return
    hidden = lambda p: p.name.startswith(".") or p.name == "lost+found"  # .DS_Store, .gitkeep, a fresh mount
    if first := next((p for p in sorted(folder.iterdir()) if not hidden(p)), None):
        raise ValueError(
            f"--out {out} holds files vit-train prepare did not write ({first.name}): give a new or empty folder, "
            "e.g. shards/<name>"
        )


def _chunks_only(folder: Path) -> bool:
    """Whether `folder` holds LitData chunks alone in train/ and val/: a prepare stopped before its first index, by
    a version that wrote no mark."""
    parts = [p for split in ("train", "val") if (folder / split).is_dir() for p in (folder / split).iterdir()]
    named = lambda p: p.name.startswith("chunk-") or p.name.endswith("index.json")
    return bool(parts) and all(named(p) for p in parts) and {p.name for p in folder.iterdir()} <= {"train", "val"}


def check_chunk_bytes(chunk_bytes: int | str) -> None:
    """A `ValueError` unless `chunk_bytes` is a positive size LitData reads (a number of bytes, or "64MB", "4kb"): a
    wrong one failed inside LitData after the whole scan, with a traceback."""
    size = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([tgmk]b?|b)\s*", str(chunk_bytes), re.IGNORECASE)
    if not (chunk_bytes > 0 if isinstance(chunk_bytes, int) else size and float(size[1]) > 0):
        raise ValueError(f"--chunk_bytes {chunk_bytes!r}: give a size with its unit, such as 64MB or 4kb")


def _remove_meta(out: str) -> None:
    """Delete an earlier prepare's `vitscope.json` from `out`: new chunks beside it, from a prepare stopped half-way,
    trained on its old classes without a word (`read_meta` then says the prepare did not finish)."""
    if "://" not in out:
        (Path(out) / META).unlink(missing_ok=True)
        return
    import fsspec

    fs, path = fsspec.core.url_to_fs(f"{out.rstrip('/')}/{META}")
    if fs.exists(path):
        fs.rm(path)


def _write_text(out: str, name: str, text: str) -> None:
    if "://" not in out:  # whole or not at all: a prepare killed mid-write leaves no vitscope.json cut short
        Path(out).mkdir(parents=True, exist_ok=True)
        partial = Path(out) / f".{name}.partial"
        with create_anew(partial, "w", encoding="utf-8", errors=FILE_NAME_ERRORS) as f:  # never through a link
            f.write(text)
        partial.replace(Path(out) / name)
        return
    import fsspec  # remote outputs: the object store's fsspec driver (s3fs, gcsfs)

    with fsspec.open(f"{out.rstrip('/')}/{name}", "w", encoding="utf-8", errors=FILE_NAME_ERRORS) as f:
        f.write(text)


def read_meta(root: str) -> dict:
    """`vitscope.json` of a prepared dataset (local or remote)."""
    try:
        if "://" not in root:
            meta = json.loads((Path(root).expanduser() / META).read_text())
        else:
            import fsspec

            with fsspec.open(f"{root.rstrip('/')}/{META}") as f:
                meta = json.loads(f.read())
    except FileNotFoundError:
        raise ValueError(
            f"{root} has chunks but no {META}: its `vit-train prepare` did not finish; run it again"
        ) from None
    except ValueError as e:  # cut short or damaged
        raise ValueError(f"{root}/{META} cannot be read ({e}): run its `vit-train prepare` again") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{root} is not a dataset written by `vit-train prepare` (format {meta.get('format')!r})")
    return meta


def streaming_scan(root: str) -> FolderScan:
    """What the data module needs of a prepared dataset: classes and bad files (the split is in the chunks)."""
    meta = read_meta(root)
    bad = [BadFile(b["path"], b["reason"]) for b in meta.get("bad", [])]
    return FolderScan(Path(meta["root"]), list(meta["classes"]), [], [], bad, layout="litdata")


def streaming_class_counts(root: str, classes: list[str]) -> list[int]:
    """Training images per class of a prepared dataset (0s for one prepared before counts were kept)."""
    return list(read_meta(root).get("class_counts") or [0] * len(classes))


def write_streaming_report(root: str, run_dir: Path, balance: str, counts: list[int]) -> None:
    """`reports/data.json` of a run on a prepared dataset: the report `prepare` made, with this run's balance."""
    report = read_meta(root).get("report")
    if report is None:
        log.warning("%s was prepared without a data report: prepare it again for reports/data.json", root)
        return
    report["balance"] = {"requested": balance, "method": resolve_balance(balance, counts) if any(counts) else None}
    (run_dir / REPORTS).mkdir(parents=True, exist_ok=True)
    (run_dir / REPORTS / "data.json").write_text(json.dumps(report, indent=1))


def streaming_dataset(root: str, split: str, fixed, shuffle: bool, seed: int = 42, transform=None):
    """A `litdata.StreamingDataset` of `root/split` yielding (image, label).

    The image is `fixed`'s (S, S, 3) uint8 array as a tensor (for a batch transform), or `transform` of it.
    """
    from litdata import StreamingDataset

    class StreamingImages(StreamingDataset):
        def __getitem__(self, index):
            sample = super().__getitem__(index)
            pixels = fixed(load_image(bytes(sample["image"])))  # verified by prepare: decodes
            if transform is not None:
                return transform(pixels), int(sample["label"])
            return torch.from_numpy(np.ascontiguousarray(pixels)), int(sample["label"])

    return StreamingImages(f"{root.rstrip('/')}/{split}", shuffle=shuffle, drop_last=shuffle, seed=seed)


def streaming_loader(dataset, batch_size: int, num_workers: int, collate_fn=None):
    """A `litdata.StreamingDataLoader` of `dataset` whose position is saved in checkpoints and resumed mid-epoch."""
    from litdata import StreamingDataLoader

    class ResumableLoader(StreamingDataLoader):
        def __iter__(self):
            for batch in super().__iter__():
                # LitData leaves a resumed loader in its resuming state until the epoch's iterator runs out, but
                # Lightning, which knows the epoch's length, never asks past its last batch: the next epoch
                # would then go on from the end of this one, and yield nothing.
                if self.restore and self._num_samples_yielded_streaming >= len(self.dataset):
                    self.restore = False
                yield batch

    return ResumableLoader(
        dataset, batch_size=batch_size, num_workers=num_workers, collate_fn=collate_fn, worker_init_fn=ignore_sigterm
    )


PREPARE_HELP = "Write an image folder as LitData chunks that fit streams, on one node or many."


def moved_position(state: dict, path: str | None) -> dict:
    """A streamed loader's saved position, read from the prepared folder at `path` (LitData refuses a position saved
    under another path: a folder moved to another disk or mount between the kill and the resume)."""
    saved = state.get("dataset")
    if not (isinstance(saved, dict) and path and saved.get("input_dir_path") not in (None, path)):
        return state
    log.info("resuming the prepared dataset from %s (the run saved its position in %s)", path, saved["input_dir_path"])
    return {**state, "dataset": {**saved, "input_dir_path": path}}


def prepare_parser() -> ArgumentParser:
    """The options of `vit-train prepare`; `vit-train --help` lists it with the Trainer's subcommands."""
    parser = ArgumentParser(
        prog="vit-train prepare",
        description=f"{PREPARE_HELP} Scans --data.root as fit does (same classes, split and header check), decodes "
        "every image once to list the broken ones in bad_files.csv, and writes OUT/train/, OUT/val/ and "
        f"OUT/{META}. Then: vit-train fit --data.root OUT.",
    )
    parser.add_argument(
        "--data.root", required=True, help="the image folder: root/<class>/* or root/train|val/<class>/*"
    )
    parser.add_argument("--out", required=True, help="output folder, or an s3:// / gs:// URL")
    parser.add_argument(
        "--data.val_fraction", type=float, default=0.2,
        help="share of each class held out for validation when the folder has no train/val split (as in fit)",
    )  # fmt: skip
    parser.add_argument("--data.seed", type=int, default=42, help="seed of that split (as in fit)")
    parser.add_argument(
        "--chunk_bytes", type=str, default="64MB",
        help="size of each chunk: DDP ranks and nodes share chunks out, so a small dataset needs small chunks",
    )  # fmt: skip
    parser.add_argument(
        "--data.corrections", type=str | None, default=None,
        help="a CSV path,label applied before the split, as in fit: a label relabels, an empty one leaves out",
    )  # fmt: skip
    parser.add_argument(
        "--data.dedupe", type=Literal["auto", "none"], default="auto",
        help="auto: find copies and near-copies and split by group, as in fit (out/duplicates.csv); none: skip",
    )  # fmt: skip
    parser.add_argument("--workers", type=int | None, default=None, help="processes (default: the usable cores)")
    return parser


def main(argv: list[str]) -> None:
    """`vit-train prepare`: see `prepare_parser` for its options."""
    args = prepare_parser().parse_args(argv)
    data = args.data
    try:
        with sigterm_as_interrupt():  # SIGTERM stops it as Ctrl-C does, its workers with it
            meta = prepare(
                data.root, args.out, data.val_fraction, data.seed, args.workers, args.chunk_bytes,
                data.corrections, data.dedupe,
            )  # fmt: skip
    except (OSError, ValueError, RuntimeError) as e:  # RuntimeError: LitData's, for a chunk it could not write
        said = str(e) if isinstance(e, ValueError) else write_failure(e, args.out)
        if said is None:
            raise
        print(f"vit-train prepare: {said}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt as e:
        said = str(e) or "interrupted"
        print(f"vit-train prepare: {said}: {args.out} is not finished; the same command prepares it", file=sys.stderr)
        raise SystemExit(exit_code(e)) from None
    print(
        f"{args.out}: {meta['train']} train and {meta['val']} val images, {len(meta['classes'])} classes, "
        f"{len(meta['bad'])} unreadable (bad_files.csv); train with --data.root {shlex.quote(args.out)}"
    )
