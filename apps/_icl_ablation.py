"""The ICL heads page's ablation curves: few-shot accuracy with the top heads by each
ranking (FV, induction, random) mean-ablated, as the share of ablated heads grows."""
from __future__ import annotations

from collections.abc import Callable

import holoviews as hv
import panel as pn
import xarray as xr

from apps import theme
from apps._controls import caption, tip
from apps._icl_scores import _waiting
from apps._session import CancelToken
from explorer.analyses import icl_heads as ih

__all__ = ["plot_ablation_curves", "ablation_caption", "AblationPart"]

hv.extension("bokeh", logo=False)


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
    """``variable`` (mean accuracy by default) against % of heads ablated, one curve per
    ranking; where the Dataset holds ``<variable>_low`` / ``_high`` (the bootstrap interval
    over prompts), a shaded band per ranking."""
    if curves is None:
        return _waiting("Press Recompute ablation curves (left)", 300)
    ylabel, title = _CURVE_LABELS[variable]
    if variable == "mean_accuracy" and curves.attrs.get("params", {}).get("score") == "f1":
        ylabel, title = "F1 of the generated answer", "Ablation: F1 of the generated answer"
    pct = curves["percent"].values
    banded = f"{variable}_low" in curves and f"{variable}_high" in curves
    out = []
    for r in curves["ranking"].values:
        y = curves[variable].sel(ranking=r).values
        c = _RANKING_COLORS.get(str(r), theme.ACCENT)
        if banded:
            lo = curves[f"{variable}_low"].sel(ranking=r).values
            hi = curves[f"{variable}_high"].sel(ranking=r).values
            out.append(hv.Area((pct, lo, hi), "% heads ablated", [ylabel, "high"])
                       .opts(color=c, alpha=0.15, line_alpha=0))
        out.append(hv.Curve((pct, y), "% heads ablated", ylabel, label=str(r))
                   .opts(color=c, line_width=2, tools=["hover"]))
        out.append(hv.Scatter((pct, y), "% heads ablated", ylabel).opts(color=c, size=6))
    if banded:
        level = float(curves.attrs.get("params", {}).get("confidence_level", 0.95))
        title = f"{title} ({level:.0%} bands)"
    extra = {"ylim": (-0.02, 1.05)} if variable == "mean_accuracy" else {}
    return hv.Overlay(out).opts(responsive=True, height=320, legend_position="right",
                                title=title, show_legend=True, **extra)


#: How each ICL score reads in a caption.
_SCORE_WORDS = {
    "first_token": "Few-shot accuracy (argmax = the answer's first token)",
    "f1": ("F1 of the answer parsed from 5 greedily generated tokens (the paper's score; the "
           "heads are ablated at the last prompt token and every generated token)"),
}


def ablation_caption(curves: xr.Dataset | None, mean_source: str,
                     score: str = "first_token") -> str:
    """How the ablation curves were made: the tasks, the prompts, the score, the ablation
    value; of a shown result, from its own attrs (the controls only before one exists)."""
    what = {"cross-task": "its mean last-token output averaged over the FV-scoring tasks' "
                          "prompts (the paper's ablation)",
            "per-task": "its mean last-token output on the evaluated task's own prompts "
                        "(keeps the head's share of that task's function vector)",
            "zero": "zero"}
    if curves is None:
        return (f"{_SCORE_WORDS[score]} on the evaluation tasks with the top heads by each "
                f"ranking ablated at the last token; an ablated head's output is replaced with "
                f"{what[mean_source]}. Yin & Steinhardt find ablating FV heads hurts ICL far "
                f"more than ablating induction heads.")
    p = curves.attrs.get("params", {})
    src = p.get("mean_source", mean_source)
    pool = p.get("mean_tasks")
    tasks = ", ".join(str(t) for t in curves["task"].values)
    words = _SCORE_WORDS[p.get("score", "first_token")]
    return (f"{words} on {tasks}, "
            f"{p.get('n_prompts')} prompts of {p.get('n_shots')} shots each, with the top "
            f"heads by each ranking ablated at the last token. An ablated head's output is "
            f"replaced with {what[src]}" + (f" ({', '.join(pool)})" if pool else "") +
            f". Bands: {float(p.get('confidence_level', 0.95)):.0%} bootstrap interval over "
            f"prompts ({p.get('n_boot')} resamples within each task); with few prompts they are "
            f"wide. Yin & Steinhardt find ablating FV heads hurts ICL far more than ablating "
            f"induction heads.")


class AblationPart:
    """The ablation curves of `ICLHeadsView`."""

    def _got_curves(self, ds: xr.Dataset) -> None:
        self.curves = ds
        self.status = "ablation curves ready"

    def _curves_job(self) -> Callable[[CancelToken], xr.Dataset] | None:
        """Accuracy with the top heads by each ranking mean-ablated (None before scores)."""
        if self.scores is None:
            return None
        m, o, edits = self._model, self._opts, list(self.edits)
        ind, fv = self.scores["induction_score"].values, self.scores["fv_score"].values
        top = float(self.max_percent)
        percents = sorted({0.0, *[p for p in (1, 3, 5, 10, 20, 30, 50) if p <= top], top})
        rankings = (("fv_excl_induction", "induction_excl_fv", "random")
                    if self.exclude_other else ("fv", "induction", "random"))
        exclude = float(self.exclude_percent) / 100
        source, score = self.mean_source, self.icl_score

        def job(token: CancelToken) -> xr.Dataset:
            progress = self.progress_fn(token)
            return ih.ablation_curves(m, self._eval_tasks, ind, fv, percents=percents,
                                      rankings=rankings, exclude_fraction=exclude,
                                      loss_sequences=2, loss_tokens=64, progress=progress,
                                      mean_source=source, mean_tasks=self._fv_tasks,
                                      score=score, edits=edits, **o)
        return job

    def _ablation_controls(self) -> list[pn.viewable.Viewable]:
        p = self.param
        slider = pn.widgets.FloatSlider.from_param(p.max_percent)
        slider.param.watch(lambda e: (setattr(self, "max_percent", e.new), self._request("curves")),
                           "value_throttled")
        button = pn.widgets.Button(label="Recompute ablation curves", color="primary",
                                   description="Mean-ablate the top heads by each ranking and "
                                               "measure the evaluation tasks again.")
        button.on_click(lambda *_: self._request("curves"))
        return [tip(slider, p.max_percent.doc),
                tip(pn.widgets.Checkbox.from_param(p.exclude_other), p.exclude_other.doc),
                tip(pn.widgets.FloatSlider.from_param(p.exclude_percent), p.exclude_percent.doc),
                tip(pn.widgets.Select.from_param(p.mean_source), p.mean_source.doc),
                tip(pn.widgets.Select.from_param(p.icl_score), p.icl_score.doc), button]

    def _ablation_panes(self) -> list[pn.viewable.Viewable]:
        p = self.param
        return [pn.pane.HoloViews(pn.bind(plot_ablation_curves, p.curves), linked_axes=False,
                                  sizing_mode="stretch_width"),
                caption(pn.bind(ablation_caption, p.curves, p.mean_source, p.icl_score),
                        "icl-ablation-caption")]
