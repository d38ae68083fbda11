"""Browser test of the Circuits page (apps/circuits.py) on the tiny model.

The page is served in a subprocess on a free 127.0.0.1 port; Playwright drives Debian's
chromium: wait for the edge scores, move the circuit-size slider with the keyboard (the
segments on the canvas become the pruned circuit, `select_circuit` computed here; the time
from one key press to the canvas's segment count changing is measured in the browser),
switch to threshold mode (same circuit), choose an edge to ablate (the metric readout shows
the metric with that edge patched, checked against `patch_edges_metric` computed here),
choose another (the readout changes); click an edge on the canvas (the same readout for the
clicked edge). A screenshot goes to ``test-artifacts/`` (gitignored).
"""
from __future__ import annotations

import functools
import os
import textwrap
import time

import numpy as np
import pytest
from _browser import ARTIFACTS, attribute, free_port, open_page, served_in_subprocess, wait_for

pytestmark = pytest.mark.browser

N_PROMPTS = 4
VIEWPORT = {"width": 1500, "height": 1400}


@pytest.fixture(scope="module")
def page_url(tmp_path_factory):
    port = free_port()
    code = textwrap.dedent(f"""
        import torch
        torch.set_num_threads(1)
        import panel as pn
        from apps import theme
        from apps.circuits import CircuitsView
        from explorer import load_model

        model = load_model("tiny-llama")
        theme.enable_extension()

        def app():
            view = CircuitsView(model, n_prompts={N_PROMPTS})
            return theme.page([view], title="Circuits")

        server = pn.serve({{"circuits": app}}, port={port}, address="127.0.0.1", threaded=True,
                          show=False)
        server.join()
    """)
    tmp = tmp_path_factory.mktemp("circuits-server")
    with served_in_subprocess(["-c", code], port, tmp / "server.log", timeout=240,
                              env={"EXPLORER_CACHE": str(tmp / "cache")}) as url:
        yield f"{url}/circuits"


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


def circuit_size(top_n: int) -> int:
    """Edges in the pruned top-n circuit of the tiny model, computed here."""
    from explorer.analyses import circuits as ca

    return int(ca.select_circuit(_scores()[2], top_n=top_n).sum())


def expected_metric(src: str, dst: str) -> float:
    """The tiny model's metric with only the edge src -> dst patched, computed here."""
    from explorer.analyses import circuits as ca

    model, task, scores = _scores()
    keep = ~((scores["src"].values == src) & (scores["dst"].values == dst))
    assert keep.sum() == scores.sizes["edge"] - 1
    return ca.patch_edges_metric(model, task, scores, keep, batch_size=N_PROMPTS)["metric"]


_SEGMENTS_JS = """
() => {
  let n = null;
  const walk = (v) => { if (v.model && v.model.renderers) for (const r of v.model.renderers)
                          if (r.glyph && r.glyph.type === "Segment") n = r.data_source.data.x0.length;
                        for (const c of v.children()) walk(c); };
  for (const root of Bokeh.index) walk(root);
  return n;
}
"""


def test_slider_redraws_edges_and_edge_choice_ablates(page_url, browser):
    from apps.circuits import size_grid

    page, errors = open_page(browser, page_url, viewport=VIEWPORT, ready=".circuit-state", timeout=240)
    wait_for(page, "data-circuit-scores", lambda v: v == "ready")
    page.wait_for_selector("canvas", state="attached", timeout=60_000)
    # the slider steps through log-spaced top-n sizes (1..118 edges on tiny-llama); the page
    # opens at the one nearest 30 and draws that circuit, pruned to input -> logits paths
    grid = size_grid(118).tolist()
    start = grid.index(min(grid, key=lambda n: abs(np.log(n) - np.log(30))))
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
    time.sleep(1.5)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "circuits_page.png"), full_page=True)
    assert not errors, errors
    page.close()


_EDGE_MIDPOINT_JS = """
(i) => {
  const plots = [];
  const walk = (v) => { if (v.frame !== undefined && v.model.renderers) plots.push(v);
                        for (const c of v.children()) walk(c); };
  for (const root of Bokeh.index) walk(root);
  for (const pv of plots) {
    for (const r of pv.model.renderers) {
      if (r.glyph && r.glyph.type === "Segment" && r.data_source.data.x0.length > i) {
        const d = r.data_source.data;
        const sx = pv.frame.x_scale.compute((d.x0[i] + d.x1[i]) / 2);
        const sy = pv.frame.y_scale.compute((d.y0[i] + d.y1[i]) / 2);
        const canvas = pv.canvas_view ?? pv.canvas;
        const rect = canvas.el.getBoundingClientRect();
        return {x: rect.left + sx, y: rect.top + sy, edge: `${d.src[i]} → ${d.dst[i]}`};
      }
    }
  }
  return null;
}
"""


def test_clicking_an_edge_ablates_it(page_url, browser):
    page, _ = open_page(browser, page_url, viewport=VIEWPORT, ready=".circuit-state", timeout=240)
    wait_for(page, "data-circuit-scores", lambda v: v == "ready")
    page.wait_for_selector("canvas", state="attached", timeout=60_000)
    time.sleep(1.5)
    # click the midpoint of the top-ranked drawn edge (screen position from Bokeh's own scales)
    target = page.evaluate(_EDGE_MIDPOINT_JS, 0)
    assert target is not None, "no edge renderer found"
    page.mouse.click(target["x"], target["y"])
    ablated = wait_for(page, "data-circuit-ablated", lambda v: v != "none", timeout=60)
    assert ablated == target["edge"]
    src, dst = ablated.split(" → ")
    metric = float(attribute(page, "data-circuit-metric"))
    assert metric == pytest.approx(expected_metric(src, dst), abs=1e-6)
    page.close()
