"""The page `vit-export --web` writes, in Chromium: how fast it is against onnxruntime in Python on the same file,
and the driver that its tests (`tests/serve/test_web.py`) and the browser guide's screenshot (`tests.web_page`)
use too.

    make sample && .venv/bin/python -m benchmarks.web
    .venv/bin/python -m benchmarks.web --variants vit_micro_patch4_32 --images 20

    with StaticSite(folder) as site, WebBrowser() as browser:
        page = browser.open(site.url)             # waits for window.vitscope.ready
        result = classify(page, "samples/a.png")  # {labels, logits, probs, top, rollout}

Chromium is Debian's (`/usr/bin/chromium`), driven by Playwright; every request that is not for 127.0.0.1 is
aborted and recorded in `WebBrowser.blocked`, so a page that reached for a CDN fails its test. The benchmark
serves each variant's page (random weights) plain (one WASM thread) and cross-origin isolated (WASM threads), and
times page load (to `window.vitscope.ready`, fresh context), `classify` per image inside the page, and Python's
`prepare` + `rollout` with as many threads; parity is on noise images of random sizes.
"""

from __future__ import annotations

import argparse
import base64
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks import common
from benchmarks.servers import random_model_file, sample_image
from serve.runtime.classifier import OnnxClassifier
from serve.server.testing import free_port, noise_png, wait_until

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]
# the numbers classify returns, without the RGBA crop the page draws (which does not cross to Python)
CLASSIFY_JS = """async (source) => {
  const r = await window.vitscope.classify(source);
  return {labels: r.labels, logits: r.logits, probs: r.probs, top: r.top, rollout: r.rollout, unknown: r.unknown,
          ood_score: r.ood_score};
}"""
BLOB_JS = """async ([b64, type]) => {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const r = await window.vitscope.classify(new Blob([bytes], {type}));
  return {logits: r.logits, top: r.top, rollout: r.rollout};
}"""


class StaticSite:
    """`python -m http.server` serving `folder` on a free port of 127.0.0.1, as any static host would.

    Args:
        folder: the folder `vit-export --web` wrote.
        isolated: send the cross-origin isolation headers (COOP and COEP) that WASM threads need.
    """

    def __init__(self, folder: str | Path, isolated: bool = False):
        self.folder, self.isolated = Path(folder), isolated
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> StaticSite:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", STATIC_SERVER, str(self.port), "isolated" if self.isolated else "plain"],
            cwd=self.folder,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

        def up() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the static server exited with {self.proc.returncode}")
            try:
                return httpx.get(self.url + "index.html", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(up, 20, f"the static server on {self.url}")
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)


# http.server, and with `isolated` the two headers that make the page cross-origin isolated (WASM threads)
STATIC_SERVER = """
import http.server, sys
class Isolated(http.server.SimpleHTTPRequestHandler):
    def end_headers(self):
        self.send_header("Cross-Origin-Opener-Policy", "same-origin")
        self.send_header("Cross-Origin-Embedder-Policy", "require-corp")
        super().end_headers()
handler = Isolated if sys.argv[2] == "isolated" else http.server.SimpleHTTPRequestHandler
http.server.test(HandlerClass=handler, port=int(sys.argv[1]), bind="127.0.0.1")
"""


class WebBrowser:
    """Headless Chromium through Playwright, with the network cut down to 127.0.0.1."""

    def __init__(self, timeout_ms: int = 60_000):
        self.timeout_ms = timeout_ms
        self.blocked: list[str] = []
        self.errors: list[str] = []
        self.offline = False

    def __enter__(self) -> WebBrowser:
        from playwright.sync_api import sync_playwright

        if not CHROMIUM.exists():
            raise FileNotFoundError(f"no Chromium at {CHROMIUM}: apt-get install chromium")
        self._pw = sync_playwright().start()
        self.browser = self._pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        return self

    def __exit__(self, *exc) -> None:
        self.browser.close()
        self._pw.stop()

    def _route(self, route) -> None:
        url = route.request.url
        if self.offline or not url.startswith(("http://127.0.0.1:", "data:", "blob:")):
            self.blocked.append(url)
            route.abort()
        else:
            route.continue_()

    def open(self, url: str, wait_ready: bool = True) -> Any:
        """A new page at `url`; with `wait_ready`, returned once `window.vitscope.ready` has resolved."""
        page = self.browser.new_page()
        page.set_default_timeout(self.timeout_ms)
        page.route("**/*", self._route)
        page.on("pageerror", lambda e: self.errors.append(str(e)))
        page.goto(url, wait_until="domcontentloaded")
        return ready(page) if wait_ready else page


def ready(page: Any) -> Any:
    """`page` once its `window.vitscope.ready` has resolved (the model fetched, the WASM compiled, the session made)."""
    page.wait_for_function("() => window.vitscope !== undefined")
    page.evaluate("async () => { await window.vitscope.ready; }")
    return page


def classify(page: Any, source: str) -> dict[str, Any]:
    """`window.vitscope.classify(source)` for a URL relative to the page."""
    return page.evaluate(CLASSIFY_JS, source)


def classify_bytes(page: Any, data: bytes, mime: str = "image/png") -> dict[str, Any]:
    """`window.vitscope.classify(blob)` for encoded image bytes built into a Blob inside the page."""

    return page.evaluate(BLOB_JS, [base64.b64encode(data).decode(), mime])


def drop_file(page: Any, name: str, data: bytes, mime: str = "image/png") -> None:
    """Drop a file on the page's drop zone, as a user dragging it from a file manager does."""
    page.evaluate(
        """([name, b64, type]) => {
          const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
          const transfer = new DataTransfer();
          transfer.items.add(new File([bytes], name, {type}));
          const zone = document.getElementById("drop");
          for (const kind of ["dragenter", "dragover", "drop"]) {
            zone.dispatchEvent(new DragEvent(kind, {dataTransfer: transfer, bubbles: true, cancelable: true}));
          }
        }""",
        [name, base64.b64encode(data).decode(), mime],
    )


TIMED_JS = """async ([b64, n]) => {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const blob = new Blob([bytes], {type: "image/png"});
  await window.vitscope.classify(blob);  // warm-up
  const times = [], model = [];
  for (let i = 0; i < n; i++) {
    const t0 = performance.now();
    const r = await window.vitscope.classify(blob);
    times.push(performance.now() - t0);
    model.push(r.timings.model_ms);
  }
  return {times, model, isolated: self.crossOriginIsolated, threads: window.vitscope.ort.env.wasm.numThreads};
}"""


def python_ms(model: Path, png: bytes, threads: int | None, n: int) -> tuple[float, float]:
    """Median ms of prepare + rollout (what the page does per image), and of the graph alone (`attentions`)."""
    clf = OnnxClassifier(model, threads=threads)
    pixels = clf.prepare(png)[None]
    clf.rollout(pixels)  # warm-up
    whole, graph = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        clf.rollout(clf.prepare(png)[None])
        t1 = time.perf_counter()
        clf.attentions(pixels)
        whole.append(t1 - t0)
        graph.append(time.perf_counter() - t1)
    return 1000 * statistics.median(whole), 1000 * statistics.median(graph)


def browser_figures(browser: WebBrowser, url: str, png: bytes, loads: int, images: int) -> dict:
    load_s = []
    for _ in range(loads):
        context = browser.browser.new_context()  # no cache from the last load
        page = context.new_page()
        t0 = time.perf_counter()
        page.goto(url, wait_until="domcontentloaded")
        ready(page)
        load_s.append(time.perf_counter() - t0)
        if len(load_s) < loads:
            context.close()
    timed = page.evaluate(TIMED_JS, [base64.b64encode(png).decode(), images])
    context.close()
    return {
        "load_s": statistics.median(load_s),
        "ms": statistics.median(timed["times"]),
        "model_ms": statistics.median(timed["model"]),
        **timed,
    }


def parity(browser: WebBrowser, url: str, clf: OnnxClassifier, images: int) -> dict:
    """The page against onnxruntime in Python on noise images of random sizes, 0.5x to 3x the input on each side
    (so resized and cropped by the page and by Pillow)."""
    page = browser.open(url)
    H, W = clf.input_size
    rng = np.random.default_rng(0)
    worst, corr, same = 0.0, 1.0, 0
    for i in range(images):
        png = noise_png(i, (int(H * rng.uniform(0.5, 3)), int(W * rng.uniform(0.5, 3))))
        got = classify_bytes(page, png)
        pixels = clf.prepare(png)[None]
        _, maps = clf.rollout(pixels)
        logits = clf.logits(pixels)[0]
        worst = max(worst, float(np.abs(np.asarray(got["logits"]) - logits).max()))
        corr = min(corr, float(np.corrcoef(got["rollout"]["values"], maps[0].ravel())[0, 1]))
        same += got["top"][0]["label"] == clf.labels[int(logits.argmax())]
    page.close()
    return {"worst": worst, "corr": corr, "same": same}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", default=["vit_micro_patch4_32", "vit_tiny_patch16_224"])
    p.add_argument("--data", type=Path, default=ROOT / "data" / "digits", help="class folders (labels, one image)")
    p.add_argument("--loads", type=int, default=3, help="page loads per variant and server")
    p.add_argument("--images", type=int, default=20, help="timed images per variant and server")
    common.add_results_option(p)
    args = p.parse_args()
    from serve.export.web import ort_web_version, write_web  # the exporter (onnx): the tests import this module too

    result = common.Result(
        "web",
        {"loads": args.loads, "images": args.images, "onnxruntime-web": ort_web_version()},
        packages=("onnxruntime", "playwright"),
        results=args.results,
    )
    table = result.table(
        ["model", "file MB", "server", "WASM threads", "page load s", "browser ms/image", "Python ms/image",
         "browser / Python", "graph alone: browser ms", "Python ms"],
        formats={"file MB": "{:.1f}", "page load s": "{:.2f}", "browser ms/image": "{:.1f}",
                 "Python ms/image": "{:.1f}", "browser / Python": "{:.2f}x", "graph alone: browser ms": "{:.1f}",
                 "Python ms": "{:.1f}"},
    )  # fmt: skip
    agree = result.table(
        ["model", "images", "largest logit difference", "lowest rollout correlation", "top-1 agreement"],
        title="The page against onnxruntime in Python, noise images of random sizes (0.5x to 3x the input)",
        formats={"largest logit difference": "{:.1e}", "lowest rollout correlation": "{:.6f}"},
    )
    with tempfile.TemporaryDirectory() as tmp, WebBrowser(timeout_ms=300_000) as browser:
        for variant in args.variants:
            model = random_model_file(variant, args.data, Path(tmp), target="portable")
            site = write_web(model, Path(tmp) / f"site-{variant}")
            clf = OnnxClassifier(model)
            png = sample_image(args.data, clf.input_size)
            mb = model.stat().st_size / 1e6
            with StaticSite(site) as server:
                same = parity(browser, server.url, clf, args.images)
            agree.add(variant, args.images, same["worst"], same["corr"], f"{same['same']}/{args.images}")
            for isolated in (False, True):
                threads = min(4, os.cpu_count() or 1) if isolated else 1  # what vitscope.js picks
                py, py_graph = python_ms(model, png, threads, args.images)  # before the browser's threads exist
                with StaticSite(site, isolated=isolated) as server:
                    b = browser_figures(browser, server.url, png, args.loads, args.images)
                assert b["isolated"] == isolated and b["threads"] == threads, b
                name = "COOP+COEP" if isolated else "plain"
                row = [variant, mb, name, threads, b["load_s"], b["ms"], py, b["ms"] / py, b["model_ms"], py_graph]
                table.add(*row)
    result.finish()


if __name__ == "__main__":
    main()
