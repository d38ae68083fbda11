"""Circuits page: the edge-attribution graph, faithfulness, live edge ablation, fine-tuning.

Edge attribution patching (EAP / EAP-IG, Hanna et al. 2024) scores every edge of the
head/MLP graph once; the slider keeps the top-n edges by |score| (re-drawn from the cached
scores, no new trace). Nodes sit layer by layer (heads stacked, the MLP above them); edge
width is |score| and colour the signed score on the diverging map centred on 0. Picking an
edge (click it, or choose it in the list) patches that one edge to its corrupted value in
the full model and shows the metric's change next to the EAP estimate. The faithfulness
curve marks the current circuit size. A LoRA fine-tuning run (Wang et al., "Towards
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
from apps._session import CancelToken, Runner, user_message
from explorer.analyses import circuit_lora as cl
from explorer.analyses import circuits as ca

__all__ = ["CircuitsView", "node_positions", "edge_table", "plot_circuit",
           "plot_faithfulness", "MAX_DRAWN_EDGES"]

hv.extension("bokeh", logo=False)

MAX_DRAWN_EDGES = 300  # Bokeh stays fast with a few hundred segments
_TOOLS = ["save", "box_zoom", "reset"]
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


def edge_table(scores: xr.Dataset, order: np.ndarray, n_edges: int, *,
               reference: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Columns of the drawn edges: the top ``n_edges`` of ``order`` (indices by |score|, desc).

    With ``reference`` (a bool mask of another circuit over the same edges), edges of the
    reference missing from this one are added as ``dropped`` and the rest marked ``kept`` /
    ``added``.
    """
    n_layers, n_heads = int(scores.attrs["n_layers"]), int(scores.attrs["n_heads"])
    pos = node_positions(n_layers, n_heads)
    top = order[:n_edges]
    status = np.full(len(top), "kept", dtype=object)
    if reference is not None:
        status = np.where(reference[top], "kept", "added").astype(object)
        mine = np.zeros(len(reference), bool)
        mine[top] = True
        dropped = np.flatnonzero(reference & ~mine)
        top = np.concatenate([top, dropped])
        status = np.concatenate([status, np.full(len(dropped), "dropped", dtype=object)])
    src = scores["src"].values[top].astype(str)
    dst = scores["dst"].values[top].astype(str)
    s = scores["score"].values[top].astype(float)
    xy0 = np.array([pos[n] for n in src]).reshape(-1, 2)
    xy1 = np.array([pos[n] for n in dst]).reshape(-1, 2)
    vmax = float(np.abs(scores["score"].values[order[:max(n_edges, 1)]]).max()) or 1.0
    return {"x0": xy0[:, 0], "y0": xy0[:, 1], "x1": xy1[:, 0], "y1": xy1[:, 1],
            "src": src, "dst": dst, "score": s, "edge": top.astype(int),
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


def plot_nodes(table: dict[str, np.ndarray] | None, n_layers: int, n_heads: int) -> hv.Points:
    """Every node at its place; the circuit's nodes larger and dark."""
    pos = node_positions(n_layers, n_heads)
    names = list(pos)
    used = set() if table is None else set(table["src"].tolist()) | set(table["dst"].tolist())
    return hv.Points({"x": [pos[n][0] for n in names], "y": [pos[n][1] for n in names],
                      "node": names, "size": [9 if n in used else 4 for n in names],
                      "fill": ["black" if n in used else "#c8c8c8" for n in names]},
                     ["x", "y"], ["node", "size", "fill"]).opts(
        tools=["hover"], size="size", color="fill")


def plot_circuit(table: dict[str, np.ndarray] | None, n_layers: int, n_heads: int, *,
                 diff: bool = False, title: str = "") -> hv.Overlay:
    """Nodes layer by layer and the drawn edges (width |score|, colour signed score or diff)."""
    return plot_edges(table, n_layers, n_heads, diff=diff, title=title) * plot_nodes(
        table, n_layers, n_heads)


def plot_faithfulness(curve: xr.Dataset | None, n_edges: int) -> hv.Element:
    """Share of the clean-minus-corrupted metric the top-n circuit recovers, current n marked."""
    if curve is None:
        return hv.Text(0.5, 0.5, "Faithfulness: press Compute circuit (edge scores of the "
                       "base model)").opts(xaxis=None, yaxis=None, toolbar=None, height=260,
                                           responsive=True, xlim=(0, 1), ylim=(0, 1))
    x = curve["n_edges"].values
    y = curve["recovered"].values
    line = hv.Curve((x, y), "edges kept (top-n by |score|)", "metric recovered").opts(
        color=theme.ACCENT, line_width=2, tools=["hover"])
    pts = hv.Scatter((x, y), "edges kept (top-n by |score|)", "metric recovered").opts(
        color=theme.ACCENT, size=6)
    here = float(np.interp(n_edges, x, y))
    mark = hv.Scatter([(n_edges, here)]).opts(color="black", size=11, marker="diamond")
    return (line * pts * hv.VLine(n_edges).opts(color="black", line_dash="dashed") * mark).opts(
        responsive=True, height=260, default_tools=_TOOLS, logx=False,
        title=f"Faithfulness (edge patching): top {n_edges} edges recover {here:.0%}")


class CircuitsView(pn.viewable.Viewer):
    """Edge-attribution circuit with a top-n slider, faithfulness, edge ablation, fine-tuning.

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
    n_edges = param.Integer(default=30, bounds=(1, MAX_DRAWN_EDGES), label="Edges drawn (top-n)")
    checkpoint = param.Integer(default=0, bounds=(0, 0), label="Fine-tuning checkpoint")
    diff = param.Boolean(default=False, label="Diff vs first checkpoint")
    edge = param.Selector(default="", objects=[""], label="Ablate edge (patch to corrupted)")
    ft_steps = param.Integer(default=6, bounds=(1, 200), label="Fine-tuning steps")

    scores = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True, precedence=-1)
    curve = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True, precedence=-1)
    checkpoints = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True,
                                      precedence=-1)
    ablation = param.Dict(default=None, allow_None=True, precedence=-1)
    status = param.String(default="", precedence=-1)
    error = param.String(default="", precedence=-1)
    redraw_ms = param.Number(default=0.0, precedence=-1)       # wall time of the last re-draw
    redraw_cpu_ms = param.Number(default=0.0, precedence=-1)   # its CPU time (busy machines)

    def __init__(self, model: explorer.Model, *, background: bool | None = None,
                 autostart: bool | None = None, run_folder: str | Path | None = None,
                 **params: Any):
        checkpoint = params.pop("checkpoint", 0)  # its bounds are known once a run is loaded
        super().__init__(**params)
        self._model = model
        self._run_folder = Path(run_folder) if run_folder else None
        if background is None:
            doc = pn.state.curdoc
            background = doc is not None and doc.session_context is not None
        self._runners = {}
        for name, on_result in (("scores", self._got_scores), ("ablate", self._got_ablation),
                                ("finetune", self._got_checkpoints)):
            r = Runner(on_result=on_result, on_error=self._show_error,
                       on_busy=lambda b: None, background=background)
            r.bind_session()
            self._runners[name] = r
        self._progress = pn.indicators.Progress(value=0, max=100,
                                                sizing_mode="stretch_width", visible=False)
        self._order: np.ndarray | None = None          # edge indices by |score|, descending
        self._ck_orders: list[np.ndarray] = []
        self._ck_masks: list[np.ndarray] = []
        self._table: dict[str, np.ndarray] | None = None
        self._task: ca.CircuitTask | None = None
        self._edge_labels: dict[str, int] = {}
        streams = [self.param.n_edges, self.param.checkpoint, self.param.diff,
                   self.param.scores, self.param.checkpoints]
        self._edges_dm = hv.DynamicMap(self._edges_plot, streams=streams)
        self._nodes_dm = hv.DynamicMap(self._nodes_plot, streams=streams)
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

    # -- jobs -----------------------------------------------------------------------------
    def _set_progress(self, done: int, total: int) -> None:
        self._progress.visible = done < total
        self._progress.value = int(100 * done / max(total, 1))

    def _progress_fn(self, token: CancelToken):
        def progress(done: int, total: int) -> None:
            token.check()
            self._set_progress(done, total)
        return progress

    def _request_scores(self) -> None:
        m, task_name, method, n = self._model, self.task, self.method, self.n_prompts

        def job(token: CancelToken):
            task = ca.make_task(task_name, n, seed=0)
            scores = ca.edge_scores(m, task, method=method, batch_size=n,
                                    progress=self._progress_fn(token))
            token.check()
            total = scores.sizes["edge"]
            sizes = sorted({s for s in (0, 5, 10, 20, 50, 100, 200, 300, total) if s <= total})
            curve = ca.faithfulness_curve(m, task, scores, sizes=sizes, batch_size=n,
                                          progress=self._progress_fn(token))
            return task, scores, curve

        self.status = f"scoring edges ({method}, {n} {task_name} pairs)…"
        self._runners["scores"].submit(job)

    def _got_scores(self, result: tuple) -> None:
        task, scores, curve = result
        self._task = task
        self._order = np.argsort(-np.abs(scores["score"].values), kind="stable")
        self.param.n_edges.bounds = (1, min(MAX_DRAWN_EDGES, scores.sizes["edge"]))
        self.n_edges = min(self.n_edges, self.param.n_edges.bounds[1])
        self.param.update(scores=scores, curve=curve, ablation=None)
        self._progress.visible = False
        self.status = (f"{scores.sizes['edge']} edges scored; clean metric "
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
                                        progress=self._progress_fn(token))
            out.update(edge=label, estimate=float(scores["score"].values[index]))
            return out

        self.status = f"patching {label}…"
        self._runners["ablate"].submit(job)

    def _got_ablation(self, out: dict) -> None:
        self._progress.visible = False
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
                             folder=folder, progress=self._progress_fn(token))
            token.check()
            return cl.checkpoint_circuits(m, folder, ca.make_task(task_name, n, seed=0),
                                          method=method, batch_size=n,
                                          progress=self._progress_fn(token))

        self.status = f"fine-tuning {steps} LoRA steps, then scoring each checkpoint…"
        self._runners["finetune"].submit(job)

    def _got_checkpoints(self, ds: xr.Dataset) -> None:
        self._progress.visible = False
        self._set_checkpoints(ds)
        self.status = f"{ds.sizes['checkpoint']} checkpoints scored"

    def _set_checkpoints(self, ds: xr.Dataset) -> None:
        self._ck_orders = [np.argsort(-np.abs(ds["score"].values[i]), kind="stable")
                           for i in range(ds.sizes["checkpoint"])]
        self._ck_masks = []
        self.param.checkpoint.bounds = (0, ds.sizes["checkpoint"] - 1)
        self.checkpoints = ds

    def _show_error(self, exc: BaseException) -> None:
        self._progress.visible = False
        self.error = user_message(exc)
        self.status = f"error: {self.error}"
        theme.notify("error", self.error)

    # -- drawing --------------------------------------------------------------------------
    def _current(self) -> tuple[xr.Dataset | None, np.ndarray | None, str]:
        """Scores, order and a label of what the graph shows (a checkpoint or the base)."""
        ck = self.checkpoints
        if ck is not None and self.checkpoint > 0:
            i = min(self.checkpoint, ck.sizes["checkpoint"] - 1)
            ds = ck["score"].isel(checkpoint=i).to_dataset(name="score")
            ds.attrs = {"n_layers": self._model.n_layers, "n_heads": self._model.spec.n_heads}
            return ds, self._ck_orders[i], f"checkpoint step {int(ck.checkpoint[i])}"
        if self.scores is None and ck is not None:
            ds = ck["score"].isel(checkpoint=0).to_dataset(name="score")
            ds.attrs = {"n_layers": self._model.n_layers, "n_heads": self._model.spec.n_heads}
            return ds, self._ck_orders[0], f"checkpoint step {int(ck.checkpoint[0])}"
        return self.scores, self._order, "base model"

    def _nodes_plot(self, **_: Any) -> hv.Points:
        return plot_nodes(self._table, self._model.n_layers, self._model.spec.n_heads)

    def _edges_plot(self, **_: Any) -> hv.Segments:
        t0, c0 = time.perf_counter(), time.thread_time()
        L, H = self._model.n_layers, self._model.spec.n_heads
        scores, order, label = self._current()
        if scores is None:
            self._table = None
            return plot_edges(None, L, H, title="Circuit: waiting for edge scores")
        n = min(self.n_edges, len(order))
        reference = None
        diff = self.diff and self.checkpoints is not None
        if diff:
            ref_order = self._ck_orders[0]
            reference = np.zeros(len(ref_order), bool)
            reference[ref_order[:n]] = True
        self._table = edge_table(scores, order, n, reference=reference)
        labels = [f"{s} → {d}" for s, d in zip(self._table["src"], self._table["dst"])]
        self._edge_labels = dict(zip(labels, self._table["edge"].tolist()))
        keep = self.edge if self.edge in self._edge_labels else ""
        self.param.edge.objects = ["", *labels]
        if self.edge != keep:
            self.param.update(edge=keep)
        what = "diff vs first checkpoint (grey kept, green added, orange dropped)" if diff \
            else "colour = signed score"
        plot = plot_edges(self._table, L, H, diff=diff,
                            title=f"Top {n} edges by |score|, {label}; {what}")
        self.param.update(redraw_ms=1e3 * (time.perf_counter() - t0),
                          redraw_cpu_ms=1e3 * (time.thread_time() - c0))
        return plot

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
        return (f"<div class='circuit-state' data-circuit-scores="
                f"'{'ready' if self.scores is not None else 'none'}' "
                f"data-circuit-edges='{drawn}' data-circuit-metric='{metric}' "
                f"data-circuit-ablated='{edge}' data-circuit-redraw-ms='{self.redraw_ms:.1f}' "
                f"data-circuit-redraw-cpu-ms='{self.redraw_cpu_ms:.1f}' "
                f"data-circuit-checkpoints='{0 if self.checkpoints is None else self.checkpoints.sizes['checkpoint']}'></div>")

    def __panel__(self) -> pn.viewable.Viewable:
        graph = self._edges_dm * self._nodes_dm
        compute = pn.widgets.Button(name="Compute circuit", button_type="primary")
        compute.on_click(lambda *_: self._request_scores())
        finetune = pn.widgets.Button(name="Fine-tune (LoRA) and score checkpoints")
        finetune.on_click(lambda *_: self._request_finetune())
        player = pn.widgets.Player.from_param(self.param.checkpoint, interval=900, loop_policy="loop",
                                              show_value=True, width=260)
        state = pn.bind(self._state_html, self.param.scores, self.param.ablation,
                        self.param.n_edges, self.param.checkpoints, self.param.redraw_ms)
        controls = pn.Column(
            pn.widgets.Select.from_param(self.param.task),
            pn.widgets.Select.from_param(self.param.method),
            pn.widgets.IntInput.from_param(self.param.n_prompts), compute, self._progress,
            pn.widgets.IntSlider.from_param(self.param.n_edges),
            pn.widgets.Select.from_param(self.param.edge),
            pn.layout.Divider(), pn.widgets.IntInput.from_param(self.param.ft_steps), finetune,
            player, pn.widgets.Checkbox.from_param(self.param.diff),
            pn.pane.Markdown(self.param.status), pn.pane.HTML(state),
            width=theme.SIZES["controls_width"])
        main = pn.Column(
            pn.pane.HoloViews(graph, sizing_mode="stretch_width", linked_axes=False),
            pn.pane.Markdown(pn.bind(self._readout, self.param.ablation, self.param.scores),
                             css_classes=["circuit-readout"]),
            pn.pane.HoloViews(pn.bind(plot_faithfulness, self.param.curve, self.param.n_edges),
                              linked_axes=False),
            sizing_mode="stretch_width")
        return pn.Row(controls, main, sizing_mode="stretch_width")


def app(model_name: str = "smollm2-135m") -> pn.template.FastListTemplate:
    """The page for `panel serve`."""
    from apps._session import get_model

    theme.enable_extension()
    view = CircuitsView(get_model(model_name))
    return theme.page([view], title="Circuits: edge attribution and fine-tuning")


if __name__.startswith("bokeh"):
    app().servable()
