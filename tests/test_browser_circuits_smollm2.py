"""Browser test of the Circuits page in the gallery on the packaged SmolLM2: the default
circuit is faithful and drawn readably.

The gallery (`apps.gallery.Gallery`) is served on SmolLM2-135M by the test process's shared
server (`_browser.shared_page`); a 1280 px
tab opens the Circuits page, which starts on the task ``ioi`` with 8 prompt pairs, and
presses Compute circuit. Then, from the page and from a recomputation here:

- the default circuit, patched here (edge scores and patching redone in the test), recovers
  the share the page prints, and at least the target, or the caption says that no measured
  circuit does;
- every node of that circuit (found here) is drawn and labelled, and the caption's node
  count is theirs;
- hovering a node draws exactly its circuit edges (found here) and its strongest paths,
  which run from the input through it to the logits;
- the share of the circuit's influence on the logits that the drawn edges carry, computed
  here by a matrix inverse over the circuit's |scores|, is the one printed.

A screenshot goes to ``test-artifacts/`` (gitignored; docs/figures/gallery_circuits.png is a
copy). Its time is printed: the page's computation of the default is the one the benchmark
`benchmarks/circuits_default.py` reports.
"""
from __future__ import annotations

import re
import time

import numpy as np
import pytest
from _browser import ARTIFACTS, attribute, shared_page, wait_for, wait_for_text
from _story import smollm2_gallery

pytestmark = [pytest.mark.browser, pytest.mark.integration,
              pytest.mark.usefixtures("one_torch_thread")]

N_PAIRS = 8
TASK = "ioi"

# The Circuits graph's Bokeh sources (renderers named in `apps._circuit_graph`) and each
# node's place on the screen.
_GRAPH_JS = """
() => {
  const out = {edges: null, labels: [], nodes: null, hover: null};
  const walk = (v) => {
    if (v.frame !== undefined && v.model.renderers && v.el.isConnected) {
      const rect = (v.canvas_view ?? v.canvas).el.getBoundingClientRect();
      for (const r of v.model.renderers) {
        if (!r.glyph) continue;
        const d = r.data_source.data;
        if (r.name === "edges") out.edges = {src: [...d.src], dst: [...d.dst]};
        else if (r.name === "head-labels" || r.name === "mlp-labels") {
          for (let i = 0; i < d.text.length; i++) out.labels.push([d.x[i], d.y[i], d.text[i]]);
        } else if (r.name === "nodes")
          out.nodes = {name: [...d.name], x: [...d.x], y: [...d.y],
                       sx: d.x.map(x => rect.left + v.frame.x_scale.compute(x)),
                       sy: d.y.map(y => rect.top + v.frame.y_scale.compute(y))};
        else if (r.name === "hover-edges")
          out.hover = {src: [...d.src], dst: [...d.dst], kind: [...d.kind]};
      }
    }
    for (const c of v.children()) walk(c);
  };
  for (const root of Bokeh.index) walk(root);
  return out;
}
"""


gallery_url = shared_page("circuits-smollm2", smollm2_gallery)


def influence_share_by_inverse(pairs, mag, circuit, drawn):
    """Share of the circuit's influence on the logits carried by the ``drawn`` edges:
    |score| rows normalised per target, node influence w (I - A)^-1 - w (w: 1 at the
    logits), an edge's influence its normalised weight times its target's influence plus
    the target's weight."""
    names = sorted({n for i in circuit for n in pairs[i]})
    index = {n: k for k, n in enumerate(names)}
    a = np.zeros((len(names), len(names)))
    for i in circuit:
        s, d = pairs[i]
        a[index[d], index[s]] += mag[i]
    a = a / np.maximum(a.sum(1, keepdims=True), 1e-10)
    w = np.zeros(len(names))
    w[index["logits"]] = 1.0
    infl = w @ np.linalg.inv(np.eye(len(names)) - a) - w
    edge = {i: a[index[pairs[i][1]], index[pairs[i][0]]] *
            (infl[index[pairs[i][1]]] + w[index[pairs[i][1]]]) for i in circuit}
    return sum(edge[i] for i in circuit if pairs[i] in drawn) / sum(edge.values())


@pytest.mark.timeout(1800)   # about 90 s of CPU; a shared, loaded machine stretches the wall time
def test_default_circuit_is_faithful_and_drawn_readably_on_smollm2(browser, gallery_url,
                                                                   smollm2):
    import torch

    from explorer.analyses import circuits as ca
    from explorer.components import canonical

    started = time.perf_counter()
    tab = browser.new_page(viewport={"width": 1280, "height": 1200})
    problems: list[str] = []
    tab.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    tab.on("console", lambda m: problems.append(f"console: {m.text}") if m.type == "error"
           else None)
    tab.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
    tab.goto(gallery_url, timeout=400_000)   # the gallery builds slowly on a busy machine
    tab.wait_for_selector("canvas", state="attached", timeout=300_000)
    tab.locator(".bk-btn-group button", has_text="Circuits").first.click()
    tab.wait_for_selector(".circuit-state", state="attached", timeout=120_000)
    tab.locator("button", has_text="Compute circuit").first.click()
    clicked = time.perf_counter()
    wait_for(tab, "data-circuit-scores", lambda v: v == "ready", timeout=900)
    default = wait_for(tab, "data-circuit-default", lambda v: v != "none", timeout=120)
    page_s = time.perf_counter() - clicked
    top_n, n_kept, page_rec, reached = default.split()
    top_n, n_kept, page_rec, reached = int(top_n), int(n_kept), float(page_rec), reached == "1"
    fraction = float(attribute(tab, "data-circuit-fraction"))
    assert fraction == 0.8 and attribute(tab, "data-circuit-cap") == "None"
    low, high = (float(v) for v in attribute(tab, "data-circuit-interval").split())
    assert low <= page_rec <= high

    # recomputed here: the task's pairs, the edge scores, the circuit, its patched metric
    task = ca.make_task(TASK, N_PAIRS, seed=0)
    with smollm2.lock, torch.enable_grad():
        scores = ca.edge_scores(smollm2, task, method="eap", batch_size=N_PAIRS)
    mask = ca.select_circuit(scores, top_n=top_n).values
    assert int(mask.sum()) == n_kept
    with smollm2.lock:
        patched = ca.patch_edges_metric(smollm2, task, scores, mask, batch_size=N_PAIRS)
    assert patched["recovered"] == pytest.approx(page_rec, abs=1e-4)
    caption = wait_for_text(tab, ".circuit-caption", "recovering", timeout=60)
    if reached:
        assert patched["recovered"] >= fraction
        assert (f"Default: the smallest measured circuit recovering at least {fraction:.0%} "
                f"of the metric: {n_kept:,} edges") in caption
        assert f"recovering {patched['recovered']:.0%} [{low:.0%}, {high:.0%}]" in caption
    else:
        assert f"No measured circuit recovers {fraction:.0%}." in caption
        assert f"{n_kept:,} edges (top {top_n:,} by |score|, pruned), recovering " \
               f"{patched['recovered']:.0%}" in caption

    # every node of the circuit is drawn and labelled at its place
    pairs = [(canonical(str(s)), canonical(str(d)))
             for s, d in zip(scores["src"].values, scores["dst"].values)]
    circuit = np.flatnonzero(mask)
    nodes = {n for i in circuit for n in pairs[i]}
    g = tab.evaluate(_GRAPH_JS)
    place = {(x, y): name for name, x, y in zip(g["nodes"]["name"], g["nodes"]["x"],
                                                g["nodes"]["y"])}
    labelled = {place[(x, y)]: t for x, y, t in g["labels"] if t}
    assert labelled == {c: (c.split(".")[1] if re.fullmatch(r"L\d+\.H\d+", c) else c)
                        for c in nodes}
    assert nodes <= set(g["nodes"]["name"])
    assert int(attribute(tab, "data-circuit-nodes")) == len(nodes)
    assert f"all {len(nodes):,} nodes of the circuit are drawn and labelled" in caption
    drawn = set(zip(g["edges"]["src"], g["edges"]["dst"]))
    circuit_pairs = {pairs[i] for i in circuit}
    assert drawn <= circuit_pairs and 0 < len(drawn) < len(circuit_pairs)

    # the drawn share of the influence, computed here, is the one printed
    mag = np.abs(scores["score"].values.astype(np.float64))
    share = influence_share_by_inverse(pairs, mag, circuit, drawn)
    assert float(attribute(tab, "data-circuit-share")) == pytest.approx(share, abs=1e-6)
    assert f"the {len(drawn):,} of its {n_kept:,} edges that carry **{share:.1%}**" in caption \
        or f"the {len(drawn):,} of its {n_kept:,} edges that carry {share:.1%}" in caption

    # hover a node: its circuit edges (found here) and its strongest paths are drawn
    sx, sy = np.array(g["nodes"]["sx"]), np.array(g["nodes"]["sy"])
    gap = {n: min(np.hypot(sx[k] - sx[j], sy[k] - sy[j]) for j in range(len(sx)) if j != k)
           for k, n in enumerate(g["nodes"]["name"])}
    target = max((n for n in nodes if n.endswith(".MLP")), key=lambda n: (gap[n], n))
    k = g["nodes"]["name"].index(target)
    tab.mouse.move(sx[k], sy[k])
    tab.wait_for_function(f"() => {{ const h = ({_GRAPH_JS})().hover; "
                          f"return h !== null && h.src.length > 0; }}", timeout=30_000)
    h = tab.evaluate(_GRAPH_JS)["hover"]
    mine = sorted(p for p in circuit_pairs if target in p)
    assert sorted((s, d) for s, d, kind in zip(h["src"], h["dst"], h["kind"])
                  if kind == "edge") == mine
    path = [(s, d) for s, d, kind in zip(h["src"], h["dst"], h["kind"]) if kind == "path"]
    chain = [path[0][0]] + [d for _, d in path]
    assert chain[0] == "input" and chain[-1] == "logits" and target in chain
    assert all(p in circuit_pairs for p in path)
    assert all(path[i][1] == path[i + 1][0] for i in range(len(path) - 1))
    tab.mouse.move(5, 5)   # off the node: the hover's edges go
    tab.wait_for_function(f"() => ({_GRAPH_JS})().hover.src.length === 0", timeout=30_000)

    print(f"default: top {top_n} -> {n_kept} edges, {len(nodes)} nodes, recovering "
          f"{page_rec:.3f} [{low:.3f}, {high:.3f}] ({'reached' if reached else 'not reached'}); "
          f"drawn {len(drawn)} edges carrying {share:.3f} of the influence; page computed the "
          f"default in {page_s:.0f} s, whole test {time.perf_counter() - started:.0f} s")
    ARTIFACTS.mkdir(exist_ok=True)
    tab.screenshot(path=str(ARTIFACTS / "gallery_circuits.png"), full_page=False)
    assert not problems, problems
    tab.close()
