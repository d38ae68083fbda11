"""Streaming-parity page: scrub through the training of a parity RNN and watch its automaton form.

van Rossem & Saxe (ICML 2025): a small-init ReLU RNN trained on the parity of all binary strings
of length 1-10 first spreads its hidden states into a tree, then merges states whose futures
agree until a 2-state automaton remains, and from then on computes parity at any length. The
training-step slider drives every panel: the PCA of the hidden states (coloured by parity or
length), the automaton of merged states (or its Hopcroft-minimised form) drawn as a graph, the
accuracy against string length up to 10,000, and the automaton size, loss and long-string
accuracy over training with the current step marked.

The hidden states, the automaton and the summary are drawn at once from the step, threshold
and length controls, so their words are of those controls. The automaton sizes over training
are recomputed in the background when the threshold or length changes; their record
(`curves_record`: the run, the threshold and length they were merged at, when) writes their
caption, the page's code and the export's manifest, and a note marks them outdated until the
new counts land.
"""
from __future__ import annotations

import functools
from collections import deque
from typing import Any

import holoviews as hv
import numpy as np
import panel as pn
import param
import xarray as xr

from apps import theme
from apps._controls import caption, control, flex_row, run_page, show_steps, training_step
from apps._lab_provenance import (LabInput, drawn_as, lab_record, lab_stale_text,
                                  recompute_state, stale_pane, stamped)
from apps._paper import paper_panel
from apps._parity_phase import phase_caption, plot_phase_diagram
from apps._provenance import Provenance
from apps._recipe import Call, Expr, Note, Recipe, Ref, Step
from apps._session import CancelToken
from apps._view import ZOOM_TOOLS, Scope, View, serve, shown_dataset
from explorer.analyses.parity import DEFAULTS as PARITY_DEFAULTS
from explorer.analyses.parity import (
    parity_automaton,
    parity_automaton_sizes,
    parity_hidden_pca,
    parity_run,
    stored_parity_analysis,
    stored_parity_phase_diagram,
)

__all__ = ["ParityView", "plot_hidden_pca", "plot_automaton", "plot_accuracy_by_length",
           "plot_state_curves", "plot_loss_curve", "plot_long_accuracy_curves",
           "plot_training_curves", "plot_phase_diagram", "automaton_caption", "accuracy_caption",
           "curves_caption", "phase_caption", "CURVES_INPUTS", "run_name"]

hv.extension("bokeh", logo=False)

_TOOLS = ZOOM_TOOLS
#: How the stale note names the inputs of the automaton sizes over training.
CURVES_INPUTS = {"threshold": LabInput("the merge threshold", "merge threshold {:g}"),
                 "max_length": LabInput("the longest analysed string",
                                        "strings up to {} symbols")}


def run_name(run: xr.Dataset) -> str:
    """The parity RNN of ``run`` in a record: its size and seed."""
    return (f"the parity RNN ({run.attrs.get('params', {}).get('hidden_size', '?')} ReLU units, "
            f"seed {run.attrs.get('seed', 0)})")


_PARITY_COLORS = {"even": theme.CATEGORICAL[0], "odd": theme.CATEGORICAL[1]}
_SYMBOL_COLORS = {0: theme.CATEGORICAL[2], 1: theme.CATEGORICAL[3]}


_font = theme.font_sizes


_placeholder = functools.partial(theme.placeholder, height=320)


# -- plots (pure: Datasets in, HoloViews out) ------------------------------------------------

def plot_hidden_pca(pca: xr.Dataset | None, color_by: str = "parity") -> hv.Element:
    """Hidden state of every prefix in the plane of the first two principal components."""
    if pca is None:
        return _placeholder("No run yet.")
    pc = pca["pc"].values
    second = pc[:, 1] if pc.shape[1] > 1 else np.zeros(len(pc))
    data = {"PC1": pc[:, 0], "PC2": second, "string": [s or "(start)" for s in pca["string"].values],
            "length": pca["length"].values,
            "parity": np.where(pca["parity"].values == 1, "odd", "even")}
    ratio = pca["explained_variance_ratio"].values
    points = hv.Points(data, ["PC1", "PC2"], ["string", "length", "parity"])
    step = pca.attrs.get("params", {}).get("step")
    common = dict(responsive=True, height=360, size=6, tools=["hover"], default_tools=_TOOLS,
                  active_tools=["wheel_zoom"], fontsize=_font(), line_color="white", line_width=0.3,
                  xlabel=f"PC1 ({ratio[0]:.0%} of variance)",
                  ylabel=f"PC2 ({ratio[1]:.0%} of variance)" if len(ratio) > 1 else "PC2",
                  title=f"Hidden states, step {step}")
    if color_by == "length":
        return points.opts(color="length", cmap=theme.MAGNITUDE_CMAP, colorbar=True,
                           clabel="string length", **common)
    return points.opts(color="parity", cmap=_PARITY_COLORS, show_legend=True,
                       legend_position="right", **common)


def _layout(transitions: np.ndarray, initial: int) -> np.ndarray:
    """Node positions: x = breadth-first depth from the start, y spread within each depth."""
    n = transitions.shape[0]
    depth = np.full(n, -1)
    depth[initial] = 0
    order = [initial]
    queue = deque([initial])
    while queue:
        q = queue.popleft()
        for t in transitions[q]:
            if t >= 0 and depth[t] < 0:
                depth[t] = depth[q] + 1
                order.append(int(t))
                queue.append(int(t))
    depth[depth < 0] = depth.max() + 1  # unreachable (not drawn by the analyses, but be safe)
    seen = set(order)
    order += [q for q in range(n) if q not in seen]
    pos = np.zeros((n, 2))
    for level in np.unique(depth):
        members = [q for q in order if depth[q] == level]
        k = len(members)
        for i, q in enumerate(members):
            pos[q] = (float(level), (i - (k - 1) / 2) / max(1, k - 1) * min(k - 1, 8) if k > 1 else 0.0)
    return pos


def _edge_curve(p0: np.ndarray, p1: np.ndarray, bend: float, n: int = 24) -> np.ndarray:
    """Quadratic Bezier from p0 to p1, its control point pushed sideways by ``bend``."""
    mid = (p0 + p1) / 2
    d = p1 - p0
    normal = np.array([-d[1], d[0]]) / (np.hypot(*d) or 1.0)
    ctrl = mid + bend * normal
    t = np.linspace(0, 1, n)[:, None]
    return (1 - t) ** 2 * p0 + 2 * (1 - t) * t * ctrl + t**2 * p1


def _loop(p: np.ndarray, symbol: int, radius: float, n: int = 24) -> np.ndarray:
    """A small circle touching the node: above for symbol 0, below for symbol 1."""
    sign = 1 if symbol == 0 else -1
    centre = p + np.array([0.0, sign * radius])
    angle = np.linspace(0, 2 * np.pi, n) - sign * np.pi / 2
    return centre + radius * np.stack([np.cos(angle), np.sin(angle)], axis=1)


def plot_automaton(auto: xr.Dataset | None, minimal: bool = False) -> hv.Element:
    """The automaton as a graph: nodes coloured by output parity, edges by input symbol."""
    if auto is None:
        return _placeholder("No run yet.")
    if minimal:
        trans = auto["min_transitions"].values
        output = auto["min_output"].values
        initial = 0
        state_of = auto["minimal_state"].values[auto["state_of"].values]
        members = np.bincount(state_of[state_of >= 0], minlength=len(output))
    else:
        trans = auto["transitions"].values
        output = auto["output"].values
        initial = int(auto.attrs["initial"])
        members = auto["n_members"].values
        state_of = auto["state_of"].values
    n = len(output)
    strings = auto["string"].values
    example = ["" for _ in range(n)]
    for i in range(len(state_of) - 1, -1, -1):  # the shortest (first) prefix of each state
        if state_of[i] >= 0:
            example[state_of[i]] = strings[i] or "(start)"
    pos = _layout(trans, initial)
    span = max(1.0, float(np.ptp(pos[:, 0])))
    radius = 0.12 * span / max(1.0, np.sqrt(n))
    paths: dict[int, list[np.ndarray]] = {0: [], 1: []}
    heads: list[tuple[float, float, float, int]] = []
    for q in range(n):
        for a in (0, 1):
            t = int(trans[q, a])
            if t < 0:
                continue
            if t == q:
                curve = _loop(pos[q], a, radius)
            else:
                curve = _edge_curve(pos[q], pos[t], bend=0.15 * (1 if a == 0 else -1) *
                                    float(np.hypot(*(pos[t] - pos[q]))))
            paths[a].append(curve)
            j = int(0.8 * (len(curve) - 1))
            dx, dy = curve[j + 1] - curve[j - 1]
            heads.append((curve[j, 0], curve[j, 1], float(np.arctan2(dy, dx) - np.pi / 2), a))
    overlay = []
    for a in (0, 1):
        if paths[a]:
            overlay.append(hv.Path(paths[a], label=f"reads {a}").opts(
                color=_SYMBOL_COLORS[a], line_width=1.5 if n < 60 else 0.7, alpha=0.8))
    if heads:
        h = np.asarray(heads)
        overlay.append(hv.Points({"x": h[:, 0], "y": h[:, 1], "angle": h[:, 2],
                                  "symbol": h[:, 3].astype(int)}, ["x", "y"], ["angle", "symbol"]).opts(
            marker="triangle", angle=hv.dim("angle"), size=8 if n < 60 else 4,
            color=hv.dim("symbol").categorize({0: _SYMBOL_COLORS[0], 1: _SYMBOL_COLORS[1]}),
            line_color=None))
    size = 10 + 14 * np.sqrt(members / max(1, members.max())) if n < 60 else np.full(n, 6.0)
    nodes = hv.Points({"x": pos[:, 0], "y": pos[:, 1], "state": np.arange(n),
                       "output": np.where(output == 1, "odd", "even"), "members": members,
                       "example": example, "size": size, "start": np.arange(n) == initial},
                      ["x", "y"], ["state", "output", "members", "example", "size", "start"])
    overlay.append(nodes.opts(color="output", cmap=_PARITY_COLORS, size="size", line_color="black",
                              line_width=hv.dim("start").categorize({True: 3, False: 0.5}),
                              tools=["hover"]))
    if n <= 30:
        overlay.append(hv.Labels({"x": pos[:, 0], "y": pos[:, 1], "text": [str(i) for i in range(n)]},
                                 ["x", "y"], "text").opts(text_font_size="8pt", text_color="white"))
    for a in (0, 1):  # legend entries for the edge colours (a one-point curve draws nothing)
        overlay.append(hv.Curve([(pos[initial, 0], pos[initial, 1])], label=f"reads {a}").opts(
            color=_SYMBOL_COLORS[a], line_width=2))
    kind = "Minimal automaton" if minimal else "Merged automaton"
    return hv.Overlay(overlay).opts(
        responsive=True, height=360, xaxis=None, yaxis=None, default_tools=_TOOLS,
        active_tools=["wheel_zoom"], fontsize=_font(), legend_position="right",
        title=f"{kind}, step {auto.attrs['params']['step']}", padding=0.15)


def automaton_caption(pca: xr.Dataset | None, auto: xr.Dataset | None, minimal: bool = False) -> str:
    """The numbers behind the two top plots: strings analysed, states merged and minimal."""
    if auto is None:
        return ""
    n, n_min = auto.attrs["n_states"], auto.attrs["n_states_minimal"]
    shape = "finite" if auto.attrs["finite"] else "not finite (a tree)"
    longest = int(pca["length"].max()) if pca is not None else auto.attrs["params"].get("max_length")
    shown = "its Hopcroft-minimised form" if minimal else "the merged states"
    return (f"**Hidden states (first plot):** the hidden state after every prefix of the strings of up to {longest} symbols, "
            "in its first two principal components. **Automaton (second plot):** the automaton read off those states: "
            f"{n} merged states ({shape}), {n_min} after Hopcroft minimisation; drawn: {shown}. Node "
            "colour = output parity, size = prefixes merged, thick outline = start; edges coloured by "
            "the symbol read.")


def plot_accuracy_by_length(analysis: xr.Dataset | None, step: int | None) -> hv.Element:
    """Accuracy on random strings of each length at one checkpoint (log length axis)."""
    if analysis is None or step is None or step not in analysis["step"].values:
        return _placeholder("No analysis loaded yet.", height=300)
    acc = analysis["accuracy"].sel(step=step)
    lengths = analysis["length"].values
    trained = int(analysis.attrs.get("params", {}).get("run_params", {}).get("max_length", 10))
    curve = hv.Curve((lengths, acc.values), "string length", "accuracy").opts(
        color=theme.ACCENT, line_width=2)
    dots = hv.Scatter((lengths, acc.values), "string length", "accuracy").opts(
        color=theme.ACCENT, size=7, tools=["hover"])
    chance = hv.HLine(0.5).opts(color="grey", line_dash="dashed", line_width=1)
    seen = hv.VLine(trained).opts(color="black", line_dash="dotted", line_width=1)
    return (curve * dots * chance * seen).opts(
        logx=True, ylim=(-0.02, 1.05), responsive=True, height=300, default_tools=_TOOLS,
        fontsize=_font(), xlabel="string length (log)", title=f"Accuracy by length, step {step}")


def accuracy_caption(analysis: xr.Dataset | None, step: int | None) -> str:
    """What the accuracy plot shows."""
    if analysis is None or step is None or step not in analysis["step"].values:
        return ""
    trained = int(analysis.attrs.get("params", {}).get("run_params", {}).get("max_length", 10))
    n = analysis.attrs.get("params", {}).get("n_strings")
    acc = analysis["accuracy"].sel(step=step)
    return (f"Accuracy on {n} random strings per length at step {step}; the dotted line is the longest "
            f"training string ({trained}), the dashed line chance (0.5). Worst length: "
            f"{float(acc.min()):.0%}.")


def _curve_opts() -> dict:
    return dict(responsive=True, height=260, default_tools=_TOOLS, fontsize=_font(),
                xlabel="training step", tools=["hover"])


def plot_state_curves(analysis: xr.Dataset | None, step: int | None) -> hv.Element:
    """Merged and minimal automaton size over training (log), the step shown and the
    transition to the parity automaton marked."""
    if analysis is None:
        return _placeholder("No analysis loaded yet.", height=280)
    steps = analysis["step"].values
    transition = analysis.attrs.get("transition_step")
    sizes = (hv.Curve((steps, analysis["n_states"].values), "training step", "states",
                      label="merged").opts(color=theme.CATEGORICAL[0], line_width=2)
             * hv.Curve((steps, analysis["n_states_minimal"].values), "training step", "states",
                        label="minimal").opts(color=theme.CATEGORICAL[1], line_width=2)
             * theme.step_marker(steps, step))
    if transition is not None:
        sizes = sizes * hv.VLine(float(transition)).opts(color=theme.CATEGORICAL[1], line_width=1,
                                                          alpha=0.6)
    return sizes.opts(logy=True, legend_position="right", title="Automaton states", **_curve_opts())


def plot_loss_curve(analysis: xr.Dataset | None, step: int | None) -> hv.Element:
    """Training loss over training (log), the step shown marked."""
    if analysis is None:
        return _placeholder("No analysis loaded yet.", height=280)
    steps = analysis["step"].values
    return (hv.Curve((steps, np.maximum(analysis["train_loss"].values, 1e-12)), "training step",
                     "training MSE").opts(color=theme.ACCENT, line_width=2)
            * theme.step_marker(steps, step)).opts(logy=True, title="Training loss", **_curve_opts())


def plot_long_accuracy_curves(analysis: xr.Dataset | None, step: int | None) -> hv.Element:
    """Accuracy at the longest test length and at the worst length over training."""
    if analysis is None:
        return _placeholder("No analysis loaded yet.", height=280)
    steps = analysis["step"].values
    longest = int(analysis["length"].values[-1])
    return (hv.Curve((steps, analysis["accuracy"].sel(length=longest).values), "training step",
                     "accuracy", label=f"{longest:,}").opts(color=theme.CATEGORICAL[0], line_width=2)
            * hv.Curve((steps, analysis["accuracy"].min("length").values), "training step", "accuracy",
                       label="worst").opts(color=theme.CATEGORICAL[1], line_width=1.5, line_dash="dotdash")
            * theme.step_marker(steps, step)).opts(ylim=(-0.02, 1.05), legend_position="right",
                                                   title="Long-string accuracy", **_curve_opts())


def plot_training_curves(analysis: xr.Dataset | None, step: int | None) -> hv.Element:
    """Automaton size, training loss and long-string accuracy over training; step marked."""
    if analysis is None:
        return _placeholder("No analysis loaded yet.", height=280)
    return hv.Layout([plot_state_curves(analysis, step), plot_loss_curve(analysis, step),
                      plot_long_accuracy_curves(analysis, step)]).cols(3).opts(shared_axes=False)


def curves_caption(analysis: xr.Dataset | None, record: Provenance | None = None) -> str:
    """What the curves over training show, with the transition and generalisation steps;
    ``record``: the threshold and length the state counts were merged at."""
    if analysis is None:
        return ""
    a = analysis.attrs
    longest = int(analysis["length"].values[-1])
    transition = a.get("transition_step")
    merged = ""
    if record is not None:
        r = dict(record.request)
        merged = (f" (the states of the strings up to {r['max_length']} symbols, merged at "
                  f"threshold {r['threshold']:g})")
    return ("Over training (the dashed line is the step shown): the number of merged and of "
            f"Hopcroft-minimal automaton states{merged} (log), the training MSE, and the accuracy "
            f"at length {longest:,} and at the worst tested length. "
            + (f"The 2-state parity automaton appears at step {transition} (faint line); "
               if transition is not None else "The parity automaton never appears in this run; ")
            + f"every length is solved from step {a.get('generalisation_step')}.")


def _parity(auto: xr.Dataset) -> bool:
    return (auto.attrs["n_states_minimal"] == 2 and auto.attrs["finite"]
            and auto["min_transitions"].values.tolist() == [[0, 1], [1, 0]]
            and auto["min_output"].values.tolist() == [0, 1])


# -- the view --------------------------------------------------------------------------------

class ParityView(View):
    """A parity RNN's training, checkpoint by checkpoint: hidden states, automaton, accuracy.

    Parameters
    ----------
    model : explorer.Model, optional
        Ignored (the gallery passes its language model; this page trains its own RNN).
    run : xarray.Dataset, optional
        A run from `explorer.analyses.parity.train_parity_rnn`. Default: the stored run with
        the paper's settings (trained on first use, a few minutes on a laptop CPU).
    analysis : xarray.Dataset, optional
        Its `parity_analysis`; computed (and stored) when not given.
    phase : xarray.Dataset, optional
        A `parity_phase_diagram`; default: the stored one for the default grid, if any.
    background : bool, optional
        Compute in a worker thread (default when served) or inline (tests, notebooks).
    """

    notify_title = "Parity"
    link_params = ("threshold", "max_length", "minimal", "color_by")

    def scope(self) -> Scope:
        """Its own parity RNN on binary strings; the workspace's model is not involved."""
        return Scope(on="its own ReLU RNN trained on the parity of binary strings (lengths "
                        "1-10), not your prompt",
                     edits="not applicable: the page studies a separate toy RNN, not the "
                           "workspace's language model")

    step = training_step(doc="Checkpoint shown in every panel: the hidden states, the automaton, "
                             "the accuracy by length and the dashed markers on the curves.")
    threshold = param.Number(default=0.01, bounds=(0.001, 0.2), step=0.001, label="Merge threshold",
                             doc="Hidden states closer than this fraction of their spread merge into "
                                 "one automaton state (the automaton and the state counts over "
                                 "training follow).")
    max_length = param.Integer(default=8, bounds=(2, 9), label="Longest analysed string",
                               doc="The hidden states of all strings up to this length are drawn and "
                                   "merged into the automaton.")
    minimal = param.Boolean(default=False, label="Show the Hopcroft-minimised automaton",
                            doc="Draw the automaton after Hopcroft minimisation (equivalent states "
                                "joined) instead of the merged hidden states.")
    color_by = param.Selector(default="parity", objects=["parity", "length"], label="Colour states by",
                              doc="Colour the hidden states in the PCA plot by the parity of their "
                                  "prefix or by its length.")

    run = shown_dataset()
    analysis = shown_dataset()
    sizes = shown_dataset()
    phase = shown_dataset()
    curves_record = param.ClassSelector(
        class_=Provenance, default=None, allow_None=True, precedence=-1,
        doc="What the automaton sizes over training were computed on.")

    def __init__(self, model: Any = None, *, run: xr.Dataset | None = None,
                 analysis: xr.Dataset | None = None, phase: xr.Dataset | None = None,
                 background: bool | None = None, **params: Any):
        super().__init__(background=background, **params)
        self._phase_given = phase is not None
        self.phase = phase
        self.bound_cache("views", max_items=64)   # PCA and automata: 64 entries, 256 MB at most
        self.runner("load", self._loaded)
        self.runner("sizes", self._sized)
        self.param.watch(self._request_sizes, ["threshold", "max_length"])
        if run is not None:
            self._use_run(run)
        if analysis is not None:
            self.analysis = analysis
            if run is not None:
                self._follow_analysis()
        if run is None or analysis is None or phase is None:
            self.param.update(running=True, status="Loading the stored parity run…")
            self.submit("load", lambda token: self._load(run, analysis, token))

    # -- computation ---------------------------------------------------------------------
    def _load(self, run: xr.Dataset | None, analysis: xr.Dataset | None,
              token: CancelToken) -> dict[str, xr.Dataset]:
        progress = self.status_reporter(
            token, lambda done, total, s: f"Training the parity RNN: epoch {done}/{total} ({s:.0f} s)…")
        if run is None:
            self.post(status="Loading the stored parity run (training it if missing)…")
            run = parity_run(progress=progress)
        token.check()
        self.post(status="Measuring automata and long-string accuracy at every checkpoint…")
        if analysis is None:
            analysis = stored_parity_analysis(run)
        # The phase diagram takes minutes: shown only when stored (`explorer parity phase`).
        phase = self.phase if self._phase_given else stored_parity_phase_diagram(compute=False)
        return {"run": run, "analysis": analysis, "phase": phase}

    def _use_run(self, run: xr.Dataset) -> None:
        keep = show_steps(self, run)
        with param.parameterized.discard_events(self):
            self.run = run
            self.step = keep
        self.param.trigger("step")

    def _loaded(self, out: dict[str, xr.Dataset]) -> None:
        run = self.run if self.run is not None else out["run"]
        p = out["run"].attrs.get("params", {})
        self.param.update(running=False, status=(
            f"{p.get('hidden_size', '?')} ReLU units, seed {out['run'].attrs.get('seed')}, "
            f"{int(out['run'].sizes['step'])} checkpoints"
            + (", shipped (float16)." if "source" in out["run"].attrs else ".")))
        keep = show_steps(self, run)
        # One batch of events: each plot is drawn once with everything in place.
        with param.parameterized.discard_events(self):
            self.param.update(run=run, step=keep, analysis=out["analysis"], phase=out["phase"])
        self.param.trigger("run", "step", "analysis", "phase")
        self._follow_analysis()

    # -- what the automaton sizes over training were computed on -------------------------
    def curves_request(self) -> Provenance | None:
        """The record of the automaton sizes the page would compute from its controls now."""
        if self.run is None:
            return None
        return lab_record("parity", run_name(self.run), {
            "threshold": float(self.threshold), "max_length": int(self.max_length)})

    def _follow_analysis(self) -> None:
        """The analysis's state counts are shown: their record; recounted at once when the
        controls ask for another threshold or length (a link's, say)."""
        p = self.analysis.attrs.get("params", {})
        record = lab_record("parity", run_name(self.run), {
            "threshold": float(p.get("threshold", 0.01)), "max_length": int(p.get("max_length", 8))})
        self.param.update(sizes=None, curves_record=stamped(record))
        if dict(self.curves_record.request) != dict(self.curves_request().request):
            self._request_sizes()

    def shown_provenance(self) -> Provenance | None:
        """The record of the sizes over training, with the checkpoint, threshold and length
        the hidden states and the automaton are drawn at (drawn at once from the controls)."""
        return drawn_as(self.curves_record, {
            "step": self.step, "drawn_threshold": float(self.threshold),
            "drawn_max_length": int(self.max_length), "minimal": self.minimal,
            "color_by": self.color_by})

    def requested_provenance(self) -> Provenance | None:
        return self.curves_request()

    def stale_note(self, *_: Any) -> str:
        """'' while the sizes over training are of the controls; else what they were computed
        on and that the new ones are on their way (or failed)."""
        return lab_stale_text(self.curves_record, self.curves_request(), CURVES_INPUTS,
                              state=recompute_state(self, "sizes"))

    def _request_sizes(self, *events: Any) -> None:
        if self.run is None:
            return
        run, threshold, max_length = self.run, self.threshold, self.max_length
        wanted = self.curves_request()
        self.submit("sizes", lambda token: (parity_automaton_sizes(
            run, max_length=max_length, threshold=threshold,
            progress=lambda done, total: not token.cancelled), wanted))

    def _sized(self, out: tuple[xr.Dataset, Provenance]) -> None:
        sizes, wanted = out
        self.param.update(sizes=sizes, curves_record=stamped(wanted), error="")

    def _cached(self, kind: str, *key: Any) -> xr.Dataset | None:
        if self.run is None or self.step is None:
            return None
        run, step = self.run, self.step

        def compute() -> xr.Dataset:
            if kind == "pca":
                return parity_hidden_pca(run, step, max_length=key[0])
            return parity_automaton(run, step, max_length=key[0], threshold=key[1])
        return self.cached("views", (kind, step, *key), compute)

    @param.depends("run", "step", "max_length")
    def pca(self) -> xr.Dataset | None:
        """PCA of the hidden states at the current step."""
        return self._cached("pca", self.max_length)

    @param.depends("run", "step", "max_length", "threshold")
    def automaton(self) -> xr.Dataset | None:
        """The automaton at the current step."""
        return self._cached("automaton", self.max_length, self.threshold)

    @param.depends("analysis", "sizes")
    def curves(self) -> xr.Dataset | None:
        """The analysis over training, with sizes for the current threshold if recomputed."""
        if self.analysis is None:
            return None
        if self.sizes is None:
            return self.analysis
        sizes = self.sizes[["n_states", "n_states_minimal"]]
        out = self.analysis.assign(n_states=sizes["n_states"], n_states_minimal=sizes["n_states_minimal"])
        out.attrs = {**self.analysis.attrs, "transition_step": self.sizes.attrs["transition_step"]}
        return out

    @param.depends("run", "step", "max_length", "color_by")
    def _pca_plot(self) -> hv.Element:
        return plot_hidden_pca(self.pca(), self.color_by)

    @param.depends("run", "step", "max_length", "threshold", "minimal")
    def _automaton_plot(self) -> hv.Element:
        return plot_automaton(self.automaton(), self.minimal)

    @param.depends("analysis", "step")
    def _accuracy_plot(self) -> hv.Element:
        return plot_accuracy_by_length(self.analysis, self.step)

    @param.depends("analysis", "sizes", "step")
    def _curves_plot(self) -> hv.Element:
        return plot_training_curves(self.curves(), self.step)

    @param.depends("phase")
    def _phase_plot(self) -> hv.Element:
        return plot_phase_diagram(self.phase)

    @param.depends("phase")
    def _phase_caption(self) -> str:
        return phase_caption(self.phase)

    @param.depends("analysis", "sizes", "step")
    def _states_plot(self) -> hv.Element:
        return plot_state_curves(self.curves(), self.step)

    @param.depends("analysis", "step")
    def _loss_plot(self) -> hv.Element:
        return plot_loss_curve(self.analysis, self.step)

    @param.depends("analysis", "step")
    def _long_plot(self) -> hv.Element:
        return plot_long_accuracy_curves(self.analysis, self.step)

    @param.depends("analysis", "sizes", "curves_record")
    def _curves_caption(self) -> str:
        return curves_caption(self.curves(), self.curves_record)

    @param.depends("run", "step", "max_length", "threshold", "minimal")
    def _automaton_caption(self) -> str:
        return automaton_caption(self.pca(), self.automaton(), self.minimal)

    @param.depends("analysis", "step")
    def _accuracy_caption(self) -> str:
        return accuracy_caption(self.analysis, self.step)

    @param.depends("run", "step", "max_length", "threshold", "analysis", "minimal")
    def summary(self) -> str:
        """One line on the current checkpoint: automaton, loss, long-string accuracy (drawn
        at once from the controls: its words are of them)."""
        auto = self.automaton()
        if auto is None:
            return "No run loaded yet."
        at = self.run.sel(step=self.step)
        text = (f"**Step {self.step}** (epoch {int(at['epoch'])}): {auto.attrs['n_states']} merged "
                f"states ({'finite' if auto.attrs['finite'] else 'not finite'}), "
                f"{auto.attrs['n_states_minimal']} after Hopcroft minimisation"
                f"{' — the parity automaton' if _parity(auto) else ''}; training MSE "
                f"{float(at['train_loss']):.2g}")
        if self.analysis is not None and self.step in self.analysis["step"].values:
            acc = self.analysis["accuracy"].sel(step=self.step)
            longest = int(acc["length"].values[-1])
            text += f"; accuracy at length {longest:,}: {float(acc.isel(length=-1)):.0%}"
        shown = "minimal automaton" if self.minimal else "merged automaton"
        return text + f". Graph: {shown}."

    # -- reproducibility -----------------------------------------------------------------
    def code_recipe(self) -> Recipe:
        """What the page shows at the current step as records: the run, its analysis over
        training, the hidden-state PCA and the automaton (and the state counts for a threshold
        or length other than the analysis's)."""
        if self.run is None or self.step is None:
            return Recipe(steps=[Note("The parity run is still loading.")])
        pa = "explorer.analyses.parity"
        params = dict(self.run.attrs.get("params", {}))
        seed = int(self.run.attrs.get("seed", 0))
        if params.get("from_models"):
            load: Step = Expr("run", "...", "the page's run was built from networks given to it "
                              "(parity_run_from_models); pass the same networks")
        elif set(params) <= set(PARITY_DEFAULTS):
            load = Call("run", f"{pa}.parity_run", (), {
                k: v for k, v in {**params, "seed": seed}.items() if PARITY_DEFAULTS.get(k) != v},
                "from the cache folder, the shipped file or trained (seeded)")
        else:
            load = Call("run", f"{pa}.train_parity_rnn", (), {**params, "seed": seed})
        at = {"max_length": self.max_length, "threshold": self.threshold}
        steps = [load,
                 Call("analysis", f"{pa}.stored_parity_analysis", (Ref("run"),),
                      comment="automaton sizes and long-string accuracy"),
                 Call("pca", f"{pa}.parity_hidden_pca", (Ref("run"), self.step),
                      {"max_length": self.max_length}),
                 Call("automaton", f"{pa}.parity_automaton", (Ref("run"), self.step), at,
                      ".attrs['n_states'], ['n_states_minimal']")]
        if self.sizes is not None and self.curves_record is not None:   # the counts shown
            steps.append(Call("sizes", f"{pa}.parity_automaton_sizes", (Ref("run"),),
                              dict(sorted(dict(self.curves_record.request).items(),
                                          key=lambda kv: kv[0] != "max_length")),
                              "the state counts over training"))
        return Recipe(steps=steps)

    # -- layout --------------------------------------------------------------------------
    def controls(self) -> pn.Column:
        p = self.param
        step = pn.widgets.DiscreteSlider.from_param(p.step, sizing_mode="stretch_width")
        threshold = pn.widgets.FloatSlider.from_param(p.threshold, throttled=True,
                                                      sizing_mode="stretch_width")
        max_length = pn.widgets.IntSlider.from_param(p.max_length, throttled=True,
                                                     sizing_mode="stretch_width")
        minimal = pn.widgets.Checkbox.from_param(p.minimal)
        color_by = pn.widgets.RadioButtonGroup.from_param(p.color_by, color="primary", variant="outline",
                                                          label="", sizing_mode="stretch_width")
        return pn.Column(control(step, p.step.doc), control(threshold, p.threshold.doc),
                         control(max_length, p.max_length.doc), control(minimal, p.minimal.doc),
                         control(color_by, p.color_by.doc, p.color_by.label),
                         width=theme.SIZES["controls_width"], css_classes=["parity-controls"])

    def __panel__(self) -> pn.viewable.Viewable:
        # The phase diagram is shown once stored (it takes minutes: `explorer parity phase`);
        # until then its caption alone says how to make it.
        phase_stored = pn.bind(lambda phase: phase is not None, self.param.phase)
        return run_page(
            self, self.controls(), "parity-summary", paper_panel("parity", self),
            # Each keeps its legend beside a frame of ~250 px: they wrap below 420 px.
            flex_row(420, (self._pca_plot, "parity-pca"), (self._automaton_plot, "parity-automaton")),
            caption(self._automaton_caption, "parity-automaton-caption"),
            pn.pane.HoloViews(self._accuracy_plot, sizing_mode="stretch_width",
                              css_classes=["parity-accuracy"]),
            caption(self._accuracy_caption, "parity-accuracy-caption"),
            stale_pane(self.stale_note, [self.param[n] for n in (
                "curves_record", "threshold", "max_length", "error", "run")], "parity-stale"),
            flex_row(340, (self._states_plot, "parity-curves"), (self._loss_plot, "parity-loss"),
                     (self._long_plot, "parity-long")),
            caption(self._curves_caption, "parity-curves-caption"),
            pn.pane.HoloViews(self._phase_plot, sizing_mode="stretch_width",
                              css_classes=["parity-phase"], visible=phase_stored),
            caption(self._phase_caption, "parity-phase-caption"))


serve(__name__, ParityView, title=f"{theme.TITLE}: streaming parity", model=False, intro="parity")
