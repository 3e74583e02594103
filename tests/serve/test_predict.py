"""vit-predict: folders with broken files in them, both output formats, exit codes."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from serve.runtime.predict import main
from tests.helpers import CLASS_NAMES, quadrant_images


def _folder(tmp_path, n: int = 6):
    images, labels = quadrant_images(n, seed=3)
    folder = tmp_path / "photos"
    for i, (img, label) in enumerate(zip(images, labels, strict=True)):
        sub = folder / ("nested" if i % 2 else "")
        sub.mkdir(parents=True, exist_ok=True)
        Image.fromarray(img).save(sub / f"{i}_{CLASS_NAMES[label]}.png")
    return folder


def test_a_folder_with_broken_files_is_classified_and_the_broken_ones_reported(tiny_onnx, tmp_path, capsys):
    folder = _folder(tmp_path)
    good = (folder / "0_top_left.png").read_bytes()
    (folder / "truncated.png").write_bytes(good[: len(good) // 2])
    (folder / "notes.jpg").write_text("not an image")
    (folder / "readme.txt").write_text("ignored: not an image suffix")

    assert main([str(tiny_onnx), str(folder), "--top-k", "2", "--batch-size", "4"]) == 1  # some were unreadable
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 6
    for row in rows:
        assert len(row["predictions"]) == 2
        true = row["path"].rsplit("/", 1)[1].split("_", 1)[1].removesuffix(".png")
        assert row["predictions"][0]["label"] == true
    broken = [line for line in err.splitlines() if line.startswith(str(folder))]
    assert sorted(line.split(":")[0].rsplit("/", 1)[1] for line in broken) == ["notes.jpg", "truncated.png"]
    assert "6 images; 2 input(s) could not be read" in err


def test_a_missing_path_among_good_ones_fails_the_run_after_classifying_the_rest(tiny_onnx, tmp_path, capsys):
    folder = _folder(tmp_path, n=2)
    assert main([str(tiny_onnx), str(folder), str(tmp_path / "typo.png")]) == 1
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 2  # the good images are written all the same
    assert "typo.png: no such file or folder" in err and "classified 2 images; 1 input(s)" in err


def test_csv_output_has_one_row_per_image_and_rank(tiny_onnx, tmp_path, capsys):
    folder = _folder(tmp_path, n=3)
    single = next(folder.glob("*.png"))
    assert main([str(tiny_onnx), str(folder), str(single), "--format", "csv", "--top-k", "3"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert len(rows) == 3 * 3  # the folder's three images, top 3 each: the one named again is scored once
    assert [r["rank"] for r in rows[:3]] == ["1", "2", "3"]
    assert list(rows[0]) == ["path", "rank", "label", "score", "in_set", "unknown", "ood_score"]
    assert all(r["in_set"] == "" and r["unknown"] in ("true", "false") and float(r["ood_score"]) for r in rows)
    probs = np.array([float(r["score"]) for r in rows[:3]])
    assert np.all(np.diff(probs) <= 0) and 0 < probs.sum() <= 1.0001


def test_csv_on_stdout_quotes_a_name_with_a_carriage_return(tiny_onnx, tmp_path, capsys):
    """Left unquoted, a reader took the carriage return for the end of the row: a path `x`, then a broken row."""
    folder = _folder(tmp_path, n=2)
    odd = (folder / "0_top_left.png").rename(folder / "x\ry.png")
    assert main([str(tiny_onnx), str(folder), "--format", "csv", "--top-k", "1"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out, newline="")))
    paths = [r["path"] for r in rows]
    assert str(odd) in paths and all(Path(p).is_file() for p in paths) and len(paths) == 2


def test_csv_on_stdout_writes_a_name_that_is_not_utf8_as_its_bytes(tiny_onnx, tmp_path, monkeypatch):
    """Under a UTF-8 locale (stdout's errors 'strict') the run stopped at the first such name with exit 2, and the
    files after it were never classified; --out and JSON kept them."""
    folder = _folder(tmp_path, n=3)
    odd = (folder / "0_top_left.png").rename(folder / os.fsdecode(b"0_\xff.png"))  # listed first
    stdout = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict")
    monkeypatch.setattr(sys, "stdout", stdout)
    assert main([str(tiny_onnx), str(folder), "--format", "csv", "--top-k", "1"]) == 0
    stdout.flush()
    rows = stdout.buffer.getvalue().splitlines()
    assert len(rows) == 4 and sum(row.startswith(os.fsencode(odd) + b",1,") for row in rows) == 1


def test_nothing_classifiable_exits_non_zero(tiny_onnx, tmp_path, capsys):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n broken")
    assert main([str(tiny_onnx), str(bad), str(tmp_path / "missing.jpg")]) == 1
    err = capsys.readouterr().err
    assert "bad.png" in err and "missing.jpg: no such file or folder" in err
    assert "classified 0 images; 2 input(s) could not be read" in err


def test_a_foreign_model_file_is_a_clear_error(tmp_path, capsys):
    fake = tmp_path / "model.onnx"
    fake.write_bytes(b"\x00\x01garbage")
    assert main([str(fake), str(tmp_path)]) == 2
    assert "vit-predict:" in capsys.readouterr().err


def test_a_checkpoint_given_for_the_model_says_to_export_it(tiny_checkpoint, tmp_path, capsys):
    """It said "truncated or not an ONNX file (field number 0)": true, and no help."""
    assert main([str(tiny_checkpoint), str(_folder(tmp_path, n=1))]) == 2
    err = capsys.readouterr().err
    assert "zip archive" in err and "checkpoint" in err and "vit-export" in err and "field number" not in err, err


def _strict_json(line: str) -> dict:
    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(line, parse_constant=refuse)


def test_json_output_is_valid_json_even_when_the_model_gives_nan(tiny_checkpoint, tmp_path, capsys):
    from serve.export.cli import export_onnx

    from .broken_models import nan_checkpoint

    model = tmp_path / "nan.onnx"
    export_onnx(nan_checkpoint(tiny_checkpoint, tmp_path / "run"), model, gradients=False, check_parity=False)
    folder = _folder(tmp_path, n=2)
    assert main([str(model), str(folder), "--top-k", "2"]) == 0
    rows = [_strict_json(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 2
    assert all(p["score"] is None and p["label"] in CLASS_NAMES for r in rows for p in r["predictions"])


def test_json_predictions_name_their_probability_score(tiny_onnx, tmp_path, capsys):
    folder = _folder(tmp_path, n=1)
    assert main([str(tiny_onnx), str(folder), "--top-k", "2"]) == 0
    (row,) = [_strict_json(line) for line in capsys.readouterr().out.splitlines()]
    assert [set(p) for p in row["predictions"]] == [{"label", "score"}] * 2
    assert 0.0 <= row["predictions"][1]["score"] <= row["predictions"][0]["score"] <= 1.0  # calibrated: can be 0.0


def test_with_coverage_each_line_gains_its_prediction_set_unknown_verdict_and_ood_score(tiny_onnx, tmp_path, capsys):
    folder = _folder(tmp_path, n=4)
    assert main([str(tiny_onnx), str(folder), "--coverage", "0.95", "--format", "json"]) == 0
    rows = [_strict_json(line) for line in capsys.readouterr().out.splitlines()]
    for row in rows:
        assert set(row) == {"path", "predictions", "prediction_set", "unknown", "ood_score"}
        assert set(row["prediction_set"]) <= set(CLASS_NAMES) and isinstance(row["unknown"], bool)
        assert isinstance(row["ood_score"], float)
    true = [r["path"].rsplit("/", 1)[1].split("_", 1)[1].removesuffix(".png") for r in rows]
    assert sum(t in r["prediction_set"] for t, r in zip(true, rows, strict=True)) >= 3
    assert main([str(tiny_onnx), str(folder), "--coverage", "0.95", "--format", "csv", "--top-k", "4"]) == 0
    csv_rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    by_path = {r["path"]: set(r["prediction_set"]) for r in rows}
    assert all((r["in_set"] == "true") == (r["label"] in by_path[r["path"]]) for r in csv_rows)


@pytest.mark.parametrize(("coverage", "says"), [("1.5", "between 0 and 1"), ("0.999", "finer than the 120")])
def test_a_bad_coverage_exits_2_with_a_clear_message(tiny_onnx, tmp_path, capsys, coverage, says):
    folder = _folder(tmp_path, n=1)
    assert main([str(tiny_onnx), str(folder), "--coverage", coverage]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("vit-predict: ") and says in err


def _predict_process(model: Path, folder: Path, stdout) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    cmd = [sys.executable, "-m", "serve.runtime.predict", str(model), str(folder)]
    return subprocess.run(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True, env=env, timeout=120)


def test_a_full_disk_is_a_one_line_error(tiny_onnx, tmp_path):
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    folder = _folder(tmp_path, n=2)
    with open("/dev/full", "w") as full:
        result = _predict_process(tiny_onnx, folder, full)
    assert result.returncode == 2
    assert result.stderr.strip() == "vit-predict: cannot write the results to stdout: No space left on device"


def test_a_reader_that_goes_away_ends_the_run_quietly(tiny_onnx, tmp_path):
    folder = _folder(tmp_path, n=2)
    read, write = os.pipe()
    os.close(read)  # as `vit-predict ... | head -c0` once head has exited
    try:
        result = _predict_process(tiny_onnx, folder, write)
    finally:
        os.close(write)
    assert result.returncode == 141 and result.stderr == ""


def test_a_model_with_a_character_string_for_class_names_is_a_clear_error(tiny_onnx, tmp_path, capsys):
    pytest.importorskip("onnx")  # edits the file
    from .broken_models import with_metadata

    edited = with_metadata(tiny_onnx, tmp_path / "edited.onnx", class_names="abcd")
    assert main([str(edited), str(_folder(tmp_path, n=1))]) == 2
    err = capsys.readouterr().err
    assert "invalid class_names metadata" in err and "export it again" in err


def test_hidden_files_and_folders_are_skipped_and_a_dangling_link_is_reported(tiny_onnx, tmp_path, capsys):
    """As training scans a folder: hidden files and folders are not inputs; a link to nothing is an unreadable image."""
    folder = _folder(tmp_path, n=2)
    hidden = folder / ".ipynb_checkpoints"
    hidden.mkdir()
    (hidden / "0_top_left-checkpoint.png").write_bytes((folder / "0_top_left.png").read_bytes())
    (folder / ".thumb.png").write_bytes((folder / "0_top_left.png").read_bytes())
    (folder / "gone.png").symlink_to(tmp_path / "deleted.png")
    assert main([str(tiny_onnx), str(folder)]) == 1
    out, err = capsys.readouterr()
    assert sorted(json.loads(line)["path"] for line in out.splitlines()) == sorted(
        str(p) for p in folder.rglob("[0-9]*.png") if ".ipynb_checkpoints" not in p.parts
    )
    assert f"{folder / 'gone.png'}: " in err and "classified 2 images; 1 input(s) could not be read" in err, err


def test_vit_predict_runs_where_the_os_has_no_sched_getaffinity(tiny_onnx, tmp_path, capsys, monkeypatch):
    """macOS and Windows have none: the --threads check failed every run there with an AttributeError."""
    folder = _folder(tmp_path, n=1)
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    assert main([str(tiny_onnx), str(folder)]) == 0 and len(capsys.readouterr().out.splitlines()) == 1


def test_ray_without_ray_installed_says_what_to_install_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """Only `import ray` inside the job failed, after the model loaded: a ModuleNotFoundError traceback, exit 1.
    (Run here with Ray hidden; the [serve]-only venv, which has no Ray, runs it as it is.)"""
    from serve.cluster.cli import main as vit_predict

    monkeypatch.setitem(sys.modules, "ray", None)  # as absent as an uninstalled package: `import ray` fails
    argv = [str(tmp_path / "no-model.onnx"), str(tmp_path), "--ray", "--out", str(tmp_path / "p.parquet")]
    assert vit_predict(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("vit-predict: --ray needs Ray Data: pip install 'vitscope[ray]'") and "Traceback" not in err


def _usage_error(argv: list[str], capsys) -> list[str]:
    """The stderr lines of a run refused at argument checking (exit 2, before the model loads)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.splitlines()


def test_an_out_name_too_long_for_the_file_system_is_one_line_not_a_traceback(tiny_onnx, tmp_path, capsys):
    """`--out` of 300 characters ended in an OSError traceback (ENAMETOOLONG), where an input's or the model's said
    why in one line."""
    folder = _folder(tmp_path, n=1)
    out = tmp_path / f"{'a' * 300}.csv"
    assert _usage_error([str(tiny_onnx), str(folder), "--out", str(out)], capsys) == [
        f"vit-predict: --out {out}: File name too long; give another --out"
    ]


def test_an_out_that_is_a_link_to_nothing_is_refused_and_a_link_to_a_file_is_left_as_it_was(
    tiny_onnx, tmp_path, capsys
):
    """The job replaced a dangling link with its table (exit 0): nothing was written where the link pointed, and
    the link was gone."""
    folder = _folder(tmp_path, n=1)
    link = tmp_path / "dl.csv"
    link.symlink_to("/nonexistent/dir/p.csv")
    said = _usage_error([str(tiny_onnx), str(folder), "--out", str(link)], capsys)[-1]
    assert f"--out {link} is a symbolic link to /nonexistent/dir/p.csv, which does not exist" in said, said
    assert os.readlink(link) == "/nonexistent/dir/p.csv"  # the link kept, and nothing made beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dl.csv", "photos"]
    # a link to a file that exists is an output that exists, as before: refused without --resume, the file untouched
    (tmp_path / "target.csv").write_text("kept\n")
    (tmp_path / "good.csv").symlink_to("target.csv")
    assert main([str(tiny_onnx), str(folder), "--out", str(tmp_path / "good.csv")]) == 2
    assert "exists: add --resume" in capsys.readouterr().err and (tmp_path / "target.csv").read_text() == "kept\n"


def test_a_batch_size_past_its_bound_is_refused_at_argument_checking(tiny_onnx, tmp_path, capsys):
    """--batch-size 1000000000 was taken: every input decoded into one batch, memory growing with the inputs."""
    folder = _folder(tmp_path, n=1)
    for out in ([], ["--out", str(tmp_path / "p.csv")]):
        said = _usage_error([str(tiny_onnx), str(folder), "--batch-size", "1000000000", *out], capsys)[-1]
        assert said.endswith(" must be 1 to 1024, got 1000000000") and "--batch-size" in said, said
    assert main([str(tiny_onnx), str(folder), "--batch-size", "1024"]) == 0


def test_a_model_path_that_is_a_link_loop_says_so(tiny_onnx, tmp_path, capsys):
    """It said `model file not found`, which sent the user looking for a file that is there by name."""
    folder = _folder(tmp_path, n=1)
    loop = tmp_path / "loop1"
    loop.symlink_to("loop1")
    assert main([str(loop), str(folder)]) == 2
    said = f"vit-predict: {loop} is a symbolic link that loops (it leads back to itself): fix or remove the link"
    assert capsys.readouterr().err == said + "\n"


FORGED = "vit-predict: classified 99 images; 0 input(s) could not be read"


def test_each_unreadable_file_is_one_stderr_line_its_control_characters_escaped(tiny_onnx, tmp_path, capsys):
    """A name holding a newline wrote a line of its own choosing (a forged summary), and `\\r` overwrote a terminal's
    line; a printable name, accents and all, is written as it is."""
    folder = _folder(tmp_path, n=1)
    (folder / f"x\n{FORGED}\n.png").write_bytes(b"not an image")
    (folder / "over\rwrite.png").write_bytes(b"not an image")
    (folder / "café ünï.png").write_bytes(b"not an image")
    (folder / "a\\x0ab.png").write_bytes(b"not an image")  # a backslash in the name: not to pass for an escape
    assert main([str(tiny_onnx), str(folder)]) == 1
    err = capsys.readouterr().err.split("\n")[:-1]  # not splitlines: it would split at the \r too
    assert len(err) == 5 and FORGED not in err and not any("\r" in line for line in err), err
    assert any(line.startswith(f"{folder}/a\\x5cx0ab.png: ") for line in err), err
    assert any(line.startswith(f"{folder}/x\\x0a{FORGED}\\x0a.png: ") for line in err), err
    assert any(line.startswith(f"{folder}/over\\x0dwrite.png: ") for line in err), err
    assert any(line.startswith(f"{folder}/café ünï.png: ") for line in err), err
