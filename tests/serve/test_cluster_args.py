"""`vit-predict --ray` refuses the arguments the local run refuses, with the same usage error, before Ray starts."""

from __future__ import annotations

import pytest

from serve.runtime.predict import main as predict_local

ray = pytest.importorskip("ray")
from serve.cluster.cli import main as vit_predict  # noqa: E402 (after the skip when ray is absent)

REFUSED = {
    "no batch": ["--batch-size", "0"],
    "negative batch": ["--batch-size", "-5"],
    "no classes": ["--top-k", "0"],
    "negative classes": ["--top-k", "-1"],
    "more threads than cores": ["--threads", "99999"],
}


def _usage_error(run, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as stopped:
        run(argv)
    assert stopped.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


@pytest.mark.parametrize("args", [*REFUSED.values(), []], ids=[*REFUSED, "no inputs"])
def test_ray_refuses_what_the_local_run_refuses_before_ray_starts(args, tmp_path, monkeypatch, capsys):
    inputs = [str(tmp_path)] if args else []  # [] and no options: no inputs given
    argv = [str(tmp_path / "model.onnx"), *inputs, *args]
    local = _usage_error(predict_local, [*argv, "--out", str(tmp_path / "local.parquet")], capsys)
    monkeypatch.setattr(ray, "init", lambda *a, **kw: pytest.fail("Ray started for arguments it cannot run"))
    assert _usage_error(vit_predict, [*argv, "--ray", "--out", str(tmp_path / "ray.parquet")], capsys) == local
    assert not list(tmp_path.glob("*.parquet*"))


@pytest.mark.parametrize("cpus", ["inf", "1e400", "nan", "0", "-1"])
def test_a_cpu_count_that_is_no_finite_positive_number_is_a_usage_error(cpus, tmp_path, monkeypatch, capsys):
    """inf gave an OverflowError traceback, and NaN passed the check to fail as "cannot convert float NaN to
    integer"."""
    monkeypatch.setattr(ray, "init", lambda *a, **kw: pytest.fail("Ray started for arguments it cannot run"))
    argv = [str(tmp_path / "model.onnx"), str(tmp_path), "--ray", "--out", str(tmp_path / "p.parquet")]
    said = _usage_error(vit_predict, [*argv, "--cpus-per-worker", cpus], capsys)
    assert said.endswith(f"--cpus-per-worker must be a finite number above 0, got {float(cpus):g}")


def test_an_existing_out_folder_is_refused_as_the_ray_run_says_not_as_a_local_table(tmp_path, monkeypatch, capsys):
    """With --ray, --out is a folder: one already there was refused with the local run's "is a folder: give the
    table's file name", which --ray users cannot follow."""
    monkeypatch.setattr(ray, "init", lambda *a, **kw: pytest.fail("Ray started for arguments it cannot run"))
    (tmp_path / "preds.parquet").mkdir()
    argv = [str(tmp_path / "model.onnx"), str(tmp_path), "--ray", "--out", str(tmp_path / "preds.parquet")]
    said = _usage_error(vit_predict, argv, capsys)
    assert said.endswith(
        f"{tmp_path / 'preds.parquet'} exists: remove it to score again (--resume is for runs on one machine)"
    )


def test_a_ray_address_nothing_answers_on_is_refused_at_once(tmp_path, monkeypatch, capsys):
    """Ray retried an address nothing listens on for minutes, printing its own timeouts, and vit-predict said
    nothing of its own."""
    monkeypatch.setattr(ray, "init", lambda *a, **kw: pytest.fail("Ray started for a cluster that is not there"))
    (tmp_path / "a.png").write_bytes(b"")
    argv = [str(tmp_path / "model.onnx"), str(tmp_path / "a.png"), "--ray", "--out", str(tmp_path / "p.parquet")]
    said = _usage_error(vit_predict, [*argv, "--ray-address", "127.0.0.1:1"], capsys)
    assert "cannot reach a Ray cluster at 127.0.0.1:1" in said and "ray start --head" in said
    assert not list(tmp_path.glob("*.parquet*"))
