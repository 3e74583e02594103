"""A real browser (Debian's Chromium, driven by Playwright) uploads an image and sees the label and the overlay.

Also writes the README screenshot from the sample model:

    .venv/bin/python -m tests.serve.test_browser artifacts/sample.onnx data/digits/3/<file>.png docs/ui.png
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.helpers import ServerProcess

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def capture_ui(url: str, image: Path, screenshot: Path, timeout_ms: int = 60_000) -> str:
    """Open the UI, upload `image`, wait for the prediction and the overlay, save a screenshot.

    Returns:
        The text of the prediction panel.
    """
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(url, wait_until="domcontentloaded", timeout=timeout_ms)
            page.locator("input[type=file]").first.set_input_files(str(image), timeout=timeout_ms)
            page.locator("#overlay img").first.wait_for(state="visible", timeout=timeout_ms)
            label = page.locator("#label")
            label.locator("text=%").first.wait_for(state="visible", timeout=timeout_ms)
            page.locator("#faithfulness", has_text="Deletion score").wait_for(timeout=timeout_ms)
            page.locator("#trust", has_text="Prediction set").wait_for(timeout=timeout_ms)
            two_frames = "() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))"
            page.evaluate(two_frames)  # the last paint has happened
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(screenshot), full_page=False)
            return label.inner_text() + "\n" + page.locator("#trust").inner_text()
        finally:
            browser.close()


@pytest.mark.browser
@pytest.mark.slow
def test_upload_in_a_real_browser_shows_label_and_overlay(tiny_onnx, tmp_path):
    if not CHROMIUM.exists():
        pytest.skip("Debian's chromium is not installed at /usr/bin/chromium (apt-get install chromium)")
    pytest.importorskip("playwright")
    from serve.runtime.classifier import OnnxClassifier

    img = np.full((32, 32, 3), 30, np.uint8)
    img[18:28, 4:14] = 230
    image = tmp_path / "square.png"
    Image.fromarray(img).save(image)
    expected = OnnxClassifier(tiny_onnx).predict(image, top_k=1)[0][0][0]
    shot = tmp_path / "ui.png"
    with ServerProcess(tiny_onnx, "--examples-dir", "") as server:
        text = capture_ui(server.url + "/", image, shot)
    assert expected in text
    assert "Calibrated confidence" in text and "Prediction set at 90%" in text and "nown" in text
    assert shot.stat().st_size > 10_000 and Image.open(shot).size == (1280, 900)


if __name__ == "__main__":
    model, image, out = sys.argv[1:4]
    with ServerProcess(model) as server:
        print(capture_ui(server.url + "/", Path(image), Path(out)))
