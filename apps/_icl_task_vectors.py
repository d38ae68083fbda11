"""The ICL heads page's function vector (Todd et al. 2024) and task encoding (Han et al.,
ICML 2025): the FV's zero-shot accuracy, a 2-D PCA of the last-token residual coloured by
task, and task decodability per layer."""
from __future__ import annotations

from collections.abc import Callable

import holoviews as hv
import panel as pn
import xarray as xr

import explorer
from apps import theme
from apps._controls import caption, tip
from apps._icl_scores import _waiting
from apps._session import CancelToken
from apps._view import STATIC_TOOLS
from explorer.analyses import task_vectors as tv

__all__ = ["plot_td", "td_caption", "plot_projection", "plot_finetune_td", "fv_caption",
           "TaskVectorsPart"]

hv.extension("bokeh", logo=False)


def plot_td(td: xr.Dataset | None, layer: int) -> hv.Element:
    """Task decodability (leave-one-out 10-NN accuracy) per layer, current layer marked."""
    if td is None:
        return _waiting("Task decodability appears here (Compute scores)", 260)
    curve = hv.Curve((td["layer"].values, td["td"].values), "layer", "task decodability")
    return (curve.opts(line_width=2, color=theme.ACCENT, tools=["hover"])
            * hv.VLine(layer).opts(color="black", line_dash="dashed")).opts(
        responsive=True, height=260, ylim=(0, 1.05), default_tools=STATIC_TOOLS,
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
                    responsive=True, height=300, default_tools=STATIC_TOOLS,
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


class TaskVectorsPart:
    """The function vector and task encoding of `ICLHeadsView`."""

    def _got_fv(self, ds: xr.Dataset) -> None:
        self.fv_result = ds
        if self.status == "computing fv…":
            self.status = "ready"

    def _got_td(self, ds: xr.Dataset) -> None:
        self.td = ds

    def _fv_text(self) -> str:
        return fv_caption(self.fv_result, self._fv_tasks)

    def _fv_job(self) -> Callable[[CancelToken], xr.Dataset] | None:
        """The function vector's zero-shot accuracy at ``fv_layer`` (None before scores)."""
        if self.scores is None:
            return None
        m, o = self._model, self._opts
        fv, layer, task = self.scores["fv_score"].values, self.fv_layer, self._task()
        return lambda token: tv.function_vector_accuracy(m, [task], fv, layer=layer, **o)

    def _td_job(self) -> Callable[[CancelToken], xr.Dataset]:
        """Task decodability per layer and the residual's PCA."""
        m, o = self._model, self._opts
        # every prompt of the tasks and the Null task, less the one left out
        n_points = (len(self._td_tasks) + 1) * o["n_prompts"]
        return lambda token: tv.task_decodability(m, self._td_tasks, k=min(10, n_points - 1),
                                                  **o)

    def _task_vector_controls(self) -> list[pn.viewable.Viewable]:
        p = self.param
        return [tip(pn.widgets.IntSlider.from_param(p.fv_layer), p.fv_layer.doc),
                tip(pn.widgets.IntSlider.from_param(p.td_layer), p.td_layer.doc)]

    def _task_vector_panes(self) -> list[pn.viewable.Viewable]:
        p = self.param
        return [caption(pn.bind(lambda *_: self._fv_text(), p.fv_result), "icl-fv"),
                pn.pane.HoloViews(pn.bind(plot_projection, p.td, p.td_layer), linked_axes=False,
                                  sizing_mode="stretch_width"),
                pn.pane.HoloViews(pn.bind(plot_td, p.td, p.td_layer), linked_axes=False,
                                  sizing_mode="stretch_width"),
                caption(pn.bind(td_caption, p.td, p.td_layer))]
