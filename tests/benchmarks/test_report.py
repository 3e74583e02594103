"""The figures in the docs site's benchmark pages, BENCHMARKS.md and README's results table are what
`benchmarks.report` renders from the results (so nobody edits them by hand), every result is on a page, every
page is in the docs navigation, every result file is in the format `common.Result` writes, and BENCHMARKS.md stays
a page of current tables: 500 lines at most, notes of two sentences at most, no clock times."""

from __future__ import annotations

import json
import re

import pytest

from benchmarks.common import RESULTS, Table
from benchmarks.report import DOCS, RESULT, ROOT, every_result, nav, render

RERUN = "run `make report` (python -m benchmarks.report)"
NOT_NOTES = ("|", "#", "```", "<!--", "- ", "vit-serve beside", "in-process,")  # and "Measured <date>" lines
HEADER = ("benchmark", "question", "date", "machine", "versions", "setting", "command", "tables")


@pytest.mark.parametrize("path", sorted(render(every_result())), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_page_holds_the_figures_the_results_render(path):
    assert path.read_text() == render(every_result())[path], f"{path.relative_to(ROOT)} is out of date: {RERUN}"


def test_every_result_is_on_one_page_and_every_page_in_the_docs_navigation():
    shown = [name for page in DOCS.glob("*.md") for name in RESULT.findall(page.read_text())]
    assert len(shown) == len(set(shown)), "a result shown twice"
    assert {p.stem for p in RESULTS.glob("*.json")} <= set(shown), "a result on no page of docs/benchmarks/"
    assert sorted(p.name for p in DOCS.glob("*.md")) == sorted(nav()), "a page of docs/benchmarks/ not in mkdocs.yml"
    assert all((DOCS / name).read_text().startswith("# ") for name in nav()), "a page without its title first"


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.stem)
def test_a_result_file_is_in_the_harness_format(path):
    result = json.loads(path.read_text())
    assert all(key in result for key in HEADER) and result["benchmark"] == path.stem
    for t in result["tables"]:
        table = Table.from_dict(t)
        assert all(len(row) == len(table.columns) for row in table.rows) and table.rows
        assert set(table.formats) <= set(table.columns), f"a format for no column in {path.name}"
        table.markdown()  # every cell renders with its column's format


def notes(text: str) -> list[str]:
    """The page's prose paragraphs: not tables, titles, provenance lines, code or lists (numbered too)."""
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
    return [p for p in paragraphs if p and not p.startswith(NOT_NOTES) and not re.match(r"Measured \d{4}-|\d+\. ", p)]


def sentences(paragraph: str) -> int:
    plain = re.sub(r"\b(?:e\.g|i\.e|vs|etc|cf|approx|Fig)\.", "", paragraph)
    return len(re.findall(r"[.!?][)\"'*_`]*(?:\s|$)", plain)) + (not re.search(r"[.!?][)\"'*_`]*$", plain))


def test_the_benchmark_page_is_short_with_short_notes_and_no_clock_times():
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert len(text.splitlines()) <= 500, "BENCHMARKS.md is over 500 lines: keep the current tables only"
    long = [p[:80] for p in notes(text) if sentences(p) > 2]
    assert not long, f"notes over two sentences (say what a figure means, no run histories): {long}"
    assert not re.search(r"[0-2]\d:[0-5]\d\b|\bUTC\b", text), "a clock time on the page: its date is enough"
    assert sentences("A first one, e.g. this. A second: 0.5 s.") == 2 and notes("| a |\n\nOne. Two.") == ["One. Two."]
    assert sentences("One (a note.) Two, ending so") == 2 and sentences('"Quoted." Two.') == 2
