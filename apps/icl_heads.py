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

import time
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
from apps._view import STATIC_TOOLS, View, head_cell, serve
from explorer._checks import InputError
from explorer.analyses import icl_heads as ih
from explorer.analyses import task_vectors as tv
from explorer.analyses import user_items

__all__ = ["ICLHeadsView", "plot_head_scatter", "plot_score_heatmaps", "plot_attention",
           "plot_ablation_curves", "plot_td", "plot_projection", "plot_finetune_td",
           "scatter_caption", "td_caption", "fv_caption", "estimated_score_seconds"]

hv.extension("bokeh", logo=False)

_TOOLS = STATIC_TOOLS
DEFAULT_FV_TASKS = ("antonym", "country-capital", "english-french")
DEFAULT_EVAL_TASKS = ("capitalize", "present-past")
DEFAULT_TD_TASKS = ("antonym", "country-capital", "english-french", "capitalize")
#: The task name of the user's pasted pairs.
OWN_TASK = "your pairs"


def _waiting(text: str, height: int = 300) -> hv.Element:
    return theme.placeholder(text, height=height)


def plot_head_scatter(scores: xr.Dataset | None, top_induction: float, top_fv: float) -> hv.Element:
    """Induction score (x) vs FV score (y) per head, coloured by layer; top-p% heads ringed."""
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
    return (pts.opts(color="layer", cmap=theme.MAGNITUDE_CMAP, colorbar=True, size=9,
                     tools=["hover", "tap"], default_tools=_TOOLS, active_tools=["tap"],
                     nonselection_alpha=0.6, clabel="layer")
            * top.opts(size=16, fill_alpha=0, line_color="black", line_width=1.5,
                       tools=["hover"])).opts(
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


def plot_score_heatmaps(scores: xr.Dataset | None) -> hv.Layout | hv.Element:
    """Layer x head heatmaps: induction score (sequential map) and FV score (diverging, 0 white)."""
    if scores is None:
        return _waiting("Head scores appear here (Compute scores, left)")
    ind, fv = scores["induction_score"].values, scores["fv_score"].values
    n_layers, n_heads = ind.shape

    def cells(a):
        return [(h, l, float(a[l, h])) for l in range(n_layers) for h in range(n_heads)]

    height = max(260, theme.SIZES["cell_height"] * n_layers + 90)
    common = dict(tools=["hover", "tap"], colorbar=True, responsive=True, height=height,
                  default_tools=_TOOLS, xlabel="head", ylabel="layer", invert_yaxis=True,
                  xticks=list(range(n_heads)), yticks=list(range(n_layers)),
                  fontsize={"xticks": "7pt", "yticks": "7pt"})
    bound = float(np.nanmax(np.abs(fv))) or 1.0
    left = hv.HeatMap(cells(ind), ["head", "layer"], "induction_score").opts(
        cmap=theme.MAGNITUDE_CMAP, clim=(0.0, float(np.nanmax(ind)) or 1.0),
        title="Induction score", **common)
    right = hv.HeatMap(cells(fv), ["head", "layer"], "fv_score").opts(
        cmap=theme.SIGNED_CMAP, clim=(-bound, bound),
        title="FV score (0 = white)", **common)
    return (left + right).cols(2)


def plot_attention(ds: xr.Dataset | None, title: str) -> hv.Element:
    """Query x key heatmap of one head's attention, tokens on both axes."""
    if ds is None:
        return _waiting("The selected head's attention appears here", 260)
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
    """``variable`` (mean accuracy by default) against % of heads ablated, one curve per ranking."""
    if curves is None:
        return _waiting("Press Recompute ablation curves (left)", 300)
    ylabel, title = _CURVE_LABELS[variable]
    pct = curves["percent"].values
    out = []
    for r in curves["ranking"].values:
        y = curves[variable].sel(ranking=r).values
        c = _RANKING_COLORS.get(str(r), theme.ACCENT)
        out.append(hv.Curve((pct, y), "% heads ablated", ylabel, label=str(r))
                   .opts(color=c, line_width=2, tools=["hover"]))
        out.append(hv.Scatter((pct, y), "% heads ablated", ylabel).opts(color=c, size=6))
    return hv.Overlay(out).opts(responsive=True, height=320, legend_position="right",
                                title=title, show_legend=True)


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
        return "Function vector: waiting for the head scores…"
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
    fv_layer = param.Integer(default=0, bounds=(0, None), label="Function vector: layer",
                             doc="Layer whose residual the function vector is added to.")
    td_layer = param.Integer(default=0, bounds=(0, None), label="Task encoding: layer",
                             doc="Layer of the residual PCA and of the dashed line on the "
                                 "task-decodability curve.")

    scores = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True, precedence=-1)
    patterns = param.Dict(default=None, allow_None=True, precedence=-1)
    curves = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True, precedence=-1)
    fv_result = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True, precedence=-1)
    td = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True, precedence=-1)

    notify_title = None
    failed_status = None

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
        self._progress = pn.indicators.Progress(name="progress", value=self.param.progress, max=100,
                                                sizing_mode="stretch_width",
                                                visible=self.param.progress_active)
        self.param.watch(lambda *_: self._request("patterns"), ["layer", "head", "task"])
        self.param.watch(lambda *_: self._request("fv"), ["fv_layer", "task"])
        self.param.watch(lambda *_: self._request("curves"), ["exclude_other"])
        self.estimated_seconds = estimated_score_seconds(
            spec.n_layers, spec.n_heads, spec.d_model, n_prompts, n_shots, len(self._fv_tasks))
        self._score_button = pn.widgets.Button(
            name=f"Compute scores (about {max(1, round(self.estimated_seconds)):d} s)",
            button_type="primary", sizing_mode="stretch_width",
            description="Induction and FV scores of every head (the scatter and heatmaps), "
                        "then the function vector; and the task encoding (PCA, decodability).")
        self._score_button.on_click(lambda *_: self._compute())
        self._own_task: ih.ICLTask | None = None
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
        self._own_task = task
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
    def _compute(self) -> None:
        """The page's heavy work: head scores (then the FV) and the task encoding."""
        if self.td is None:
            self._request("td")
        self._request("scores")

    def _request(self, name: str) -> None:
        m, o = self._model, self._opts
        if name == "scores":
            started = time.perf_counter()
            self._score_button.disabled = True

            def job(token: CancelToken):
                ind = ih.induction_scores(m, n_sequences=4, half_len=16)
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
                return ih.head_attention(m, layer, head, task=task)
        elif name == "curves":
            if self.scores is None:
                return
            ind, fv = self.scores["induction_score"].values, self.scores["fv_score"].values
            top = float(self.max_percent)
            percents = sorted({0.0, *[p for p in (1, 3, 5, 10, 20, 30, 50) if p <= top], top})
            rankings = (("fv_excl_induction", "induction_excl_fv", "random")
                        if self.exclude_other else ("fv", "induction", "random"))
            exclude = max(self.top_induction, self.top_fv) / 100

            def job(token: CancelToken):
                progress = self.progress_fn(token)
                return ih.ablation_curves(m, self._eval_tasks, ind, fv, percents=percents,
                                          rankings=rankings, exclude_fraction=exclude,
                                          loss_sequences=2, loss_tokens=64, progress=progress,
                                          **o)
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

    def _tapped(self, index: list[int]) -> None:
        if index and self.scores is not None:
            n_heads = self.scores.sizes["head"]
            self.param.update(layer=index[0] // n_heads, head=index[0] % n_heads)

    def _cell_tapped(self, x: Any = None, y: Any = None) -> None:
        """A click on a heatmap cell (x = head, y = layer) selects that head."""
        cell = head_cell(x, y, self.scores)
        if cell is not None:
            self.param.update(layer=cell[0], head=cell[1])

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
        return (f"<div class='icl-state' data-icl-scores='{'ready' if self.scores is not None else 'none'}' "
                f"data-icl-head='{self.layer}:{self.head}' data-icl-curves='{curves}' "
                f"data-icl-rankings='{rankings}' "
                f"data-icl-fv='{fv}' data-icl-td='{'ready' if self.td is not None else 'none'}'></div>")

    def __panel__(self) -> pn.viewable.Viewable:
        def scatter(scores, top_induction, top_fv):
            plot = plot_head_scatter(scores, top_induction, top_fv)
            if scores is not None:   # clicking a point selects its head
                points = plot.get(0) if isinstance(plot, hv.Overlay) else plot
                hv.streams.Selection1D(source=points).add_subscriber(self._tapped)
            return plot

        scatter = pn.bind(scatter, self.param.scores, self.param.top_induction, self.param.top_fv)

        def heatmaps(scores):
            plot = plot_score_heatmaps(scores)
            if isinstance(plot, hv.Layout):   # clicking a cell selects its head
                for panel in plot:
                    hv.streams.Tap(source=panel).add_subscriber(self._cell_tapped)
            return plot

        heatmaps = pn.bind(heatmaps, self.param.scores)
        pat_rep = pn.bind(lambda d, l, h: plot_attention(
            None if d is None else d["repeat"], f"{explorer.components.head(l, h)}, repeated sequence"),
            self.param.patterns, self.param.layer, self.param.head)
        pat_icl = pn.bind(lambda d, l, h, t: plot_attention(
            None if d is None else d["icl"], f"{explorer.components.head(l, h)}, {t} prompt"),
            self.param.patterns, self.param.layer, self.param.head, self.param.task)
        slider = pn.widgets.FloatSlider.from_param(self.param.max_percent)
        button = pn.widgets.Button(name="Recompute ablation curves", button_type="primary",
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
            tip(pn.widgets.Checkbox.from_param(p.exclude_other), p.exclude_other.doc), button,
            tip(pn.widgets.IntSlider.from_param(p.fv_layer), p.fv_layer.doc),
            tip(pn.widgets.IntSlider.from_param(p.td_layer), p.td_layer.doc),
            pn.pane.HTML(pn.bind(self._state_html, p.scores, p.layer, p.head, p.curves,
                                 p.fv_result, p.td)),
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
            pn.pane.Markdown("Few-shot accuracy on the evaluation tasks with the top heads by "
                             "each ranking mean-ablated: Yin & Steinhardt find ablating FV heads "
                             "hurts ICL far more than ablating induction heads.", **caption),
            pn.pane.Markdown(pn.bind(lambda *_: self._fv_text(), p.fv_result),
                             css_classes=["icl-fv"], **caption),
            pn.pane.HoloViews(pn.bind(plot_projection, p.td, p.td_layer), linked_axes=False,
                              sizing_mode="stretch_width"),
            pn.pane.HoloViews(pn.bind(plot_td, p.td, p.td_layer), linked_axes=False,
                              sizing_mode="stretch_width"),
            pn.pane.Markdown(pn.bind(td_caption, p.td, p.td_layer), **caption),
            sizing_mode="stretch_width")
        return pn.Row(controls, main, sizing_mode="stretch_width")


serve(__name__, ICLHeadsView, title="ICL heads: induction vs function-vector heads", intro="icl-heads")
