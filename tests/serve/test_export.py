"""vit-export: the exported file, its metadata, the explain branch, the parity gate, int8."""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from serve.export import parity
from serve.export.cli import main
from serve.runtime.classifier import OnnxClassifier
from tests.helpers import CLASS_NAMES


def test_exported_model_predicts_the_quadrant_of_its_validation_images(tiny_onnx, tiny_run):
    clf = OnnxClassifier(tiny_onnx)
    val = json.loads((tiny_run / "split.json").read_text())["val"]
    top = clf.predict([v["path"] for v in val], top_k=2)
    accuracy = np.mean([clf.labels.index(t[0][0]) == v["label"] for t, v in zip(top, val, strict=True)])
    assert accuracy >= 0.9


def test_metadata_round_trips_from_the_checkpoint_to_the_file(tiny_onnx, tiny_checkpoint):
    from train.checkpoint_format import load_network

    net, meta = load_network(tiny_checkpoint)
    clf = OnnxClassifier(tiny_onnx)
    assert clf.labels == CLASS_NAMES
    assert clf.preprocess == meta["preprocess"]
    assert clf.input_size == (32, 32) and clf.grid_size == (4, 4)
    assert (clf.num_prefix_tokens, clf.depth, clf.num_heads) == (1, 2, 2)
    assert clf.name == "tiny_test" and clf.version == meta["sha256"][:12]
    m = clf.metadata
    assert m["checkpoint_sha256"] == meta["sha256"] and m["quantization"] == "none"
    assert m["mean"] == list(meta["preprocess"].mean) and m["std"] == list(meta["preprocess"].std)
    assert {"vitscope", "torch", "onnx", "onnxruntime", "opset"} <= set(m["versions"])
    assert m["model_config"]["embed_dim"] == net.config["embed_dim"]
    # the fast branch, fused (serve.export.fusion); the last block computes the CLS token alone and stays plain
    assert m["contrib_ops"] == {"Attention": 1, "BiasGelu": 2}


def test_the_graph_takes_uint8_pixels_and_explain_is_optional(tiny_onnx):
    model = onnx.load(tiny_onnx)
    onnx.checker.check_model(model)
    session = ort.InferenceSession(str(tiny_onnx), providers=["CPUExecutionProvider"])
    pixels = session.get_inputs()[0]
    assert pixels.name == "pixels" and pixels.type == "tensor(uint8)" and pixels.shape[1:] == [32, 32, 3]
    x = np.random.default_rng(0).integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
    assert [o.name for o in session.get_outputs()] == ["logits", "attns", "grads", "features"]
    logits, attns, grads, features = session.run(None, {"pixels": x})  # no explain input: the fast branch
    assert logits.shape == (3, 4) and attns.size == 0 and grads.size == 0 and features.shape == (3, 32)
    logits2, attns2, grads2, features2 = session.run(None, {"pixels": x, "explain": np.array(True)})
    assert grads2.size == 0
    np.testing.assert_allclose(logits2, logits, atol=1e-5)
    np.testing.assert_allclose(features2, features, atol=1e-5)  # every branch gives the same pre-logits
    assert attns2.shape == (2, 3, 2, 17, 17)
    np.testing.assert_allclose(attns2.sum(-1), 1.0, atol=1e-5)  # softmax rows


def test_the_fast_and_explain_branches_share_one_copy_of_the_weights(tiny_checkpoint, tmp_path):
    from train.checkpoint_format import load_network

    net, _ = load_network(tiny_checkpoint)
    n_params = sum(p.numel() for p in net.parameters())
    out, file = tmp_path / "no_grad.onnx", tmp_path / "files" / "no_grad.onnx"
    file.parent.mkdir()
    file.touch()
    out.symlink_to(file)  # written through: the link stays, and names the model (it was replaced by the file)
    assert main([str(tiny_checkpoint), "-o", str(out), "--no-gradients"]) == 0
    assert out.is_symlink() and out.resolve() == file and file.stat().st_size > 0
    assert sorted(tmp_path.iterdir()) == [file.parent, out] and list(file.parent.iterdir()) == [file]
    stored = sum(int(np.prod(t.dims)) for t in onnx.load(out).graph.initializer)
    assert n_params <= stored < 1.3 * n_params
    clf = OnnxClassifier(out)
    assert not clf.supports_gradients
    with pytest.raises(ValueError, match="no gradient graph"):
        clf.gradient_rollout(np.zeros((1, 32, 32, 3), np.uint8))


def _logits(model: onnx.ModelProto, pixels: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["logits"], {"pixels": pixels})[0]


def _plain_and_fused(net, preprocess) -> tuple[onnx.ModelProto, onnx.ModelProto, dict[str, int]]:
    """The fast graph as exported and fused, from one export (`export_fast_graph` fuses the same way)."""
    from serve.export.fusion import fuse_for_cpu
    from serve.export.trace import export_fast_graph

    plain, _ = export_fast_graph(net, preprocess, fuse=False)
    return plain, *fuse_for_cpu(plain, net.blocks[0].attn.num_heads)


def test_the_fused_fast_graph_matches_the_graph_as_exported(tiny_checkpoint):
    from train.checkpoint_format import load_network

    net, meta = load_network(tiny_checkpoint)
    plain, fused, counts = _plain_and_fused(net, meta["preprocess"])
    assert counts == {"Attention": 1, "BiasGelu": 2}
    ops = collections.Counter(n.op_type for n in fused.graph.node)
    assert ops["Attention"] == 1 and ops["BiasGelu"] == 2 and ops["Erf"] == 0  # nothing of the fused blocks left
    assert ops["Softmax"] == 1  # the last block's one query row (the CLS token's), plain ops
    pixels = np.random.default_rng(0).integers(0, 256, (5, 32, 32, 3), dtype=np.uint8)
    np.testing.assert_allclose(_logits(fused, pixels), _logits(plain, pixels), atol=1e-5)


@pytest.mark.parametrize("attn_score", ["dot", "bilinear", "additive"])
def test_fusion_leaves_attention_it_does_not_recognise_as_it_is(attn_score):
    import torch

    from serve.runtime.images import Preprocess
    from tests.helpers import TINY_NET
    from vit import VisionTransformer

    torch.manual_seed(0)
    net = VisionTransformer(**TINY_NET, attn_score=attn_score).eval()
    plain, fused, counts = _plain_and_fused(net, Preprocess(img_size=(32, 32)))
    assert counts == {"Attention": 0, "BiasGelu": 2}
    assert "Softmax" in {n.op_type for n in fused.graph.node}
    pixels = np.random.default_rng(1).integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
    np.testing.assert_allclose(_logits(fused, pixels), _logits(plain, pixels), atol=1e-5)


def test_the_parity_gate_fails_loudly_and_writes_nothing(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(parity, "MAX_LOGIT_DELTA", 0.0)  # no real export is bit-exact: the gate must trip
    out = tmp_path / "model.onnx"
    assert main([str(tiny_checkpoint), "-o", str(out), "--no-gradients"]) == 1
    err = capsys.readouterr().err
    assert "parity gate FAILED" in err and "max |delta logit|" in err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_the_gate_catches_a_model_that_differs_from_the_checkpoint(tiny_onnx, tiny_checkpoint):
    import torch

    from train.checkpoint_format import load_network

    net, meta = load_network(tiny_checkpoint)
    with torch.no_grad():
        net.head.bias[0] += 1.0  # what the file holds is no longer what the checkpoint holds
    sample = parity.validation_sample(tiny_checkpoint, CLASS_NAMES, meta["preprocess"])
    with pytest.raises(parity.ParityError, match="delta logit") as err:
        parity.check(net, tiny_onnx, sample, meta["preprocess"])
    assert err.value.report["max_logit_delta"] == pytest.approx(1.0, abs=1e-3)


KILLED_MID_QUANTIZATION = """
import os, tempfile
from serve.export.quantize import scratch_folder
with scratch_folder() as folder:
    (folder / "fp32.onnx").write_bytes(bytes(1000))
    tempfile.mkdtemp(prefix="ort.quant.")  # as onnxruntime's static quantiser makes its own
    os.kill(os.getpid(), 9)
"""


@pytest.mark.slow
def test_int8_export_runs_reports_and_keeps_the_answers(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    """... and leaves no copy of the model in $TMPDIR, nor what an export killed while it quantised left there."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch)}
    killed = subprocess.run([sys.executable, "-c", KILLED_MID_QUANTIZATION], env=env, timeout=120)
    left = lambda: sorted(p.name for p in scratch.rglob("*") if p.is_dir() or p.suffix == ".onnx")
    assert killed.returncode == -9 and left()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    out = tmp_path / "int8.onnx"
    assert (
        main([str(tiny_checkpoint), "-o", str(out), "--quantize", "int8", "--img-size", "32", "32", "--no-gradients"])
        == 0
    )
    assert not left()  # (onnxruntime keeps a small session file of its own there)
    printed = capsys.readouterr().out
    assert "int8-dynamic" in printed and "chosen: int8-" in printed and "PASSED" in printed
    clf = OnnxClassifier(out)
    assert clf.metadata["quantization"].startswith("int8-") and clf.metadata["explain_precision"] == "fp32"
    branches = {a.name: a.g for a in onnx.load(out).graph.node[0].attribute}
    ops = {n.op_type for n in branches["else_branch"].node}  # the logits path
    assert ops & {"MatMulInteger", "DynamicQuantizeLinear", "QuantizeLinear", "QLinearMatMul"}
    if clf.metadata["quantization"] == "int8-dynamic":
        assert "QAttention" in ops  # the fused attention blocks, quantised too
    probs, maps = clf.rollout(np.zeros((1, 32, 32, 3), np.uint8))
    assert maps.shape == (1, 4, 4)


def test_fusion_refuses_an_attention_block_whose_output_is_not_tokens_by_width():
    import torch
    from onnx import numpy_helper

    from serve.export.fusion import fuse_for_cpu
    from serve.export.trace import export_fast_graph
    from serve.runtime.images import Preprocess
    from tests.helpers import TINY_NET
    from vit import VisionTransformer

    torch.manual_seed(0)
    net = VisionTransformer(**TINY_NET).eval()
    plain, _ = export_fast_graph(net, Preprocess(img_size=(32, 32)), fuse=False)
    _, counts = fuse_for_cpu(plain, net.blocks[0].attn.num_heads)
    assert counts["Attention"] == len(net.blocks) - 1  # all but the CLS-only last block
    # make every (B, N, D) merge of the heads a (B * N, D) one: no longer what `Attention` outputs
    merges = {n.input[1] for n in plain.graph.node if n.op_type == "Reshape"}
    for init in plain.graph.initializer:
        shape = numpy_helper.to_array(init)
        if init.name in merges and shape.ndim == 1 and len(shape) == 3 and shape[2] == net.embed_dim:
            init.CopyFrom(numpy_helper.from_array(np.array([-1, net.embed_dim], np.int64), init.name))
    _, counts = fuse_for_cpu(plain, net.blocks[0].attn.num_heads)
    assert counts["Attention"] == 0


def test_the_written_model_is_readable_by_everyone_the_umask_allows(tiny_onnx):
    umask = os.umask(0)
    os.umask(umask)
    assert tiny_onnx.stat().st_mode & 0o777 == 0o666 & ~umask


def test_export_says_what_to_give_it_when_the_input_is_not_a_checkpoint(tiny_onnx, tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    pickled = tmp_path / "object.ckpt"
    torch.save({"vitscope": Path("not plain data")}, pickled)  # an object weights_only refuses to unpickle
    for source, says in [
        (tiny_onnx, "is not a PyTorch checkpoint (it is an ONNX model"),
        (notes, "is not a PyTorch checkpoint; give the .ckpt file"),
        (pickled, "holds Python objects that a weights-only load refuses"),
    ]:
        assert main([str(source), "-o", str(tmp_path / "out.onnx")]) == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err
    assert not (tmp_path / "out.onnx").exists()


def test_a_run_folder_or_a_missing_best_checkpoint_names_the_checkpoints_there(tiny_run, tmp_path, capsys):
    """A run stopped before its first validation has last.ckpt alone: "checkpoint not found" for best.ckpt, and
    for the run folder itself (which is there), left a user guessing."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(tiny_run / "checkpoints" / "best.ckpt", run / "checkpoints" / "last.ckpt")
    last = run / "checkpoints" / "last.ckpt"
    for source, says in [
        (run, f"{run} is a folder: give a checkpoint file in it: {last}"),
        (run / "checkpoints", f"is a folder: give a checkpoint file in it: {last}"),
        (
            run / "checkpoints" / "best.ckpt",
            f"checkpoint not found: {run}/checkpoints/best.ckpt; that folder holds {last}",
        ),
        (tmp_path / "elsewhere" / "best.ckpt", "checkpoint not found: "),
    ]:
        assert main([str(source), "-o", str(tmp_path / "out.onnx")]) == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out.onnx").exists()


def test_metadata_the_runtime_would_refuse_is_refused_at_export_with_what_to_do(tiny_checkpoint, tmp_path, capsys):
    from serve.export import merge

    # the Mahalanobis Gaussian of a wide model with many classes can outgrow what the runtime reads (64 MiB)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(merge, "MAX_METADATA_VALUE_CHARS", 2_000)  # the tiny file's Gaussian is larger than that
        assert main([str(tiny_checkpoint), "-o", str(tmp_path / "out.onnx"), "--no-gradients"]) == 2
    err = capsys.readouterr().err
    assert "over the 2,000 the runtime reads; export with --ood-score energy" in err and "Traceback" not in err
    assert not (tmp_path / "out.onnx").exists()


def test_the_report_warns_when_the_checkpoint_is_no_better_than_chance():
    report = {
        "images": 100,
        "source": "val",
        "precision": "fp32",
        "top1_agreement": 1.0,
        "max_logit_delta": 1e-6,
        "explain_max_logit_delta": 1e-6,
        "min_rollout_corr": 1.0,
        "passed": True,
    }
    trained = parity.format_report({**report, "torch_accuracy": 0.99, "onnx_accuracy": 0.99, "chance_accuracy": 0.1})
    untrained = parity.format_report({**report, "torch_accuracy": 0.1, "onnx_accuracy": 0.1, "chance_accuracy": 0.1})
    assert "close to chance" not in trained
    assert "close to chance (10.0% for 10 classes)" in untrained and "is this the checkpoint you meant?" in untrained


def test_the_parity_gate_fails_a_model_whose_logits_are_not_finite(tiny_checkpoint, tmp_path, capsys):
    from .broken_models import nan_checkpoint

    checkpoint = nan_checkpoint(tiny_checkpoint, tmp_path / "run")
    out = tmp_path / "nan.onnx"
    assert main([str(checkpoint), "-o", str(out), "--no-gradients"]) == 1  # NaN fails every `>` threshold
    err = capsys.readouterr().err
    assert "parity gate FAILED" in err and "not finite" in err and "result: FAILED" in err
    assert not out.exists()


@pytest.mark.parametrize("where", ["under_a_file", "proc"])
def test_export_into_a_folder_it_cannot_write_is_a_one_line_error(tiny_checkpoint, tmp_path, capsys, where):
    # root ignores chmod, so the folder is made unwritable by what it is: a path through a file, or /proc
    (tmp_path / "a_file").write_text("not a folder")
    out = tmp_path / "a_file" / "model.onnx" if where == "under_a_file" else Path("/proc/vitscope/model.onnx")
    if where == "proc" and not Path("/proc/self").exists():
        pytest.skip("no /proc on this system")
    assert main([str(tiny_checkpoint), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vit-export: cannot write to ") and "choose an output folder" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()


def test_an_output_name_too_long_for_its_temporary_is_refused_before_the_export(tiny_checkpoint, tmp_path, capsys):
    """A legal 240-character name failed after the whole export: the temporary beside it adds about 40."""
    out = tmp_path / ("m" * 235 + ".onnx")
    assert main([str(tiny_checkpoint), "-o", str(out), "--no-calibration"]) == 2
    err = capsys.readouterr().err
    assert "the name is too long to be written through a temporary beside it" in err and "choose a shorter" in err
    assert len(err.strip().splitlines()) == 1 and "parity" not in err and not any(tmp_path.iterdir())


def test_a_model_file_with_class_names_that_are_not_a_json_list_is_refused(tiny_onnx, tmp_path):
    from .broken_models import with_metadata

    # four characters for four logits: read as a string, it would become four one-letter labels
    edited = with_metadata(tiny_onnx, tmp_path / "edited.onnx", class_names="abcd")
    with pytest.raises(ValueError, match=r"invalid class_names metadata 'abcd': expected a JSON list of distinct"):
        OnnxClassifier(edited)
