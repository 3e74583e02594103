"""The benchmark pages from the results: BENCHMARKS.md, the docs site's pages and the README's results table, from
`benchmarks/results/*.json` and the sections of `benchmarks/pages/`. `make report` writes them all; a test fails
when any differs from what this renders, so none is edited by hand.

    .venv/bin/python -m benchmarks.report                                   # BENCHMARKS.md's text, to stdout
    .venv/bin/python -m benchmarks.report --out BENCHMARKS.md --docs docs/benchmarks --readme README.md
    .venv/bin/python -m benchmarks.report serve_bench web                   # these results alone, any order

Under each result: the question it answers, its tables, what its run noted, and where the figures come from
(the date, the machine, the versions and the command that reproduces them).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import RESULTS, Table
from benchmarks.pages import INTRO, PAGES, SECTIONS, Section, readme


def provenance(result: dict) -> str:
    """`Measured DATE on MACHINE (load L); VERSIONS. Setting: ...` and the command that reproduces the figures."""
    load = f" (load {result['load_average']})" if result.get("load_average") is not None else ""
    libs = ", ".join(f"{k} {v}" for k, v in result.get("versions", {}).items())
    setting = ", ".join(f"{k} {v}" for k, v in result.get("setting", {}).items())
    where = f"Measured {result['date'][:10]} on {result['machine']}{load}" + (f"; {libs}" if libs else "") + "."
    return where + (f" Setting: {setting}." if setting else "") + f" Reproduce: `{result['command']}`"


def block(result: dict, question: bool = True) -> str:
    """One result's markdown, without a heading: its question (unless its section asks it), tables, notes and
    provenance."""
    tables = [Table.from_dict(t).markdown() for t in result.get("tables", [])]
    parts = [result.get("question", "") if question else "", *tables, *result.get("notes", []), provenance(result)]
    return "\n\n".join(p for p in parts if p)


def load(folder: Path, name: str) -> dict | None:
    path = folder / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def section(s: Section, folder: Path) -> str:
    """One question: its heading, its text, and each of its results (a heading of its own when it has a title)."""
    out = [f"## {s.title}", s.text]
    for part in s.parts:
        result = load(folder, part.result)
        if part.title:
            out.append(f"### {part.title}")
        out.append(part.text)
        missing = f"Not measured yet: no `benchmarks/results/{part.result}.json`."
        out.append(block(result, question=False) if result else missing)
    return "\n\n".join(p for p in out if p)


def page(folder: Path = RESULTS) -> str:
    """BENCHMARKS.md: every section, in the order of the docs pages."""
    order = [s for name in PAGES for s in SECTIONS if s.page == name]
    return "\n\n".join(["# Benchmarks", INTRO, *(section(s, folder) for s in order)]) + "\n"


def docs_pages(folder: Path = RESULTS) -> dict[str, str]:
    """The docs site's pages: `index.md` (what each page answers) and one page per `PAGES` entry."""
    pages = {}
    for name, title in PAGES.items():
        body = [section(s, folder) for s in SECTIONS if s.page == name]
        pages[f"{name}.md"] = "\n\n".join([f"# {title}", *body]) + "\n"
    rows = [f"| [{title}]({name}.md) | {'; '.join(s.title for s in SECTIONS if s.page == name)} |"
            for name, title in PAGES.items()]  # fmt: skip
    index = ["# Benchmarks", INTRO, "| page | the questions |\n|---|---|\n" + "\n".join(rows)]
    pages["index.md"] = "\n\n".join(index) + "\n"
    return pages


def every_result(folder: Path = RESULTS) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def render(folder: Path, names: list[str] | None = None) -> str:
    """Every result in `folder` (or those named, in that order), each under its name, as one markdown document."""
    paths = [folder / f"{n}.json" for n in names] if names else sorted(folder.glob("*.json"))
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise SystemExit(f"no such result: {', '.join(missing)} (run `python -m benchmarks.NAME` first)")
    return "\n\n".join(f"## {p.stem}\n\n" + block(json.loads(p.read_text())) for p in paths) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help="render these results alone, in this order")
    p.add_argument("--results", type=Path, default=RESULTS, help="the folder of NAME.json files")
    p.add_argument("--out", type=Path, help="write the page (BENCHMARKS.md) here instead of stdout")
    p.add_argument("--docs", type=Path, help="also write the docs site's pages into this folder")
    p.add_argument("--readme", type=Path, help="also rewrite the results table between this README's markers")
    args = p.parse_args(argv)
    if args.names:
        text = render(args.results, args.names)
    else:
        text = page(args.results)
    if args.docs:
        for name, doc in docs_pages(args.results).items():
            (args.docs / name).write_text(doc)
    if args.readme:
        args.readme.write_text(readme.render_into(args.readme.read_text(), every_result(args.results)))
    if args.out:
        args.out.write_text(text)
    elif not (args.docs or args.readme):
        print(text, end="")


if __name__ == "__main__":
    main()
