"""The Circuits view (apps/circuits.py) headless on tiny-llama: the drawn circuit is the pruned
circuit (top-n or threshold), the faithfulness marker sits at its size, edge ablation, diff."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import apps.circuits as ac
from apps.circuits import CircuitsView, edge_table, node_positions, size_grid
from explorer.analyses import circuits as ca


@pytest.fixture(scope="module")
def view(tiny_model, tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("EXPLORER_CACHE", str(tmp_path_factory.mktemp("cache")))
    with torch.enable_grad():
        return CircuitsView(tiny_model, background=False, n_prompts=4)


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


def drawn(view):
    t = view._table
    keep = t["status"] != "dropped"
    return set(zip(t["src"][keep].tolist(), t["dst"][keep].tolist()))


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
    assert sizes[0] == 0 and sizes[1:].tolist() == size_grid(scores.sizes["edge"]).tolist()
    n_nonempty = 0
    for n in (1, 7, 40, int(sizes[-3])):
        view.n_edges = n
        view._edges_plot()
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
            view._edges_plot()
            want = pruned_by_hand(scores, mag >= t)
            assert drawn(view) == want and view._shown["chosen"] == int((mag >= t).sum())
            if want:
                assert marker(view)[0] == len(want)
        # the slider's positions are the thresholds that choose the grid's edge counts
        options = list(view._slider.options.values())
        view._slider.value = options[-4]
        n = size_grid(scores.sizes["edge"])[-4]
        assert view.threshold == options[-4] and int((mag >= view.threshold).sum()) == n
        view._edges_plot()
        assert drawn(view) == pruned_by_hand(scores, mag >= options[-4])
        x, y = marker(view)
        assert x == int(view.curve["n_kept"].sel(n_edges=n))
        assert y == pytest.approx(float(view.curve["recovered"].sel(n_edges=n)))
    finally:
        view.mode = "top-n"


def test_slider_moves_set_top_n(view):
    options = list(view._slider.options.values())
    assert options == size_grid(view.scores.sizes["edge"]).tolist()
    view._slider.value = options[5]
    assert view.n_edges == options[5]
    view.n_edges = options[7]              # set in code: the slider follows
    assert view._slider.value == options[7]


def test_mode_switch_keeps_the_chosen_edges(view):
    sizes = size_grid(view.scores.sizes["edge"])
    view.n_edges = int(sizes[-5])
    view._edges_plot()
    before = drawn(view)
    view.mode = "threshold"
    try:
        mag = np.abs(view.scores["score"].values.astype(np.float64))
        assert int((mag >= view.threshold).sum()) == sizes[-5]
        assert view._slider.value == view.threshold
        view._edges_plot()
        assert drawn(view) == before
        view._slider.value = list(view._slider.options.values())[-3]
    finally:
        view.mode = "top-n"
    assert view.n_edges == sizes[-3] and view._slider.value == sizes[-3]


def test_large_circuits_draw_their_strongest_edges(view, monkeypatch):
    monkeypatch.setattr(ac, "MAX_DRAWN_EDGES", 5)
    scores = view.scores
    n = scores.sizes["edge"]
    view.n_edges = n
    plot = view._edges_plot()
    circuit = pruned_by_hand(scores, np.ones(n, bool))
    assert len(circuit) > 5 and view._shown["size"] == len(circuit)
    mag = {(str(s), str(d)): abs(float(v)) for s, d, v in
           zip(scores["src"].values, scores["dst"].values, scores["score"].values)}
    strongest = sorted(circuit, key=lambda e: -mag[e])[:5]
    assert drawn(view) == set(strongest)
    assert "drawing the strongest 5" in plot.opts.get().kwargs["title"]
    assert marker(view)[0] == len(circuit)   # the marker counts the whole circuit


def test_edge_choice_patches_that_edge(view, tiny_model):
    view.n_edges = 40
    view._edges_plot()
    label = view.param.edge.objects[3]
    view.edge = label
    src, dst = label.split(" → ")
    keep = ~((view.scores["src"].values == src) & (view.scores["dst"].values == dst))
    expected = ca.patch_edges_metric(tiny_model, ca.make_task("add", 4, seed=0), view.scores,
                                     keep, batch_size=4)
    assert view.ablation["edge"] == label
    assert view.ablation["metric"] == pytest.approx(expected["metric"], abs=1e-7)
    assert f"**{label}** patched" in view._readout()


def test_tap_selects_edge(view):
    view.n_edges = 40
    view._edges_plot()
    view._tapped([2])
    assert view.edge == f"{view._table['src'][2]} → {view._table['dst'][2]}"


def test_edge_table_diff_marks_added_and_dropped(view):
    scores = view.scores
    order = np.argsort(-np.abs(scores["score"].values), kind="stable")
    reference = np.zeros(scores.sizes["edge"], bool)
    reference[order[2:6]] = True              # edges 2..5 of the ranking
    t = edge_table(scores, order[:4], reference=reference)   # draws edges 0..3
    assert t["status"].tolist() == ["added", "added", "kept", "kept", "dropped", "dropped"]
    assert t["edge"].tolist() == order[[0, 1, 2, 3, 4, 5]].tolist()
    pos = node_positions(3, 4)
    assert (t["x0"][0], t["y0"][0]) == pos[t["src"][0]]


def test_finetune_button_adds_checkpoints(view):
    view.ft_steps = 2
    with torch.enable_grad():
        view._request_finetune()
    ck = view.checkpoints
    assert ck is not None and ck["checkpoint"].values.tolist() == [0, 1, 2]
    n = 40
    view.param.update(checkpoint=2, diff=True, n_edges=n)
    view._edges_plot()
    mine = pruned_by_hand(view._ck_scores[2], top_n_by_hand(view._ck_scores[2], n))
    first = pruned_by_hand(view._ck_scores[0], top_n_by_hand(view._ck_scores[0], n))
    t = view._table
    edges = list(zip(t["src"].tolist(), t["dst"].tolist()))
    assert {e for e, s in zip(edges, t["status"]) if s != "dropped"} == mine
    assert {e for e, s in zip(edges, t["status"]) if s == "dropped"} == first - mine
    assert {e for e, s in zip(edges, t["status"]) if s == "kept"} == mine & first
    view.param.update(checkpoint=0, diff=False)


def test_drawn_nodes_follow_the_circuit_in_the_served_document(view):
    """In a Bokeh Document (as served), each slider move leaves the node plot's data source
    marking exactly the nodes of the segments drawn in the same document."""
    import panel as pn
    from bokeh.document import Document
    from bokeh.models import ColumnDataSource
    from panel.io.state import set_curdoc

    doc = Document()
    with set_curdoc(doc):
        doc.add_root(pn.panel(view).get_root(doc))
        assert len(view.nodes_drawn()) == 1
        for value in list(view._slider.options.values())[::4]:
            view._slider.value = value
            segs = [m.data for m in doc.select({"type": ColumnDataSource}) if "x0" in m.data]
            assert len(segs) == 1
            used = set(segs[0]["src"]) | set(segs[0]["dst"])
            nodes = view.nodes_drawn()[0]
            big = {n for n, s in zip(nodes["node"], nodes["size"]) if s == 9}
            dark = {n for n, f in zip(nodes["node"], nodes["fill"]) if f == "black"}
            assert big == dark == used
            assert len(nodes["node"]) == len(node_positions(view._model.n_layers,
                                                            view._model.spec.n_heads))
