"""Browser test: a token position clicked on the Attention page of the gallery (tiny-llama)
is selected everywhere. The Attention page, opened from the sidebar, shows the prompt's tokens
as a strip; a click on one marks it in the strip (``data-positions-selected``), puts its P<n>
chip in the sidebar's selection and outlines it dashed on the enlarged head (its query row and
key column); the Saturation page, opened next from the sidebar, marks it in its own strip and
outlines the same position's column on its prompt heatmap; a click on the token there
deselects it: no chip, no outline on either page. Last, Enter and Space on a focused token
select and deselect it, the focus staying on it. The outlines are read from the page's own
Bokeh models (the Quad glyphs' data sources) and compared with boxes worked out by hand from
the prompt's length (its tokenizer's count). Console errors, page errors and failed requests
fail the test (the `browser` fixture). About 45 s."""
from __future__ import annotations

import time

import pytest
from _browser import ARTIFACTS, plot_ids, settle_gallery_page, shared_page, wait_for_text

from apps._positions import POSITION_COLOR

pytestmark = pytest.mark.browser

PROMPT = "The quick brown fox jumps over the lazy dog"
POS = 2          # the token clicked ("·brown" or so: any position but the first and last)
K = 5            # the Saturation page's default top-k: its heatmap's ranks 1..K
WIDTH = 1280


def _gallery(request):
    """The gallery on tiny-llama with a blank start page, Attention and a cheap Saturation
    page; each session starts on the blank page with the prompt."""
    import panel as pn

    from apps.attention import AttentionView
    from apps.gallery import Gallery
    from apps.saturation import SaturationView

    class Blank(pn.viewable.Viewer):
        def __panel__(self):
            return pn.pane.Markdown("A page that computes nothing.")

    options = dict(n_permutations=50, n_pairs=1, sample_positions=100, min_sat_layer=0)
    views = [("Start", "start", lambda m: Blank()),
             ("Attention", "attention", lambda m: AttentionView(m)),
             ("Saturation events", "saturation",
              lambda m: SaturationView(m, store=None, n_tokens=200, analysis_options=options))]
    return lambda: Gallery("tiny-llama", views=views, view="start", prompt=PROMPT).template()


gallery_url = shared_page("positions", _gallery)


# [left, right, bottom, top] of every dashed quad drawn in the selection colour, per plot
# title (the plots on show), and those plots' output backends, read from BokehJS's own
# models: each glyph property is a field of its renderer's data source or one value.
_OUTLINES = """(color) => {
  const value = (spec, data, n) => {
    if (spec != null && typeof spec === 'object' && 'field' in spec)
      return Array.from(data.get(spec.field))
    const v = spec != null && typeof spec === 'object' && 'value' in spec ? spec.value : spec
    return Array(n).fill(v)
  }
  const out = {}, backends = {}
  for (const v of Bokeh.index.all_views()) {
    const m = v.model
    if (!(m.type === 'Figure' || m.type === 'Plot')) continue
    if (!v.el.isConnected || v.el.offsetParent == null) continue    // plots on show only
    const title = m.title != null ? String(m.title.text) : ''
    for (const r of m.renderers) {
      const g = r.glyph
      if (g == null || g.type !== 'Quad' || !r.visible) continue
      const data = r.data_source.data instanceof Map ? r.data_source.data
                 : new Map(Object.entries(r.data_source.data))
      const n = r.data_source.get_length() || 0
      const dash = value(g.properties.line_dash.get_value(), data, n)
      const colour = value(g.properties.line_color.get_value(), data, n)
      const alpha = value(g.properties.fill_alpha.get_value(), data, n)
      const cols = ['left', 'right', 'bottom', 'top']
        .map(k => value(g.properties[k].get_value(), data, n))
      for (let i = 0; i < n; i++) {
        const d = dash[i]
        const dashed = Array.isArray(d) ? d.length > 0 : (d != null && d !== 'solid' && d !== '')
        const ours = String(colour[i]).toLowerCase() === color.toLowerCase() && alpha[i] === 0
        if (!dashed || !ours) continue
        ;(out[title] = out[title] || []).push(cols.map(c => Number(c[i])))
        backends[title] = m.output_backend
      }
    }
  }
  for (const t in out)
    out[t].sort((a, b) => a[0] - b[0] || a[1] - b[1] || a[2] - b[2] || a[3] - b[3])
  return {boxes: out, backends}
}"""


def _outlines(tab) -> dict[str, list[list[float]]]:
    return tab.evaluate(_OUTLINES, POSITION_COLOR)["boxes"]


def _backends(tab) -> set[str]:
    """The output backends of the plots that draw outlines: Bokeh's WebGL (HoloViews'
    default) draws a quad's dashes solid, so "canvas"."""
    return set(tab.evaluate(_OUTLINES, POSITION_COLOR)["backends"].values())


def _wait_outlines(tab, predicate, what, timeout=60.0):
    deadline = time.time() + timeout
    got = _outlines(tab)
    while not predicate(got) and time.time() < deadline:
        tab.wait_for_timeout(250)
        got = _outlines(tab)
    assert predicate(got), (what, got)
    return got


def _show(tab, title):
    button = tab.locator(".bk-btn-group button", has_text=title).first
    before = plot_ids(tab)
    button.click()
    tab.mouse.move(WIDTH // 2, 10)
    assert settle_gallery_page(tab, before=before, timeout=180), f"{title} did not settle"


def _strip(tab, css):
    return tab.locator(f".{css} .pos-strip").first


def _chips(tab) -> list[str]:
    """The names on the sidebar selection's chips (Choices.js items: their data-value)."""
    items = tab.locator(".workspace-selection .choices__list--multiple .choices__item")
    return items.evaluate_all("els => els.map(e => e.dataset.value)")   # at once: no race


def _wait_chips(tab, expected, timeout=30.0):
    deadline = time.time() + timeout
    while _chips(tab) != expected and time.time() < deadline:
        tab.wait_for_timeout(250)
    assert _chips(tab) == expected


def test_a_clicked_position_is_outlined_on_attention_and_saturation(gallery_url, browser,
                                                                   tiny_model):
    n = len(tiny_model.tokenizer(PROMPT, add_special_tokens=False)["input_ids"])
    assert 0 < POS < n - 1
    # the enlarged head: query row POS from key 0 to itself, key column POS from itself down
    attention_boxes = sorted([[-0.5, POS + 0.5, POS - 0.5, POS + 0.5],
                              [POS - 0.5, POS + 0.5, POS - 0.5, n - 0.5]])
    saturation_box = [[POS - 0.5, POS + 0.5, 0.5, K + 0.5]]   # the column, every rank

    tab = browser.new_page(viewport={"width": WIDTH, "height": 1000})
    tab.goto(gallery_url, timeout=180_000)
    tab.wait_for_selector(".workspace-selection", state="attached", timeout=240_000)

    # Attention, from the sidebar: the strip shows the prompt's n tokens, nothing selected
    _show(tab, "Attention")
    strip = _strip(tab, "attention-prompt-tokens")
    strip.wait_for(state="visible", timeout=120_000)
    assert strip.locator(".pos-token").count() == n
    assert strip.get_attribute("data-positions-selected") == ""
    assert not any(_outlines(tab).values()) and _chips(tab) == []

    strip.locator(f'.pos-token[data-pos="{POS}"]').click()
    strip = _strip(tab, "attention-prompt-tokens")
    tab.wait_for_selector(f'.attention-prompt-tokens .pos-strip[data-positions-selected="{POS}"]',
                          timeout=30_000)
    assert "pos-selected" in strip.locator(f'[data-pos="{POS}"]').get_attribute("class")
    assert strip.locator(".pos-selected").count() == 1
    _wait_chips(tab, [f"P{POS}"])
    got = _wait_outlines(tab, lambda o: any(o.values()), "attention outlines")
    assert list(got.values()) == [attention_boxes], got
    assert _backends(tab) == {"canvas"}
    wait_for_text(tab, ".attention-positions-caption", rf"P{POS}\b", timeout=30)
    ARTIFACTS.mkdir(exist_ok=True)
    tab.screenshot(path=str(ARTIFACTS / "positions-attention.png"), full_page=True)

    # Saturation, from the sidebar: the same position's column outlined on the prompt heatmap
    _show(tab, "Saturation events")
    tab.locator(".sat-prompt-clean").first.wait_for(state="attached", timeout=180_000)
    strip = _strip(tab, "sat-prompt-tokens")
    strip.wait_for(state="attached", timeout=60_000)
    assert strip.get_attribute("data-positions-selected") == str(POS)
    got = _wait_outlines(tab, lambda o: any(o.values()), "saturation outlines", timeout=120)
    assert list(got.values()) == [saturation_box], got
    assert _backends(tab) == {"canvas"}
    strip.scroll_into_view_if_needed()
    tab.screenshot(path=str(ARTIFACTS / "positions-saturation.png"), full_page=True)

    # a second click (on this page's strip) deselects it: no chip, no outline, on either page
    strip.locator(f'.pos-token[data-pos="{POS}"]').click()
    tab.wait_for_selector('.sat-prompt-tokens .pos-strip[data-positions-selected=""]',
                          timeout=30_000)
    _wait_outlines(tab, lambda o: not any(o.values()), "saturation outlines gone")
    _wait_chips(tab, [])
    _show(tab, "Attention")
    tab.wait_for_selector('.attention-prompt-tokens .pos-strip[data-positions-selected=""]',
                          timeout=30_000)
    _wait_outlines(tab, lambda o: not any(o.values()), "attention outlines gone")

    # from the keyboard: Enter on a focused token selects it, Space deselects it, and the
    # token keeps the focus (the strip marks the selection in place)
    token = _strip(tab, "attention-prompt-tokens").locator(f'.pos-token[data-pos="{POS + 1}"]')
    token.focus()
    token.press("Enter")
    tab.wait_for_selector(
        f'.attention-prompt-tokens .pos-strip[data-positions-selected="{POS + 1}"]', timeout=30_000)
    _wait_chips(tab, [f"P{POS + 1}"])
    assert token.evaluate("el => el.getRootNode().activeElement === el")
    token.press(" ")
    tab.wait_for_selector('.attention-prompt-tokens .pos-strip[data-positions-selected=""]',
                          timeout=30_000)
    _wait_chips(tab, [])
    tab.close()
