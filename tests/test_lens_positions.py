"""Token positions clicked and highlighted on the Logit lens page, headless on tiny-llama: a
click on a prompt token (the strip's ``selected``, as its JavaScript sets it) selects the
position on the page and, in the gallery, in the workspace; the heatmaps (clean and, with
workspace edits, edited) then outline the selected positions' columns, read back from the
Bokeh document's quads. Expected boxes are worked out by hand from the tokenizer's count."""
from __future__ import annotations

import pytest
from bokeh.document import Document
from panel.io.state import set_curdoc

from apps.gallery import Gallery
from apps.lens import LensView
from explorer._checks import InputError
from explorer.interventions import Ablate
from tests.test_apps_positions import _dashed_boxes

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path / "cache"))


def _n_tokens(model, text=PROMPT):
    return len(model.tokenizer(text, add_special_tokens=False)["input_ids"])


def _doc(view):
    doc = Document()
    with set_curdoc(doc):
        doc.add_root(view.__panel__().get_root(doc))
    return doc


@pytest.mark.slow
def test_a_click_outlines_the_position_on_every_layer(tiny_model):
    view = LensView(tiny_model, prompt=PROMPT, k=3, background=False)
    n, L = _n_tokens(tiny_model), tiny_model.n_layers
    assert len(view._positions.tokens) == n
    doc = _doc(view)
    assert _dashed_boxes(doc) == []
    with set_curdoc(doc):
        view._positions.selected = [2]                   # as a click on token 2 sets it
    assert view.selected_positions == [2]
    assert _dashed_boxes(doc) == [(1.5, 2.5, -0.5, L - 0.5)]   # x = position, all layers
    with set_curdoc(doc):
        view.toggle_position(n - 1)
    assert view._positions.selected == [2, n - 1]
    assert _dashed_boxes(doc) == [(1.5, 2.5, -0.5, L - 0.5), (n - 1.5, n - 0.5, -0.5, L - 0.5)]
    with set_curdoc(doc):
        view.toggle_position(2)                          # again: deselected
    assert _dashed_boxes(doc) == [(n - 1.5, n - 0.5, -0.5, L - 0.5)]
    with pytest.raises(InputError, match=rf"in \[0, {n - 1}\]; got {n}"):
        view.toggle_position(n)
    with set_curdoc(doc):
        view.selected_positions = [n + 3]                # past the prompt: nothing drawn
    assert _dashed_boxes(doc) == []
    view.close()


@pytest.mark.slow
def test_with_edits_both_heatmaps_are_outlined(tiny_model):
    view = LensView(tiny_model, prompt=PROMPT, k=3, background=False)
    L = tiny_model.n_layers
    doc = _doc(view)
    with set_curdoc(doc):
        view.edits = [Ablate(layer=1, head=0)]
        view.wait()
        assert view.edited_result is not None
        view.selected_positions = [1]
    assert _dashed_boxes(doc) == [(0.5, 1.5, -0.5, L - 0.5)] * 2
    view.close()


@pytest.mark.slow
def test_the_gallery_carries_the_lens_click_to_the_workspace(tiny_model):
    views = [("Logit lens", "lens", lambda m: LensView(m, k=3, background=False))]
    g = Gallery("tiny-llama", views=views, view="lens")
    try:
        g.prompt = PROMPT
        lens = g.page("lens")
        lens.wait()
        doc = _doc(lens)
        with set_curdoc(doc):
            lens._positions.selected = [3]
        assert g.workspace.selected_positions == [3]
        with set_curdoc(doc):
            g.workspace.select("P5")                      # typed in the sidebar
        assert lens.selected_positions == [3, 5] and lens._positions.selected == [3, 5]
        L = tiny_model.n_layers
        assert _dashed_boxes(doc) == [(2.5, 3.5, -0.5, L - 0.5), (4.5, 5.5, -0.5, L - 0.5)]
    finally:
        g.close()
