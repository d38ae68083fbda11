"""Saturation events page: when does a model fix each of its top-k tokens?

Lioubashevski et al. (ICML 2025), "Looking Beyond the Top-1: Transformers Determine Top
Tokens in Order": read every layer through the logit lens; the layer from which the final
rank-j token stays at rank j is its saturation layer s_j, and s_1 < s_2 < ... tends to
hold. The page runs `explorer.analyses.saturation.saturation_analysis` over the shipped
corpus (cached in the activation store) and shows, from that one result:

* the text as a token strip coloured by s_1; a click shows the token's layer x rank table
  of lens top-k strings with saturation markers and its staircase of s_1..s_k;
* a k slider (1-10), the strict Kendall tau histogram with its permutation null;
* the task probe's balanced accuracy per layer against a random-feature control;
* the early-exit Pareto plot, theta sliders for the softmax-margin and cosine baselines,
  markers for the probe and the oracle;
* an intervention panel: a pair of tokens, an injection layer, the new s_1 (runs the model);
* a toggle between the trained weights and a random init of the same architecture;
* the prompt's token view (the gallery's sidebar prompt): s_1..s_k of each of its tokens as a
  position x rank heatmap and, with workspace edits (`SaturationView.edits`, e.g. an ablated
  head), the same for the edited model below it, titled with the edits, the cells whose
  saturation layer moved outlined. Above it the prompt's tokens as a strip: a click selects
  or deselects that token position (`SaturationView.selected_positions`, in the gallery the
  workspace's: ``P5``), and the selected positions' columns are outlined dashed on both
  heatmaps.
"""
from __future__ import annotations

import hashlib
import html
import json
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import holoviews as hv
import numpy as np
import pandas as pd
import panel as pn
import param
import xarray as xr

import explorer
from apps import theme
from apps._controls import labelled, tip
from apps._positions import (PagePositions, column_boxes, position_caption, position_outlines,
                             shown_positions)
from apps._session import CancelToken
from apps._view import Scope, View, serve
from explorer._checks import ExplorerError, InputError, check_choice, check_prompts
from explorer.analyses import saturation as sat
from explorer.defaults import DEFAULT_MODEL
from explorer.interventions import Edit
from explorer.models import token_text

__all__ = ["SaturationView", "TokenStrip", "detail_data", "detail_columns", "detail_header",
           "plot_rank_table", "plot_staircase", "plot_tau_histogram", "plot_probe_accuracy",
           "plot_pareto", "plot_intervention", "click_latency", "export_figures", "tau_caption",
           "probe_caption", "pareto_caption", "estimated_seconds", "OPEN_BUDGET_S",
           "prompt_table", "plot_prompt_saturation", "LABELLED_POSITIONS", "changed_cells",
           "prompt_caption",
           "edited_title", "PROMPT_RANKS"]

hv.extension("bokeh", logo=False)

_LABEL_CHARS = 9
_TOOLS = ["hover", "save", "reset"]
_WEIGHTS = ("trained", "random-init")
_NEVER_COLOR = "#bdbdbd"


# -- the token strip (a small custom component: real spans, real clicks) ---------------------

class TokenStrip(pn.custom.JSComponent):
    """Tokens as coloured spans; clicking one sets ``selected`` to its position."""

    tokens = param.List(default=[], doc="Dicts with text, bg, fg, title per token.")
    selected = param.Integer(default=-1, doc="Position of the clicked token (-1: none).")

    _esm = """
    export function render({ model, el }) {
      const draw = () => {
        el.innerHTML = "";
        const box = document.createElement("div");
        box.className = "sat-strip";
        model.tokens.forEach((t, i) => {
          const s = document.createElement("span");
          s.textContent = t.text;
          s.title = t.title;
          s.style.background = t.bg;
          s.style.color = t.fg;
          s.dataset.pos = String(i);
          s.className = "sat-token" + (i === model.selected ? " sat-selected" : "");
          s.addEventListener("click", () => { model.selected = i; });
          box.appendChild(s);
        });
        el.appendChild(box);
      };
      draw();
      model.on("tokens", draw);
      model.on("selected", draw);
    }
    """
    _stylesheets = ["""
    .sat-strip { line-height: 1.9; font-family: ui-monospace, monospace; font-size: 13px; }
    .sat-token { padding: 1px 2px; margin: 0 1px; border-radius: 3px; cursor: pointer;
                 white-space: pre; display: inline-block; }
    .sat-token:hover { outline: 2px solid #444; }
    .sat-selected { outline: 3px solid #000; }
    """]


def _layer_colors(values: np.ndarray, n_layers: int) -> tuple[list[str], list[str]]:
    """Background and text colour per saturation layer (grey for never)."""
    cmap = theme.CMAPS["magnitude"]
    top = max(1, n_layers - 1)
    bg, vals = [], []
    for v in values:
        if v < 0:
            bg.append(_NEVER_COLOR)
            vals.append(float("nan"))
        else:
            bg.append(cmap[min(len(cmap) - 1, int(round(v / top * (len(cmap) - 1))))])
            vals.append(float(v))
    fg = theme.text_colors(vals, cmap, 0.0, float(top))
    return bg, fg


def strip_tokens(ds: xr.Dataset, prompt: int) -> list[dict[str, str]]:
    """The token strip's input for one text: visible token, colours by s_1, a tooltip."""
    one = ds.isel(prompt=prompt)
    n = int(one.mask.values.sum())
    s1 = one.sat_layer.values[:n, 0].astype(int)
    kept = one.kept.values[:n]
    bg, fg = _layer_colors(s1, ds.sizes["layer"])
    toks = one.token.values[:n]
    ids = one.token_id.values[:n]
    out = []
    for i in range(n):
        label = "never" if s1[i] < 0 else str(s1[i])
        out.append({"text": theme.show_token(str(toks[i])), "bg": bg[i], "fg": fg[i],
                    "title": f"pos {i} · id {ids[i]} · s_1 = {label}"
                             f"{'' if kept[i] else ' (filtered out)'}"})
    return out


# -- detail of one token (pure, from the result) -------------------------------------------

def detail_data(ds: xr.Dataset, prompt: int, pos: int, k: int, decode: Any) -> dict[str, Any]:
    """Everything the detail plots need for one token, read from the computed result.

    Returns a dict: ``layer``, ``rank`` (1-based), ``label``, ``probability``, ``saturated``
    (flat arrays, one entry per layer x rank cell), ``sat`` [k] saturation layers,
    ``final`` [k] final token labels, ``layers``, ``token``.
    """
    n_layers = ds.sizes["layer"]
    k = min(k, ds.sizes["rank"])
    top_id = np.asarray(ds.top_token_id.values[prompt, pos, :, :k])  # [layer, k]
    top_p = np.asarray(ds.top_prob.values[prompt, pos, :, :k])
    s = np.asarray(ds.sat_layer.values[prompt, pos, :k]).astype(int)
    final = np.asarray(ds.final_token_id.values[prompt, pos, :k])
    labels = decode(np.concatenate([top_id.ravel(), final]))
    layer = np.repeat(np.arange(n_layers), k)
    rank = np.tile(np.arange(k), n_layers)
    saturated = (s[rank] >= 0) & (layer >= s[rank])
    return {"layers": n_layers, "layer": layer, "rank": rank + 1,
            "label": [labels[int(t)][:_LABEL_CHARS] for t in top_id.ravel()],
            "probability": top_p.ravel().astype(float), "saturated": saturated, "sat": s,
            "final": [labels[int(t)] for t in final],
            "token": theme.show_token(str(ds.token.values[prompt, pos]))}


_RANK_TABLE_OPTS = (
    hv.opts.Rectangles("Cells", color="probability", cmap=theme.CMAPS["probability"], clim=(0, 1),
                       colorbar=True, line_color="white", tools=["hover"]),
    hv.opts.Labels(text_font_size=f"{theme.SIZES['label_font_pt']}pt", text_color="fg"),
    hv.opts.Rectangles("Saturated", fill_alpha=0, line_color=theme.ACCENT, line_width=2),
    hv.opts.Overlay(title="Lens top-k per layer", xlabel="rank (1 = top)",
                    ylabel="layer", toolbar="above",
                    min_height=theme.SIZES["plot_min_height"], responsive=True),
)
_STAIRCASE_OPTS = (
    hv.opts.Scatter(size=9, color=theme.ACCENT, tools=["hover"]),
    hv.opts.Curve(color=theme.ACCENT),          # the steps are drawn by `steps_mid`
    hv.opts.Overlay(title="Saturation staircase", xlabel="rank (1 = top)",
                    ylabel="saturation layer", min_height=theme.SIZES["plot_min_height"],
                    responsive=True),
)


_CLICK_HINT = "Click a token\nin the strip above"

_NO_DETAIL = ('<span data-sat-detail="none"></span>Click a token to see its layer × rank table '
              'and staircase.')


def detail_header(d: dict[str, Any] | None, text: int, pos: int) -> str:
    """The detail's one-line HTML header: token, final top-k strings, s_1..s_k."""
    if d is None:
        return _NO_DETAIL
    k = len(d["sat"])
    sat_text = ", ".join("never" if x < 0 else str(x) for x in d["sat"])
    finals = " ".join(html.escape(repr(t)) for t in d["final"])
    return (f'<span data-sat-detail="{text}:{pos}:{k}"></span><b>Token {pos} '
            f'{html.escape(repr(d["token"]))}</b>: final top-{k} {finals}; s_1..s_{k} = {sat_text}')


def empty_detail(n_layers: int) -> dict[str, Any]:
    """A detail with no cells (before any click)."""
    z = np.zeros(0, dtype=int)
    return {"layers": n_layers, "layer": z, "rank": z, "label": [], "probability": z.astype(float),
            "saturated": z.astype(bool), "sat": z, "final": [], "token": ""}


def steps_mid(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A step line through (x, y) that changes value halfway between points (as HoloViews'
    ``interpolation="steps-mid"`` draws it): 2n points for n."""
    x, y = np.asarray(x, float), np.asarray(y)
    if len(x) == 0:
        return x, y
    xs = np.empty(2 * len(x))
    xs[0], xs[-1] = x[0], x[-1]
    xs[1:-1:2] = xs[2::2] = (x[:-1] + x[1:]) / 2
    return xs, np.repeat(y, 2)


#: The detail plots' glyphs, in the order `detail_columns` returns them.
DETAIL_GLYPHS = ("cells", "labels", "saturated", "steps", "points")


def detail_columns(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Column data of the detail plots' five glyphs for one token (the click path).

    Keys are `DETAIL_GLYPHS`: the rank table's probability cells, their text labels and the
    saturation outlines; the staircase's step line and points. Each value is the
    ``ColumnDataSource.data`` HoloViews gives that glyph for the same elements, so a click
    replaces the data of the rendered plots in place.
    """
    d = data
    rank, layer = np.asarray(d["rank"], float), np.asarray(d["layer"], float)
    x0, x1, y0, y1 = rank - 0.5, rank + 0.5, layer - 0.5, layer + 0.5
    p = np.asarray(d["probability"], float)
    label = list(d["label"])
    m = np.asarray(d["saturated"], bool)
    s = np.asarray(d["sat"]).astype(int)
    ranks = np.arange(1, len(s) + 1)
    ok = s >= 0
    sx, sy = steps_mid(ranks[ok], s[ok])
    return {
        "cells": {"left": x0, "right": x1, "bottom": y0, "top": y1, "x0": x0, "y0": y0,
                  "x1": x1, "y1": y1, "probability": p, "token": label, "color": p},
        "labels": {"rank": rank, "layer": layer, "token": label,
                   "text_color": theme.text_colors(p, theme.CMAPS["probability"])},
        "saturated": {"left": x0[m], "right": x1[m], "bottom": y0[m], "top": y1[m]},
        "steps": {"rank": sx, "saturation layer": sy},
        "points": {"rank": ranks[ok], "saturation layer": s[ok], "saturation_layer": s[ok]},
    }


def rank_table_elements(data: dict[str, Any]) -> hv.Overlay:
    """The rank table's elements without styling.

    Cells are rectangles centred on (rank, layer), so the axes stay numeric and the
    saturation outlines sit exactly on them.
    """
    c = detail_columns(data)
    cells, lab, sat = c["cells"], c["labels"], c["saturated"]
    rects = hv.Rectangles((cells["x0"], cells["y0"], cells["x1"], cells["y1"],
                           cells["probability"], cells["token"]),
                          vdims=["probability", "token"], group="Cells")
    # text colour readable on its cell
    labels = hv.Labels((lab["rank"], lab["layer"], lab["token"], lab["text_color"]),
                       kdims=["rank", "layer"], vdims=["token", "fg"])
    boxes = hv.Rectangles((sat["left"], sat["bottom"], sat["right"], sat["top"]),
                          group="Saturated")
    return rects * labels * boxes


def staircase_elements(data: dict[str, Any]) -> hv.Overlay:
    """The staircase's elements without styling: s_j against rank j (never left out)."""
    c = detail_columns(data)
    steps = hv.Curve((c["steps"]["rank"], c["steps"]["saturation layer"]), kdims=["rank"],
                     vdims=["saturation layer"])
    pts = hv.Scatter((c["points"]["rank"], c["points"]["saturation layer"]), kdims=["rank"],
                     vdims=["saturation layer"])
    return steps * pts


def plot_rank_table(d: dict[str, Any]) -> hv.Overlay:
    """Layer x rank table of the lens top-k strings, coloured by probability; saturated
    cells (the final rank-j token holding rank j from s_j on) outlined."""
    return rank_table_elements(d).opts(*_RANK_TABLE_OPTS).opts(
        hv.opts.Overlay(xlim=(0.5, len(d["sat"]) + 0.5), ylim=(-0.5, d["layers"] - 0.5)))


def plot_staircase(d: dict[str, Any]) -> hv.Overlay:
    """Saturation layer of each rank: the staircase s_1..s_k (never-saturating ranks left out)."""
    return staircase_elements(d).opts(*_STAIRCASE_OPTS).opts(ylim=(-0.5, d["layers"] - 0.5))


# -- corpus-level plots (pure, from the result) ---------------------------------------------

def tau_histogram_data(ds: xr.Dataset, k: int, bins: int = 21) -> dict[str, Any] | None:
    """Histogram counts of per-position tau and of its shuffled null for ``k`` (None if k < 3)."""
    if "k_order" not in ds.dims or k not in ds.k_order.values.tolist():
        return None
    sel = ds.sel(k_order=k)
    obs = sel.tau.values[np.isfinite(sel.tau.values)]
    null = sel.tau_shuffled.values[np.isfinite(sel.tau_shuffled.values)]
    edges = np.linspace(-1, 1, bins + 1)
    return {"k": k, "edges": edges, "observed": np.histogram(obs, edges)[0],
            "null": np.histogram(null, edges)[0], "mean_tau": float(sel.mean_tau),
            "p_value": float(sel.p_value), "n": int(sel.n_order_positions)}


def plot_tau_histogram(h: dict[str, Any] | None) -> hv.Element:
    """Strict Kendall tau per position (observed) over one shuffle per position (null)."""
    if h is None:
        return hv.Text(0, 0, "the order test needs k ≥ 3").opts(
            title="Kendall tau", xaxis=None, yaxis=None,
            min_height=theme.SIZES["plot_min_height"], responsive=True)
    cat = theme.CMAPS["categorical"]
    null = hv.Histogram((h["edges"], h["null"]), kdims=["tau"], vdims=["positions"],
                        label="permutation null").opts(fill_color=cat[1], fill_alpha=0.45,
                                                       line_color=None)
    obs = hv.Histogram((h["edges"], h["observed"]), kdims=["tau"], vdims=["positions"],
                       label="observed").opts(fill_color=cat[0], fill_alpha=0.6, line_color=None)
    mean = hv.VLine(h["mean_tau"]).opts(color="black", line_dash="dashed")
    return (null * obs * mean).opts(
        title=f"Strict Kendall tau, k={h['k']}", xlabel="tau (rank vs saturation layer)",
        ylabel="positions", legend_position="right", min_height=theme.SIZES["plot_min_height"],
        responsive=True)


def tau_caption(h: dict[str, Any] | None) -> str:
    """The order test's numbers, under the histogram."""
    if h is None:
        return "The order test compares at least 3 ranks: raise Top-k to 3 or more."
    return (f"Per position, Kendall tau between rank (1..{h['k']}) and saturation layer (1 = the "
            f"ranks saturate in order), over {h['n']} positions: mean **{h['mean_tau']:.3f}** "
            f"(dashed), permutation p = **{h['p_value']:.4f}**; orange: the same with the "
            f"layers shuffled per position.")


def plot_probe_accuracy(ds: xr.Dataset) -> hv.Element:
    """Balanced accuracy per layer of the task probe, the random-feature control and chance."""
    if "probe_layer_accuracy" not in ds:
        why = ds.attrs.get("probe_error", "too few positions")
        return hv.Text(0, 0, f"no probe: {why[:80]}").opts(
            title="Task probe", xaxis=None, yaxis=None, responsive=True,
            min_height=theme.SIZES["plot_min_height"])
    info = json.loads(str(ds.probe_summary.values))
    layers = ds.layer.values
    cat = theme.CMAPS["categorical"]
    probe = hv.Curve((layers, ds.probe_layer_accuracy.values), "layer", "balanced accuracy",
                     label=f"probe ({info['balanced_accuracy']:.2f} overall)").opts(color=cat[0])
    ctrl = hv.Curve((layers, ds.control_layer_accuracy.values), "layer", "balanced accuracy",
                    label=f"random features ({info['control_balanced_accuracy']:.2f})").opts(
        color=cat[1], line_dash="dotted")
    chance = hv.HLine(info["chance"]).opts(color="grey", line_dash="dashed")
    return (probe * ctrl * chance).opts(
        title="Task probe per layer", ylim=(0, 1.02), legend_position="right", tools=["hover"],
        min_height=theme.SIZES["plot_min_height"], responsive=True)


def probe_caption(ds: xr.Dataset | None) -> str:
    """The probe's numbers, under its plot."""
    if ds is None or "probe_layer_accuracy" not in ds:
        return ""
    info = json.loads(str(ds.probe_summary.values))
    return (f"A linear probe reads from each layer's residual how many leading ranks are "
            f"already decided (classes 0-{len(info['classes']) - 1}): balanced accuracy "
            f"{info['balanced_accuracy']:.2f} overall against {info['control_balanced_accuracy']:.2f} "
            f"for random features; chance {info['chance']:.2f} (dashed).")


def pareto_markers(ds: xr.Dataset, theta_margin: float, theta_cosine: float, *,
                   against: str = "full model") -> dict[str, dict[str, float]]:
    """The two baselines' points at the chosen thresholds (the nearest computed θ):
    ``{"margin": {"theta", "speedup", "accuracy"}, "cosine": {...}}``."""
    suffix = "" if against == "full model" else "_true"
    out = {}
    for rule, theta in (("margin", theta_margin), ("cosine", theta_cosine)):
        grid = ds[f"theta_{rule}"].values
        i = int(np.abs(grid - theta).argmin())
        out[rule] = {"theta": float(grid[i]), "speedup": float(ds[f"{rule}_speedup"].values[i]),
                     "accuracy": float(ds[f"{rule}_accuracy{suffix}"].values[i])}
    return out


def plot_pareto(ds: xr.Dataset, theta_margin: float, theta_cosine: float, *,
                against: str = "full model") -> hv.Element:
    """Early exit: accuracy vs speed-up of the two baselines over theta, the probe and oracle."""
    if "margin_speedup" not in ds:
        return hv.Text(0, 0, "no early-exit result").opts(
            title="Early exit", xaxis=None, yaxis=None, responsive=True,
            min_height=theme.SIZES["plot_min_height"])
    suffix = "" if against == "full model" else "_true"
    key = "accuracy" if against == "full model" else "accuracy_true"
    info = json.loads(str(ds.early_exit_summary.values))
    cat = theme.CMAPS["categorical"]
    ylabel = f"accuracy vs {against}"
    m = hv.Curve((ds.margin_speedup.values, ds[f"margin_accuracy{suffix}"].values), "speed-up",
                 ylabel, label="softmax margin p1 − p2 ≥ θ").opts(color=cat[0])
    c = hv.Curve((ds.cosine_speedup.values, ds[f"cosine_accuracy{suffix}"].values), "speed-up",
                 ylabel, label="cosine(h_l, h_l−1) ≥ θ").opts(color=cat[2])
    at = pareto_markers(ds, theta_margin, theta_cosine, against=against)
    mp = hv.Points([(at["margin"]["speedup"], at["margin"]["accuracy"])],
                   kdims=["speed-up", ylabel]).opts(color=cat[0], size=12, marker="circle")
    cp = hv.Points([(at["cosine"]["speedup"], at["cosine"]["accuracy"])],
                   kdims=["speed-up", ylabel]).opts(color=cat[2], size=12, marker="circle")
    probe = hv.Points([(info["probe"]["speedup"], info["probe"][key])], kdims=["speed-up", ylabel],
                      label="probe").opts(color=cat[3], size=14, marker="diamond")
    oracle = hv.Points([(info["oracle"]["speedup"], info["oracle"][key])], kdims=["speed-up", ylabel],
                       label="oracle (true s_1)").opts(color="black", size=14, marker="star")
    return (m * c * mp * cp * probe * oracle).opts(
        title=f"Early exit: margin θ={at['margin']['theta']:.2f}, "
              f"cosine θ={at['cosine']['theta']:.4f}", legend_position="right",
        ylim=(0, 1.02), logx=True, min_height=theme.SIZES["plot_min_height"], responsive=True,
        tools=["hover"])


def pareto_caption(ds: xr.Dataset | None) -> str:
    """How to read the early-exit plot, under it."""
    if ds is None or "margin_speedup" not in ds:
        return ""
    info = json.loads(str(ds.early_exit_summary.values))
    return (f"Over {info['n_positions']} positions: accuracy of exiting early against the "
            f"speed-up (layers saved), for the two threshold rules as θ varies (the dots: the "
            f"θ sliders), the probe's exit and the oracle that exits at the true s_1.")


def plot_intervention(r: dict[str, Any] | None, decode: Any) -> hv.Element:
    """Rank of the late token's prediction per layer, before and after the injection."""
    if r is None:
        return hv.Text(0, 0, "pick a pair").opts(title="Intervention", xaxis=None, yaxis=None,
                                                 responsive=True, min_height=260)
    cat = theme.CMAPS["categorical"]
    n = len(r["rank_before"])
    before = hv.Curve((np.arange(n), np.asarray(r["rank_before"]) + 1), "layer", "rank + 1",
                      label=f"before (s_1 = {r['s1_before']})").opts(color=cat[0])
    after = hv.Curve((np.arange(n), np.asarray(r["rank_after"]) + 1), "layer", "rank + 1",
                     label=f"after (s_1 = {r['s1_after']})").opts(color=cat[3])
    inj = hv.VLine(r["layer"]).opts(color="black", line_dash="dashed")
    return (before * after * inj).opts(
        title=f"Injection at layer {r['layer']}", logy=True, legend_position="right",
        responsive=True, min_height=260)


# -- the prompt's token view, clean and edited (pure, from saturation_layers results) ---------

PROMPT_RANKS = 10
"""Ranks the prompt's saturation layers are computed for (the k slider shows up to them)."""

_TITLE_EDITS = 2  # workspace edits named in the edited heatmap's title (all in its caption)
_PROMPT_TOOLS = ["save", "reset"]


def prompt_table(ds: xr.Dataset, k: int, decode: Any) -> pd.DataFrame:
    """One row per (position, rank) of a one-prompt `saturation_layers` result: the heatmap's
    input. Columns ``pos``, ``rank`` (1-based), ``input`` (the token at ``pos``), ``final``
    (the output's rank-j token there), ``s`` (its saturation layer; NaN: never), ``label``
    (the layer, or "never"), ``fg`` (a text colour readable on the cell)."""
    one = ds.isel(prompt=0)
    n = int(one.mask.values.sum())
    k = min(k, ds.sizes["rank"])
    s = one.sat_layer.values[:n, :k].astype(int)                          # [pos, k]
    final = one.final_token_id.values[:n, :k]
    labels = decode(final)
    inputs = theme.show_tokens(one.token.values[:n])
    vals = np.where(s < 0, np.nan, s).astype(float).ravel()
    top = max(1, ds.sizes["layer"] - 1)
    return pd.DataFrame({
        "pos": np.repeat(np.arange(n), k), "rank": np.tile(np.arange(1, k + 1), n),
        "input": np.repeat(np.array(inputs, dtype=object), k),
        "final": [labels[int(t)] for t in final.ravel()], "s": vals,
        "label": ["never" if v < 0 else str(v) for v in s.ravel()],
        "fg": theme.text_colors(vals, theme.CMAPS["magnitude"], 0.0, float(top))}).astype(
        {"input": object, "final": object, "label": object, "fg": object})


def changed_cells(clean: xr.Dataset | None, edited: xr.Dataset | None,
                  k: int) -> list[tuple[int, int]] | None:
    """(pos, rank) (rank 1-based) of every cell whose saturation layer differs between two
    one-prompt results of the same tokens; None when they cannot be compared."""
    if clean is None or edited is None:
        return None
    a, b = clean.isel(prompt=0), edited.isel(prompt=0)
    n = int(a.mask.values.sum())
    if n != int(b.mask.values.sum()) or not np.array_equal(a.token_id.values[:n],
                                                           b.token_id.values[:n]):
        return None
    k = min(k, clean.sizes["rank"], edited.sizes["rank"])
    moved = a.sat_layer.values[:n, :k] != b.sat_layer.values[:n, :k]
    return [(int(p), int(r) + 1) for p, r in zip(*np.nonzero(moved))]


def _final_moved(clean: xr.Dataset, edited: xr.Dataset, k: int) -> int:
    """Cells whose final rank-j token differs (same tokens assumed)."""
    n = int(clean.mask.values[0].sum())
    return int((clean.final_token_id.values[0, :n, :k]
                != edited.final_token_id.values[0, :n, :k]).sum())


def edited_title(labels: Sequence[str]) -> str:
    """The edited heatmap's title: ``edited: ablate L1.H0 (zero)`` (the caption lists all)."""
    shown = ", ".join(labels[:_TITLE_EDITS])
    if len(labels) > _TITLE_EDITS:
        shown += f" +{len(labels) - _TITLE_EDITS} more"
    return f"edited: {shown}"


def prompt_caption(clean: xr.Dataset | None, edited: xr.Dataset | None, k: int) -> str:
    """Under the edited heatmap: every workspace edit, and how many cells moved."""
    if clean is None or edited is None:
        return ""
    labels = list(edited.attrs.get("workspace_edits", []))
    text = ("Edited run, same prompt, with " + "; then ".join(
        f"`{html.escape(t)}`" for t in labels) + ".")
    moved = changed_cells(clean, edited, k)
    if moved is not None:
        k = min(k, clean.sizes["rank"])
        cells = int(clean.mask.values[0].sum()) * k
        text += (f" The saturation layer differs from the clean run in {len(moved)} of {cells} "
                 f"cells (outlined); the final rank-j token itself in "
                 f"{_final_moved(clean, edited, k)}.")
    return text


LABELLED_POSITIONS = 24
"""Up to this many prompt tokens the prompt heatmap writes each cell's layer in it; past it
the cells are narrower than a two-digit label (the plot's frame is ~430 px wide in a 1280 px
window: 18 px a cell at 24 tokens), which ran together, so the colour and the hover carry it."""


def plot_prompt_saturation(ds: xr.Dataset | None, k: int, decode: Any, *, title: str,
                           changed: Sequence[tuple[int, int]] = (),
                           positions: Sequence[int] = ()) -> hv.Element:
    """Position x rank heatmap of a one-prompt result: cell (pos, j) is the layer from which
    the output's rank-j token at ``pos`` holds rank j (s_j; grey: never); ``changed`` cells
    are outlined, the selected ``positions``' columns outlined dashed. Hover names the input
    token and the final rank-j token. Cells carry their layer as text up to
    `LABELLED_POSITIONS` tokens."""
    if ds is None:
        return theme.placeholder("Computing the prompt's saturation layers…", height=200)
    table = prompt_table(ds, k, decode)
    n_layers = ds.sizes["layer"]
    n = int(table["pos"].max()) + 1 if len(table) else 0
    k = int(table["rank"].max()) if len(table) else k
    ticks = [(i, t) for i, t in enumerate(theme.show_tokens(ds.token.values[0, :n]))]
    sizes = theme.SIZES
    height = sizes["cell_height"] * k + 150
    heat = hv.HeatMap(table, ["pos", "rank"], ["s", "input", "final", "label"]).opts(
        cmap=theme.CMAPS["magnitude"], clim=(0, max(1, n_layers - 1)), colorbar=True,
        clabel="saturation layer", clipping_colors={"NaN": _NEVER_COLOR},
        xticks=ticks, yticks=list(range(1, k + 1)), invert_yaxis=True,
        xrotation=45 if n > 8 else 0, xlabel="position (input token)", ylabel="rank (1 = top)",
        title=title, tools=["hover"], line_color="white", line_width=0.5,
        hover_tooltips=[("input", "@pos: @input"), ("rank", "@rank"), ("final token", "@final"),
                        ("saturation layer", "@label")],
        responsive=True, height=height, toolbar="above", default_tools=_PROMPT_TOOLS,
        active_tools=[], padding=0, fontsize={"title": f"{sizes['title_font_pt']}pt"})
    labels = hv.Labels(table, ["pos", "rank"], ["label", "fg"]).opts(
        text_color="fg", text_font_size=f"{sizes['label_font_pt']}pt",
        default_tools=_PROMPT_TOOLS)
    plot = heat * labels if n <= LABELLED_POSITIONS else heat
    if changed:
        plot *= hv.Rectangles([(p - 0.5, r - 0.5, p + 0.5, r + 0.5) for p, r in changed]).opts(
            fill_alpha=0, line_color=theme.ACCENT, line_width=3, default_tools=_PROMPT_TOOLS)
    shown = shown_positions(positions, n)
    if shown:
        plot *= position_outlines(column_boxes(shown, 0.5, k + 0.5)).opts(
            default_tools=_PROMPT_TOOLS)
    # no active scroll zoom: the wheel keeps scrolling the page
    return plot.opts(responsive=True, height=height, active_tools=[],
                     xlim=(-0.5, n - 0.5), ylim=(0.5, k + 0.5))


# -- the view -------------------------------------------------------------------------------

# SmolLM2-135M (30 layers, d_model 576, vocab 49152) takes ~70 s over 1,024 tokens on a
# laptop CPU, ~8 s of it the statistics (order test, probe, early exit) whatever the model;
# the model part is scaled by the per-token cost of the forward (12 d_model^2 a layer) and of
# the lens readout (d_model x vocab a layer).
_REF_SECONDS, _STATS_SECONDS, _REF_TOKENS = 62.0, 8.0, 1024
_REF_COST = 30 * 576 * (49152 + 12 * 576)
OPEN_BUDGET_S = 5.0
"""An analysis estimated under this many seconds runs when the page opens; a longer one
waits for the *Analyse* button (unless its result is in the store)."""


def estimated_seconds(n_layers: int, d_model: int, vocab_size: int, n_tokens: int) -> float:
    """Rough CPU seconds of `saturation_analysis` over ``n_tokens`` tokens."""
    cost = n_layers * d_model * (vocab_size + 12 * d_model)
    return (_REF_SECONDS * cost / _REF_COST + _STATS_SECONDS) * n_tokens / _REF_TOKENS


def prompt_saturation(model: explorer.Model, prompt: str, *,
                      edits: Sequence[Edit] = ()) -> xr.Dataset:
    """The page's token view of one prompt: `saturation_layers` over `PROMPT_RANKS` ranks
    (no probe sample), with ``edits`` applied in the trace."""
    k = min(PROMPT_RANKS, model.vocab_size)
    return sat.saturation_layers(model, [prompt], k=k, rank_cap=min(model.vocab_size, max(50, k)),
                                 sample_positions=0,
                                 edits=list(edits), progress=False)


class _CachedOnly:
    """A store that answers from its entries and never computes (`LookupError` on a miss)."""

    def __init__(self, store: Any):
        self._store = store

    def get_or_compute(self, parts: dict, compute: Any, **_: Any) -> xr.Dataset:
        hit = self._store.get(self._store.key(parts))
        if hit is None:
            raise LookupError("not cached")
        return hit


def _caption(text: Any) -> pn.pane.Markdown:
    """A caption under a plot: its numbers and how to read it (the title stays short)."""
    return pn.pane.Markdown(text, sizing_mode="stretch_width", margin=(0, 10),
                            styles={"font-size": "0.9em", "color": "#444"})


class SaturationView(View):
    """Saturation events over the shipped corpus, for the trained or a random-init model.

    Parameters
    ----------
    model : explorer.Model
    texts : list of str, optional
        Prompts to analyse instead of the shipped corpus (cut to ``n_tokens``).
    store : ActivationStore or None, optional
        Cache of results (default: the user's store; None when it cannot be used).
    background : bool, optional
        Compute in a worker thread (default when served) or inline (notebooks, tests).
    analysis_options : dict, optional
        Passed to `saturation_analysis` (e.g. ``n_permutations``, ``n_pairs``).
    result : xarray.Dataset, optional
        A computed `saturation_analysis` result to show instead of running the analysis
        (until ``weights`` or ``n_tokens`` change).
    compute_on_open : bool, optional
        Run the analysis as the page opens; default: when its result is in the store or it
        is estimated under `OPEN_BUDGET_S` seconds (`estimated_seconds`), else on the
        *Analyse* button.
    """

    weights = param.Selector(default="trained", objects=list(_WEIGHTS), label="Weights",
                             doc="The model's trained weights or a random init of the same "
                                 "architecture (the paper finds ordering in both).")
    n_tokens = param.Integer(default=1024, bounds=(64, 50_000), label="Corpus tokens analysed",
                             doc="Tokens of the shipped corpus run through the analysis.")
    text = param.Integer(default=0, bounds=(0, None), label="Text",
                         doc="Which text (chunk) of the corpus the token strip shows.")
    k = param.Integer(default=5, bounds=(1, 10), label="Top-k",
                      doc="Ranks shown in the detail and used by the order test.")
    selected = param.Integer(default=-1, precedence=-1, doc="Clicked token position.")
    selected_positions = param.List(default=[], item_type=int, precedence=-1,
                                    doc="Selected token positions of the prompt (0-based; the "
                                        "workspace's in the gallery), outlined on its heatmaps.")
    theta_margin = param.Number(default=0.5, bounds=(0.0, 1.0), step=0.02, label="Margin θ",
                                doc="Softmax-margin exit threshold: exit once p1 − p2 ≥ θ.")
    theta_cosine = param.Number(default=0.99, bounds=(0.5, 1.0), step=0.0005, label="Cosine θ",
                                doc="State-saturation exit threshold: exit once "
                                    "cos(h_l, h_l−1) ≥ θ.")
    against = param.Selector(default="full model", objects=["full model", "true next token"],
                             label="Early-exit accuracy against",
                             doc="What an early exit must match to count as right: the full "
                                 "model's prediction or the text's true next token.")
    pair = param.Integer(default=0, bounds=(0, None), label="Intervention pair",
                         doc="Early/late-saturating token pair for the intervention.")
    inj_layer = param.Integer(default=0, bounds=(0, None), label="Injection layer",
                              doc="Block after which the early token's residual replaces the "
                                  "late token's (the intervention plot).")

    prompt = param.String(default="The capital of France is", label="Prompt",
                          doc="Prompt whose tokens' saturation layers s_1..s_k the page shows "
                              "(the gallery's sidebar prompt), clean and with the edits.")

    result = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True, precedence=-1)
    intervention = param.Dict(default=None, allow_None=True, precedence=-1)
    edits = param.List(default=[], item_type=Edit, precedence=-1,
                       doc="Workspace edits (intervention records): with any, a second heatmap "
                           "shows the prompt's saturation layers with them applied.")
    prompt_result = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True,
                                        precedence=-1,
                                        doc="`saturation_layers` of the prompt, unedited.")
    prompt_edited = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True,
                                        precedence=-1,
                                        doc="The same with `edits` applied; None without edits.")

    notify_title = "Saturation"
    failed_status = "Last run failed: {message}"
    link_params = ("weights", "n_tokens", "text", "k", "theta_margin", "theta_cosine", "against",
                   "pair", "inj_layer")

    def scope(self) -> Scope:
        """The corpus (its statistics) and your prompt (its token view); the edits apply to
        the prompt's token view only."""
        corpus = "your texts" if self._texts is not None else "the shipped corpus"
        return Scope(on=f"{corpus} ({self.n_tokens} tokens) for the statistics; your prompt "
                        "for its token view",
                     edits="applied to your prompt's token view (a second heatmap); not "
                           "applicable to the corpus statistics: they are the unedited "
                           "model's, cached once per model")

    def __init__(self, model: explorer.Model, *, texts: list[str] | None = None,
                 store: Any = "default", background: bool | None = None,
                 analysis_options: dict[str, Any] | None = None,
                 result: xr.Dataset | None = None, compute_on_open: bool | None = None,
                 **params: Any):
        super().__init__(background=background, **params)
        self._model = model
        self._twin: explorer.Model | None = None
        self._texts = texts
        self._options = dict(analysis_options or {})
        if store == "default":
            try:
                store = explorer.ActivationStore()
            except ExplorerError:
                store = None
        self._store = store
        self._lock = threading.Lock()
        self._cleans: dict[tuple, Any] = {}
        self._labels: dict[int, str] = {}
        self.runner("analysis", self._show_result, heavy=True)   # a corpus: waits its turn
        self.runner("intervention", self._show_intervention, busy=False)
        self.runner("prompt", self._show_prompt)
        self._prompt_cleans: dict[tuple[str, str], xr.Dataset] = {}   # (weights, prompt)
        n_layers = model.spec.n_layers
        self.param.inj_layer.bounds = (0, max(0, n_layers - 2))
        self.param.watch(self._request_run, ["weights", "n_tokens"])
        self.param.watch(self._request_intervention, ["inj_layer"])
        self.param.watch(self._pair_changed, ["pair"])
        self.param.watch(self._text_changed, ["text"])
        # the click path: a fixed header pane and the detail plots' data sources, updated
        # in place (no new Bokeh model, so no re-walk of the document's models)
        self._header = pn.pane.HTML(_NO_DETAIL, sizing_mode="stretch_width",
                                    css_classes=["sat-detail-header"])
        self._columns = detail_columns(empty_detail(n_layers))
        self._sources: dict[str, list[weakref.ref]] = {g: [] for g in DETAIL_GLYPHS}
        # the "click a token" hints drawn in the empty detail plots: (source, its text data)
        self._hint_sources: list[tuple[weakref.ref, dict[str, Any]]] = []
        self._detail_row: pn.Row | None = None
        self._strip_widget: TokenStrip | None = None
        # the prompt's tokens: one strip for the page's life, a click toggles a position
        self._position_links = PagePositions(self, self.prompt_tokens,
                                             refresh_on="prompt_result",
                                             css_class="sat-prompt-tokens")
        self._positions = self._position_links.strip
        self.param.watch(self._send_detail, ["result", "text", "selected", "k"])
        self._run_button = pn.widgets.Button(
            color="primary", sizing_mode="stretch_width",
            description="Run the logit lens over the corpus and every analysis of the page "
                        "(cached in the activation store: the next open is instant).")
        self._run_button.on_click(lambda *_: self._request_run())
        self._name_button()
        self.param.watch(self._name_button, ["n_tokens"])
        self.param.watch(self._request_prompt, ["prompt", "edits", "weights"])
        self._request_prompt()
        if result is not None:
            self._show_result((self.weights, result, 0.0))
        elif compute_on_open or (compute_on_open is None and self._estimate() <= OPEN_BUDGET_S):
            self._request_run()
        elif compute_on_open is None and self._show_cached():
            pass
        else:
            self.status = (f"Press **Analyse** to run the analysis over {self.n_tokens:,} tokens "
                           f"(about {self._estimate():.0f} s on a CPU; then cached).")

    # -- model and data ---------------------------------------------------------------------
    @property
    def model(self) -> explorer.Model:
        return self._model

    def current_model(self) -> explorer.Model:
        """The trained model or its random-init twin (built once, seeded)."""
        if self.weights == "trained":
            return self._model
        with self._lock:
            if self._twin is None:
                self._twin = sat.random_init_twin(self._model, seed=0)
            return self._twin

    def texts(self) -> list[str]:
        docs = self._texts if self._texts is not None else sat.load_corpus()
        return sat.corpus_chunks(self._model, docs, max_tokens=self.n_tokens)

    def decode(self, ids: Any) -> dict[int, str]:
        """Visible token strings for ids (cached)."""
        out = {}
        for i in np.asarray(ids).reshape(-1).tolist():
            i = int(i)
            if i not in self._labels:
                self._labels[i] = (theme.show_token(token_text(self._model.tokenizer, i))
                                   if i >= 0 else "∅")
            out[i] = self._labels[i]
        return out

    # -- the analysis -------------------------------------------------------------------------
    def _estimate(self) -> float:
        """Estimated seconds of the analysis at the current settings."""
        spec = self._model.spec
        try:
            return estimated_seconds(spec.n_layers, spec.d_model, self._model.vocab_size,
                                     self.n_tokens)
        except AttributeError:      # a stand-in model without the shape: assume it is slow
            return float("inf")

    def _name_button(self, *events: Any) -> None:
        est = self._estimate()
        about = f" (about {est:.0f} s)" if est < 1e6 else ""
        self._run_button.label = f"Analyse {self.n_tokens:,} tokens{about}"

    def _show_cached(self) -> bool:
        """Show the stored result of the current settings if there is one (no model run)."""
        if self._store is None or self.weights != "trained":
            return False
        try:
            ds = sat.saturation_analysis(self._model, self.texts(), store=_CachedOnly(self._store),
                                         **self._options)
        except (LookupError, ExplorerError, OSError, ValueError):
            return False
        self._show_result((self.weights, ds.load(), -1.0))
        return True

    def _request_run(self, *events: Any) -> None:
        self.running = True
        self.progress = 0
        self._run_button.disabled = True
        weights, started = self.weights, time.perf_counter()
        bar = self.progress_fn()

        def report(done: int, total: int) -> None:
            bar(done, total)
            left = (time.perf_counter() - started) * (total - done) / max(1, done)
            self.post(status=f"Logit lens over the corpus: {done}/{total}, about {left:.0f} s "
                             "left" if done < total else
                             "Order test, task probe, early exit and intervention…")

        def job(token: CancelToken):
            model = self.current_model()
            texts = self.texts()
            token.check()
            self.post(status=f"Analysing {self.n_tokens:,} tokens…")
            ds = sat.saturation_analysis(model, texts, store=self._store, progress=report,
                                         **self._options)
            return weights, ds.load(), time.perf_counter() - started

        self.submit("analysis", job)

    def show_error(self, exc: BaseException) -> None:
        super().show_error(exc)
        self._run_button.disabled = False

    def _show_result(self, out: tuple[str, xr.Dataset, float]) -> None:
        weights, ds, seconds = out
        n_texts = ds.sizes["prompt"]
        self.param.text.bounds = (0, n_texts - 1)
        summary = ds.attrs.get("summary", {})
        text = min(self.text, n_texts - 1)
        self._run_button.disabled = False
        self.param.update(result=ds, error="", running=False, progress=100, text=text,
                          selected=-1, pair=0, intervention=None,
                          status=f"{ds.attrs.get('model', '?')} ({weights}) · {summary.get('n_tokens')} "
                                 f"tokens · kept {summary.get('kept_fraction', 0):.0%} · "
                                 + ("from the store" if seconds < 0 else f"{seconds:.1f} s"))
        self.param.pair.bounds = (0, max(0, ds.sizes.get("pair", 1) - 1))
        self._pair_changed()

    def close(self) -> None:
        super().close()
        with self._lock:
            self._cleans.clear()
            self._prompt_cleans.clear()

    # -- reproducibility ------------------------------------------------------------------------
    def code_snippet(self) -> str:
        """The page's calls as Python: the corpus analysis behind the strip, the order test,
        probe, early exit and injection, and the prompt's token view clean and edited."""
        spec = self._model.spec
        corpus = repr(self._texts) if self._texts is not None else "sat.load_corpus()"
        options = "".join(f", {k}={v!r}" for k, v in self._options.items())
        k = min(PROMPT_RANKS, self._model.vocab_size)
        cap = min(self._model.vocab_size, max(50, k))
        lines = ["import explorer", "from explorer.analyses import saturation as sat", "",
                 f"model = explorer.load_model({spec.name!r})"]
        if self.weights != "trained":
            lines.append("model = sat.random_init_twin(model, seed=0)  # the random-init weights")
        lines += [
            f"texts = sat.corpus_chunks(model, {corpus}, max_tokens={self.n_tokens})",
            f"result = sat.saturation_analysis(model, texts{options})  # strip, tau, probe, exit",
            f"text, k = {self.text}, {self.k}",
            "n = int(result.mask.isel(prompt=text).sum())",
            "strip = result.sat_layer.isel(prompt=text, pos=slice(0, n), rank=0)  # s_1; -1: never"]
        if self.selected >= 0:
            lines.append(f"clicked = result.isel(prompt=text, pos={self.selected}, "
                         "rank=slice(0, k))  # the rank table and staircase")
        pairs = self.pairs()
        if pairs and self.intervention is not None:
            pt, e, l = pairs[min(self.pair, len(pairs) - 1)]
            lines.append(f"injection = sat.inject_residual(model, texts[{pt}], source_pos={e}, "
                         f"target_pos={l}, layer={self.inj_layer})")
        lines += [
            "",
            f"prompt = {self.prompt!r}",
            f"clean = sat.saturation_layers(model, [prompt], k={k}, rank_cap={cap}, "
            "sample_positions=0)",
            "shown = clean.sat_layer.isel(prompt=0, rank=slice(0, k))  # [pos, rank]; -1: never"]
        if self.edits:
            lines += [
                f"edits = explorer.edits_from_json({explorer.edits_to_json(self.edits)!r})",
                f"edited = sat.saturation_layers(model, [prompt], k={k}, rank_cap={cap}, "
                "sample_positions=0, edits=edits)",
                "edited_shown = edited.sat_layer.isel(prompt=0, rank=slice(0, k))",
                "changed = shown != edited_shown  # the outlined cells"]
        return "\n".join(lines) + "\n"

    # -- the prompt's token view ----------------------------------------------------------------
    def _request_prompt(self, *events: Any) -> None:
        """Saturation layers of the prompt, clean and (with workspace edits) edited."""
        prompt, weights, edits = self.prompt, self.weights, list(self.edits)

        def job(token: CancelToken) -> tuple[xr.Dataset, xr.Dataset | None]:
            check_prompts(prompt)
            model = self.current_model()
            with self._lock:
                clean = self._prompt_cleans.get((weights, prompt))
            if clean is None:
                clean = prompt_saturation(model, prompt)
                with self._lock:
                    if len(self._prompt_cleans) > 8:
                        self._prompt_cleans.clear()
                    self._prompt_cleans[(weights, prompt)] = clean
            token.check()
            edited = None
            if edits:
                from explorer.workspace import edit_label

                edited = prompt_saturation(model, prompt, edits=edits)
                edited.attrs["workspace_edits"] = [edit_label(e) for e in edits]
            return clean, edited

        self.submit("prompt", job)

    def _show_prompt(self, out: tuple[xr.Dataset, xr.Dataset | None]) -> None:
        clean, edited = out
        self.param.update(prompt_result=clean, prompt_edited=edited)

    def _text_changed(self, *events: Any) -> None:
        self.selected = -1

    # -- the prompt's token positions ------------------------------------------------------
    def prompt_tokens(self) -> list[str]:
        """The prompt's tokens as shown (those of the last prompt result; [] before one)."""
        ds = self.prompt_result
        if ds is None:
            return []
        n = int(ds.mask.values[0].sum())
        return theme.show_tokens(ds.token.values[0, :n])

    def toggle_position(self, pos: int) -> None:
        """Select token position ``pos`` of the prompt, or deselect it (a click on it)."""
        self._position_links.toggle(pos)

    # -- intervention -------------------------------------------------------------------------
    def pairs(self) -> list[tuple[int, int, int]]:
        ds = self.result
        if ds is None or not ds.sizes.get("pair", 0):
            return []
        return list(zip(ds.pair_prompt.values.tolist(), ds.pair_early.values.tolist(),
                        ds.pair_late.values.tolist()))

    def pair_label(self, i: int) -> str:
        ds = self.result
        p, e, l = self.pairs()[i]
        tok = ds.token.values
        s1 = ds.sat_layer.values[..., 0]
        return (f"text {p}: {theme.show_token(str(tok[p, e]))!r} @ {e} (s_1={s1[p, e]}) → "
                f"{theme.show_token(str(tok[p, l]))!r} @ {l} (s_1={s1[p, l]})")

    def _pair_changed(self, *events: Any) -> None:
        pairs = self.pairs()
        if not pairs:
            self.intervention = None
            return
        p, e, _ = pairs[min(self.pair, len(pairs) - 1)]
        s_early = int(self.result.sat_layer.values[p, e, 0])
        layer = min(max(0, s_early), self._model.spec.n_layers - 2)
        if layer == self.inj_layer:
            self._request_intervention()
        else:
            self.inj_layer = layer          # triggers the run

    def _request_intervention(self, *events: Any) -> None:
        pairs = self.pairs()
        if not pairs:
            return
        p, e, l = pairs[min(self.pair, len(pairs) - 1)]
        ds, layer, weights = self.result, self.inj_layer, self.weights
        text = self.texts()[p]
        base = {"rank": ds.final_rank.values[p, l, :, 0].astype(int).tolist(),
                "top1": int(ds.final_token_id.values[p, l, 0])}

        def job(token: CancelToken):
            model = self.current_model()
            key = (weights, text)
            with self._lock:
                clean = self._cleans.get(key)
            if clean is None and not model.remote:  # a remote injection does not resume
                clean = explorer.clean_run(model, [text])
                with self._lock:
                    if len(self._cleans) > 4:
                        self._cleans.clear()
                    self._cleans[key] = clean
            token.check()
            return sat.inject_residual(model, text, source_pos=e, target_pos=l, layer=layer,
                                       clean=clean, baseline=base)

        self.submit("intervention", job)

    def _show_intervention(self, r: dict[str, Any]) -> None:
        self.intervention = r

    # -- panes ----------------------------------------------------------------------------------
    def detail(self) -> dict[str, Any] | None:
        """The clicked token's detail data (None before a click)."""
        ds = self.result
        if ds is None or self.selected < 0:
            return None
        n = int(ds.mask.values[self.text].sum())
        if self.selected >= n:
            return None
        return detail_data(ds, self.text, self.selected, self.k, self.decode)

    @param.depends("result", "text", "running")
    def _strip(self):
        if self.result is None:
            return pn.pane.Markdown("Computing…" if self.running else
                                    "The corpus text appears here once the analysis has run.")
        strip = TokenStrip(tokens=strip_tokens(self.result, self.text), selected=self.selected,
                           sizing_mode="stretch_width")
        strip.param.watch(lambda e: setattr(self, "selected", e.new), "selected")
        self._strip_widget = strip
        return strip

    def _detail_plots(self) -> pn.Row:
        """Rank table and staircase, built once; a click replaces their glyphs' data.

        Each rendering of the plots (one per page session) registers its five Bokeh data
        sources through a HoloViews hook; `_send_detail` sets their ``data`` from
        `detail_columns`: no new figure or model, no DynamicMap update, no re-trace.
        """
        if self._detail_row is not None:
            return self._detail_row
        n_layers = self._model.spec.n_layers
        limits = dict(xlim=(0.5, self.param.k.bounds[1] + 0.5), ylim=(-0.5, n_layers - 0.5))
        height = max(theme.SIZES["plot_min_height"], 18 * n_layers)      # one readable row a layer
        hook = {g: [self._source_hook(g)] for g in DETAIL_GLYPHS}
        # drawn from two cells left of the axis (one white, one black label), so that
        # HoloViews reads the label colours as colours, not as numbers to map; the hooks
        # then put the current detail in
        empty = empty_detail(n_layers)
        empty.update(layer=np.zeros(2, int), rank=np.zeros(2, int), label=["", ""],
                     probability=np.array([0.0, 1.0]), saturated=np.zeros(2, bool))
        # until a click, each plot says so in its frame (the text is emptied on a click)
        hint = hv.Text(sum(limits["xlim"]) / 2, (n_layers - 1) / 2, _CLICK_HINT).opts(
            text_color="#555555", text_font_size=f"{theme.SIZES['axis_font_pt']}pt",
            hooks=[self._hint_hook])
        table = (rank_table_elements(empty) * hint).opts(*_RANK_TABLE_OPTS).opts(
            hv.opts.Overlay(min_height=height, **limits),
            hv.opts.Rectangles("Cells", hooks=hook["cells"]),
            hv.opts.Labels(hooks=hook["labels"]),
            hv.opts.Rectangles("Saturated", hooks=hook["saturated"]))
        stair = (staircase_elements(empty) * hint).opts(*_STAIRCASE_OPTS).opts(
            hv.opts.Overlay(min_height=height, **limits), hv.opts.Curve(hooks=hook["steps"]),
            hv.opts.Scatter(hooks=hook["points"]))
        # not linked to the page's other plots with a "rank" axis: linking gave the
        # staircase another plot's range, drawn from 10 down to 0
        self._detail_row = pn.Row(pn.pane.HoloViews(table, sizing_mode="stretch_width",
                                                    linked_axes=False,
                                                    css_classes=["sat-rank-table"]),
                                  pn.pane.HoloViews(stair, sizing_mode="stretch_width",
                                                    linked_axes=False,
                                                    css_classes=["sat-staircase"]),
                                  sizing_mode="stretch_width")
        return self._detail_row

    def _source_hook(self, glyph: str):
        """A HoloViews hook that keeps the rendered glyph's data source and fills it."""
        def hook(plot: Any, element: Any) -> None:
            source = plot.handles.get("source")
            if source is None:
                return
            refs = self._sources[glyph]
            if not any(r() is source for r in refs):
                refs.append(weakref.ref(source))
            source.data = self._columns[glyph]
        return hook

    def _hint_hook(self, plot: Any, element: Any) -> None:
        """Keep the rendered hint's data source; empty it while a token's detail is shown."""
        source = plot.handles.get("source")
        if source is None:
            return
        if not any(ref() is source for ref, _ in self._hint_sources):
            self._hint_sources.append((weakref.ref(source), dict(source.data)))
        self._show_hints(len(self._columns["cells"]["probability"]) == 0)

    def _show_hints(self, show: bool) -> None:
        self._hint_sources[:] = [(ref, data) for ref, data in self._hint_sources
                                 if ref() is not None]
        for ref, data in self._hint_sources:
            ref().data = data if show else {key: [] for key in data}

    def hints_shown(self) -> list[bool]:
        """Whether each rendered detail plot shows its "click a token" text."""
        return [bool(len(ref().data.get("text", []))) for ref, _ in self._hint_sources
                if ref() is not None]

    def detail_sources(self) -> dict[str, list[Any]]:
        """The rendered detail plots' Bokeh data sources per glyph (live ones only)."""
        out = {}
        for glyph, refs in self._sources.items():
            refs[:] = [r for r in refs if r() is not None]
            out[glyph] = [r() for r in refs]
        return out

    def _send_detail(self, *events: Any) -> None:
        d = self.detail()
        self._header.object = detail_header(d, self.text, self.selected)
        n_layers = self.result.sizes["layer"] if self.result is not None else \
            self._model.spec.n_layers
        self._columns = detail_columns(d if d is not None else empty_detail(n_layers))
        for glyph, sources in self.detail_sources().items():
            for source in sources:
                source.data = self._columns[glyph]
        self._show_hints(d is None)

    @param.depends("prompt_result", "selected_positions")
    def _position_caption(self):
        return _caption(position_caption(self.selected_positions, self.prompt_tokens()))

    @param.depends("prompt_result", "prompt_edited", "k", "selected_positions")
    def _prompt_view(self):
        """The prompt's s_1..s_k heatmap; with edits, the edited one below, titled with them."""
        clean, edited = self.prompt_result, self.prompt_edited
        k = self.k
        if edited is None:
            title = f"Saturation layers of the prompt's tokens, top-{k}"
        else:
            title = f"clean: no workspace edits · top-{k}"
        # linked_axes=False: the rank axis is not the detail table's (Panel links the axes
        # of every HoloViews pane in a page that share a dimension name)
        positions = list(self.selected_positions)
        panes = [pn.pane.HoloViews(plot_prompt_saturation(clean, k, self.decode, title=title,
                                                          positions=positions),
                                   sizing_mode="stretch_width", linked_axes=False,
                                   css_classes=["sat-prompt-clean"])]
        if edited is not None:
            moved = changed_cells(clean, edited, k) or []
            labels = list(edited.attrs.get("workspace_edits", []))
            marker = ",".join(f"{p}:{r}" for p, r in moved)
            panes += [
                pn.pane.HoloViews(plot_prompt_saturation(edited, k, self.decode,
                                                         title=edited_title(labels),
                                                         changed=moved, positions=positions),
                                  sizing_mode="stretch_width", linked_axes=False,
                                  css_classes=["sat-prompt-edited"]),
                pn.pane.HTML(f'<span data-sat-prompt-moved="{marker}"></span>', height=0,
                             margin=0),
                _caption(prompt_caption(clean, edited, k))]
        return pn.Column(*panes, sizing_mode="stretch_width")

    @param.depends("result", "k")
    def _histogram(self):
        if self.result is None:
            return pn.pane.Markdown("")
        h = tau_histogram_data(self.result, self.k)
        digest = "none" if h is None else hashlib.sha1(
            np.concatenate([h["observed"], h["null"]]).tobytes()).hexdigest()[:12]
        return pn.Column(pn.pane.HTML(f'<span data-sat-hist="{digest}"></span>', height=0, margin=0),
                         pn.pane.HoloViews(plot_tau_histogram(h), sizing_mode="stretch_width",
                                           css_classes=["sat-tau-hist"]),
                         _caption(tau_caption(h)), sizing_mode="stretch_width")

    @param.depends("result")
    def _probe(self):
        if self.result is None:
            return pn.pane.Markdown("")
        return pn.Column(pn.pane.HoloViews(plot_probe_accuracy(self.result),
                                           sizing_mode="stretch_width", css_classes=["sat-probe"]),
                         _caption(probe_caption(self.result)), sizing_mode="stretch_width")

    @param.depends("result", "theta_margin", "theta_cosine", "against")
    def _pareto(self):
        if self.result is None:
            return pn.pane.Markdown("")
        plot = pn.pane.HoloViews(plot_pareto(self.result, self.theta_margin, self.theta_cosine,
                                             against=self.against),
                                 sizing_mode="stretch_width", css_classes=["sat-pareto"])
        if "margin_speedup" not in self.result:
            return plot
        at = pareto_markers(self.result, self.theta_margin, self.theta_cosine,
                            against=self.against)
        marker = "|".join(f"{rule}:{m['theta']:.4f}:{m['speedup']:.4f}:{m['accuracy']:.4f}"
                          for rule, m in at.items())
        return pn.Column(pn.pane.HTML(f'<span data-sat-pareto="{marker}"></span>', height=0,
                                      margin=0), plot, _caption(pareto_caption(self.result)),
                         sizing_mode="stretch_width")

    @param.depends("result", "intervention", "pair")
    def _intervention(self):
        pairs = self.pairs()
        if self.result is None:
            return pn.pane.Markdown("The injection test waits for the corpus analysis: its "
                                    "token pairs come from the analysed text.")
        if not pairs:
            return pn.pane.Markdown("No token pairs with the same prediction and far-apart s_1 "
                                    "in the analysed text.")
        pair = min(self.pair, len(pairs) - 1)
        label = html.escape(self.pair_label(pair))
        r = self.intervention
        if r is None:
            line = "Running the intervention…"
        else:
            p, e, l = pairs[pair]
            words = self.decode([r["top1_before"], r["top1_after"]])
            line = (f'<span data-sat-injection="{p}:{e}:{l}:{r["layer"]}:{r["s1_before"]}:'
                    f'{r["s1_after"]}:{r["top1_before"]}:{r["top1_after"]}"></span>'
                    f'Injected at layer {r["layer"]}: s_1 {r["s1_before"]} → {r["s1_after"]}; '
                    f'prediction {"changed" if r["prediction_changed"] else "unchanged"} '
                    f'({html.escape(repr(words[r["top1_before"]]))} → '
                    f'{html.escape(repr(words[r["top1_after"]]))})')
        return pn.Column(pn.pane.HTML(f"<b>Pair {self.pair}</b>: {label}<br>{line}",
                                      css_classes=["sat-injection"]),
                         pn.pane.HoloViews(plot_intervention(self.intervention, self.decode),
                                           sizing_mode="stretch_width",
                                           css_classes=["sat-intervention"]),
                         sizing_mode="stretch_width")

    @param.depends("status", "error", "busy", "progress", "running")
    def _status(self):
        bar = pn.indicators.Progress(value=self.progress, max=100, active=self.running,
                                     visible=self.running, sizing_mode="stretch_width", height=12)
        text = f"⚠ {self.error}" if self.error else (
            self.status or "Analysing the corpus…" if self.running else self.status)
        return pn.Column(bar, pn.pane.Markdown(text, css_classes=["sat-status"]),
                         sizing_mode="stretch_width")

    def controls(self) -> pn.Column:
        p = self.param

        def group(name: str) -> pn.Column:
            return labelled(pn.widgets.RadioButtonGroup.from_param(
                p[name], color="primary", variant="outline",
                sizing_mode="stretch_width"), p[name].label, p[name].doc)

        def slider(name: str, kind: Any = pn.widgets.IntSlider, **kw: Any) -> pn.viewable.Viewable:
            return tip(kind.from_param(p[name], sizing_mode="stretch_width", **kw), p[name].doc)

        own_prompt = []
        if p.prompt.precedence is None or p.prompt.precedence >= 0:  # not driven by a sidebar
            own_prompt = [tip(pn.widgets.TextInput.from_param(
                p.prompt, placeholder="Enter a prompt and press Enter",
                sizing_mode="stretch_width"), p.prompt.doc)]
        return pn.Column(
            *own_prompt,
            group("weights"),
            tip(pn.widgets.IntInput.from_param(p.n_tokens, step=256, sizing_mode="stretch_width"),
                 p.n_tokens.doc),
            self._run_button,
            slider("text", throttled=True),
            slider("k", css_classes=["sat-k"]),
            slider("theta_margin", pn.widgets.FloatSlider, css_classes=["sat-theta-margin"]),
            slider("theta_cosine", pn.widgets.FloatSlider, format="0.0000",
                   css_classes=["sat-theta-cosine"]),
            group("against"),
            slider("pair", throttled=True),
            slider("inj_layer", throttled=True, css_classes=["sat-inj-layer"]),
            width=theme.SIZES["controls_width"])

    def __panel__(self) -> pn.viewable.Viewable:
        return pn.Row(
            self.controls(),
            pn.Column(
                self._status,
                pn.pane.Markdown("### The prompt's tokens: saturation layers s_1..s_k"),
                _caption("Cell (token, rank j): the layer from which the model's final rank-j "
                         "token at that position holds rank j (grey: never; the number in the "
                         f"cell up to {LABELLED_POSITIONS} tokens, else hover). With workspace "
                         "edits the edited run follows below, its changed cells outlined."),
                self._positions, self._position_caption,
                self._prompt_view,
                pn.pane.Markdown("### Corpus text, coloured by s_1"),
                _caption("Each token coloured by the layer its top-1 prediction saturates at "
                         "(dark: early, yellow: late, grey: never). **Click a token** for its "
                         "layer × rank table of lens predictions (outlined: saturated) and its "
                         "staircase s_1..s_k, just below."),
                self._strip, self._header, self._detail_plots(),
                self._histogram, self._probe, self._pareto, self._intervention,
                sizing_mode="stretch_width"),
            sizing_mode="stretch_width")

    def page(self) -> pn.template.FastListTemplate:
        """The view in the app template (standalone serving)."""
        return theme.page([self.__panel__()], title="Saturation events")


def click_latency(view: SaturationView, positions: Sequence[int], *, k: int | None = None,
                  text: int = 0) -> dict[str, list[float]]:
    """Seconds per token click through the page's own update path, wall and process CPU.

    The view's page is attached to a new Bokeh ``Document`` (as a served session holds it)
    and each position is clicked as the token strip does it in the browser: the strip's
    ``selected`` changes, the view updates the header and the detail plots' data. Times
    stop when the Python side has applied every change to the document (sending the
    change to a browser and drawing it are not included).
    """
    from bokeh.document import Document
    from panel.io.state import set_curdoc

    if view.result is None:
        raise InputError("the view has no result yet: nothing to click")
    doc = Document()
    layout = view.__panel__()
    wall, cpu = [], []
    with set_curdoc(doc):
        root = layout.get_root(doc)
        doc.add_root(root)
        try:
            view.param.update(text=text, **({} if k is None else {"k": k}))
            strip = view._strip_widget
            for pos in positions:
                w0, c0 = time.perf_counter(), time.process_time()
                if strip is not None:
                    strip.selected = int(pos)
                else:
                    view.selected = int(pos)
                cpu.append(time.process_time() - c0)
                wall.append(time.perf_counter() - w0)
        finally:
            layout._cleanup(root)
            doc.clear()
    return {"wall": wall, "cpu": cpu}


def export_figures(folder: str | Path, *, max_tokens: int | None = None,
                   random_tokens: int | None = None, seed: int = 0,
                   model: str = DEFAULT_MODEL,
                   analysis_options: dict[str, Any] | None = None,
                   weights: Sequence[str] = _WEIGHTS) -> list[Path]:
    """Screenshots of the page's plots for SmolLM2 (trained and random-init) from the store.

    Serves the view on a free local port, drives headless chromium with Playwright, clicks
    a token, and saves ``saturation_{trained,random}_{plot}.png`` files. ``max_tokens`` and
    ``random_tokens`` (default: the whole corpus) must match the analysed runs so the
    results are read from the activation store (run ``benchmarks/saturation_evidence.py``),
    and so must ``analysis_options`` (e.g. ``{"unembed_dtype": "bfloat16"}``).
    """
    import socket

    from playwright.sync_api import sync_playwright

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    base = explorer.load_model(model)
    saved = []
    for weights in [check_choice("weights", w, list(_WEIGHTS)) for w in weights]:
        n_tokens = (max_tokens if weights == "trained" else random_tokens) or 50_000
        view = SaturationView(base, background=False, weights=weights, n_tokens=n_tokens,
                              analysis_options={**(analysis_options or {}), "seed": seed})
        if view.result is None:
            raise InputError(f"no {weights} result: {view.error}")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = pn.serve(view.page, port=port, address="127.0.0.1", show=False, threaded=True)
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True,
                                            args=["--no-sandbox", "--disable-gpu", "--disable-quic",
                                                  "--disable-background-networking",
                                                  "--disable-component-update", "--disable-sync"])
                page = browser.new_page(viewport={"width": 1600, "height": 1200})
                page.goto(f"http://127.0.0.1:{port}/", timeout=120_000)
                page.locator(".sat-tau-hist canvas").first.wait_for(state="attached", timeout=120_000)
                # click the first text's token with the longest run of ranks saturating in time
                one = view.result.isel(prompt=0)
                n = int(one.mask.values.sum())
                s5 = one.sat_layer.values[:n, :5]
                early = (s5 >= 0) & (s5 < view.result.sizes["layer"] - 1)
                run = np.cumprod(early, axis=1).sum(1) * one.kept.values[:n]
                page.locator(f".sat-token[data-pos='{int(run.argmax())}']").click()
                page.locator(".sat-rank-table canvas").first.wait_for(state="attached", timeout=60_000)
                page.locator(".sat-intervention canvas").first.wait_for(state="attached", timeout=120_000)
                time.sleep(2)
                tag = "trained" if weights == "trained" else "random"
                for cls, name in ((".sat-strip", "strip"), (".sat-rank-table", "rank_table"),
                                  (".sat-staircase", "staircase"), (".sat-tau-hist", "tau"),
                                  (".sat-probe", "probe"), (".sat-pareto", "pareto"),
                                  (".sat-intervention", "intervention")):
                    path = folder / f"saturation_{tag}_{name}.png"
                    page.locator(cls).first.screenshot(path=str(path))
                    saved.append(path)
                browser.close()
        finally:
            server.stop()
    return saved


serve(__name__, SaturationView, title="Saturation events", intro="saturation")
