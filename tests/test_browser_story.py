"""One researcher's story through the gallery in a real browser, on the packaged SmolLM2.

The gallery (`apps.gallery.Gallery`, what `make app` serves) is served in this process on
SmolLM2-135M. One tab: a prompt typed in the sidebar; the Attention page's tile of a head is
clicked (a real mouse click at the tile's place, read from Bokeh's frame scales); the head is
then selected in the sidebar and highlighted in the Head atlas; the sidebar's menu ablates
it; the Logit lens shows the clean and the ablated heatmap, and both are read from the
page's Bokeh data sources and checked against a lens computed here with plain torch hooks;
the menu's "Show circuit edges" opens the Circuits page, which computes a circuit on two
prompt pairs typed into it and draws the head's edges (in the circuit, or its strongest
edges outside it, as its caption then says); the state is exported, imported into a second tab (a fresh session), and the
second tab's lens shows the same two heatmaps.
"""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
from _browser import gallery_page_state, served_in_process, settle_gallery_page, wait_for_text

from tests.test_lens_edits import hooked_lens

pytestmark = [pytest.mark.browser, pytest.mark.integration]

PROMPT = "When Mary and John went to the store, John gave a drink to"
LAYER, HEAD = 3, 5           # the head the story picks
PLACEHOLDER = "Enter a prompt and press Enter"
PAIRS = ("When Mary and John went to the store, John gave a drink to | When Mary and John went "
         "to the store, Mary gave a drink to | Mary | John\n"
         "When Tom and Anna went to the park, Tom gave a ball to | When Tom and Anna went to "
         "the park, Anna gave a ball to | Anna | Tom")

# The circuit graph's drawn edges: (source, target) of every segment shown.
_EDGES = """() => [...Bokeh.index.all_views()].filter(v => v.model.type === 'Figure'
    || v.model.type === 'Plot').flatMap(v => v.model.renderers.map(r => r.data_source).filter(s => s != null && s.data != null
        && s.data.src != null && s.data.dst != null)
    .flatMap(s => Array.from(s.data.src, (a, i) => [String(a), String(s.data.dst[i])])))"""

# Every Bokeh plot shown: its title, its css classes, and the lens heatmap's columns if it has one.
_PLOTS = """() => [...Bokeh.index.all_views()].filter(v =>
    (v.model.type === 'Figure' || v.model.type === 'Plot') && v.el.isConnected
    && v.el.offsetParent != null).map(v => {
  const heat = v.model.renderers.map(r => r.data_source).find(s => s != null && s.data != null
      && s.data.id0 != null)
  const col = name => heat == null ? null : Array.from(heat.data[name], x => Number(x))
  // the outlines (hv.Rectangles draws Bokeh quads): [left, right, bottom, top] per box
  const quads = v.model.renderers.filter(r => r.glyph != null && r.glyph.type === 'Quad')
      .flatMap(r => {
        const d = r.data_source.data, g = r.glyph, f = name => Array.from(d[g[name].field])
        const [l, rt, b, t] = ['left', 'right', 'bottom', 'top'].map(f)
        return l.map((_, i) => [l[i], rt[i], b[i], t[i]])
      })
  return {id: v.model.id, title: v.model.title != null ? String(v.model.title.text) : '',
          classes: [...(v.model.css_classes || [])], quads,
          heat: heat == null ? null : {pos: col('pos'), layer: col('layer'), id0: col('id0'),
                                        p0: col('p0')}}
})"""

# Where, on the screen, the centre of the tile (x, y) of the plot ``id`` is.
_TILE = """([id, x, y]) => {
  const v = [...Bokeh.index.all_views()].find(w => w.model.id === id)
  const box = v.canvas_view.el.getBoundingClientRect()
  return [box.left + v.frame.x_scale.compute(x), box.top + v.frame.y_scale.compute(y)]
}"""


def _plots(tab) -> list[dict]:
    return tab.evaluate(_PLOTS)


def _open(tab, title: str) -> None:
    """Open a page from the sidebar's navigation and wait for it to settle."""
    tab.locator(".bk-btn-group button", has_text=title).first.click()
    tab.mouse.move(700, 10)
    settle_gallery_page(tab, timeout=240)


def _heatmaps(tab, timeout: float = 300) -> list[dict]:
    """The lens heatmaps shown (clean first), once there are two."""
    deadline = tab.evaluate("Date.now()") + timeout * 1000
    while True:
        heats = [p for p in _plots(tab) if p["heat"] is not None]
        if len(heats) == 2 or tab.evaluate("Date.now()") > deadline:
            return heats
        tab.wait_for_timeout(500)


def _cells(heat: dict) -> dict[tuple[int, int], tuple[int, float]]:
    return {(int(p), int(l)): (int(i), float(q))
            for p, l, i, q in zip(heat["pos"], heat["layer"], heat["id0"], heat["p0"])}


def _assert_heat_is(heat: dict, ids: np.ndarray, probs: np.ndarray) -> None:
    """The heatmap's top-1 token and probability in every cell equal the hooked lens's."""
    cells = _cells(heat)
    n_pos, n_layers = ids.shape[:2]
    assert len(cells) == n_pos * n_layers
    got_p = np.array([[cells[(p, l)][1] for l in range(n_layers)] for p in range(n_pos)])
    got_i = np.array([[cells[(p, l)][0] for l in range(n_layers)] for p in range(n_pos)])
    np.testing.assert_allclose(got_p, probs[..., 0], rtol=2e-3, atol=1e-6)
    tied = (probs[..., 0] - probs[..., 1]) / probs[..., 0] < 1e-3
    assert np.all((got_i == ids[..., 0]) | tied)


def _shown(tab, container: str, text: str, timeout: float = 60) -> None:
    """Until ``text`` is shown inside ``container`` (nested shadow roots included)."""
    tab.locator(container).get_by_text(text).first.wait_for(state="visible",
                                                             timeout=timeout * 1000)


def _sidebar_prompt(tab):
    return tab.locator(f'input[placeholder="{PLACEHOLDER}"]').first


@pytest.fixture(scope="module")
def gallery_url(tmp_path_factory):
    from apps.gallery import Gallery

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EXPLORER_CACHE", str(tmp_path_factory.mktemp("story-cache")))
        with served_in_process({"gallery": lambda: Gallery("smollm2-135m").template()},
                               timeout=60) as url:
            yield f"{url}/gallery"


def test_a_prompt_a_head_an_ablation_a_circuit_and_the_state_travel_together(
        browser, gallery_url, smollm2, tmp_path):
    model = smollm2
    n_layers = model.spec.n_layers
    tab = browser.new_page(viewport={"width": 1280, "height": 1000})
    tab.goto(gallery_url, timeout=180_000)
    tab.wait_for_selector("canvas", state="attached", timeout=300_000)
    settle_gallery_page(tab, timeout=240)

    # 1. the prompt, typed in the sidebar
    box = _sidebar_prompt(tab)
    box.fill(PROMPT)
    box.press("Enter")

    # 2. the Attention page: click the head's tile in the grid of every head
    _open(tab, "Attention")
    grid = next(p for p in _plots(tab) if "attention-grid" in p["classes"])
    x, y = tab.evaluate(_TILE, [grid["id"], HEAD, n_layers - 1 - LAYER])
    tab.mouse.click(x, y)
    name = f"L{LAYER}.H{HEAD}"
    wait_for_text(tab, ".workspace-selection", re.escape(name), timeout=60)

    # 3. the Head atlas outlines it (its heatmap's one box is the head's cell)
    _open(tab, "Head atlas")
    heat = next(p for p in _plots(tab) if "atlas-heatmap" in p["classes"])
    np.testing.assert_allclose(heat["quads"], [[HEAD - 0.5, HEAD + 0.5, LAYER - 0.5, LAYER + 0.5]])

    # 4. the sidebar's menu ablates it; the edit stack lists it
    tab.locator(".menu-ablate button").first.click()
    _shown(tab, ".edit-stack", name)

    # 5. the Logit lens: clean and ablated heatmaps, each equal to a hooked lens
    _open(tab, "Logit lens")
    heats = _heatmaps(tab)
    assert len(heats) == 2, [h["title"] for h in heats]
    clean, edited = heats
    assert name in edited["title"]
    with model.lock:  # nothing else runs the model while the hooks are on
        clean_ids, clean_p = hooked_lens(model, PROMPT)
        ab_ids, ab_p = hooked_lens(model, PROMPT, ablate=[(LAYER, HEAD)])
    _assert_heat_is(clean["heat"], clean_ids, clean_p)
    _assert_heat_is(edited["heat"], ab_ids, ab_p)
    assert np.abs(ab_p[..., 0] / clean_p[..., 0] - 1).max() > 1e-3  # the ablation shows

    # 6. the Circuits page: a circuit on two prompt pairs typed into it, with the head shown
    tab.locator(".menu-circuit button").first.click()     # the menu opens the page on it
    settle_gallery_page(tab, timeout=240)
    tab.locator(".own-items textarea").first.fill(PAIRS)
    tab.locator(".own-items button").first.click()
    tab.wait_for_selector(".circuit-state[data-circuit-scores='ready']", state="attached",
                          timeout=600_000)
    state_el = tab.locator(".circuit-state").first
    assert state_el.get_attribute("data-circuit-selected") == name
    task = [sel for sel in gallery_page_state(tab)["selects"] if sel["label"].startswith("Task")]
    assert [sel["shown"] for sel in task] == ["your pairs"]  # the circuit of the typed pairs
    settle_gallery_page(tab, timeout=300)
    edges = tab.evaluate(_EDGES)
    assert edges and any(name in pair for pair in edges), "the head has no edge drawn"
    in_circuit = int(state_el.get_attribute("data-circuit-outside")) == 0
    if not in_circuit:  # drawn as its strongest edges outside the circuit, and said so
        _shown(tab, ".circuit-caption", f"{name} has no edge in this circuit")

    # 7. export the state; import it in a fresh session; the same views
    with tab.expect_download() as download:
        tab.locator(".export-state").first.click()
    path = tmp_path / "state.json"
    download.value.save_as(path)
    state = json.loads(path.read_text())
    assert state["prompts"] == [PROMPT] and state["selected"] == [name]
    assert [e.get("head") for e in state["edits"]] == [HEAD]
    assert state["items"]["circuits"] == PAIRS

    fresh = browser.new_page(viewport={"width": 1280, "height": 1000})
    fresh.goto(gallery_url, timeout=180_000)
    fresh.wait_for_selector("canvas", state="attached", timeout=300_000)
    settle_gallery_page(fresh, timeout=240)
    fresh.locator(".import-state input[type=file]").set_input_files(str(path))
    wait_for_text(fresh, ".state-message", "Imported", timeout=60)
    assert _sidebar_prompt(fresh).input_value() == PROMPT
    wait_for_text(fresh, ".workspace-selection", re.escape(name), timeout=60)
    again = _heatmaps(fresh)
    assert len(again) == 2
    assert _cells(again[0]["heat"]) == _cells(clean["heat"])
    assert _cells(again[1]["heat"]) == _cells(edited["heat"])
    fresh.close()
    tab.close()
