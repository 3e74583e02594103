"""How much a production host installs: the size of a fresh venv per install extra.

    .venv/bin/python -m benchmarks.install_size [--extras core serve all]

Each venv is built from this checkout with pip (which may reuse its cache), measured with `du`, then
deleted. `core` is `pip install vitscope` (the runtime and vit-predict), `serve` adds vit-serve and the
UI, `all` is everything (training and export, torch included). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path

from benchmarks.common import Result, add_results_option

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints-x86_64-linux.txt"


def venv_size(extra: str) -> tuple[int, float, bool]:
    """(bytes on disk, seconds to install, whether torch is importable) of a fresh venv with `extra`."""
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp) / "venv"
        venv.create(where, with_pip=True)
        target = str(ROOT) if extra == "core" else f"{ROOT}[{extra}]"
        cmd = [str(where / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-compile", target]
        if CONSTRAINTS.exists() and platform.machine() == "x86_64":
            cmd += ["-c", str(CONSTRAINTS)]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True)
        seconds = time.perf_counter() - t0
        size = int(subprocess.run(["du", "-sb", str(where)], capture_output=True, text=True).stdout.split()[0])
        torch = subprocess.run([str(where / "bin" / "python"), "-c", "import torch"], capture_output=True).returncode
        return size, seconds, torch == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--extras", nargs="+", default=["core", "serve", "all"])
    args = add_results_option(parser).parse_args()
    result = Result("install_size", {"extras": " ".join(args.extras)}, packages=("pip",), results=args.results)
    columns = ["install", "venv size", "install time (pip cache warm)", "torch importable"]
    table = result.table(columns, formats={"venv size": "{:,.0f} MB", "install time (pip cache warm)": "{:.0f} s"})
    for extra in args.extras:
        size, seconds, torch = venv_size(extra)
        name = "`pip install vitscope`" if extra == "core" else f"`pip install 'vitscope[{extra}]'`"
        table.add(name, size / 1e6, seconds, torch)
        print(f"{name}: {size / 1e6:,.0f} MB", file=sys.stderr, flush=True)
    result.finish()


if __name__ == "__main__":
    main()
