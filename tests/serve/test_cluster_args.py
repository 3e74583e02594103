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
