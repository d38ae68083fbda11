"""The Knowledge conflicts page's plots and captions as pure functions: every head's direct
effect as a layer x head heatmap and as a context-vs-memory scatter (the chosen S+ / S-
heads marked), the answer bars before and after the intervention, the split's accuracy."""
from __future__ import annotations

import html

import holoviews as hv
import numpy as np
import pandas as pd
import xarray as xr

from apps import theme
from apps._heads_heatmap import heads_heatmap, heads_in, selected_outlines
from apps._positions import POSITION_COLOR
from apps._view import STATIC_TOOLS
from explorer import components
from explorer.analyses import conflicts as C

__all__ = ["head_name", "parse_head", "HEATMAP_CAPTION", "SCATTER_CAPTION", "ALPHA_NOTE",
           "plot_head_heatmap", "selected_heads_in", "plot_selected_heads", "prompts_note",
           "plot_head_scatter", "answer_bars_data", "plot_answer_bars", "edited_title",
           "NO_HEADS_NOTE", "bars_caption", "split_time_left", "edited_bars_caption",
           "accuracy_table"]

hv.extension("bokeh", logo=False)


_SET_COLORS = {"S+": theme.CATEGORICAL[2], "S-": theme.CATEGORICAL[3]}


_TITLE_EDITS = 2  # workspace edits named in the edited bars' title (all in their caption)


def _label(f: C.Fact) -> str:
    return f"{f.relation}: {f.subject} (memory {f.memory}, context {f.context})"


def head_name(layer: int, head: int) -> str:
    return str(components.head(int(layer), int(head)))


def parse_head(name: str) -> tuple[int, int]:
    c = components.parse(name)
    return int(c.layer), int(c.head)


HEATMAP_CAPTION = (
    "Each head's direct contribution to logit(memory answer) − logit(context answer) at the "
    "last token (red: pushes the memory answer, blue: the context answer). Click a cell to "
    "add the head to the set *Clicks add heads to* names; click it again to remove it.")


SCATTER_CAPTION = (
    "Every head's context score (x) against its memory score (y), coloured by layer; ringed: "
    "the heads chosen (S+ green, S- red). Heads far from both axes push memory on some "
    "prompts and context on others.")


ALPHA_NOTE = (
    "Raising α_l can lower P(memory), and that is not a sign error. The heatmap ranks heads by "
    "their direct push on logit(memory) − logit(context); enhancing the picked heads widens "
    "that gap at first (SmolLM2, France, S+ only: log P(memory)/P(context) 2.8 → 3.7 at "
    "α_l = 1), but scaled-up head outputs also move probability to other tokens and the later "
    "layers react, so P(memory) itself falls (0.40, 0.36, 0.03 at α_l = 0, 1, 5). JuICE picks "
    "heads by the intervention's effect on all three prompt types (*Select heads as JuICE "
    "does*): there no head qualifies for S+, and suppressing its three S- heads raises "
    "P(memory) to 0.58.")


def _waiting(text: str, height: int = 300) -> hv.Element:
    return theme.placeholder(text, height=height)


def _chosen(plus: list[str], minus: list[str]) -> dict[str, str]:
    return {**{n: "S+" for n in plus}, **{n: "S-" for n in minus}}


def plot_head_heatmap(scores: xr.Dataset | None, plus: list[str] = (),
                      minus: list[str] = ()) -> hv.Element:
    """Layer x head direct contribution to memory minus context logit (mean over prompts);
    chosen heads marked (S+ / S-)."""
    if scores is None:
        return _waiting("Computing head scores…", 360)
    d = scores.direct_diff.mean(("kind", "fact")).transpose("layer", "head")
    heat = heads_heatmap(d.values, name="direct_diff", label="logit(memory) − logit(context)",
                         title="Direct effect per head", signed=True,
                         height=max(300, 12 * d.sizes["layer"] + 80))
    chosen = _chosen(list(plus), list(minus))
    marks = hv.Points([(*parse_head(n)[::-1], s) for n, s in chosen.items()],
                      kdims=["head", "layer"], vdims=["set"])
    return heat * marks.opts(color="set", cmap=_SET_COLORS, marker="square", size=14,
                             fill_alpha=0, line_width=3, show_legend=False)


selected_heads_in = heads_in   # the workspace's selected heads that the model has


def plot_selected_heads(scores: xr.Dataset | None, highlighted: list[str]) -> hv.Element | None:
    """Dashed outlines (the selection's colour) of the workspace's selected heads on
    `plot_head_heatmap`; None when none of them is a head of the scored model."""
    if scores is None or not heads_in(highlighted, scores.sizes["layer"], scores.sizes["head"]):
        return None
    return selected_outlines(highlighted, scores.sizes["layer"], scores.sizes["head"])


def prompts_note(fact: C.Fact, kind: str) -> str:
    """The line above the plots naming the prompt the page runs (its own fact set, not the
    sidebar prompt)."""
    prompt = C.conflict_prompt(fact, kind)
    text = prompt if len(prompt) <= 160 else prompt[:159] + "…"
    return (f"**Runs on its own fact set**, not your prompt: the *{kind}* prompt of "
            f"{html.escape(fact.subject)} ({html.escape(fact.relation)}): "
            f"“{html.escape(text)}” (memory answer **{html.escape(fact.memory)}**, context "
            f"answer **{html.escape(fact.context)}**). Pick another under *Example* or add your "
            "own.")


def _scatter_rows(scores: xr.Dataset) -> list[tuple[float, float, str, int]]:
    ms, cs = scores.memory_score, scores.context_score
    return [(float(cs.sel(layer=layer, head=h)), float(ms.sel(layer=layer, head=h)),
             head_name(layer, h), int(layer)) for layer in ms.layer.values for h in ms["head"].values]


def plot_head_scatter(scores: xr.Dataset | None, plus: list[str] = (),
                      minus: list[str] = (), highlighted: list[str] = ()) -> hv.Element:
    """Each head's context score against its memory score, coloured by layer; chosen heads
    ringed (S+ / S-), the workspace's selected heads (``highlighted``) ringed dashed in the
    selection's colour. Heads far from both axes push memory on some prompts and context on
    others (superposition)."""
    if scores is None:
        return _waiting("Computing head scores…", 360)
    rows = _scatter_rows(scores)
    picked = {head_name(l, h) for l, h in selected_heads_in(
        list(highlighted), scores.sizes["layer"], scores.sizes["head"])}
    pts = hv.Points(rows, kdims=["context_score", "memory_score"], vdims=["head_name", "layer"])
    chosen = _chosen(list(plus), list(minus))
    ring = hv.Points([(*r[:2], r[2], chosen[r[2]]) for r in rows if r[2] in chosen],
                     kdims=["context_score", "memory_score"], vdims=["head_name", "set"])
    return (pts.opts(color="layer", cmap=theme.MAGNITUDE_CMAP, colorbar=True, clabel="layer",
                     size=8, tools=["hover", "tap"], default_tools=STATIC_TOOLS, active_tools=["tap"],
                     nonselection_alpha=0.8)
            * ring.opts(color="set", cmap=_SET_COLORS, size=18, fill_alpha=0, line_width=3,
                        tools=["hover"], show_legend=False)
            * hv.Points([r[:3] for r in rows if r[2] in picked],
                        kdims=["context_score", "memory_score"], vdims=["head_name"]).opts(
                color=POSITION_COLOR, size=24, fill_alpha=0, line_width=2.5,
                line_dash="dashed", tools=["hover"])).opts(
        responsive=True, height=360, xlabel="context score (logit units)",
        ylabel="memory score (logit units)",
        title="Context vs memory score", xticks=5)


def answer_bars_data(before: np.ndarray, after: np.ndarray) -> list[tuple[str, str, float]]:
    """(answer, run, probability) rows from two [2] arrays (memory, context)."""
    return [(ans, run, float(p[i])) for run, p in (("before", before), ("after", after))
            for i, ans in enumerate(("memory", "context"))]


def plot_answer_bars(rows: list[tuple[str, str, float]] | None, *,
                     title: str = "P(answer)") -> hv.Element:
    """P(memory) and P(context) before and after the intervention; the run labels stand
    upright (at 45 degrees one answer's 'before' and 'after' collide)."""
    if rows is None:
        return _waiting("Computing…", 300)
    bars = hv.Bars(rows, kdims=["answer", "run"], vdims=["probability"])
    return bars.redim.values(answer=["memory", "context"], run=["before", "after"]).opts(
        ylim=(0, 1), tools=["hover"], responsive=True, height=280, multi_level=True, xrotation=90,
        color="run", cmap={"before": "#999999", "after": theme.ACCENT}, default_tools=STATIC_TOOLS,
        show_legend=False, xlabel="", title=title)


def edited_title(labels: list[str]) -> str:
    """The heading over the edited bars, naming every workspace edit: ``Edited: ablate L1.H0
    (zero)`` (a heading, not the plot's title: a long one wraps, a title would be cut)."""
    return "Edited: " + "; then ".join(labels)


NO_HEADS_NOTE = ("**No head selected yet**, so both runs are the plain model and the bars "
                 "match. Click heads in the heatmap or scatter below, or press *Pick top heads "
                 "for the direction* or *Select heads as JuICE does*.")


def bars_caption(rows: list[tuple[str, str, float]] | None, fact: C.Fact, mode: str, *,
                 n_heads: int | None = None, alphas: tuple[float, float] | None = None,
                 preview: str | None = None) -> str:
    """The numbers of the answer bars, under them; with ``n_heads`` 0 (empty S+ and S-), the
    note that nothing is intervened on yet and what to press. ``alphas`` (α_l, α_s) are named
    where given; ``preview`` (the preview's precision, `apps._conflicts_preview.preview_dtype`)
    says the bars are a slider's preview."""
    if rows is None:
        return "Computing the answer probabilities…"
    p = {(a, r): v for a, r, v in rows}
    run = "JuICE dual run" if mode == "juice" else "single run"
    lead = NO_HEADS_NOTE + " " if n_heads == 0 else ""
    if preview:
        how = {"float32": "re-run from the lowest chosen layer in float32",
               "bfloat16": "re-run from the lowest chosen layer with bfloat16 products, "
                           "within 0.05 of exact"}.get(preview, "exact path")
        lead += f"*Preview while the slider moves ({how}); exact on release.* "
    heads = "the heads" if n_heads is None else f"{n_heads} head{'s' if n_heads != 1 else ''}"
    at = ("α above" if alphas is None
          else f"α_l = {float(alphas[0]):g}, α_s = {float(alphas[1]):g}")
    return lead + (f"P(first token) of the memory answer **{fact.memory}**: {p['memory', 'before']:.2f} "
            f"→ **{p['memory', 'after']:.2f}**; of the context answer **{fact.context}**: "
            f"{p['context', 'before']:.2f} → **{p['context', 'after']:.2f}** (grey: no "
            f"intervention, blue: the {run} with {heads} at {at}).")


def split_time_left(seconds: float) -> str:
    """'about 40 s left' / 'about 3 min left' for the split's progress line."""
    if seconds < 90:
        return f"about {seconds:.0f} s left"
    return f"about {seconds / 60:.0f} min left"


def edited_bars_caption(rows: list[tuple[str, str, float]] | None,
                        clean: list[tuple[str, str, float]] | None, labels: list[str],
                        fact: C.Fact) -> str:
    """Under the edited bars: every workspace edit and the edited numbers next to the clean."""
    if rows is None:
        return ""
    p = {(a, r): v for a, r, v in rows}
    c = {(a, r): v for a, r, v in clean or []}

    def pair(answer: str, run: str) -> str:
        was = f" (clean {c[answer, run]:.2f})" if (answer, run) in c else ""
        return f"**{p[answer, run]:.2f}**{was}"

    edits = "; then ".join(f"`{t}`" for t in labels)
    return (f"The same example on the model with {edits}: P(memory **{fact.memory}**) "
            f"{pair('memory', 'before')} without, {pair('memory', 'after')} with the "
            f"intervention; P(context **{fact.context}**) {pair('context', 'before')} and "
            f"{pair('context', 'after')}.")


def accuracy_table(acc: xr.Dataset) -> pd.DataFrame:
    """One row per intervention, columns accuracy toward memory / context per prompt type."""
    names = {"baseline": "baseline (no intervention)", "single": "single run (JuNE)",
             "juice": "JuICE dual run"}
    rows = []
    for m in acc.intervention.values.tolist():
        row = {"intervention": names.get(m, m)}
        for k in acc.kind.values.tolist():
            row[f"to memory, {k}"] = float(acc.memory_accuracy.sel(intervention=m, kind=k))
            row[f"to context, {k}"] = float(acc.context_accuracy.sel(intervention=m, kind=k))
        rows.append(row)
    return pd.DataFrame(rows)
