"""The Circuits view (apps/circuits.py) headless on tiny-llama: the default circuit is the
smallest measured one reaching the chosen fraction (capped), the drawn circuit is the pruned
circuit (top-n or threshold), the faithfulness marker sits at its size, node labels, edge
encoding, layout, clicks, edge ablation, EAP / EAP-IG and checkpoint diffs, CSV export."""
from __future__ import annotations

import csv
import gc
import io
import re

import numpy as np
import pytest
import torch

import apps._circuit_graph as cg
import apps.circuits as ac
from apps.circuits import CircuitsView, edge_table, node_positions, size_grid
from explorer.analyses import circuit_select as cs
from explorer.analyses import circuits as ca


@pytest.fixture(scope="module")
def view(tiny_model, tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("EXPLORER_CACHE", str(tmp_path_factory.mktemp("cache")))
    with torch.enable_grad():
        VIEW[:] = [CircuitsView(tiny_model, background=False, n_prompts=4)]
        return VIEW[0]


VIEW = []   # the module's view (page_sizes reads its measured curve)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def pruned_by_hand(scores, chosen):
    """Chosen edges on an input -> logits path through chosen edges, by plain graph search
    over the node names (written here, independent of circuits.select_circuit)."""
    src = [str(s) for s in scores["src"].values]
    dst = [str(d) for d in scores["dst"].values]
    fwd, bwd = {}, {}
    for s, d, c in zip(src, dst, chosen):
        if c:
            fwd.setdefault(s, set()).add(d)
            bwd.setdefault(d, set()).add(s)

    def reach(start, nbrs):
        seen, todo = {start}, [start]
        while todo:
            for n in nbrs.get(todo.pop(), ()):
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
        return seen

    a, b = reach("input", fwd), reach("logits", bwd)
    return {(s, d) for s, d, c in zip(src, dst, chosen) if c and s in a and d in b}


def top_n_by_hand(scores, n):
    mag = np.abs(scores["score"].values.astype(np.float64))
    chosen = np.zeros(len(mag), bool)
    chosen[np.argsort(-mag, kind="stable")[:n]] = True
    return chosen


def spelled(name):
    """The one component spelling of a graph node name, written out here by hand."""
    m = re.fullmatch(r"a(\d+)\.h(\d+)", name)
    if m:
        return f"L{m[1]}.H{m[2]}"
    m = re.fullmatch(r"m(\d+)", name)
    return f"L{m[1]}.MLP" if m else name


def short(name):
    """A node's drawn label, written out here: H3 for the head L17.H3, else the name."""
    return name.split(".")[1] if re.fullmatch(r"L\d+\.H\d+", name) else name


def spelled_edges(edges):
    return {(spelled(s), spelled(d)) for s, d in edges}


def readable_by_hand(scores, targets=cs.READABLE_TARGETS):
    """For each target, the first top-n whose pruned circuit has at least that many edges,
    by trying every n in turn."""
    sizes = [len(pruned_by_hand(scores, top_n_by_hand(scores, n)))
             for n in range(scores.sizes["edge"] + 1)]
    return sorted({next(n for n, k in enumerate(sizes) if k >= t) for t in targets
                   if t <= sizes[-1]})


def page_sizes(scores, view=None):
    """The slider's positions (and the curve's sizes but 0): the page's log grid, plus the
    bisection steps toward the smallest circuit reaching the target (from the page's
    measured values at the grid, by a plain loop here)."""
    sizes = sorted(size_grid(scores.sizes["edge"], points=ac.CURVE_POINTS).tolist())
    view = view or VIEW[0]
    rec = dict(zip(view.curve["n_edges"].values.tolist(), view.curve["recovered"].values.tolist()))
    for _ in range(ac.REFINE_STEPS):
        points = sorted([0, *sizes])
        first = next((i for i, n in enumerate(points) if rec[n] >= view.fraction), None)
        if first is None or first == 0:
            break
        lo, hi = points[first - 1], points[first]
        mid = round((max(lo, 1) * hi) ** 0.5)
        if not lo < mid < hi:
            break
        sizes = sorted([*sizes, mid])
    return sizes


def drawn(view):
    """The drawn circuit's edges, as graph node names (a0.h1, m2) for comparison by hand."""
    t = view._table
    keep = t["status"] != "lost"
    back = {spelled(n): n for n in ac.cg.node_names(view._model.n_layers, view._model.spec.n_heads)}
    return {(back[s], back[d]) for s, d in zip(t["src"][keep].tolist(), t["dst"][keep].tolist())}


def marker(view):
    plot = view._faithfulness_plot()
    marks = [el for el in plot if el.group == "Current"]
    assert len(marks) == 1
    return float(marks[0].data.iloc[0, 0]), float(marks[0].data.iloc[0, 1])


def test_size_grid_is_log_spaced_over_the_useful_range():
    g = size_grid(44_371)   # SmolLM2-135M
    assert g[0] == 44 and g[-1] == 44_371 and (np.diff(g) > 0).all()
    ratios = g[1:] / g[:-1]
    assert ratios.max() / ratios.min() < 1.05   # a constant step on a log scale
    assert len(g) == ac.GRID_POINTS
    assert size_grid(118)[0] == 1 and size_grid(118)[-1] == 118


def test_drawn_edges_are_the_pruned_top_n_circuit(view):
    scores = view.scores
    assert scores is not None and view.curve is not None
    sizes = view.curve["n_edges"].values
    assert sizes[0] == 0 and sizes[1:].tolist() == page_sizes(scores)
    assert cs.readable_sizes(scores) == readable_by_hand(scores)
    assert len(readable_by_hand(scores)) >= 3   # tiny-llama's pruned graph reaches 10..100
    n_nonempty = 0
    gc.collect()   # a collection of the scoring's garbage is no part of a re-draw's time
    for n in (1, 7, 40, int(sizes[-3])):
        view.n_edges = n
        view.redraw()
        want = pruned_by_hand(scores, top_n_by_hand(scores, n))
        assert drawn(view) == want
        assert want == ca.circuit_edges(scores, ca.select_circuit(scores, top_n=n))
        assert len(view.param.edge.objects) == len(want) + 1
        assert view.redraw_cpu_ms < 100   # CPU time: wall time depends on the machine's load
        if want:
            n_nonempty += 1
            x, y = marker(view)
            assert x == len(want)
            if n in sizes:   # a measured point: the curve's circuit is the drawn one
                assert int(view.curve["n_kept"].sel(n_edges=n)) == len(want)
                assert y == pytest.approx(float(view.curve["recovered"].sel(n_edges=n)))
    assert n_nonempty >= 2


def test_threshold_mode_draws_the_pruned_threshold_circuit(view):
    scores = view.scores
    mag = np.abs(scores["score"].values.astype(np.float64))
    view.mode = "threshold"
    try:
        for q in (0.5, 0.8, 0.95):
            t = float(np.quantile(mag, q))
            view.threshold = t
            view.redraw()
            want = pruned_by_hand(scores, mag >= t)
            assert drawn(view) == want and view._shown["chosen"] == int((mag >= t).sum())
            if want:
                assert marker(view)[0] == len(want)
        # the slider shows the threshold set in code, at a position of its own, labelled
        # with the edges it chooses ...
        label = next(k for k, v in view._slider.options.items() if v == t)
        assert view._slider.value == t and f"({int((mag >= t).sum()):,} edges)" in label
        # ... beside the thresholds that choose the grid's edge counts
        options = [o for o in view._slider.options.values() if o != t]
        view._slider.value = options[-4]
        n = page_sizes(scores)[-4]
        assert view.threshold == options[-4] and int((mag >= view.threshold).sum()) == n
        view.redraw()
        assert drawn(view) == pruned_by_hand(scores, mag >= options[-4])
        x, y = marker(view)
        assert x == int(view.curve["n_kept"].sel(n_edges=n))
        assert y == pytest.approx(float(view.curve["recovered"].sel(n_edges=n)))
    finally:
        view.mode = "top-n"


def test_slider_moves_set_top_n(view):
    options = list(view._slider.options.values())
    assert options == page_sizes(view.scores)
    view._slider.value = options[5]
    assert view.n_edges == options[5]
    view.n_edges = options[7]              # set in code: the slider follows
    assert view._slider.value == options[7]


def test_an_off_grid_size_is_shown_as_it_is_not_snapped(view):
    """A size off the slider's grid (the other method's default kept after a toggle, a link)
    is the slider's value and label, not the nearest grid position."""
    sizes = page_sizes(view.scores)
    before = view.n_edges
    off = int(sizes[-5]) + 1
    assert off not in sizes
    try:
        view.n_edges = off
        assert view._slider.value == off
        label = next(k for k, v in view._slider.options.items() if v == off)
        assert label.startswith(f"{off:,} (")
        assert sorted(view._slider.options.values()) == sorted([*sizes, off])
    finally:
        view.n_edges = before


def test_mode_switch_keeps_the_chosen_edges(view):
    sizes = page_sizes(view.scores)
    view.n_edges = int(sizes[-5])
    view.redraw()
    before = drawn(view)
    view.mode = "threshold"
    try:
        mag = np.abs(view.scores["score"].values.astype(np.float64))
        assert int((mag >= view.threshold).sum()) == sizes[-5]
        assert view._slider.value == view.threshold
        view.redraw()
        assert drawn(view) == before
        view._slider.value = list(view._slider.options.values())[-3]
    finally:
        view.mode = "top-n"
    assert view.n_edges == sizes[-3] and view._slider.value == sizes[-3]


def share_by_inverse(scores, circuit, drawn_edges):
    """Share of the circuit's influence on the logits carried by ``drawn_edges``: |score|
    rows normalised, influence w (I - A)^-1 - w by a matrix inverse, an edge's influence its
    normalised weight times its target's influence (+1 at the logits); written here."""
    names = sorted({n for e in circuit for n in e})
    index = {n: i for i, n in enumerate(names)}
    mag = {(str(s), str(d)): abs(float(v)) for s, d, v in
           zip(scores["src"].values, scores["dst"].values, scores["score"].values)}
    a = np.zeros((len(names), len(names)))
    for s_, d in circuit:
        a[index[d], index[s_]] += mag[(s_, d)]
    a = a / np.maximum(a.sum(1, keepdims=True), 1e-10)
    w = np.zeros(len(names))
    w[index["logits"]] = 1.0
    infl = w @ np.linalg.inv(np.eye(len(names)) - a) - w
    edge = {(s_, d): a[index[d], index[s_]] * (infl[index[d]] + w[index[d]]) for s_, d in circuit}
    return sum(edge[e] for e in drawn_edges) / sum(edge.values())


def test_large_circuits_draw_their_influence_pruned_subset(view, monkeypatch):
    from explorer.analyses import circuit_influence as ci

    monkeypatch.setattr(ac, "MAX_DRAWN_EDGES", 5)
    scores = view.scores
    n = scores.sizes["edge"]
    view.n_edges = n
    plot = view.redraw()
    circuit = pruned_by_hand(scores, np.ones(n, bool))
    assert len(circuit) > 5 and view._shown["size"] == len(circuit)
    pairs = list(zip(scores["src"].values.astype(str), scores["dst"].values.astype(str)))
    mask = np.array([p in circuit for p in pairs])
    pruned = ci.influence_pruning(scores, mask)   # (checked by hand in test_circuit_influence)
    want = {p for p, k in zip(pairs, pruned["drawn"].values) if k}
    assert drawn(view) == want and 0 < len(want) < len(circuit)
    assert f"({len(want)} drawn)" in plot["title"]
    assert marker(view)[0] == len(circuit)   # the marker counts the whole circuit
    # the printed share is the drawn edges' share of the influence, computed here
    share = share_by_inverse(scores, circuit, want)
    assert view.influence_share() == pytest.approx(share, abs=1e-9)
    assert f"carry **{share:.1%}** of the circuit's influence" in view._caption()
    assert f"data-circuit-share='{view.influence_share():.9g}'" in view._state_html()
    # every node of the circuit is drawn and labelled, also those without a drawn edge
    cols = view.node_columns()
    labelled = {c for c, t in zip(cols["name"], cols["text"]) if t}
    assert labelled == {spelled(x) for e in circuit for x in e}
    # a pinned node: all its circuit edges (drawn or not) and its strongest paths, which
    # run from the input to it and from it to the logits through circuit edges
    node = next(spelled(s) for s, d in sorted(circuit) if s.startswith("a") and
                sum(spelled(s) in (spelled(a), spelled(b)) for a, b in circuit) > 2)
    view.selected = node
    try:
        check_pinned(view, node, circuit)
    finally:
        view.selected = ""


def check_pinned(view, node, circuit):
    view.redraw()
    pin = view._pinned_data()      # what the drawings' pinned-edges source holds
    mine = {(spelled(a), spelled(b)) for a, b in circuit if node in (spelled(a), spelled(b))}
    edges = [(a, b) for a, b, k in zip(pin["src"], pin["dst"], pin["kind"]) if k == "edge"]
    assert sorted(edges) == sorted(mine)
    path = [(a, b) for a, b, k in zip(pin["src"], pin["dst"], pin["kind"]) if k == "path"]
    chain = [path[0][0]] + [b for _, b in path]
    assert chain[0] == "input" and chain[-1] == "logits" and node in chain
    assert all(p in {(spelled(a), spelled(b)) for a, b in circuit} for p in path)
    assert all(path[i][1] == path[i + 1][0] for i in range(len(path) - 1))
    cols = view.node_columns()
    k = cols["name"].index(node)
    assert cols["line"][k] == cg.SELECTED_LINE and cols["line_width"][k] > 1


def test_edge_choice_patches_that_edge(view, tiny_model):
    view.n_edges = 40
    view.redraw()
    label = view.param.edge.objects[3]
    view.edge = label
    src, dst = label.split(" → ")
    names = np.array([spelled(str(n)) for n in view.scores["src"].values])
    dsts = np.array([spelled(str(n)) for n in view.scores["dst"].values])
    keep = ~((names == src) & (dsts == dst))
    assert keep.sum() == len(keep) - 1
    expected = ca.patch_edges_metric(tiny_model, ca.make_task("add", 4, seed=0), view.scores,
                                     keep, batch_size=4)
    assert view.ablation["edge"] == label
    assert view.ablation["metric"] == pytest.approx(expected["metric"], abs=1e-7)
    assert f"**{label}** patched" in view._readout()


def test_clicking_an_edge_patches_it_and_a_node_selects_it(view):
    view.n_edges = 40
    view.redraw()
    t = view._table
    # the midpoint of an edge whose midpoint is no node's place
    pos = np.array(list(view._pos.values()))
    i = next(i for i in range(len(t["x0"]))
             if np.hypot(*(pos - [(t["x0"][i] + t["x1"][i]) / 2,
                                  (t["y0"][i] + t["y1"][i]) / 2]).T).min() > 0.5)
    fig = view._graph_figure()
    halo = fig.select_one({"name": "picked-edges"}).data_source
    before = list(view.selected_edges)
    view._clicked((t["x0"][i] + t["x1"][i]) / 2, (t["y0"][i] + t["y1"][i]) / 2)
    assert view.edge == f"{t['src'][i]} → {t['dst'][i]}"
    # the clicked edge is selected (the workspace's edge spelling, SRC->DST) and drawn with
    # a halo from its source's place to its target's; a second click deselects it
    name = f"{t['src'][i]}->{t['dst'][i]}"
    assert view.selected_edges == [*before, name]
    k = halo.data["edge"].index(name)
    assert [halo.data[c][k] for c in ("x0", "y0", "x1", "y1")] == \
        [t["x0"][i], t["y0"][i], t["x1"][i], t["y1"][i]]
    view._clicked((t["x0"][i] + t["x1"][i]) / 2, (t["y0"][i] + t["y1"][i]) / 2)
    assert view.selected_edges == before and name not in halo.data["edge"]
    # a node: its name in the one spelling; its edges keep their opacity, the others fade
    node = t["src"][i]
    raw = next(n for n in view._pos if spelled(n) == node)
    view._clicked(*view._pos[raw])
    assert view.selected == node
    view.redraw()
    t2 = view._table
    touches = (t2["src"] == node) | (t2["dst"] == node)
    assert touches.any() and (~touches).any()
    assert np.allclose(t2["alpha"][touches], cg.edge_style(t2["score"])["alpha"][touches])
    assert (t2["alpha"][~touches] == 0.08).all()
    cols = view.node_columns()
    k = cols["name"].index(node)
    assert cols["size"][k] == max(cols["size"])
    view._clicked(*view._pos[raw])   # again: cleared
    assert view.selected == ""
    view.redraw()
    assert np.allclose(view._table["alpha"], cg.edge_style(view._table["score"])["alpha"])


def test_edge_table_diff_marks_gained_and_lost(view):
    scores = view.scores
    order = np.argsort(-np.abs(scores["score"].values), kind="stable")
    reference = np.zeros(scores.sizes["edge"], bool)
    reference[order[2:6]] = True              # edges 2..5 of the ranking
    pos = node_positions(3, 4)
    t = edge_table(scores, order[:4], pos, reference=reference)   # draws edges 0..3
    assert t["status"].tolist() == ["gained", "gained", "kept", "kept", "lost", "lost"]
    assert t["edge"].tolist() == order[[0, 1, 2, 3, 4, 5]].tolist()
    raw = str(scores["src"].values[order[0]])
    assert t["src"][0] == spelled(raw) and (t["x0"][0], t["y0"][0]) == pos[raw]


def test_finetune_button_adds_checkpoints(view, tiny_model):
    view.ft_steps = 2
    with torch.enable_grad():
        view._request_finetune()
    ck = view.checkpoints
    assert ck is not None and ck["checkpoint"].values.tolist() == [0, 1, 2]
    # scored the paper's way by default: EAP-IG on KL, as edge_scores gives it here
    assert view.ft_method == "eap-ig"
    assert ck.attrs["params"]["edge_method"] == "eap-ig" and ck.attrs["params"]["metric"] == "kl"
    from explorer.analyses import circuit_lora as cl
    task = view._task_data(view.task, view.n_prompts, seed=0)
    with torch.enable_grad():
        want = ca.edge_scores(cl.load_checkpoint(tiny_model, ck.attrs["folder"], 2), task,
                              method="eap-ig", metric="kl", batch_size=len(task))
    np.testing.assert_allclose(ck["score"].isel(checkpoint=2).values, want["score"].values,
                               rtol=1e-4, atol=1e-6)
    n = 40
    view.param.update(checkpoint=2, diff=True, diff_against="first checkpoint", n_edges=n)
    view.redraw()
    mine = pruned_by_hand(view._ck_scores[2], top_n_by_hand(view._ck_scores[2], n))
    first = pruned_by_hand(view._ck_scores[0], top_n_by_hand(view._ck_scores[0], n))
    t = view._table
    edges = list(zip(t["src"].tolist(), t["dst"].tolist()))
    assert {e for e, s in zip(edges, t["status"]) if s != "lost"} == spelled_edges(mine)
    assert {e for e, s in zip(edges, t["status"]) if s == "lost"} == spelled_edges(first - mine)
    assert {e for e, s in zip(edges, t["status"]) if s == "kept"} == spelled_edges(mine & first)
    view.param.update(checkpoint=0, diff=False)


def test_drawn_nodes_follow_the_circuit_in_the_served_document(view):
    """In a Bokeh Document (as served), each slider move leaves the node plot's data source
    marking exactly the nodes of the segments drawn in the same document."""
    import panel as pn
    from bokeh.document import Document
    from panel.io.state import set_curdoc

    doc = Document()
    with set_curdoc(doc):
        doc.add_root(pn.panel(view).get_root(doc))
        assert len(view.nodes_drawn()) >= 1   # this document's drawing is the last
        for value in list(view._slider.options.values())[::4]:
            view._slider.value = value
            segs = [r.data_source.data for r in doc.select({"name": "edges"})]
            assert len(segs) == 1
            used = set(segs[0]["src"]) | set(segs[0]["dst"])
            nodes = view.nodes_drawn()[-1]
            big = {n for n, s in zip(nodes["name"], nodes["size"]) if s == 8}
            dark = {n for n, f in zip(nodes["name"], nodes["fill"]) if f == cg.USED_NODE}
            assert big == dark == used
            assert len(nodes["name"]) == len(node_positions(view._model.n_layers,
                                                            view._model.spec.n_heads))
            # every drawn node is labelled at its place: a head by its short name (H3, in its
            # layer's column), the others by their name in the one spelling
            labels = view.labels_drawn()
            at = {(x, y): t for x, y, t in zip(labels["x"], labels["y"], labels["text"]) if t}
            want = {view._pos[n]: short(spelled(n)) for n in view._pos if spelled(n) in used}
            assert at == want


def choice_by_loop(curve, fraction, cap):
    """The curve's smallest circuit recovering `fraction` within `cap` edges, by a plain loop
    over its points in order of size; else the most faithful non-empty one within the cap
    (None: no cap)."""
    cap = np.inf if cap is None else cap
    points = sorted(zip(curve["n_kept"].values.tolist(), curve["n_edges"].values.tolist(),
                        curve["recovered"].values.tolist()))
    for kept, top_n, rec in points:
        if kept <= cap and rec >= fraction:
            return top_n, kept, True
    best = None
    for kept, top_n, rec in points:
        if 0 < kept <= cap and (best is None or rec > best[2]):
            best = (top_n, kept, rec)
    if best is None:   # nothing non-empty fits: the smallest non-empty circuit
        kept, top_n, rec = next(p for p in points if p[0] > 0)
        return top_n, kept, rec >= fraction
    return best[0], best[1], False


def test_default_circuit_is_the_smallest_faithful_prefix_within_the_cap(view):
    curve, scores = view.curve, view.scores
    rec = curve["recovered"].values
    kept_sizes = curve["n_kept"].values
    caps = [ac.DEFAULT_MAX_EDGES, int(np.median(kept_sizes[kept_sizes > 0])),
            max(1, int(kept_sizes[kept_sizes > 0].min()) - 1)]   # below it: capped
    fractions = [0.8, 0.5, float(np.nanmax(rec)), float(np.nanmax(rec)) + 0.1]
    seen_past_cap = seen_reached = False
    try:
        for cap in caps:
            view.max_default_edges = cap
            for f in fractions:
                f = min(f, 1.0)
                view.fraction = f      # the fraction slider re-chooses the default
                top_n, kept, reached = choice_by_loop(curve, f, cap)
                assert view._default.n_edges == view.n_edges == top_n
                assert view._default.reached == reached
                view.redraw()
                assert drawn(view) == pruned_by_hand(scores, top_n_by_hand(scores, top_n))
                assert len(drawn(view)) == kept
                assert cap is None or kept <= cap or not any(0 < k <= cap for k in kept_sizes)
                seen_reached |= reached
                seen_past_cap |= cap is not None and kept > cap
                if kept == 0:
                    continue
                x, y = marker(view)
                assert x == kept and y == pytest.approx(
                    float(curve["recovered"].sel(n_edges=top_n)))
                if reached:
                    assert y >= f
    finally:
        view.max_default_edges = ac.DEFAULT_MAX_EDGES
        view.fraction = 0.8
    assert seen_reached and seen_past_cap   # (capping itself: the hand-made curve below)


def test_smallest_faithful_circuit_on_a_hand_made_curve():
    import xarray as xr

    curve = xr.Dataset({"recovered": ("n_edges", [0.0, 0.0, 0.3, 0.6, 0.6, 0.85, 0.8, 0.95]),
                        "n_kept": ("n_edges", [0, 0, 5, 12, 12, 40, 80, 200])},
                       coords={"n_edges": [0, 10, 20, 40, 50, 90, 150, 400]})
    assert cs.smallest_faithful_circuit(curve, 0.8) == cs.CircuitChoice(90, 40, 0.85, True)
    assert cs.smallest_faithful_circuit(curve, 0.9).n_edges == 400
    # past the cap: the most faithful circuit within it (of equals, the smaller top-n)
    assert cs.smallest_faithful_circuit(curve, 0.9, max_edges=100) == cs.CircuitChoice(
        90, 40, 0.85, False)
    assert cs.smallest_faithful_circuit(curve, 0.8, max_edges=30) == cs.CircuitChoice(
        40, 12, 0.6, False)
    # no non-empty circuit within the cap: the smallest non-empty one, past it
    assert cs.smallest_faithful_circuit(curve, 0.5, max_edges=4) == cs.CircuitChoice(
        20, 5, 0.3, False)
    assert cs.smallest_faithful_circuit(curve, 0.2, max_edges=4).reached


def test_smallest_faithful_circuit_rejects_bad_arguments(view):
    with pytest.raises(ValueError, match=r"`fraction` must be a number in \[0, 1\]; got 1.5"):
        cs.smallest_faithful_circuit(view.curve, 1.5)
    with pytest.raises(ValueError, match="`max_edges` must be an int >= 0"):
        cs.smallest_faithful_circuit(view.curve, 0.5, max_edges=-1)
    with pytest.raises(TypeError, match="faithfulness_curve"):
        cs.smallest_faithful_circuit(view.scores, 0.5)


def test_edge_width_and_opacity_grow_with_abs_score_and_colour_is_the_sign():
    s = np.random.default_rng(0).normal(size=200)
    st = cg.edge_style(s)
    order = np.argsort(np.abs(s))
    assert (np.diff(st["width"][order]) > 0).all() and (np.diff(st["alpha"][order]) > 0).all()
    assert st["width"][order[-1]] == pytest.approx(6.0) and st["alpha"][order[-1]] == 1.0
    assert ((st["color"] == cg.POSITIVE) == (s >= 0)).all()
    assert ((st["color"] == cg.NEGATIVE) == (s < 0)).all()


def test_layout_orders_heads_by_score_mass_and_stays_fixed(view):
    L, H = view._model.n_layers, view._model.spec.n_heads
    scores = view._results[("add", 4, "eap")][1]
    mass = {}
    for s, d, v in zip(scores["src"].values, scores["dst"].values, scores["score"].values):
        for n in (str(s), str(d)):
            mass[n] = mass.get(n, 0.0) + abs(float(v))
    before = dict(view._pos)
    for layer in range(L):
        heads = [f"a{layer}.h{h}" for h in range(H)]
        by_y = sorted(heads, key=lambda n: -view._pos[n][1])
        assert [mass[n] for n in by_y] == sorted((mass[n] for n in heads), reverse=True)
        assert all(view._pos[n][0] == layer for n in heads)
        assert view._pos[f"m{layer}"][1] > max(view._pos[n][1] for n in heads)   # MLP on top
        assert view._pos[f"m{layer}"][0] == layer + 0.5
    assert view._pos["input"][0] < 0 < L == view._pos["logits"][0]
    view.method = "eap-ig"
    try:
        assert view.scores is view._results[("add", 4, "eap-ig")][1]
        assert view._pos == before
    finally:
        view.method = "eap"
    assert view._pos == before


def test_layer_ticks_do_not_collide_at_1280_px():
    # SmolLM2's 30 layers over the graph's ~500 px data area at a 1280 px window: 15 px a
    # layer, a two-digit label with a character's gap each side needs ~26 px: every 2nd layer
    ticks = cg.layer_ticks(30)
    assert [x for x, _ in ticks] == list(range(30))          # a tick at every layer
    labelled = [int(x) for x, t in ticks if t]
    assert labelled == list(range(0, 30, 2))
    assert all(t == str(int(x)) for x, t in ticks if t)
    px_per_layer = cg.FRAME_PX_1280 / 33
    assert 2 * px_per_layer >= 4 * 6.5
    assert [t for _, t in cg.layer_ticks(3)] == ["0", "1", "2"]   # tiny-llama: all labelled


def test_csv_rows_are_the_shown_edges_and_scores(view):
    view.n_edges = 40
    view.redraw()
    rows = list(csv.DictReader(io.StringIO(view._csv_file().read())))
    assert list(rows[0]) == ["source", "target", "score", "patch_effect"]
    want = {}
    for s, d, v in zip(view.scores["src"].values, view.scores["dst"].values,
                       view.scores["score"].values):
        want[(spelled(str(s)), spelled(str(d)))] = float(v)
    assert {(r["source"], r["target"]) for r in rows} == spelled_edges(drawn(view))
    assert len(rows) == len(drawn(view))
    for r in rows:
        assert float(r["score"]) == want[(r["source"], r["target"])]
    # an edge patched on the page carries its patch effect in the export
    label = view.param.edge.objects[1]
    view.edge = label
    rows = {(r["source"], r["target"]): r for r in csv.DictReader(io.StringIO(view.circuit_csv()))}
    src, dst = label.split(" → ")
    a = view.ablation
    assert float(rows[(src, dst)]["patch_effect"]) == pytest.approx(
        a["metric"] - a["clean_metric"], abs=1e-4)
    patched = {(spelled(str(view.scores["src"].values[i])), spelled(str(view.scores["dst"].values[i])))
               for i in view._effects[view._key()]}   # every edge patched so far on the page
    assert {e for e, r in rows.items() if r["patch_effect"]} == patched & set(rows)
    svg = view._svg_file().read()
    assert svg.startswith("<svg") and svg.count("<line") == len(rows)


def test_diff_against_the_other_attribution_is_the_set_difference(view):
    eap = view._results[("add", 4, "eap")][1]
    view.param.update(method="eap-ig", n_edges=40)   # computed now if not yet
    try:
        ig = view._results[("add", 4, "eap-ig")][1]
        assert view.scores is ig and view.n_edges == 40
        view.param.update(diff=True, diff_against="other attribution")
        view.redraw()
        mine = pruned_by_hand(ig, top_n_by_hand(ig, 40))
        other = pruned_by_hand(eap, top_n_by_hand(eap, 40))
        t = view._table
        edges = list(zip(t["src"].tolist(), t["dst"].tolist()))
        by = {k: {e for e, s in zip(edges, t["status"]) if s == k} for k in ("gained", "lost", "kept")}
        assert by["gained"] == spelled_edges(mine - other)
        assert by["lost"] == spelled_edges(other - mine)
        assert by["kept"] == spelled_edges(mine & other)
        assert by == {k: spelled_edges(v) for k, v in cg.edge_diff(mine, other).items()}
        assert mine != other   # the two methods' circuits differ on this model
        assert all(c == cg.DIFF_COLORS[s] for c, s in zip(t["color"], t["status"]))
    finally:
        view.param.update(diff=False, method="eap")
