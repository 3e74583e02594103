"""The browser guide's screenshot: the page `vit-export --web` writes, an image dropped on it, in Chromium
(`benchmarks.web` drives it, as it does for the page's tests and benchmark).

    .venv/bin/python -m tests.web_page artifacts/web data/digits/3/0003.png docs/web.png
"""

from __future__ import annotations

import sys
from pathlib import Path

from benchmarks.web import StaticSite, WebBrowser, drop_file


def screenshot(folder: Path, image: Path, out: Path) -> str:
    """Serve `folder`, drop `image` on the page, save a 900 x 640 screenshot to `out`; return the answer shown."""
    with StaticSite(folder) as site, WebBrowser() as browser:
        page = browser.open(site.url)
        page.set_viewport_size({"width": 900, "height": 640})
        drop_file(page, image.name, image.read_bytes())
        page.locator("#result").wait_for(state="visible")
        page.screenshot(path=str(out))
        return page.locator("#answer").inner_text()


if __name__ == "__main__":
    print(screenshot(*map(Path, sys.argv[1:4])))
