"""The layering holds: import contracts catch a forbidden import, an API-only server never loads gradio, and a
production host with only the `[serve]` extra (no torch) serves and predicts with an exported file."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import httpx
import pytest

from tests.helpers import ServerProcess, noise_png
from tests.venvs import ROOT, make_venv, vitscope_wheel


def imported_modules(lines: list[str]) -> set[str]:
    """Top-level module names from the `import time:` lines that PYTHONPROFILEIMPORTTIME=1 prints."""
    names = set()
    for line in lines:
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[-1].strip().split(".")[0])
    return names


@pytest.mark.slow
@pytest.mark.parametrize("ui", [False, True], ids=["no-ui", "ui"])
def test_an_api_only_server_never_imports_gradio(tiny_onnx, ui):
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}  # the child lists every module it imports
    args = ["--examples-dir", ""] + ([] if ui else ["--no-ui"])
    with ServerProcess(tiny_onnx, *args, env=env) as server:
        r = httpx.post(server.url + "/v1/classify?explain=true", content=noise_png(), timeout=30)
        assert r.status_code == 200  # the explain path ran too: its lazy imports have happened
    imported = imported_modules(server.lines)
    assert "uvicorn" in imported  # the listing works
    assert ("gradio" in imported) == ui
    assert "torch" not in imported


def test_a_forbidden_import_breaks_the_contracts(tmp_path):
    pytest.importorskip("importlinter")
    for package in ("vit", "train", "serve"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    lint = [str(Path(sys.executable).with_name("lint-imports")), "--no-cache"]
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    kept = subprocess.run(lint, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert kept.returncode == 0, kept.stdout + kept.stderr
    with open(tmp_path / "serve" / "runtime" / "images.py", "a") as f:
        f.write("\nimport torch  # noqa: E402\n")
    broken = subprocess.run(lint, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert broken.returncode != 0
    assert "serve.runtime is not allowed to import torch" in broken.stdout


@pytest.fixture(scope="module")
def serve_only_venv(tmp_path_factory) -> Path:
    """A fresh venv with vitscope's wheel and its `[serve]` extra only (pip may reuse its cache)."""
    # its installed files, not an import or find_spec("pip"): either turns setuptools' distutils shim off for the
    # whole process, and a torch.compile later in the same test worker failed on it
    try:
        distribution("pip")
    except PackageNotFoundError:
        pytest.skip("this environment has no pip to install the venv with")
    root = tmp_path_factory.mktemp("serve-venv")
    make_venv(root / "venv", f"{vitscope_wheel(root / 'wheel')}[serve]")
    return root / "venv"


@pytest.mark.slow
def test_the_serve_extra_serves_and_predicts_without_torch(serve_only_venv, tiny_onnx, tmp_path):
    python = str(serve_only_venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    no_torch = subprocess.run([python, "-c", "import torch"], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr
    image = tmp_path / "a.png"
    image.write_bytes(noise_png())
    predict = [str(serve_only_venv / "bin" / "vit-predict"), str(tiny_onnx), str(image), "--top-k", "2"]
    out = subprocess.run(predict, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert str(image) in out.stdout
    server = ServerProcess(tiny_onnx, "--examples-dir", "", cwd=tmp_path, env=env, python=python)
    with server:
        r = httpx.post(server.url + "/v1/classify", content=noise_png(), timeout=30)
        ui = httpx.get(server.url + "/", timeout=30)
    assert r.status_code == 200 and r.json()["predictions"][0]["score"] > 0
    assert ui.status_code == 200 and "gradio" in ui.text.lower()
