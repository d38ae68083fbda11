"""Browser test: the Saturation and Knowledge-conflicts pages in the gallery at 1280 px with a
workspace edit (an ablated head) on tiny-llama. Each shows the edited view under the clean
one, titled with the edit, with the numbers of a plain torch-hook ablation; nothing is cut or
runs past the window."""
from __future__ import annotations


import pytest

from _browser import gallery_page_state, shared_page, show_gallery_page, title_fits

pytestmark = pytest.mark.browser

PROMPT = "The quick brown fox jumps over the lazy dog"
HEAD = (0, 1)
WIDTH = 1280


def _gallery(request):
    """The gallery on tiny-llama with cheap Saturation and Knowledge-conflicts pages; each
    session starts on Saturation with the prompt and the head ablated."""
    from apps.conflicts import ConflictsView
    from apps.gallery import Gallery
    from apps.saturation import SaturationView
    from explorer.analyses.conflicts import load_facts
    from explorer.interventions import Ablate

    facts = load_facts(["country_capital"])[:2]
    options = dict(n_permutations=50, n_pairs=1, sample_positions=100, min_sat_layer=0)
    views = [("Saturation events", "saturation",
              lambda m: SaturationView(m, store=None, n_tokens=200, analysis_options=options)),
             ("Knowledge conflicts", "conflicts",
              lambda m: ConflictsView(m, facts=facts, closed_book=False, n_new=2))]

    def app():
        g = Gallery("tiny-llama", views=views, view="saturation", prompt=PROMPT)
        g.workspace.push_edit(Ablate(*HEAD))
        return g.template()

    return app


gallery_url = shared_page("edits", _gallery)


_OVERFLOW = """() => {
  const out = [];
  const walk = root => {
    for (const el of root.querySelectorAll('*')) {
      const r = el.getBoundingClientRect();
      if (r.width > 0 && r.right > window.innerWidth + 1) out.push(el.tagName + ' ' + Math.round(r.right));
      if (el.shadowRoot) walk(el.shadowRoot);
    }
  };
  walk(document);
  return out;
}"""


def _show(tab, title):
    show_gallery_page(tab, title, width=WIDTH)


def _fits(state, titles):
    plots = {p["title"]: p for p in state["plots"]}
    for t in titles:
        p = plots[t]
        assert title_fits(p), (t, p)
        assert min(p["frame"]) > 50, (t, p)


def test_pages_show_clean_and_edited_at_1280(gallery_url, browser, tiny_model):
    from test_conflicts_edits import _pm, hooked_last_probs
    from test_saturation_edits import hooked_lens_logits, hooked_saturation

    from explorer.analyses import conflicts as C

    tab = browser.new_page(viewport={"width": WIDTH, "height": 1000})
    tab.goto(gallery_url, timeout=180_000)
    tab.wait_for_selector("canvas", state="attached", timeout=240_000)

    # Saturation: the prompt's heatmaps, clean then edited, the moved cells those of the hooks
    _show(tab, "Saturation events")
    tab.locator(".sat-prompt-edited").first.wait_for(state="attached", timeout=120_000)
    _fits(gallery_page_state(tab), ["clean: no workspace edits · top-5",
                                    "edited: ablate L0.H1 (zero)"])
    marker = tab.locator("[data-sat-prompt-moved]").first.get_attribute("data-sat-prompt-moved")
    shown = {tuple(int(x) for x in c.split(":")) for c in marker.split(",") if c}
    clean, clean_gap = hooked_saturation(hooked_lens_logits(tiny_model, PROMPT), 5)
    edited, gap = hooked_saturation(hooked_lens_logits(tiny_model, PROMPT, [HEAD]), 5)
    clear = (gap > 1e-5) & (clean_gap > 1e-5)
    want = {(int(p), int(j) + 1) for p, j in zip(*(clear & (clean != edited)).nonzero())}
    unclear = {(int(p), int(j) + 1) for p, j in zip(*(~clear).nonzero())}
    assert want and shown - unclear == want
    assert tab.evaluate(_OVERFLOW) == []

    # Knowledge conflicts: the edited bars under their heading, with the hooked probabilities
    _show(tab, "Knowledge conflicts")
    tab.locator(".cf-bars-edited").first.wait_for(state="attached", timeout=120_000)
    tab.locator(".cf-bars-edited").first.scroll_into_view_if_needed()
    tab.wait_for_timeout(1000)
    _fits(gallery_page_state(tab), ["P(answer), clean", "P(answer), edited"])
    heading = tab.locator(".cf-edited-title strong").first.inner_text()  # in its shadow root
    assert "Edited: ablate L0.H1 (zero)" in heading
    values = [float(v) for v in tab.locator(".cf-state").first.get_attribute(
        "data-cf-edited").split(",")]
    fact = C.load_facts(["country_capital"])[0]
    m, c = _pm(tiny_model, fact, hooked_last_probs(
        tiny_model, C.conflict_prompt(fact, "substitution"), ablate=[HEAD])[0])
    # rows: (memory, before), (context, before), (memory, after), (context, after); no heads
    # chosen, so "after" is the edited run itself
    assert values == pytest.approx([m, c, m, c], rel=1e-4, abs=1e-6)
    assert tab.evaluate(_OVERFLOW) == []
    tab.close()
