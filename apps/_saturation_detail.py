"""The saturation page's detail of one clicked token: its layer x rank table of lens top-k
strings with saturation markers, and its staircase of s_1..s_k. The plots are built once;
a click replaces their glyphs' data in place (`DetailPart._send_detail`)."""
from __future__ import annotations

import html
import weakref
from typing import Any

import holoviews as hv
import numpy as np
import panel as pn
import param
import xarray as xr

from apps import theme
from apps._drawn import keep_drawn, live_drawn_by_key
from apps._saturation_strip import TokenStrip, strip_tokens

__all__ = ["detail_data", "detail_header", "empty_detail", "steps_mid", "DETAIL_GLYPHS",
           "detail_columns", "rank_table_elements", "staircase_elements", "plot_rank_table",
           "plot_staircase", "DetailPart"]

hv.extension("bokeh", logo=False)


_LABEL_CHARS = 9


def detail_data(ds: xr.Dataset, prompt: int, pos: int, k: int, decode: Any) -> dict[str, Any]:
    """Everything the detail plots need for one token, read from the computed result.

    Returns a dict: ``layer``, ``rank`` (1-based), ``label``, ``probability``, ``saturated``
    (flat arrays, one entry per layer x rank cell), ``sat`` [k] saturation layers,
    ``final`` [k] final token labels, ``layers``, ``token``.
    """
    n_layers = ds.sizes["layer"]
    k = min(k, ds.sizes["rank"])
    top_id = np.asarray(ds.top_token_id.values[prompt, pos, :, :k])  # [layer, k]
    top_p = np.asarray(ds.top_prob.values[prompt, pos, :, :k])
    s = np.asarray(ds.sat_layer.values[prompt, pos, :k]).astype(int)
    final = np.asarray(ds.final_token_id.values[prompt, pos, :k])
    labels = decode(np.concatenate([top_id.ravel(), final]))
    layer = np.repeat(np.arange(n_layers), k)
    rank = np.tile(np.arange(k), n_layers)
    saturated = (s[rank] >= 0) & (layer >= s[rank])
    return {"layers": n_layers, "layer": layer, "rank": rank + 1,
            "label": [labels[int(t)][:_LABEL_CHARS] for t in top_id.ravel()],
            "probability": top_p.ravel().astype(float), "saturated": saturated, "sat": s,
            "final": [labels[int(t)] for t in final],
            "token": theme.show_token(str(ds.token.values[prompt, pos]))}


_RANK_TABLE_OPTS = (
    hv.opts.Rectangles("Cells", color="probability", cmap=theme.CMAPS["probability"], clim=(0, 1),
                       colorbar=True, line_color="white", tools=["hover"]),
    hv.opts.Labels(text_font_size=f"{theme.SIZES['label_font_pt']}pt", text_color="fg"),
    hv.opts.Rectangles("Saturated", fill_alpha=0, line_color=theme.ACCENT, line_width=2),
    hv.opts.Overlay(title="Lens top-k per layer", xlabel="rank (1 = top)",
                    ylabel="layer", toolbar="above",
                    min_height=theme.SIZES["plot_min_height"], responsive=True),
)


_STAIRCASE_OPTS = (
    hv.opts.Scatter(size=9, color=theme.ACCENT, tools=["hover"]),
    hv.opts.Curve(color=theme.ACCENT),          # the steps are drawn by `steps_mid`
    hv.opts.Overlay(title="Saturation staircase", xlabel="rank (1 = top)",
                    ylabel="saturation layer", min_height=theme.SIZES["plot_min_height"],
                    responsive=True),
)


_CLICK_HINT = "Click a token\nin the strip above"


_NO_DETAIL = ('<span data-sat-detail="none"></span>Click a token to see its layer × rank table '
              'and staircase.')


def detail_header(d: dict[str, Any] | None, text: int, pos: int) -> str:
    """The detail's one-line HTML header: token, final top-k strings, s_1..s_k."""
    if d is None:
        return _NO_DETAIL
    k = len(d["sat"])
    sat_text = ", ".join("never" if x < 0 else str(x) for x in d["sat"])
    finals = " ".join(html.escape(repr(t)) for t in d["final"])
    return (f'<span data-sat-detail="{text}:{pos}:{k}"></span><b>Token {pos} '
            f'{html.escape(repr(d["token"]))}</b>: final top-{k} {finals}; s_1..s_{k} = {sat_text}')


def empty_detail(n_layers: int) -> dict[str, Any]:
    """A detail with no cells (before any click)."""
    z = np.zeros(0, dtype=int)
    return {"layers": n_layers, "layer": z, "rank": z, "label": [], "probability": z.astype(float),
            "saturated": z.astype(bool), "sat": z, "final": [], "token": ""}


def steps_mid(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A step line through (x, y) that changes value halfway between points (as HoloViews'
    ``interpolation="steps-mid"`` draws it): 2n points for n."""
    x, y = np.asarray(x, float), np.asarray(y)
    if len(x) == 0:
        return x, y
    xs = np.empty(2 * len(x))
    xs[0], xs[-1] = x[0], x[-1]
    xs[1:-1:2] = xs[2::2] = (x[:-1] + x[1:]) / 2
    return xs, np.repeat(y, 2)


#: The detail plots' glyphs, in the order `detail_columns` returns them.
DETAIL_GLYPHS = ("cells", "labels", "saturated", "steps", "points")


def detail_columns(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Column data of the detail plots' five glyphs for one token (the click path).

    Keys are `DETAIL_GLYPHS`: the rank table's probability cells, their text labels and the
    saturation outlines; the staircase's step line and points. Each value is the
    ``ColumnDataSource.data`` HoloViews gives that glyph for the same elements, so a click
    replaces the data of the rendered plots in place.
    """
    d = data
    rank, layer = np.asarray(d["rank"], float), np.asarray(d["layer"], float)
    x0, x1, y0, y1 = rank - 0.5, rank + 0.5, layer - 0.5, layer + 0.5
    p = np.asarray(d["probability"], float)
    label = list(d["label"])
    m = np.asarray(d["saturated"], bool)
    s = np.asarray(d["sat"]).astype(int)
    ranks = np.arange(1, len(s) + 1)
    ok = s >= 0
    sx, sy = steps_mid(ranks[ok], s[ok])
    return {
        "cells": {"left": x0, "right": x1, "bottom": y0, "top": y1, "x0": x0, "y0": y0,
                  "x1": x1, "y1": y1, "probability": p, "token": label, "color": p},
        "labels": {"rank": rank, "layer": layer, "token": label,
                   "text_color": theme.text_colors(p, theme.CMAPS["probability"])},
        "saturated": {"left": x0[m], "right": x1[m], "bottom": y0[m], "top": y1[m]},
        "steps": {"rank": sx, "saturation layer": sy},
        "points": {"rank": ranks[ok], "saturation layer": s[ok], "saturation_layer": s[ok]},
    }


def rank_table_elements(data: dict[str, Any]) -> hv.Overlay:
    """The rank table's elements without styling.

    Cells are rectangles centred on (rank, layer), so the axes stay numeric and the
    saturation outlines sit exactly on them.
    """
    c = detail_columns(data)
    cells, lab, sat = c["cells"], c["labels"], c["saturated"]
    rects = hv.Rectangles((cells["x0"], cells["y0"], cells["x1"], cells["y1"],
                           cells["probability"], cells["token"]),
                          vdims=["probability", "token"], group="Cells")
    # text colour readable on its cell
    labels = hv.Labels((lab["rank"], lab["layer"], lab["token"], lab["text_color"]),
                       kdims=["rank", "layer"], vdims=["token", "fg"])
    boxes = hv.Rectangles((sat["left"], sat["bottom"], sat["right"], sat["top"]),
                          group="Saturated")
    return rects * labels * boxes


def staircase_elements(data: dict[str, Any]) -> hv.Overlay:
    """The staircase's elements without styling: s_j against rank j (never left out)."""
    c = detail_columns(data)
    steps = hv.Curve((c["steps"]["rank"], c["steps"]["saturation layer"]), kdims=["rank"],
                     vdims=["saturation layer"])
    pts = hv.Scatter((c["points"]["rank"], c["points"]["saturation layer"]), kdims=["rank"],
                     vdims=["saturation layer"])
    return steps * pts


def plot_rank_table(d: dict[str, Any]) -> hv.Overlay:
    """Layer x rank table of the lens top-k strings, coloured by probability; saturated
    cells (the final rank-j token holding rank j from s_j on) outlined."""
    return rank_table_elements(d).opts(*_RANK_TABLE_OPTS).opts(
        hv.opts.Overlay(xlim=(0.5, len(d["sat"]) + 0.5), ylim=(-0.5, d["layers"] - 0.5)))


def plot_staircase(d: dict[str, Any]) -> hv.Overlay:
    """Saturation layer of each rank: the staircase s_1..s_k (never-saturating ranks left out)."""
    return staircase_elements(d).opts(*_STAIRCASE_OPTS).opts(ylim=(-0.5, d["layers"] - 0.5))


class DetailPart:
    """The token strip and the clicked token's detail plots of `SaturationView`."""

    def _text_changed(self, *events: Any) -> None:
        self.selected = -1

    def detail(self) -> dict[str, Any] | None:
        """The clicked token's detail data (None before a click)."""
        ds = self.result
        if ds is None or self.selected < 0:
            return None
        n = int(ds.mask.values[self.text].sum())
        if self.selected >= n:
            return None
        return detail_data(ds, self.text, self.selected, self.k, self.decode)

    @param.depends("result", "text", "running")
    def _strip(self):
        if self.result is None:
            return pn.pane.Markdown("Computing…" if self.running else
                                    "The corpus text appears here once the analysis has run.")
        strip = TokenStrip(tokens=strip_tokens(self.result, self.text), selected=self.selected,
                           sizing_mode="stretch_width")
        strip.param.watch(lambda e: setattr(self, "selected", e.new), "selected")
        self._strip_widget = strip
        return strip

    def _detail_plots(self) -> pn.Row:
        """Rank table and staircase, built once; a click replaces their glyphs' data.

        Each rendering of the plots (one per page session) registers its five Bokeh data
        sources through a HoloViews hook; `_send_detail` sets their ``data`` from
        `detail_columns`: no new figure or model, no DynamicMap update, no re-trace.
        """
        if self._detail_row is not None:
            return self._detail_row
        n_layers = self._model.spec.n_layers
        limits = dict(xlim=(0.5, self.param.k.bounds[1] + 0.5), ylim=(-0.5, n_layers - 0.5))
        height = max(theme.SIZES["plot_min_height"], 18 * n_layers)      # one readable row a layer
        hook = {g: [self._source_hook(g)] for g in DETAIL_GLYPHS}
        # drawn from two cells left of the axis (one white, one black label), so that
        # HoloViews reads the label colours as colours, not as numbers to map; the hooks
        # then put the current detail in
        empty = empty_detail(n_layers)
        empty.update(layer=np.zeros(2, int), rank=np.zeros(2, int), label=["", ""],
                     probability=np.array([0.0, 1.0]), saturated=np.zeros(2, bool))
        # until a click, each plot says so in its frame (the text is emptied on a click)
        hint = hv.Text(sum(limits["xlim"]) / 2, (n_layers - 1) / 2, _CLICK_HINT).opts(
            text_color="#555555", text_font_size=f"{theme.SIZES['axis_font_pt']}pt",
            hooks=[self._hint_hook])
        table = (rank_table_elements(empty) * hint).opts(*_RANK_TABLE_OPTS).opts(
            hv.opts.Overlay(min_height=height, **limits),
            hv.opts.Rectangles("Cells", hooks=hook["cells"]),
            hv.opts.Labels(hooks=hook["labels"]),
            hv.opts.Rectangles("Saturated", hooks=hook["saturated"]))
        stair = (staircase_elements(empty) * hint).opts(*_STAIRCASE_OPTS).opts(
            hv.opts.Overlay(min_height=height, **limits), hv.opts.Curve(hooks=hook["steps"]),
            hv.opts.Scatter(hooks=hook["points"]))
        # not linked to the page's other plots with a "rank" axis: linking gave the
        # staircase another plot's range, drawn from 10 down to 0
        self._detail_row = pn.Row(pn.pane.HoloViews(table, sizing_mode="stretch_width",
                                                    linked_axes=False,
                                                    css_classes=["sat-rank-table"]),
                                  pn.pane.HoloViews(stair, sizing_mode="stretch_width",
                                                    linked_axes=False,
                                                    css_classes=["sat-staircase"]),
                                  sizing_mode="stretch_width")
        return self._detail_row

    def _source_hook(self, glyph: str):
        """A HoloViews hook that keeps the rendered glyph's data source and fills it."""
        def hook(plot: Any, element: Any) -> None:
            source = plot.handles.get("source")
            if source is None:
                return
            keep_drawn(self._sources[glyph], source)
            source.data = self._columns[glyph]
        return hook

    def _hint_hook(self, plot: Any, element: Any) -> None:
        """Keep the rendered hint's data source; empty it while a token's detail is shown."""
        source = plot.handles.get("source")
        if source is None:
            return
        if not any(ref() is source for ref, _ in self._hint_sources):
            self._hint_sources.append((weakref.ref(source), dict(source.data)))
        self._show_hints(len(self._columns["cells"]["probability"]) == 0)

    def _show_hints(self, show: bool) -> None:
        self._hint_sources[:] = [(ref, data) for ref, data in self._hint_sources
                                 if ref() is not None]
        for ref, data in self._hint_sources:
            ref().data = data if show else {key: [] for key in data}

    def hints_shown(self) -> list[bool]:
        """Whether each rendered detail plot shows its "click a token" text."""
        return [bool(len(ref().data.get("text", []))) for ref, _ in self._hint_sources
                if ref() is not None]

    def detail_sources(self) -> dict[str, list[Any]]:
        """The rendered detail plots' Bokeh data sources per glyph (live ones only)."""
        return live_drawn_by_key(self._sources)

    def _send_detail(self, *events: Any) -> None:
        d = self.detail()
        self._header.object = detail_header(d, self.text, self.selected)
        n_layers = self.result.sizes["layer"] if self.result is not None else \
            self._model.spec.n_layers
        self._columns = detail_columns(d if d is not None else empty_detail(n_layers))
        for glyph, sources in self.detail_sources().items():
            for source in sources:
                source.data = self._columns[glyph]
        self._show_hints(d is None)
