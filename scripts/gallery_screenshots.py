"""Reference screenshots of the gallery: one per page, opened from the sidebar at 1400 x 1000
(or ``--width`` x 1000).

Serves the gallery as ``make app`` does (`apps.gallery.serve`, in a child process on a free
127.0.0.1 port), drives Debian's chromium with Playwright, clicks each page in the sidebar,
waits until it settles (no spinner, its Bokeh plots unchanged for a few seconds; the same
wait as tests/test_browser_gallery.py) and writes ``docs/figures/gallery_<slug>.png``.
A page that does not settle in ``--timeout`` seconds is shot as it is, and named on stderr.

    python scripts/gallery_screenshots.py                      # every page, smollm2-135m
    python scripts/gallery_screenshots.py --pages lens,parity  # some pages
    python scripts/gallery_screenshots.py --width 1280 --out /tmp/shots
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from _browser import plot_ids, settle_gallery_page  # noqa: E402
from _served_gallery import gallery_in_chromium  # noqa: E402

from explorer.defaults import DEFAULT_MODEL  # noqa: E402
WIDTH, HEIGHT = 1400, 1000


def main(argv: list[str] | None = None) -> int:
    from apps.gallery import VIEWS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="model the gallery serves")
    p.add_argument("--pages", default="", help="comma-separated slugs (default: every page)")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "figures", help="output folder")
    p.add_argument("--timeout", type=float, default=420, help="seconds a page may take to settle")
    p.add_argument("--width", type=int, default=WIDTH, help="browser width in pixels")
    args = p.parse_args(argv)
    slugs = [s for s in args.pages.split(",") if s] or [slug for _, slug, _ in VIEWS]
    titles = {slug: title for title, slug, _ in VIEWS}
    unknown = [s for s in slugs if s not in titles]
    if unknown:
        p.error(f"unknown pages {unknown}; the gallery has {list(titles)}")
    args.out.mkdir(parents=True, exist_ok=True)

    unsettled = []
    with gallery_in_chromium(args.model, args.out / ".gallery_server.log") as (url, browser):
        viewport = {"width": args.width, "height": HEIGHT}
        tab = browser.new_page(viewport=viewport)
        tab.goto(url + "/", timeout=180_000)
        # the gallery opens on its home page (no plot): wait for the sidebar's page buttons
        tab.wait_for_selector(".bk-btn-group button", state="attached", timeout=300_000)
        for slug in slugs:
            started = time.time()
            button = tab.locator(".bk-btn-group button", has_text=titles[slug]).first
            shown = "bk-active" in (button.get_attribute("class") or "")
            before = [] if shown else plot_ids(tab)
            button.click()
            tab.mouse.move(args.width // 2, 10)  # onto the title bar: no tooltip shown
            if not settle_gallery_page(tab, before=before, timeout=args.timeout):
                unsettled.append(slug)
            path = args.out / f"gallery_{slug.replace('-', '_')}.png"
            tab.screenshot(path=str(path))
            shown = path.resolve()
            shown = shown.relative_to(ROOT) if shown.is_relative_to(ROOT) else shown
            print(f"{shown}  ({time.time() - started:.0f} s)", flush=True)
    (args.out / ".gallery_server.log").unlink(missing_ok=True)
    if unsettled:
        print(f"did not settle in {args.timeout:.0f} s (shot as they were): {unsettled}",
              file=sys.stderr)
    return 1 if unsettled else 0


if __name__ == "__main__":
    sys.exit(main())
