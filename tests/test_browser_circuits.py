"""Browser test of the Circuits page (apps/circuits.py) on the tiny model (tiny-llama: SmolLM2's
scores and faithfulness curve take minutes on the shared 2-core machine).

The page is served in a subprocess on a free 127.0.0.1 port; Playwright drives Debian's
chromium. From the page's Bokeh models: the default circuit is the smallest measured one
recovering the chosen fraction (computed here, at most the cap's edges), every drawn node is
labelled with its name in the one spelling, and a size-slider step changes both the edge
count and the faithfulness marker; clicking a node selects it and fades the other edges.
Then: wait for the edge scores, move the circuit-size slider with the keyboard (the
segments on the canvas become the pruned circuit, `select_circuit` computed here; the time
from one key press to the canvas's segment count changing is measured in the browser),
switch to threshold mode (same circuit), choose an edge to ablate (the metric readout shows
the metric with that edge patched, checked against `patch_edges_metric` computed here),
choose another (the readout changes); click an edge on the canvas (the same readout for the
clicked edge). A screenshot goes to ``test-artifacts/`` (gitignored).
"""
from __future__ import annotations

import re

import functools
import os
import time

import pytest
from _browser import ARTIFACTS, attribute, open_page, painted, served_view_fixture, steady, wait_for

pytestmark = pytest.mark.browser

N_PROMPTS = 4
VIEWPORT = {"width": 1500, "height": 1400}


page_url = served_view_fixture("circuits", """
    from apps.circuits import CircuitsView
    from explorer import load_model
    model = load_model("tiny-llama")
    """, f"""
    view = CircuitsView(model, n_prompts={N_PROMPTS})
    return theme.page([view], title="Circuits")
    """, one_thread=True)


@functools.cache
def _scores():
    """The tiny model, its task and edge scores as the page computes them, computed here."""
    import torch

    from explorer import load_model
    from explorer.analyses import circuits as ca

    torch.set_grad_enabled(True)  # edge_scores needs gradients (the session disables them)
    model = load_model("tiny-llama")
    task = ca.make_task("add", N_PROMPTS, seed=0)
    scores = ca.edge_scores(model, task, batch_size=N_PROMPTS)
    torch.set_grad_enabled(False)
    return model, task, scores


@functools.cache
def _curve():
    """The faithfulness curve at the slider's sizes, as the page measures it, computed here."""
    from explorer.analyses import circuits as ca

    model, task, scores = _scores()
    return ca.faithfulness_curve(model, task, scores, sizes=page_sizes(), batch_size=N_PROMPTS)


@functools.cache
def page_sizes(fraction: float = 0.8) -> list[int]:
    """The curve's sizes as the page measures them: 0 and the page's log grid, then up to
    two bisection steps (geometric midpoints, measured here) between the first size that
    recovers ``fraction`` and the size below it."""
    from apps.circuits import CURVE_POINTS, REFINE_STEPS, size_grid
    from explorer.analyses import circuits as ca

    model, task, scores = _scores()
    sizes = [0, *size_grid(scores.sizes["edge"], points=CURVE_POINTS).tolist()]
    curve = ca.faithfulness_curve(model, task, scores, sizes=sizes, batch_size=N_PROMPTS)
    rec = dict(zip(sizes, curve["recovered"].values.tolist()))
    for _ in range(REFINE_STEPS):
        points = sorted(rec)
        first = next((i for i, n in enumerate(points) if rec[n] >= fraction), None)
        if not first:
            break
        lo, hi = points[first - 1], points[first]
        mid = round((max(lo, 1) * hi) ** 0.5)
        if not lo < mid < hi:
            break
        rec[mid] = float(ca.faithfulness_curve(model, task, scores, sizes=[mid],
                                               batch_size=N_PROMPTS)["recovered"].values[0])
    return sorted(rec)


def default_by_loop(fraction: float, cap: int) -> tuple[int, int, float]:
    """(top-n, edges, recovered) of the smallest curve point recovering ``fraction`` within
    ``cap`` edges, by a plain loop (the tiny model reaches 80 % well within the cap)."""
    c = _curve()
    for kept, top_n, rec in sorted(zip(c["n_kept"].values.tolist(), c["n_edges"].values.tolist(),
                                       c["recovered"].values.tolist())):
        if (cap is None or kept <= cap) and rec >= fraction:
            return top_n, kept, rec
    raise AssertionError(f"no circuit of at most {cap} edges recovers {fraction}")


def raw_names() -> dict[str, str]:
    """Graph node name of each component name (L2.H1 -> a2.h1), spelt out here."""
    import re

    out = {}
    for n in set(_scores()[2]["src"].values.astype(str)) | set(_scores()[2]["dst"].values.astype(str)):
        m = re.fullmatch(r"a(\d+)\.h(\d+)", n)
        k = re.fullmatch(r"m(\d+)", n)
        out[f"L{m[1]}.H{m[2]}" if m else f"L{k[1]}.MLP" if k else n] = n
    return out


def circuit_size(top_n: int) -> int:
    """Edges in the pruned top-n circuit of the tiny model, computed here."""
    from explorer.analyses import circuits as ca

    return int(ca.select_circuit(_scores()[2], top_n=top_n).sum())


def expected_metric(src: str, dst: str) -> float:
    """The tiny model's metric with only the edge src -> dst patched, computed here."""
    from explorer.analyses import circuits as ca

    model, task, scores = _scores()
    back = raw_names()
    keep = ~((scores["src"].values == back[src]) & (scores["dst"].values == back[dst]))
    assert keep.sum() == scores.sizes["edge"] - 1
    return ca.patch_edges_metric(model, task, scores, keep, batch_size=N_PROMPTS)["metric"]


_SEGMENTS_JS = """
() => {
  let n = null;
  const walk = (v) => { if (v.model && v.model.renderers) for (const r of v.model.renderers)
                          if (r.name === "edges") n = r.data_source.data.x0.length;
                        for (const c of v.children()) walk(c); };
  for (const root of Bokeh.index) walk(root);
  return n;
}
"""


@pytest.mark.timing
def test_slider_redraws_edges_and_edge_choice_ablates(page_url, browser):

    page, errors = open_page(browser, page_url, viewport=VIEWPORT, ready=".circuit-state", timeout=240)
    wait_for(page, "data-circuit-scores", lambda v: v == "ready")
    page.wait_for_selector("canvas", state="attached", timeout=60_000)
    # the slider steps through log-spaced top-n sizes (1..118 edges on tiny-llama); the page
    # opens at the default circuit's and draws that circuit, pruned to input -> logits paths
    grid = page_sizes()[1:]
    start = grid.index(default_by_loop(0.8, 300)[0])
    want = circuit_size(grid[start])
    assert int(wait_for(page, "data-circuit-chosen", lambda v: v == str(grid[start]))) == grid[start]
    assert int(wait_for(page, "data-circuit-edges", lambda v: v == str(want))) == want
    assert page.evaluate(_SEGMENTS_JS) == want
    handles = page.locator(".noUi-handle")
    handle = next(handles.nth(i) for i in range(handles.count())
                  if float(handles.nth(i).get_attribute("aria-valuemax")) == len(grid) - 1)
    # one key press, timed in the browser until the canvas holds the new circuit's segments
    step = next(s for s in range(1, len(grid) - start) if circuit_size(grid[start + s]) != want)
    handle.focus()
    for _ in range(step - 1):
        handle.press("ArrowRight")
    if step > 1:
        page.wait_for_function(f"() => ({_SEGMENTS_JS})() === {circuit_size(grid[start + step - 1])}",
                               timeout=60_000)
    target = circuit_size(grid[start + step])
    assert target > 0
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    handle.press("ArrowRight")
    page.wait_for_function(f"() => ({_SEGMENTS_JS})() === {target}", polling="raf",
                           timeout=60_000)
    key_to_canvas_ms = 1e3 * (time.perf_counter() - t0)
    print(f"key press to canvas: {key_to_canvas_ms:.0f} ms wall (1-min load {load:.1f}); "
          f"server re-draw {attribute(page, 'data-circuit-redraw-cpu-ms')} ms CPU")
    assert key_to_canvas_ms < 5000, key_to_canvas_ms   # generous: a loaded 2-core machine
    assert int(wait_for(page, "data-circuit-edges", lambda v: v == str(target))) == target
    assert attribute(page, "data-circuit-chosen") == str(grid[start + step])
    redraw_ms = float(attribute(page, "data-circuit-redraw-cpu-ms"))  # CPU: robust to load
    assert redraw_ms < 100, redraw_ms
    # threshold mode: the slider keeps its position, so the same circuit is drawn
    page.locator("button", has_text="threshold").first.click()
    wait_for(page, "data-circuit-mode", lambda v: v == "threshold", timeout=60)
    assert attribute(page, "data-circuit-edges") == str(target)
    assert page.evaluate(_SEGMENTS_JS) == target
    # choose an edge in the list: the readout shows the metric with that edge patched
    select = page.locator("select").filter(has=page.locator("option", has_text="→")).first
    labels = [o for o in select.locator("option").all_inner_texts() if "→" in o]
    assert len(labels) == target
    assert attribute(page, "data-circuit-metric") == "none"
    select.select_option(label=labels[0])
    first = float(wait_for(page, "data-circuit-metric", lambda v: v != "none"))
    assert attribute(page, "data-circuit-ablated") == labels[0]
    src, dst = labels[0].split(" → ")
    assert first == pytest.approx(expected_metric(src, dst), abs=1e-6)
    select.select_option(label=labels[1])
    wait_for(page, "data-circuit-ablated", lambda v: v == labels[1])
    second = float(attribute(page, "data-circuit-metric"))
    src, dst = labels[1].split(" → ")
    assert second == pytest.approx(expected_metric(src, dst), abs=1e-6)
    assert second != first
    # the readout (bold edge name, then the metric) names the edge now patched
    page.locator("strong", has_text=labels[1]).first.wait_for(state="attached", timeout=30_000)
    ARTIFACTS.mkdir(exist_ok=True)
    painted(page, path=str(ARTIFACTS / "circuits_page.png"), full_page=True)
    assert not errors, errors
    page.close()


_EDGE_MIDPOINT_JS = """
() => {
  // the screen position of the midpoint of the first drawn edge whose midpoint is at least
  // 20 px from every node (a click there hits the edge, not a node)
  const plots = [];
  const walk = (v) => { if (v.frame !== undefined && v.model.renderers) plots.push(v);
                        for (const c of v.children()) walk(c); };
  for (const root of Bokeh.index) walk(root);
  for (const pv of plots) {
    const seg = pv.model.renderers.find(r => r.name === "edges");
    const pts = pv.model.renderers.find(r => r.glyph && r.glyph.type === "Scatter"
                                             && r.data_source.data.name);
    if (!seg || !pts) continue;
    const d = seg.data_source.data, n = pts.data_source.data;
    const X = (x) => pv.frame.x_scale.compute(x), Y = (y) => pv.frame.y_scale.compute(y);
    for (let i = 0; i < d.x0.length; i++) {
      const sx = X((d.x0[i] + d.x1[i]) / 2), sy = Y((d.y0[i] + d.y1[i]) / 2);
      let far = true;
      for (let j = 0; j < n.x.length; j++)
        if (Math.hypot(X(n.x[j]) - sx, Y(n.y[j]) - sy) < 20) far = false;
      if (!far) continue;
      const canvas = pv.canvas_view ?? pv.canvas;
      const rect = canvas.el.getBoundingClientRect();
      return {x: rect.left + sx, y: rect.top + sy, edge: `${d.src[i]} → ${d.dst[i]}`};
    }
  }
  return null;
}
"""


def test_clicking_an_edge_ablates_it(page_url, browser):
    page, _ = open_page(browser, page_url, viewport=VIEWPORT, ready=".circuit-state", timeout=240)
    wait_for(page, "data-circuit-scores", lambda v: v == "ready")
    page.wait_for_selector("canvas", state="attached", timeout=60_000)
    # click the midpoint of the top-ranked drawn edge (screen position from Bokeh's own scales,
    # once the layout has settled)
    target = steady(page, _EDGE_MIDPOINT_JS)
    assert target is not None, "no edge renderer found"
    page.mouse.click(target["x"], target["y"])
    ablated = wait_for(page, "data-circuit-ablated", lambda v: v != "none", timeout=60)
    assert ablated == target["edge"]
    src, dst = ablated.split(" → ")
    metric = float(attribute(page, "data-circuit-metric"))
    assert metric == pytest.approx(expected_metric(src, dst), abs=1e-6)
    page.close()


_GRAPH_JS = """
() => {
  // what the page's Bokeh models hold: the circuit's segments, the node labels, the nodes
  // (with screen positions) and the faithfulness marker
  const out = {segments: null, labels: null, nodes: null, marker: null};
  const walk = (v) => {
    if (v.frame !== undefined && v.model.renderers) {
      const rect = (v.canvas_view ?? v.canvas).el.getBoundingClientRect();
      for (const r of v.model.renderers) {
        if (!r.glyph) continue;
        const d = r.data_source.data;
        if (r.name === "edges")
          out.segments = {src: [...d.src], dst: [...d.dst], alpha: [...d.alpha], score: [...d.score]};
        else if (r.glyph.type === "Text") {   // heads' and MLPs' labels: two renderers
          out.labels = out.labels ?? {text: [], x: [], y: []};
          out.labels.text.push(...d.text); out.labels.x.push(...d.x); out.labels.y.push(...d.y);
        }
        else if (r.glyph.type === "Scatter" && d.name)
          out.nodes = {name: [...d.name], x: [...d.x], y: [...d.y],
                       sx: d.x.map(x => rect.left + v.frame.x_scale.compute(x)),
                       sy: d.y.map(y => rect.top + v.frame.y_scale.compute(y))};
        else if (r.glyph.type === "Scatter" && r.glyph.marker && r.glyph.marker.value === "diamond") {
          const k = Object.keys(d);
          const xs = d[k.find(c => c.startsWith("edges"))], ys = d[k.find(c => c.startsWith("metric"))];
          out.marker = xs.length ? [xs[0], ys[0]] : [];
        }
      }
    }
    for (const c of v.children()) walk(c);
  };
  for (const root of Bokeh.index) walk(root);
  return out;
}
"""


def test_default_circuit_labels_and_size_slider(page_url, browser):
    from explorer.components import canonical

    page, errors = open_page(browser, page_url, viewport=VIEWPORT, ready=".circuit-state",
                             timeout=240)
    wait_for(page, "data-circuit-scores", lambda v: v == "ready")
    page.wait_for_selector("canvas", state="attached", timeout=60_000)
    fraction, cap = float(attribute(page, "data-circuit-fraction")), attribute(page, "data-circuit-cap")
    assert (fraction, cap) == (0.8, "None")   # no cap: the smallest faithful circuit
    cap = None
    top_n, kept, recovered = default_by_loop(fraction, cap)
    page.wait_for_function(f"() => ({_GRAPH_JS})().segments.src.length === {kept}", timeout=60_000)
    g = steady(page, _GRAPH_JS)
    # the default circuit: the independent loop's, recovering >= the fraction within the cap
    n = len(g["segments"]["src"])
    assert n == kept == circuit_size(top_n) and 0 < n
    assert g["marker"][0] == n and g["marker"][1] == pytest.approx(recovered)
    assert g["marker"][1] >= fraction
    from explorer.analyses import circuits as ca
    want = {(canonical(s), canonical(d)) for s, d in
            ca.circuit_edges(_scores()[2], ca.select_circuit(_scores()[2], top_n=top_n))}
    assert set(zip(g["segments"]["src"], g["segments"]["dst"])) == want
    # every drawn node has a label, at its place, in the one spelling; no other node has one
    used = {c for e in want for c in e}
    place = {(x, y): name for name, x, y in zip(g["nodes"]["name"], g["nodes"]["x"], g["nodes"]["y"])}
    labelled = {place[(x, y)]: t for t, x, y in zip(*g["labels"].values()) if t}
    assert labelled == {c: (c.split(".")[1] if re.fullmatch(r"L\d+\.H\d+", c) else c) for c in used}
    assert set(labelled) == {canonical(r) for r in raw_names().values() if canonical(r) in used}
    # one step of the size slider: the edge count and the marker both change
    grid = page_sizes()[1:]
    handles = page.locator(".noUi-handle")
    handle = next(handles.nth(i) for i in range(handles.count())
                  if float(handles.nth(i).get_attribute("aria-valuemax")) == len(grid) - 1)
    handle.focus()
    i = grid.index(top_n)
    while circuit_size(grid[i]) == kept:   # the next position whose pruned circuit differs
        handle.press("ArrowRight")
        i += 1
    page.wait_for_function(f"() => ({_GRAPH_JS})().segments.src.length === {circuit_size(grid[i])}",
                           timeout=60_000)
    page.wait_for_function(f"() => ({_GRAPH_JS})().marker[0] === {circuit_size(grid[i])}",
                           timeout=60_000)
    g2 = page.evaluate(_GRAPH_JS)
    assert len(g2["segments"]["src"]) != n and g2["marker"][0] != g["marker"][0]
    assert g2["marker"][1] == pytest.approx(float(_curve()["recovered"].sel(n_edges=grid[i])))
    assert g2["marker"][1] != g["marker"][1]
    # click a labelled node: it is selected (one spelling) and the other edges fade
    node = sorted(used - {"input", "logits"})[0]
    j = g2["nodes"]["name"].index(node)
    page.mouse.click(g2["nodes"]["sx"][j], g2["nodes"]["sy"][j])
    wait_for(page, "data-circuit-selected", lambda v: v == node, timeout=60)
    page.wait_for_function(f"() => ({_GRAPH_JS})().segments.alpha.some(a => a === 0.08)",
                           timeout=60_000)
    g3 = page.evaluate(_GRAPH_JS)
    for s, d, a in zip(g3["segments"]["src"], g3["segments"]["dst"], g3["segments"]["alpha"]):
        assert (a == 0.08) == (node not in (s, d))
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "circuits_default.png"), full_page=True)
    assert not errors, errors
    page.close()


_LEGEND_BOX_JS = """
() => {
  let out = null;
  const walk = (v) => {
    if (v.frame !== undefined && v.model.renderers && v.el.isConnected
        && v.model.renderers.some(r => r.name === "edges")) {
      const rect = (v.canvas_view ?? v.canvas).el.getBoundingClientRect();
      out = {left: rect.left, right: rect.right, bottom: rect.bottom,
             frame_bottom: rect.top + v.frame.bbox.bottom};
    }
    for (const c of v.children()) walk(c);
  };
  for (const root of Bokeh.index) walk(root);
  return out;
}
"""


def test_legend_line_samples_render(page_url, browser):
    """The colour / width key under the graph draws its line samples: below the x axis,
    where only the legend is, the screenshot holds pixels of the positive (red) and the
    negative (blue) edge colours (`apps._circuit_graph.POSITIVE`, `NEGATIVE`)."""
    import io

    import numpy as np
    from PIL import Image

    from apps._circuit_graph import NEGATIVE, POSITIVE

    page, errors = open_page(browser, page_url, viewport=VIEWPORT, ready=".circuit-state",
                             timeout=240)
    wait_for(page, "data-circuit-scores", lambda v: v == "ready")
    page.wait_for_function(f"() => ({_LEGEND_BOX_JS})() !== null", timeout=60_000)
    box = page.evaluate(_LEGEND_BOX_JS)
    top = box["frame_bottom"] + 40            # under the tick labels and the axis label
    clip = {"x": box["left"], "y": top, "width": box["right"] - box["left"],
            "height": box["bottom"] - top}
    assert clip["height"] > 20, box
    px = np.asarray(Image.open(io.BytesIO(painted(page, clip=clip))).convert("RGB"), dtype=int)

    def count(color: str) -> int:
        rgb = np.array([int(color[i:i + 2], 16) for i in (1, 3, 5)])
        return int((np.abs(px - rgb).max(-1) <= 24).sum())

    assert count(POSITIVE) >= 20 and count(NEGATIVE) >= 20, (count(POSITIVE), count(NEGATIVE))
    assert not errors, errors
    page.close()
