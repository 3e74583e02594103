"""Export targets: the portable file in other runtimes (onnx.reference, OpenVINO), opsets, IR versions."""

from __future__ import annotations

import collections
import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from serve.export.cli import export_onnx, main
from serve.export.targets import OLDEST_ONNXRUNTIME, OPSETS
from serve.export.trace import DEFAULT_OPSET
from serve.runtime.classifier import OnnxClassifier
from tests.helpers import quadrant_images
from tests.venvs import make_venv

LOGIT_TOLERANCE = 1e-4
INT8_LOGIT_TOLERANCE, INT8_MAP_TOLERANCE = 2.0, 0.1  # an int8 file across runtimes (see its test)
MAP_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def portable_onnx(tiny_checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("portable") / "tiny-portable.onnx"
    export_onnx(tiny_checkpoint, out, target="portable")
    return out


@pytest.fixture(scope="module")
def int8_files(tiny_checkpoint, tmp_path_factory) -> dict[str, Path]:
    """Both targets in int8 (the onnxruntime one without gradients, to keep it quick), with their Triton models."""
    root = tmp_path_factory.mktemp("int8")
    files = {}
    for target in ("onnxruntime", "portable"):
        out = root / f"{target}-int8.onnx"
        args = ["--target", target, "--quantize", "int8", "--no-gradients", "--triton-repo", str(root / "triton")]
        assert main([str(tiny_checkpoint), "-o", str(out), *args]) == 0
        files[f"{target}-int8"] = out
        files[f"{target}-int8-triton"] = root / "triton" / out.stem / "1" / "model.onnx"
    return files


@pytest.fixture(scope="module")
def exported(tiny_checkpoint, tmp_path_factory) -> Callable[[str, int], Path]:
    """`exported(target, opset)`: the tiny checkpoint through `vit-export --target --opset`, once per module (an
    export is most of these tests' time)."""
    folder, files = tmp_path_factory.mktemp("opsets"), {}

    def export(target: str, opset: int) -> Path:
        if (target, opset) not in files:
            out = folder / f"{target}-{opset}.onnx"
            assert main([str(tiny_checkpoint), "-o", str(out), "--target", target, "--opset", str(opset)]) == 0
            files[target, opset] = out
        return files[target, opset]

    return export


@pytest.fixture(scope="module")
def pixels() -> np.ndarray:
    images, _ = quadrant_images(6, seed=5)
    return images  # (6, 32, 32, 3) uint8


def _ops(model: onnx.ModelProto) -> collections.Counter:
    return collections.Counter((n.domain, n.op_type) for n in model.graph.node)


def test_the_portable_file_is_standard_onnx_in_one_plain_graph(portable_onnx):
    model = onnx.load(portable_onnx)
    onnx.checker.check_model(model, full_check=True)
    assert [o.domain for o in model.opset_import] == [""] and not model.functions
    assert {domain for domain, _ in _ops(model)} == {""}
    assert not {"If", "Loop", "Scan"} & {op for _, op in _ops(model)}
    inits = {i.name for i in model.graph.initializer}
    assert [i.name for i in model.graph.input if i.name not in inits] == ["pixels"]
    assert not inits & {"explain", "gradients", "target"}  # no optional inputs for a runtime to freeze
    assert [o.name for o in model.graph.output] == ["logits", "attns", "features"]


def _reference_maps(path: Path, pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """onnxruntime running the onnxruntime target: (logits (B, K), rollout maps (B, Gh, Gw))."""
    clf = OnnxClassifier(path)
    (logits,) = clf.session.run(["logits"], {"pixels": pixels})
    _, maps = clf.rollout(pixels)
    return logits, maps


def _maps_from(attns: np.ndarray, path: Path) -> np.ndarray:
    return OnnxClassifier(path).rollout_from_attns(attns)


def test_the_portable_file_runs_in_the_onnx_reference_evaluator(portable_onnx, tiny_onnx, pixels):
    from onnx.reference import ReferenceEvaluator

    logits, attns = ReferenceEvaluator(onnx.load(portable_onnx)).run(["logits", "attns"], {"pixels": pixels})
    expected_logits, expected_maps = _reference_maps(tiny_onnx, pixels)
    np.testing.assert_allclose(logits, expected_logits, atol=LOGIT_TOLERANCE)
    assert attns.shape == (2, 6, 2, 17, 17)
    np.testing.assert_allclose(_maps_from(attns, portable_onnx), expected_maps, atol=MAP_TOLERANCE)


def _openvino_run(path: Path, pixels: np.ndarray) -> dict[str, np.ndarray]:
    ov = pytest.importorskip("openvino", reason="OpenVINO is in the dev extra: pip install -e '.[dev]'")
    core = ov.Core()
    # fp32 answers: on CPUs with bf16 units OpenVINO computes in bf16 unless asked not to
    compiled = core.compile_model(core.read_model(str(path)), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    result = compiled({"pixels": pixels})
    return {out.get_any_name(): result[out] for out in compiled.outputs}


def test_the_portable_file_runs_in_openvino(portable_onnx, tiny_onnx, pixels):
    out = _openvino_run(portable_onnx, pixels)
    expected_logits, expected_maps = _reference_maps(tiny_onnx, pixels)
    np.testing.assert_allclose(out["logits"], expected_logits, atol=LOGIT_TOLERANCE)
    np.testing.assert_allclose(_maps_from(out["attns"], portable_onnx), expected_maps, atol=MAP_TOLERANCE)
    one = _openvino_run(portable_onnx, pixels[:1])  # the batch axis stays dynamic in OpenVINO
    np.testing.assert_allclose(one["logits"], expected_logits[:1], atol=LOGIT_TOLERANCE)


def test_the_classifier_reads_logits_and_rollout_from_both_targets(portable_onnx, tiny_onnx, pixels):
    portable, fused = OnnxClassifier(portable_onnx), OnnxClassifier(tiny_onnx)
    assert portable.metadata["target"] == "portable" and fused.metadata["target"] == "onnxruntime"
    np.testing.assert_allclose(portable.predict_pixels(pixels), fused.predict_pixels(pixels), atol=1e-5)
    (p_probs, p_maps), (f_probs, f_maps) = portable.rollout(pixels), fused.rollout(pixels)
    np.testing.assert_allclose(p_probs, f_probs, atol=1e-5)
    np.testing.assert_allclose(p_maps, f_maps, atol=MAP_TOLERANCE)
    assert p_maps.shape == (6, 4, 4)
    assert not portable.supports_gradients and portable.metadata["contrib_ops"] == {}
    with pytest.raises(ValueError, match="no gradient graph"):
        portable.gradient_rollout(pixels)


@pytest.mark.slow
def test_the_portable_int8_file_uses_standard_quantised_ops_and_runs_everywhere(int8_files, pixels):
    from onnx.reference import ReferenceEvaluator

    out = int8_files["portable-int8"]
    model = onnx.load(out)
    ops = {op for _, op in _ops(model)}
    assert {domain for domain, _ in _ops(model)} == {""} and [o.domain for o in model.opset_import] == [""]
    assert ops & {"MatMulInteger", "QuantizeLinear"}
    clf = OnnxClassifier(out)
    assert clf.metadata["quantization"].startswith("int8-") and clf.metadata["explain_precision"] == "int8"
    logits = clf.session.run(["logits"], {"pixels": pixels})[0]
    ref_logits, ref_attns = ReferenceEvaluator(model).run(["logits", "attns"], {"pixels": pixels})
    ov = _openvino_run(out, pixels)
    _, maps = clf.rollout(pixels)
    # Runtimes round int8 differently (onnxruntime's MatMulInteger path against onnx's reference evaluator:
    # logits apart by up to 1.5 on one image of this model), so each is held to the same answers and to int8's error,
    # not to the others' last digits.
    for name, other_logits, other_attns in (
        ("reference", ref_logits, ref_attns),
        ("openvino", ov["logits"], ov["attns"]),
    ):
        assert (other_logits.argmax(-1) == logits.argmax(-1)).all(), name
        np.testing.assert_allclose(other_logits, logits, atol=INT8_LOGIT_TOLERANCE, err_msg=name)
        np.testing.assert_allclose(_maps_from(other_attns, out), maps, atol=INT8_MAP_TOLERANCE, err_msg=name)
    triton = onnx.load(int8_files["portable-int8-triton"])
    assert {domain for domain, _ in _ops(triton)} == {""}
    assert [o.name for o in triton.graph.output] == ["logits", "features", "probs"]
    assert {p.key: p.value for p in triton.metadata_props}["quantization"].startswith("int8-")


@pytest.mark.parametrize("opset", [5, -1, 16, 22])
def test_an_opset_outside_the_supported_range_is_refused_in_one_line(tiny_checkpoint, tmp_path, capsys, opset):
    out = tmp_path / "model.onnx"
    assert main([str(tiny_checkpoint), "-o", str(out), "--opset", str(opset)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"vit-export: --opset {opset} is not supported: choose {OPSETS[0]} to {OPSETS[-1]}")
    assert len(err.strip().splitlines()) == 1 and not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("target, opset, ir_version", [("onnxruntime", 17, 8), ("portable", 21, 10)])
def test_the_file_declares_the_opset_asked_for_and_the_oldest_ir_version_for_it(exported, target, opset, ir_version):
    out = exported(target, opset)
    model = onnx.load(out)
    assert {o.domain: o.version for o in model.opset_import}[""] == opset
    assert model.ir_version == ir_version
    clf = OnnxClassifier(out)
    assert clf.metadata["versions"]["opset"] == str(opset)
    assert clf.metadata["requires_onnxruntime"] == f">={OLDEST_ONNXRUNTIME[opset]}"
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert session.run(["logits"], {"pixels": np.zeros((1, 32, 32, 3), np.uint8)})[0].shape == (1, 4)


OLD_RUNTIME_SCRIPT = """
import json, sys
import numpy as np
import onnxruntime as ort
pixels = np.load(sys.argv[1])
out = {}
for name, path in json.loads(sys.argv[2]).items():
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    inputs = {i.name for i in [*session.get_inputs(), *session.get_overridable_initializers()]}
    out[name] = session.run(["logits"], {"pixels": pixels})[0]
    if "explain" in inputs:
        out[name + ":attns"] = session.run(["attns"], {"pixels": pixels, "explain": np.array(True)})[0]
    if "target" in inputs:
        feeds = {"pixels": pixels, "explain": np.array(True), "gradients": np.array(True)}
        out[name + ":grads"] = session.run(["grads"], {**feeds, "target": np.zeros(len(pixels), np.int64)})[0]
    elif "attns" in [o.name for o in session.get_outputs()]:
        out[name + ":attns"] = session.run(["attns"], {"pixels": pixels})[0]
np.savez(sys.argv[3], **out)
print(ort.__version__)
"""


def _old_onnxruntime_venv(folder: Path, version: str) -> Path:
    """A throwaway venv with onnxruntime==version (numpy 1.x: the old wheels are built against it)."""
    return make_venv(folder, f"onnxruntime=={version}", "numpy<2")


def _run_in_old_onnxruntime(python: Path, files: dict[str, Path], pixels: np.ndarray, tmp_path: Path):
    """Every file through `OLD_RUNTIME_SCRIPT` in the old venv: its version and the outputs, by name."""
    np.save(tmp_path / "pixels.npy", pixels)
    cmd = [str(python), "-c", OLD_RUNTIME_SCRIPT, str(tmp_path / "pixels.npy")]
    run = subprocess.run(
        [*cmd, json.dumps({k: str(v) for k, v in files.items()}), str(tmp_path / "old.npz")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.strip(), np.load(tmp_path / "old.npz")


@pytest.mark.slow
def test_every_target_runs_in_the_oldest_onnxruntime_it_declares(
    tiny_onnx, portable_onnx, int8_files, pixels, tmp_path
):
    version = OLDEST_ONNXRUNTIME[DEFAULT_OPSET]
    python = _old_onnxruntime_venv(tmp_path / "venv", f"{version}.0")
    files = {"onnxruntime": tiny_onnx, "portable": portable_onnx, **int8_files}
    ran, old = _run_in_old_onnxruntime(python, files, pixels, tmp_path)
    assert ran == f"{version}.0"
    for name, path in files.items():
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        np.testing.assert_allclose(old[name], session.run(["logits"], {"pixels": pixels})[0], atol=1e-3, err_msg=name)
    assert old["onnxruntime:attns"].shape == old["portable:attns"].shape == (2, 6, 2, 17, 17)
    np.testing.assert_allclose(old["onnxruntime:attns"], old["portable:attns"], atol=1e-5)
    assert old["onnxruntime:grads"].shape == (2, 6, 2, 17, 17)


@pytest.mark.slow
def test_the_newest_opset_runs_in_the_oldest_onnxruntime_it_declares(exported, pixels, tmp_path):
    opset = OPSETS[-1]
    files = {target: exported(target, opset) for target in ("onnxruntime", "portable")}
    version = f"{OLDEST_ONNXRUNTIME[opset]}.0"
    ran, old = _run_in_old_onnxruntime(_old_onnxruntime_venv(tmp_path / "venv", version), files, pixels, tmp_path)
    assert ran == version
    np.testing.assert_allclose(old["onnxruntime"], old["portable"], atol=1e-5)
    np.testing.assert_allclose(old["onnxruntime:attns"], old["portable:attns"], atol=1e-5)
    assert old["onnxruntime:grads"].shape == (2, 6, 2, 17, 17)


def test_a_reduction_converted_down_to_opset_17_loads_and_keeps_its_values():
    # onnx's 18 -> 17 converter moves ReduceMean's axes back into an attribute but left the opset-18
    # `noop_with_empty_axes` beside it, and the checker refused the file (avg-pooled models at --opset 17)
    from onnx import TensorProto, helper

    from serve.export.targets import pin_versions

    axes = helper.make_node("Constant", [], ["axes"], value=helper.make_tensor("a", TensorProto.INT64, [1], [1]))
    mean = helper.make_node("ReduceMean", ["x", "axes"], ["y"], keepdims=0, noop_with_empty_axes=0)
    graph = helper.make_graph(
        [axes, mean],
        "pooled",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
    )
    model = pin_versions(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), 17)
    onnx.checker.check_model(model, full_check=True)
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {"x": x})[0], x.mean(axis=1))
