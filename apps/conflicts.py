"""Knowledge conflicts page: which heads push the memory vs the context answer, and JuICE.

Li, Chen & Tong, "Taming Knowledge Conflicts in Language Models" (JuICE, ICML 2025).
For one fact and prompt type the page shows each head's direct contribution to the memory
minus context answer logit (layer x head heatmap) and the heads' memory vs context scores
(scatter); heads picked in the two lists are intervened on with the sliders' alpha_l
(enhance) and alpha_s (suppress), by the dual run or the single-run baseline, and the bars
show P(memory answer) and P(context answer) before and after.
"""
from __future__ import annotations

from typing import Any

import holoviews as hv
import numpy as np
import panel as pn
import param
import xarray as xr

from apps import theme
from explorer.analyses import conflicts as C

__all__ = ["ConflictsView", "plot_head_heatmap", "plot_head_scatter", "plot_answer_bars",
           "answer_bars_data"]

hv.extension("bokeh", logo=False)


def _label(f: C.Fact) -> str:
    return f"{f.relation}: {f.subject} (memory {f.memory}, context {f.context})"


def plot_head_heatmap(scores: xr.Dataset) -> hv.HeatMap:
    """Layer x head direct contribution to memory minus context logit (mean over prompts)."""
    d = scores.direct_diff.mean(("kind", "fact"))
    lim = float(abs(d).max()) or 1.0
    rows = [(int(h), int(layer), float(d.sel(layer=layer, head=h)))
            for layer in d.layer.values for h in d["head"].values]
    return hv.HeatMap(rows, kdims=["head", "layer"], vdims=["direct_diff"]).opts(
        cmap="RdBu_r", clim=(-lim, lim), colorbar=True, tools=["hover", "tap"],
        title="Direct effect on logit(memory) − logit(context)", responsive=True, height=360)


def plot_head_scatter(scores: xr.Dataset) -> hv.Points:
    """Each head's context score against its memory score."""
    ms, cs = scores.memory_score, scores.context_score
    rows = [(float(cs.sel(layer=layer, head=h)), float(ms.sel(layer=layer, head=h)),
             f"L{int(layer)}.H{int(h)}") for layer in ms.layer.values for h in ms["head"].values]
    return hv.Points(rows, kdims=["context_score", "memory_score"], vdims=["head_name"]).opts(
        tools=["hover"], size=7, color=theme.ACCENT, responsive=True, height=360,
        title="Heads: context score vs memory score (logit units)")


def answer_bars_data(before: np.ndarray, after: np.ndarray) -> list[tuple[str, str, float]]:
    """(answer, run, probability) rows from two [2] arrays (memory, context)."""
    return [(ans, run, float(p[i])) for run, p in (("before", before), ("after", after))
            for i, ans in enumerate(("memory", "context"))]


def plot_answer_bars(rows: list[tuple[str, str, float]]) -> hv.Bars:
    return hv.Bars(rows, kdims=["answer", "run"], vdims=["probability"]).opts(
        ylim=(0, 1), tools=["hover"], responsive=True, height=300, multi_level=True,
        title="P(first token of the answer)")


class ConflictsView(pn.viewable.Viewer):
    """One fact under conflict: head scores, head picks, alpha sliders, answer bars."""

    example = param.Selector(default=None, objects=[], doc="Fact to show")
    kind = param.Selector(default="substitution", objects=list(C.PROMPT_KINDS), doc="Prompt type")
    heads_plus = param.ListSelector(default=[], objects=[], doc="Heads to enhance (S+)")
    heads_minus = param.ListSelector(default=[], objects=[], doc="Heads to suppress (S-)")
    alpha_l = param.Number(default=1.0, bounds=(0.0, 5.0), step=0.5, doc="Enhance factor")
    alpha_s = param.Number(default=1.0, bounds=(0.0, 3.0), step=0.5, doc="Suppress factor")
    mode = param.Selector(default="juice", objects=["juice", "single"],
                          doc="Dual run (JuICE) or single-run scaling")

    def __init__(self, model: Any, **params: Any):
        self._model = model
        self._scores: tuple[Any, Any] = (None, None)
        self._facts = {_label(f): f for f in C.load_facts()}
        names = [f"L{layer}.H{h}" for layer in range(model.n_layers)
                 for h in range(model.spec.n_heads)]
        self.param.example.objects = list(self._facts)
        self.param.heads_plus.objects = names
        self.param.heads_minus.objects = names
        params.setdefault("example", next(iter(self._facts)))
        super().__init__(**params)

    @staticmethod
    def _pairs(names: list[str]) -> list[tuple[int, int]]:
        return [tuple(int(x) for x in n[1:].split(".H")) for n in names]

    @param.depends("example", "kind")
    def scores(self) -> xr.Dataset:
        key = (self.example, self.kind)
        if self._scores[0] != key:  # the heatmap and the scatter share one computation
            fact = self._facts[self.example]
            self._scores = (key, C.head_context_memory_scores(
                self._model, [fact], kinds=[self.kind], ablation=False))
        return self._scores[1]

    @param.depends("example", "kind")
    def _heatmap(self) -> hv.HeatMap:
        return plot_head_heatmap(self.scores())

    @param.depends("example", "kind")
    def _scatter(self) -> hv.Points:
        return plot_head_scatter(self.scores())

    @param.depends("example", "kind", "heads_plus", "heads_minus", "alpha_l", "alpha_s", "mode")
    def _bars(self) -> hv.Bars:
        return plot_answer_bars(self.bars())

    @param.depends("example", "kind", "heads_plus", "heads_minus", "alpha_l", "alpha_s", "mode")
    def bars(self) -> list[tuple[str, str, float]]:
        fact = self._facts[self.example]
        prompt = [C.conflict_prompt(fact, self.kind)]
        run = C.juice_logits if self.mode == "juice" else C.single_run_logits
        before = C.answer_probabilities(self._model, C.juice_logits(self._model, prompt), [fact])[0]
        after = C.answer_probabilities(
            self._model, run(self._model, prompt, self._pairs(self.heads_plus),
                             self._pairs(self.heads_minus), alpha_l=self.alpha_l,
                             alpha_s=self.alpha_s), [fact])[0]
        return answer_bars_data(before, after)

    def __panel__(self) -> pn.viewable.Viewable:
        controls = pn.Param(self, parameters=["example", "kind", "heads_plus", "heads_minus",
                                              "alpha_l", "alpha_s", "mode"],
                            widgets={"heads_plus": pn.widgets.MultiChoice,
                                     "heads_minus": pn.widgets.MultiChoice,
                                     "mode": pn.widgets.RadioButtonGroup},
                            show_name=False)
        return pn.Row(
            pn.Column(controls, width=320),
            pn.Column(pn.Row(self._heatmap, self._scatter), self._bars),
        )


if pn.state.served:
    from apps._session import get_model

    theme.enable_extension()
    theme.page([ConflictsView(get_model("smollm2-135m"))], title="Knowledge conflicts").servable()
