"""`vit-train` and `vit-export` on a host without their extra: one line naming the extra to install, exit 2.

The console scripts start in `train.launch` and `serve.export.launch`. A child interpreter with
`sys.modules[name] = None` for a module is one where that module cannot be found or imported, as on a host
with the `[serve]` extra only (no torch, no onnx).
"""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from tests.venvs import ROOT
from train import launch


def run_without(blocked: tuple[str, ...], launcher: str, *argv: str) -> subprocess.CompletedProcess:
    """Run `launcher`'s main with `argv` in a child interpreter where the `blocked` modules are missing."""
    code = (
        "import sys\n"
        f"for name in {blocked!r}: sys.modules[name] = None\n"
        f"sys.argv = {list(argv)!r}\n"
        f"from {launcher} import main\n"
        "sys.exit(main())\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)


@pytest.mark.parametrize(
    ("blocked", "launcher", "argv", "extra"),
    [
        (("torch",), "train.launch", ("vit-train", "fit", "--help"), "train"),
        (("torch", "onnx"), "serve.export.launch", ("vit-export", "--help"), "export"),
        (("onnx",), "serve.export.launch", ("vit-export", "run/best.ckpt", "-o", "m.onnx"), "export"),
    ],
    ids=["train-without-torch", "export-without-torch", "export-without-onnx"],
)
def test_a_missing_extra_is_named_in_one_line_with_exit_2(blocked, launcher, argv, extra):
    done = run_without(blocked, launcher, *argv)
    assert done.returncode == 2, done.stderr
    assert done.stdout == "" and done.stderr.count("\n") == 1, done.stderr  # one line, no traceback
    assert f"pip install 'vitscope[{extra}]'" in done.stderr
    assert all(name in done.stderr for name in blocked)  # what is missing is named
    assert done.stderr.startswith(argv[0] + " needs ")


def test_with_its_extra_the_launcher_runs_the_real_command_and_passes_on_its_status(monkeypatch):
    monkeypatch.setitem(sys.modules, "train.cli", types.SimpleNamespace(main=lambda argv: len(argv)))
    assert launch.main(["prepare", "--out", "shards"]) == 3
