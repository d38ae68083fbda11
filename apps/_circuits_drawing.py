"""The Circuits page's graph: what is drawn for the current selection (the pruned circuit,
its influence-pruned subset past `MAX_DRAWN_EDGES`, a diff, the pinned node's edges), the
in-place redraw of every drawing, clicks on nodes and edges, and the caption."""
from __future__ import annotations

import time
from typing import Any

import numpy as np
import panel as pn
import param
import xarray as xr

from apps import _circuit_graph as cg
from apps import theme
from apps._circuits_curve import TOOLS
from apps._circuits_scoring import METHOD_LABELS
from apps._circuits_text import graph_title
from explorer import components
from explorer._checks import InputError
from explorer.analyses import circuit_influence as ci
from explorer.components import canonical

__all__ = ["LEGEND_PX", "graph_height", "graph_ranges", "CircuitDrawing"]

LEGEND_PX = 44           # the colour / width legend's two rows under the graph


def graph_height(n_heads: int) -> int:
    """Pixel height of the graph: about 38 px per head row, room above for the MLP labels
    and below for the legend."""
    return int(max(380, 38 * (n_heads + 4))) + LEGEND_PX


def graph_ranges(n_layers: int, n_heads: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """The graph's x and y ranges (room for the input, the logits and the labels)."""
    return (-1.6, n_layers + 1.4), (-0.8, n_heads + 2.4)


class CircuitDrawing:
    """The drawing part of `apps.circuits.CircuitsView` (a mixin): the edge table, the
    Bokeh graph figures kept up to date in place, clicks and the caption."""

    def _current(self) -> tuple[xr.Dataset | None, np.ndarray | None, str]:
        """Scores, order and a label of what the graph shows (a checkpoint or the base)."""
        ck = self.checkpoints
        if ck is not None and self.checkpoint > 0:
            i = min(self.checkpoint, ck.sizes["checkpoint"] - 1)
            return self._ck_scores[i], self._ck_orders[i], f"step {int(ck.checkpoint[i])}"
        if self.scores is None and ck is not None:
            return self._ck_scores[0], self._ck_orders[0], f"step {int(ck.checkpoint[0])}"
        return self.scores, self._order, "base model"

    def _reference(self, showing_base: bool) -> tuple[np.ndarray | None, str]:
        """The diff's reference circuit (same selection) and what it is, or why there is none."""
        if not self.diff:
            return None, ""
        if self.diff_against == "first checkpoint":
            if self.checkpoints is None:
                return None, "no fine-tuning checkpoints yet (press Fine-tune)"
            return self._circuit(self._ck_scores[0]), \
                f"step {int(self.checkpoints.checkpoint[0])}"
        if not showing_base:
            return None, "the other attribution is scored on the base model only"
        if self.other_scores is None:
            return None, f"waiting for the {METHOD_LABELS[self._other_method()]} scores"
        return self._circuit(self.other_scores), METHOD_LABELS[self._other_method()]

    def _refresh_nodes(self, force: bool = False) -> None:
        """The node set of the circuit (all of it, drawn edges or not) and of the selection's
        shown edges."""
        t, c = self._table, self._circuit_table
        nodes: frozenset[str] = frozenset()
        if t is not None:
            keep = t["status"] != "lost"
            nodes = frozenset(t["src"][keep].tolist()) | frozenset(t["dst"][keep].tolist())
        if c is not None:
            nodes |= frozenset(c["src"].tolist()) | frozenset(c["dst"].tolist())
        self._nodes = nodes
        if force:
            self._drawn_nodes_key = None

    def _influence_of(self, scores: xr.Dataset, mask: np.ndarray) -> xr.Dataset:
        """`circuit_influence.influence_pruning` of the circuit ``mask`` (cached)."""
        key = self._selection_key(scores)
        out = self._influence_cache.get(key)
        if out is None:
            if len(self._influence_cache) > 64:
                self._influence_cache.clear()
            out = ci.influence_pruning(scores, mask)
            self._influence_cache[key] = out
        return out

    def _set_circuit_table(self, scores: xr.Dataset, mask: np.ndarray, members: np.ndarray,
                           diff: bool, effects: dict[int, float]) -> None:
        """Every edge of the shown circuit (what a hover over a node reads) and each node's
        strongest paths from the input and to the logits, as rows of it."""
        if diff or not len(members):
            self._circuit_table, self._node_paths = None, {}
            return
        self._circuit_table = cg.edge_table(scores, members, self._pos, spell=self._spell,
                                            effects=effects)
        key = self._selection_key(scores) + ("paths",)
        paths = self._influence_cache.get(key)
        if paths is None:   # the same circuit re-drawn (a selection, a hover): computed once
            row = {int(e): i for i, e in enumerate(members.tolist())}
            paths = {self._spell[n]: ",".join(str(row[e]) for e in back + fwd)
                     for n, (back, fwd) in ci.strongest_paths(scores, mask).items()}
            self._influence_cache[key] = paths
        self._node_paths = paths

    def influence_share(self) -> float:
        """Share of the shown circuit's influence on the logits that its drawn edges carry
        (1 when the whole circuit is drawn)."""
        return 1.0 if self._influence is None else float(self._influence.attrs["drawn_share"])

    def _pinned_data(self) -> dict[str, list]:
        """The selected node's circuit edges and strongest paths (drawn like a hover)."""
        c = self._circuit_table
        if not self.selected or c is None:
            return cg.node_edges_data(cg.circuit_source_data(None), "", "")
        return cg.node_edges_data(c, self.selected, self._node_paths.get(self.selected, ""))

    def nodes_drawn(self) -> list[dict[str, list]]:
        """What each drawing's node data source holds: name, size and fill (for tests)."""
        return [{k: list(g.nodes.data[k]) for k in ("name", "size", "fill")}
                for g in self._graphs]

    def labels_drawn(self) -> dict[str, list]:
        """What the last drawing's label sources hold together: x, y and text (for tests)."""
        srcs = [self._graphs[-1].head_labels, self._graphs[-1].mlp_labels] if self._graphs else []
        return {k: [v for src in srcs for v in src.data[k]] for k in ("x", "y", "text")}

    def node_columns(self) -> dict[str, list]:
        """The node columns the page draws now (places, sizes, fills, labels, paths)."""
        return cg.node_columns(self._names, self._pos, self._nodes, self.selected,
                               self._node_paths)

    def _graph_title(self, n_members: int, n_drawn: int, method: str, label: str,
                     ref_label: str) -> str:
        """`apps._circuits_text.graph_title` of the shown scores' method (``method``: the
        shown result's provenance, or the checkpoints'); a diff's counts."""
        if ref_label:
            t = self._table
            return (f"Diff: {METHOD_LABELS.get(method, method)} vs {ref_label}, "
                    f"+{int((t['status'] == 'gained').sum())} "
                    f"/ −{int((t['status'] == 'lost').sum())}")
        stale = label == "base model" and bool(self.stale_note())
        return graph_title(method, n_members, n_drawn, where=label, stale=stale,
                           n_nodes=self._shown["chosen"] if self.nodes_mode() else None)

    def _current_key(self) -> tuple:
        return (self.granularity, self.n_nodes, self.mode, self.n_edges, self.threshold,
                self.checkpoint, self.diff,
                self.diff_against, id(self.scores), id(self.checkpoints), id(self.other_scores),
                self.selected, self.show_outside, self._pos_version, self._key())

    def _update_table(self) -> None:
        """The drawn edges for the current selection (once per change: both graph callbacks
        read it)."""
        key = self._current_key()
        if key == self._frame_key:
            return
        self._frame_key = key
        self._frame_times = {}
        scores, order, label = self._current()
        self._outside = np.zeros(0, dtype=int)
        if scores is None:
            self._table = None
            self._members = np.zeros(0, dtype=int)
            self._shown = {"size": 0, "chosen": 0, "drawn": 0}
            self._title = "Circuit: waiting for edge scores"
            self._refresh_nodes()
            return
        mask = self._circuit(scores)
        n_chosen = self._n_chosen(scores)
        members = order[mask[order]]              # the pruned circuit, strongest first
        self._influence = None
        if len(members) > self.max_drawn_edges:        # its influence-pruned subset
            self._influence = self._influence_of(scores, mask)
            shown = members[self._influence["drawn"].values[members]]
        else:
            shown = members
        base = scores is self.scores
        reference, ref_label = self._reference(base)
        self._diff_note = ref_label if reference is None else ""
        if reference is None:
            ref_label = ""
        effects = self._effects.get(self._key(), {}) if base else {}
        raw = self._raw.get(self.selected)
        if raw is not None and self.show_outside:   # asked for: its strongest other edges
            self._outside = cg.strongest_edges(scores, raw, 5, exclude=mask)
        self._table = cg.edge_table(scores, shown, self._pos, reference=reference, circuit=mask,
                                    max_lost=self.max_drawn_edges, selected=self.selected,
                                    effects=effects, extra=self._outside, spell=self._spell)
        self._members = members
        self._shown = {"size": int(len(members)), "chosen": n_chosen, "drawn": int(len(shown))}
        self._set_circuit_table(scores, mask, members, reference is not None, effects)
        keep_rows = self._table["status"] != "lost"
        labels = [f"{s} → {d}" for s, d in zip(self._table["src"][keep_rows],
                                                 self._table["dst"][keep_rows])]
        self._edge_labels = dict(zip(labels, self._table["edge"][keep_rows].tolist()))
        keep = self.edge if self.edge in self._edge_labels else ""
        self.param.edge.objects = ["", *labels]
        if self.edge != keep:
            self.param.update(edge=keep)
        method = (self._shown_method if base else
                  str(self.checkpoints.attrs.get("edge_method", self.method)))
        self._title = self._graph_title(len(members), len(shown), method, label, ref_label)
        self._csv.filename = (f"circuit_{self._model.spec.name.split('/')[-1]}_"
                              f"{self.task.replace(' ', '-')}_"
                              f"{method}_{len(members)}edges.csv")
        self._svg.filename = self._csv.filename[:-4] + ".svg"
        self._refresh_nodes()

    def redraw(self) -> dict[str, Any]:
        """Bring every drawing of the graph up to date (the edge table for the current
        selection; the nodes and labels when the node set, the selection or the layout
        changed) and return what is drawn: ``edges`` (the edge source's columns), ``title``,
        ``nodes`` (`node_columns`). Publishes its time (`redraw_ms`, `redraw_cpu_ms`)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        self._update_table()
        edges = cg.edge_source_data(self._table)
        key = (self._nodes, self.selected, self._pos_version, id(self._circuit_table))
        nodes = self.node_columns() if (key != self._drawn_nodes_key or not self._graphs) \
            else None
        circuit = cg.circuit_source_data(self._circuit_table) if nodes is not None else None
        pinned = self._pinned_data() if nodes is not None else None
        with pn.io.document.hold():
            for g in self._graphs:
                g.show_edges(edges, self._title)
                if nodes is not None:
                    g.show_circuit(circuit, pinned)
                    g.show_nodes(nodes)
                    g.show_picked(self._picked_data())
        self._drawn_nodes_key = key
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        # after the render, not inside it: a pane following these parameters would be
        # rebuilt mid-render, before its model joins the document (Panel then styles it
        # with the design's CDN style sheets, which a browser fetches)
        self.schedule(lambda: self.param.update(redraw_ms=1e3 * wall, redraw_cpu_ms=1e3 * cpu))
        return {"edges": edges, "title": self._title,
                "nodes": nodes if nodes is not None else self.node_columns()}

    _edges_plot = redraw   # the name the remote-model tests call

    def _picked_data(self) -> dict[str, list]:
        pairs = [tuple(e.split("->", 1)) for e in self.selected_edges]
        return cg.picked_source_data(pairs, self._pos, self._raw)

    def _redraw_picked(self) -> None:
        data = self._picked_data()
        with pn.io.document.hold():
            for g in self._graphs:
                g.show_picked(data)

    def _graph_figure(self) -> Any:
        """A new drawing of the graph (one per rendering of the page), drawn now and kept up
        to date by `redraw`; a click on it goes to `_clicked`."""
        from bokeh.events import Tap

        L, H = self._model.n_layers, self._model.spec.n_heads
        xlim, ylim = graph_ranges(L, H)
        g = cg.GraphFigure(L, H, height=graph_height(H), xlim=xlim, ylim=ylim,
                           font_sizes=theme.font_sizes(), tools=TOOLS)
        g.figure.on_event(Tap, lambda event: self._clicked(event.x, event.y))
        self._graphs.append(g)
        self._frame_key = None
        self._drawn_nodes_key = None
        self.redraw()
        return g.figure

    def _clicked(self, x: float | None = None, y: float | None = None) -> None:
        """A click on the graph: a node selects it (again: clears it) and highlights its
        edges; else an edge under the pointer is patched and selected in the workspace
        (`selected_edges`; a click on a selected edge deselects it); empty space clears the
        component selection."""
        if x is None or y is None:
            return
        L, H = self._model.n_layers, self._model.spec.n_heads
        xlim, ylim = graph_ranges(L, H)
        px_x = cg.FRAME_PX_1280 / (xlim[1] - xlim[0])
        px_y = (graph_height(H) - 70 - LEGEND_PX) / (ylim[1] - ylim[0])
        node = cg.nearest_node(x, y, self._pos, px_per_x=px_x, px_per_y=px_y)
        if node is not None:
            name = canonical(node)
            self.selected = "" if self.selected == name else name
            return
        row = cg.nearest_edge(x, y, self._table, px_per_x=px_x, px_per_y=px_y)
        if row is not None and self._table["status"][row] != "lost":
            src, dst = self._table["src"][row], self._table["dst"][row]
            self.edge = f"{src} → {dst}"
            name = str(components.edge(src, dst))
            self.selected_edges = ([e for e in self.selected_edges if e != name]
                                   if name in self.selected_edges else [*self.selected_edges, name])
        elif row is None:
            self.selected = ""

    def _check_selected(self, event: param.parameterized.Event) -> None:
        """The pinned node must be a node of this model's graph, in any spelling
        `components.canonical` reads (set to its canonical one); else it is refused and the
        previous one kept."""
        name = event.new
        if not name or name in self._raw:
            return
        try:
            spelled = canonical(name)
        except components.ComponentError:
            spelled = None
        if spelled in self._raw:
            self.selected = spelled
            return
        self.param.update(selected=event.old)
        L, H = self._model.n_layers, self._model.spec.n_heads
        raise InputError(f"`selected` must be a node of this model's graph: L0.H0 to "
                         f"L{L - 1}.H{H - 1}, L0.MLP to L{L - 1}.MLP, input or logits (or "
                         f"empty); got {str(name)[:60]!r}.")

    def drawn_text(self) -> str:
        """What of the circuit is drawn, and the influence share the drawn edges carry."""
        size, n_drawn = self._shown["size"], self._shown["drawn"]
        if not size or (self.diff and self._table is not None
                        and np.isin(self._table["status"], ["gained", "lost"]).any()):
            return ""
        n_nodes = len(self._circuit_nodes())
        if self.nodes_mode():
            n_nodes = self._shown["chosen"]
        if self._influence is None:
            return (f"All {size:,} edges and {n_nodes:,} nodes of the circuit are drawn "
                    f"(100% of its influence on the logits).")
        return (f"Drawn: the {n_drawn:,} of its {size:,} edges that carry "
                f"**{self.influence_share():.1%}** of the circuit's influence on the logits "
                f"(influence pruning as in circuit-tracer: nodes to "
                f"{ci.NODE_THRESHOLD:.0%}, edges to {ci.EDGE_THRESHOLD:.0%} of the "
                f"influence); all {n_nodes:,} nodes of the circuit are drawn and labelled. "
                "Hover or click a node for all its circuit edges and its strongest paths "
                "from the input and to the logits (black).")

    def _circuit_nodes(self) -> set[str]:
        c = self._circuit_table
        return set() if c is None else set(c["src"].tolist()) | set(c["dst"].tolist())

    def _caption(self, *_: Any) -> str:
        """What the graph shows, in words (the title stays short)."""
        if self.scores is None and self.checkpoints is None:
            return ""
        self._update_table()
        stale = self.stale_note()
        parts = [f"**Outdated.** {stale}" if stale else "", self.default_text(),
                 self.drawn_text()]
        if self.diff and self._diff_note:
            parts.append(f"Diff: {self._diff_note}.")
        elif self.diff:
            parts.append("Diff: green edges are gained, orange lost, grey kept.")
        parts.append("Layout: heads are labelled H3 in their layer's column (hover for L17.H3) "
                     "and ordered by the score mass they carry (heaviest on top) in the first "
                     f"scores this page computed ({self.layout_from or 'none yet'}), kept so "
                     "that no node moves between results. Click a node to pin it, an edge to "
                     "patch it.")
        parts.append(self._selection_text())
        return " ".join(p for p in parts if p)

    def _selection_text(self) -> str:
        """Where the selected component is in the graph (also when it is not in the circuit)."""
        if not self.selected:
            return ""
        if self.selected not in self._raw:
            return f"Selected: **{self.selected}** (not a node of this model's graph)."
        self._update_table()
        t = self._table
        if t is None:
            return f"Selected: **{self.selected}** (highlighted; its edges show once scored)."
        rows = np.flatnonzero(t["status"] == "outside")
        outside = ", ".join(f"{t['src'][i]} → {t['dst'][i]} ({t['score'][i]:+.3g})"
                            for i in rows)
        inside = self.selected in self._circuit_nodes()
        if not inside:
            if len(rows):
                return (f"**{self.selected}** has no edge in this circuit; its strongest edges "
                        f"(drawn in purple): {outside}.")
            return (f"**{self.selected}** has no edge in this circuit (tick \"Show the "
                    "selection's edges outside the circuit\" to draw its strongest ones).")
        c = self._circuit_table
        n = int(((c["src"] == self.selected) | (c["dst"] == self.selected)).sum())
        more = f" Its strongest edges outside the circuit (purple): {outside}." if len(rows) else ""
        return (f"Selected: **{self.selected}**; its edges in the circuit stand out: outlined, "
                f"its {n:,} circuit edges and its strongest paths from the input and to the "
                f"logits drawn over the graph.{more}")
