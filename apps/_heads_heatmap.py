"""The layer x head heatmap that the Attention, Head atlas, ICL heads and Knowledge conflicts
pages share: one value per head drawn as one image (layer 0 on top, head 0 left), the
layer and head ticks in the one spelling (``L3``, ``H2``), a sequential colour map for
magnitudes or a diverging one centred on 0 for signed scores, the workspace's selected
heads outlined dashed in the selection colour, and a click that picks a head.

Cells sit at numeric coordinates: head ``h``'s column spans x in [h - 0.5, h + 0.5] and
layer ``l``'s row y in [l - 0.5, l + 0.5] (drawn top-down), so an outline or a marker is
a rectangle at those coordinates and a click at (x, y) rounds to its head.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import holoviews as hv
import numpy as np

from apps import theme
from apps._positions import position_outlines
from apps._view import STATIC_TOOLS
from explorer import components

__all__ = ["heads_in", "head_ticks", "layer_ticks", "head_boxes", "selected_outlines",
           "current_head_box", "component_cell_box", "heads_heatmap", "head_cell", "on_head_click",
           "MAX_LAYER_TICKS"]

hv.extension("bokeh", logo=False)

MAX_LAYER_TICKS = 16
"""At most this many layer ticks (every k-th layer on a deep model): they never touch."""


def heads_in(names: Sequence[str] | None, n_layers: int, n_heads: int) -> list[tuple[int, int]]:
    """(layer, head) of the heads among ``names`` (the workspace selection, e.g.
    ``["L3.H1", "L4.MLP"]``) that the model has, once each in the order given; other
    components and unreadable names are skipped."""
    out: list[tuple[int, int]] = []
    for name in names or ():
        try:
            c = components.check_in_model(name, n_layers, n_heads)
        except components.ComponentError:
            continue
        if c.is_head and (c.layer, c.head) not in out:
            out.append((c.layer, c.head))
    return out


def head_ticks(n_heads: int) -> list[tuple[int, str]]:
    """``(h, "H<h>")`` for every head."""
    return [(h, f"H{h}") for h in range(n_heads)]


def layer_ticks(layers: Sequence[int], *, flip: bool = False) -> list[tuple[int, str]]:
    """``(y, "L<layer>")`` for every k-th of ``layers`` (at most `MAX_LAYER_TICKS`); row i
    sits at y = i, or at y = n - 1 - i with ``flip`` (an image whose first row is on top)."""
    n = len(layers)
    step = max(1, math.ceil(n / MAX_LAYER_TICKS))
    return [(n - 1 - i if flip else i, f"L{layer}") for i, layer in enumerate(layers)
            if i % step == 0]


def head_boxes(cells: Sequence[tuple[int, int]], *, n_layers: int | None = None) -> list[tuple]:
    """(x0, y0, x1, y1) of each (layer, head) cell; with ``n_layers`` the rows are flipped
    (layer l at y = n_layers - 1 - l)."""
    boxes = []
    for layer, head in cells:
        y = layer if n_layers is None else n_layers - 1 - layer
        boxes.append((head - 0.5, y - 0.5, head + 0.5, y + 0.5))
    return boxes


def selected_outlines(names: Sequence[str] | None, n_layers: int, n_heads: int, *,
                      flip: bool = False) -> hv.Rectangles:
    """Dashed outlines (the selection's colour) of the selected heads among ``names``."""
    cells = heads_in(names, n_layers, n_heads)
    return position_outlines(head_boxes(cells, n_layers=n_layers if flip else None))


def current_head_box(layer: int, head: int, *, n_layers: int | None = None) -> hv.Rectangles:
    """A solid outline in the accent colour around the one head a page shows enlarged."""
    return hv.Rectangles(head_boxes([(int(layer), int(head))], n_layers=n_layers)).opts(
        fill_alpha=0.0, line_color=theme.ACCENT, line_width=2.5, default_tools=STATIC_TOOLS)


def component_cell_box(name: str, n_layers: int, n_heads: int) -> tuple | None:
    """(x0, y0, x1, y1) of a component's cell on a layer x (heads, then MLP) grid, the MLP in
    column ``n_heads`` (the logit attribution's grid); None for an empty name or anything
    that is not a head or an MLP of the model."""
    if not name:
        return None
    try:
        c = components.check_in_model(name, n_layers, n_heads)
    except components.ComponentError:
        return None
    if c.is_head:
        x = c.head
    elif str(c) == str(components.mlp(c.layer)):
        x = n_heads
    else:
        return None
    return (x - 0.5, c.layer - 0.5, x + 0.5, c.layer + 0.5)


def _colour_range(values: np.ndarray, signed: bool, low: float | None) -> tuple[str, tuple]:
    finite = values[np.isfinite(values)]
    if signed:
        lim = float(np.abs(finite).max()) if finite.size else 0.0
        return theme.SIGNED_CMAP, (-(lim or 1.0), lim or 1.0)
    lo = (float(finite.min()) if finite.size else 0.0) if low is None else float(low)
    hi = float(finite.max()) if finite.size else lo + 1.0
    return theme.MAGNITUDE_CMAP, (lo, hi if hi > lo else lo + 1.0)


def heads_heatmap(values: np.ndarray, *, name: str, title: str, label: str | None = None,
                  signed: bool = False, low: float | None = None,
                  highlighted: Sequence[str] | None = (), fixed: bool = False,
                  height: int | None = None) -> hv.Image | hv.Overlay:
    """One value per head, [layer, head] ``values``, as a heatmap with layer 0 on top.

    Parameters
    ----------
    values : array [layer, head]
    name : str
        The value's dimension name (the hover's label); ``label`` the colour bar's, default
        ``name``.
    title : str
    signed : bool, default=False
        Diverging map centred on 0 (limits +-max |value|); else the sequential map from
        ``low`` (default the smallest value) to the largest.
    highlighted : sequence of str
        The workspace's selected components; the heads among them are outlined dashed.
    fixed : bool, default=False
        A fixed frame (one cell ``cell_min_width`` x ``cell_height`` px, at least 300 x 160)
        for a fixed-size pane; else as wide as the pane and ``height`` px high (default one
        ``cell_height`` a layer plus the axes, at least 260).
    """
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 2:
        raise ValueError(f"`values` must be [layer, head] (2-D); got shape {values.shape}.")
    n_layers, n_heads = values.shape
    cmap, clim = _colour_range(values, signed, low)
    cell_w, cell_h = theme.SIZES["cell_min_width"], theme.SIZES["cell_height"]
    if fixed:
        size = dict(frame_width=max(300, cell_w * n_heads), frame_height=max(160, cell_h * n_layers))
    else:
        size = dict(responsive=True, height=height or max(260, cell_h * n_layers + 90))
    heat = hv.Image((np.arange(n_heads), np.arange(n_layers), values), kdims=["head", "layer"],
                    vdims=[hv.Dimension(name, label=label or name)]).opts(
        cmap=cmap, clim=clim, colorbar=True, clabel=label or name, title=title,
        xlabel="head", ylabel="layer", invert_yaxis=True, xaxis="top",
        xticks=head_ticks(n_heads), yticks=layer_ticks(range(n_layers)),
        hover_tooltips=[("head", "H$x{0}"), ("layer", "L$y{0}"), (label or name, "@image")],
        tools=["hover", "tap"], default_tools=STATIC_TOOLS, active_tools=[], toolbar="above",
        fontsize=theme.font_sizes(), **size)
    if heads_in(highlighted, n_layers, n_heads):
        return heat * selected_outlines(highlighted, n_layers, n_heads)
    return heat


def click_cell(x: Any, y: Any) -> tuple[int, int] | None:
    """The (column, row) of the grid cell nearest a click at data coordinates ``(x, y)``; None
    without a click or where a coordinate is no number. Categorical axes give strings; they are
    read as numbers."""
    if x is None or y is None:
        return None
    try:
        return int(round(float(x))), int(round(float(y)))
    except (TypeError, ValueError):
        return None


def head_cell(x: Any, y: Any, scores: Any) -> tuple[int, int] | None:
    """(layer, head) of a click at ``(x, y)`` = (head, layer) on a layer x head heatmap of
    ``scores`` (a Dataset with ``layer`` and ``head`` dimensions); None when the click is off the
    grid or there are no scores (`click_cell`)."""
    cell = click_cell(x, y)
    if cell is None or scores is None:
        return None
    head, layer = cell
    if 0 <= layer < scores.sizes["layer"] and 0 <= head < scores.sizes["head"]:
        return layer, head
    return None


def on_head_click(plot: Any, pick: Callable[[Any, Any], None]) -> Any:
    """Subscribe ``pick(x, y)`` to clicks on every heatmap in ``plot`` (an Image or a HeatMap,
    or an Overlay or a Layout of them: a heads heatmap, or a layer grid such as the logit
    attribution's or the patching grid); returns ``plot``."""
    images = (plot.traverse(lambda el: el, [hv.Image, hv.HeatMap])
              if isinstance(plot, hv.core.dimension.LabelledData) else [])
    for image in images:
        hv.streams.Tap(source=image).add_subscriber(lambda x=None, y=None, **_: pick(x, y))
    return plot
