"""How the logit lens page draws its heatmaps: built once per shape, then redrawn in place
(the drawn data sources' columns patched) when a new result or preview has the same shape;
the edited heatmap below it; the selected positions outlined."""
from __future__ import annotations

import weakref
from typing import Any

import holoviews as hv
import panel as pn
import xarray as xr

from apps import theme
from apps._drawn import keep_drawn, live_drawn, live_drawn_by_key, shown_figures
from apps._lens_heatmap import (_SHAPE_COLUMNS, _update_source, edited_caption, edited_title,
                                extra_labels, heatmap_updates, lens_title, moved_cells,
                                plot_lens_heatmap, plot_positions, plot_shape)
from apps._view import STATIC_TOOLS

__all__ = ["DrawingPart"]

hv.extension("bokeh", logo=False)


class DrawingPart:
    """The heatmaps of `apps.lens.LensView`."""

    @property
    def shown(self) -> xr.Dataset | None:
        """The result the heatmap draws: the preview while there is one, else the result."""
        return self.preview if self.preview is not None else self.result

    def _source_hook(self, glyph: str):
        """A HoloViews hook keeping the rendered glyph's data source (and the figure)."""
        def hook(plot: Any, element: Any) -> None:
            keep_drawn(self._sources[glyph], plot.handles.get("source"))
            keep_drawn(self._figures, plot.handles.get("plot"))
        return hook

    def drawn_sources(self) -> dict[str, list[Any]]:
        """The rendered heatmap's Bokeh data sources per glyph (live ones only)."""
        return live_drawn_by_key(self._sources)

    def toggle_position(self, pos: int) -> None:
        """Select token position ``pos`` of the prompt, or deselect it (a click on it)."""
        self._position_links.toggle(pos)

    def _positions_changed(self, *_: Any) -> None:
        self.plot_version += 1      # the outlines are part of the plot: draw it anew

    def _plot(self, _version: int) -> hv.Overlay | hv.Element:
        ds = self.shown
        for refs in (*self._sources.values(), self._figures):
            refs.clear()                   # the new render registers its own
        self._lines.clear()
        self._drawn_shape = self._page_shape(ds)
        steers = () if ds is None else self._shape_of(ds)[3]
        line = steers[0] if len(steers) == 1 else self.steer_layer
        plot = plot_lens_heatmap(ds, title=None if ds is None else
                                 lens_title(ds, clean=self.edited_result is not None),
                                 steer_line=line)
        if ds is None:
            return plot
        outlines = plot_positions(ds, self.selected_positions)
        if outlines is not None:
            plot = (plot * outlines.opts(default_tools=STATIC_TOOLS)).opts(active_tools=[])
        return plot.opts(hv.opts.HeatMap(hooks=[self._source_hook("heat")]),
                         hv.opts.Labels(hooks=[self._source_hook("labels")]),
                         hv.opts.HLine(hooks=[self._line_hook]))

    def _shape_of(self, ds: xr.Dataset | None) -> tuple | None:
        """`plot_shape` of ``ds``, kept for the last result asked about: each preview of a
        drag asks three times (whether it draws in place, the redraw, the steering line),
        and each time took a selection of the result and its tokens."""
        if ds is None:
            return None
        memo = getattr(self, "_shape_memo", None)
        if memo is not None and memo[0]() is ds:
            return memo[1]
        shape = plot_shape(ds)
        self._shape_memo = (weakref.ref(ds), shape)
        return shape

    def _page_shape(self, ds: xr.Dataset | None) -> tuple | None:
        """`plot_shape` without the steering layer where there is at most one steer edit:
        the page draws that line always and moves or hides it in place."""
        shape = self._shape_of(ds)
        return shape if shape is None or len(shape[3]) > 1 else shape[:3]

    def _line_hook(self, plot: Any, element: Any) -> None:
        """A HoloViews hook keeping the rendered steering line (a Bokeh Span)."""
        keep_drawn(self._lines, plot.handles.get("glyph"))

    def _plot_edited(self, edited: xr.Dataset | None) -> hv.Overlay | hv.Element:
        if edited is None:
            return hv.Text(0, 0, "").opts(xaxis=None, yaxis=None, toolbar=None, height=10,
                                          responsive=True)
        plot = plot_lens_heatmap(edited, title=edited_title(edited, extra_labels(edited)))
        moved = moved_cells(self.result, edited)
        if moved:  # outline the cells whose top-1 token differs from the clean lens
            plot *= hv.Rectangles([(p - 0.5, l - 0.5, p + 0.5, l + 0.5) for p, l in moved]).opts(
                fill_alpha=0, line_color=theme.ACCENT, line_width=3, default_tools=STATIC_TOOLS)
        outlines = plot_positions(edited, self.selected_positions)
        if outlines is not None:
            plot *= outlines.opts(default_tools=STATIC_TOOLS)
        return plot.opts(active_tools=[])

    def _edited_panes(self) -> pn.Column:
        """The edited heatmap and its caption: present only while there are workspace
        edits (without them the page holds one heatmap, as before)."""
        box = pn.Column(sizing_mode="stretch_width", css_classes=["lens-edited"], margin=0)

        def fill(*_: Any) -> None:
            edited = self.edited_result
            if edited is None:
                box.objects = []
                return
            box.objects = [
                pn.pane.HoloViews(self._plot_edited(edited), sizing_mode="stretch_width",
                                  css_classes=["lens-edited-plot"]),
                pn.pane.Markdown(edited_caption(self.result, edited), sizing_mode="stretch_width",
                                 css_classes=["lens-edited-caption"])]

        fill()
        self.param.watch(fill, ["edited_result", "selected_positions"])
        return box

    def _draws_in_place(self, ds: xr.Dataset | None) -> bool:
        """Whether `_draw` would redraw ``ds`` in the drawn plot (same shape, its data
        sources and steering line alive) rather than build a new one."""
        lines = live_drawn(self._lines)
        return ds is not None and self._page_shape(ds) == self._drawn_shape \
            and all(self.drawn_sources().values()) and len(lines) == 1

    def _draw(self, *events: Any) -> None:
        """Redraw the heatmap: in place when the drawn plot has this result's shape (a
        slider move: only the columns that change, the title; no new Bokeh models), else
        anew."""
        ds = self.shown
        sources = self.drawn_sources()
        lines = live_drawn(self._lines)
        if ds is not None and self._page_shape(ds) == self._drawn_shape \
                and all(sources.values()) and len(lines) == 1:
            columns = heatmap_updates(ds)
            if all(set(src.data) <= set(columns[glyph]) | set(_SHAPE_COLUMNS[glyph])
                   for glyph, srcs in sources.items() for src in srcs):
                for glyph, srcs in sources.items():
                    for src in srcs:
                        _update_source(src, {name: columns[glyph][name] for name in src.data
                                             if name in columns[glyph]})
                steers = self._shape_of(ds)[3]
                if steers:
                    lines[0].location = steers[0] - 0.5
                lines[0].visible = bool(steers)
                title = lens_title(ds, clean=self.edited_result is not None)
                shown = shown_figures(self._plot_panes)
                for fig in live_drawn(self._figures):
                    if id(fig) in shown and fig.title is not None:
                        fig.title.text = title
                return
        self.plot_version += 1
