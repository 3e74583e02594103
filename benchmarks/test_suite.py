"""How long does the test suite take? `.ci/run` (`make test`, then `make test-serve-only`) on a fresh clone.

    .venv/bin/python -m benchmarks.test_suite [--commit HEAD]

Clones the commit into a temporary folder, runs `CI=true bash .ci/run` there as CI does (install, lint, docs,
`make test`'s tests, then the runtime and server tests again in the `[serve]`-only venv), reads each pytest run's
summary line, and deletes the clone. It takes as long as CI and keeps both cores busy: run it on a machine with
nothing else running.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.common import Result, add_results_option

ROOT = Path(__file__).resolve().parents[1]
# pytest's last line: "N passed, M skipped in S.SSs"
SUMMARY = re.compile(r"^=*\s*(\d+ (?:passed|failed)[^=]*?) in ([\d.]+)s")


def minutes(seconds: float) -> str:
    """`5 min 47 s`."""
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s} s"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--commit", default="HEAD", help="what to clone")
    args = add_results_option(p).parse_args()
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.commit], capture_output=True,
                            text=True, check=True).stdout.strip()  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="test_suite-"))
    try:
        subprocess.run(["git", "clone", "--quiet", str(ROOT), str(tmp / "fresh")], check=True)
        subprocess.run(["git", "-C", str(tmp / "fresh"), "checkout", "--quiet", commit], check=True)
        user0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime, time.perf_counter()
        run = subprocess.run(["bash", ".ci/run"], cwd=tmp / "fresh", env={**os.environ, "CI": "true"},
                             capture_output=True, text=True)  # fmt: skip
        wall = time.perf_counter() - t0
        user = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime - user0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    suites = [m.groups() for line in run.stdout.splitlines() if (m := SUMMARY.match(line))]
    if run.returncode or len(suites) != 2:
        raise SystemExit(f".ci/run exited with {run.returncode}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    (tests, tests_s), (serve_only, serve_only_s) = suites
    result = Result("test_suite", {"commit": commit, "fresh clone": True}, results=args.results)
    table = result.table(["step", "time"])
    table.add(f"`make test`'s tests: `pytest -q -n 2 --dist loadfile`, {tests}", minutes(float(tests_s)))
    table.add(f"`make test-serve-only`'s tests (the `[serve]`-only venv): {serve_only}", minutes(float(serve_only_s)))
    steps = "install, lint, docs, both suites"
    table.add(f"`.ci/run` in all: {steps} (real {minutes(wall)}, user {minutes(user)})", minutes(wall))
    result.data = {"seconds": {"tests": float(tests_s), "serve-only tests": float(serve_only_s), "ci": wall}}
    result.finish()


if __name__ == "__main__":
    main()
