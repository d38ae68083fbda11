"""The ICL heads page's head scores (Yin & Steinhardt, ICML 2025): every head's induction
score against its FV score (Todd et al. 2024) as a scatter and as two layer x head
heatmaps, and the selected head's attention on a repeated sequence and on an ICL prompt."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import holoviews as hv
import numpy as np
import panel as pn
import xarray as xr

from apps import theme
from apps._controls import caption, tip
from apps._heads_heatmap import head_cell, heads_heatmap, heads_in, on_head_click
from apps._icl_estimate import (ForwardCost, ScoreWork, estimated_score_seconds,
                                measured_forward_cost, reference_cost, score_work, seconds_text)
from apps._icl_record import RECORD, requested_words, scores_words
from apps._provenance import Provenance
from apps._result_cache import cached_note
from apps._session import CancelToken
from apps._view import STATIC_TOOLS
from explorer import components
from explorer.analyses import icl_heads as ih

__all__ = ["selected_heads", "plot_head_scatter", "scatter_caption", "plot_score_heatmaps",
           "plot_attention", "OPEN_BUDGET_S", "ScoresPart"]

hv.extension("bokeh", logo=False)


def _waiting(text: str, height: int = 300) -> hv.Element:
    return theme.placeholder(text, height=height)


selected_heads = heads_in   # the workspace's selected heads that the model has


def plot_head_scatter(scores: xr.Dataset | None, top_induction: float, top_fv: float,
                      highlighted=()) -> hv.Element:
    """Induction score (x) vs FV score (y) per head, coloured by layer; top-p% heads ringed,
    the workspace's selected heads (``highlighted``) in a square outline."""
    if scores is None:
        return _waiting("Press Compute scores (left)")
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
                     tools=["hover", "tap"], default_tools=STATIC_TOOLS, active_tools=["tap"],
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
        return _waiting("Press Compute scores (left)")
    left = heads_heatmap(scores["induction_score"].values, name="induction_score",
                         title="Induction score", low=0.0, highlighted=highlighted)
    right = heads_heatmap(scores["fv_score"].values, name="fv_score", signed=True,
                          title="FV score (0 = white)", highlighted=highlighted)
    return (left + right).cols(2)


def pattern_head(d: dict | None) -> str:
    """The head whose attention the patterns ``d`` show (``L1.H2``), from their attrs."""
    if d is None:
        return ""
    params = d["repeat"].attrs["params"]
    return str(components.head(int(params["layer"]), int(params["head"])))


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
        default_tools=STATIC_TOOLS, title=title, xlabel="key token", ylabel="query token",
        clim=(0, 1), fontsize={"xticks": "7pt", "yticks": "7pt"})


OPEN_BUDGET_S = 5.0
"""Work estimated under this many seconds runs when the page opens; longer waits for a click."""


class ScoresPart:
    """The head scores and the selected head's attention of `ICLHeadsView`."""

    _read_scores: xr.Dataset | None = None   # the scores last read from the result cache

    @property
    def _scores_note(self) -> str:
        """`cached_note` of the shown scores' record while they are the ones read from the
        result cache, else '' (any other scores shown, a rescore's included)."""
        shown = self.shown_provenance()
        if shown is None or self._read_scores is None or self.scores is not self._read_scores:
            return ""
        return cached_note(shown.computed_at)

    def scores_note(self, *_: Any) -> str:
        """The words under the scatter, from the shown scores' record and the page's inputs:
        the stale note (red) and what the controls ask for instead, while they differ; the
        cache note; what the scores were computed on; the scatter's caption."""
        shown = self.shown_provenance()
        stale = self.stale_markdown()
        if stale:
            asked = requested_words(shown, self.request_provenance())
            stale = (f"<span class='icl-stale' style='color:#a33'>{stale}"
                     f"{' ' + asked if asked else ''}</span>  \n")
        note = f"{self._scores_note}.  \n" if self._scores_note else ""
        return (stale + note + scores_words(shown) + "  \n"
                + scatter_caption(self.scores, self.top_induction, self.top_fv)).strip()

    def score_work(self, *, induction_only: bool = False) -> ScoreWork:
        """What *Compute scores* runs with the page's settings (`apps._icl_estimate`): the
        task encoding only while it is not computed; ``induction_only``: the induction
        rescore that a change of its settings or of the edits starts."""
        task = self._task()
        if isinstance(task, str) and task not in ih.icl_task_names():
            task = self._fv_tasks[0]              # pasted pairs not taken in yet
        work = score_work(self._model, fv_tasks=self._fv_tasks,
                          td_tasks=self._td_tasks if self.td is None else (), task=task,
                          n_prompts=self._opts["n_prompts"], n_shots=self._opts["n_shots"],
                          n_sequences=int(self.induction_sequences),
                          half_len=int(self.induction_half_len))
        if induction_only:
            return ScoreWork(work.forwards[:1], work.n_sequences, work.seq_len)
        return work

    _cost: ForwardCost | None = None   # the model's costs on this machine, once measured

    def estimated_seconds(self, *, induction_only: bool = False,
                          reference: bool = False) -> float:
        """Seconds `score_work` takes on this machine: its forwards at the model's costs
        measured after the page's first job (`measured_forward_cost`; `reference_cost`
        until then); ``reference``: at `reference_cost`, the same on every machine."""
        spec = self._model.spec
        cost = reference_cost(spec) if reference or self._cost is None else self._cost
        return estimated_score_seconds(self.score_work(induction_only=induction_only), cost,
                                       n_layers=spec.n_layers, n_heads=spec.n_heads)

    def _time_text(self) -> str:
        if self._cost is None:
            return "timing the model on this machine…"
        return seconds_text(self.estimated_seconds())

    @property
    def _press_note(self) -> str:
        return (f"Press **Compute scores** to score every head and the task encoding "
                f"({self._time_text()}).")

    def _score_label(self, *_: Any) -> None:
        """The Compute button says how long it takes with the page's settings."""
        again = " again" if self.scores is not None else ""
        self._score_button.name = f"Compute scores{again} ({self._time_text()})"

    def _measure_cost(self) -> None:
        """Time the model's forwards (`measured_forward_cost`, once per model in the
        process) after the page's first job, so it does not slow the page's opening nor
        time a run that waits for another; the button's time follows."""
        if self._cost is None and not self._runners["cost"].running:
            model = self._model
            self.submit("cost", lambda token: measured_forward_cost(model))

    def _got_cost(self, cost: ForwardCost) -> None:
        self._cost = cost
        self._score_label()
        if self.scores is None and self.status.startswith("Press **Compute scores**"):
            self.status = self._press_note

    def show_stored_scores(self) -> bool:
        """Show the head scores of the page's current inputs from the result cache, when it
        holds them (`apps._result_cache`); whether it did."""
        _, hit = self.stored_result("scores", self.request_provenance())
        if hit is None or "scores" not in hit.datasets:
            return False
        self.cancel("scores")
        self._got_scores(hit.datasets["scores"], from_cache=True)
        return True

    def _compute(self) -> None:
        """The page's heavy work: head scores (then the FV) and the task encoding."""
        if self.td is None:
            self._request("td")
        self._request("scores")

    def _induction_job(self) -> Callable[[CancelToken], tuple]:
        """Rescore induction with the page's settings and edits (the FV scores stay)."""
        m, edits, kwargs = self._model, list(self.edits), self._induction_kwargs()
        wanted = self.request_provenance()
        return lambda token: (wanted, ih.induction_scores(m, edits=edits, **kwargs))

    def _rescore_induction(self) -> None:
        """Rescore induction once the scores exist (the page waits on it: `running`)."""
        if self.scores is not None:
            seconds = seconds_text(self.estimated_seconds(induction_only=True))
            self.param.update(running=True, status=f"rescoring induction ({seconds})…")
            self.submit("induction", self._induction_job())

    def _got_induction(self, result: tuple) -> None:
        wanted, ds = result
        self.param.update(running=False, status="scores ready")
        if self.scores is not None:
            scores = self.scores.assign(induction_score=ds["induction_score"])
            scores.attrs = dict(self.scores.attrs)
            self.scores = self.with_record(scores, wanted)

    def _got_scores(self, ds: xr.Dataset, *, from_cache: bool = False) -> None:
        """Show head scores (``from_cache``: read from the result cache)."""
        self._read_scores = ds if from_cache else None
        self.param.update(scores=ds, running=False)
        self._score_button.disabled = False
        fv = ds["fv_score"].values
        layer, head = np.unravel_index(int(np.nanargmax(fv)), fv.shape)
        if (self.layer, self.head) == (layer, head):
            self._request("patterns")
        else:                                   # the new head's attention (`_request`)
            self.param.update(layer=int(layer), head=int(head))
        self._request("fv")
        self.status = "scores ready"

    def _got_patterns(self, d: dict) -> None:
        self.patterns = d
        self.status = "ready" if self.scores is not None else self._press_note
        self._measure_cost()

    def _tapped(self, index: list[int]) -> None:
        if index and self.scores is not None:
            n_heads = self.scores.sizes["head"]
            self.param.update(layer=index[0] // n_heads, head=index[0] % n_heads)

    def _cell_tapped(self, x: Any = None, y: Any = None) -> None:
        """A click on a heatmap cell (x = head, y = layer) selects that head."""
        cell = head_cell(x, y, self.scores)
        if cell is not None:
            self.param.update(layer=cell[0], head=cell[1])

    def _scores_job(self) -> Callable[[CancelToken], xr.Dataset] | None:
        """Every head's induction score (on the edited model), then its FV score, kept in
        the result cache; None when the cache holds them (they are shown at once)."""
        m, o, edits = self._model, self._opts, list(self.edits)
        induction = self._induction_kwargs()
        wanted = self.request_provenance()
        parts, hit = self.stored_result("scores", wanted)
        if hit is not None and "scores" in hit.datasets:
            self.cancel("scores")
            self._got_scores(hit.datasets["scores"], from_cache=True)
            return None
        started = time.perf_counter()
        self._score_button.disabled = True
        self.running = True

        def job(token: CancelToken) -> xr.Dataset:
            ind = ih.induction_scores(m, edits=edits, **induction)
            token.check()
            bar = self.progress_fn(token)

            def progress(done: int, total: int) -> None:
                bar(done, total)
                left = (time.perf_counter() - started) * (total - done) / max(1, done)
                self.post(status=f"scoring heads: {done}/{total}, about {left:.0f} s left")
            fv = ih.fv_scores(m, self._fv_tasks, progress=progress, **o)
            ds = self.with_record(xr.merge([ind[["induction_score"]], fv[["fv_score", "mean_z"]]],
                                           combine_attrs="drop_conflicts"), wanted)
            self.store_result(parts, {"scores": ds},
                              computed_at=Provenance.from_json(ds.attrs[RECORD]).computed_at)
            return ds
        return job

    def _patterns_job(self) -> Callable[[CancelToken], dict]:
        """The selected head's attention on a repeated sequence and on the task's prompt."""
        m, edits = self._model, list(self.edits)
        layer, head, task, name = self.layer, self.head, self._task(), self.task
        return lambda token: {**ih.head_attention(m, layer, head, task=task, edits=edits),
                              "task": name}

    def _scores_controls(self) -> list[pn.viewable.Viewable]:
        p = self.param
        return [self._score_button, self._progress, pn.pane.Markdown(p.status),
                tip(pn.widgets.FloatSlider.from_param(p.top_induction), p.top_induction.doc),
                tip(pn.widgets.FloatSlider.from_param(p.top_fv), p.top_fv.doc),
                tip(pn.widgets.IntSlider.from_param(p.layer), p.layer.doc),
                tip(pn.widgets.IntSlider.from_param(p.head), p.head.doc),
                tip(pn.widgets.Select.from_param(p.task), p.task.doc), self._own.layout(p.error),
                tip(pn.widgets.IntInput.from_param(p.induction_sequences),
                    p.induction_sequences.doc),
                tip(pn.widgets.IntInput.from_param(p.induction_half_len), p.induction_half_len.doc),
                tip(pn.widgets.Select.from_param(p.induction_measure), p.induction_measure.doc)]

    def _scores_panes(self) -> list[pn.viewable.Viewable]:
        p = self.param

        def scatter(scores, top_induction, top_fv, highlighted):
            plot = plot_head_scatter(scores, top_induction, top_fv, highlighted)
            if scores is not None:   # clicking a point selects its head
                points = plot.get(0) if isinstance(plot, hv.Overlay) else plot
                hv.streams.Selection1D(source=points).add_subscriber(self._tapped)
            return plot

        def heatmaps(scores, highlighted):   # clicking a cell selects its head
            return on_head_click(plot_score_heatmaps(scores, highlighted), self._cell_tapped)

        pat_rep = pn.bind(lambda d: plot_attention(
            None if d is None else d["repeat"], f"{pattern_head(d)}, repeated sequence",
            "a repeated random sequence"), p.patterns)
        pat_icl = pn.bind(lambda d, t: plot_attention(
            None if d is None else d["icl"], f"{pattern_head(d)}, {d['task'] if d else t} "
            "prompt", f"a few-shot {t} prompt"), p.patterns, p.task)
        # every input of the note: the shown scores, the page's inputs, the rescore's state
        note_inputs = [p[n] for n in ("scores", "top_induction", "top_fv", "edits",
                                      "induction_sequences", "induction_half_len",
                                      "induction_measure", "running", "error")]

        return [
            pn.pane.HoloViews(pn.bind(scatter, p.scores, p.top_induction, p.top_fv,
                                      p.highlighted),
                              sizing_mode="stretch_width", linked_axes=False),
            caption(pn.bind(self.scores_note, *note_inputs), "icl-scores-note"),
            # the clicked head's attention right under the scatter it was clicked on
            pn.pane.HoloViews(pat_rep, linked_axes=False, sizing_mode="stretch_width"),
            pn.pane.HoloViews(pat_icl, linked_axes=False, sizing_mode="stretch_width"),
            caption("Attention of the selected head (query rows, key columns): on a repeated "
                    "random sequence an induction head attends to the token after the current "
                    "token's earlier copy (a stripe below the diagonal); on an ICL prompt, an "
                    "FV head reads the demonstrations' answers."),
            pn.pane.HoloViews(pn.bind(heatmaps, p.scores, p.highlighted),
                              sizing_mode="stretch_width", linked_axes=False),
            caption("The same two scores as layer × head maps (click a cell to select the "
                    "head).")]
