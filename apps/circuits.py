"""Circuits page: the edge-attribution graph, faithfulness, live edge ablation, fine-tuning.

Edge attribution patching (EAP / EAP-IG, Hanna et al. 2024) scores every edge of the
head/MLP graph once. The circuit is chosen by top-n edges by |score| or by a |score|
threshold, then pruned to the edges on an input -> logits path (`circuits.select_circuit`),
the same circuit the faithfulness curve patches; the slider steps through log-spaced sizes
from about 0.1 % to 100 % of the edges and re-draws from the cached scores (no new trace).
When the circuit has more than `MAX_DRAWN_EDGES` edges, the strongest of them are drawn and
the title says so. Nodes sit layer by layer (heads stacked, the MLP above them); edge width
is |score| and colour the signed score on the diverging map centred on 0. Picking an edge
(click it, or choose it in the list) patches that one edge to its corrupted value in the
full model and shows the metric's change next to the EAP estimate. The faithfulness curve
(metric recovered against the number of edges in the pruned circuit) marks the current
circuit. A LoRA fine-tuning run (Wang et al., "Towards
Understanding Fine-Tuning Mechanisms of LLMs via Circuit Analysis", ICML 2025) adds a
checkpoint slider that animates the circuit through fine-tuning, with a diff mode that
colours edges added to / dropped from the first checkpoint's circuit.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import holoviews as hv
import numpy as np
import panel as pn
import param
import xarray as xr

import explorer
from apps import theme
from apps._session import CancelToken
from apps._view import STATIC_TOOLS, View, serve
from explorer.analyses import circuit_lora as cl
from explorer.analyses import circuits as ca

__all__ = ["CircuitsView", "node_positions", "edge_table", "plot_circuit",
           "plot_faithfulness", "size_grid", "slider_redraw_times", "MAX_DRAWN_EDGES"]

hv.extension("bokeh", logo=False)

MAX_DRAWN_EDGES = 400  # legible, and Bokeh stays fast; larger circuits draw their strongest edges
GRID_POINTS = 20       # slider positions (and faithfulness points), log-spaced
_TOOLS = STATIC_TOOLS
DIFF_COLORS = {"kept": "#9a9a9a", "added": theme.CATEGORICAL[2], "dropped": theme.CATEGORICAL[1]}


def node_positions(n_layers: int, n_heads: int) -> dict[str, tuple[float, float]]:
    """(x, y) of every node: x = layer (heads at L, the MLP at L + 0.5), heads stacked in y,
    the MLP above them (odd layers a little higher), input left and logits right."""
    pos = {"input": (-1.0, (n_heads - 1) / 2), "logits": (float(n_layers), (n_heads - 1) / 2)}
    for layer in range(n_layers):
        for h in range(n_heads):
            pos[f"a{layer}.h{h}"] = (float(layer), float(h))
        pos[f"m{layer}"] = (layer + 0.5, n_heads + 0.7 * (layer % 2))  # staggered: MLP chains stay visible
    return pos


def size_grid(n_total: int, *, points: int = GRID_POINTS, low: float = 0.001) -> np.ndarray:
    """Circuit sizes of the slider: about ``points`` log-spaced edge counts from ``low`` (0.1 %)
    of the graph's edges (at least 1) to all of them, distinct, ascending."""
    if n_total < 1:
        return np.zeros(0, dtype=int)
    lo = max(1, int(round(low * n_total)))
    return np.unique(np.round(np.geomspace(lo, n_total, points)).astype(int))


def edge_table(scores: xr.Dataset, index: np.ndarray, *, reference: np.ndarray | None = None,
               circuit: np.ndarray | None = None,
               max_dropped: int = MAX_DRAWN_EDGES) -> dict[str, np.ndarray]:
    """Columns of the drawn edges ``index`` (edge indices, strongest first).

    With ``reference`` (a bool mask of another circuit over the same edges), the drawn edges
    are marked ``kept`` (in the reference) or ``added``, and the reference's edges missing
    from ``circuit`` (this circuit's full bool mask; by default the drawn edges) are appended
    as ``dropped``, strongest first, at most ``max_dropped`` of them.
    """
    n_layers, n_heads = int(scores.attrs["n_layers"]), int(scores.attrs["n_heads"])
    pos = node_positions(n_layers, n_heads)
    top = np.asarray(index, dtype=int)
    status = np.full(len(top), "kept", dtype=object)
    if reference is not None:
        status = np.where(reference[top], "kept", "added").astype(object)
        if circuit is None:
            circuit = np.zeros(len(reference), bool)
            circuit[top] = True
        mag = np.abs(scores["score"].values)
        dropped = np.flatnonzero(reference & ~circuit)
        dropped = dropped[np.argsort(-mag[dropped], kind="stable")][:max_dropped]
        top = np.concatenate([top, dropped]).astype(int)
        status = np.concatenate([status, np.full(len(dropped), "dropped", dtype=object)])
    src = scores["src"].values[top].astype(str)
    dst = scores["dst"].values[top].astype(str)
    s = scores["score"].values[top].astype(float)
    xy0 = np.array([pos[n] for n in src]).reshape(-1, 2)
    xy1 = np.array([pos[n] for n in dst]).reshape(-1, 2)
    vmax = float(np.abs(s).max()) if len(s) else 1.0
    vmax = vmax or 1.0
    return {"x0": xy0[:, 0], "y0": xy0[:, 1], "x1": xy1[:, 0], "y1": xy1[:, 1],
            "src": src, "dst": dst, "score": s, "edge": top,
            "width": 1.0 + 5.0 * np.abs(s) / vmax, "status": status,
            "color": np.array([DIFF_COLORS[k] for k in status], dtype=object)}


_COLUMNS = ("x0", "y0", "x1", "y1", "src", "dst", "score", "edge", "width", "status", "color")


def plot_edges(table: dict[str, np.ndarray] | None, n_layers: int, n_heads: int, *,
               diff: bool = False, title: str = "") -> hv.Segments:
    """The drawn edges: width |score|, colour the signed score (or added/kept/dropped)."""
    table = table or {k: np.array([]) for k in _COLUMNS}
    lim = float(np.abs(table["score"]).max()) if len(table["score"]) else 1.0
    seg = hv.Segments(table, ["x0", "y0", "x1", "y1"], list(_COLUMNS[4:]))
    if diff:
        seg = seg.opts(color="color", line_width="width", colorbar=False)
    else:
        seg = seg.opts(color="score", cmap=theme.SIGNED_CMAP, clim=(-lim, lim), colorbar=True,
                       line_width="width", clabel="edge score")
    xt = [(-1, "input")] + [(l, str(l)) for l in range(n_layers)] + [(n_layers, "logits")]
    return seg.opts(tools=["hover", "tap"], nonselection_alpha=0.35, line_alpha=0.85,
                    responsive=True, height=max(360, 26 * (n_heads + 2)), default_tools=_TOOLS,
                    xlabel="layer (heads at L, MLP above at L+0.5)", ylabel="head (MLP on top)",
                    xticks=xt, title=title, xlim=(-1.5, n_layers + 0.5),
                    ylim=(-1, n_heads + 1.5))


def node_style(names: list[str], used: set[str] | frozenset[str]) -> dict[str, list]:
    """Marker size and fill of each node: the circuit's nodes larger and dark."""
    return {"size": [9 if n in used else 4 for n in names],
            "fill": ["black" if n in used else "#c8c8c8" for n in names]}


def plot_nodes(table: dict[str, np.ndarray] | None, n_layers: int, n_heads: int) -> hv.Points:
    """Every node at its place; the circuit's nodes larger and dark."""
    pos = node_positions(n_layers, n_heads)
    names = list(pos)
    used = set() if table is None else set(table["src"].tolist()) | set(table["dst"].tolist())
    return hv.Points({"x": [pos[n][0] for n in names], "y": [pos[n][1] for n in names],
                      "node": names, **node_style(names, used)},
                     ["x", "y"], ["node", "size", "fill"]).opts(
        tools=["hover"], size="size", color="fill")


def plot_circuit(table: dict[str, np.ndarray] | None, n_layers: int, n_heads: int, *,
                 diff: bool = False, title: str = "") -> hv.Overlay:
    """Nodes layer by layer and the drawn edges (width |score|, colour signed score or diff)."""
    return plot_edges(table, n_layers, n_heads, diff=diff, title=title) * plot_nodes(
        table, n_layers, n_heads)


def _no_curve() -> hv.Text:
    return hv.Text(0.5, 0.5, "Faithfulness: press Compute circuit (edge scores of the "
                   "base model)").opts(xaxis=None, yaxis=None, toolbar=None, height=260,
                                       responsive=True, xlim=(0, 1), ylim=(0, 1))


_FAITH_X = "edges in the circuit (pruned to input → logits paths)"


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


def faithfulness_marker(curve: xr.Dataset, n_kept: int, n_chosen: int | None = None) -> hv.Scatter:
    """The current circuit on the curve: x = its pruned size, y = the curve at its top-n
    ``n_chosen`` (measured there, else interpolated between measured top-n values); the
    title says which. Empty (no point) when the circuit is empty."""
    top_n = curve["n_edges"].values
    y = curve["recovered"].values
    if n_chosen is None:
        n_chosen = n_kept
    if n_chosen in top_n:
        here, how = float(y[list(top_n).index(n_chosen)]), "measured"
    else:
        here, how = float(np.interp(n_chosen, top_n, y)), "interpolated"
    if n_kept > 0:
        title = (f"Faithfulness (edge patching): the {n_kept:,}-edge circuit recovers "
                 f"{here:.0%} ({how})")
        data = [(n_kept, here)]
    else:
        title = "Faithfulness (edge patching): the circuit is empty (no input → logits path)"
        data = []
    return hv.Scatter(data, _FAITH_X, "metric recovered", group="Current").opts(
        color="black", size=13, marker="diamond", title=title)


def plot_faithfulness(curve: xr.Dataset | None, n_kept: int, n_chosen: int | None = None) -> hv.Element:
    """Share of the clean-minus-corrupted metric recovered against the number of edges in the
    pruned circuit (log axis), with the current circuit marked at x = its pruned size.

    ``n_chosen`` is the current circuit's edge count before pruning (its top-n): where the
    curve was measured at that top-n the marker sits on the measured point, else its height
    is interpolated between the neighbouring measured top-n values (the title says which).
    """
    if curve is None:
        return _no_curve()
    mark = faithfulness_marker(curve, n_kept, n_chosen)
    return (faithfulness_line(curve) * mark).opts(
        responsive=True, height=260, default_tools=_TOOLS, logx=True,
        title=mark.opts.get().kwargs["title"])


class CircuitsView(View):
    """Edge-attribution circuit (top-n or threshold, pruned), faithfulness, edge ablation,
    fine-tuning.

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

    task = param.Selector(default="add", objects=list(ca.TASK_NAMES), label="Task")
    method = param.Selector(default="eap", objects=list(ca.METHODS), label="Attribution")
    n_prompts = param.Integer(default=8, bounds=(1, 64), label="Prompt pairs")
    mode = param.Selector(default="top-n", objects=["top-n", "threshold"], label="Circuit by")
    n_edges = param.Integer(default=30, bounds=(0, None),
                            label="Top-n edges by |score| (before pruning)")
    threshold = param.Number(default=0.0, bounds=(0, None), label="|score| threshold")
    checkpoint = param.Integer(default=0, bounds=(0, 0), label="Fine-tuning checkpoint")
    diff = param.Boolean(default=False, label="Diff vs first checkpoint")
    edge = param.Selector(default="", objects=[""], label="Ablate edge (patch to corrupted)")
    ft_steps = param.Integer(default=6, bounds=(1, 200), label="Fine-tuning steps")

    scores = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True, precedence=-1)
    curve = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True, precedence=-1)
    checkpoints = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True,
                                      precedence=-1)
    ablation = param.Dict(default=None, allow_None=True, precedence=-1)
    redraw_ms = param.Number(default=0.0, precedence=-1)       # wall time of the last re-draw
    redraw_cpu_ms = param.Number(default=0.0, precedence=-1)   # its CPU time (busy machines)

    notify_title = None
    failed_status = "error: {message}"

    def __init__(self, model: explorer.Model, *, background: bool | None = None,
                 autostart: bool | None = None, run_folder: str | Path | None = None,
                 **params: Any):
        checkpoint = params.pop("checkpoint", 0)  # its bounds are known once a run is loaded
        self._chosen_size = "n_edges" in params or "threshold" in params
        super().__init__(background=background, **params)
        self._model = model
        self._run_folder = Path(run_folder) if run_folder else None
        self.runner("scores", self._got_scores, busy=False, progress=True)
        self.runner("ablate", self._got_ablation, busy=False, progress=True)
        self.runner("finetune", self._got_checkpoints, busy=False, progress=True)
        self._progress = pn.indicators.Progress(value=self.param.progress, max=100,
                                                sizing_mode="stretch_width",
                                                visible=self.param.progress_active)
        self._order: np.ndarray | None = None          # edge indices by |score|, descending
        self._ck_orders: list[np.ndarray] = []
        self._ck_scores: list[xr.Dataset] = []
        self._table: dict[str, np.ndarray] | None = None
        self._nodes: frozenset[str] = frozenset()
        self._task: ca.CircuitTask | None = None
        self._edge_labels: dict[str, int] = {}
        self._circuit_cache: dict[tuple, np.ndarray] = {}
        self._shown = {"size": 0, "chosen": 0, "drawn": 0}
        self._slider = pn.widgets.DiscreteSlider(label=self.param.n_edges.label, options=[30],
                                                 value=30, sizing_mode="stretch_width")
        self._syncing = False
        self._slider.param.watch(self._slider_moved, "value")
        self.param.watch(self._mode_changed, ["mode"])
        self.param.watch(lambda *_: self._sync_slider(), ["n_edges", "threshold"])
        streams = [self.param.mode, self.param.n_edges, self.param.threshold,
                   self.param.checkpoint, self.param.diff, self.param.scores,
                   self.param.checkpoints]
        self._edges_dm = hv.DynamicMap(self._edges_plot, streams=streams)
        # the nodes are drawn once; when the circuit's node set changes only their size and
        # fill columns are replaced in the drawn plots' data sources (a HoloViews re-draw of
        # the 302 SmolLM2 nodes was a third of a slider move's time)
        self._node_names = list(node_positions(model.n_layers, model.spec.n_heads))
        self._node_sources: list[Any] = []
        self._nodes_el = plot_nodes(None, model.n_layers, model.spec.n_heads).opts(
            hooks=[self._keep_node_source])
        self._tap = hv.streams.Selection1D(source=self._edges_dm)
        self._tap.add_subscriber(self._tapped)
        self.param.watch(lambda e: self._request_ablation(), ["edge"])
        if self._run_folder is not None and (self._run_folder / "circuits.nc").is_file():
            self._set_checkpoints(xr.load_dataset(self._run_folder / "circuits.nc"))
            self.checkpoint = min(checkpoint, self.param.checkpoint.bounds[1])
        small = model.n_layers * model.spec.n_heads <= 64
        if autostart if autostart is not None else small:
            self._request_scores()
        else:
            self.status = "Press **Compute circuit** to score the edges."

    # -- the circuit ------------------------------------------------------------------------
    def _total(self) -> int:
        scores, _, _ = self._current()
        return 0 if scores is None else int(scores.sizes["edge"])

    def _circuit(self, scores: xr.Dataset) -> np.ndarray:
        """The pruned circuit (`select_circuit`) of ``scores`` at the current selection."""
        n_total = int(scores.sizes["edge"])
        if self.mode == "top-n":
            key = (id(scores), "top-n", min(self.n_edges, n_total))
        else:
            key = (id(scores), "threshold", float(self.threshold))
        mask = self._circuit_cache.get(key)
        if mask is None:
            if len(self._circuit_cache) > 256:
                self._circuit_cache.clear()
            sel = (ca.select_circuit(scores, top_n=key[2]) if self.mode == "top-n"
                   else ca.select_circuit(scores, threshold=key[2]))
            mask = sel.values
            mask.flags.writeable = False
            self._circuit_cache[key] = mask
            self._circuit_cache[key + ("chosen",)] = sel.attrs["n_chosen"]
        return mask

    def _n_chosen(self, scores: xr.Dataset) -> int:
        """Edges chosen before pruning (top-n, or how many pass the threshold)."""
        self._circuit(scores)
        n_total = int(scores.sizes["edge"])
        key = ((id(scores), "top-n", min(self.n_edges, n_total)) if self.mode == "top-n"
               else (id(scores), "threshold", float(self.threshold)))
        return int(self._circuit_cache[key + ("chosen",)])

    def _grid(self) -> tuple[np.ndarray, np.ndarray]:
        """Slider sizes (top-n) and the |score| thresholds that choose as many edges."""
        scores, order, _ = self._current()
        if scores is None:
            return np.array([self.n_edges]), np.array([self.threshold])
        sizes = size_grid(int(scores.sizes["edge"]))
        mag = np.abs(scores["score"].values.astype(np.float64))
        return sizes, mag[order[sizes - 1]]

    def _sync_slider(self) -> None:
        """Slider options and value from the mode and the current n_edges / threshold."""
        if self._syncing:
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
            # one batch of Bokeh events, and the document's model graph recomputed once
            with pn.io.document.hold(freeze=True):
                if self.mode == "top-n":
                    self.n_edges = int(event.new)
                else:
                    self.threshold = float(event.new)
        finally:
            self._syncing = False

    def _set_default_size(self) -> None:
        """A circuit of about 5 % of the edges (at least 30), unless one was asked for."""
        sizes, thresholds = self._grid()
        if not self._chosen_size and len(sizes):
            total = self._total()
            i = int(np.argmin(np.abs(np.log(sizes) - np.log(max(0.05 * total, min(30, total))))))
            self.param.update(n_edges=int(sizes[i]), threshold=float(thresholds[i]))
        self._sync_slider()

    # -- jobs -----------------------------------------------------------------------------
    def _request_scores(self) -> None:
        m, task_name, method, n = self._model, self.task, self.method, self.n_prompts

        def job(token: CancelToken):
            task = ca.make_task(task_name, n, seed=0)
            scores = ca.edge_scores(m, task, method=method, batch_size=n,
                                    progress=self.progress_fn(token))
            token.check()
            sizes = [0, *size_grid(scores.sizes["edge"]).tolist()]  # the slider's positions
            curve = ca.faithfulness_curve(m, task, scores, sizes=sizes, batch_size=n,
                                          progress=self.progress_fn(token))
            return task, scores, curve

        self.status = f"scoring edges ({method}, {n} {task_name} pairs)…"
        self.submit("scores", job)

    def _got_scores(self, result: tuple) -> None:
        task, scores, curve = result
        self._task = task
        self._circuit_cache.clear()
        self._order = np.argsort(-np.abs(scores["score"].values), kind="stable")
        self.param.n_edges.bounds = (0, scores.sizes["edge"])
        self.n_edges = min(self.n_edges, scores.sizes["edge"])
        self.param.update(scores=scores, curve=curve, ablation=None)
        self._set_default_size()
        self.status = (f"{scores.sizes['edge']:,} edges scored; clean metric "
                       f"{scores.attrs['clean_metric']:.3f}, corrupted "
                       f"{scores.attrs['corrupt_metric']:.3f}")

    def _request_ablation(self) -> None:
        if not self.edge or self.scores is None or self.edge not in self._edge_labels:
            return
        index = self._edge_labels[self.edge]
        m, task, scores = self._model, self._task, self.scores
        label = self.edge

        def job(token: CancelToken):
            keep = np.ones(scores.sizes["edge"], bool)
            keep[index] = False  # every edge clean but this one
            out = ca.patch_edges_metric(m, task, scores, keep, batch_size=len(task),
                                        progress=self.progress_fn(token))
            out.update(edge=label, estimate=float(scores["score"].values[index]))
            return out

        self.status = f"patching {label}…"
        self.submit("ablate", job)

    def _got_ablation(self, out: dict) -> None:
        self.ablation = out
        self.status = f"patched {out['edge']}"

    def _request_finetune(self) -> None:
        m, task_name, method, n, steps = (self._model, self.task, self.method, self.n_prompts,
                                          self.ft_steps)
        folder = self._run_folder or (explorer.models.cache_dir() / "circuit_lora" /
                                      f"{m.spec.name.replace('/', '_')}-view-{task_name}")

        def job(token: CancelToken):
            data = ca.make_task(task_name, 64, seed=2)
            ckpts = sorted({0, steps // 3, 2 * steps // 3, steps} - {-1})
            cl.finetune_lora(m, data.clean, data.answer, ranks=cl.uniform_lora_ranks(m, 2),
                             steps=steps, batch_size=8, lr=1e-3, checkpoints=ckpts,
                             folder=folder, progress=self.progress_fn(token))
            token.check()
            return cl.checkpoint_circuits(m, folder, ca.make_task(task_name, n, seed=0),
                                          method=method, batch_size=n,
                                          progress=self.progress_fn(token))

        self.status = f"fine-tuning {steps} LoRA steps, then scoring each checkpoint…"
        self.submit("finetune", job)

    def _got_checkpoints(self, ds: xr.Dataset) -> None:
        self._set_checkpoints(ds)
        self.status = f"{ds.sizes['checkpoint']} checkpoints scored"

    def _set_checkpoints(self, ds: xr.Dataset) -> None:
        self._circuit_cache.clear()
        self._ck_scores = [self._checkpoint_scores(ds, i) for i in range(ds.sizes["checkpoint"])]
        self._ck_orders = [np.argsort(-np.abs(s["score"].values), kind="stable")
                           for s in self._ck_scores]
        self.param.checkpoint.bounds = (0, ds.sizes["checkpoint"] - 1)
        self.checkpoints = ds
        if self.scores is None:
            self._set_default_size()

    def _checkpoint_scores(self, ds: xr.Dataset, i: int) -> xr.Dataset:
        out = ds["score"].isel(checkpoint=i).to_dataset(name="score")
        out.attrs = {"n_layers": self._model.n_layers, "n_heads": self._model.spec.n_heads}
        return out

    # -- drawing --------------------------------------------------------------------------
    def _current(self) -> tuple[xr.Dataset | None, np.ndarray | None, str]:
        """Scores, order and a label of what the graph shows (a checkpoint or the base)."""
        ck = self.checkpoints
        if ck is not None and self.checkpoint > 0:
            i = min(self.checkpoint, ck.sizes["checkpoint"] - 1)
            return self._ck_scores[i], self._ck_orders[i], f"checkpoint step {int(ck.checkpoint[i])}"
        if self.scores is None and ck is not None:
            return self._ck_scores[0], self._ck_orders[0], f"checkpoint step {int(ck.checkpoint[0])}"
        return self.scores, self._order, "base model"

    def _selection_label(self, n_chosen: int) -> str:
        if self.mode == "top-n":
            return f"top {n_chosen:,} by |score|"
        return f"|score| ≥ {self.threshold:.3g} ({n_chosen:,} edges)"

    def _bump_nodes(self) -> None:
        t = self._table
        nodes = frozenset() if t is None else frozenset(t["src"].tolist()) | frozenset(
            t["dst"].tolist())
        if nodes != self._nodes:
            self._nodes = nodes
            style = node_style(self._node_names, nodes)
            for source in self._node_sources:
                source.data.update(style)

    def _keep_node_source(self, plot: Any, element: Any) -> None:
        """Plot hook: remember each drawn node plot's data source and bring it up to date."""
        source = plot.handles["source"]
        if source not in self._node_sources:
            self._node_sources.append(source)
        source.data.update(node_style(self._node_names, self._nodes))

    def nodes_drawn(self) -> list[dict[str, list]]:
        """What each drawn node plot holds: node, size and fill columns (for tests)."""
        return [{k: list(src.data[k]) for k in ("node", "size", "fill")}
                for src in self._node_sources]

    def _edges_plot(self, **_: Any) -> hv.Segments:
        t0, c0 = time.perf_counter(), time.thread_time()
        L, H = self._model.n_layers, self._model.spec.n_heads
        scores, order, label = self._current()
        if scores is None:
            self._table = None
            self._shown = {"size": 0, "chosen": 0, "drawn": 0}
            self._bump_nodes()
            return plot_edges(None, L, H, title="Circuit: waiting for edge scores")
        mask = self._circuit(scores)
        n_chosen = self._n_chosen(scores)
        members = order[mask[order]]              # the pruned circuit, strongest first
        shown = members[:MAX_DRAWN_EDGES]
        reference = None
        diff = self.diff and self.checkpoints is not None
        if diff:
            reference = self._circuit(self._ck_scores[0])
        self._table = edge_table(scores, shown, reference=reference, circuit=mask)
        self._shown = {"size": int(len(members)), "chosen": n_chosen, "drawn": int(len(shown))}
        labels = [f"{s} → {d}" for s, d in zip(self._table["src"], self._table["dst"])]
        self._edge_labels = dict(zip(labels, self._table["edge"].tolist()))
        keep = self.edge if self.edge in self._edge_labels else ""
        self.param.edge.objects = ["", *labels]
        if self.edge != keep:
            self.param.update(edge=keep)
        what = "diff vs first checkpoint (grey kept, green added, orange dropped)" if diff \
            else "colour = signed score"
        title = (f"Circuit: {len(members):,} edges ({self._selection_label(n_chosen)}, pruned "
                 f"to input → logits paths), {label}")
        if len(members) > len(shown):
            title += f"; drawing the strongest {len(shown):,}"
        plot = plot_edges(self._table, L, H, diff=diff, title=f"{title}; {what}")
        self._bump_nodes()
        self.param.update(redraw_ms=1e3 * (time.perf_counter() - t0),
                          redraw_cpu_ms=1e3 * (time.thread_time() - c0))
        return plot

    def _faithfulness_plot(self, *_: Any) -> hv.Element:
        """The base model's curve, marked at its circuit for the current selection (also
        while the graph shows a fine-tuning checkpoint)."""
        if self.curve is None or self.scores is None:
            return plot_faithfulness(None, 0)
        mask = self._circuit(self.scores)
        return plot_faithfulness(self.curve, int(mask.sum()), self._n_chosen(self.scores))

    def _marker_plot(self, **_: Any) -> hv.Scatter:
        if self.curve is None or self.scores is None:
            return hv.Scatter([], _FAITH_X, "metric recovered", group="Current")
        mask = self._circuit(self.scores)
        return faithfulness_marker(self.curve, int(mask.sum()), self._n_chosen(self.scores))

    def _faithfulness_pane(self, curve: xr.Dataset | None) -> hv.Element:
        """The curve, drawn once per set of scores, and the marker as a DynamicMap: a slider
        move updates the marker's data and the title, not the whole figure."""
        if curve is None:
            return _no_curve()
        marker = hv.DynamicMap(self._marker_plot, streams=[
            self.param.mode, self.param.n_edges, self.param.threshold, self.param.scores])
        return (faithfulness_line(curve) * marker).opts(
            responsive=True, height=260, default_tools=_TOOLS, logx=True)

    def _tapped(self, index: list[int]) -> None:
        if index and self._table is not None and index[0] < len(self._table["src"]):
            i = index[0]
            self.edge = f"{self._table['src'][i]} → {self._table['dst'][i]}"

    # -- layout ---------------------------------------------------------------------------
    def _readout(self, *_: Any) -> str:
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

    def _state_html(self, *_: Any) -> str:
        """Hidden markers of what the page shows (read by the browser test)."""
        drawn = 0 if self._table is None else int((self._table["status"] != "dropped").sum())
        metric = "none" if self.ablation is None else f"{self.ablation['metric']:.9g}"
        edge = "none" if self.ablation is None else self.ablation["edge"]
        n_ck = 0 if self.checkpoints is None else self.checkpoints.sizes["checkpoint"]
        return (f"<div class='circuit-state' data-circuit-scores="
                f"'{'ready' if self.scores is not None else 'none'}' "
                f"data-circuit-edges='{drawn}' data-circuit-size='{self._shown['size']}' "
                f"data-circuit-chosen='{self._shown['chosen']}' data-circuit-mode='{self.mode}' "
                f"data-circuit-metric='{metric}' "
                f"data-circuit-ablated='{edge}' data-circuit-redraw-ms='{self.redraw_ms:.1f}' "
                f"data-circuit-redraw-cpu-ms='{self.redraw_cpu_ms:.1f}' "
                f"data-circuit-checkpoints='{n_ck}'></div>")

    def __panel__(self) -> pn.viewable.Viewable:
        graph = self._edges_dm * self._nodes_el
        compute = pn.widgets.Button(name="Compute circuit", button_type="primary")
        compute.on_click(lambda *_: self._request_scores())
        finetune = pn.widgets.Button(name="Fine-tune (LoRA) and score checkpoints")
        finetune.on_click(lambda *_: self._request_finetune())
        player = pn.widgets.Player.from_param(self.param.checkpoint, interval=900, loop_policy="loop",
                                              show_value=True, width=260)
        state = pn.bind(self._state_html, self.param.scores, self.param.ablation,
                        self.param.mode, self.param.n_edges, self.param.threshold,
                        self.param.checkpoint, self.param.diff, self.param.checkpoints,
                        self.param.redraw_ms)
        controls = pn.Column(
            pn.widgets.Select.from_param(self.param.task),
            pn.widgets.Select.from_param(self.param.method),
            pn.widgets.IntInput.from_param(self.param.n_prompts), compute, self._progress,
            pn.widgets.RadioButtonGroup.from_param(self.param.mode), self._slider,
            pn.widgets.Select.from_param(self.param.edge),
            pn.layout.Divider(), pn.widgets.IntInput.from_param(self.param.ft_steps), finetune,
            player, pn.widgets.Checkbox.from_param(self.param.diff),
            pn.pane.Markdown(self.param.status), pn.pane.HTML(state),
            width=theme.SIZES["controls_width"])
        faith = pn.bind(self._faithfulness_pane, self.param.curve)
        main = pn.Column(
            pn.pane.HoloViews(graph, sizing_mode="stretch_width", linked_axes=False),
            pn.pane.Markdown(pn.bind(self._readout, self.param.ablation, self.param.scores),
                             css_classes=["circuit-readout"]),
            pn.pane.HoloViews(faith, linked_axes=False),
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
    updated: re-pruning (`select_circuit`), the edge table, the three plots' Bokeh updates.
    Checks that the drawn segments equal the page's circuit after each move.
    """
    from bokeh.document import Document
    from bokeh.models import ColumnDataSource
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
        view._got_scores((task, scores, curve))
        options = list(view._slider.options.values())
        start = options.index(view._slider.value)
        order = [i for i in np.random.default_rng(0).permutation(len(options)) if i != start]
        wall, cpu = [], []
        for i in order[:moves]:
            t0, c0 = time.perf_counter(), time.thread_time()
            view._slider.value = options[i]
            wall.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
            drawn = [len(m.data["x0"]) for m in doc.select({"type": ColumnDataSource})
                     if "x0" in m.data]
            if drawn != [view._shown["drawn"]] or view.n_edges != options[i]:
                raise RuntimeError(f"slider move to {options[i]} drew {drawn} segments, "
                                   f"expected {view._shown['drawn']}")
    return {"slider_redraw_ms": float(np.median(wall)) * 1e3,
            "slider_redraw_cpu_ms": float(np.median(cpu)) * 1e3,
            "slider_redraw_max_cpu_ms": float(np.max(cpu)) * 1e3,
            "slider_moves": len(cpu)}


serve(__name__, CircuitsView, title="Circuits: edge attribution and fine-tuning", intro="circuits")
