"""Knowledge conflicts page: which heads push the memory vs the context answer, and JuICE.

Li, Chen & Tong, "Taming Knowledge Conflicts in Language Models" (JuICE, ICML 2025).
For one fact and prompt type the page shows each head's direct contribution to the memory
minus context answer logit (layer x head heatmap) and the heads' memory vs context scores
(scatter). Clicking a head in either plot adds it to the enhance (S+) or suppress (S-) set
(the "clicks add to" toggle) or removes it; the sliders set alpha_l (enhance) and alpha_s
(suppress) of the dual run (or the single-run baseline) and the bars show P(memory
answer) and P(context answer) before and after. Run 1 of the dual run is computed once
per example, so a slider move costs one run 2 resumed at the first chosen layer. A button
scores the whole split (the facts the model knows closed book) for baseline, single run
and JuICE, with a progress bar and a results table.

With workspace edits (`ConflictsView.edits`: the session's edit stack, e.g. an ablated head)
a second bar chart under the first shows the same P(memory) / P(context), with and without
the JuICE intervention, on the edited model (both runs of the dual run carry the edits),
titled "edited: ..."; the first is then titled "clean". `ConflictsView.add_to_juice` adds a
head named in the component spelling (``L17.H3``) to the enhance or suppress set (the
gallery's component menu calls it).
"""
from __future__ import annotations

import html
import time
from collections.abc import Callable
from typing import Any

import holoviews as hv
import numpy as np
import pandas as pd
import panel as pn
import param
import xarray as xr

import explorer
from apps import theme
from apps._controls import OwnItems, labelled, tip
from apps._session import CancelToken, user_message
from apps._positions import POSITION_COLOR
from apps._heads_heatmap import head_cell, heads_heatmap, heads_in, on_head_click, selected_outlines
from apps._view import STATIC_TOOLS, Scope, View, serve
from explorer import components
from explorer.analyses import user_items
from explorer._checks import InputError, check_choice
from explorer.analyses import conflicts as C
from explorer.interventions import Edit

__all__ = ["ConflictsView", "plot_head_heatmap", "plot_head_scatter", "plot_answer_bars",
           "answer_bars_data", "bars_caption", "edited_bars_caption", "edited_title",
           "accuracy_table", "head_name", "parse_head", "HEATMAP_CAPTION", "SCATTER_CAPTION",
           "ALPHA_NOTE", "JUICE_SETS", "NO_HEADS_NOTE", "split_time_left", "selected_heads_in",
           "prompts_note", "plot_selected_heads"]

hv.extension("bokeh", logo=False)

_TOOLS = STATIC_TOOLS
_SET_COLORS = {"S+": theme.CATEGORICAL[2], "S-": theme.CATEGORICAL[3]}
_TITLE_EDITS = 2  # workspace edits named in the edited bars' title (all in their caption)

JUICE_SETS = {"enhance": "heads_plus", "suppress": "heads_minus"}
"""`ConflictsView.add_to_juice`'s ``which`` and the head set it fills."""


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
                     size=8, tools=["hover", "tap"], default_tools=_TOOLS, active_tools=["tap"],
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
    upright (at 45 degrees one answer's 'before' and 'after' collide in the narrow plot)."""
    if rows is None:
        return _waiting("Computing…", 300)
    bars = hv.Bars(rows, kdims=["answer", "run"], vdims=["probability"])
    return bars.redim.values(answer=["memory", "context"], run=["before", "after"]).opts(
        ylim=(0, 1), tools=["hover"], responsive=True, height=280, multi_level=True, xrotation=90,
        color="run", cmap={"before": "#999999", "after": theme.ACCENT}, default_tools=_TOOLS,
        show_legend=False, xlabel="", title=title)


def edited_title(labels: list[str]) -> str:
    """The heading over the edited bars, naming every workspace edit: ``Edited: ablate L1.H0
    (zero)`` (a heading, not the plot's title: it wraps in the narrow controls column)."""
    return "Edited: " + "; then ".join(labels)


NO_HEADS_NOTE = ("**No head selected yet**, so both runs are the plain model and the bars "
                 "match. Click heads in the heatmap or scatter below, or press *Pick top heads "
                 "for the direction* or *Select heads as JuICE does*.")


def bars_caption(rows: list[tuple[str, str, float]] | None, fact: C.Fact, mode: str, *,
                 n_heads: int | None = None) -> str:
    """The numbers of the answer bars, under them; with ``n_heads`` 0 (empty S+ and S-), the
    note that nothing is intervened on yet and what to press."""
    if rows is None:
        return "Computing the answer probabilities…"
    p = {(a, r): v for a, r, v in rows}
    run = "JuICE dual run" if mode == "juice" else "single run"
    lead = NO_HEADS_NOTE + " " if n_heads == 0 else ""
    return lead + (f"P(first token) of the memory answer **{fact.memory}**: {p['memory', 'before']:.2f} "
            f"→ **{p['memory', 'after']:.2f}**; of the context answer **{fact.context}**: "
            f"{p['context', 'before']:.2f} → **{p['context', 'after']:.2f}** (grey: no "
            f"intervention, blue: the {run} with the heads and α above).")


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


class ConflictsView(View):
    """One fact under conflict: head scores, head picks by click, alpha sliders, answer bars,
    and accuracy over the split.

    Parameters
    ----------
    model : explorer.Model
    facts : sequence of Fact, optional
        Facts to pick from and to score (default: every shipped fact).
    closed_book : bool, default=True
        Score the split on the facts the model answers correctly without context only.
    background : bool, optional
        Compute in worker threads (default when served) or inline (tests, notebooks).
    n_new : int, default=5
        Tokens generated per answer when scoring the split.
    """

    example = param.Selector(default=None, objects=[], label="Example",
                             doc="The fact shown: its true (memory) and its false (context) value.")
    kind = param.Selector(default="substitution", objects=list(C.PROMPT_KINDS), label="Prompt type",
                          doc="clean: the question alone; substitution: one sentence stating the "
                              "false value first; coherent: a short passage supporting it.")
    direction = param.Selector(default="parametric", objects=list(C.DIRECTIONS),
                               label="Answer to strengthen",
                               doc="Which answer the head-picking buttons strengthen: parametric "
                                   "= the memory answer, context = the answer the prompt states.")
    pick_set = param.Selector(default="S+ (enhance)", objects=["S+ (enhance)", "S- (suppress)"],
                              label="Clicks add heads to",
                              doc="The set a click on a head in the heatmap or scatter adds it "
                                  "to (a second click removes it).")
    heads_plus = param.ListSelector(default=[], objects=[], label="Enhance (S+)",
                                    doc="Heads whose output run 2 adds α_l times again.")
    heads_minus = param.ListSelector(default=[], objects=[], label="Suppress (S-)",
                                     doc="Heads whose output run 2 subtracts α_s times.")
    alpha_l = param.Number(default=1.0, bounds=(0.0, 5.0), step=0.5, label="α_l (enhance)",
                           doc="How many times each S+ head's output is added (0: off).")
    alpha_s = param.Number(default=1.0, bounds=(0.0, 3.0), step=0.5, label="α_s (suppress)",
                           doc="How many times each S- head's output is subtracted (1: the head "
                               "removed; more: pushed the other way).")
    mode = param.Selector(default="juice", objects=["juice", "single"], label="Intervention",
                          doc="juice: the dual run (run 1 records the heads' outputs, run 2 adds "
                              "them); single: each head scaled in place by 1 + α_l or 1 − α_s.")

    highlighted = param.List(default=[], item_type=str, precedence=-1,
                             doc="Components to outline (the workspace selection): its heads are "
                                 "outlined dashed on the heatmap and ringed on the scatter.")
    scores = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True, precedence=-1)
    bar_rows = param.List(default=None, allow_None=True, precedence=-1)
    edits = param.List(default=[], item_type=Edit, precedence=-1,
                       doc="Workspace edits (intervention records): with any, a second bar chart "
                           "shows the answer probabilities on the model with them applied.")
    edited_rows = param.List(default=None, allow_None=True, precedence=-1,
                             doc="The answer bars' rows on the edited model; None without edits.")
    accuracy = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True, precedence=-1)

    notify_title = None
    failed_status = "error"
    link_params = ("example", "kind", "direction", "heads_plus", "heads_minus", "alpha_l",
                   "alpha_s", "mode")

    def __init__(self, model: Any, *, facts: Any = None, closed_book: bool = True,
                 background: bool | None = None, n_new: int = 5, **params: Any):
        self._model = model
        self._shipped = facts is None
        facts = C.load_facts() if facts is None else list(facts)
        self._facts = {_label(f): f for f in facts}
        self._split_facts = list(facts)     # the split scored: the shipped (or given) facts only
        names = [head_name(layer, h) for layer in range(model.n_layers)
                 for h in range(model.spec.n_heads)]
        self.param.example.objects = list(self._facts)
        self.param.heads_plus.objects = names
        self.param.heads_minus.objects = names
        params.setdefault("example", next(iter(self._facts)))
        super().__init__(background=background, **params)
        self._closed_book = closed_book
        self._n_new = n_new
        self._run1: tuple[Any, Any] = (None, None)   # (key, JuiceFirstRun)
        self._run1_edited: tuple[Any, Any] = (None, None)   # the same on the edited model
        self.runner("example", self._got_example)
        self.runner("bars", self._got_bars)
        self.runner("split", self._got_split, progress=True)
        self.runner("select", self._got_selection, progress=True)
        self._progress = pn.indicators.Progress(label="progress", value=self.param.progress, max=100,
                                                sizing_mode="stretch_width",
                                                visible=self.param.progress_active)
        self.param.watch(lambda *_: self._request("example"), ["example", "kind"])
        self.param.watch(lambda *_: self._request("bars"),
                         ["heads_plus", "heads_minus", "alpha_l", "alpha_s", "mode", "edits"])
        self._own = OwnItems(
            "Your own example", user_items.CONFLICT_FORMAT,
            "One 'field: value' per line: prompt (the question the model completes), context "
            "(a sentence stating a false answer), memory (the true answer), context answer (the "
            "false one); optional subject, passage, question. Use adds it to the examples.",
            self.use_own)
        self._request("example")

    def use_own(self, text: str) -> C.Fact | None:
        """Parse the user's example, add it to the examples and show it (the same job as a
        shipped one); bad text shows the parser's message and keeps the current result."""
        try:
            fact = user_items.parse_conflict_example(text)
        except InputError as e:
            self.show_error(e)
            return None
        label = _label(fact) if fact.relation == "yours" else "yours: " + _label(fact)
        self._facts[label] = fact
        self.param.example.objects = list(self._facts)
        self.error = ""
        if self.example == label:
            self._request("example")
        else:
            self.example = label
        return fact

    def scope(self) -> Scope:
        """Its own fact set (the example's prompt of the chosen type), not your prompt; the
        edits apply to the answer bars."""
        fact = self._fact()
        return Scope(on=f"its own fact set: the {self.kind} prompt of {fact.subject} "
                        f"({fact.relation}), not your prompt",
                     edits="applied to the answer bars (a second chart); the head scores are "
                           "those of the unedited model")

    # -- jobs -----------------------------------------------------------------------------
    def _fact(self) -> C.Fact:
        return self._facts[self.example]

    def _request(self, name: str) -> None:
        model, fact, kind = self._model, self._fact(), self.kind
        if name == "example":
            def job(token: CancelToken):
                scores = C.head_context_memory_scores(model, [fact], kinds=[kind], ablation=False)
                token.check()
                return (fact, kind), scores, C.juice_first_run(model, [C.conflict_prompt(fact, kind)])
        elif name == "bars":
            key, run1 = self._run1
            if key != (fact, kind):
                return  # the example job requests the bars once run 1 is there
            plus, minus = [parse_head(n) for n in self.heads_plus], [parse_head(n) for n in self.heads_minus]
            run = C.juice_logits if self.mode == "juice" else C.single_run_logits
            a_l, a_s = self.alpha_l, self.alpha_s
            edits = tuple(self.edits)

            def bars(first: C.JuiceFirstRun) -> list[tuple[str, str, float]]:
                before = C.answer_probabilities(model, first.logits, [fact])[0]
                after = C.answer_probabilities(
                    model, run(model, None, plus, minus, alpha_l=a_l, alpha_s=a_s, run1=first),
                    [fact])[0]
                return answer_bars_data(before, after)

            def job(token: CancelToken):
                rows = bars(run1)
                if not edits:
                    return rows, None
                token.check()
                ekey, first = self._run1_edited
                if ekey != (fact, kind, edits):     # run 1 of the edited model, once per edits
                    first = C.juice_first_run(model, [C.conflict_prompt(fact, kind)],
                                              edits=edits)
                    self._run1_edited = ((fact, kind, edits), first)
                token.check()
                return rows, bars(first)
        elif name == "select":
            direction = self.direction
            started = time.perf_counter()
            report = self.progress_fn(token=None)

            def job(token: CancelToken):
                def progress(done: int, total: int) -> None:
                    token.check()
                    report(done, total)
                    left = (time.perf_counter() - started) * (total - done) / max(1, done)
                    self.post(status=f"scoring heads by intervention: {done}/{total} "
                                     f"(about {left:.0f} s left)")
                return C.juice_head_selection(model, [fact], direction=direction, k=3,
                                              prune=True, progress=progress)
            self.param.update(progress=0, progress_active=True)
        else:
            facts = list(self._split_facts)
            plus, minus = [parse_head(n) for n in self.heads_plus], [parse_head(n) for n in self.heads_minus]
            a_l, a_s, n_new = self.alpha_l, self.alpha_s, self._n_new

            def job(token: CancelToken):
                bar = self.progress_fn(token)

                def timed(phase: str) -> Callable[[int, int], None]:
                    """Progress of one phase, with the time left from its rate so far."""
                    started = time.perf_counter()

                    def progress(done: int, total: int) -> None:
                        bar(done, total)
                        left = (time.perf_counter() - started) * (total - done) / max(1, done)
                        self.post(status=f"{phase}: {done}/{total} facts, "
                                         f"{split_time_left(left) if done else 'timing…'}")
                    return progress

                split = facts
                if self._closed_book:
                    self.post(status="keeping the facts the model knows closed book…")
                    split = C.closed_book_facts(model, facts,
                                                progress=timed("keeping the facts known closed book"))
                    if not split:
                        raise InputError("the model answers none of the facts closed book; "
                                           "nothing to score.")
                self.post(status=f"scoring {len(split)} facts…")
                return C.conflict_accuracy(model, split, plus, minus, alpha_l=a_l, alpha_s=a_s,
                                           n_new=n_new, progress=timed("scoring"))
            self.param.update(progress=0, progress_active=True)
        self.status = f"computing {name}…"
        self.submit(name, job)

    def _got_example(self, result: tuple) -> None:
        key, scores, run1 = result
        self._run1 = (key, run1)
        self.scores = scores
        self._request("bars")

    def _got_bars(self, out: tuple[list, list | None]) -> None:
        rows, edited = out
        self.param.update(bar_rows=rows, edited_rows=edited)
        if self.status.startswith("computing"):
            self.status = "ready"

    def _got_selection(self, ds: xr.Dataset) -> None:
        plus, minus = C.selected_heads(ds)
        self.param.update(heads_plus=[head_name(*h) for h in plus],
                          heads_minus=[head_name(*h) for h in minus],
                          status=f"JuICE selection: S+ {len(plus)}, S- {len(minus)} heads "
                                 "(consistent over the three prompt types)")

    def _got_split(self, ds: xr.Dataset) -> None:
        self.accuracy = ds
        self.status = f"split scored ({ds.sizes['fact']} facts)"

    # -- head picks ---------------------------------------------------------------------------
    def add_to_juice(self, component: str, which: str) -> bool:
        """Add the head ``component`` (``"L17.H3"``; other spellings `explorer.components`
        reads are accepted) to the JuICE enhance (S+, ``which="enhance"``) or suppress (S-,
        ``"suppress"``) set; the plots and bars redraw. A head in the other set moves.
        Anything that is not a head of this model, or a bad ``which``, gives a notification
        and changes nothing. Returns whether the head is now in the set."""
        spec = self._model.spec
        try:
            check_choice("which", which, list(JUICE_SETS))
            c = components.check_in_model(component, self._model.n_layers, spec.n_heads)
            if not c.is_head:
                raise InputError(f"{c} is not an attention head: the JuICE sets hold heads "
                                 "(e.g. L3.H1).")
        except (InputError, components.ComponentError, TypeError) as exc:
            theme.notify("error", f"Knowledge conflicts: {user_message(exc)}")
            return False
        name = str(c)
        into, other = JUICE_SETS[which], JUICE_SETS["suppress" if which == "enhance" else "enhance"]
        sets = {into: list(getattr(self, into)), other: list(getattr(self, other))}
        moved = name in sets[other]
        if name not in sets[into]:
            sets[into].append(name)
        sets[other] = [n for n in sets[other] if n != name]
        self.param.update(**sets)
        label = "S+ (enhance)" if which == "enhance" else "S- (suppress)"
        theme.notify("info", f"Knowledge conflicts: {name} {'moved to' if moved else 'in'} "
                             f"{label}.", duration=3000)
        return True

    def toggle_head(self, layer: int, head: int) -> None:
        """Add the head to the set the toggle names, or remove it if already chosen."""
        name = head_name(layer, head)
        plus, minus = list(self.heads_plus), list(self.heads_minus)
        if name in plus or name in minus:
            plus = [n for n in plus if n != name]
            minus = [n for n in minus if n != name]
        elif self.pick_set.startswith("S+"):
            plus.append(name)
        else:
            minus.append(name)
        self.param.update(heads_plus=plus, heads_minus=minus)

    def pick_top_heads(self, k: int = 3) -> None:
        """Fill S+ with the k heads whose direct effect pushes hardest toward the direction's
        answer on this example, and S- with the k pushing hardest against it."""
        if self.scores is None:
            return
        d = self.scores.direct_diff.mean(("kind", "fact")).values     # [layer, head]
        if self.direction == "context":
            d = -d
        order = np.argsort(d, axis=None)
        H = d.shape[1]
        plus = [head_name(*divmod(int(i), H)) for i in order[::-1][:k] if d.flat[i] > 0]
        minus = [head_name(*divmod(int(i), H)) for i in order[:k] if d.flat[i] < 0]
        self.param.update(heads_plus=plus, heads_minus=minus)

    def _scatter_tapped(self, index: list[int]) -> None:
        if index and self.scores is not None:
            H = self.scores.sizes["head"]
            self.toggle_head(*divmod(int(index[0]), H))

    def _heatmap_tapped(self, x: Any = None, y: Any = None) -> None:
        cell = head_cell(x, y, self.scores)
        if cell is not None:
            self.toggle_head(*cell)

    # -- layout ---------------------------------------------------------------------------------
    def _state_html(self, *_: Any) -> str:
        """Hidden markers of what the page shows (read by the browser test)."""
        after = ("none" if self.bar_rows is None
                 else ",".join(f"{r[2]:.6f}" for r in self.bar_rows if r[1] == "after"))
        acc = "none" if self.accuracy is None else str(self.accuracy.sizes["fact"])
        edited = ("none" if self.edited_rows is None
                  else ",".join(f"{r[2]:.6f}" for r in self.edited_rows))
        return (f"<div class='cf-state' data-cf-scores='{'none' if self.scores is None else 'ready'}' "
                f"data-cf-plus='{','.join(self.heads_plus)}' "
                f"data-cf-minus='{','.join(self.heads_minus)}' data-cf-after='{after}' "
                f"data-cf-accuracy='{acc}' data-cf-edited='{edited}' "
                f"data-cf-busy='{int(self.busy)}'></div>")

    def _edited_bars(self, rows: list | None) -> pn.viewable.Viewable:
        """The bars on the edited model and their caption; nothing without workspace edits."""
        if rows is None:
            return pn.Column(height=0, margin=0)
        from explorer.workspace import edit_label

        labels = [edit_label(e) for e in self.edits]
        caption = dict(sizing_mode="stretch_width", styles={"font-size": "0.9em", "color": "#444"})
        return pn.Column(
            pn.pane.Markdown(f"**{html.escape(edited_title(labels))}**", margin=(10, 10, 0, 10),
                             sizing_mode="stretch_width", css_classes=["cf-edited-title"]),
            pn.pane.HoloViews(plot_answer_bars(rows, title="P(answer), edited"),
                              linked_axes=False, sizing_mode="stretch_width",
                              css_classes=["cf-bars-edited"]),
            pn.pane.Markdown(edited_bars_caption(rows, self.bar_rows, labels, self._fact()),
                             **caption),
            sizing_mode="stretch_width", margin=0)

    def _selection_note(self, highlighted: list[str], scores: xr.Dataset | None) -> str:
        """Which of the workspace's selected heads the plots outline (dashed)."""
        spec = self._model.spec
        cells = selected_heads_in(highlighted, self._model.n_layers, spec.n_heads)
        if not cells:
            return ""
        names = ", ".join(head_name(l, h) for l, h in cells)
        return (f"Your selected heads, outlined dashed on the heatmap and ringed dashed on the "
                f"scatter: {names}. *Clicks add heads to* puts a clicked head in S+ or S-.")

    # -- reproducibility ------------------------------------------------------------------------
    def export_tables(self) -> dict[str, pd.DataFrame]:
        """The base tables plus the answer bars (clean and, with edits, edited) and the
        split's accuracy table as the page shows them."""
        out = super().export_tables()
        columns = ["answer", "run", "probability"]
        if self.bar_rows is not None:
            out["answer_bars"] = pd.DataFrame(self.bar_rows, columns=columns)
        if self.edited_rows is not None:
            out["answer_bars_edited"] = pd.DataFrame(self.edited_rows, columns=columns)
        if self.accuracy is not None:
            out["accuracy_table"] = accuracy_table(self.accuracy)
        return out

    def code_snippet(self) -> str:
        """The page's calls as Python: head scores, the answer bars (clean and, with workspace
        edits, edited) and, once scored, the split's accuracy."""
        fact = self._fact()
        run = "juice_logits" if self.mode == "juice" else "single_run_logits"
        plus = [parse_head(n) for n in self.heads_plus]
        minus = [parse_head(n) for n in self.heads_minus]
        heads = f"{plus!r}, {minus!r}, alpha_l={self.alpha_l!r}, alpha_s={self.alpha_s!r}"
        lines = [
            "import explorer", "from explorer.analyses import conflicts as C", "",
            f"model = explorer.load_model({self._model.spec.name!r})",
            f"fact = C.Fact(**{fact.to_dict()!r})",
            f"kind = {self.kind!r}",
            "prompt = C.conflict_prompt(fact, kind)",
            "scores = C.head_context_memory_scores(model, [fact], kinds=[kind], ablation=False)",
            "heatmap = scores.direct_diff.mean(('kind', 'fact'))  # [layer, head]",
            "run1 = C.juice_first_run(model, [prompt])",
            "before = C.answer_probabilities(model, run1.logits, [fact])[0]  # P(memory), P(context)",
            f"after = C.answer_probabilities(model, C.{run}(model, None, {heads}, run1=run1), "
            "[fact])[0]"]
        if self.edits:
            lines += [
                f"edits = explorer.edits_from_json({explorer.edits_to_json(self.edits)!r})",
                "run1_edited = C.juice_first_run(model, [prompt], edits=edits)",
                "edited_before = C.answer_probabilities(model, run1_edited.logits, [fact])[0]",
                f"edited_after = C.answer_probabilities(model, C.{run}(model, None, {heads}, "
                "run1=run1_edited), [fact])[0]"]
        if self.accuracy is not None:
            if self._shipped:
                lines.append("facts = C.load_facts()")
            else:
                lines.append("facts = [C.Fact(**d) for d in "
                             f"{[f.to_dict() for f in self._split_facts]!r}]")
            if self._closed_book:
                lines.append(f"facts = C.closed_book_facts(model, facts, n_new={self._n_new})")
            lines.append(f"accuracy = C.conflict_accuracy(model, facts, {heads}, "
                         f"n_new={self._n_new})")
        return "\n".join(lines) + "\n"

    def __panel__(self) -> pn.viewable.Viewable:
        def heatmap(scores, plus, minus, highlighted):
            plot = on_head_click(plot_head_heatmap(scores, plus, minus), self._heatmap_tapped)
            outlines = plot_selected_heads(scores, highlighted)
            return plot if outlines is None else plot * outlines

        def scatter(scores, plus, minus, highlighted):
            plot = plot_head_scatter(scores, plus, minus, highlighted)
            if scores is not None:
                hv.streams.Selection1D(source=plot.get(0)).add_subscriber(self._scatter_tapped)
            return plot

        p = self.param
        pick = pn.widgets.Button(
            label="Pick top heads for the direction",
            description="Fill S+ with the 3 heads whose direct effect (the heatmap) pushes "
                        "hardest toward the answer to strengthen, S- with the 3 pushing against.")
        pick.on_click(lambda *_: self.pick_top_heads())
        select = pn.widgets.Button(
            label="Select heads as JuICE does",
            description="Score every head by adding its output (α = the paper's grid) on the "
                        "three prompt types of this example, keep those that help on all three "
                        "(the paper's selection; about a minute for SmolLM2 on a CPU, time left shown).")
        select.on_click(lambda *_: self._request("select"))
        score = pn.widgets.Button(
            label="Score the whole split", color="primary",
            description="Greedy answers on every fact (the ones known closed book) for no "
                        "intervention, the single run and JuICE with the heads and α above.")
        score.on_click(lambda *_: self._request("split"))
        table = pn.bind(lambda acc: pn.pane.DataFrame(
            accuracy_table(acc), index=False, float_format="{:.2f}".format,
            sizing_mode="stretch_width") if acc is not None else pn.pane.Markdown(
            "Press *Score the whole split* for accuracy toward the memory and the context "
            "answer (baseline / single run / JuICE)."), p.accuracy)

        def group(name: str) -> pn.Column:
            return labelled(pn.widgets.RadioButtonGroup.from_param(
                p[name], color="primary", variant="outline",
                sizing_mode="stretch_width"), p[name].label, p[name].doc)

        caption = dict(sizing_mode="stretch_width", styles={"font-size": "0.9em", "color": "#444"})
        controls = pn.Column(
            tip(pn.widgets.Select.from_param(p.example), p.example.doc),
            self._own.layout(p.error), group("kind"),
            group("direction"), group("pick_set"),
            tip(pn.widgets.MultiChoice.from_param(p.heads_plus), p.heads_plus.doc),
            tip(pn.widgets.MultiChoice.from_param(p.heads_minus), p.heads_minus.doc), pick, select,
            tip(pn.widgets.FloatSlider.from_param(p.alpha_l), p.alpha_l.doc),
            tip(pn.widgets.FloatSlider.from_param(p.alpha_s), p.alpha_s.doc),
            group("mode"),
            pn.pane.HoloViews(pn.bind(lambda rows, edited: plot_answer_bars(
                rows, title="P(answer), clean" if edited is not None else "P(answer)"),
                p.bar_rows, p.edited_rows), linked_axes=False, sizing_mode="stretch_width",
                css_classes=["cf-bars"]),
            pn.pane.Markdown(pn.bind(lambda rows, ex, mode, plus, minus: bars_caption(
                rows, self._facts[ex], mode, n_heads=len(plus) + len(minus)),
                p.bar_rows, p.example, p.mode, p.heads_plus, p.heads_minus), **caption),
            pn.bind(self._edited_bars, p.edited_rows),
            pn.pane.Markdown(ALPHA_NOTE, **caption),
            score, self._progress, pn.pane.Markdown(p.status),
            pn.pane.HTML(pn.bind(self._state_html, p.scores, p.heads_plus, p.heads_minus,
                                 p.bar_rows, p.accuracy, p.busy, p.edited_rows)),
            width=theme.SIZES["controls_width"])
        main = pn.Column(
            pn.pane.Markdown(pn.bind(lambda ex, kind: prompts_note(self._facts[ex], kind),
                                     p.example, p.kind), sizing_mode="stretch_width",
                             css_classes=["cf-prompts"], styles={"font-size": "0.9em"}),
            pn.pane.Markdown(pn.bind(self._selection_note, p.highlighted, p.scores),
                             sizing_mode="stretch_width", css_classes=["cf-selection"],
                             styles={"font-size": "0.9em", "color": "#444"}),
            pn.pane.HoloViews(pn.bind(heatmap, p.scores, p.heads_plus, p.heads_minus,
                                      p.highlighted),
                              linked_axes=False, sizing_mode="stretch_width",
                              css_classes=["cf-heatmap"]),
            pn.pane.Markdown(HEATMAP_CAPTION, **caption),
            pn.pane.HoloViews(pn.bind(scatter, p.scores, p.heads_plus, p.heads_minus,
                                      p.highlighted),
                              linked_axes=False, sizing_mode="stretch_width"),
            pn.pane.Markdown(SCATTER_CAPTION, **caption),
            pn.pane.Markdown("### Accuracy over the split"), table,
            sizing_mode="stretch_width")
        return pn.Row(controls, main, sizing_mode="stretch_width")


serve(__name__, ConflictsView, title="Knowledge conflicts (JuICE)", intro="conflicts")
