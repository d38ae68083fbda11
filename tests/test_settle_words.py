"""The browser tests' settle check knows every "work under way" text the pages show.

`_browser.settle_gallery_page` counts a page as settled only when no status line or
placeholder says work is under way (`_browser.BUSY_TEXT`). A page whose placeholder names a
verb the pattern lacks ("Comparing the two prompts…") would count as settled before its first
result arrives, and a test would read an empty plot.
"""
from __future__ import annotations

import re
from pathlib import Path

from _browser import BUSY_TEXT

APPS = Path(__file__).resolve().parents[1] / "apps"
# a text a page shows while it works: a capitalised -ing verb, then up to the ellipsis
AT_WORK = re.compile(r"""["']([A-Z][a-z]+ing\b[^"'.]{0,80}…)""")


def _texts_at_work() -> list[str]:
    return [m.group(1) for path in sorted(APPS.glob("*.py"))
            for m in AT_WORK.finditer(path.read_text(encoding="utf-8"))]


def test_the_pages_show_texts_at_work():
    texts = _texts_at_work()
    assert any(t.startswith("Comparing") for t in texts), texts
    assert len({t.split()[0] for t in texts}) >= 8, texts


def test_every_text_at_work_counts_as_busy():
    missed = [t for t in _texts_at_work() if not re.search(BUSY_TEXT, t, re.IGNORECASE)]
    assert not missed, f"texts at work that settle_gallery_page would take for a settled page: {missed}"


def test_a_finished_text_is_not_busy():
    for text in ("Computed in 1.2 s.", "Comparing A and B: 3 positions differ", "Loaded."):
        assert not re.search(BUSY_TEXT, text, re.IGNORECASE), text
