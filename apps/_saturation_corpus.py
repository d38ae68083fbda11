"""The saturation page's corpus analysis: running it (or reading it from the store), its
cost estimate, and its statistics plots (the Kendall tau histogram with its permutation
null, the task probe per layer, the early-exit Pareto plot)."""
from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import holoviews as hv
import numpy as np
import panel as pn
import param
import xarray as xr

from apps import theme
from apps._controls import caption
from apps._session import CancelToken
from explorer._checks import ExplorerError
from explorer.analyses import saturation as sat

__all__ = ["tau_histogram_data", "plot_tau_histogram", "tau_caption", "plot_probe_accuracy",
           "probe_caption", "pareto_markers", "plot_pareto", "pareto_caption", "OPEN_BUDGET_S",
           "estimated_seconds", "CorpusPart"]

hv.extension("bokeh", logo=False)


_WEIGHTS = ("trained", "random-init")


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


def _part_summary(ds: xr.Dataset | None, part: str) -> dict[str, Any] | None:
    """The JSON summary the analysis stores beside its ``part`` ("probe" or "early_exit"),
    or None where the result has no such part (too few positions, no sampled positions)."""
    name = f"{part}_summary"
    if ds is None or name not in ds:
        return None
    return json.loads(str(ds[name].values))


def plot_probe_accuracy(ds: xr.Dataset) -> hv.Element:
    """Balanced accuracy per layer of the task probe, the random-feature control and chance."""
    info = _part_summary(ds, "probe")
    if info is None:
        why = ds.attrs.get("probe_error", "too few positions")
        return hv.Text(0, 0, f"no probe: {why[:80]}").opts(
            title="Task probe", xaxis=None, yaxis=None, responsive=True,
            min_height=theme.SIZES["plot_min_height"])
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
    info = _part_summary(ds, "probe")
    if info is None:
        return ""
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
    info = _part_summary(ds, "early_exit")
    if info is None:
        return hv.Text(0, 0, "no early-exit result").opts(
            title="Early exit", xaxis=None, yaxis=None, responsive=True,
            min_height=theme.SIZES["plot_min_height"])
    suffix = "" if against == "full model" else "_true"
    key = "accuracy" if against == "full model" else "accuracy_true"
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
    info = _part_summary(ds, "early_exit")
    if info is None:
        return ""
    return (f"Over {info['n_positions']} positions: accuracy of exiting early against the "
            f"speed-up (layers saved), for the two threshold rules as θ varies (the dots: the "
            f"θ sliders), the probe's exit and the oracle that exits at the true s_1.")


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


class _CachedOnly:
    """A store that answers from its entries and never computes (`LookupError` on a miss)."""

    def __init__(self, store: Any):
        self._store = store

    def get_or_compute(self, parts: dict, compute: Any, **_: Any) -> xr.Dataset:
        hit = self._store.get(self._store.key(parts))
        if hit is None:
            raise LookupError("not cached")
        return hit


def _note(text: Any) -> pn.pane.Markdown:
    """A caption under one of the page's plots: its numbers and how to read it."""
    return caption(text, margin=(0, 10))


class CorpusPart:
    """Runs the corpus analysis of `SaturationView` and shows its statistics."""

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
                         _note(tau_caption(h)), sizing_mode="stretch_width")

    @param.depends("result")
    def _probe(self):
        if self.result is None:
            return pn.pane.Markdown("")
        return pn.Column(pn.pane.HoloViews(plot_probe_accuracy(self.result),
                                           sizing_mode="stretch_width", css_classes=["sat-probe"]),
                         _note(probe_caption(self.result)), sizing_mode="stretch_width")

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
                                      margin=0), plot, _note(pareto_caption(self.result)),
                         sizing_mode="stretch_width")
