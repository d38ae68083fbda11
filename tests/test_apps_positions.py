"""Token positions clicked and highlighted on the Saturation and Attention pages, headless on
tiny-llama: a click on a prompt token (the strip's ``selected``, as its JavaScript sets it)
selects the position on the page and, in the gallery, in the workspace; every page then draws
the selected positions' dashed outlines, read back from the Bokeh document's quads. The
expected boxes are worked out by hand from the prompt's length (from the tokenizer)."""
from __future__ import annotations

import numpy as np
import pytest
from bokeh.document import Document
from bokeh.models import GlyphRenderer, Quad
from panel.io.state import set_curdoc

from apps._positions import POSITION_COLOR, PositionStrip, position_caption, toggled
from apps.attention import AttentionView
from apps.gallery import Gallery
from apps.saturation import SaturationView
from explorer._checks import InputError

PROMPT = "The quick brown fox jumps over the lazy dog"
OPTIONS = dict(n_permutations=50, n_pairs=1, sample_positions=100, min_sat_layer=0)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _n_tokens(model, text=PROMPT):
    return len(model.tokenizer(text, add_special_tokens=False)["input_ids"])


def _saturation(model, **params):
    return SaturationView(model, store=None, n_tokens=200, background=False,
                          analysis_options=OPTIONS, **params)


def _doc(layout):
    doc = Document()
    with set_curdoc(doc):
        doc.add_root(layout.get_root(doc))
    return doc


def _column(data, spec):
    """A glyph property's values: a column named by a string or a field, or one number."""
    if isinstance(spec, str):
        return data[spec]
    field = getattr(spec, "field", None)
    return data[field] if field is not None else [spec]


def _dashed_boxes(doc):
    """[left, right, bottom, top] of every dashed quad in the document (the selection's
    outlines)."""
    out = []
    for r in doc.select({"type": GlyphRenderer}):
        g = r.glyph
        if not isinstance(g, Quad) or not g.line_dash or g.line_color != POSITION_COLOR:
            continue
        d = r.data_source.data
        cols = [_column(d, getattr(g, k)) for k in ("left", "right", "bottom", "top")]
        out += [tuple(float(v) for v in box) for box in zip(*cols)]
    return sorted(out)


def _dashed_backends(doc):
    """The output backends of the figures that draw dashed selection outlines: Bokeh's WebGL
    (HoloViews' default) draws a quad's dashes solid, so each must be "canvas"."""
    from bokeh.models import Plot
    out = set()
    for plot in doc.select({"type": Plot}):
        for r in plot.renderers:
            g = getattr(r, "glyph", None)
            if isinstance(g, Quad) and g.line_dash and g.line_color == POSITION_COLOR:
                out.add(plot.output_backend)
    return out


def test_toggled_and_caption():
    assert toggled([1, 3], 3) == [1] and toggled([1], 3) == [1, 3]
    assert position_caption([], ["a"]).startswith("Click a token")
    assert "P1 ·b" in position_caption([1, 9], ["a", "·b"]) and "P9" not in position_caption(
        [1, 9], ["a", "·b"])


@pytest.mark.slow
def test_saturation_strip_click_selects_and_outlines_the_columns(tiny_model):
    view = _saturation(tiny_model, prompt=PROMPT)
    view.wait()
    n = _n_tokens(tiny_model)
    assert len(view.prompt_tokens()) == n == len(view._positions.tokens)
    doc = _doc(view.__panel__())
    assert _dashed_boxes(doc) == []
    k = view.k
    with set_curdoc(doc):
        view._positions.selected = [2]                    # as a click on token 2 sets it
        assert view.selected_positions == [2]
        view.toggle_position(n - 1)
    assert view._positions.selected == [2, n - 1]
    # one column box per selected position on the heatmap: x = pos +- 0.5, all ranks
    assert _dashed_boxes(doc) == [(1.5, 2.5, 0.5, k + 0.5), (n - 1.5, n - 0.5, 0.5, k + 0.5)]
    assert _dashed_backends(doc) == {"canvas"}
    with set_curdoc(doc):
        view.toggle_position(2)                           # again: deselected
    assert view.selected_positions == [n - 1]
    assert _dashed_boxes(doc) == [(n - 1.5, n - 0.5, 0.5, k + 0.5)]
    with pytest.raises(InputError, match=rf"in \[0, {n - 1}\]; got {n}"):
        view.toggle_position(n)
    view.close()


def test_attention_strip_click_outlines_the_query_row_and_key_column(tiny_model):
    view = AttentionView(tiny_model, background=False, prompt=PROMPT)
    n = _n_tokens(tiny_model)
    assert view._positions.tokens and len(view._positions.tokens) == n
    doc = _doc(view.__panel__())
    with set_curdoc(doc):
        view._positions.selected = [3]
    assert view.selected_positions == [3]
    # query row 3: keys 0..3; key column 3: queries 3..n-1 (the causal triangle's edge)
    assert _dashed_boxes(doc) == sorted([(-0.5, 3.5, 2.5, 3.5), (2.5, 3.5, 2.5, n - 0.5)])
    assert _dashed_backends(doc) == {"canvas"}
    with set_curdoc(doc):
        view.selected_positions = [3, n + 5]                # past the prompt: not drawn
    assert _dashed_boxes(doc) == sorted([(-0.5, 3.5, 2.5, 3.5), (2.5, 3.5, 2.5, n - 0.5)])
    view.close()


@pytest.mark.slow
def test_gallery_clicks_select_positions_and_every_page_highlights_them(tiny_model):
    views = [("Saturation events", "saturation", lambda m: _saturation(m)),
             ("Attention", "attention", lambda m: AttentionView(m, background=False))]
    g = Gallery("tiny-llama", views=views, view="attention")
    try:
        g.prompt = PROMPT
        ws, n = g.workspace, _n_tokens(tiny_model)
        att, sat = g.page("attention"), g.page("saturation")
        sat.wait()
        assert ws.n_tokens == n
        att_doc, sat_doc = _doc(att.__panel__()), _doc(sat.__panel__())
        with set_curdoc(att_doc):
            att._positions.selected = [1]                 # a click on the Attention page
        assert ws.selected_positions == [1]
        g.view = "saturation"                              # a page follows when opened
        assert sat.selected_positions == [1]
        with set_curdoc(sat_doc):
            sat._positions.selected = [1, 4]               # a click on the Saturation page
        assert ws.selected_positions == [1, 4]
        g.view = "attention"
        assert att.selected_positions == [1, 4]
        assert att._positions.selected == [1, 4]         # the other page's strip follows
        k = sat.k
        assert _dashed_boxes(sat_doc) == [(0.5, 1.5, 0.5, k + 0.5), (3.5, 4.5, 0.5, k + 0.5)]
        rows = [(-0.5, p + 0.5, p - 0.5, p + 0.5) for p in (1, 4)]
        cols = [(p - 0.5, p + 0.5, p - 0.5, n - 0.5) for p in (1, 4)]
        assert _dashed_boxes(att_doc) == sorted(rows + cols)
        # the heads' highlight stays: a selected head is outlined dashed on the grid
        with set_curdoc(att_doc):
            ws.select("L1.H2")
        L = tiny_model.spec.n_layers
        assert (1.5, 2.5, L - 1 - 1 - 0.5, L - 1 - 1 + 0.5) in _dashed_boxes(att_doc)
        assert _dashed_backends(att_doc) == {"canvas"}        # the grid's too
        assert att.highlighted == ["L1.H2"] and ws.selected_positions == [1, 4]
        with set_curdoc(sat_doc):
            ws.deselect("P1")                              # the sidebar's ✕ on the chip
        assert att.selected_positions == [4]
        g.view = "saturation"
        assert sat._positions.selected == [4]
        assert _dashed_boxes(sat_doc) == [(3.5, 4.5, 0.5, k + 0.5)]
        assert "P1" not in ws.selection and "P4" in ws.selection
    finally:
        g.close()


def test_position_strip_is_a_plain_component():
    strip = PositionStrip(tokens=["a", "b"], selected=[1])
    assert strip.selected == [1] and {"render", "tokens", "selected"} <= set(PositionStrip._scripts)
    assert np.array_equal(strip.tokens, ["a", "b"])
