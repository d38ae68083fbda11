"""Task-vector emergence page: scrub through the training of a small transformer on a task mixture.

Han, Song, Gore & Agrawal (ICML 2025): a GPT-2-style transformer trained from scratch on a
mixture of sparse linear regressions comes to encode, at the query token, which latent task
(basis) a prompt uses, while its in-context loss falls towards the loss of regression in the
right subspace. The training-step slider drives every panel: the 2-D projection of the query
token's residual coloured by task at the chosen layer, task decodability (TD) per layer at
that step, and the ICL loss per task and TD over training with the step marked.

Every panel is drawn at once from the analysis and the step and layer controls, so the words
(titles, captions, summary) are of those controls. The page's record
(`TaskEmergenceView.shown_provenance`: the run's settings and seed, the step and layer, when
the analysis landed) writes the page's code and the export's manifest.
"""
from __future__ import annotations

import functools
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
from apps._recipe import Call, Expr, Note, Recipe, Ref, Step
from apps._session import CancelToken
from apps._view import ZOOM_TOOLS, View, serve, shown_dataset
from explorer.analyses.task_emergence import DEFAULTS as TASK_EMERGENCE_DEFAULTS
from explorer.analyses.task_emergence import default_analysis, stored_task_emergence_analysis

__all__ = ["TaskEmergenceView", "plot_task_projection", "plot_td_by_layer", "plot_icl_loss_curves",
           "plot_td_curves", "plot_emergence_curves", "projection_caption", "curves_caption",
           "run_name"]

hv.extension("bokeh", logo=False)

_TOOLS = ZOOM_TOOLS


_font = theme.font_sizes


_placeholder = functools.partial(theme.placeholder, height=320)


def _task_colors(n_tasks: int) -> dict[str, str]:
    return {f"task {t}": theme.CATEGORICAL[t % len(theme.CATEGORICAL)] for t in range(n_tasks)}


def run_name(analysis: xr.Dataset) -> str:
    """The transformer an analysis is of, in a record: its depth, tasks and seed."""
    p = analysis.attrs.get("params", {})
    run = p.get("run_params") or {}
    seed = p.get("run_seed")
    return (f"the task-mixture transformer ({run.get('n_layers', analysis.sizes['layer'])} "
            f"blocks, {run.get('n_tasks', analysis.sizes['task'])} tasks"
            + (f", seed {seed})" if seed is not None else ")"))


# -- plots (pure: Datasets in, HoloViews out) ------------------------------------------------

def plot_task_projection(analysis: xr.Dataset | None, step: int | None, layer: int) -> hv.Element:
    """Query-token residuals after ``layer`` at ``step`` in their first two principal components."""
    if analysis is None or step is None:
        return _placeholder("No run yet.")
    at = analysis.sel(step=step, layer=layer)
    pc = at["projection"].values
    tasks = analysis["prompt_task"].values
    data = {"PC1": pc[:, 0], "PC2": pc[:, 1], "task": [f"task {t}" for t in tasks],
            "prompt": analysis["prompt"].values}
    return hv.Points(data, ["PC1", "PC2"], ["task", "prompt"]).opts(
        color="task", cmap=_task_colors(int(analysis.sizes["task"])), size=6, line_color="white",
        line_width=0.3, tools=["hover"], default_tools=_TOOLS, active_tools=["wheel_zoom"],
        responsive=True, height=360, fontsize=_font(), legend_position="right", show_legend=True,
        title=f"Query residual, layer {layer}, step {step}")


def projection_caption(analysis: xr.Dataset | None, step: int | None, layer: int | None) -> str:
    """The numbers behind the two top plots: TD at the layer shown and the best layer."""
    if analysis is None or step is None or layer is None:
        return ""
    at = analysis.sel(step=step)
    chance = 1 / int(analysis.sizes["task"])
    return (f"**The projection (first plot):** the residual of the query token after layer {layer} at step {step}, for "
            f"{analysis.sizes['prompt']} evaluation prompts, in its first two principal components, "
            f"coloured by the prompt's task; task decodability (TD) there = "
            f"{float(at['td'].sel(layer=layer)):.2f}. **TD by layer (second plot):** TD after every layer at this step "
            f"(dashed: chance, {chance:.2f}; dotted: the layer shown); best layer "
            f"{int(analysis['layer'].values[int(np.argmax(at['td'].values))])}.")


def plot_td_by_layer(analysis: xr.Dataset | None, step: int | None, layer: int | None = None) -> hv.Element:
    """Task decodability per layer at one step; chance level dashed, the shown layer marked."""
    if analysis is None or step is None:
        return _placeholder("No run yet.")
    layers = analysis["layer"].values
    td = analysis["td"].sel(step=step).values
    chance = 1 / int(analysis.sizes["task"])
    curve = hv.Curve((layers, td), "layer", "TD").opts(color=theme.ACCENT, line_width=2)
    dots = hv.Scatter((layers, td), "layer", "TD").opts(color=theme.ACCENT, size=8, tools=["hover"])
    over = curve * dots * hv.HLine(chance).opts(color="grey", line_dash="dashed", line_width=1)
    if layer is not None:
        over = over * hv.VLine(float(layer)).opts(color="black", line_dash="dotted", line_width=1)
    return over.opts(ylim=(0, 1.05), responsive=True, height=360, default_tools=_TOOLS,
                     fontsize=_font(), xticks=[int(x) for x in layers],
                     title=f"TD by layer, step {step}")


def _curve_opts() -> dict:
    return dict(responsive=True, height=300, default_tools=_TOOLS, fontsize=_font(),
                xlabel="training step", tools=["hover"])


def plot_icl_loss_curves(analysis: xr.Dataset | None, step: int | None) -> hv.Element:
    """ICL loss per task over training (log), with the reference losses as grey lines."""
    if analysis is None:
        return _placeholder("No analysis loaded yet.", height=280)
    steps = analysis["step"].values
    n_tasks = int(analysis.sizes["task"])
    colors = list(_task_colors(n_tasks).values())
    loss = [hv.Curve((steps, analysis["icl_loss"].sel(task=t).values), "training step",
                     "query squared error", label=f"task {t}").opts(color=colors[t], line_width=2)
            for t in range(n_tasks)]
    refs = [hv.HLine(float(analysis["agnostic_loss"].mean())).opts(color="grey", line_dash="dotdash",
                                                                   line_width=1),
            hv.HLine(float(analysis["oracle_loss"].mean())).opts(color="grey", line_dash="dotted",
                                                                 line_width=1)]
    if "task_mean_loss" in analysis:
        refs.append(hv.HLine(float(analysis["task_mean_loss"].mean())).opts(color="grey", line_dash="dashed",
                                                                           line_width=1))
    # The y range takes in both reference lines (HLines do not extend it themselves).
    low = min(float(analysis["oracle_loss"].mean()), float(analysis["icl_loss"].min())) / 1.5
    high = max(float(analysis["icl_loss"].max()), float(analysis["agnostic_loss"].mean())) * 1.2
    return hv.Overlay(loss + refs + [theme.step_marker(steps, step)]).opts(
        logy=True, legend_position="right", ylim=(low, high), title="ICL loss per task", **_curve_opts())


def plot_td_curves(analysis: xr.Dataset | None, step: int | None) -> hv.Element:
    """Task decodability after every layer over training, chance dashed."""
    if analysis is None:
        return _placeholder("No analysis loaded yet.", height=280)
    steps = analysis["step"].values
    layer_colors = theme.MAGNITUDE_CMAP
    n_layers = int(analysis.sizes["layer"])
    tds = [hv.Curve((steps, analysis["td"].sel(layer=l).values), "training step", "TD",
                    label=f"layer {l}").opts(
               color=layer_colors[int(l * (len(layer_colors) - 1) / max(1, n_layers - 1))], line_width=2)
           for l in range(n_layers)]
    chance = hv.HLine(1 / int(analysis.sizes["task"])).opts(color="grey", line_dash="dashed", line_width=1)
    return hv.Overlay(tds + [chance, theme.step_marker(steps, step)]).opts(
        ylim=(0, 1.05), legend_position="right", title="TD over training", **_curve_opts())


def plot_emergence_curves(analysis: xr.Dataset | None, step: int | None) -> hv.Element:
    """ICL loss per task and TD per layer over training, with the current step marked."""
    if analysis is None:
        return _placeholder("No analysis loaded yet.", height=280)
    return hv.Layout([plot_icl_loss_curves(analysis, step),
                      plot_td_curves(analysis, step)]).cols(2).opts(shared_axes=False)


def curves_caption(analysis: xr.Dataset | None) -> str:
    """What the curves over training show: the reference lines and the rise steps."""
    if analysis is None:
        return ""
    a = analysis.attrs
    refs = (f"task-agnostic ridge (dot-dash, {float(analysis['agnostic_loss'].mean()):.3g}), "
            + (f"the task's mean weights (dashed, {float(analysis['task_mean_loss'].mean()):.3g}), "
               if "task_mean_loss" in analysis else "")
            + f"regression knowing the task (dotted, {float(analysis['oracle_loss'].mean()):.3g})")
    return (f"**ICL loss per task:** the in-context loss of each task's query over training, against {refs}. "
            "**TD over training:** task decodability after every layer over training (dashed: chance). The "
            f"dashed vertical line is the step shown. TD (layer {a.get('best_layer')}) is half-way "
            f"up at step {a.get('td_rise_step_50')}, the ICL performance at step "
            f"{a.get('icl_rise_step_50')}; their correlation over training is {a.get('td_icl_correlation')}.")


# -- the view --------------------------------------------------------------------------------

class TaskEmergenceView(View):
    """A transformer's training on a task mixture, checkpoint by checkpoint: task encoding and ICL loss.

    Parameters
    ----------
    model : explorer.Model, optional
        Ignored (the gallery passes its language model; this page trains its own transformer).
    run : xarray.Dataset, optional
        A run from `explorer.analyses.task_emergence.train_task_emergence`. Default: the
        analysis of the stored run with the default settings, or, when the store has none, the
        analysis shipped with the project (`task_emergence.SHIPPED_ANALYSIS`), so nothing is
        trained on first use.
    analysis : xarray.Dataset, optional
        Its `task_emergence_analysis`; computed (and stored) when not given.
    background : bool, optional
        Compute in a worker thread (default when served) or inline (tests, notebooks).
    """

    notify_title = "Task emergence"

    step = training_step(doc="Checkpoint shown in every panel: the projection, TD by layer and the "
                             "dashed markers on the curves over training.")
    layer = param.Selector(default=None, objects=[], label="Layer",
                           doc="Block after which the query-token residual is projected (the projection plot; "
                               "dotted line in TD by layer).")

    analysis = shown_dataset()

    def __init__(self, model: Any = None, *, run: xr.Dataset | None = None,
                 analysis: xr.Dataset | None = None, background: bool | None = None, **params: Any):
        super().__init__(background=background, **params)
        self._landed = ""   # when the analysis landed on the page (its record's time)
        self.runner("load", self._loaded)
        if analysis is not None:
            self._use(analysis)
        else:
            self.param.update(running=True, status="Loading the stored analysis…")
            self.submit("load", lambda token: self._load(run, token))

    # -- computation ---------------------------------------------------------------------
    def _load(self, run: xr.Dataset | None, token: CancelToken) -> xr.Dataset:
        progress = self.status_reporter(
            token, lambda done, total, s: f"Training the transformer: step {done}/{total} ({s:.0f} s)…")
        if run is None:
            self.post(status="Loading the stored analysis (training the run if it is missing)…")
            return default_analysis(progress=progress)
        token.check()
        self.post(status="Measuring task decodability and ICL loss at every checkpoint…")
        return stored_task_emergence_analysis(run)

    def _use(self, analysis: xr.Dataset) -> None:
        layers = [int(layer) for layer in analysis["layer"].values]
        best = int(analysis.attrs.get("best_layer", layers[-1]))
        # Chosen before the widgets get their options (a slider snaps to the first one then).
        layer = best if self.layer not in layers else self.layer
        step = show_steps(self, analysis)
        self.param.layer.objects = layers
        self._landed = computed_at_now()
        with param.parameterized.discard_events(self):
            self.param.update(analysis=analysis, step=step, layer=layer)
        self.param.trigger("analysis", "step", "layer")
        self.status = (f"{int(analysis.sizes['step'])} checkpoints"
                       + (" (the analysis shipped with the project)." if "source" in analysis.attrs
                          else "."))

    def _loaded(self, analysis: xr.Dataset) -> None:
        self.running = False
        self._use(analysis)

    # Every panel is drawn at once from (analysis, step, layer): no stale state to mark.
    def shown_provenance(self) -> Provenance | None:
        """What the page shows: the analysis's run (settings, seed; when it landed on the page)
        at the step and layer picked."""
        if self.analysis is None or self.step is None:
            return None
        p = self.analysis.attrs.get("params", {})
        return lab_record("task-emergence", run_name(self.analysis),
                          {"step": int(self.step), "layer": int(self.layer)},
                          settings={"run_params": p.get("run_params") or {},
                                    "n_per_task": p.get("n_per_task"), "k": p.get("k")},
                          computed_at=self._landed)

    @param.depends("analysis", "step", "layer")
    def _projection_plot(self) -> hv.Element:
        return plot_task_projection(self.analysis, self.step, self.layer)

    @param.depends("analysis", "step", "layer")
    def _td_plot(self) -> hv.Element:
        return plot_td_by_layer(self.analysis, self.step, self.layer)

    @param.depends("analysis", "step")
    def _loss_plot(self) -> hv.Element:
        return plot_icl_loss_curves(self.analysis, self.step)

    @param.depends("analysis", "step")
    def _td_curves_plot(self) -> hv.Element:
        return plot_td_curves(self.analysis, self.step)

    @param.depends("analysis", "step", "layer")
    def _projection_caption(self) -> str:
        return projection_caption(self.analysis, self.step, self.layer)

    @param.depends("analysis")
    def _curves_caption(self) -> str:
        return curves_caption(self.analysis)

    @param.depends("analysis", "step", "layer")
    def summary(self) -> str:
        """One line on the current checkpoint: TD at the layer and the ICL loss per task."""
        if self.analysis is None or self.step is None:
            return "No run loaded yet."
        at = self.analysis.sel(step=self.step)
        losses = ", ".join(f"{float(v):.3g}" for v in at["icl_loss"].values)
        return (f"**Step {self.step}**: TD after layer {self.layer} = {float(at['td'].sel(layer=self.layer)):.2f} "
                f"(best layer at this step: {int(at['td'].idxmax('layer'))}); ICL loss per task: {losses} "
                f"(knowing the task: {float(self.analysis['oracle_loss'].mean()):.3g}, task-agnostic "
                f"ridge: {float(self.analysis['agnostic_loss'].mean()):.3g}, "
                + (f"the task's mean weights: {float(self.analysis['task_mean_loss'].mean()):.3g}, "
                   if "task_mean_loss" in self.analysis else "")
                + f"predicting 0: "
                f"{float(self.analysis['zero_loss'].mean()):.3g}).")

    # -- reproducibility -----------------------------------------------------------------
    def code_recipe(self) -> Recipe:
        """What the page shows as records: the analysis over training and, at the step and
        layer shown, the residual projection and TD per layer."""
        if self.analysis is None or self.step is None:
            return Recipe(steps=[Note("The analysis is still loading.")])
        te = "explorer.analyses.task_emergence"
        a = self.analysis.attrs
        p = a.get("params", {})
        run_params, run_seed = dict(p.get("run_params") or {}), p.get("run_seed", 0)
        settings = {"n_per_task": p.get("n_per_task", 100), "k": p.get("k", 10),
                    "seed": a.get("seed", 1)}
        defaults = {k: v for k, v in TASK_EMERGENCE_DEFAULTS.items() if k != "seed"}
        if "source" in a or (run_params == defaults and run_seed == 0
                             and settings == {"n_per_task": 100, "k": 10, "seed": 1}):
            steps: list[Step] = [Call("analysis", f"{te}.default_analysis", comment=(
                "the stored run's, else the one shipped with the project"))]
        else:
            steps = [Call("run", f"{te}.task_emergence_run", (), {**run_params, "seed": run_seed},
                          "stored, else trained (seeded)"),
                     Call("analysis", f"{te}.stored_task_emergence_analysis", (Ref("run"),),
                          settings)]
        shown = dict(self.shown_provenance().request)
        steps += [Call("projection", "analysis['projection'].sel", (),
                       {"step": shown["step"], "layer": shown["layer"]},
                       "[prompt, component]; analysis['prompt_task'] colours it"),
                  Call("td_by_layer", "analysis['td'].sel", (), {"step": shown["step"]}),
                  Expr("curves", "analysis[['icl_loss', 'td']]", "over training")]
        return Recipe(steps=steps)

    # -- layout --------------------------------------------------------------------------
    def controls(self) -> pn.Column:
        p = self.param
        step = pn.widgets.DiscreteSlider.from_param(p.step, sizing_mode="stretch_width")
        layer = pn.widgets.RadioButtonGroup.from_param(p.layer, color="primary", variant="outline",
                                                       label="", sizing_mode="stretch_width")
        return pn.Column(control(step, p.step.doc), control(layer, p.layer.doc, p.layer.label),
                         width=theme.SIZES["controls_width"], css_classes=["emergence-controls"])

    def __panel__(self) -> pn.viewable.Viewable:
        return run_page(
            self, self.controls(), "emergence-summary", paper_panel("task-emergence", self),
            # Side by side only where the projection keeps room for its legend and title
            # (they wrap below about 1,500 px).
            flex_row(420, (self._projection_plot, "emergence-projection"),
                     (self._td_plot, "emergence-td")),
            caption(self._projection_caption, "emergence-projection-caption"),
            # Each curve plot keeps a legend beside its frame: below about 480 px the frame
            # would shrink to a sliver, so they wrap instead.
            flex_row(480, (self._loss_plot, "emergence-curves"),
                     (self._td_curves_plot, "emergence-td-curves")),
            caption(self._curves_caption, "emergence-curves-caption"))


serve(__name__, TaskEmergenceView, title=f"{theme.TITLE}: task-vector emergence", model=False, intro="task-emergence")
