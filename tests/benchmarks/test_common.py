"""benchmarks.common, the harness: interleaved rounds rotate who goes first, and a result's JSON renders
back (benchmarks.report) into the very tables it printed."""

from __future__ import annotations

import json

from benchmarks.common import Result, interleaved
from benchmarks.report import block


def test_interleaved_rounds_rotate_who_goes_first():
    order = []
    sides = {name: (lambda r, name=name: order.append((r, name)) or float(r)) for name in ("a", "b", "c")}
    figures = interleaved(3, sides)
    assert figures == {"a": [0.0, 1.0, 2.0], "b": [0.0, 1.0, 2.0], "c": [0.0, 1.0, 2.0]}
    firsts = [name for r, name in order[::3]]
    assert firsts == ["a", "b", "c"]  # each side leads one round


def test_a_result_is_written_as_json_and_renders_back_to_its_tables(tmp_path, capsys):
    result = Result("demo", {"rounds": 3}, packages=("numpy",), question="Is it fast?", results=tmp_path)
    table = result.table(["engine", "ms", "ok"], "Latency", formats={"ms": "{:.2f}"})
    table.add("ours", 1.2345, True)
    table.add("theirs", 10.0, False)
    path = result.finish()
    printed = capsys.readouterr().out
    saved = json.loads(path.read_text())
    assert path == tmp_path / "demo.json" and saved["setting"] == {"rounds": 3} and "numpy" in saved["versions"]
    assert saved["tables"][0]["rows"] == [["ours", 1.2345, True], ["theirs", 10.0, False]]  # values, not text
    assert "| ours | 1.23 | yes |" in printed and "|---|---:|---|" in printed
    page = block(saved)
    assert saved["question"] == "Is it fast?" and table.markdown() in page and saved["command"] in page


def test_a_benchmark_that_adds_rows_replaces_the_row_of_the_same_options(tmp_path, capsys):
    from benchmarks.small_images_ablation import options_of, record

    def run(argv: list[str], accuracy: str) -> list[list]:
        options = " ".join(options_of(argv))
        result = Result("small_images_ablation", question="?", results=tmp_path)
        record(result, [argv[-1], options, 1, accuracy, "1.00", 9.0, result.header["date"]], tmp_path)
        return json.loads((tmp_path / "small_images_ablation.json").read_text())["tables"][0]["rows"]

    assert options_of(["--lr", "5e-3", "--tag", "a b", "--results=x", "--data", "d", "--epochs", "1"]) == [
        "--lr", "5e-3", "--epochs", "1"
    ]  # fmt: skip
    run(["--epochs", "3"], "80.0")
    run(["--epochs", "1"], "70.0")
    rows = run(["--epochs", "3"], "81.0")
    assert [(r[1], r[3]) for r in rows] == [("--epochs 1", "70.0"), ("--epochs 3", "81.0")]
