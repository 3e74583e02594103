"""serve.runtime.classifier: torch-free loading, preprocessing equal to training's, predictions, rollout, refusals."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from PIL import Image

from serve.runtime.classifier import OnnxClassifier
from serve.runtime.images import ImageError, load_image
from serve.runtime.model_file import ModelFileError
from serve.runtime.rollout import attention_rollout, rollout_from_gradients

ROOT = Path(__file__).resolve().parents[2]

BLOCK_TORCH = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "lightning", "pytorch_lightning", "torchvision", "timm"):
            raise ImportError(f"{name} is blocked in this process")
sys.meta_path.insert(0, Block())
"""


def test_runtime_classifies_with_torch_and_lightning_blocked(tiny_onnx):
    code = (
        BLOCK_TORCH
        + f"""
from serve.runtime.classifier import OnnxClassifier
import numpy as np
clf = OnnxClassifier({str(tiny_onnx)!r})
x = np.zeros((2, *clf.input_size, 3), np.uint8)
probs, maps = clf.rollout(x)
assert probs.shape == (2, len(clf.labels)) and maps.shape == (2, *clf.grid_size)
assert not any(m.split(".")[0] in ("torch", "lightning") for m in sys.modules)
print("ok", clf.predict(x[0], top_k=1)[0][0][0])
"""
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok ")


def test_blocking_torch_really_blocks_it():
    proc = subprocess.run([sys.executable, "-c", BLOCK_TORCH + "import torch"], capture_output=True, text=True)
    assert proc.returncode != 0 and "blocked" in proc.stderr


def _random_images(seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    images = []
    for H, W, mode in [(32, 32, "RGB"), (45, 70, "RGB"), (100, 33, "L"), (64, 64, "RGBA"), (17, 29, "P")]:
        a = rng.integers(0, 256, (H, W, 4), dtype=np.uint8)
        img = Image.fromarray(a, "RGBA")
        images.append(img.convert(mode) if mode != "P" else img.convert("RGB").quantize(16))
    return images


def test_preprocessing_equals_the_training_evaluation_transform(tiny_onnx, tiny_checkpoint):
    from train.checkpoint import load_network
    from train.transforms import EvalTransform

    clf = OnnxClassifier(tiny_onnx)
    _, meta = load_network(tiny_checkpoint)
    evaluate = EvalTransform(meta["preprocess"])
    for img in _random_images():
        served = clf.preprocess.normalize(clf.prepare(img))  # (3, H, W): what the graph computes inside
        trained = evaluate(load_image(img)).numpy()
        np.testing.assert_array_equal(served, trained)


def test_every_image_source_gives_the_same_prediction(tiny_onnx, tmp_path):
    clf = OnnxClassifier(tiny_onnx)
    img = _random_images(1)[1].convert("RGB")
    path = tmp_path / "x.png"
    img.save(path)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    results = clf.predict([img, path, str(path), buf.getvalue(), np.asarray(img)], top_k=3)
    assert all(r == results[0] for r in results)
    probs = [p for _, p in results[0]]
    assert probs == sorted(probs, reverse=True) and len(probs) == 3


def test_predictions_agree_with_the_torch_model(tiny_onnx, tiny_checkpoint, tiny_run):
    from train.checkpoint import load_network

    net, meta = load_network(tiny_checkpoint)
    clf = OnnxClassifier(tiny_onnx)
    paths = sorted((tiny_run / "data").rglob("*.png"))
    pixels = np.stack([clf.prepare(p) for p in paths])
    with torch.no_grad():
        logits = net(torch.from_numpy(meta["preprocess"].normalize(pixels)))
    expected = (logits / clf.trust.temperature).softmax(-1).numpy()  # calibrated probabilities
    np.testing.assert_allclose(clf.predict_pixels(pixels), expected, atol=1e-5)
    np.testing.assert_allclose(clf.logits(pixels), logits.numpy(), atol=1e-4)  # the raw logits stay available
    assert clf.predict_pixels(pixels).max(-1).mean() > 0.8  # a trained model, not a uniform one


def test_rollout_maps_match_torch_rollout_of_the_same_model(tiny_onnx, tiny_checkpoint):
    from train.checkpoint import load_network
    from vit import attention_rollout as torch_rollout

    net, meta = load_network(tiny_checkpoint)
    clf = OnnxClassifier(tiny_onnx)
    pixels = np.stack([clf.prepare(img) for img in _random_images(2)])
    with torch.no_grad():
        _, attns = net(torch.from_numpy(meta["preprocess"].normalize(pixels)), return_attn=True)
    expected = torch_rollout(attns, head_fusion="max", num_prefix_tokens=1).numpy()
    probs, maps = clf.rollout(pixels, head_fusion="max")
    assert maps.shape == (len(pixels), *clf.grid_size)
    np.testing.assert_allclose(maps.reshape(len(pixels), -1), expected, atol=1e-5)
    assert maps.max() == pytest.approx(1.0) and maps.min() >= 0.0


def test_gradient_rollout_from_the_file_matches_torch_for_any_target(tiny_onnx, tiny_checkpoint):
    from train.checkpoint import load_network
    from vit import gradient_rollout as torch_gradient_rollout

    net, meta = load_network(tiny_checkpoint)
    clf = OnnxClassifier(tiny_onnx)
    assert clf.supports_gradients
    pixels = np.stack([clf.prepare(img) for img in _random_images(4)])
    x = torch.from_numpy(meta["preprocess"].normalize(pixels))
    for target in (None, 2, [0, 1, 2, 3, 0]):
        expected, logits = torch_gradient_rollout(net, x, None if target is None else torch.tensor(target))
        probs, maps = clf.gradient_rollout(pixels, target=target)
        assert maps.shape == (len(pixels), *clf.grid_size)
        np.testing.assert_allclose(maps.reshape(len(pixels), -1), expected.numpy(), atol=1e-4)
        np.testing.assert_allclose(probs, (logits / clf.trust.temperature).softmax(-1).numpy(), atol=1e-5)
    with pytest.raises(ValueError, match="target classes"):
        clf.gradient_rollout(pixels, target=7)


def test_rollout_blocks_selects_a_range_of_blocks(tiny_onnx):
    clf = OnnxClassifier(tiny_onnx)
    pixels = np.stack([clf.prepare(img) for img in _random_images(3)])
    _, attns = clf.attentions(pixels)
    assert attns.shape == (clf.depth, len(pixels), clf.num_heads, 17, 17)
    _, last = clf.rollout(pixels, blocks=(1, 2))
    expected = attention_rollout(attns[1:2], num_prefix_tokens=1).reshape(last.shape)
    np.testing.assert_allclose(last, expected, atol=1e-6)
    with pytest.raises(ValueError, match="selects no block"):
        clf.rollout(pixels, blocks=(5, 6))


@pytest.mark.parametrize("head_fusion", ["mean", "max", "min"])
@pytest.mark.parametrize("discard_ratio", [0.0, 0.4])
@pytest.mark.parametrize("query,prefix", [("cls", 1), ("cls", 3), ("mean", 0)])
def test_numpy_rollout_follows_the_torch_math(head_fusion, discard_ratio, query, prefix):
    from vit import attention_rollout as torch_rollout

    g = torch.Generator().manual_seed(0)
    attns = [torch.randn(2, 3, prefix + 9, prefix + 9, generator=g).softmax(-1) for _ in range(3)]
    kw = dict(head_fusion=head_fusion, discard_ratio=discard_ratio, num_prefix_tokens=prefix, query=query)
    expected = torch_rollout(attns, **kw).numpy()
    got = attention_rollout(np.stack([a.numpy() for a in attns]), **kw)
    np.testing.assert_allclose(got, expected, atol=1e-6)


def test_numpy_gradient_rollout_follows_the_torch_math():
    from vit import rollout_from_gradients as torch_grad_rollout

    g = torch.Generator().manual_seed(1)
    attns = [torch.randn(2, 2, 10, 10, generator=g).softmax(-1) for _ in range(2)]
    grads = [torch.randn(2, 2, 10, 10, generator=g) for _ in range(2)]
    expected = torch_grad_rollout(attns, grads, num_prefix_tokens=1).numpy()
    got = rollout_from_gradients([a.numpy() for a in attns], [g_.numpy() for g_ in grads], num_prefix_tokens=1)
    np.testing.assert_allclose(got, expected, atol=1e-6)


def test_a_wrongly_shaped_batch_is_refused_with_the_expected_shape(tiny_onnx):
    clf = OnnxClassifier(tiny_onnx)
    with pytest.raises(ValueError, match=r"expected \(B, 32, 32, 3\) uint8"):
        clf.predict_pixels(np.zeros((1, 64, 64, 3), np.uint8))
    with pytest.raises(ImageError):
        clf.predict(b"not an image at all")


def test_a_truncated_model_file_is_refused_clearly(tiny_onnx, tmp_path):
    bad = tmp_path / "truncated.onnx"
    bad.write_bytes(tiny_onnx.read_bytes()[: tiny_onnx.stat().st_size // 2])
    with pytest.raises(ValueError, match="truncated or not an ONNX file"):
        OnnxClassifier(bad)
    text = tmp_path / "notes.onnx"
    text.write_text("this is not a model\n" * 10)
    with pytest.raises(ValueError, match="ONNX"):
        OnnxClassifier(text)
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        OnnxClassifier(empty)


def test_a_model_without_vitscope_metadata_is_refused(tiny_onnx, tmp_path):
    model = onnx.load(tiny_onnx)
    del model.metadata_props[:]
    foreign = tmp_path / "foreign.onnx"
    onnx.save(model, foreign)
    with pytest.raises(ValueError, match="no vitscope metadata"):
        OnnxClassifier(foreign)


def test_a_model_with_external_data_is_refused_before_loading(tiny_onnx, tmp_path):
    model = onnx.load(tiny_onnx)
    external = tmp_path / "external.onnx"
    onnx.save(model, external, save_as_external_data=True, location="weights.bin", size_threshold=0)
    assert (tmp_path / "weights.bin").exists()
    with pytest.raises(ModelFileError, match="external data"):
        OnnxClassifier(external)


def test_thread_default_follows_model_size(tiny_onnx):
    from serve.runtime.classifier import OnnxClassifier, default_threads
    from vit import create_model

    sample = create_model("vit_micro_patch4_32")  # ~0.02 GFLOP: one thread
    vit_small = create_model("vit_small_patch16_224")  # ~9 GFLOP: every core
    assert default_threads({"gflops_per_image": str(sample.flops_per_image() / 1e9)}) == 1
    assert default_threads({"gflops_per_image": str(vit_small.flops_per_image() / 1e9)}) == 0
    assert default_threads({}) == 1  # no usable metadata: the cautious choice
    clf = OnnxClassifier(tiny_onnx)
    assert float(clf.metadata["gflops_per_image"]) > 0 and clf.threads == 1
    assert OnnxClassifier(tiny_onnx, threads=2).threads == 2


def test_session_options_set_the_intra_op_threads_only():
    from serve.runtime.classifier import session_options

    options = session_options(2)
    assert options.intra_op_num_threads == 2 and options.inter_op_num_threads == 1


def test_a_tiff_with_impossible_tiles_is_a_corrupt_image():
    buf = io.BytesIO()
    Image.new("I;16", (40, 48)).save(buf, format="TIFF")
    data = bytearray(buf.getvalue())
    data[70] = 68  # one byte of the header: PIL raised a bare ValueError ("Invalid tile dimensions")
    with pytest.raises(ImageError) as e:
        load_image(bytes(data))
    assert e.value.kind == "corrupt"


@pytest.mark.filterwarnings("ignore")  # PIL warns about the damage it tolerates
@pytest.mark.parametrize("fmt, mode", [("TIFF", "I;16"), ("TIFF", "RGB"), ("BMP", "RGB"), ("GIF", "P"), ("PNG", "LA")])
def test_a_damaged_file_is_an_image_error_never_another_exception(fmt, mode):
    buf = io.BytesIO()
    Image.new(mode, (40, 48)).save(buf, format=fmt)
    good = np.frombuffer(buf.getvalue(), np.uint8)
    rng = np.random.default_rng(0)
    for _ in range(300):  # flip a few bytes, mostly in the header where the parsers live
        bad = good.copy()
        at = rng.integers(0, min(len(bad), 256), size=rng.integers(1, 4))
        bad[at] = rng.integers(0, 256, size=len(at))
        try:
            load_image(bad.tobytes())
        except ImageError:
            pass  # any other exception would be an HTTP 500 in the server


def test_only_the_documented_formats_are_decoded():
    with pytest.raises(ImageError, match="not an image") as e:
        load_image(b"P6\n4x 4\n255\n")  # a PPM header: PIL reads PPM, we do not
    assert e.value.kind == "not_an_image"


@pytest.mark.parametrize(
    "key, value, says",
    [
        ("input_size", [64, 64], "input_size is [64, 64] but preprocess img_size is"),
        ("preprocess", None, "the graph's pixels input"),  # img_size edited in both places: the graph disagrees
        ("class_names", ["only", "three", "labels"], "the number of class_names is [3] but the graph's logits width"),
        ("mean", [0.0, 0.0, 0.0], "mean is [0.0, 0.0, 0.0] but preprocess mean is"),
    ],
)
def test_a_model_whose_metadata_disagrees_with_itself_or_the_graph_is_refused(tiny_onnx, tmp_path, key, value, says):
    model = onnx.load(tiny_onnx)
    props = {p.key: p for p in model.metadata_props}
    if key == "preprocess":
        pre = json.loads(props["preprocess"].value)
        pre["img_size"] = [64, 64]
        props["preprocess"].value = json.dumps(pre)
        props["input_size"].value = json.dumps([64, 64])
        props["grid_size"].value = json.dumps([64 // json.loads(props["patch_size"].value)] * 2)
    else:
        props[key].value = json.dumps(value)
    edited = tmp_path / "edited.onnx"
    onnx.save(model, edited)
    with pytest.raises(ValueError, match=re.escape(says)):
        OnnxClassifier(edited)


@pytest.mark.parametrize("side", [7_000, 20_000])  # under and over Pillow's own decompression-bomb limits
def test_an_oversized_image_is_refused_naming_our_pixel_limit(side):
    from tests.serve.test_api import huge_png_header

    with pytest.raises(ImageError, match="over the limit of 40,000,000; resize it first") as e:
        load_image(huge_png_header(side, side), max_pixels=40_000_000)
    assert e.value.kind == "too_large" and f"{side * side:,} pixels" in str(e.value)
