"""Drawing and encoding of the Circuits page's graph (no Panel state): pure functions
and `GraphFigure`, the plain Bokeh figure whose data sources a re-draw updates in place.

Layout: layers left to right (heads at x = L, the MLP above them at L + 0.5, input left,
logits right); within a layer the heads sit by the score mass they carry (heaviest at the
top, just under the MLP). Encoding: an edge's width and opacity grow with |score|, its colour
is the score's sign (or, in a diff, gained / lost / kept). Nodes are named in the one
component spelling of `explorer.components` (L17.H3, L17.MLP, input, logits); a head's label
is its short form ``H3`` above it, in its layer's column (the layer is the x axis; the full
name is in the hover and the ``name`` column), so that labels of neighbouring layers do not
run into each other; an MLP's label is its full name, straight up.
"""
from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable, Mapping, Sequence
from html import escape
from typing import Any

import numpy as np
import xarray as xr

from apps import theme
from explorer.components import canonical

__all__ = ["node_names", "head_mass_order", "node_positions", "edge_style", "edge_table",
           "node_columns", "short_label", "strongest_edges", "OUTSIDE", "layer_ticks", "tick_step", "nearest_node", "nearest_edge",
           "circuit_csv", "circuit_svg", "edge_diff", "POSITIVE", "NEGATIVE", "DIFF_COLORS",
           "FRAME_PX_1280", "GraphFigure", "EDGE_COLUMNS", "EDGE_HOVER", "PICKED",
           "edge_source_data", "label_source_data", "picked_source_data", "circuit_source_data",
           "node_edges_data", "HOVER_JS", "SELECTED_LINE", "PATH_COLOR"]

POSITIVE = theme.SIGNED_CMAP[-20]   # the diverging map's red end: patching the edge raises the metric
NEGATIVE = theme.SIGNED_CMAP[20]    # its blue end: patching lowers the metric (the edge helps)
DIFF_COLORS = {"kept": "#8c8c8c", "gained": theme.CATEGORICAL[2], "lost": theme.CATEGORICAL[1]}
FADED_NODE, USED_NODE = "#d4d4d4", "#303030"
SELECTED_LINE = "#000000"   # the outline of the selected (pinned) node
PATH_COLOR = "#000000"      # a hovered or pinned node's strongest paths
NODE_EDGE_WIDTH = 2.0       # a hovered or pinned node's circuit edges
OUTSIDE = theme.CATEGORICAL[4]   # a selected component's strongest edges outside the circuit
FRAME_PX_1280 = 500   # the graph's data area at a 1280 px window (gallery sidebar + controls)


def node_names(n_layers: int, n_heads: int) -> list[str]:
    """The graph's node names in drawing order: input, each layer's heads and MLP, logits."""
    names = ["input"]
    for layer in range(n_layers):
        names += [f"a{layer}.h{h}" for h in range(n_heads)] + [f"m{layer}"]
    return names + ["logits"]


def head_mass_order(scores: xr.Dataset | None, n_layers: int, n_heads: int) -> dict[int, list[int]]:
    """Heads of each layer, heaviest first: the sum of |score| over the edges into and out of
    each head (ties and no scores: head index order)."""
    mass: dict[str, float] = {}
    if scores is not None:
        mag = np.abs(np.asarray(scores["score"].values, dtype=np.float64))
        for names in (scores["src"].values, scores["dst"].values):
            for n, m in zip(names.astype(str), mag):
                mass[n] = mass.get(n, 0.0) + m
    return {layer: sorted(range(n_heads), key=lambda h: (-mass.get(f"a{layer}.h{h}", 0.0), h))
            for layer in range(n_layers)}


def node_positions(n_layers: int, n_heads: int,
                   order: Mapping[int, Sequence[int]] | None = None) -> dict[str, tuple[float, float]]:
    """(x, y) of every node: x = layer (heads at L, the MLP at L + 0.5, odd layers' MLP a
    little higher so MLP -> MLP chains stay visible), input at x = -1 and logits at
    x = n_layers. ``order`` (from `head_mass_order`) puts each layer's first head at the top
    (y = n_heads - 1); without it head h sits at y = h."""
    mid = (n_heads - 1) / 2
    pos = {"input": (-1.0, mid), "logits": (float(n_layers), mid)}
    for layer in range(n_layers):
        heads = list(order[layer]) if order is not None else list(range(n_heads - 1, -1, -1))
        for rank, h in enumerate(heads):
            pos[f"a{layer}.h{h}"] = (float(layer), float(n_heads - 1 - rank))
        pos[f"m{layer}"] = (layer + 0.5, n_heads + 0.7 * (layer % 2))
    return {n: pos[n] for n in node_names(n_layers, n_heads)}


def edge_style(score: np.ndarray, vmax: float | None = None) -> dict[str, np.ndarray]:
    """Width (0.6-6 px) and opacity (0.15-1) growing linearly with |score| / ``vmax`` (by
    default the largest |score|), and the colour of the sign."""
    s = np.asarray(score, dtype=np.float64)
    if vmax is None:
        vmax = float(np.abs(s).max()) if len(s) else 1.0
    r = np.clip(np.abs(s) / (vmax or 1.0), 0.0, 1.0)
    return {"width": 0.6 + 5.4 * r, "alpha": 0.15 + 0.85 * r,
            "color": np.where(s >= 0, POSITIVE, NEGATIVE).astype(object)}


def strongest_edges(scores: xr.Dataset, node: str, k: int = 5,
                    exclude: np.ndarray | None = None) -> np.ndarray:
    """Indices of the ``k`` edges into or out of ``node`` (a graph node name, ``a3.h1``) with
    the largest |score|, strongest first; ``exclude`` (a bool mask over the edges, e.g. the
    circuit) leaves those edges out."""
    touches = (scores["src"].values == node) | (scores["dst"].values == node)
    if exclude is not None:
        touches &= ~np.asarray(exclude, dtype=bool)
    touches = np.flatnonzero(touches)
    mag = np.abs(np.asarray(scores["score"].values, dtype=np.float64)[touches])
    return touches[np.argsort(-mag, kind="stable")[:k]]


def edge_table(scores: xr.Dataset, index: np.ndarray, pos: Mapping[str, tuple[float, float]], *,
               reference: np.ndarray | None = None, circuit: np.ndarray | None = None,
               max_lost: int = 400, selected: str = "",
               effects: Mapping[int, float] | None = None, extra: np.ndarray | None = None,
               spell: Mapping[str, str] | None = None) -> dict[str, np.ndarray]:
    """Columns of the drawn edges ``index`` (edge indices, strongest first).

    ``src``/``dst`` are the components' names in the one spelling; ``edge`` the edge's index
    in ``scores``; ``effect`` the measured patch effect (metric change) where ``effects``
    has one, else "not computed". With ``reference`` (a bool mask of another circuit over the
    same edges) the drawn edges are ``kept`` (in the reference too) or ``gained``, and the
    reference's edges missing from ``circuit`` (this circuit's whole mask; by default the
    drawn edges) follow as ``lost``, strongest first, at most ``max_lost``. ``extra`` (edge
    indices outside the circuit: a selected component's strongest edges) follow as
    ``outside``, in their own colour. With ``selected`` (a component name) the edges not
    touching it are faded to 0.08 opacity. ``spell`` maps graph node names to the one
    spelling (default: `canonical` of each).
    """
    top = np.asarray(index, dtype=int)
    status = np.full(len(top), "kept", dtype=object)
    mag = np.abs(np.asarray(scores["score"].values, dtype=np.float64))
    if reference is not None:
        status = np.where(reference[top], "kept", "gained").astype(object)
        if circuit is None:
            circuit = np.zeros(len(reference), bool)
            circuit[top] = True
        lost = np.flatnonzero(reference & ~circuit)
        lost = lost[np.argsort(-mag[lost], kind="stable")][:max_lost]
        top = np.concatenate([top, lost]).astype(int)
        status = np.concatenate([status, np.full(len(lost), "lost", dtype=object)])
    if extra is not None and len(extra):
        top = np.concatenate([top, np.asarray(extra, dtype=int)])
        status = np.concatenate([status, np.full(len(extra), "outside", dtype=object)])
    raw_src = scores["src"].values[top].astype(str)
    raw_dst = scores["dst"].values[top].astype(str)
    s = np.asarray(scores["score"].values[top], dtype=np.float64)
    xy0 = np.array([pos[n] for n in raw_src], dtype=float).reshape(-1, 2)
    xy1 = np.array([pos[n] for n in raw_dst], dtype=float).reshape(-1, 2)
    style = edge_style(s)
    if reference is not None:
        style["color"] = np.array([DIFF_COLORS.get(k, OUTSIDE) for k in status], dtype=object)
    outside = status == "outside"
    style["color"] = np.where(outside, OUTSIDE, style["color"]).astype(object)
    style["alpha"] = np.where(outside, np.maximum(style["alpha"], 0.6), style["alpha"])
    style["width"] = np.where(outside, np.maximum(style["width"], 2.5), style["width"])
    spell = spell if spell is not None else {n: canonical(n) for n in {*raw_src, *raw_dst}}
    src = np.array([spell[n] for n in raw_src], dtype=object)
    dst = np.array([spell[n] for n in raw_dst], dtype=object)
    alpha = style["alpha"]
    if selected:
        touches = (src == selected) | (dst == selected)
        alpha = np.where(touches, alpha, 0.08)
    effects = effects or {}
    effect = np.array([f"{effects[i]:+.4f}" if i in effects else "not computed"
                       for i in top.tolist()], dtype=object)
    return {"x0": xy0[:, 0], "y0": xy0[:, 1], "x1": xy1[:, 0], "y1": xy1[:, 1],
            "src": src, "dst": dst, "score": s, "edge": top, "width": style["width"],
            "alpha": alpha, "color": style["color"], "status": status, "effect": effect}


def short_label(name: str) -> str:
    """The label drawn at a node: ``H3`` for the head ``L17.H3`` (its layer is the column),
    the name itself for an MLP, input and logits."""
    layer, dot, rest = name.partition(".")
    return rest if dot and rest.startswith("H") else name


def node_columns(names: Sequence[str], pos: Mapping[str, tuple[float, float]],
                 used: Iterable[str], selected: str = "",
                 paths: Mapping[str, str] | None = None) -> dict[str, list]:
    """Per node: place, marker size, fill and outline, the name (one spelling), the label
    drawn at it (`short_label`) for nodes of the circuit and the selected one, empty for the
    others (drawn small and pale), and ``path``: the rows of the circuit's edge source
    (`circuit_source_data`) on its strongest paths from the input and to the logits, comma
    separated (what a hover draws). The selected node is outlined in black."""
    used = {canonical(n) for n in used}
    label = [canonical(n) for n in names]
    paths = paths or {}
    size, fill, line, width = [], [], [], []
    for c in label:
        if c == selected:
            size.append(14), fill.append(theme.ACCENT), line.append(SELECTED_LINE)
            width.append(3.0)
        elif c in used:
            size.append(8), fill.append(USED_NODE), line.append("white"), width.append(0.5)
        else:
            size.append(4), fill.append(FADED_NODE), line.append("white"), width.append(0.5)
    return {"x": [pos[n][0] for n in names], "y": [pos[n][1] for n in names], "name": label,
            "size": size, "fill": fill, "line": line, "line_width": width,
            "path": [paths.get(c, "") for c in label],
            "text": [short_label(c) if c in used or c == selected else "" for c in label]}


def tick_step(n_layers: int, frame_px: float = FRAME_PX_1280, font_px: float = 6.5) -> int:
    """Label every k-th layer so the labels of the widest layer number (plus a gap of one
    character each side) do not collide in ``frame_px`` over the n_layers + 3 units of the
    x range."""
    label_px = (len(str(max(n_layers - 1, 0))) + 2) * font_px
    per_layer = frame_px / (n_layers + 3)
    return max(1, math.ceil(label_px / per_layer))


def layer_ticks(n_layers: int, frame_px: float = FRAME_PX_1280) -> list[tuple[float, str]]:
    """A tick at every layer, labelled at every `tick_step`-th (the others unlabelled)."""
    k = tick_step(n_layers, frame_px)
    return [(float(layer), str(layer) if layer % k == 0 else "") for layer in range(n_layers)]


def nearest_node(x: float, y: float, pos: Mapping[str, tuple[float, float]], *,
                 px_per_x: float, px_per_y: float, tol_px: float = 9.0) -> str | None:
    """The node within ``tol_px`` screen pixels of (x, y) (data units), nearest first."""
    names = list(pos)
    xy = np.array([pos[n] for n in names])
    d = np.hypot((xy[:, 0] - x) * px_per_x, (xy[:, 1] - y) * px_per_y)
    i = int(np.argmin(d))
    return names[i] if d[i] <= tol_px else None


def nearest_edge(x: float, y: float, table: Mapping[str, np.ndarray] | None, *,
                 px_per_x: float, px_per_y: float, tol_px: float = 6.0) -> int | None:
    """Row of ``table`` whose segment passes within ``tol_px`` screen pixels of (x, y)."""
    if table is None or not len(table["x0"]):
        return None
    p = np.array([x * px_per_x, y * px_per_y])
    a = np.stack([table["x0"] * px_per_x, table["y0"] * px_per_y], 1)
    b = np.stack([table["x1"] * px_per_x, table["y1"] * px_per_y], 1)
    ab = b - a
    t = np.clip(((p - a) * ab).sum(1) / np.maximum((ab * ab).sum(1), 1e-12), 0, 1)
    d = np.hypot(*(a + t[:, None] * ab - p).T)
    i = int(np.argmin(d))
    return i if d[i] <= tol_px else None


def edge_diff(current: Iterable[tuple[str, str]], reference: Iterable[tuple[str, str]]
              ) -> dict[str, set[tuple[str, str]]]:
    """Edges gained (in ``current`` only), lost (in ``reference`` only) and kept (both)."""
    cur, ref = set(current), set(reference)
    return {"gained": cur - ref, "lost": ref - cur, "kept": cur & ref}


def circuit_csv(table: Mapping[str, np.ndarray] | None) -> str:
    """The shown circuit as CSV: source, target, score, patch effect (one row per edge of the
    circuit, strongest first; lost edges of a diff are left out, a ``status`` column added)."""
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    diff = table is not None and bool(np.isin(table["status"], ["gained", "lost"]).any())
    w.writerow(["source", "target", "score", "patch_effect"] + (["status"] if diff else []))
    if table is not None:
        for i in range(len(table["src"])):
            if table["status"][i] in ("lost", "outside"):
                continue
            effect = table["effect"][i]
            row = [table["src"][i], table["dst"][i], repr(float(table["score"][i])),
                   "" if effect == "not computed" else effect]
            w.writerow(row + ([table["status"][i]] if diff else []))
    return out.getvalue()


def circuit_svg(table: Mapping[str, np.ndarray] | None, nodes: Mapping[str, list], *,
                n_layers: int, n_heads: int, title: str = "", width: int = 1200,
                height: int = 560) -> str:
    """The graph as a standalone SVG (the same places, widths, opacities, colours and labels
    as the page's Bokeh plot, whose save tool writes PNG only)."""
    x_lo, x_hi, y_lo, y_hi = -1.5, n_layers + 1.5, -1.0, n_heads + 2.5
    m = {"l": 40, "r": 20, "t": 36, "b": 40}
    sx = (width - m["l"] - m["r"]) / (x_hi - x_lo)
    sy = (height - m["t"] - m["b"]) / (y_hi - y_lo)

    def X(v: float) -> float:
        return m["l"] + (v - x_lo) * sx

    def Y(v: float) -> float:
        return height - m["b"] - (v - y_lo) * sy

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{m["l"]}" y="22" font-size="15" font-weight="bold">{escape(title)}</text>']
    if table is not None:
        for i in np.argsort(np.asarray(table["width"]), kind="stable"):  # strongest on top
            out.append(f'<line x1="{X(table["x0"][i]):.1f}" y1="{Y(table["y0"][i]):.1f}" '
                       f'x2="{X(table["x1"][i]):.1f}" y2="{Y(table["y1"][i]):.1f}" '
                       f'stroke="{table["color"][i]}" stroke-width="{table["width"][i]:.2f}" '
                       f'stroke-opacity="{table["alpha"][i]:.3f}" stroke-linecap="round">'
                       f'<title>{escape(table["src"][i])} → {escape(table["dst"][i])}: '
                       f'{table["score"][i]:+.4g}</title></line>')
    for x, y, size, fill, name, text in zip(nodes["x"], nodes["y"], nodes["size"], nodes["fill"],
                                            nodes["name"], nodes["text"]):
        out.append(f'<circle cx="{X(x):.1f}" cy="{Y(y):.1f}" r="{size / 2:.1f}" fill="{fill}"/>')
        if text:   # the full name (a wide picture has room for it at 45 degrees)
            out.append(f'<text x="{X(x) + 4:.1f}" y="{Y(y) - 4:.1f}" font-size="9" '
                       f'transform="rotate(-45 {X(x) + 4:.1f} {Y(y) - 4:.1f})">{escape(name)}</text>')
    for x, label in layer_ticks(n_layers, frame_px=width - m["l"] - m["r"]):
        if label:
            out.append(f'<text x="{X(x):.1f}" y="{height - m["b"] + 16}" font-size="11" '
                       f'text-anchor="middle">{label}</text>')
    out.append(f'<text x="{width / 2:.0f}" y="{height - 6}" font-size="12" '
               'text-anchor="middle">layer</text></svg>')
    return "\n".join(out)


# -- the page's Bokeh figure ---------------------------------------------------------------

EDGE_COLUMNS = ("x0", "y0", "x1", "y1", "src", "dst", "score", "width", "alpha", "color",
                "effect")
"""The columns of the drawn edges' data source (what is drawn or hovered)."""
PICKED = "#ffb000"   # the halo under edges selected in the workspace
EDGE_HOVER = [("edge", "@src → @dst"), ("score", "@score{+0.0000}"),
              ("patch effect", "@effect")]


def edge_source_data(table: Mapping[str, np.ndarray] | None) -> dict[str, Any]:
    """The edge data source's columns from an `edge_table` (empty without one)."""
    if table is None:
        return {k: [] for k in EDGE_COLUMNS}
    return {k: table[k] for k in EDGE_COLUMNS}


def circuit_source_data(table: Mapping[str, np.ndarray] | None) -> dict[str, Any]:
    """The whole circuit's edges (an `edge_table` of every member, drawn or not): what a hover
    over a node reads to draw that node's circuit edges."""
    keys = ("x0", "y0", "x1", "y1", "src", "dst", "color")
    if table is None:
        return {k: [] for k in keys}
    return {k: table[k] for k in keys}


def node_edges_data(circuit: Mapping[str, Any], name: str, path: str) -> dict[str, list]:
    """The segments a hover or pin over the node ``name`` draws: its circuit edges (rows of
    `circuit_source_data` with ``name`` at an end, in their sign's colour) and its strongest
    paths (rows ``path``, comma separated, in black, wider); ``kind`` says which. The same
    rule as `HOVER_JS`, for the pinned node (drawn by the server)."""
    out: dict[str, list] = {k: [] for k in ("x0", "y0", "x1", "y1", "src", "dst", "color",
                                            "width", "kind")}

    def add(i: int, color: str, width: float, kind: str) -> None:
        for k in ("x0", "y0", "x1", "y1", "src", "dst"):
            out[k].append(circuit[k][i])
        out["color"].append(color), out["width"].append(width), out["kind"].append(kind)

    for i in range(len(circuit["src"])):
        if circuit["src"][i] == name or circuit["dst"][i] == name:
            add(i, circuit["color"][i], NODE_EDGE_WIDTH, "edge")
    for k in (p for p in path.split(",") if p):
        add(int(k), PATH_COLOR, 3.5, "path")
    return out


HOVER_JS = """
const idx = cb_data.index.indices;
const out = {x0: [], y0: [], x1: [], y1: [], src: [], dst: [], color: [], width: [], kind: []};
const c = circuit.data;
const add = (i, color, width, kind) => {
  out.x0.push(c.x0[i]); out.y0.push(c.y0[i]); out.x1.push(c.x1[i]); out.y1.push(c.y1[i]);
  out.src.push(c.src[i]); out.dst.push(c.dst[i]); out.color.push(color);
  out.width.push(width); out.kind.push(kind);
};
if (idx.length) {
  const k = idx[0];
  const name = nodes.data.name[k];
  for (let i = 0; i < c.src.length; i++)
    if (c.src[i] === name || c.dst[i] === name) add(i, c.color[i], EDGE_WIDTH, "edge");
  const path = nodes.data.path[k];
  if (path) for (const p of path.split(",")) add(Number(p), PATH_COLOR, 3.5, "path");
}
hovered.data = out;
"""


def label_source_data(columns: Mapping[str, list]) -> tuple[dict[str, list], dict[str, list]]:
    """The labels drawn at the nodes (`node_columns`): (heads, input and logits: level,
    centred above), (MLPs: straight up); only the non-empty ones."""
    heads: dict[str, list] = {"x": [], "y": [], "text": []}
    mlps: dict[str, list] = {"x": [], "y": [], "text": []}
    for x, y, name, text in zip(columns["x"], columns["y"], columns["name"], columns["text"]):
        if text:
            out = mlps if name.endswith(".MLP") else heads
            out["x"].append(x), out["y"].append(y), out["text"].append(text)
    return heads, mlps


def picked_source_data(pairs: Iterable[tuple[str, str]],
                       pos: Mapping[str, tuple[float, float]],
                       raw: Mapping[str, str]) -> dict[str, list]:
    """Segments of the edges ``pairs`` ((source, target) in the one spelling) that the
    graph has nodes for; ``raw`` maps the one spelling to graph node names."""
    out: dict[str, list] = {"x0": [], "y0": [], "x1": [], "y1": [], "edge": []}
    for s, d in pairs:
        a, b = raw.get(s), raw.get(d)
        if a is None or b is None:
            continue
        out["x0"].append(pos[a][0]), out["y0"].append(pos[a][1])
        out["x1"].append(pos[b][0]), out["y1"].append(pos[b][1])
        out["edge"].append(f"{s}->{d}")
    return out


class GraphFigure:
    """One drawing of the circuit graph as a plain Bokeh figure: its data sources are
    updated in place (a slider move sends new columns and a title, no new models).

    Renderers, in drawing order: ``picked-edges`` (a halo under the workspace's selected
    edges), ``edges`` (Segment: width, opacity, colour per edge; hover), ``nodes`` (Scatter
    with a ``name`` column; hover), ``head-labels`` and ``mlp-labels`` (Text).
    """

    def __init__(self, n_layers: int, n_heads: int, *, height: int,
                 xlim: tuple[float, float], ylim: tuple[float, float],
                 font_sizes: Mapping[str, str], tools: Sequence[str]):
        from bokeh.models import ColumnDataSource, CustomJS, FixedTicker, HoverTool, Range1d
        from bokeh.plotting import figure
        from bokeh.transform import dodge

        fig = figure(height=height, sizing_mode="stretch_width", tools=list(tools),
                     x_range=Range1d(*xlim), y_range=Range1d(*ylim), toolbar_location="right",
                     x_axis_label="layer", min_border_right=10)
        fig.grid.visible = False
        fig.title.text_font_size = font_sizes["title"]
        fig.xaxis.axis_label_text_font_size = font_sizes["labels"]
        fig.xaxis.major_label_text_font_size = font_sizes["xticks"]
        fig.yaxis.major_label_text_font_size = font_sizes["yticks"]
        ticks = layer_ticks(n_layers)
        fig.xaxis.ticker = FixedTicker(ticks=[x for x, _ in ticks], minor_ticks=[])
        fig.xaxis.major_label_overrides = {x: label for x, label in ticks}
        ys = [(n_heads - 1) / 2, n_heads + 0.35]
        fig.yaxis.ticker = FixedTicker(ticks=ys, minor_ticks=[])
        fig.yaxis.major_label_overrides = {ys[0]: "heads", ys[1]: "MLP"}
        self.picked = ColumnDataSource({"x0": [], "y0": [], "x1": [], "y1": [], "edge": []})
        fig.segment("x0", "y0", "x1", "y1", source=self.picked, line_color=PICKED,
                    line_width=9, line_alpha=0.75, line_cap="round", name="picked-edges")
        self.edges = ColumnDataSource(edge_source_data(None))
        seg = fig.segment("x0", "y0", "x1", "y1", source=self.edges, line_color="color",
                          line_width="width", line_alpha="alpha", name="edges")
        node_edges = {k: [] for k in ("x0", "y0", "x1", "y1", "src", "dst", "color", "width",
                                      "kind")}
        self.pinned = ColumnDataSource(dict(node_edges))
        fig.segment("x0", "y0", "x1", "y1", source=self.pinned, line_color="color",
                    line_width="width", line_alpha=0.9, name="pinned-edges")
        self.hovered = ColumnDataSource(dict(node_edges))
        fig.segment("x0", "y0", "x1", "y1", source=self.hovered, line_color="color",
                    line_width="width", line_alpha=0.9, name="hover-edges")
        self.circuit = ColumnDataSource(circuit_source_data(None))
        self.nodes = ColumnDataSource({"x": [], "y": [], "name": [], "size": [], "fill": [],
                                       "line": [], "line_width": [], "path": []})
        pts = fig.scatter("x", "y", source=self.nodes, size="size", fill_color="fill",
                          line_color="line", line_width="line_width", name="nodes")
        self.head_labels = ColumnDataSource({"x": [], "y": [], "text": []})
        self.mlp_labels = ColumnDataSource({"x": [], "y": [], "text": []})
        style = {"text_font_size": "7pt", "text_color": "#202020"}
        fig.text(x="x", y=dodge("y", 0.2, range=fig.y_range), text="text",
                 source=self.head_labels, text_align="center", text_baseline="bottom",
                 name="head-labels", **style)
        fig.text(x="x", y=dodge("y", 0.25, range=fig.y_range), text="text",
                 source=self.mlp_labels, angle=math.pi / 2, text_align="left",
                 text_baseline="middle", name="mlp-labels", **style)
        reveal = CustomJS(args={"circuit": self.circuit, "hovered": self.hovered,
                                "nodes": self.nodes},
                          code=HOVER_JS.replace("EDGE_WIDTH", str(NODE_EDGE_WIDTH))
                                       .replace("PATH_COLOR", repr(PATH_COLOR)))
        fig.add_tools(HoverTool(renderers=[seg], tooltips=EDGE_HOVER),
                      HoverTool(renderers=[pts], tooltips=[("component", "@name")],
                                callback=reveal))
        self._legend(fig)
        fig.toolbar.logo = None
        self.figure = fig

    @staticmethod
    def _legend(fig: Any) -> None:
        """Colour and width key under the plot (renderers of one NaN point stand for the
        encodings: their line samples render, nothing is drawn in the plot)."""
        from bokeh.models import ColumnDataSource, Legend, LegendItem

        # one NaN point: Bokeh draws no legend sample for a renderer without data, and
        # draws nothing in the plot for a NaN point
        empty = {"x": [math.nan], "y": [math.nan]}
        items = []
        for label, color, width in (("red: patching raises the metric", POSITIVE, 3),
                                    ("blue: lowers it", NEGATIVE, 3),
                                    ("weak |score|", "#8c8c8c", 0.6),
                                    ("strong |score|", "#8c8c8c", 6),
                                    ("node's strongest paths (hover / click)", PATH_COLOR, 3.5)):
            r = fig.line("x", "y", source=ColumnDataSource(dict(empty)), line_color=color,
                         line_width=width, name="legend-key")
            items.append(LegendItem(label=label, renderers=[r]))
        legend = Legend(items=items, orientation="horizontal", label_text_font_size="8pt", nrows=2,
                        spacing=12, margin=2, padding=2, name="edge-legend",
                        glyph_width=22, border_line_alpha=0)
        fig.add_layout(legend, "below")

    def show_edges(self, data: Mapping[str, Any], title: str) -> None:
        self.edges.data = dict(data)
        self.figure.title.text = title

    def show_circuit(self, data: Mapping[str, Any], pinned: Mapping[str, list]) -> None:
        self.circuit.data = dict(data)
        self.pinned.data = dict(pinned)

    def show_nodes(self, columns: Mapping[str, list]) -> None:
        self.nodes.data = {k: list(columns[k]) for k in ("x", "y", "name", "size", "fill",
                                                         "line", "line_width", "path")}
        heads, mlps = label_source_data(columns)
        self.head_labels.data, self.mlp_labels.data = heads, mlps

    def show_picked(self, data: Mapping[str, list]) -> None:
        self.picked.data = dict(data)
