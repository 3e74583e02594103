"""How fast is the `vit-export --web` page in Chromium, against onnxruntime in Python on the same file?

    make sample && .venv/bin/python -m benchmarks.web
    .venv/bin/python -m benchmarks.web --variants vit_micro_patch4_32 --images 20

For each variant, a model with random weights (speed does not depend on training) is exported for the
portable target and written as the page (`serve.export.web.write_web`); `python -m http.server` serves it
on 127.0.0.1, plain (one WASM thread) and with the cross-origin isolation headers (WASM threads). Measured:
- page load: a fresh browser context opens the page until `window.vitscope.ready` resolves (the model
  fetched, onnxruntime-web's WASM compiled, the session created), median of `--loads`;
- per image: `window.vitscope.classify(blob)` timed inside the page (decode, resize, the graph with its
  attention maps, rollout), median of `--images` after one warm-up;
- Python: `OnnxClassifier.prepare(png)` then `rollout` (the same graph and the same map), median, with as
  many intra-op threads as the page's WASM build used;
- the graph alone on both sides: `session.run` in the page (`classify`'s `timings.model_ms`) and
  `OnnxClassifier.attentions` in Python.
And the parity the browser test asks for, on `--images` noise images at the input size: the largest logit
difference, the lowest rollout correlation and the top-1 agreement. Writes benchmarks/results/web.json and
prints markdown tables.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import common
from benchmarks.browser import StaticSite, WebBrowser, classify_bytes
from benchmarks.servers import random_model_file, sample_image
from serve.export.web import ort_web_version, write_web
from serve.runtime.classifier import OnnxClassifier
from serve.server.testing import noise_png

ROOT = Path(__file__).resolve().parents[1]
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
    import base64

    load_s = []
    for _ in range(loads):
        context = browser.browser.new_context()  # no cache from the last load
        page = context.new_page()
        t0 = time.perf_counter()
        page.goto(url, wait_until="domcontentloaded")
        page.wait_for_function("() => window.vitscope !== undefined")
        page.evaluate("async () => { await window.vitscope.ready; }")
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
