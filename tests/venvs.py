"""Throwaway virtual environments for tests that install something other than the dev environment.

The venv gets no pip of its own: this environment's pip installs into it (`pip --python`), which saves
bootstrapping pip each time. pip may reuse its cache; a test is skipped when no package index answers.
"""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OFFLINE = ("Could not find a version", "No matching distribution", "Failed to establish", "Temporary failure")


def make_venv(folder: Path, *requirements: str) -> Path:
    """A new venv at `folder` with `requirements` installed; its python."""
    venv.create(folder, with_pip=False)
    python = folder / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-compile"]
    done = subprocess.run([*pip, *requirements], capture_output=True, text=True, timeout=900)
    if done.returncode != 0 and any(marker in done.stderr + done.stdout for marker in OFFLINE):
        pytest.skip(f"pip cannot reach a package index for {' '.join(requirements)}: {done.stderr.strip()[-300:]}")
    assert done.returncode == 0, done.stderr[-2000:]
    return python


def vitscope_wheel(out: Path) -> Path:
    """This checkout built as a wheel (with this environment's setuptools, so without a build venv)."""
    cmd = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(out)]
    done = subprocess.run([*cmd, str(ROOT)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = out.glob("vitscope-*.whl")
    return wheel
