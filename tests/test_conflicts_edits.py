"""Knowledge conflicts with the workspace's edits: the dual run and the single-run baseline on
an edited model (``edits=``), the page's clean vs edited answer bars, `add_to_juice`, and the
page's "copy as code" snippet. Values are checked against plain torch hooks on ``model.hf``
(a head's slice of the o_proj input zeroed, the chosen heads' slices added or scaled)."""
from __future__ import annotations

import numpy as np
import panel as pn
import pytest
import torch
import xarray as xr

from explorer._checks import InputError
from explorer.analyses import conflicts as C
from explorer.interventions import Ablate, Scale
from tests._hooks import removed_after
from tests._views import ablate_then_remove_l0h1

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _facts():
    return C.load_facts(["country_capital"])[:2]


def hooked_last_probs(model, prompt, *, ablate=(), add=(), scale=(), capture=()):
    """Softmax of the last position's logits with torch pre-hooks on o_proj: each (layer,
    head) in ``ablate`` zeroed; each (layer, head, z, alpha) in ``add`` gets ``alpha * z``
    ([pos, d_head]) added after that; each (layer, head, factor) in ``scale`` multiplied.
    ``capture``: layers whose (edited) o_proj input is returned too, [pos, head*d_head]."""
    ids = torch.tensor([model.tokenize([prompt]).token_ids[0]])
    d = model.spec.d_head
    by_layer: dict[int, list] = {}
    for layer, head in ablate:
        by_layer.setdefault(layer, []).append(("zero", head, None))
    for layer, head, z, alpha in add:
        by_layer.setdefault(layer, []).append(("add", head, alpha * z))
    for layer, head, factor in scale:
        by_layer.setdefault(layer, []).append(("scale", head, factor))
    seen, handles = {}, []
    for layer in set(by_layer) | set(capture):
        def hook(mod, args, _ops=by_layer.get(layer, []), _l=layer):
            x = args[0].clone()
            for op, h, v in _ops:
                sl = slice(h * d, (h + 1) * d)
                if op == "zero":
                    x[0, :, sl] = 0
                elif op == "add":
                    x[0, :, sl] += v
                else:
                    x[0, :, sl] *= v
            seen[_l] = x[0].clone()
            return (x, *args[1:])
        handles.append(model.o_proj(layer).register_forward_pre_hook(hook))
    with removed_after(handles), torch.no_grad():
        logits = model.hf(input_ids=ids).logits[0, -1].float()
    return torch.softmax(logits, -1), seen


def _answer_ids(model, fact):
    return [model.tokenizer(" " + a, add_special_tokens=False)["input_ids"][0]
            for a in (fact.memory, fact.context)]


def _pm(model, fact, probs):
    m, c = _answer_ids(model, fact)
    return [float(probs[m]), float(probs[c])]


def hooked_dual_run(model, prompt, plus, minus, alpha_l, alpha_s, ablate=()):
    """JuICE by hand: run 1 with the ablation keeps the chosen heads' o_proj inputs; run 2
    with the same ablation adds +alpha_l / -alpha_s times them."""
    layers = {l for l, _ in [*plus, *minus]}
    _, z = hooked_last_probs(model, prompt, ablate=ablate, capture=layers)
    d = model.spec.d_head
    add = [(l, h, z[l][:, h * d:(h + 1) * d], alpha_l) for l, h in plus]
    add += [(l, h, z[l][:, h * d:(h + 1) * d], -alpha_s) for l, h in minus]
    return hooked_last_probs(model, prompt, ablate=ablate, add=add)[0]


# an edit before the chosen heads (run 2 resumes after it) and one after them (run 2 must apply it)
@pytest.mark.parametrize("ablate", [[(0, 1)], [(2, 1)]])
def test_dual_run_and_single_run_on_an_edited_model_are_the_hooked_ones(tiny_model, ablate):
    model, fact = tiny_model, _facts()[0]
    prompt = C.conflict_prompt(fact, "substitution")
    plus, minus = [(1, 2)], [(2, 0)]
    edits = [Ablate(l, h) for l, h in ablate]
    run1 = C.juice_first_run(model, [prompt], edits=edits)
    assert run1.edits == tuple(edits)
    got = torch.softmax(C.juice_logits(model, None, plus, minus, alpha_l=3.0, alpha_s=1.0,
                                       run1=run1)[0], -1)
    want = hooked_dual_run(model, prompt, plus, minus, 3.0, 1.0, ablate)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    clean = hooked_dual_run(model, prompt, plus, minus, 3.0, 1.0)
    assert (want - clean).abs().max() > 1e-4          # the ablation matters here
    # the same without run1, and the edited run 1's own logits
    direct = torch.softmax(C.juice_logits(model, [prompt], plus, minus, alpha_l=3.0,
                                          alpha_s=1.0, edits=edits)[0], -1)
    torch.testing.assert_close(direct, want, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(torch.softmax(run1.logits[0], -1),
                               hooked_last_probs(model, prompt, ablate=ablate)[0],
                               rtol=1e-4, atol=1e-6)
    # the single-run baseline: ablation, then each head scaled by 1 + alpha_l / 1 - alpha_s
    single = torch.softmax(C.single_run_logits(model, None, plus, minus, alpha_l=2.0,
                                               alpha_s=0.5, run1=run1)[0], -1)
    want = hooked_last_probs(model, prompt, ablate=ablate,
                             scale=[(1, 2, 3.0), (2, 0, 0.5)])[0]
    assert (want - hooked_last_probs(model, prompt, scale=[(1, 2, 3.0), (2, 0, 0.5)])[0]
            ).abs().max() > 1e-5
    torch.testing.assert_close(single, want, rtol=1e-4, atol=1e-6)
    fresh = torch.softmax(C.single_run_logits(model, [prompt], plus, minus, alpha_l=2.0,
                                              alpha_s=0.5, edits=edits)[0], -1)
    torch.testing.assert_close(fresh, want, rtol=1e-4, atol=1e-6)
    # a run 1 of other edits is refused by name
    with pytest.raises(InputError, match="edits"):
        C.juice_logits(model, None, plus, minus, run1=run1, edits=[Ablate(1, 1)])
    with pytest.raises(TypeError, match="edit record"):
        C.juice_first_run(model, [prompt], edits=["L0.H1"])


# -- the page ------------------------------------------------------------------------------------

def _view(model, **params):
    from apps.conflicts import ConflictsView

    return ConflictsView(model, facts=_facts(), closed_book=False, background=False, n_new=2,
                         **params)


def _rows(rows):
    return {(a, r): v for a, r, v in rows}


def _bar_titles(layout):
    out = []
    for pane in layout.select(pn.pane.HoloViews):
        if {"cf-bars", "cf-bars-edited"} & set(pane.css_classes):
            obj = pane.object
            obj = obj() if callable(obj) else obj
            out.append(obj.opts.get().kwargs["title"])
    return out


def test_page_bars_clean_vs_edited_are_the_hooked_ones(tiny_model):
    model = tiny_model
    view = _view(model)
    fact = view._fact()
    prompt = C.conflict_prompt(fact, view.kind)
    assert view.edited_rows is None
    layout = view.__panel__()
    assert _bar_titles(layout) == ["P(answer)"]
    view.param.update(heads_plus=["L1.H2"], heads_minus=["L2.H0"], alpha_l=3.0, alpha_s=1.0)
    view.edits = [Ablate(0, 1)]
    view.wait()
    clean, edited = _rows(view.bar_rows), _rows(view.edited_rows)
    want = {
        "before": _pm(model, fact, hooked_last_probs(model, prompt, ablate=[(0, 1)])[0]),
        "after": _pm(model, fact, hooked_dual_run(model, prompt, [(1, 2)], [(2, 0)], 3.0, 1.0,
                                                  [(0, 1)]))}
    for run, (m, c) in want.items():
        assert edited["memory", run] == pytest.approx(m, rel=1e-4, abs=1e-7)
        assert edited["context", run] == pytest.approx(c, rel=1e-4, abs=1e-7)
    clean_before = _pm(model, fact, hooked_last_probs(model, prompt)[0])
    assert clean["memory", "before"] == pytest.approx(clean_before[0], rel=1e-4, abs=1e-7)
    # the ablation moves P(memory) well beyond the tolerance above (tiny-llama's answers sit
    # near 1 / vocab, so the change is small in absolute terms)
    assert abs(edited["memory", "before"] / clean["memory", "before"] - 1) > 1e-3
    layout = view.__panel__()
    assert _bar_titles(layout) == ["P(answer), clean", "P(answer), edited"]
    heading = [m.object for m in layout.select(pn.pane.Markdown) if "cf-edited-title" in m.css_classes]
    assert heading == ["**Edited: ablate L0.H1 (zero)**"]
    state = view._state_html()
    assert f"data-cf-edited='{','.join(f'{r[2]:.6f}' for r in view.edited_rows)}'" in state
    from apps.conflicts import edited_bars_caption

    text = edited_bars_caption(view.edited_rows, view.bar_rows, ["ablate L0.H1 (zero)"], fact)
    assert f"**{edited['memory', 'after']:.2f}** (clean {clean['memory', 'after']:.2f})" in text
    # the single-run baseline on the edited model too
    view.mode = "single"
    view.wait()
    single = _pm(model, fact, hooked_last_probs(model, prompt, ablate=[(0, 1)],
                                                scale=[(1, 2, 4.0), (2, 0, 0.0)])[0])
    assert _rows(view.edited_rows)["memory", "after"] == pytest.approx(single[0], rel=1e-4,
                                                                       abs=1e-7)
    view.edits = []
    view.wait()
    assert view.edited_rows is None and _bar_titles(view.__panel__()) == ["P(answer)"]
    view.close()


def test_add_to_juice(tiny_model, notes):
    view = _view(tiny_model)
    rows = view.bar_rows
    assert view.add_to_juice("L1.H2", "enhance") is True
    assert view.heads_plus == ["L1.H2"] and view.heads_minus == []
    assert view.bar_rows != rows                       # the bars were recomputed
    want = hooked_dual_run(tiny_model, C.conflict_prompt(view._fact(), view.kind), [(1, 2)], [],
                           view.alpha_l, view.alpha_s)
    assert _rows(view.bar_rows)["memory", "after"] == pytest.approx(
        _pm(tiny_model, view._fact(), want)[0], rel=1e-4, abs=1e-7)
    assert view.add_to_juice("a2.h0", "suppress") is True   # an older spelling, read canonically
    assert view.heads_minus == ["L2.H0"]
    assert view.add_to_juice("L1.H2", "suppress") is True   # moves from S+ to S-
    assert view.heads_plus == [] and view.heads_minus == ["L2.H0", "L1.H2"]
    assert view.add_to_juice("L1.H2", "suppress") is True   # already there: unchanged
    assert view.heads_minus == ["L2.H0", "L1.H2"]
    assert "moved to S- (suppress)" in notes[-2][1]
    before = (list(view.heads_plus), list(view.heads_minus), view.bar_rows)
    for component, which, message in [
            ("L1.MLP", "enhance", "not an attention head"),
            ("L1", "suppress", "not an attention head"),
            ("L9.H0", "enhance", "out of range"),
            ("L1.H7", "enhance", "out of range"),
            ("banana", "enhance", "cannot read component"),
            (None, "enhance", "a component name is a string"),
            ("L1.H0", "boost", "`which` must be one of 'enhance', 'suppress'")]:
        n = len(notes)
        assert view.add_to_juice(component, which) is False
        assert len(notes) == n + 1 and notes[-1][0] == "error"
        assert message in notes[-1][1] and "\n" not in notes[-1][1]
        assert (list(view.heads_plus), list(view.heads_minus), view.bar_rows) == before
    view.close()


def test_snippet_recomputes_what_the_page_shows(tiny_model):
    view = _view(tiny_model)
    view.param.update(heads_plus=["L1.H2"], heads_minus=["L2.H0"], alpha_l=2.0)
    view.edits = [Ablate(0, 1), Scale(1, 3, 0.5)]
    view._request("split")
    view.wait()
    ns: dict = {}
    exec(compile(view.code_snippet(), "<snippet>", "exec"), ns)  # noqa: S102 - the page's own
    assert ns["model"].spec.name == "tiny-llama" and ns["fact"] == view._fact()
    xr.testing.assert_allclose(ns["heatmap"], view.scores.direct_diff.mean(("kind", "fact")))
    shown, edited = _rows(view.bar_rows), _rows(view.edited_rows)
    for name, rows, run in (("before", shown, "before"), ("after", shown, "after"),
                            ("edited_before", edited, "before"), ("edited_after", edited, "after")):
        np.testing.assert_allclose(ns[name], [rows["memory", run], rows["context", run]],
                                   rtol=1e-5, atol=1e-8)
    xr.testing.assert_allclose(ns["accuracy"].memory_accuracy, view.accuracy.memory_accuracy)
    # the page's data export holds the same numbers as tables
    from apps._view import read_export

    tables = read_export(view.export_bytes())["tables"]
    for name, rows in (("answer_bars", view.bar_rows), ("answer_bars_edited", view.edited_rows)):
        assert tables[name].values.tolist() == [list(r) for r in rows]
    assert tables["accuracy_table"].shape == (3, 1 + 2 * view.accuracy.sizes["kind"])
    view.close()


def test_gallery_conflicts_follow_the_edit_stack(tiny_model):
    from apps.conflicts import ConflictsView
    from apps.gallery import Gallery

    views = [("Knowledge conflicts", "conflicts",
              lambda m: ConflictsView(m, facts=_facts(), closed_book=False, n_new=2))]
    g = Gallery("tiny-llama", views=views, view="conflicts")
    try:
        page = g.page("conflicts")
        page.wait()

        def check():
            fact = page._fact()
            want = _pm(tiny_model, fact, hooked_last_probs(
                tiny_model, C.conflict_prompt(fact, page.kind), ablate=[(0, 1)])[0])
            got = _rows(page.edited_rows)
            assert [got["memory", "before"], got["context", "before"]] == pytest.approx(
                want, rel=1e-4, abs=1e-7)
        ablate_then_remove_l0h1(g, page, "edited_rows", check)
    finally:
        g.close()


def test_no_heads_caption_and_split_progress_with_time_left(tiny_model):
    """With S+ and S- empty both runs are the plain model (before == after), and the caption
    says no head is selected and what to press; scoring the split posts the time left."""
    import re

    from apps.conflicts import NO_HEADS_NOTE, bars_caption, split_time_left

    view = _view(tiny_model)
    assert view.heads_plus == [] and view.heads_minus == []
    rows = _rows(view.bar_rows)
    assert rows["memory", "before"] == pytest.approx(rows["memory", "after"], abs=1e-6)
    fact = view._facts[view.example]
    assert bars_caption(view.bar_rows, fact, view.mode, n_heads=0).startswith(NO_HEADS_NOTE)
    assert NO_HEADS_NOTE not in bars_caption(view.bar_rows, fact, view.mode, n_heads=1)
    shown = [o.object for o in view.__panel__().select(pn.pane.Markdown)]
    assert any(str(s).startswith("**No head selected yet**") for s in shown)
    statuses = []
    view.param.watch(lambda e: statuses.append(e.new), "status")
    view._request("split")
    lines = [s for s in statuses if s.startswith("scoring:")]
    assert lines and all(re.fullmatch(r"scoring: \d+/\d+ facts, (about \d+ s left|timing…)", s)
                         for s in lines)
    assert any("left" in s for s in lines)
    assert (split_time_left(40), split_time_left(200)) == ("about 40 s left", "about 3 min left")
    view.close()
