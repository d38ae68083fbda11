"""ICL heads page: induction vs function-vector heads, ablations, function vectors, task encoding.

Yin & Steinhardt ("Which Attention Heads Matter for In-Context Learning?", ICML 2025):
a scatter of every head's induction score against its FV score (Todd et al. 2024),
coloured by layer, with top-p% thresholds; the selected head's attention on a repeated
random-token sequence and on an ICL prompt; ablation curves (few-shot accuracy vs % of
heads mean-ablated) by FV / induction / random ranking. Function-vector panel (Todd et al.)
and task-encoding panel (Han et al., ICML 2025): 2-D PCA of the last-token residual
coloured by task and task decodability per layer.
"""
from __future__ import annotations

import html
import time
import warnings
from typing import Any

import holoviews as hv
import numpy as np
import panel as pn
import param
import xarray as xr

import explorer
from apps import theme
from apps._controls import OwnItems, tip
from apps._session import CancelToken
from apps._heads_heatmap import head_cell, heads_heatmap, heads_in, on_head_click
from apps._view import STATIC_TOOLS, Scope, View, serve
from explorer._checks import InputError
from explorer.analyses import icl_heads as ih
from explorer.analyses import task_vector_patching as tvp
from explorer.analyses import task_vectors as tv
from explorer.analyses import user_items
from explorer.interventions import Edit

__all__ = ["ICLHeadsView", "plot_head_scatter", "plot_score_heatmaps", "plot_attention",
           "plot_ablation_curves", "ablation_caption", "plot_td", "plot_projection", "plot_finetune_td",
           "scatter_caption", "td_caption", "fv_caption", "estimated_score_seconds",
           "conflict_matrix", "plot_conflict_matrix", "plot_conflict_controls",
           "plot_conflict_layers", "conflict_caption", "default_conflict_layers",
           "parse_layers", "DEFAULT_CONFLICT_TASKS", "plot_patching", "patching_caption",
           "DEFAULT_PATCHING_TASKS"]

hv.extension("bokeh", logo=False)

_TOOLS = STATIC_TOOLS
DEFAULT_FV_TASKS = ("antonym", "country-capital", "english-french")
DEFAULT_EVAL_TASKS = ("capitalize", "present-past")
DEFAULT_TD_TASKS = ("antonym", "country-capital", "english-french", "capitalize")
#: Tasks of the conflict test on opening: two word transforms and two list picks, whose
#: answers to each other's queries are defined (`task_vector_patching.ANSWER_RULES`).
DEFAULT_CONFLICT_TASKS = ("capitalize", "uppercase", "choose-first-of-3", "choose-last-of-3")
#: The task name of the user's pasted pairs.
OWN_TASK = "your pairs"


def _waiting(text: str, height: int = 300) -> hv.Element:
    return theme.placeholder(text, height=height)


selected_heads = heads_in   # the workspace's selected heads that the model has


def plot_head_scatter(scores: xr.Dataset | None, top_induction: float, top_fv: float,
                      highlighted=()) -> hv.Element:
    """Induction score (x) vs FV score (y) per head, coloured by layer; top-p% heads ringed,
    the workspace's selected heads (``highlighted``) in a square outline."""
    if scores is None:
        return _waiting("Head scores appear here (Compute scores, left)")
    ind, fv = scores["induction_score"].values, scores["fv_score"].values
    ti = set(ih.top_heads(ind, top_induction / 100))
    tf = set(ih.top_heads(fv, top_fv / 100))
    rows = []
    for layer in range(ind.shape[0]):
        for head in range(ind.shape[1]):
            kind = ("both" if (layer, head) in ti & tf else "induction" if (layer, head) in ti
                    else "FV" if (layer, head) in tf else "")
            rows.append((float(ind[layer, head]), float(fv[layer, head]), layer, head, kind))
    pts = hv.Points(rows, ["induction_score", "fv_score"], ["layer", "head", "top"])
    top = hv.Points([r for r in rows if r[4]], ["induction_score", "fv_score"],
                    ["layer", "head", "top"])
    chosen = selected_heads(highlighted, *ind.shape)
    picked = hv.Points([(float(ind[l, h]), float(fv[l, h]), l, h, "selected") for l, h in chosen],
                       ["induction_score", "fv_score"], ["layer", "head", "top"])
    return (pts.opts(color="layer", cmap=theme.MAGNITUDE_CMAP, colorbar=True, size=9,
                     tools=["hover", "tap"], default_tools=_TOOLS, active_tools=["tap"],
                     nonselection_alpha=0.6, clabel="layer")
            * top.opts(size=16, fill_alpha=0, line_color="black", line_width=1.5,
                       tools=["hover"])
            * picked.opts(marker="square", size=20, fill_alpha=0, line_color=theme.ACCENT,
                          line_width=2.5)).opts(
        responsive=True, height=380, xlabel="induction score", ylabel="FV score",
        title="Induction vs FV score")


def scatter_caption(scores: xr.Dataset | None, top_induction: float, top_fv: float) -> str:
    """What the scatter shows, with its numbers."""
    if scores is None:
        return ""
    ind, fv = scores["induction_score"].values, scores["fv_score"].values
    ti = set(ih.top_heads(ind, top_induction / 100))
    tf = set(ih.top_heads(fv, top_fv / 100))
    return (f"One point per head. x: induction score (attention on the induction target of a "
            f"repeated random sequence); y: FV score (indirect effect on P(answer) of patching "
            f"the head's mean output into corrupted ICL prompts). Ringed: the top "
            f"{top_induction:g}% induction and top {top_fv:g}% FV heads, {len(ti & tf)} in "
            f"both. **Click a point** to show that head's attention just below.")


def plot_score_heatmaps(scores: xr.Dataset | None, highlighted=()) -> hv.Layout | hv.Element:
    """Layer x head heatmaps: induction score (sequential map from 0) and FV score (diverging,
    0 white); the workspace's selected heads (``highlighted``) outlined."""
    if scores is None:
        return _waiting("Head scores appear here (Compute scores, left)")
    left = heads_heatmap(scores["induction_score"].values, name="induction_score",
                         title="Induction score", low=0.0, highlighted=highlighted)
    right = heads_heatmap(scores["fv_score"].values, name="fv_score", signed=True,
                          title="FV score (0 = white)", highlighted=highlighted)
    return (left + right).cols(2)


def plot_attention(ds: xr.Dataset | None, title: str, on: str = "a prompt") -> hv.Element:
    """Query x key heatmap of one head's attention, tokens on both axes (``on``: what the
    prompt is, named by the placeholder shown before the patterns exist)."""
    if ds is None:
        return _waiting(f"Press Compute scores (left): the attention on {on} of the top FV "
                        "head (or of a head you click) appears here", 260)
    width = len(str(ds.sizes["pos"] - 1))  # zero-padded so the categorical axes keep order
    toks = [f"{i:0{width}d} {theme.show_token(str(t))}" for i, t in enumerate(ds["token"].values)]
    a = ds["attention"].values
    rows = [(toks[k], toks[q], float(a[q, k])) for q in range(len(toks)) for k in range(q + 1)]
    return hv.HeatMap(rows, ["key", "query"], "weight").opts(
        cmap=theme.PROBABILITY_CMAP, colorbar=True, tools=["hover"], xrotation=90,
        invert_yaxis=True, responsive=True, height=max(300, 10 * len(toks) + 150),
        default_tools=_TOOLS, title=title, xlabel="key token", ylabel="query token",
        clim=(0, 1), fontsize={"xticks": "7pt", "yticks": "7pt"})


_CURVE_LABELS = {
    "mean_accuracy": ("few-shot accuracy", "Ablation: few-shot accuracy"),
    "mean_answer_prob": ("P(answer)", "Ablation: P(answer)"),
    "token_loss_difference": ("loss(early) - loss(late) (nats)", "Ablation: token-loss gap"),
}
# one colour per ranking on every plot
_RANKING_COLORS = {r: theme.CATEGORICAL[i % len(theme.CATEGORICAL)]
                   for i, r in enumerate(ih.RANKINGS)}


def plot_ablation_curves(curves: xr.Dataset | None,
                         variable: str = "mean_accuracy") -> hv.Element:
    """``variable`` (mean accuracy by default) against % of heads ablated, one curve per
    ranking; where the Dataset holds ``<variable>_low`` / ``_high`` (the bootstrap interval
    over prompts), a shaded band per ranking."""
    if curves is None:
        return _waiting("Press Recompute ablation curves (left)", 300)
    ylabel, title = _CURVE_LABELS[variable]
    pct = curves["percent"].values
    banded = f"{variable}_low" in curves and f"{variable}_high" in curves
    out = []
    for r in curves["ranking"].values:
        y = curves[variable].sel(ranking=r).values
        c = _RANKING_COLORS.get(str(r), theme.ACCENT)
        if banded:
            lo = curves[f"{variable}_low"].sel(ranking=r).values
            hi = curves[f"{variable}_high"].sel(ranking=r).values
            out.append(hv.Area((pct, lo, hi), "% heads ablated", [ylabel, "high"])
                       .opts(color=c, alpha=0.15, line_alpha=0))
        out.append(hv.Curve((pct, y), "% heads ablated", ylabel, label=str(r))
                   .opts(color=c, line_width=2, tools=["hover"]))
        out.append(hv.Scatter((pct, y), "% heads ablated", ylabel).opts(color=c, size=6))
    if banded:
        level = float(curves.attrs.get("params", {}).get("confidence_level", 0.95))
        title = f"{title} ({level:.0%} bands)"
    extra = {"ylim": (-0.02, 1.05)} if variable == "mean_accuracy" else {}
    return hv.Overlay(out).opts(responsive=True, height=320, legend_position="right",
                                title=title, show_legend=True, **extra)


def ablation_caption(curves: xr.Dataset | None, mean_source: str) -> str:
    """How the ablation curves were made: the tasks, the prompts, the ablation value."""
    what = {"cross-task": "its mean last-token output averaged over the FV-scoring tasks' "
                          "prompts (the paper's ablation)",
            "per-task": "its mean last-token output on the evaluated task's own prompts "
                        "(keeps the head's share of that task's function vector)",
            "zero": "zero"}
    if curves is None:
        return (f"Few-shot accuracy on the evaluation tasks with the top heads by each ranking "
                f"ablated at the last token; an ablated head's output is replaced with "
                f"{what[mean_source]}. Yin & Steinhardt find ablating FV heads hurts ICL far "
                f"more than ablating induction heads.")
    p = curves.attrs.get("params", {})
    src = p.get("mean_source", mean_source)
    pool = p.get("mean_tasks")
    tasks = ", ".join(str(t) for t in curves["task"].values)
    return (f"Few-shot accuracy (argmax = the answer's first token) on {tasks}, "
            f"{p.get('n_prompts')} prompts of {p.get('n_shots')} shots each, with the top "
            f"heads by each ranking ablated at the last token. An ablated head's output is "
            f"replaced with {what[src]}" + (f" ({', '.join(pool)})" if pool else "") +
            f". Bands: {float(p.get('confidence_level', 0.95)):.0%} bootstrap interval over "
            f"prompts ({p.get('n_boot')} resamples within each task); with few prompts they are "
            f"wide. Yin & Steinhardt find ablating FV heads hurts ICL far more than ablating "
            f"induction heads.")


def plot_td(td: xr.Dataset | None, layer: int) -> hv.Element:
    """Task decodability (leave-one-out 10-NN accuracy) per layer, current layer marked."""
    if td is None:
        return _waiting("Task decodability appears here (Compute scores)", 260)
    curve = hv.Curve((td["layer"].values, td["td"].values), "layer", "task decodability")
    return (curve.opts(line_width=2, color=theme.ACCENT, tools=["hover"])
            * hv.VLine(layer).opts(color="black", line_dash="dashed")).opts(
        responsive=True, height=260, ylim=(0, 1.05), default_tools=_TOOLS,
        title="Task decodability")


def td_caption(td: xr.Dataset | None, layer: int) -> str:
    """What the task-encoding plots show, with their numbers."""
    if td is None:
        return ""
    return (f"Upper plot: the last-token residual at layer {layer}, projected on its first two "
            f"principal components, one point per prompt (grey: the Null task). Lower plot: task "
            f"decodability (leave-one-out 10-NN accuracy of the task from that residual) per "
            f"layer, dashed at layer {layer}; best at layer {td.attrs['best_layer']}, R² of TD "
            f"against few-shot accuracy over the tasks {td.attrs['td_accuracy_r2']:.2f} "
            f"(Han et al., ICML 2025).")


def plot_projection(td: xr.Dataset | None, layer: int) -> hv.Element:
    """2-D PCA of the last-token residual at ``layer``, coloured by task (Null grey)."""
    if td is None:
        return _waiting("Task encoding appears here (Compute scores)", 300)
    p = td["projection"].sel(layer=layer).values
    tasks = td["prompt_task"].values
    names = [t for t in td["task"].values]
    colors = {n: ("#999999" if n == "null" else theme.CATEGORICAL[i % len(theme.CATEGORICAL)])
              for i, n in enumerate(names)}
    pts = hv.Points({"pc1": p[:, 0], "pc2": p[:, 1], "task": tasks}, ["pc1", "pc2"], ["task"])
    return pts.opts(color="task", cmap=colors, size=7, tools=["hover"], legend_position="right",
                    responsive=True, height=300, default_tools=_TOOLS,
                    title=f"Residual PCA, layer {layer}")


def plot_finetune_td(summary: dict) -> hv.Element:
    """TD of the tuned task per layer for the base model and the early / late LoRA copies.

    ``summary`` is `explorer.analyses.icl_finetune.finetune_summary` output.
    """
    curves = []
    for i, v in enumerate(("base", "early", "late")):
        td = summary[v]["task_td"]
        label = (f"{v} (accuracy {summary[v]['accuracy']:.2f})" if v == "base" else
                 f"{v}: layers {summary[v + '_layers'][0]}–{summary[v + '_layers'][-1]} "
                 f"(accuracy {summary[v]['accuracy']:.2f})")
        curves.append(hv.Curve((list(range(len(td))), td), "layer", "task decodability",
                               label=label).opts(color=theme.CATEGORICAL[i], line_width=2,
                                                 tools=["hover"]))
    return hv.Overlay(curves).opts(
        responsive=True, height=320, ylim=(0, 1.05), legend_position="bottom_right",
        title=f"TD of '{summary['task']}' per layer after LoRA on the first / last layers")


# -- the task-vector conflict test (Han et al.) ------------------------------------------------

def default_conflict_layers(n_layers: int) -> list[int]:
    """Every 4th layer and every layer at 60-75 % of the depth, where the conflict test finds
    the task vectors acting on SmolLM2 (layers 18-22 of 30, docs/icl_heads.md)."""
    band = range(int(0.6 * n_layers), int(0.75 * n_layers) + 1)
    return sorted({*range(0, n_layers, 4), *band} & set(range(n_layers)))


def parse_layers(text: str, n_layers: int) -> list[int]:
    """Layers from a comma-separated text (``"0, 8, 18-22"``; ranges inclusive), checked
    against the model's ``n_layers``; a clear InputError names what is wrong."""
    allowed = f"layer numbers in [0, {n_layers - 1}] separated by commas (ranges like 18-22)"
    out: set[int] = set()
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        lo, dash, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise InputError(f"`Conflict: layers` must be {allowed}; got {part!r}.") from None
        if not (0 <= first <= last < n_layers):
            raise InputError(f"`Conflict: layers` must be {allowed}; got {part!r}.")
        out.update(range(first, last + 1))
    if not out:
        raise InputError(f"`Conflict: layers` must be {allowed}; got none.")
    return sorted(out)


def layers_text(layers: list[int]) -> str:
    """Layers as the text `parse_layers` reads, runs written as ranges: '0, 4, 16-22'."""
    out, run = [], []
    for layer in sorted(layers):
        if run and layer == run[-1] + 1:
            run.append(layer)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)))
        run = [layer]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)))
    return ", ".join(out)


def _short_task(name: str) -> str:
    """A task name short enough for a matrix axis (the hover keeps the full one)."""
    return {"lowercase-first-letter": "lower-first"}.get(
        name, name.removeprefix("choose-").removeprefix("country-"))


def conflict_matrix(ds: xr.Dataset, layer: int) -> xr.DataArray:
    """The page's matrix: ``follows_source`` at ``layer`` for the task sources, [source,
    target] (NaN where A has no answer to B's queries)."""
    tasks = list(ds["target"].values)
    return ds["follows_source"].sel(source=tasks, layer=layer)


def _cells(da: xr.DataArray, low: xr.DataArray, high: xr.DataArray, n: xr.DataArray,
           rows: list[str]) -> list[tuple]:
    out = []
    for i, row in enumerate(rows):
        for j, col in enumerate(da["target"].values):
            v = float(da.values[i, j])
            out.append((_short_task(str(col)), row, v, float(low.values[i, j]),
                        float(high.values[i, j]), int(n.values[i, j]), str(col)))
    return out


def _frame_width(n_targets: int) -> int:
    """Pixels of the matrices' plot area: about 70 a column, 300-430 in all; the figure is
    170 wider for the axes (fixed figure sizes, one left margin so that the two matrices'
    columns line up). It fits beside the controls at 1280 px."""
    return int(np.clip(72 * n_targets, 300, 430))


def _left_margin(plot: Any, element: Any) -> None:
    """The matrices' one left margin (room for the longest short task name)."""
    plot.state.min_border_left = 140


def _matrix_plot(cells: list[tuple], rows: list[str], title: str, frame_height: int,
                 xlabel: str, ylabel: str, value: str) -> hv.Overlay:
    """A heatmap of rates in [0, 1] with the value written in each cell (so no colour bar);
    fixed pixel sizes, the column labels turned only when they would overlap."""
    vdims = [value, "low", "high", "n_scored", "target task"]
    n_cols = len({c[0] for c in cells})
    width = _frame_width(n_cols)
    longest = max(len(c[0]) for c in cells)
    turned = 6.5 * longest > width / n_cols
    height = frame_height + 70 + (int(4.6 * longest) + 20 if turned else 40)
    heat = hv.HeatMap(cells, ["target", "row"], vdims).opts(
        cmap=theme.PROBABILITY_CMAP, clim=(0.0, 1.0), colorbar=False, tools=["hover"],
        default_tools=_TOOLS, width=width + 170, height=height, hooks=[_left_margin],
        xlabel=xlabel,
        ylabel=ylabel, invert_yaxis=True, title=title, clipping_colors={"NaN": "#f0f0f0"},
        xrotation=45 if turned else 0,
        fontsize={"xticks": "8pt", "yticks": "8pt", "title": "11pt"})
    values = [c[2] for c in cells]
    colors = theme.text_colors(values, theme.PROBABILITY_CMAP)
    labels = hv.Labels([(c[0], c[1], "–" if c[2] != c[2] else f"{c[2]:.2f}", col)
                        for c, col in zip(cells, colors)], ["target", "row"],
                       ["text", "color"]).opts(text_color="color", text_font_size="8pt")
    return (heat * labels).opts(width=width + 170, height=height)


def plot_conflict_matrix(ds: xr.Dataset | None, layer: int | None) -> hv.Element:
    """Source task A (rows) x target task B (columns): the fraction of B's prompts answered
    with A's answer when A's task vector replaces the last token's residual at ``layer``."""
    if ds is None or layer is None:
        return _waiting("The conflict matrix appears here (Run the conflict test, left)", 300)
    tasks = [str(t) for t in ds["target"].values]
    sel = dict(source=tasks, layer=layer)
    rows = [_short_task(t) for t in tasks]
    cells = _cells(ds["follows_source"].sel(**sel), ds["follows_source_low"].sel(**sel),
                   ds["follows_source_high"].sel(**sel), ds["n_scored"].sel(source=tasks), rows)
    return _matrix_plot(cells, rows, f"Answer follows task A's vector, layer {layer}",
                        int(np.clip(30 * len(tasks), 120, 300)),
                        "target task B (the prompt's demonstrations)", "source task A (vector)",
                        "follows A")


_CONTROL_ROWS = {"null": "Null vector", "none": "no patch"}


def plot_conflict_controls(ds: xr.Dataset | None, layer: int | None) -> hv.Element:
    """The controls: with the Null task's vector or nothing written at ``layer``, the fraction
    of B's prompts answered with B's own answer."""
    if ds is None or layer is None:
        return _waiting("The Null-vector control appears here", 150)
    sel = dict(source=list(_CONTROL_ROWS), layer=layer)
    rows = list(_CONTROL_ROWS.values())
    cells = _cells(ds["follows_target"].sel(**sel), ds["follows_target_low"].sel(**sel),
                   ds["follows_target_high"].sel(**sel), ds["n_scored"].sel(source=sel["source"]),
                   rows)
    return _matrix_plot(cells, rows, f"Controls: answer follows B, layer {layer}", 60,
                        "target task B", "", "follows B")


FOLLOWS_A, FOLLOWS_B = "A's vector: follows A", "A's vector: follows B"
FOLLOWS_B_NULL = "Null vector: follows B"


def _layer_profile(ds: xr.Dataset) -> dict[str, np.ndarray]:
    """Per layer: the mean over scored A != B cells of follows-A and follows-B, and the mean
    over targets of follows-B under the Null vector."""
    tasks = list(ds["target"].values)
    off = ~np.eye(len(tasks), dtype=bool)[..., None]                 # [source, target, 1]
    a = np.where(off, ds["follows_source"].sel(source=tasks).values, np.nan)
    b = np.where(off, ds["follows_target"].sel(source=tasks).values, np.nan)
    with warnings.catch_warnings():       # a layer with no scored cell is NaN, not a warning
        warnings.simplefilter("ignore", RuntimeWarning)
        return {FOLLOWS_A: np.nanmean(a, axis=(0, 1)), FOLLOWS_B: np.nanmean(b, axis=(0, 1)),
                FOLLOWS_B_NULL: np.nanmean(ds["follows_target"].sel(source="null").values,
                                           axis=0)}


def plot_conflict_layers(ds: xr.Dataset | None, layer: int | None) -> hv.Element:
    """The layer profile of the conflict test, the shown layer dashed."""
    if ds is None or layer is None:
        return _waiting("The conflict test per layer appears here", 220)
    x = ds["layer"].values
    curves = []
    for i, (label, y) in enumerate(_layer_profile(ds).items()):
        c = theme.CATEGORICAL[i]
        curves.append(hv.Curve((x, y), "layer", "fraction of prompts", label=label)
                      .opts(color=c, line_width=2, tools=["hover"]))
        curves.append(hv.Scatter((x, y), "layer", "fraction of prompts").opts(color=c, size=5))
    curves.append(hv.VLine(layer).opts(color="black", line_dash="dashed"))
    return hv.Overlay(curves).opts(width=580, height=260, ylim=(-0.02, 1.05),
                                   legend_position="right", show_legend=True,
                                   fontsize={"title": "11pt", "legend": "8pt"},
                                   title="Conflict test per layer (matrix means)")


def conflict_caption(ds: xr.Dataset | None, layer: int | None) -> str:
    """How to read the conflict matrix, with its numbers at ``layer``."""
    if ds is None or layer is None:
        return ("**Does the encoded task drive the answer?** Run the conflict test: each "
                "task's mean last-token residual (its task vector) is written over the last "
                "token of few-shot prompts of another task, layer by layer (Han et al., ICML "
                "2025).")
    p = ds.attrs.get("params", {})
    at = list(ds["layer"].values).index(layer)
    prof = {k: float(v[at]) for k, v in _layer_profile(ds).items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        unpatched = float(np.nanmean(ds["follows_target"].sel(source="none", layer=layer)))

    def num(v: float) -> str:
        return "–" if v != v else f"{v:.2f}"

    n, shots = p.get("n_prompts"), p.get("n_shots")
    return (f"**How to read it.** Row A: the task whose vector (its mean last-token residual "
            f"over {n} {shots}-shot prompts) *replaced* the last token's residual at layer "
            f"{layer}; column B: the task of the prompt's demonstrations and query ({n} other "
            f"prompts). A cell is the fraction of B's prompts answered with A's answer to B's "
            f"query (hover: its {float(p.get('level', 0.95)):.0%} bootstrap interval and the "
            f"prompts scored, those where A's answer is defined and starts with another token "
            f"than B's; '–': none). A bright cell off the diagonal means A's vector overrides "
            f"B's demonstrations: the vector drives the answer. The diagonal writes B's own "
            f"vector into B's prompts. At layer {layer} the answer follows A on "
            f"**{num(prof[FOLLOWS_A])}** of the prompts on average over A ≠ B (B on "
            f"{num(prof[FOLLOWS_B])}). **Controls** (lower matrix): with the Null task's vector "
            f"(inputs with random outputs) the answer follows B on {num(prof[FOLLOWS_B_NULL])} "
            f"on average, with no patch on {num(unpatched)}; where the Null vector removes B's "
            f"answer without giving A's, the switch to A comes from A's vector, not from "
            f"overwriting the residual. Best layer {ds.attrs.get('best_layer')} (the highest "
            f"mean over A ≠ B, picked on these prompts). The curves: per layer, the means over "
            f"the A ≠ B cells, and over the targets for the Null vector; the layer slider "
            f"(left) moves the matrices and the dashed line.")


# -- the zero-shot task-vector patching test (Han et al.) ---------------------------------------

#: Tasks of the zero-shot patching test on opening: ones whose vectors move SmolLM2's zero-shot
#: answers in docs/icl_heads.md, and one lookup task.
DEFAULT_PATCHING_TASKS = ("antonym", "capitalize", "present-past", "country-capital")
MEAN_OVER_TASKS = "mean over tasks"
_PATCH_LABELS = {"task": "task vector", "null": "Null-task vector", "none": "no patch"}


def plot_patching(ds: xr.Dataset | None, shown: str | None = MEAN_OVER_TASKS) -> hv.Element:
    """Zero-shot accuracy by layer with the task's vector, the Null task's vector, or nothing
    written over the last token's residual; ``shown`` one task (with its Wilson bands) or
    the mean over the tasks."""
    if ds is None:
        return _waiting("Accuracy by layer appears here (Run the patching test, left)", 260)
    layers = ds["layer"].values
    one = shown in [str(t) for t in ds["task"].values]
    acc = ds["accuracy"].sel(task=shown) if one else ds["accuracy"].mean("task")
    out = []
    for i, v in enumerate(("task", "null", "none")):
        c = theme.CATEGORICAL[i]
        y = acc.sel(vector=v).values
        if one and "accuracy_low" in ds:
            lo = ds["accuracy_low"].sel(task=shown, vector=v).values
            hi = ds["accuracy_high"].sel(task=shown, vector=v).values
            out.append(hv.Area((layers, lo, hi), "layer", ["zero-shot accuracy", "high"])
                       .opts(color=c, alpha=0.12, line_alpha=0))
        out.append(hv.Curve((layers, y), "layer", "zero-shot accuracy", label=_PATCH_LABELS[v])
                   .opts(color=c, line_width=2, tools=["hover"],
                         line_dash="dashed" if v == "none" else "solid"))
        out.append(hv.Scatter((layers, y), "layer", "zero-shot accuracy").opts(color=c, size=5))
    what = shown if one else f"mean over {ds.sizes['task']} tasks"
    return hv.Overlay(out).opts(responsive=True, height=300, ylim=(-0.02, 1.05),
                                legend_position="right", show_legend=True,
                                default_tools=_TOOLS,
                                title=f"Task vector written at one layer: {what}")


def patching_caption(ds: xr.Dataset | None, shown: str | None = MEAN_OVER_TASKS) -> str:
    """How to read the zero-shot patching test, with its numbers."""
    if ds is None:
        return ("**Does the encoded task drive the answer?** Run the patching test: each task's "
                "mean last-token residual (its task vector) replaces the last token's residual "
                "of *zero-shot* prompts, one layer at a time; the Null task's vector (inputs "
                "with random outputs) is the control (Han et al., ICML 2025).")
    p = ds.attrs.get("params", {})
    task = ds["accuracy"].sel(vector="task").mean("task").values
    null = ds["accuracy"].sel(vector="null").mean("task").values
    none = float(ds["accuracy"].sel(vector="none").mean("task").values[0])
    best = int(np.argmax(task))
    layer = int(ds["layer"].values[best])
    few = ", ".join(f"{t} {float(a):.2f}" for t, a in zip(ds["task"].values,
                                                         ds["few_shot_accuracy"].values))
    return (f"Each task's vector is its mean last-token residual over {p.get('n_prompts')} "
            f"{p.get('n_shots')}-shot prompts; it {'replaces' if p.get('mode') == 'replace' else 'is added to'} "
            f"the last token's residual of {p.get('n_prompts')} other "
            f"{p.get('target_shots')}-shot prompts at the layer on the x axis, and the answer's "
            f"first token is scored. Mean over the tasks: without a patch "
            f"**{none:.2f}**; best with the task vector at layer {layer}: **{float(task[best]):.2f}** "
            f"(picked on these prompts), the Null vector there {float(null[best]):.2f}. A task "
            f"vector that lifts accuracy where the Null vector does not drives the answer. "
            f"Few-shot accuracy for reference: {few}. One task's curves carry 95 % Wilson "
            f"bands over its prompts.")


# SmolLM2-135M (30 layers, 9 heads, d_model 576) scores its heads in ~30 s on a laptop CPU
# at 6 prompts of 4 shots over 3 FV tasks; other settings are scaled from that.
_REF_SECONDS, _REF_SHAPE, _REF_SETTINGS = 30.0, (30, 9, 576), (6, 4, 3)
OPEN_BUDGET_S = 5.0
"""Work estimated under this many seconds runs when the page opens; longer waits for a click."""


def estimated_score_seconds(n_layers: int, n_heads: int, d_model: int, n_prompts: int,
                            n_shots: int, n_tasks: int) -> float:
    """Rough CPU seconds to score every head: one patched run per head (layers x heads), each
    a forward over the prompts (layers x d_model^2 per token), scaled from SmolLM2's ~30 s."""
    L, H, d = _REF_SHAPE
    p, k, t = _REF_SETTINGS
    return (_REF_SECONDS * (n_layers ** 2 * n_heads * d_model ** 2) / (L ** 2 * H * d ** 2)
            * (n_prompts / p) * ((n_shots + 1) / (k + 1)) * (n_tasks / t))


def fv_caption(ds: xr.Dataset | None, fv_tasks: list[str]) -> str:
    """The function-vector result in words, and why its heads are the same for every task."""
    if ds is None:
        return ("**Function vector**: shown after **Compute scores** (left): the summed mean "
                "output of the top FV heads, added at one layer, and the zero-shot accuracy it gives.")
    heads = ", ".join(str(explorer.components.head(int(l), int(h))) for l, h in ds.attrs["heads"])
    params = ds.attrs.get("params", {})
    n = int(params.get("n_prompts", ds.sizes.get("prompt", 1)))
    top = float(params.get("top_fraction", 0.02))
    return (f"**Function vector, {ds.task.values[0]}**: the summed mean output of heads {heads} "
            f"added at layer {ds.attrs['layer']}: zero-shot accuracy "
            f"**{float(ds.zero_shot_accuracy[0]):.0%}** → with the FV "
            f"**{float(ds.fv_accuracy[0]):.0%}** (few-shot {float(ds.few_shot_accuracy[0]):.0%}). "
            f"The heads are the top {top:.0%} by FV score averaged over "
            f"the FV tasks ({', '.join(fv_tasks)}), as in Todd et al., so every task uses the "
            f"same heads; only the vector (their mean output on this task) differs. Accuracies "
            f"count {n} prompts (steps of {1 / n:.0%}), so two tasks often show the same number.")


class ICLHeadsView(View):
    """Induction vs FV heads with ablation curves, function vectors and task encoding.

    Parameters
    ----------
    model : explorer.Model
    background : bool, optional
        Compute in worker threads (default when served) or inline (tests, notebooks).
    n_prompts, n_shots : int
        Prompts per task and demonstrations per prompt of every computation.
    compute_on_open : bool, optional
        Score the heads as the page opens; default: when that is estimated to take under
        `OPEN_BUDGET_S` seconds (`estimated_score_seconds`), else on the *Compute scores*
        button (the task encoding too).
    """

    top_induction = param.Number(default=5.0, bounds=(1, 50), step=1, label="Top % induction",
                                 doc="Share of heads with the highest induction score, ringed "
                                     "on the scatter.")
    top_fv = param.Number(default=5.0, bounds=(1, 50), step=1, label="Top % FV",
                          doc="Share of heads with the highest FV score, ringed on the scatter.")
    layer = param.Integer(default=0, bounds=(0, None), label="Head: layer",
                          doc="Layer of the head whose attention is shown (or click a point).")
    head = param.Integer(default=0, bounds=(0, None), label="Head: head",
                         doc="Index of the head whose attention is shown (or click a point).")
    task = param.Selector(default="antonym", objects=ih.icl_task_names(), label="Task",
                          doc="ICL task of the attention prompt and of the function vector.")
    max_percent = param.Number(default=20.0, bounds=(1, 50), step=1,
                               label="Ablate up to % of heads",
                               doc="Largest share of heads mean-ablated on the ablation curves "
                                   "(release the slider to recompute them).")
    exclude_other = param.Boolean(
        default=False, label="Exclude the other score's top heads",
        doc="Ablate the top FV heads that are not top induction heads and vice versa (the "
            "excluded set is the top % of the larger threshold above)")
    mean_source = param.Selector(
        default="cross-task", objects=list(ih.MEAN_SOURCES), label="Ablation: mean source",
        doc="What an ablated head's last-token output is replaced with: its mean over the "
            "FV-scoring tasks' prompts (cross-task, the paper's), its mean on the evaluated "
            "task (per-task), or zero.")
    fv_layer = param.Integer(default=0, bounds=(0, None), label="Function vector: layer",
                             doc="Layer whose residual the function vector is added to.")
    td_layer = param.Integer(default=0, bounds=(0, None), label="Task encoding: layer",
                             doc="Layer of the residual PCA and of the dashed line on the "
                                 "task-decodability curve.")

    conflict_tasks = param.ListSelector(
        default=list(DEFAULT_CONFLICT_TASKS), objects=ih.icl_task_names(),
        label="Conflict: tasks",
        doc="Tasks of the task-vector conflict test: each one's vector is written into the "
            "others' prompts (at least two; their answers to each other's queries must be "
            "defined, as for rules like uppercase or choose-first-of-3).")
    conflict_layers = param.String(
        default="", label="Conflict: layers",
        doc="Layers the vectors are written at, e.g. '0, 8, 18-22' (each layer costs one "
            "patched run of every task pair).")
    conflict_layer = param.Selector(
        default=None, objects=[], label="Conflict: layer shown",
        doc="Layer of the conflict matrices (dashed on the per-layer curves); the layers "
            "computed are the choices.")

    patching_tasks = param.ListSelector(
        default=list(DEFAULT_PATCHING_TASKS), objects=ih.icl_task_names(),
        label="Patching: tasks",
        doc="Tasks of the zero-shot patching test: each one's vector is written into its own "
            "zero-shot prompts, layer by layer, beside the Null task's vector.")
    patching_layers = param.String(
        default="", label="Patching: layers",
        doc="Layers the vectors are written at, e.g. '0, 8, 18-22' (each layer costs two "
            "patched runs per task).")
    patching_shown = param.Selector(
        default=MEAN_OVER_TASKS, objects=[MEAN_OVER_TASKS], label="Patching: task shown",
        doc="One task's curves (with their intervals) or the mean over the tasks.")
    patching = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True,
                                   precedence=-1,
                                   doc="The last patching test (`task_vector_patching`).")
    edits = param.List(default=[], item_type=Edit, precedence=-1,
                       doc="The workspace's edits: the induction scores, the attention and the "
                           "ablation curves are of the edited model.")
    highlighted = param.List(default=[], item_type=str, precedence=-1,
                             doc="Components outlined on the scatter and heatmaps (the "
                                 "workspace selection).")
    scores = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True, precedence=-1)
    patterns = param.Dict(default=None, allow_None=True, precedence=-1)
    curves = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True, precedence=-1)
    fv_result = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True, precedence=-1)
    td = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True, precedence=-1)
    conflict = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True,
                                   precedence=-1,
                                   doc="The last conflict test (`conflicting_task_patching`).")
    conflict_error = param.String(default="", precedence=-1,
                                  doc="Why the last conflict test did not run ('' after a good one).")

    notify_title = None
    failed_status = None
    link_params = ("top_induction", "top_fv", "layer", "head", "task", "max_percent",
                   "exclude_other", "mean_source", "fv_layer", "td_layer", "patching_tasks",
                   "patching_layers", "conflict_tasks", "conflict_layers")

    def scope(self) -> Scope:
        """Task prompts, not the sidebar prompt; the edits reach what reruns the model as a
        whole, not the tests that patch or read an unedited run."""
        n, shots = self._opts["n_prompts"], self._opts["n_shots"]
        on = (f"task prompts, not your prompt: FV scores on {', '.join(self._fv_tasks)}; "
              f"ablations on {', '.join(self._eval_tasks)} ({n} prompts x {shots} shots each); "
              f"induction scores on repeated random tokens")
        edits = ("applied to the induction scores, the attention and the ablation curves; not "
                 "applicable to the FV scores, function vector, task encoding and task-vector "
                 "tests: they patch into or read an unedited cached run")
        return Scope(on=on, edits=edits)

    def __init__(self, model: explorer.Model, *, background: bool | None = None,
                 n_prompts: int = 6, n_shots: int = 4, fv_tasks=DEFAULT_FV_TASKS,
                 eval_tasks=DEFAULT_EVAL_TASKS, td_tasks=DEFAULT_TD_TASKS,
                 compute_on_open: bool | None = None, **params: Any):
        super().__init__(background=background, **params)
        self._model = model
        spec = model.spec
        for name in ("layer", "fv_layer", "td_layer"):
            self.param[name].bounds = (0, spec.n_layers - 1)
        self.param.head.bounds = (0, spec.n_heads - 1)
        self.fv_layer = spec.n_layers // 3
        self.td_layer = spec.n_layers // 2
        self._opts = dict(n_prompts=n_prompts, n_shots=n_shots)
        self._fv_tasks, self._eval_tasks, self._td_tasks = (list(fv_tasks), list(eval_tasks),
                                                            list(td_tasks))
        self.runner("scores", self._got_scores, progress=True)
        self.runner("patterns", self._got_patterns)
        self.runner("curves", self._got_curves, progress=True)
        self.runner("fv", self._got_fv)
        self.runner("td", self._got_td)
        self.runner("conflict", self._got_conflict, progress=True)
        self.runner("patching", self._got_patching, progress=True)
        self.conflict_layers = layers_text(default_conflict_layers(spec.n_layers))
        self.patching_layers = layers_text(default_conflict_layers(spec.n_layers))
        self._patching_button = pn.widgets.Button(
            label="Run the patching test", color="primary", sizing_mode="stretch_width",
            description="Write each chosen task's vector (and the Null task's) into its "
                        "zero-shot prompts at each chosen layer; draw the accuracy by layer.")
        self._patching_button.on_click(lambda *_: self.run_patching())
        self._conflict_button = pn.widgets.Button(
            label="Run the conflict test", color="primary", sizing_mode="stretch_width",
            description="Write each chosen task's vector into the other tasks' few-shot "
                        "prompts at each chosen layer; draw whose task the answer follows.")
        self._conflict_button.on_click(lambda *_: self.run_conflict())
        self._progress = pn.indicators.Progress(label="progress", value=self.param.progress, max=100,
                                                sizing_mode="stretch_width",
                                                visible=self.param.progress_active)
        self.param.watch(lambda *_: self._request("patterns"), ["layer", "head", "task"])
        self.param.watch(lambda *_: self._request("fv"), ["fv_layer", "task"])
        self.param.watch(lambda *_: self._request("curves"), ["exclude_other", "mean_source"])
        self.param.watch(lambda *_: self._edits_changed(), ["edits"])
        self.runner("induction", self._got_induction)
        self.estimated_seconds = estimated_score_seconds(
            spec.n_layers, spec.n_heads, spec.d_model, n_prompts, n_shots, len(self._fv_tasks))
        self._score_button = pn.widgets.Button(
            label=f"Compute scores (about {max(1, round(self.estimated_seconds)):d} s)",
            color="primary", sizing_mode="stretch_width",
            description="Induction and FV scores of every head (the scatter and heatmaps), "
                        "then the function vector; and the task encoding (PCA, decodability).")
        self._score_button.on_click(lambda *_: self._compute())
        self._own_task: ih.ICLTask | None = None
        self._own_text = ""
        self._own = OwnItems(
            "Your own pairs", user_items.ICL_FORMAT,
            f"One 'input -> output' pair per line, at least {self._min_pairs()}. Use makes them "
            f"the task '{OWN_TASK}' of the attention prompt and of the function vector.",
            self.use_own)
        self._press_note = (f"Press **Compute scores** to score every head and the task "
                            f"encoding (about {self.estimated_seconds:.0f} s on a CPU).")
        if compute_on_open is None:
            compute_on_open = self.estimated_seconds <= OPEN_BUDGET_S
        if compute_on_open:
            self._compute()
        else:   # the selected head's attention is cheap: show it while the scores wait
            self._request("patterns")
            self.status = self._press_note

    def _min_pairs(self) -> int:
        """Pairs a pasted task needs: the attention prompt's 3 demonstrations and the FV
        prompts' ``n_shots``, plus the query."""
        return max(4, self._opts["n_shots"] + 1)

    def _task(self) -> ih.ICLTask | str:
        """The selected task: a shipped task's name, or the user's pasted task."""
        return self._own_task if self.task == OWN_TASK and self._own_task is not None else self.task

    def use_own(self, text: str) -> ih.ICLTask | None:
        """Parse the user's pairs and make them the selected task (the same jobs as a shipped
        task); bad text shows the parser's message and keeps the current result."""
        try:
            task = user_items.parse_icl_pairs(text, name=OWN_TASK, min_pairs=self._min_pairs())
        except InputError as e:
            self.show_error(e)
            return None
        self._own_task, self._own_text = task, text
        if OWN_TASK not in self.param.task.objects:
            self.param.task.objects = [*self.param.task.objects, OWN_TASK]
        self.error = ""
        if self.task == OWN_TASK:
            self._request("patterns")
            self._request("fv")
        else:
            self.task = OWN_TASK
        return task

    # -- jobs ---------------------------------------------------------------------------
    def conflict_settings(self) -> dict[str, Any]:
        """The arguments of `conflicting_task_patching` the page runs with (tasks, layers,
        prompts, shots); raises InputError naming a bad control."""
        tasks = list(self.conflict_tasks)
        if len(tasks) < 2:
            raise InputError(f"`Conflict: tasks` must hold at least two tasks; got "
                             f"{len(tasks)}{': ' + tasks[0] if tasks else ''}.")
        layers = parse_layers(self.conflict_layers, self._model.spec.n_layers)
        return dict(tasks=tasks, layers=layers, **self._opts)

    def run_conflict(self) -> None:
        """The conflict test for the chosen tasks and layers, in the background with
        progress. Bad input shows a message under the button and keeps the last matrix."""
        try:
            settings = self.conflict_settings()
        except InputError as e:
            self._conflict_failed(e)
            return
        m = self._model
        started = time.perf_counter()
        # the button stays enabled: a click while the test runs starts it again (the runner
        # supersedes the job in flight), and a stopped job cannot leave it disabled
        self.conflict_error = ""

        def job(token: CancelToken):
            bar = self.progress_fn(token)

            def progress(done: int, total: int) -> None:
                bar(done, total)
                left = (time.perf_counter() - started) * (total - done) / max(1, done)
                self.post(status=f"conflict test: {done}/{total} patched runs, about "
                                 f"{left:.0f} s left")
            try:
                return tvp.conflicting_task_patching(m, settings.pop("tasks"), progress=progress,
                                                     **settings)
            except InputError as e:          # shown under the button, like bad controls
                return e

        self.status = "computing the conflict test…"
        self.submit("conflict", job)

    def patching_settings(self) -> dict[str, Any]:
        """The arguments of `task_vector_patching` the page runs with; raises InputError
        naming a bad control."""
        tasks = list(self.patching_tasks)
        if not tasks:
            raise InputError("`Patching: tasks` must hold at least one task; got none.")
        try:
            layers = parse_layers(self.patching_layers, self._model.spec.n_layers)
        except InputError as e:
            raise InputError(str(e).replace("`Conflict: layers`", "`Patching: layers`")) from None
        return dict(tasks=tasks, layers=layers, **self._opts)

    def run_patching(self) -> None:
        """The zero-shot patching test for the chosen tasks and layers, in the background
        with progress; bad input is one message and keeps the last result."""
        try:
            settings = self.patching_settings()
        except InputError as e:
            self.show_error(e)
            return
        m = self._model

        def job(token: CancelToken):
            return tvp.task_vector_patching(m, settings.pop("tasks"),
                                            progress=self.progress_fn(token), **settings)

        self.status = "computing the patching test…"
        self.submit("patching", job)

    def _got_patching(self, ds: xr.Dataset) -> None:
        tasks = [str(t) for t in ds["task"].values]
        keep = self.patching_shown if self.patching_shown in tasks else MEAN_OVER_TASKS
        self.param.patching_shown.objects = [MEAN_OVER_TASKS, *tasks]
        with param.parameterized.discard_events(self):
            self.param.update(patching=ds, patching_shown=keep)
        self.param.trigger("patching", "patching_shown")
        self._patching_button.label = "Run the patching test again"
        self.status = "patching test ready"

    def _conflict_failed(self, exc: BaseException) -> None:
        self._conflict_button.disabled = False
        self.conflict_error = str(exc)
        theme.notify("error", f"Conflict test: {exc}")

    def _got_conflict(self, out: xr.Dataset | InputError) -> None:
        if isinstance(out, InputError):
            self._conflict_failed(out)
            self.status = f"Conflict test not run: {out}"
            return
        layers = [int(x) for x in out["layer"].values]
        best = out.attrs.get("best_layer")
        keep = (self.conflict_layer if self.conflict_layer in layers
                else best if best in layers else layers[-1])
        self.param.conflict_layer.objects = layers
        with param.parameterized.discard_events(self):
            self.param.update(conflict=out, conflict_layer=keep)
        self.param.trigger("conflict", "conflict_layer")
        self._conflict_button.param.update(disabled=False, name="Run the conflict test again")
        self.status = "conflict test ready"

    def _compute(self) -> None:
        """The page's heavy work: head scores (then the FV) and the task encoding."""
        if self.td is None:
            self._request("td")
        self._request("scores")

    def _request(self, name: str) -> None:
        m, o = self._model, self._opts
        edits = list(self.edits)
        if name == "scores":
            started = time.perf_counter()
            self._score_button.disabled = True

            def job(token: CancelToken):
                ind = ih.induction_scores(m, n_sequences=4, half_len=16, edits=edits)
                token.check()
                bar = self.progress_fn(token)

                def progress(done: int, total: int) -> None:
                    bar(done, total)
                    left = (time.perf_counter() - started) * (total - done) / max(1, done)
                    self.post(status=f"scoring heads: {done}/{total}, about {left:.0f} s left")
                fv = ih.fv_scores(m, self._fv_tasks, progress=progress, **o)
                return xr.merge([ind[["induction_score"]], fv[["fv_score", "mean_z"]]],
                                combine_attrs="drop_conflicts")
        elif name == "patterns":
            layer, head, task = self.layer, self.head, self._task()

            def job(token: CancelToken):
                return ih.head_attention(m, layer, head, task=task, edits=edits)
        elif name == "curves":
            if self.scores is None:
                return
            ind, fv = self.scores["induction_score"].values, self.scores["fv_score"].values
            top = float(self.max_percent)
            percents = sorted({0.0, *[p for p in (1, 3, 5, 10, 20, 30, 50) if p <= top], top})
            rankings = (("fv_excl_induction", "induction_excl_fv", "random")
                        if self.exclude_other else ("fv", "induction", "random"))
            exclude = max(self.top_induction, self.top_fv) / 100
            source = self.mean_source

            def job(token: CancelToken):
                progress = self.progress_fn(token)
                return ih.ablation_curves(m, self._eval_tasks, ind, fv, percents=percents,
                                          rankings=rankings, exclude_fraction=exclude,
                                          loss_sequences=2, loss_tokens=64, progress=progress,
                                          mean_source=source, mean_tasks=self._fv_tasks,
                                          edits=edits, **o)
        elif name == "fv":
            if self.scores is None:
                return
            fv, layer, task = self.scores["fv_score"].values, self.fv_layer, self._task()

            def job(token: CancelToken):
                return tv.function_vector_accuracy(m, [task], fv, layer=layer, **o)
        else:
            def job(token: CancelToken):
                # every prompt of the tasks and the Null task, less the one left out
                n_points = (len(self._td_tasks) + 1) * o["n_prompts"]
                return tv.task_decodability(m, self._td_tasks, k=min(10, n_points - 1), **o)
        if name != "td":   # task decodability computes quietly beside the rest
            self.status = f"computing {name}…"
        self.submit(name, job)

    def _edits_changed(self) -> None:
        """The workspace's edits changed: recompute what they reach (attention, the induction
        score, the ablation curves once computed)."""
        self._request("patterns")
        if self.scores is not None:
            m, edits = self._model, list(self.edits)
            self.submit("induction", lambda token: ih.induction_scores(
                m, n_sequences=4, half_len=16, edits=edits))
        if self.curves is not None:
            self._request("curves")

    def _got_induction(self, ds: xr.Dataset) -> None:
        if self.scores is not None:
            self.scores = self.scores.assign(induction_score=ds["induction_score"])

    def _got_scores(self, ds: xr.Dataset) -> None:
        self.scores = ds
        self._score_button.param.update(disabled=False, name="Compute scores again")
        fv = ds["fv_score"].values
        layer, head = np.unravel_index(int(np.nanargmax(fv)), fv.shape)
        self.param.update(layer=int(layer), head=int(head))
        self._request("patterns")
        self._request("fv")
        self.status = "scores ready"

    def _got_patterns(self, d: dict) -> None:
        self.patterns = d
        self.status = "ready" if self.scores is not None else self._press_note

    def _got_curves(self, ds: xr.Dataset) -> None:
        self.curves = ds
        self.status = "ablation curves ready"

    def _got_fv(self, ds: xr.Dataset) -> None:
        self.fv_result = ds
        if self.status == "computing fv…":
            self.status = "ready"

    def _got_td(self, ds: xr.Dataset) -> None:
        self.td = ds

    def show_error(self, exc: BaseException) -> None:
        super().show_error(exc)
        self._score_button.disabled = False
        self._conflict_button.disabled = False

    def _tapped(self, index: list[int]) -> None:
        if index and self.scores is not None:
            n_heads = self.scores.sizes["head"]
            self.param.update(layer=index[0] // n_heads, head=index[0] % n_heads)

    def _cell_tapped(self, x: Any = None, y: Any = None) -> None:
        """A click on a heatmap cell (x = head, y = layer) selects that head."""
        cell = head_cell(x, y, self.scores)
        if cell is not None:
            self.param.update(layer=cell[0], head=cell[1])

    # -- reproducibility ------------------------------------------------------------------
    def code_snippet(self) -> str:
        """Python that recomputes what the page shows: the head scores, the selected head's
        attention, the function vector, the task encoding, and the ablation curves and the
        conflict test once computed; a result the page has not computed yet is a comment."""
        o = self._opts
        opts = ", ".join(f"{k}={v!r}" for k, v in o.items())
        own = self.task == OWN_TASK and self._own_task is not None
        lines = ["import xarray as xr", "", "import explorer",
                 "from explorer.analyses import icl_heads as ih",
                 "from explorer.analyses import task_vector_patching as tvp",
                 "from explorer.analyses import task_vectors as tv"]
        if own:
            lines.append("from explorer.analyses import user_items")
        lines += ["", f"model = explorer.load_model({self._model.spec.name!r})",
                  f"opts = dict({opts})  # prompts per task, demonstrations per prompt"]
        if own:
            lines.append(f"task = user_items.parse_icl_pairs({self._own_text!r}, "
                         f"name={OWN_TASK!r}, min_pairs={self._min_pairs()})  # your pairs")
        task = "task" if own else repr(self.task)
        lines.append(f"patterns = ih.head_attention(model, {self.layer}, {self.head}, "
                     f"task={task})  # {explorer.components.head(self.layer, self.head)}")
        if self.scores is None:
            lines.append("# Compute scores on the page for the head scores and what follows")
        else:
            lines += ["induction = ih.induction_scores(model, n_sequences=4, half_len=16)",
                      f"fv = ih.fv_scores(model, {self._fv_tasks!r}, **opts)",
                      "scores = xr.merge([induction[['induction_score']], "
                      "fv[['fv_score', 'mean_z']]], combine_attrs='drop_conflicts')"]
        if self.fv_result is not None:
            fv_task = task if str(self.fv_result.task.values[0]) == OWN_TASK \
                else repr(str(self.fv_result.task.values[0]))
            lines.append(f"fv_result = tv.function_vector_accuracy(model, [{fv_task}], "
                         f"scores['fv_score'].values, layer={self.fv_result.attrs['layer']}, "
                         "**opts)")
        if self.td is not None:
            k = int(self.td.attrs.get("params", {}).get("k", 10))
            lines.append(f"td = tv.task_decodability(model, {self._td_tasks!r}, k={k}, **opts)")
        if self.curves is not None:
            c = self.curves.attrs.get("params", {})
            lines.append(
                f"curves = ih.ablation_curves(model, {self._eval_tasks!r}, "
                "scores['induction_score'].values, scores['fv_score'].values, "
                f"percents={[float(x) for x in self.curves.percent.values]!r}, "
                f"rankings={[str(r) for r in self.curves.ranking.values]!r}, "
                f"exclude_fraction={c.get('exclude_fraction')!r}, loss_sequences=2, "
                f"loss_tokens=64, mean_source={c.get('mean_source')!r}, "
                f"mean_tasks={self._fv_tasks!r}, **opts)")
        if self.patching is not None:
            tasks = [str(t) for t in self.patching.task.values]
            layers = [int(x) for x in self.patching.layer.values]
            lines.append(f"patching = tvp.task_vector_patching(model, {tasks!r}, "
                         f"layers={layers!r}, **opts)  # zero-shot, task / Null / no patch")
        if self.conflict is not None:
            tasks = [str(t) for t in self.conflict.target.values]
            layers = [int(x) for x in self.conflict.layer.values]
            lines += [f"conflict = tvp.conflicting_task_patching(model, {tasks!r}, "
                      f"layers={layers!r}, **opts)",
                      f"matrix = conflict['follows_source'].sel(source={tasks!r}, "
                      f"layer={self.conflict_layer})  # A x B at the layer shown",
                      "controls = conflict['follows_target'].sel(source=['null', 'none'], "
                      f"layer={self.conflict_layer})  # Null vector, no patch"]
        else:
            lines.append("# Run the conflict test on the page for "
                         "tvp.conflicting_task_patching(model, tasks, layers=..., **opts)")
        return "\n".join(lines) + "\n"

    # -- layout ---------------------------------------------------------------------------
    def _fv_text(self) -> str:
        return fv_caption(self.fv_result, self._fv_tasks)

    def _state_html(self, *_: Any) -> str:
        """Hidden markers of what the page shows (read by the browser test)."""
        curves = "none" if self.curves is None else ",".join(
            f"{p:g}" for p in self.curves["percent"].values)
        rankings = "none" if self.curves is None else ",".join(
            str(r) for r in self.curves["ranking"].values)
        fv = "none" if self.fv_result is None else str(self.fv_result.attrs["layer"])
        conflict = ("none" if self.conflict is None else
                    ",".join(str(t) for t in self.conflict["target"].values))
        return (f"<div class='icl-state' data-icl-scores='{'ready' if self.scores is not None else 'none'}' "
                f"data-icl-head='{self.layer}:{self.head}' data-icl-curves='{curves}' "
                f"data-icl-rankings='{rankings}' "
                f"data-icl-fv='{fv}' data-icl-td='{'ready' if self.td is not None else 'none'}' "
                f"data-icl-conflict='{html.escape(conflict)}' "
                f"data-icl-conflict-layer='{self.conflict_layer}'></div>")

    def __panel__(self) -> pn.viewable.Viewable:
        def scatter(scores, top_induction, top_fv, highlighted):
            plot = plot_head_scatter(scores, top_induction, top_fv, highlighted)
            if scores is not None:   # clicking a point selects its head
                points = plot.get(0) if isinstance(plot, hv.Overlay) else plot
                hv.streams.Selection1D(source=points).add_subscriber(self._tapped)
            return plot

        scatter = pn.bind(scatter, self.param.scores, self.param.top_induction, self.param.top_fv,
                          self.param.highlighted)

        def heatmaps(scores, highlighted):   # clicking a cell selects its head
            return on_head_click(plot_score_heatmaps(scores, highlighted), self._cell_tapped)

        heatmaps = pn.bind(heatmaps, self.param.scores, self.param.highlighted)
        pat_rep = pn.bind(lambda d, l, h: plot_attention(
            None if d is None else d["repeat"], f"{explorer.components.head(l, h)}, repeated sequence",
            "a repeated random sequence"),
            self.param.patterns, self.param.layer, self.param.head)
        pat_icl = pn.bind(lambda d, l, h, t: plot_attention(
            None if d is None else d["icl"], f"{explorer.components.head(l, h)}, {t} prompt",
            f"a few-shot {t} prompt"),
            self.param.patterns, self.param.layer, self.param.head, self.param.task)
        slider = pn.widgets.FloatSlider.from_param(self.param.max_percent)
        button = pn.widgets.Button(label="Recompute ablation curves", color="primary",
                                   description="Mean-ablate the top heads by each ranking and "
                                               "measure the evaluation tasks again.")
        button.on_click(lambda *_: self._request("curves"))
        slider.param.watch(lambda e: (setattr(self, "max_percent", e.new), self._request("curves")),
                           "value_throttled")
        p = self.param
        caption = dict(sizing_mode="stretch_width", styles={"font-size": "0.9em", "color": "#444"})
        controls = pn.Column(
            self._score_button, self._progress, pn.pane.Markdown(p.status),
            tip(pn.widgets.FloatSlider.from_param(p.top_induction), p.top_induction.doc),
            tip(pn.widgets.FloatSlider.from_param(p.top_fv), p.top_fv.doc),
            tip(pn.widgets.IntSlider.from_param(p.layer), p.layer.doc),
            tip(pn.widgets.IntSlider.from_param(p.head), p.head.doc),
            tip(pn.widgets.Select.from_param(p.task), p.task.doc), self._own.layout(p.error),
            tip(slider, p.max_percent.doc),
            tip(pn.widgets.Checkbox.from_param(p.exclude_other), p.exclude_other.doc),
            tip(pn.widgets.Select.from_param(p.mean_source), p.mean_source.doc), button,
            tip(pn.widgets.IntSlider.from_param(p.fv_layer), p.fv_layer.doc),
            tip(pn.widgets.IntSlider.from_param(p.td_layer), p.td_layer.doc),
            pn.pane.Markdown("**Task vectors: zero-shot patching**", margin=(10, 10, 0, 10)),
            tip(pn.widgets.MultiChoice.from_param(p.patching_tasks, sizing_mode="stretch_width"),
                p.patching_tasks.doc),
            tip(pn.widgets.TextInput.from_param(p.patching_layers), p.patching_layers.doc),
            self._patching_button,
            tip(pn.widgets.Select.from_param(p.patching_shown), p.patching_shown.doc),
            pn.pane.Markdown("**Task vectors: conflict test**", margin=(10, 10, 0, 10)),
            tip(pn.widgets.MultiChoice.from_param(p.conflict_tasks, sizing_mode="stretch_width"),
                p.conflict_tasks.doc),
            tip(pn.widgets.TextInput.from_param(p.conflict_layers), p.conflict_layers.doc),
            self._conflict_button,
            pn.pane.Markdown(pn.bind(lambda e: e or "", p.conflict_error), margin=(0, 10),
                             styles={"color": "#b00020", "font-size": "0.9em"},
                             css_classes=["icl-conflict-error"], sizing_mode="stretch_width"),
            tip(pn.widgets.DiscreteSlider.from_param(p.conflict_layer,
                                                     sizing_mode="stretch_width"),
                p.conflict_layer.doc),
            pn.pane.HTML(pn.bind(self._state_html, p.scores, p.layer, p.head, p.curves,
                                 p.fv_result, p.td, p.conflict, p.conflict_layer)),
            width=theme.SIZES["controls_width"])
        main = pn.Column(
            pn.pane.HoloViews(scatter, sizing_mode="stretch_width", linked_axes=False),
            pn.pane.Markdown(pn.bind(scatter_caption, p.scores, p.top_induction, p.top_fv),
                             **caption),
            # the clicked head's attention right under the scatter it was clicked on
            pn.pane.HoloViews(pat_rep, linked_axes=False, sizing_mode="stretch_width"),
            pn.pane.HoloViews(pat_icl, linked_axes=False, sizing_mode="stretch_width"),
            pn.pane.Markdown("Attention of the selected head (query rows, key columns): on a "
                             "repeated random sequence an induction head attends to the token "
                             "after the current token's earlier copy (a stripe below the "
                             "diagonal); on an ICL prompt, an FV head reads the demonstrations' "
                             "answers.", **caption),
            pn.pane.HoloViews(heatmaps, sizing_mode="stretch_width", linked_axes=False),
            pn.pane.Markdown("The same two scores as layer × head maps (click a cell to select "
                             "the head).", **caption),
            pn.pane.HoloViews(pn.bind(plot_ablation_curves, p.curves), linked_axes=False,
                              sizing_mode="stretch_width"),
            pn.pane.Markdown(pn.bind(ablation_caption, p.curves, p.mean_source),
                             css_classes=["icl-ablation-caption"], **caption),
            pn.pane.Markdown(pn.bind(lambda *_: self._fv_text(), p.fv_result),
                             css_classes=["icl-fv"], **caption),
            pn.pane.HoloViews(pn.bind(plot_projection, p.td, p.td_layer), linked_axes=False,
                              sizing_mode="stretch_width"),
            pn.pane.HoloViews(pn.bind(plot_td, p.td, p.td_layer), linked_axes=False,
                              sizing_mode="stretch_width"),
            pn.pane.Markdown(pn.bind(td_caption, p.td, p.td_layer), **caption),
            pn.pane.HoloViews(pn.bind(plot_patching, p.patching, p.patching_shown),
                              linked_axes=False, sizing_mode="stretch_width",
                              css_classes=["icl-patching"]),
            pn.pane.Markdown(pn.bind(patching_caption, p.patching, p.patching_shown),
                             css_classes=["icl-patching-caption"], **caption),
            # each in a Row of its own: Bokeh lines up the plot areas of one column's plots,
            # which squeezed these fixed-size plots to the attention maps' narrow area
            *[pn.Row(pn.pane.HoloViews(pn.bind(fn, p.conflict, p.conflict_layer),
                                       linked_axes=False, css_classes=css),
                     sizing_mode="stretch_width")
              for fn, css in ((plot_conflict_matrix, ["icl-conflict-matrix"]),
                              (plot_conflict_controls, ["icl-conflict-controls"]),
                              (plot_conflict_layers, []))],
            pn.pane.Markdown(pn.bind(conflict_caption, p.conflict, p.conflict_layer),
                             css_classes=["icl-conflict-caption"], **caption),
            sizing_mode="stretch_width")
        return pn.Row(controls, main, sizing_mode="stretch_width")


serve(__name__, ICLHeadsView, title="ICL heads: induction vs function-vector heads", intro="icl-heads")
