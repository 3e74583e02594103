"""The one harness every benchmark uses: timers, interleaved A/B rounds, the header (date, machine, versions)
and the result, written as JSON under `benchmarks/results/NAME.json` and printed as markdown tables.

    result = Result("demo", {"rounds": 3}, packages=("torch",))
    result.table(["model", "ms"], formats={"ms": "{:.2f}"}).add("vit_tiny_patch16_224", 41.3)
    result.finish()   # prints the header line and the tables, writes benchmarks/results/demo.json

A cell holds the measured value (a number, not its text), so `benchmarks.report` renders the same tables from the
JSON files alone. Run a benchmark as `python -m benchmarks.NAME` from the repository root.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


# --- timers ---------------------------------------------------------------------------------------------


def timed(fn: Callable[[], Any], sync: Callable[[], None] | None = None) -> float:
    """Seconds one call of `fn` takes; `sync` (e.g. `torch.cuda.synchronize`) runs before and after."""
    if sync:
        sync()
    start = time.perf_counter()
    fn()
    if sync:
        sync()
    return time.perf_counter() - start


def rate(fn: Callable[[], Any], items_per_call: int, seconds: float) -> float:
    """Items per second of calling `fn` back to back for at least `seconds` (after one untimed call)."""
    fn()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        n += items_per_call
    return n / (time.perf_counter() - start)


def interleaved(rounds: int, sides: dict[str, Callable[[int], float]]) -> dict[str, list[float]]:
    """Run each side once per round, who goes first rotating, so that the machine's drift hits every side alike.

    Args:
        rounds: how many rounds.
        sides: name -> a measurement that takes the round's number and returns one figure.

    Returns:
        name -> that side's figures, one per round, in round order.
    """
    names = list(sides)
    figures: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            figures[name].append(sides[name](r))
    return figures


def spread(values: Sequence[float]) -> str:
    """`median [min-max]` of `values`, three decimals: a figure with the noise beside it."""
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


# --- the header -----------------------------------------------------------------------------------------


def machine() -> str:
    """`2-core x86_64 (CPU model name), Linux`: the machine a figure was measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()}-core {platform.machine()} ({cpu}), {platform.system()}"


def versions(packages: Sequence[str]) -> dict[str, str]:
    """Python's version and each installed package's (those not installed are left out)."""
    found = {"python": platform.python_version()}
    for name in packages:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found


def command() -> str:
    """The command line that ran this benchmark, as `python -m benchmarks.NAME ...`."""
    main = sys.modules["__main__"]
    module = getattr(main, "__spec__", None) and main.__spec__.name
    program = f"python -m {module}" if module else f"python {sys.argv[0]}"
    return " ".join([program, *map(shlex.quote, sys.argv[1:])])


def add_results_option(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`--results DIR`: where the JSON result goes (default benchmarks/results; a short trial run elsewhere)."""
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder for NAME.json (default: %(default)s)")
    return parser


# --- the result -----------------------------------------------------------------------------------------


def question(doc: str) -> str:
    """The first paragraph of a module docstring, on one line: the question its benchmark answers."""
    return " ".join(doc.strip().split("\n\n")[0].split())


def previous(name: str, folder: Path = RESULTS) -> dict | None:
    """The result NAME.json in `folder` as the last run wrote it, or None (for a benchmark that adds to it)."""
    path = Path(folder) / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def cell(value: Any, fmt: str | None = None) -> str:
    """One table cell as text: `fmt` (a str.format pattern) when given, thousands separated ints, 4 digits."""
    if value is None:
        return ""
    if fmt:
        return fmt.format(value)
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.4g}"
    return str(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass
class Table:
    """One markdown table: named columns, rows of measured values, and per-column formats."""

    columns: list[str]
    title: str = ""
    formats: dict[str, str] = field(default_factory=dict)
    rows: list[list[Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *values: Any) -> None:
        if len(values) != len(self.columns):
            raise ValueError(f"a row of {len(values)} values for {len(self.columns)} columns: {values}")
        self.rows.append(list(values))

    def markdown(self) -> str:
        lines = [f"{self.title}\n" if self.title else ""]
        lines.append("| " + " | ".join(self.columns) + " |")
        given = [[r[i] for r in self.rows if r[i] is not None] for i in range(len(self.columns))]
        numeric = [bool(values) and all(map(_is_number, values)) for values in given]  # right-aligned
        lines.append("|" + "".join("---:|" if right else "---|" for right in numeric))
        for row in self.rows:
            lines.append(
                "| " + " | ".join(cell(v, self.formats.get(c)) for c, v in zip(self.columns, row, strict=True)) + " |"
            )
        lines += [f"\n{note}" for note in self.notes]
        return "\n".join(line for line in lines if line != "")

    @classmethod
    def from_dict(cls, d: dict) -> Table:
        return cls(d["columns"], d.get("title", ""), d.get("formats", {}), d.get("rows", []), d.get("notes", []))


@dataclass
class Result:
    """A benchmark's result: its header (date, machine, versions, setting, command) and its tables.

    Args:
        name: the benchmark's name, and of its file `NAME.json`.
        setting: the knobs of this run (rounds, durations, model), shown in the header line.
        packages: the packages whose versions matter to the figures (Python's is always recorded).
        question: what the benchmark answers (default: the first paragraph of its module docstring).
        results: the folder for NAME.json.
        notes: paragraphs after the tables: what the figures mean, where a target stands.
    """

    name: str
    setting: dict[str, Any] = field(default_factory=dict)
    packages: Sequence[str] = ()
    question: str = ""
    results: Path = RESULTS
    notes: list[str] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    header: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)  # raw figures beyond the tables (rounds, samples)

    def __post_init__(self):
        if not self.question:
            self.question = question(sys.modules["__main__"].__doc__ or "")
        self.header = {
            "benchmark": self.name,
            "question": self.question,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": machine(),
            "load_average": round(os.getloadavg()[0], 2),
            "versions": versions(self.packages),
            "setting": self.setting,
            "command": command(),
        }

    def table(self, columns: list[str], title: str = "", formats: dict[str, str] | None = None) -> Table:
        """A new table in this result (rows are added to it with `Table.add`)."""
        t = Table(columns, title, formats or {})
        self.tables.append(t)
        return t

    def header_line(self) -> str:
        h = self.header
        libs = ", ".join(f"{k} {v}" for k, v in h["versions"].items())
        knobs = ", ".join(f"{k} {v}" for k, v in h["setting"].items())
        return f"# {h['benchmark']}: {h['date']}, {h['machine']}, load {h['load_average']}; {libs}" + (
            f"; {knobs}" if knobs else ""
        )

    def markdown(self) -> str:
        return "\n\n".join([self.header_line(), *(t.markdown() for t in self.tables), *self.notes])

    def to_dict(self) -> dict:
        tables = [vars(t) for t in self.tables]
        extra = {"notes": self.notes} if self.notes else {}
        return {**self.header, "tables": tables, **extra, **({"data": self.data} if self.data else {})}

    def finish(self, path: Path | None = None) -> Path:
        """Print the header line and the tables, and write the JSON result (to `path` or results/NAME.json)."""
        print(self.markdown(), flush=True)
        path = path or Path(self.results) / f"{self.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1, default=str) + "\n")
        print(f"\n(written to {path})", file=sys.stderr)
        return path
