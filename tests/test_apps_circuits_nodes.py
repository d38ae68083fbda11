"""The Circuits page's node granularity, headless on tiny-llama: the toggle measures the node
curve, opens on the smallest measured node circuit reaching the target (read here from the
curve's values), draws exactly the edges between its nodes (found here by a loop over the
edges, ranking nodes by their out-edge sums), and its faithfulness equals node patching
done with plain torch hooks (tests/test_circuit_nodes.py's reference)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_circuit_nodes import hook_node_patched_metric

from apps.circuits import CircuitsView
from explorer.analyses import circuits as ca


@pytest.fixture(scope="module")
def view(tiny_model, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("EXPLORER_CACHE", str(tmp_path_factory.mktemp("cache")))
    with torch.enable_grad():
        v = CircuitsView(tiny_model, background=False, n_prompts=4)
    yield v
    mp.undo()


def ranking_by_hand(scores):
    total: dict[str, float] = {}
    for s, v in zip(scores["src"].values.astype(str), scores["score"].values):
        total[s] = total.get(s, 0.0) + float(v)
    return sorted(total, key=lambda n: -abs(total[n]))


def test_node_toggle_opens_on_the_smallest_faithful_node_circuit(view, tiny_model):
    assert view.scores is not None and view.node_curve is None
    view.granularity = "nodes"
    curve = view.node_curve
    assert curve is not None
    ks, rec = curve["n_nodes"].values.tolist(), curve["recovered"].values.tolist()
    reaching = [k for k, r in zip(ks, rec) if r >= view.fraction]
    want = reaching[0] if reaching else max((k for k in ks if k > 0),
                                            key=lambda k: rec[ks.index(k)])
    assert view.n_nodes == want
    assert view._slider.value == want and set(view._slider.options.values()) == {
        k for k in ks if k > 0}
    text = view.default_text()
    if reaching:
        assert f"recovering at least {view.fraction:.0%}" in text and f"{want:,} nodes" in text
    else:
        assert "No measured node circuit recovers" in text
    # the drawn circuit: the edges between the top-k nodes and into the logits
    kept = set(ranking_by_hand(view.scores)[:view.n_nodes])
    by_hand = {(str(s), str(d)) for s, d in zip(view.scores["src"].values,
                                                view.scores["dst"].values)
               if str(s) in kept and (ca.node_of(str(d)) in kept or str(d) == "logits")}
    drawn = view.redraw()
    got = {(s, d) for s, d in zip(view._table["src"], view._table["dst"])}
    spell = view._spell
    assert got == {(spell[s], spell[d]) for s, d in by_hand}
    assert drawn["title"].startswith(f"{view.n_nodes:,} nodes, {len(by_hand):,} edges")
    # its faithfulness, on the page's pairs, is node patching by hooks
    patched, clean, corrupt = hook_node_patched_metric(tiny_model, view._task, kept)
    k = view.n_nodes
    assert float(curve["recovered"].sel(n_nodes=k)) == pytest.approx(
        (patched - corrupt) / (clean - corrupt), abs=1e-4)
    data, title = view._marker_state()
    assert data["edges"] == [float(k)] and title.startswith(f"Node faithfulness: {k:,} nodes")


def test_node_slider_and_link_state(view):
    view.granularity = "nodes"
    sizes = sorted(view._slider.options.values())
    view._slider.value = sizes[-1]
    assert view.n_nodes == sizes[-1]
    mask = view.shown_edges()
    assert int(mask.sum()) == view._shown["size"]
    assert "granularity" in view.link_params and "n_nodes" in view.link_params
    assert "cs.node_circuit(scores, " in view.code_snippet()
    html = view._state_html()
    assert "data-circuit-granularity='nodes'" in html
    assert f"data-circuit-n-nodes='{sizes[-1]}'" in html
    # back to edges: the edge circuit and its slider again
    view.granularity = "edges"
    assert view._slider.label == view.param.n_edges.label
    assert view.redraw()["title"].startswith("Circuit: ")
    np.testing.assert_array_equal(view.shown_edges(),
                                  ca.select_circuit(view.scores, top_n=view.n_edges).values)


def test_fraction_moves_the_node_default(view):
    view.granularity = "nodes"
    curve = view.node_curve
    ks, rec = curve["n_nodes"].values.tolist(), curve["recovered"].values.tolist()
    view.fraction = 0.05
    reaching = [k for k, r in zip(ks, rec) if r >= 0.05]
    if reaching:
        assert view.n_nodes == reaching[0]
    view.fraction = 0.8
