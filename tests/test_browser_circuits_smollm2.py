"""Browser test of the Circuits page in the gallery on the packaged SmolLM2, read from
the page's Bokeh models.

The gallery (`apps.gallery.Gallery`) is served in this process on SmolLM2-135M; a 1280 px
tab opens the Circuits page, asks for 2 prompt pairs of the task ``add`` (the fewest that
keep the test short on a 2-core machine) and presses Compute circuit. From the Bokeh data
sources the page draws: the default circuit has at most the cap's edges and is the one
`circuit_select.smallest_faithful_circuit` picks from a faithfulness curve computed here
(edge scores and patching redone in the test); on SmolLM2 no circuit within the cap
recovers 80 % (docs/circuits.md; with these 2 pairs the best within it, 300 edges, recovers
about 4 %), so the default is the most faithful within it, and the caption says so with the
numbers computed here; the faithfulness marker sits at that circuit's size and recovered
share; every node the circuit touches is labelled and drawn larger than the others, which
are unlabelled; one step of the size
slider changes both the drawn edge count and the marker (to the values computed here); a
click on an edge selects it in the workspace (the sidebar's chips) and draws its halo.
A screenshot goes to ``test-artifacts/`` (gitignored).
"""
from __future__ import annotations

import re
import time

import pytest
from _browser import ARTIFACTS, attribute, served_in_process, wait_for, wait_for_text

pytestmark = [pytest.mark.browser, pytest.mark.integration,
              pytest.mark.usefixtures("one_torch_thread")]

N_PAIRS = 2
TASK = "add"

# What the Circuits page's Bokeh models hold: the drawn edges, the node labels, the nodes
# and the faithfulness marker (found by the renderers' names, `apps._circuit_graph`).
_GRAPH_JS = """
() => {
  const out = {segments: null, labels: {text: [], x: [], y: []}, nodes: null, marker: null,
               faith_title: null, graph_title: null};
  const walk = (v) => {
    if (v.frame !== undefined && v.model.renderers && v.el.isConnected) {
      for (const r of v.model.renderers) {
        if (!r.glyph) continue;
        const d = r.data_source.data;
        if (r.name === "edges") {
          out.segments = {src: [...d.src], dst: [...d.dst]};
          out.graph_title = v.model.title.text;
        } else if (r.name === "head-labels" || r.name === "mlp-labels") {
          out.labels.text.push(...d.text); out.labels.x.push(...d.x); out.labels.y.push(...d.y);
        } else if (r.name === "nodes")
          out.nodes = {name: [...d.name], x: [...d.x], y: [...d.y], size: [...d.size]};
        else if (r.name === "current-circuit") {
          out.marker = d.edges.length ? [d.edges[0], d.metric[0]] : [];
          out.faith_title = v.model.title.text;
        }
      }
    }
    for (const c of v.children()) walk(c);
  };
  for (const root of Bokeh.index) walk(root);
  return out;
}
"""

# The screen place of a drawn edge's midpoint that a click picks out: at least 14 px from
# every node (the page takes a click within 9 px of a node for the node) and 8 px nearer to
# this edge than to any other drawn edge (the page patches the nearest edge); of those, the
# one with the widest margin. SmolLM2's heads sit ~15 px apart across layers and ~35 px
# apart within one at 1280 px, so most midpoints are near a node or another edge. Also the
# selected edges' halo.
_EDGE_JS = """
() => {
  const out = {click: null, halo: null};
  const walk = (v) => {
    if (v.frame !== undefined && v.model.renderers && v.el.isConnected) {
      const seg = v.model.renderers.find(r => r.name === "edges");
      const pts = v.model.renderers.find(r => r.name === "nodes");
      const halo = v.model.renderers.find(r => r.name === "picked-edges");
      if (seg && pts && halo) {
        out.halo = [...halo.data_source.data.edge];
        const d = seg.data_source.data, n = pts.data_source.data;
        const X = (x) => v.frame.x_scale.compute(x), Y = (y) => v.frame.y_scale.compute(y);
        const rect = (v.canvas_view ?? v.canvas).el.getBoundingClientRect();
        const ax = d.x0.map(X), ay = d.y0.map(Y), bx = d.x1.map(X), by = d.y1.map(Y);
        const toSeg = (k, px, py) => {
          const dx = bx[k] - ax[k], dy = by[k] - ay[k];
          const t = Math.max(0, Math.min(1, ((px - ax[k]) * dx + (py - ay[k]) * dy) /
                                             Math.max(dx * dx + dy * dy, 1e-12)));
          return Math.hypot(ax[k] + t * dx - px, ay[k] + t * dy - py);
        };
        let best = 0;
        for (let i = 0; i < ax.length; i++) {
          const sx = (ax[i] + bx[i]) / 2, sy = (ay[i] + by[i]) / 2;
          let node = Infinity, other = Infinity;
          for (let j = 0; j < n.x.length; j++)
            node = Math.min(node, Math.hypot(X(n.x[j]) - sx, Y(n.y[j]) - sy));
          for (let k = 0; k < ax.length; k++)
            if (k !== i) other = Math.min(other, toSeg(k, sx, sy));
          const margin = Math.min(node - 14, other - 8);
          if (margin >= 0 && margin >= best && (out.click === null || margin > best)) {
            best = margin;
            out.click = {x: rect.left + sx, y: rect.top + sy, src: d.src[i], dst: d.dst[i],
                         node_px: node, other_px: other};
          }
        }
      }
    }
    for (const c of v.children()) walk(c);
  };
  for (const root of Bokeh.index) walk(root);
  return out;
}
"""


@pytest.fixture(scope="module")
def gallery_url(tmp_path_factory, smollm2):
    from apps.gallery import Gallery

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EXPLORER_CACHE", str(tmp_path_factory.mktemp("circuits-smollm2-cache")))
        with served_in_process({"gallery": lambda: Gallery("smollm2-135m").template()},
                               timeout=60) as url:
            yield f"{url}/gallery"


def _independent(model):
    """Edge scores, the slider's sizes and the faithfulness curve at every size whose pruned
    circuit fits the cap (all the default's choice depends on), computed here."""
    import torch

    from apps.circuits import DEFAULT_MAX_EDGES, size_grid
    from explorer.analyses import circuit_select as cs
    from explorer.analyses import circuits as ca

    task = ca.make_task(TASK, N_PAIRS, seed=0)
    with model.lock, torch.enable_grad():
        scores = ca.edge_scores(model, task, method="eap", batch_size=N_PAIRS)
    sizes = sorted({*size_grid(scores.sizes["edge"]).tolist(), *cs.readable_sizes(scores)})
    kept = {n: int(ca.select_circuit(scores, top_n=n).sum()) for n in sizes}
    return task, scores, sizes, kept, DEFAULT_MAX_EDGES


def test_default_circuit_fallback_labels_and_slider_on_smollm2(browser, gallery_url, smollm2):
    from apps.circuits import MAX_DRAWN_EDGES
    from explorer.analyses import circuit_select as cs
    from explorer.analyses import circuits as ca
    from explorer.components import canonical

    started = time.perf_counter()
    tab = browser.new_page(viewport={"width": 1280, "height": 1000})
    tab.goto(gallery_url, timeout=180_000)
    tab.wait_for_selector("canvas", state="attached", timeout=300_000)
    tab.locator(".bk-btn-group button", has_text="Circuits").first.click()
    tab.wait_for_selector(".circuit-state", state="attached", timeout=120_000)
    pairs = tab.locator(".bk-input-group", has_text="Prompt pairs").locator("input").first
    pairs.fill(str(N_PAIRS))
    pairs.press("Enter")
    tab.locator("button", has_text="Compute circuit").first.click()
    wait_for(tab, "data-circuit-scores", lambda v: v == "ready", timeout=600)
    page_done = time.perf_counter()

    # the same analysis, computed here while the page settles
    task, scores, sizes, kept, cap = _independent(smollm2)
    assert int(attribute(tab, "data-circuit-cap")) == cap
    fraction = float(attribute(tab, "data-circuit-fraction"))
    assert fraction == 0.8
    in_cap = [n for n in sizes if 0 < kept[n] <= cap]
    assert in_cap, "no non-empty circuit within the cap: the default would be past it"
    with smollm2.lock:
        curve = ca.faithfulness_curve(smollm2, task, scores, sizes=in_cap, batch_size=N_PAIRS)
    choice = cs.smallest_faithful_circuit(curve, fraction, max_edges=cap)
    # SmolLM2 reaches 80 % only with thousands of edges (docs/circuits.md): no measured
    # circuit within the cap does, so the default is the fallback, the most faithful of them
    rec = curve["recovered"].values
    assert rec.max() < fraction
    assert not choice.reached and choice.n_kept <= cap and choice.recovered == rec.max()

    n = choice.n_kept
    tab.wait_for_function(f"() => {{ const g = ({_GRAPH_JS})(); return g.segments !== null "
                          f"&& g.segments.src.length === {n} && g.marker !== null "
                          f"&& g.marker[0] === {n}; }}", timeout=120_000)
    g = tab.evaluate(_GRAPH_JS)
    # the default circuit: this test's choice, at most the cap's edges, drawn edge for edge
    assert attribute(tab, "data-circuit-chosen") == str(choice.n_edges)
    want = {(canonical(s), canonical(d)) for s, d in
            ca.circuit_edges(scores, ca.select_circuit(scores, top_n=choice.n_edges))}
    assert len(g["segments"]["src"]) == len(want) == n <= cap
    assert set(zip(g["segments"]["src"], g["segments"]["dst"])) == want
    # its faithfulness as shown: the marker and the plot's title
    assert g["marker"][0] == n
    assert g["marker"][1] == pytest.approx(choice.recovered, abs=1e-4)
    assert g["marker"][1] < fraction
    assert g["faith_title"] == f"Faithfulness: {n:,} edges recover {choice.recovered:.0%}"
    # the honest fallback, said in the caption with these numbers
    # (the caption's text is in the Markdown pane's shadow DOM)
    wait_for_text(tab, ".circuit-caption", re.escape(
        f"No measured circuit of at most {cap:,} edges recovers {fraction:.0%}; the default "
        f"is the most faithful within that size: {n:,} edges recovering "
        f"{choice.recovered:.0%}. Move the size slider for larger circuits."), timeout=30)
    # every drawn node has its label at its place (a head its short name, H3), no other does
    used = {c for e in want for c in e}
    place = {(x, y): name for name, x, y in zip(g["nodes"]["name"], g["nodes"]["x"], g["nodes"]["y"])}
    labelled = {place[(x, y)]: t for t, x, y in zip(*g["labels"].values()) if t}
    assert labelled == {c: (c.split(".")[1] if re.fullmatch(r"L\d+\.H\d+", c) else c)
                        for c in used}
    # the nodes the circuit does not touch are drawn small (faded), the touched ones larger
    size = dict(zip(g["nodes"]["name"], g["nodes"]["size"]))
    assert set(size) == set(place.values()) and used <= set(size)
    assert max(size[c] for c in set(size) - used) < min(size[c] for c in used)

    # the size slider: step right until the pruned circuit changes (sizes computed here)
    grid = sizes   # the slider's positions: the curve's sizes but the empty circuit
    i = grid.index(choice.n_edges)
    step = next(j for j in range(i + 1, len(grid)) if kept[grid[j]] != n)
    with smollm2.lock:
        there = ca.faithfulness_curve(smollm2, task, scores, sizes=[grid[step]],
                                      batch_size=N_PAIRS)
    new_n, new_rec = kept[grid[step]], float(there["recovered"].values[0])
    handle = next(h for h in (tab.locator(".noUi-handle").nth(k)
                              for k in range(tab.locator(".noUi-handle").count()))
                  if float(h.get_attribute("aria-valuemax")) == len(grid) - 1)
    handle.focus()
    for _ in range(step - i):
        handle.press("ArrowRight")
    drawn = min(new_n, MAX_DRAWN_EDGES)
    tab.wait_for_function(f"() => {{ const g = ({_GRAPH_JS})(); return g.segments.src.length "
                          f"=== {drawn} && g.marker[0] === {new_n}; }}", timeout=60_000)
    g2 = tab.evaluate(_GRAPH_JS)
    assert len(g2["segments"]["src"]) != len(g["segments"]["src"])
    assert g2["marker"][0] != g["marker"][0] and g2["marker"][1] != g["marker"][1]
    assert g2["marker"][1] == pytest.approx(new_rec, abs=1e-4)
    # the state pane is published after the figures' sources: wait for it, not a race
    assert wait_for(tab, "data-circuit-chosen", lambda v: v == str(grid[step]), timeout=30)
    # a click on an edge selects it in the workspace (the sidebar's chips) and haloes it
    e = tab.evaluate(_EDGE_JS)
    assert e["click"] is not None and e["halo"] == []
    name = f"{e['click']['src']}->{e['click']['dst']}"
    tab.mouse.click(e["click"]["x"], e["click"]["y"])
    wait_for_text(tab, ".workspace-selection", re.escape(name), timeout=60)
    tab.wait_for_function(f"() => ({_EDGE_JS})().halo.includes({name!r})", timeout=30_000)
    assert wait_for(tab, "data-circuit-ablated", lambda v: v != "none", timeout=120) == \
        f"{e['click']['src']} → {e['click']['dst']}"
    print(f"default {n} edges (top {choice.n_edges}) recovering {choice.recovered:.3f}; "
          f"one slider step: {new_n} edges recovering {new_rec:.3f}; "
          f"page computed in {page_done - started:.0f} s, whole test "
          f"{time.perf_counter() - started:.0f} s; slider re-draw "
          f"{attribute(tab, 'data-circuit-redraw-cpu-ms')} ms CPU on the server")
    ARTIFACTS.mkdir(exist_ok=True)
    tab.screenshot(path=str(ARTIFACTS / "circuits_smollm2_1280.png"), full_page=True)
    tab.close()
