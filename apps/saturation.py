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
* a toggle between the trained weights and a random init of the same architecture.
"""
from __future__ import annotations

import hashlib
import html
import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import holoviews as hv
import numpy as np
import panel as pn
import param
import xarray as xr

import explorer
from apps import theme
from apps._session import CancelToken, Runner, user_message
from explorer._checks import ExplorerError, InputError, check_choice
from explorer.analyses import saturation as sat

__all__ = ["SaturationView", "TokenStrip", "detail_data", "plot_rank_table", "plot_staircase",
           "plot_tau_histogram", "plot_probe_accuracy", "plot_pareto", "plot_intervention",
           "export_figures"]

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
    hv.opts.Overlay(title="Lens top-k per layer (outlined: saturated)", xlabel="rank (1 = top)",
                    ylabel="layer", toolbar="above",
                    min_height=theme.SIZES["plot_min_height"], responsive=True),
)
_STAIRCASE_OPTS = (
    hv.opts.Scatter(size=9, color=theme.ACCENT, tools=["hover"]),
    hv.opts.Curve(interpolation="steps-mid", color=theme.ACCENT),
    hv.opts.Overlay(title="Staircase: saturation layer of each rank", xlabel="rank (1 = top)",
                    ylabel="saturation layer", min_height=theme.SIZES["plot_min_height"],
                    responsive=True),
)


def empty_detail(n_layers: int) -> dict[str, Any]:
    """A detail with no cells (before any click)."""
    z = np.zeros(0, dtype=int)
    return {"layers": n_layers, "layer": z, "rank": z, "label": [], "probability": z.astype(float),
            "saturated": z.astype(bool), "sat": z, "final": [], "token": ""}


def rank_table_elements(data: dict[str, Any]) -> hv.Overlay:
    """The rank table's elements without styling (cheap: the click path).

    Cells are rectangles centred on (rank, layer), so the axes stay numeric and the
    saturation outlines sit exactly on them.
    """
    d = data
    rank, layer = np.asarray(d["rank"], float), np.asarray(d["layer"], float)
    cells = hv.Rectangles((rank - 0.5, layer - 0.5, rank + 0.5, layer + 0.5, d["probability"],
                           d["label"]), vdims=["probability", "token"], group="Cells")
    fg = theme.text_colors(d["probability"], theme.CMAPS["probability"])   # readable on its cell
    labels = hv.Labels((rank, layer, d["label"], fg), kdims=["rank", "layer"], vdims=["token", "fg"])
    m = np.asarray(d["saturated"], bool)
    boxes = hv.Rectangles((rank[m] - 0.5, layer[m] - 0.5, rank[m] + 0.5, layer[m] + 0.5),
                          group="Saturated")
    return cells * labels * boxes


def staircase_elements(data: dict[str, Any]) -> hv.Overlay:
    """The staircase's elements without styling: s_j against rank j (never left out)."""
    s = np.asarray(data["sat"])
    ranks = np.arange(1, len(s) + 1)
    ok = s >= 0
    steps = hv.Curve((ranks[ok], s[ok]), kdims=["rank"], vdims=["saturation layer"])
    pts = hv.Scatter((ranks[ok], s[ok]), kdims=["rank"], vdims=["saturation layer"])
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
    if k not in ds.k_order.values.tolist():
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
            title="Kendall tau: rank vs saturation layer", xaxis=None, yaxis=None,
            min_height=theme.SIZES["plot_min_height"], responsive=True)
    cat = theme.CMAPS["categorical"]
    null = hv.Histogram((h["edges"], h["null"]), kdims=["tau"], vdims=["positions"],
                        label="permutation null").opts(fill_color=cat[1], fill_alpha=0.45,
                                                       line_color=None)
    obs = hv.Histogram((h["edges"], h["observed"]), kdims=["tau"], vdims=["positions"],
                       label="observed").opts(fill_color=cat[0], fill_alpha=0.6, line_color=None)
    mean = hv.VLine(h["mean_tau"]).opts(color="black", line_dash="dashed")
    return (null * obs * mean).opts(
        title=f"Strict Kendall tau, k={h['k']}: mean {h['mean_tau']:.3f}, p = {h['p_value']:.4f} "
              f"(n = {h['n']})", xlabel="tau (rank vs saturation layer)", ylabel="positions",
        legend_position="top_left", min_height=theme.SIZES["plot_min_height"], responsive=True)


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
        title=f"Task probe: tasks 0-{len(info['classes']) - 1} decided, chance {info['chance']:.2f}",
        ylim=(0, 1.02), legend_position="bottom_right", tools=["hover"],
        min_height=theme.SIZES["plot_min_height"], responsive=True)


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
    mi = int(np.abs(ds.theta_margin.values - theta_margin).argmin())
    ci = int(np.abs(ds.theta_cosine.values - theta_cosine).argmin())
    mp = hv.Points([(float(ds.margin_speedup.values[mi]), float(ds[f"margin_accuracy{suffix}"].values[mi]))],
                   kdims=["speed-up", ylabel]).opts(color=cat[0], size=12, marker="circle")
    cp = hv.Points([(float(ds.cosine_speedup.values[ci]), float(ds[f"cosine_accuracy{suffix}"].values[ci]))],
                   kdims=["speed-up", ylabel]).opts(color=cat[2], size=12, marker="circle")
    probe = hv.Points([(info["probe"]["speedup"], info["probe"][key])], kdims=["speed-up", ylabel],
                      label="probe").opts(color=cat[3], size=14, marker="diamond")
    oracle = hv.Points([(info["oracle"]["speedup"], info["oracle"][key])], kdims=["speed-up", ylabel],
                       label="oracle (true s_1)").opts(color="black", size=14, marker="star")
    return (m * c * mp * cp * probe * oracle).opts(
        title=f"Early exit ({info['n_positions']} positions): margin θ={ds.theta_margin.values[mi]:.2f}, "
              f"cosine θ={ds.theta_cosine.values[ci]:.4f}", legend_position="top_right",
        ylim=(0, 1.02), logx=True, min_height=theme.SIZES["plot_min_height"], responsive=True,
        tools=["hover"])


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
    labels = decode([r["top1_before"], r["top1_after"]])
    changed = "changed" if r["prediction_changed"] else "unchanged"
    return (before * after * inj).opts(
        title=f"Injected at layer {r['layer']}: s_1 {r['s1_before']} → {r['s1_after']}; prediction "
              f"{changed} ({labels[r['top1_before']]!r} → {labels[r['top1_after']]!r})",
        logy=True, legend_position="top_right", responsive=True, min_height=260)


# -- the view -------------------------------------------------------------------------------

class SaturationView(pn.viewable.Viewer):
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
    """

    weights = param.Selector(default="trained", objects=list(_WEIGHTS), label="Weights",
                             doc="The model's trained weights or a random init of the same "
                                 "architecture (the paper finds ordering in both).")
    n_tokens = param.Integer(default=1024, bounds=(64, 50_000), label="Corpus tokens analysed",
                             doc="Tokens of the shipped corpus run through the analysis.")
    text = param.Integer(default=0, bounds=(0, None), label="Text",
                         doc="Which text of the corpus the token strip shows.")
    k = param.Integer(default=5, bounds=(1, 10), label="Top-k",
                      doc="Ranks shown in the detail and used by the order test.")
    selected = param.Integer(default=-1, precedence=-1, doc="Clicked token position.")
    theta_margin = param.Number(default=0.5, bounds=(0.0, 1.0), step=0.02, label="Margin θ",
                                doc="Softmax-margin exit threshold: exit once p1 − p2 ≥ θ.")
    theta_cosine = param.Number(default=0.99, bounds=(0.5, 1.0), step=0.0005, label="Cosine θ",
                                doc="State-saturation exit threshold: exit once "
                                    "cos(h_l, h_l−1) ≥ θ.")
    against = param.Selector(default="full model", objects=["full model", "true next token"],
                             label="Accuracy against")
    pair = param.Integer(default=0, bounds=(0, None), label="Pair",
                         doc="Early/late-saturating token pair for the intervention.")
    inj_layer = param.Integer(default=0, bounds=(0, None), label="Injection layer",
                              doc="Block after which the early token's residual replaces the "
                                  "late token's.")

    result = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True, precedence=-1)
    intervention = param.Dict(default=None, allow_None=True, precedence=-1)
    running = param.Boolean(default=False, precedence=-1)
    busy = param.Boolean(default=False, precedence=-1)
    progress = param.Integer(default=0, bounds=(0, 100), precedence=-1)
    status = param.String(default="", precedence=-1)
    error = param.String(default="", precedence=-1)

    def __init__(self, model: explorer.Model, *, texts: list[str] | None = None,
                 store: Any = "default", background: bool | None = None,
                 analysis_options: dict[str, Any] | None = None, **params: Any):
        super().__init__(**params)
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
        if background is None:
            doc = pn.state.curdoc
            background = doc is not None and doc.session_context is not None
        self._lock = threading.Lock()
        self._cleans: dict[tuple, Any] = {}
        self._labels: dict[int, str] = {}
        self._runner = Runner(on_result=self._show_result, on_error=self._show_error,
                              on_busy=self._set_busy, background=background)
        self._inj_runner = Runner(on_result=self._show_intervention, on_error=self._show_error,
                                  on_busy=lambda b: None, background=background)
        self._runner.bind_session()
        self._inj_runner.bind_session()
        n_layers = model.spec.n_layers
        self.param.inj_layer.bounds = (0, max(0, n_layers - 2))
        self.param.watch(self._request_run, ["weights", "n_tokens"])
        self.param.watch(self._request_intervention, ["inj_layer"])
        self.param.watch(self._pair_changed, ["pair"])
        self.param.watch(self._text_changed, ["text"])
        self._request_run()

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
                self._labels[i] = theme.show_token(self._model.tokenizer.decode([i])) if i >= 0 else "∅"
            out[i] = self._labels[i]
        return out

    # -- the analysis -------------------------------------------------------------------------
    def _request_run(self, *events: Any) -> None:
        self.running = True
        self.progress = 0
        weights, started = self.weights, time.perf_counter()
        doc = pn.state.curdoc if self._runner.background else None

        def report(done: int, total: int) -> None:
            value = int(100 * done / max(1, total))
            if doc is not None and doc.session_context is not None:
                doc.add_next_tick_callback(lambda: setattr(self, "progress", value))
            else:
                self.progress = value

        def job(token: CancelToken):
            model = self.current_model()
            texts = self.texts()
            token.check()
            ds = sat.saturation_analysis(model, texts, store=self._store, progress=report,
                                         **self._options)
            return weights, ds.load(), time.perf_counter() - started

        self._runner.submit(job)

    def _show_result(self, out: tuple[str, xr.Dataset, float]) -> None:
        weights, ds, seconds = out
        n_texts = ds.sizes["prompt"]
        self.param.text.bounds = (0, n_texts - 1)
        summary = ds.attrs.get("summary", {})
        text = min(self.text, n_texts - 1)
        self.param.update(result=ds, error="", running=False, progress=100, text=text,
                          selected=-1, pair=0, intervention=None,
                          status=f"{ds.attrs['model']} ({weights}) · {summary.get('n_tokens')} tokens"
                                 f" · kept {summary.get('kept_fraction', 0):.0%} · {seconds:.1f} s")
        self.param.pair.bounds = (0, max(0, ds.sizes.get("pair", 1) - 1))
        self._pair_changed()

    def _show_error(self, exc: BaseException) -> None:
        message = user_message(exc)
        self.param.update(error=message, running=False, status=f"Last run failed: {message}")
        theme.notify("error", f"Saturation: {message}")

    def _set_busy(self, busy: bool) -> None:
        if self.busy != busy:
            self.busy = busy

    def wait(self, timeout: float | None = 600) -> SaturationView:
        """Block until the analysis and any intervention in flight have finished."""
        self._runner.wait(timeout)
        self._inj_runner.wait(timeout)
        return self

    def close(self) -> None:
        self._runner.close()
        self._inj_runner.close()
        with self._lock:
            self._cleans.clear()

    def _text_changed(self, *events: Any) -> None:
        self.selected = -1

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
            if clean is None:
                clean = explorer.clean_run(model, [text])
                with self._lock:
                    if len(self._cleans) > 4:
                        self._cleans.clear()
                    self._cleans[key] = clean
            token.check()
            return sat.inject_residual(model, text, source_pos=e, target_pos=l, layer=layer,
                                       clean=clean, baseline=base)

        self._inj_runner.submit(job)

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

    @param.depends("result", "text")
    def _strip(self):
        if self.result is None:
            return pn.pane.Markdown("Computing…")
        strip = TokenStrip(tokens=strip_tokens(self.result, self.text), selected=self.selected,
                           sizing_mode="stretch_width")
        strip.param.watch(lambda e: setattr(self, "selected", e.new), "selected")
        return strip

    def _detail_plots(self) -> pn.Row:
        """Rank table and staircase as DynamicMaps fed by a Pipe: a click sends new data and
        Bokeh patches the existing plots (no new figure, no re-trace)."""
        n_layers = self._model.spec.n_layers
        self._detail_pipe = hv.streams.Pipe(data=empty_detail(n_layers))
        limits = dict(xlim=(0.5, self.param.k.bounds[1] + 0.5), ylim=(-0.5, n_layers - 0.5))
        height = max(theme.SIZES["plot_min_height"], 18 * n_layers)      # one readable row a layer
        table = hv.DynamicMap(rank_table_elements, streams=[self._detail_pipe]).opts(
            *_RANK_TABLE_OPTS).opts(hv.opts.Overlay(min_height=height, **limits))
        stair = hv.DynamicMap(staircase_elements, streams=[self._detail_pipe]).opts(
            *_STAIRCASE_OPTS).opts(hv.opts.Overlay(**limits))
        self.param.watch(self._send_detail, ["result", "text", "selected", "k"])
        return pn.Row(pn.pane.HoloViews(table, sizing_mode="stretch_width",
                                        css_classes=["sat-rank-table"]),
                      pn.pane.HoloViews(stair, sizing_mode="stretch_width",
                                        css_classes=["sat-staircase"]),
                      sizing_mode="stretch_width")

    def _send_detail(self, *events: Any) -> None:
        d = self.detail()
        self._detail_pipe.send(d if d is not None else empty_detail(self._model.spec.n_layers))

    @param.depends("result", "text", "selected", "k")
    def _detail_header(self):
        d = self.detail()
        if d is None:
            return pn.pane.HTML('<span data-sat-detail="none"></span>Click a token to see its '
                                'layer × rank table and staircase.')
        marker = f"{self.text}:{self.selected}:{len(d['sat'])}"
        sat_text = ", ".join("never" if x < 0 else str(x) for x in d["sat"])
        finals = " ".join(html.escape(repr(t)) for t in d["final"])
        return pn.pane.HTML(f'<span data-sat-detail="{marker}"></span><b>Token {self.selected} '
                            f'{html.escape(repr(d["token"]))}</b>: final top-{len(d["sat"])} {finals}; '
                            f"s_1..s_{len(d['sat'])} = {sat_text}")

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
                         sizing_mode="stretch_width")

    @param.depends("result")
    def _probe(self):
        if self.result is None:
            return pn.pane.Markdown("")
        return pn.pane.HoloViews(plot_probe_accuracy(self.result), sizing_mode="stretch_width",
                                 css_classes=["sat-probe"])

    @param.depends("result", "theta_margin", "theta_cosine", "against")
    def _pareto(self):
        if self.result is None:
            return pn.pane.Markdown("")
        return pn.pane.HoloViews(plot_pareto(self.result, self.theta_margin, self.theta_cosine,
                                             against=self.against),
                                 sizing_mode="stretch_width", css_classes=["sat-pareto"])

    @param.depends("result", "intervention", "pair")
    def _intervention(self):
        pairs = self.pairs()
        if not pairs:
            return pn.pane.Markdown("No token pairs with the same prediction and far-apart s_1 "
                                    "in the analysed text.")
        label = html.escape(self.pair_label(min(self.pair, len(pairs) - 1)))
        return pn.Column(pn.pane.HTML(f"<b>Pair {self.pair}</b>: {label}"),
                         pn.pane.HoloViews(plot_intervention(self.intervention, self.decode),
                                           sizing_mode="stretch_width",
                                           css_classes=["sat-intervention"]),
                         sizing_mode="stretch_width")

    @param.depends("status", "error", "busy", "progress", "running")
    def _status(self):
        bar = pn.indicators.Progress(value=self.progress, max=100, active=self.running,
                                     visible=self.running, sizing_mode="stretch_width", height=12)
        text = f"⚠ {self.error}" if self.error else (
            "Analysing the corpus…" if self.running else self.status)
        return pn.Column(bar, pn.pane.Markdown(text, css_classes=["sat-status"]),
                         sizing_mode="stretch_width")

    def controls(self) -> pn.Column:
        widgets = {
            "weights": {"type": pn.widgets.RadioButtonGroup},
            "n_tokens": {"type": pn.widgets.IntInput, "step": 256},
            "text": {"type": pn.widgets.IntSlider, "throttled": True},
            "k": {"type": pn.widgets.IntSlider},
            "theta_margin": {"type": pn.widgets.FloatSlider},
            "theta_cosine": {"type": pn.widgets.FloatSlider, "format": "0.0000"},
            "against": {"type": pn.widgets.RadioButtonGroup},
            "pair": {"type": pn.widgets.IntSlider, "throttled": True},
            "inj_layer": {"type": pn.widgets.IntSlider, "throttled": True},
        }
        return pn.Param(self, parameters=list(widgets), widgets=widgets, show_name=False,
                        width=theme.SIZES["controls_width"])

    def __panel__(self) -> pn.viewable.Viewable:
        return pn.Row(
            self.controls(),
            pn.Column(
                self._status,
                pn.pane.Markdown("### Text, coloured by s_1 (dark: early, yellow: late, grey: "
                                 "never; click a token)"),
                self._strip, self._detail_header, self._detail_plots(),
                pn.Row(self._histogram, self._probe, sizing_mode="stretch_width"),
                pn.Row(self._pareto, self._intervention, sizing_mode="stretch_width"),
                sizing_mode="stretch_width"),
            sizing_mode="stretch_width")

    def page(self) -> pn.template.FastListTemplate:
        """The view in the app template (standalone serving)."""
        return theme.page([self.__panel__()], title="Saturation events")


def export_figures(folder: str | Path, *, max_tokens: int | None = None,
                   random_tokens: int | None = None, seed: int = 0,
                   model: str = "smollm2-135m",
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


if pn.state.served:
    theme.enable_extension()
    SaturationView(explorer.load_model()).page().servable()
