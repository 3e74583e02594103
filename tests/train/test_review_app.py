"""The review page's callbacks (`train.review_app.ReviewActions`) on a real run directory, and the page's server."""

from __future__ import annotations

import csv
import html
import json
import logging
import os
import re
import shlex
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import CLASS_NAMES, free_port, wait_until
from tests.train.test_review import write_review_run
from train.corrections import load_corrections

gr = pytest.importorskip("gradio")
pytest.importorskip("torch")

from train.review_app import ReviewActions  # noqa: E402
from train.review_data import LISTS, ReviewRun  # noqa: E402

FLAGGED = LISTS[0]  # likely wrong labels: three images of the run's training split


@pytest.fixture(scope="module")
def review_run(tmp_path_factory) -> Path:
    return write_review_run(tmp_path_factory.mktemp("review-app") / "run")


@pytest.fixture
def run(review_run: Path, tmp_path: Path) -> Path:
    """A copy of the run directory (its images stay where they are): a corrections file of its own."""
    return Path(shutil.copytree(review_run, tmp_path / "run"))


def _rows(file: Path) -> list[list[str]]:
    with open(file, newline="", encoding="utf-8") as f:
        return list(csv.reader(f))


def _data_root(run: Path) -> str:
    return json.loads((run / "split.json").read_text())["root"]


def test_class_names_with_spaces_come_back_as_written_after_a_restart(tmp_path: Path):
    """Folders named 'top_right ' or ' top_left': the review wrote the names as they are and read them back
    stripped, so a restarted review and fit refused the file ("label 'top_right' is not a class") and the table
    said "relabelled top_right" for an image that was only kept."""
    classes = [" top_left", "top_right ", " bottom_left ", "bottom_right"]
    run = write_review_run(tmp_path / "run", classes)
    on = ReviewActions(ReviewRun(run, limit=3))
    items = on.run.lists[FLAGGED]
    target = next(c for c in classes if c != items[1].given and c.strip() != c)
    on.decide(FLAGGED, 0, "keep", None)
    on.decide(FLAGGED, 1, "relabel", target)
    again = ReviewActions(ReviewRun(run, limit=3))
    assert [row[-1] for row in again.rows(FLAGGED)][:2] == ["kept", f"relabelled {target}"]
    fixes = load_corrections(run / "corrections.csv", _data_root(run), classes)
    assert fixes == {items[0].path: items[0].given, items[1].path: target}


def test_the_newest_decision_wins_over_an_older_hand_row_naming_the_image_relative_to_the_data_root(run: Path):
    """A relabel rewrote the file with the review's row first and an older hand row (`class/image.png,label`,
    relative to the data root) after it, so fit trained the hand row's label."""
    on = ReviewActions(ReviewRun(run, limit=3))
    items = on.run.lists[FLAGGED]
    path, other = items[0].path, items[1].path
    relative = os.path.relpath(path, _data_root(run))
    (run / "corrections.csv").write_text(
        f"path,label\n{path},{CLASS_NAMES[1]}\n{other},\n{relative},{CLASS_NAMES[2]}\n"
    )  # the review's decision, then a row added by hand
    on = ReviewActions(on.run)
    assert on.decisions.get(path) == (True, CLASS_NAMES[2])  # as fit reads it: the later row
    on.decide(FLAGGED, 0, "relabel", CLASS_NAMES[3])
    assert load_corrections(run / "corrections.csv", _data_root(run), CLASS_NAMES)[path] == CLASS_NAMES[3]
    # the hand row as written; the review's, relative to the data root (it follows the images to another mount)
    assert _rows(run / "corrections.csv") == [["path", "label"], [other, ""], [relative, CLASS_NAMES[3]]]


def test_a_decision_keeps_the_columns_a_person_added(run: Path):
    """`path,label,note`: the first click wrote the file back with two columns, and the notes were gone."""
    on = ReviewActions(ReviewRun(run, limit=3))
    first, second = (it.path for it in on.run.lists[FLAGGED][:2])
    (run / "corrections.csv").write_text(f"path,label,note\n{first},{CLASS_NAMES[3]},checked by Ann\n")
    on.decide(FLAGGED, 1, "leave", None)
    on.decide(FLAGGED, 0, "relabel", CLASS_NAMES[2])
    first, second = (os.path.relpath(p, _data_root(run)) for p in (first, second))  # as the review writes them
    assert _rows(run / "corrections.csv") == [
        ["path", "label", "note"], [second, "", ""], [first, CLASS_NAMES[2], "checked by Ann"]
    ]  # fmt: skip


def test_a_page_load_shows_the_decisions_another_review_of_the_run_made(run: Path):
    """Two pages on one run (two `vit-train review` of it): one's decisions never showed in the other, even after
    a reload, because the table was read from memory."""
    scored = ReviewRun(run, limit=3)
    mine, other = ReviewActions(scored), ReviewActions(scored)
    other.decide(FLAGGED, 0, "leave", None)
    table, *_ = mine.load(FLAGGED)  # a reload of the page
    assert table[0][-1] == "left out"


def _stray_quote_file(file: Path, paths: list[str], rows: int) -> int:
    """`rows` decisions, one of whose paths opens a quote it never closes; returns the line of that row."""
    lines = ["path,label"] + [f"{paths[i % len(paths)]},{CLASS_NAMES[i % 4]}" for i in range(rows)]
    lines[3] = '"' + lines[3]
    file.write_text("\n".join(lines) + "\n")
    return 4


@pytest.mark.parametrize("rows", [100, 3000], ids=["rows-swallowed", "field-over-csv-limit"])
def test_a_stray_quote_in_the_decisions_file_is_refused_with_its_line(run: Path, rows: int):
    """A `"` opening a path: in a small file every later row became part of that path and the decisions vanished
    without a word; past 128 kB the csv module's field limit raised an error that was no ValueError."""
    split = json.loads((run / "split.json").read_text())
    line = _stray_quote_file(run / "corrections.csv", [e["path"] for e in split["train"]], rows)
    with pytest.raises(ValueError) as e:
        ReviewActions(ReviewRun(run, limit=3))
    message = str(e.value)
    assert "\n" not in message and 'quote (")' in message
    assert message.startswith(f"{run / 'corrections.csv'} line {line}")


def test_a_decisions_file_over_the_csv_field_limit_stops_the_review_in_one_line(run: Path, capsys):
    """It ended `vit-train review` in a traceback (csv's "field larger than field limit")."""
    from train.review import main

    split = json.loads((run / "split.json").read_text())
    line = _stray_quote_file(run / "corrections.csv", [e["path"] for e in split["train"]], 3000)
    with pytest.raises(SystemExit) as e:
        main([str(run)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err and err.count("\n") == 1
    assert err.startswith(f"vit-train review: {run / 'corrections.csv'} line {line}")


def test_a_decisions_file_broken_while_the_page_is_open_is_said_and_nothing_recorded(run: Path):
    on = ReviewActions(ReviewRun(run, limit=3))
    (run / "corrections.csv").write_text(f'path,label\n"{on.run.lists[FLAGGED][0].path},top_left\n')
    before = (run / "corrections.csv").read_text()
    with pytest.raises(gr.Error, match="line 2"):
        on.decide(FLAGGED, 1, "leave", None)
    with pytest.raises(gr.Error, match="line 2"):
        on.load(FLAGGED)
    assert (run / "corrections.csv").read_text() == before


@pytest.mark.slow
def test_what_is_uploaded_to_the_page_is_deleted_when_it_closes(run: Path):
    """The page takes no upload, yet Gradio's upload route kept each one under 1 KiB in /tmp/gradio for ever."""
    from train.review import launch_review

    port = free_port()
    app = launch_review(run, port=port, limit=3, block=False)
    try:
        upload = httpx.post(
            f"http://127.0.0.1:{port}/gradio_api/upload", files={"files": ("a.bin", bytes(512))}, timeout=30
        )
        assert upload.status_code == 200
        (kept,) = upload.json()
        assert Path(kept).is_file()
    finally:
        app.close()
    wait_until(lambda: not Path(kept).exists(), 10, "the upload deleted")


def test_port_0_serves_the_page_on_a_free_port(run: Path):
    """--port 0 scored the whole run, then ended in a traceback (httpx.ConnectError): Gradio, given 0, bound a free
    port and then asked port 0 whether its page was up."""
    from train.review import launch_review

    app = launch_review(run, port=0, limit=3, block=False)
    try:
        port = int(app.local_url.rstrip("/").rsplit(":", 1)[1])
        assert port > 0 and _answers(port)
    finally:
        app.close()


@pytest.mark.parametrize(
    ("stop", "code", "said"), [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")]
)
def test_a_review_stopped_while_it_scores_the_run_says_so_in_one_line(run: Path, capsys, monkeypatch, stop, code, said):
    """Ctrl-C or SIGTERM while the run was scored printed a traceback of some 60 lines, exit 1."""
    from train.review import main

    def stopped(self, path):  # the signal lands in this, the main, thread while the first image is read
        os.kill(os.getpid(), stop)
        time.sleep(30)

    monkeypatch.setattr(ReviewRun, "_pixels", stopped)
    with pytest.raises(SystemExit) as e:
        main([str(run), "--port", str(free_port())])
    assert e.value.code == code and capsys.readouterr().err == f"vit-train review: {said}\n"


@pytest.mark.parametrize("when", ["serving", "launching", "before-gradio-waits"])
def test_a_review_stopped_by_sigterm_closes_and_deletes_what_was_uploaded(
    when, run: Path, tmp_path: Path, capsys, caplog, monkeypatch
):
    """`vit-train review` stopped by SIGTERM (a scheduler, `timeout`) was killed, its uploads left behind; it told
    the user to "set `share=True` in `launch()`", where its option is --share. A SIGTERM after the page was up but
    before Gradio's own wait took over escaped the command as an exception, the page open: while launch() checked
    that the page answers (`launching`), or between launch() and Gradio's wait (`before-gradio-waits`). Each upload
    also left an empty folder in the shared /tmp/gradio: the review now keeps its own folder, and removes it."""
    from train.review import main

    if when == "launching":  # the signal lands in the main thread while launch() asks the page it started
        url_ok = gr.networking.url_ok
        monkeypatch.setattr(gr.networking, "url_ok", lambda url: (time.sleep(60), url_ok(url))[1])
    if when == "before-gradio-waits":  # or after launch(), before block_thread() has its own handler
        block_thread = gr.Blocks.block_thread
        monkeypatch.setattr(gr.Blocks, "block_thread", lambda app: (time.sleep(60), block_thread(app)))
    port, kept = free_port(), []
    temp = tmp_path / "tmp"  # the system's temporary folder, for this test: the page's folders go in it
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))

    def upload_then_terminate() -> None:
        wait_until(lambda: _answers(port), 60, "the review page up")
        upload = httpx.post(
            f"http://127.0.0.1:{port}/gradio_api/upload", files={"files": ("a.bin", bytes(512))}, timeout=30
        )
        kept.extend(upload.json())
        if when != "launching":  # the page answers while launch() still checks it: wait until launch() has returned
            wait_until(lambda: "the page is at" in caplog.text, 60, "launch() done")
        os.kill(os.getpid(), signal.SIGTERM)  # handled in this, the main, thread

    before = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=upload_then_terminate, daemon=True).start()
    with caplog.at_level(logging.INFO, logger="train.review"):
        try:
            main([str(run), "--port", str(port), "--limit", "3"])  # returns once the page has closed
        except KeyboardInterrupt as e:  # Terminated: raised by the SIGTERM handler, and let out of the command
            pytest.fail(f"vit-train review let {type(e).__name__} out instead of closing its page")
    assert kept and signal.getsignal(signal.SIGTERM) is before
    if when != "launching":  # stopped before it could say
        assert f"the page is at http://127.0.0.1:{port}/ (--share for a public link)" in caplog.text
    assert "share=True" not in capsys.readouterr().out
    wait_until(lambda: not Path(kept[0]).exists(), 10, "the upload deleted")
    assert Path(kept[0]).is_relative_to(temp) and list(temp.iterdir()) == []  # Gradio's folders left no empty one


def _answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _browser_safe(value) -> None:
    """Every string in what a callback returns (table rows, gr.update dicts, Markdown) encodes as UTF-8, as the
    page's messages must."""
    if isinstance(value, str):
        value.encode("utf-8")
    elif isinstance(value, dict):
        for k, v in value.items():
            _browser_safe(k), _browser_safe(v)
    elif isinstance(value, list | tuple):
        for v in value:
            _browser_safe(v)


def _rename_first_flagged(run: Path, name: str) -> str:
    """Give the run's first likely wrong label the file name `name`, in its folder, split.json and report, as if
    the run had found it so; returns its new path."""
    split = json.loads((run / "split.json").read_text())
    old = split["train"][0]["path"]
    new = os.path.join(os.path.dirname(old), name)
    os.rename(old, new)
    split["train"][0]["path"] = new
    (run / "split.json").write_text(json.dumps(split))
    issues = run / "reports" / "label_issues.csv"
    with open(issues, newline="", encoding="utf-8") as f:
        rows = [[new if cell == old else cell for cell in row] for row in csv.reader(f)]
    with open(issues, "w", newline="", encoding="utf-8", errors="surrogateescape") as f:
        csv.writer(f).writerows(rows)
    return new


def test_an_image_name_that_is_not_utf8_is_shown_escaped_and_its_decisions_are_saved_as_named(tmp_path: Path):
    """`caf\\xe9.png` (a Latin-1 archive unzipped on Linux): the table, the image's text and every click failed with
    Gradio's "unexpected error" (`str is not valid UTF-8: surrogates not allowed`), the Leave-out click too, though
    it was saved."""
    run = write_review_run(tmp_path / "run")
    new = _rename_first_flagged(run, os.fsdecode(b"caf\xe9.png"))
    on = ReviewActions(ReviewRun(run, limit=3))
    assert on.run.lists[FLAGGED][0].path == new
    table, *shown = on.load(FLAGGED)
    _browser_safe([table, shown])
    assert table[0][1] == os.path.join(os.path.basename(os.path.dirname(new)), "caf\\xe9.png")
    assert "caf\\xe9.png" in shown[3]  # the image's text (its Markdown)
    _browser_safe(on.show(FLAGGED, 0))
    answer = on.decide(FLAGGED, 0, "leave", None)
    _browser_safe(answer)
    assert "caf\\xe9.png" in answer[-1] and "left out" in answer[-1]
    assert answer[0][0][-1] == "left out"
    assert load_corrections(run / "corrections.csv", _data_root(run), CLASS_NAMES) == {new: None}
    assert b"/caf\xe9.png," in (run / "corrections.csv").read_bytes()  # the real name, not the one shown


def test_a_decision_on_an_image_named_over_two_lines_stays_readable_once_the_image_is_gone(tmp_path: Path, caplog):
    """`new\nline.png`: the review wrote a well-formed quoted row for it, and once the image was moved the review
    (each click reads the file again) and fit refused the whole file ("names no file ... a field that starts with
    a quote"), though a missing image is warned about, not refused."""
    from train.folder_scan import scan_folder

    run = write_review_run(tmp_path / "run")
    new = _rename_first_flagged(run, "new\nline.png")
    on = ReviewActions(ReviewRun(run, limit=3))
    on.decide(FLAGGED, 0, "relabel", CLASS_NAMES[3])
    os.remove(new)
    table, *_ = on.load(FLAGGED)  # a page reload
    assert table[0][-1] == f"relabelled {CLASS_NAMES[3]}"
    *_, status = on.decide(FLAGGED, 1, "leave", None)
    assert "left out" in status
    again = ReviewActions(ReviewRun(run, limit=3))  # a restarted review
    assert again.decisions.get(new) == (True, CLASS_NAMES[3])
    with caplog.at_level(logging.WARNING, logger="train.corrections"):
        scan = scan_folder(_data_root(run), 0.25, seed=0, corrections=run / "corrections.csv")  # as fit applies it
    assert scan.corrections["not_found"] == 1 and scan.corrections["left_out"] == 1
    assert any("not images of the folder" in r.getMessage() for r in caplog.records)


def test_a_click_after_the_last_image_of_a_list_changes_no_decision(run: Path):
    """The page stayed on the last image once it was decided, and the next click rewrote that decision unseen."""
    on = ReviewActions(ReviewRun(run, limit=3))
    last = len(on.run.lists[FLAGGED]) - 1
    *_, about, _, shown, seen, status = on.decide(FLAGGED, last, "leave", None)
    assert "the end of the list" in about and shown == (FLAGGED, -1) and seen == ""
    with pytest.raises(gr.Error, match="pick an image in the table first"):
        on.decide(*shown, "keep", None, seen)
    assert on.decisions.get(on.run.lists[FLAGGED][last].path) == (True, None)  # still left out


def test_a_click_made_while_the_page_changes_to_another_list_records_nothing(run: Path):
    """A decision took its list from the radio and its index from the server: clicked while another list loaded, it
    went to an image of that list the reviewer had not seen."""
    on = ReviewActions(ReviewRun(run, limit=3))
    *_, seen = on.show(FLAGGED, 1)  # what the browser shows when the reviewer clicks
    other = next(name for name in LISTS if name != FLAGGED and on.run.lists[name])
    *_, shown, _ = on.load(other)  # the other list loads first, on the server
    with pytest.raises(gr.Error, match="nothing was recorded"):
        on.decide(*shown, "leave", None, seen)
    assert not any(decided for decided, _ in map(on.decisions.get, [it.path for it in on.run.lists[other]]))


def test_a_file_name_with_markup_is_shown_as_text(tmp_path: Path):
    """A backtick in a file name closed the Markdown code span around it, and the rest became HTML on the page."""
    from train.review_app import code, plain

    name = "x`<img src=https://example.com/p.png>`.png"
    shown = code(name)
    assert shown.startswith("`` ") and shown.endswith(" ``") and name in shown  # a fence longer than any run in it
    assert plain("<b>bar</b> *x*") == "&lt;b&gt;bar&lt;/b&gt; \\*x\\*"


def test_a_refused_click_or_load_tells_the_page_and_prints_no_traceback(run: Path):
    """Every refusal printed a traceback of about 30 lines, with the server's paths, to the console: Gradio prints
    one for each `gr.Error` unless it is told not to (`print_exception`), as vit-serve's page does."""
    on = ReviewActions(ReviewRun(run, limit=3))
    refusals = []
    (run / "corrections.csv").write_text("path,label\n")
    calls = [
        lambda: on.decide(FLAGGED, None, "keep", None),  # nothing picked
        lambda: on.decide(FLAGGED, 0, "relabel", "no such class"),
        lambda: on.decide(FLAGGED, 0, "keep", None, "another image"),  # the page moved on as the click was made
    ]
    for call in calls:
        with pytest.raises(gr.Error) as refused:
            call()
        refusals.append(refused.value)
    (run / "corrections.csv").write_text('path,label\n"broken,top_left\n')  # broken by hand while the page is open
    for call in (lambda: on.decide(FLAGGED, 1, "leave", None), lambda: on.load(FLAGGED)):
        with pytest.raises(gr.Error, match="line 2") as refused:
            call()
        refusals.append(refused.value)
    assert [e.print_exception for e in refusals] == [False] * len(refusals)


@pytest.mark.parametrize("index", [5, None, [], ["x", 0], [float("nan"), 0], [float("inf"), 0], [True, 0], [1.5, 0]])
def test_a_select_event_whose_index_is_no_row_is_refused_without_a_traceback(run: Path, index):
    """Sent to the page's API by hand, each ended in a traceback on the console ("'int' object is not subscriptable",
    "cannot convert float NaN to integer"); a real click's index is still a row's."""
    from types import SimpleNamespace

    on = ReviewActions(ReviewRun(run, limit=3))
    with pytest.raises(gr.Error, match="pick an image in the table") as refused:
        on.pick(FLAGGED, SimpleNamespace(index=index))
    assert refused.value.print_exception is False
    shown = on.pick(FLAGGED, SimpleNamespace(index=[1, 4]))
    assert shown[5] == (FLAGGED, 1) and shown[6] == on.shown_path(on.run.lists[FLAGGED][1].path)
    assert on.pick(FLAGGED, SimpleNamespace(index=[10**400, 0]))[5] == (FLAGGED, -1)  # past the end, as a click there


def test_a_list_name_that_is_no_lists_is_refused_without_a_traceback(run: Path):
    """Sent to the page's API by hand, a list the page has not ("nope") ended in a KeyError on the console."""
    on = ReviewActions(ReviewRun(run, limit=3))
    for which in ("nope", None, ["x"]):
        for call, args in ((on.load, (which,)), (on.decide, (which, 0, "leave", None))):
            with pytest.raises(gr.Error, match="pick one of the lists") as refused:
                call(*args)
            assert refused.value.print_exception is False
    assert on.load(FLAGGED)[0]  # a list of the page's: its table


def _heading(app) -> str:
    return next(block.value for block in app.blocks.values() if isinstance(block, gr.Markdown))


def test_a_run_folder_named_with_markup_is_shown_as_written_and_its_fit_command_can_be_pasted(review_run, tmp_path):
    """The heading put the run's path and the decisions file into Markdown as they were: a folder name's `**` and
    HTML became bold text and an image on the page, and its backticks cut the path in the command to paste."""
    from markdown_it import MarkdownIt

    from train.review_app import build_review_app

    run = Path(shutil.copytree(review_run, tmp_path / "r`x` **bold** <img src=x> [a](b) it's"))
    app = build_review_app(ReviewRun(run, limit=3))
    page = MarkdownIt().render(_heading(app))
    assert "<img" not in page and "<strong>bold" not in page and "<a href" not in page
    commands = [html.unescape(c) for c in re.findall(r"<code>(vit-train fit .*?)</code>", page)]
    assert commands == [f"vit-train fit ... --data.corrections {shlex.quote(str(run / 'corrections.csv'))}"]
    assert f"# vitscope review: {run}" in html.unescape(page.replace("<h1>", "# "))  # the path, as it is


def test_a_run_folder_a_decision_cannot_be_written_to_is_said_when_the_review_opens(run: Path, caplog):
    """A run folder the review could not write to (read-only, full, or its write's file taken by a folder) was found
    only at the first click, while the page said each decision is saved at once."""
    from train.review_app import build_review_app

    (run / ".corrections.csv.tmp").mkdir()  # where each decision is written before it is renamed into place
    with caplog.at_level(logging.WARNING, logger="train.review_store"):
        app = build_review_app(ReviewRun(run, limit=3))
    said = f"decisions cannot be saved in {run / 'corrections.csv'}"
    assert said in caplog.text and "Is a directory" in caplog.text
    assert said in _heading(app).replace("`", "").replace("\\", "") and "Each decision is saved" not in _heading(app)
    assert not (run / "corrections.csv").exists() and (run / ".corrections.csv.tmp").is_dir()


def _move(run: Path, entries: int) -> list[str]:
    """Point the first `entries` images of the run's split somewhere they are not, as if their folder had moved."""
    split = json.loads((run / "split.json").read_text())
    every = [e for key in ("train", "val", "calib") for e in split[key]]
    for e in every[:entries]:
        e["path"] = str(run / "moved" / Path(e["path"]).name)
    (run / "split.json").write_text(json.dumps(split))
    return [e["path"] for e in every[:entries]]


def test_images_that_cannot_be_read_are_counted_once_on_the_page_and_all_of_them_stop_the_review(run: Path, caplog):
    """With its images moved, the review logged a line per image and opened on lists that said "nothing to look
    at in this run", as if the model made no error; with some moved, its lists shrank without a word."""
    from train.errors import SetupError
    from train.review_app import build_review_app

    total = len(json.loads((run / "split.json").read_text())["train"]) + 12 + 24
    gone = _move(run, 17)
    with caplog.at_level(logging.INFO, logger="train.review_data"):
        app = build_review_app(ReviewRun(run, limit=3))
    records = [r for r in caplog.records if r.name == "train.review_data" and r.levelno >= logging.WARNING]
    warnings = [r.getMessage() for r in records]
    assert len(warnings) == 1 and f"17 of the run's {total} images cannot be read" in warnings[0]
    assert gone[0] in warnings[0] and "moved" in warnings[0]
    assert f"17 of the run's {total} images cannot be read" in _heading(app)
    _move(run, total)
    with pytest.raises(SetupError, match=f"none of the run's {total} images can be read .*moved"):
        ReviewRun(run, limit=3)
