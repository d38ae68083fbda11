"""The Knowledge conflicts page's answer bars as drawn: built once, then new bars (a slider's
preview or the exact ones) written into the drawn plot's data source and title in place, and
the hidden markers of what the page shows (read by the browser tests)."""
from __future__ import annotations

import contextlib
import weakref
from typing import Any

import holoviews as hv
import numpy as np
import panel as pn
import param
from panel.io.document import hold

from apps._conflicts_plots import plot_answer_bars
from apps._drawn import keep_drawn, live_drawn, shown_figures
from apps._lens_heatmap import _update_source

__all__ = ["BarsPart"]


class BarsPart(param.Parameterized):
    """The answer bars' drawing of `apps.conflicts.ConflictsView`."""

    bars_version = param.Integer(default=0, precedence=-1,
                                 doc="Bumped when the answer bars' plot must be built anew (the "
                                     "first bars, edits coming or going); else new bars are "
                                     "drawn in place.")

    def _init_bars(self) -> None:
        # the drawn bars' data source and figure: new bars are written into them in place
        self._bar_sources: list[weakref.ref] = []
        self._bar_figures: list[weakref.ref] = []
        self._bar_panes: list[weakref.ref] = []
        self._bars_shape: tuple[bool, bool] = (False, False)
        self.param.watch(self._bars_changed, ["bar_rows", "edited_rows", "shown"])

    def _bars_title(self) -> str:
        """The bars' title: "clean" beside edited bars, "preview" while a slider's preview
        is drawn (the exact bars on release take the title back)."""
        title = "P(answer), clean" if self.edited_rows is not None else "P(answer)"
        return f"{title} · preview" if self.previewing else title

    def _bars_changed(self, *_: Any) -> None:
        """New bars (a preview or the exact ones) are written into the drawn plot's data
        source and title (one document patch); the plot is built anew only for the first
        bars or when edited bars come or go."""
        shape = (self.bar_rows is not None, self.edited_rows is not None)
        sources, figures = live_drawn(self._bar_sources), live_drawn(self._bar_figures)
        if shape != self._bars_shape or not shape[0] or not sources:
            self._bars_shape = shape
            self.bars_version += 1
            return
        value = {(a, r): v for a, r, v in self.bar_rows}
        title = self._bars_title()
        held = hold(self._doc) if self._doc is not None else contextlib.nullcontext()
        with held:
            for source in sources:
                data = source.data
                _update_source(source, {"probability": np.array(
                    [value[a, r] for a, r in zip(data["answer"], data["run"])])})
            shown = shown_figures(self._bar_panes)
            for fig in figures:
                if id(fig) in shown and fig.title is not None and fig.title.text != title:
                    fig.title.text = title

    def _bars_pane(self) -> pn.pane.HoloViews:
        """The pane drawing the answer bars (kept, to know which figure it shows)."""
        pane = pn.pane.HoloViews(pn.bind(self._bars_plot, self.param.bars_version),
                                 linked_axes=False, sizing_mode="stretch_width",
                                 css_classes=["cf-bars"])
        self._bar_panes.append(weakref.ref(pane))
        return pane

    def _bars_plot(self, _version: int) -> hv.Element:
        """The answer bars (a placeholder before the first), keeping the rendered data source
        and figure for `_bars_changed`."""
        self._bar_sources.clear()
        self._bar_figures.clear()
        if self.bar_rows is None:
            return plot_answer_bars(None)

        def hook(plot: Any, element: Any) -> None:
            keep_drawn(self._bar_sources, plot.handles.get("source"))
            keep_drawn(self._bar_figures, plot.handles.get("plot"))
        return plot_answer_bars(self.bar_rows, title=self._bars_title()).opts(hooks=[hook])

    def _state_html(self, *_: Any) -> str:
        """Hidden markers of what the page shows (read by the browser test)."""
        after = ("none" if self.bar_rows is None
                 else ",".join(f"{r[2]:.6f}" for r in self.bar_rows if r[1] == "after"))
        acc = "none" if self.accuracy is None else str(self.accuracy.sizes["fact"])
        edited = ("none" if self.edited_rows is None
                  else ",".join(f"{r[2]:.6f}" for r in self.edited_rows))
        shown = self.shown
        alphas = "none" if shown is None else ",".join(
            f"{a:g}" for a in dict(shown.request)["alphas"])
        return (f"<div class='cf-state' data-cf-scores='{'none' if self.scores is None else 'ready'}' "
                f"data-cf-preview='{int(self.previewing)}' data-cf-alphas='{alphas}' "
                f"data-cf-plus='{','.join(self.heads_plus)}' "
                f"data-cf-minus='{','.join(self.heads_minus)}' data-cf-after='{after}' "
                f"data-cf-accuracy='{acc}' data-cf-edited='{edited}' "
                f"data-cf-busy='{int(self.busy)}'></div>")
