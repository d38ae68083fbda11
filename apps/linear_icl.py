"""Linear-ICL page: scrub through the training of multi-head softmax attention on in-context
linear regression and watch the heads settle into the debiased-GD pattern.

He, Pan, Chen & Yang (ICML 2025): one attention layer trained on prompts (x_i, y_i) learns a
key-query x-block close to omega_h I and an output-value vector on the y entry only (mu_h), with
the heads pairing up (omega, mu) / (-omega, -mu) so that the sum of mu is about 0; the pair then
computes one step of debiased gradient descent. One head cannot cancel the mean of the context's
y and stays worse. The training-step slider drives the per-head KQ and OV heatmaps, the loss
against context length and the markers on the loss and pattern curves over training.

Every panel is drawn at once from the run picked by the head count and the step slider, so the
words (titles, captions, summary) are of those controls; "Retrain" replaces a run only when the
new one lands. The page's record (`LinearICLView.shown_provenance`: the run, its seed, the
step, when the run landed) writes the page's code and the export's manifest.
"""
from __future__ import annotations

import functools
import time
from typing import Any

import holoviews as hv
import numpy as np
import panel as pn
import param
import xarray as xr

from apps import theme
from apps._paper import paper_panel
from apps._controls import caption, control, flex_row, run_page, show_steps, training_step
from apps._lab_provenance import lab_record
from apps._provenance import Provenance, computed_at_now
from apps._recipe import Call, Expr, Let, Note, Recipe, Step
from apps._session import CancelToken
from apps._view import STATIC_TOOLS, Scope, View, serve
from explorer.analyses.linear_icl import (
    DEFAULTS,
    SHIPPED_HEADS,
    TEST_LENGTHS,
    attention_patterns,
    linear_icl_run,
    stored_linear_icl_analysis,
    train_linear_icl,
)

__all__ = ["LinearICLView", "DEFAULT_HEADS", "plot_kq_heatmaps", "retrain_estimate",
           "plot_ov_heatmap", "plot_loss_curves", "plot_loss_by_length", "plot_head_curves", "plot_metric_curves",
           "plot_pattern_metrics", "kq_caption", "ov_caption", "loss_caption", "pattern_caption",
           "toy_head_name", "run_name"]

#: Head counts loaded for the page by default (shipped with the project: nothing is trained).
DEFAULT_HEADS: tuple[int, ...] = SHIPPED_HEADS

hv.extension("bokeh", logo=False)

_TOOLS = STATIC_TOOLS


_font = theme.font_sizes


_placeholder = functools.partial(theme.placeholder, height=280)


# -- plots (pure: Datasets in, HoloViews out) ------------------------------------------------

def toy_head_name(h: int) -> str:
    """A toy model's head: ``toy head 0``. Not the component spelling (``L0.H0``) of the
    workspace's model, which these one-layer regression models are not part of."""
    return f"toy head {int(h)}"


_head = toy_head_name


def run_name(run: xr.Dataset) -> str:
    """A linear-ICL run in a record: its head count, dimension and seed."""
    p = run.attrs.get("params", {})
    return (f"one-layer softmax attention ({p.get('n_heads', '?')} heads, d = {p.get('d', '?')}, "
            f"seed {run.attrs.get('seed', 0)})")


def plot_kq_heatmaps(patterns: xr.Dataset | None) -> hv.Element:
    """W_KQ of every head at one checkpoint (rows: query feature, columns: key feature), one
    small map per head at a fixed size (the page wraps them); the colour bar on the last."""
    if patterns is None:
        return _placeholder("No run yet.")
    kq = patterns["W_KQ"].values                                        # [head, q, k]
    feats = [str(f) for f in patterns["query_feature"].values]
    # The query's y entry is always 0: that row of W_KQ never acts (and is never trained).
    rows_named = feats[:-1] + [f"{feats[-1]} (unused)"]
    lim = float(np.abs(kq[:, :-1]).max()) or 1.0
    panels = []
    last = kq.shape[0] - 1
    for h in range(kq.shape[0]):
        rows = [(feats[j], rows_named[i], float(kq[h, i, j])) for i in range(len(feats))
                for j in range(len(feats))]
        # Feature names on the first map's y axis only: the maps sit side by side.
        panels.append(hv.HeatMap(rows, ["key feature", "query feature"], "W_KQ").opts(
            cmap=theme.SIGNED_CMAP, clim=(-lim, lim), colorbar=h == last, tools=["hover"],
            invert_yaxis=True, frame_width=150, frame_height=150, default_tools=_TOOLS,
            fontsize=_font(), line_color="white", line_width=0.5, title=_head(h),
            yaxis="left" if h == 0 else None, toolbar=None if h < last else "right"))
    return hv.Layout(panels).cols(4).opts(shared_axes=False)


def kq_caption(patterns: xr.Dataset | None) -> str:
    """The numbers behind the KQ maps: each head's omega and distance from omega I."""
    if patterns is None:
        return ""
    heads = "; ".join(f"{_head(h)}: ω {float(o):+.3f}, distance {float(e):.2f}" for h, o, e in zip(
        patterns["head"].values, patterns["omega"].values, patterns["kq_identity_error"].values))
    return (f"**W_KQ = W_Q W_Kᵀ per head.** {heads}. ω = mean of the x-block diagonal / √(d+1); "
            "distance = ‖x-block − ωI‖ / ‖x-block‖ (0: a scaled identity). The y row is unused: "
            "the query's y entry is always 0.")


def plot_ov_heatmap(patterns: xr.Dataset | None) -> hv.Element:
    """W_OV of every head at one checkpoint: the weight each head gives each token entry."""
    if patterns is None:
        return _placeholder("No run yet.", height=200)
    ov = patterns["W_OV"].values                                        # [head, feature]
    feats = [str(f) for f in patterns["feature"].values]
    lim = float(np.abs(ov).max()) or 1.0
    rows = [(feats[j], _head(h), float(ov[h, j])) for h in range(ov.shape[0]) for j in range(len(feats))]
    return hv.HeatMap(rows, ["feature", "head"], "W_OV").opts(
        cmap=theme.SIGNED_CMAP, clim=(-lim, lim), colorbar=True, tools=["hover"], invert_yaxis=True,
        responsive=True, height=110 + 36 * ov.shape[0], default_tools=_TOOLS, fontsize=_font(),
        line_color="white", line_width=0.5, title="W_OV per head")


def ov_caption(patterns: xr.Dataset | None) -> str:
    """The numbers behind the OV map: mu per head and how well the heads cancel."""
    if patterns is None:
        return ""
    mu = ", ".join(f"{_head(h)} {float(m):+.2f}" for h, m in zip(patterns["head"].values,
                                                                 patterns["mu"].values))
    return (f"**W_OV = W_V W_O per head**; μ = its y entry: {mu}. |Σμ| / Σ|μ| = "
            f"{float(patterns['mu_sum_ratio']):.3f} (0: the heads cancel the mean of y); "
            f"OV energy off y {float(patterns['ov_offy_ratio_max']):.4f}.")


def plot_loss_curves(analyses: dict[int, xr.Dataset], step: int | None, n_heads: int | None) -> hv.Element:
    """Test loss at the training context length over training, one line per head count,
    with the debiased-GD and Bayes-optimal losses as horizontal lines."""
    if not analyses:
        return _placeholder("No run loaded yet.")
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
    if step is not None:
        curves.append(hv.VLine(float(step)).opts(color="black", line_dash="dashed", line_width=1.2))
    losses = [ds["test_loss"].sel(test_context_length=L) for ds in analyses.values()]
    low = min([float(x.min()) for x in losses] + [bayes]) / 1.2
    high = max([float(x.max()) for x in losses] + [dgd]) * 1.2
    return hv.Overlay(curves).opts(
        logy=True, ylim=(low, high), responsive=True, height=300,
        default_tools=_TOOLS, fontsize=_font(), legend_position="right", tools=["hover"],
        title=f"Test loss at L = {L}")


def plot_loss_by_length(run: xr.Dataset | None, analysis: xr.Dataset | None, step: int | None) -> hv.Element:
    """Test loss against context length at one checkpoint, with the baselines."""
    if run is None or analysis is None or step is None:
        return _placeholder("No run loaded yet.")
    lengths = run["context_length"].values
    model = run["test_loss"].sel(step=step).values
    L = int(run.attrs.get("params", {}).get("context_length", 40))
    parts = [hv.Curve((lengths, model), "context length", "test MSE", label="model").opts(
        color=theme.ACCENT, line_width=3),
        hv.Scatter((lengths, model), "context length", "test MSE").opts(color=theme.ACCENT, size=6)]
    base_L = analysis["context_length"].values
    for i, (name, label) in enumerate((("baseline_debiased_gd", "debiased GD"),
                                       ("baseline_gd", "GD"),
                                       ("baseline_bayes_expected", "Bayes"))):
        parts.append(hv.Curve((base_L, analysis[name].values), "context length", "test MSE",
                              label=label).opts(color=theme.CATEGORICAL[(i + 1) % len(theme.CATEGORICAL)],
                                                line_dash=["dotdash", "dotted", "dashed"][i], line_width=2))
    parts.append(hv.VLine(float(L)).opts(color="grey", line_dash="dotted", line_width=1))
    values = np.concatenate([model] + [analysis[n].values for n in
                                       ("baseline_debiased_gd", "baseline_gd", "baseline_bayes_expected")])
    values = values[np.isfinite(values) & (values > 0)]
    low, high = float(values.min()) / 1.2, float(values.max()) * 1.2
    return hv.Overlay(parts).opts(
        logx=True, logy=True, ylim=(low, high), padding=(0.05, 0),
        xticks=[int(x) for x in lengths], responsive=True, height=300, default_tools=_TOOLS,
        fontsize=_font(), legend_position="right", tools=["hover"],
        title=f"Loss by length, step {step}")


def loss_caption(analyses: dict[int, xr.Dataset], n_heads: int | None) -> str:
    """What the two loss plots show, with the reference losses at the training length."""
    if not analyses:
        return ""
    some = analyses.get(n_heads, next(iter(analyses.values())))
    L = int(some.attrs["params"]["run_params"].get("context_length", 40))
    bayes = float(some["baseline_bayes_expected"].sel(context_length=L))
    dgd = float(some["baseline_debiased_gd"].sel(context_length=L))
    finals = "; ".join(f"H = {H}: {ds.attrs['final_test_loss']:.3f}" for H, ds in sorted(analyses.items())
                       if ds.attrs.get("final_test_loss") is not None)
    return (f"**Test loss (first plot):** test MSE on prompts of the training length L = {L} over training (thick: the "
            f"H shown), against debiased GD (dot-dash, {dgd:.3f}) and the Bayes-optimal ridge "
            f"(dashed, {bayes:.3f}); the dashed vertical line is the step shown. Final loss: {finals}. "
            "**Loss by length (second plot):** loss against context length at that step; the GD step sizes are fitted at "
            f"L = {L} (dotted) and kept at every length, as a trained model keeps its weights; Bayes "
            "= the posterior-mean ridge.")


def plot_head_curves(analysis: xr.Dataset | None, step: int | None, quantity: str = "omega") -> hv.Element:
    """``omega`` or ``mu`` of each head over training, the current step marked."""
    if analysis is None:
        return _placeholder("No run loaded yet.")
    steps = analysis["step"].values
    heads = analysis["head"].values
    symbol = {"omega": "ω", "mu": "μ"}[quantity]
    curves = [hv.Curve((steps, analysis[quantity].sel(head=h).values), "training step", symbol,
                       label=_head(h)).opts(color=theme.CATEGORICAL[i % len(theme.CATEGORICAL)], line_width=2)
              for i, h in enumerate(heads)]
    return hv.Overlay(curves + [theme.step_marker(steps, step)]).opts(
        responsive=True, height=260, default_tools=_TOOLS, fontsize=_font(), tools=["hover"],
        xlabel="training step", legend_position="right", title=f"{symbol} per head")


_METRICS = (("kq_identity_error_max", "KQ off ωI"), ("ov_offy_ratio_max", "OV off y"),
            ("mu_sum_ratio", "|Σμ|/Σ|μ|"), ("dgd_r2", "1 − R² (dGD)"))


def plot_metric_curves(analysis: xr.Dataset | None, step: int | None) -> hv.Element:
    """The pattern metrics over training (log scale), the current step marked and the step from
    which the pattern holds as a faint line."""
    if analysis is None:
        return _placeholder("No run loaded yet.")
    steps = analysis["step"].values
    metrics = []
    for i, (name, label) in enumerate(_METRICS):
        values = analysis[name].values
        if name == "dgd_r2":
            values = 1 - values
        metrics.append(hv.Curve((steps, np.clip(values, 1e-5, None)), "training step", "metric",
                                label=label).opts(color=theme.CATEGORICAL[i], line_width=2))
    reached = analysis.attrs.get("pattern_step")
    if reached is not None:
        metrics.append(hv.VLine(float(reached)).opts(color=theme.CATEGORICAL[0], alpha=0.5, line_width=1))
    return hv.Overlay(metrics + [theme.step_marker(steps, step)]).opts(
        logy=True, legend_position="right", responsive=True, height=260, default_tools=_TOOLS,
        fontsize=_font(), tools=["hover"], xlabel="training step", title="Pattern metrics")


def plot_pattern_metrics(analysis: xr.Dataset | None, step: int | None) -> hv.Element:
    """omega and mu of each head, and the pattern metrics, over training (three plots)."""
    if analysis is None:
        return _placeholder("No run loaded yet.")
    return hv.Layout([plot_head_curves(analysis, step, "omega"), plot_head_curves(analysis, step, "mu"),
                      plot_metric_curves(analysis, step)]).cols(3).opts(shared_axes=False)


def pattern_caption(analysis: xr.Dataset | None) -> str:
    """What the pattern curves show, and from which step the paper's pattern holds."""
    if analysis is None:
        return ""
    reached = analysis.attrs.get("pattern_step")
    when = (f"The pattern holds from step {reached} on (faint vertical line)." if reached is not None
            else "The pattern never settles in this run (with H > 2 heads some die out or share the work).")
    return ("**ω** (KQ x-block / √(d+1)) and **μ** (OV weight on y) per head over training, and the "
            "pattern metrics (log scale, worst active head): KQ distance from ωI, OV energy off y, "
            "|Σμ| / Σ|μ| (heads cancel) and 1 − R² of the predictions against debiased GD. " + when)

def retrain_estimate(run: xr.Dataset | None) -> str:
    """How long retraining ``run`` should take: its step count times the time a step took when
    it was trained (``train_seconds`` / ``steps``, recorded on the run)."""
    if run is None:
        return ""
    steps = int(run.attrs.get("params", {}).get("steps", run["step"].values[-1]))
    seconds = run.attrs.get("train_seconds")
    if not seconds:
        return f"Retraining runs {steps:,} steps (no training time is recorded for this run)."
    per_step = float(seconds) / max(steps, 1)
    return (f"Retraining takes about {float(seconds):.0f} s: {steps:,} steps at "
            f"{per_step * 1e3:.1f} ms a step, the rate this run was trained at "
            "(slower on a busy machine).")


# -- the view --------------------------------------------------------------------------------


def _is_default_run(run: xr.Dataset) -> bool:
    """Whether ``run`` was trained with `DEFAULTS` (any head count), so `linear_icl_run` names it."""
    p = run.attrs.get("params", {})
    want = {**DEFAULTS, "n_heads": p.get("n_heads")}
    have = {**{k: p.get(k) for k in DEFAULTS if k != "seed"}, "seed": run.attrs.get("seed")}
    return (have == want and list(p.get("test_lengths", [])) == list(TEST_LENGTHS)
            and p.get("n_test") == 2048)


class LinearICLView(View):
    """Training of one-layer multi-head softmax attention on in-context linear regression.

    Parameters
    ----------
    model : explorer.Model, optional
        Ignored (the gallery passes its language model; this page trains its own).
    runs : dict of int to xarray.Dataset, optional
        Runs from `explorer.analyses.linear_icl.train_linear_icl` by head count. Default: the
        stored runs with the paper's settings for H in `DEFAULT_HEADS`, read from the file
        shipped with the project when the store lacks them (nothing is trained on open).
    analyses : dict of int to xarray.Dataset, optional
        Their `linear_icl_analysis`, by head count; computed when not given.
    heads : tuple of int, default=DEFAULT_HEADS
        Head counts to load when ``runs`` is not given.
    background : bool, optional
        Compute in a worker thread (default when served) or inline (tests, notebooks).

    The "Retrain" button trains the run shown again from its seed (about a minute for the
    default settings on one core), with a progress bar, and replaces it (and, for the default
    settings, the stored run).
    """

    notify_title = "Linear ICL"
    link_params = ("n_heads", "step")

    def scope(self) -> Scope:
        """Its own one-layer attention models on synthetic regression prompts."""
        return Scope(on="its own one-layer softmax-attention models (toy head 0, 1, …) trained "
                        "on synthetic in-context linear regression prompts, not your prompt",
                     edits="not applicable: the page studies separate toy models, not the "
                           "workspace's language model")
    wait_timeout = 1200

    n_heads = param.Selector(default=None, objects=[], label="Heads (H)",
                             doc="Which run the heatmaps, the pattern curves and the summary show: "
                                 "the model trained with this many attention heads.")
    step = training_step(doc="Checkpoint of the heatmaps, the loss-by-length plot and the dashed "
                             "markers on the curves over training.")

    runs = param.Dict(default={}, precedence=-1)
    analyses = param.Dict(default={}, precedence=-1)
    retraining = param.Boolean(default=False, precedence=-1, doc="A retraining is in flight.")
    retrain_status = param.String(default="", precedence=-1,
                                  doc="What the last retraining did (shown under its button).")

    def __init__(self, model: Any = None, *, runs: dict[int, xr.Dataset] | None = None,
                 analyses: dict[int, xr.Dataset] | None = None,
                 heads: tuple[int, ...] = DEFAULT_HEADS, background: bool | None = None,
                 **params: Any):
        super().__init__(background=background, **params)
        self._landed: dict[int, str] = {}   # when each run landed on the page (its record's time)
        # its cache (`View.cached`): "patterns", the KQ/OV patterns by (heads, step)
        self.runner("load", self._loaded)
        self.runner("retrain", self._retrained, progress=True)
        self.param.watch(self._switch_run, "n_heads")
        given = dict(runs or {})
        if given and analyses is not None and set(analyses) == set(given):
            self._loaded({"runs": given, "analyses": dict(analyses)})
        else:
            self.param.update(running=True, status="Loading the runs (H = " + ", ".join(
                map(str, sorted(given) or heads)) + ")…")
            self.submit("load", lambda token: self._load(given, tuple(heads), token))

    # -- computation ---------------------------------------------------------------------
    def _load(self, given: dict[int, xr.Dataset], heads: tuple[int, ...],
              token: CancelToken) -> dict[str, dict]:
        runs = dict(given)
        for H in ([] if given else heads):
            progress = self.status_reporter(
                token, lambda done, total, s, H=H: f"Training H = {H}: step {done}/{total} ({s:.0f} s)…")
            self.post(status=f"Loading the run with H = {H}…")
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
        self._landed = {H: computed_at_now() for H in runs}
        choice = self.n_heads if self.n_heads in runs else 2 if 2 in runs else sorted(runs)[0]
        shipped = any("source" in r.attrs for r in runs.values())
        # The results arrive without events: the n_heads and step events below draw each plot.
        with param.parameterized.discard_events(self):
            self.param.update(analyses=out["analyses"], runs=runs)
        self.param.n_heads.objects = sorted(runs)
        self.param.update(running=False, status=(
            f"{len(runs)} runs (H = {', '.join(map(str, sorted(runs)))}), "
            f"{int(runs[choice].sizes['step'])} checkpoints" + (", shipped (float16)." if shipped else ".")))
        if self.n_heads == choice:
            self._switch_run()
        else:
            self.n_heads = choice

    def _switch_run(self, *events: Any) -> None:
        run = self.runs.get(self.n_heads)
        if run is None:
            return
        keep = show_steps(self, run)
        with param.parameterized.discard_events(self):
            self.step = keep
        self.param.trigger("step")

    def retrain(self, *events: Any) -> None:
        """Train the run shown again from its seed, with progress; it replaces the shown run."""
        run = self.runs.get(self.n_heads)
        if run is None or self.retraining:
            return
        H = int(self.n_heads)
        default = _is_default_run(run)
        params = dict(run.attrs.get("params", {}))
        seed = int(run.attrs.get("seed", 0))
        self.param.update(retraining=True, running=True, progress=0, progress_active=True,
                          retrain_status=f"Training H = {H}…")

        def job(token: CancelToken) -> dict[str, Any]:
            bar = self.progress_fn(token, hi=90)
            started = time.perf_counter()
            last = [0.0]

            def progress(done: int, total: int) -> bool:
                bar(done, total)  # raises Cancelled once cancelled: nothing half-trained is kept
                now = time.perf_counter()
                if now - last[0] > 0.5 or done == total:
                    last[0] = now
                    seconds = now - started
                    left = seconds / max(done, 1) * (total - done)
                    text = (f"Training H = {H}: step {done:,}/{total:,}, {seconds:.0f} s, "
                            f"about {left:.0f} s left…")
                    self.post(retrain_status=text)  # under the button; the status line keeps the runs
                return not token.cancelled

            def fresh() -> xr.Dataset:
                if default:
                    return linear_icl_run(n_heads=H, retrain=True, progress=progress)
                return train_linear_icl(**params, seed=seed, progress=progress)

            new = fresh()
            token.check()
            self.post(retrain_status=f"Measuring patterns and baselines for H = {H}…", progress=92)
            analysis = stored_linear_icl_analysis(new) if default else _analyse(new)
            return {"H": H, "run": new, "analysis": analysis}

        self.submit("retrain", job)

    def cancel_retrain(self, *events: Any) -> None:
        """Stop a retraining; the run shown stays as it was."""
        if not self.retraining:
            return
        self.cancel("retrain")
        self.param.update(retraining=False, running=False, progress_active=False,
                          retrain_status="Retraining stopped; the run shown is unchanged.")

    def _retrained(self, out: dict[str, Any]) -> None:
        H, run = out["H"], out["run"]
        self.forget("patterns", where=lambda key: key[0] == H)
        self._landed[H] = computed_at_now()
        self.analyses = {**self.analyses, H: out["analysis"]}
        self.runs = {**self.runs, H: run}
        self._switch_run()
        loss = out["analysis"].attrs.get("final_test_loss")
        text = (f"Retrained H = {H} in {run.attrs.get('train_seconds', 0):.0f} s"
                + (f": final test loss {loss:.3f}." if loss is not None else "."))
        self.param.update(retraining=False, running=False, retrain_status=text)

    # Every panel is drawn at once from (runs, n_heads, step): no stale state to mark.
    def shown_provenance(self) -> Provenance | None:
        """What the page shows: the run of the head count picked (its name and seed, when it
        landed on the page) at the step picked."""
        run = self.runs.get(self.n_heads)
        if run is None or self.step is None:
            return None
        return lab_record("linear-icl", run_name(run), {"n_heads": int(self.n_heads),
                                                        "step": int(self.step)},
                          settings=run.attrs.get("params", {}),
                          computed_at=self._landed.get(int(self.n_heads), ""))

    @param.depends("n_heads", "step")
    def patterns(self) -> xr.Dataset | None:
        """KQ/OV patterns of the selected run at the current step."""
        run = self.runs.get(self.n_heads)
        if run is None or self.step is None or self.step not in run["step"].values:
            return None
        step = self.step
        return self.cached("patterns", (self.n_heads, step),
                           lambda: attention_patterns(run.sel(step=step)), limit=256)

    @param.depends("runs", "n_heads", "step")
    def _kq_plots(self) -> pn.FlexBox:
        # One pane per head at a fixed size, wrapping as the window narrows.
        layout = plot_kq_heatmaps(self.patterns())
        plots = list(layout) if isinstance(layout, hv.Layout) else [layout]
        return pn.FlexBox(*[pn.pane.HoloViews(p, linked_axes=False) for p in plots],
                          sizing_mode="stretch_width")

    @param.depends("runs", "n_heads", "step")
    def _kq_caption(self) -> str:
        return kq_caption(self.patterns())

    @param.depends("runs", "n_heads", "step")
    def _ov_plot(self) -> hv.Element:
        return plot_ov_heatmap(self.patterns())

    @param.depends("runs", "n_heads", "step")
    def _ov_caption(self) -> str:
        return ov_caption(self.patterns())

    @param.depends("analyses", "n_heads", "step")
    def _loss_plot(self) -> hv.Element:
        return plot_loss_curves(self.analyses, self.step, self.n_heads)

    @param.depends("analyses", "n_heads", "step")
    def _length_plot(self) -> hv.Element:
        return plot_loss_by_length(self.runs.get(self.n_heads), self.analyses.get(self.n_heads), self.step)

    @param.depends("analyses", "n_heads")
    def _loss_caption(self) -> str:
        return loss_caption(self.analyses, self.n_heads)

    @param.depends("analyses", "n_heads", "step")
    def _omega_plot(self) -> hv.Element:
        return plot_head_curves(self.analyses.get(self.n_heads), self.step, "omega")

    @param.depends("analyses", "n_heads", "step")
    def _mu_plot(self) -> hv.Element:
        return plot_head_curves(self.analyses.get(self.n_heads), self.step, "mu")

    @param.depends("analyses", "n_heads", "step")
    def _metrics_plot(self) -> hv.Element:
        return plot_metric_curves(self.analyses.get(self.n_heads), self.step)

    @param.depends("analyses", "n_heads")
    def _pattern_caption(self) -> str:
        return pattern_caption(self.analyses.get(self.n_heads))

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

    # -- reproducibility -----------------------------------------------------------------
    def code_recipe(self) -> Recipe:
        """What the page shows as records: the runs (by head count), their analyses over
        training, and the selected run's KQ / OV patterns at the step shown."""
        if not self.runs or self.n_heads is None or self.step is None:
            return Recipe(steps=[Note("The runs are still loading.")])
        la, heads = "explorer.analyses.linear_icl", sorted(self.runs)
        if all(_is_default_run(self.runs[H]) for H in heads):
            imports = [f"{la}.linear_icl_run", f"{la}.stored_linear_icl_analysis"]
            steps: list[Step] = [
                Let("heads", heads),
                Expr("runs", "{H: linear_icl_run(n_heads=H) for H in heads}",
                     "stored or shipped, else trained"),
                Expr("analyses", "{H: stored_linear_icl_analysis(run) for H, run in runs.items()}")]
        else:
            imports = [f"{la}.linear_icl_analysis"]
            steps = [Let("runs", {H: Call(None, f"{la}.train_linear_icl", (), {
                         **self.runs[H].attrs.get("params", {}),
                         "seed": int(self.runs[H].attrs.get("seed", 0))}) for H in heads}),
                     Expr("analyses", "{H: linear_icl_analysis(run, n_prompts=512) "
                          "for H, run in runs.items()}")]
        shown = dict(self.shown_provenance().request)
        steps += [Let("shown", shown["n_heads"], "the head count shown"),
                  Call("patterns", f"{la}.attention_patterns",
                       (Call(None, "runs[shown].sel", (), {"step": shown["step"]}),),
                       comment="the heatmaps: kq, ov, omega, mu")]
        return Recipe(steps=steps, imports=imports)

    # -- layout --------------------------------------------------------------------------
    def controls(self) -> pn.Column:
        heads = pn.widgets.RadioButtonGroup.from_param(self.param.n_heads, color="primary",
                                                       variant="outline", label="",
                                                       sizing_mode="stretch_width")
        step = pn.widgets.DiscreteSlider.from_param(self.param.step, sizing_mode="stretch_width")
        retrain = pn.widgets.Button(label="Retrain this run", color="primary",
                                    description="Train the run shown again from its seed (about a "
                                                "minute for the default settings), with progress; "
                                                "the new run replaces it.",
                                    disabled=self.param.retraining, sizing_mode="stretch_width")
        retrain.on_click(self.retrain)
        stop = pn.widgets.Button(label="Stop retraining", color="warning",
                                 description="Stop the retraining; the run shown stays as it was.",
                                 visible=self.param.retraining, sizing_mode="stretch_width")
        stop.on_click(self.cancel_retrain)
        bar = self.progress_bar(margin=(4, 10))
        note = pn.pane.Markdown(self.param.retrain_status, css_classes=["icl-retrain-status"],
                                styles={"color": "#555"}, margin=(0, 10))
        estimate = pn.pane.Markdown(
            pn.bind(lambda runs, H: retrain_estimate(runs.get(H)), self.param.runs, self.param.n_heads),
            visible=self.param.retraining.rx.not_(), css_classes=["icl-retrain-estimate"],
            styles={"color": "#555", "font-size": "0.9em"}, margin=(0, 10))
        return pn.Column(control(heads, self.param.n_heads.doc, self.param.n_heads.label),
                         control(step, self.param.step.doc), retrain, estimate, stop, bar, note,
                         width=theme.SIZES["controls_width"], css_classes=["icl-controls"])

    def __panel__(self) -> pn.viewable.Viewable:
        kq = pn.panel(self._kq_plots, css_classes=["icl-kq"], sizing_mode="stretch_width")
        return run_page(
            self, self.controls(), "icl-summary", paper_panel("linear-icl", self),
            kq, caption(self._kq_caption, "icl-kq-caption"),
            pn.pane.HoloViews(self._ov_plot, sizing_mode="stretch_width", css_classes=["icl-ov"]),
            caption(self._ov_caption, "icl-ov-caption"),
            # Each keeps its legend beside a readable frame: they wrap (one above the other)
            # below 480 px each.
            flex_row(480, (self._loss_plot, "icl-loss"), (self._length_plot, "icl-length")),
            caption(self._loss_caption, "icl-loss-caption"),
            # Legends beside each frame: 400 px keeps the frames readable.
            flex_row(400, (self._omega_plot, "icl-omega"), (self._mu_plot, "icl-mu"),
                     (self._metrics_plot, "icl-metrics")),
            caption(self._pattern_caption, "icl-pattern-caption"))


def _analyse(run: xr.Dataset) -> xr.Dataset:
    from explorer.analyses.linear_icl import linear_icl_analysis

    return linear_icl_analysis(run, n_prompts=512)


serve(__name__, LinearICLView, title=f"{theme.TITLE}: in-context linear regression", model=False, intro="linear-icl")
