"""Attention page: every head's attention pattern on the user's prompt, and one head enlarged.

All layers' and heads' patterns come from one trace of the prompt (`explorer.trace` at the
``attn_pattern`` site, eager attention). The grid is drawn as one image: the layer x head
mosaic of query x key tiles, so 30 layers x 9 heads x 64 tokens is a single glyph of about a
million pixels rather than 270 plots. Clicking a tile (or picking the layer and head, or
typing ``L17.H3``) enlarges that head with its tokens on both axes and a hover; in the gallery
it also selects the head in the session's workspace, whose selected heads (`highlighted`) are
outlined dashed on the grid. Above the enlarged head the prompt's tokens form a strip: a click
selects or deselects that token position (`AttentionView.selected_positions`, in the gallery
the workspace's: ``P5``), and the enlarged head outlines dashed the selected positions' query
rows (what they attend to) and key columns (what attends to them).
"""
from __future__ import annotations

import html
import math
import time
from typing import Any

import holoviews as hv
import numpy as np
import panel as pn
import param
import xarray as xr

import explorer
from apps import theme
from apps._attention_trace import trace_patterns
from apps._controls import index_choice
from apps._heads_heatmap import (click_cell, current_head_box, head_ticks, heads_in, layer_ticks,
                                 selected_outlines)
from apps._page_provenance import ShownRecord, result_heading
from apps._positions import PagePositions, position_caption, position_outlines, shown_positions
from apps._provenance import Provenance, one_line
from apps._recipe import EDITS, MODEL, Call, Expr, Recipe
from apps._session import CancelToken
from apps._view import (STATIC_TOOLS, Scope, View, run_seconds, serve, shown_dataset,
                        workspace_edits, workspace_positions, workspace_selection)
from explorer import components
from explorer._checks import InputError
from explorer.interventions import edit_from_dict

__all__ = ["AttentionView", "MAX_TOKENS", "head_label", "parse_head", "patterns", "mosaic",
           "quantize", "LEVELS", "plot_grid", "plot_marker", "plot_highlight", "plot_head",
           "head_pattern", "grid_cell", "highlighted_heads", "plot_positions", "plot_enlarged",
           "prompt_tokens", "grid_title", "edits_caption", "trace_patterns",
           "attention_heading"]

MAX_TOKENS = 128
"""The longest prompt the page draws (the grid grows with the square of the length)."""

METHOD = "attention patterns"  # the method of the page's records (`Provenance.method`)

GAP = 1  # px of empty (transparent) space after each tile of the mosaic
_MAX_TICKS = 32
_TICK_CHARS = 10

hv.extension("bokeh", logo=False)


# -- pure functions: Datasets in, arrays / HoloViews out --------------------------------

def head_label(layer: int, head: int) -> str:
    """A head's one spelling (`explorer.components`): ``L17.H3``."""
    return str(components.head(layer, head))


def parse_head(text: str, n_layers: int, n_heads: int) -> tuple[int, int]:
    """``'L17.H3'`` (or an older spelling, ``a17.h3``) -> (17, 3); InputError naming the
    problem for anything else."""
    example = head_label(n_layers - 1, n_heads - 1)
    try:
        c = components.parse(text or "")
    except components.ComponentError:
        c = None
    if c is None or not c.is_head:
        raise InputError(f"A head is spelled like {example}; got {text!r}.")
    if c.layer >= n_layers or c.head >= n_heads:
        raise InputError(f"{c} is not in this model: layers 0-{n_layers - 1}, heads 0-"
                         f"{n_heads - 1}.")
    return c.layer, c.head


highlighted_heads = heads_in   # the workspace's selected heads that the model has


def patterns(ds: xr.Dataset, prompt: int = 0) -> xr.DataArray:
    """The prompt's real-token patterns [layer, head, dst_pos, src_pos] from a trace."""
    one = ds.isel(prompt=prompt)
    n = int(one.mask.sum())
    return one.attn_pattern.isel(dst_pos=slice(0, n), src_pos=slice(0, n))


def mosaic(weights: np.ndarray, gap: int = GAP) -> np.ndarray:
    """[layer, head, query, key] weights -> one float32 image, layer 0's row of tiles on top.

    Tile (l, h) holds ``weights[l, h]`` (query down, key right) at rows ``l*(n+gap)`` and
    columns ``h*(n+gap)``; the ``gap`` rows and columns after each tile are NaN (drawn empty).
    """
    n_layers, n_heads, n_q, n_k = weights.shape
    out = np.full((n_layers, n_q + gap, n_heads, n_k + gap), np.nan, dtype=np.float32)
    out[:, :n_q, :, :n_k] = weights.transpose(0, 2, 1, 3)
    return out.reshape(n_layers * (n_q + gap), n_heads * (n_k + gap))


LEVELS = 254
"""Grey levels of the grid image: weights are sent as uint8 0..254 (255 marks the gaps),
a quarter of float32's bytes; the colour map has 256 colours, so nothing visible is lost."""


def quantize(image: np.ndarray) -> np.ndarray:
    """A `mosaic` (weights in [0, 1], NaN gaps) as uint8: round(w * LEVELS), gaps LEVELS + 1."""
    out = np.full(image.shape, LEVELS + 1, dtype=np.uint8)
    real = ~np.isnan(image)
    out[real] = np.rint(np.clip(image[real], 0.0, 1.0) * LEVELS).astype(np.uint8)
    return out


def tile_pixels(n_layers: int, n_heads: int) -> int:
    """Screen pixels of one tile: about 1200 px for all layers, 28-96 px a tile."""
    return int(min(96, max(28, 1200 // max(1, n_layers), 360 // max(1, n_heads))))


def grid_cell(x: Any, y: Any, n_layers: int, n_heads: int) -> tuple[int, int] | None:
    """(layer, head) of a click at data coordinates (x, y) on `plot_grid`; None off the grid."""
    cell = click_cell(x, y)
    if cell is None:
        return None
    head, row = cell
    layer = n_layers - 1 - row
    if 0 <= layer < n_layers and 0 <= head < n_heads:
        return layer, head
    return None


def plot_grid(ds: xr.Dataset | None, n_layers: int | None = None,
              n_heads: int | None = None) -> hv.Element:
    """All heads as small multiples: one uint8 image (`quantize` of `mosaic`), layers down,
    heads across; layer ``l``'s tiles sit at y = n_layers - 1 - l, head ``h``'s at x = h.

    Without a trace (``ds`` None) it is the same image, sized for ``n_layers`` x ``n_heads``,
    all gaps: the plot the trace later fills has its real size from the first frame (a
    DynamicMap keeps the size of the plot it first drew)."""
    if ds is None:
        if n_layers is None or n_heads is None:
            return theme.placeholder("Tracing the prompt…")
        img = np.full((n_layers, n_heads), LEVELS + 1, dtype=np.uint8)
        layers = list(range(n_layers))
    else:
        p = patterns(ds)
        n_layers, n_heads = p.sizes["layer"], p.sizes["head"]
        img = quantize(mosaic(p.values))
        layers = p.layer.values.tolist()
    tile = tile_pixels(n_layers, n_heads)
    return hv.Image(img, kdims=["head", "layer"], vdims=["weight"],
                    bounds=(-0.5, -0.5, n_heads - 0.5, n_layers - 0.5)).opts(
        cmap=theme.PROBABILITY_CMAP, clim=(0, LEVELS), clipping_colors={"max": "white"},
        title=grid_title(ds), xlabel="head", ylabel="layer",
        xticks=head_ticks(n_heads), yticks=layer_ticks(layers, flip=True), xaxis="top",
        frame_width=tile * n_heads, frame_height=tile * n_layers,
        tools=["tap"], default_tools=STATIC_TOOLS, active_tools=[], toolbar="above",
        fontsize=theme.font_sizes(), colorbar=False)


def attention_heading(prov: Provenance) -> str:
    """The line over the patterns: the shown trace's prompt, model and workspace edits
    (``Attention patterns of 'The cat' (tiny-llama), with 1 workspace edit``)."""
    return result_heading("Attention patterns", prov, clean=False)


def grid_title(ds: xr.Dataset | None) -> str:
    """"All heads", or "All heads · n edits" for a trace run with workspace edits. Kept short:
    the plot's toolbar shares the title's row and leaves it 174 px on a 4-head model."""
    n = len(ds.attrs.get("edits", [])) if ds is not None else 0
    return f"All heads · {n} edit{'s' if n != 1 else ''}" if n else "All heads"


def edits_caption(ds: xr.Dataset | None) -> str:
    """Under the grid: the workspace edits the patterns were computed under ('' without)."""
    labels = list(ds.attrs.get("workspace_edits", [])) if ds is not None else []
    if not labels:
        return ""
    return ("Patterns of the edited model: " + "; then ".join(f"`{html.escape(t)}`" for t in labels)
            + ". An edit changes only the patterns computed after it (a head's ablation: "
              "the later layers').")


def plot_marker(ds: xr.Dataset | None, layer: int, head: int) -> hv.Element:
    """The outline of the selected head's tile on `plot_grid`."""
    if ds is None:
        return hv.Rectangles([])
    return current_head_box(layer, head, n_layers=ds.sizes["layer"])


def plot_highlight(n_layers: int, n_heads: int, names: list[str]) -> hv.Element:
    """Dashed outlines of the workspace-selected heads' tiles on `plot_grid`."""
    return selected_outlines(names, n_layers, n_heads, flip=True)


def head_pattern(ds: xr.Dataset, layer: int, head: int) -> xr.DataArray:
    """One head's [dst_pos, src_pos] weights on the prompt's real tokens."""
    return patterns(ds).sel(layer=int(layer), head=int(head))


def _ticks(tokens: list[str]) -> list[tuple[int, str]]:
    n = len(tokens)
    step = max(1, math.ceil(n / _MAX_TICKS))
    out = []
    for i in range(0, n, step):
        t = tokens[i]
        t = t if len(t) <= _TICK_CHARS else t[:_TICK_CHARS - 1] + "…"
        out.append((i, f"{i} {t}"))
    return out


def prompt_tokens(ds: xr.Dataset | None) -> list[str]:
    """The traced prompt's real tokens as shown ([] before a trace)."""
    if ds is None:
        return []
    one = ds.isel(prompt=0)
    return theme.show_tokens(one.token.values[:int(one.mask.sum())])


def plot_positions(ds: xr.Dataset | None, positions: list[int]) -> hv.Element:
    """Dashed outlines on `plot_head` of the selected positions: each one's query row (from
    key 0 to itself: what it attends to) and key column (from itself down: who attends to it)."""
    n = len(prompt_tokens(ds))
    shown = shown_positions(positions, n)
    boxes = ([(-0.5, p - 0.5, p + 0.5, p + 0.5) for p in shown]            # query rows
             + [(p - 0.5, p - 0.5, p + 0.5, n - 0.5) for p in shown])      # key columns
    return position_outlines(boxes)


def plot_enlarged(ds: xr.Dataset | None, layer: int, head: int,
                  positions: list[int]) -> hv.Element:
    """`plot_head` with the selected positions outlined (`plot_positions`)."""
    heat = plot_head(ds, layer, head)
    if ds is None or not shown_positions(positions, len(prompt_tokens(ds))):
        return heat
    return (heat * plot_positions(ds, positions)).opts(
        responsive=True, height=heat.opts.get().kwargs["height"])


def plot_head(ds: xr.Dataset | None, layer: int, head: int) -> hv.Element:
    """One head's query x key pattern, tokens on both axes (thinned past 32), hover per cell.

    Key tokens stand upright: "0 The 1 ·capital" side by side touch even on a short prompt."""
    if ds is None:
        return theme.placeholder("Tracing the prompt…")
    a = head_pattern(ds, layer, head).values
    n = a.shape[0]
    one = ds.isel(prompt=0)
    tokens = theme.show_tokens(one.token.values[:n])
    q, k = np.tril_indices(n)
    # the token columns are not named after a key dimension plus a suffix ("query_token"):
    # HoloViews rewrites "@query" inside "@query_token" and the hover showed "8_token"
    table = {"key": k, "query": q, "weight": a[q, k].astype(float),
             "src_token": np.array(tokens, dtype=object)[k],
             "dst_token": np.array(tokens, dtype=object)[q]}
    ticks = _ticks(tokens)
    size = int(min(760, max(320, 11 * n + 170)))
    hover = [("query", "@query @dst_token"), ("key", "@key @src_token"),
             ("weight", "@weight{0.000}")]
    return hv.HeatMap(table, ["key", "query"], ["weight", "src_token", "dst_token"]).opts(
        cmap=theme.PROBABILITY_CMAP, clim=(0.0, 1.0), colorbar=True, clabel="attention weight",
        title=head_label(layer, head), xlabel="key token", ylabel="query token",
        xticks=ticks, yticks=ticks, xrotation=90, invert_yaxis=True,
        tools=["hover"], hover_tooltips=hover, default_tools=STATIC_TOOLS, active_tools=[],
        toolbar="above", responsive=True, height=size, min_width=320, max_width=size + 80,
        fontsize=theme.font_sizes(), padding=0)


# -- the view ----------------------------------------------------------------------------

class AttentionView(ShownRecord, View):
    """Every head's attention on a prompt (one trace), one head enlarged.

    Parameters
    ----------
    model : explorer.Model
    background : bool, optional
        Trace in a worker thread (default when served) or inline (tests, notebooks).
    **params
        Initial values of the parameters below.
    """

    notify_title = "Attention"
    page_slug = "attention"
    described = ("result",)
    failed_status = "Last run failed: {message}"
    kept_note = "The previous prompt's patterns are still shown."
    wait_timeout = 300

    prompt = param.String(default="The capital of France is", label="Prompt",
                          doc="Prompt whose attention patterns are shown (press Enter to run).")
    layer = index_choice("Layer", doc="Layer of the enlarged head.")
    head = index_choice("Head", doc="Head (within the layer) that is enlarged.")
    selected = param.String(default="L0.H0", label="Enlarged head",
                            doc="The enlarged head, spelled L<layer>.H<head>; type one to pick it.")
    selected_positions = workspace_positions(doc="Selected token positions of the prompt "
                                                 "(0-based; the workspace's in the gallery), "
                                                 "outlined on the head.")
    highlighted = workspace_selection(doc="Components to outline on the grid (the workspace "
                                          "selection; heads are drawn, other components skipped).")
    edits = workspace_edits(doc="Workspace edits (intervention records): the patterns are those "
                                "of the model with them applied.")
    result = shown_dataset(doc="The last good trace (attn_pattern of the prompt).")
    seconds = run_seconds(doc="Seconds from the prompt change to the data ready (last run).")

    def __init__(self, model: explorer.Model, *, background: bool | None = None, **params: Any):
        super().__init__(background=background, **params)
        self._model = model
        n_layers, n_heads = model.spec.n_layers, model.spec.n_heads
        self.param.layer.bounds = (0, n_layers - 1)
        self.param.head.bounds = (0, n_heads - 1)
        self._sync_label()
        self.runner("trace", self._got_trace)
        self._started = 0.0
        self._enlarged_streams: list[Any] = []  # the enlarged plot's watchers on layer, head
        self.param.watch(self._request_trace, ["prompt", "edits"])
        self.param.watch(self._sync_label, ["layer", "head"])
        self.param.watch(self._pick_label, ["selected"])
        self._position_links = PagePositions(self, lambda: prompt_tokens(self.result),
                                             refresh_on="result",
                                             css_class="attention-prompt-tokens",
                                             empty="the prompt has not been traced yet.")
        self._positions = self._position_links.strip
        self.run_once_loaded(self._request_trace)  # the gallery sets the prompt first: one run

    link_params = ("layer", "head")

    def scope(self) -> Scope:
        """Your prompt (the shown patterns', `shown_record`); the workspace's edits are
        applied to the traced model."""
        shown = self.shown_record
        prompt = f" {one_line(shown.prompts[0])}" if shown is not None else ""
        return Scope(on=f"your prompt{prompt} (at most {MAX_TOKENS} tokens)", edits="applied")

    def requested_provenance(self) -> Provenance:
        """What the page would trace now: the workspace's (else its own) prompt and edits."""
        return self.record(METHOD, *self.current_inputs())

    def heading(self, prov: Provenance) -> str:
        return attention_heading(prov)

    # -- selection -----------------------------------------------------------------------
    def _sync_label(self, *events: Any) -> None:
        label = head_label(self.layer, self.head)
        if self.selected != label:
            self.selected = label

    def _pick_label(self, event: Any) -> None:
        try:
            layer, head = parse_head(event.new, self._model.spec.n_layers,
                                     self._model.spec.n_heads)
        except InputError as exc:
            theme.notify("warning", str(exc), duration=4000)
            self.selected = head_label(self.layer, self.head)
            return
        self.param.update(layer=layer, head=head)
        self._sync_label()  # normalised spelling (e.g. 'l3.h1' -> 'L3.H1')

    def select(self, layer: int, head: int) -> None:
        """Enlarge head ``(layer, head)``."""
        self.param.update(layer=self._model.check_layer(layer),
                          head=self._model.check_head(head))

    def toggle_position(self, pos: int) -> None:
        """Select token position ``pos`` of the prompt, or deselect it (a click on it)."""
        self._position_links.toggle(pos)

    def _grid_tapped(self, x: Any = None, y: Any = None, **_: Any) -> None:
        spec = self._model.spec
        cell = grid_cell(x, y, spec.n_layers, spec.n_heads)
        if cell is not None:
            self.select(*cell)

    # -- computation -----------------------------------------------------------------------
    def _request_trace(self, *events: Any) -> None:
        if not self._page_loaded:
            return
        prompt, model, edits = self.prompt, self._model, list(self.edits)
        record = self.record(METHOD, prompt, edits)
        self.running = True
        self._started = time.perf_counter()

        def job(token: CancelToken) -> tuple[Provenance, xr.Dataset]:
            return record, trace_patterns(model, prompt, edits, max_tokens=MAX_TOKENS,
                                          check=token.check,
                                          why="every head's pattern grows with its square")

        self.submit("trace", job)

    def _got_trace(self, out: tuple[Provenance, xr.Dataset]) -> None:
        record, ds = out
        seconds = time.perf_counter() - self._started
        n = int(ds.mask.sum())
        spec = self._model.spec
        n_edits = len(ds.attrs.get("edits", []))
        edited = f" · {n_edits} workspace edit{'s' if n_edits != 1 else ''} applied" if n_edits else ""
        self.param.update(result=ds, seconds=seconds, error="", running=False,
                          shown_record=self.stamped(record),
                          status=f"{spec.name} · {n} tokens · {spec.n_layers} layers × "
                                 f"{spec.n_heads} heads{edited} · traced in {seconds:.2f} s")

    def code_recipe(self) -> Recipe:
        """The trace the page draws (every head's pattern, the enlarged head) as records: the
        shown trace's prompt and edits (its record and attrs), before one the page's."""
        prompt, edits = self.prompt, list(self.edits)
        if self.shown_record is not None and self.result is not None:
            prompt = self.shown_record.prompts[0]
            edits = [edit_from_dict(d) for d in self.result.attrs.get("edits", [])]
        return Recipe(model=self._model.spec.name, edits=edits, steps=[
            Call("ds", "explorer.trace", (MODEL, [prompt]),
                 {"sites": ("attn_pattern",), **({"edits": EDITS} if edits else {})}),
            Expr("n", "int(ds.mask.isel(prompt=0).sum())", "the prompt's tokens"),
            Expr("patterns", "ds.attn_pattern.isel(prompt=0, dst_pos=slice(0, n), "
                 "src_pos=slice(0, n))"),
            Call("enlarged", "patterns.sel", kwargs={"layer": self.layer, "head": self.head},
                 comment=self.selected)])

    def _enlarged(self, ds: xr.Dataset | None, positions: list[int]) -> hv.Element:
        """The enlarged head: a new plot per trace or position change (its height and ticks
        follow the prompt), in which a change of layer or head replaces the data and the
        title in place (a DynamicMap on them: no new figure for the browser to lay out)."""
        for stream in self._enlarged_streams:
            stream.unwatch()  # the plot it drew is gone: its watchers on layer and head too
        if ds is None:
            self._enlarged_streams = []
            return plot_head(None, self.layer, self.head)
        dmap = hv.DynamicMap(pn.bind(plot_enlarged, ds, self.param.layer, self.param.head,
                                     list(positions)))
        self._enlarged_streams = [s for s in dmap.streams if hasattr(s, "unwatch")]
        return dmap

    def close(self) -> None:
        """Stop the runner and drop the patterns (the page is gone)."""
        super().close()
        self.result = None

    # -- layout ----------------------------------------------------------------------------
    def _grid(self) -> pn.pane.HoloViews:
        spec = self._model.spec
        image = hv.DynamicMap(pn.bind(plot_grid, self.param.result, spec.n_layers, spec.n_heads))
        marker = hv.DynamicMap(pn.bind(plot_marker, self.param.result, self.param.layer,
                                       self.param.head))
        highlight = hv.DynamicMap(pn.bind(plot_highlight, spec.n_layers, spec.n_heads,
                                          self.param.highlighted))
        hv.streams.Tap(source=image).add_subscriber(self._grid_tapped)
        return pn.pane.HoloViews(image * highlight * marker, sizing_mode="fixed",
                                 css_classes=["attention-grid"], linked_axes=False)

    def __panel__(self) -> pn.viewable.Viewable:
        spinner = self.busy_spinner()
        status = self.status_text("attention-status")
        alert = pn.pane.Alert(self.param.error, alert_type="danger",
                              visible=self.param.error.rx.bool(), css_classes=["attention-error"],
                              sizing_mode="stretch_width")
        widgets = {
            "prompt": {"type": pn.widgets.TextInput,
                       "placeholder": "Enter a prompt and press Enter"},
            "layer": {"type": pn.widgets.IntSlider, "throttled": True},
            "head": {"type": pn.widgets.IntSlider, "throttled": True},
            "selected": {"type": pn.widgets.TextInput},
        }
        shown = [name for name in widgets if self.param[name].precedence is None
                 or self.param[name].precedence >= 0]
        controls = pn.Param(self, parameters=shown, widgets={k: widgets[k] for k in shown},
                            show_name=False, default_layout=pn.Row,
                            sizing_mode="stretch_width", css_classes=["attention-controls"])
        enlarged = pn.pane.HoloViews(pn.bind(self._enlarged, self.param.result,
                                             self.param.selected_positions),
                                     sizing_mode="stretch_width", css_classes=["attention-head"])
        caption = pn.pane.Markdown(
            pn.bind(lambda ds, sel: position_caption(sel, prompt_tokens(ds)), self.param.result,
                    self.param.selected_positions),
            styles={"color": "#555", "font-size": "0.9em"}, margin=(0, 10),
            css_classes=["attention-positions-caption"])
        return pn.Column(
            pn.Row(spinner, status, align="center"),
            alert,
            self.heading_pane("attention-heading"),
            self.stale_box("attention-stale", ["prompt", "edits", "running", "error"]),
            pn.Row(pn.Column(self._grid(), pn.pane.Markdown(
                       pn.bind(edits_caption, self.param.result), width=360, margin=(0, 10),
                       styles={"color": "#555", "font-size": "0.9em"},
                       css_classes=["attention-edits"])),
                   pn.Column(controls, self._positions, caption, enlarged,
                                           sizing_mode="stretch_width"),
                   sizing_mode="stretch_width"),
            sizing_mode="stretch_width",
        )


serve(__name__, AttentionView, title=f"{theme.TITLE}: attention", intro="attention")
