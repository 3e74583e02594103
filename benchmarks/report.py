"""The benchmark page from the results: one section per `benchmarks/results/*.json`, in markdown.

    .venv/bin/python -m benchmarks.report                       # every result, to stdout
    .venv/bin/python -m benchmarks.report serve_bench model_vs_timm --out docs/benchmarks.md

Each section holds the question the benchmark answers, its tables, and the line that says where the figures
come from: the date, the machine, the versions and the command that reproduces them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import RESULTS, Table


def section(result: dict) -> str:
    """One result file's markdown: heading, question, tables, and its provenance."""
    title = f"## {result['benchmark']}"
    question = result.get("question", "")
    tables = [Table.from_dict(t).markdown() for t in result.get("tables", [])]
    libs = ", ".join(f"{k} {v}" for k, v in result.get("versions", {}).items())
    setting = ", ".join(f"{k} {v}" for k, v in result.get("setting", {}).items())
    where = f"Measured {result['date']} on {result['machine']} (load {result.get('load_average', '?')}); {libs}."
    parts = [title, question, *tables, where + (f" Setting: {setting}." if setting else "")]
    parts.append(f"Reproduce: `{result['command']}`")
    return "\n\n".join(p for p in parts if p)


def render(folder: Path, names: list[str] | None = None) -> str:
    """Every result in `folder` (or those named, in that order) as one markdown document."""
    paths = [folder / f"{n}.json" for n in names] if names else sorted(folder.glob("*.json"))
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise SystemExit(f"no such result: {', '.join(missing)} (run `python -m benchmarks.NAME` first)")
    return "\n\n".join(section(json.loads(p.read_text())) for p in paths) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help="results to include, in order (default: all, by name)")
    p.add_argument("--results", type=Path, default=RESULTS, help="the folder of NAME.json files")
    p.add_argument("--out", type=Path, help="write the markdown here instead of stdout")
    args = p.parse_args(argv)
    text = render(args.results, args.names or None)
    if args.out:
        args.out.write_text(text)
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
