"""The ICL heads page's task-vector tests (Han et al., ICML 2025): zero-shot patching (each
task's vector written into its own zero-shot prompts, beside the Null task's) and the
conflict test (each task's vector written into the other tasks' few-shot prompts)."""
from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import holoviews as hv
import numpy as np
import panel as pn
import param
import xarray as xr

from apps import theme
from apps._controls import caption, tip
from apps._icl_scores import _waiting
from apps._session import CancelToken
from apps._view import STATIC_TOOLS
from explorer._checks import InputError, parse_layer_list
from explorer.analyses import icl_heads as ih
from explorer.analyses import task_vector_patching as tvp

__all__ = ["FOLLOWS_A", "FOLLOWS_B", "DEFAULT_CONFLICT_TASKS", "default_conflict_layers",
           "parse_layers", "layers_text", "conflict_matrix", "plot_conflict_matrix",
           "plot_conflict_controls", "FOLLOWS_B_NULL", "plot_conflict_layers", "conflict_caption",
           "DEFAULT_PATCHING_TASKS", "MEAN_OVER_TASKS", "plot_patching", "patching_caption",
           "PatchingPart", "vector_test_tasks", "vector_test_layers"]

hv.extension("bokeh", logo=False)


FOLLOWS_A, FOLLOWS_B = "A's vector: follows A", "A's vector: follows B"


#: Tasks of the conflict test on opening: two word transforms and two list picks, whose
#: answers to each other's queries are defined (`task_vector_patching.ANSWER_RULES`).
DEFAULT_CONFLICT_TASKS = ("capitalize", "uppercase", "choose-first-of-3", "choose-last-of-3")


def vector_test_tasks(test: str, default: Sequence[str], *, doc: str) -> param.ListSelector:
    """The page's Parameter for the tasks of one task-vector test (``test``: "Conflict",
    "Patching"), any of the ICL tasks."""
    return param.ListSelector(default=list(default), objects=ih.icl_task_names(),
                              label=f"{test}: tasks", doc=doc)


def vector_test_layers(test: str, *, cost: str) -> param.String:
    """The page's Parameter for the layers one task-vector test writes the vectors at (a text
    `parse_layers` reads; ``cost``: what each layer costs)."""
    return param.String(default="", label=f"{test}: layers",
                        doc=f"Layers the vectors are written at, e.g. '0, 8, 18-22' (each layer "
                            f"costs {cost}).")


def default_conflict_layers(n_layers: int) -> list[int]:
    """Every 4th layer and every layer at 60-75 % of the depth, where the conflict test finds
    the task vectors acting on SmolLM2 (layers 18-22 of 30, docs/icl_heads.md)."""
    band = range(int(0.6 * n_layers), int(0.75 * n_layers) + 1)
    return sorted({*range(0, n_layers, 4), *band} & set(range(n_layers)))


def parse_layers(text: str, n_layers: int, what: str = "`Conflict: layers`") -> list[int]:
    """Layers from a comma-separated text (``"0, 8, 18-22"``; ranges inclusive), checked
    against the model's ``n_layers``; a clear InputError names the field ``what`` and what
    is wrong."""
    return parse_layer_list(text, n_layers, what)


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
        default_tools=STATIC_TOOLS, width=width + 170, height=height, hooks=[_left_margin],
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
                                default_tools=STATIC_TOOLS,
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


class PatchingPart:
    """The task-vector patching and conflict tests of `ICLHeadsView`."""

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
        self._request("conflict")

    def _conflict_job(self) -> Callable[[CancelToken], xr.Dataset | InputError]:
        """The conflict test's job; InputError naming a bad control (`_conflict_failed`
        shows it)."""
        settings = self.conflict_settings()
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
        return job

    def patching_settings(self) -> dict[str, Any]:
        """The arguments of `task_vector_patching` the page runs with; raises InputError
        naming a bad control."""
        tasks = list(self.patching_tasks)
        if not tasks:
            raise InputError("`Patching: tasks` must hold at least one task; got none.")
        layers = parse_layers(self.patching_layers, self._model.spec.n_layers,
                              "`Patching: layers`")
        return dict(tasks=tasks, layers=layers, **self._opts)

    def run_patching(self) -> None:
        """The zero-shot patching test for the chosen tasks and layers, in the background
        with progress; bad input is one message and keeps the last result."""
        self._request("patching")

    def _patching_job(self) -> Callable[[CancelToken], xr.Dataset]:
        """The patching test's job; InputError naming a bad control (`show_error` shows
        it)."""
        settings, m = self.patching_settings(), self._model
        return lambda token: tvp.task_vector_patching(m, settings.pop("tasks"),
                                                      progress=self.progress_fn(token), **settings)

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

    def _patching_controls(self) -> list[pn.viewable.Viewable]:
        p = self.param
        return [
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
                p.conflict_layer.doc)]

    def _patching_panes(self) -> list[pn.viewable.Viewable]:
        p = self.param
        return [
            pn.pane.HoloViews(pn.bind(plot_patching, p.patching, p.patching_shown),
                              linked_axes=False, sizing_mode="stretch_width",
                              css_classes=["icl-patching"]),
            caption(pn.bind(patching_caption, p.patching, p.patching_shown),
                    "icl-patching-caption"),
            # each in a Row of its own: Bokeh lines up the plot areas of one column's plots,
            # which squeezed these fixed-size plots to the attention maps' narrow area
            *[pn.Row(pn.pane.HoloViews(pn.bind(fn, p.conflict, p.conflict_layer),
                                       linked_axes=False, css_classes=css),
                     sizing_mode="stretch_width")
              for fn, css in ((plot_conflict_matrix, ["icl-conflict-matrix"]),
                              (plot_conflict_controls, ["icl-conflict-controls"]),
                              (plot_conflict_layers, []))],
            caption(pn.bind(conflict_caption, p.conflict, p.conflict_layer),
                    "icl-conflict-caption")]
