"""The image-folder data module: a folder of class folders in, train/val DataLoaders out.

Images are decoded by `serve.runtime.images.load_image` (the serving loader), validated with
`serve.runtime.images.Preprocess` (the serving transform), and the split and the list of skipped files
are written into the run directory (`split.json`, `bad_files.csv`).
"""

from __future__ import annotations

import csv
import logging
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from serve.runtime.images import ImageError, Preprocess, load_image
from train.folder import FolderScan, scan_folder
from train.transforms import Augment, EvalTransform, build_train_transform

log = logging.getLogger(__name__)


class ImageListDataset(Dataset):
    """(path, label) pairs -> (image tensor, label). A file that fails to decode is replaced by the next one.

    Args:
        items: (absolute path, label) pairs.
        transform: RGB PIL image (or what `fixed` returns) -> (3, H, W) tensor.
        cache: keep decoded images in memory (for small datasets that fit; each worker holds its own).
        fixed: a first step that gives the same result every epoch (validation: resize and crop); the
            cache keeps its result, not the full-size image, and `transform` gets it.
    """

    def __init__(self, items: list[tuple[str, int]], transform, cache: bool = False, fixed=None):
        self.items, self.transform, self.cache, self.fixed = items, transform, cache, fixed
        self._images: dict[int, object] = {}

    def __len__(self) -> int:
        return len(self.items)

    def _load(self, i: int):
        if i in self._images:
            return self._images[i]
        img = load_image(self.items[i][0])
        if self.fixed is not None:
            img = self.fixed(img)
        if self.cache:
            self._images[i] = img
        return img

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        for offset in range(len(self.items)):
            j = (i + offset) % len(self.items)
            try:
                img = self._load(j)
            except (ImageError, OSError) as e:  # changed or removed since the scan: train on, say so
                log.warning("skipping %s: %s", self.items[j][0], e)
                continue
            return self.transform(img), self.items[j][1]
        raise RuntimeError("no image in this dataset can be read")


class ImageFolderDataModule(pl.LightningDataModule):
    """Train and validation data from `root/<class>/*` or `root/train|val/<class>/*`.

    Args:
        root: the image folder.
        val_fraction: share of each class held out for validation when the folder has no train/val split.
        seed: seed of that split (the same seed always gives the same split).
        img_size: side the model sees, in pixels.
        crop_pct: evaluation centre-crop fraction (1.0 keeps the whole image).
        interpolation: resize interpolation: "bicubic", "bilinear", "nearest" or "lanczos".
        mean: normalisation mean, RGB.
        std: normalisation standard deviation, RGB.
        augment: training augmentation.
        batch_size: training batch size per device.
        eval_batch_size: validation batch size (default: 2 x batch_size).
        num_workers: DataLoader worker processes.
        pin_memory: page-locked batches for faster host-to-GPU copies.
        verify_images: decode every image once before training, so broken files are skipped and listed up front.
        cache_images: keep decoded images in memory (small datasets).
    """

    def __init__(
        self,
        root: str,
        val_fraction: float = 0.2,
        seed: int = 42,
        img_size: int = 224,
        crop_pct: float = 0.875,
        interpolation: str = "bicubic",
        mean: tuple[float, float, float] = (0.485, 0.456, 0.406),
        std: tuple[float, float, float] = (0.229, 0.224, 0.225),
        augment: Augment = Augment(),
        batch_size: int = 64,
        eval_batch_size: int | None = None,
        num_workers: int = 4,
        pin_memory: bool = True,
        verify_images: bool = True,
        cache_images: bool = False,
    ):
        super().__init__()
        self.root, self.val_fraction, self.seed = root, val_fraction, seed
        self.img_size = img_size
        self.preprocess = Preprocess((img_size, img_size), crop_pct, interpolation, mean, std)
        self.augment = augment
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size or 2 * batch_size
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.verify_images, self.cache_images = verify_images, cache_images
        self._scan: FolderScan | None = None

    @property
    def scan(self) -> FolderScan:
        """The folder scan, done once on first use."""
        if self._scan is None:
            self._scan = scan_folder(self.root, self.val_fraction, self.seed, self.verify_images)
        return self._scan

    @property
    def classes(self) -> list[str]:
        return self.scan.classes

    @property
    def num_classes(self) -> int:
        return len(self.scan.classes)

    def setup(self, stage: str) -> None:
        scan = self.scan
        self.train_set = ImageListDataset(
            scan.train, build_train_transform(self.augment, self.preprocess), self.cache_images
        )
        evaluate = EvalTransform(self.preprocess)
        self.val_set = ImageListDataset(scan.val, evaluate, self.cache_images, fixed=evaluate.resize)
        if scan.bad:
            log.warning("skipped %d unreadable image file(s) in %s", len(scan.bad), scan.root)
        if self.trainer is not None and self.trainer.is_global_zero:
            self.write_reports(Path(self.trainer.default_root_dir))

    def write_reports(self, run_dir: Path) -> None:
        """Write `split.json` and `bad_files.csv` (file, reason) into the run directory."""
        run_dir.mkdir(parents=True, exist_ok=True)
        self.scan.write_split(run_dir / "split.json")
        with open(run_dir / "bad_files.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["file", "reason"])
            w.writerows((b.path, b.reason) for b in self.scan.bad)
        if self.scan.bad:
            log.warning("list of skipped files: %s", run_dir / "bad_files.csv")

    def _loader(self, dataset: Dataset, train: bool) -> DataLoader:
        workers = self.num_workers
        return DataLoader(
            dataset,
            batch_size=self.batch_size if train else self.eval_batch_size,
            shuffle=train,
            drop_last=train and len(dataset) > self.batch_size,  # even batches for mixup
            num_workers=workers,
            pin_memory=self.pin_memory and torch.cuda.is_available(),
            persistent_workers=workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)
