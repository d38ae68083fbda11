"""Logit attribution page, headless: the heatmaps against torch hooks on the tiny model, the
edited and difference panels, words from the shown result, stale marking, the click that
selects a component (in the gallery: in the workspace), the snippet and the export."""
from __future__ import annotations

import numpy as np
import pytest

from apps._view import read_export
from apps.dla import (DLAView, dla_caption, dla_grid, dla_title, grid_component, plot_dla,
                      stale_note)
from explorer.interventions import Ablate
from tests.test_answer_dla import RTOL, _hand_terms

PROMPT = "The quick brown fox jumps over the lazy"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _shown(plot):
    """[layer, column] values the heatmap of `plot_dla` draws."""
    heat = plot.get(0)
    cols, layers = heat.dimension_values("column"), heat.dimension_values("layer")
    out = np.full((int(layers.max()) + 1, int(cols.max()) + 1), np.nan)
    out[layers.astype(int), cols.astype(int)] = heat.dimension_values("value")
    return out


def test_heatmaps_equal_hooks_clean_edited_and_difference(tiny_model):
    m = tiny_model
    view = DLAView(m, background=False, prompt=PROMPT)
    ds = view.result
    assert view.error == "" and ds is not None
    a, b = ds.attrs["answer_id"], ds.attrs["alternative_id"]
    heads, mlps, _, scale, *_ = _hand_terms(m, PROMPT, a, b)
    want = np.concatenate([heads, mlps[:, None]], axis=1)               # [layer, head + MLP]
    np.testing.assert_allclose(_shown(plot_dla(ds, "clean")), want, rtol=RTOL, atol=1e-7)
    assert "logit(" in dla_title(ds, "clean") and "No workspace edits" in dla_caption(ds)

    view.edits = [Ablate(layer=1, head=0)]
    ds = view.result
    assert ds.attrs["answer_id"] == a                     # the clean model's top tokens still
    e_heads, e_mlps, *_ = _hand_terms(m, PROMPT, a, b, ablate=(1, 0), scale=scale)
    e_want = np.concatenate([e_heads, e_mlps[:, None]], axis=1)
    np.testing.assert_allclose(_shown(plot_dla(ds, "edited")), e_want, rtol=RTOL, atol=1e-7)
    np.testing.assert_allclose(_shown(plot_dla(ds, "difference")), e_want - want, rtol=RTOL,
                               atol=1e-7)
    assert "ablate L1.H0" in dla_caption(ds)
    assert dla_title(ds, "difference").startswith("edited − clean")
    view.close()


def test_pickers_stale_marking_and_errors(tiny_model):
    view = DLAView(tiny_model, background=False, prompt=PROMPT, answer="#5", alternative="#9")
    ds = view.result
    assert (ds.attrs["answer_id"], ds.attrs["alternative_id"]) == (5, 9)
    assert stale_note(ds, PROMPT, [], "#5", "#9") == ""
    note = stale_note(ds, "Another prompt", [Ablate(layer=0, head=1)], "#5", "#9")
    assert note.startswith("**Outdated**") and "the prompt, the edits" in note
    assert repr(PROMPT) in note                              # what it was computed on
    view.alternative = "#5"                                  # same as the answer: refused
    assert "must differ" in view.error
    assert view.result is ds                                 # the last good result stays
    assert "the answer or alternative" in stale_note(view.result, view.prompt, [],
                                                      view.answer, view.alternative)
    view.alternative = "#99999"
    assert "token id in [0, 511]" in view.error
    view.close()


def test_click_selects_heads_and_mlps_and_the_gallery_workspace(tiny_model):
    from apps.gallery import VIEWS, Gallery

    assert grid_component(4, 2, 3, 4) == "L2.MLP"
    assert grid_component(1.2, 0.8, 3, 4) == "L1.H1"
    assert grid_component(5, 0, 3, 4) is None and grid_component(0, 3, 3, 4) is None
    g = Gallery("tiny-llama", views=[v for v in VIEWS if v[1] == "dla"], view="dla")
    try:
        g.prompt = PROMPT
        view = g.page("dla")
        view._background = False
        view._tapped(x=4, y=1)                    # the MLP column of layer 1
        assert view.selected == "L1.MLP"
        assert "L1.MLP" in g.workspace.selected
        view._tapped(x=2, y=0)
        assert "L0.H2" in g.workspace.selected
    finally:
        g.close()


def test_snippet_recomputes_and_export_carries_the_result(tiny_model):
    view = DLAView(tiny_model, background=False, prompt=PROMPT, edits=[Ablate(layer=2, head=1)])
    ns: dict = {}
    exec(compile(view.code_snippet(), "<snippet>", "exec"), ns)  # noqa: S102 - the page's own
    np.testing.assert_allclose(ns["ds"].heads.values, view.result.heads.values, rtol=1e-6)
    np.testing.assert_allclose(ns["difference"].mlp.values,
                               dla_grid(view.result, "difference")[:, -1], rtol=1e-6,
                               atol=1e-9)
    back = read_export(view.export_bytes())
    assert any(np.allclose(d["heads"].values, view.result.heads.values)
               for d in back["datasets"].values() if "heads" in d)
    view.close()


def test_head_atlas_gains_the_clean_and_edited_dla_columns(tiny_model):
    from apps.atlas import AtlasView
    from explorer.head_atlas import head_atlas

    view = AtlasView(tiny_model, background=False, prompt=PROMPT)
    atlas = view.atlas
    logits = tiny_model.hf(input_ids=tiny_model.tokenize([PROMPT]).input_ids).logits[0, -1]
    a, b = logits.topk(2).indices.tolist()
    heads, *_ = _hand_terms(tiny_model, PROMPT, a, b)
    np.testing.assert_allclose(atlas["dla"].values, heads, rtol=RTOL, atol=1e-7)
    assert "dla_edited" not in atlas and "logit(" in atlas["dla"].attrs["description"]
    view.edits = [Ablate(layer=0, head=3)]
    assert view.atlas["dla_edited"].sel(layer=0, head=3).item() == 0.0
    assert "ablate" in view.atlas["dla_edited"].attrs["edits"]
    view.close()
    dla = DLAView(tiny_model, background=False, prompt=PROMPT, answer="#5", alternative="#9")
    from_page = head_atlas(dla.result, model=tiny_model)
    h5, *_ = _hand_terms(tiny_model, PROMPT, 5, 9)
    np.testing.assert_allclose(from_page["dla"].values, h5, rtol=RTOL, atol=1e-7)
    dla.close()
