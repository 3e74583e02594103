"""vit-export --triton-repo: a repository Triton's own config parser reads, a model that runs as configured."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from PIL import Image

from serve.export import files
from serve.export.cli import main
from serve.runtime.classifier import OnnxClassifier
from serve.server.repository.layout import parse_config, scan
from tests.helpers import CLASS_NAMES, REPO, quadrant_images, wait_until

NUMPY_DTYPES = {"TYPE_UINT8": np.uint8, "TYPE_FP32": np.float32}


@pytest.fixture(scope="module")
def repo(tiny_checkpoint, tmp_path_factory) -> tuple[Path, Path]:
    """(the repository, the main file exported beside it) for the default onnxruntime target."""
    root = tmp_path_factory.mktemp("triton")
    out = root / "tiny.onnx"
    args = ["--triton-repo", str(root / "models"), "--triton-name", "tiny vit", "--no-gradients"]
    assert main([str(tiny_checkpoint), "-o", str(out), *args]) == 0
    return root / "models", out


def _pb2():
    return pytest.importorskip(
        "tritonclient.grpc.model_config_pb2", reason="tritonclient is in the dev extra: pip install -e '.[dev]'"
    )


def _config(folder: Path):
    from google.protobuf import text_format

    return text_format.Parse((folder / "config.pbtxt").read_text(), _pb2().ModelConfig())


def test_the_repository_has_the_layout_triton_expects(repo):
    models, _ = repo
    assert sorted(p.name for p in models.iterdir()) == ["tiny_vit"]  # a name Triton accepts as a folder
    folder = models / "tiny_vit"
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) == [
        "1",
        "1/model.onnx",
        "config.pbtxt",
        "labels.txt",
    ]
    assert (folder / "labels.txt").read_text().splitlines() == CLASS_NAMES


def test_the_config_parses_as_tritons_model_config_and_matches_the_graph(repo):
    folder = repo[0] / "tiny_vit"
    config = _config(folder)
    assert config.name == "tiny_vit" and config.platform == "onnxruntime_onnx"
    assert config.max_batch_size >= 1 and config.HasField("dynamic_batching")
    (pixels,), (logits, features, probs) = config.input, config.output
    pb2 = _pb2()
    K = len(CLASS_NAMES)
    assert (pixels.name, pixels.data_type, list(pixels.dims)) == ("pixels", pb2.TYPE_UINT8, [32, 32, 3])
    assert (logits.name, logits.data_type, list(logits.dims)) == ("logits", pb2.TYPE_FP32, [K])
    assert (probs.name, probs.data_type, list(probs.dims)) == ("probs", pb2.TYPE_FP32, [K])
    assert features.name == "features" and len(features.dims) == 1
    assert logits.label_filename == probs.label_filename == "labels.txt"
    graph = onnx.load(folder / "1" / "model.onnx").graph
    inits = {i.name for i in graph.initializer}
    assert [i.name for i in graph.input if i.name not in inits] == ["pixels"]
    assert [o.name for o in graph.output] == ["logits", "features", "probs"]  # the logits path alone, no maps


def test_the_model_runs_in_onnxruntime_as_the_config_describes_it(repo):
    models, main_file = repo
    folder = models / "tiny_vit"
    config = _config(folder)
    (inp,), outs = config.input, config.output
    dtype = NUMPY_DTYPES[_pb2().DataType.Name(inp.data_type)]
    images, _ = quadrant_images(5, seed=7)
    batch = images.astype(dtype).reshape(len(images), *inp.dims)  # (B, *dims): Triton adds the batch axis
    session = ort.InferenceSession(str(folder / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in outs], session.run([o.name for o in outs], {inp.name: batch}), strict=True))
    for out in outs:
        assert got[out.name].dtype == NUMPY_DTYPES[_pb2().DataType.Name(out.data_type)]
        assert got[out.name].shape == (len(images), *out.dims)
    clf = OnnxClassifier(main_file)
    logits = got["logits"]
    np.testing.assert_allclose(logits, clf.session.run(["logits"], {"pixels": images})[0], atol=1e-5)
    # the temperature is folded into the graph: a Triton client reads the calibrated probabilities as served
    assert clf.calibrated and clf.trust.temperature != pytest.approx(1.0)
    np.testing.assert_allclose(got["probs"], clf.predict_pixels(images), atol=1e-5)
    labels = (folder / "labels.txt").read_text().splitlines()
    assert [labels[i] for i in logits.argmax(-1)] == [top[0][0] for top in clf.top_k(clf.predict_pixels(images), 1)]


@pytest.mark.slow
def test_the_portable_target_gives_triton_standard_ops(tiny_checkpoint, tmp_path):
    out = tmp_path / "tiny-portable.onnx"
    assert main([str(tiny_checkpoint), "-o", str(out), "--target", "portable", "--triton-repo", str(tmp_path)]) == 0
    model = onnx.load(tmp_path / "tiny-portable" / "1" / "model.onnx")  # named after the output's stem
    assert {n.domain for n in model.graph.node} == {""}
    assert [o.name for o in model.graph.output] == ["logits", "features", "probs"]
    assert _config(tmp_path / "tiny-portable").name == "tiny-portable"


def _logits_only(K: int) -> onnx.ModelProto:
    """A small graph with the Triton model's input and first output: pixels (B, 2, 2, 3) uint8 -> logits (B, K)."""
    weights = onnx.numpy_helper.from_array(np.ones((12, K), np.float32), "w")
    nodes = [
        onnx.helper.make_node("Cast", ["pixels"], ["x"], to=onnx.TensorProto.FLOAT),
        onnx.helper.make_node("Flatten", ["x"], ["flat"]),
        onnx.helper.make_node("MatMul", ["flat", "w"], ["logits"]),
    ]
    pixels = onnx.helper.make_tensor_value_info("pixels", onnx.TensorProto.UINT8, [None, 2, 2, 3])
    logits = onnx.helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, [None, K])
    return onnx.helper.make_model(onnx.helper.make_graph(nodes, "tiny", [pixels], [logits], [weights]))


def _files(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_write_that_fails_midway_replaces_nothing_names_its_file_and_leaves_no_empty_model(tmp_path, monkeypatch):
    """A full disk while the model was written left the new labels.txt and config.pbtxt beside the old model, the
    error named the main output, and a new model's folder stayed in the repository without its files."""
    from serve.export import files, triton

    folder = triton.write_repo(_logits_only(4), CLASS_NAMES, tmp_path, "tiny")
    before = _files(folder)
    new = _logits_only(3)
    write_new = files.write_new

    def full_disk(path: Path, data: bytes) -> None:
        if data == new.SerializeToString():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write_new(path, data)

    monkeypatch.setattr(files, "write_new", full_disk)
    for name in ("tiny", "other"):  # a model rewritten, a new one
        with pytest.raises(OSError) as failed:
            triton.write_repo(new, ["a", "b", "c"], tmp_path, name)
        assert failed.value.filename == str(tmp_path / name / "1" / "model.onnx")
    assert _files(folder) == before and sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]


def test_a_version_policy_written_by_hand_is_kept_when_the_model_is_written_again(tmp_path):
    """The re-export rewrote the whole config: a pin to a version was lost."""
    from serve.export import triton

    config = triton.write_repo(_logits_only(4), CLASS_NAMES, tmp_path, "tiny") / "config.pbtxt"
    pin = '# rolled back by hand\nversion_policy: { specific { versions: [1] } }  # "}" in a comment\n'
    config.write_text(config.read_text() + pin)
    triton.write_repo(_logits_only(3), ["a", "b", "c"], tmp_path, "tiny")
    parsed = parse_config(config.read_text())
    assert list(parsed.version_policy.specific.versions) == [1] and list(parsed.output[0].dims) == [3]


def test_what_was_tuned_by_hand_in_the_config_is_kept_when_the_model_is_written_again(tmp_path, caplog):
    """A re-export rewrote the whole config but its version_policy: instances, batching and parameters a
    Triton user had set were lost, and the model went back to one instance and the default batching."""
    from serve.export import triton

    config = triton.write_repo(_logits_only(4), CLASS_NAMES, tmp_path, "tiny") / "config.pbtxt"
    generated = "".join(line for line in config.open() if not line.startswith(("max_batch", "dynamic", "  max_q", "}")))
    tuned = (
        'instance_group [ { count: 2, kind: KIND_CPU } ]\nmax_batch_size: 8\ndefault_model_filename: "a.onnx"\n'
        "dynamic_batching { preferred_batch_size: [ 4, 8 ] max_queue_delay_microseconds: 100 }\n"
        'parameters { key: "intra_op_thread_count" value: { string_value: "1" } }\n'
        'model_warmup [ { name: "w" batch_size: 1 inputs { key: "pixels" value: { data_type: TYPE_UINT8 '
        "dims: [ 2, 2, 3 ] zero_data: true } } } ]\n"  # the old input's shape: left out
    )
    config.write_text(generated + tuned)
    triton.write_repo(_logits_only(3), ["a", "b", "c"], tmp_path, "tiny")
    parsed = _config(config.parent)  # read by Triton's own messages: a field written twice is refused
    assert [(g.count, g.kind) for g in parsed.instance_group] == [(2, _pb2().ModelInstanceGroup.KIND_CPU)]
    assert parsed.max_batch_size == 8 and list(parsed.dynamic_batching.preferred_batch_size) == [4, 8]
    assert parsed.parameters["intra_op_thread_count"].string_value == "1"
    assert list(parsed.output[0].dims) == [3] and parsed.default_model_filename == ""  # the export writes model.onnx
    assert not parsed.model_warmup and "default_model_filename, model_warmup written anew or left out" in caplog.text

    for size in ("0", "-0", "0x0"):  # no batch axis: every dims would be wrong
        config.write_text(generated + f"max_batch_size: {size}\n")
        with pytest.raises(ValueError, match="max_batch_size: 0"):
            triton.write_repo(_logits_only(3), ["a", "b", "c"], tmp_path, "tiny")
    config.write_text(generated + "instance_group [ { count: 2 } }\n")  # a bracket closed by another kind
    with pytest.raises(ValueError, match="an unmatched '}'"):
        triton.write_repo(_logits_only(3), ["a", "b", "c"], tmp_path, "tiny")


def _export_args(checkpoint: Path, root: Path) -> list[str]:
    """`vit-export` writing root/tiny.onnx and the model `tiny` in root/models."""
    return [str(checkpoint), "-o", str(root / "tiny.onnx"), "--triton-repo", str(root / "models"), "--no-gradients"]


def _kill_export_when(args: list[str], moment: Callable[[], object], what: str) -> None:
    """Run `vit-export args` in a child and SIGKILL it as soon as `moment()` is true (or it has ended)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "serve.export.cli", *args], env=env, stdout=subprocess.DEVNULL)
    try:
        wait_until(lambda: moment() or proc.poll() is not None, 300, what, interval=0.001)  # the moment is brief
    finally:
        proc.kill()
        proc.wait(30)


def _stamp(path: Path) -> tuple[int, int, int] | None:
    """A file's inode, size and modification time (None: it is not there)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def _assert_whole(root: Path, versions: list[int]) -> None:
    """root/models/tiny is whole as vit-serve scans it (config, labels, `versions` that load) and nothing of
    an export is left half: the main file, once in place, loads too."""
    model = scan(root / "models")["tiny"]
    assert model.error == "" and sorted(model.files) == versions
    config = model.folder / "config.pbtxt"
    assert config.is_file(), f"a version without its config: {sorted(model.folder.rglob('*'))}"
    assert parse_config(config.read_text()).name == "tiny"
    for path in model.files.values():
        assert model.labels() == OnnxClassifier(path).labels == CLASS_NAMES
    if (root / "tiny.onnx").exists():
        assert OnnxClassifier(root / "tiny.onnx").labels == CLASS_NAMES


def _hidden(root: Path) -> list[Path]:
    return sorted(root.rglob(".*"))


@pytest.mark.slow
def test_an_export_killed_as_its_version_appears_or_changes_leaves_the_model_whole(tiny_checkpoint, tmp_path):
    args = _export_args(tiny_checkpoint, tmp_path)
    version = tmp_path / "models" / "tiny" / "1" / "model.onnx"
    _kill_export_when(args, version.exists, "the version file appears")  # a new model
    _assert_whole(tmp_path, [1])  # a server polling the repository never sees a version without its config
    live = tmp_path / files.temporary_name("tiny.onnx")  # a running export's temporary: kept
    live.touch()
    # an export killed in a container, where the next export runs as the same process id: not a running one's
    earlier = tmp_path / f".tiny.onnx.vit-export-{os.getpid()}-1-0123abcd"
    earlier.touch()
    older = tmp_path / f".tiny.onnx.vit-export-{os.getpid()}-0123abcd"  # named before the start time: by its id alone
    older.touch()
    assert main(args) == 0
    _assert_whole(tmp_path, [1])
    assert (tmp_path / "tiny.onnx").is_file() and _hidden(tmp_path) == sorted([live, older])  # the killed ones' go

    before = _stamp(version)  # the same model rewritten in place
    _kill_export_when(args, lambda: _stamp(version) != before, "the version file changes")
    _assert_whole(tmp_path, [1])


@pytest.mark.slow
def test_vit_serve_of_the_repository_classifies_and_says_why_it_cannot_explain(repo, tmp_path, ui_client):
    """The repository's file has the logits path alone: every UI call and /v1/classify?explain=true failed on the
    missing attention output (a Gradio traceback, a 500). It classifies, and says where explanations are."""
    from gradio_client import handle_file

    from tests.helpers import ServerProcess

    image = tmp_path / "square.png"
    Image.fromarray(np.full((32, 32, 3), 200, np.uint8)).save(image)
    with ServerProcess(repo[0], "--examples-dir", "", "--graceful-timeout-s", "3") as server:
        plain = httpx.post(server.url + "/v1/classify", content=image.read_bytes(), timeout=60)
        assert plain.status_code == 200
        r = httpx.post(server.url + "/v1/classify?explain=true", content=image.read_bytes(), timeout=60)
        assert r.status_code == 422 and "no attention" in r.json()["error"]["message"], r.text
        client = ui_client(server.url + "/")
        label, overlay, text, *_ = client.predict(
            handle_file(str(image)), "mean", 0.0, 0, 2, 0.5, "inferno", api_name="/classify"
        )
        assert label["label"] == plain.json()["predictions"][0]["label"] and overlay is None and "no attention" in text
