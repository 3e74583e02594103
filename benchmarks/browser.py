"""The page `vit-export --web` writes, in a real browser: a static server, and Chromium. Its benchmark
(`benchmarks.web`), its tests (`tests/serve/test_web.py`) and the browser guide's screenshot (`tests.web_page`)
drive it from here.

    with StaticSite(folder) as site, WebBrowser() as browser:
        page = browser.open(site.url)            # waits for window.vitscope.ready
        result = classify(page, "samples/a.png")  # {labels, logits, probs, top, rollout}

Chromium is Debian's (`/usr/bin/chromium`), driven by Playwright; every request that is not for 127.0.0.1
is aborted and recorded in `WebBrowser.blocked`, so a page that reached for a CDN fails its test.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from serve.server.testing import free_port, wait_until

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
        if wait_ready:
            page.wait_for_function("() => window.vitscope !== undefined")
            page.evaluate("async () => { await window.vitscope.ready; }")
        return page


def classify(page: Any, source: str) -> dict[str, Any]:
    """`window.vitscope.classify(source)` for a URL relative to the page."""
    return page.evaluate(CLASSIFY_JS, source)


def classify_bytes(page: Any, data: bytes, mime: str = "image/png") -> dict[str, Any]:
    """`window.vitscope.classify(blob)` for encoded image bytes built into a Blob inside the page."""
    import base64

    return page.evaluate(BLOB_JS, [base64.b64encode(data).decode(), mime])


def drop_file(page: Any, name: str, data: bytes, mime: str = "image/png") -> None:
    """Drop a file on the page's drop zone, as a user dragging it from a file manager does."""
    import base64

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
