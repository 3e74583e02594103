"""Serving fixtures: a tiny trained checkpoint in the contract format and its exported ONNX file.

The checkpoint's network learns which quadrant of a 32 x 32 image holds a bright square
(`tests.helpers.write_tiny_run`), so its predictions are confident and not uniform. The run folder has a
`split.json` pointing at real PNG files, as `vit-train` writes it.

Without torch (the `[serve]`-only venv), `tiny_onnx` is the file named by VITSCOPE_TINY_ONNX, exported
beforehand in the full venv (`make test-serve-only` does both); the checkpoint fixtures then skip.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import write_tiny_run

# The exporter's tests need torch and onnx at import: the [serve]-only venv leaves them out.
EXPORTER_TESTS = ["test_export.py", "test_export_targets.py", "test_triton_repo.py", "test_runtime_parity.py"]
collect_ignore = [] if importlib.util.find_spec("torch") else EXPORTER_TESTS


def built_once(tmp_path_factory, name: str, build: Callable[[Path], object]) -> Path:
    """The folder `name`, filled by `build(folder)` once per test run: pytest-xdist's workers share it (each
    would otherwise train and export the same tiny model again: about 25 s of CPU a worker). Tests only read it."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:  # one process: a folder of its own, as ever
        folder = tmp_path_factory.mktemp(name)
        build(folder)
        return folder
    from filelock import FileLock  # torch's dependency: the fixtures that build need torch anyway

    folder = tmp_path_factory.getbasetemp().parent / name  # the run's folder, above each worker's own
    with FileLock(f"{folder}.lock"):
        if not (folder / ".built").is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            (folder / ".built").touch()
    return folder


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """A run folder: checkpoints/best.ckpt (the contract format), split.json and its PNG files."""
    pytest.importorskip("torch")
    return built_once(tmp_path_factory, "tiny_run", write_tiny_run)


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_run) -> Path:
    """A tiny trained checkpoint in the vitscope contract format (4 classes, 32 x 32 inputs)."""
    return tiny_run / "checkpoints" / "best.ckpt"


@pytest.fixture
def no_export(monkeypatch):
    """Every refusal comes before the export: a test that reaches it fails at once instead of exporting."""
    pytest.importorskip("torch")
    from serve.export import targets

    def started(*args, **kwargs):
        raise AssertionError("the export started: the refusal should have come before it")

    monkeypatch.setattr(targets, "build", started)


@pytest.fixture
def own_run(tiny_checkpoint, tmp_path) -> Path:
    """A copy of the tiny run's checkpoint and split in a folder of its own: a test may damage it."""
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    shutil.copy(tiny_checkpoint.parent.parent / "split.json", tmp_path / "run" / "split.json")
    shutil.copy(tiny_checkpoint, tmp_path / "run" / "checkpoints" / "best.ckpt")
    return tmp_path / "run"


@pytest.fixture(scope="session")
def tiny_onnx(request, tmp_path_factory) -> Path:
    """The tiny checkpoint exported by `export_onnx` (fp32, parity-checked, with its metadata)."""
    given = os.environ.get("VITSCOPE_TINY_ONNX")
    if given:
        assert Path(given).is_file(), f"VITSCOPE_TINY_ONNX names no file: {given}"
        return Path(given)
    checkpoint = request.getfixturevalue("tiny_checkpoint")  # skips without torch
    from serve.export.cli import export_onnx

    folder = built_once(tmp_path_factory, "tiny_onnx", lambda f: export_onnx(checkpoint, f / "tiny.onnx"))
    return folder / "tiny.onnx"


@pytest.fixture(scope="session")
def exported(request, tmp_path_factory) -> Path:
    """A repository from `vit-export --triton-repo --no-gradients`: model `alpha`, version 1. In the [serve]-only
    venv it is the one named by VITSCOPE_TINY_REPO, exported beforehand in the full venv. Tests copy from it."""
    given = os.environ.get("VITSCOPE_TINY_REPO")
    if given:
        assert (Path(given) / "alpha" / "1" / "model.onnx").is_file(), f"VITSCOPE_TINY_REPO holds no alpha/1: {given}"
        return Path(given)
    checkpoint = request.getfixturevalue("tiny_checkpoint")  # skips without torch
    from serve.export.cli import main as export_main

    def build(folder: Path) -> None:
        args = ["-o", str(folder / "alpha.onnx"), "--triton-repo", str(folder / "models"), "--no-gradients"]
        assert export_main([str(checkpoint), *args]) == 0

    return built_once(tmp_path_factory, "exported", build) / "models"


@pytest.fixture
def ui_client(tmp_path, monkeypatch) -> Callable[..., object]:
    """`gradio_client.Client(url, **kwargs)` that downloads into the test's own folder: the client passes each
    download through a new folder in the system's temporary directory and leaves that folder behind."""
    from gradio_client import Client

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return lambda url, **kwargs: Client(url, verbose=False, download_files=tmp_path / "downloads", **kwargs)
