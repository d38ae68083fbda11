"""Logit lens page: what each layer would predict, and how a steering vector changes it.

With workspace edits (`LensView.edits`: the session's edit stack, e.g. an ablated head), a
second heatmap below the first shows the lens of the same prompt with those edits applied
(after the page's own steering, which both runs share), titled "edited: ..."; the first is
then titled "clean".

The logit lens (nostalgebraist 2020, "interpreting GPT: the logit lens") reads each layer's
residual stream through the final norm and the unembedding. The steering vector is the
difference of mean activations of two sets of contrast prompts, added to one layer's
residual stream at every position (Turner et al. 2023, "Steering Language Models With
Activation Engineering", arXiv:2308.10248).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import html
import io
import json
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import bokeh
import holoviews as hv
import numpy as np
import pandas as pd
import panel as pn
import param
from panel.io.document import hold
import xarray as xr

import explorer
from apps import theme
from apps._session import Cancelled, CancelToken, user_message
from apps._positions import (PagePositions, column_boxes, position_caption, position_outlines,
                             shown_positions)
from apps._view import STATIC_TOOLS, Scope, View, serve
from explorer._checks import InputError, check_float, check_int, check_prompts
from explorer.interventions import Edit
from explorer.lens import preview_vocabulary
from explorer.lens_preview import compatible_base, preview_forward_reason, steered_lens_preview
from explorer.trace import trace as trace_sites

__all__ = ["LensView", "lens_table", "plot_lens_heatmap", "heatmap_columns", "plot_shape",
           "heatmap_updates", "is_preview", "lens_tokens", "plot_positions", "contrast_vector",
           "slider_preview_times", "check_lens_prompt", "MAX_LENS_TOKENS", "lens_grid_table",
           "STATE_FORMAT"]

MAX_LENS_TOKENS = 256
"""The longest prompt the lens page runs and draws: one column of every layer per token, so
wider prompts scroll sideways in the page up to this many columns; longer ones are refused
with this limit in the message (a prompt of 3,000 words is refused before any forward)."""

STATE_FORMAT = "explorer.lens-state"
STATE_FORMAT_VERSION = 1
_MAX_STATE_BYTES = 4_000_000
_LABEL_CHARS = 8
_TOOLS = STATIC_TOOLS
_RUN_PARAMS = ("prompt", "k", "steer_layer", "alpha", "contrast_a", "contrast_b")

hv.extension("bokeh", logo=False)


# -- analysis glue (xarray in, xarray/pandas out; no Panel) --------------------------------

def contrast_prompts(text: str) -> list[str]:
    """Prompts from a text box, one a line (blank lines skipped, leading spaces kept)."""
    return [line for line in text.splitlines() if line.strip()]


def contrast_vector(model: explorer.Model, prompts_a: list[str], prompts_b: list[str],
                    layer: int) -> np.ndarray:
    """Mean ``resid_post`` at ``layer`` over the tokens of ``prompts_a`` minus that of ``prompts_b``.

    The first token of each prompt is left out where a prompt has more than one: it
    carries the attention-sink norm (tens of times the others'), which would swamp the
    difference. Returns a [d_model] float32 vector.
    """
    check_prompts(prompts_a)
    check_prompts(prompts_b)

    def mean(prompts):
        ds = trace_sites(model, prompts, sites=("resid_post",), layers=[layer], progress=False)
        x = ds.resid_post.sel(layer=layer)                          # [prompt, pos, d_model]
        keep = ds.mask & ((ds.pos > 0) | (ds.mask.sum("pos") == 1))  # [prompt, pos]
        return x.where(keep).mean(("prompt", "pos")).values

    return (mean(prompts_a) - mean(prompts_b)).astype(np.float32)


def check_lens_prompt(model: explorer.Model, prompt: str) -> int:
    """The prompt's token count; InputError naming the page's limit (`MAX_LENS_TOKENS`) when
    it is longer. Only the tokenizer runs (a long prompt is refused at once)."""
    check_prompts(prompt)
    n = len(model.tokenizer(prompt, add_special_tokens=False)["input_ids"])  # as tokenize counts
    if n > MAX_LENS_TOKENS:
        raise InputError(f"The prompt is {n} tokens; the logit lens draws at most "
                         f"{MAX_LENS_TOKENS} (one column per token). Shorten it.")
    return n


def lens_grid_table(ds: xr.Dataset, *, prompt: int = 0) -> pd.DataFrame:
    """The lens grid as a tidy table: one row per (position, layer, rank) with the input
    token, the rank's token, its id and probability (the page data export's CSV)."""
    one = ds.isel(prompt=prompt)
    real = one.mask.values                                               # [pos]
    pos = one.pos.values[real]
    layers = one.layer.values
    k = one.sizes["rank"]
    inputs = np.array(theme.show_tokens(one.token.values[real]), dtype=object)
    n_pos, n_layers = len(pos), len(layers)
    shape = (n_pos, n_layers, k)
    return pd.DataFrame({
        "pos": np.broadcast_to(pos[:, None, None], shape).reshape(-1),
        "input_token": np.broadcast_to(inputs[:, None, None], shape).reshape(-1),
        "layer": np.broadcast_to(layers[None, :, None], shape).reshape(-1),
        "rank": np.broadcast_to(np.arange(1, k + 1)[None, None, :], shape).reshape(-1),
        "token": np.array(theme.show_tokens(one.top_token.values[real].reshape(-1).tolist()),
                          dtype=object),
        "token_id": one.top_token_id.values[real].reshape(-1).astype(int),
        "probability": one.top_prob.values[real].reshape(-1).astype(float),
    })


def lens_table(ds: xr.Dataset, *, prompt: int = 0) -> pd.DataFrame:
    """One row per (position, layer) of a `explorer.logit_lens` result: the plot's input.

    Columns: ``pos``, ``layer``, ``top_prob`` (top-1 probability), ``label`` (top-1 token,
    visible whitespace, shortened), ``input`` (the input token at ``pos``), and per rank
    ``r``: ``tok{r}``, ``id{r}``, ``p{r}``; ``text_color`` for the label on its cell.
    """
    one = ds.isel(prompt=prompt)
    real = one.mask.values                                               # [pos]
    pos = one.pos.values[real]
    layers = one.layer.values
    n_pos, n_layers, k = len(pos), len(layers), one.sizes["rank"]
    probs = one.top_prob.values[real]                                    # [pos, layer, rank]
    ids = one.top_token_id.values[real]
    toks = one.top_token.values[real]
    inputs = theme.show_tokens(one.token.values[real])
    table: dict[str, Any] = {
        "pos": np.repeat(pos, n_layers),
        "layer": np.tile(layers, n_pos),
        "top_prob": probs[..., 0].reshape(-1).astype(float),
        "input": np.repeat(np.array(inputs, dtype=object), n_layers),
    }
    # each distinct token shown once (a slider's redraw builds this table every move)
    distinct, where = np.unique(toks.reshape(-1).astype(str), return_inverse=True)
    visible = np.array([theme.show_token(t) for t in distinct.tolist()], dtype=object)
    shown = visible[where].reshape(toks.shape)
    short = np.array([s if len(s) <= _LABEL_CHARS else s[:_LABEL_CHARS - 1] + "…"
                      for s in visible.tolist()], dtype=object)
    table["label"] = short[where.reshape(toks.shape)[..., 0].reshape(-1)]
    for r in range(k):
        table[f"tok{r}"] = shown[..., r].reshape(-1)
        table[f"id{r}"] = ids[..., r].reshape(-1)
        table[f"p{r}"] = probs[..., r].reshape(-1).astype(float)
    table["text_color"] = _text_colors(table["top_prob"])
    df = pd.DataFrame(table)
    # object, not pandas' arrow strings: HoloViews reshapes HeatMap value columns
    text = ["input", "label", "text_color"] + [f"tok{r}" for r in range(k)]
    return df.astype({c: object for c in text})


@functools.lru_cache(maxsize=1)
def _light_cells() -> np.ndarray:
    """Per colour of the probability map: whether black text reads on it (theme.text_colors)."""
    n = len(theme.PROBABILITY_CMAP)
    return np.array([c == "black" for c in theme.text_colors(
        np.minimum((np.arange(n) + 0.5) / (n - 1), 1.0), theme.PROBABILITY_CMAP)])


def _text_colors(values: np.ndarray) -> np.ndarray:
    """`theme.text_colors` of probabilities in [0, 1] on the probability map, vectorised."""
    v = np.asarray(values, dtype=float)
    n = len(theme.PROBABILITY_CMAP)
    i = np.clip(np.nan_to_num(v, nan=0.0) * (n - 1), 0, n - 1).astype(int)
    return np.where(np.isnan(v) | _light_cells()[i], "black", "white").astype(object)


def steering_summary(edits: list[dict]) -> str:
    """'steered at layer 10, α = 4' for a lens result's ``edits`` attr, or 'unedited'."""
    steers = [e for e in edits if e.get("kind") == "steer"]
    if not steers:
        return "unedited"
    return "; ".join(f"steered at layer {e['layer']}, α = {e['alpha']:g}" for e in steers)


def is_preview(ds: xr.Dataset | None) -> bool:
    """Whether a lens result is a preview (`explorer.logit_lens` ``preview_vocab``)."""
    return ds is not None and ds.attrs.get("params", {}).get("readout") == "preview"


def lens_title(ds: xr.Dataset, *, clean: bool = False) -> str:
    """The heatmap's title; a preview's says so. ``clean``: the page also shows an edited
    lens, and this one (without the workspace edits) is titled "clean"."""
    what = steering_summary(ds.attrs.get("edits", []))
    if is_preview(ds):
        return f"PREVIEW (exact on release) · {'clean · ' if clean else ''}{what}"
    if clean:
        return f"clean · {what}" if what != "unedited" else "clean: no workspace edits"
    return f"Logit lens: top-1 token per layer and position · {what}"


_TITLE_EDITS = 2  # workspace edits named in the edited heatmap's title (all in its caption)


def edited_title(ds: xr.Dataset, labels: list[str]) -> str:
    """The edited heatmap's title: ``edited: ablate L1.H0 (zero)`` (the caption says more)."""
    shown = ", ".join(labels[:_TITLE_EDITS])
    if len(labels) > _TITLE_EDITS:
        shown += f" +{len(labels) - _TITLE_EDITS} more"
    what = steering_summary(ds.attrs.get("edits", []))
    return f"edited: {shown}" + ("" if what == "unedited" else " + the steering")


def extra_labels(ds: xr.Dataset | None) -> list[str]:
    """The workspace edits an edited lens result carries (their one-line labels)."""
    return list(ds.attrs.get("workspace_edits", [])) if ds is not None else []


def edited_caption(clean: xr.Dataset | None, edited: xr.Dataset | None, *, prompt: int = 0) -> str:
    """Under the edited heatmap: every workspace edit, and how many cells' top-1 token moved."""
    if edited is None:
        return ""
    labels = extra_labels(edited)
    steering = steering_summary(edited.attrs.get("edits", []))
    text = ("Edited run, same prompt" + ("" if steering == "unedited" else f", {steering}")
            + ", with " + "; then ".join(f"`{html.escape(t)}`" for t in labels) + ".")
    moved = moved_cells(clean, edited, prompt=prompt)
    if moved is not None:
        n = int(edited.isel(prompt=prompt).mask.sum()) * edited.sizes["layer"]
        text += (f" The top-1 token differs from the clean lens in {len(moved)} of {n} cells "
                 "(outlined).")
    return text


def moved_cells(clean: xr.Dataset | None, edited: xr.Dataset | None, *,
                prompt: int = 0) -> list[tuple[int, int]] | None:
    """(pos, layer) of every cell whose top-1 token differs between two lens results of the
    same tokens and layers; None when they cannot be compared."""
    if clean is None or edited is None or plot_shape(clean, prompt=prompt)[:2] != plot_shape(
            edited, prompt=prompt)[:2]:
        return None
    a, b = clean.isel(prompt=prompt), edited.isel(prompt=prompt)
    real = a.mask.values
    moved = a.top_token_id.values[real, :, 0] != b.top_token_id.values[real, :, 0]
    pos, layers = a.pos.values[real], a.layer.values
    return [(int(pos[i]), int(layers[j])) for i, j in zip(*np.nonzero(moved))]


def plot_lens_heatmap(ds: xr.Dataset | None, *, prompt: int = 0, title: str | None = None,
                      steer_line: int | None = None) -> hv.Overlay | hv.Element:
    """Layer x position heatmap of the lens's top-1 probability, the top-1 token in each cell.

    Hover lists the top-k tokens with ids and probabilities. ``None`` gives a placeholder.
    A preview's title starts with "PREVIEW". Each steer edit's layer gets a dashed line at
    its lower edge; with ``steer_line`` (the page's steering layer) one line is drawn there
    instead, hidden while ``ds`` carries no steer edit, so a steered and an unsteered
    result draw the same figure (a slider move from 0 updates it in place).
    """
    if ds is None:
        return hv.Text(0, 0, "Computing the logit lens…").opts(
            xaxis=None, yaxis=None, toolbar=None, responsive=True,
            height=theme.SIZES["plot_min_height"])
    table = lens_table(ds, prompt=prompt)
    one = ds.isel(prompt=prompt)
    real = one.mask.values
    ticks = list(zip(one.pos.values[real].tolist(), theme.show_tokens(one.token.values[real])))
    layers = one.layer.values.tolist()
    k = one.sizes["rank"]
    n_pos = len(ticks)
    hover = [("input", "@pos: @input"), ("layer", "@layer")] + [
        (f"#{r + 1}", f"@tok{r}  (id @id{r})  @p{r}{{0.0%}}") for r in range(k)]
    sizes = theme.SIZES
    height = max(sizes["plot_min_height"], sizes["cell_height"] * len(layers) + 140)
    edits = ds.attrs.get("edits", [])
    title = lens_title(ds) if title is None else title
    vdims = ["top_prob", "input"] + [c for r in range(k) for c in (f"tok{r}", f"id{r}", f"p{r}")]
    heat = hv.HeatMap(table, ["pos", "layer"], vdims).opts(
        cmap=theme.PROBABILITY_CMAP, clim=(0.0, 1.0), colorbar=True,
        clabel="top-1 probability", xticks=ticks, yticks=layers,
        xrotation=45 if n_pos > 8 else 0, xlabel="position (input token)", ylabel="layer",
        title=title, tools=["hover"], hover_tooltips=hover, line_color="white", line_width=0.5,
        responsive=True, height=height, min_width=max(sizes["plot_min_width"], 56 * n_pos),
        fontsize={"title": f"{sizes['title_font_pt']}pt", "labels": f"{sizes['axis_font_pt']}pt",
                  "xticks": f"{sizes['axis_font_pt']}pt", "yticks": f"{sizes['label_font_pt']}pt"},
        # the toolbar on the right: above, it sat over the start of the title
        toolbar="right", default_tools=_TOOLS, active_tools=[], padding=0,
    )
    labels = hv.Labels(table, ["pos", "layer"], ["label", "text_color"]).opts(
        text_color="text_color", text_font_size=f"{sizes['label_font_pt']}pt",
        default_tools=_TOOLS)
    overlay = heat * labels
    steers = [e["layer"] for e in edits if e.get("kind") == "steer"]
    line = {"color": theme.ACCENT, "line_width": 3, "line_dash": "dashed"}
    if steer_line is not None:
        overlay *= hv.HLine(steer_line - 0.5).opts(visible=bool(steers), **line)
        steers = [layer for layer in steers if layer != steer_line]
    for layer in steers:  # the steered layer's lower edge: rows from here up carry the edit
        overlay *= hv.HLine(layer - 0.5).opts(**line)
    # no active scroll zoom: the wheel keeps scrolling the page
    return overlay.opts(responsive=True, height=height, active_tools=[])


def plot_shape(ds: xr.Dataset | None, *, prompt: int = 0) -> tuple | None:
    """What fixes the heatmap's axes and glyphs: tokens, layers, k and the steering line.
    Results of the same shape are drawn by replacing the plot's data in place."""
    if ds is None:
        return None
    one = ds.isel(prompt=prompt)
    steer = tuple(e["layer"] for e in ds.attrs.get("edits", []) if e.get("kind") == "steer")
    return (tuple(one.token.values[one.mask.values].tolist()), tuple(one.layer.values.tolist()),
            int(one.sizes["rank"]), steer)


def lens_tokens(ds: xr.Dataset | None, *, prompt: int = 0) -> list[str]:
    """The prompt's real tokens as the heatmap's x axis shows them ([] without a result)."""
    if ds is None:
        return []
    one = ds.isel(prompt=prompt)
    return theme.show_tokens(one.token.values[one.mask.values])


def plot_positions(ds: xr.Dataset | None, positions: Sequence[int], *,
                   prompt: int = 0) -> hv.Rectangles | None:
    """Dashed outlines of the selected token positions' columns (every layer) on
    `plot_lens_heatmap`; None when none of them is in the prompt. Position ``P<i>`` is the
    prompt's i-th real token (its x is that token's ``pos``)."""
    if ds is None:
        return None
    one = ds.isel(prompt=prompt)
    xs = one.pos.values[one.mask.values]
    shown = shown_positions(positions, len(xs))
    if not shown:
        return None
    layers = one.layer.values
    return position_outlines(column_boxes([int(xs[p]) for p in shown],
                                          float(layers.min()) - 0.5, float(layers.max()) + 0.5))


def _as_text(values: np.ndarray) -> list[str]:
    """Numbers as HoloViews' hover columns show them (``%.5g``; ids as integers)."""
    values = np.asarray(values)
    if values.dtype.kind in "iu":
        return values.astype(str).tolist()
    return np.char.mod("%.5g", values.astype(float)).tolist()


def heatmap_columns(ds: xr.Dataset, *, prompt: int = 0) -> dict[str, dict[str, Any]]:
    """The ``ColumnDataSource.data`` HoloViews gives the heatmap (``"heat"``) and its labels
    (``"labels"``) for ``ds``: what a same-shape update writes into the drawn plot."""
    t = lens_table(ds, prompt=prompt)
    n = len(t)
    heat: dict[str, Any] = {"pos": t["pos"].to_numpy(), "layer": t["layer"].to_numpy(),
                            "zvalues": t["top_prob"].to_numpy(), "width": np.ones(n),
                            "height": np.ones(n), "top_prob": _as_text(t["top_prob"].to_numpy()),
                            "input": list(t["input"])}
    for r in range(ds.sizes["rank"]):
        heat[f"tok{r}"] = list(t[f"tok{r}"])
        heat[f"id{r}"] = _as_text(t[f"id{r}"].to_numpy())
        heat[f"p{r}"] = _as_text(t[f"p{r}"].to_numpy())
    labels = {"pos": t["pos"].to_numpy(), "layer": t["layer"].to_numpy(),
              "label": list(t["label"]), "text_color": list(t["text_color"])}
    return {"heat": heat, "labels": labels}


_SHAPE_COLUMNS = {"heat": ("pos", "layer", "width", "height", "input"),
                  "labels": ("pos", "layer")}
"""The heatmap's data columns fixed by `plot_shape` (the same for every result of a shape)."""


@functools.lru_cache(maxsize=65536)
def _shown_token(token: str) -> tuple[str, str]:
    """A token as shown in the hover (`theme.show_token`) and as a cell's short label."""
    s = theme.show_token(token)
    return s, (s if len(s) <= _LABEL_CHARS else s[:_LABEL_CHARS - 1] + "…")


def heatmap_updates(ds: xr.Dataset, *, prompt: int = 0) -> dict[str, dict[str, Any]]:
    """The columns of `heatmap_columns` that change between results of one `plot_shape`
    (top-1 probability, tokens, ids, probabilities, labels and their colours), built
    straight from the arrays: what a slider move sends to the drawn plot."""
    one = ds.isel(prompt=prompt)
    real = one.mask.values                                               # [pos]
    k = one.sizes["rank"]
    probs = one.top_prob.values[real].reshape(-1, k)                     # [pos*layer, rank]
    ids = one.top_token_id.values[real].reshape(-1, k)
    toks = one.top_token.values[real].reshape(-1, k)
    shown = [[_shown_token(t) for t in row] for row in toks.tolist()]
    top = probs[:, 0].astype(float)
    heat: dict[str, Any] = {"zvalues": top, "top_prob": _as_text(top)}
    for r in range(k):
        heat[f"tok{r}"] = [row[r][0] for row in shown]
        heat[f"id{r}"] = _as_text(ids[:, r])
        heat[f"p{r}"] = _as_text(probs[:, r].astype(float))
    labels = {"label": [row[0][1] for row in shown], "text_color": list(_text_colors(top))}
    return {"heat": heat, "labels": labels}


_PATCH_SHARE = 0.5
"""A column whose cells changed in at most this share is patched cell by cell."""


def _update_source(source: Any, columns: dict[str, Any]) -> None:
    """Write ``columns`` into a drawn ``source``, sending only what changed: columns equal
    to the drawn ones are skipped, a column with few changed cells (a drag: the layers
    before the edit, and most tokens, stay) goes as a patch of those cells, the others
    whole, in one change event each."""
    whole: dict[str, Any] = {}
    patches: dict[str, list[tuple[int, Any]]] = {}
    for name, new in columns.items():
        old = source.data.get(name)
        if old is None or len(old) != len(new):
            whole[name] = new
            continue
        changed = np.flatnonzero(np.asarray(old, dtype=object) != np.asarray(new, dtype=object))
        if len(changed) == 0:
            continue
        if len(changed) <= _PATCH_SHARE * len(new):
            values = np.asarray(new, dtype=object)[changed].tolist()   # plain Python values
            patches[name] = list(zip(changed.tolist(), values))
        else:
            whole[name] = new
    if whole:
        source.data.update(whole)
    if patches:
        source.patch(patches)


def lens_digest(ds: xr.Dataset) -> str:
    """A short fingerprint of a lens result (changes whenever the displayed cells do)."""
    h = hashlib.sha1(np.ascontiguousarray(ds.top_token_id.values).tobytes())
    h.update(np.round(np.nan_to_num(ds.top_prob.values), 4).tobytes())
    return h.hexdigest()[:12]


def details_html(ds: xr.Dataset | None, *, prompt: int = 0) -> str:
    """The model's prediction after the last input token (final layer, top-k) as a table."""
    if ds is None:
        return "<div class='lens-details'>No result yet.</div>"
    one = ds.isel(prompt=prompt)
    last = int(np.flatnonzero(one.mask.values)[-1])
    cell = one.isel(pos=last, layer=-1)
    rows = "".join(
        f"<tr><td>{r + 1}</td><td><code>{html.escape(theme.show_token(str(t)))}</code></td>"
        f"<td>{int(i)}</td><td>{p:.1%}</td></tr>"
        for r, (t, i, p) in enumerate(zip(cell.top_token.values, cell.top_token_id.values,
                                          cell.top_prob.values)))
    prompt_text = ds.attrs.get("params", {}).get("prompts", [""])[prompt]
    inputs = theme.show_tokens(one.token.values[one.mask.values])
    tokens = " ".join(f"<code>{html.escape(t)}</code>" for t in inputs)
    return (
        f"<div class='lens-details' data-lens-digest='{lens_digest(ds)}' "
        f"data-prompt='{html.escape(prompt_text, quote=True)}'>"
        f"<b>Next-token prediction</b> after <code>{html.escape(inputs[last])}</code> "
        f"(final layer, {html.escape(steering_summary(ds.attrs.get('edits', [])))})"
        "<table class='lens-topk'><thead><tr><th>rank</th><th>token</th><th>id</th>"
        f"<th>probability</th></tr></thead><tbody>{rows}</tbody></table>"
        f"<div class='lens-tokens'>Input tokens: {tokens}</div></div>"
    )


_DETAILS_CSS = """
table.lens-topk { border-collapse: collapse; margin: 6px 0; font-size: 13px; }
table.lens-topk th, table.lens-topk td { padding: 2px 10px; text-align: left;
  border-bottom: 1px solid #ddd; }
.lens-tokens code, table.lens-topk code { background: #f3f3f3; padding: 0 3px; }
"""


# -- the view ------------------------------------------------------------------------------

class _DragSlider(pn.widgets.FloatSlider):
    """A float slider whose moves reach the server at once: Panel holds a widget's browser
    changes 50 ms to merge bursts (its debounce), which a drag's preview does itself (one
    preview computes, the newest move waits, older ones are dropped)."""

    _priority_changes = ["value"]


class LensView(View):
    """Logit lens of a prompt, live under a steering vector set by sliders.

    Parameters
    ----------
    model : explorer.Model
    background : bool, optional
        Compute in a worker thread (default when served) or inline (default in notebooks
        and tests).
    **params
        Initial values of the parameters below.
    """

    prompt = param.String(default="The capital of France is",
                          doc="Prompt whose residual stream is read at every layer.")
    contrast_a = param.String(default="I love you. You are wonderful.", label="Contrast prompts A",
                              doc="One prompt a line. The steering vector points from the mean "
                                  "activation of B towards that of A (first tokens left out).")
    contrast_b = param.String(default="I hate you. You are terrible.", label="Contrast prompts B",
                              doc="One prompt a line; the other end of the steering vector.")
    steer_layer = param.Integer(default=0, bounds=(0, None), label="Steering layer",
                                doc="Layer whose resid_post gets α × (mean A − mean B) at every "
                                    "position.")
    alpha = param.Number(default=0.0, bounds=(-10.0, 10.0), step=0.5, label="Steering strength α",
                         doc="Multiple of the steering vector added; 0 runs the model unedited.")
    k = param.Integer(default=5, bounds=(1, 20), label="Top-k tokens",
                      doc="Tokens listed per cell in the hover tooltip.")

    result = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True, precedence=-1,
                                 doc="The last good lens result (kept while a new one computes).")
    preview = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True, precedence=-1,
                                  doc="The preview drawn while the steering slider moves; None "
                                      "once the exact result of the released value is in.")
    plot_version = param.Integer(default=0, precedence=-1,
                                 doc="Bumped when the heatmap must be built anew (a new shape).")
    edits = param.List(default=[], item_type=Edit, precedence=-1,
                       doc="Workspace edits (intervention records): with any, a second "
                           "heatmap shows the lens with them applied after the steering.")
    selected_positions = param.List(default=[], item_type=int, precedence=-1,
                                    doc="Selected token positions of the prompt (0-based; the "
                                        "workspace's in the gallery), outlined on the heatmaps.")
    edited_result = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True,
                                        precedence=-1,
                                        doc="The lens with `edits` (and the steering) applied; "
                                            "None without workspace edits.")

    notify_title = "Logit lens"
    failed_status = "Last run failed: {message}"
    wait_timeout = 120
    link_params = ("contrast_a", "contrast_b", "steer_layer", "alpha", "k")

    def scope(self) -> Scope:
        """Your prompt (and the contrast prompts of the steering vector); the workspace's
        edits are applied in a second heatmap."""
        return Scope(on=f"your prompt (at most {MAX_LENS_TOKENS} tokens), steered by the "
                        "contrast prompts A − B",
                     edits="applied (a second heatmap: the lens with the workspace's edits)")

    def __init__(self, model: explorer.Model, *, background: bool | None = None, **params: Any):
        steer_layer = params.pop("steer_layer", model.spec.n_layers // 3)
        super().__init__(background=background, **params)
        self._model = model
        self.param.steer_layer.bounds = (0, model.spec.n_layers - 1)
        self.steer_layer = steer_layer
        served = self._doc is not None
        self._cache_lock = threading.Lock()
        self._clean: tuple[str, Any] | None = None                  # (prompt, CleanRun)
        self._vectors: dict[tuple, np.ndarray] = {}                  # (A, B, layer) -> [d_model]
        self._runner = self.runner("run", self._show_result)
        self._started = 0.0
        # the preview path: one job at a time, only the newest waiting request kept
        self.runner("preview", self._show_preview, busy=False)
        self._preview_lock = threading.Lock()
        self._preview_busy = False
        self._preview_pending: tuple[int, dict] | None = None
        self._seq = 0            # request counter (previews and exact runs)
        self._exact_seq = 0      # the newest exact request: older previews are not drawn
        self.preview_runs = 0    # previews computed (tests and the bench read it)
        self._candidates: tuple[Any, tuple, np.ndarray] | None = None  # the last preview's
        self._alpha_slider: pn.widgets.FloatSlider | None = None
        # the prompt's tokens: a click toggles a position (the workspace's in the gallery)
        self._position_links = PagePositions(self, lambda: lens_tokens(self.result),
                                             refresh_on="result", css_class="lens-prompt-tokens",
                                             empty="the prompt has not been read yet.")
        self._positions = self._position_links.strip
        self.param.watch(self._positions_changed, ["selected_positions"])
        self._syncing = False
        # the drawn heatmap's data sources, filled in place for results of the same shape
        self._sources: dict[str, list[weakref.ref]] = {"heat": [], "labels": []}
        self._figures: list[weakref.ref] = []
        self._lines: list[weakref.ref] = []   # the drawn steering line (a Bokeh Span)
        self._drawn_shape: tuple | None = None
        self.param.watch(self._request_run, [*_RUN_PARAMS, "edits"])
        self.param.watch(self._draw, ["result", "preview"])
        self._page_loaded = not served
        if served:
            pn.state.onload(self._on_page_load)  # runs at once if the page is already up
        else:
            self._request_run()

    @property
    def model(self) -> explorer.Model:
        return self._model

    # -- computation ---------------------------------------------------------------------
    def _run_params(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _RUN_PARAMS}

    def _on_page_load(self) -> None:
        self._page_loaded = True
        self._request_run()

    def _mark_preview_ready(self, ready: bool) -> None:
        """The steering slider carries the CSS class ``preview-ready`` while a drag's first
        move finds the preview's inputs ready (`_warm_preview` done for the exact result
        shown); a page script or a test can wait on it."""
        slider = self._alpha_slider
        if slider is None:
            return
        classes = [c for c in slider.css_classes if c != "preview-ready"]
        slider.css_classes = classes + ["preview-ready"] if ready else classes

    def _request_run(self, *events: Any) -> None:
        if not self._page_loaded:  # changes before the page is up coalesce into its first run
            return
        self._mark_preview_ready(False)
        p = self._run_params()
        self.running = True
        self._started = time.perf_counter()
        self._seq += 1
        self._exact_seq = self._seq
        with self._preview_lock:
            self._preview_pending = None   # previews asked for before this are stale
        extra = list(self.edits)
        self.submit("run", lambda token: self._compute(p, token, extra))

    # -- the preview while the steering slider moves ------------------------------------
    def request_preview(self, alpha: float) -> None:
        """Draw a preview at steering strength ``alpha`` (the slider is being dragged).

        One preview computes at a time; a request made meanwhile waits in a single slot
        that the next request overwrites, so stale positions are dropped, never queued.
        The exact run follows when the slider is released (`alpha` is set).
        """
        if not self._page_loaded:
            return
        self._seq += 1
        request = (self._seq, {**self._run_params(), "alpha": float(alpha)})
        with self._preview_lock:
            if self._preview_busy:
                self._preview_pending = request
                return
            self._preview_busy = True
        self._start_preview(request)

    def _start_preview(self, request: tuple[int, dict]) -> None:
        if self.submit("preview", lambda token: self._preview_job(request, token)) is None:
            with self._preview_lock:       # closed: nothing more runs
                self._preview_busy = False
                self._preview_pending = None

    def _preview_job(self, request: tuple[int, dict], token: CancelToken) -> tuple:
        seq, p = request
        try:
            return seq, p, self._compute_preview(p, token), None
        except Cancelled:
            raise
        except Exception as exc:  # a failed preview is not shown; the exact run reports
            return seq, p, None, exc

    def _compute_preview(self, p: dict[str, Any], token: CancelToken) -> xr.Dataset:
        """The lens at ``p``, previewed: the layers before the edit copied from the last
        exact result, the later ones re-run in plain torch from the clean run and read
        over candidate tokens (`explorer.lens_preview.steered_lens_preview`); where that
        forward does not cover the model, `explorer.logit_lens` ``preview_vocab``."""
        check_lens_prompt(self._model, p["prompt"])
        edits = self.edits_for(p)
        last = self.result
        if not edits and last is not None and not last.attrs["edits"] \
                and last.attrs["params"]["prompts"] == [p["prompt"]] \
                and last.sizes["rank"] == p["k"]:
            return last  # the unedited lens is already exact
        token.check()
        # alpha 0 after a steered exact result: the unedited lens, previewed as a zero
        # steering from the same layer (the preview forward runs it as fast as any move)
        forward = edits or [explorer.Steer(layer=p["steer_layer"],
                                           vector=self._steering_vector(p), alpha=0.0)]
        resume = self._clean_run(p["prompt"]) if not self._model.remote else None
        token.check()
        if resume is not None and preview_forward_reason(self._model, forward) is None \
                and compatible_base(last, p["prompt"], p["k"], min(e.layer for e in forward)):
            vocab = self._preview_candidates(last, forward)
            self.preview_runs += 1
            out = steered_lens_preview(self._model, p["prompt"], k=p["k"], edits=forward,
                                       clean=resume, base=last, candidates=vocab)
            if not edits:
                out.attrs["edits"] = []
            return out
        resume = resume if edits else None
        shown = [ds for ds in (self.result, self.preview) if ds is not None
                 and ds.attrs["params"]["prompts"] == [p["prompt"]]]
        directions = [np.sign(e.alpha) * np.asarray(e.vector) for e in edits]
        vocab = preview_vocabulary(self._model, results=shown, directions=directions)
        token.check()
        self.preview_runs += 1
        return explorer.logit_lens(self._model, p["prompt"], k=p["k"], edits=edits, resume=resume,
                                   rank_cap=p["k"], unembed_dtype="auto", preview_vocab=vocab)

    def _preview_candidates(self, base: xr.Dataset, edits: list[explorer.Steer]) -> np.ndarray:
        """`preview_vocabulary` of the exact result and the steering direction, kept while
        they stay the same (every move of one drag reads the same candidates)."""
        signs = tuple(float(np.sign(e.alpha)) for e in edits)
        key = (signs, tuple(e.vector for e in edits))
        if self._candidates is not None and self._candidates[0] is base \
                and self._candidates[1] == key:
            return self._candidates[2]
        vocab = preview_vocabulary(self._model, results=[base], directions=[
            s * np.asarray(e.vector) for s, e in zip(signs, edits)])
        self._candidates = (base, key, vocab)
        return vocab

    def _show_preview(self, out: tuple) -> None:
        seq, p, ds, exc = out   # a warm-up (`_warm_preview`) has seq == _exact_seq: not drawn
        if seq == self._exact_seq:
            self._mark_preview_ready(exc is None)
        if exc is None and seq > self._exact_seq and ds is not None:
            # the status stays the same through a drag (the title names alpha): a changed
            # status line re-lays the page out in the browser on every move. A redraw in
            # place (no new Bokeh models) reaches the browser as one document patch
            # (Panel's `hold`): data, title and line drawn in one repaint.
            held = hold(self._doc) if self._doc is not None and self._draws_in_place(ds) \
                else contextlib.nullcontext()
            with held:
                self.param.update(preview=ds, status="Preview: top tokens among candidates, "
                                                     "estimated probabilities; exact on release")
        with self._preview_lock:
            request, self._preview_pending = self._preview_pending, None
            if request is None:
                self._preview_busy = False
        if request is not None:
            self._start_preview(request)

    def _steering_vector(self, p: dict[str, Any]) -> np.ndarray:
        a, b = contrast_prompts(p["contrast_a"]), contrast_prompts(p["contrast_b"])
        for name, prompts in (("contrast_a", a), ("contrast_b", b)):
            if not prompts:
                raise InputError(f"`{name}` needs at least one prompt to steer with; got none.")
        key = (tuple(a), tuple(b), p["steer_layer"])
        with self._cache_lock:
            vec = self._vectors.get(key)
        if vec is None:
            vec = contrast_vector(self._model, a, b, p["steer_layer"])
            with self._cache_lock:
                if len(self._vectors) > 16:
                    self._vectors.clear()
                self._vectors[key] = vec
        return vec

    def edits_for(self, p: dict[str, Any] | None = None) -> list[explorer.Steer]:
        """The intervention records of the current (or given) parameters."""
        p = p or self._run_params()
        if p["alpha"] == 0:
            return []
        return [explorer.Steer(layer=p["steer_layer"], vector=self._steering_vector(p),
                               alpha=p["alpha"])]

    def _clean_run(self, prompt: str) -> Any:
        with self._cache_lock:
            if self._clean is not None and self._clean[0] == prompt:
                return self._clean[1]
        clean = explorer.clean_run(self._model, prompt)
        with self._cache_lock:
            self._clean = (prompt, clean)
        return clean

    def _compute(self, p: dict[str, Any], token: CancelToken,
                 extra: list[Edit] | None = None) -> tuple[dict, xr.Dataset, xr.Dataset | None]:
        """The lens at ``p`` (with its steering) and, with ``extra`` (workspace edits), the
        lens with the steering and then ``extra`` applied, for the same prompt."""
        check_lens_prompt(self._model, p["prompt"])
        edits = self.edits_for(p)
        token.check()
        # a remote model reduces the lens inside its trace; locally, an edit resumes at its
        # layer from the clean run; "auto" takes the bfloat16 screen where this CPU has
        # native bfloat16 (about half the unembedding's cost) and exact float32 elsewhere
        remote = self._model.remote
        resume = self._clean_run(p["prompt"]) if (edits and not remote) else None
        token.check()
        ds = explorer.logit_lens(self._model, p["prompt"], k=p["k"], edits=edits, resume=resume,
                                 rank_cap=p["k"], unembed_dtype="auto")
        edited = None
        if extra:
            from explorer.workspace import edit_label

            token.check()
            resume = None if remote else self._clean_run(p["prompt"])
            edited = explorer.logit_lens(self._model, p["prompt"], k=p["k"],
                                         edits=[*edits, *extra], resume=resume,
                                         rank_cap=p["k"], unembed_dtype="auto")
            edited.attrs["workspace_edits"] = [edit_label(e) for e in extra]
        return p, ds, edited

    # -- results (on the session's event loop when served) -------------------------------
    def _show_result(self, out: tuple[dict, xr.Dataset, xr.Dataset | None]) -> None:
        p, ds, edited = out
        seconds = time.perf_counter() - self._started
        n = len(extra_labels(edited))
        more = "" if edited is None else f" · edited: {n} workspace edit{'s' if n > 1 else ''}"
        self.param.update(result=ds, edited_result=edited, preview=None, error="", running=False,
                          status=f"{self._model.spec.name} · {steering_summary(ds.attrs['edits'])}"
                                 f"{more} · {seconds:.2f} s")
        self._warm_preview()

    def _warm_preview(self) -> None:
        """Served, after an exact result: compute one preview that is not drawn, so that the
        first move of the next drag finds the steering vector, the clean run, the preview's
        blocks, candidates and GEMM backend ready (seconds on a busy machine) instead of
        making the hand wait for them. It is a preview request like a move's: a move made
        meanwhile waits in the single slot."""
        if not self._background or self._model.remote or self.result is None:
            return
        with self._preview_lock:
            if self._preview_busy:
                return
            self._preview_busy = True
        alpha = self.alpha if self.alpha != 0 else self.param.alpha.step
        self._start_preview((self._exact_seq, {**self._run_params(), "alpha": float(alpha)}))

    def _error_note(self) -> str:
        return " The previous result is still shown." if self.result is not None else ""

    def cancel(self, name: str | None = None) -> None:
        """Stop waiting for the run in flight; its result is discarded."""
        was_running = self.running
        super().cancel(name)
        if name in (None, "preview"):
            with self._preview_lock:
                self._preview_busy = False
                self._preview_pending = None
        if was_running:
            self.param.update(running=False, status="Cancelled; showing the previous result.")

    def close(self) -> None:
        """Cancel any run and drop cached activations (the page is gone)."""
        super().close()
        with self._cache_lock:
            self._clean = None
            self._vectors.clear()

    # -- reproducibility -----------------------------------------------------------------
    def code_snippet(self) -> str:
        """Python that recomputes the heatmap's lens (with the page's steering vector) and,
        with workspace edits, the edited lens below it."""
        p = self._run_params()
        lines = ["import explorer", "", f"model = explorer.load_model({self._model.spec.name!r})",
                 f"prompt = {p['prompt']!r}"]
        if p["alpha"] == 0:
            lines.append("steer = []  # steering strength 0: the model unedited")
        else:
            layer = p["steer_layer"]
            lines += [
                f"a = {contrast_prompts(p['contrast_a'])!r}  # contrast prompts A",
                f"b = {contrast_prompts(p['contrast_b'])!r}  # contrast prompts B", "",
                "def mean_resid(prompts, layer):",
                "    \"\"\"Mean resid_post over the prompts' tokens, the first token left out (its",
                "    attention-sink norm would swamp the difference).\"\"\"",
                "    ds = explorer.trace(model, prompts, sites=('resid_post',), layers=[layer])",
                "    keep = ds.mask & ((ds.pos > 0) | (ds.mask.sum('pos') == 1))",
                "    return ds.resid_post.sel(layer=layer).where(keep).mean(('prompt', 'pos')).values",
                "",
                f"vector = (mean_resid(a, {layer}) - mean_resid(b, {layer})).astype('float32')",
                f"steer = [explorer.Steer(layer={layer}, vector=vector, alpha={float(p['alpha'])!r})]"]
        k = p["k"]
        lines.append(f"lens = explorer.logit_lens(model, prompt, k={k}, edits=steer, rank_cap={k}, "
                     "unembed_dtype='auto')")
        if self.edits:
            lines += [f"workspace = explorer.edits_from_json({explorer.edits_to_json(self.edits)!r})",
                      f"edited = explorer.logit_lens(model, prompt, k={k}, "
                      f"edits=[*steer, *workspace], rank_cap={k}, unembed_dtype='auto')"]
        lines.append("top = lens.top_token.isel(prompt=0, rank=0)  # the heatmap: [pos, layer]")
        return "\n".join(lines) + "\n"

    # -- drawing ---------------------------------------------------------------------------
    @property
    def shown(self) -> xr.Dataset | None:
        """The result the heatmap draws: the preview while there is one, else the result."""
        return self.preview if self.preview is not None else self.result

    def _source_hook(self, glyph: str):
        """A HoloViews hook keeping the rendered glyph's data source (and the figure)."""
        def hook(plot: Any, element: Any) -> None:
            source = plot.handles.get("source")
            refs = self._sources[glyph]
            if source is not None and not any(r() is source for r in refs):
                refs.append(weakref.ref(source))
            fig = plot.handles.get("plot")
            if fig is not None and not any(r() is fig for r in self._figures):
                self._figures.append(weakref.ref(fig))
        return hook

    def drawn_sources(self) -> dict[str, list[Any]]:
        """The rendered heatmap's Bokeh data sources per glyph (live ones only)."""
        out = {}
        for glyph, refs in self._sources.items():
            refs[:] = [r for r in refs if r() is not None]
            out[glyph] = [r() for r in refs]
        return out

    # -- the prompt's token positions ------------------------------------------------------
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
        steers = () if ds is None else plot_shape(ds)[3]
        line = steers[0] if len(steers) == 1 else self.steer_layer
        plot = plot_lens_heatmap(ds, title=None if ds is None else
                                 lens_title(ds, clean=self.edited_result is not None),
                                 steer_line=line)
        if ds is None:
            return plot
        outlines = plot_positions(ds, self.selected_positions)
        if outlines is not None:
            plot = (plot * outlines.opts(default_tools=_TOOLS)).opts(active_tools=[])
        return plot.opts(hv.opts.HeatMap(hooks=[self._source_hook("heat")]),
                         hv.opts.Labels(hooks=[self._source_hook("labels")]),
                         hv.opts.HLine(hooks=[self._line_hook]))

    @staticmethod
    def _page_shape(ds: xr.Dataset | None) -> tuple | None:
        """`plot_shape` without the steering layer where there is at most one steer edit:
        the page draws that line always and moves or hides it in place."""
        shape = plot_shape(ds)
        return shape if shape is None or len(shape[3]) > 1 else shape[:3]

    def _line_hook(self, plot: Any, element: Any) -> None:
        """A HoloViews hook keeping the rendered steering line (a Bokeh Span)."""
        span = plot.handles.get("glyph")
        if span is not None and not any(r() is span for r in self._lines):
            self._lines.append(weakref.ref(span))

    def _plot_edited(self, edited: xr.Dataset | None) -> hv.Overlay | hv.Element:
        if edited is None:
            return hv.Text(0, 0, "").opts(xaxis=None, yaxis=None, toolbar=None, height=10,
                                          responsive=True)
        plot = plot_lens_heatmap(edited, title=edited_title(edited, extra_labels(edited)))
        moved = moved_cells(self.result, edited)
        if moved:  # outline the cells whose top-1 token differs from the clean lens
            plot *= hv.Rectangles([(p - 0.5, l - 0.5, p + 0.5, l + 0.5) for p, l in moved]).opts(
                fill_alpha=0, line_color=theme.ACCENT, line_width=3, default_tools=_TOOLS)
        outlines = plot_positions(edited, self.selected_positions)
        if outlines is not None:
            plot *= outlines.opts(default_tools=_TOOLS)
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
        lines = [span for span in (r() for r in self._lines) if span is not None]
        return ds is not None and self._page_shape(ds) == self._drawn_shape \
            and all(self.drawn_sources().values()) and len(lines) == 1

    def _draw(self, *events: Any) -> None:
        """Redraw the heatmap: in place when the drawn plot has this result's shape (a
        slider move: only the columns that change, the title; no new Bokeh models), else
        anew."""
        ds = self.shown
        sources = self.drawn_sources()
        lines = [span for span in (r() for r in self._lines) if span is not None]
        if ds is not None and self._page_shape(ds) == self._drawn_shape \
                and all(sources.values()) and len(lines) == 1:
            columns = heatmap_updates(ds)
            if all(set(src.data) <= set(columns[glyph]) | set(_SHAPE_COLUMNS[glyph])
                   for glyph, srcs in sources.items() for src in srcs):
                for glyph, srcs in sources.items():
                    for src in srcs:
                        _update_source(src, {name: columns[glyph][name] for name in src.data
                                             if name in columns[glyph]})
                steers = plot_shape(ds)[3]
                if steers:
                    lines[0].location = steers[0] - 0.5
                lines[0].visible = bool(steers)
                title = lens_title(ds, clean=self.edited_result is not None)
                for ref in self._figures:
                    fig = ref()
                    if fig is not None and fig.title is not None:
                        fig.title.text = title
                return
        self.plot_version += 1

    # -- page data export ----------------------------------------------------------------
    def export_tables(self) -> dict[str, pd.DataFrame]:
        """The lens grid as tidy tables (`lens_grid_table`): ``lens`` (the heatmap's result)
        and, with workspace edits, ``lens_edited``; a row per (position, layer, rank)."""
        out = {}
        if self.result is not None:
            out["lens"] = lens_grid_table(self.result)
        if self.edited_result is not None:
            out["lens_edited"] = lens_grid_table(self.edited_result)
        return out

    # -- session export / import ---------------------------------------------------------
    def export_state(self) -> dict[str, Any]:
        """The page's state as JSON-able data: model, prompts, parameters, edits, versions."""
        p = self._run_params()
        spec = self._model.spec
        return {
            "format": STATE_FORMAT,
            "format_version": STATE_FORMAT_VERSION,
            "view": "lens",
            "model": spec.name,
            "model_weights": spec.weights,
            "prompts": [p["prompt"]],
            "params": p,
            "edits": json.loads(explorer.edits_to_json(self.edits_for(p))),
            "versions": {**spec.versions, "panel": pn.__version__,
                         "holoviews": hv.__version__, "bokeh": bokeh.__version__},
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore parameters and edits from `export_state` output (one run follows).

        Raises InputError naming the first bad field. A state saved with another model
        keeps its parameters; its steering vector is recomputed for this model.
        """
        if not isinstance(state, dict):
            raise InputError(f"a lens state must be a JSON object; got {type(state).__name__}.")
        if state.get("format") != STATE_FORMAT:
            raise InputError(f"`format` must be {STATE_FORMAT!r}; got {state.get('format')!r}.")
        params = state.get("params")
        if not isinstance(params, dict):
            raise InputError("`params` must be an object of lens parameters.")
        unknown = sorted(set(params) - set(_RUN_PARAMS))
        if unknown:
            raise InputError(f"unknown lens parameter {unknown[0]!r}; allowed: "
                             f"{', '.join(_RUN_PARAMS)}.")
        edits = explorer.edits_from_json(json.dumps(state.get("edits", [])))
        same_model = state.get("model") == self._model.spec.name
        if not same_model:
            theme.notify("warning", f"This state was saved with model {state.get('model')!r}; "
                                    f"the page runs {self._model.spec.name!r}. Parameters restored; "
                                    "the steering vector is recomputed.")
        new = {**self._run_params(), **params}
        for e in edits:
            if not isinstance(e, explorer.Steer):
                raise InputError(f"the lens page applies steer edits only; got a {e.kind!r} edit.")
            if e.layer != new["steer_layer"] or e.alpha != new["alpha"]:
                raise InputError("the steer edit does not match `steer_layer`/`alpha` in `params`.")
        new = self._checked_params(new)
        if same_model:
            for e in edits:
                key = (tuple(contrast_prompts(new["contrast_a"])),
                       tuple(contrast_prompts(new["contrast_b"])), e.layer)
                if len(e.vector) == self._model.spec.d_model:
                    with self._cache_lock:
                        self._vectors[key] = np.asarray(e.vector, dtype=np.float32)
        self.param.update(**new)

    def _checked_params(self, p: dict[str, Any]) -> dict[str, Any]:
        """Parameters from a state file, each checked against its bounds before any is set."""
        for name in ("prompt", "contrast_a", "contrast_b"):
            if not isinstance(p[name], str):
                raise InputError(f"`{name}` must be a string; got {type(p[name]).__name__}.")
        out = dict(p)
        for name, check in (("steer_layer", check_int), ("alpha", check_float), ("k", check_int)):
            low, high = self.param[name].bounds
            out[name] = check(name, p[name], low=low, high=high)
        return out

    def _state_file(self) -> io.StringIO:
        return io.StringIO(json.dumps(self.export_state(), indent=1))

    def _upload_state(self, event: param.parameterized.Event) -> None:
        data, filename = event.new, event.obj.filename or ""
        if not data:
            return
        try:
            if not filename.lower().endswith(".json"):
                raise InputError(f"state files are .json; got {filename!r}.")
            if len(data) > _MAX_STATE_BYTES:
                raise InputError(f"{filename!r} is {len(data)} bytes; a state file is at most "
                                 f"{_MAX_STATE_BYTES}.")
            try:
                state = json.loads(data.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise InputError(f"{filename!r} is not valid JSON ({exc}).") from None
            self.load_state(state)
        except (InputError, ValueError, TypeError) as exc:
            theme.notify("error", f"Import failed: {user_message(exc)}")
        else:
            theme.notify("success", f"Loaded {filename}.")
        finally:
            event.obj.clear()  # the same file can be loaded again

    # -- layout ----------------------------------------------------------------------------
    def controls(self) -> pn.Column:
        """The widgets: prompts, steering, top-k, export/import."""
        widgets = {  # sliders apply on release (value_throttled), not while dragging
            "prompt": {"type": pn.widgets.TextInput, "placeholder": "Enter a prompt and press Enter"},
            "contrast_a": {"type": pn.widgets.TextAreaInput, "auto_grow": True, "rows": 2},
            "contrast_b": {"type": pn.widgets.TextAreaInput, "auto_grow": True, "rows": 2},
            "steer_layer": {"type": pn.widgets.IntSlider, "throttled": True},
            "k": {"type": pn.widgets.IntSlider, "throttled": True},
        }
        params = pn.Param(self, parameters=list(widgets), widgets=widgets, show_name=False,
                          sizing_mode="stretch_width")
        layer_at = next(i for i, w in enumerate(params.layout)
                        if getattr(w, "name", None) == self.param.steer_layer.label)
        params.layout.insert(layer_at + 1, self.alpha_slider())
        download = pn.widgets.FileDownload(callback=self._state_file, filename="lens-state.json",
                                           label="Export state (JSON)",
                                           sizing_mode="stretch_width")
        upload = pn.widgets.FileInput(accept=".json,application/json", multiple=False,
                                      sizing_mode="stretch_width")
        upload.param.watch(self._upload_state, "value")
        return pn.Column(params, pn.layout.Divider(), download,
                         pn.pane.Markdown("Import state (JSON):", margin=(0, 10)), upload,
                         width=theme.SIZES["controls_width"], css_classes=["lens-controls"])

    def alpha_slider(self) -> pn.widgets.FloatSlider:
        """The steering-strength slider: a preview while it moves (``value``), the exact
        lens on release (``value_throttled`` sets `alpha`)."""
        if self._alpha_slider is not None:
            return self._alpha_slider
        spec = self.param.alpha
        slider = _DragSlider(label=spec.label, start=spec.bounds[0], end=spec.bounds[1],
                             step=spec.step, value=self.alpha, sizing_mode="stretch_width")

        def dragged(event: param.parameterized.Event) -> None:
            if not self._syncing and event.new != self.alpha:
                self.request_preview(event.new)

        def released(event: param.parameterized.Event) -> None:
            if not self._syncing and event.new is not None:
                self.alpha = event.new

        def synced(event: param.parameterized.Event) -> None:  # alpha set elsewhere (a state)
            self._syncing = True
            try:
                slider.value = event.new
            finally:
                self._syncing = False

        slider.param.watch(dragged, "value")
        slider.param.watch(released, "value_throttled")
        self.param.watch(synced, "alpha")
        self._alpha_slider = slider
        return slider

    def __panel__(self) -> pn.viewable.Viewable:
        spinner = pn.indicators.LoadingSpinner(value=self.param.busy, visible=self.param.busy,
                                               size=theme.SIZES["spinner"], color="primary")
        cancel = pn.widgets.Button(label="Cancel", color="default", width=90,
                                   disabled=self.param.running.rx.not_())
        cancel.on_click(lambda _event: self.cancel())
        plot = pn.pane.HoloViews(pn.bind(self._plot, self.param.plot_version),
                                 sizing_mode="stretch_width", css_classes=["lens-plot"])
        edited = self._edited_panes()
        details = pn.pane.HTML(pn.bind(details_html, self.param.result),
                               stylesheets=[_DETAILS_CSS], sizing_mode="stretch_width")
        caption = pn.pane.Markdown(
            pn.bind(lambda ds, sel: position_caption(sel, lens_tokens(ds)), self.param.result,
                    self.param.selected_positions),
            styles={"color": "#555", "font-size": "0.9em"}, margin=(0, 10),
            css_classes=["lens-positions-caption"])
        status = pn.pane.HTML(pn.bind(html.escape, self.param.status), css_classes=["lens-status"],
                              styles={"color": "#555"}, sizing_mode="stretch_width")
        return pn.Row(
            self.controls(),
            pn.Column(pn.Row(spinner, cancel, status, align="center"), self._positions,
                      caption,
                      # a wide prompt's heatmap (56 px a token) scrolls sideways in its box
                      pn.Column(plot, edited, sizing_mode="stretch_width", scroll="x-auto",
                                css_classes=["lens-scroll"]),
                      details, sizing_mode="stretch_width"),
            sizing_mode="stretch_width",
        )


def slider_preview_times(model: explorer.Model, prompt: str, *, steer_layer: int,
                         vector: np.ndarray | None = None, alphas: Any = None,
                         start_alpha: float = 4.0) -> dict[str, Any]:
    """Server-side time of the steering slider's preview while it moves (`explorer bench
    slider`): the page attached to a Bokeh Document (as in a served session), jobs inline,
    released once at ``start_alpha`` (its exact run fills the clean layers' readouts, as
    the first release does), then dragged through ``alphas``; each move is timed from the
    widget's value change until the heatmap's data are replaced (the preview's lens and
    the in-place redraw). ``vector`` replaces the contrast prompts' steering vector.
    Checks that every move drew a preview in place (no new plot) and returns the moves'
    wall and thread-CPU seconds and the previews, with the exact results after release.
    """
    from bokeh.document import Document
    from panel.io.state import set_curdoc

    alphas = list(np.linspace(start_alpha + 0.25, start_alpha + 4.0, 16) if alphas is None
                  else alphas)
    view = LensView(model, prompt=prompt, steer_layer=steer_layer, background=False)
    if vector is not None:
        key = (tuple(contrast_prompts(view.contrast_a)), tuple(contrast_prompts(view.contrast_b)),
               steer_layer)
        view._vectors[key] = np.asarray(vector, dtype=np.float32)
    doc = Document()
    wall, cpu, previews = [], [], []
    try:
        with set_curdoc(doc):
            doc.add_root(pn.panel(view).get_root(doc))
            slider = view.alpha_slider()
            with param.parameterized.edit_constant(slider):
                slider.param.update(value=start_alpha, value_throttled=start_alpha)
            version = view.plot_version
            for a in alphas:
                t0, c0 = time.perf_counter(), time.thread_time()
                slider.value = float(a)
                wall.append(time.perf_counter() - t0)
                cpu.append(time.thread_time() - c0)
                if not is_preview(view.preview) or view.plot_version != version:
                    raise RuntimeError(f"slider move to {a} drew no preview in place")
                previews.append(view.preview)
            with param.parameterized.edit_constant(slider):
                slider.value_throttled = float(alphas[-1])
            exact = view.result
    finally:
        view.close()
    return {"wall": wall, "cpu": cpu, "previews": previews, "alphas": alphas, "exact": exact}


serve(__name__, LensView, title=f"{theme.TITLE}: logit lens", intro="lens")
