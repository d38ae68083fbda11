"""Knowledge conflicts page: which heads push the memory vs the context answer, and JuICE.

Li, Chen & Tong, "Taming Knowledge Conflicts in Language Models" (JuICE, ICML 2025).
For one fact and prompt type the page shows each head's direct contribution to the memory
minus context answer logit (layer x head heatmap) and the heads' memory vs context scores
(scatter). Clicking a head in either plot adds it to the enhance (S+) or suppress (S-) set
(the "clicks add to" toggle) or removes it; the sliders set alpha_l (enhance) and alpha_s
(suppress) of the dual run (or the single-run baseline) and the bars show P(memory
answer) and P(context answer) before and after. Run 1 of the dual run is computed once
per example. The sliders are live (`apps._conflicts_preview`): while one moves, the bars
show a preview (run 2 re-run in plain torch from the lowest chosen layer on run 1, float32,
one torch thread; the newest move waits, older ones are dropped), drawn in place; on release
the exact bars follow (run 2 through the traced model, resumed at the first chosen layer,
at one torch thread). A button
scores the whole split (the facts the model knows closed book) for baseline, single run
and JuICE, with a progress bar and a results table. *Select heads as JuICE does* says on its
label how long it takes, from a run timed on this machine (`apps._conflicts_estimate`). The
bars sit at the top of the main column, the controls left.

With workspace edits (`ConflictsView.edits`: the session's edit stack, e.g. an ablated head)
a second bar chart under the first shows the same P(memory) / P(context), with and without
the JuICE intervention, on the edited model (both runs of the dual run carry the edits),
titled "edited: ..."; the first is then titled "clean". `ConflictsView.add_to_juice` adds a
head named in the component spelling (``L17.H3``) to the enhance or suppress set (the
gallery's component menu calls it).

The bars' captions, the edited bars' heading and the page's scope line are written from the
bars' record (`apps._conflicts_record`: the fact's prompt, heads, alphas, intervention and
edits they were computed with, and whether they are a preview); the page runs on its own
facts, not the sidebar's prompt, so that prompt is no part of the record.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import holoviews as hv
import pandas as pd
import panel as pn
import param
import xarray as xr

from apps import theme
from apps._paper import paper_panel
from apps._conflicts_bars import BarsPart
from apps._conflicts_estimate import EstimatePart
from apps._conflicts_heads import HeadsPart, JUICE_SETS
from apps._conflicts_own import OwnExamplesPart
from apps._conflicts_preview import PreviewPart
from apps._conflicts_record import RecordPart
from apps._conflicts_plots import (ALPHA_NOTE, HEATMAP_CAPTION, NO_HEADS_NOTE, SCATTER_CAPTION,
                                   _label, accuracy_table, answer_bars_data, bars_caption,
                                   edited_bars_caption, edited_title, head_name, parse_head,
                                   plot_answer_bars, plot_head_heatmap, plot_head_scatter,
                                   plot_selected_heads, prompts_note, selected_heads_in,
                                   split_time_left)
from apps._controls import OwnItems, labelled, tip
from apps._heads_heatmap import on_head_click
from apps._recipe import EDITS, MODEL, Call, Expr, Let, Recipe, Ref, Step
from apps._provenance import computed_at_now, one_line
from apps._result_cache import DiskResults
from apps._session import CancelToken
from apps._view import STATIC_TOOLS, Scope, View, serve, workspace_edits, workspace_selection
from explorer._checks import InputError
from explorer.analyses import conflicts as C
from explorer.analyses import user_items
from explorer.lens_preview import preview_threads

__all__ = ["ConflictsView", "plot_head_heatmap", "plot_head_scatter", "plot_answer_bars",
           "answer_bars_data", "bars_caption", "edited_bars_caption", "edited_title",
           "accuracy_table", "head_name", "parse_head", "HEATMAP_CAPTION", "SCATTER_CAPTION",
           "ALPHA_NOTE", "JUICE_SETS", "NO_HEADS_NOTE", "split_time_left", "selected_heads_in",
           "prompts_note", "plot_selected_heads"]

hv.extension("bokeh", logo=False)

_TOOLS = STATIC_TOOLS


class ConflictsView(HeadsPart, RecordPart, BarsPart, EstimatePart, PreviewPart, OwnExamplesPart,
                    DiskResults, View):
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
    estimate_time : bool, optional
        Time the head selection's unit after the first bars and show the selection's time
        on its button (`apps._conflicts_estimate`; default: when computing in the background).
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
    select_k = param.Integer(default=3, bounds=(1, 20), label="JuICE selection: heads per set (K)",
                             doc="Heads kept in S+ and in S- by *Select heads as JuICE does* "
                                 "(the paper: 5).")
    select_facts = param.Integer(
        default=1, bounds=(1, 8), label="JuICE selection: facts",
        doc="Facts the selection averages over: this example and the next ones in the list (the "
            "paper: 4; each fact costs about as much as the first).")
    mode = param.Selector(default="juice", objects=["juice", "single"], label="Intervention",
                          doc="juice: the dual run (run 1 records the heads' outputs, run 2 adds "
                              "them); single: each head scaled in place by 1 + α_l or 1 − α_s.")

    highlighted = workspace_selection(doc="Components to outline (the workspace selection): its "
                                          "heads are outlined dashed on the heatmap and ringed on"
                                          " the scatter.")
    scores = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True, precedence=-1)
    bar_rows = param.List(default=None, allow_None=True, precedence=-1)
    edits = workspace_edits(doc="Workspace edits (intervention records): with any, a second bar "
                                "chart shows the answer probabilities on the model with them "
                                "applied.")
    edited_rows = param.List(default=None, allow_None=True, precedence=-1,
                             doc="The answer bars' rows on the edited model; None without edits.")
    accuracy = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True, precedence=-1)

    notify_title = None
    failed_status = "error"
    link_params = ("own_examples", "example", "kind", "direction", "heads_plus", "heads_minus", "alpha_l",
                   "alpha_s", "mode")

    def __init__(self, model: Any, *, facts: Any = None, closed_book: bool = True,
                 background: bool | None = None, n_new: int = 5,
                 estimate_time: bool | None = None, **params: Any):
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
        self._init_preview()
        self._init_bars()
        self._init_estimate(self._background if estimate_time is None else estimate_time)
        self._progress = self.progress_bar(label="progress")
        self.param.watch(lambda *_: self._request("example"), ["example", "kind"])
        self.param.watch(lambda *_: self._request("bars"),
                         ["heads_plus", "heads_minus", "alpha_l", "alpha_s", "mode", "edits"])
        self._own = OwnItems(
            "Your own example", user_items.CONFLICT_FORMAT,
            "One 'field: value' per line: prompt (the question the model completes), context "
            "(a sentence stating a false answer), memory (the true answer), context answer (the "
            "false one); optional subject, passage, question. Use adds it to the examples.",
            self.use_own)
        self._own.follow(self, "own_examples", self._own_examples_set)
        self._request("example")

    def scope(self) -> Scope:
        """Its own fact set (the shown bars' prompt, from their record; before any bars, the
        example's), not your prompt; the edits apply to the answer bars."""
        shown, fact, kind = self.shown, self._fact(), self.kind
        if shown is not None:
            kind = dict(shown.request)["prompt_type"]
            fact = next((f for f in self._facts.values()
                         if C.conflict_prompt(f, kind) == shown.prompts[0]), None)
        of = (f"{fact.subject} ({fact.relation})" if fact is not None
              else f"“{one_line(shown.prompts[0])}”")
        return Scope(on=f"its own fact set: the {kind} prompt of {of}, not your prompt",
                     edits="applied to the answer bars (a second chart); the head scores are "
                           "those of the unedited model")

    # -- jobs -----------------------------------------------------------------------------
    def _fact(self) -> C.Fact:
        return self._facts[self.example]

    def _request(self, name: str) -> None:
        """Start the page's job ``name``: example, bars, select (`HeadsPart._select_job`) or
        split."""
        model, fact, kind = self._model, self._fact(), self.kind
        if name in ("example", "bars"):
            self._exact_requested()        # the previews asked for before are stale
        if name == "select":
            self._yield_timing()
            job = self._select_job()
        elif name == "example":
            parts, hit = self.stored_scores(fact, kind)
            if hit is not None:       # run 1 is made by the bars job, when they need it
                self.cancel("example")
                return self._got_example(((fact, kind), hit.datasets["scores"], None))

            def job(token: CancelToken):
                scores = C.head_context_memory_scores(model, [fact], kinds=[kind], ablation=False)
                self.store_result(parts, {"scores": scores}, computed_at=computed_at_now())
                token.check()
                return (fact, kind), scores, C.juice_first_run(model, [C.conflict_prompt(fact, kind)])
        elif name == "bars":
            key, run1 = self._run1
            if key != (fact, kind):
                return  # the example job requests the bars once run 1 is there
            wanted = self.request_provenance()
            parts, hit = self.stored_bars(fact, wanted)
            if hit is not None:
                self.cancel("bars")
                return self.show_stored_bars(wanted, hit)
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
                with preview_threads():    # one torch thread, taking turns with the previews
                    return exact(token)

            def exact(token: CancelToken):
                first = run1
                if first is None:
                    first = C.juice_first_run(model, [C.conflict_prompt(fact, kind)])
                    if self._run1[0] == (fact, kind):   # not another example's meanwhile
                        self._run1 = ((fact, kind), first)
                rows = bars(first)
                if not edits:
                    return self.store_bars(parts, wanted, rows, None), rows, None
                token.check()
                ekey, first = self._run1_edited
                if ekey != (fact, kind, edits):     # run 1 of the edited model, once per edits
                    first = C.juice_first_run(model, [C.conflict_prompt(fact, kind)],
                                              edits=edits)
                    self._run1_edited = ((fact, kind, edits), first)
                token.check()
                edited = bars(first)
                return self.store_bars(parts, wanted, rows, edited), rows, edited
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

    def _got_bars(self, out: tuple[Any, list, list | None]) -> None:
        wanted, rows, edited = out
        self.param.update(bar_rows=rows, edited_rows=edited, shown=wanted,
                          result_note="")
        if self.status.startswith("computing"):
            self.status = "ready"
        self._warm_preview()
        self._request_timing()

    def _got_split(self, ds: xr.Dataset) -> None:
        self.accuracy = ds
        self.status = f"split scored ({ds.sizes['fact']} facts)"

    # -- layout ---------------------------------------------------------------------------------
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

    def code_recipe(self) -> Recipe:
        """The page's calls as records: head scores, the answer bars (clean and, with workspace
        edits, edited) and, once scored, the split's accuracy."""
        c = "explorer.analyses.conflicts"
        run = f"{c}.{'juice_logits' if self.mode == 'juice' else 'single_run_logits'}"
        heads = ([parse_head(n) for n in self.heads_plus],
                 [parse_head(n) for n in self.heads_minus])
        alphas = {"alpha_l": self.alpha_l, "alpha_s": self.alpha_s}
        steps: list[Step] = [
            Call("fact", f"{c}.Fact", kwargs=self._fact().to_dict()),
            Let("kind", self.kind),
            Call("prompt", f"{c}.conflict_prompt", (Ref("fact"), Ref("kind"))),
            Call("scores", f"{c}.head_context_memory_scores", (MODEL, [Ref("fact")]),
                 {"kinds": [Ref("kind")], "ablation": False}),
            Expr("heatmap", "scores.direct_diff.mean(('kind', 'fact'))", "[layer, head]")]
        runs = [("run1", "steered", "before", "after", {})]
        if self.edits:
            runs.append(("run1_edited", "steered_edited", "edited_before", "edited_after",
                         {"edits": EDITS}))
        for run1, steered, before, after, edits in runs:
            steps += [
                Call(run1, f"{c}.juice_first_run", (MODEL, [Ref("prompt")]), edits),
                Expr(before, f"C.answer_probabilities(model, {run1}.logits, [fact])[0]",
                     "P(memory), P(context)"),
                Call(steered, run, (MODEL, None, *heads), {**alphas, "run1": Ref(run1)}),
                Expr(after, f"C.answer_probabilities(model, {steered}, [fact])[0]")]
        if self.accuracy is not None:
            if self._shipped:
                steps.append(Call("facts", f"{c}.load_facts"))
            else:
                steps.append(Let("facts", [Call(None, f"{c}.Fact", kwargs=f.to_dict())
                                           for f in self._split_facts]))
            if self._closed_book:
                steps.append(Call("facts", f"{c}.closed_book_facts", (MODEL, Ref("facts")),
                                  {"n_new": self._n_new}))
            steps.append(Call("accuracy", f"{c}.conflict_accuracy", (MODEL, Ref("facts"), *heads),
                              {**alphas, "n_new": self._n_new}))
        return Recipe(model=self._model.spec.name, edits=list(self.edits), steps=steps,
                      aliases={c: "C"})

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
        select, estimate = self.select_widgets()
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
        stale_inputs = [p[n] for n in ("shown", "example", "kind", "mode", "heads_plus",
                                       "heads_minus", "alpha_l", "alpha_s", "edits")]
        controls = pn.Column(
            tip(pn.widgets.Select.from_param(p.example), p.example.doc),
            self._own.layout(p.error), group("kind"),
            group("direction"), group("pick_set"),
            tip(pn.widgets.MultiChoice.from_param(p.heads_plus), p.heads_plus.doc),
            tip(pn.widgets.MultiChoice.from_param(p.heads_minus), p.heads_minus.doc), pick,
            tip(pn.widgets.IntInput.from_param(p.select_k), p.select_k.doc),
            tip(pn.widgets.IntInput.from_param(p.select_facts), p.select_facts.doc), select,
            estimate,
            tip(self.alpha_slider("alpha_l"), p.alpha_l.doc),
            tip(self.alpha_slider("alpha_s"), p.alpha_s.doc),
            group("mode"),
            pn.pane.Markdown(ALPHA_NOTE, **caption),
            score, self._progress, pn.pane.Markdown(p.status),
            pn.pane.HTML(pn.bind(self._state_html, p.scores, p.heads_plus, p.heads_minus,
                                 p.bar_rows, p.accuracy, p.busy, p.edited_rows, p.shown)),
            width=theme.SIZES["controls_width"])
        main = pn.Column(
            paper_panel("conflicts", self),
            pn.pane.Markdown(pn.bind(lambda ex, kind: prompts_note(self._facts[ex], kind),
                                     p.example, p.kind), sizing_mode="stretch_width",
                             css_classes=["cf-prompts"], styles={"font-size": "0.9em"}),
            # the answer bars at the top of the main column, beside the sliders that move
            # them (wide enough to read; not wider than a glance takes in)
            pn.Column(
                self._bars_pane(),
                pn.pane.Markdown(pn.bind(self.stale_markdown, *stale_inputs),
                                 visible=pn.bind(lambda *_: bool(self.stale_note()),
                                                 *stale_inputs),
                                 css_classes=["cf-stale"], styles={"color": "#a33"},
                                 margin=(0, 10)),
                pn.pane.Markdown(p.result_note, visible=pn.bind(bool, p.result_note),
                                 css_classes=["cf-result-note"], **caption),
                pn.pane.Markdown(pn.bind(self.bars_words, p.bar_rows, p.shown), **caption),
                pn.bind(self._edited_bars, p.edited_rows),
                # the right margin: Bokeh places a glyph renderer's (empty) box one y-axis
                # width right of the frame, past the window where the frame reaches its edge
                sizing_mode="stretch_width", max_width=720, margin=(5, 80, 5, 5),
                css_classes=["cf-bars-column"]),
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
