"""`vit-fashion-mnist`: idx files -> a train/val image folder, and a next step that is the guide's run."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.doc_commands import ROOT, parse_file
from train.fashion_mnist import CLASSES, main


def write_idx(path: Path, array: np.ndarray) -> None:
    """`array` (uint8) as a gzip'd idx file, as Debian's dataset-fashion-mnist installs them."""
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(gzip.compress(header + array.astype(np.uint8).tobytes()))


@pytest.fixture
def idx_folder(tmp_path: Path) -> Path:
    """The four idx files, with 4 training and 2 test images of 28 x 28."""
    source = tmp_path / "idx"
    source.mkdir()
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 4), ("t10k", 2)):
        write_idx(source / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        write_idx(source / f"{prefix}-labels-idx1-ubyte.gz", np.arange(n) % len(CLASSES))
    return source


def test_the_printed_next_step_is_the_guides_command(idx_folder: Path, tmp_path: Path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    main(["--out", "data/fmnist", "--source", str(idx_folder)])
    assert Image.open(tmp_path / "data/fmnist/val" / CLASSES[1] / "00001.png").size == (28, 28)
    hint = capsys.readouterr().out.strip().split("train with ", 1)[1]
    guide = {c.key for c in parse_file(ROOT / "docs" / "guide" / "train.md")}
    assert hint in guide  # --data.img_size 28 included: the config's default is 32
