"""Two prompts page: the workspace prompt (A) and the second prompt (B) side by side.

One result of `explorer.analyses.prompt_compare.compare_prompts`: for the view picked (the
logit lens, the selected head's attention pattern, the saturation layers of the top tokens, or
each head's and MLP's direct logit attribution) prompt A's grid, prompt B's grid on the same
axes, and B − A where the two grids mean the same cells (prompts of the same length in tokens;
a note says why no difference is drawn otherwise). A click on a cell selects its token
position (or, on the attribution grid, its component) in the workspace. Titles, captions and
the stale note are written from the shown result's record (`compare_provenance`), never from
the widgets.
"""
from __future__ import annotations

import dataclasses
import html
import time
from collections.abc import Sequence
from typing import Any

import holoviews as hv
import numpy as np
import pandas as pd
import panel as pn
import param
import xarray as xr

import explorer
from apps import theme
from apps._controls import (check_selected_component, index_choice, selected_component,
                            token_choice)
from apps._heads_heatmap import click_cell, component_cell_box, layer_ticks, on_head_click
from apps._positions import position_outlines, toggled
from apps._page_provenance import auto_recompute_state
from apps._provenance import Provenance, changed_inputs, computed_at_now, one_line
from apps._recipe import EDITS, MODEL, Call, Expr, Recipe, Ref
from apps._session import CancelToken
from apps._view import (STATIC_TOOLS, Scope, View, serve, shown_dataset, workspace_edits,
                        workspace_positions)
from explorer import components
from explorer._checks import InputError
from explorer.analyses.answer_dla import answer_token_id
from explorer.analyses.prompt_compare import COMPARE_VIEWS, VIEW_AXES, compare_prompts
from explorer.workspace import edit_label

__all__ = ["CompareView", "VIEW_LABELS", "PANELS", "MAX_TOKENS", "compare_provenance",
           "compare_request", "compare_title", "compare_caption", "compare_stale_text",
           "plot_compare", "cell_target", "panel_grid"]

hv.extension("bokeh", logo=False)

MAX_TOKENS = 128
"""The longest prompt the page compares (each grid has a column per token)."""

VIEW_LABELS: dict[str, str] = {"Logit lens": "lens", "Attention (selected head)": "attention",
                               "Saturation layers": "saturation", "Logit attribution": "dla"}
"""The view selector's words -> `COMPARE_VIEWS`."""

PANELS = ("A", "B", "difference")
"""The grids the page draws: prompt A, prompt B, and B − A."""

_QUANTITY = {"lens": "top-1 probability", "attention": "weight",
             "saturation": "saturation layer", "dla": "contribution (logits)"}
_NO_SECOND = ("No second prompt: prompt A is shown alone. Type the prompt to compare with in "
              "the sidebar's **Second prompt (compare)** box (for example your prompt with two "
              "names swapped) and press Enter.")


# -- the shown result's record ---------------------------------------------------------------

def compare_request(model: str, state: dict[str, Any]) -> Provenance:
    """The record of what the page computes from its inputs ``state`` (`CompareView.
    request_state`): the two prompts, the view and its settings, the edits."""
    view = str(state["view"])
    request: dict[str, Any] = {"view": view,
                               "edits": tuple(str(e) for e in state.get("edit_labels", ()))}
    if view == "attention":
        request["head"] = (int(state["layer"]), int(state["head"]))
    elif view == "saturation":
        request["k"] = int(state["k"])
    elif view == "dla":
        request["pickers"] = (str(state["answer"]), str(state["alternative"]))
    return Provenance(page="compare", model=model, method=view,
                      prompts=(str(state["prompt"]), str(state["second_prompt"])),
                      edits=tuple(str(e) for e in state.get("edit_labels", ())),
                      request=tuple(sorted(request.items())))


def compare_provenance(ds: xr.Dataset | None) -> Provenance | None:
    """The shown result's record, from its attrs: the inputs it was requested with, the
    answer and alternative it attributed (DLA), when it was computed."""
    if ds is None:
        return None
    record = compare_request(str(ds.attrs["model"]), ds.attrs["request"])
    return dataclasses.replace(record, computed_at=str(ds.attrs.get("computed_at", "")),
                               answer=str(ds.attrs.get("answer", "")),
                               wrong=str(ds.attrs.get("alternative", "")))


def compare_stale_text(shown: Provenance, wanted: Provenance, state: str = "") -> str:
    """'' when the shown result is of the current inputs; else what it was computed on
    (both prompts), what changed since, and ``state``: what the page is doing about it."""
    changed = changed_inputs(shown, wanted)
    if not changed:
        return ""
    words = []
    for name in changed:
        if name == "prompts":
            a, b = (shown.prompts[i] != wanted.prompts[i] for i in range(2))
            words.append("both prompts" if a and b else "prompt A" if a else "prompt B")
        else:
            words.append({"view": "the view", "head": "the head", "k": "the ranks",
                          "pickers": "the answer or alternative", "edits": "the edits",
                          "model": "the model"}.get(name, name))
    return (f"Shown: computed on A = {one_line(shown.prompts[0])} and B = "
            f"{one_line(shown.prompts[1]) if shown.prompts[1] else 'none'} "
            f"({dict(shown.request)['view']}) at "
            f"{shown.computed_at[11:16]} UTC; {', '.join(words)} changed since"
            + (f": {state}" if state else "."))


# -- pure functions: Datasets in, arrays / text / HoloViews out ---------------------------

def panel_grid(ds: xr.Dataset, panel: str) -> np.ndarray | None:
    """[rows, columns] of one panel: prompt "A", "B", or the "difference" (None when the
    result has none)."""
    if panel == "difference":
        return ds["difference"].values if "difference" in ds else None
    return ds["value"].sel(prompt=panel).values if panel in ds.prompt.values else None


def _axis_labels(ds: xr.Dataset, panel: str, dim: str) -> list[tuple[int, str]]:
    """Tick labels of a position axis: the panel's tokens (``3 ·John``); on the difference,
    ``A→B`` where the two prompts' tokens differ."""
    tokens = ds.token.values
    n = ds.sizes["pos"]
    out = []
    for p in range(n):
        a, b = theme.show_token(str(tokens[0, p])), theme.show_token(str(tokens[-1, p]))
        text = {"A": a, "B": b}.get(panel, a if a == b else f"{a}→{b}")
        out.append((p, f"{p} {text}"))
    step = max(1, int(np.ceil(n / 40)))
    return out[::step]


def compare_title(ds: xr.Dataset | None, panel: str) -> str:
    """A panel's title from the result's attrs: which prompt (or B − A) and what is shown."""
    if ds is None:
        return "Two prompts"
    view = ds.attrs["view"]
    what = {"lens": "logit lens, top-1 probability",
            "attention": f"attention of {ds.attrs.get('component', '')}",
            "saturation": f"saturation layer of the top-{ds.attrs.get('k', '')} tokens",
            "dla": (f"logit({theme.show_token(ds.attrs.get('answer', ''))}) − "
                    f"logit({theme.show_token(ds.attrs.get('alternative', ''))})")}[view]
    return {"A": f"A: {what}", "B": f"B: {what}", "difference": f"B − A: {what}"}[panel]


def _cell_size(n_cols: int, n_rows: int, view: str) -> tuple[int, int]:
    if view == "dla":
        return max(12, min(18, 200 // max(1, n_cols))), max(10, min(18, 420 // max(1, n_rows)))
    if view == "attention":
        side = max(8, min(24, 220 // max(1, n_cols)))
        return side, side
    return max(12, min(44, 640 // max(1, n_cols))), max(10, min(22, 360 // max(1, n_rows)))


def plot_compare(ds: xr.Dataset | None, panel: str, positions: Sequence[int] = (),
                 selected: str = "") -> hv.Element:
    """One panel's heatmap: A or B on the view's colour map (one colour limit for both, so
    the same colour is the same value), B − A on the diverging map centred on 0; the
    workspace's selected positions outlined dashed, the clicked component solid."""
    if ds is None:
        return theme.placeholder("Comparing the two prompts…", height=260)
    grid = panel_grid(ds, panel)
    if grid is None and ds.sizes["prompt"] == 1:
        return theme.placeholder("No prompt B: set the second prompt in the sidebar.",
                                 height=120)
    if grid is None:
        n_a, n_b = (int(n) for n in ds.n_tokens.values)
        return theme.placeholder(f"No B − A: A has {n_a} tokens, B {n_b} (see the note "
                                 "below).", height=120)
    view = ds.attrs["view"]
    rows, cols = VIEW_AXES[view]
    n_rows, n_cols = grid.shape
    c, r = np.meshgrid(np.arange(n_cols), np.arange(n_rows))
    table = pd.DataFrame({"x": c.ravel(), "y": r.ravel(), "value": grid.ravel().astype(float)})
    hover = [("value", "@value{0.000}")]
    label = _hover_labels(ds, panel, view)
    if label is not None:
        table["label"] = pd.Series(label.ravel().tolist(), dtype=object)
        hover.insert(0, ({"lens": "top-1 token", "saturation": "token", "dla": "component",
                          "attention": "query → key"}[view], "@label"))
    if view == "lens" and panel != "difference":  # the output's token there, read per layer
        table["answer"] = ds.answer_prob.sel(prompt=panel).values.ravel().astype(float)
        hover.append(("p(output's top-1)", "@answer{0.000}"))
    both = ds["value"].values
    if panel == "difference":
        lim = float(np.nanmax(np.abs(grid))) if np.isfinite(grid).any() else 1.0
        clim, cmap, clabel = (-(lim or 1.0), lim or 1.0), theme.SIGNED_CMAP, "B − A"
    elif view == "dla":  # the 99th percentile: one large writer (the last MLP) would wash
        # out every head; cells beyond it saturate, the tooltip gives their value
        lim = float(np.nanpercentile(np.abs(both), 99)) or 1.0
        clim, cmap, clabel = (-lim, lim), theme.SIGNED_CMAP, "logits"
    elif view == "saturation":
        clim, cmap, clabel = (0, ds.attrs["model_spec"]["n_layers"] - 1), theme.MAGNITUDE_CMAP, \
            "layer (blank: never)"
    else:
        clim, cmap, clabel = (0.0, max(1e-6, float(np.nanmax(both)))), theme.PROBABILITY_CMAP, \
            _QUANTITY[view]
    cell_w, cell_h = _cell_size(n_cols, n_rows, view)
    ticks = {"layer": layer_ticks(range(n_rows)),
             "rank": [(i, f"{i + 1}") for i in range(n_rows)],
             "dst_pos": _axis_labels(ds, panel, "dst_pos")}
    xticks = ([(i, str(name)) for i, name in enumerate(ds.column.values)] if view == "dla"
              else _axis_labels(ds, panel, cols))
    heat = hv.HeatMap(table, ["x", "y"],
                      [v for v in ("value", "label", "answer") if v in table]).opts(
        cmap=cmap, clim=clim, colorbar=True, clabel=clabel, title=compare_title(ds, panel),
        xlabel={"pos": "position", "src_pos": "key position", "column": ""}[cols],
        ylabel={"layer": "layer", "dst_pos": "query position", "rank": "rank"}[rows],
        xticks=xticks, yticks=ticks[rows], xrotation=90 if view != "dla" or n_cols > 6 else 0,
        invert_yaxis=view in ("attention", "saturation", "dla"),
        tools=["hover", "tap"], hover_tooltips=hover, default_tools=STATIC_TOOLS,
        active_tools=[], toolbar="below", clipping_colors={"NaN": "#f2f2f2"},
        frame_width=max(160, cell_w * n_cols), frame_height=max(150, cell_h * n_rows),
        fontsize=theme.font_sizes(), padding=0)
    if view == "dla":  # the colour bar under the grid and the title on two lines: A, B and
        # B − A fit one row at 1280 px
        heat = heat.opts(colorbar_position="bottom", frame_width=max(200, cell_w * n_cols),
                         title=compare_title(ds, panel).replace(") − logit(", ")\n− logit(", 1))
    out = heat
    if view == "lens" and panel != "difference" and cell_w >= 30 and cell_h >= 12:
        out = out * _token_labels(table, cmap, clim)
    if view == "dla":
        box = component_cell_box(selected, n_rows, n_cols - 1)
        if box is not None:
            out = out * hv.Rectangles([box]).opts(fill_alpha=0.0, line_color=theme.ACCENT,
                                                  line_width=2.5, default_tools=STATIC_TOOLS)
    else:
        boxes = [_position_box(p, view, n_rows) for p in positions if 0 <= p < n_cols]
        out = out * position_outlines(boxes)
    return out


def _hover_labels(ds: xr.Dataset, panel: str, view: str) -> np.ndarray | None:
    """The text of each cell's tooltip ([rows, columns] of str), or None."""
    if view == "lens":
        a, b = (ds.top_token.isel(prompt=i).values for i in (0, -1))
        show = np.vectorize(theme.show_token, otypes=[object])
        if panel == "difference":
            return np.where(a == b, show(a), show(a) + " → " + show(b))
        return show(a if panel == "A" else b)
    if view == "saturation":
        which = "A" if panel != "B" else "B"
        return np.vectorize(theme.show_token, otypes=[object])(
            ds.final_token.sel(prompt=which).values)
    if view == "dla":
        return ds.component.values.astype(object)
    n = ds.sizes["pos"]
    q, k = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    return np.char.add(np.char.add(q.astype(str), " → "), k.astype(str)).astype(object)


def _token_labels(table: pd.DataFrame, cmap: Sequence[str], clim: tuple) -> hv.Labels:
    """The lens cells' top-1 tokens, black or white against the cell's colour."""
    shown = table[table.value.notna()].copy()
    shown["color"] = theme.text_colors(shown.value.tolist(), cmap, *clim)
    shown["text"] = [str(t)[:6] for t in shown.label]
    return hv.Labels(shown, ["x", "y"], ["text", "color"]).opts(
        text_color="color", text_font_size="7pt", default_tools=STATIC_TOOLS)


def _position_box(pos: int, view: str, n_rows: int) -> tuple:
    """(x0, y0, x1, y1) of a selected position: its column (on attention: its query row)."""
    if view == "attention":
        return (-0.5, pos - 0.5, n_rows - 0.5, pos + 0.5)
    return (pos - 0.5, -0.5, pos + 0.5, n_rows - 0.5)


def cell_target(view: str, x: Any, y: Any, n_rows: int, n_cols: int) -> str | int | None:
    """What a click at (x, y) picks: a token position (lens and saturation: the column;
    attention: the query row), or on the attribution grid a component (``L3.H1``,
    ``L3.MLP``); None off the grid."""
    cell = click_cell(x, y)
    if cell is None:
        return None
    col, row = cell
    if not (0 <= col < n_cols and 0 <= row < n_rows):
        return None
    if view == "dla":
        n_heads = n_cols - 1
        return str(components.mlp(row) if col == n_heads else components.head(row, col))
    return row if view == "attention" else col


def _how_to_read(ds: xr.Dataset) -> str:
    """One line on how to read the view's cells."""
    view = ds.attrs["view"]
    if view == "lens":
        return ("Each cell: the top-1 token of the lens at that layer and position, coloured by "
                "its probability; the tooltip names it and gives the probability, at that layer, "
                "of the token the model finally predicts there.")
    if view == "attention":
        return (f"Each row: where {ds.attrs['component']}'s query at that position attends; "
                "select another head in the sidebar, or set Layer and Head.")
    if view == "saturation":
        return ("Each cell: the layer from which the model's final rank-r token stays at rank "
                "r (blank: only at the output).")
    a, b = (html.escape(theme.show_token(ds.attrs[n])) for n in ("answer", "alternative"))
    diffs = ", ".join(f"{float(d):+.3f} on {p}" for p, d in zip(ds.prompt.values,
                                                                ds.logit_diff.values))
    return (f"Each cell: the component's direct contribution to logit({a}) − logit({b}) at "
            f"each prompt's last position ({ds.attrs['picked']}); logit difference {diffs}.")


def compare_caption(ds: xr.Dataset | None) -> str:
    """Under the grids, from the result: the two prompts, their lengths, how to read the
    view, and the difference's note or its largest cell."""
    if ds is None:
        return ""
    view = ds.attrs["view"]
    lines = [" · ".join(f"{p}: {html.escape(one_line(text), quote=False)} ({int(n)} tokens)"
                        for p, text, n in zip(ds.prompt.values, ds.attrs["prompts"],
                                              ds.n_tokens.values))
             + f" · {ds.attrs['model']}."]
    lines.append(_how_to_read(ds))
    if "difference" in ds:
        d = ds.difference.values
        if np.isfinite(d).any() and np.nanmax(np.abs(d)) > 0:
            i = np.unravel_index(np.nanargmax(np.abs(d)), d.shape)
            where = (str(ds.component.values[i]) if view == "dla"
                     else f"{VIEW_AXES[view][0]} {i[0] + (view == 'saturation')}, "
                          f"{VIEW_AXES[view][1].replace('_', ' ')} {i[1]}")
            lines.append(f"Largest change B − A: {float(d[i]):+.3f} at {where}.")
        else:
            lines.append("B − A is 0 everywhere: the two prompts give the same grid.")
    else:
        lines.append(html.escape(ds.attrs["difference_note"], quote=False))
    edits = ds.attrs.get("workspace_edits") or []
    if edits:
        lines.append(f"Both prompts under the workspace's edits "
                     f"({'; '.join(html.escape(t) for t in edits)}).")
    return "  \n".join(lines)


# -- the view ----------------------------------------------------------------------------

class CompareView(View):
    """The workspace prompt (A) and the second prompt (B), one view of each, and B − A.

    Built from the model; ``background`` and the initial Parameters (below) as for `View`.
    """

    notify_title = "Two prompts"
    failed_status = "Last run failed: {message}"
    kept_note = "The previous comparison is still shown."
    wait_timeout = 300

    prompt = param.String(default="The capital of France is", label="Prompt A",
                          doc="The first prompt (the workspace prompt).")
    second_prompt = param.String(default="", label="Prompt B",
                                 doc="The prompt compared with A (the workspace's second "
                                     "prompt); empty: nothing to compare.")
    view = param.Selector(default="lens", objects=VIEW_LABELS, label="View",
                          doc="What is set side by side: the logit lens, the selected head's "
                              "attention, the saturation layers or the logit attribution.")
    layer = index_choice("Layer", doc="Layer of the head whose attention is shown.")
    head = index_choice("Head",
                        doc="Head whose attention is shown (the workspace's newest selected "
                            "head sets it).")
    k = param.Integer(default=5, bounds=(1, 10), label="Ranks",
                      doc="Saturation view: the final top-k tokens whose saturation layer is "
                          "shown.")
    answer = token_choice("Answer", doc="Attribution view: the answer token, the same for "
                                        "both prompts; empty for prompt A's top token; a "
                                        "token or #id.")
    alternative = token_choice("Alternative", doc="Attribution view: the token the answer is "
                                                  "compared with; empty for prompt A's second "
                                                  "token; a token or #id.")
    selected = selected_component(doc="The component last clicked on the attribution grid "
                                      "(or the workspace's newest head)")
    selected_positions = workspace_positions(doc="Selected token positions of prompt A, "
                                                 "outlined on every grid; a click on a cell "
                                                 "selects or deselects its position.")
    edits = workspace_edits(doc="Workspace edits, applied to both prompts' runs.")
    result = shown_dataset(doc="The comparison shown.")
    note = param.String(default="", precedence=-1,
                        doc="Why nothing new is computed (no second prompt), '' otherwise.")

    link_params = ("view", "layer", "head", "k", "answer", "alternative")
    _inputs = ("prompt", "second_prompt", "view", "layer", "head", "k", "answer", "alternative")

    def __init__(self, model: explorer.Model, *, background: bool | None = None, **params: Any):
        layer, head = params.pop("layer", 0), params.pop("head", 0)
        super().__init__(background=background, **params)
        self._model = model
        self._started = 0.0
        # the inputs of the last request asked, and of the last one answered (a result or a
        # refusal landed; a request superseded or stopped is not)
        self._asked: tuple[Provenance, list[dict]] | None = None
        self._answered: tuple[Provenance, list[dict]] | None = None
        self.bound_layer("layer", layer, model.spec.n_layers)
        self.param.head.bounds = (0, model.spec.n_heads - 1)
        self.head = head
        self.runner("compare", self._got_result)
        self.param.watch(self._request, [*self._inputs, "edits"])
        self.param.watch(self._check_selected, ["selected"])
        self.run_once_loaded(self._request)

    def scope(self) -> Scope:
        """Both prompts, each run alone; the edits apply to both."""
        return Scope(on=f"your prompt (A) and the second prompt (B), each run alone (at most "
                        f"{MAX_TOKENS} tokens)", edits="applied to both prompts")

    # -- the shown result's record ---------------------------------------------------------
    def request_state(self) -> dict[str, Any]:
        """The inputs a result is computed from (its record and stale note compare them)."""
        return {name: getattr(self, name) for name in self._inputs} | {
            "edit_labels": [edit_label(e) for e in self.edits]}

    def shown_provenance(self) -> Provenance | None:
        return compare_provenance(self.result)

    def requested_provenance(self) -> Provenance:
        return compare_request(self._model.spec.name, self.request_state())

    def stale_note(self) -> str:
        """'' while the shown result is of the current inputs; else what it was computed on,
        what changed since and what the page is doing about it: recomputing, its recompute
        failed or was refused (the message says why), or, out of view in the gallery (or not
        loaded yet), it recomputes when opened (`auto_recompute_state`)."""
        shown = self.shown_provenance()
        if shown is None:
            return ""
        state = auto_recompute_state(running=self.running, failed=bool(self.error))
        return compare_stale_text(shown, self.requested_provenance(), state)

    def stale_markdown(self, *_: Any) -> str:
        text = self.stale_note()
        return f"**Outdated.** {html.escape(text, quote=False)}" if text else ""

    # -- computation -----------------------------------------------------------------------
    def _request(self, *events: Any) -> None:
        if not self._page_loaded:
            return
        state = self.request_state()
        model, edits = self._model, list(self.edits)
        # an input the view does not read (the head outside the attention view, the ranks
        # outside saturation, ...) asks for the result (or refusal) that landed last again:
        # nothing to compute, nor a message to repeat
        self._asked = (self.requested_provenance(), [e.to_dict() for e in edits])
        if self._asked == self._answered:
            return
        try:  # a picker that is not one token is said now, and the shown result stays
            for name in ("answer", "alternative"):
                token = _token(state[name])
                if state["view"] == "dla" and token is not None:
                    answer_token_id(model, token, name=name)
        except InputError as exc:
            self.show_error(exc)
            return
        self.param.update(note="" if self.second_prompt.strip() else _NO_SECOND, running=True)
        self._started = time.perf_counter()

        def job(token: CancelToken) -> xr.Dataset:
            for which, text in (("A", state["prompt"]), ("B", state["second_prompt"] or "")):
                n = len(model.tokenizer(text, add_special_tokens=False)["input_ids"])
                if n > MAX_TOKENS:
                    raise InputError(f"Prompt {which} is {n} tokens; this page compares at "
                                     f"most {MAX_TOKENS}. Shorten it.")
            token.check()
            ds = compare_prompts(model, state["prompt"], state["second_prompt"],
                                 view=state["view"], layer=state["layer"], head=state["head"],
                                 k=state["k"], answer=_token(state["answer"]),
                                 alternative=_token(state["alternative"]), edits=edits)
            ds.attrs.update(request=state, workspace_edits=state["edit_labels"],
                            computed_at=computed_at_now())
            return ds

        self.submit("compare", job)

    def show_error(self, exc: BaseException) -> None:
        """`View.show_error`, the request refused being the last one answered."""
        self._answered = self._asked
        super().show_error(exc)

    def _got_result(self, ds: xr.Dataset) -> None:
        self._answered = self._asked
        seconds = time.perf_counter() - self._started
        lengths = ", ".join(f"{p} {int(n)} tokens" for p, n in zip(ds.prompt.values,
                                                                   ds.n_tokens.values))
        self.param.update(result=ds, error="", running=False,
                          status=f"{self._model.spec.name} · {lengths} · computed in "
                                 f"{seconds:.2f} s")

    # -- selection -------------------------------------------------------------------------
    def _check_selected(self, event: Any) -> None:
        check_selected_component(self, self._model.spec, event)
        try:
            c = components.parse(self.selected) if self.selected else None
        except components.ComponentError:
            return
        if c is not None and c.is_head and (self.layer, self.head) != (c.layer, c.head):
            self.param.update(layer=c.layer, head=c.head)

    def click(self, x: Any, y: Any) -> None:
        """A click on a cell of the shown grids: select its position (its component on the
        attribution grid), as in the other pages."""
        ds = self.result
        if ds is None:
            return
        rows, cols = ds["value"].shape[1:]
        target = cell_target(ds.attrs["view"], x, y, rows, cols)
        if isinstance(target, str):
            self.selected = target
        elif target is not None and target < int(ds.n_tokens.sel(prompt="A")):
            self.selected_positions = toggled(self.selected_positions, target)

    def _panel(self, ds: xr.Dataset | None, panel: str, positions: Sequence[int],
               selected: str) -> hv.Element:
        plot = plot_compare(ds, panel, positions, selected)
        return plot if ds is None else on_head_click(plot, self.click)

    # -- reproducibility -------------------------------------------------------------------
    def code_recipe(self) -> Recipe:
        """The comparison the page shows, as one library call on its two prompts."""
        ds = self.result
        state = ds.attrs["request"] if ds is not None else self.request_state()
        kwargs: dict[str, Any] = {"view": state["view"]}
        if state["view"] == "attention":
            kwargs.update(layer=int(state["layer"]), head=int(state["head"]))
        elif state["view"] == "saturation":
            kwargs["k"] = int(state["k"])
        elif state["view"] == "dla" and ds is not None:
            kwargs.update(answer=int(ds.attrs["answer_id"]),
                          alternative=int(ds.attrs["alternative_id"]))
        if self.edits:
            kwargs["edits"] = EDITS
        return Recipe(model=self._model.spec.name, edits=list(self.edits),
                      inputs={"prompt_a": state["prompt"], "prompt_b": state["second_prompt"]},
                      steps=[Call("ds", "explorer.analyses.prompt_compare.compare_prompts",
                                  (MODEL, Ref("prompt_a"), Ref("prompt_b")), kwargs),
                             Expr("a", "ds.value.sel(prompt='A')", "prompt A's grid"),
                             Expr("b", "ds.value.sel(prompt='B')", "prompt B's grid, aligned"),
                             Expr("difference", "ds.get('difference')",
                                  "B - A; None when the grids differ in length "
                                  "(ds.attrs['difference_note'] says why)")])

    # -- layout ----------------------------------------------------------------------------
    def __panel__(self) -> pn.viewable.Viewable:
        view = pn.widgets.RadioButtonGroup.from_param(
            self.param.view, color="primary", variant="outline",
            css_classes=["compare-view"], description=None)  # a tooltip would cover the page
        is_ = {v: self.param.view.rx.pipe(lambda cur, v=v: cur == v) for v in COMPARE_VIEWS}
        options = pn.Row(
            pn.widgets.IntInput.from_param(self.param.layer, width=90, visible=is_["attention"]),
            pn.widgets.IntInput.from_param(self.param.head, width=90, visible=is_["attention"]),
            pn.widgets.IntInput.from_param(self.param.k, width=90, visible=is_["saturation"]),
            pn.widgets.TextInput.from_param(self.param.answer, placeholder="A's top-1 token",
                                            width=170, visible=is_["dla"],
                                            description=self.param.answer.doc),
            pn.widgets.TextInput.from_param(self.param.alternative, width=170,
                                            placeholder="A's top-2 token", visible=is_["dla"],
                                            description=self.param.alternative.doc),
            css_classes=["compare-options"])
        alert = pn.pane.Alert(self.param.error, alert_type="danger",
                              visible=self.param.error.rx.bool(), css_classes=["compare-error"],
                              sizing_mode="stretch_width")
        note = pn.pane.Alert(self.param.note, alert_type="info",
                             visible=self.param.note.rx.bool(), css_classes=["compare-note"],
                             sizing_mode="stretch_width")
        stale = pn.pane.Markdown(
            pn.bind(self.stale_markdown, self.param.result, *[self.param[n] for n in
                                                              (*self._inputs, "edits")]),
            css_classes=["compare-stale"], styles={"color": "#a33"}, margin=(0, 10))
        panes = [pn.pane.HoloViews(  # B and B − A hidden while the result has none (the
            # note above and the caption say why)
            pn.bind(self._panel, self.param.result, panel, self.param.selected_positions,
                    self.param.selected),
            css_classes=[f"compare-{panel}"], linked_axes=False, margin=(0, 6),
            visible=self.param.result.rx.pipe(
                lambda ds, p=panel: ds is None or panel_grid(ds, p) is not None))
            for panel in PANELS]
        caption = pn.pane.Markdown(pn.bind(compare_caption, self.param.result),
                                   css_classes=["compare-caption"], sizing_mode="stretch_width",
                                   styles={"color": "#444", "font-size": "0.9em"})
        return pn.Column(
            pn.Row(self.busy_spinner(), self.status_text("compare-status"), align="center"),
            alert, note, view, options, stale, pn.FlexBox(*panes, sizing_mode="stretch_width"),
            caption, sizing_mode="stretch_width")


def _token(text: str) -> int | str | None:
    """A picker's text: '' -> None (prompt A's top tokens), ``#123`` -> id 123, else the text."""
    if not text:
        return None
    if text.startswith("#") and text[1:].isdigit():
        return int(text[1:])
    return text


serve(__name__, CompareView, title=f"{theme.TITLE}: two prompts", intro="compare")
