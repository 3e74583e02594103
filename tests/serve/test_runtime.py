"""serve.runtime.classifier without torch: loading, predictions, rollout, refusals of bad files and images.

The parity with the torch model and the training transform is in test_runtime_parity.py."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, PngImagePlugin

from serve.runtime.classifier import OnnxClassifier
from serve.runtime.images import ImageError, load_image, load_reduced
from serve.runtime.model_file import ModelFileError
from serve.runtime.rollout import attention_rollout
from tests.helpers import huge_png_header, mixed_images

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


def test_every_image_source_gives_the_same_prediction(tiny_onnx, tmp_path):
    clf = OnnxClassifier(tiny_onnx)
    img = mixed_images(1)[1].convert("RGB")
    path = tmp_path / "x.png"
    img.save(path)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    results = clf.predict([img, path, str(path), buf.getvalue(), np.asarray(img)], top_k=3)
    assert all(r == results[0] for r in results)
    probs = [p for _, p in results[0]]
    assert probs == sorted(probs, reverse=True) and len(probs) == 3


def test_rollout_blocks_selects_a_range_of_blocks(tiny_onnx):
    clf = OnnxClassifier(tiny_onnx)
    pixels = np.stack([clf.prepare(img) for img in mixed_images(3)])
    _, attns = clf.attentions(pixels)
    assert attns.shape == (clf.depth, len(pixels), clf.num_heads, 17, 17)
    _, last = clf.rollout(pixels, blocks=(1, 2))
    expected = attention_rollout(attns[1:2], num_prefix_tokens=1).reshape(last.shape)
    np.testing.assert_allclose(last, expected, atol=1e-6)
    with pytest.raises(ValueError, match="selects no block"):
        clf.rollout(pixels, blocks=(5, 6))


def test_a_wrongly_shaped_batch_is_refused_with_the_expected_shape(tiny_onnx):
    clf = OnnxClassifier(tiny_onnx)
    with pytest.raises(ValueError, match=r"expected \(B, 32, 32, 3\) uint8"):
        clf.predict_pixels(np.zeros((1, 64, 64, 3), np.uint8))
    with pytest.raises(ImageError):
        clf.predict(b"not an image at all")


def test_out_of_range_arguments_are_refused_and_a_generator_of_images_is_classified(tiny_onnx):
    """batch_size=-1 returned [] (every result lost), top_k=0 was read as 1, a 0 x 0 array divided by zero, an empty
    batch failed in numpy, target=2.5 explained class 2, and a generator was taken for one path."""
    clf = OnnxClassifier(tiny_onnx)
    image = np.full((32, 32, 3), 200, np.uint8)
    for kwargs, says in [
        ({"batch_size": -1}, "batch_size"),
        ({"batch_size": 0}, "batch_size"),
        ({"top_k": 0}, "top_k"),
    ]:
        with pytest.raises(ValueError, match=says):
            clf.predict([image] * 3, **kwargs)
    with pytest.raises(ImageError, match="empty"):
        clf.predict(np.zeros((0, 0, 3), np.uint8))
    with pytest.raises(ValueError, match="at least one image"):
        clf.predict_pixels(np.zeros((0, 32, 32, 3), np.uint8))
    if clf.supports_gradients:
        with pytest.raises(ValueError, match="target"):
            clf.gradient_rollout(image[None], target=2.5)
    assert len(clf.predict(img for img in [image, image])) == 2
    assert len(clf.predict([image] * 3, top_k=np.int64(2), batch_size=np.int64(2))) == 3  # numpy's ints are whole


def test_a_folder_reached_twice_is_listed_under_its_first_name(tmp_path):
    from serve.runtime.image_files import walk_image_files

    (tmp_path / "a" / "sub").mkdir(parents=True)
    for path in (tmp_path / "a" / "1.png", tmp_path / "a" / "sub" / "2.png"):
        Image.new("RGB", (4, 4)).save(path)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "link_a").symlink_to(tmp_path / "a")
    found, errors = walk_image_files(tmp_path)
    assert found == [str(tmp_path / "a" / "1.png"), str(tmp_path / "a" / "sub" / "2.png")] and errors == []


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
    onnx = pytest.importorskip("onnx")  # edits the file
    model = onnx.load(tiny_onnx)
    del model.metadata_props[:]
    foreign = tmp_path / "foreign.onnx"
    onnx.save(model, foreign)
    with pytest.raises(ValueError, match="no vitscope metadata"):
        OnnxClassifier(foreign)


def test_a_model_with_external_data_is_refused_before_loading(tiny_onnx, tmp_path):
    onnx = pytest.importorskip("onnx")  # edits the file
    model = onnx.load(tiny_onnx)
    external = tmp_path / "external.onnx"
    onnx.save(model, external, save_as_external_data=True, location="weights.bin", size_threshold=0)
    assert (tmp_path / "weights.bin").exists()
    with pytest.raises(ModelFileError, match="external data"):
        OnnxClassifier(external)


def test_session_options_set_the_intra_op_threads_only():
    from serve.runtime.session import session_options

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


IMAGE_ERROR_KINDS = {"corrupt", "not_an_image", "too_large", "empty", "non_finite", "unsupported"}


@pytest.mark.filterwarnings("ignore")  # PIL warns about the damage it tolerates
@pytest.mark.parametrize("fmt, mode", [("TIFF", "I;16"), ("TIFF", "RGB"), ("BMP", "RGB"), ("GIF", "P"), ("PNG", "LA")])
def test_a_damaged_file_is_an_image_error_never_another_exception(fmt, mode):
    buf = io.BytesIO()
    Image.new(mode, (40, 48)).save(buf, format=fmt)
    good = np.frombuffer(buf.getvalue(), np.uint8)
    rng = np.random.default_rng(0)
    refused = 0
    for _ in range(300):  # flip a few bytes, mostly in the header where the parsers live
        bad = good.copy()
        at = rng.integers(0, min(len(bad), 256), size=rng.integers(1, 4))
        bad[at] = rng.integers(0, 256, size=len(at))
        try:  # any exception but ImageError fails the test: it would be an HTTP 500 in the server
            img = load_image(bad.tobytes())
        except ImageError as e:
            refused += 1
            assert e.kind in IMAGE_ERROR_KINDS and str(e), e
        else:  # damage Pillow tolerates must still give what the model takes
            assert img.mode == "RGB" and img.width > 0 and img.height > 0
    assert refused > 0  # the damage is seen, not only tolerated


def test_only_the_documented_formats_are_decoded():
    with pytest.raises(ImageError, match="not an image") as e:
        load_image(b"P6\n4x 4\n255\n")  # a PPM header: PIL reads PPM, we do not
    assert e.value.kind == "not_an_image"


def test_a_file_with_an_image_signature_and_a_header_that_cannot_be_read_is_called_damaged():
    """A PNG whose header fails its checksum, or a JPEG cut after its first bytes, was "not an image: no JPEG, PNG,
    GIF, BMP, WebP or TIFF header found", though it starts with that header's signature."""
    png = io.BytesIO()
    Image.new("RGB", (4, 4)).save(png, "PNG")
    bad_crc = bytearray(png.getvalue())
    bad_crc[29] ^= 0xFF  # the IHDR chunk's checksum
    for data, kind in ((bytes(bad_crc), "PNG"), (b"\xff\xd8\xff\xe0" + bytes(20), "JPEG")):
        with pytest.raises(ImageError, match=f"is a damaged {kind} file: its header cannot be read") as e:
            load_image(data)
        assert e.value.kind == "corrupt"


@pytest.mark.parametrize("brand, kind", [(b"heic", "HEIC or HEIF"), (b"mif1", "HEIC or HEIF"), (b"avif", "AVIF")])
def test_a_phone_photo_in_a_format_not_read_says_so_and_what_to_do(tmp_path: Path, brand: bytes, kind: str):
    """An iPhone's HEIC photo was "not an image: no JPEG, PNG ... header found"."""
    photo = tmp_path / "IMG_0001.HEIC"
    photo.write_bytes(b"\x00\x00\x00\x18ftyp" + brand + bytes(64))
    for source in (photo, photo.read_bytes()):
        with pytest.raises(ImageError, match=f"is a {kind} image, which is not read: convert it to JPEG or PNG") as e:
            load_image(source)
        assert e.value.kind == "unsupported"


def test_a_movie_is_not_an_image_rather_than_a_photo_in_a_format_not_read():
    """An MP4 (an ISO media file, as a HEIC photo is) was called a HEIC photo."""
    with pytest.raises(ImageError, match="not an image: no JPEG") as e:
        load_image(b"\x00\x00\x00\x18ftypisom" + bytes(64))
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
    onnx = pytest.importorskip("onnx")  # edits the file
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
    with pytest.raises(ImageError, match="over the limit of 40,000,000; resize it first") as e:
        load_image(huge_png_header(side, side), max_pixels=40_000_000)
    assert e.value.kind == "too_large" and f"{side * side:,} pixels" in str(e.value)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "PNG with XMP"])
@pytest.mark.parametrize("orientation", [1, 3, 6, 8, None])
def test_images_decode_upright_whatever_carries_their_orientation(fmt, orientation):
    pixels = np.random.default_rng(orientation or 0).integers(0, 256, (6, 10, 3), np.uint8)
    buf, save = io.BytesIO(), {}
    if orientation is not None and fmt == "PNG with XMP":
        save["pnginfo"] = PngImagePlugin.PngInfo()
        tiff = 'xmlns:tiff="http://ns.adobe.com/tiff/1.0/"'
        save["pnginfo"].add_itxt("XML:com.adobe.xmp", f'<rdf:Description {tiff} tiff:Orientation="{orientation}"/>')
    elif orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        save["exif"] = exif.tobytes()
    Image.fromarray(pixels).save(buf, fmt.split()[0], quality=100, lossless=True, **save)
    stored = np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))  # JPEG's own rounding included
    turned = {3: np.rot90(stored, 2), 6: np.rot90(stored, -1), 8: np.rot90(stored, 1)}.get(orientation, stored)
    assert np.array_equal(np.asarray(load_image(buf.getvalue())), turned)
    assert np.array_equal(np.asarray(load_reduced(buf.getvalue(), (10, 10), None)), turned)  # the server's way
