"""Every model file and config is served or refused with a reason: hostile metadata, deep graphs, edited
calibration and `config.pbtxt` files a user, a pipeline or an attacker could drop into a repository."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from serve.runtime.classifier import OnnxClassifier
from serve.runtime.model_file import ModelFileError
from serve.server.repository.layout import (
    CONFIG_FILE,
    MAX_CONFIG_BYTES,
    MODEL_FILE,
    VersionPolicy,
    parse_version_policy,
    scan,
)

onnx = pytest.importorskip("onnx")  # edits real exported files


def edited(model: Path, out: Path, drop: tuple[str, ...] = (), **values: str) -> Path:
    """A copy of an exported file with some `metadata_props` replaced by raw strings, added, or dropped."""
    m = onnx.load(model)
    props = {p.key: p.value for p in m.metadata_props if p.key not in drop}
    props.update(values)
    del m.metadata_props[:]
    for k, v in props.items():
        m.metadata_props.add(key=k, value=v)
    onnx.save(m, out)
    return out


def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field."""
    key, length = (number << 3) | 2, len(payload)
    out = bytearray()
    for v in (key, length):
        while v >= 0x80:
            out.append((v & 0x7F) | 0x80)
            v >>= 7
        out.append(v)
    return bytes(out) + payload


def nested_graph(depth: int) -> bytes:
    """A GraphProto whose one node's attribute holds a graph, `depth` times over (If inside If inside ...)."""
    graph = b""
    for _ in range(depth):
        graph = _field(1, _field(5, _field(6, graph)))  # graph.node[0].attribute[0].g = graph
    return graph


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("class_names", "[" * 100_000),  # RecursionError in json
        ("preprocess", "[" * 900 + "]" * 900),  # parses, but too deep for anything that walks it
        ("vitscope_notes", '{"a": ' * 100_000),  # a key vitscope does not read is parsed too
    ],
)
def test_deeply_nested_metadata_is_a_model_file_error(tiny_onnx, tmp_path, key, value):
    with pytest.raises(ModelFileError, match=rf"{key}.*nested.*export it again with vit-export"):
        OnnxClassifier(edited(tiny_onnx, tmp_path / "deep.onnx", **{key: value}))


def test_a_graph_nested_1500_deep_is_a_model_file_error(tiny_onnx, tmp_path):
    # a second `graph` field merges into the first on the wire: a real model with a deep subgraph appended
    bad = tmp_path / "deep_graph.onnx"
    bad.write_bytes(tiny_onnx.read_bytes() + _field(7, nested_graph(1500)))
    with pytest.raises(ModelFileError, match=r"nested.*deeper than.*export it again with vit-export"):
        OnnxClassifier(bad)


@pytest.mark.parametrize("key", ["preprocess", "input_size", "grid_size", "num_prefix_tokens", "depth", "num_heads"])
def test_a_missing_metadata_key_is_a_model_file_error_naming_it(tiny_onnx, tmp_path, key):
    with pytest.raises(ModelFileError, match=rf"no {key!r} metadata.*export it again with vit-export"):
        OnnxClassifier(edited(tiny_onnx, tmp_path / "missing.onnx", drop=(key,)))


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("input_size", '"abc"'),
        ("input_size", "7"),
        ("input_size", "[0, 0]"),
        ("input_size", "[1e400, 32]"),
        ("grid_size", '{"a": 1}'),
        ("grid_size", "[4]"),
        ("depth", '"two"'),
        ("num_heads", "-1"),
        ("num_prefix_tokens", "[1]"),
        ("preprocess", "[]"),
        ("preprocess", '{"img_size": "x"}'),
        ("preprocess", '{"crop_pct": "big"}'),
        ("class_names", "{}"),
        ("class_names", '["a", ["b"], "c", "d"]'),
        ("patch_size", '"eight"'),
        ("mean", '"grey"'),
        ("class_names", '["a", "a", "b", "c"]'),  # labelled a 9 as the other "0"
        ("class_names", '["a", "", "b", "c"]'),
        ("preprocess", '{"img_size": [32, 32], "crop_pct": 1e-9}'),  # resized to gigapixels, then cropped
        ("vitscope_format", '"2"'),
    ],
)
def test_malformed_metadata_is_only_ever_a_model_file_error(tiny_onnx, tmp_path, key, value):
    with pytest.raises(ModelFileError, match=rf"{key}.*vit-export"):
        OnnxClassifier(edited(tiny_onnx, tmp_path / "bad.onnx", **{key: value}))


def test_a_copy_cut_short_between_two_metadata_entries_is_refused(tiny_onnx, tmp_path):
    """A cut that fell just before the `calibration` entry parsed as a whole file and served uncalibrated scores:
    vit-export writes the format entry last, so any cut in the metadata takes it, and the file says it was cut."""
    data = tiny_onnx.read_bytes()
    keys = [p.key for p in onnx.load(tiny_onnx).metadata_props]
    assert keys[-1] == "vitscope_format"  # written last
    m = onnx.load(tiny_onnx)
    del m.metadata_props[keys.index("calibration") :]  # every entry from the calibration on
    cut = m.SerializeToString()
    if not m.functions:  # metadata_props is the file's last field: this is a prefix of it, as a copy cut short is
        assert data.startswith(cut)
    (tmp_path / "cut.onnx").write_bytes(cut)
    with pytest.raises(ModelFileError, match="cut short"):
        OnnxClassifier(tmp_path / "cut.onnx")


def test_truncated_and_foreign_files_are_model_file_errors(tiny_onnx, tmp_path):
    data = tiny_onnx.read_bytes()
    for name, body in [("cut.onnx", data[: len(data) // 2]), ("text.onnx", b"not a model at all\n" * 10)]:
        (tmp_path / name).write_bytes(body)
        with pytest.raises(ModelFileError, match="vit-export"):
            OnnxClassifier(tmp_path / name)


@pytest.mark.timeout(60, method="thread")  # a named pipe was opened and waited on for ever
def test_a_folder_or_a_named_pipe_given_as_the_model_is_said_to_be_one(tmp_path):
    """Both were "model file not found", for a path that is there."""
    os.mkfifo(tmp_path / "pipe.onnx")
    for path, says in [(tmp_path, "is a folder, not a model file"), (tmp_path / "pipe.onnx", "named pipe")]:
        with pytest.raises(ModelFileError, match=says):
            OnnxClassifier(path)


def with_calibration(model: Path, out: Path, edit) -> Path:
    """A copy of an exported (calibrated) file whose `calibration` metadata `edit(entry)` has changed."""
    entry = json.loads({p.key: p.value for p in onnx.load(model).metadata_props}["calibration"])
    edit(entry)
    return edited(model, out, calibration=json.dumps(entry))


def _set(path: str, value):
    """An edit that sets entry[a][b]... = value, for a dotted `path`."""

    def edit(entry: dict) -> None:
        *parents, last = path.split(".")
        for p in parents:
            entry = entry[p]
        entry[last] = value(entry[last]) if callable(value) else value

    return edit


@pytest.mark.parametrize(
    ("field", "edit"),
    [
        ("temperature", _set("temperature", -1.0)),  # served the least likely class
        ("temperature", _set("temperature", math.inf)),  # gave uniform probabilities
        ("temperature", _set("temperature", math.nan)),
        ("temperature", _set("temperature", 0.0)),
        ("temperature", _set("temperature", "warm")),
        ("temperature", _set("temperature", "1")),  # read as 1.0
        ("temperature", _set("temperature", True)),
        ("temperature", _set("temperature", 1e300)),  # every probability 0.1, and the top class changed
        ("temperature", _set("temperature", 1e-9)),
        ("conformal.class_conditional", _set("conformal.class_conditional", "false")),  # read as True
        ("conformal.labels", _set("conformal.labels", lambda labels: [0.5] * len(labels))),  # read as 0
        ("confidence_map", _set("confidence_map", {"confidence": [0.5, 0.9], "accuracy": [-5.0, 7.0]})),
        ("conformal.scores", _set("conformal.scores", lambda s: s[::-1])),  # unsorted: wrong sets
        ("conformal.scores", _set("conformal.scores", lambda s: [*s[:-1], math.nan])),
        ("conformal.scores", _set("conformal.scores", [])),
        ("conformal.scores", _set("conformal.scores", [[0.1, 0.2]])),
        ("conformal.labels", _set("conformal.labels", lambda labels: labels[:-1])),
        ("conformal.labels", _set("conformal.labels", lambda labels: [99] * len(labels))),
        ("conformal.method", _set("conformal.method", "raps")),
        ("ood.threshold", _set("ood.threshold", math.nan)),  # never said unknown
        ("ood.threshold", _set("ood.threshold", -math.inf)),
        ("ood.threshold", _set("ood.threshold", "1e9")),  # read as 1e9, as the temperature's strings were not
        ("ood.threshold", _set("ood.threshold", True)),
        ("ood.score", _set("ood.score", "vibes")),
        ("ood.means", _set("ood.means", lambda means: means[:-1])),  # (K - 1, D): fewer classes than the file
        ("ood.means", _set("ood.means", lambda means: [row[:-1] for row in means])),  # (K, D - 1)
        ("ood.precision", _set("ood.precision", lambda p: [row[:-1] for row in p[:-1]])),  # (D - 1, D - 1)
        ("ood.precision", _set("ood.precision", lambda p: [[math.inf] * len(row) for row in p])),
        ("ood.means", lambda entry: entry["ood"].pop("means")),
        ("confidence_map", _set("confidence_map", {"confidence": [0.9, 0.5], "accuracy": [0.5, 0.9]})),
        ("confidence_map", _set("confidence_map", {"confidence": [0.5, 0.9], "accuracy": [0.5]})),
        ("drift.confidence", _set("drift.confidence.fractions", [1.0])),
        ("drift.predicted", _set("drift.predicted.fractions", [0.5, 0.5])),
        ("drift.ood_score", _set("drift.ood_score.edges", lambda e: e[::-1])),
        ("conformal", lambda entry: entry.pop("conformal")),
        ("ood", lambda entry: entry.update(ood=[1, 2])),
    ],
)
def test_invalid_calibration_is_a_model_file_error_naming_the_field(tiny_onnx, tmp_path, field, edit):
    bad = with_calibration(tiny_onnx, tmp_path / "bad_calibration.onnx", edit)
    with pytest.raises(ModelFileError, match=rf"calibration.*{field}.*export it again with vit-export"):
        OnnxClassifier(bad)


def test_a_file_without_any_calibration_is_valid_and_uncalibrated(tiny_onnx, tmp_path):
    clf = OnnxClassifier(edited(tiny_onnx, tmp_path / "uncalibrated.onnx", drop=("calibration",)))
    assert not clf.calibrated and clf.trust_summary()["calibrated"] is False


def repo_with(root: Path, configs: dict[str, str | None], versions: tuple[str, ...] = ("1",)) -> Path:
    """A repository of models named by `configs` (None: no config.pbtxt), each with `versions` folders."""
    root.mkdir(parents=True, exist_ok=True)
    for name, config in configs.items():
        folder = root / name
        folder.mkdir(parents=True)
        if config is not None:
            (folder / CONFIG_FILE).write_text(config, encoding="utf-8")
        for v in versions:
            (folder / v).mkdir()
            (folder / v / MODEL_FILE).write_bytes(b"onnx")
    return root


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        # a comment after the policy, or text later in the file, once changed the policy
        ("version_policy { all { } }\n# was: latest { num_versions: 1 }\n", VersionPolicy("all")),
        (
            'version_policy { all { } }\nparameters { key: "n" value { string_value: "latest { num_versions: 1 }" } }',
            VersionPolicy("all"),
        ),
        (
            "version_policy: { specific: { versions: [1, 3] } } # specific { versions: [2] }",
            VersionPolicy("specific", versions=(1, 3)),
        ),
        # a comment that mentions version_policy once made the file unreadable
        ('# version_policy: see the model repository guide\nname: "m"\n', VersionPolicy()),
        ("version_policy { latest { num_versions: 2 } }", VersionPolicy("latest", 2)),
        ("version_policy { specific { versions: 1 versions: 3 } }", VersionPolicy("specific", versions=(1, 3))),
        ("", VersionPolicy()),
    ],
)
def test_the_version_policy_is_read_as_triton_reads_it(config, expected):
    assert parse_version_policy(config) == expected


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ("version_policy { newest { } }", 'no field named "newest"'),
        ('nmae: "m"', 'no field named "nmae"'),  # a typo: Triton refuses it too
        ("version_policy { latest { num_versions: 0 } }", "num_versions of at least 1"),
        ("version_policy { }", "version_policy names no policy"),
        ("version_policy { all { } }\nversion_policy { all { } }", "version_policy"),
        ("sequence_batching { }", "vitscope does not serve"),
        ("max_batch_size: 1e9", "max_batch_size"),
        ("version_policy { all {", "1:"),
    ],
)
def test_a_config_triton_would_refuse_is_refused_with_a_reason(config, says):
    with pytest.raises(ValueError, match=says):
        parse_version_policy(config)


TYPICAL_TRITON_CONFIG = """
name: "vit"
backend: "onnxruntime"
max_batch_size: 32
input [ { name: "pixels" data_type: TYPE_UINT8 format: FORMAT_NHWC dims: [ 224, 224, 3 ] } ]
output [ { name: "logits" data_type: TYPE_FP32 dims: [ 1000 ] label_filename: "labels.txt" } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
dynamic_batching { preferred_batch_size: [ 8, 16 ] max_queue_delay_microseconds: 100 }
optimization { execution_accelerators { gpu_execution_accelerator : [ {
  name : "tensorrt"
  parameters { key: "precision_mode" value: "FP16" } } ] } }
parameters { key: "intra_op_thread_count" value: { string_value: "4" } }
model_warmup [ { name: "zeros" batch_size: 1 inputs { key: "pixels" value: {
  data_type: TYPE_UINT8 dims: [ 224, 224, 3 ] zero_data: true } } } ]
response_cache { enable: false }
version_policy: { latest: { num_versions: 2 } }
"""


def test_typical_triton_and_vit_export_configs_parse(tiny_onnx):
    assert parse_version_policy(TYPICAL_TRITON_CONFIG) == VersionPolicy("latest", 2)
    from serve.export.triton import config_pbtxt

    assert parse_version_policy(config_pbtxt(onnx.load(tiny_onnx), "alpha")) == VersionPolicy()


def test_a_bad_config_fails_its_own_model_and_not_the_scan(tmp_path):
    root = repo_with(tmp_path, {"bad": "version_policy { newest { } }", "good": "version_policy { all { } }"})
    models = scan(root)
    assert models["good"].error == "" and list(models["good"].wanted()) == [1]
    assert 'no field named "newest"' in models["bad"].error and models["bad"].wanted() == {}
    with pytest.raises(ValueError, match="holds no model"):
        scan(repo_with(tmp_path / "empty", {}))


def test_a_config_over_the_size_cap_is_that_models_error(tmp_path):
    # Triton's configs are a few KiB; a larger one took seconds to parse on every poll, under the repository lock
    models = scan(repo_with(tmp_path, {"big": "#" * (64 * 1024 + 1), "good": None}))
    assert "a few KiB" in models["big"].error and models["big"].wanted() == {} and models["good"].error == ""


@pytest.mark.timeout(60, method="thread")  # a named pipe opened would wait for a writer for ever
def test_a_config_that_is_a_folder_a_dangling_link_or_a_pipe_is_that_models_error(tmp_path):
    """Taken for no config at all: the model was served under Triton's default policy, where Triton refuses it."""
    root = repo_with(tmp_path, {"folder": None, "link": None, "pipe": None, "good": None}, versions=("1", "2"))
    (root / "folder" / CONFIG_FILE).mkdir()
    (root / "link" / CONFIG_FILE).symlink_to(tmp_path / "gone.pbtxt")
    os.mkfifo(root / "pipe" / CONFIG_FILE)
    models = scan(root)
    for name in ("folder", "link", "pipe"):
        assert CONFIG_FILE in models[name].error and models[name].wanted() == {}, models[name]
    assert models["good"].error == "" and list(models["good"].wanted()) == [2]


def test_an_unchanged_config_is_parsed_once_not_on_every_poll(tmp_path, monkeypatch):
    from serve.server.repository import layout

    parsed = []
    monkeypatch.setattr(layout, "parse_version_policy", lambda text: parsed.append(text) or VersionPolicy("all"))
    root = repo_with(tmp_path, {"m": "version_policy { all { } }"})
    scan(root), scan(root)
    assert len(parsed) == 1
    (root / "m" / CONFIG_FILE).write_text("version_policy { latest { num_versions: 2 } }")
    assert scan(root)["m"].policy == VersionPolicy("all") and len(parsed) == 2  # a changed file is read again


def test_a_labels_file_over_its_cap_is_that_models_error(tmp_path):
    root = repo_with(tmp_path, {"m": None})
    (root / "m" / "labels.txt").write_bytes(b"cat\n" * (1 << 18) + b"x")  # just over 1 MiB
    with pytest.raises(ValueError, match="over 1,048,576 bytes"):
        scan(root)["m"].labels()


def test_a_config_of_whitespace_up_to_the_cap_parses_in_linear_time(tmp_path):
    # the regex reader backtracked quadratically on it: about 27 minutes per megabyte, under the repository lock
    config = "version_policy { all { } }\n# latest" + " " * (MAX_CONFIG_BYTES - 64)
    repo_with(tmp_path, {"spaces": config})
    code = "import sys; from serve.server.repository.layout import scan; print(scan(sys.argv[1])['spaces'].policy)"
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=30, cwd=Path.cwd()
    )
    assert "kind='all'" in done.stdout, done.stderr


def test_version_folders_are_ascii_digits_without_a_leading_zero_as_in_triton(tmp_path):
    # '²' and '١' are digits to str.isdigit: one broke the scan of every model, the other collided with '1'
    models = scan(repo_with(tmp_path, {"m": None, "n": None}, versions=("²", "١", "01", "0", "1", "3", "9" * 30)))
    assert sorted(models["m"].files) == [1, 3] and models["m"].error == ""
    assert models["m"].wanted() == {3: tmp_path / "m" / "3" / MODEL_FILE}


@pytest.mark.parametrize(
    "entries", [{"num_prefix_tokens": "0"}, {"num_prefix_tokens": "60"}, {"grid_size": "[8, 8]", "patch_size": "0"}]
)
def test_metadata_that_miscounts_the_attention_tokens_is_a_model_file_error_when_explaining(
    tiny_onnx, tmp_path, entries
):
    """The file loaded and answered; each explanation then failed with numpy's "cannot reshape array of size 48"."""
    clf = OnnxClassifier(edited(tiny_onnx, tmp_path / "miscounted.onnx", **entries))
    batch = clf.prepare(np.zeros((40, 40, 3), np.uint8))[None]
    assert clf.predict_pixels(batch).shape == (1, len(clf.labels))
    for explain in (clf.rollout, clf.gradient_rollout):
        with pytest.raises(ModelFileError, match=r"its attention maps are over \d+ tokens.*export it again"):
            explain(batch)


@pytest.mark.parametrize("change", ["float_pixels", "no_logits"])
def test_another_graph_carrying_a_vitscope_files_metadata_is_refused_at_load(tiny_onnx, tmp_path, change):
    """It loaded; vit-predict then failed on every batch with onnxruntime's InvalidArgument traceback, exit 1."""
    import onnx
    from onnx import TensorProto, helper

    pixels = TensorProto.FLOAT if change == "float_pixels" else TensorProto.UINT8
    x = helper.make_tensor_value_info("pixels", pixels, None)
    y = helper.make_tensor_value_info("logits" if change == "float_pixels" else "scores", TensorProto.FLOAT, None)
    cast = helper.make_node("Cast", ["pixels"], [y.name], to=TensorProto.FLOAT)
    graph = helper.make_graph([cast], "other", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    model.metadata_props.extend(p for p in onnx.load(tiny_onnx).metadata_props if p.key != "calibration")
    onnx.save(model, tmp_path / "other.onnx")
    with pytest.raises(ModelFileError, match="has no uint8 'pixels' input and 'logits' output"):
        OnnxClassifier(tmp_path / "other.onnx")
