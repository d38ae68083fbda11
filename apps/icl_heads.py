"""ICL heads page: induction vs function-vector heads, ablations, function vectors, task encoding.

Yin & Steinhardt ("Which Attention Heads Matter for In-Context Learning?", ICML 2025):
a scatter of every head's induction score against its FV score (Todd et al. 2024),
coloured by layer, with top-p% thresholds; the selected head's attention on a repeated
random-token sequence and on an ICL prompt; ablation curves (few-shot accuracy vs % of
heads mean-ablated) by FV / induction / random ranking. Function-vector panel (Todd et al.)
and task-encoding panel (Han et al., ICML 2025): 2-D PCA of the last-token residual
coloured by task and task decodability per layer.

The page runs on its own tasks and random sequences, never on the sidebar's prompt: the head
scores' record (`apps._icl_record`, in their attrs) holds the FV tasks, the induction settings
and the edits they were computed with, the words over the scatter come from it, and the stale
note says when those inputs moved on. The attention plots are titled from the patterns' attrs.
"""
from __future__ import annotations

import html
from typing import Any

import holoviews as hv
import panel as pn
import param

import explorer
from apps import theme
from apps._paper import paper_panel
from apps._controls import OwnItems, index_choice
from apps._icl_ablation import AblationPart, ablation_caption, plot_ablation_curves
from apps._icl_record import RecordPart
from apps._icl_patching import (DEFAULT_CONFLICT_TASKS, DEFAULT_PATCHING_TASKS, MEAN_OVER_TASKS,
                                PatchingPart, _short_task, conflict_caption, conflict_matrix,
                                default_conflict_layers, layers_text, parse_layers,
                                patching_caption, plot_conflict_controls, plot_conflict_layers,
                                plot_conflict_matrix, plot_patching, vector_test_layers,
                                vector_test_tasks)
from apps._icl_estimate import estimated_score_seconds
from apps._icl_scores import (OPEN_BUDGET_S, ScoresPart, plot_attention, plot_head_scatter,
                              plot_score_heatmaps, scatter_caption, selected_heads)
from apps._icl_task_vectors import (TaskVectorsPart, fv_caption, plot_finetune_td,
                                    plot_projection, plot_td, td_caption)
from apps._recipe import MODEL, Call, Note, Recipe, Ref, Step
from apps._result_cache import DiskResults
from apps._view import Scope, View, serve, shown_dataset, workspace_edits, workspace_selection
from explorer._checks import InputError
from explorer.analyses import icl_heads as ih
from explorer.analyses import user_items

__all__ = ["ICLHeadsView", "plot_head_scatter", "plot_score_heatmaps", "plot_attention",
           "plot_ablation_curves", "ablation_caption", "plot_td", "plot_projection", "plot_finetune_td",
           "scatter_caption", "td_caption", "fv_caption", "estimated_score_seconds",
           "conflict_matrix", "plot_conflict_matrix", "plot_conflict_controls",
           "plot_conflict_layers", "conflict_caption", "default_conflict_layers",
           "parse_layers", "DEFAULT_CONFLICT_TASKS", "plot_patching", "patching_caption",
           "DEFAULT_PATCHING_TASKS", "selected_heads"]

hv.extension("bokeh", logo=False)

DEFAULT_FV_TASKS = ("antonym", "country-capital", "english-french")
DEFAULT_EVAL_TASKS = ("capitalize", "present-past")
DEFAULT_TD_TASKS = ("antonym", "country-capital", "english-french", "capitalize")
_JOB_TITLES = {"conflict": "the conflict test", "patching": "the patching test"}
"""The status line's words for a job whose runner's name alone would not say what it computes."""
#: The task name of the user's pasted pairs.
OWN_TASK = "your pairs"


class ICLHeadsView(ScoresPart, RecordPart, AblationPart, TaskVectorsPart, PatchingPart,
                   DiskResults, View):
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
        `OPEN_BUDGET_S` seconds at the reference cost (`apps._icl_estimate.reference_cost`:
        the same on every machine, so a page opens the same way under any load), else on
        the *Compute scores* button (the task encoding too). The button says the time at
        the model's costs measured on this machine after the page's first job
        (`measured_forward_cost`).
    """

    top_induction = param.Number(default=5.0, bounds=(1, 50), step=1, label="Top % induction",
                                 doc="Share of heads with the highest induction score, ringed "
                                     "on the scatter.")
    top_fv = param.Number(default=5.0, bounds=(1, 50), step=1, label="Top % FV",
                          doc="Share of heads with the highest FV score, ringed on the scatter.")
    layer = index_choice("Head: layer",
                         doc="Layer of the head whose attention is shown (or click a point).")
    head = index_choice("Head: head",
                        doc="Index of the head whose attention is shown (or click a point).")
    task = param.Selector(default="antonym", objects=ih.icl_task_names(), label="Task",
                          doc="ICL task of the attention prompt and of the function vector.")
    own_pairs = param.String(default="", precedence=-1,
                             doc="The pasted pairs of the task 'your pairs' (the text Use took "
                                 "in); a link carries them, and a page given them takes them in "
                                 "and offers the task (the link's task then picks it)")
    max_percent = param.Number(default=20.0, bounds=(1, 50), step=1,
                               label="Ablate up to % of heads",
                               doc="Largest share of heads mean-ablated on the ablation curves "
                                   "(release the slider to recompute them).")
    exclude_other = param.Boolean(
        default=True, label="Exclude the other score's top heads",
        doc="Ablate the top FV heads that are not top induction heads and vice versa (the "
            "paper's exclusion variant; the excluded set is the other score's top "
            "'Excluded top %').")
    exclude_percent = param.Number(
        default=2.0, bounds=(0.5, 20), step=0.5, label="Excluded top % of the other score",
        doc="Share of heads with the other score's highest values removed from a ranking "
            "before its top p% are ablated (the paper's code: 2 %).")
    induction_sequences = param.Integer(
        default=4, bounds=(1, 1000), label="Induction: sequences",
        doc="Repeated random-token sequences the induction score averages (the paper: 1,000).")
    induction_half_len = param.Integer(
        default=50, bounds=(2, 200), label="Induction: tokens per half",
        doc="Random tokens repeated once in each sequence (the paper: 50).")
    induction_measure = param.Selector(
        default="abs", objects=["abs", "mul"], label="Induction: measure",
        doc="abs: 1 - mean L1 distance to the induction pattern (TransformerLens detect_head, "
            "the paper's); mul: attention mass on the induction target.")
    mean_source = param.Selector(
        default="cross-task", objects=list(ih.MEAN_SOURCES), label="Ablation: mean source",
        doc="What an ablated head's last-token output is replaced with: its mean over the "
            "FV-scoring tasks' prompts (cross-task, the paper's), its mean on the evaluated "
            "task (per-task), or zero.")
    icl_score = param.Selector(
        default="first_token", objects=list(ih.ICL_SCORES), label="Ablation: ICL score",
        doc="first_token: 1 when the argmax next token is the answer's first token (one "
            "forward per prompt); f1: the paper's score, the F1 of the answer parsed from 5 "
            "greedily generated tokens with the heads ablated at every step (5 forwards).")
    fv_layer = index_choice("Function vector: layer",
                            doc="Layer whose residual the function vector is added to.")
    td_layer = index_choice("Task encoding: layer",
                            doc="Layer of the residual PCA and of the dashed line on the "
                                "task-decodability curve.")

    conflict_tasks = vector_test_tasks(
        "Conflict", DEFAULT_CONFLICT_TASKS,
        doc="Tasks of the task-vector conflict test: each one's vector is written into the "
            "others' prompts (at least two; their answers to each other's queries must be "
            "defined, as for rules like uppercase or choose-first-of-3).")
    conflict_layers = vector_test_layers("Conflict", cost="one patched run of every task pair")
    conflict_layer = param.Selector(
        default=None, objects=[], label="Conflict: layer shown",
        doc="Layer of the conflict matrices (dashed on the per-layer curves); the layers "
            "computed are the choices.")

    patching_tasks = vector_test_tasks(
        "Patching", DEFAULT_PATCHING_TASKS,
        doc="Tasks of the zero-shot patching test: each one's vector is written into its own "
            "zero-shot prompts, layer by layer, beside the Null task's vector.")
    patching_layers = vector_test_layers("Patching", cost="two patched runs per task")
    patching_shown = param.Selector(
        default=MEAN_OVER_TASKS, objects=[MEAN_OVER_TASKS], label="Patching: task shown",
        doc="One task's curves (with their intervals) or the mean over the tasks.")
    patching = shown_dataset(doc="The last patching test (`task_vector_patching`).")
    edits = workspace_edits(doc="The workspace's edits: the induction scores, the attention and "
                                "the ablation curves are of the edited model.")
    highlighted = workspace_selection(doc="Components outlined on the scatter and heatmaps (the "
                                          "workspace selection).")
    scores = shown_dataset()
    patterns = param.Dict(default=None, allow_None=True, precedence=-1)
    curves = shown_dataset()
    fv_result = shown_dataset()
    td = shown_dataset()
    conflict = shown_dataset(doc="The last conflict test (`conflicting_task_patching`).")
    conflict_error = param.String(default="", precedence=-1,
                                  doc="Why the last conflict test did not run ('' after a good one).")

    notify_title = None
    failed_status = None
    link_params = ("top_induction", "top_fv", "layer", "head", "own_pairs", "task", "max_percent",
                   "exclude_other", "exclude_percent", "induction_sequences",
                   "induction_half_len", "induction_measure", "mean_source", "fv_layer",
                   "td_layer", "patching_tasks",
                   "patching_layers", "conflict_tasks", "conflict_layers")

    def scope(self) -> Scope:
        """Task prompts, not the sidebar prompt; the edits reach what reruns the model as a
        whole, not the tests that patch or read an unedited run."""
        n, shots = self._opts["n_prompts"], self._opts["n_shots"]
        on = (f"task prompts, not your prompt: FV scores on {', '.join(self._fv_tasks)}; "
              f"ablations on {', '.join(self._eval_tasks)} ({n} prompts x {shots} shots each); "
              f"induction scores on repeated random tokens")
        edits = ("applied to the induction scores, the attention and the ablation curves; not "
                 "applicable to the FV scores, function vector, task encoding and task-vector "
                 "tests: they patch into or read an unedited cached run")
        return Scope(on=on, edits=edits)

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
        self.runner("cost", self._got_cost, busy=False, counted=False)
        self.runner("curves", self._got_curves, progress=True)
        self.runner("fv", self._got_fv)
        self.runner("td", self._got_td)
        self.runner("conflict", self._got_conflict, progress=True)
        self.runner("patching", self._got_patching, progress=True)
        self.conflict_layers = layers_text(default_conflict_layers(spec.n_layers))
        self.patching_layers = layers_text(default_conflict_layers(spec.n_layers))
        self._patching_button = pn.widgets.Button(
            label="Run the patching test", color="primary", sizing_mode="stretch_width",
            description="Write each chosen task's vector (and the Null task's) into its "
                        "zero-shot prompts at each chosen layer; draw the accuracy by layer.")
        self._patching_button.on_click(lambda *_: self.run_patching())
        self._conflict_button = pn.widgets.Button(
            label="Run the conflict test", color="primary", sizing_mode="stretch_width",
            description="Write each chosen task's vector into the other tasks' few-shot "
                        "prompts at each chosen layer; draw whose task the answer follows.")
        self._conflict_button.on_click(lambda *_: self.run_conflict())
        self._progress = self.progress_bar(label="progress")
        self.param.watch(lambda *_: self._request("patterns"), ["layer", "head", "task"])
        self.param.watch(lambda *_: self._request("fv"), ["fv_layer", "task"])
        self.param.watch(lambda *_: self._request("curves"),
                         ["exclude_other", "exclude_percent", "mean_source", "icl_score"])
        self.param.watch(lambda *_: self._induction_changed(),
                         ["induction_sequences", "induction_half_len", "induction_measure"])
        self.param.watch(lambda *_: self._edits_changed(), ["edits"])
        self.runner("induction", self._got_induction)
        self._score_button = pn.widgets.Button(
            color="primary", sizing_mode="stretch_width",
            description="Induction and FV scores of every head (the scatter and heatmaps), "
                        "then the function vector; and the task encoding (PCA, decodability). "
                        "The time is every forward this runs, at the model's costs measured "
                        "on this machine.")
        self._score_button.on_click(lambda *_: self._compute())
        self._own_task: ih.ICLTask | None = None    # `own_pairs` parsed
        self._own = OwnItems(
            "Your own pairs", user_items.ICL_FORMAT,
            f"One 'input -> output' pair per line, at least {self._min_pairs()}. Use makes them "
            f"the task '{OWN_TASK}' of the attention prompt and of the function vector.",
            self.use_own)
        # pairs set from elsewhere (a link) are taken in, the task 'your pairs' offered but
        # not selected (the link's task picks it)
        self._own.follow(self, "own_pairs", self._own.taking(self._parse_own, self._take_own))
        self._score_label()
        self.param.watch(self._score_label, ["induction_sequences", "induction_half_len", "task",
                                             "own_pairs", "scores", "td"])
        if compute_on_open is None:
            compute_on_open = self.estimated_seconds(reference=True) <= OPEN_BUDGET_S
        if compute_on_open:
            self._compute()
        elif not self.show_stored_scores():   # stored scores at once; else the attention
            self._request("patterns")
            self.status = self._press_note

    def _min_pairs(self) -> int:
        """Pairs a pasted task needs: the attention prompt's 3 demonstrations and the FV
        prompts' ``n_shots``, plus the query."""
        return max(4, self._opts["n_shots"] + 1)

    def _task(self) -> ih.ICLTask | str:
        """The selected task: a shipped task's name, or the user's pasted task."""
        return self._own_task if self.task == OWN_TASK and self._own_task is not None else self.task

    def _parse_own(self, text: str) -> ih.ICLTask:
        return user_items.parse_icl_pairs(text, name=OWN_TASK, min_pairs=self._min_pairs())

    def _take_own(self, task: ih.ICLTask, text: str) -> None:
        """Hold ``task`` (read from ``text``) as the task 'your pairs' and offer it; the
        attention and the function vector follow when it is the selected task."""
        self._own_task = task
        self._own.keep(text)
        if OWN_TASK not in self.param.task.objects:
            self.param.task.objects = [*self.param.task.objects, OWN_TASK]
        if self.task == OWN_TASK:
            self._request("patterns")
            self._request("fv")

    def use_own(self, text: str) -> ih.ICLTask | None:
        """Parse the user's pairs and make them the selected task (the same jobs as a shipped
        task); bad text shows the parser's message and keeps the current result."""
        def use(task: ih.ICLTask) -> None:
            self._take_own(task, text)
            if self.task != OWN_TASK:
                self.task = OWN_TASK
        return self.adopt_own(text, self._parse_own, use)

    # -- jobs ---------------------------------------------------------------------------


    def _request(self, name: str) -> None:
        """Start the page's job ``name`` (scores, patterns, curves, fv, td, conflict or
        patching), built by its part (``_<name>_job``; None when there is nothing to compute
        yet). A builder that raises InputError names a bad control: ``_<name>_failed`` (else
        `show_error`) shows it, and the last result stays."""
        try:
            job = getattr(self, f"_{name}_job")()
        except InputError as exc:
            getattr(self, f"_{name}_failed", self.show_error)(exc)
            return
        if job is None:
            return
        if name != "td":   # task decodability computes quietly beside the rest
            self.status = f"computing {_JOB_TITLES.get(name, name)}…"
        self.submit(name, job)

    def _induction_kwargs(self) -> dict:
        """The induction score's settings on the page (sequences, tokens per half, measure)."""
        return {"n_sequences": int(self.induction_sequences),
                "half_len": int(self.induction_half_len), "measure": self.induction_measure}

    def _induction_changed(self) -> None:
        """New induction settings: rescore induction once the scores exist."""
        self._rescore_induction()

    def _edits_changed(self) -> None:
        """The workspace's edits changed: recompute what they reach (attention, the induction
        score, the ablation curves once computed)."""
        self._request("patterns")
        self._rescore_induction()
        if self.curves is not None:
            self._request("curves")


    def show_error(self, exc: BaseException) -> None:
        super().show_error(exc)
        self._score_button.disabled = False
        self._conflict_button.disabled = False

    def _runner_busy(self, name: str, busy: bool) -> None:
        """The scores job ending without a result (stopped by the gallery's stop button, or
        cancelled) gives the Compute button back and says so."""
        super()._runner_busy(name, busy)
        if name == "scores" and not busy and self._score_button.disabled:
            self._score_button.disabled = False
            self.param.update(running=False, status="Stopped: the head scores were not computed.")


    # -- reproducibility ------------------------------------------------------------------
    def code_recipe(self) -> Recipe:
        """What the page shows as records: the head scores, the selected head's attention, the
        function vector, the task encoding, and the ablation curves and the conflict test once
        computed; a result the page has not computed yet is a comment."""
        ih, tv = "explorer.analyses.icl_heads", "explorer.analyses.task_vectors"
        tvp = "explorer.analyses.task_vector_patching"
        opts = dict(self._opts)                  # prompts per task, demonstrations per prompt
        own = self.task == OWN_TASK and self._own_task is not None
        steps: list[Step] = []
        if own:
            steps.append(Call("task", "explorer.analyses.user_items.parse_icl_pairs",
                              (self.own_pairs,), {"name": OWN_TASK, "min_pairs": self._min_pairs()},
                              "your pairs"))
        task = Ref("task") if own else self.task
        steps.append(Call("patterns", f"{ih}.head_attention", (MODEL, self.layer, self.head),
                          {"task": task}, str(explorer.components.head(self.layer, self.head))))
        if self.scores is None:
            steps.append(Note("Compute scores on the page for the head scores and what follows"))
        else:
            steps += [Call("induction", f"{ih}.induction_scores", (MODEL,),
                           self._induction_kwargs()),
                      Call("fv", f"{ih}.fv_scores", (MODEL, self._fv_tasks), opts),
                      Call("scores", "xarray.merge", ([Ref("induction[['induction_score']]"),
                                                       Ref("fv[['fv_score', 'mean_z']]")],),
                           {"combine_attrs": "drop_conflicts"})]
        if self.fv_result is not None:
            shown = str(self.fv_result.task.values[0])
            steps.append(Call("fv_result", f"{tv}.function_vector_accuracy",
                              (MODEL, [task if shown == OWN_TASK else shown],
                               Ref("scores['fv_score'].values")),
                              {"layer": self.fv_result.attrs["layer"], **opts}))
        if self.td is not None:
            k = int(self.td.attrs.get("params", {}).get("k", 10))
            steps.append(Call("td", f"{tv}.task_decodability", (MODEL, self._td_tasks),
                              {"k": k, **opts}))
        if self.curves is not None:
            c = self.curves.attrs.get("params", {})
            steps.append(Call(
                "curves", f"{ih}.ablation_curves",
                (MODEL, self._eval_tasks, Ref("scores['induction_score'].values"),
                 Ref("scores['fv_score'].values")),
                {"percents": [float(x) for x in self.curves.percent.values],
                 "rankings": [str(r) for r in self.curves.ranking.values],
                 "exclude_fraction": c.get("exclude_fraction"), "loss_sequences": 2,
                 "loss_tokens": 64, "mean_source": c.get("mean_source"),
                 "mean_tasks": self._fv_tasks, "score": c.get("score", "first_token"),
                 **opts}))
        if self.patching is not None:
            steps.append(Call("patching", f"{tvp}.task_vector_patching",
                              (MODEL, [str(t) for t in self.patching.task.values]),
                              {"layers": [int(x) for x in self.patching.layer.values], **opts},
                              "zero-shot, task / Null / no patch"))
        if self.conflict is not None:
            tasks = [str(t) for t in self.conflict.target.values]
            steps += [Call("conflict", f"{tvp}.conflicting_task_patching", (MODEL, tasks),
                           {"layers": [int(x) for x in self.conflict.layer.values], **opts}),
                      Call("matrix", "conflict['follows_source'].sel", (),
                           {"source": tasks, "layer": self.conflict_layer},
                           "A x B at the layer shown"),
                      Call("controls", "conflict['follows_target'].sel", (),
                           {"source": ["null", "none"], "layer": self.conflict_layer},
                           "Null vector, no patch")]
        else:
            steps.append(Note("Run the conflict test on the page for "
                              "tvp.conflicting_task_patching(model, tasks, layers=...)"))
        return Recipe(model=self._model.spec.name, steps=steps,
                      aliases={"xarray": "xr", ih: "ih", tv: "tv", tvp: "tvp",
                               "explorer.analyses.user_items": "user_items"})

    # -- layout ---------------------------------------------------------------------------

    def _state_html(self, *_: Any) -> str:
        """Hidden markers of what the page shows (read by the browser test)."""
        curves = "none" if self.curves is None else ",".join(
            f"{p:g}" for p in self.curves["percent"].values)
        rankings = "none" if self.curves is None else ",".join(
            str(r) for r in self.curves["ranking"].values)
        fv = "none" if self.fv_result is None else str(self.fv_result.attrs["layer"])
        conflict = ("none" if self.conflict is None else
                    ",".join(str(t) for t in self.conflict["target"].values))
        return (f"<div class='icl-state' data-icl-scores='{'ready' if self.scores is not None else 'none'}' "
                f"data-icl-head='{self.layer}:{self.head}' data-icl-curves='{curves}' "
                f"data-icl-rankings='{rankings}' "
                f"data-icl-fv='{fv}' data-icl-td='{'ready' if self.td is not None else 'none'}' "
                f"data-icl-conflict='{html.escape(conflict)}' "
                f"data-icl-conflict-layer='{self.conflict_layer}'></div>")

    def __panel__(self) -> pn.viewable.Viewable:
        p = self.param
        controls = pn.Column(
            *self._scores_controls(), *self._ablation_controls(),
            *self._task_vector_controls(), *self._patching_controls(),
            pn.pane.HTML(pn.bind(self._state_html, p.scores, p.layer, p.head, p.curves,
                                 p.fv_result, p.td, p.conflict, p.conflict_layer)),
            width=theme.SIZES["controls_width"])
        main = pn.Column(paper_panel("icl-heads", self), *self._scores_panes(), *self._ablation_panes(),
                         *self._task_vector_panes(), *self._patching_panes(),
                         sizing_mode="stretch_width")
        return pn.Row(controls, main, sizing_mode="stretch_width")


serve(__name__, ICLHeadsView, title="ICL heads: induction vs function-vector heads", intro="icl-heads")
