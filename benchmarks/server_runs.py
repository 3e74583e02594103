"""Server runs for the model-server benchmarks (rollout.py, probes.py): a vit-serve child process, percentiles,
the JSON result under `benchmarks/results/`.

    with Server("artifacts/sample.onnx", "--no-ui") as server:
        ...
    write_result("rollout", rows)   # benchmarks/results/rollout.json, with the date, machine and command
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

from serve.server.testing import terminate

RESULTS = Path(__file__).resolve().parent / "results"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine() -> str:
    return f"{os.cpu_count()}-core {platform.machine()}, Python {platform.python_version()}"


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def ms(values: list[float], q: float) -> float:
    """The `q`th percentile of `values` (seconds) in milliseconds; NaN when there are none."""
    return round(float(np.percentile(values, q)) * 1000, 2) if values else float("nan")


class Server:
    """`python -m serve.server MODEL --port <free> ARGS` until the block ends (SIGTERM, then the drain).

    Args:
        model: an .onnx file or a model repository folder.
        args: more `vit-serve` options.
        log: where the server's output goes.
        python: the interpreter (another tree's venv for side-by-side runs).
        cwd: the source tree to run it from.
    """

    def __init__(self, model, *args: str, log: Path | None = None, python: str = sys.executable, cwd=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log or Path(os.devnull)
        cmd = [python, "-m", "serve.server", str(model), "--host", "127.0.0.1", "--port", str(self.port), *args]
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd)

    def __enter__(self) -> Server:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vit-serve exited with {self.proc.returncode}; see {self.log}")
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError("vit-serve was not ready within 300 s")

    def __exit__(self, *exc) -> None:
        terminate(self.proc, 60)


def write_result(name: str, rows: list[dict], **extra) -> Path:
    """benchmarks/results/NAME.json with the date, machine and command; prints the rows as a markdown table."""
    RESULTS.mkdir(exist_ok=True)
    command = " ".join([".venv/bin/python -m benchmarks." + name, *sys.argv[1:]])
    out = RESULTS / f"{name}.json"
    out.write_text(
        json.dumps({"date": now(), "machine": machine(), "command": command, **extra, "rows": rows}, indent=2)
    )
    print(f"# {name}: {machine()}, {now()}\n# {command}\n")
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(str(row[k]) for k in keys) + " |")
    return out
