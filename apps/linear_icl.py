"""Linear-ICL page: scrub through the training of multi-head softmax attention on in-context
linear regression and watch the heads settle into the debiased-GD pattern.

He, Pan, Chen & Yang (ICML 2025): one attention layer trained on prompts (x_i, y_i) learns a
key-query x-block close to omega_h I and an output-value vector on the y entry only (mu_h), with
the heads pairing up (omega, mu) / (-omega, -mu) so that the sum of mu is about 0; the pair then
computes one step of debiased gradient descent. One head cannot cancel the mean of the context's
y and stays worse. The training-step slider drives the per-head KQ and OV heatmaps, the loss
against context length and the markers on the loss and pattern curves over training.
"""
from __future__ import annotations

import functools
import threading
from typing import Any

import holoviews as hv
import numpy as np
import panel as pn
import param
import xarray as xr

from apps import theme
from apps._session import CancelToken
from apps._view import STATIC_TOOLS, View, serve
from explorer.analyses.linear_icl import (
    attention_patterns,
    linear_icl_run,
    stored_linear_icl_analysis,
)

__all__ = ["LinearICLView", "DEFAULT_HEADS", "plot_kq_heatmaps", "plot_ov_heatmap",
           "plot_loss_curves", "plot_loss_by_length", "plot_pattern_metrics"]

#: Head counts trained (or loaded) for the page by default.
DEFAULT_HEADS: tuple[int, ...] = (1, 2, 4)

hv.extension("bokeh", logo=False)

_TOOLS = STATIC_TOOLS


_font = theme.font_sizes


_placeholder = functools.partial(theme.placeholder, height=280)


# -- plots (pure: Datasets in, HoloViews out) ------------------------------------------------

def plot_kq_heatmaps(patterns: xr.Dataset | None) -> hv.Element:
    """W_KQ of every head at one checkpoint (rows: query feature, columns: key feature)."""
    if patterns is None:
        return _placeholder("No run yet.")
    kq = patterns["W_KQ"].values                                        # [head, q, k]
    feats = [str(f) for f in patterns["query_feature"].values]
    # The query's y entry is always 0: that row of W_KQ never acts (and is never trained).
    rows_named = feats[:-1] + [f"{feats[-1]} (unused)"]
    lim = float(np.abs(kq[:, :-1]).max()) or 1.0
    panels = []
    for h in range(kq.shape[0]):
        rows = [(feats[j], rows_named[i], float(kq[h, i, j])) for i in range(len(feats))
                for j in range(len(feats))]
        omega = float(patterns["omega"].values[h])
        err = float(patterns["kq_identity_error"].values[h])
        panels.append(hv.HeatMap(rows, ["key feature", "query feature"], "W_KQ").opts(
            cmap=theme.SIGNED_CMAP, clim=(-lim, lim), colorbar=h == kq.shape[0] - 1,
            tools=["hover"], invert_yaxis=True, width=280 if h < kq.shape[0] - 1 else 350,
            height=260, default_tools=_TOOLS, fontsize=_font(), line_color="white", line_width=0.5,
            title=f"head {h}: ω {omega:+.3f}, err {err:.2f}"))
    return hv.Layout(panels).cols(4).opts(shared_axes=False)


def plot_ov_heatmap(patterns: xr.Dataset | None) -> hv.Element:
    """W_OV of every head at one checkpoint: the weight each head gives each token entry."""
    if patterns is None:
        return _placeholder("No run yet.", height=200)
    ov = patterns["W_OV"].values                                        # [head, feature]
    feats = [str(f) for f in patterns["feature"].values]
    lim = float(np.abs(ov).max()) or 1.0
    rows = [(feats[j], f"head {h}", float(ov[h, j])) for h in range(ov.shape[0]) for j in range(len(feats))]
    ratio = float(patterns["mu_sum_ratio"])
    return hv.HeatMap(rows, ["feature", "head"], "W_OV").opts(
        cmap=theme.SIGNED_CMAP, clim=(-lim, lim), colorbar=True, tools=["hover"], invert_yaxis=True,
        responsive=True, height=90 + 36 * ov.shape[0], default_tools=_TOOLS, fontsize=_font(),
        line_color="white", line_width=0.5,
        title=f"OV per head (μ = the y column); |Σμ| / Σ|μ| = {ratio:.3f}")


def plot_loss_curves(analyses: dict[int, xr.Dataset], step: int | None, n_heads: int | None) -> hv.Element:
    """Test loss at the training context length over training, one line per head count,
    with the debiased-GD and Bayes-optimal losses as horizontal lines."""
    if not analyses:
        return _placeholder("Training…")
    curves = []
    some = next(iter(analyses.values()))
    L = int(some.attrs["params"]["run_params"].get("context_length", 40))
    for i, (H, ds) in enumerate(sorted(analyses.items())):
        loss = ds["test_loss"].sel(test_context_length=L)
        curves.append(hv.Curve((ds["step"].values, loss.values), "training step", "test MSE",
                               label=f"H = {H}").opts(color=theme.CATEGORICAL[i % len(theme.CATEGORICAL)],
                                                      line_width=3 if H == n_heads else 1.5))
    bayes = float(some["baseline_bayes_expected"].sel(context_length=L))
    dgd = float(some["baseline_debiased_gd"].sel(context_length=L))
    curves.append(hv.HLine(bayes).opts(color="black", line_dash="dashed", line_width=1))
    curves.append(hv.HLine(dgd).opts(color="grey", line_dash="dotdash", line_width=1))
    curves.append(hv.Text(float(some["step"].values[-1]), bayes, "Bayes optimal ", halign="right",
                          valign="bottom", fontsize=8))
    curves.append(hv.Text(float(some["step"].values[-1]), dgd, "debiased GD ", halign="right",
                          valign="bottom", fontsize=8))
    if step is not None:
        curves.append(hv.VLine(float(step)).opts(color="black", line_dash="dashed", line_width=1.2))
    return hv.Overlay(curves).opts(
        logy=True, responsive=True, height=300, default_tools=_TOOLS, fontsize=_font(),
        legend_position="top_right", tools=["hover"],
        title=f"Test loss at context length {L} over training (H = 1 vs H ≥ 2)")


def plot_loss_by_length(run: xr.Dataset | None, analysis: xr.Dataset | None, step: int | None) -> hv.Element:
    """Test loss against context length at one checkpoint, with the baselines."""
    if run is None or analysis is None or step is None:
        return _placeholder("Measuring baselines…")
    lengths = run["context_length"].values
    model = run["test_loss"].sel(step=step).values
    L = int(run.attrs.get("params", {}).get("context_length", 40))
    parts = [hv.Curve((lengths, model), "context length", "test MSE", label="model at this step").opts(
        color=theme.ACCENT, line_width=3),
        hv.Scatter((lengths, model), "context length", "test MSE").opts(color=theme.ACCENT, size=6)]
    base_L = analysis["context_length"].values
    for i, (name, label) in enumerate((("baseline_debiased_gd", "debiased GD (step size fit at L = "
                                        f"{L})"), ("baseline_gd", "GD (step size fit at L = "
                                                                  f"{L})"),
                                       ("baseline_bayes_expected", "Bayes optimal (ridge)"))):
        parts.append(hv.Curve((base_L, analysis[name].values), "context length", "test MSE",
                              label=label).opts(color=theme.CATEGORICAL[(i + 1) % len(theme.CATEGORICAL)],
                                                line_dash=["dotdash", "dotted", "dashed"][i], line_width=2))
    parts.append(hv.VLine(float(L)).opts(color="grey", line_dash="dotted", line_width=1))
    return hv.Overlay(parts).opts(
        logx=True, logy=True, responsive=True, height=300, default_tools=_TOOLS, fontsize=_font(),
        legend_position="top_right", tools=["hover"],
        title=f"Length generalisation at step {step} (dotted: training length)")


def plot_pattern_metrics(analysis: xr.Dataset | None, step: int | None) -> hv.Element:
    """omega and mu of each head, and the pattern metrics, over training."""
    if analysis is None:
        return _placeholder("Measuring patterns…")
    steps = analysis["step"].values
    marker = theme.step_marker(steps, step)
    common = dict(responsive=True, height=260, default_tools=_TOOLS, fontsize=_font(),
                  tools=["hover"], xlabel="training step")
    heads = analysis["head"].values
    color = {h: theme.CATEGORICAL[i % len(theme.CATEGORICAL)] for i, h in enumerate(heads)}
    omega = hv.Overlay([hv.Curve((steps, analysis["omega"].sel(head=h).values), "training step", "ω",
                                 label=f"head {h}").opts(color=color[h], line_width=2) for h in heads]
                       + [marker]).opts(title="ω per head (KQ x-block / √(d+1))",
                                        legend_position="bottom_right", **common)
    mu = hv.Overlay([hv.Curve((steps, analysis["mu"].sel(head=h).values), "training step", "μ",
                              label=f"head {h}").opts(color=color[h], line_width=2) for h in heads]
                    + [marker]).opts(title="μ per head (OV weight on y)",
                                     legend_position="bottom_right", **common)
    metrics = []
    for i, (name, label) in enumerate((("kq_identity_error_max", "KQ: distance from ωI"),
                                       ("ov_offy_ratio_max", "OV: energy off y"),
                                       ("mu_sum_ratio", "|Σμ| / Σ|μ|"),
                                       ("dgd_r2", "1 − R² vs debiased GD"))):
        values = analysis[name].values
        if name == "dgd_r2":
            values = 1 - values
        metrics.append(hv.Curve((steps, np.clip(values, 1e-5, None)), "training step", "metric",
                                label=label).opts(color=theme.CATEGORICAL[i], line_width=2))
    reached = analysis.attrs.get("pattern_step")
    if reached is not None:
        metrics.append(hv.VLine(float(reached)).opts(color=theme.CATEGORICAL[0], alpha=0.5, line_width=1))
    pattern = hv.Overlay(metrics + [marker]).opts(
        logy=True, legend_position="top_right", legend_opts={"background_fill_alpha": 0.5},
        title="Pattern metrics" + (f" (pattern from step {reached})" if reached else ""),
        **common)
    return hv.Layout([omega, mu, pattern]).cols(3).opts(shared_axes=False)


# -- the view --------------------------------------------------------------------------------

class LinearICLView(View):
    """Training of one-layer multi-head softmax attention on in-context linear regression.

    Parameters
    ----------
    model : explorer.Model, optional
        Ignored (the gallery passes its language model; this page trains its own).
    runs : dict of int to xarray.Dataset, optional
        Runs from `explorer.analyses.linear_icl.train_linear_icl` by head count. Default: the
        stored runs with the paper's settings for H in `DEFAULT_HEADS` (trained on first use).
    analyses : dict of int to xarray.Dataset, optional
        Their `linear_icl_analysis`, by head count; computed when not given.
    heads : tuple of int, default=DEFAULT_HEADS
        Head counts to load or train when ``runs`` is not given.
    background : bool, optional
        Compute in a worker thread (default when served) or inline (tests, notebooks).
    """

    notify_title = "Linear ICL"
    wait_timeout = 1200

    n_heads = param.Selector(default=None, objects=[], label="Heads (H)",
                             doc="Which run the heatmaps and pattern curves show.")
    step = param.Selector(default=None, objects=[], label="Training step",
                          doc="Checkpoint of the heatmaps and of the markers.")

    runs = param.Dict(default={}, precedence=-1)
    analyses = param.Dict(default={}, precedence=-1)

    def __init__(self, model: Any = None, *, runs: dict[int, xr.Dataset] | None = None,
                 analyses: dict[int, xr.Dataset] | None = None,
                 heads: tuple[int, ...] = DEFAULT_HEADS, background: bool | None = None,
                 **params: Any):
        super().__init__(background=background, **params)
        self._lock = threading.Lock()
        self._patterns: dict[tuple[int, int], xr.Dataset] = {}
        self.runner("load", self._loaded)
        self.param.watch(self._switch_run, "n_heads")
        given = dict(runs or {})
        if given and analyses is not None and set(analyses) == set(given):
            self._loaded({"runs": given, "analyses": dict(analyses)})
        else:
            self.submit("load", lambda token: self._load(given, tuple(heads), token))

    # -- computation ---------------------------------------------------------------------
    def _load(self, given: dict[int, xr.Dataset], heads: tuple[int, ...],
              token: CancelToken) -> dict[str, dict]:
        runs = dict(given)
        for H in ([] if given else heads):
            progress = self.status_reporter(
                token, lambda done, total, s, H=H: f"Training H = {H}: step {done}/{total} ({s:.0f} s)…")
            self.post(status=f"Loading the stored run with H = {H} (training it if missing)…")
            runs[H] = linear_icl_run(n_heads=H, progress=progress)
            token.check()
        analyses = {}
        for H, run in sorted(runs.items()):
            self.post(status=f"Measuring patterns and baselines for H = {H}…")
            analyses[H] = stored_linear_icl_analysis(run) if not given else _analyse(run)
            token.check()
        return {"runs": runs, "analyses": analyses}

    def _loaded(self, out: dict[str, dict]) -> None:
        runs = {int(k): v for k, v in out["runs"].items()}
        self.analyses = out["analyses"]
        self.runs = runs
        self.param.n_heads.objects = sorted(runs)
        choice = 2 if 2 in runs else sorted(runs)[0]
        if self.n_heads == choice:
            self._switch_run()
        else:
            self.n_heads = choice
        parts = []
        for H, ds in sorted(self.analyses.items()):
            loss = ds.attrs.get("final_test_loss")
            parts.append(f"H={H}: loss {loss:.3f}" if loss is not None else f"H={H}")
        self.status = "Runs: " + "; ".join(parts) + "."

    def _switch_run(self, *events: Any) -> None:
        run = self.runs.get(self.n_heads)
        if run is None:
            return
        steps = [int(s) for s in run["step"].values]
        keep = self.step if self.step in steps else steps[-1]
        self.param.step.objects = steps
        with param.parameterized.discard_events(self):
            self.step = keep
        self.param.trigger("step")

    @param.depends("n_heads", "step")
    def patterns(self) -> xr.Dataset | None:
        """KQ/OV patterns of the selected run at the current step."""
        run = self.runs.get(self.n_heads)
        if run is None or self.step is None or self.step not in run["step"].values:
            return None
        key = (self.n_heads, self.step)
        with self._lock:
            if key not in self._patterns:
                if len(self._patterns) > 256:
                    self._patterns.clear()
                self._patterns[key] = attention_patterns(run.sel(step=self.step))
            return self._patterns[key]

    @param.depends("n_heads", "step")
    def _kq_plot(self) -> hv.Element:
        return plot_kq_heatmaps(self.patterns())

    @param.depends("n_heads", "step")
    def _ov_plot(self) -> hv.Element:
        return plot_ov_heatmap(self.patterns())

    @param.depends("analyses", "n_heads", "step")
    def _loss_plot(self) -> hv.Element:
        return plot_loss_curves(self.analyses, self.step, self.n_heads)

    @param.depends("analyses", "n_heads", "step")
    def _length_plot(self) -> hv.Element:
        return plot_loss_by_length(self.runs.get(self.n_heads), self.analyses.get(self.n_heads), self.step)

    @param.depends("analyses", "n_heads", "step")
    def _metrics_plot(self) -> hv.Element:
        return plot_pattern_metrics(self.analyses.get(self.n_heads), self.step)

    @param.depends("analyses", "n_heads", "step")
    def summary(self) -> str:
        """One line on the current checkpoint: omega, mu, pattern metrics, loss."""
        pats = self.patterns()
        if pats is None:
            return "No run loaded yet."
        run = self.runs[self.n_heads]
        L = int(run.attrs.get("params", {}).get("context_length", 40))
        losses = run["test_loss"].sel(step=self.step)
        loss = float(losses.sel(context_length=L)) if L in losses["context_length"].values else float("nan")
        fmt = ", ".join
        return (f"**H = {self.n_heads}, step {self.step}**: ω = [{fmt(f'{v:+.3f}' for v in pats['omega'].values)}], "
                f"μ = [{fmt(f'{v:+.2f}' for v in pats['mu'].values)}]; KQ distance from ωI "
                f"{float(pats['kq_identity_error_max']):.3f}, OV energy off y "
                f"{float(pats['ov_offy_ratio_max']):.4f}, |Σμ|/Σ|μ| {float(pats['mu_sum_ratio']):.3f}; "
                f"test loss at L = {L}: {loss:.3f}.")

    # -- layout --------------------------------------------------------------------------
    def controls(self) -> pn.Column:
        widgets = {"n_heads": {"type": pn.widgets.RadioButtonGroup, "color": "primary",
                               "variant": "outline"},
                   "step": {"type": pn.widgets.DiscreteSlider}}
        return pn.Column(pn.Param(self, parameters=list(widgets), widgets=widgets, show_name=False,
                                  sizing_mode="stretch_width"),
                         width=theme.SIZES["controls_width"], css_classes=["icl-controls"])

    def __panel__(self) -> pn.viewable.Viewable:
        spinner = pn.indicators.LoadingSpinner(value=self.param.busy, visible=self.param.busy,
                                               size=theme.SIZES["spinner"], color="primary")
        status = pn.pane.Str(self.param.status, styles={"color": "#555"}, margin=(12, 10))

        def pane(fn, css):
            return pn.pane.HoloViews(fn, sizing_mode="stretch_width", css_classes=[css])

        summary = pn.pane.Markdown(self.summary, css_classes=["icl-summary"])
        return pn.Row(self.controls(),
                      pn.Column(pn.Row(spinner, status, align="center"), summary,
                                pane(self._kq_plot, "icl-kq"), pane(self._ov_plot, "icl-ov"),
                                pn.Row(pane(self._loss_plot, "icl-loss"),
                                       pane(self._length_plot, "icl-length")),
                                pane(self._metrics_plot, "icl-metrics"),
                                sizing_mode="stretch_width"),
                      sizing_mode="stretch_width")


def _analyse(run: xr.Dataset) -> xr.Dataset:
    from explorer.analyses.linear_icl import linear_icl_analysis

    return linear_icl_analysis(run, n_prompts=512)


serve(__name__, LinearICLView, title=f"{theme.TITLE}: in-context linear regression", model=False, intro="linear-icl")
