"""The logit lens of a wide prompt at 1280 and 1920 px in Chromium: the page does not scroll
sideways (neither the document nor the template's main area), the heatmaps scroll in their own
box, and every colour bar lies inside the viewport, with a workspace edit's second heatmap
and its answer line shown."""
from __future__ import annotations

import time

import pytest
from _browser import ARTIFACTS, settle_gallery_page, shared_page

pytestmark = pytest.mark.browser

PROMPT = "When Mary and John went to the store, John gave a drink to"

_SESSIONS: list = []


def _gallery(request):
    from apps.gallery import Gallery
    from apps.lens import LensView
    from explorer import Ablate

    request.getfixturevalue("tiny_model")

    def app():
        g = Gallery("tiny-llama", views=[("Logit lens", "lens", LensView)])
        g.prompt = PROMPT
        g.workspace.push_edit(Ablate(1, 2))
        _SESSIONS.append(g)
        return g.template()
    return app


gallery_url = shared_page("lens-width", _gallery)

_MEASURE = """() => {
  const se = document.scrollingElement, main = document.querySelector('#main')
  const find = (root, css) => {
    for (const e of root.querySelectorAll('*')) {
      if (e.matches(css)) return e
      if (e.shadowRoot) { const f = find(e.shadowRoot, css); if (f) return f }
    }
    return null
  }
  const box = find(document, '.lens-scroll')
  const bars = []
  for (const v of Bokeh.index.all_views()) {
    if ((v.model.type || '') !== 'ColorBar' || !v.parent || !v.parent.el) continue
    if (!v.parent.el.isConnected) continue
    const c = v.parent.el.getBoundingClientRect()
    bars.push([c.left + v.bbox.left, c.left + v.bbox.right])
  }
  return {document: [se.scrollWidth, se.clientWidth], main: [main.scrollWidth, main.clientWidth],
          box: box ? [box.scrollWidth, box.clientWidth] : null, bars, width: window.innerWidth}
}"""


def test_a_wide_lens_scrolls_in_its_box_with_its_colour_bars_in_view(browser, gallery_url):
    ARTIFACTS.mkdir(exist_ok=True)
    tab = browser.new_page(viewport={"width": 1280, "height": 1000})
    tab.goto(gallery_url, timeout=120_000)
    tab.wait_for_selector(".lens-edited-plot canvas", state="attached", timeout=180_000)
    tab.locator(".lens-answer").first.wait_for(state="visible", timeout=60_000)
    for width, height in ((1280, 1000), (1920, 1080)):
        tab.set_viewport_size({"width": width, "height": height})
        assert settle_gallery_page(tab, timeout=90)
        deadline = time.time() + 30
        while True:   # Bokeh lays the plots out again after the resize
            m = tab.evaluate(_MEASURE)
            if len(m["bars"]) == 2 or time.time() > deadline:
                break
            tab.wait_for_timeout(200)
        assert m["document"][0] <= m["document"][1], (width, m)
        assert m["main"][0] <= m["main"][1], (width, m)
        assert m["box"][0] > m["box"][1], (width, m)   # the heatmaps are wider than the box
        assert len(m["bars"]) == 2, m                  # the clean and the edited heatmap's
        for left, right in m["bars"]:
            assert 0 <= left < right <= width, (width, m["bars"])
        tab.screenshot(path=str(ARTIFACTS / f"lens-wide-prompt-{width}.png"))
    tab.close()
