"""The whole job through the console scripts, as a user runs it: sample folder -> vit-train ->
vit-export (with its parity gate) -> vit-predict. Each stage reads only what the one before wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([str(BIN / args[0]), *args[1:]], cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.slow
def test_folder_to_onnx_to_predictions(tmp_path):
    repo = Path(__file__).resolve().parents[1]
    digits, run_dir, onnx_path = tmp_path / "digits", tmp_path / "run", tmp_path / "digits.onnx"
    run("vit-sample-data", "--out", str(digits), cwd=tmp_path)
    assert (digits / ".complete").is_file() and sorted(p.name for p in digits.iterdir() if p.is_dir()) == list(
        "0123456789"
    )

    run(
        "vit-train", "fit", "--config", str(repo / "configs/sample.yaml"),
        "--data.root", str(digits), "--trainer.default_root_dir", str(run_dir),
        "--trainer.max_epochs", "4", "--trainer.enable_progress_bar", "false",
        "--model.warmup_epochs", "0.5", "--model.ema_decay", "null",  # a short run: no long warm-up, no EMA lag
        cwd=tmp_path,
    )  # fmt: skip
    best = run_dir / "checkpoints" / "best.ckpt"
    assert best.is_file() and (run_dir / "checkpoints" / "last.ckpt").is_file()
    split = json.loads((run_dir / "split.json").read_text())

    # without the gradient graph: half of the export's time, and tests/serve checks it (test_runtime_parity)
    export = run("vit-export", str(best), "-o", str(onnx_path), "--no-gradients", cwd=tmp_path)
    assert onnx_path.is_file()
    assert "parity" in (export.stdout + export.stderr).lower()

    val = split["val"]
    listing = tmp_path / "val_files"
    listing.mkdir()
    for i, item in enumerate(val):  # a flat folder of validation images, plus one broken file
        (listing / f"{i:04d}_{item['label']}.png").symlink_to(item["path"])
    (listing / "broken.png").write_bytes(b"not an image at all")
    out = subprocess.run(
        [str(BIN / "vit-predict"), str(onnx_path), str(listing), "--format", "json", "--top-k", "3"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1, out.stderr[-3000:]  # one input could not be read; the rest are classified
    assert "broken.png" in out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    assert len(rows) == len(val)
    classes = split["classes"]
    correct = 0
    for row in rows:
        label = int(Path(row["path"]).stem.split("_")[1])
        top = row["predictions"][0]["label"]
        correct += top == classes[label]
    accuracy = correct / len(rows)
    assert accuracy > 0.2, f"accuracy {accuracy:.2f} after 4 epochs (chance is 0.1): training is broken"
    # the ONNX model through the serving loader scores exactly what training's validation reported
    best_val_acc = json.loads((run_dir / "summary.json").read_text())["best_val_acc"]
    assert accuracy == pytest.approx(best_val_acc, abs=1.5 / len(rows))


@pytest.mark.parametrize("script", ["vit-sample-data", "vit-train", "vit-export", "vit-predict", "vit-serve"])
def test_every_console_script_explains_itself(script, capsys):
    # the installed entry point, called in this process: the test above runs four of them as commands already,
    # and a process each only for --help cost about 30 s of the suite (importing torch and Lightning each time)
    (entry,) = entry_points(group="console_scripts", name=script)
    with pytest.raises(SystemExit) as exit_info:
        entry.load()(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and "usage:" in out.lower()
    if script == "vit-serve":  # every server setting is an option, with its documentation
        assert "--preferred-batch-size" in out and "3% of the best" in out
