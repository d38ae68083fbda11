"""The Circuits page's faithfulness curve: the slider's sizes (`size_grid`,
`page_curve_sizes`), the curve and the current circuit's marker (`plot_faithfulness`, the
page's Bokeh figure drawn once per result and moved in place), and the default circuit in
words with its bootstrap interval over the pairs (edges and nodes)."""
from __future__ import annotations

from typing import Any

import holoviews as hv
import numpy as np
import panel as pn
import xarray as xr

from apps import theme
from apps._circuits_text import ShownCircuit, circuit_text, pairs_text
from apps._view import STATIC_TOOLS
from explorer.analyses import circuit_select as cs
from explorer.analyses import circuits as ca

__all__ = ["GRID_POINTS", "CURVE_POINTS", "REFINE_STEPS", "TOOLS", "FAITH_X", "NODE_X",
           "size_grid", "page_curve_sizes", "no_curve", "faithfulness_line", "marker_height",
           "faithfulness_marker", "plot_faithfulness", "FaithfulnessCurve"]

GRID_POINTS = 20         # log-spaced points of `size_grid` by default
CURVE_POINTS = cs.CURVE_POINTS   # the page's faithfulness points (slider positions), log-spaced
REFINE_STEPS = cs.REFINE_STEPS   # bisection steps narrowing the smallest faithful circuit
TOOLS = STATIC_TOOLS
FAITH_X = "edges in the circuit (pruned)"
NODE_X = "nodes in the circuit (heads, MLPs, input)"


def size_grid(n_total: int, *, points: int = GRID_POINTS, low: float = 0.001) -> np.ndarray:
    """Circuit sizes of the slider: about ``points`` log-spaced edge counts from ``low`` (0.1 %)
    of the graph's edges (at least 1) to all of them, distinct, ascending."""
    if n_total < 1:
        return np.zeros(0, dtype=int)
    lo = max(1, int(round(low * n_total)))
    return np.unique(np.round(np.geomspace(lo, n_total, points)).astype(int))


def page_curve_sizes(scores: xr.Dataset, cap: int | None = None) -> list[int]:
    """The top-n sizes the page measures first: the empty circuit and `CURVE_POINTS`
    log-spaced sizes (`size_grid`); with a cap on the default's size, also where the pruned
    circuit first reaches 10, 25, ... edges up to it (`circuit_select.readable_sizes`)."""
    sizes = {0, *size_grid(scores.sizes["edge"], points=CURVE_POINTS).tolist()}
    if cap is not None:
        sizes |= set(cs.readable_sizes(scores, [t for t in cs.READABLE_TARGETS if t <= cap]))
    return sorted(sizes)


def no_curve() -> hv.Text:
    """The faithfulness plot before any curve: what to press."""
    return hv.Text(0.5, 0.5, "Faithfulness: press Compute circuit").opts(
        xaxis=None, yaxis=None, toolbar=None, height=260, responsive=True, xlim=(0, 1),
        ylim=(0, 1))


def faithfulness_line(curve: xr.Dataset) -> hv.Overlay:
    """The measured curve: metric recovered against edges in the pruned circuit (log axis;
    the empty circuit, which recovers 0 by definition, is left off)."""
    kept = curve["n_kept"].values
    y = curve["recovered"].values
    on_axis = kept > 0
    line = hv.Curve((kept[on_axis], y[on_axis]), FAITH_X, "metric recovered").opts(
        color=theme.ACCENT, line_width=2, tools=["hover"])
    pts = hv.Scatter((kept[on_axis], y[on_axis]), FAITH_X, "metric recovered").opts(
        color=theme.ACCENT, size=6)
    return line * pts


def marker_height(curve: xr.Dataset, n_chosen: int) -> tuple[float, str]:
    """The curve's value at top-n ``n_chosen``: measured there, else interpolated between
    the measured top-n values."""
    top_n = curve["n_edges"].values
    y = curve["recovered"].values
    if n_chosen in top_n:
        return float(y[list(top_n).index(n_chosen)]), "measured"
    return float(np.interp(n_chosen, top_n, y)), "interpolated"


def faithfulness_marker(curve: xr.Dataset, n_kept: int, n_chosen: int | None = None) -> hv.Scatter:
    """The current circuit on the curve: x = its pruned size, y = the curve at its top-n
    ``n_chosen`` (`marker_height`); a short title. Empty when the circuit is empty."""
    here, how = marker_height(curve, n_kept if n_chosen is None else n_chosen)
    if n_kept > 0:
        title = f"Faithfulness: {n_kept:,} edges recover {here:.0%}"
        if how == "interpolated":
            title += " (interp.)"
        data = [(n_kept, here)]
    else:
        title, data = "Faithfulness: the circuit is empty", []
    return hv.Scatter(data, FAITH_X, "metric recovered", group="Current").opts(
        color="black", size=13, marker="diamond", title=title)


def plot_faithfulness(curve: xr.Dataset | None, n_kept: int, n_chosen: int | None = None,
                      fraction: float | None = None) -> hv.Element:
    """Share of the clean-minus-corrupted metric recovered against the number of edges in the
    pruned circuit (log axis), the current circuit marked, the target share as a dashed line."""
    if curve is None:
        return no_curve()
    mark = faithfulness_marker(curve, n_kept, n_chosen)
    out = faithfulness_line(curve) * mark
    if fraction is not None:
        out = out * hv.HLine(fraction).opts(color="#777777", line_dash="dashed", line_width=1)
    return out.opts(responsive=True, height=260, default_tools=TOOLS, logx=True,
                    title=mark.opts.get().kwargs["title"])


class FaithfulnessCurve:
    """The faithfulness part of `apps.circuits.CircuitsView` (a mixin): the curve's figure,
    its marker, the edited model's line and the default circuit's text."""

    def _faithfulness_plot(self, *_: Any) -> hv.Element:
        """The base model's curve, marked at its circuit for the current selection (also
        while the graph shows a fine-tuning checkpoint)."""
        if self.curve is None or self.scores is None:
            return plot_faithfulness(None, 0)
        mask = self._circuit(self.scores)
        return plot_faithfulness(self.curve, int(mask.sum()), self._n_chosen(self.scores),
                                 self.fraction)

    def _marker_state(self) -> tuple[dict[str, list], str]:
        """The marker's data source columns (``edges``, ``metric``: the current circuit on
        the curve, `faithfulness_marker`) and the faithfulness plot's title."""
        if self.nodes_mode():
            return self._node_marker_state()
        if self.curve is None or self.scores is None:
            return {"edges": [], "metric": []}, "Faithfulness"
        mask = self._circuit(self.scores)
        mark = faithfulness_marker(self.curve, int(mask.sum()), self._n_chosen(self.scores))
        rows = mark.data
        return ({"edges": [float(v) for v in rows.iloc[:, 0]],
                 "metric": [float(v) for v in rows.iloc[:, 1]]},
                mark.opts.get().kwargs["title"])

    def _node_marker_state(self) -> tuple[dict[str, list], str]:
        """The node circuit on the node curve (x: its nodes) and the plot's title."""
        c = self.node_curve
        if c is None or self.scores is None:
            return {"edges": [], "metric": []}, "Node faithfulness: measuring…"
        k = int(self.n_nodes)
        ks, y = c["n_nodes"].values, c["recovered"].values
        here = float(y[list(ks).index(k)]) if k in ks else float(np.interp(k, ks, y))
        how = "" if k in ks else " (interp.)"
        if k == 0:
            return {"edges": [], "metric": []}, "Node faithfulness: the circuit is empty"
        return ({"edges": [float(k)], "metric": [here]},
                f"Node faithfulness: {k:,} nodes recover {here:.0%}{how}")

    def _redraw_marker(self) -> None:
        """Move the marker, the title and the target line of every faithfulness drawing (a
        slider move changes these three, not the figure)."""
        if not self._faith_figs:
            return
        data, title = self._marker_state()
        with pn.io.document.hold():
            for fig, marker, target in self._faith_figs:
                marker.data = data
                fig.title.text = title
                target.location = float(self.fraction)

    def edited_line(self) -> hv.HLine | None:
        """The share of the metric the full model keeps with the workspace edits (a dotted
        line on the faithfulness curve), or None without edits."""
        kept = self.edited["recovered"] if self.edited is not None else np.nan
        if not np.isfinite(kept):
            return None
        return hv.HLine(kept).opts(color=theme.ACCENT, line_dash="dotted", line_width=2)

    def _faithfulness_pane(self, curve: xr.Dataset | None, edited: dict | None = None,
                           node_curve: xr.Dataset | None = None,
                           granularity: str = "edges") -> Any:
        """The curve (and the edited model's line, dotted) as a plain Bokeh figure, drawn
        once per set of scores and edits; the marker (a diamond), the title and the target
        share (dashed) follow the selection in place (`_redraw_marker`). For a node circuit,
        the node curve (recovered against the nodes kept)."""
        nodes = granularity == "nodes"
        if nodes and node_curve is None:
            return hv.Text(0.5, 0.5, "Node faithfulness: measuring the node circuits…").opts(
                xaxis=None, yaxis=None, toolbar=None, height=260, responsive=True,
                xlim=(0, 1), ylim=(0, 1))
        if curve is None:
            return no_curve()
        from bokeh.models import ColumnDataSource, HoverTool, Span
        from bokeh.plotting import figure

        if nodes:
            kept, y = node_curve["n_nodes"].values, node_curve["recovered"].values
            x_label = NODE_X
        else:
            kept, y = curve["n_kept"].values, curve["recovered"].values
            x_label = FAITH_X
        on_axis = kept > 0   # the empty circuit (0 by definition) has no place on a log axis
        fig = figure(height=260, sizing_mode="stretch_width", x_axis_type="log",
                     tools=list(TOOLS), x_axis_label=x_label, y_axis_label="metric recovered",
                     toolbar_location="right")
        fig.toolbar.logo = None
        fonts = theme.font_sizes()
        fig.title.text_font_size = fonts["title"]
        for axis, ticks in ((fig.xaxis, "xticks"), (fig.yaxis, "yticks")):
            axis.axis_label_text_font_size = fonts["labels"]
            axis.major_label_text_font_size = fonts[ticks]
        points = ColumnDataSource({"edges": kept[on_axis].astype(float),
                                   "metric": y[on_axis].astype(float)})
        line = fig.line("edges", "metric", source=points, color=theme.ACCENT, line_width=2,
                        name="faithfulness-curve")
        fig.scatter("edges", "metric", source=points, color=theme.ACCENT, size=6)
        fig.add_tools(HoverTool(renderers=[line], tooltips=[(x_label, "@edges{0,0}"),
                                                            ("metric recovered", "@metric{0.000}")]))
        target = Span(location=float(self.fraction), dimension="width", line_color="#777777",
                      line_dash="dashed", line_width=1, name="target-share")
        fig.add_layout(target)
        line_el = self.edited_line()
        if line_el is not None:
            fig.add_layout(Span(location=float(line_el.data), dimension="width",
                                line_color=theme.ACCENT, line_dash="dotted", line_width=2,
                                name="edited-share"))
        data, title = self._marker_state()
        marker = ColumnDataSource(data)
        fig.scatter("edges", "metric", source=marker, color="black", size=13, marker="diamond",
                    name="current-circuit")
        fig.title.text = title
        self._faith_figs.append((fig, marker, target))
        return theme.BokehPane(fig, sizing_mode="stretch_width")

    def default_interval(self) -> tuple[float, float] | None:
        """95 % bootstrap interval over the pairs of the default circuit's recovered share
        (`circuit_select.bootstrap_recovered` on the curve's per-pair values), or None."""
        d, curve = self._default, self.curve
        if d is None or curve is None or "pair_metric" not in curve \
                or curve.sizes.get("prompt", 0) < 2:
            return None
        if self._boot is None or self._boot[0] != id(curve):
            self._boot = (id(curve), cs.bootstrap_recovered(curve))
        b = self._boot[1].sel(n_edges=d.n_edges)
        return float(b["recovered_low"]), float(b["recovered_high"])

    def node_default_interval(self) -> tuple[float, float] | None:
        """95 % bootstrap interval over the pairs of the node default's recovered share."""
        d, curve = self._node_default, self.node_curve
        if d is None or curve is None or curve.sizes.get("prompt", 0) < 2:
            return None
        if self._node_boot is None or self._node_boot[0] != id(curve):
            self._node_boot = (id(curve), cs.bootstrap_recovered(curve))
        b = self._node_boot[1].sel(n_nodes=d.n_edges)
        return float(b["recovered_low"]), float(b["recovered_high"])

    def node_default_text(self) -> str:
        """The node circuit's default in words, beside the edge circuit's node count (whether
        the node circuit is the smaller faithful picture)."""
        d = self._node_default
        if self.node_curve is None or d is None:
            return ("Node circuit: measuring the node circuits (every node outside the top k "
                    "patched to its corrupted output)…") if self.scores is not None else ""
        ci_ = self.node_default_interval()
        rec = f"**{d.recovered:.0%}**"
        if ci_ is not None:
            rec += (f" [{ci_[0]:.0%}, {ci_[1]:.0%}] (95 % bootstrap interval over the "
                    f"{self.node_curve.sizes['prompt']} pairs)")
        edge = self._default
        compare = ""
        if edge is not None and self.scores is not None:
            n_edge_nodes = len(ca.circuit_nodes(self.scores, ca.select_circuit(
                self.scores, top_n=edge.n_edges)))
            compare = (f" The default edge circuit ({edge.n_kept:,} edges, recovering "
                       f"{edge.recovered:.0%}) touches {n_edge_nodes:,} nodes.")
        if d.reached:
            return (f"Node circuit: the smallest measured set of nodes recovering at least "
                    f"{self.fraction:.0%} of the metric: {d.n_edges:,} nodes (top {d.n_edges:,} "
                    f"by |node score|; every other node's output patched to its corrupted "
                    f"value), recovering {rec}.{compare}")
        return (f"No measured node circuit recovers {self.fraction:.0%}. Shown is the most "
                f"faithful one: {d.n_edges:,} nodes, recovering {rec}.{compare}")

    def shown_circuit(self) -> ShownCircuit | None:
        """The numbers of the shown base circuit and of its default (`ShownCircuit`), or None
        before a result with its curve."""
        if self.scores is None or self.curve is None:
            return None
        mask = self._circuit(self.scores)
        n_top = self._n_chosen(self.scores)
        here, how = marker_height(self.curve, n_top)
        d = self._default
        return ShownCircuit(
            n_kept=int(mask.sum()), n_top=int(n_top), n_total=int(self.scores.sizes["edge"]),
            recovered=here, how=how, mode=self.mode, threshold=float(self.threshold),
            default_kept=None if d is None else int(d.n_kept),
            default_top=None if d is None else int(d.n_edges),
            default_recovered=None if d is None else float(d.recovered),
            default_reached=bool(d is not None and d.reached), fraction=float(self.fraction),
            cap=self.max_default_edges, interval=self.default_interval())

    def default_text(self) -> str:
        """The shown circuit and the default in words, from the shown result's provenance
        (`apps._circuits_text.circuit_text`), then the clean - corrupted gap and, for one
        pair, why there is no interval (`pairs_text`)."""
        if self.nodes_mode():
            text = self.node_default_text()
            if text and self.shown is not None and self.node_curve is not None:
                extra = pairs_text(self.shown, interval=self.node_default_interval() is not None)
                text += f" {extra}" if extra else ""
            return text
        c = self.shown_circuit()
        if c is None or self.shown is None:
            return ""
        extra = pairs_text(self.shown, interval=c.interval is not None)
        return circuit_text(self.shown, c) + (f" {extra}" if extra else "")
