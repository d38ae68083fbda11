"""The Circuits view (apps/circuits.py) headless on tiny-llama: slider, edge ablation, diff."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from apps.circuits import CircuitsView, edge_table, node_positions
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


def test_slider_draws_top_n_by_abs_score(view):
    scores = view.scores
    assert scores is not None and view.curve is not None
    for n in (1, 7, 40):
        view.n_edges = n
        view._edges_plot()
        drawn = set(zip(view._table["src"], view._table["dst"]))
        mag = np.abs(scores["score"].values)
        expected = {(str(scores["src"].values[i]), str(scores["dst"].values[i]))
                    for i in np.argsort(-mag, kind="stable")[:n]}
        assert drawn == expected
        assert len(view.param.edge.objects) == n + 1
        assert view.redraw_cpu_ms < 100   # CPU time: wall time depends on the machine's load


def test_edge_choice_patches_that_edge(view, tiny_model):
    view.n_edges = 10
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
    view.n_edges = 5
    view._edges_plot()
    view._tapped([2])
    assert view.edge == f"{view._table['src'][2]} → {view._table['dst'][2]}"


def test_edge_table_diff_marks_added_and_dropped(view):
    scores = view.scores
    order = np.argsort(-np.abs(scores["score"].values), kind="stable")
    reference = np.zeros(scores.sizes["edge"], bool)
    reference[order[2:6]] = True              # edges 2..5 of the ranking
    t = edge_table(scores, order, 4, reference=reference)   # draws edges 0..3
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
    view.param.update(checkpoint=2, diff=True, n_edges=8)
    view._edges_plot()
    assert set(view._table["status"]) <= {"kept", "added", "dropped"}
    shown = view._table["status"] != "dropped"
    assert int(shown.sum()) == 8
