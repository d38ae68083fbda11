"""The gallery served for a script that drives it in Debian's chromium
(scripts/gallery_screenshots.py, scripts/circuits_walk.py)."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _browser import free_port, served_in_subprocess

from explorer.benches.serve import CHROMIUM, CHROMIUM_ARGS


@contextlib.contextmanager
def gallery_in_chromium(model: str, log_path: Path) -> Iterator[tuple[str, Any]]:
    """Serve the gallery on ``model`` as ``make app`` does (`apps.gallery.serve`, in a child
    process on a free 127.0.0.1 port, its output in ``log_path``) and launch headless chromium
    through Playwright; yields (the gallery's URL, the browser), both closed on the way out."""
    from playwright.sync_api import sync_playwright

    port = free_port()
    serve = f"from apps.gallery import serve; serve(model={model!r}, port={port})"
    with served_in_subprocess(["-c", serve], port, log_path) as url, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield url, browser
        finally:
            browser.close()
