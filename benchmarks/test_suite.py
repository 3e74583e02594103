"""How long does the test suite take? `.ci/run` (`make test`, `make test-cluster`, `make test-serve-only`) on a fresh
clone.

    .venv/bin/python -m benchmarks.test_suite [--commit HEAD]

It takes as long as CI and keeps every core busy: run it on a machine with nothing else running.
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
        makefile = (tmp / "fresh" / "Makefile").read_text()  # the commit's own, for its number of test workers
        if not re.search(r"^test-cluster:", makefile, re.M):  # older commits ran the cluster's tests in make test
            raise SystemExit(f"{commit} has no `make test-cluster`: time it with its own benchmarks/test_suite.py")
        walls, stdout = [], ""
        user0 = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime
        for target in ("test", "test-cluster", "test-serve-only"):
            t0 = time.perf_counter()
            run = subprocess.run(["make", target], cwd=tmp / "fresh", env={**os.environ, "CI": "true"},
                                 capture_output=True, text=True)  # fmt: skip
            walls.append(time.perf_counter() - t0)
            print(f"make {target}: {minutes(walls[-1])} (exit {run.returncode})", flush=True)  # kept if a step fails
            stdout += run.stdout
            if run.returncode:
                raise SystemExit(
                    f"make {target} exited with {run.returncode}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
                )
        user = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime - user0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    suites = [m.groups() for line in stdout.splitlines() if (m := SUMMARY.match(line))]
    if len(suites) != 3:
        raise SystemExit(f"expected three pytest summaries, found {len(suites)}:\n{stdout[-3000:]}")
    (tests, tests_s), (cluster, _), (serve_only, serve_only_s) = suites
    result = Result("test_suite", {"commit": commit, "fresh clone": True}, results=args.results)
    table = result.table(["step", "time"])
    table.add(f"`make test` in all: install, lint, docs and the tests ({tests})", minutes(walls[0]))
    workers = re.search(r"^TEST_WORKERS \?= (\d+)$", makefile, re.M).group(1)
    table.add(f"of which the tests (`pytest -n {workers} --dist loadfile`)", minutes(float(tests_s)))
    table.add(f"`make test-cluster`: the tests that start a local Ray cluster ({cluster})", minutes(walls[1]))
    table.add(f"`make test-serve-only`: the `[serve]`-only venv and its tests ({serve_only})", minutes(walls[2]))
    table.add(f"all three, as `.ci/run` runs them (CPU: user {minutes(user)})", minutes(sum(walls)))
    result.data = {"seconds": {"make test": walls[0], "tests": float(tests_s), "make test-cluster": walls[1],
                               "make test-serve-only": walls[2], "serve-only tests": float(serve_only_s),
                               "ci": sum(walls)}}  # fmt: skip
    result.finish()


if __name__ == "__main__":
    main()
