"""Activation patching page: which activations carry the difference between your prompt and a
counterfactual.

The clean prompt is the workspace's; the corrupted one is the clean prompt with the token at
one clicked position replaced (a counterfactual: click a token of the strip, type its
replacement) or a prompt typed in full, of the same token length. One result of
`explorer.patching.activation_patching` is drawn as a layer x position heatmap (layer x head
for the per-head grid) on the diverging colour map centred on 0: the normalised logit
difference (patched - corrupted) / (clean - corrupted) of the answer against the alternative,
or the answer's probability. A click on a cell selects its component (``L3.MLP``, ``L3.H1``,
the residual stream ``L2`` / ``input``) and its position in the workspace. Titles, captions,
the scope line and the stale note are written from the shown result's record
(`patching_provenance`, read from its attrs), never from the widgets.
"""
from __future__ import annotations

import dataclasses
import html
import json
import time
from collections.abc import Sequence
from typing import Any

import holoviews as hv
import numpy as np
import panel as pn
import param
import xarray as xr

import explorer
from apps import theme
from apps._attention_trace import check_prompt_tokens
from apps._controls import selected_component, token_choice
from apps._heads_heatmap import layer_ticks, on_head_click
from apps._page_provenance import CheckedRecompute, outdated_markdown
from apps._positions import PositionStrip, column_boxes, position_outlines
from apps._provenance import (Counterfactual, Provenance, computed_at_now, one_line,
                              stale_text)
from apps._recipe import EDITS, MODEL, Call, Expr, Recipe
from apps._session import CancelToken
from apps._view import (STATIC_TOOLS, Scope, View, run_seconds, serve, shown_dataset,
                        workspace_edits, workspace_positions, workspace_selection)
from explorer import components
from explorer._checks import InputError
from explorer.interventions import edit_from_dict
from explorer.patching import activation_patching
from explorer.workspace import edit_label

__all__ = ["PatchingView", "counterfactual_ids", "cell_component", "plot_patching",
           "patching_title", "patching_caption", "patching_provenance", "patching_request",
           "stale_note", "parse_token", "PAGE_KINDS",
           "MAX_TOKENS"]

hv.extension("bokeh", logo=False)

PAGE_KINDS = ("resid_pre", "attn_out", "mlp_out", "heads")
MAX_TOKENS = 64
"""The longest prompt the page patches (the grid runs layers x positions copies)."""

_KIND_WORDS = {"resid_pre": "residual stream (resid_pre)", "attn_out": "attention output",
               "mlp_out": "MLP output", "heads": "each head's output, all positions"}


# -- pure functions: Datasets in, arrays / text / HoloViews out ---------------------------

def parse_token(text: str) -> int | str | None:
    """A picker's text as `activation_patching` takes it: '' -> None (the default), ``#123``
    -> token id 123, anything else the token's text as typed."""
    if not text:
        return None
    if text.startswith("#") and text[1:].isdigit():
        return int(text[1:])
    return text


def counterfactual_ids(model: explorer.Model, prompt: str, position: int,
                       replacement: str) -> list[int]:
    """The prompt's token ids with the token at ``position`` replaced by ``replacement`` (the
    text of one token, or ``#id``); InputError naming what is wrong otherwise."""
    ids = model.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if not 0 <= position < len(ids):
        raise InputError(f"the counterfactual position must be in [0, {len(ids) - 1}]; got "
                         f"{position}.")
    token = parse_token(replacement)
    if token is None:
        raise InputError("type the token that replaces the clicked one (e.g. ' Mary').")
    if isinstance(token, str):
        new = model.tokenizer(token, add_special_tokens=False)["input_ids"]
        if len(new) != 1:
            raise InputError(f"the replacement must be one token; {token!r} is {len(new)} "
                             f"tokens ({'|'.join(model.token_strings(new))}).")
        token = new[0]
    if not 0 <= token < model.vocab_size:
        raise InputError(f"token id {token} is outside [0, {model.vocab_size}).")
    return [*ids[:position], int(token), *ids[position + 1:]]


def cell_component(kind: str, layer: int, column: int) -> str | None:
    """The workspace component of a cell: the residual stream before layer l (``input`` at
    layer 0, else ``L{l-1}``), ``L{l}.MLP``, head ``L{l}.H{h}``; None for the attention
    output (no component names a layer's whole attention)."""
    if kind == "resid_pre":
        return str(components.INPUT if layer == 0 else components.layer(layer - 1))
    if kind == "mlp_out":
        return str(components.mlp(layer))
    if kind == "heads":
        return str(components.head(layer, column))
    return None


def _columns(ds: xr.Dataset) -> tuple[str, list[int], list[str]]:
    """The heatmap's column dim, its values and tick labels (``P3 ␣John`` or ``H2``)."""
    if "pos" in ds.effect.dims:
        pos = ds.pos.values.tolist()
        return "pos", pos, [f"{p} {theme.show_token(t)}" for p, t in
                            zip(pos, ds.token.values.tolist())]
    heads = ds["head"].values.tolist()
    return "head", heads, [f"H{h}" for h in heads]


def patching_request(model: str, state: dict[str, Any],
                     edit_labels: Sequence[str] = ()) -> Provenance:
    """The record of what the page computes from its inputs ``state`` (`PatchingView.
    request_state`: the prompt, the counterfactual, the grid, metric, direction, pickers and
    edits as dicts)."""
    edits = tuple(json.dumps(e, sort_keys=True) for e in state.get("edits", []))
    request = {"replacement": (int(state["cf_position"]), str(state["cf_token"])),
               "corrupt": str(state["corrupt"]), "grid": str(state["kind"]),
               "metric": str(state["metric"]), "direction": str(state["direction"]),
               "pickers": (str(state["answer"]), str(state["alternative"])), "edits": edits}
    return Provenance(page="patching", model=model, prompts=(str(state["prompt"]),),
                      edits=tuple(edit_labels), request=tuple(sorted(request.items())))


def patching_provenance(ds: xr.Dataset | None) -> Provenance | None:
    """The record of a grid, from its attrs: the inputs it was requested with, completed by
    what the run found (the corrupted prompt's tokens, the counterfactual by position, the
    answer and alternative), when computed."""
    if ds is None:
        return None
    p = ds.attrs["params"]
    wanted = patching_request(str(ds.attrs["model"]), ds.attrs["request"],
                              ds.attrs.get("workspace_edits") or ())
    changed = [int(q) for q in p["changed_positions"]]
    cf = (Counterfactual(changed[0], p["clean_tokens"][changed[0]],
                         p["corrupt_tokens"][changed[0]]) if len(changed) == 1 else None)
    return dataclasses.replace(wanted, corrupt=("".join(p["corrupt_tokens"]),),
                               counterfactual=cf, positions=tuple(changed),
                               answer=str(p["answer"]), wrong=str(p["alternative"]),
                               computed_at=str(ds.attrs.get("computed_at", "")))


def patching_title(ds: xr.Dataset | None) -> str:
    """The heatmap's title from the result's record: what was patched, which way."""
    shown = patching_provenance(ds)
    if shown is None:
        return "Activation patching"
    r = dict(shown.request)
    return f"{_KIND_WORDS[r['grid']]}, {r['direction']}"


def _metric_label(ds: xr.Dataset) -> str:
    """The colour bar's label: the metric with the answer and alternative."""
    p = ds.attrs["params"]
    a, b = theme.show_token(p["answer"]), theme.show_token(p["alternative"])
    return (f"normalised logit({a}) − logit({b})" if p["metric"] == "logit_diff"
            else f"p({a})")


def _changes(ds: xr.Dataset) -> str:
    """``position 10: ' John' -> ' Mary'`` for each changed position of the result (the
    tokens HTML-escaped, for a Markdown pane)."""
    p = ds.attrs["params"]

    def tok(t: str) -> str:
        return html.escape(repr(t), quote=False)
    return "; ".join(f"position {q}: {tok(p['clean_tokens'][q])} -> {tok(p['corrupt_tokens'][q])}"
                     for q in p["changed_positions"])


def patching_caption(ds: xr.Dataset | None) -> str:
    """Under the heatmap, from the result's attrs: the counterfactual, the answer and the
    unpatched runs' values, and how to read the colours."""
    shown = patching_provenance(ds)
    if shown is None:
        return ""
    p = ds.attrs["params"]
    a, b = theme.show_token(shown.answer), theme.show_token(shown.wrong)
    direction = dict(shown.request)["direction"]
    into = "the corrupted run" if direction == "denoising" else "the clean run"
    source = "clean" if direction == "denoising" else "corrupted"
    lines = [
        f"On {html.escape(one_line(shown.prompts[0]), quote=False)} ({shown.model}).",
        f"Counterfactual: {_changes(ds)}.",
        f"Answer `{html.escape(a)}` (#{p['answer_id']}) against `{html.escape(b)}` "
        f"(#{p['alternative_id']}): logit difference {p['clean_logit_diff']:+.3f} clean, "
        f"{p['corrupt_logit_diff']:+.3f} corrupted; p(answer) {p['clean_prob']:.3f} clean, "
        f"{p['corrupt_prob']:.3f} corrupted.",
        f"Each cell: the {source} run's activation written into {into} at that cell only. "
        + ("1 = the clean run's logit difference, 0 = the corrupted run's."
           if dict(shown.request)["metric"] == "logit_diff"
           else "The patched run's probability of the answer.")]
    if shown.edits:
        lines.append(f"Under the workspace's edits "
                     f"({'; '.join(html.escape(t) for t in shown.edits)}), applied to every run.")
    return "  \n".join(lines)


def stale_note(ds: xr.Dataset | None, request: dict[str, Any], *, state: str = "") -> str:
    """'' when the shown result is of the inputs ``request`` (`PatchingView.request_state`);
    else, as Markdown, what it was computed on, what changed since and ``state``: what the
    page is doing about it (`recompute_state`; default: press Enter)."""
    shown = patching_provenance(ds)
    if shown is None:
        return ""
    return outdated_words(stale_text(shown, patching_request(shown.model, request),
                                     action=PatchingView.compute_action, state=state), shown)


def outdated_words(text: str, shown: Provenance) -> str:
    """A stale text as the page shows it (`outdated_markdown`), with the grid it was computed
    on."""
    r = dict(shown.request)
    return outdated_markdown(text, f" (It was computed on the {r['grid']} grid, {r['direction']}, "
                                   f"with {len(shown.edits)} edits.)")


def plot_patching(ds: xr.Dataset | None, selected: str = "",
                  positions: Sequence[int] = ()) -> hv.Element:
    """The grid as a heatmap (layer 0 on top; positions or heads across), diverging map
    centred on 0 (the probability on a sequential one), the clicked cell outlined solid and
    the workspace's selected positions dashed."""
    if ds is None:
        return theme.placeholder("Click a token of the prompt and type its replacement to "
                                 "patch the two runs.", height=300)
    p = ds.attrs["params"]
    col_dim, cols, labels = _columns(ds)
    values = ds.effect.transpose("layer", col_dim).values
    layers = ds.layer.values.tolist()
    xs, ys = np.meshgrid(np.arange(len(cols)), layers)
    table = {"column": xs.ravel(), "layer": ys.ravel(), "value": values.ravel(),
             "label": np.array([labels[i] for i in xs.ravel()], dtype=object)}
    finite = np.abs(values[np.isfinite(values)])
    if p["metric"] == "logit_diff":
        lim = float(max(1.0, finite.max() if finite.size else 1.0))
        style = dict(cmap=theme.SIGNED_CMAP, clim=(-lim, lim))
    else:
        style = dict(cmap=theme.PROBABILITY_CMAP, clim=(0.0, float(max(finite.max(), 1e-6))))
    n = len(cols)
    heat = hv.HeatMap(table, ["column", "layer"], ["value", "label"]).opts(
        **style, colorbar=True, clabel=_metric_label(ds),
        title=patching_title(ds), xlabel="position" if col_dim == "pos" else "head",
        ylabel="layer", xticks=list(enumerate(labels)), yticks=layer_ticks(layers),
        invert_yaxis=True, xrotation=60 if col_dim == "pos" else 0,
        tools=["hover", "tap"], hover_tooltips=[("layer", "@layer"), (col_dim, "@label"),
                                                ("effect", "@value{0.000}")],
        default_tools=STATIC_TOOLS, active_tools=[], toolbar="above",
        frame_width=max(300, min(760, 34 * n)), frame_height=max(160, min(420, 14 * len(layers))),
        fontsize=theme.font_sizes(), padding=0)
    out = heat
    if col_dim == "pos":
        at = [cols.index(q) for q in positions if q in cols]
        out = out * position_outlines(column_boxes(at, min(layers) - 0.5, max(layers) + 0.5))
    cell = _selected_cell(ds, selected)
    if cell is not None:
        x, y = cell
        out = out * hv.Rectangles([(x - 0.5, y - 0.5, x + 0.5, y + 0.5)]).opts(
            fill_alpha=0.0, line_color=theme.ACCENT, line_width=2.5, default_tools=STATIC_TOOLS)
    return out


def _selected_cell(ds: xr.Dataset, selected: str) -> tuple[int, int] | None:
    """(column index, layer) of the cell the page last selected (``"L3@P5"``), or None."""
    if not selected or "@" not in selected:
        return None
    layer, col = selected.split("@")
    try:
        layer_i, col_i = int(layer[1:]), int(col[1:])
    except ValueError:
        return None
    col_dim, cols, _ = _columns(ds)
    if col_i not in cols or layer_i not in ds.layer.values.tolist():
        return None
    return cols.index(col_i), layer_i


# -- the view ----------------------------------------------------------------------------

class PatchingView(CheckedRecompute, View):
    """Activation patching between the workspace prompt and a counterfactual.

    Built from the model; ``background`` and the initial Parameters (below) as for `View`.
    """

    notify_title = "Activation patching"
    failed_status = "Last run failed: {message}"
    kept_note = "The previous grid is still shown."
    wait_timeout = 600

    prompt = param.String(default="When Mary and John went to the store, John gave a drink to",
                          label="Prompt", doc="The clean prompt (the workspace's).")
    cf_position = param.Integer(default=-1, bounds=(-1, None), label="Counterfactual position",
                                doc="The position whose token the counterfactual replaces "
                                    "(click a token of the strip); -1: none.")
    cf_token = param.String(default="", label="Replacement token",
                            doc="The token that replaces the clicked one (mind the leading "
                                "space: ' Mary'), or #id.")
    corrupt = param.String(default="", label="Corrupted prompt (typed)",
                           doc="A corrupted prompt typed in full (as many tokens as the clean "
                               "one); when given it is used instead of the counterfactual.")
    kind = param.Selector(default="resid_pre", objects=list(PAGE_KINDS), label="Grid",
                          doc="What is patched: the residual stream, the attention or MLP "
                              "output at one layer and position, or one head at every "
                              "position.")
    metric = param.Selector(default="logit_diff", objects=["logit_diff", "prob"],
                            label="Metric", doc="Normalised logit difference or p(answer).")
    direction = param.Selector(default="denoising", objects=["denoising", "noising"],
                               label="Direction",
                               doc="Denoising: clean activations into the corrupted run; "
                                   "noising: corrupted ones into the clean run.")
    answer = token_choice("Answer", doc="Empty: the clean run's top token; a token or #id.")
    alternative = token_choice("Alternative", doc="Empty: the corrupted run's top token (its "
                                                  "second when that is the answer); a token "
                                                  "or #id.")
    selected = selected_component(doc="The component of the cell last clicked")
    cell = param.String(default="", precedence=-1, doc="The cell last clicked, L3@P5.")
    highlighted = workspace_selection(doc="The workspace's selected components.")
    selected_positions = workspace_positions(doc="Token positions selected in the workspace "
                                                 "(dashed columns).")
    edits = workspace_edits(doc="Workspace edits, applied to every run.")
    result = shown_dataset(doc="The patching grid shown.")
    seconds = run_seconds(doc="Seconds from the request to the result (last run).")

    link_params = ("cf_position", "cf_token", "corrupt", "kind", "metric", "direction",
                   "answer", "alternative")
    compute_action = "Enter"   # each input recomputes the page as it changes
    outdated_words = staticmethod(outdated_words)
    _inputs = ("prompt", "cf_position", "cf_token", "corrupt", "kind", "metric", "direction",
               "answer", "alternative")

    def __init__(self, model: explorer.Model, *, background: bool | None = None, **params: Any):
        super().__init__(background=background, **params)
        self._model = model
        self._started = 0.0
        self._refused = False   # the last input was refused before computing (its message shows)
        self._strip = PositionStrip(tokens=self._tokens(), sizing_mode="stretch_width",
                                    selected=[] if self.cf_position < 0 else [self.cf_position],
                                    css_classes=["patching-strip"])
        self._strip.param.watch(self._strip_clicked, "selected")
        self.runner("patching", self._got_result, progress=True)
        self.param.watch(self._request, [*self._inputs, "edits"])
        self.param.watch(self._prompt_changed, ["prompt"])
        self.param.watch(self._to_strip, ["cf_position"])
        self.run_once_loaded(self._request)

    def scope(self) -> Scope:
        """Your prompt and its counterfactual; the edits apply to every run."""
        return Scope(on=f"your prompt and one counterfactual of it (at most {MAX_TOKENS} "
                        "tokens)", edits="applied to every run (clean, corrupted, patched)")

    # -- inputs ----------------------------------------------------------------------------
    def _tokens(self) -> list[str]:
        ids = self._model.tokenizer(self.prompt, add_special_tokens=False)["input_ids"]
        return theme.show_tokens(self._model.token_strings(ids))

    def _prompt_changed(self, *_: Any) -> None:
        self._strip.tokens = self._tokens()

    def _strip_clicked(self, event: Any) -> None:
        new = [p for p in event.new if p not in (event.old or [])]
        self.cf_position = new[-1] if new else -1

    def _to_strip(self, *_: Any) -> None:
        want = [] if self.cf_position < 0 else [self.cf_position]
        if list(self._strip.selected) != want:
            self._strip.selected = want

    def request_state(self) -> dict[str, Any]:
        """The inputs a result is computed from (its stale note compares them)."""
        return {name: getattr(self, name) for name in self._inputs} | {
            "edits": [e.to_dict() for e in self.edits]}

    def shown_provenance(self) -> Provenance | None:
        """The shown grid's record (`patching_provenance`)."""
        return patching_provenance(self.result)

    def requested_provenance(self) -> Provenance:
        return patching_request(self._model.spec.name, self.request_state())

    def waiting_state(self) -> str:
        """Waiting for a token to replace, else `CheckedRecompute.waiting_state`."""
        if not self.corrupt and (self.cf_position < 0 or not self.cf_token):  # no token
            return "click a token of the prompt and type its replacement to update."
        return super().waiting_state()

    def caption(self, *_: Any) -> str:
        """The caption under the grid, of the shown grid (`patching_caption`)."""
        return patching_caption(self.result)

    def _corrupt_input(self) -> Any:
        """The corrupted prompt: the typed one, else the counterfactual's ids, else None."""
        if self.corrupt:
            return self.corrupt
        if self.cf_position < 0 or not self.cf_token:
            return None
        return counterfactual_ids(self._model, self.prompt, self.cf_position, self.cf_token)

    # -- computation -----------------------------------------------------------------------
    def _request(self, *events: Any) -> None:
        if not self._page_loaded:
            return
        try:
            corrupt = self._corrupt_input()
        except InputError as exc:
            self._refused = True
            self.show_error(exc)
            return
        self._refused = False
        if corrupt is None:
            self.status = "Click a token of the prompt and type its replacement."
            return
        model, prompt, edits = self._model, self.prompt, list(self.edits)
        settings = dict(kind=self.kind, metric=self.metric, direction=self.direction,
                        answer=parse_token(self.answer),
                        alternative=parse_token(self.alternative))
        state = self.request_state()
        self.running = True
        self._started = time.perf_counter()

        def job(token: CancelToken) -> xr.Dataset:
            check_prompt_tokens(model, prompt, max_tokens=MAX_TOKENS, limit="this page patches")
            token.check()
            ds = activation_patching(model, prompt, corrupt, edits=edits,
                                     progress=self.progress_fn(token), **settings)
            p = ds.attrs["params"]
            p.update(clean=prompt, clean_tokens=model.token_strings(p["clean_ids"]),
                     corrupt_tokens=model.token_strings(p["corrupt_ids"]))
            ds.attrs.update(workspace_edits=[edit_label(e) for e in edits], request=state,
                            computed_at=computed_at_now())
            return ds

        self.submit("patching", job)

    def _got_result(self, ds: xr.Dataset) -> None:
        seconds = time.perf_counter() - self._started
        p = ds.attrs["params"]
        cells = int(np.isfinite(ds.effect.values).sum())
        n_edits = len(ds.attrs.get("edits", []))
        edited = f" · {n_edits} edit{'s' if n_edits != 1 else ''}" if n_edits else ""
        self.param.update(result=ds, seconds=seconds, error="", running=False,
                          status=f"{ds.attrs['model']} · {len(p['clean_ids'])} tokens · "
                                 f"{cells} cells of {p['kind']}{edited} · {seconds:.2f} s")

    # -- selection -------------------------------------------------------------------------
    def select_cell(self, layer: int, column: int) -> None:
        """Select a cell as a click does: its component (when one names it) and, on a
        position grid, its position in the workspace."""
        ds = self.result
        if ds is None:
            return
        p = ds.attrs["params"]
        col_dim = "pos" if "pos" in ds.effect.dims else "head"
        name = cell_component(p["kind"], int(layer), int(column))
        self.cell = f"L{int(layer)}@{'P' if col_dim == 'pos' else 'H'}{int(column)}"
        if name is not None:
            self.selected = name
        if col_dim == "pos" and int(column) not in self.selected_positions:
            self.selected_positions = [*self.selected_positions, int(column)]

    def _tapped(self, x: Any = None, y: Any = None, **_: Any) -> None:
        ds = self.result
        if ds is None or x is None or y is None:
            return
        col_dim, cols, _ = _columns(ds)
        i, layer = int(round(float(x))), int(round(float(y)))
        if 0 <= i < len(cols) and layer in ds.layer.values.tolist():
            self.select_cell(layer, cols[i])

    def _plot(self, ds: xr.Dataset | None, cell: str, positions: Sequence[int]) -> hv.Element:
        plot = plot_patching(ds, cell, positions)
        return plot if ds is None else on_head_click(plot, self._tapped)

    # -- reproducibility -------------------------------------------------------------------
    def code_recipe(self) -> Recipe:
        """The grid the page shows, as one library call."""
        ds = self.result
        kwargs: dict[str, Any] = {"kind": self.kind, "metric": self.metric,
                                  "direction": self.direction}
        corrupt: Any = self.corrupt or None
        if ds is not None:
            p = ds.attrs["params"]
            kwargs = {"kind": p["kind"], "metric": p["metric"], "direction": p["direction"],
                      "answer": int(p["answer_id"]), "alternative": int(p["alternative_id"])}
            corrupt = p["corrupt"] or list(p["corrupt_ids"])
        prompt, edits = self.prompt, list(self.edits)
        if ds is not None:   # the shown grid's inputs
            prompt = ds.attrs["request"]["prompt"]
            edits = [edit_from_dict(d) for d in ds.attrs["request"]["edits"]]
        if edits:
            kwargs["edits"] = EDITS
        return Recipe(model=self._model.spec.name, edits=edits, steps=[
            Call("ds", "explorer.activation_patching", (MODEL, prompt, corrupt), kwargs),
            Expr("grid", "ds.effect", "the grid: (layer, pos) or (layer, head)")])

    # -- layout ----------------------------------------------------------------------------
    def __panel__(self) -> pn.viewable.Viewable:
        def text(name: str, placeholder: str, width: int = 170) -> pn.widgets.TextInput:
            return pn.widgets.TextInput.from_param(self.param[name], placeholder=placeholder,
                                                   description=self.param[name].doc, width=width)

        def choice(name: str) -> pn.widgets.Select:
            return pn.widgets.Select.from_param(self.param[name], width=140,
                                                description=self.param[name].doc)

        controls = pn.FlexBox(text("cf_token", "' Mary' or #id"),
                              text("corrupt", "or type it all", 260), choice("kind"),
                              choice("metric"), choice("direction"),
                              text("answer", "top token", 120),
                              text("alternative", "runner-up", 120),
                              css_classes=["patching-controls"], sizing_mode="stretch_width")
        alert = pn.pane.Alert(self.param.error, alert_type="danger",
                              visible=self.param.error.rx.bool(), css_classes=["patching-error"],
                              sizing_mode="stretch_width")
        inputs = (self.param.result, *[self.param[n] for n in (*self._inputs, "edits")])
        stale = pn.pane.Markdown(
            pn.bind(self.stale_markdown, *inputs),
            visible=pn.bind(lambda *_: bool(self.stale_note()), *inputs),
            css_classes=["patching-stale"], styles={"color": "#a33"}, margin=(0, 10))
        plot = pn.pane.HoloViews(pn.bind(self._plot, self.param.result, self.param.cell,
                                         self.param.selected_positions),
                                 css_classes=["patching-grid"], linked_axes=False)
        caption = pn.pane.Markdown(pn.bind(self.caption, self.param.result),
                                   css_classes=["patching-caption"], sizing_mode="stretch_width",
                                   styles={"color": "#444", "font-size": "0.9em"})
        hint = pn.pane.Markdown("Click the token to change, then type its replacement:",
                                margin=(0, 10))
        return pn.Column(
            pn.Row(self.busy_spinner(), self.status_text("patching-status"), align="center"),
            alert, hint, self._strip, controls, self.progress_bar(), stale, plot, caption,
            sizing_mode="stretch_width")


serve(__name__, PatchingView, title=f"{theme.TITLE}: activation patching", intro="patching")
