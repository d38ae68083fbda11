"""The Circuits page's fine-tuning comparison: LoRA checkpoints, their circuits and how much
each layer's edges changed, against the change prompt resampling alone gives.

The checkpoints are scored by `circuit_lora.checkpoint_circuits` (EAP-IG on the KL divergence
by default, Wang et al. 2025); the per-layer edge change D_l of each checkpoint against the
first is `circuit_lora.layer_edge_change`. The noise floor is
`circuit_lora.layer_change_noise_floor` on the base model: the same method, metric, IG steps
and circuit size on `NOISE_SAMPLES` samples of the task's pairs (seeds 0, 1, ...; seed 0 is
the sample the checkpoints were scored on), D_l between every two of them. A layer whose
change is not above the largest of those cannot be told from prompt resampling.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np
import panel as pn
import xarray as xr

import explorer
from apps import theme
from apps._circuits_scoring import METHOD_LABELS
from apps._session import CancelToken
from apps._view import STATIC_TOOLS
from explorer._checks import InputError
from explorer.analyses import circuit_lora as cl
from explorer.analyses import circuits as ca

__all__ = ["NOISE_SAMPLES", "checkpoint_params", "layer_changes", "layer_change_figure",
           "FinetuneComparison"]

NOISE_SAMPLES = 3          # prompt samples of the base model: 3 pairs of samples
FLOOR_LABEL = "noise floor: prompt resamples (max)"
METRIC_NAMES = {"kl": "KL", "logit_diff": "logit difference"}


def checkpoint_params(checkpoints: xr.Dataset) -> dict[str, Any]:
    """The scoring parameters `checkpoint_circuits` recorded (``edge_method``, ``metric``,
    ``ig_steps``, ``top_percent``, ``task``, ``n_pairs``), also from a netCDF file (JSON)."""
    params = checkpoints.attrs.get("params", {})
    if isinstance(params, str):
        params = json.loads(params)
    return dict(params)


def layer_changes(checkpoints: xr.Dataset, n_layers: int) -> xr.DataArray:
    """D_l of every checkpoint against the first (`circuit_lora.layer_edge_change`), over
    (checkpoint, layer); the first row is 0."""
    first = checkpoints.isel(checkpoint=0)
    rows = [cl.layer_edge_change(first, checkpoints.isel(checkpoint=i),
                                 n_layers=n_layers)["edge_change"].values
            for i in range(checkpoints.sizes["checkpoint"])]
    return xr.DataArray(np.stack(rows), dims=("checkpoint", "layer"),
                        coords={"checkpoint": checkpoints["checkpoint"].values,
                                "layer": np.arange(n_layers)}, name="edge_change")


def layer_change_figure(changes: xr.DataArray, floor: xr.Dataset | None, shown: int,
                        *, what: str = "") -> Any:
    """The per-layer edge change D_l of checkpoint ``shown`` (an index; the last one when 0)
    against the first, the other checkpoints thin, and the noise floor (``noise_max`` of
    `layer_change_noise_floor`) as a shaded band with a dashed top; layers above the floor
    are marked. A plain Bokeh figure; renderers are named for tests."""
    from bokeh.models import BasicTicker, ColumnDataSource, HoverTool, Legend
    from bokeh.plotting import figure

    steps = [int(s) for s in changes["checkpoint"].values]
    i = shown if 0 < shown < len(steps) else len(steps) - 1
    layers = changes["layer"].values.astype(float)
    fig = figure(height=300, sizing_mode="stretch_width", tools=list(STATIC_TOOLS),
                 x_axis_label="layer", y_axis_label="edge change D_l",
                 toolbar_location="right")
    fig.toolbar.logo = None
    fig.xaxis.ticker = BasicTicker(min_interval=1)    # whole layers
    fonts = theme.font_sizes()
    fig.title.text_font_size = fonts["title"]
    for axis, ticks in ((fig.xaxis, "xticks"), (fig.yaxis, "yticks")):
        axis.axis_label_text_font_size = fonts["labels"]
        axis.major_label_text_font_size = fonts[ticks]
    # under the plot, in two columns: the plot keeps the page's width at 1280 px
    fig.add_layout(Legend(orientation="horizontal", ncols=2, label_text_font_size=fonts["xticks"],
                          spacing=4, margin=4, padding=4), "below")
    if floor is not None:
        top = floor["noise_max"].values.astype(float)
        band = ColumnDataSource({"layer": layers, "low": np.zeros_like(top), "floor": top,
                                 "mean": floor["noise_mean"].values.astype(float)})
        fig.varea("layer", "low", "floor", source=band, fill_color="#999999", fill_alpha=0.3,
                  legend_label=FLOOR_LABEL, name="noise-floor-band")
        line = fig.line("layer", "floor", source=band, color="#444444", line_dash="dashed",
                        line_width=2, legend_label=FLOOR_LABEL, name="noise-floor")
        fig.add_tools(HoverTool(renderers=[line], tooltips=[
            ("layer", "@layer{0}"), ("noise floor (max)", "@floor{0.0000}"),
            ("mean over pairs", "@mean{0.0000}")]))
    for k in range(1, len(steps)):
        if k != i:
            fig.line(layers, changes.values[k].astype(float), color="#bbbbbb", line_width=1,
                     legend_label="other checkpoints", name=f"change-step-{steps[k]}")
    if len(steps) > 1:
        y = changes.values[i].astype(float)
        src = ColumnDataSource({"layer": layers, "change": y})
        line = fig.line("layer", "change", source=src, color=theme.ACCENT, line_width=3,
                        legend_label=f"step {steps[i]} vs step {steps[0]}", name="layer-change")
        fig.scatter("layer", "change", source=src, color=theme.ACCENT, size=6)
        fig.add_tools(HoverTool(renderers=[line], tooltips=[("layer", "@layer{0}"),
                                                            ("D_l", "@change{0.0000}")]))
        if floor is not None:
            above = y > floor["noise_max"].values
            fig.scatter(layers[above], y[above], marker="circle", size=13, fill_alpha=0,
                        line_color="black", line_width=2, legend_label="above the floor",
                        name="above-floor")
    fig.title.text = f"Per-layer edge change vs step {steps[0]}" + (f" ({what})" if what else "")
    return fig


class FinetuneComparison:
    """The fine-tuning part of `apps.circuits.CircuitsView` (a mixin): the Fine-tune button's
    job, the checkpoints' scores, the noise floor's job and the per-layer change plot. The
    view declares the parameters it reads (``checkpoints``, ``noise_floor``, ``checkpoint``,
    ``ft_steps``, ``ft_method``)."""

    def _request_finetune(self) -> None:
        m, task_name, method, n, steps = (self._model, self.task, self.ft_method,
                                          self.n_prompts, self.ft_steps)
        slug = task_name.replace(" ", "-")
        folder = self._run_folder or (explorer.models.cache_dir() / "circuit_lora" /
                                      f"{m.spec.name.replace('/', '_')}-view-{slug}")
        try:   # the user's pairs train and score; a generated task trains on 64 other pairs
            data = self._task_data(task_name, 64, seed=2)
            scored = self._task_data(task_name, n, seed=0)
        except InputError as e:
            self.show_error(e)
            return

        def job(token: CancelToken):
            ckpts = sorted({0, steps // 3, 2 * steps // 3, steps} - {-1})
            cl.finetune_lora(m, data.clean, data.answer, ranks=cl.uniform_lora_ranks(m, 2),
                             steps=steps, batch_size=8, lr=1e-3, checkpoints=ckpts,
                             folder=folder, progress=self.progress_fn(token))
            token.check()
            return cl.checkpoint_circuits(m, folder, scored, method=method, batch_size=len(scored),
                                          progress=self.progress_fn(token))

        self.status = (f"fine-tuning {steps} LoRA steps, then scoring each checkpoint "
                       f"({METHOD_LABELS[method]})…")
        self.submit("finetune", job)

    def _got_checkpoints(self, ds: xr.Dataset) -> None:
        self._set_checkpoints(ds)
        self.status = f"{ds.sizes['checkpoint']} checkpoints scored"

    def _set_checkpoints(self, ds: xr.Dataset) -> None:
        self._circuit_cache.clear()
        self._ck_scores = [self._checkpoint_scores(ds, i) for i in range(ds.sizes["checkpoint"])]
        self._ck_orders = [np.argsort(-np.abs(s["score"].values), kind="stable")
                           for s in self._ck_scores]
        self.param.checkpoint.bounds = (0, ds.sizes["checkpoint"] - 1)
        if not self.layout_from:
            self._set_layout(self._ck_scores[0], "scores of the first checkpoint")
        self.checkpoints = ds
        if self.scores is None:
            self._set_default_size()
        self._request_noise_floor(ds)

    def _checkpoint_scores(self, ds: xr.Dataset, i: int) -> xr.Dataset:
        out = ds["score"].isel(checkpoint=i).to_dataset(name="score")
        out.attrs = {"n_layers": self._model.n_layers, "n_heads": self._model.spec.n_heads}
        return out

    # -- the noise floor ------------------------------------------------------------------
    def noise_floor_samples(self, checkpoints: xr.Dataset) -> tuple[list, dict[str, Any], str]:
        """The prompt samples of the noise floor (``NOISE_SAMPLES`` samples of the task the
        checkpoints were scored on, as many pairs, seeds 0, 1, ...), the scoring options of
        `layer_change_noise_floor` read from the checkpoints, and, when there can be no floor,
        why (the user's own pairs or prompt are one sample)."""
        p = checkpoint_params(checkpoints)
        name = str(p.get("task") or self.task)
        opts = {"method": str(p.get("edge_method", cl.CHECKPOINT_METHOD)),
                "metric": p.get("metric"), "ig_steps": int(p.get("ig_steps", 5)),
                "top_percent": float(p.get("top_percent", 5.0))}
        if name not in ca.TASK_NAMES:
            return [], opts, (f"no noise floor: the task {name!r} is one sample of pairs "
                              "(the floor resamples a generated task's pairs)")
        n = int(p.get("n_pairs") or self.n_prompts)
        return [ca.make_task(name, n, seed=s) for s in range(NOISE_SAMPLES)], opts, ""

    def _request_noise_floor(self, ds: xr.Dataset) -> None:
        """Measure the noise floor of the checkpoints ``ds`` (once per task and scoring)."""
        tasks, opts, why = self.noise_floor_samples(ds)
        if not tasks:
            self.param.update(noise_floor=None, noise_note=why)
            return
        key = (tasks[0].name, len(tasks[0]), tuple(sorted(opts.items(), key=str)))
        if key in self._floors:
            self.param.update(noise_floor=self._floors[key], noise_note="")
            return
        m = self._model

        def job(token: CancelToken):
            floor = cl.layer_change_noise_floor(m, tasks, batch_size=len(tasks[0]), **opts)
            return key, floor

        self.noise_note = (f"measuring the noise floor: {METHOD_LABELS[opts['method']]} on "
                           f"{NOISE_SAMPLES} prompt samples of the base model…")
        self.submit("noise", job)

    def _got_noise_floor(self, result: tuple) -> None:
        key, floor = result
        self._floors[key] = floor
        self.param.update(noise_floor=floor, noise_note="")

    def layer_change_text(self) -> str:
        """Which layers of the shown checkpoint changed more than prompt resampling gives."""
        ck, floor = self.checkpoints, self.noise_floor
        if ck is None or ck.sizes["checkpoint"] < 2:
            return ""
        changes = layer_changes(ck, self._model.n_layers)
        steps = [int(s) for s in changes["checkpoint"].values]
        i = self.checkpoint if 0 < self.checkpoint < len(steps) else len(steps) - 1
        p = checkpoint_params(ck)
        how = (f"{METHOD_LABELS.get(p.get('edge_method'), p.get('edge_method'))} on "
               f"{METRIC_NAMES.get(p.get('metric'), p.get('metric'))}, circuits of the top "
               f"{float(p.get('top_percent', 5.0)):g} % of edges")
        head = (f"**Per-layer edge change** of step {steps[i]} against step {steps[0]} "
                f"(D_l, Wang et al. 2025; {how}).")
        if floor is None:
            return f"{head} {self.noise_note or 'No noise floor yet.'}"
        above = np.flatnonzero(changes.values[i] > floor["noise_max"].values).tolist()
        n_pairs = floor.sizes["pair"]
        if above:
            where = (f"Layers {', '.join(map(str, above))} ({len(above)} of "
                     f"{len(changes['layer'])}) change more than")
        else:
            where = "No layer changes more than"
        return (f"{head} {where} the noise floor: the largest D_l between "
                f"{floor.attrs['params']['n_samples']} prompt samples of the base model "
                f"({n_pairs} pairs of samples, the same method and circuit size).")

    def layer_change_plot(self) -> Any:
        """The per-layer change figure for the current checkpoints, floor and checkpoint."""
        ck = self.checkpoints
        changes = layer_changes(ck, self._model.n_layers)
        p = checkpoint_params(ck)
        what = (f"{METHOD_LABELS.get(p.get('edge_method'), p.get('edge_method'))} on "
                f"{METRIC_NAMES.get(p.get('metric'), p.get('metric'))}")
        return layer_change_figure(changes, self.noise_floor, int(self.checkpoint), what=what)

    def _layer_change_pane(self, *_: Any) -> Any:
        ck = self.checkpoints
        if ck is None or ck.sizes["checkpoint"] < 2:
            return pn.Spacer(height=0)
        return pn.Column(theme.BokehPane(self.layer_change_plot(), sizing_mode="stretch_width"),
                         pn.pane.Markdown(self.layer_change_text(),
                                          css_classes=["circuit-layer-change"],
                                          sizing_mode="stretch_width"),
                         sizing_mode="stretch_width")
