"""Direct logit attribution page: which heads and MLPs write your answer against an alternative.

One result of `explorer.analyses.answer_dla.answer_logit_attribution` on the workspace prompt:
each head's and MLP's direct contribution to logit(answer) - logit(alternative) at the last
position, through the final norm frozen at the clean run, drawn as a layer x (heads + MLP)
heatmap on the diverging colour map centred on 0. With workspace edits the edited run and its
difference from the clean one sit beside it, in the same units. The answer and alternative
default to the clean model's top two tokens; typing a token (or ``#id``) picks another. A click
on a cell selects that component (``L3.H1``, ``L3.MLP``) in the workspace. Titles, captions
and the stale note are written from the shown result's record (`dla_provenance`, read from its
attrs), never from the widgets.
"""
from __future__ import annotations

import html
import json
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
from apps._attention_trace import check_prompt_tokens
from apps._controls import check_selected_component, selected_component, token_choice
from apps._heads_heatmap import click_cell, component_cell_box, layer_ticks, on_head_click
from apps._page_provenance import CheckedRecompute, outdated_markdown
from apps._positions import position_outlines
from apps._provenance import Provenance, computed_at_now, one_line, stale_text
from apps._recipe import EDITS, MODEL, Call, Expr, Recipe
from apps._session import CancelToken
from apps._view import (STATIC_TOOLS, Scope, View, run_seconds, serve, shown_dataset,
                        workspace_edits, workspace_selection)
from explorer import components
from explorer._checks import InputError
from explorer.analyses.answer_dla import answer_logit_attribution, answer_token_id
from explorer.interventions import Edit, edit_from_dict
from explorer.workspace import edit_label

__all__ = ["DLAView", "dla_grid", "grid_component", "plot_dla", "dla_title", "dla_caption",
           "dla_provenance", "dla_request", "stale_note", "parse_token", "MAX_TOKENS", "PANELS"]

hv.extension("bokeh", logo=False)

MAX_TOKENS = 256
"""The longest prompt the page attributes."""

PANELS = ("clean", "edited", "difference")
"""The heatmaps the page draws (the last two only under workspace edits)."""


# -- pure functions: Datasets in, arrays / text / HoloViews out ---------------------------

def parse_token(text: str) -> int | str | None:
    """A picker's text as `answer_logit_attribution` takes it: '' -> None (the default),
    ``#123`` -> token id 123, anything else the token's text as typed."""
    if not text:
        return None
    if text.startswith("#") and text[1:].isdigit():
        return int(text[1:])
    return text


def dla_grid(ds: xr.Dataset, panel: str) -> np.ndarray:
    """[layer, head + 1] contributions at the first position of ``ds``: the heads, then the
    MLP in the last column. ``panel`` is a run ("clean", "edited") or "difference"
    (edited - clean)."""
    one = ds.isel(pos=0)

    def grid(run: str) -> np.ndarray:
        r = one.sel(run=run)
        return np.concatenate([r.heads.transpose("layer", "head").values,
                               r.mlp.values[:, None]], axis=1)

    if panel == "difference":
        return grid("edited") - grid("clean")
    return grid(panel)


def grid_component(x: Any, y: Any, n_layers: int, n_heads: int) -> str | None:
    """The component at a click (x = column, y = layer) on `plot_dla`: ``L3.H1``, or
    ``L3.MLP`` in the last column; None off the grid."""
    cell = click_cell(x, y)
    if cell is None:
        return None
    col, layer = cell
    if not (0 <= layer < n_layers and 0 <= col <= n_heads):
        return None
    return str(components.mlp(layer) if col == n_heads else components.head(layer, col))


def _limit(ds: xr.Dataset, panel: str) -> float:
    """Colour limit: clean and edited share one (same colour, same value); the difference
    has its own."""
    values = (dla_grid(ds, "difference") if panel == "difference"
              else np.concatenate([dla_grid(ds, "clean"), dla_grid(ds, "edited")]))
    finite = np.abs(values[np.isfinite(values)])
    return float(finite.max()) if finite.size and finite.max() > 0 else 1.0


def _edit_keys(edits: Sequence[Any]) -> tuple[str, ...]:
    """Edits (records or their ``to_dict``) as sorted JSON texts, to compare two stacks."""
    return tuple(json.dumps(e if isinstance(e, dict) else e.to_dict(), sort_keys=True)
                 for e in edits)


def dla_request(model: str, prompt: str, edits: Sequence[Edit], answer: str,
                alternative: str) -> Provenance:
    """What the page would attribute from these inputs (compared with `dla_provenance`)."""
    return Provenance(page="dla", model=model, prompts=(prompt,),
                      edits=tuple(edit_label(e) for e in edits),
                      request=(("edits", _edit_keys(edits)),
                               ("pickers", (answer, alternative))))


def dla_provenance(ds: xr.Dataset | None) -> Provenance | None:
    """The record of an attribution, from its attrs: the model, the prompt, the edits, the
    pickers as typed and the answer and alternative they resolved to, when computed."""
    if ds is None:
        return None
    a = ds.attrs
    return Provenance(page="dla", model=str(a["model"]), prompts=(str(a["prompt"]),),
                      answer=str(a["answer"]), wrong=str(a["alternative"]),
                      edits=tuple(a.get("workspace_edits") or ()),
                      request=(("edits", _edit_keys(a.get("edits", []))),
                               ("pickers", (a.get("requested_answer", ""),
                                            a.get("requested_alternative", "")))),
                      computed_at=str(a.get("computed_at", "")))


def dla_title(ds: xr.Dataset | None, panel: str = "clean") -> str:
    """The heatmap's title from the result's record: the logit difference it splits."""
    shown = dla_provenance(ds)
    if shown is None:
        return "Direct logit attribution"
    a, b = theme.show_token(shown.answer), theme.show_token(shown.wrong)
    if panel == "clean":
        return f"clean: logit({a}) − logit({b})"
    return {"edited": "edited (same colours)", "difference": "edited − clean"}[panel]


def dla_caption(ds: xr.Dataset | None) -> str:
    """Under the heatmaps, from the result's attrs and values: the prompt position, the
    answer and alternative (ids), the logit difference and how much the terms explain."""
    shown = dla_provenance(ds)
    if shown is None:
        return ""
    one = ds.isel(pos=0)
    a, b = shown.answer, shown.wrong
    clean = one.sel(run="clean")
    lines = [
        f"On {html.escape(one_line(shown.prompts[0]), quote=False)} ({shown.model}).",
        f"Answer `{html.escape(theme.show_token(a))}` (#{ds.attrs['answer_id']}) against "
        f"`{html.escape(theme.show_token(b))}` (#{ds.attrs['alternative_id']}), read at "
        f"position {int(one.position)} `{html.escape(theme.show_token(str(one.token.item())))}`"
        f" ({ds.attrs['params'].get('picked', 'given')}).",
        f"Clean logit difference {float(clean.logit_diff):+.3f}; the embedding gives "
        f"{float(clean.embed):+.3f}, heads {float(clean.heads.sum()):+.3f}, MLPs "
        f"{float(clean.mlp.sum()):+.3f}, biases "
        f"{float(clean.attn_bias.sum() + clean.norm_bias):+.3f} (sum {float(clean.total):+.3f})."]
    if shown.edits:
        edited = one.sel(run="edited")
        lines.append(
            f"Edited ({'; '.join(html.escape(t) for t in shown.edits)}): logit difference "
            f"{float(edited.logit_diff):+.3f}; its writers read through the clean run's final "
            f"norm sum to {float(edited.total):+.3f}.")
    else:
        lines.append("No workspace edits: add one (e.g. ablate a head from the sidebar's "
                     "component menu) to see the edited run and its difference beside this.")
    return "  \n".join(lines)


def stale_note(ds: xr.Dataset | None, prompt: str, edits: Sequence[Edit], answer: str,
               alternative: str, *, state: str = "") -> str:
    """'' when the shown result is of the current prompt, edits and pickers; else, as
    Markdown, what it was computed on, what changed since and ``state``: what the page is
    doing about it (`recompute_state`; default: press Enter)."""
    shown = dla_provenance(ds)
    if shown is None:
        return ""
    text = stale_text(shown, dla_request(shown.model, prompt, edits, answer, alternative),
                      action=DLAView.compute_action, state=state)
    return outdated_words(text, shown)


def outdated_words(text: str, shown: Provenance) -> str:
    """A stale text as the page shows it (`outdated_markdown`), with the edits it was computed
    with."""
    n = len(shown.edits)
    return outdated_markdown(text, f" (It was computed with {n} edit{'s' if n != 1 else ''}.)")


def plot_dla(ds: xr.Dataset | None, panel: str = "clean", selected: str = "",
             highlighted: Sequence[str] = ()) -> hv.Element:
    """One panel's [layer, heads + MLP] heatmap (layer 0 on top), diverging map centred on 0,
    the workspace's selected components outlined dashed and the clicked one solid."""
    if ds is None:
        return theme.placeholder("Attributing the prompt…", height=300)
    values = dla_grid(ds, panel)
    n_layers, n_cols = values.shape
    n_heads = n_cols - 1
    head_comp = ds.head_component.transpose("layer", "head").values
    names = np.concatenate([head_comp, ds.mlp_component.values[:, None]], axis=1)
    cols, layers = np.meshgrid(np.arange(n_cols), np.arange(n_layers))
    # object dtype: HoloViews reshapes the vdims, which an Arrow-backed string column refuses
    table = pd.DataFrame({"column": cols.ravel(), "layer": layers.ravel(),
                          "value": values.ravel(),
                          "component": pd.Series(names.ravel().tolist(), dtype=object)})
    lim = _limit(ds, panel)
    cell_w = max(14, min(28, 260 // n_cols))
    cell_h = max(12, min(22, 440 // n_layers))
    xticks = [(h, f"H{h}") for h in range(n_heads)] + [(n_heads, "MLP")]
    heat = hv.HeatMap(table, ["column", "layer"], ["value", "component"]).opts(
        cmap=theme.SIGNED_CMAP, clim=(-lim, lim), colorbar=True,
        clabel="contribution (logits)", title=dla_title(ds, panel), xlabel="", ylabel="layer",
        xticks=xticks, yticks=layer_ticks(range(n_layers)), invert_yaxis=True, xaxis="top",
        xrotation=90 if n_cols > 6 else 0,
        tools=["hover", "tap"], hover_tooltips=[("component", "@component"),
                                                ("contribution", "@value{+0.000}")],
        default_tools=STATIC_TOOLS, active_tools=[], toolbar="above",
        frame_width=max(160, cell_w * n_cols), frame_height=max(120, cell_h * n_layers),
        fontsize=theme.font_sizes(), padding=0)
    boxes = []
    for name in highlighted or ():
        box = component_cell_box(name, n_layers, n_heads)
        if box is not None:
            boxes.append(box)
    out = heat * position_outlines(boxes)
    current = component_cell_box(selected, n_layers, n_heads)
    if current is not None:
        out = out * hv.Rectangles([current]).opts(
            fill_alpha=0.0, line_color=theme.ACCENT, line_width=2.5, default_tools=STATIC_TOOLS)
    return out


# -- the view ----------------------------------------------------------------------------

class DLAView(CheckedRecompute, View):
    """Direct logit attribution of an answer against an alternative on the prompt.

    Built from the model; ``background`` and the initial Parameters (below) as for `View`.
    """

    notify_title = "Logit attribution"
    compute_action = "Enter"   # each input recomputes the page as it changes
    outdated_words = staticmethod(outdated_words)
    failed_status = "Last run failed: {message}"
    kept_note = "The previous attribution is still shown."
    wait_timeout = 300

    prompt = param.String(default="The capital of France is", label="Prompt",
                          doc="Prompt whose last position is attributed.")
    answer = token_choice("Answer", doc="The answer token: empty for the model's top token; "
                                        "type a token as the model spells it (mind the "
                                        "leading space) or #id.")
    alternative = token_choice("Alternative", doc="The token the answer is compared with: "
                                                  "empty for the model's second token; a "
                                                  "token or #id.")
    selected = selected_component(doc="The component last clicked (L3.H1 or L3.MLP)")
    highlighted = workspace_selection(doc="Components outlined on the heatmaps (the workspace "
                                          "selection).")
    edits = workspace_edits(doc="Workspace edits: the edited run (and its difference from the "
                                "clean one) is the model with them applied.")
    result = shown_dataset(doc="The attribution shown.")
    seconds = run_seconds(doc="Seconds from the request to the result (last run).")

    link_params = ("answer", "alternative")

    def __init__(self, model: explorer.Model, *, background: bool | None = None, **params: Any):
        super().__init__(background=background, **params)
        self._model = model
        self._started = 0.0
        self._refused = False   # the last input was refused before computing (its message shows)
        self.runner("dla", self._got_dla)
        self.param.watch(self._request, ["prompt", "edits", "answer", "alternative"])
        self.param.watch(self._check_selected, ["selected"])
        self.run_once_loaded(self._request)

    def scope(self) -> Scope:
        """Your prompt's last position; the edits make the edited run."""
        return Scope(on=f"your prompt's last position (at most {MAX_TOKENS} tokens)",
                     edits="applied to the edited run, shown beside the clean one")

    def shown_provenance(self) -> Provenance | None:
        """The shown attribution's record (`dla_provenance`)."""
        return dla_provenance(self.result)

    def requested_provenance(self) -> Provenance:
        return dla_request(self._model.spec.name, self.prompt, list(self.edits), self.answer,
                           self.alternative)

    def caption(self, *_: Any) -> str:
        """The caption under the heatmaps, of the shown attribution (`dla_caption`)."""
        return dla_caption(self.result)

    # -- computation -----------------------------------------------------------------------
    def _request(self, *events: Any) -> None:
        if not self._page_loaded:
            return
        model, prompt, edits = self._model, self.prompt, list(self.edits)
        answer, alternative = self.answer, self.alternative
        self._refused = False
        try:  # a token that is not one token is said now, and the shown result stays
            for name, text in (("answer", answer), ("alternative", alternative)):
                token = parse_token(text)
                if token is not None:
                    answer_token_id(model, token, name=name)
        except InputError as exc:
            self._refused = True
            self.show_error(exc)
            return
        self.running = True
        self._started = time.perf_counter()

        def job(token: CancelToken) -> xr.Dataset:
            check_prompt_tokens(model, prompt, max_tokens=MAX_TOKENS, limit="this page attributes")
            token.check()
            ds = answer_logit_attribution(model, prompt, answer=parse_token(answer),
                                          alternative=parse_token(alternative), edits=edits)
            ds.attrs.update(workspace_edits=[edit_label(e) for e in edits],
                            requested_answer=answer, requested_alternative=alternative,
                            computed_at=computed_at_now())
            return ds

        self.submit("dla", job)

    def _got_dla(self, ds: xr.Dataset) -> None:
        seconds = time.perf_counter() - self._started
        n_edits = len(ds.attrs.get("edits", []))
        edited = f" · {n_edits} edit{'s' if n_edits != 1 else ''}" if n_edits else ""
        self.param.update(result=ds, seconds=seconds, error="", running=False,
                          status=f"{self._model.spec.name} · {ds.attrs['n_tokens']} tokens"
                                 f"{edited} · attributed in {seconds:.2f} s")

    # -- selection -------------------------------------------------------------------------
    def _check_selected(self, event: Any) -> None:
        check_selected_component(self, self._model.spec, event)

    def select(self, component: str) -> None:
        """Select ``component`` (``L3.H1`` or ``L3.MLP``), as a click on its cell does."""
        self.selected = component

    def _tapped(self, x: Any = None, y: Any = None, **_: Any) -> None:
        spec = self._model.spec
        name = grid_component(x, y, spec.n_layers, spec.n_heads)
        if name is not None:
            self.select(name)

    def _panel(self, ds: xr.Dataset | None, panel: str, selected: str,
               highlighted: Sequence[str]) -> hv.Element:
        plot = plot_dla(ds, panel, selected, highlighted)
        return plot if ds is None else on_head_click(plot, self._tapped)

    # -- reproducibility -------------------------------------------------------------------
    def code_recipe(self) -> Recipe:
        """The attribution the page shows, as one library call."""
        ds = self.result
        kwargs: dict[str, Any] = {}
        prompt, edits = self.prompt, list(self.edits)
        if ds is not None:   # the shown attribution's inputs
            kwargs = {"answer": int(ds.attrs["answer_id"]),
                      "alternative": int(ds.attrs["alternative_id"])}
            prompt = ds.attrs["prompt"]
            edits = [edit_from_dict(d) for d in ds.attrs.get("edits", [])]
        if edits:
            kwargs["edits"] = EDITS
        return Recipe(model=self._model.spec.name, edits=edits, steps=[
            Call("ds", "explorer.analyses.answer_dla.answer_logit_attribution",
                 (MODEL, prompt), kwargs),
            Expr("clean", "ds.sel(run='clean', pos=-1)", "heads [layer, head], mlp [layer]"),
            Expr("difference", "ds.sel(pos=-1, run='edited') - clean",
                 "what the edits changed in each writer")])

    # -- layout ----------------------------------------------------------------------------
    def __panel__(self) -> pn.viewable.Viewable:
        controls = pn.Row(
            pn.widgets.TextInput.from_param(self.param.answer, placeholder="top-1 token",
                                            description=self.param.answer.doc, width=180),
            pn.widgets.TextInput.from_param(self.param.alternative, placeholder="top-2 token",
                                            description=self.param.alternative.doc, width=180),
            pn.widgets.TextInput.from_param(self.param.selected, placeholder="L3.H1 or L3.MLP",
                                            description=self.param.selected.doc, width=180),
            css_classes=["dla-controls"])
        alert = pn.pane.Alert(self.param.error, alert_type="danger",
                              visible=self.param.error.rx.bool(), css_classes=["dla-error"],
                              sizing_mode="stretch_width")
        inputs = (self.param.result, self.param.prompt, self.param.edits, self.param.answer,
                  self.param.alternative)
        stale = pn.pane.Markdown(
            pn.bind(self.stale_markdown, *inputs),
            visible=pn.bind(lambda *_: bool(self.stale_note()), *inputs),
            css_classes=["dla-stale"], styles={"color": "#a33"}, margin=(0, 10))
        has_edits = self.param.result.rx.pipe(lambda ds: ds is not None
                                              and bool(ds.attrs.get("edits")))
        panes = []
        for panel in PANELS:
            pane = pn.pane.HoloViews(
                pn.bind(self._panel, self.param.result, panel, self.param.selected,
                        self.param.highlighted),
                css_classes=[f"dla-{panel}"], linked_axes=False, margin=(0, 6))
            if panel != "clean":
                pane.visible = has_edits
            panes.append(pane)
        caption = pn.pane.Markdown(pn.bind(self.caption, self.param.result),
                                   css_classes=["dla-caption"], sizing_mode="stretch_width",
                                   styles={"color": "#444", "font-size": "0.9em"})
        return pn.Column(
            pn.Row(self.busy_spinner(), self.status_text("dla-status"), align="center"),
            alert, controls, stale, pn.FlexBox(*panes, sizing_mode="stretch_width"), caption,
            sizing_mode="stretch_width")


serve(__name__, DLAView, title=f"{theme.TITLE}: logit attribution", intro="dla")
