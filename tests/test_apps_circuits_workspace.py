"""The Circuits page in the session workspace (apps/circuits.py, headless on tiny-llama): the
user's own prompt pairs, workspace edits (the task metric clean vs edited), a selection made
elsewhere drawn in the graph, "Patch all shown edges", and the page's copy-as-code snippet."""
from __future__ import annotations

import numpy as np
import panel as pn
import pytest
import torch

import apps.circuits as ac
from apps.circuits import OWN_TASK, CircuitsView
from explorer.analyses import circuits as ca
from explorer.analyses import user_items as ui
from tests.test_lens_edits import zero_heads

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# two pairs whose prompts have as many tokens, and whose answers start with different tokens,
# on tiny-llama's 512-token tokenizer
PAIRS = ('"Tom gave a drink to " | "Kim gave a drink to " | "Mary" | "Bob"\n'
         '"The sum: 12 + 30 = " | "The sum: 12 - 30 = " | "4" | "1"')


@pytest.fixture(scope="module")
def own_view(tiny_model):
    """A page that computed the circuit of PAIRS, pasted in its 'Your own' box."""
    with torch.enable_grad():
        view = CircuitsView(tiny_model, background=False, autostart=False)
        view.__panel__()
        view._own.area.value = PAIRS
        view._own.button.clicks += 1
    return view


def test_own_pairs_are_the_task_and_their_scores_are_edge_scores(own_view, tiny_model):
    view = own_view
    task = ui.parse_circuit_pairs(PAIRS, tiny_model, name=OWN_TASK)
    assert view.task == OWN_TASK and view.error == "" and OWN_TASK in view.param.task.objects
    assert view._task.clean == task.clean and view._task.answer == task.answer
    assert view.scores is not None and view.scores.attrs["n_prompts"] == 2
    with torch.enable_grad():
        want = ca.edge_scores(tiny_model, task, method="eap", batch_size=len(task))
    np.testing.assert_allclose(view.scores["score"].values, want["score"].values, rtol=1e-5,
                               atol=1e-7)
    assert view.scores.attrs["clean_metric"] == pytest.approx(want.attrs["clean_metric"], abs=1e-5)
    assert list(view.scores["src"].values) == list(want["src"].values)


def test_own_pairs_bad_text_shows_one_line_and_keeps_the_result(own_view):
    view = own_view
    scores = view.scores
    root = view.__panel__()
    area = view._own.area
    assert area in root.select(pn.widgets.TextAreaInput) and area.placeholder == ui.CIRCUIT_FORMAT
    area.value = PAIRS + "\n" + '"Tom gave a drink to " | "Kimberly gave a drink to " | "a" | "b"'
    view._own.button.clicks += 1
    assert view.error.startswith("line 3: the clean prompt has 14 tokens and the corrupted "
                                 "prompt 18") and "\n" not in view.error
    assert view.scores is scores and view.task == OWN_TASK
    shown = [m.object for m in root.select(pn.pane.Markdown) if "own-items-error" in m.css_classes]
    assert shown == [view.error]
    area.value = PAIRS


def test_pairs_a_link_sets_are_taken_in_and_bad_ones_keep_the_old(own_view, tiny_model):
    """`own_pairs` holds the pairs Use took in; a fresh page given them (a link) shows them
    in its box and scores them; pairs it refuses leave the ones taken in before."""
    assert own_view.own_pairs == PAIRS and own_view.link_params.index("own_pairs") < \
        own_view.link_params.index("task")
    view = CircuitsView(tiny_model, background=False, autostart=False)
    with torch.enable_grad():     # a link's settings, in the order of `link_params`
        view.param.update(method="eap-ig")
        view.own_pairs = PAIRS
        view.task = OWN_TASK
    assert view._own.area.value == PAIRS and view.task == OWN_TASK and view.error == ""
    task = ui.parse_circuit_pairs(PAIRS, tiny_model, name=OWN_TASK)
    assert view.shown.prompts == tuple(task.clean) and view.shown.method == "eap-ig"
    shown = view.shown
    view.own_pairs = "one field only"
    assert view.error.startswith("line 1: 1 field(s)") and view.own_pairs == PAIRS
    assert view.shown is shown and view.task == OWN_TASK


def hooked_logit_diff(model, task, ablate=()):
    """Per pair: the answer's minus the wrong answer's logit at the last token, each prompt run
    alone by the Hugging Face model with each (layer, head) in ``ablate`` zeroed at the input
    of its layer's o_proj by torch hooks; the answers' first tokens read from the tokenizer."""
    tok = model.tokenizer
    handles = zero_heads(model, ablate)
    out = {"clean": [], "corrupt": []}
    try:
        for i, (a, w) in enumerate(zip(task.answer, task.wrong)):
            n = len(tok(task.clean[i], add_special_tokens=False)["input_ids"])
            first = [tok(task.clean[i] + t, add_special_tokens=False)["input_ids"][n] for t in (a, w)]
            for which in out:
                ids = torch.tensor([tok(getattr(task, which)[i], add_special_tokens=False)["input_ids"]])
                with torch.no_grad():
                    logits = model.hf(input_ids=ids).logits[0, -1].double()
                out[which].append(float(logits[first[0]] - logits[first[1]]))
    finally:
        for h in handles:
            h.remove()
    return {k: np.array(v) for k, v in out.items()}


def test_edits_show_the_task_metric_clean_vs_edited_as_torch_hooks(own_view, tiny_model):
    import explorer

    view = own_view
    task = view._task
    assert view.edited is None and "Workspace edits" not in view._readout()
    view.edits = [explorer.Ablate(layer=1, head=2), explorer.Ablate(layer=0, head=0)]
    e = view.edited
    plain = hooked_logit_diff(tiny_model, task)
    edited = hooked_logit_diff(tiny_model, task, ablate=[(1, 2), (0, 0)])
    assert abs(edited["clean"].mean() - plain["clean"].mean()) > 1e-4   # the edit matters
    assert e["clean_metric"] == pytest.approx(plain["clean"].mean(), abs=1e-4)
    assert e["corrupt_metric"] == pytest.approx(plain["corrupt"].mean(), abs=1e-4)
    assert e["edited_clean_metric"] == pytest.approx(edited["clean"].mean(), abs=1e-4)
    assert e["edited_corrupt_metric"] == pytest.approx(edited["corrupt"].mean(), abs=1e-4)
    # the unedited metric is the one the edge scores report (the circuit's own forward)
    assert e["clean_metric"] == pytest.approx(view.scores.attrs["clean_metric"], abs=1e-4)
    want = (edited["clean"].mean() - plain["corrupt"].mean()) / (plain["clean"].mean() -
                                                                 plain["corrupt"].mean())
    assert e["recovered"] == pytest.approx(want, rel=1e-3)
    text = view._readout()
    assert "ablate L1.H2 (zero), ablate L0.H0 (zero)" in text
    assert f"{e['clean_metric']:.4f} → {e['edited_clean_metric']:.4f}" in text
    assert f"data-circuit-edited='{e['clean_metric']:.9g} " in view._state_html()
    # the faithfulness panel marks the edited model's share
    assert float(view.edited_line().data) == pytest.approx(want, rel=1e-3)
    from bokeh.models import Span

    fig = view._faithfulness_pane(view.curve, view.edited).object
    lines = [el for el in fig.center if isinstance(el, Span)]   # and the target's
    assert sorted(el.location for el in lines) == pytest.approx(sorted([want, view.fraction]))
    view.edits = []
    assert view.edited is None and "Workspace edits" not in view._readout()


def test_a_selection_outside_the_circuit_is_drawn_with_its_strongest_edges(own_view):
    view = own_view
    scores = view.scores
    view.param.update(mode="top-n", n_edges=6)
    view.redraw()
    t = view._table
    used = set(t["src"]) | set(t["dst"])
    heads = [f"L{layer}.H{h}" for layer in range(3) for h in range(4)]
    outside = next(h for h in heads if h not in used)
    view.selected = outside                       # as the gallery sets it
    view.redraw()
    # outlined, but its edges outside the circuit are drawn only when asked for
    assert not (view._table["status"] == "outside").any()
    assert f"**{outside}** has no edge in this circuit (tick" in view._caption()
    view.show_outside = True
    view.redraw()
    t = view._table
    rows = t["status"] == "outside"
    # its 5 strongest edges by |score|, by a plain sort over the scores here
    layer, head = outside[1:].split(".H")
    raw = f"a{layer}.h{head}"
    mine = [(abs(float(v)), str(s), str(d)) for s, d, v in
            zip(scores["src"].values, scores["dst"].values, scores["score"].values)
            if raw in (str(s), str(d))]
    want = sorted(mine, key=lambda r: -r[0])[:5]
    spell = {n: c for n, c in view._spell.items()}
    assert list(zip(t["src"][rows], t["dst"][rows])) == [(spell[s], spell[d]) for _, s, d in want]
    assert (t["color"][rows] == ac_outside()).all() and (t["alpha"][rows] >= 0.6).all()
    # the circuit itself is unchanged, and counted without them
    assert (~rows).sum() == view._shown["drawn"]
    assert f"data-circuit-edges='{view._shown['drawn']}'" in view._state_html()
    caption = view._caption()
    assert f"**{outside}** has no edge in this circuit; its strongest edges" in caption
    s0, d0 = spell[want[0][1]], spell[want[0][2]]
    assert f"{s0} → {d0}" in caption
    # highlighted and labelled: the biggest node, its short label
    cols = view.node_columns()
    k = cols["name"].index(outside)
    assert cols["size"][k] == max(cols["size"]) and cols["text"][k] == f"H{head}"
    assert "outside" not in view.circuit_csv() and len(view.circuit_csv().splitlines()) == \
        view._shown["drawn"] + 1
    # a head the circuit touches: no extra edges, the caption says its edges stand out
    inside = next(iter(sorted(n for n in used if ".H" in n)))
    view.param.update(selected=inside, show_outside=False)
    view.redraw()
    assert not (view._table["status"] == "outside").any()
    assert f"Selected: **{inside}**; its edges in the circuit stand out" in view._caption()
    view.param.update(selected="", show_outside=False)


def ac_outside():
    from apps import _circuit_graph as cg
    return cg.OUTSIDE


def test_head_labels_are_short_inside_their_layer_column(own_view):
    """Labels drawn: ``H3`` for a head (its layer is the x axis), full names for MLPs,
    input and logits; only nodes the circuit touches; centred on the node's column."""
    view = own_view
    view.param.update(mode="top-n", n_edges=40, selected="")
    view.redraw()
    t = view._table
    used = set(t["src"]) | set(t["dst"])
    cols = view.node_columns()
    want = {}
    for name in used:
        want[name] = name.split(".")[1] if ".H" in name else name
    got = {n: x for n, x in zip(cols["name"], cols["text"]) if x}
    assert got == want
    fig = view._graph_figure()
    heads, mlps = (fig.select_one({"name": n}) for n in ("head-labels", "mlp-labels"))
    assert heads.glyph.angle == 0 and heads.glyph.text_align == "center"
    assert mlps.glyph.angle == pytest.approx(np.pi / 2)
    drawn = list(heads.data_source.data["text"]) + list(mlps.data_source.data["text"])
    assert sorted(drawn) == sorted(want.values())   # every label the circuit needs, once
    assert all(str(v).endswith(".MLP") for v in mlps.data_source.data["text"])
    assert not any(str(v).endswith(".MLP") for v in heads.data_source.data["text"])


def test_patch_all_shown_edges_is_the_shown_circuits_faithfulness(own_view, tiny_model,
                                                                   monkeypatch):
    view = own_view
    scores = view.scores
    view.param.update(mode="top-n", n_edges=12, selected="")
    view.redraw()
    t = view._table
    # the shown edges, as (src, dst) in the one spelling -> a mask built here over the scores
    shown = set(zip(t["src"], t["dst"]))
    spell = view._spell
    keep = np.array([(spell[str(s)], spell[str(d)]) in shown
                     for s, d in zip(scores["src"].values, scores["dst"].values)])
    assert 0 < keep.sum() == len(shown) < len(keep)
    buttons = {b.name: b for b in view.__panel__().select(pn.widgets.Button)}
    buttons["Patch all shown edges"].clicks += 1
    c = view.circuit_patch
    want = ca.patch_edges_metric(tiny_model, view._task, scores, keep, batch_size=2)
    assert c["metric"] == pytest.approx(want["metric"], abs=1e-7)
    assert c["recovered"] == pytest.approx(want["recovered"], abs=1e-6)
    assert c["n_shown"] == keep.sum()
    # where the curve was measured at this size, the shown circuit's faithfulness is the
    # curve's; also when only its strongest few edges are drawn (the whole circuit is kept)
    n = int(view.curve["n_edges"].values[-4])
    monkeypatch.setattr(ac, "MAX_DRAWN_EDGES", 5)
    view.n_edges = n
    view.redraw()
    # drawn: the influence-pruned subset (circuit_influence.influence_pruning)
    n_drawn = int(view._influence["drawn"].sum())
    assert view._shown["size"] > view._shown["drawn"] == n_drawn
    buttons["Patch all shown edges"].clicks += 1
    assert view.circuit_patch["n_shown"] == int(view.curve["n_kept"].sel(n_edges=n))
    assert view.circuit_patch["recovered"] == pytest.approx(
        float(view.curve["recovered"].sel(n_edges=n)), abs=1e-6)
    text = view._readout()
    assert f"**Only the circuit's {view.circuit_patch['n_shown']:,} edges kept** ({n_drawn:,} of them drawn)" in text
    assert f"{view.circuit_patch['recovered']:.0%}** of the clean − corrupted gap" in text


def test_copy_as_code_recomputes_the_pages_scores_circuit_and_metric(own_view, tiny_model):
    import explorer

    view = own_view
    view.param.update(mode="top-n", n_edges=int(view.curve["n_edges"].values[4]))
    view.edits = [explorer.Ablate(layer=1, head=2)]
    code = view.code_snippet()
    assert "user_items.parse_circuit_pairs(" in code and "load_model('tiny-llama')" in code
    ns: dict = {}
    with torch.enable_grad():
        exec(compile(code, "<circuits snippet>", "exec"), ns)  # noqa: S102 - the page's snippet
    np.testing.assert_allclose(ns["scores"]["score"].values, view.scores["score"].values,
                               rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(ns["curve"]["recovered"].values, view.curve["recovered"].values,
                               rtol=1e-5, atol=1e-6)
    view.redraw()
    drawn = set(zip(view._table["src"], view._table["dst"]))
    spell = view._spell
    assert {(spell[s], spell[d]) for s, d in ns["edges"]} == drawn
    assert int(ns["circuit"].values.sum()) == view._shown["size"]
    assert np.mean(ns["clean"]) == pytest.approx(view.edited["clean_metric"], abs=1e-6)
    assert np.mean(ns["edited"]) == pytest.approx(
        view.edited["edited_clean_metric"], abs=1e-6)
    view.edits = []
    # a generated task's snippet makes the same task as the page
    assert "ca.make_task('add', 8, seed=0)" in CircuitsView(
        tiny_model, background=False, autostart=False).code_snippet()
