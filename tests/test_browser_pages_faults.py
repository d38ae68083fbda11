"""The pages' drawing in a real chromium, on the gallery (tiny-llama, a selected head and an
ablation in the workspace, a prompt with an emoji and a CJK character): the lens scrolls a wide
prompt inside its box and keeps its title clear of the toolbar, Attention's hover names the
tokens, Head atlas column titles break between words only, byte tokens read as escapes;
screenshots of each page at 1280 and 1920 px in test-artifacts/."""
from __future__ import annotations

import re

import pytest
from _browser import (ARTIFACTS, SHADOW_TEXT, clipped_titles, gallery_page_state, plot_ids,
                      settle_gallery_page, shared_page)

pytestmark = pytest.mark.browser

PROMPT = ("The cat 😀 sat on the mat near 中 and the dog ran to the park because the cat was "
          "tired of waiting for the dog")
WIDTHS = (1280, 1920)
PAGES = {"lens": "Logit lens", "attention": "Attention", "atlas": "Head atlas",
         "conflicts": "Knowledge conflicts", "linear-icl": "Linear ICL"}


def _gallery(request):
    """The gallery on tiny-llama with the five pages, the cheap Linear ICL runs and two facts;
    each session starts on the lens with the prompt, a selected head and an ablation."""
    from _views import linear_icl_runs

    from apps.conflicts import ConflictsView
    from apps.gallery import VIEWS, Gallery
    from apps.linear_icl import LinearICLView
    from explorer.analyses.conflicts import load_facts
    from explorer.interventions import Ablate

    runs = linear_icl_runs()
    facts = load_facts(["country_capital"])[:2]
    cheap = {"conflicts": lambda m: ConflictsView(m, facts=facts, closed_book=False, n_new=2),
             "linear-icl": lambda m: LinearICLView(m, runs=runs)}
    views = [(t, s, cheap.get(s, f)) for t, s, f in VIEWS if s in PAGES]

    def app():
        g = Gallery("tiny-llama", views=views, view="lens", prompt=PROMPT)
        g.workspace.selected = ["L1.H2"]
        g.workspace.push_edit(Ablate(0, 1))
        return g.template()

    return app


gallery_url = shared_page("pages-faults", _gallery)


@pytest.fixture(scope="module")
def tab(browser, gallery_url):
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    page.goto(gallery_url, timeout=180_000)
    page.wait_for_selector("canvas", state="attached", timeout=240_000)
    yield page
    page.close()


def _show(tab, slug: str, width: int) -> dict:
    if tab.viewport_size["width"] != width:
        tab.set_viewport_size({"width": width, "height": 1000})
    button = tab.locator(".bk-btn-group button", has_text=PAGES[slug]).first
    before = [] if "bk-active" in (button.get_attribute("class") or "") else plot_ids(tab)
    button.click()
    tab.mouse.move(width // 2, 10)
    assert settle_gallery_page(tab, before=before, timeout=240), f"{slug} did not settle"
    ARTIFACTS.mkdir(exist_ok=True)
    tab.screenshot(path=str(ARTIFACTS / f"pages-{slug}-{width}.png"), full_page=True)
    return gallery_page_state(tab)


def _texts(tab, css: str) -> str:
    return " ".join(tab.locator(css).evaluate_all(f"els => els.map({SHADOW_TEXT})"))


# the page is no wider than the window (a wide plot scrolls inside its own box)
_PAGE_WIDTH = "() => [document.documentElement.scrollWidth, window.innerWidth]"


@pytest.mark.parametrize("width", WIDTHS)
def test_lens_scrolls_a_wide_prompt_in_its_box_and_shows_byte_tokens(tab, width):
    state = _show(tab, "lens", width)
    scroll, inner = tab.evaluate(_PAGE_WIDTH)
    assert scroll <= inner + 1, (scroll, inner)
    box = tab.locator(".lens-scroll").first
    sizes = box.evaluate("el => [el.scrollWidth, el.clientWidth]")
    assert sizes[0] > sizes[1], sizes        # 56 px a token: this prompt is wider than the box
    assert not clipped_titles(state["plots"])    # within the canvas, clear of a toolbar
    strip = _texts(tab, ".lens-prompt-tokens")
    assert "\\xf0\\x9f\\x98" in strip and "\ufffd" not in strip
    assert "\\xe4" in strip or "中" in strip


# The attention heatmap's frame in page coordinates (x, y, width, height): the Bokeh view
# that draws on ``canvas``, its frame scaled from the canvas's own size to its box.
_FRAME_BOX = """canvas => {
  for (const v of Bokeh.index.all_views()) {
    const cv = v.canvas_view
    if (!cv || !v.frame || cv.primary.canvas !== canvas) continue
    const r = canvas.getBoundingClientRect(), f = v.frame.bbox
    const s = r.width / Math.max(1, cv.bbox.width)
    return [r.left + f.left * s, r.top + f.top * s, f.width * s, f.height * s]
  }
  return null
}"""


@pytest.mark.parametrize("width", WIDTHS)
def test_attention_hover_names_the_tokens(tab, width):
    state = _show(tab, "attention", width)
    assert not clipped_titles(state["plots"])    # "All heads" says the edit shown
    canvas = tab.locator(".attention-head canvas").first
    canvas.scroll_into_view_if_needed()         # at 1280 px the plot starts below the fold
    x0, y0, w, h = canvas.evaluate(_FRAME_BOX)
    assert w > 50 and h > 50, (w, h)
    text = ""
    # a causal pattern's cells sit on and below the diagonal: hover the lower-left quarter
    for fx, fy in ((0.2, 0.8), (0.3, 0.7), (0.15, 0.9), (0.4, 0.6)):
        x, y = x0 + w * fx, y0 + h * fy
        tab.mouse.move(x, y)
        tab.mouse.move(x + 2, y + 1)
        for _ in range(20):                     # the tooltip shows within 2 s, or not here
            text = " ".join(tab.locator(".bk-tooltip-content").evaluate_all(
                "els => els.map(e => e.innerText)"))
            if "query" in text:
                break
            tab.wait_for_timeout(100)
        if "query" in text:
            break
    tab.mouse.move(width // 2, 10)
    assert re.search(r"query:\s*\d+ \S", text), text
    assert "_token" not in text and "???" not in text, text


@pytest.mark.parametrize("width", WIDTHS)
def test_atlas_column_titles_break_between_words(tab, width):
    _show(tab, "atlas", width)
    lines = tab.evaluate("""() => {
      const out = [];
      const walk = root => { for (const el of root.querySelectorAll('.tabulator-col-title')) {
          const node = el.firstChild; if (!node || node.nodeType !== 3) continue;
          const rows = new Map();
          for (let i = 0; i < node.length; i++) {
            const r = document.createRange(); r.setStart(node, i); r.setEnd(node, i + 1);
            const rect = r.getClientRects()[0]; if (!rect) continue;
            const top = Math.round(rect.top);
            rows.set(top, (rows.get(top) || '') + node.data[i]);
          }
          out.push([node.data, [...rows.values()]]);
        }
        for (const el of root.querySelectorAll('*')) if (el.shadowRoot) walk(el.shadowRoot); };
      walk(document); return out;
    }""")
    assert any(" " in title for title, _ in lines), lines
    for title, rows in lines:
        words = set(title.split())
        for row in rows:
            assert set(row.split()) <= words, (title, rows)   # no line holds part of a word


@pytest.mark.parametrize("width", WIDTHS)
def test_conflicts_and_linear_icl_draw(tab, width):
    _show(tab, "conflicts", width)
    assert "not your prompt" in _texts(tab, ".cf-prompts")
    assert "L1.H2" in _texts(tab, ".cf-selection")
    state = _show(tab, "linear-icl", width)
    titles = [p["title"] for p in state["plots"]]
    assert "toy head 0" in titles and not any(re.fullmatch(r"L\d+\.H\d+", t or "") for t in titles)
