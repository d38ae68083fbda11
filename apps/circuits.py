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
"""
from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import holoviews as hv
import numpy as np
import panel as pn
import param
import xarray as xr

import explorer
from apps import _circuit_graph as cg
from apps._circuits_finetune import FinetuneComparison
from apps import theme
from apps._controls import OwnItems, labelled_control
from apps._positions import PositionStrip
from apps._server import BoundedCache
from apps._session import CancelToken
from apps._view import STATIC_TOOLS, Scope, View, serve
from explorer import components
from explorer._checks import InputError
from explorer.analyses import circuit_influence as ci
from explorer.analyses import circuit_lora as cl
from explorer.analyses import circuit_select as cs
from explorer.analyses import circuits as ca
from explorer.analyses import user_items
from explorer.components import canonical
from explorer.interventions import Edit
from explorer.workspace import edit_label

__all__ = ["CircuitsView", "node_positions", "edge_table", "plot_faithfulness",
           "faithfulness_marker", "size_grid", "slider_redraw_times", "MAX_DRAWN_EDGES",
           "DEFAULT_MAX_EDGES", "METHOD_LABELS", "OWN_TASK", "task_logit_diff", "default_task",
           "page_curve_sizes", "CURVE_POINTS", "REFINE_STEPS"]

hv.extension("bokeh", logo=False)

MAX_DRAWN_EDGES = 400    # a circuit of more edges is drawn by its influence-pruned subset
DEFAULT_MAX_EDGES = None  # the default circuit has no size cap (the smallest faithful one)
GRID_POINTS = 20         # log-spaced points of `size_grid` by default
CURVE_POINTS = cs.CURVE_POINTS   # the page's faithfulness points (slider positions), log-spaced
REFINE_STEPS = cs.REFINE_STEPS   # bisection steps narrowing the smallest faithful circuit
_TOOLS = STATIC_TOOLS
LEGEND_PX = 44           # the colour / width legend's two rows under the graph
METHOD_LABELS = {"eap": "EAP", "eap-ig": "EAP-IG"}
OWN_TASK = "your pairs"  # the task of the user's own prompt pairs (the "Your own" box)
PROMPT_TASK = "your prompt"  # the sidebar prompt against its counterfactual
node_positions = cg.node_positions
edge_table = cg.edge_table
_GRAPH_PARAMS = ["mode", "n_edges", "threshold", "checkpoint", "diff", "diff_against", "scores",
                 "checkpoints", "other_scores", "selected", "granularity", "n_nodes"]
GRANULARITIES = ("edges", "nodes")   # a circuit of edges (EAP's) or of nodes (node patching)

def task_logit_diff(model: explorer.Model, task: ca.CircuitTask, *,
                    edits: list[Edit] | tuple = ()) -> dict[str, np.ndarray]:
    """The task's metric in the full model, with ``edits`` applied (`explorer.run_with`): per
    pair, the logit of the answer's first token minus the wrong answer's at the last
    position (the tokens `explorer.analyses.circuits` reads), on the clean and on the
    corrupted prompts. Returns ``{"clean": [prompt], "corrupt": [prompt]}``."""
    ids = np.array([[user_items.continuation_token(model.tokenizer, p, t) for t in (a, w)]
                    for p, a, w in zip(task.clean, task.answer, task.wrong)])   # [prompt, 2]
    rows = np.arange(len(ids))
    out = {}
    for which in ("clean", "corrupt"):
        logits = explorer.run_with(model, getattr(task, which), list(edits), positions=[-1])
        last = logits["logits"].values[:, 0].astype(np.float64)   # [prompt, vocab]
        out[which] = last[rows, ids[:, 0]] - last[rows, ids[:, 1]]
    return out


def default_task(model: explorer.Model, n_prompts: int = 8) -> str:
    """The page's first task: ``ioi`` (SmolLM2 answers 62 of 64 pairs right), unless the
    model's tokenizer splits one of its first ``n_prompts`` clean / corrupted pairs into
    different lengths (a small test tokenizer): then ``add``."""
    task = ca.make_task("ioi", max(1, int(n_prompts)), seed=0)
    clean, corrupt = model.tokenize(list(task.clean)), model.tokenize(list(task.corrupt))
    return "ioi" if list(clean.lengths) == list(corrupt.lengths) else "add"


def size_grid(n_total: int, *, points: int = GRID_POINTS, low: float = 0.001) -> np.ndarray:
    """Circuit sizes of the slider: about ``points`` log-spaced edge counts from ``low`` (0.1 %)
    of the graph's edges (at least 1) to all of them, distinct, ascending."""
    if n_total < 1:
        return np.zeros(0, dtype=int)
    lo = max(1, int(round(low * n_total)))
    return np.unique(np.round(np.geomspace(lo, n_total, points)).astype(int))


def page_curve_sizes(scores: xr.Dataset, cap: int | None = None) -> list[int]:
    """The top-n sizes the page measures first: the empty circuit and `CURVE_POINTS`
    log-spaced sizes (`size_grid`); with a cap on the default's size, also where the pruned
    circuit first reaches 10, 25, ... edges up to it (`circuit_select.readable_sizes`)."""
    sizes = {0, *size_grid(scores.sizes["edge"], points=CURVE_POINTS).tolist()}
    if cap is not None:
        sizes |= set(cs.readable_sizes(scores, [t for t in cs.READABLE_TARGETS if t <= cap]))
    return sorted(sizes)


def graph_height(n_heads: int) -> int:
    """Pixel height of the graph: about 38 px per head row, room above for the MLP labels
    and below for the legend."""
    return int(max(380, 38 * (n_heads + 4))) + LEGEND_PX


def _ranges(n_layers: int, n_heads: int) -> tuple[tuple[float, float], tuple[float, float]]:
    return (-1.6, n_layers + 1.4), (-0.8, n_heads + 2.4)


def _no_curve() -> hv.Text:
    return hv.Text(0.5, 0.5, "Faithfulness: press Compute circuit").opts(
        xaxis=None, yaxis=None, toolbar=None, height=260, responsive=True, xlim=(0, 1),
        ylim=(0, 1))


_FAITH_X = "edges in the circuit (pruned)"
_NODE_X = "nodes in the circuit (heads, MLPs, input)"


def faithfulness_line(curve: xr.Dataset) -> hv.Overlay:
    """The measured curve: metric recovered against edges in the pruned circuit (log axis;
    the empty circuit, which recovers 0 by definition, is left off)."""
    kept = curve["n_kept"].values
    y = curve["recovered"].values
    on_axis = kept > 0
    line = hv.Curve((kept[on_axis], y[on_axis]), _FAITH_X, "metric recovered").opts(
        color=theme.ACCENT, line_width=2, tools=["hover"])
    pts = hv.Scatter((kept[on_axis], y[on_axis]), _FAITH_X, "metric recovered").opts(
        color=theme.ACCENT, size=6)
    return line * pts


def marker_height(curve: xr.Dataset, n_chosen: int) -> tuple[float, str]:
    """The curve's value at top-n ``n_chosen``: measured there, else interpolated between
    the measured top-n values."""
    top_n = curve["n_edges"].values
    y = curve["recovered"].values
    if n_chosen in top_n:
        return float(y[list(top_n).index(n_chosen)]), "measured"
    return float(np.interp(n_chosen, top_n, y)), "interpolated"


def faithfulness_marker(curve: xr.Dataset, n_kept: int, n_chosen: int | None = None) -> hv.Scatter:
    """The current circuit on the curve: x = its pruned size, y = the curve at its top-n
    ``n_chosen`` (`marker_height`); a short title. Empty when the circuit is empty."""
    here, how = marker_height(curve, n_kept if n_chosen is None else n_chosen)
    if n_kept > 0:
        title = f"Faithfulness: {n_kept:,} edges recover {here:.0%}"
        if how == "interpolated":
            title += " (interp.)"
        data = [(n_kept, here)]
    else:
        title, data = "Faithfulness: the circuit is empty", []
    return hv.Scatter(data, _FAITH_X, "metric recovered", group="Current").opts(
        color="black", size=13, marker="diamond", title=title)


def plot_faithfulness(curve: xr.Dataset | None, n_kept: int, n_chosen: int | None = None,
                      fraction: float | None = None) -> hv.Element:
    """Share of the clean-minus-corrupted metric recovered against the number of edges in the
    pruned circuit (log axis), the current circuit marked, the target share as a dashed line."""
    if curve is None:
        return _no_curve()
    mark = faithfulness_marker(curve, n_kept, n_chosen)
    out = faithfulness_line(curve) * mark
    if fraction is not None:
        out = out * hv.HLine(fraction).opts(color="#777777", line_dash="dashed", line_width=1)
    return out.opts(responsive=True, height=260, default_tools=_TOOLS, logx=True,
                    title=mark.opts.get().kwargs["title"])


class CircuitsView(FinetuneComparison, View):
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
                                      "replaces this word of the prompt, e.g. John=Paul (or "
                                      "click the word in the token strip and type its "
                                      "replacement); empty: mean ablation, each node's output "
                                      "averaged over the prompt's positions")
    replacement = param.String(default="", label="Replace the clicked word by",
                               doc="For the task 'your prompt': the clicked token's "
                                   "replacement (sets the counterfactual)")
    explain = param.String(default="", label="Token to explain (empty: the model's top token)",
                           doc="For the task 'your prompt': the answer whose logit the "
                               "circuit carries (against the corrupted prompt's top token)")
    method = param.Selector(default="eap", objects=list(ca.METHODS), label="Attribution",
                            doc="EAP: one gradient at the clean run; EAP-IG: gradients averaged "
                                "along the path from corrupted to clean inputs (slower, the "
                                "paper's choice).")
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

    scores = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True, precedence=-1)
    curve = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True, precedence=-1)
    node_curve = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True,
                                     precedence=-1)   # the node-level faithfulness curve
    other_scores = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True,
                                       precedence=-1)   # the other attribution method's scores
    checkpoints = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True,
                                      precedence=-1)
    noise_floor = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True,
                                      precedence=-1,
                                      doc="The per-layer change that prompt resampling of the "
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
    redraw_ms = param.Number(default=0.0, precedence=-1)       # wall time of the last re-draw
    redraw_cpu_ms = param.Number(default=0.0, precedence=-1)   # its CPU time (busy machines)

    notify_title = None
    failed_status = "error: {message}"
    link_params = ("task", "method", "n_prompts", "fraction", "granularity", "mode", "n_edges",
                   "threshold", "n_nodes", "selected", "counterfactual", "explain", "show_outside",
                   "diff", "diff_against", "ft_method")

    def scope(self) -> Scope:
        """The task's prompt pairs (not the sidebar prompt); edits change only the readout."""
        if self.task == PROMPT_TASK:
            t = self._task if self._task is not None and self._task.name == PROMPT_TASK \
                else None
            if not self.counterfactual.strip():
                against = ("mean ablation (no counterfactual: each node's output averaged "
                           "over the prompt's positions)")
            else:
                against = (f"its counterfactual {self.counterfactual!r}" if t is None
                           else repr(t.corrupt[0]))
            on = f"your prompt {self.prompt!r} vs {against}"
            if t is not None:
                on += f", explaining {t.answer[0]!r} against {t.wrong[0]!r}"
        elif self.task == OWN_TASK:
            n = len(self._own_task) if self._own_task is not None else 0
            on = f"your own prompt pairs ({n} pairs), not the sidebar prompt"
        else:
            on = f"task pairs: {self.task}, {self.n_prompts} pairs (not the sidebar prompt)"
        return Scope(on=on, edits="not applicable: the circuit is of the unedited model (the "
                                  "readout shows the task metric with the edits)")

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
        self._progress = pn.indicators.Progress(value=self.param.progress, max=100,
                                                sizing_mode="stretch_width",
                                                visible=self.param.progress_active)
        # (task, n, method) -> (task, scores, curve); kept whole: the caches below key on id(scores)
        self._results: dict[tuple, tuple] = {}
        self._node_curves: dict[tuple, xr.Dataset] = {}   # (task, n, method) -> node curve
        self._node_default: cs.CircuitChoice | None = None
        self._node_boot: tuple[int, xr.Dataset] | None = None
        self._chosen_nodes = "n_nodes" in params
        self._sizing = 0            # > 0 while the page itself sets the size (not a user or link)
        self._scoring = False       # a scoring job is in flight
        self._own_task: ca.CircuitTask | None = None   # the user's pairs (`use_own`)
        self._own_text = ""
        self._own_version = 0                          # bumped by each good paste
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
        self._shown_method = self.method
        self._diff_note = ""
        self._names = cg.node_names(L, H)
        self._pos = cg.node_positions(L, H, cg.head_mass_order(None, L, H))
        self._pos_version = 0
        self._layout_from = ""                          # the scores the layout was ordered by
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
        self.param.watch(self._size_asked, ["n_edges", "threshold", "n_nodes"])
        self.param.watch(self._check_selected, ["selected"])
        self.param.watch(lambda *_: self._granularity_changed(), ["granularity"])
        self.param.watch(self._diff_changed, ["diff", "diff_against"])
        # the graph is a plain Bokeh figure per drawing (`cg.GraphFigure`) whose data sources
        # a change updates in place: a slider move sends the new edge columns and the title
        # (the nodes and labels only when the node set changes), no new Bokeh models
        self.param.watch(lambda *_: self.redraw(), _GRAPH_PARAMS + ["show_outside"])
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
        self._clicked_word = ""
        self.param.watch(lambda *_: self._prompt_changed(), ["prompt"])
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

    # -- the circuit ------------------------------------------------------------------------
    def _key(self, method: str | None = None) -> tuple:
        if self.task == OWN_TASK:   # every paste is its own task
            n = len(self._own_task) if self._own_task is not None else 0
            return ((OWN_TASK, self._own_version), n, method or self.method)
        if self.task == PROMPT_TASK:
            return ((PROMPT_TASK, self.prompt, self.counterfactual, self.explain), 1,
                    method or self.method)
        return (self.task, self.n_prompts, method or self.method)

    def _task_data(self, name: str, n: int, *, seed: int = 0) -> ca.CircuitTask:
        """The pairs of the task ``name``: the user's (`use_own`), or ``n`` generated ones."""
        if name == PROMPT_TASK:
            word, eq, by = self.counterfactual.partition("=")
            if not self.counterfactual.strip():   # no counterfactual: the mean baseline
                return ca.prompt_task(self._model, self.prompt, "", "", answer=self.explain,
                                      name=PROMPT_TASK)
            if not eq:
                raise InputError("the task 'your prompt' needs a counterfactual: a word of the "
                                 "prompt and its replacement, e.g. 'John=Paul' (or none, for "
                                 f"mean ablation); got {self.counterfactual!r}.")
            return ca.prompt_task(self._model, self.prompt, word, by, answer=self.explain,
                                  name=PROMPT_TASK)
        if name == OWN_TASK:
            if self._own_task is None:
                raise InputError(f"the task {OWN_TASK!r} has no pairs yet: paste them in "
                                 "'Your own prompt pairs' and press Use.")
            return self._own_task
        return ca.make_task(name, n, seed=seed)

    def use_own(self, text: str) -> ca.CircuitTask | None:
        """Parse the user's prompt pairs (`user_items.parse_circuit_pairs`, checked against the
        model's tokenizer), make them the task and compute their circuit; bad text shows the
        parser's one-line message and keeps the current result."""
        try:
            task = user_items.parse_circuit_pairs(text, self._model, name=OWN_TASK)
        except InputError as e:
            self.show_error(e)
            return None
        self._own_task = task
        self._own_text = text
        self._own_version += 1
        if OWN_TASK not in self.param.task.objects:
            self.param.task.objects = [*self.param.task.objects, OWN_TASK]
        self.error = ""
        self.task = OWN_TASK
        self._request_scores()
        return task

    def prompt_tokens(self) -> list[str]:
        """The prompt's tokens as the model sees them (spaces shown), for the token strip."""
        ids = self._model.tokenizer(self.prompt, add_special_tokens=False)["input_ids"]
        return [theme.show_token(self._model.tokenizer.decode([i])) for i in ids]

    def click_token(self, pos: int) -> None:
        """Pick token ``pos`` of the prompt as the word the counterfactual replaces (what a
        click on the token strip does); the counterfactual becomes ``word=replacement``."""
        ids = self._model.tokenizer(self.prompt, add_special_tokens=False)["input_ids"]
        pos = int(pos)
        if not 0 <= pos < len(ids):
            raise InputError(f"`pos` must be a token position of the prompt in "
                             f"[0, {len(ids) - 1}]; got {pos}.")
        word = self._model.tokenizer.decode([ids[pos]]).strip()
        if not word:
            raise InputError(f"token {pos} of the prompt is whitespace; click a word.")
        self._clicked_word = word
        if list(self._strip.selected) != [pos]:
            self._strip.selected = [pos]
        self._set_counterfactual()

    def _token_clicked(self, event: Any) -> None:
        new = [p for p in event.new if p not in event.old]
        if not new:            # a click on the picked token again: keep it picked
            if not event.new and self._clicked_word:
                self._strip.selected = list(event.old)
            return
        try:
            self.click_token(new[-1])
        except InputError as e:
            self.show_error(e)
            self._strip.selected = list(event.old)

    def _set_counterfactual(self) -> None:
        if self._clicked_word:
            self.counterfactual = f"{self._clicked_word}={self.replacement.strip()}"

    def _prompt_changed(self) -> None:
        self._clicked_word = ""
        self._strip.param.update(tokens=self.prompt_tokens(), selected=[])

    def _other_method(self) -> str:
        return next(m for m in ca.METHODS if m != self.method)

    def _total(self) -> int:
        scores, _, _ = self._current()
        return 0 if scores is None else int(scores.sizes["edge"])

    def nodes_mode(self) -> bool:
        """Whether the page shows a node circuit (granularity "nodes")."""
        return self.granularity == "nodes"

    def _selection_key(self, scores: xr.Dataset) -> tuple:
        n_total = int(scores.sizes["edge"])
        if self.nodes_mode():
            return (id(scores), "nodes", int(self.n_nodes))
        if self.mode == "top-n":
            return (id(scores), "top-n", min(self.n_edges, n_total))
        return (id(scores), "threshold", float(self.threshold))

    def _circuit(self, scores: xr.Dataset) -> np.ndarray:
        """The pruned circuit (`select_circuit`) of ``scores`` at the current selection."""
        key = self._selection_key(scores)
        mask = self._circuit_cache.get(key)
        if mask is None:
            if key[1] == "nodes":
                total = len(cs.node_ranking(scores))
                sel = cs.node_circuit(scores, min(key[2], total))
                chosen = int(sel.attrs["n_nodes"])
            else:
                sel = (ca.select_circuit(scores, top_n=key[2]) if self.mode == "top-n"
                       else ca.select_circuit(scores, threshold=key[2]))
                chosen = sel.attrs["n_chosen"]
            mask = sel.values
            mask.flags.writeable = False
            self._circuit_cache[key] = mask
            self._circuit_cache[key + ("chosen",)] = chosen
        return mask

    def _n_chosen(self, scores: xr.Dataset) -> int:
        """Edges chosen before pruning (top-n, or how many pass the threshold); for a node
        circuit, its nodes."""
        self._circuit(scores)
        return int(self._circuit_cache[self._selection_key(scores) + ("chosen",)])

    def _grid(self) -> tuple[np.ndarray, np.ndarray]:
        """Slider sizes (top-n) and the |score| thresholds that choose as many edges."""
        scores, order, _ = self._current()
        if scores is None:
            return np.array([self.n_edges]), np.array([self.threshold])
        sizes = self._sizes(scores)
        mag = np.abs(scores["score"].values.astype(np.float64))
        return sizes, mag[order[sizes - 1]]

    def _sizes(self, scores: xr.Dataset) -> np.ndarray:
        """The slider's top-n positions: where the faithfulness curve was measured (the
        log-spaced grid plus the readable sizes), or the grid for a checkpoint's scores."""
        if scores is self.scores and self.curve is not None:
            sizes = self.curve["n_edges"].values
            return np.asarray(sizes[sizes > 0], dtype=int)
        return size_grid(int(scores.sizes["edge"]))

    def _node_sizes(self) -> list[int]:
        """The slider's node counts: where the node curve was measured, else log-spaced."""
        if self.node_curve is not None:
            return [int(k) for k in self.node_curve["n_nodes"].values if k > 0]
        scores, _, _ = self._current()
        if scores is None:
            return [max(1, self.n_nodes)]
        return cs.default_node_sizes(len(cs.node_ranking(scores)))[1:]

    def _sync_slider(self) -> None:
        """Slider options and value from the mode and the current n_edges / threshold (or
        n_nodes for a node circuit)."""
        if self._syncing:
            return
        if self.nodes_mode():
            values = self._node_sizes()
            options = {f"{k} nodes": k for k in values}
            value = self.n_nodes if self.n_nodes in values else min(
                values, key=lambda v: abs(np.log1p(v) - np.log1p(self.n_nodes)))
            self._syncing = True
            try:
                self._slider.param.update(options=options, value=value,
                                          label=self.param.n_nodes.label)
            finally:
                self._syncing = False
            return
        sizes, thresholds = self._grid()
        total = self._total()
        if self.mode == "top-n":
            options = {(f"{n:,} ({100 * n / total:.2g} %)" if total else f"{n:,}"): int(n)
                       for n in sizes}
            value, values = self.n_edges, [int(n) for n in sizes]
            name = self.param.n_edges.label
        else:
            options = {f"{t:.3g} ({n:,} edges)": float(t) for n, t in zip(sizes, thresholds)}
            value, values = self.threshold, [float(t) for t in thresholds]
            name = self.param.threshold.label
        if value not in values:  # an off-grid value (set in code): show the nearest position
            value = min(values, key=lambda v: abs(np.log1p(v) - np.log1p(value)))
        self._syncing = True
        try:
            self._slider.param.update(options=options, value=value, label=name)
        finally:
            self._syncing = False

    def _mode_changed(self, *_: Any) -> None:
        """Switching top-n <-> threshold keeps the slider's position (the same edges chosen)."""
        sizes, thresholds = self._grid()
        if self.scores is not None or self.checkpoints is not None:
            with self._sizing_by_page():
                if self.mode == "threshold":
                    i = int(np.argmin(np.abs(np.log(sizes) - np.log(max(self.n_edges, 1)))))
                    self.threshold = float(thresholds[i])
                else:
                    i = int(np.argmin(np.abs(thresholds - self.threshold)))
                    self.n_edges = int(sizes[i])
        self._sync_slider()

    def _slider_moved(self, event: param.parameterized.Event) -> None:
        if self._syncing:
            return
        self._syncing = True
        try:
            # one batch of Bokeh events; the plots change their sources' data in place, so
            # no model joins the document and its model graph needs no recompute (freeze)
            with pn.io.document.hold():
                if self.nodes_mode():
                    self.n_nodes = int(event.new)
                elif self.mode == "top-n":
                    self.n_edges = int(event.new)
                else:
                    self.threshold = float(event.new)
        finally:
            self._syncing = False

    def _set_default_size(self, force: bool = False) -> None:
        """The smallest measured circuit recovering ``fraction`` of the metric, at most
        ``max_default_edges`` edges (`circuit_select.smallest_faithful_circuit`); without a
        curve (checkpoints only), about 5 % of the edges. A size asked for in the constructor
        is kept until the fraction slider moves (``force``). The node circuit's default is
        chosen the same way from the node curve (`circuit_select.smallest_faithful_nodes`)."""
        self._set_node_default(force)
        sizes, thresholds = self._grid()
        if self.curve is not None and self.scores is not None:
            self._default = cs.smallest_faithful_circuit(self.curve, self.fraction,
                                                         max_edges=self.max_default_edges)
        if (force or not self._chosen_size) and len(sizes):
            if self._default is not None and self.curve is not None:
                n = self._default.n_edges
            else:
                total = self._total()
                n = max(0.05 * total, min(30, total))
            i = int(np.argmin(np.abs(np.log(np.maximum(sizes, 1)) - np.log(max(n, 1)))))
            with self._sizing_by_page():
                self.param.update(n_edges=int(n) if self.curve is not None else int(sizes[i]),
                                  threshold=float(thresholds[i]))
        self._sync_slider()

    def _set_node_default(self, force: bool = False) -> None:
        """The smallest measured node circuit recovering ``fraction`` (from the node curve);
        n_nodes moves to it unless a count was asked for in the constructor."""
        if self.node_curve is None:
            self._node_default = None
            return
        self._node_default = cs.smallest_faithful_nodes(self.node_curve, self.fraction)
        if force or not self._chosen_nodes:
            with self._sizing_by_page():
                self.n_nodes = self._node_default.n_edges
        self._chosen_nodes = False

    @contextlib.contextmanager
    def _sizing_by_page(self) -> Iterator[None]:
        """The page sets the size (its default, a mode switch, a new result): not a size the
        user or a link asked for."""
        self._sizing += 1
        try:
            yield
        finally:
            self._sizing -= 1

    def _size_asked(self, *events: param.parameterized.Event) -> None:
        """A size set from outside (code, a link, a state file) is kept when the scores
        arrive, as one given to the constructor is; the page's own moves and the slider's
        are not."""
        if self._sizing or self._syncing:
            return
        for event in events:
            if event.name == "n_nodes":
                self._chosen_nodes = True
            else:
                self._chosen_size = True

    def _check_selected(self, event: param.parameterized.Event) -> None:
        """The pinned node must be a node of this model's graph, in any spelling
        `components.canonical` reads (set to its canonical one); else it is refused and the
        previous one kept."""
        name = event.new
        if not name or name in self._raw:
            return
        try:
            spelled = canonical(name)
        except components.ComponentError:
            spelled = None
        if spelled in self._raw:
            self.selected = spelled
            return
        self.param.update(selected=event.old)
        L, H = self._model.n_layers, self._model.spec.n_heads
        raise InputError(f"`selected` must be a node of this model's graph: L0.H0 to "
                         f"L{L - 1}.H{H - 1}, L0.MLP to L{L - 1}.MLP, input or logits (or "
                         f"empty); got {str(name)[:60]!r}.")

    def _task_changed(self, *_: Any) -> None:
        """Another task or prompt count: a result already computed is shown at once; else,
        once the page has scored (or is scoring) anything, the new one is computed (a link or
        a state file that names the task opens on its graph); else on the button."""
        if self._key() in self._results:
            self._show(self._key(), default=False)
        elif (self._results or self._scoring) and not (
                self.task == OWN_TASK and self._own_task is None):
            self._request_scores()

    def _granularity_changed(self) -> None:
        """Edges <-> nodes: the node curve of the shown scores is measured on first use."""
        if self.nodes_mode() and self.scores is not None and self.node_curve is None:
            self._request_node_curve()
        self._sync_slider()
        self._redraw_marker()

    # -- jobs -----------------------------------------------------------------------------
    def _request_node_curve(self) -> None:
        """Measure the node-level faithfulness curve of the shown scores
        (`circuit_select.measured_node_curve`) in a worker."""
        key, task, scores = self._key(self._shown_method), self._task, self.scores
        if scores is None or task is None:
            return
        m, fraction = self._model, self.fraction

        def job(token: CancelToken):
            curve = cs.measured_node_curve(m, task, scores, fraction=fraction,
                                           batch_size=len(task),
                                           progress=self.progress_fn(token), check=token.check)
            return key, curve

        self.status = f"patching node circuits ({len(task)} pairs)…"
        self.submit("nodes", job)

    def _got_node_curve(self, result: tuple) -> None:
        key, curve = result
        self._node_curves[key] = curve
        if key == self._key() and self.scores is not None:
            self.node_curve = curve
            self._set_node_default()
            self._sync_slider()
            d = self._node_default
            self.status = (f"node curve measured: {d.n_edges} nodes recover {d.recovered:.0%}"
                           if d is not None else "node curve measured")

    def _request_scores(self, method: str | None = None) -> None:
        m, task_name = self._model, self.task
        method = method or self.method
        key = self._key(method)
        try:
            task = self._task_data(task_name, self.n_prompts)
        except InputError as e:
            self.show_error(e)
            return
        n = len(task)

        fraction, cap = self.fraction, self.max_default_edges

        def job(token: CancelToken):
            scores = ca.edge_scores(m, task, method=method, batch_size=n,
                                    progress=self.progress_fn(token))
            token.check()
            curve = cs.measured_default_curve(m, task, scores, fraction=fraction,
                                              sizes=page_curve_sizes(scores, cap),
                                              batch_size=n, progress=self.progress_fn(token),
                                              check=token.check)
            return key, task, scores, curve

        self.status = f"scoring edges ({METHOD_LABELS[method]}, {n} {task_name} pairs)…"
        self._scoring = True
        self.submit("scores", job)

    def _got_scores(self, result: tuple) -> None:
        key, task, scores, curve = result
        self._scoring = False
        # the first result of a task and prompt count opens on the default circuit; the
        # other method's, arriving after a toggle, keeps the size shown (a fair comparison)
        first = not any(k[:2] == key[:2] for k in self._results if k != key)
        self._results[key] = (task, scores, curve)
        if key == self._key():
            self._show(key, default=first)
        elif key == self._key(self._other_method()):
            self.other_scores = scores
            self.status = f"{METHOD_LABELS[key[2]]} scores ready for the diff"

    def _show(self, key: tuple, *, default: bool) -> None:
        """Make the result ``key`` the page's: scores, curve, order; the first result also
        fixes the layout (heads by score mass), which no later result changes."""
        task, scores, curve = self._results[key]
        self._task = task
        self._shown_method = key[2]
        self._circuit_cache.clear()
        self._influence_cache.clear()
        self._order = np.argsort(-np.abs(scores["score"].values), kind="stable")
        if not self._layout_from:
            self._set_layout(scores, f"{METHOD_LABELS[key[2]]} scores of the base model")
        other = self._results.get((key[0], key[1], self._other_method()))
        self.param.n_edges.bounds = (0, scores.sizes["edge"])
        node_curve = self._node_curves.get(key)
        with self._sizing_by_page():
            self.param.update(n_edges=min(self.n_edges, scores.sizes["edge"]), scores=scores,
                              curve=curve, ablation=None, node_curve=node_curve,
                              other_scores=None if other is None else other[1])
        if node_curve is None and self.nodes_mode():
            self._request_node_curve()
        if default:
            self._set_default_size()
        else:
            self._default = cs.smallest_faithful_circuit(curve, self.fraction,
                                                         max_edges=self.max_default_edges)
            self._sync_slider()
        self.status = (f"{scores.sizes['edge']:,} edges scored ({METHOD_LABELS[key[2]]}); "
                       f"clean metric {scores.attrs['clean_metric']:.3f}, corrupted "
                       f"{scores.attrs['corrupt_metric']:.3f}")
        self._request_edited()

    def _set_layout(self, scores: xr.Dataset, label: str) -> None:
        L, H = self._model.n_layers, self._model.spec.n_heads
        self._pos = cg.node_positions(L, H, cg.head_mass_order(scores, L, H))
        self._pos_version += 1
        self._frame_key = None
        self._layout_from = label
        self._refresh_nodes(force=True)

    def _method_changed(self, *_: Any) -> None:
        """EAP <-> EAP-IG: a result already computed is shown at once (same size, same
        layout); else it is computed when any result has been (else on the button)."""
        if self._key() in self._results:
            self._show(self._key(), default=False)
        elif self._results or self._scoring:
            self._request_scores()
        else:
            self.status = f"Press **Compute circuit** to score the edges ({METHOD_LABELS[self.method]})."

    def _diff_changed(self, *_: Any) -> None:
        """The diff against the other method needs its scores: computed if missing."""
        if self.diff and self.diff_against == "other attribution" and self.scores is not None:
            other = self._key(self._other_method())
            if other in self._results:
                self.other_scores = self._results[other][1]
            else:
                self._request_scores(self._other_method())

    def _request_ablation(self) -> None:
        if not self.edge or self.scores is None or self.edge not in self._edge_labels:
            return
        index = self._edge_labels[self.edge]
        m, task, scores = self._model, self._task, self.scores
        label, key = self.edge, self._key()

        def job(token: CancelToken):
            keep = np.ones(scores.sizes["edge"], bool)
            keep[index] = False  # every edge clean but this one
            out = ca.patch_edges_metric(m, task, scores, keep, batch_size=len(task),
                                        progress=self.progress_fn(token))
            out.update(edge=label, estimate=float(scores["score"].values[index]),
                       index=int(index), key=key)
            return out

        self.status = f"patching {label}…"
        self.submit("ablate", job)

    def _got_ablation(self, out: dict) -> None:
        self._effects.setdefault(out["key"], {})[out["index"]] = out["metric"] - out["clean_metric"]
        self.ablation = out
        self.status = f"patched {out['edge']}"
        t = self._table
        if t is not None and out["key"] == self._key() and (t["edge"] == out["index"]).any():
            t["effect"][t["edge"] == out["index"]] = f"{out['metric'] - out['clean_metric']:+.4f}"
            self._frame_key = None
            self.redraw()   # the hover's patch effect

    def shown_edges(self) -> np.ndarray:
        """Bool mask over the shown scores' edges: the shown circuit (the pruned circuit of
        the current selection, the one the title counts and the faithfulness marker places;
        all of it, also past the `MAX_DRAWN_EDGES` drawn)."""
        scores, _, _ = self._current()
        return np.zeros(0, bool) if scores is None else self._circuit(scores).copy()

    def request_circuit_patch(self) -> None:
        """Patch every edge outside the shown circuit to its corrupted value (the shown
        circuit's own faithfulness, `circuits.patch_edges_metric`)."""
        scores, _, label = self._current()
        if scores is None or self._task is None:
            self.show_error(InputError("no circuit yet: press Compute circuit first."))
            return
        if scores is not self.scores:
            self.show_error(InputError(f"the graph shows the fine-tuning checkpoint ({label}); "
                                       "patching runs on the base model's circuit (checkpoint 0)."))
            return
        keep = self.shown_edges()
        m, task, key = self._model, self._task, self._key()

        def job(token: CancelToken):
            out = ca.patch_edges_metric(m, task, scores, keep, batch_size=len(task),
                                        progress=self.progress_fn(token))
            out.update(key=key, n_shown=int(keep.sum()), n_drawn=int(self._shown["drawn"]))
            return out

        self.status = f"patching every edge outside the circuit's {int(keep.sum()):,}…"
        self.submit("circuit_patch", job)

    def _got_circuit_patch(self, out: dict) -> None:
        self.circuit_patch = out
        self.status = f"patched every edge outside the circuit's {out['n_shown']:,}"

    def _request_edited(self) -> None:
        """The task metric of the full model without and with the workspace edits (on the
        shown task's pairs); nothing without edits or before a task has been scored."""
        task, edits = self._task, list(self.edits)
        if not edits or task is None:
            if self.edited is not None:
                self.edited = None
            return
        key = (self._key()[:2], tuple(edits))
        if self.edited is not None and self.edited.get("key") == key:
            return
        m = self._model

        def job(token: CancelToken):
            plain = task_logit_diff(m, task)
            token.check()
            edited = task_logit_diff(m, task, edits=edits)
            return {"key": key, "labels": [edit_label(e) for e in edits],
                    **{f"{k}_metric": float(v.mean()) for k, v in plain.items()},
                    **{f"edited_{k}_metric": float(v.mean()) for k, v in edited.items()}}

        self.submit("edited", job)

    def _got_edited(self, out: dict) -> None:
        span = out["clean_metric"] - out["corrupt_metric"]
        out["recovered"] = ((out["edited_clean_metric"] - out["corrupt_metric"]) / span
                            if span else float("nan"))
        self.edited = out

    # -- drawing --------------------------------------------------------------------------
    def _current(self) -> tuple[xr.Dataset | None, np.ndarray | None, str]:
        """Scores, order and a label of what the graph shows (a checkpoint or the base)."""
        ck = self.checkpoints
        if ck is not None and self.checkpoint > 0:
            i = min(self.checkpoint, ck.sizes["checkpoint"] - 1)
            return self._ck_scores[i], self._ck_orders[i], f"step {int(ck.checkpoint[i])}"
        if self.scores is None and ck is not None:
            return self._ck_scores[0], self._ck_orders[0], f"step {int(ck.checkpoint[0])}"
        return self.scores, self._order, "base model"

    def _reference(self, showing_base: bool) -> tuple[np.ndarray | None, str]:
        """The diff's reference circuit (same selection) and what it is, or why there is none."""
        if not self.diff:
            return None, ""
        if self.diff_against == "first checkpoint":
            if self.checkpoints is None:
                return None, "no fine-tuning checkpoints yet (press Fine-tune)"
            return self._circuit(self._ck_scores[0]), \
                f"step {int(self.checkpoints.checkpoint[0])}"
        if not showing_base:
            return None, "the other attribution is scored on the base model only"
        if self.other_scores is None:
            return None, f"waiting for the {METHOD_LABELS[self._other_method()]} scores"
        return self._circuit(self.other_scores), METHOD_LABELS[self._other_method()]

    def _refresh_nodes(self, force: bool = False) -> None:
        """The node set of the circuit (all of it, drawn edges or not) and of the selection's
        shown edges."""
        t, c = self._table, self._circuit_table
        nodes: frozenset[str] = frozenset()
        if t is not None:
            keep = t["status"] != "lost"
            nodes = frozenset(t["src"][keep].tolist()) | frozenset(t["dst"][keep].tolist())
        if c is not None:
            nodes |= frozenset(c["src"].tolist()) | frozenset(c["dst"].tolist())
        self._nodes = nodes
        if force:
            self._drawn_nodes_key = None

    def _influence_of(self, scores: xr.Dataset, mask: np.ndarray) -> xr.Dataset:
        """`circuit_influence.influence_pruning` of the circuit ``mask`` (cached)."""
        key = self._selection_key(scores)
        out = self._influence_cache.get(key)
        if out is None:
            if len(self._influence_cache) > 64:
                self._influence_cache.clear()
            out = ci.influence_pruning(scores, mask)
            self._influence_cache[key] = out
        return out

    def _set_circuit_table(self, scores: xr.Dataset, mask: np.ndarray, members: np.ndarray,
                           diff: bool, effects: dict[int, float]) -> None:
        """Every edge of the shown circuit (what a hover over a node reads) and each node's
        strongest paths from the input and to the logits, as rows of it."""
        if diff or not len(members):
            self._circuit_table, self._node_paths = None, {}
            return
        self._circuit_table = cg.edge_table(scores, members, self._pos, spell=self._spell,
                                            effects=effects)
        key = self._selection_key(scores) + ("paths",)
        paths = self._influence_cache.get(key)
        if paths is None:   # the same circuit re-drawn (a selection, a hover): computed once
            row = {int(e): i for i, e in enumerate(members.tolist())}
            paths = {self._spell[n]: ",".join(str(row[e]) for e in back + fwd)
                     for n, (back, fwd) in ci.strongest_paths(scores, mask).items()}
            self._influence_cache[key] = paths
        self._node_paths = paths

    def influence_share(self) -> float:
        """Share of the shown circuit's influence on the logits that its drawn edges carry
        (1 when the whole circuit is drawn)."""
        return 1.0 if self._influence is None else float(self._influence.attrs["drawn_share"])

    def _pinned_data(self) -> dict[str, list]:
        """The selected node's circuit edges and strongest paths (drawn like a hover)."""
        c = self._circuit_table
        if not self.selected or c is None:
            return cg.node_edges_data(cg.circuit_source_data(None), "", "")
        return cg.node_edges_data(c, self.selected, self._node_paths.get(self.selected, ""))

    def nodes_drawn(self) -> list[dict[str, list]]:
        """What each drawing's node data source holds: name, size and fill (for tests)."""
        return [{k: list(g.nodes.data[k]) for k in ("name", "size", "fill")}
                for g in self._graphs]

    def labels_drawn(self) -> dict[str, list]:
        """What the last drawing's label sources hold together: x, y and text (for tests)."""
        srcs = [self._graphs[-1].head_labels, self._graphs[-1].mlp_labels] if self._graphs else []
        return {k: [v for src in srcs for v in src.data[k]] for k in ("x", "y", "text")}

    def node_columns(self) -> dict[str, list]:
        """The node columns the page draws now (places, sizes, fills, labels, paths)."""
        return cg.node_columns(self._names, self._pos, self._nodes, self.selected,
                               self._node_paths)

    def _graph_title(self, n_members: int, n_drawn: int, method: str, label: str,
                     ref_label: str) -> str:
        what = f"{n_members:,} edges" + (f" ({n_drawn:,} drawn)" if n_members > n_drawn else "")
        if ref_label:
            t = self._table
            return (f"Diff: {method} vs {ref_label}, +{int((t['status'] == 'gained').sum())} "
                    f"/ −{int((t['status'] == 'lost').sum())}")
        if self.nodes_mode():   # short enough for the plot's width at 1280 px
            where = "" if label == "base model" else f", {label}"
            return f"{self._shown['chosen']:,} nodes, {what}, {method}{where}"
        return f"Circuit: {what}, {method}, {label}"

    def _current_key(self) -> tuple:
        return (self.granularity, self.n_nodes, self.mode, self.n_edges, self.threshold,
                self.checkpoint, self.diff,
                self.diff_against, id(self.scores), id(self.checkpoints), id(self.other_scores),
                self.selected, self.show_outside, self._pos_version)

    def _update_table(self) -> None:
        """The drawn edges for the current selection (once per change: both graph callbacks
        read it)."""
        key = self._current_key()
        if key == self._frame_key:
            return
        self._frame_key = key
        self._frame_times = {}
        scores, order, label = self._current()
        self._outside = np.zeros(0, dtype=int)
        if scores is None:
            self._table = None
            self._members = np.zeros(0, dtype=int)
            self._shown = {"size": 0, "chosen": 0, "drawn": 0}
            self._title = "Circuit: waiting for edge scores"
            self._refresh_nodes()
            return
        mask = self._circuit(scores)
        n_chosen = self._n_chosen(scores)
        members = order[mask[order]]              # the pruned circuit, strongest first
        self._influence = None
        if len(members) > MAX_DRAWN_EDGES:        # its influence-pruned subset
            self._influence = self._influence_of(scores, mask)
            shown = members[self._influence["drawn"].values[members]]
        else:
            shown = members
        base = scores is self.scores
        reference, ref_label = self._reference(base)
        self._diff_note = ref_label if reference is None else ""
        if reference is None:
            ref_label = ""
        effects = self._effects.get(self._key(), {}) if base else {}
        raw = self._raw.get(self.selected)
        if raw is not None and self.show_outside:   # asked for: its strongest other edges
            self._outside = cg.strongest_edges(scores, raw, 5, exclude=mask)
        self._table = cg.edge_table(scores, shown, self._pos, reference=reference, circuit=mask,
                                    max_lost=MAX_DRAWN_EDGES, selected=self.selected,
                                    effects=effects, extra=self._outside, spell=self._spell)
        self._members = members
        self._shown = {"size": int(len(members)), "chosen": n_chosen, "drawn": int(len(shown))}
        self._set_circuit_table(scores, mask, members, reference is not None, effects)
        keep_rows = self._table["status"] != "lost"
        labels = [f"{s} → {d}" for s, d in zip(self._table["src"][keep_rows],
                                                 self._table["dst"][keep_rows])]
        self._edge_labels = dict(zip(labels, self._table["edge"][keep_rows].tolist()))
        keep = self.edge if self.edge in self._edge_labels else ""
        self.param.edge.objects = ["", *labels]
        if self.edge != keep:
            self.param.update(edge=keep)
        method = METHOD_LABELS[self._shown_method if base else
                               str(self.checkpoints.attrs.get("edge_method", self.method))]
        self._title = self._graph_title(len(members), len(shown), method, label, ref_label)
        self._csv.filename = (f"circuit_{self._model.spec.name.split('/')[-1]}_"
                              f"{self.task.replace(' ', '-')}_"
                              f"{method.lower()}_{len(members)}edges.csv")
        self._svg.filename = self._csv.filename[:-4] + ".svg"
        self._refresh_nodes()

    def redraw(self) -> dict[str, Any]:
        """Bring every drawing of the graph up to date (the edge table for the current
        selection; the nodes and labels when the node set, the selection or the layout
        changed) and return what is drawn: ``edges`` (the edge source's columns), ``title``,
        ``nodes`` (`node_columns`). Publishes its time (`redraw_ms`, `redraw_cpu_ms`)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        self._update_table()
        edges = cg.edge_source_data(self._table)
        key = (self._nodes, self.selected, self._pos_version, id(self._circuit_table))
        nodes = self.node_columns() if (key != self._drawn_nodes_key or not self._graphs) \
            else None
        circuit = cg.circuit_source_data(self._circuit_table) if nodes is not None else None
        pinned = self._pinned_data() if nodes is not None else None
        with pn.io.document.hold():
            for g in self._graphs:
                g.show_edges(edges, self._title)
                if nodes is not None:
                    g.show_circuit(circuit, pinned)
                    g.show_nodes(nodes)
                    g.show_picked(self._picked_data())
        self._drawn_nodes_key = key
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        # after the render, not inside it: a pane following these parameters would be
        # rebuilt mid-render, before its model joins the document (Panel then styles it
        # with the design's CDN style sheets, which a browser fetches)
        self.schedule(lambda: self.param.update(redraw_ms=1e3 * wall, redraw_cpu_ms=1e3 * cpu))
        return {"edges": edges, "title": self._title,
                "nodes": nodes if nodes is not None else self.node_columns()}

    def _picked_data(self) -> dict[str, list]:
        pairs = [tuple(e.split("->", 1)) for e in self.selected_edges]
        return cg.picked_source_data(pairs, self._pos, self._raw)

    def _redraw_picked(self) -> None:
        data = self._picked_data()
        with pn.io.document.hold():
            for g in self._graphs:
                g.show_picked(data)

    def _graph_figure(self) -> Any:
        """A new drawing of the graph (one per rendering of the page), drawn now and kept up
        to date by `redraw`; a click on it goes to `_clicked`."""
        from bokeh.events import Tap

        L, H = self._model.n_layers, self._model.spec.n_heads
        xlim, ylim = _ranges(L, H)
        g = cg.GraphFigure(L, H, height=graph_height(H), xlim=xlim, ylim=ylim,
                           font_sizes=theme.font_sizes(), tools=_TOOLS)
        g.figure.on_event(Tap, lambda event: self._clicked(event.x, event.y))
        self._graphs.append(g)
        self._frame_key = None
        self._drawn_nodes_key = None
        self.redraw()
        return g.figure

    _edges_plot = redraw   # the name the remote-model tests call

    def _faithfulness_plot(self, *_: Any) -> hv.Element:
        """The base model's curve, marked at its circuit for the current selection (also
        while the graph shows a fine-tuning checkpoint)."""
        if self.curve is None or self.scores is None:
            return plot_faithfulness(None, 0)
        mask = self._circuit(self.scores)
        return plot_faithfulness(self.curve, int(mask.sum()), self._n_chosen(self.scores),
                                 self.fraction)

    def _marker_state(self) -> tuple[dict[str, list], str]:
        """The marker's data source columns (``edges``, ``metric``: the current circuit on
        the curve, `faithfulness_marker`) and the faithfulness plot's title."""
        if self.nodes_mode():
            return self._node_marker_state()
        if self.curve is None or self.scores is None:
            return {"edges": [], "metric": []}, "Faithfulness"
        mask = self._circuit(self.scores)
        mark = faithfulness_marker(self.curve, int(mask.sum()), self._n_chosen(self.scores))
        rows = mark.data
        return ({"edges": [float(v) for v in rows.iloc[:, 0]],
                 "metric": [float(v) for v in rows.iloc[:, 1]]},
                mark.opts.get().kwargs["title"])

    def _node_marker_state(self) -> tuple[dict[str, list], str]:
        """The node circuit on the node curve (x: its nodes) and the plot's title."""
        c = self.node_curve
        if c is None or self.scores is None:
            return {"edges": [], "metric": []}, "Node faithfulness: measuring…"
        k = int(self.n_nodes)
        ks, y = c["n_nodes"].values, c["recovered"].values
        here = float(y[list(ks).index(k)]) if k in ks else float(np.interp(k, ks, y))
        how = "" if k in ks else " (interp.)"
        if k == 0:
            return {"edges": [], "metric": []}, "Node faithfulness: the circuit is empty"
        return ({"edges": [float(k)], "metric": [here]},
                f"Node faithfulness: {k:,} nodes recover {here:.0%}{how}")

    def _redraw_marker(self) -> None:
        """Move the marker, the title and the target line of every faithfulness drawing (a
        slider move changes these three, not the figure)."""
        if not self._faith_figs:
            return
        data, title = self._marker_state()
        with pn.io.document.hold():
            for fig, marker, target in self._faith_figs:
                marker.data = data
                fig.title.text = title
                target.location = float(self.fraction)

    def edited_line(self) -> hv.HLine | None:
        """The share of the metric the full model keeps with the workspace edits (a dotted
        line on the faithfulness curve), or None without edits."""
        kept = self.edited["recovered"] if self.edited is not None else np.nan
        if not np.isfinite(kept):
            return None
        return hv.HLine(kept).opts(color=theme.ACCENT, line_dash="dotted", line_width=2)

    def _faithfulness_pane(self, curve: xr.Dataset | None, edited: dict | None = None,
                           node_curve: xr.Dataset | None = None,
                           granularity: str = "edges") -> Any:
        """The curve (and the edited model's line, dotted) as a plain Bokeh figure, drawn
        once per set of scores and edits; the marker (a diamond), the title and the target
        share (dashed) follow the selection in place (`_redraw_marker`). For a node circuit,
        the node curve (recovered against the nodes kept)."""
        nodes = granularity == "nodes"
        if nodes and node_curve is None:
            return hv.Text(0.5, 0.5, "Node faithfulness: measuring the node circuits…").opts(
                xaxis=None, yaxis=None, toolbar=None, height=260, responsive=True,
                xlim=(0, 1), ylim=(0, 1))
        if curve is None:
            return _no_curve()
        from bokeh.models import ColumnDataSource, HoverTool, Span
        from bokeh.plotting import figure

        if nodes:
            kept, y = node_curve["n_nodes"].values, node_curve["recovered"].values
            x_label = _NODE_X
        else:
            kept, y = curve["n_kept"].values, curve["recovered"].values
            x_label = _FAITH_X
        on_axis = kept > 0   # the empty circuit (0 by definition) has no place on a log axis
        fig = figure(height=260, sizing_mode="stretch_width", x_axis_type="log",
                     tools=list(_TOOLS), x_axis_label=x_label, y_axis_label="metric recovered",
                     toolbar_location="right")
        fig.toolbar.logo = None
        fonts = theme.font_sizes()
        fig.title.text_font_size = fonts["title"]
        for axis, ticks in ((fig.xaxis, "xticks"), (fig.yaxis, "yticks")):
            axis.axis_label_text_font_size = fonts["labels"]
            axis.major_label_text_font_size = fonts[ticks]
        points = ColumnDataSource({"edges": kept[on_axis].astype(float),
                                   "metric": y[on_axis].astype(float)})
        line = fig.line("edges", "metric", source=points, color=theme.ACCENT, line_width=2,
                        name="faithfulness-curve")
        fig.scatter("edges", "metric", source=points, color=theme.ACCENT, size=6)
        fig.add_tools(HoverTool(renderers=[line], tooltips=[(x_label, "@edges{0,0}"),
                                                            ("metric recovered", "@metric{0.000}")]))
        target = Span(location=float(self.fraction), dimension="width", line_color="#777777",
                      line_dash="dashed", line_width=1, name="target-share")
        fig.add_layout(target)
        line_el = self.edited_line()
        if line_el is not None:
            fig.add_layout(Span(location=float(line_el.data), dimension="width",
                                line_color=theme.ACCENT, line_dash="dotted", line_width=2,
                                name="edited-share"))
        data, title = self._marker_state()
        marker = ColumnDataSource(data)
        fig.scatter("edges", "metric", source=marker, color="black", size=13, marker="diamond",
                    name="current-circuit")
        fig.title.text = title
        self._faith_figs.append((fig, marker, target))
        return theme.BokehPane(fig, sizing_mode="stretch_width")

    def _clicked(self, x: float | None = None, y: float | None = None) -> None:
        """A click on the graph: a node selects it (again: clears it) and highlights its
        edges; else an edge under the pointer is patched and selected in the workspace
        (`selected_edges`; a click on a selected edge deselects it); empty space clears the
        component selection."""
        if x is None or y is None:
            return
        L, H = self._model.n_layers, self._model.spec.n_heads
        xlim, ylim = _ranges(L, H)
        px_x = cg.FRAME_PX_1280 / (xlim[1] - xlim[0])
        px_y = (graph_height(H) - 70 - LEGEND_PX) / (ylim[1] - ylim[0])
        node = cg.nearest_node(x, y, self._pos, px_per_x=px_x, px_per_y=px_y)
        if node is not None:
            name = canonical(node)
            self.selected = "" if self.selected == name else name
            return
        row = cg.nearest_edge(x, y, self._table, px_per_x=px_x, px_per_y=px_y)
        if row is not None and self._table["status"][row] != "lost":
            src, dst = self._table["src"][row], self._table["dst"][row]
            self.edge = f"{src} → {dst}"
            name = str(components.edge(src, dst))
            self.selected_edges = ([e for e in self.selected_edges if e != name]
                                   if name in self.selected_edges else [*self.selected_edges, name])
        elif row is None:
            self.selected = ""

    # -- export ---------------------------------------------------------------------------
    def code_snippet(self) -> str:
        """Python that recomputes what the page shows: the task's pairs, the edge scores, the
        faithfulness curve, the shown circuit (pruned) and its edges, and, with workspace
        edits, the task metric of the edited model."""
        scores, _, label = self._current()
        own = self.task == OWN_TASK and self._own_task is not None
        lines = ["import explorer", "from explorer.analyses import circuits as ca"]
        if own:
            lines.append("from explorer.analyses import user_items")
        if self.edits:
            lines.append("from explorer.analyses.user_items import continuation_token")
        lines += ["", f"model = explorer.load_model({self._model.spec.name!r})"]
        if own:
            lines.append(f"task = user_items.parse_circuit_pairs({self._own_text!r}, model, "
                         f"name={OWN_TASK!r})")
        elif self.task == PROMPT_TASK and not self.counterfactual.strip():
            lines.append(f"task = ca.prompt_task(model, {self.prompt!r}, '', '', "
                         f"answer={self.explain!r}, name={PROMPT_TASK!r})  # mean ablation")
        elif self.task == PROMPT_TASK:
            word, _, by = self.counterfactual.partition("=")
            lines.append(f"task = ca.prompt_task(model, {self.prompt!r}, {word!r}, {by!r}, "
                         f"answer={self.explain!r}, name={PROMPT_TASK!r})")
        else:
            lines.append(f"task = ca.make_task({self.task!r}, {self.n_prompts}, seed=0)")
        n = "len(task)"
        method = self._shown_method if self.scores is not None else self.method
        lines.append(f"scores = ca.edge_scores(model, task, method={method!r}, batch_size={n})")
        if self.curve is not None:
            sizes = [int(v) for v in self.curve["n_edges"].values]
            lines.append(f"curve = ca.faithfulness_curve(model, task, scores, sizes={sizes}, "
                         f"batch_size={n})  # the faithfulness plot")
        if self.nodes_mode():
            lines.insert(1, "from explorer.analyses import circuit_select as cs")
            if self.node_curve is not None:
                k = [int(v) for v in self.node_curve["n_nodes"].values]
                lines.append(f"node_curve = cs.node_faithfulness_curve(model, task, scores, "
                             f"sizes={k}, batch_size={n})  # the node faithfulness plot")
            lines.append(f"circuit = cs.node_circuit(scores, {self.n_nodes})  # the top "
                         f"{self.n_nodes} nodes by |node score| and the edges between them")
        elif self.mode == "top-n":
            lines.append(f"circuit = ca.select_circuit(scores, top_n={self.n_edges})  "
                         "# the shown circuit, pruned to input -> logits paths")
        else:
            lines.append(f"circuit = ca.select_circuit(scores, threshold={self.threshold!r})  "
                         "# the shown circuit, pruned to input -> logits paths")
        lines.append("edges = sorted(ca.circuit_edges(scores, circuit))  # (src, dst) node names")
        if self._shown["size"] > MAX_DRAWN_EDGES:
            lines.append(f"# the page draws the strongest {MAX_DRAWN_EDGES} of them")
        lines.append(f"faithfulness = ca.patch_edges_metric(model, task, scores, circuit, "
                     f"batch_size={n})  # 'Patch all shown edges'")
        if self.edits:
            lines += [
                f"edits = explorer.edits_from_json({explorer.edits_to_json(self.edits)!r})",
                "ids = [[continuation_token(model.tokenizer, p, t) for t in (a, w)]",
                "       for p, a, w in zip(task.clean, task.answer, task.wrong)]",
                "",
                "def logit_diff(edits=()):  # per pair, on the clean prompts",
                "    last = explorer.run_with(model, task.clean, edits, positions=[-1])"
                "['logits'][:, 0]",
                "    return [float(last[i, a] - last[i, w]) for i, (a, w) in enumerate(ids)]",
                "",
                "clean, edited = logit_diff(), logit_diff(edits)  # the readout's clean vs edited"]
        if scores is not None and scores is not self.scores:
            lines.append(f"# the graph shows the fine-tuning checkpoint {label} "
                         "(explorer.analyses.circuit_lora.checkpoint_circuits)")
        return "\n".join(lines) + "\n"

    def circuit_csv(self) -> str:
        """The shown circuit's edges as CSV (source, target, score, patch effect): all of
        them, also those the influence pruning leaves undrawn (a diff: the drawn table)."""
        self._update_table()
        return cg.circuit_csv(self._circuit_table if self._circuit_table is not None
                              else self._table)

    def _csv_file(self) -> io.StringIO:
        return io.StringIO(self.circuit_csv())

    def _svg_file(self) -> io.StringIO:
        L, H = self._model.n_layers, self._model.spec.n_heads
        return io.StringIO(cg.circuit_svg(self._table, self.node_columns(), n_layers=L,
                                          n_heads=H, title=self._csv.filename[:-4]))

    # -- layout ---------------------------------------------------------------------------
    def _readout(self, *_: Any) -> str:
        return "\n\n".join(p for p in (self._ablation_text(), self._circuit_patch_text(),
                                        self._edited_text()) if p)

    def _circuit_patch_text(self) -> str:
        c = self.circuit_patch
        if c is None or c.get("key") != self._key():
            return ""
        more = (f" ({c['n_drawn']:,} of them drawn)" if c["n_shown"] > c["n_drawn"] else "")
        return (f"**Only the circuit's {c['n_shown']:,} edges kept**{more}, every other edge patched "
                f"to corrupted: metric **{c['metric']:.4f}**, **{c['recovered']:.0%}** of the "
                f"clean − corrupted gap recovered (clean {c['clean_metric']:.4f}, corrupted "
                f"{c['corrupt_metric']:.4f}); accuracy {c['accuracy']:.0%} (clean "
                f"{c['clean_accuracy']:.0%}).")

    def _ablation_text(self) -> str:
        a, s = self.ablation, self.scores
        if s is None:
            return "**Edge ablation:** waiting for the edge scores."
        if a is None:
            return ("**Edge ablation:** click an edge or choose one in the list to patch it to "
                    "its corrupted value.")
        change = a["metric"] - a["clean_metric"]
        return (f"**{a['edge']}** patched: metric **{a['metric']:.4f}** (clean "
                f"{a['clean_metric']:.4f}, corrupted {a['corrupt_metric']:.4f}); change "
                f"**{change:+.4f}**, EAP estimate {a['estimate']:+.4f}")

    def _edited_text(self) -> str:
        """The full model's task metric clean vs with the workspace edits."""
        e = self.edited
        if not self.edits:
            return ""
        if e is None:
            return "**Workspace edits:** the task metric with them follows the edge scores."
        what = ", ".join(e["labels"])
        return (f"**Full model with the workspace edits** ({what}): logit difference on the "
                f"clean prompts **{e['clean_metric']:.4f} → {e['edited_clean_metric']:.4f}** "
                f"(clean → edited), {e['recovered']:.0%} of the clean − corrupted gap kept; on "
                f"the corrupted prompts {e['corrupt_metric']:.4f} → "
                f"{e['edited_corrupt_metric']:.4f}. The graph and scores are of the unedited "
                "model.")

    def default_interval(self) -> tuple[float, float] | None:
        """95 % bootstrap interval over the pairs of the default circuit's recovered share
        (`circuit_select.bootstrap_recovered` on the curve's per-pair values), or None."""
        d, curve = self._default, self.curve
        if d is None or curve is None or "pair_metric" not in curve \
                or curve.sizes.get("prompt", 0) < 2:
            return None
        if self._boot is None or self._boot[0] != id(curve):
            self._boot = (id(curve), cs.bootstrap_recovered(curve))
        b = self._boot[1].sel(n_edges=d.n_edges)
        return float(b["recovered_low"]), float(b["recovered_high"])

    def node_default_interval(self) -> tuple[float, float] | None:
        """95 % bootstrap interval over the pairs of the node default's recovered share."""
        d, curve = self._node_default, self.node_curve
        if d is None or curve is None or curve.sizes.get("prompt", 0) < 2:
            return None
        if self._node_boot is None or self._node_boot[0] != id(curve):
            self._node_boot = (id(curve), cs.bootstrap_recovered(curve))
        b = self._node_boot[1].sel(n_nodes=d.n_edges)
        return float(b["recovered_low"]), float(b["recovered_high"])

    def node_default_text(self) -> str:
        """The node circuit's default in words, beside the edge circuit's node count (whether
        the node circuit is the smaller faithful picture)."""
        d = self._node_default
        if self.node_curve is None or d is None:
            return ("Node circuit: measuring the node circuits (every node outside the top k "
                    "patched to its corrupted output)…") if self.scores is not None else ""
        ci_ = self.node_default_interval()
        rec = f"**{d.recovered:.0%}**"
        if ci_ is not None:
            rec += (f" [{ci_[0]:.0%}, {ci_[1]:.0%}] (95 % bootstrap interval over the "
                    f"{self.node_curve.sizes['prompt']} pairs)")
        edge = self._default
        compare = ""
        if edge is not None and self.scores is not None:
            n_edge_nodes = len(ca.circuit_nodes(self.scores, ca.select_circuit(
                self.scores, top_n=edge.n_edges)))
            compare = (f" The default edge circuit ({edge.n_kept:,} edges, recovering "
                       f"{edge.recovered:.0%}) touches {n_edge_nodes:,} nodes.")
        if d.reached:
            return (f"Node circuit: the smallest measured set of nodes recovering at least "
                    f"{self.fraction:.0%} of the metric: {d.n_edges:,} nodes (top {d.n_edges:,} "
                    f"by |node score|; every other node's output patched to its corrupted "
                    f"value), recovering {rec}.{compare}")
        return (f"No measured node circuit recovers {self.fraction:.0%}. Shown is the most "
                f"faithful one: {d.n_edges:,} nodes, recovering {rec}.{compare}")

    def default_text(self) -> str:
        """The default circuit in words: its size, its measured recovery and interval; or
        that no measured circuit reaches the target, and the most faithful one's number."""
        if self.nodes_mode():
            return self.node_default_text()
        d = self._default
        if d is None or self.scores is None:
            return ""
        ci_ = self.default_interval()
        n_pairs = self.curve.sizes.get("prompt", 0) if self.curve is not None else 0
        rec = f"**{d.recovered:.0%}**"
        if ci_ is not None:
            rec += (f" [{ci_[0]:.0%}, {ci_[1]:.0%}] (95 % bootstrap interval over the "
                    f"{n_pairs} pairs)")
        size = f"{d.n_kept:,} edges (top {d.n_edges:,} by |score|, pruned)"
        cap = self.max_default_edges
        if cap is not None and d.n_kept > cap:
            return (f"No measured circuit of at most {cap:,} edges has an input → logits "
                    f"path; the default is the smallest that does: {size}, recovering {rec}.")
        if d.reached:
            within = "" if cap is None else f" within {cap:,} edges"
            return (f"Default: the smallest measured circuit{within} recovering at least "
                    f"{self.fraction:.0%} of the metric: {size}, recovering {rec}.")
        within = "" if cap is None else f" of at most {cap:,} edges"
        return (f"No measured circuit{within} recovers {self.fraction:.0%}. Shown is the most "
                f"faithful one: {size}, recovering {rec}.")

    def drawn_text(self) -> str:
        """What of the circuit is drawn, and the influence share the drawn edges carry."""
        size, n_drawn = self._shown["size"], self._shown["drawn"]
        if not size or (self.diff and self._table is not None
                        and np.isin(self._table["status"], ["gained", "lost"]).any()):
            return ""
        n_nodes = len(self._circuit_nodes())
        if self.nodes_mode():
            n_nodes = self._shown["chosen"]
        if self._influence is None:
            return (f"All {size:,} edges and {n_nodes:,} nodes of the circuit are drawn "
                    f"(100% of its influence on the logits).")
        return (f"Drawn: the {n_drawn:,} of its {size:,} edges that carry "
                f"**{self.influence_share():.1%}** of the circuit's influence on the logits "
                f"(influence pruning as in circuit-tracer: nodes to "
                f"{ci.NODE_THRESHOLD:.0%}, edges to {ci.EDGE_THRESHOLD:.0%} of the "
                f"influence); all {n_nodes:,} nodes of the circuit are drawn and labelled. "
                "Hover or click a node for all its circuit edges and its strongest paths "
                "from the input and to the logits (black).")

    def _circuit_nodes(self) -> set[str]:
        c = self._circuit_table
        return set() if c is None else set(c["src"].tolist()) | set(c["dst"].tolist())

    def _caption(self, *_: Any) -> str:
        """What the graph shows, in words (the title stays short)."""
        if self.scores is None and self.checkpoints is None:
            return ""
        self._update_table()
        parts = [self.default_text(), self.drawn_text()]
        if self.diff and self._diff_note:
            parts.append(f"Diff: {self._diff_note}.")
        elif self.diff:
            parts.append("Diff: green edges are gained, orange lost, grey kept.")
        parts.append("Heads are labelled H3 in their layer's column (hover for L17.H3) and "
                     "ordered by the score mass they carry (heaviest on top), fixed by the "
                     f"{self._layout_from or 'first scores'}. Click a node to pin it, an edge "
                     "to patch it.")
        parts.append(self._selection_text())
        return " ".join(p for p in parts if p)

    def _selection_text(self) -> str:
        """Where the selected component is in the graph (also when it is not in the circuit)."""
        if not self.selected:
            return ""
        if self.selected not in self._raw:
            return f"Selected: **{self.selected}** (not a node of this model's graph)."
        self._update_table()
        t = self._table
        if t is None:
            return f"Selected: **{self.selected}** (highlighted; its edges show once scored)."
        rows = np.flatnonzero(t["status"] == "outside")
        outside = ", ".join(f"{t['src'][i]} → {t['dst'][i]} ({t['score'][i]:+.3g})"
                            for i in rows)
        inside = self.selected in self._circuit_nodes()
        if not inside:
            if len(rows):
                return (f"**{self.selected}** has no edge in this circuit; its strongest edges "
                        f"(drawn in purple): {outside}.")
            return (f"**{self.selected}** has no edge in this circuit (tick \"Show the "
                    "selection's edges outside the circuit\" to draw its strongest ones).")
        c = self._circuit_table
        n = int(((c["src"] == self.selected) | (c["dst"] == self.selected)).sum())
        more = f" Its strongest edges outside the circuit (purple): {outside}." if len(rows) else ""
        return (f"Selected: **{self.selected}**; its edges in the circuit stand out: outlined, "
                f"its {n:,} circuit edges and its strongest paths from the input and to the "
                f"logits drawn over the graph.{more}")

    def _state_html(self, *_: Any) -> str:
        """Hidden markers of what the page shows (read by the browser test)."""
        self._update_table()
        t = self._table
        drawn = 0 if t is None else int((~np.isin(t["status"], ["lost", "outside"])).sum())
        metric = "none" if self.ablation is None else f"{self.ablation['metric']:.9g}"
        edge = "none" if self.ablation is None else self.ablation["edge"]
        n_ck = 0 if self.checkpoints is None else self.checkpoints.sizes["checkpoint"]
        d = self._default
        default = "none" if d is None else f"{d.n_edges} {d.n_kept} {d.recovered:.9g} {int(d.reached)}"
        interval = self.default_interval() if d is not None else None
        interval = "none" if interval is None else f"{interval[0]:.9g} {interval[1]:.9g}"
        e = self.edited
        edited = "none" if e is None else f"{e['clean_metric']:.9g} {e['edited_clean_metric']:.9g}"
        nd = self._node_default
        node_default = ("none" if nd is None else
                        f"{nd.n_edges} {nd.recovered:.9g} {int(nd.reached)}")
        c = self.circuit_patch
        patched = "none" if c is None else f"{c['n_shown']} {c['metric']:.9g} {c['recovered']:.9g}"
        return (f"<div class='circuit-state' data-circuit-scores="
                f"'{'ready' if self.scores is not None else 'none'}' "
                f"data-circuit-method='{self.method}' "
                f"data-circuit-edges='{drawn}' data-circuit-size='{self._shown['size']}' "
                f"data-circuit-chosen='{self._shown['chosen']}' data-circuit-mode='{self.mode}' "
                f"data-circuit-fraction='{self.fraction:.6g}' data-circuit-default='{default}' "
                f"data-circuit-cap='{self.max_default_edges}' "
                f"data-circuit-interval='{interval}' "
                f"data-circuit-share='{self.influence_share():.9g}' "
                f"data-circuit-nodes='{len(self._circuit_nodes())}' "
                f"data-circuit-selected='{self.selected}' "
                f"data-circuit-outside='{len(self._outside)}' "
                f"data-circuit-metric='{metric}' "
                f"data-circuit-ablated='{edge}' data-circuit-redraw-ms='{self.redraw_ms:.1f}' "
                f"data-circuit-redraw-cpu-ms='{self.redraw_cpu_ms:.1f}' "
                f"data-circuit-edited='{edited}' data-circuit-patched-all='{patched}' "
                f"data-circuit-granularity='{self.granularity}' "
                f"data-circuit-n-nodes='{self.n_nodes}' "
                f"data-circuit-node-default='{node_default}' "
                f"data-circuit-floor='{'ready' if self.noise_floor is not None else 'none'}' "
                f"data-circuit-checkpoints='{n_ck}'></div>")

    def _prompt_controls(self) -> pn.Column:
        """The token strip and the replacement box, shown for the task 'your prompt'."""
        col = pn.Column(
            pn.pane.Markdown("Click the word to replace, then type its replacement (no "
                             "counterfactual: mean ablation):", margin=(4, 10, 0, 10)),
            self._strip, pn.widgets.TextInput.from_param(self.param.replacement),
            visible=self.task == PROMPT_TASK, sizing_mode="stretch_width")
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
                 self.param.noise_floor]
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


def slider_redraw_times(model: explorer.Model, task: ca.CircuitTask, scores: xr.Dataset,
                        moves: int = 20) -> dict[str, float]:
    """Server-side time of a slider move on the Circuits page (`explorer bench eap`).

    The page is attached to a Bokeh Document (as in a served session, with the document as
    ``pn.state.curdoc``) and given ``scores``; its faithfulness curve is stood in by the
    pruned sizes of the slider's positions (no patching: only drawing is timed). Each move
    sets the slider to a position not visited before (no cached circuit), in a fixed
    shuffled order, and is timed from the widget's value change until every pane has been
    updated: re-pruning (`select_circuit`), the edge table, the graph's data source and the
    faithfulness marker's Bokeh updates.
    Checks that the drawn segments equal the page's circuit after each move.
    """
    from bokeh.document import Document
    from panel.io.state import set_curdoc

    n = int(scores.sizes["edge"])
    sizes = [0, *size_grid(n).tolist()]
    kept = [int(ca.select_circuit(scores, top_n=k).sum()) for k in sizes]
    curve = xr.Dataset({"recovered": ("n_edges", np.array(kept) / n),
                        "n_kept": ("n_edges", np.array(kept))}, coords={"n_edges": sizes})
    view = CircuitsView(model, background=False, autostart=False)
    doc = Document()
    with set_curdoc(doc):
        doc.add_root(pn.panel(view).get_root(doc))
        view._got_scores((view._key(), task, scores, curve))
        options = list(view._slider.options.values())
        start = options.index(view._slider.value)
        order = [i for i in np.random.default_rng(0).permutation(len(options)) if i != start]
        wall, cpu = [], []
        for i in order[:moves]:
            t0, c0 = time.perf_counter(), time.thread_time()
            view._slider.value = options[i]
            wall.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
            drawn = [len(r.data_source.data["x0"]) for r in doc.select({"name": "edges"})]
            if drawn != [view._shown["drawn"]] or view.n_edges != options[i]:
                raise RuntimeError(f"slider move to {options[i]} drew {drawn} segments, "
                                   f"expected {view._shown['drawn']}")
    return {"slider_redraw_ms": float(np.median(wall)) * 1e3,
            "slider_redraw_cpu_ms": float(np.median(cpu)) * 1e3,
            "slider_redraw_max_cpu_ms": float(np.max(cpu)) * 1e3,
            "slider_moves": len(cpu)}


serve(__name__, CircuitsView, title="Circuits: edge attribution and fine-tuning", intro="circuits")
