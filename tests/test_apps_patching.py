"""Activation patching page, headless: the heatmap against torch hooks on the tiny model, the
counterfactual by a clicked position, words from the shown result, stale marking, the click
that selects a component and a position, errors, the snippet and the export."""
from __future__ import annotations

import numpy as np
import pytest

from apps._view import read_export
from apps.patching import (PatchingView, cell_component, counterfactual_ids, patching_caption,
                           patching_title, plot_patching, stale_note)
from explorer._checks import InputError
from tests.test_patching import _reference

PROMPT = "abcdefg"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _ids(model, text):
    return model.tokenizer(text, add_special_tokens=False)["input_ids"]


def _shown(plot):
    """[layer, column] values the heatmap of `plot_patching` draws."""
    heat = plot.get(0) if hasattr(plot, "get") else plot
    cols, layers = heat.dimension_values("column"), heat.dimension_values("layer")
    out = np.full((int(layers.max()) + 1, int(cols.max()) + 1), np.nan)
    out[layers.astype(int), cols.astype(int)] = heat.dimension_values("value")
    return out


@pytest.mark.parametrize("kind, direction", [("resid_pre", "denoising"),
                                             ("mlp_out", "noising"), ("heads", "denoising")])
def test_heatmap_equals_hooks_for_a_clicked_counterfactual(tiny_model, kind, direction):
    m = tiny_model
    view = PatchingView(m, background=False, prompt=PROMPT, kind=kind, direction=direction)
    assert view.result is None and "Click a token" in view.status
    view._strip.selected = [3]                        # a click on the strip's token 3
    assert view.cf_position == 3 and view.result is None
    view.cf_token = "x"
    ds = view.result
    assert view.error == "" and ds is not None
    clean, corrupt = _ids(m, PROMPT), _ids(m, "abcxefg")
    assert ds.attrs["params"]["corrupt_ids"] == corrupt      # the token at THAT position
    a, b = ds.attrs["params"]["answer_id"], ds.attrs["params"]["alternative_id"]
    effect, _, _ = _reference(m, kind, direction, a, b, clean, corrupt)
    np.testing.assert_allclose(_shown(plot_patching(ds)).ravel(), effect, rtol=1e-4, atol=1e-4)
    assert "position 3: 'd' -> 'x'" in patching_caption(ds)
    assert direction in patching_title(ds) and "cells of " + kind in view.status
    view.close()


def test_typed_corrupt_prompt_answers_and_metric(tiny_model):
    view = PatchingView(tiny_model, background=False, prompt=PROMPT, corrupt="abcdxfg",
                        answer="#7", alternative="#9", metric="prob")
    p = view.result.attrs["params"]
    assert (p["answer_id"], p["alternative_id"], p["metric"]) == (7, 9, "prob")
    assert p["changed_positions"] == [4]
    heat = plot_patching(view.result)
    heat = heat.get(0) if hasattr(heat, "get") else heat
    assert heat.opts.get().kwargs["clabel"].startswith("p(")          # the metric's label
    assert "position 4: 'e' -> 'x'" in patching_caption(view.result)
    view.close()


def test_words_come_from_the_shown_result_and_stale_marking(tiny_model):
    view = PatchingView(tiny_model, background=False, prompt=PROMPT, cf_position=1,
                        cf_token="z")
    ds = view.result
    assert stale_note(ds, view.request_state()) == ""
    state = {**view.request_state(), "kind": "mlp_out", "prompt": "other"}
    note = stale_note(ds, state)
    assert note.startswith("**Outdated**") and "the prompt, the grid changed" in note
    assert "position 1: 'b' -> 'z'" in note and "resid_pre" in note   # what it was computed on
    # a refused input keeps the shown grid, says why and leaves the words of the old result
    view.cf_token = "zz"
    assert "must be one token" in view.error and view.result is ds
    assert "position 1: 'b' -> 'z'" in patching_caption(view.result)
    view.close()


def test_cell_click_selects_component_and_position(tiny_model):
    view = PatchingView(tiny_model, background=False, prompt=PROMPT, cf_position=2,
                        cf_token="x")
    view._tapped(x=5, y=1)                               # column 5 = position 5, layer 1
    assert view.selected == "L0" and view.selected_positions == [5]
    assert view.cell == "L1@P5"
    view._tapped(x=0, y=0)
    assert view.selected == "input" and view.selected_positions == [5, 0]
    view.kind = "mlp_out"
    view._tapped(x=2, y=2)
    assert view.selected == "L2.MLP"
    view.kind = "heads"
    view._tapped(x=3, y=1)
    assert view.selected == "L1.H3" and view.cell == "L1@H3"
    assert cell_component("attn_out", 1, 2) is None
    view.close()


def test_counterfactual_errors(tiny_model):
    with pytest.raises(InputError, match=r"position must be in \[0, 6\]; got 9"):
        counterfactual_ids(tiny_model, PROMPT, 9, "x")
    with pytest.raises(InputError, match="type the token"):
        counterfactual_ids(tiny_model, PROMPT, 1, "")
    assert counterfactual_ids(tiny_model, PROMPT, 0, "#5")[0] == 5


def test_snippet_reproduces_the_grid_and_export_holds_it(tiny_model):
    view = PatchingView(tiny_model, background=False, prompt=PROMPT, cf_position=2,
                        cf_token="x", kind="attn_out")
    code = view.code_snippet()
    assert "activation_patching" in code
    scope: dict = {}
    exec(code, scope)                                     # noqa: S102 - the page's own snippet
    np.testing.assert_allclose(scope["grid"].values, view.result.effect.values, rtol=1e-6)
    out = read_export(view.export_bytes())
    ds = next(iter(out["datasets"].values()))
    np.testing.assert_allclose(ds.effect.values, view.result.effect.values)
    view.close()
