"""ICL heads view, headless: score heatmaps, the exclusion toggle, clicking a heatmap cell."""
from __future__ import annotations

import re

import holoviews as hv
import numpy as np
import panel as pn
import pytest
import xarray as xr

import explorer
from apps import theme
from apps.icl_heads import ICLHeadsView, plot_ablation_curves, plot_score_heatmaps


def _scores(ind, fv):
    return xr.Dataset({"induction_score": (("layer", "head"), ind),
                       "fv_score": (("layer", "head"), fv)},
                      coords={"layer": range(ind.shape[0]), "head": range(ind.shape[1])})


def test_score_heatmaps_show_both_scores_with_their_colour_maps():
    ind = np.array([[0.1, 0.5, 0.0], [0.9, 0.2, 0.3]])
    fv = np.array([[0.02, -0.05, 0.0], [0.01, 0.04, -0.01]])
    layout = plot_score_heatmaps(_scores(ind, fv))
    left, right = list(layout)
    for plot, values in ((left, ind), (right, fv)):
        got = {(int(h), int(l)): v for h, l, v in zip(plot.dimension_values(0),
                                                       plot.dimension_values(1),
                                                       plot.dimension_values(2))}
        assert got == {(h, l): values[l, h] for l in range(2) for h in range(3)}
    def opts(el):
        return {**hv.Store.lookup_options("bokeh", el, "plot").kwargs,
                **hv.Store.lookup_options("bokeh", el, "style").kwargs}

    lo, ro = opts(left), opts(right)
    assert lo["cmap"] == theme.MAGNITUDE_CMAP and lo["clim"] == (0.0, 0.9)
    assert ro["cmap"] == theme.SIGNED_CMAP and ro["clim"] == (-0.05, 0.05)   # centred on 0
    assert isinstance(plot_score_heatmaps(None), hv.Text)


def test_ablation_plot_draws_the_chosen_variable():
    ds = xr.Dataset({"mean_accuracy": (("ranking", "percent"), [[1.0, 0.5], [1.0, 0.9]]),
                     "mean_answer_prob": (("ranking", "percent"), [[0.6, 0.2], [0.6, 0.5]])},
                    coords={"ranking": ["fv", "random"], "percent": [0.0, 10.0]})
    overlay = plot_ablation_curves(ds, "mean_answer_prob")
    curves = [el for el in overlay if isinstance(el, hv.Curve)]
    assert [c.label for c in curves] == ["fv", "random"]
    np.testing.assert_allclose(curves[0].dimension_values(1), [0.6, 0.2])
    assert curves[0].vdims[0].name == "P(answer)"


def test_view_exclusion_toggle_and_cell_click(tiny_model):
    view = ICLHeadsView(tiny_model, background=False, n_prompts=2, n_shots=2,
                        fv_tasks=("antonym",), eval_tasks=("uppercase",),
                        td_tasks=("antonym", "uppercase"))
    assert view.scores is not None and view.td is not None
    view.max_percent = 10
    view._request("curves")
    # the paper's exclusion variant by default: the other score's top 2 % left out
    assert list(view.curves.ranking.values) == ["fv_excl_induction", "induction_excl_fv",
                                                "random"]
    assert view.curves.attrs["params"]["exclude_fraction"] == pytest.approx(0.02)
    assert "data-icl-rankings='fv_excl_induction,induction_excl_fv,random'" in view._state_html()
    view.exclude_percent = 5.0         # recomputes at once
    assert view.curves.attrs["params"]["exclude_fraction"] == pytest.approx(0.05)
    view.exclude_other = False
    assert list(view.curves.ranking.values) == ["fv", "induction", "random"]
    view._cell_tapped(x=3, y=2)
    assert (view.layer, view.head) == (2, 3)
    view._cell_tapped(x=7, y=0)        # outside the model: ignored
    assert (view.layer, view.head) == (2, 3)
    # what the page shows: the selected head's attention titled with its name, right under
    # the scatter (a click's result next to it), and every slider's tooltip
    import panel as pn

    root = view.__panel__()
    main = root[1]
    panes = [o for o in main if isinstance(o, pn.pane.HoloViews)]
    # the paper's setting and card, the scatter, its caption, then the head
    assert main.objects.index(panes[1]) == 3
    assert panes[1].object.opts.get().kwargs["title"] == "L2.H3, repeated sequence"
    sliders = root.select(pn.widgets.IntSlider) + root.select(pn.widgets.FloatSlider)
    tips = {w.value for w in root.select(pn.widgets.TooltipIcon)}
    names = ["top_induction", "top_fv", "layer", "head", "max_percent", "exclude_percent",
             "fv_layer", "td_layer", "conflict_layer"]
    # the conflict test's layer is a DiscreteSlider (an IntSlider inside)
    assert len(sliders) == 9 and all(view.param[n].doc in tips for n in names)
    described = {w.description for w in root.select(pn.widgets.MultiChoice)
                 + root.select(pn.widgets.TextInput)}
    assert {view.param.conflict_tasks.doc, view.param.conflict_layers.doc} <= described
    assert view.param.exclude_other.doc in tips


def test_view_scores_on_request_and_explains_the_function_vector(tiny_model, monkeypatch):
    """With compute_on_open=False nothing is scored until Compute scores; its scores are the
    analyses' own; the FV caption names the heads, which are the same for every task."""
    from apps import icl_heads as page
    from explorer.analyses import icl_heads as ih
    from explorer.analyses import task_vectors as tv

    view = ICLHeadsView(tiny_model, background=False, n_prompts=2, n_shots=2,
                        fv_tasks=("antonym", "country-capital"), eval_tasks=("uppercase",),
                        td_tasks=("antonym", "uppercase"), compute_on_open=False)
    assert view.scores is None and view.fv_result is None and view.td is None
    assert "Compute scores" in view.status
    want = ih.head_attention(tiny_model, 0, 0, task="antonym")     # shown while scores wait
    np.testing.assert_allclose(view.patterns["repeat"]["attention"].values,
                               want["repeat"]["attention"].values, rtol=1e-5)
    view._score_button.clicks += 1
    assert view.td is not None
    fv = ih.fv_scores(tiny_model, ["antonym", "country-capital"], n_prompts=2, n_shots=2)
    ind = ih.induction_scores(tiny_model, n_sequences=4, half_len=50)
    np.testing.assert_allclose(view.scores["fv_score"].values, fv["fv_score"].values, rtol=1e-5)
    np.testing.assert_allclose(view.scores["induction_score"].values,
                               ind["induction_score"].values, rtol=1e-5)
    for task in ("antonym", "country-capital"):
        view.task = task
        want = tv.function_vector_accuracy(tiny_model, [task], fv["fv_score"].values,
                                           layer=view.fv_layer, n_prompts=2, n_shots=2)
        got = view.fv_result
        assert str(got.task.values[0]) == task
        assert float(got.few_shot_accuracy[0]) == float(want.few_shot_accuracy[0])
        heads = ", ".join(f"L{l}.H{h}" for l, h in ih.top_heads(fv["fv_score"].values, 0.02))
        text = view._fv_text()
        assert f"heads {heads} added at layer {view.fv_layer}" in text
        assert "same heads" in text and "count 2 prompts (steps of 50%)" in text
    # the default: score on open only when the estimate is under the budget
    monkeypatch.setattr(page, "OPEN_BUDGET_S", 0.0)
    assert ICLHeadsView(tiny_model, background=False, n_prompts=2, n_shots=2,
                        fv_tasks=("antonym",), td_tasks=("antonym", "uppercase")).scores is None


# -- the task-vector conflict test ------------------------------------------------------------

CONFLICT_TASKS = ["capitalize", "uppercase", "choose-first-of-3", "choose-last-of-3"]


def _cells(plot) -> dict[tuple[str, str], tuple[float, float, float, int]]:
    """(column, row) -> (value, low, high, n_scored) of a conflict heatmap overlay."""
    heat = plot.get(0)
    cols = [heat.dimension_values(i, flat=True) for i in range(6)]
    return {(str(c), str(r)): (float(v), float(lo), float(hi), int(n))
            for c, r, v, lo, hi, n in zip(*cols)}


def _same(a: float, b: float) -> bool:
    return (a != a and b != b) or a == b


@pytest.mark.slow
def test_conflict_matrix_is_the_analysis_result(tiny_model):
    """Run on request: the page's Dataset, its A x B matrix at the layer shown, the controls
    and the hover intervals equal `conflicting_task_patching` called directly."""
    import panel as pn

    from explorer.analyses.task_vector_patching import conflicting_task_patching

    view = ICLHeadsView(tiny_model, background=False, n_prompts=3, n_shots=2,
                        fv_tasks=("antonym",), td_tasks=("antonym", "uppercase"),
                        compute_on_open=False)
    assert view.conflict is None
    view.param.update(conflict_tasks=CONFLICT_TASKS, conflict_layers="0, 2")
    view._conflict_button.clicks += 1                 # what the button does
    want = conflicting_task_patching(tiny_model, CONFLICT_TASKS, layers=[0, 2], n_prompts=3,
                                     n_shots=2)
    got = view.conflict
    xr.testing.assert_identical(got.drop_attrs(), want.drop_attrs())
    assert got.attrs["params"] == want.attrs["params"]
    assert view.param.conflict_layer.objects == [0, 2]
    assert view.conflict_layer == want.attrs["best_layer"]
    root = view.__panel__()

    def drawn(css):
        return next(p for p in root.select(pn.pane.HoloViews) if css in p.css_classes).object

    assert np.isfinite(want.follows_source.values).any()
    # tiny-llama's answers rarely follow either task, so the drawn cells are also checked on
    # the same Dataset with distinct random rates (NaN where the analysis has none)
    rng = np.random.default_rng(0)
    stats = [v for v in want.data_vars if v.startswith("follows_")]
    fake = want.assign({v: want[v].copy(data=np.where(np.isnan(want[v].values), np.nan,
                                                      rng.random(want[v].shape)))
                        for v in stats})
    for ds in (want, fake):
        view.conflict = ds
        _check_drawn(view, drawn, ds)
    view.conflict = got
    # a pair with no defined answer is blank, not 0; uppercase -> choose is scored
    matrix = _cells(drawn("icl-conflict-matrix"))
    assert want.n_scored.sel(source="choose-first-of-3", target="capitalize") == 0
    assert np.isnan(matrix[("capitalize", "first-of-3")][0])
    assert want.n_scored.sel(source="uppercase", target="choose-first-of-3") > 0
    assert "data-icl-conflict='capitalize,uppercase,choose-first-of-3,choose-last-of-3'" \
        in view._state_html()
    assert "follows A on" in drawn_caption(root) and "Null task's vector" in drawn_caption(root)


def _check_drawn(view, drawn, want):
    from apps.icl_heads import _short_task, conflict_matrix

    for layer in (0, 2):
        view.conflict_layer = layer                   # the slider moves both matrices
        matrix = _cells(drawn("icl-conflict-matrix"))
        assert len(matrix) == len(CONFLICT_TASKS) ** 2
        for a in CONFLICT_TASKS:
            for b in CONFLICT_TASKS:
                w = want.sel(source=a, target=b, layer=layer)
                cell = matrix[(_short_task(b), _short_task(a))]
                for v, key in zip(cell, ("follows_source", "follows_source_low",
                                         "follows_source_high", "n_scored")):
                    assert _same(v, float(w[key])), (a, b, layer, key)
        np.testing.assert_array_equal(
            conflict_matrix(view.conflict, layer).values,
            want.follows_source.sel(source=CONFLICT_TASKS, layer=layer).values)
        controls = _cells(drawn("icl-conflict-controls"))
        for source, row in (("null", "Null vector"), ("none", "no patch")):
            for b in CONFLICT_TASKS:
                w = want.sel(source=source, target=b, layer=layer)
                assert _same(controls[(_short_task(b), row)][0], float(w.follows_target))
                assert _same(controls[(_short_task(b), row)][1], float(w.follows_target_low))


def drawn_caption(root) -> str:
    import panel as pn

    pane = next(p for p in root.select(pn.pane.Markdown) if "icl-conflict-caption" in p.css_classes)
    return str(pane.object)


def test_conflict_test_bad_input_is_a_clear_message_and_keeps_the_matrix(tiny_model, notes):
    view = ICLHeadsView(tiny_model, background=False, n_prompts=2, n_shots=2,
                        fv_tasks=("antonym",), td_tasks=("antonym", "uppercase"),
                        compute_on_open=False)
    view.param.update(conflict_tasks=CONFLICT_TASKS[:2], conflict_layers="1")
    view.run_conflict()
    shown = view.conflict
    assert shown is not None and view.conflict_error == ""
    for layers, tasks, match in (
            ("7", CONFLICT_TASKS[:2], r"`Conflict: layers` must be layer numbers in \[0, 2\].*got '7'"),
            ("1, two", CONFLICT_TASKS[:2], r"`Conflict: layers` must be .*got 'two'"),
            (" , ", CONFLICT_TASKS[:2], r"`Conflict: layers` must be .*got none"),
            ("1", ["uppercase"], r"`Conflict: tasks` must hold at least two tasks; got 1: uppercase")):
        view.param.update(conflict_layers=layers, conflict_tasks=tasks)
        view.run_conflict()                            # no exception reaches the page
        assert re.search(match, view.conflict_error), view.conflict_error
        assert "Traceback" not in view.conflict_error and "\n" not in view.conflict_error
        assert view.conflict is shown                  # the last good matrix stays
        assert not view._conflict_button.disabled
    assert any(kind == "error" and "Conflict test:" in text for kind, text in notes)
    view.param.update(conflict_layers="0-1", conflict_tasks=CONFLICT_TASKS[:2])
    view.run_conflict()
    assert view.conflict_error == "" and list(view.conflict.layer.values) == [0, 1]


def test_conflict_layers_text_round_trips():
    from apps.icl_heads import default_conflict_layers, layers_text, parse_layers

    assert default_conflict_layers(30) == [0, 4, 8, 12, 16, 18, 19, 20, 21, 22, 24, 28]
    assert layers_text(default_conflict_layers(30)) == "0, 4, 8, 12, 16, 18-22, 24, 28"
    for n in (1, 3, 12, 30):
        assert parse_layers(layers_text(default_conflict_layers(n)), n) == \
            default_conflict_layers(n)
    assert parse_layers("3, 1-2, 3", 4) == [1, 2, 3]


def test_a_stopped_scores_job_gives_the_compute_button_back(tiny_model, monkeypatch):
    """The gallery's stop button cancels the scores runner mid-job: no scores arrive, the
    Compute button is live again and the status says the scores were not computed (not
    "computing scores" for ever)."""
    from explorer.analyses import icl_heads as ih

    view = ICLHeadsView(tiny_model, background=False, n_prompts=2, n_shots=2,
                        fv_tasks=("antonym",), td_tasks=("antonym", "uppercase"),
                        compute_on_open=False)
    real = ih.induction_scores
    during = []

    def stopped_while_scoring(*args, **kwargs):
        during.append(view._score_button.disabled)        # pressed: off while it runs
        view._runners["scores"].cancel()                   # what the stop button does
        return real(*args, **kwargs)

    monkeypatch.setattr(ih, "induction_scores", stopped_while_scoring)
    view._score_button.clicks += 1
    assert during == [True]
    assert view.scores is None and not view._score_button.disabled
    assert view.status == "Stopped: the head scores were not computed."


def test_placeholders_before_compute_say_what_to_press_and_differ():
    from apps.icl_heads import fv_caption, plot_attention

    repeat = plot_attention(None, "L0.H0, repeated sequence", "a repeated random sequence")
    icl = plot_attention(None, "L0.H0, antonym prompt", "a few-shot antonym prompt")
    assert repeat.text != icl.text                            # the two boxes say different things
    assert all(t.text.startswith("Press Compute scores") for t in (repeat, icl))
    assert "antonym" in icl.text and "repeated" in repeat.text
    # Nothing runs before the button: no "waiting"/"computing" text, the button named instead.
    text = fv_caption(None, ["antonym"])
    assert "**Compute scores**" in text and "waiting" not in text.lower()


def test_ablation_bands_are_the_bootstrap_interval():
    ds = xr.Dataset({"mean_accuracy": (("ranking", "percent"), [[1.0, 0.5], [1.0, 0.9]]),
                     "mean_accuracy_low": (("ranking", "percent"), [[0.8, 0.3], [0.8, 0.7]]),
                     "mean_accuracy_high": (("ranking", "percent"), [[1.0, 0.7], [1.0, 1.0]])},
                    coords={"ranking": ["fv", "random"], "percent": [0.0, 10.0]},
                    attrs={"params": {"confidence_level": 0.9}})
    overlay = plot_ablation_curves(ds)
    bands = [el for el in overlay if isinstance(el, hv.Area)]
    assert len(bands) == 2
    np.testing.assert_allclose(bands[0].dimension_values(1), [0.8, 0.3])
    np.testing.assert_allclose(bands[0].dimension_values(2), [1.0, 0.7])
    np.testing.assert_allclose(bands[1].dimension_values(1), [0.8, 0.7])
    assert overlay.opts.get().kwargs["title"] == "Ablation: few-shot accuracy (90% bands)"


def test_view_icl_score_recomputes_and_its_words_come_from_the_result(tiny_model):
    from explorer.analyses import icl_heads as ih
    from apps.icl_heads import ablation_caption

    view = ICLHeadsView(tiny_model, background=False, n_prompts=2, n_shots=2,
                        fv_tasks=("antonym",), eval_tasks=("uppercase",),
                        td_tasks=("antonym", "uppercase"))
    view.max_percent = 5
    view.mean_source = "zero"
    view._request("curves")
    assert view.curves.attrs["params"]["score"] == "first_token"
    view.icl_score = "f1"                                             # recomputes at once
    got = view.curves
    assert got.attrs["params"]["score"] == "f1"
    want = ih.ablation_curves(tiny_model, ["uppercase"], view.scores["induction_score"].values,
                              view.scores["fv_score"].values, percents=[0.0, 1.0, 3.0, 5.0],
                              rankings=["fv", "induction", "random"], exclude_fraction=0.05,
                              loss_sequences=2, loss_tokens=64, mean_source="zero",
                              n_prompts=2, n_shots=2, score="f1")
    np.testing.assert_allclose(got["correct"].values, want["correct"].values)
    # the words follow the shown result, not the control
    words = ablation_caption(got, "zero", "first_token")
    assert words.startswith("F1 of the answer parsed from 5 greedily generated tokens")
    assert plot_ablation_curves(got).opts.get().kwargs["title"].startswith(
        "Ablation: F1 of the generated answer")
    assert "score='f1'" in view.code_snippet()


def test_view_mean_source_recomputes_the_curves_as_the_library(tiny_model):
    from explorer.analyses import icl_heads as ih

    view = ICLHeadsView(tiny_model, background=False, n_prompts=2, n_shots=2,
                        fv_tasks=("antonym",), eval_tasks=("uppercase",),
                        td_tasks=("antonym", "uppercase"))
    view.max_percent = 10
    view._request("curves")
    assert view.curves.attrs["params"]["mean_source"] == "cross-task"
    assert view.curves.attrs["params"]["mean_tasks"] == ["antonym"]   # the FV-scoring tasks
    view.mean_source = "zero"                                         # recomputes at once
    got = view.curves
    want = ih.ablation_curves(tiny_model, ["uppercase"], view.scores["induction_score"].values,
                              view.scores["fv_score"].values, percents=[0.0, 1.0, 3.0, 5.0, 10.0],
                              rankings=["fv", "induction", "random"], exclude_fraction=0.05,
                              loss_sequences=2, loss_tokens=64, mean_source="zero",
                              n_prompts=2, n_shots=2)
    for var in ("mean_accuracy", "mean_accuracy_low", "mean_accuracy_high", "answer_prob"):
        np.testing.assert_allclose(got[var].values, want[var].values)
    from apps.icl_heads import ablation_caption
    assert "replaced with zero" in ablation_caption(got, view.mean_source)
    assert "mean_source='zero'" in view.code_snippet()


def test_patching_test_on_the_page_is_the_library_call(tiny_model, notes):
    from apps.icl_heads import MEAN_OVER_TASKS, patching_caption, plot_patching
    from explorer.analyses import task_vector_patching as tvp

    view = ICLHeadsView(tiny_model, background=False, n_prompts=3, n_shots=2,
                        fv_tasks=("antonym",), eval_tasks=("uppercase",),
                        td_tasks=("antonym", "uppercase"), compute_on_open=False)
    view.param.update(patching_tasks=["antonym", "uppercase"], patching_layers="0, 2")
    view.run_patching()
    want = tvp.task_vector_patching(tiny_model, ["antonym", "uppercase"], layers=[0, 2],
                                    n_prompts=3, n_shots=2)
    for var in ("accuracy", "accuracy_low", "accuracy_high", "few_shot_accuracy"):
        np.testing.assert_array_equal(view.patching[var].values, want[var].values)
    assert view.param.patching_shown.objects == [MEAN_OVER_TASKS, "antonym", "uppercase"]
    # the mean over tasks: three curves (task, Null, no patch), no bands
    overlay = plot_patching(view.patching, MEAN_OVER_TASKS)
    curves = {c.label: c for c in overlay if isinstance(c, hv.Curve)}
    assert set(curves) == {"task vector", "Null-task vector", "no patch"}
    np.testing.assert_allclose(curves["task vector"].dimension_values(1),
                               want.accuracy.sel(vector="task").mean("task").values)
    assert not [el for el in overlay if isinstance(el, hv.Area)]
    # one task: its curves with their Wilson bands
    view.patching_shown = "uppercase"
    overlay = plot_patching(view.patching, view.patching_shown)
    curves = {c.label: c for c in overlay if isinstance(c, hv.Curve)}
    np.testing.assert_allclose(curves["Null-task vector"].dimension_values(1),
                               want.accuracy.sel(task="uppercase", vector="null").values)
    bands = [el for el in overlay if isinstance(el, hv.Area)]
    np.testing.assert_allclose(bands[0].dimension_values(2),
                               want.accuracy_high.sel(task="uppercase", vector="task").values)
    assert "Null vector there" in patching_caption(view.patching, view.patching_shown)
    assert "tvp.task_vector_patching(model, ['antonym', 'uppercase'], layers=[0, 2]" in \
        view.code_snippet()
    # bad layers: one clear message, the last result kept
    kept = view.patching
    view.patching_layers = "0, 9"
    view.run_patching()
    assert view.patching is kept
    assert "`Patching: layers` must be layer numbers in [0, 2]" in view.error
    view.patching_tasks = []
    view.run_patching()
    assert "`Patching: tasks` must hold at least one task" in view.error


def test_selected_heads_are_outlined_on_the_scatter_and_heatmaps():
    from apps.icl_heads import plot_head_scatter, selected_heads

    ind = np.array([[0.1, 0.5, 0.0], [0.9, 0.2, 0.3]])
    fv = np.array([[0.02, -0.05, 0.0], [0.01, 0.04, -0.01]])
    assert selected_heads(["L1.H2", "L0.MLP", "L7.H0", "L0.H1"], 2, 3) == [(1, 2), (0, 1)]
    scatter = plot_head_scatter(_scores(ind, fv), 20, 20, ["L1.H2", "L0.MLP"])
    picked = list(scatter)[-1]
    assert [(float(x), float(y)) for x, y in zip(picked.dimension_values(0),
                                                  picked.dimension_values(1))] == [(0.3, -0.01)]
    left, right = list(plot_score_heatmaps(_scores(ind, fv), ["L1.H2"]))
    for panel in (left, right):
        outline = list(panel)[-1]
        assert isinstance(outline, hv.Rectangles)
        assert [tuple(float(v) for v in row) for row in outline.array()] == \
            [(1.5, 0.5, 2.5, 1.5)]                       # head 2, layer 1: its cell
    assert isinstance(plot_score_heatmaps(_scores(ind, fv), []), hv.Layout)
    assert not isinstance(list(plot_score_heatmaps(_scores(ind, fv), []))[0], hv.Overlay)


def test_view_scope_links_and_edits(tiny_model):
    from explorer.analyses import icl_heads as ih
    from explorer.interventions import Ablate

    view = ICLHeadsView(tiny_model, background=False, n_prompts=2, n_shots=2,
                        fv_tasks=("antonym",), eval_tasks=("uppercase",),
                        td_tasks=("antonym", "uppercase"))
    scope = view.scope()
    assert scope.on.startswith("task prompts, not your prompt: FV scores on antonym; "
                               "ablations on uppercase (2 prompts x 2 shots each)")
    assert scope.edits.startswith("applied to the induction scores") and \
        "not applicable to the FV scores" in scope.edits
    for name in view.link_params:
        assert name in view.param
    fv_before = view.scores["fv_score"].values.copy()
    view.max_percent = 10
    view._request("curves")
    edit = Ablate(0, 1, mode="zero")
    view.edits = [edit]                    # the workspace's edit: recomputes what it reaches
    want = ih.induction_scores(tiny_model, n_sequences=4, half_len=50, edits=[edit])
    np.testing.assert_allclose(view.scores["induction_score"].values,
                               want["induction_score"].values)
    np.testing.assert_array_equal(view.scores["fv_score"].values, fv_before)
    assert view.curves.attrs["edits"] == [edit.to_dict()]
    att = ih.head_attention(tiny_model, view.layer, view.head, task=view.task, edits=[edit])
    np.testing.assert_allclose(view.patterns["icl"].attention.values, att["icl"].attention.values)


def test_the_note_under_the_scores_follows_the_shown_scores_and_the_controls(tiny_model,
                                                                             cache_on):
    """The words under the scatter are the shown scores' own (their record; 'Shown from the
    result cache' only while the scores shown are the ones read from it); a control changed
    after them is named with what it asks for, until the rescore lands."""
    from param.parameterized import discard_events

    from apps._icl_record import RECORD
    from apps._provenance import Provenance
    from explorer.analyses import icl_heads as ih

    def page(**params):
        return ICLHeadsView(tiny_model, background=False, n_prompts=2, n_shots=2,
                            fv_tasks=("antonym",), eval_tasks=("uppercase",),
                            td_tasks=("antonym", "uppercase"), **params)

    page(compute_on_open=True).close()                     # stores the scores
    view = page(compute_on_open=False)                     # opens on them, from the cache
    try:
        when = Provenance.from_json(view.scores.attrs[RECORD]).computed_at
        note = view.scores_note()
        stamp = when.replace("T", " ")[:16]
        assert f"Shown from the result cache (computed {stamp} UTC" in note
        assert "induction on 4 repeated random sequences of 50 tokens (abs); no edits" in note
        assert "Outdated" not in note and "controls now ask" not in note
        with discard_events(view):                         # changed, its rescore not run yet
            view.induction_sequences = 7
        note = view.scores_note()
        assert "Outdated" in note and "the induction settings changed since" in note
        assert ("The controls now ask for induction on 7 repeated random sequences of 50 "
                "tokens (abs).") in note
        assert "induction on 4 repeated random sequences" in note          # still the shown
        assert "Shown from the result cache" in note                       # they are
        view.running = True
        assert "recomputing" in view.scores_note()
        view.running = False
        view._induction_changed()                          # the rescore lands
        note = view.scores_note()
        want = ih.induction_scores(tiny_model, n_sequences=7, half_len=50)
        np.testing.assert_allclose(view.scores["induction_score"].values,
                                   want["induction_score"].values, rtol=1e-5)
        assert "induction on 7 repeated random sequences of 50 tokens (abs); no edits" in note
        assert "Shown from the result cache" not in note and view._scores_note == ""
        assert "Outdated" not in note and "controls now ask" not in note
        assert not view.running
        with discard_events(view):                         # an edit: named with its label
            view.edits = [explorer.Ablate(0, 1)]
        note = view.scores_note()
        assert "The controls now ask for the edits `ablate L0.H1 (zero)`." in note
        assert note.count("no edits") == 1                                  # the shown's
        # the caption on the page is this note, and follows the same inputs
        pane = view.__panel__().select(lambda o: "icl-scores-note" in getattr(
            o, "css_classes", []))[0]
        assert pane.object == note
        view.edits = []                                    # the rescore lands
        assert pane.object == view.scores_note() and "controls now ask" not in pane.object
        with discard_events(view):
            view.induction_measure = "mul"
        view.running = True                                # the page waits on the rescore
        assert "induction settings changed since: recomputing" in pane.object
        assert ("The controls now ask for induction on 7 repeated random sequences of 50 "
                "tokens (mul).") in pane.object
    finally:
        view.close()
