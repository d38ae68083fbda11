"""What the two parts of the researcher's story in the browser share (test_browser_story.py,
test_browser_story_circuit.py): the prompt, the head, the circuit's prompt pairs, reading the
gallery's Bokeh plots. Two files, so two test workers run the parts side by side. And the
gallery on the packaged SmolLM2 (`smollm2_gallery`) that the SmolLM2 browser tests have the
test process's shared server serve (`_browser.shared_page`)."""
from __future__ import annotations

import numpy as np
from _browser import settle_gallery_page

PROMPT = "When Mary and John went to the store, John gave a drink to"
LAYER, HEAD = 3, 5           # the head the story picks
NAME = f"L{LAYER}.H{HEAD}"
PLACEHOLDER = "Enter a prompt and press Enter"
PAIRS = ("When Mary and John went to the store, John gave a drink to | When Mary and John went "
         "to the store, Mary gave a drink to | Mary | John\n"
         "When Tom and Anna went to the park, Tom gave a ball to | When Tom and Anna went to "
         "the park, Anna gave a ball to | Anna | Tom")

# The circuit graph's drawn edges: (source, target) of every segment shown.
EDGES = """() => [...Bokeh.index.all_views()].filter(v => v.model.type === 'Figure'
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
TILE = """([id, x, y]) => {
  const v = [...Bokeh.index.all_views()].find(w => w.model.id === id)
  const box = v.canvas_view.el.getBoundingClientRect()
  return [box.left + v.frame.x_scale.compute(x), box.top + v.frame.y_scale.compute(y)]
}"""


def smollm2_gallery(request):
    """The app for `_browser.shared_page`: the gallery (`apps.gallery.Gallery`, what `make
    app` serves) on SmolLM2-135M. Its pages read the test process's cache folder, where the
    converted SmolLM2 is linked (an empty one would convert the packaged GGUF again)."""
    from apps.gallery import Gallery

    return lambda: Gallery("smollm2-135m").template()


def plots(tab) -> list[dict]:
    return tab.evaluate(_PLOTS)


def open_gallery(browser, url: str):
    """A fresh tab (a browser context of its own: a new session) on the gallery, settled."""
    tab = browser.new_page(viewport={"width": 1280, "height": 1000})
    tab.goto(url, timeout=180_000)
    tab.wait_for_selector("canvas", state="attached", timeout=300_000)
    settle_gallery_page(tab, timeout=240)
    return tab


def open_page(tab, title: str) -> None:
    """Open a page from the sidebar's navigation and wait for it to settle."""
    tab.locator(".bk-btn-group button", has_text=title).first.click()
    tab.mouse.move(700, 10)
    settle_gallery_page(tab, timeout=240)


def heatmaps(tab, timeout: float = 300) -> list[dict]:
    """The lens heatmaps shown (clean first), once there are two."""
    deadline = tab.evaluate("Date.now()") + timeout * 1000
    while True:
        heats = [p for p in plots(tab) if p["heat"] is not None]
        if len(heats) == 2 or tab.evaluate("Date.now()") > deadline:
            return heats
        tab.wait_for_timeout(500)


def cells(heat: dict) -> dict[tuple[int, int], tuple[int, float]]:
    return {(int(p), int(l)): (int(i), float(q))
            for p, l, i, q in zip(heat["pos"], heat["layer"], heat["id0"], heat["p0"])}


def assert_heat_is(heat: dict, ids: np.ndarray, probs: np.ndarray) -> None:
    """The heatmap's top-1 token and probability in every cell equal the hooked lens's."""
    shown = cells(heat)
    n_pos, n_layers = ids.shape[:2]
    assert len(shown) == n_pos * n_layers
    got_p = np.array([[shown[(p, l)][1] for l in range(n_layers)] for p in range(n_pos)])
    got_i = np.array([[shown[(p, l)][0] for l in range(n_layers)] for p in range(n_pos)])
    np.testing.assert_allclose(got_p, probs[..., 0], rtol=2e-3, atol=1e-6)
    tied = (probs[..., 0] - probs[..., 1]) / probs[..., 0] < 1e-3
    assert np.all((got_i == ids[..., 0]) | tied)


def shown(tab, container: str, text: str, timeout: float = 60) -> None:
    """Until ``text`` is shown inside ``container`` (nested shadow roots included)."""
    tab.locator(container).get_by_text(text).first.wait_for(state="visible",
                                                             timeout=timeout * 1000)


def sidebar_prompt(tab):
    return tab.locator(f'input[placeholder="{PLACEHOLDER}"]').first


def exported_state(tab, path):
    """The sidebar's state export, saved to ``path`` and read back (JSON)."""
    import json

    with tab.expect_download() as download:
        tab.locator(".export-state").first.click()
    download.value.save_as(path)
    return json.loads(path.read_text())
