"""Datasets of (path, label) pairs: decoding (reduced-size JPEG decoding), one uint8 cache, batch collation.

Every image goes through a fixed first step that gives the same (S, S, 3) uint8 array every epoch (resize
and crop), so decoded images can be cached as one (N, S, S, 3) array, filled up front by a process pool and
shared by the DataLoader workers (they fork after it is filled, and only read it). Random augmentation
comes after: per image on PIL, or per batch on tensors (`train.transforms.BatchTransform`) in `collate`.
"""

from __future__ import annotations

import logging
import math
import random
import signal
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset, get_worker_info

from serve.runtime.images import JPEG_FORMATS, ImageError, load_image, open_image
from serve.runtime.jobs import usable_cores
from train.parallel import parallel_map

log = logging.getLogger(__name__)

Item = tuple[str, int]


def decode(path: str | Path, min_side: int | None = None) -> Image.Image:
    """Decode an image to upright RGB; a JPEG is decoded at a reduced scale when `min_side` allows.

    Pillow's `draft` makes the JPEG decoder skip detail (scale 1/2, 1/4 or 1/8) while keeping both sides at
    least `min_side` pixels: a 4000 x 3000 photo for a 224-pixel model decodes at 1/8 scale. Training only:
    validation decodes in full, pixel for pixel as the server does.
    """
    img = open_image(path)
    if min_side and img.format in JPEG_FORMATS and min(img.size) >= 2 * min_side:
        w, h = img.size
        scale = min_side / min(w, h)
        img.draft("RGB", (math.ceil(w * scale), math.ceil(h * scale)))
    return load_image(img)


class ImageListDataset(Dataset):
    """(path, label) pairs -> (image, label). A file that fails to decode is replaced by the next one, or with
    `skip_broken` left out of its batch (a batch of broken files alone still gets the next readable images).

    Args:
        items: (absolute path, label) pairs.
        fixed: RGB PIL image -> (S, S, 3) uint8, the same every epoch (resize and crop); None keeps the PIL
            image (per-image augmentation of full-size images, no cache).
        transform: what follows `fixed`: uint8 array (or PIL image) -> what the loader collates. None
            returns the uint8 array as a tensor, for `collate` to transform as a batch.
        min_side: decode JPEGs at reduced size down to this side (see `decode`); None decodes in full.
        cache: a filled `fill_cache` result ((N, S, S, 3) uint8, (N,) bool readable), or None.
        seed: in a DataLoader worker, each batch's random numbers are seeded from this and the batch's
            indices (`seed_batch`); None leaves the worker's own streams.
        skip_broken: leave a broken file out of its batch rather than give its neighbour twice (validation:
            a neighbour, of another class maybe, would be scored twice).
    """

    def __init__(
        self,
        items: list[Item],
        fixed: Callable | None,
        transform: Callable | None = None,
        min_side: int | None = None,
        cache: tuple[np.ndarray, np.ndarray] | None = None,
        seed: int | None = None,
        skip_broken: bool = False,
    ):
        self.items, self.fixed, self.transform, self.min_side, self.cache = items, fixed, transform, min_side, cache
        self.seed, self.skip_broken = seed, skip_broken

    def __len__(self) -> int:
        return len(self.items)

    def load(self, i: int):
        """Item `i`'s pixels before `transform` (`fixed`'s array, or the PIL image); `ImageError` or `OSError` when
        it cannot be decoded (`__getitem__` then gives the next image, which scoring must not: `predict_logits`)."""
        if self.cache is not None:
            pixels, readable = self.cache
            if not readable[i]:
                raise ImageError("could not be decoded when the cache was filled")
            return pixels[i]
        img = decode(self.items[i][0], self.min_side)
        return img if self.fixed is None else self.fixed(img)

    def __getitem__(self, i: int):
        for offset in range(len(self.items)):
            sample = self._sample((i + offset) % len(self.items))
            if sample is not None:
                return sample
        raise RuntimeError("no image in this dataset can be read")

    def _sample(self, j: int):
        """Item `j`'s (image, label), or None when it cannot be decoded."""
        try:
            img = self.load(j)
        except (ImageError, OSError) as e:  # changed or removed since the scan: train on, say so
            if self.cache is None:
                log.warning("skipping %s: %s", self.items[j][0], e)
            return None
        if self.transform is None:
            return torch.from_numpy(np.ascontiguousarray(img)), self.items[j][1]  # (S, S, 3) uint8
        return self.transform(img), self.items[j][1]

    def __getitems__(self, indices: list[int]) -> list:
        """One batch's samples (what the DataLoader asks for). A persistent worker's random streams run on
        from epoch to epoch, and a resumed run's new worker starts them afresh: seeded per batch, the batch's
        augmentation depends only on the seed and the images it holds, in both. The main process keeps its
        one stream (the checkpoint saves and restores it)."""
        if self.seed is not None and get_worker_info() is not None:
            seed_batch(self.seed, indices)
        if self.skip_broken and (samples := [s for s in map(self._sample, indices) if s is not None]):
            return samples
        return [self[i] for i in indices]


def seed_batch(seed: int, indices: list[int]) -> None:
    """Seed torch, numpy and Python's `random` in this process from `seed` and a batch's indices, in order."""
    words = [int(w) for w in np.random.SeedSequence([seed, *indices]).generate_state(6)]  # 6 x 32 bits
    torch.manual_seed(words[0] << 32 | words[1])
    np.random.seed(words[2:4])
    random.seed(words[4] << 32 | words[5])


class BatchCollate:
    """Stack (uint8 image, label) samples and run a batch transform: (B, S, S, 3) uint8 -> (B, 3, H, W) float."""

    def __init__(self, transform: Callable[[torch.Tensor], torch.Tensor]):
        self.transform = transform

    def __call__(self, samples: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.stack([s[0] for s in samples])  # (B, S, S, 3) uint8
        labels = torch.tensor([s[1] for s in samples], dtype=torch.long)  # (B,)
        return self.transform(images), labels


def _decode_chunk(args: tuple[list[str], Callable, int | None, tuple]) -> tuple[np.ndarray, list[tuple[str, str]]]:
    paths, fixed, min_side, shape = args
    out = np.zeros((len(paths), *shape), np.uint8)  # (n, S, S, 3)
    failed = []
    for i, p in enumerate(paths):
        try:
            out[i] = fixed(decode(p, min_side))
        except (ImageError, OSError) as e:
            failed.append((p, str(e)))
    return out, failed


def fill_cache(
    items: list[Item],
    fixed: Callable,
    shape: tuple[int, int, int],
    min_side: int | None = None,
    workers: int | None = None,
    chunk: int = 512,
) -> tuple[np.ndarray, np.ndarray, list[tuple[str, str]]]:
    """Decode every image once through `fixed`, in parallel, into one uint8 array.

    Args:
        items: (path, label) pairs.
        fixed: RGB PIL image -> (S, S, 3) uint8.
        shape: (S, S, 3), what `fixed` returns.
        min_side: reduced-size JPEG decoding (see `decode`).
        workers: decoding processes (default: the usable cores).
        chunk: images per task.

    Returns:
        ((N, S, S, 3) uint8 pixels, (N,) bool readable, [(path, reason)] of the files that failed).
    """
    paths = [p for p, _ in items]
    tasks = [(paths[i : i + chunk], fixed, min_side, tuple(shape)) for i in range(0, len(paths), chunk)]
    workers = max(1, min(workers or usable_cores(), len(tasks)))
    parts = parallel_map(_decode_chunk, tasks, workers)
    pixels = np.concatenate([a for a, _ in parts]) if parts else np.zeros((0, *shape), np.uint8)
    failed = [f for _, fs in parts for f in fs]
    bad = {p for p, _ in failed}
    readable = np.array([p not in bad for p in paths], dtype=bool)
    return pixels, readable, failed


def ignore_sigterm(worker_id: int) -> None:
    """A DataLoader worker's start (`worker_init_fn`): SIGTERM is the main process's to handle.

    `timeout`, systemd and SLURM signal the whole process group: a worker that died of it first ended the run with
    PyTorch's "DataLoader worker ... exited unexpectedly" (exit 1, no word on resuming) instead of the stop that
    says how to resume. The main process ends its workers itself, as after Ctrl-C, which PyTorch's workers
    already leave to it; a worker whose main process is gone exits by itself.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
