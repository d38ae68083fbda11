"""What a person sees in the gallery: every page opened from the sidebar and seen at 1280, 1400, 1920 px.

One gallery (`apps.gallery.Gallery`, the template `make app` serves) is served for the module
by the test process's shared server (`_browser.shared_page`) on the tiny random-init model,
with the pages that train or scan a corpus on open given small settings (the same ones their own browser tests use); every other page is the
gallery's own factory. One tab opens every page once, at the width its first test asks for
(1280 x 1000), and then widens the window in place to 1400 x 1000 and 1920 x 1080, as a person
resizing the browser does. After a page settles (no spinner, no job of the session in flight by
the stop button, Bokeh's plots unchanged for 1.5 s: `_browser.settle_gallery_page`; after a
resize, two animation frames and the plots unchanged for 0.5 s: `_browser.resize_and_settle`),
the checks read the browser: Bokeh's own layout (each plot view's frame), the pixels of
each plot's canvas inside its frame, each title's rendered width against the room it has,
whether neighbouring tick labels overlap (with each axis's own font), the options of every
select widget, and the console. Screenshots go to test-artifacts/.
"""
from __future__ import annotations

import json
import time

import pytest
from _browser import (ARTIFACTS, clipped_titles, gallery_page_state, plot_ids, resize_and_settle,
                      settle_gallery_page, shared_page, tick_collisions)
from _views import cheap_gallery_views

pytestmark = pytest.mark.browser

WIDTHS = {1280: 1000, 1400: 1000, 1920: 1080}
MIN_FRAME = 60       # px: a plot's data area narrower or shorter than this reads as collapsed
MIN_INK = 0.002      # share of a frame's pixels that differ from its background colour

# How wide the page is against the room it has: the document and the template's main area
# (which scrolls on its own), and every Bokeh colour bar shown (left and right edge, px).
_SIDEWAYS = """() => {
  const se = document.scrollingElement, main = document.querySelector('#main')
  const bars = []
  for (const v of Bokeh.index.all_views()) {
    if ((v.model.type || '') !== 'ColorBar' || !v.parent || !v.parent.el) continue
    const el = v.parent.el
    if (!el.isConnected || el.offsetParent == null || !v.model.visible) continue
    const c = el.getBoundingClientRect()
    if (v.bbox.width > 0) bars.push([c.left + v.bbox.left, c.left + v.bbox.right])
  }
  return {document: [se.scrollWidth, se.clientWidth],
          main: main ? [main.scrollWidth, main.clientWidth] : null, bars,
          width: window.innerWidth}
}"""


def _slugs() -> list[str]:
    from apps.gallery import VIEWS

    return [slug for _, slug, _ in VIEWS]


# Checks that fail on today's view files, not on the gallery. Strict, so each one fails
# loudly once its page is fixed (then its entry goes). Keyed by (check, width, slug).
KNOWN_VIEW_FAULTS: dict[tuple[str, int, str], str] = {}


def _loading_in_the_background(view_class, km, sweep):
    """`view_class` (the shattering page) opening as in the gallery, its model arriving from
    its loader after the widgets exist, but the tiny ``km`` and ``sweep`` instead of the
    stored or freshly trained ones."""

    class Cheap(view_class):
        def _load(self, token):
            return km

        def _request_sweep(self):
            self._swept(sweep)

    return Cheap


@pytest.fixture(scope="module")
def cheap_views(tmp_path_factory):
    """The gallery's pages in its order; the slow ones with small settings."""
    from apps.shattering import ShatteringView

    return cheap_gallery_views(
        tmp_path_factory.mktemp("gallery-views"),
        shattering=lambda km, sweep: _loading_in_the_background(ShatteringView, km, sweep))


def _gallery(request):
    from apps.gallery import Gallery

    views = request.getfixturevalue("cheap_views")
    return lambda: Gallery("tiny-llama", views=views).template()


gallery_url = shared_page("gallery", _gallery)


@pytest.fixture(scope="module")
def observed(browser, gallery_url, cheap_views):
    """What each page shows, by (width, slug): measured once, on first use, in one tab."""
    titles = {slug: title for title, slug, _ in cheap_views}
    tab = browser.new_page(viewport={"width": 1280, "height": WIDTHS[1280]})
    errors: list[tuple[str, str]] = []
    current = {"slug": "(loading)"}
    tab.on("console", lambda msg: errors.append((current["slug"], msg.text))
           if msg.type == "error" else None)
    tab.on("pageerror", lambda exc: errors.append((current["slug"], str(exc))))
    tab.goto(gallery_url, timeout=120_000)
    tab.wait_for_selector("canvas", state="attached", timeout=180_000)
    cache: dict[tuple[int, str], dict] = {}
    ARTIFACTS.mkdir(exist_ok=True)

    def record(width: int, slug: str, seen: int, started: float, settled: bool) -> None:
        state = gallery_page_state(tab)
        state["ticks"] = tick_collisions(tab)
        state["sideways"] = tab.evaluate(_SIDEWAYS)
        state.update(settled=settled, seconds=round(time.time() - started, 1),
                     errors=[text for page, text in errors[seen:] if page == slug])
        tab.screenshot(path=str(ARTIFACTS / f"gallery-{slug}-{width}.png"), full_page=True)
        cache[(width, slug)] = state

    def visit(width: int, slug: str) -> None:
        """Open ``slug`` at ``width``, then widen or narrow the window in place to each
        other width not seen yet: one visit per page, every width observed."""
        if tab.viewport_size["width"] != width:
            tab.set_viewport_size({"width": width, "height": WIDTHS[width]})
        current["slug"] = slug
        seen = len(errors)
        started = time.time()
        button = tab.locator(".bk-btn-group button", has_text=titles[slug]).first
        shown = "bk-active" in (button.get_attribute("class") or "")
        before = [] if shown else plot_ids(tab)
        button.click()
        tab.mouse.move(width // 2, 10)  # off the sidebar: no tooltip over the page
        record(width, slug, seen, started,
               settle_gallery_page(tab, before=before, timeout=90))
        for other in WIDTHS:
            if (other, slug) in cache:
                continue
            seen, started = len(errors), time.time()
            settled = resize_and_settle(tab, other, WIDTHS[other], timeout=90)
            record(other, slug, seen, started, settled)

    def observe(width: int, slug: str) -> dict:
        if (width, slug) not in cache:
            visit(width, slug)
        return cache[(width, slug)]

    yield observe
    (ARTIFACTS / "gallery-observed.json").write_text(json.dumps(
        {f"{w} {s}": v for (w, s), v in cache.items()}, indent=1))
    tab.close()


def _cases(check: str):
    return [pytest.param(width, slug, id=f"{slug}-{width}", marks=[
        pytest.mark.xfail(strict=True, reason=KNOWN_VIEW_FAULTS[(check, width, slug)])]
        if (check, width, slug) in KNOWN_VIEW_FAULTS else [])
        for width in WIDTHS for slug in _slugs()]


@pytest.mark.parametrize(("width", "slug"), _cases("size"))
def test_every_plot_is_laid_out_at_a_real_size(observed, width, slug):
    state = observed(width, slug)
    assert state["settled"], f"{slug} did not settle in 90 s: {state}"
    collapsed = [(p["title"], p["frame"], p["canvas"]) for p in state["plots"]
                 if min(p["frame"]) < MIN_FRAME or min(p["canvas"]) <= 0]
    assert not collapsed, f"{slug} at {width} px: plots without a real frame: {collapsed}"


@pytest.mark.parametrize(("width", "slug"), _cases("ink"))
def test_every_plot_frame_has_ink(observed, width, slug):
    state = observed(width, slug)
    blank = [(p["title"], p["ink"]) for p in state["plots"] if not p["ink"] >= MIN_INK]
    assert not blank, f"{slug} at {width} px: plots whose frame is blank: {blank}"


@pytest.mark.parametrize(("width", "slug"), _cases("titles"))
def test_every_plot_title_fits(observed, width, slug):
    state = observed(width, slug)
    clipped = clipped_titles(state["plots"])
    assert not clipped, f"{slug} at {width} px: titles wider than their room (text, px, room): {clipped}"


@pytest.mark.parametrize(("width", "slug"), _cases("ticks"))
def test_no_tick_labels_collide(observed, width, slug):
    """Every axis either has a labelling policy that hides tick labels that would overlap (the
    theme's) or draws labels that do not overlap, measured with the axis's own font."""
    state = observed(width, slug)
    assert not state["ticks"], f"{slug} at {width} px: {state['ticks']}"


@pytest.mark.parametrize(("width", "slug"), _cases("selects"))
def test_no_select_widget_is_empty(observed, width, slug):
    state = observed(width, slug)
    # a blank option is a fine "none" choice (the circuits page's edge to ablate) but a
    # select with nothing else offers nothing
    empty = [s["label"] for s in state["selects"] if s["named"] == 0]
    assert not empty, f"{slug} at {width} px: select widgets without options: {empty}"


@pytest.mark.parametrize(("width", "slug"), _cases("sideways"))
def test_no_page_scrolls_sideways(observed, width, slug):
    """Neither the document nor the main area is wider than the window; a wide plot scrolls
    in its own box."""
    seen = observed(width, slug)["sideways"]
    (doc, doc_room), main = seen["document"], seen["main"]
    assert doc <= doc_room, f"{slug} at {width} px: the page is {doc} px wide in {doc_room}"
    assert main is None or main[0] <= main[1], \
        f"{slug} at {width} px: the main area is {main[0]} px wide in {main[1]}"


def test_the_lens_colour_bar_is_in_view(observed):
    for width in WIDTHS:
        bars = observed(width, "lens")["sideways"]["bars"]
        assert bars, f"the lens at {width} px shows no colour bar"
        cut = [b for b in bars if not 0 <= b[0] < b[1] <= width]
        assert not cut, f"the lens at {width} px: colour bars out of the window: {cut}"


@pytest.mark.parametrize(("width", "slug"), _cases("console"))
def test_no_console_errors(observed, width, slug):
    state = observed(width, slug)
    assert not state["errors"], f"{slug} at {width} px: {state['errors']}"


def test_every_gallery_page_is_checked(cheap_views):
    """The checks above run over the gallery's whole navigation, not a copy that drifted."""
    from apps.gallery import VIEWS

    assert [s for _, s, _ in cheap_views] == [s for _, s, _ in VIEWS] == _slugs()
    assert len(VIEWS) >= 12
