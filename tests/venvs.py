"""Throwaway virtual environments for tests that install something other than the dev environment.

The venv gets no pip of its own: this environment's pip installs into it (`pip --python`), which saves
bootstrapping pip each time. pip may reuse its cache; a test is skipped when no package index answers.

    .venv/bin/python -m tests.venvs build/serve-only/venv serve   # vitscope[serve] and the test runner only
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import venv
from importlib.metadata import version
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


# What a venv needs to run the tests, at this environment's versions
TEST_RUNNER = ("pytest", "pytest-timeout", "pytest-xdist", "httpx", "hypothesis")


def main() -> None:
    p = argparse.ArgumentParser(description="A venv holding this checkout's wheel with one extra, and the test runner.")
    p.add_argument("folder", type=Path)
    p.add_argument("extra", help="the optional dependencies to install, e.g. serve")
    args = p.parse_args()
    wheel = vitscope_wheel(args.folder.with_name(args.folder.name + "-wheel"))
    make_venv(args.folder, f"{wheel}[{args.extra}]", *(f"{name}=={version(name)}" for name in TEST_RUNNER))
    print(args.folder / "bin" / "python")


if __name__ == "__main__":
    main()
