"""BENCHMARKS.md, the docs site's benchmark pages and README's results table are what `benchmarks.report` renders
from the results (so nobody edits them by hand), every result is on a page, and every result file is in the format
`common.Result` writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from benchmarks.common import RESULTS, Table
from benchmarks.pages import PAGES, SECTIONS, readme
from benchmarks.report import docs_pages, every_result, page

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "benchmarks"
RERUN = "run `make report` (python -m benchmarks.report --out BENCHMARKS.md --docs docs/benchmarks --readme README.md)"
HEADER = ("benchmark", "question", "date", "machine", "versions", "setting", "command", "tables")


def test_benchmarks_md_is_what_the_results_render():
    assert (ROOT / "BENCHMARKS.md").read_text() == page(RESULTS), f"BENCHMARKS.md is out of date: {RERUN}"


def test_the_docs_benchmark_pages_are_what_the_results_render():
    rendered = docs_pages(RESULTS)
    assert sorted(p.name for p in DOCS.glob("*.md")) == sorted(rendered), "docs/benchmarks/ holds a page of its own"
    for name, text in rendered.items():
        assert (DOCS / name).read_text() == text, f"docs/benchmarks/{name} is out of date: {RERUN}"


def test_the_readme_results_table_is_what_the_results_render():
    text = (ROOT / "README.md").read_text()
    assert readme.render_into(text, every_result(RESULTS)) == text, f"README's results table is out of date: {RERUN}"


def test_every_result_is_on_a_page_and_every_page_in_the_docs_navigation():
    shown = [part.result for s in SECTIONS for part in s.parts]
    assert len(shown) == len(set(shown)), "a result shown twice"
    assert {p.stem for p in RESULTS.glob("*.json")} <= set(shown), "a result in no section of benchmarks/pages/"
    assert {s.page for s in SECTIONS} == set(PAGES)
    nav = next(item for item in yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"] if "Benchmarks" in item)
    listed = [next(iter(e.values())) if isinstance(e, dict) else e for e in nav["Benchmarks"]]
    assert listed == ["benchmarks/index.md", *(f"benchmarks/{name}.md" for name in PAGES)]


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.stem)
def test_a_result_file_is_in_the_harness_format(path):
    result = json.loads(path.read_text())
    assert all(key in result for key in HEADER) and result["benchmark"] == path.stem
    for t in result["tables"]:
        table = Table.from_dict(t)
        assert all(len(row) == len(table.columns) for row in table.rows) and table.rows
        assert set(table.formats) <= set(table.columns), f"a format for no column in {path.name}"
        table.markdown()  # every cell renders with its column's format
