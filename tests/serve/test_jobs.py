"""vit-predict --out: resumable parts, the output formats, inputs from lists and URIs, a run killed and resumed."""

from __future__ import annotations

import csv
import http.server
import importlib.util
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from serve.runtime import input_lists
from serve.runtime.outputs import JOB_FILE, PartStore, create_anew
from serve.runtime.predict import main
from serve.runtime.row_formats import table_row
from tests.helpers import CLASS_NAMES, bright_square, png_bytes, quadrant_images, wait_until

ROOT = Path(__file__).resolve().parents[2]
HAS_PYARROW = importlib.util.find_spec("pyarrow") is not None  # the [batch] extra; the [serve]-only venv lacks it
NEEDS_PYARROW = pytest.mark.skipif(not HAS_PYARROW, reason="needs pyarrow")
OUT_SUFFIXES = [pytest.param(".parquet", marks=NEEDS_PYARROW), ".csv", ".jsonl"]


def _images(folder: Path, n: int, seed: int = 5) -> list[Path]:
    images, labels = quadrant_images(n, seed=seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (img, label) in enumerate(zip(images, labels, strict=True)):
        paths.append(folder / f"{i:04d}_{CLASS_NAMES[label]}.png")
        Image.fromarray(img).save(paths[-1])
    return paths


def _stdout_rows(model: Path, folder: Path, capsys, *args: str) -> dict[str, dict]:
    main([str(model), str(folder), *args])
    return {r["path"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}


def _read(out: Path) -> list[dict]:
    if out.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(out).to_pylist()
    if out.suffix == ".csv":
        with open(out, newline="") as f:
            return list(csv.DictReader(f))
    return [table_row(json.loads(line)) for line in out.read_text().splitlines()]


@pytest.mark.parametrize("suffix", OUT_SUFFIXES)
def test_out_file_holds_the_same_predictions_as_stdout_and_reports_broken_files(tiny_onnx, tmp_path, capsys, suffix):
    folder = tmp_path / "photos"
    _images(folder, 10)
    (folder / "truncated.png").write_bytes((folder / "0000_top_left.png").read_bytes()[:40])
    expected = _stdout_rows(tiny_onnx, folder, capsys, "--top-k", "2")
    out = tmp_path / f"preds{suffix}"
    args = ["--top-k", "2", "--batch-size", "3", "--part-size", "4"]
    assert main([str(tiny_onnx), str(folder), "--out", str(out), *args]) == 1
    err = capsys.readouterr().err
    assert f"{folder / 'truncated.png'}: " in err and "classified 10 images; 1 input(s)" in err
    rows = _read(out)
    assert [r["path"] for r in rows] == list(expected)  # input order, each image once
    for row in rows:
        want = expected[row["path"]]
        assert [row["label_1"], row["label_2"]] == [p["label"] for p in want["predictions"]]
        assert float(row["score_1"]) == pytest.approx(want["predictions"][0]["score"], abs=1e-6)
        # every field stdout prints, without --coverage too: the unknown verdict was on stdout and not in the file
        assert str(row["unknown"]).lower() == str(want["unknown"]).lower()
        assert float(row["ood_score"]) == pytest.approx(want["ood_score"], abs=1e-6)
        assert row["prediction_set"] in (None, "") and want["prediction_set"] is None
    assert not out.with_name(out.name + ".parts").exists()


@pytest.mark.parametrize("suffix", OUT_SUFFIXES)
def test_coverage_adds_prediction_sets_and_unknown_verdicts_to_the_out_file(tiny_onnx, tmp_path, capsys, suffix):
    folder = tmp_path / "photos"
    _images(folder, 6)
    expected = _stdout_rows(tiny_onnx, folder, capsys, "--coverage", "0.9", "--top-k", "2")
    out = tmp_path / f"preds{suffix}"
    assert main([str(tiny_onnx), str(folder), "--out", str(out), "--coverage", "0.9", "--top-k", "2"]) == 0
    rows = _read(out)
    assert [r["path"] for r in rows] == list(expected)
    sizes = []
    for row in rows:
        want = expected[row["path"]]
        got_set = json.loads(row["prediction_set"]) if suffix == ".csv" else row["prediction_set"]
        assert got_set == want["prediction_set"]  # a set may be empty: no class reaches the bar for that image
        sizes.append(len(got_set))
        # CSV writes true and false, as vit-predict's stdout CSV does (it wrote Python's True and False)
        assert row["unknown"] == (json.dumps(want["unknown"]) if suffix == ".csv" else want["unknown"])
        assert float(row["ood_score"]) == pytest.approx(want["ood_score"], abs=1e-6)
    assert sum(sizes) >= 1


def test_a_coverage_the_file_cannot_honour_is_refused_before_anything_is_written(tiny_onnx, tmp_path, capsys):
    _images(tmp_path / "photos", 2)
    out = tmp_path / "preds.jsonl"
    assert main([str(tiny_onnx), str(tmp_path / "photos"), "--out", str(out), "--coverage", "0.999"]) == 2
    assert "finer than the 120 calibration images" in capsys.readouterr().err
    assert not out.exists() and not out.with_name(out.name + ".parts").exists()


def test_an_existing_output_is_refused_without_resume(tiny_onnx, tmp_path, capsys):
    folder = tmp_path / "photos"
    _images(folder, 2)
    out = tmp_path / "preds.jsonl"
    assert main([str(tiny_onnx), str(folder), "--out", str(out)]) == 0
    assert main([str(tiny_onnx), str(folder), "--out", str(out)]) == 2
    assert "add --resume" in capsys.readouterr().err
    assert main([str(tiny_onnx), str(folder), "--out", str(out), "--resume"]) == 0  # complete: nothing to do
    assert len(out.read_text().splitlines()) == 2


def test_an_unknown_output_suffix_is_a_clear_error(tiny_onnx, tmp_path, capsys):
    _images(tmp_path / "photos", 1)
    assert main([str(tiny_onnx), str(tmp_path / "photos"), "--out", str(tmp_path / "preds.xlsx")]) == 2
    assert "name the file .parquet, .csv or .jsonl" in capsys.readouterr().err


@pytest.mark.parametrize("resume", [[], ["--resume"]], ids=["new", "resume"])
def test_an_output_that_is_a_folder_is_refused_as_one(tiny_onnx, tmp_path, capsys, resume):
    """It said "exists: add --resume", and with --resume "is complete: nothing to resume" then "Is a directory"."""
    _images(tmp_path / "photos", 1)
    (tmp_path / "preds.csv").mkdir()
    with pytest.raises(SystemExit) as e:
        main([str(tiny_onnx), str(tmp_path / "photos"), "--out", str(tmp_path / "preds.csv"), *resume])
    said = capsys.readouterr().err.strip().splitlines()[-1]  # after argparse's usage lines
    assert e.value.code == 2 and "preds.csv is a folder: give the table's file name" in said and "resume" not in said


@pytest.mark.skipif(HAS_PYARROW, reason="the [serve]-only install, without pyarrow")
def test_parquet_without_pyarrow_says_what_to_install_before_any_image_is_read(tiny_onnx, tmp_path, capsys):
    _images(tmp_path / "photos", 1)
    assert main([str(tiny_onnx), str(tmp_path / "photos"), "--out", str(tmp_path / "preds.parquet")]) == 2
    err = capsys.readouterr().err
    assert "pip install 'vitscope[batch]'" in err and "or name the output .csv or .jsonl" in err
    assert not (tmp_path / "preds.parquet").exists() and not (tmp_path / "preds.parquet.parts").exists()


def test_an_uncommitted_part_is_cleared_and_its_images_scored_again(tmp_path):
    store = PartStore(tmp_path / "preds.jsonl")
    store.committed()
    store.commit([{"path": "a.png", "predictions": []}], [("b.png", "corrupt")])
    (store.dir / "part-00001.jsonl").write_text('{"path": "c.png"}\n')  # data written, manifest not yet renamed
    (store.dir / "part-00001.json.tmp").write_text('{"paths": ["c.png"')  # a manifest cut off mid-write
    done, failed = PartStore(tmp_path / "preds.jsonl").committed()
    assert done == {"a.png"} and failed == [("b.png", "corrupt")]
    assert sorted(p.name for p in store.dir.iterdir()) == ["part-00000.json", "part-00000.jsonl"]


@NEEDS_PYARROW
def test_a_part_that_cannot_be_read_at_the_merge_keeps_its_reason(tmp_path):
    """A read error of the merge (pyarrow's, with no errno) was named after the merged file's temporary, its own
    reason lost: `[Errno None] None: 'preds.parquet.tmp'`. Only a write's error (a full disk) names the file."""
    store = PartStore(tmp_path / "preds.parquet")
    store.committed()
    store.commit([{"path": f"{i}.png", "label": "x" * 50} for i in range(200)], [])
    part = store.dir / "part-00000.parquet"
    data = bytearray(part.read_bytes())
    data[8:400] = bytes(b ^ 0x5A for b in data[8:400])  # its pages, not the footer it is counted by
    part.write_bytes(bytes(data))
    with pytest.raises(OSError) as e:
        store.finish()
    assert e.value.filename is None and "Errno None" not in str(e.value), str(e.value)
    assert not (tmp_path / "preds.parquet.tmp").exists()


def test_parts_past_99999_are_merged_in_the_order_they_were_written(tmp_path):
    """Parts were merged in the order of their names: `part-100000` before `part-99998`."""
    store = PartStore(tmp_path / "preds.jsonl")
    store.committed()
    store.next_index = 99_998  # a run of 100,000 parts and more (--part-size 10 over a million images)
    for name in ("a.png", "b.png", "c.png"):
        store.commit([{"path": name, "predictions": []}], [])
    assert PartStore(tmp_path / "preds.jsonl").committed() == ({"a.png", "b.png", "c.png"}, [])
    store.finish()
    assert store.output_paths() == ["a.png", "b.png", "c.png"]


def test_from_list_reads_paths_and_uris(tiny_onnx, tmp_path, capsys):
    paths = _images(tmp_path / "photos", 3)
    listing = tmp_path / "inputs.txt"
    listing.write_text(f"# tonight's photos\n{paths[0]}\n\nfile://{paths[1]}\n{paths[0]}\n{tmp_path / 'gone.png'}\n")
    out = tmp_path / "preds.jsonl"
    assert main([str(tiny_onnx), str(paths[2]), "--from-list", str(listing), "--out", str(out)]) == 1
    assert "gone.png: no such file or folder" in capsys.readouterr().err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["path"] for r in rows] == [str(paths[2]), str(paths[0]), f"file://{paths[1]}"]
    assert [r["predictions"][0]["label"] for r in rows] == ["bottom_left", "top_left", "top_right"]


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16"])  # Notepad's UTF-8; PowerShell 5's `>` (UTF-16LE)
def test_a_list_written_by_notepad_is_read_bom_and_crlf_aside(tiny_onnx, tmp_path, capsys, encoding):
    """Its first line, behind the byte order mark Notepad and PowerShell write, was a file that was not there."""
    paths = _images(tmp_path / "photos", 2)
    listing = tmp_path / "inputs.txt"
    listing.write_bytes(f"{paths[0]}\r\n{paths[1]}\r\n".encode(encoding))
    out = tmp_path / "preds.jsonl"
    assert main([str(tiny_onnx), "--from-list", str(listing), "--out", str(out)]) == 0, capsys.readouterr().err
    assert [json.loads(line)["path"] for line in out.read_text().splitlines()] == [str(p) for p in paths]


def test_a_comment_line_that_names_a_file_says_how_to_score_it(tiny_onnx, tmp_path, capsys, monkeypatch):
    """`#1.png` in a list was skipped as a comment without a word, though the folder held that file."""
    paths = _images(tmp_path / "photos", 2)
    paths[1].rename(tmp_path / "photos" / "#1.png")
    monkeypatch.chdir(tmp_path / "photos")
    listing = tmp_path / "inputs.txt"
    listing.write_text(f"# tonight's photos\n{paths[0].name}\n#1.png\n# {'a long comment ' * 20}\n")  # no name
    assert main([str(tiny_onnx), "--from-list", str(listing), "--out", str(tmp_path / "preds.jsonl")]) == 0
    assert capsys.readouterr().err.splitlines() == [
        f"{listing}:3: #1.png is read as a comment; write it as ./#1.png to score that file"
    ]
    listing.write_text("./#1.png\n")
    assert main([str(tiny_onnx), "--from-list", str(listing), "--out", str(tmp_path / "more.jsonl")]) == 0
    assert [json.loads(line)["path"] for line in (tmp_path / "more.jsonl").read_text().splitlines()] == ["./#1.png"]


def test_a_url_that_cannot_be_reached_is_one_input_that_failed_not_the_run(tiny_onnx, tmp_path, capsys):
    """A host that refuses, or a name that does not resolve, stopped the whole run with a bare "vit-predict: Connect
    call failed ('127.0.0.1', 9)" that named no input; a 404 was already one input's problem."""
    pytest.importorskip("aiohttp", reason="fsspec reads http:// with aiohttp")

    class Forbidden(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # HEAD too: every request is refused, but /busy.png is listed, then busy when read
            if self.path != "/busy.png" or self.headers.get("Range"):  # fsspec reads in byte ranges
                return self.send_error(503 if self.path == "/busy.png" else 403)
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(bytes(100))

        do_HEAD = do_GET

        def log_message(self, *args):
            pass

    (path,) = _images(tmp_path / "photos", 1)
    out = tmp_path / "preds.jsonl"
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Forbidden)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    forbidden = f"http://127.0.0.1:{server.server_address[1]}/photo.png"
    busy = f"http://127.0.0.1:{server.server_address[1]}/busy.png"  # its 503 on reading was a traceback, rows lost
    try:
        with socket.socket() as s:  # bound and not listening for the whole run: it refuses, and no one else takes it
            s.bind(("127.0.0.1", 0))
            refused = f"http://127.0.0.1:{s.getsockname()[1]}/photo.png"
            assert main([str(tiny_onnx), refused, forbidden, busy, str(path), "--out", str(out)]) == 1
    finally:
        server.shutdown()
        server.server_close()
    err = capsys.readouterr().err
    assert f"{refused}: cannot be reached or listed (" in err and f"{forbidden}: cannot be reached or listed" in err
    assert "503" in err.split(f"{busy}: ", 1)[1].splitlines()[0], err
    assert "3 input(s) could not be read" in err, err
    assert [json.loads(line)["path"] for line in out.read_text().splitlines()] == [str(path)]


def test_a_uri_whose_storage_backend_is_not_installed_is_one_line(tiny_onnx, tmp_path, capsys):
    """s3:// without s3fs (and http:// without aiohttp, as the [serve]-only install has it) was a traceback."""
    if importlib.util.find_spec("s3fs") is not None:
        pytest.skip("s3fs is installed here")
    assert main([str(tiny_onnx), "s3://bucket/photo.png", "--out", str(tmp_path / "preds.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vit-predict: s3://bucket/photo.png: ") and "s3fs" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "preds.jsonl").exists()


def test_a_list_line_with_an_unknown_scheme_names_that_input(tiny_onnx, tmp_path, capsys):
    """fsspec's "Protocol not known: s4" stopped the run without naming the line among thousands that had it."""
    listed = tmp_path / "list.txt"
    listed.write_text("# last night's\n\ns4://bucket/night/x.png\n")
    assert main([str(tiny_onnx), "--from-list", str(listed), "--out", str(tmp_path / "preds.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vit-predict: s4://bucket/night/x.png: Protocol not known: s4 (a typo in the scheme"), err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "preds.jsonl").exists()


def test_an_out_where_no_folder_can_be_made_is_one_line_that_says_so(tiny_onnx, tmp_path, capsys):
    """`--out /proc/x.jsonl` was a bare "[Errno 2] No such file or directory: '/proc/x.jsonl.parts'"."""
    image = tmp_path / "a.png"
    image.write_bytes(png_bytes(bright_square(0)))
    assert main([str(tiny_onnx), str(image), "--out", "/proc/x.jsonl"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vit-predict: cannot make /proc/x.jsonl.parts, the folder of the parts of /proc/x.jsonl"), err
    assert err.rstrip().endswith("give an --out in a folder this user can write") and len(err.splitlines()) == 1


def _predict(*args: str, preexec_fn=None, **kw) -> subprocess.Popen:
    """`vit-predict args` in a child that takes Ctrl-C as from a terminal: a shell script's background job (a CI
    runner's, say) starts its children with SIGINT ignored, and Python then installs no KeyboardInterrupt."""

    def as_from_a_terminal() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if preexec_fn is not None:
            preexec_fn()

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "serve.runtime.predict", *args]
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=as_from_a_terminal, **kw
    )


@contextmanager
def held_image(body: bytes):
    """(`http://127.0.0.1:PORT/held.png` answering `body`, an Event that lets its reads go): an input on which
    a run blocks halfway until the test says. fsspec reads a file in byte ranges, and only those wait: its listing
    and size checks are answered at once."""
    pytest.importorskip("aiohttp")  # fsspec's HTTP backend
    release = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def answer(self, with_body: bool) -> None:
            if with_body and self.headers.get("Range"):
                release.wait(60)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if with_body:
                self.wfile.write(body)

        def do_HEAD(self) -> None:
            self.answer(False)

        def do_GET(self) -> None:
            self.answer(True)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/held.png", release
    finally:
        release.set()
        server.shutdown()
        server.server_close()


@pytest.mark.slow
def test_a_run_killed_mid_job_resumes_with_every_image_exactly_once(tiny_onnx, tmp_path):
    """SIGKILL a real run while it is blocked on one input (an image whose server has not answered yet), then
    resume."""
    paths = _images(tmp_path / "photos", 120)
    with held_image(paths[0].read_bytes()) as (held, release):
        _killed_mid_job_then_resumed(tiny_onnx, tmp_path, paths, held, release)


def _killed_mid_job_then_resumed(tiny_onnx, tmp_path: Path, paths: list[Path], held: str, release) -> None:
    sources = [str(p) for p in paths[:60]] + [held] + [str(p) for p in paths[60:]]
    (tmp_path / "inputs.txt").write_text("\n".join(sources) + "\n")
    out = tmp_path / ("preds.parquet" if HAS_PYARROW else "preds.jsonl")
    args = [str(tiny_onnx), "--from-list", str(tmp_path / "inputs.txt"), "--out", str(out), "--top-k", "2"]
    args += ["--batch-size", "4", "--part-size", "8", "--decode-threads", "2"]
    proc = _predict(*args)
    parts = out.with_name(out.name + ".parts")
    deadline = time.monotonic() + 60
    while len(list(parts.glob("part-*.json"))) < 7:  # the 56 images before the FIFO's part
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert not out.exists()
    release.set()  # now answered, and scored by the resumed run

    resumed = _predict(*args, "--resume")
    _, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, err
    rows = _read(out)
    assert [r["path"] for r in rows] == sources  # every image exactly once, in input order
    clean = out.with_name("clean" + out.suffix)
    again = _predict(*args[:3], "--out", str(clean), *args[5:])
    assert again.wait(120) == 0
    assert rows == _read(clean)


class Killed(BaseException):
    """SIGKILL at this instant: nothing after it runs (a BaseException, so no `except Exception` sees it)."""


def _kill_at(step: int, monkeypatch) -> list[int]:
    """Make the `step`-th file-system change inside `PartStore.finish` (a rename, a file or folder removed) raise
    `Killed` instead of happening; returns a list that holds the steps counted so far."""
    seen = [0]
    finish, active = PartStore.finish, [False]

    def killable(name: str):
        real = getattr(os, name)

        def change(*args, **kwargs):
            if active[0]:
                seen[0] += 1
                if seen[0] > step:
                    raise Killed(f"{name}{args}")
            return real(*args, **kwargs)

        monkeypatch.setattr(os, name, change)

    for name in ("replace", "rename", "unlink", "rmdir"):
        killable(name)

    def watched(self, *args):
        active[0] = True
        try:
            return finish(self, *args)
        finally:
            active[0] = False

    monkeypatch.setattr(PartStore, "finish", watched)
    return seen


def test_a_kill_at_any_step_of_the_final_clean_up_then_resume_keeps_every_row(tiny_onnx, tmp_path, capsys):
    folder = tmp_path / "photos"
    _images(folder, 4)
    args = [str(tiny_onnx), str(folder), "--part-size", "1", "--batch-size", "1", "--top-k", "2"]  # 4 parts of a row
    assert main([*args, "--out", str(tmp_path / "whole.jsonl")]) == 0
    whole = (tmp_path / "whole.jsonl").read_text().splitlines()
    for step in range(100):
        out = tmp_path / f"kill-{step}" / "preds.jsonl"
        out.parent.mkdir()
        with pytest.MonkeyPatch.context() as mp:
            seen = _kill_at(step, mp)
            try:
                main([*args, "--out", str(out)])
            except Killed:
                pass
            else:
                break  # the clean-up has no step left to kill
        assert main([*args, "--out", str(out), "--resume"]) == 0, capsys.readouterr().err
        assert out.read_text().splitlines() == whole, f"killed at step {step} of the clean-up"
        assert sorted(p.name for p in out.parent.iterdir()) == [".preds.jsonl.job.json", "preds.jsonl"]  # its job
    assert step == seen[0] >= 2  # every step was killed once


def test_a_symlinked_parts_folder_is_refused_and_what_it_points_at_survives(tiny_onnx, tmp_path, capsys):
    folder = tmp_path / "photos"
    _images(folder, 2)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name in ("notes.txt", "part-00000.jsonl", "part-00001.json.tmp"):
        (elsewhere / name).write_text("keep me\n")
    out = tmp_path / "preds.jsonl"
    out.with_name(out.name + ".parts").symlink_to(elsewhere)
    assert main([str(tiny_onnx), str(folder), "--out", str(out), "--resume"]) == 2
    assert "is a symbolic link" in capsys.readouterr().err
    assert sorted(p.name for p in elsewhere.iterdir()) == ["notes.txt", "part-00000.jsonl", "part-00001.json.tmp"]
    assert all(p.read_text() == "keep me\n" for p in elsewhere.iterdir()) and not out.exists()


def test_a_symlinked_temporary_file_is_refused_and_never_written_through(tiny_onnx, tmp_path, capsys):
    folder = tmp_path / "photos"
    _images(folder, 2)
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me\n")
    out = tmp_path / "preds.jsonl"
    out.with_name(out.name + ".tmp").symlink_to(victim)  # where the merged output is written before its rename
    assert main([str(tiny_onnx), str(folder), "--out", str(out)]) == 2
    assert "is a symbolic link" in capsys.readouterr().err
    assert victim.read_text() == "keep me\n" and not out.exists()


def test_create_anew_replaces_what_stands_at_the_name_and_never_writes_through_a_link(tmp_path):
    """vit-train's temporary files (the review's decisions, prepare's metadata, checkpoints) are made by this: a link
    planted at the name is removed, not followed, and a stale file is replaced whole."""
    victim, tmp = tmp_path / "precious.txt", tmp_path / ".out.tmp"
    victim.write_text("keep me\n")
    tmp.symlink_to(victim)
    with create_anew(tmp, "w", encoding="utf-8") as f:
        f.write("new")
    assert victim.read_text() == "keep me\n" and not tmp.is_symlink() and tmp.read_text() == "new"
    with create_anew(tmp) as f:  # a stale file from a killed run: made anew, not written over in place
        f.write(b"x")
    assert tmp.read_bytes() == b"x"
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    create_anew(tmp_path / "dangling").close()
    assert not (tmp_path / "nowhere").exists() and (tmp_path / "dangling").is_file()


def removing(store: PartStore, start: threading.Barrier, failures: list[OSError]) -> None:
    start.wait()
    try:
        store.remove_old_parts()
    except OSError as e:
        failures.append(e)


def test_two_runs_removing_the_same_merged_parts_both_finish(tmp_path):
    """A `--resume` started while a finished run deleted its merged parts deleted the same files, and whichever came
    second to a file failed on it: "No such file or directory: 'part-01627.jsonl'", exit 2, for a table that was
    complete (8 of 8 tries)."""
    for attempt in range(5):  # two removals of 500 files at once collided in 10 tries of 10
        out = tmp_path / f"{attempt}" / "preds.jsonl"
        store = PartStore(out)
        store.old_dir.mkdir(parents=True)
        for i in range(500):
            (store.old_dir / f"part-{i:05d}.jsonl").write_bytes(b"{}\n")
        failures: list[OSError] = []
        start = threading.Barrier(2)
        threads = [threading.Thread(target=removing, args=(s, start, failures)) for s in (store, PartStore(out))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert failures == [] and not store.old_dir.exists(), failures


def test_every_rename_is_fsynced_before_and_its_folder_after(tiny_onnx, tmp_path, monkeypatch):
    """A rename that reaches the disk before its file's data, or never reaches it, loses a part on power loss."""
    events: list[tuple[str, str]] = []
    fsync, replace, rename = os.fsync, os.replace, os.rename

    def synced(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def moved(real):
        def move(src, dst, **kw):
            real(src, dst, **kw)
            events.append(("rename", os.fspath(src)))

        return move

    monkeypatch.setattr(os, "fsync", synced)
    monkeypatch.setattr(os, "replace", moved(replace))
    monkeypatch.setattr(os, "rename", moved(rename))
    _images(tmp_path / "photos", 3)
    out = tmp_path / "preds.jsonl"
    assert main([str(tiny_onnx), str(tmp_path / "photos"), "--out", str(out), "--part-size", "2"]) == 0
    renames = [i for i, (kind, _) in enumerate(events) if kind == "rename"]
    assert len(renames) >= 4  # a part of 2 files, an empty one, and the output
    for i in renames:
        src = events[i][1]
        assert ("fsync", src) in events[:i], f"{src} renamed before its data reached the disk"
        assert events[i + 1] == ("fsync", os.path.dirname(src)), f"{src}'s rename not made durable"


def _killed_after(parts: int, argv: list[str], monkeypatch) -> None:
    """Run vit-predict `argv` in this process and stop it dead once `parts` parts are committed, as SIGKILL would."""
    commit = PartStore.commit

    def commit_then_die(self, *args):
        commit(self, *args)
        if self.next_index >= parts:
            raise Killed(f"after part {self.next_index}")

    with monkeypatch.context() as mp:
        mp.setattr(PartStore, "commit", commit_then_die)
        with pytest.raises(Killed):
            main(argv)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("suffix", OUT_SUFFIXES)
def test_resume_with_another_top_k_is_refused_before_any_image_is_read(
    tiny_onnx, tmp_path, capsys, monkeypatch, suffix
):
    """The parts hold 1 label per row: a resume with --top-k 3 would append rows of 3 (a malformed CSV, a Parquet
    merge that fails after all the work); it is refused up front, and the same command still finishes the job."""
    from serve.runtime.classifier import OnnxClassifier

    folder = tmp_path / "photos"
    _images(folder, 6)
    out = tmp_path / f"pk2{suffix}"
    args = [str(tiny_onnx), str(folder), "--out", str(out), "--batch-size", "2", "--part-size", "2"]
    _killed_after(1, [*args, "--top-k", "1"], monkeypatch)
    parts = out.with_name(out.name + ".parts")
    before = _snapshot(parts)
    reads = []
    prepare = OnnxClassifier.prepare
    monkeypatch.setattr(
        OnnxClassifier, "prepare", lambda self, s, *budget: reads.append(s) or prepare(self, s, *budget)
    )
    capsys.readouterr()

    assert main([*args, "--top-k", "3", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "--top-k 1" in err and "--top-k 3" in err and "without --resume" in err, err
    assert len(err.splitlines()) == 1 and reads == []
    assert _snapshot(parts) == before and not out.exists()
    (free := PartStore(out)).lock()  # the refused run let go of the parts folder: it held it until the process ended
    free.unlock()

    assert main([*args, "--top-k", "1", "--resume"]) == 0  # the options it started with: finished as ever
    rows = _read(out)
    assert len(rows) == 6 and all("label_2" not in r for r in rows) and len(reads) == 4


def test_resume_of_a_finished_table_under_another_model_or_top_k_is_refused(tiny_onnx, tmp_path, capsys):
    """The job's record went with the parts folder: a pipeline that always adds --resume, rerun with a new model,
    kept the old model's table, was told "complete" and exited 0."""
    _images(tmp_path / "photos", 2)
    out, other = tmp_path / "preds.jsonl", tmp_path / "other.onnx"
    other.write_bytes(tiny_onnx.read_bytes() + b"\xc0\x3e\x01")  # another file (an unknown protobuf field)
    args = [str(tmp_path / "photos"), "--out", str(out), "--top-k", "2"]
    assert main([str(tiny_onnx), *args]) == 0
    table = out.read_bytes()
    capsys.readouterr()
    assert main([str(other), *args, "--resume"]) == 2
    assert "is complete, scored with another model file" in capsys.readouterr().err
    assert main([str(tiny_onnx), *args[:3], "--top-k", "3", "--resume"]) == 2
    assert "scored with --top-k 2, this run has --top-k 3" in capsys.readouterr().err
    assert main([str(tiny_onnx), *args, "--resume"]) == 0
    assert "is complete: nothing to resume" in capsys.readouterr().err and out.read_bytes() == table


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_resume_of_a_table_without_its_record_is_refused_in_one_line(tiny_onnx, tmp_path, capsys, suffix):
    """A finished table moved or copied without its hidden record was taken for complete under any model or
    options; a file vit-predict never wrote ended in a KeyError traceback."""
    _images(tmp_path / "photos", 2)
    out, moved = tmp_path / f"preds{suffix}", tmp_path / f"moved{suffix}"
    args = [str(tmp_path / "photos"), "--top-k", "2"]
    assert main([str(tiny_onnx), *args, "--out", str(out)]) == 0
    moved.write_bytes(out.read_bytes())
    foreign = tmp_path / f"foreign{suffix}"
    foreign.write_text("a,b\n1,2\n" if suffix == ".csv" else '{"a": 1}\n')
    for table in (moved, foreign):
        before = table.read_bytes()
        capsys.readouterr()
        assert main([str(tiny_onnx), *args, "--out", str(table), "--resume"]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and "no readable record of the model and options that scored it" in err, err
        assert table.read_bytes() == before


def test_resume_after_the_model_file_changed_is_refused(tiny_onnx, tmp_path, capsys, monkeypatch):
    """A model re-exported in place gives other answers: a resume would mix two models' rows in one table."""
    pytest.importorskip("onnx")  # edits the file
    import shutil

    from .broken_models import with_metadata

    folder = tmp_path / "photos"
    _images(folder, 4)
    model = tmp_path / "model.onnx"
    shutil.copyfile(tiny_onnx, model)
    out = tmp_path / "preds.csv"
    args = [str(model), str(folder), "--out", str(out), "--batch-size", "2", "--part-size", "2", "--top-k", "2"]
    _killed_after(1, args, monkeypatch)
    with_metadata(tiny_onnx, model, class_names=json.dumps(CLASS_NAMES[::-1]))  # the same file name, other labels
    capsys.readouterr()
    assert main([*args, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "model" in err and str(model) in err and "without --resume" in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def test_parts_written_with_other_row_fields_are_refused_not_merged(tiny_onnx, tmp_path, capsys, monkeypatch):
    """Rows without --coverage gained unknown and ood_score: parts an earlier version wrote lack both columns, and
    a resume would have merged rows of two shapes into one table."""
    folder = tmp_path / "photos"
    _images(folder, 4)
    out = tmp_path / "preds.csv"
    args = [str(tiny_onnx), str(folder), "--out", str(out), "--batch-size", "2", "--part-size", "2"]
    _killed_after(1, args, monkeypatch)
    job = out.with_name(out.name + ".parts") / JOB_FILE
    earlier = {k: v for k, v in json.loads(job.read_text()).items() if k != "row fields"}  # as such a version wrote
    job.write_text(json.dumps(earlier))
    capsys.readouterr()
    assert main([*args, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "started with no row fields" in err and "without --resume" in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def _non_utf8_folder(tmp_path: Path) -> tuple[Path, str]:
    """Images in a folder, one under a name that is not UTF-8 (bytes b'bad\\xff.png', as Linux allows)."""
    folder = tmp_path / "photos"
    _images(folder, 3)
    bad = os.fsdecode(os.fsencode(folder) + b"/bad\xff.png")  # '...bad\udcff.png': Python's str for those bytes
    os.rename(folder / "0000_top_left.png", bad)
    return folder, bad


@pytest.mark.parametrize("suffix", OUT_SUFFIXES)
def test_a_file_name_that_is_not_utf8_is_written_faithfully_with_every_other_row(tiny_onnx, tmp_path, capsys, suffix):
    folder, bad = _non_utf8_folder(tmp_path)
    out = tmp_path / f"preds{suffix}"
    assert main([str(tiny_onnx), str(folder), "--out", str(out), "--part-size", "2"]) == 0, capsys.readouterr().err
    if suffix == ".csv":  # the name's own bytes: read back with surrogateescape, as Python reads file names
        with open(out, newline="", errors="surrogateescape") as f:
            paths = [r["path"] for r in csv.DictReader(f)]
        assert bad in paths and os.path.exists(bad)
    elif suffix == ".parquet":  # Parquet strings are UTF-8: the byte that is not is written as \xff
        paths = [r["path"] for r in _read(out)]
        assert bad.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace") in paths
    else:
        paths = [r["path"] for r in _read(out)]
        assert bad in paths
    assert len(paths) == 3
    # and the finished table resumed again, as a pipeline's retry does: the Parquet file's \xff did not match the
    # name, so a complete table was said to lack its row, exit 1, on every retry
    assert main([str(tiny_onnx), str(folder), "--out", str(out), "--resume"]) == 0
    err = capsys.readouterr().err
    assert "is complete" in err and "no row" not in err, err


def test_hidden_files_and_folders_are_skipped_and_a_dangling_link_is_reported(tiny_onnx, tmp_path, capsys):
    """As training scans a folder: `.ipynb_checkpoints/` and `.name.png` are not inputs, and a link whose target is
    gone is an unreadable image (reported, counted, exit 1), not silently dropped."""
    folder = tmp_path / "photos"
    _images(folder, 3)
    _images(folder / ".ipynb_checkpoints", 2)
    (folder / ".thumb.png").write_bytes((folder / "0000_top_left.png").read_bytes())
    (folder / "gone.png").symlink_to(tmp_path / "deleted.png")
    out = tmp_path / "preds.jsonl"
    assert main([str(tiny_onnx), str(folder), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"{folder / 'gone.png'}: " in err and "classified 3 images; 1 input(s) could not be read" in err, err
    assert [r["path"] for r in _read(out)] == [str(p) for p in sorted(folder.glob("0*.png"))]


@pytest.mark.timeout(60, method="thread")  # the defect was a hang: end the worker rather than the suite
def test_a_named_pipe_with_an_image_name_is_reported_not_waited_on(tiny_onnx, tmp_path, capsys):
    """A folder named as a path dropped the pipe without a word; named by a `file://` URI, the run waited for a
    writer for ever, and one Ctrl-C did not end it."""
    folder = tmp_path / "photos"
    _images(folder, 2)
    os.mkfifo(folder / "pipe.png")
    for given in (str(folder), f"file://{folder}/", f"file://{folder}/pipe.png"):
        out = tmp_path / f"preds-{len(given)}.jsonl"
        assert main([str(tiny_onnx), given, "--out", str(out)]) == 1
        err = capsys.readouterr().err
        assert "pipe.png is not a regular file (a named pipe, socket or device)" in err, err
    assert len(_read(out)) == 0 and len(_read(tmp_path / f"preds-{len(str(folder))}.jsonl")) == 2


def test_a_run_with_a_non_utf8_name_killed_and_resumed_keeps_every_row(tiny_onnx, tmp_path, capsys, monkeypatch):
    """The part manifests hold the name too: a resume must find it done, and a list file may name it."""
    folder, bad = _non_utf8_folder(tmp_path)
    listing = tmp_path / "inputs.txt"
    listing.write_bytes(os.fsencode(bad) + b"\n" + b"".join(os.fsencode(p) + b"\n" for p in sorted(folder.glob("0*"))))
    out = tmp_path / "preds.csv"
    args = [str(tiny_onnx), "--from-list", str(listing), "--out", str(out), "--batch-size", "1", "--part-size", "1"]
    _killed_after(1, args, monkeypatch)
    assert main([*args, "--resume"]) == 0, capsys.readouterr().err
    with open(out, newline="", errors="surrogateescape") as f:
        assert [r["path"] for r in csv.DictReader(f)] == [bad, *map(str, sorted(folder.glob("0*")))]


def test_a_resume_that_names_the_inputs_another_way_scores_each_image_once(tiny_onnx, tmp_path, capsys, monkeypatch):
    """`photos` and `./photos/` are the same images: the resume used to score them all again, under new paths."""
    _images(tmp_path / "photos", 6)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "preds.jsonl"
    options = ["--out", str(out), "--batch-size", "2", "--part-size", "2"]
    _killed_after(2, [str(tiny_onnx), "photos", *options], monkeypatch)
    assert main([str(tiny_onnx), "./photos/", *options, "--resume"]) == 0
    rows = _read(out)
    assert len(rows) == 6 and len({os.path.normpath(r["path"]) for r in rows}) == 6, [r["path"] for r in rows]


@pytest.mark.slow
def test_small_files_that_declare_huge_images_decode_within_a_bounded_memory(tiny_onnx, tmp_path):
    """A 90 kB PNG declares 40 MP of 16-bit pixels: each decode took about 600 MB, one per decode thread (2 GB with
    4 threads, and up to 256 are allowed), so a folder of them got a job killed for memory, and again on resume."""
    folder = tmp_path / "huge"
    folder.mkdir()
    Image.fromarray(np.zeros((6300, 6300), np.uint16)).save(folder / "0.png")  # 39.7 MP, under the 40 MP limit
    for i in (1, 2):
        (folder / f"{i}.png").write_bytes((folder / "0.png").read_bytes())
    measure = "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
    measure += "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"  # KiB, of vit-predict alone
    argv = [
        sys.executable,
        "-m",
        "serve.runtime.predict",
        str(tiny_onnx),
        str(folder),
        "--out",
        str(tmp_path / "o.csv"),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    peak = subprocess.run([sys.executable, "-c", measure, *argv, "--batch-size", "1", "--decode-threads", "3"],
        env=env, capture_output=True, text=True, check=True, timeout=120)  # fmt: skip
    assert int(peak.stdout) < 700 * 1024, f"peak RSS {int(peak.stdout) // 1024} MiB"
    assert len(_read(tmp_path / "o.csv")) == 3


def _with_file_size_limit(limit: int):
    """For a child process: files it writes may grow to `limit` bytes, then a write fails as on a full disk."""

    def limit_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails (EFBIG) instead of the process being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return limit_files


def test_a_merge_that_fails_for_space_leaves_no_temporary_file_and_resumes(tiny_onnx, tmp_path):
    """The merged file's temporary copy stayed beside the output after a full disk, holding the space the user had
    to free, until a resume; a part's did the same."""
    paths = _images(tmp_path / "photos", 8)
    out = tmp_path / "preds.jsonl"
    parts = out.with_name(out.name + ".parts")
    args = [str(tiny_onnx), *map(str, paths), "--out", str(out), "--batch-size", "2"]
    full = _predict(*args, "--part-size", "8", preexec_fn=_with_file_size_limit(1500))  # the one part does not fit
    _, err = full.communicate(timeout=60)
    assert full.returncode == 2 and not list(parts.glob("*.tmp")) and not list(parts.glob("part-*")), err
    assert f"vit-predict: {parts}{os.sep}part-" in err, err  # which disk is full: the message named no file
    full = _predict(*args, "--part-size", "2", "--resume", preexec_fn=_with_file_size_limit(1500))  # the merge fails
    _, err = full.communicate(timeout=60)
    assert full.returncode == 2 and "--resume" in err and f"vit-predict: {tmp_path}{os.sep}" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["photos", "preds.jsonl.parts"]
    assert not list(parts.glob("*.tmp")) and len(list(parts.glob("part-*.jsonl"))) == 4
    assert main([*args, "--resume"]) == 0 and len(_read(out)) == 8


def test_an_input_named_twice_is_scored_once_on_stdout_too(tiny_onnx, tmp_path, capsys, monkeypatch):
    """The guide says so of every run; on stdout `a.png a.png ./a.png` gave three rows."""
    paths = _images(tmp_path / "photos", 2)
    monkeypatch.chdir(tmp_path)
    assert main([str(tiny_onnx), "photos/0000_top_left.png", "./photos/0000_top_left.png", "photos"]) == 0
    rows = [json.loads(line)["path"] for line in capsys.readouterr().out.splitlines()]
    assert rows == ["photos/0000_top_left.png", str(Path("photos") / paths[1].name)], rows


def test_a_run_resumed_from_another_folder_scores_each_image_once(tiny_onnx, tmp_path, capsys, monkeypatch):
    """Started as `photos` and resumed by cron from elsewhere with the absolute path: the parts named the inputs as
    given, so 4 of 6 images were scored again, two rows each, exit 0."""
    _images(tmp_path / "photos", 6)
    (tmp_path / "cron").mkdir()
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "preds.jsonl"
    options = ["--out", str(out), "--batch-size", "2", "--part-size", "2"]
    _killed_after(2, [str(tiny_onnx), "photos", *options], monkeypatch)
    monkeypatch.chdir(tmp_path / "cron")
    assert main([str(tiny_onnx), str(tmp_path / "photos"), *options, "--resume"]) == 0
    rows = _read(out)
    assert len(rows) == 6 and len({os.path.basename(r["path"]) for r in rows}) == 6, [r["path"] for r in rows]


def test_an_input_that_could_not_be_read_is_tried_again_on_resume(tiny_onnx, tmp_path, capsys, monkeypatch):
    """A half-copied image failed, the copy finished, and every resume still left it out (its old reason printed
    again, exit 1): the only way to its row was to start over."""
    paths = _images(tmp_path / "photos", 4)
    late = tmp_path / "photos" / "0000_a_late.png"  # first in the folder: its failure is in the first part
    late.write_bytes(b"")
    out = tmp_path / "preds.jsonl"
    argv = [str(tiny_onnx), str(tmp_path / "photos"), "--out", str(out), "--batch-size", "1", "--part-size", "1"]
    _killed_after(2, argv, monkeypatch)
    late.write_bytes(paths[0].read_bytes())  # the copy finished
    assert main([*argv, "--resume"]) == 0
    assert sorted(r["path"] for r in _read(out)) == sorted(map(str, [late, *paths]))


def test_a_resume_of_a_finished_output_says_which_inputs_have_no_row_in_it(tiny_onnx, tmp_path, capsys):
    """A finished job whose images failed (exit 1), or that was given other images since, resumed with exit 0 and
    "nothing to resume": a retry loop or a pipeline that always adds --resume took the table for complete. File
    names with a line break or a carriage return are rows as any other (the CSV left a carriage return unquoted)."""
    folder = tmp_path / "photos"
    paths = _images(folder, 3)
    paths[1].rename(folder / "line\nbreak.png")
    paths[2].rename(folder / "carriage\rreturn.png")
    (folder / "broken.png").write_bytes(b"")
    out = tmp_path / "preds.csv"
    argv = [str(tiny_onnx), str(folder), "--out", str(out)]
    assert main(argv) == 1
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 1
    assert "1 of this run's inputs have no row in it" in capsys.readouterr().err
    _images(tmp_path / "more", 2)
    assert main([*argv[:2], str(tmp_path / "more"), *argv[2:], "--resume"]) == 1
    assert "3 of this run's inputs have no row in it" in capsys.readouterr().err
    assert main([str(tiny_onnx), str(tmp_path / "more"), *argv[2:], "--resume"]) == 1  # other images, fewer
    assert "2 of this run's inputs have no row in it" in capsys.readouterr().err
    (folder / "broken.png").unlink()
    assert main([*argv, "--resume"]) == 0
    assert sorted(r["path"] for r in _read(out)) == sorted(map(str, folder.iterdir()))


def test_a_part_cut_short_or_a_damaged_manifest_is_scored_again(tiny_onnx, tmp_path, capsys, monkeypatch):
    """A parts folder copied half-way (or damaged) was merged as it was: rows lost and a broken JSON line, exit 0;
    a manifest that was not JSON stopped the resume with a bare `Expecting value`."""
    _images(tmp_path / "photos", 8)
    out = tmp_path / "preds.jsonl"
    argv = [str(tiny_onnx), str(tmp_path / "photos"), "--out", str(out), "--batch-size", "2", "--part-size", "2"]
    _killed_after(3, argv, monkeypatch)
    parts = out.with_name(out.name + ".parts")
    first = parts / "part-00000.jsonl"
    first.write_bytes(first.read_bytes()[:50])  # cut off in its first row
    (parts / "part-00001.json").write_text("{")
    third = parts / "part-00002.jsonl"
    third.write_bytes(third.read_bytes().splitlines(keepends=True)[0])  # cut off between its rows
    assert main([*argv, "--resume"]) == 0
    rows = _read(out)  # every line JSON
    assert sorted(r["path"] for r in rows) == sorted(str(p) for p in (tmp_path / "photos").iterdir())


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--threads", "-7"], "--threads must be"),
        (["--threads", "100000"], "--threads must be"),
        (["--decode-threads", "-1"], "--decode-threads must be"),
        (["--decode-threads", "0"], "--decode-threads must be"),
        (["--format", "json"], "--format json is for standard output"),  # was ignored: x.csv written as CSV
    ],
)
def test_thread_counts_out_of_range_are_refused_before_anything_is_made(tiny_onnx, tmp_path, capsys, extra, says):
    """--threads 1000 took a minute for one image; --decode-threads -1 failed after making the parts folder, which
    then refused the corrected command."""
    folder = tmp_path / "photos"
    _images(folder, 1)
    with pytest.raises(SystemExit) as e:
        main([str(tiny_onnx), str(folder), "--out", str(tmp_path / "x.csv"), *extra])
    assert e.value.code == 2 and says in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["photos"]


def test_output_and_input_errors_of_the_system_are_one_line_with_exit_2(tiny_onnx, tmp_path, capsys):
    """A list that is a folder, an --out under a file: tracebacks and exit 1 (which means "some images
    unreadable") before; then each said that "the parts written so far are kept", though none was written."""
    folder = tmp_path / "photos"
    _images(folder, 1)
    (tmp_path / "file").write_text("")
    for extra in (
        ["--from-list", str(folder), "--out", str(tmp_path / "a.csv")],
        ["--out", str(tmp_path / "file/a.csv")],
    ):
        assert main([str(tiny_onnx), str(folder), *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("vit-predict: ") and len(err.splitlines()) == 1 and "kept" not in err, err


@pytest.mark.timeout(120, method="thread")
def test_a_list_that_never_ends_is_refused_in_one_line_once_past_its_cap(tiny_onnx, tmp_path, capsys, monkeypatch):
    """`--from-list /dev/zero` (or a pipe that never closes) was read whole into memory: killed by the kernel at
    24 GB, or a MemoryError traceback under a memory limit."""
    monkeypatch.setattr(input_lists, "MAX_LIST_BYTES", 1 << 20)  # a small cap: the refusal is tested, not 1 GiB read
    assert main([str(tiny_onnx), "--from-list", "/dev/zero", "--out", str(tmp_path / "a.csv")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vit-predict: --from-list /dev/zero is over") and len(err.splitlines()) == 1, err
    assert not (tmp_path / "a.csv").exists()


def test_a_folder_nested_deeper_than_pythons_recursion_limit_is_searched(tiny_onnx, tmp_path, capsys):
    """Python 3.11's os.walk recurses: 1,100 folders deep ended the run with a RecursionError."""
    folder = tmp_path / "photos"
    _images(folder, 1)
    chain = [folder]
    for _ in range(1100):  # one by one: pathlib's mkdir(parents=True) recurses too
        chain.append(chain[-1] / "d")
        chain[-1].mkdir()
    _images(chain[-1], 1)
    try:
        assert main([str(tiny_onnx), str(folder), "--out", str(tmp_path / "preds.jsonl")]) == 0
        assert len(_read(tmp_path / "preds.jsonl")) == 2
    finally:  # from the bottom up: shutil.rmtree (pytest's clean-up of old temporary folders) recurses as well
        for image in chain[-1].iterdir():
            image.unlink()
        for sub in reversed(chain[1:]):
            sub.rmdir()


def test_a_second_run_on_the_same_out_is_refused_and_ctrl_c_ends_the_first_in_one_line(tiny_onnx, tmp_path, capsys):
    """A retry started while the first run still goes used to delete the first's temporary files; Ctrl-C printed a
    traceback and no word of --resume."""
    paths = _images(tmp_path / "photos", 8)
    with held_image(b"not an image") as (held, release):  # reading it blocks the run after its first parts
        _a_second_run_refused_then_ctrl_c(tiny_onnx, tmp_path, paths, held, release, capsys)


def test_sigterm_ends_a_run_as_ctrl_c_does_with_its_resume_line(tiny_onnx, tmp_path):
    """`timeout`, systemd and a pod's stop send SIGTERM: the run ended with 143 and no word of its parts."""
    paths = _images(tmp_path / "photos", 4)
    out = tmp_path / "preds.jsonl"
    with held_image(paths[0].read_bytes()) as (held, release):
        proc = _predict(
            str(tiny_onnx), *map(str, paths), held, "--out", str(out), "--part-size", "4", "--batch-size", "4"
        )
        parts = out.with_name(out.name + ".parts")
        deadline = time.monotonic() + 60
        while not list(parts.glob("part-*.json")):  # blocked on the held input, its first part committed
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        release.set()  # the blocked read ends
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("vit-predict: terminated: the parts written so far are kept")


def _a_second_run_refused_then_ctrl_c(tiny_onnx, tmp_path: Path, paths: list[Path], held: str, release, capsys):
    out = tmp_path / "preds.jsonl"
    args = [str(tiny_onnx), *map(str, paths), held, "--out", str(out), "--batch-size", "4"]
    proc = _predict(*args, "--part-size", "4", "--decode-threads", "1")
    parts = out.with_name(out.name + ".parts")
    deadline = time.monotonic() + 60
    while len(list(parts.glob("part-*.json"))) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)

    for retry in (args, [*args, "--resume"]):  # without --resume it was told to add it: that would wait for nothing
        assert main(retry) == 2
        err = capsys.readouterr().err
        assert "another vit-predict is writing" in err and len(err.splitlines()) == 1, err

    proc.send_signal(signal.SIGINT)
    release.set()  # the blocked read ends
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("vit-predict: interrupted") and "--resume" in last, err
    assert main([*args, "--resume"]) == 1  # the lock went with the process; the held input is no image
    assert len(_read(out)) == 8


@pytest.mark.parametrize("suffix", [pytest.param(".parquet", marks=NEEDS_PYARROW), ".csv"])
def test_a_job_in_which_no_image_could_be_read_still_writes_its_columns(tiny_onnx, tmp_path, capsys, suffix):
    """The CSV was 0 bytes and the Parquet file had a `path` column alone: a reader of the columns failed."""
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "broken.png").write_bytes(b"not an image")
    out = tmp_path / f"preds{suffix}"
    assert main([str(tiny_onnx), str(folder), "--out", str(out), "--top-k", "2", "--coverage", "0.9"]) == 1
    columns = ["path", "label_1", "score_1", "label_2", "score_2", "prediction_set", "unknown", "ood_score"]
    if suffix == ".csv":
        assert out.read_text().splitlines() == [",".join(columns)]
    else:
        import pyarrow.parquet as pq

        table = pq.read_table(out)
        assert (
            table.num_rows == 0
            and table.column_names == columns
            and str(table.schema.field("score_1").type) == "double"
        )


def _fifo_reader_open(fifo: Path, proc: subprocess.Popen):
    """`fifo` opened for writing once `proc` opens it to read (an error, not a hang, if `proc` ends first)."""

    def reader() -> int | None:
        assert proc.poll() is None, proc.communicate()
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO while no process reads it
        except OSError:
            return None

    fd = wait_until(reader, 60, "the run opening its list")
    os.set_blocking(fd, True)
    return open(fd, "w")


@pytest.mark.slow
def test_a_model_replaced_while_the_run_lists_its_inputs_is_not_the_one_its_parts_record(tiny_onnx, tmp_path):
    """The job's record hashed the model file after the (slow) listing of the inputs, not the bytes the run had
    loaded: a model replaced meanwhile was recorded, and a --resume under it mixed the two models' rows."""
    (one,) = _images(tmp_path / "photos", 1)
    for i in range(1, 400):  # many cheap inputs, a part each: the run is stopped after its first parts
        os.link(one, one.with_name(f"{i:04d}.png"))
    model, listing = tmp_path / "model.onnx", tmp_path / "inputs.txt"
    model.write_bytes(tiny_onnx.read_bytes())
    os.mkfifo(listing)
    out = tmp_path / "preds.jsonl"
    args = [str(model), "--from-list", str(listing), "--out", str(out), "--part-size", "1", "--batch-size", "1"]
    proc = _predict(*args)
    inputs = "\n".join(str(p) for p in sorted(one.parent.iterdir())) + "\n"
    with _fifo_reader_open(listing, proc) as f:  # the run reads its list after it loaded the model
        model.write_bytes(tiny_onnx.read_bytes() + b"\xc0\x3e\x01")  # another file (an unknown protobuf field)
        f.write(inputs)
    parts = out.with_name(out.name + ".parts")
    deadline = time.monotonic() + 60
    while not list(parts.glob("part-*.json")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    resumed = _predict(*args, "--resume")
    with _fifo_reader_open(listing, resumed) as f:
        f.write(inputs)
    _, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 2 and "was started with another model file" in err, err


def test_a_from_list_that_is_a_folder_says_to_give_the_folder_as_an_input(tiny_onnx, tmp_path, capsys):
    """It said `in: Is a directory`, true but no help: --from-list takes a text file of paths."""
    folder = tmp_path / "in"
    _images(folder, 1)
    out = tmp_path / "x.csv"
    assert main([str(tiny_onnx), str(folder / "0000_top_left.png"), "--out", str(out), "--from-list", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"vit-predict: --from-list {folder} is a folder: it takes a text file of paths") and (
        "give the folder as an input" in err and len(err.splitlines()) == 1
    ), err
    assert not out.exists()


def test_each_unreadable_input_of_an_out_job_is_one_stderr_line_its_control_characters_escaped(
    tiny_onnx, tmp_path, capsys
):
    """A name holding a newline wrote a line of its own choosing on stderr (a forged summary line)."""
    folder = tmp_path / "photos"
    _images(folder, 1)
    forged = "vit-predict: classified 99 images; 0 input(s) could not be read"
    (folder / f"x\n{forged}\n.png").write_bytes(b"not an image")
    (folder / "café\r.png").write_bytes(b"not an image")
    assert main([str(tiny_onnx), str(folder), "--out", str(tmp_path / "p.jsonl")]) == 1
    err = capsys.readouterr().err.split("\n")[:-1]  # not splitlines: it would split at the \r too
    assert len(err) == 3 and forged not in err and not any("\r" in line for line in err), err
    assert any(line.startswith(f"{folder}/x\\x0a{forged}\\x0a.png: ") for line in err), err
    assert any(line.startswith(f"{folder}/café\\x0d.png: ") for line in err), err
