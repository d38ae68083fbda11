"""What the evidence scripts share: rendering a HoloViews figure to a PNG for docs/figures/.

The figure is saved as standalone HTML (Bokeh resources inline, no network) and
screenshotted in Debian's chromium with Playwright once its canvas exists.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

CHROMIUM = "/usr/bin/chromium"  # never a Playwright-downloaded browser
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]


def render_png(obj: Any, path: Path, *, width: int = 1100, height: int = 500,
               settle_ms: int = 1000) -> Path:
    """Write HoloViews object ``obj`` to ``path`` as a PNG of about ``width`` x ``height``."""
    import holoviews as hv
    from playwright.sync_api import sync_playwright

    hv.extension("bokeh", logo=False)
    with tempfile.TemporaryDirectory() as tmp:
        html_path = Path(tmp) / "plot.html"
        hv.save(obj, html_path, backend="bokeh", resources="inline")
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                        args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": width + 60, "height": height + 60})
            page.goto(html_path.as_uri())
            page.wait_for_selector("canvas", state="attached", timeout=60_000)
            page.wait_for_timeout(settle_ms)
            page.screenshot(path=str(path), full_page=True)
            browser.close()
    return path
