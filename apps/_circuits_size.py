"""The Circuits page's circuit size: the pruned circuit of the current selection (top-n,
threshold or top-k nodes, cached), the size slider's positions, and the default size (the
smallest measured circuit reaching the target; a size a user, a link or code asked for is
kept)."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import panel as pn
import param
import xarray as xr

from apps._circuits_curve import size_grid
from explorer.analyses import circuit_select as cs
from explorer.analyses import circuits as ca

__all__ = ["GRANULARITIES", "CircuitSize"]

GRANULARITIES = ("edges", "nodes")   # a circuit of edges (EAP's) or of nodes (node patching)


class CircuitSize:
    """The size part of `apps.circuits.CircuitsView` (a mixin): the selection, the slider
    and the default size."""

    def _total(self) -> int:
        scores, _, _ = self._current()
        return 0 if scores is None else int(scores.sizes["edge"])

    def nodes_mode(self) -> bool:
        """Whether the page shows a node circuit (granularity "nodes")."""
        return self.granularity == "nodes"

    def _selection_key(self, scores: xr.Dataset) -> tuple:
        n_total = int(scores.sizes["edge"])
        if self.nodes_mode():
            return (id(scores), "nodes", int(self.n_nodes))
        if self.mode == "top-n":
            return (id(scores), "top-n", min(self.n_edges, n_total))
        return (id(scores), "threshold", float(self.threshold))

    def _circuit(self, scores: xr.Dataset) -> np.ndarray:
        """The pruned circuit (`select_circuit`) of ``scores`` at the current selection."""
        key = self._selection_key(scores)
        mask = self._circuit_cache.get(key)
        if mask is None:
            if key[1] == "nodes":
                total = len(cs.node_ranking(scores))
                sel = cs.node_circuit(scores, min(key[2], total))
                chosen = int(sel.attrs["n_nodes"])
            else:
                sel = (ca.select_circuit(scores, top_n=key[2]) if self.mode == "top-n"
                       else ca.select_circuit(scores, threshold=key[2]))
                chosen = sel.attrs["n_chosen"]
            mask = sel.values
            mask.flags.writeable = False
            self._circuit_cache[key] = mask
            self._circuit_cache[key + ("chosen",)] = chosen
        return mask

    def _n_chosen(self, scores: xr.Dataset) -> int:
        """Edges chosen before pruning (top-n, or how many pass the threshold); for a node
        circuit, its nodes."""
        self._circuit(scores)
        return int(self._circuit_cache[self._selection_key(scores) + ("chosen",)])

    def _grid(self) -> tuple[np.ndarray, np.ndarray]:
        """Slider sizes (top-n) and the |score| thresholds that choose as many edges."""
        scores, order, _ = self._current()
        if scores is None:
            return np.array([self.n_edges]), np.array([self.threshold])
        sizes = self._sizes(scores)
        mag = np.abs(scores["score"].values.astype(np.float64))
        return sizes, mag[order[sizes - 1]]

    def _sizes(self, scores: xr.Dataset) -> np.ndarray:
        """The slider's top-n positions: where the faithfulness curve was measured (the
        log-spaced grid plus the readable sizes), or the grid for a checkpoint's scores."""
        if scores is self.scores and self.curve is not None:
            sizes = self.curve["n_edges"].values
            return np.asarray(sizes[sizes > 0], dtype=int)
        return size_grid(int(scores.sizes["edge"]))

    def _node_sizes(self) -> list[int]:
        """The slider's node counts: where the node curve was measured, else log-spaced."""
        if self.node_curve is not None:
            return [int(k) for k in self.node_curve["n_nodes"].values if k > 0]
        scores, _, _ = self._current()
        if scores is None:
            return [max(1, self.n_nodes)]
        return cs.default_node_sizes(len(cs.node_ranking(scores)))[1:]

    def _passing(self, threshold: float) -> int:
        """How many edges of the current scores have |score| >= ``threshold``."""
        scores, _, _ = self._current()
        if scores is None:
            return 0
        return int((np.abs(scores["score"].values.astype(np.float64)) >= threshold).sum())

    def _sync_slider(self) -> None:
        """Slider options and value from the mode and the current n_edges / threshold (or
        n_nodes for a node circuit)."""
        if self._syncing:
            return
        if self.nodes_mode():
            values = self._node_sizes()
            options = {f"{k} nodes": k for k in values}
            value = self.n_nodes if self.n_nodes in values else min(
                values, key=lambda v: abs(np.log1p(v) - np.log1p(self.n_nodes)))
            self._syncing = True
            try:
                self._slider.param.update(options=options, value=value,
                                          label=self.param.n_nodes.label)
            finally:
                self._syncing = False
            return
        sizes, thresholds = self._grid()
        total = self._total()
        # an off-grid size (the other method's default kept after a toggle, a link, code) gets
        # a position of its own: the slider shows the size the circuit is chosen by
        if self.mode == "top-n":
            value = int(self.n_edges)
            values = sorted({int(n) for n in sizes} | {value})
            options = {(f"{n:,} ({100 * n / total:.2g} %)" if total else f"{n:,}"): n
                       for n in values}
            name = self.param.n_edges.label
        else:
            value = float(self.threshold)
            pairs = {float(t): int(n) for n, t in zip(sizes, thresholds)}
            if value not in pairs:
                pairs[value] = self._passing(value)
            options = {f"{t:.3g} ({pairs[t]:,} edges)": t for t in sorted(pairs, reverse=True)}
            name = self.param.threshold.label
        self._syncing = True
        try:
            self._slider.param.update(options=options, value=value, label=name)
        finally:
            self._syncing = False

    def _mode_changed(self, *_: Any) -> None:
        """Switching top-n <-> threshold keeps the slider's position (the same edges chosen)."""
        sizes, thresholds = self._grid()
        if self.scores is not None or self.checkpoints is not None:
            with self._sizing_by_page():
                if self.mode == "threshold":
                    i = int(np.argmin(np.abs(np.log(sizes) - np.log(max(self.n_edges, 1)))))
                    self.threshold = float(thresholds[i])
                else:
                    i = int(np.argmin(np.abs(thresholds - self.threshold)))
                    self.n_edges = int(sizes[i])
        self._sync_slider()

    def _slider_moved(self, event: param.parameterized.Event) -> None:
        if self._syncing:
            return
        self._syncing = True
        try:
            # one batch of Bokeh events; the plots change their sources' data in place, so
            # no model joins the document and its model graph needs no recompute (freeze)
            with pn.io.document.hold():
                if self.nodes_mode():
                    self.n_nodes = int(event.new)
                elif self.mode == "top-n":
                    self.n_edges = int(event.new)
                else:
                    self.threshold = float(event.new)
        finally:
            self._syncing = False

    def _set_default_size(self, force: bool = False) -> None:
        """The smallest measured circuit recovering ``fraction`` of the metric, at most
        ``max_default_edges`` edges (`circuit_select.smallest_faithful_circuit`); without a
        curve (checkpoints only), about 5 % of the edges. A size asked for in the constructor
        is kept until the fraction slider moves (``force``). The node circuit's default is
        chosen the same way from the node curve (`circuit_select.smallest_faithful_nodes`)."""
        self._set_node_default(force)
        sizes, thresholds = self._grid()
        if self.curve is not None and self.scores is not None:
            self._default = cs.smallest_faithful_circuit(self.curve, self.fraction,
                                                         max_edges=self.max_default_edges)
        if (force or not self._chosen_size) and len(sizes):
            if self._default is not None and self.curve is not None:
                n = self._default.n_edges
            else:
                total = self._total()
                n = max(0.05 * total, min(30, total))
            i = int(np.argmin(np.abs(np.log(np.maximum(sizes, 1)) - np.log(max(n, 1)))))
            with self._sizing_by_page():
                self.param.update(n_edges=int(n) if self.curve is not None else int(sizes[i]),
                                  threshold=float(thresholds[i]))
        self._sync_slider()

    def _set_node_default(self, force: bool = False) -> None:
        """The smallest measured node circuit recovering ``fraction`` (from the node curve);
        n_nodes moves to it unless a count was asked for in the constructor."""
        if self.node_curve is None:
            self._node_default = None
            return
        self._node_default = cs.smallest_faithful_nodes(self.node_curve, self.fraction)
        if force or not self._chosen_nodes:
            with self._sizing_by_page():
                self.n_nodes = self._node_default.n_edges
        self._chosen_nodes = False

    @contextlib.contextmanager
    def _sizing_by_page(self) -> Iterator[None]:
        """The page sets the size (its default, a mode switch, a new result): not a size the
        user or a link asked for."""
        self._sizing += 1
        try:
            yield
        finally:
            self._sizing -= 1

    def _size_asked(self, *events: param.parameterized.Event) -> None:
        """A size set from outside (code, a link, a state file) is kept when the scores
        arrive, as one given to the constructor is; the page's own moves and the slider's
        are not."""
        if self._sizing or self._syncing:
            return
        for event in events:
            if event.name == "n_nodes":
                self._chosen_nodes = True
            else:
                self._chosen_size = True

    def _granularity_changed(self) -> None:
        """Edges <-> nodes: the node curve of the shown scores is measured on first use."""
        if self.nodes_mode() and self.scores is not None and self.node_curve is None:
            self._request_node_curve()
        self._sync_slider()
        self._redraw_marker()
