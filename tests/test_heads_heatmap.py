"""The layer x head heatmap shared by the Attention, Head atlas, ICL heads and Knowledge
conflicts pages (apps/_heads_heatmap.py): values, colour limits, ticks, outlines, clicks."""
from __future__ import annotations

import holoviews as hv
import numpy as np
import pytest

from apps import theme
from apps._heads_heatmap import (head_boxes, head_cell, heads_heatmap, heads_in, layer_ticks,
                                 on_head_click, selected_outlines)


def _opts(el):
    return {**hv.Store.lookup_options("bokeh", el, "plot").kwargs,
            **hv.Store.lookup_options("bokeh", el, "style").kwargs}


def test_heads_in_keeps_the_models_heads_once_in_order():
    names = ["L1.H2", "L0.MLP", "a2.h3", "L9.H0", "nonsense", "L1.H2", "L0.H0"]
    assert heads_in(names, 3, 4) == [(1, 2), (2, 3), (0, 0)]
    assert heads_in(None, 3, 4) == [] and heads_in([], 3, 4) == []


def test_every_cell_is_drawn_at_its_layer_and_head():
    values = np.array([[0.1, 0.5, 0.0], [0.9, 0.2, 0.3]])           # [layer, head]
    heat = heads_heatmap(values, name="score", title="t")
    got = {(int(h), int(l)): v for h, l, v in zip(heat.dimension_values(0),
                                                   heat.dimension_values(1),
                                                   heat.dimension_values(2))}
    assert got == {(h, l): values[l, h] for l in range(2) for h in range(3)}
    o = _opts(heat)
    assert o["invert_yaxis"] is True                                  # layer 0 on top
    assert o["xticks"] == [(0, "H0"), (1, "H1"), (2, "H2")]
    assert o["yticks"] == [(0, "L0"), (1, "L1")]


def test_colour_maps_sequential_from_low_or_diverging_centred_on_zero():
    values = np.array([[0.2, -0.05], [0.4, np.nan]])
    seq = _opts(heads_heatmap(values, name="s", title="t"))
    assert seq["cmap"] == theme.MAGNITUDE_CMAP and seq["clim"] == (-0.05, 0.4)
    from_zero = _opts(heads_heatmap(np.abs(np.nan_to_num(values)), name="s", title="t", low=0.0))
    assert from_zero["clim"] == (0.0, 0.4)
    div = _opts(heads_heatmap(values, name="s", title="t", signed=True))
    assert div["cmap"] == theme.SIGNED_CMAP and div["clim"] == (-0.4, 0.4)
    flat = _opts(heads_heatmap(np.zeros((2, 2)), name="s", title="t", signed=True))
    assert flat["clim"] == (-1.0, 1.0)                                # no zero-width range


def test_layer_ticks_stay_at_most_sixteen_and_flip_for_an_image_drawn_top_down():
    ticks = layer_ticks(range(30))
    assert len(ticks) <= 16 and ticks[0] == (0, "L0") and ticks[1] == (2, "L2")
    assert layer_ticks([5, 6, 7], flip=True) == [(2, "L5"), (1, "L6"), (0, "L7")]


def test_selected_heads_are_outlined_over_their_cells():
    values = np.zeros((3, 4))
    plot = heads_heatmap(values, name="s", title="t", highlighted=["L1.H2", "L0.MLP"])
    assert isinstance(plot, hv.Overlay)
    outline = plot.get(1)
    assert [tuple(map(float, r)) for r in outline.array()] == [(1.5, 0.5, 2.5, 1.5)]
    assert not isinstance(heads_heatmap(values, name="s", title="t", highlighted=[]), hv.Overlay)
    # flipped rows (the attention mosaic): layer 0 at y = n_layers - 1
    flipped = selected_outlines(["L0.H1"], 3, 4, flip=True)
    assert [tuple(map(float, r)) for r in flipped.array()] == [(0.5, 1.5, 1.5, 2.5)]
    assert head_boxes([(2, 0)]) == [(-0.5, 1.5, 0.5, 2.5)]


def test_a_click_picks_the_cell_under_it():
    class Grid:
        sizes = {"layer": 3, "head": 4}

    assert head_cell(2.3, 0.6, Grid) == (1, 2)
    assert head_cell("3", "2", Grid) == (2, 3)                        # categorical axes: strings
    assert head_cell(4.6, 0, Grid) is None and head_cell(None, 1, Grid) is None
    assert head_cell(1, 1, None) is None
    picked = []
    layout = on_head_click(heads_heatmap(np.zeros((3, 4)), name="a", title="a")
                           + heads_heatmap(np.zeros((3, 4)), name="b", title="b",
                                           highlighted=["L0.H0"]),
                           lambda x, y: picked.append(head_cell(x, y, Grid)))
    taps = [s for el in layout.traverse(lambda el: el, [hv.Image])
            for s in hv.streams.Stream.registry.get(el, []) if isinstance(s, hv.streams.Tap)]
    assert len(taps) == 2
    taps[1].event(x=3.2, y=1.9)
    assert picked == [(2, 3)]


@pytest.mark.parametrize("bad", [np.zeros(3), np.zeros((2, 2, 2))])
def test_values_must_be_layer_by_head(bad):
    with pytest.raises(ValueError, match=r"must be \[layer, head\] \(2-D\); got shape"):
        heads_heatmap(bad, name="s", title="t")
