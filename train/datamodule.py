"""The image-folder data module: a folder of class folders in, train/val DataLoaders out.

Images are decoded by `serve.runtime.images.load_image` (the serving loader), validated with
`serve.runtime.images.Preprocess` (the serving transform), and the split and the list of skipped files
are written into the run directory (`split.json`, `bad_files.csv`).

With `batch_augment` (the default when the augmentation allows it), workers only decode and resize to
uint8; augmentation and normalisation run once per batch on tensors (`train.transforms.BatchTransform`).
With `cache_images`, decoded images are kept as one uint8 array, filled once, in parallel, before training.
"""

from __future__ import annotations

import copy
import csv
import inspect
import logging
import os
import time
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from PIL import Image
from torch.utils.data import DataLoader, Dataset, RandomSampler

from serve.runtime.images import FILE_NAME_ERRORS, Preprocess
from train.balance import BALANCE_CHOICES, balanced_sampler, resolve_balance
from train.data_report import class_counts, write_data_report
from train.dataset import BatchCollate, ImageListDataset, fill_cache, ignore_sigterm, usable_cores
from train.ddp_scan import hand_over, handed_scan, launched_rank, rank_0_split
from train.folder_scan import BadFile, FolderScan, folder_classes, scan_folder
from train.held_split import hold_split
from train.shards import (
    expand_local,
    is_streaming_root,
    moved_position,
    read_meta,
    streaming_class_counts,
    streaming_dataset,
    streaming_loader,
    streaming_scan,
    warn_fixed_by_prepare,
    write_streaming_report,
)
from train.transforms import Augment, BatchTransform, EvalTransform, build_train_transform

DEDUPE_CHOICES = ("auto", "none")
CACHE_RAM_SHARE = 0.25  # the automatic cache takes at most this share of the machine's memory

log = logging.getLogger(__name__)


class ImageFolderDataModule(pl.LightningDataModule):
    """Train and validation data from `root/<class>/*` or `root/train|val/<class>/*`.

    Args:
        root: the image folder.
        val_fraction: share of each class held out for validation when the folder has no train/val split.
        calib_fraction: share of each class's training images held back as the calibration split (in
            `split.json`): never trained on nor used to choose `best.ckpt`; `vit-export` fits the temperature,
            prediction sets and unknown-input threshold on it. 0 holds none back (then `vit-export --calibrate`).
        seed: seed of both splits (the same seed always gives the same split).
        img_size: side the model sees, in pixels.
        crop_pct: evaluation centre-crop fraction (1.0 keeps the whole image).
        interpolation: resize interpolation: "bicubic", "bilinear", "nearest" or "lanczos".
        mean: normalisation mean, RGB.
        std: normalisation standard deviation, RGB.
        augment: training augmentation.
        batch_size: training batch size per device.
        eval_batch_size: validation batch size (default: 2 x batch_size).
        num_workers: DataLoader worker processes; None picks them from the cores (see `auto_workers`).
        pin_memory: page-locked batches for faster host-to-GPU copies.
        verify_images: check every image's header before training, so broken files are skipped and listed up front.
        cache_images: keep decoded images in memory as one uint8 array, resized to the training size (random
            crops then zoom into those pixels); None caches when it takes under a quarter of the memory.
        batch_augment: augment and normalise whole batches of uint8 tensors instead of each PIL image; None
            does so whenever the augmentation allows (no RandAugment, no colour jitter).
        balance: "auto" acts on class imbalance when the training split's largest class over its smallest is
            `train.balance.AUTO_RATIO` or more (`balance_method` says how); "none" treats every image alike.
        dedupe: "auto" decodes every image once to find copies and near-copies (`train.duplicates`): a pool
            is split by group, so none straddles train, val and calib, and val images with a copy in the
            user's own train/ are left out; "none" skips the decoding and keeps every image where it falls.
        corrections: a CSV `path,label` applied before the split: a label relabels the image, an empty one
            leaves it out (`train.corrections`; `vit-train review` writes such a file in the run directory).
        split: a `split.json` whose split to keep (`train.held_split`): each image it lists keeps its place, the
            others are left out. A resumed fit passes its run's own (`--ckpt_path` in a run directory that holds one).

    Reports (`write_reports`), which vit-train writes into the run directory as the fit starts, once the checkpoint
    it resumes has passed its checks (`train.callbacks.RunDirConfig`): `split.json`, `bad_files.csv`,
    `reports/data.json` and `reports/duplicates.csv` (docs/guide/reports.md explains each field).
    """

    def __init__(
        self,
        root: str,
        val_fraction: float = 0.2,
        calib_fraction: float = 0.1,
        seed: int = 42,
        img_size: int = 224,
        crop_pct: float = 0.875,
        interpolation: str = "bicubic",
        mean: tuple[float, float, float] = (0.485, 0.456, 0.406),
        std: tuple[float, float, float] = (0.229, 0.224, 0.225),
        augment: Augment = Augment(),
        batch_size: int = 64,
        eval_batch_size: int | None = None,
        num_workers: int | None = None,
        pin_memory: bool = True,
        verify_images: bool = True,
        cache_images: bool | None = None,
        batch_augment: bool | None = None,
        balance: str = "auto",
        dedupe: str = "auto",
        corrections: str | None = None,
        split: str | None = None,
    ):
        super().__init__()
        self.root, self.val_fraction, self.seed = expand_local(str(root)), val_fraction, seed
        self.calib_fraction = calib_fraction
        self.img_size = img_size
        self.preprocess = Preprocess((img_size, img_size), crop_pct, interpolation, mean, std)
        self.augment = augment
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size or 2 * batch_size
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.verify_images, self.cache_images = verify_images, cache_images
        if batch_augment is None:
            batch_augment = not augment.rand_augment and augment.color_jitter <= 0
        elif batch_augment and (augment.rand_augment or augment.color_jitter > 0):  # found in a worker otherwise
            raise ValueError(
                "--data.batch_augment true does not do RandAugment or colour jitter: set --data.batch_augment false "
                "(per-image augmentation), or leave out --data.augment.rand_augment and --data.augment.color_jitter"
            )
        self.batch_augment = batch_augment
        for name, value, choices in (("balance", balance, BALANCE_CHOICES), ("dedupe", dedupe, DEDUPE_CHOICES)):
            if value not in choices:
                raise ValueError(f"--data.{name} must be one of {', '.join(choices)}, got {value!r}")
        self.balance, self.dedupe, self.corrections, self.split = balance, dedupe, corrections, split
        if corrections is not None and is_streaming_root(root):
            raise ValueError(
                f"{root} is a prepared (streamed) dataset, whose split is fixed in its chunks: apply the corrections "
                f"when preparing it (vit-train prepare --data.corrections {corrections}), then train without them"
            )
        given = {"val_fraction": val_fraction, "calib_fraction": calib_fraction, "cache_images": cache_images}
        defaults = inspect.signature(ImageFolderDataModule.__init__).parameters
        warn_fixed_by_prepare(root, {k: v for k, v in given.items() if v != defaults[k].default})
        self._scan: FolderScan | None = None
        self._stream = self._stream_state = None  # a streamed training loader, and the position it resumes from

    @property
    def scan(self) -> FolderScan:
        """The folder scan, done once on first use (a DDP process rank 0 started reads rank 0's)."""
        if self._scan is None:
            if is_streaming_root(self.root):
                self._scan = streaming_scan(self.root)
            elif (handed := handed_scan(Path(self.root))) is not None:  # rank 0 scanned before it started this process
                self._scan = handed
            else:
                self._scan = self._scan_folder()
        return self._scan

    def _scan_folder(self) -> FolderScan:
        # a held split takes its calibration images from its file: a fresh draw would be thrown away, and could
        # refuse a class that is now too small to give one
        calib_fraction = self.calib_fraction if self.split is None else 0.0
        scan = scan_folder(
            self.root, self.val_fraction, self.seed, self.verify_images, calib_fraction,
            corrections=self.corrections, dedupe=self.dedupe != "none",
        )  # fmt: skip
        return scan if self.split is None else hold_split(scan, self.split)

    def share_scan(self, trainer: pl.Trainer) -> None:
        """On global rank 0, before DDP starts the other processes: hand them the scan (`train.ddp_scan`)."""
        if trainer.world_size > 1 and trainer.global_rank == 0 and not is_streaming_root(self.root):
            hand_over(self.scan, Path(trainer.default_root_dir))

    @property
    def classes(self) -> list[str]:
        """Class names. A DDP rank other than 0 reads only the folder names: rank 0 scans for everyone."""
        if self._scan is None and launched_rank() > 0 and not is_streaming_root(self.root):
            return folder_classes(self.root)
        return self.scan.classes

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def class_counts(self) -> list[int]:
        """Training images per class (after unreadable files, corrections and copies), index = class index."""
        if self.scan.layout == "litdata":
            return streaming_class_counts(self.root, self.classes)
        return class_counts(self.scan)

    @property
    def balance_method(self) -> str | None:
        """What `balance` does on this training split (`train.balance.resolve_balance`): None for nothing."""
        return resolve_balance(self.balance, self.class_counts)

    @property
    def val_images(self) -> int:
        """How many validation images there are, over all ranks."""
        if self.scan.layout == "litdata":
            return int(read_meta(self.root)["val"])
        return len(self.scan.val)

    @property
    def train_images(self) -> int:
        """How many training images there are, over all ranks."""
        if self.scan.layout == "litdata":
            return int(read_meta(self.root)["train"])
        return len(self.scan.train)

    @property
    def _world_size(self) -> int:
        return 1 if self.trainer is None else self.trainer.world_size

    def setup(self, stage: str) -> None:
        if getattr(self, "train_set", None) is not None:
            return
        if self._world_size > 1 and not is_streaming_root(self.root):
            self._scan = rank_0_split(self.scan, self.trainer.strategy)  # every rank trains on rank 0's split
        scan = self.scan
        train_store = Preprocess(self.img_size, 1.0, self.preprocess.interpolation)  # the whole (square) image
        evaluate = EvalTransform(self.preprocess)
        if scan.layout == "litdata":
            return self._setup_streaming(train_store.to_uint8, evaluate)
        cache = self._cached = self._use_cache(len(scan.train) + len(scan.val))
        store = train_store.to_uint8 if cache or self.batch_augment else None
        train, train_cache = self._fill(scan.train, store, self.img_size) if cache else (scan.train, None)
        val, val_cache = self._fill(scan.val, evaluate.resize, None) if cache else (scan.val, None)
        if self.batch_augment:
            self.train_set = ImageListDataset(train, store, None, self.img_size, train_cache)
            self.val_set = ImageListDataset(val, evaluate.resize, None, None, val_cache, skip_broken=True)
        else:
            train_tf = build_train_transform(self.augment, self.preprocess)
            train_tf = train_tf if store is None else _Then(_to_pil, train_tf)
            self.train_set = ImageListDataset(train, store, train_tf, self.img_size, train_cache)
            self.val_set = ImageListDataset(val, evaluate.resize, evaluate, None, val_cache, skip_broken=True)
        if scan.bad:
            log.warning("skipped %d unreadable image file(s) in %s", len(scan.bad), scan.root)

    def _setup_streaming(self, store, evaluate: EvalTransform) -> None:
        self._cached = False
        train_tf = val_tf = None
        if not self.batch_augment:  # per-image PIL augmentation of the stored (img_size) image
            train_tf, val_tf = _Then(_to_pil, build_train_transform(self.augment, self.preprocess)), evaluate
        self.train_set = streaming_dataset(self.root, "train", store, True, self.seed, train_tf)
        self.val_set = streaming_dataset(self.root, "val", evaluate.resize, False, self.seed, val_tf)

    def _use_cache(self, n: int) -> bool:
        if self.cache_images is not None:
            return self.cache_images
        need = n * self.img_size * self.img_size * 3
        return need <= CACHE_RAM_SHARE * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def _fill(self, items, fixed, min_side) -> tuple:
        """(the items that decoded, their cache). A file that fails is reported (bad_files.csv) and left out: in the
        dataset, the next image would take its place, and be scored twice in validation."""
        start = time.perf_counter()
        pixels, readable, failed = fill_cache(items, fixed, (self.img_size, self.img_size, 3), min_side)
        self.scan.bad.extend(BadFile(p, r) for p, r in failed)  # reported in bad_files.csv with the rest
        log.info("cached %d images (%.0f MB) in %.1f s", len(items), pixels.nbytes / 1e6, time.perf_counter() - start)
        if failed:  # the readable rows moved up in place, a block at a time: no second cache, however large
            kept = np.flatnonzero(readable)  # kept[j] >= j: a row is read before it is written over
            for j in range(0, len(kept), 1024):
                block = kept[j : j + 1024]
                pixels[j : j + len(block)] = pixels[block]
            items, pixels = [items[i] for i in kept], pixels[: len(kept)]
        return items, (pixels, np.ones(len(items), bool))

    @property
    def workers(self) -> int:
        """DataLoader workers: `num_workers`, or picked from the cores."""
        if self.num_workers is not None:
            return self.num_workers
        return auto_workers(usable_cores(), getattr(self, "_cached", False))

    def write_reports(self, run_dir: Path) -> None:
        """Write `split.json`, `bad_files.csv` (file, reason) and `reports/` (`train.data_report`) into the run dir."""
        run_dir.mkdir(parents=True, exist_ok=True)
        if self.scan.layout == "litdata":
            write_streaming_report(self.root, run_dir, self.balance, self.class_counts)
        else:
            if self.split is None or Path(self.split).resolve() != (run_dir / "split.json").resolve():
                self.scan.write_split(run_dir / "split.json")  # a held split keeps the file it was read from whole
            write_data_report(self.scan, run_dir, self.balance, self.dedupe)
        with open(run_dir / "bad_files.csv", "w", newline="", encoding="utf-8", errors=FILE_NAME_ERRORS) as f:
            w = csv.writer(f)
            w.writerow(["file", "reason"])
            w.writerows((b.path, b.reason) for b in self.scan.bad)
        if self.scan.bad:
            log.warning("list of skipped files: %s", run_dir / "bad_files.csv")

    def _loader(self, dataset: Dataset, train: bool) -> DataLoader:
        workers = self.workers
        collate = None
        if self.batch_augment:
            collate = BatchCollate(BatchTransform(self.preprocess, self.augment if train else None))
        world = self._world_size
        if self.scan.layout == "litdata":  # the dataset shuffles and splits chunks across ranks; position resumes
            batch = self.batch_size if train else self.eval_batch_size
            if train:
                # the training set drops its last partial batch on each rank: one smaller than a batch per rank
                # would train on nothing at all, and the run would end "done" with its initial weights
                batch = max(1, min(batch, self.train_images // world))
            elif world > 1:
                # LitData deals out whole batches, the same number to each rank, and the rest to the last one:
                # with fewer than `world` batches, every rank but the last would have none, and fail.
                batch = max(1, min(batch, self.val_images // world))
            return streaming_loader(dataset, batch, workers, collate)
        if train:  # workers seed each batch from the run's seed (a resumed run's restored RNG state carries it)
            dataset.seed = torch.initial_seed()
        # The shuffle draws from the global stream, which a checkpoint saves and restores. The loader's worker
        # seed comes from a generator of its own: it is drawn when the loader's iterator is made, which a
        # resumed run does later than the uninterrupted one, and drawn from the global stream it would shift
        # every draw after it. (With `shuffle=True` the loader would shuffle from that generator too.)
        sampler = RandomSampler(dataset) if train else None
        if train and self.balance_method == "sampler":  # class-balanced sampling (train.balance)
            sampler = balanced_sampler([label for _, label in dataset.items], self.num_classes)
        if not train and world > 1:  # each image once: Lightning's DistributedSampler repeats some to even the ranks
            sampler = UnrepeatedDistributedSampler(dataset, world, self.trainer.global_rank, shuffle=False)
        return DataLoader(
            dataset,
            batch_size=self.batch_size if train else self.eval_batch_size,
            sampler=sampler,
            drop_last=train and len(dataset) > self.batch_size,  # even batches for mixup
            num_workers=workers,
            pin_memory=self.pin_memory and torch.cuda.is_available(),
            persistent_workers=workers > 0,
            collate_fn=collate,
            generator=torch.Generator().manual_seed(self.seed),
            worker_init_fn=ignore_sigterm,
        )

    def train_dataloader(self) -> DataLoader:
        loader = self._loader(self.train_set, train=True)
        if self.scan.layout == "litdata":
            self._stream = loader
            if self._stream_state:
                loader.load_state_dict(moved_position(self._stream_state, self.train_set.input_dir.path))
                self._stream_state = None
        return loader

    def state_dict(self) -> dict:
        """Where the streamed training loader stands, so that a run resumed mid-epoch goes on from the next sample.

        Lightning keeps it in its loop state too, but drops it on resume when `configure_optimizers` reads
        `trainer.estimated_stepping_batches` (ours does: the schedule's length): that builds the loader before
        the loop state is restored, and the loop restores it only into a loader it builds itself.
        """
        return {} if self._stream is None else {"train_stream": self._stream.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        """Keep the loader position for `train_dataloader`: Lightning restores the data module before asking."""
        self._stream_state = state_dict.get("train_stream")

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)

    def predict_dataloader(self) -> DataLoader:
        """One row per listed image, in order: a file that fails to decode gives its neighbour's row (a missing row
        would shift every row after it), where validation leaves it out."""
        rows = self.val_set
        if isinstance(rows, ImageListDataset):
            rows = copy.copy(rows)
            rows.skip_broken = False
        return self._loader(rows, train=False)


def _to_pil(pixels: np.ndarray) -> Image.Image:
    return Image.fromarray(pixels, "RGB")


class _Then:
    """Two steps as one picklable callable (a worker process receives it)."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def __call__(self, x):
        return self.second(self.first(x))


def auto_workers(cores: int, cached: bool) -> int:
    """DataLoader workers for `cores` usable cores.

    Cached images only need a batch transform, which costs the trainer less than feeding a worker on a
    machine of 1 or 2 cores; otherwise one core stays with the trainer and the rest decode (at most 8).
    """
    if cached and cores <= 2:
        return 0
    return max(0, min(cores - 1, 8))
