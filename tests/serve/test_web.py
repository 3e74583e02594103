"""`vit-export --web DIR`: the page in a real Chromium, served by a plain static file server on 127.0.0.1.

The page resamples as Pillow does, byte for byte, so the browser's logits are onnxruntime's in Python to
1e-4 for images of any size, its top-1 the same, its rollout map the runtime's (correlation >= 0.999); a
dropped image shows its top-5 and overlay, a broken one an error and no stale answer; once loaded the page
needs no network; a half-copied model file says so on the page.
"""

from __future__ import annotations

import base64
import os
import resource
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from benchmarks.web import CHROMIUM, StaticSite, WebBrowser, classify, classify_bytes, drop_file
from serve.runtime.classifier import OnnxClassifier
from tests.helpers import REPO, encoded, huge_png_header, png_bytes, quadrant_images

pytestmark = [pytest.mark.slow, pytest.mark.browser]
RESAMPLING = {k: getattr(Image.Resampling, k.upper()) for k in ("bicubic", "bilinear", "lanczos", "nearest")}


@pytest.fixture(scope="module")
def site(tiny_checkpoint, tmp_path_factory) -> Path:
    """The folder `vit-export CKPT --web DIR` writes, with a few PNG files beside it to classify."""
    from serve.export.cli import main as export_main
    from serve.export.web import find_ort_dist

    try:
        find_ort_dist()
    except FileNotFoundError as e:
        if shutil.which("npm") is None:
            pytest.skip(f"no npm to install onnxruntime-web with: {e}")
        raise
    folder = tmp_path_factory.mktemp("web") / "site"
    assert export_main([str(tiny_checkpoint), "--web", str(folder)]) == 0
    images, _ = quadrant_images(8, seed=3)
    (folder / "samples").mkdir()
    for i, img in enumerate(images):
        Image.fromarray(img).save(folder / "samples" / f"{i}.png")
        # the same picture at another size and aspect: the page resizes and crops it as Preprocess does
        Image.fromarray(img).resize((50, 40), Image.Resampling.BICUBIC).save(folder / "samples" / f"{i}_50x40.png")
    return folder


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.skip("Debian's chromium is not installed at /usr/bin/chromium (apt-get install chromium)")
    pytest.importorskip("playwright")
    with WebBrowser() as b:
        yield b
    assert not b.blocked, f"the page reached beyond 127.0.0.1: {b.blocked}"


def test_the_browser_gives_onnxruntimes_logits_top1_and_rollout(site, browser):
    clf = OnnxClassifier(site / "model.onnx")
    with StaticSite(site) as server:
        page = browser.open(server.url)
        for i in range(8):
            got = classify(page, f"samples/{i}.png")
            pixels = clf.prepare(site / "samples" / f"{i}.png")[None]
            logits = clf.logits(pixels)[0]
            np.testing.assert_allclose(got["logits"], logits, atol=1e-4, rtol=0)
            assert got["labels"] == clf.labels
            assert got["top"][0]["label"] == clf.labels[int(logits.argmax())]
            np.testing.assert_allclose(
                [t["score"] for t in got["top"]], sorted(clf.predict_pixels(pixels)[0])[::-1], atol=1e-5
            )
            verdict = clf.assess(pixels)  # the file's Mahalanobis score and threshold, computed in the page too
            assert got["ood_score"] == pytest.approx(float(verdict.ood_scores[0]), rel=1e-4, abs=1e-3)
            assert got["unknown"] == bool(verdict.unknown[0])
            _, maps = clf.rollout(pixels)
            assert got["rollout"]["grid"] == list(clf.grid_size)
            assert np.corrcoef(got["rollout"]["values"], maps[0].ravel())[0, 1] >= 0.999

            resized = classify(page, f"samples/{i}_50x40.png")  # resized and cropped by the page, as by Pillow
            logits = clf.logits(clf.prepare(site / "samples" / f"{i}_50x40.png")[None])[0]
            np.testing.assert_allclose(resized["logits"], logits, atol=1e-4, rtol=0)
    assert not browser.errors, browser.errors


def test_the_pages_confidence_map_gives_the_runtimes_calibrated_probabilities(site, browser):
    from serve.runtime import calibration as cal

    rng = np.random.default_rng(0)
    logits = rng.normal(0, 4, (50, 10))
    scaled = cal.softmax(logits, 0.7)
    knots = cal.fit_confidence_map(scaled.max(1), rng.random(50) < scaled.max(1) ** 2, 10)
    calibration = {
        "temperature": 0.7,
        "confidence_map": {"confidence": knots[0].tolist(), "accuracy": knots[1].tolist()},
    }
    with StaticSite(site) as server:
        page = browser.open(server.url)
        got = page.evaluate(
            "async ([logits, c]) => { const m = await import('./vitscope.js');"
            " return logits.map((l) => m.calibratedSoftmax(l, c)); }",
            [logits.tolist(), calibration],
        )
    np.testing.assert_allclose(got, cal.calibrated_softmax(logits, 0.7, knots), atol=1e-6)


@pytest.mark.parametrize("interpolation", ["bicubic", "bilinear", "lanczos", "nearest"])
def test_the_pages_resampling_is_pillows_pixel_for_pixel(site, browser, interpolation):
    """Up and down, odd sizes, a photo-sized shrink: the page's `resize` gives Pillow's bytes exactly."""
    rng = np.random.default_rng(0)
    with StaticSite(site) as server:
        page = browser.open(server.url)
        for (w, h), (nw, nh) in [
            ((50, 40), (32, 27)),
            ((20, 30), (37, 55)),
            ((640, 480), (37, 28)),
            ((33, 7), (33, 19)),
        ]:
            smooth = Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)).resize((w, h), Image.BICUBIC)
            src = np.clip(np.asarray(smooth, int) + rng.integers(-40, 40, (h, w, 3)), 0, 255).astype(np.uint8)
            want = np.asarray(Image.fromarray(src).resize((nw, nh), RESAMPLING[interpolation]))
            got = page.evaluate(
                """async ([b64, w, h, nw, nh, how]) => {
                  const m = await import('./vitscope.js');
                  const src = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
                  return Array.from(m.resize(src, w, h, nw, nh, how));
                }""",
                [base64.b64encode(src.tobytes()).decode(), w, h, nw, nh, interpolation],
            )
            np.testing.assert_array_equal(np.array(got, np.uint8).reshape(nh, nw, 3), want)


@pytest.mark.parametrize("interpolation", ["bicubic", "bilinear", "lanczos", "nearest"])
def test_the_pages_resize_and_crop_is_preprocess_pixel_for_pixel(site, browser, interpolation):
    """Preprocess.resize_crop resamples only the part its crop keeps (an image a million pixels tall would be
    gigabytes resized whole): the page does the same, to the byte, tall and wide images included."""
    from serve.runtime.images import Preprocess

    rng = np.random.default_rng(1)
    with StaticSite(site) as server:
        page = browser.open(server.url)
        for (w, h), side, crop_pct in [
            ((50, 40), 28, 1.0),
            ((3, 700), 32, 0.875),
            ((700, 3), 28, 0.9),
            ((28, 28), 28, 1.0),
            ((33, 41), 32, 1.0),
            ((640, 480), 32, 0.875),
        ]:
            src = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            pre = Preprocess((side, side), crop_pct, interpolation)
            want = np.asarray(pre.resize_crop(Image.fromarray(src)))
            got = page.evaluate(
                """async ([b64, w, h, pre]) => {
                  const m = await import('./vitscope.js');
                  const src = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
                  const g = m.resizeCrop(w, h, pre);
                  if (g.newW === w && g.newH === h) return null;  // the crop alone: toPixels copies it
                  return Array.from(m.resize(src, w, h, g.W, g.H, pre.interpolation, g.box));
                }""",
                [base64.b64encode(src.tobytes()).decode(), w, h, pre.to_dict()],
            )
            if got is None:
                left, top = (w - side) // 2, (h - side) // 2
                got = src[top : top + side, left : left + side]
            np.testing.assert_array_equal(np.array(got, np.uint8).reshape(side, side, 3), want, err_msg=f"{w}x{h}")


def test_a_dropped_image_shows_its_top5_and_overlay_and_a_broken_one_an_error_not_the_last_answer(site, browser):
    clf = OnnxClassifier(site / "model.onnx")
    good = (site / "samples" / "2.png").read_bytes()
    expected = clf.predict(site / "samples" / "2.png", top_k=1)[0][0][0]
    with StaticSite(site) as server:
        page = browser.open(server.url)
        page.locator("#status", has_text="Ready: 4 classes").wait_for()
        drop_file(page, "two.png", good)
        page.locator("#result").wait_for(state="visible")
        assert page.locator("#answer").inner_text().startswith(expected)
        assert page.locator("#top li").count() == 4  # the top-5 of a 4-class model
        assert page.locator("#error").is_hidden()
        # the overlay is drawn: the canvas is the image blended with the map, not one flat colour
        spread = page.evaluate(
            """() => {
              const c = document.getElementById('view');
              const red = c.getContext('2d').getImageData(0, 0, c.width, c.height).data.filter((_, i) => i % 4 === 0);
              return Math.max(...red) - Math.min(...red);
            }"""
        )
        assert spread > 50

        drop_file(page, "broken.png", good[: len(good) // 3])
        page.locator("#error").wait_for(state="visible")
        assert "not an image this browser can decode" in page.locator("#error").inner_text()
        assert page.locator("#result").is_hidden() and page.locator("#top li").count() == 0
        assert "broken.png: failed" in page.locator("#status").inner_text()

        with pytest.raises(Exception, match="is empty"):
            classify_bytes(page, b"")
        drop_file(page, "two.png", good)  # a good image after the error: the error goes, the answer comes
        page.locator("#result").wait_for(state="visible")
        assert page.locator("#error").is_hidden()


def _bmp_header(width: int, height: int) -> bytes:
    """A BMP file's headers (8-bit grey, rows top-down: a negative height) and its first bytes of pixels."""
    info = struct.pack("<IiiHHIIiiII", 40, width, -height, 1, 8, 0, width * height, 2835, 2835, 256, 0)
    palette = b"".join(bytes([i, i, i, 0]) for i in range(256))
    offset = 14 + len(info) + len(palette)
    return b"BM" + struct.pack("<IHHI", offset + width * height, 0, 0, offset) + info + palette + bytes(4096)


def _gif_with_a_large_frame(width: int, height: int) -> bytes:
    """A GIF whose screen is 100 x 100 and whose first frame, after a comment, is `width` x `height`."""
    comment = b"\x21\xfe" + b"".join(b"\xff" + bytes(255) for _ in range(8)) + b"\x00"
    frame = b"\x2c" + struct.pack("<HHHH", 0, 0, width, height) + b"\x00" + b"\x02\x02\x44\x01\x00"
    return b"GIF89a" + struct.pack("<HH", 100, 100) + b"\x00\x00\x00" + comment + frame + b"\x3b"


@pytest.mark.parametrize(
    ("fmt", "options"),
    [("PNG", {}), ("JPEG", {"exif": b"Exif\x00\x00" + bytes(40_000)}), ("GIF", {}), ("WEBP", {}), ("BMP", {})],
)
def test_an_image_over_the_pixel_limit_is_refused_from_its_header_with_its_size(site, browser, fmt, options):
    """createImageBitmap decodes every pixel before the size can be seen (about 2 s and 1.6 GB for a 20,000 x
    20,000 PNG in Chromium), and the message read the size of the closed bitmap: '0 x 0 pixels'. A JPEG's size
    comes after its other segments (here 40 kB of EXIF) and any fill bytes. A BMP, a GIF frame larger than its
    screen and a JPEG whose frame came after its first MiB were sized only once decoded (2.8 GB for a 16,000 x
    16,000 BMP)."""
    lossless = {"lossless": True} if fmt == "WEBP" else {}
    files = {(8000, 6000): encoded(Image.new("L", (8000, 6000), 128), fmt, **options, **lossless)}
    if fmt == "PNG":  # a header that claims a size the browser would not decode at all
        files[20000, 20000] = huge_png_header(20000, 20000)
    if fmt == "JPEG":  # fill bytes before the start of frame, which the format allows
        jpeg = files[8000, 6000]
        files[8000, 6000] = jpeg.replace(b"\xff\xc0", b"\xff\xff\xff\xc0", 1)
        app15 = b"\xff\xef" + struct.pack(">H", 65535) + bytes(65533)  # 20 such segments: 1.3 MB before the frame
        files[8000, 6001] = jpeg[:2] + app15 * 20 + jpeg[2:].replace(b"\x17\x70\x1f\x40", b"\x17\x71\x1f\x40", 1)
        stray = jpeg[:20] + b"\x00\x00" + jpeg[20:]  # two bytes after the JFIF segment, which decoders skip
        files[8000, 6002] = stray.replace(b"\x17\x70\x1f\x40", b"\x17\x72\x1f\x40", 1)
    if fmt == "GIF":
        files[7000, 7000] = _gif_with_a_large_frame(7000, 7000)
    if fmt == "BMP":  # its headers decide: the rest of 48 MB of pixels cost a minute of the page's CPU to pass in
        files[8000, 6000] = files[8000, 6000][:65536]
        files[16000, 16000] = _bmp_header(16000, 16000)
    with StaticSite(site) as server:
        page = browser.open(server.url)
        page.evaluate(
            """() => {
              window.decoded = 0;
              const decode = window.createImageBitmap;
              window.createImageBitmap = (...args) => { window.decoded += 1; return decode(...args); };
            }"""
        )
        for (w, h), data in files.items():
            with pytest.raises(Exception, match=f"is {w} x {h} pixels, over the limit of 40,000,000; resize it first"):
                classify_bytes(page, data, f"image/{fmt.lower()}")
        assert page.evaluate("window.decoded") == 0
        small = Image.fromarray(quadrant_images(1)[0][0])  # and an image under the limit is classified
        assert classify_bytes(page, encoded(small, fmt, **options, **lossless), f"image/{fmt.lower()}")["top"]
        assert page.evaluate("window.decoded") == 1


def test_once_loaded_the_page_classifies_with_the_network_cut(site, browser):
    data = png_bytes(quadrant_images(1, seed=9)[0][0])
    with StaticSite(site) as server:
        page = browser.open(server.url)
        browser.offline = True  # every request from now on is aborted
        try:
            got = classify_bytes(page, data)
            page.locator("#file").set_input_files(files=[{"name": "a.png", "mimeType": "image/png", "buffer": data}])
            page.locator("#result").wait_for(state="visible")
        finally:
            browser.offline = False
    assert len(got["logits"]) == 4 and got["top"][0]["score"] > 0.5
    browser.blocked.clear()  # what was cut on purpose


def test_a_half_copied_model_file_says_so_on_the_page(site, browser, tmp_path):
    broken = tmp_path / "site"
    shutil.copytree(site, broken)
    data = (site / "model.onnx").read_bytes()
    (broken / "model.onnx").write_bytes(data[: len(data) // 2])
    with StaticSite(broken) as server:
        page = browser.open(server.url, wait_ready=False)
        page.locator("#error").wait_for(state="visible")
        assert "model.onnx is truncated: copy the whole file again" in page.locator("#error").inner_text()
        assert page.locator("#status").inner_text() == "The model did not load."


def test_web_export_refuses_what_the_browser_cannot_run_with_what_to_do(tiny_onnx, tmp_path, capsys):
    pytest.importorskip("onnx")  # the exporter's; the [serve]-only venv has none
    from serve.export.cli import main as export_main

    # the default (onnxruntime) target has contrib ops and no attention output on its fast path
    assert export_main([str(tiny_onnx), "--web", str(tmp_path / "a")]) == 2
    assert "the browser needs --target portable" in capsys.readouterr().err
    corrupt = tmp_path / "half.onnx"
    corrupt.write_bytes(tiny_onnx.read_bytes()[:1000])
    assert export_main([str(corrupt), "--web", str(tmp_path / "b")]) == 2
    assert "half.onnx is truncated or not an ONNX file" in capsys.readouterr().err
    assert export_main([str(tiny_onnx), "--web", str(tmp_path / "c"), "--ort-web", str(tmp_path / "nowhere")]) == 2
    assert "npm ci --prefix" in capsys.readouterr().err
    assert export_main([str(tiny_onnx), "-o", str(tmp_path / "x.onnx")]) == 2  # an .onnx without --web
    assert "vit-export MODEL.onnx --web DIR packages" in capsys.readouterr().err
    for option in (["--quantize", "int8"], ["-o", str(tmp_path / "x.onnx")], ["--calibrate", str(tmp_path)]):
        with pytest.raises(SystemExit) as e:  # taken and not applied, exit 0
            export_main([str(tiny_onnx), "--web", str(tmp_path / "d"), *option])
        assert e.value.code == 2 and f"{option[0]} would change nothing" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def _web_model(path: Path, note: str = "") -> Path:
    """A file the page accepts (standard ops, logits and attns out, vitscope metadata), written to `path`."""
    onnx = pytest.importorskip("onnx")  # the exporter's; the [serve]-only venv has none
    h = onnx.helper
    nodes = [h.make_node("Identity", ["pixels"], [name]) for name in ("logits", "attns")]
    tensor = [h.make_tensor_value_info(n, onnx.TensorProto.FLOAT, ["B", 3]) for n in ("pixels", "logits", "attns")]
    model = h.make_model(h.make_graph(nodes, "g", tensor[:1], tensor[1:]), opset_imports=[h.make_opsetid("", 17)])
    onnx.helper.set_model_props(model, {"vitscope_format": "1"})
    model.doc_string = note
    onnx.save(model, path)
    return path


def test_a_page_written_again_onto_a_full_disk_leaves_the_earlier_page_whole(tmp_path):
    """Files were copied over the earlier page's one by one: a full disk left a truncated onnxruntime-web and the
    model's temporary copy, and the page that worked no longer loaded."""
    pytest.importorskip("onnx")  # the exporter's; the [serve]-only venv has none
    from serve.export import web

    try:
        web.find_ort_dist()
    except FileNotFoundError as e:
        pytest.skip(f"onnxruntime-web is not installed: {e}")
    folder = web.write_web(_web_model(tmp_path / "a.onnx"), tmp_path / "site")
    before = {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
    model = _web_model(tmp_path / "b.onnx", note="another model")
    write = f"from serve.export.web import write_web; write_web({str(model)!r}, {str(folder)!r})"

    def full_disk_at_one_mib() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails (EFBIG) as it would for a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", write], env=env, capture_output=True, text=True,
                          preexec_fn=full_disk_at_one_mib, timeout=120)  # fmt: skip
    assert done.returncode == 1 and "OSError" in done.stderr and "ort-wasm-simd-threaded.wasm" in done.stderr
    after = {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
    assert after == before, [p.name for p in set(after) ^ set(before)] or "a file of the earlier page was changed"


def test_a_folder_with_a_page_no_export_wrote_is_refused_and_left_as_it_was(tmp_path, capsys):
    """`--web DIR` over the user's own index.html replaced it (and page.js, page.css), exit 0, without a word."""
    pytest.importorskip("onnx")  # the exporter's; the [serve]-only venv has none
    from serve.export import web
    from serve.export.cli import main as export_main

    try:
        web.find_ort_dist()
    except FileNotFoundError as e:
        pytest.skip(f"onnxruntime-web is not installed: {e}")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "index.html").write_text("MY PAGE")
    assert export_main([str(_web_model(tmp_path / "a.onnx")), "--web", str(mine)]) == 2
    err = capsys.readouterr().err
    assert f"--web {mine} holds index.html, which no vit-export --web wrote" in err, err
    assert [p.name for p in mine.iterdir()] == ["index.html"] and (mine / "index.html").read_text() == "MY PAGE"
    site = web.write_web(_web_model(tmp_path / "b.onnx"), tmp_path / "site")  # an earlier page: replaced
    assert web.write_web(_web_model(tmp_path / "c.onnx", note="again"), site) == site


def test_a_first_page_stopped_after_its_first_rename_is_still_taken_for_ours(tmp_path, monkeypatch):
    """`ort/NOTICE` was renamed into place last: a first `--web` stopped after `index.html` left a page that its
    own retry refused as one no `--web` wrote."""
    pytest.importorskip("onnx")  # the exporter's; the [serve]-only venv has none
    from serve.export import files, web

    try:
        web.find_ort_dist()
    except FileNotFoundError as e:
        pytest.skip(f"onnxruntime-web is not installed: {e}")
    replace, renamed = os.replace, []

    def stopped_after_the_first(src, dst):
        if renamed:
            raise KeyboardInterrupt  # Ctrl-C between two renames
        renamed.append(dst)
        replace(src, dst)

    monkeypatch.setattr(files.os, "replace", stopped_after_the_first)
    with pytest.raises(KeyboardInterrupt):
        web.write_web(_web_model(tmp_path / "a.onnx"), tmp_path / "site")
    monkeypatch.setattr(files.os, "replace", replace)
    assert [Path(p).name for p in renamed] == ["NOTICE"]
    assert web.write_web(_web_model(tmp_path / "a.onnx"), tmp_path / "site") == tmp_path / "site"
