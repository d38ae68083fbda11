"""Circuits page: the edge-attribution graph, faithfulness, live edge ablation, fine-tuning.

Edge attribution patching (EAP / EAP-IG, Hanna et al. 2024) scores every edge of the
head/MLP graph once; the faithfulness curve patches the top-n circuits (pruned to the edges
on an input -> logits path, `circuits.select_circuit`) at the slider's log-spaced sizes. The
page opens on the smallest measured circuit that recovers a chosen share of the metric
(default 80 %), whatever its size, with its recovery and a bootstrap interval over the pairs;
when no measured circuit reaches the share the caption says so and the page shows the most
faithful one. The size slider steps through the measured sizes and re-draws from the cached
scores (no new trace).

A circuit of more than `MAX_DRAWN_EDGES` edges is drawn by its influence-pruned subset
(`circuit_influence.influence_pruning`, circuit-tracer's ``prune_graph``: the nodes carrying
80 % and the edges carrying 98 % of the influence on the logits); every node of the circuit is
drawn and labelled, and hovering or clicking a node draws all its circuit edges and its
strongest paths from the input and to the logits. The caption gives the share of influence
the drawn edges carry.

The graph (`apps._circuit_graph`): layers left to right, heads of a layer ordered by the
score mass they carry (heaviest on top, under the MLP), the layout fixed once the first
scores arrive so that switching EAP / EAP-IG or fine-tuning checkpoints moves no node. An
edge's width and opacity grow with |score|, its colour is the sign; every node the circuit
touches is labelled (L17.H3, L17.MLP, input, logits), the others are small and pale. Hover an
edge for its score, ends and patch effect; click a node to highlight its edges (the
``selected`` parameter holds its name), click an edge (or choose it in the list) to patch it
alone in the full model. The diff view colours edges gained and lost against the other
attribution method or the first fine-tuning checkpoint (Wang et al., ICML 2025). The shown
circuit downloads as CSV and the picture as SVG (the plot's save tool gives PNG).

The page is composed of parts, one module each: `apps._circuits_scoring` (tasks, the scoring
jobs, showing a result), `apps._circuits_size` (the selection, the size slider, the default
size), `apps._circuits_drawing` (the graph, clicks, the caption), `apps._circuits_curve` (the
faithfulness curve and the default's text), `apps._circuits_ablation` (patching readouts),
`apps._circuits_finetune` (LoRA checkpoints, the per-layer change and its noise floor) and
`apps._circuits_export` (code, CSV, SVG, state markers). `CircuitsView` declares the
parameters, builds the widgets and lays them out.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import holoviews as hv
import numpy as np
import panel as pn
import param
import xarray as xr

import explorer
from apps import _circuit_graph as cg
from apps import theme
from apps._circuits_ablation import CircuitAblation
from apps._circuits_curve import (CURVE_POINTS, GRID_POINTS, REFINE_STEPS, FaithfulnessCurve,
                                  faithfulness_marker, page_curve_sizes, plot_faithfulness,
                                  size_grid)
from apps._circuits_drawing import CircuitDrawing
from apps._circuits_export import CircuitExport
from apps._circuits_finetune import FinetuneComparison
from apps._circuits_scoring import (METHOD_LABELS, OWN_TASK, PROMPT_TASK, CircuitScoring,
                                    default_task, task_logit_diff)
from apps._circuits_size import GRANULARITIES, CircuitSize
from apps._controls import OwnItems, labelled_control
from apps._paper import paper_panel
from apps._positions import PositionStrip
from apps._provenance import Provenance, one_line, outdated_text
from apps._circuits_text import scope_on
from apps._server import BoundedCache
from apps._view import Scope, View, serve, shown_dataset, workspace_selection
from explorer.analyses import circuit_lora as cl
from explorer.analyses import circuit_select as cs
from explorer.analyses import circuits as ca
from explorer.analyses import user_items
from explorer._checks import InputError
from explorer.components import canonical
from explorer.interventions import Edit

__all__ = ["CircuitsView", "node_positions", "edge_table", "plot_faithfulness",
           "faithfulness_marker", "size_grid", "MAX_DRAWN_EDGES",
           "DEFAULT_MAX_EDGES", "METHOD_LABELS", "OWN_TASK", "task_logit_diff", "default_task",
           "page_curve_sizes", "CURVE_POINTS", "REFINE_STEPS"]

hv.extension("bokeh", logo=False)

MAX_DRAWN_EDGES = 400    # a circuit of more edges is drawn by its influence-pruned subset
DEFAULT_MAX_EDGES = None  # the default circuit has no size cap (the smallest faithful one)
node_positions = cg.node_positions
edge_table = cg.edge_table
_GRAPH_PARAMS = ["mode", "n_edges", "threshold", "checkpoint", "diff", "diff_against", "scores",
                 "checkpoints", "other_scores", "selected", "granularity", "n_nodes"]


class CircuitsView(FinetuneComparison, CircuitScoring, CircuitSize, CircuitAblation,
                   CircuitDrawing, FaithfulnessCurve, CircuitExport, View):
    """Edge-attribution circuit (the smallest faithful one by default; top-n or threshold,
    pruned), faithfulness, edge ablation, EAP / EAP-IG and fine-tuning comparisons, export.

    Parameters
    ----------
    model : explorer.Model
    background : bool, optional
        Compute in worker threads (default when served) or inline (tests, notebooks).
    autostart : bool, optional
        Score the edges on open; default only for small models (a few heads), else the
        page waits for the "Compute circuit" button.
    run_folder : str, optional
        A LoRA fine-tuning run (`circuit_lora.finetune_lora`); its ``circuits.nc`` (written
        by ``explorer circuit-lora run``) is loaded if present, else scored on demand.
    """

    task = param.Selector(default="ioi", objects=[*ca.TASK_NAMES, PROMPT_TASK], label="Task",
                          doc="The task's prompt pairs (SmolLM2 answers 62 of 64 ioi pairs "
                              "right, 31 of 64 add pairs: docs/circuits.md)")
    prompt = param.String(default="When Mary and John went to the store, John gave a drink to",
                          label="Prompt", doc="The prompt of the task 'your prompt' (in the "
                                              "gallery: the sidebar's prompt)")
    counterfactual = param.String(default="", label="Counterfactual (word=replacement)",
                                  doc="For the task 'your prompt': the corrupted prompt "
                                      "replaces this word of the prompt, e.g. John=Paul (a "
                                      "word that occurs once), or the token at a position, "
                                      "John@9=Paul (what a click on the token strip writes); "
                                      "empty: mean ablation, each node's output averaged "
                                      "over the prompt's positions")
    clicked = param.Integer(default=None, allow_None=True, bounds=(0, None), precedence=-1,
                            doc="The token position picked in the strip (the counterfactual "
                                "replaces the token there), or None")
    replacement = param.String(default="", label="Replace the clicked word by",
                               doc="For the task 'your prompt': the clicked token's "
                                   "replacement (sets the counterfactual)")
    explain = param.String(default="", label="Token to explain (empty: top token)",
                           doc="For the task 'your prompt': the answer whose logit the "
                               "circuit carries (against the corrupted prompt's top token); "
                               "empty: the model's top token")
    own_pairs = param.String(default="", precedence=-1,
                             doc="The pasted pairs of the task 'your pairs' (the text Use took "
                                 "in); a link carries them, and setting them takes them in as "
                                 "Use does")
    method = param.Selector(default="eap", objects=list(ca.METHODS), label="Attribution",
                            doc="EAP: one gradient at the clean run; EAP-IG: gradients averaged "
                                "along the path from corrupted to clean inputs (Wang et al.'s "
                                "choice; the page opens on EAP because EAP-IG's 5 steps take "
                                "about 3x as long: 12-16 forwards' time against 3.6-4.3, "
                                "benchmarks/README.md).")
    n_prompts = param.Integer(default=8, bounds=(1, 64), label="Prompt pairs")
    fraction = param.Number(default=0.8, bounds=(0.05, 1.0), step=0.05,
                            label="Default circuit: recovers at least")
    max_default_edges = param.Integer(default=DEFAULT_MAX_EDGES, bounds=(1, None),
                                      allow_None=True, precedence=-1,
                                      doc="The most edges (after pruning) of the default "
                                          "circuit; None: no cap")
    granularity = param.Selector(default="edges", objects=list(GRANULARITIES), label="Circuit of",
                                 doc="edges: the top-n edges by |score|, pruned; nodes: the "
                                     "top-k heads / MLPs by |node score| (the sum of their "
                                     "out-edges' scores), every other node's output patched "
                                     "to its corrupted value; its own faithfulness curve")
    n_nodes = param.Integer(default=0, bounds=(0, None), label="Top-k nodes by |node score|")
    mode = param.Selector(default="top-n", objects=["top-n", "threshold"], label="Circuit by",
                          doc="top-n: the n edges with the largest |score|; threshold: every "
                              "edge whose |score| is at least the slider's value.")
    n_edges = param.Integer(default=30, bounds=(0, None),
                            label="Top-n edges by |score| (before pruning)")
    threshold = param.Number(default=0.0, bounds=(0, None), label="|score| threshold")
    checkpoint = param.Integer(default=0, bounds=(0, 0), label="Fine-tuning checkpoint")
    diff = param.Boolean(default=False, label="Diff view: edges gained / lost")
    diff_against = param.Selector(default="other attribution",
                                  objects=["other attribution", "first checkpoint"],
                                  label="Diff against")
    selected = param.String(default="", label="Selected component",
                            doc="The clicked (pinned) node, in the one component spelling "
                                "(L17.H3): outlined, its circuit edges and strongest paths drawn")
    highlighted = workspace_selection(doc="The workspace's selected components: dropping the "
                                          "pinned node there unpins it (a link then reopens "
                                          "the same selection)")
    show_outside = param.Boolean(default=False, label="Show the selection's edges outside "
                                                      "the circuit",
                                 doc="Draw the selected component's 5 strongest edges that are "
                                     "not in the circuit (in purple)")
    edge = param.Selector(default="", objects=[""], label="Ablate edge (patch to corrupted)")
    selected_edges = param.List(default=[], item_type=str, label="Selected edges",
                                doc="Edges selected in the workspace, in the one spelling "
                                    "(L3.H1->L5.MLP); a click on an edge adds it, again "
                                    "removes it; drawn with a halo")
    ft_steps = param.Integer(default=6, bounds=(1, 200), label="Fine-tuning steps")
    ft_method = param.Selector(default=cl.CHECKPOINT_METHOD, objects=list(ca.METHODS),
                               label="Checkpoint circuits by",
                               doc="The attribution that scores each fine-tuning checkpoint: "
                                   "EAP-IG on the KL divergence from the clean run (Wang et "
                                   "al.'s choice), or EAP on the logit difference (cheaper)")

    scores = shown_dataset()
    shown = param.ClassSelector(class_=Provenance, default=None, allow_None=True, precedence=-1,
                                doc="What the shown scores were computed on (model, task, "
                                    "prompts, counterfactual by position, method, when): the "
                                    "title, caption, scope line and code are written from it")
    curve = shown_dataset()
    node_curve = shown_dataset()   # the node-level faithfulness curve
    other_scores = shown_dataset()   # the other attribution method's scores
    checkpoints = shown_dataset()
    noise_floor = shown_dataset(doc="The per-layer change that prompt resampling of the "
                                    "base model gives (`layer_change_noise_floor`)")
    noise_note = param.String(default="", precedence=-1,
                              doc="Why there is no noise floor (yet), or empty")
    ablation = param.Dict(default=None, allow_None=True, precedence=-1)
    circuit_patch = param.Dict(default=None, allow_None=True, precedence=-1,
                               doc="'Patch all shown edges': the metric of the model in which "
                                   "every edge outside the shown circuit is patched")
    edits = param.List(default=[], item_type=Edit, precedence=-1,
                       doc="Workspace edits (intervention records): with any, the readout shows "
                           "the task metric of the full model clean vs edited.")
    edited = param.Dict(default=None, allow_None=True, precedence=-1,
                        doc="The task metric (mean logit difference) of the full model without "
                            "and with `edits`; None without edits.")
    scoring = param.Boolean(default=False, precedence=-1, doc="A scoring job is in flight")
    layout_from = param.String(default="", precedence=-1,
                               doc="The scores the graph's layout was ordered by (fixed once)")
    redraw_ms = param.Number(default=0.0, precedence=-1)       # wall time of the last re-draw
    redraw_cpu_ms = param.Number(default=0.0, precedence=-1)   # its CPU time (busy machines)

    notify_title = None
    failed_status = "error: {message}"
    compute_action = "Compute circuit"
    # a link sets them in this order: the method and the pasted pairs before the task
    # 'your pairs' they make (taking them in computes their circuit, once, by that method)
    link_params = ("method", "own_pairs", "task", "n_prompts", "fraction", "granularity", "mode", "n_edges",
                   "threshold", "n_nodes", "selected", "counterfactual", "explain", "show_outside",
                   "diff", "diff_against", "ft_method")

    def scope(self) -> Scope:
        """What the shown circuit was computed on (its provenance; `scope_on`), and, when the
        inputs have changed since, that it is outdated; before any result, what Compute will
        run on. Edits change only the readout."""
        shown = self.shown
        if shown is None:
            on = scope_on(self.request_provenance(), self._request_counterfactual(),
                          own_n=len(self._own_task) if self._own_task is not None else 0)
            if self.task == PROMPT_TASK or self.task == OWN_TASK:
                on += " (to compute)"
        else:
            on = scope_on(shown)
            outdated = outdated_text(shown, self.request_provenance(), action=self.compute_action)
            if outdated:
                on += f". Outdated: {outdated}"
        return Scope(on=on, edits="not applicable: the circuit is of the unedited model (the "
                                  "readout shows the task metric with the edits)")

    def _request_counterfactual(self) -> str:
        """The current counterfactual in words (by position), or why it does not fit."""
        if not self.counterfactual.strip():
            return ""
        try:
            r = self.replacement_of(self.prompt, self.counterfactual)
        except InputError as e:
            return f"the counterfactual {self.counterfactual!r}, which does not fit: {e}"
        return f"{one_line(r.corrupt)} ({r.describe()})"

    def __init__(self, model: explorer.Model, *, background: bool | None = None,
                 autostart: bool | None = None, run_folder: str | Path | None = None,
                 **params: Any):
        checkpoint = params.pop("checkpoint", 0)  # its bounds are known once a run is loaded
        self._chosen_size = "n_edges" in params or "threshold" in params
        diff_against_given = "diff_against" in params
        if "task" not in params:
            params["task"] = default_task(model, params.get("n_prompts", 8))
        super().__init__(background=background, **params)
        self._model = model
        L, H = model.n_layers, model.spec.n_heads
        self._run_folder = Path(run_folder) if run_folder else None
        self.runner("scores", self._got_scores, busy=False, progress=True)
        self.runner("ablate", self._got_ablation, busy=False, progress=True)
        self.runner("finetune", self._got_checkpoints, busy=False, progress=True)
        self.runner("edited", self._got_edited, busy=False)
        self.runner("circuit_patch", self._got_circuit_patch, busy=False, progress=True)
        self.runner("nodes", self._got_node_curve, busy=False, progress=True)
        self.runner("noise", self._got_noise_floor, busy=False, progress=True)
        self._floors: dict[tuple, xr.Dataset] = {}   # noise floors by task and scoring
        self._progress = self.progress_bar()
        # (task, n, method) -> (task, scores, curve); kept whole: the caches below key on id(scores)
        self._results: dict[tuple, tuple] = {}
        self._node_curves: dict[tuple, xr.Dataset] = {}   # (task, n, method) -> node curve
        self._node_default: cs.CircuitChoice | None = None
        self._node_boot: tuple[int, xr.Dataset] | None = None
        self._chosen_nodes = "n_nodes" in params
        self._sizing = 0            # > 0 while the page itself sets the size (not a user or link)
        self._own_task: ca.CircuitTask | None = None   # the user's pairs (`use_own`)
        self._own_version = 0                          # bumped by each good paste
        self._taking_own = False                       # `use_own` is setting `own_pairs`
        self._own = OwnItems(
            "Your own prompt pairs", user_items.CIRCUIT_FORMAT,
            "One pair a line: clean prompt | corrupted prompt | answer | wrong answer (the "
            "corrupted prompt has as many tokens; the metric is the answer's logit minus the "
            "wrong answer's). An answer follows its prompt after a space; a field in \"quotes\" "
            f"is kept exactly. Use makes them the task '{OWN_TASK}' and computes its circuit.",
            self.use_own)
        self._effects = BoundedCache(max_items=16)      # patch effects by result and edge
        self._order: np.ndarray | None = None          # edge indices by |score|, descending
        self._ck_orders: list[np.ndarray] = []
        self._ck_scores: list[xr.Dataset] = []
        self._table: dict[str, np.ndarray] | None = None
        self._members: np.ndarray = np.zeros(0, dtype=int)
        self._nodes: frozenset[str] = frozenset()
        self._task: ca.CircuitTask | None = None
        self._edge_labels: dict[str, int] = {}
        self._circuit_cache = BoundedCache(max_items=256)
        self._shown = {"size": 0, "chosen": 0, "drawn": 0}
        self._default: cs.CircuitChoice | None = None
        self._boot: tuple[int, xr.Dataset] | None = None    # (id of the curve, its intervals)
        self._influence_cache = BoundedCache(max_items=32)   # pruning and paths by selection
        self._influence: xr.Dataset | None = None      # the shown circuit's pruning
        self._circuit_table: dict[str, np.ndarray] | None = None   # every member's edge
        self._node_paths: dict[str, str] = {}          # node -> circuit rows of its paths
        self._diff_note = ""
        self._names = cg.node_names(L, H)
        self._pos = cg.node_positions(L, H, cg.head_mass_order(None, L, H))
        self._pos_version = 0
        self._slider = pn.widgets.DiscreteSlider(label=self.param.n_edges.label, options=[30],
                                                 value=30, sizing_mode="stretch_width")
        self._syncing = False
        self._slider.param.watch(self._slider_moved, "value")
        self.param.watch(self._mode_changed, ["mode"])
        self.param.watch(lambda *_: self._sync_slider(), ["n_edges", "threshold", "n_nodes"])
        # the fraction slider (or the cap) re-chooses the default circuit, also when set to
        # its current value (a reset after moving the size slider)
        self.param.watch(lambda *_: self._set_default_size(force=True),
                         ["fraction", "max_default_edges"], onlychanged=False)
        self.param.watch(self._method_changed, ["method"])
        self.param.watch(self._task_changed, ["task", "n_prompts"])
        self.param.watch(self._own_pairs_set, ["own_pairs"])
        self.param.watch(self._size_asked, ["n_edges", "threshold", "n_nodes"])
        self.param.watch(self._check_selected, ["selected"])
        self.param.watch(self._selection_dropped, ["highlighted"])
        self.param.watch(lambda *_: self._granularity_changed(), ["granularity"])
        self.param.watch(self._diff_changed, ["diff", "diff_against"])
        # the graph is a plain Bokeh figure per drawing (`cg.GraphFigure`) whose data sources
        # a change updates in place: a slider move sends the new edge columns and the title
        # (the nodes and labels only when the node set changes), no new Bokeh models
        self.param.watch(lambda *_: self.redraw(), _GRAPH_PARAMS + ["show_outside"])
        # the title says when the shown result is no longer of the current inputs
        self.param.watch(lambda *_: self.redraw(), ["prompt", "counterfactual", "explain",
                                                    "task", "n_prompts"])
        self.param.watch(lambda *_: self._redraw_picked(), ["selected_edges"])
        self._graphs: list[cg.GraphFigure] = []
        self._faith_figs: list[tuple[Any, Any, Any]] = []   # (figure, marker source, target)
        self.param.watch(lambda *_: self._redraw_marker(),
                         ["mode", "n_edges", "threshold", "scores", "fraction", "n_nodes"])
        self._frame_key: tuple | None = None     # what the table was built for
        self._drawn_nodes_key: tuple | None = None
        self._outside: np.ndarray = np.zeros(0, dtype=int)   # the selection's edges shown
        self._spell = {n: canonical(n) for n in self._names}
        self._raw = {c: n for n, c in self._spell.items()}
        self._csv = pn.widgets.FileDownload(callback=self._csv_file, filename="circuit.csv",
                                            label="Download circuit (CSV)", embed=False,
                                            sizing_mode="stretch_width")
        self._svg = pn.widgets.FileDownload(callback=self._svg_file, filename="circuit.svg",
                                            label="Download picture (SVG)", embed=False,
                                            sizing_mode="stretch_width")
        self.param.watch(lambda e: self._request_ablation(), ["edge"])
        # the prompt's tokens: a click picks the word the counterfactual replaces
        self._strip = PositionStrip(tokens=self.prompt_tokens(), sizing_mode="stretch_width",
                                    css_classes=["circuit-prompt-strip"])
        self._strip.param.watch(self._token_clicked, "selected")
        self.param.watch(lambda *_: self._prompt_changed(), ["prompt"])
        self.param.watch(self._counterfactual_typed, ["counterfactual"])
        self._counterfactual_typed()
        self.param.watch(lambda *_: self._set_counterfactual(), ["replacement"])
        self.param.watch(lambda e: self._request_edited(), ["edits"])
        if self._run_folder is not None and (self._run_folder / "circuits.nc").is_file():
            self._set_checkpoints(xr.load_dataset(self._run_folder / "circuits.nc"))
            self.checkpoint = min(checkpoint, self.param.checkpoint.bounds[1])
            if not diff_against_given:
                self.diff_against = "first checkpoint"
        small = L * H <= 64
        if autostart if autostart is not None else small:
            self._request_scores()
        else:
            self.status = "Press **Compute circuit** to score the edges."

    def _selection_dropped(self, event: param.parameterized.Event) -> None:
        """The workspace dropped the pinned node: the page unpins it."""
        if self.selected and self.selected in event.old and self.selected not in event.new:
            self.selected = ""

    @property
    def max_drawn_edges(self) -> int:
        """`MAX_DRAWN_EDGES`, read at each use (a notebook or a test may change it)."""
        return MAX_DRAWN_EDGES

    def _prompt_controls(self) -> pn.Column:
        """The token strip and the replacement box, shown for the task 'your prompt', and a
        button that makes pairs like the prompt's with other names (an interval needs
        several pairs)."""
        variants = pn.widgets.Button(
            label="Same pair with other names (8 pairs)", sizing_mode="stretch_width",
            css_classes=["name-variants"],
            description="Write the prompt's pair and 7 more with other names into 'Your own "
                        "prompt pairs' and compute their circuit: the recovery then has a "
                        "bootstrap interval.")
        variants.on_click(lambda *_: self.use_name_variants())
        col = pn.Column(
            pn.pane.Markdown("Click the word to replace, then type its replacement (no "
                             "counterfactual: mean ablation):", margin=(4, 10, 0, 10)),
            self._strip, pn.widgets.TextInput.from_param(self.param.replacement),
            variants, visible=self.task == PROMPT_TASK, sizing_mode="stretch_width")
        self.param.watch(lambda e: setattr(col, "visible", e.new == PROMPT_TASK), ["task"])
        return col

    def __panel__(self) -> pn.viewable.Viewable:
        compute = pn.widgets.Button(label="Compute circuit", color="primary")
        compute.on_click(lambda *_: self._request_scores())
        finetune = pn.widgets.Button(label="Fine-tune (LoRA) and score checkpoints")
        patch_all = pn.widgets.Button(
            label="Patch all shown edges", sizing_mode="stretch_width",
            description="Keep only the shown circuit: patch every other edge to its corrupted "
                        "value and read the metric (the shown circuit's faithfulness).")
        patch_all.on_click(lambda *_: self.request_circuit_patch())
        finetune.on_click(lambda *_: self._request_finetune())
        player = pn.widgets.Player.from_param(self.param.checkpoint, interval=900, loop_policy="loop",
                                              show_value=True, width=260)
        shown = [self.param.scores, self.param.ablation, self.param.mode, self.param.n_edges,
                 self.param.threshold, self.param.checkpoint, self.param.diff,
                 self.param.diff_against, self.param.checkpoints, self.param.redraw_ms,
                 self.param.selected, self.param.fraction, self.param.other_scores,
                 self.param.edited, self.param.circuit_patch, self.param.show_outside,
                 self.param.granularity, self.param.n_nodes, self.param.node_curve,
                 self.param.noise_floor, self.param.shown, self.param.prompt,
                 self.param.counterfactual, self.param.explain, self.param.method,
                 self.param.task, self.param.n_prompts]
        controls = pn.Column(
            pn.widgets.Select.from_param(self.param.task),
            labelled_control(self, "method", pn.widgets.RadioButtonGroup),
            pn.widgets.IntInput.from_param(self.param.n_prompts),
            self._prompt_controls(),
            pn.widgets.TextInput.from_param(self.param.counterfactual),
            pn.widgets.TextInput.from_param(self.param.explain), compute, self._progress,
            self._own.layout(self.param.error),
            pn.widgets.FloatSlider.from_param(self.param.fraction, format="0%"),
            labelled_control(self, "granularity", pn.widgets.RadioButtonGroup),
            labelled_control(self, "mode", pn.widgets.RadioButtonGroup), self._slider,
            pn.widgets.Select.from_param(self.param.edge), patch_all,
            pn.widgets.Checkbox.from_param(self.param.show_outside),
            pn.widgets.Checkbox.from_param(self.param.diff),
            pn.widgets.Select.from_param(self.param.diff_against),
            self._csv, self._svg,
            pn.layout.Divider(), pn.widgets.IntInput.from_param(self.param.ft_steps),
            labelled_control(self, "ft_method", pn.widgets.RadioButtonGroup), finetune,
            player, pn.pane.Markdown(self.param.status), pn.pane.HTML(pn.bind(self._state_html,
                                                                              *shown)),
            width=theme.SIZES["controls_width"])
        faith = pn.bind(self._faithfulness_pane, self.param.curve, self.param.edited,
                        self.param.node_curve, self.param.granularity)
        main = pn.Column(
            paper_panel("circuits", self),
            theme.BokehPane(self._graph_figure(), sizing_mode="stretch_width"),
            # the caption re-renders when what it says can change, not on each re-draw's timing
            pn.pane.Markdown(pn.bind(self._caption, *[p for p in shown if p.name not in
                                                      ("redraw_ms", "ablation", "edited",
                                                       "circuit_patch")]),
                             css_classes=["circuit-caption"],
                             sizing_mode="stretch_width"),
            pn.pane.Markdown(pn.bind(self._readout, self.param.ablation, self.param.scores,
                                     self.param.edited, self.param.edits,
                                     self.param.circuit_patch),
                             css_classes=["circuit-readout"]),
            pn.panel(faith, sizing_mode="stretch_width"),
            pn.panel(pn.bind(self._layer_change_pane, self.param.checkpoints,
                             self.param.noise_floor, self.param.checkpoint,
                             self.param.noise_note), sizing_mode="stretch_width"),
            sizing_mode="stretch_width")
        return pn.Row(controls, main, sizing_mode="stretch_width")


serve(__name__, CircuitsView, title="Circuits: edge attribution and fine-tuning", intro="circuits")
