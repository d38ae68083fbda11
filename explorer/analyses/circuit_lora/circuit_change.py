"""How circuits change under fine-tuning: the circuit of each checkpoint (`checkpoint_circuits`,
EAP-IG on KL by default), the per-layer change that prompt resampling alone gives
(`layer_change_noise_floor`), node / edge Jaccard similarity (`jaccard`,
`circuit_similarity`), the per-layer edge change (`node_layer`, `layer_edge_change`) and the
critical layers it picks (`critical_layers`).
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from explorer._checks import InputError, check_choice, check_float, check_int
from explorer.analyses.circuit_lora.adapters import CITATION, Progress
from explorer.analyses.circuit_lora.checkpoints import checkpoint_steps, load_checkpoint, read_checkpoint
from explorer.models import Model
from explorer.trace import provenance

__all__ = [
    "checkpoint_circuits",
    "layer_change_noise_floor",
    "CHECKPOINT_METHOD",
    "CHECKPOINT_METRIC",
    "jaccard",
    "circuit_similarity",
    "node_layer",
    "layer_edge_change",
    "critical_layers",
]


#: The edge method and metric Wang et al. score fine-tuning checkpoints with (EAP-IG on KL).
CHECKPOINT_METHOD, CHECKPOINT_METRIC = "eap-ig", "kl"


def _default_metric(method: str) -> str:
    return CHECKPOINT_METRIC if method == "eap-ig" else "logit_diff"


def _circuit_of(model: Model, task: Any, *, method: str, metric: str, ig_steps: int,
                top_percent: float, batch_size: int, lora: Any = None) -> tuple[Any, Any]:
    """Edge scores of ``task`` and the circuit: the top ``top_percent`` % by |score|, pruned."""
    from explorer.analyses import circuits as ca

    s = ca.edge_scores(model, task, method=method, steps=ig_steps, metric=metric,
                       batch_size=batch_size, lora=lora)
    top_n = max(1, int(round(top_percent / 100 * s.sizes["edge"])))
    return s["score"], ca.select_circuit(s, top_n=top_n)


def checkpoint_circuits(model: Model, folder: str | Path, task: Any, *,
                        steps: Sequence[int] | None = None, method: str = CHECKPOINT_METHOD,
                        top_percent: float = 5.0, metric: str | None = None,
                        ig_steps: int = 5, batch_size: int = 16,
                        progress: Progress = None) -> xr.Dataset:
    """Edge scores and the circuit of each saved checkpoint of a run.

    Uses `explorer.analyses.circuits.edge_scores` and `select_circuit` on the model with
    each checkpoint's adapter merged (`load_checkpoint`); a remote model is scored on the
    server with the adapters applied there (`read_checkpoint`, ``lora=``). The circuit is the top
    ``top_percent`` % of edges by |score| (the paper: 5 %), pruned to input -> logits paths.
    The default scoring is the paper's, EAP-IG (``ig_steps`` interpolation steps) on the KL
    divergence from the clean run; ``method="eap"`` is the cheaper first-order alternative
    (one backward per batch instead of ``ig_steps``). ``metric`` None means KL for EAP-IG
    and the logit difference for EAP (whose gradient of KL at the clean run is zero).

    Returns
    -------
    xr.Dataset
        ``score`` (checkpoint, edge) and ``in_circuit`` (checkpoint, edge), with the edge
        coordinates of `edge_scores` (``src``, ``dst``, ``src_layer``, ``dst_layer``).
    """
    top_percent = check_float("top_percent", top_percent, low=0.0, high=100.0)
    metric = _default_metric(method) if metric is None else metric
    steps = checkpoint_steps(folder) if steps is None else list(steps)
    if not steps:
        raise InputError(f"run {str(folder)!r} has no checkpoints.")
    opts = dict(method=method, metric=metric, ig_steps=ig_steps, top_percent=top_percent,
                batch_size=batch_size)
    scores, circuits = [], []
    for i, step in enumerate(steps):
        if model.remote:  # the adapters go with each job; the served weights stay as they are
            score, circuit = _circuit_of(model, task, lora=read_checkpoint(model, folder, step),
                                         **opts)
        else:
            m = load_checkpoint(model, folder, step)
            score, circuit = _circuit_of(m, task, **opts)
            del m
        scores.append(score)
        circuits.append(circuit)
        if progress is not None:
            progress(i + 1, len(steps))
    ds = xr.Dataset({"score": xr.concat(scores, "checkpoint"),
                     "in_circuit": xr.concat(circuits, "checkpoint")})
    ds = ds.assign_coords(checkpoint=np.array(steps))
    ds.attrs = {**provenance(model, method="checkpoint-circuits", edge_method=method,
                             top_percent=top_percent, metric=metric, ig_steps=ig_steps,
                             task=getattr(task, "name", ""),
                             n_pairs=len(getattr(task, "clean", ()))),
                "folder": str(folder), "citation": CITATION}
    return ds


def layer_change_noise_floor(model: Model, tasks: Sequence[Any], *,
                             method: str = CHECKPOINT_METHOD, metric: str | None = None,
                             ig_steps: int = 5, top_percent: float = 5.0,
                             batch_size: int = 16) -> xr.Dataset:
    """The per-layer edge change D_l that prompt sampling alone gives, on one set of weights.

    Each of ``tasks`` is the same task on a different sample of prompts (e.g.
    ``make_task(name, n, seed=s)`` for several seeds). Their circuits are computed on
    ``model`` as `checkpoint_circuits` computes a checkpoint's, and D_l
    (`layer_edge_change`) is taken between every pair: a per-layer change between two
    checkpoints that is not above this floor cannot be told from prompt resampling.

    Returns
    -------
    xr.Dataset
        ``edge_change`` (pair, layer), ``noise_mean`` and ``noise_max`` (layer); the pair
        coordinate names the two samples (``"0-1"``).
    """
    if len(tasks) < 2:
        raise InputError(f"`tasks` must hold at least 2 prompt samples; got {len(tasks)}.")
    top_percent = check_float("top_percent", top_percent, low=0.0, high=100.0)
    metric = _default_metric(method) if metric is None else metric
    opts = dict(method=method, metric=metric, ig_steps=ig_steps, top_percent=top_percent,
                batch_size=batch_size)
    samples = []
    for task in tasks:
        score, circuit = _circuit_of(model, task, **opts)
        samples.append(xr.Dataset({"score": score, "in_circuit": circuit}))
    pairs = [(i, j) for i in range(len(samples)) for j in range(i + 1, len(samples))]
    change = np.stack([layer_edge_change(samples[i], samples[j], n_layers=model.n_layers)
                       ["edge_change"].values for i, j in pairs])          # [pair, layer]
    return xr.Dataset(
        {"edge_change": (("pair", "layer"), change),
         "noise_mean": ("layer", change.mean(0)), "noise_max": ("layer", change.max(0))},
        coords={"pair": [f"{i}-{j}" for i, j in pairs], "layer": np.arange(model.n_layers)},
        attrs={**provenance(model, method="layer-change-noise-floor", edge_method=method,
                            metric=metric, ig_steps=ig_steps, top_percent=top_percent,
                            n_samples=len(tasks)), "citation": CITATION})


def jaccard(a: Iterable[Any], b: Iterable[Any]) -> float:
    """|A ∩ B| / |A ∪ B|; 1.0 for two empty sets."""
    a, b = set(a), set(b)
    union = a | b
    return 1.0 if not union else len(a & b) / len(union)


def _nodes_edges(ds: xr.Dataset, c: int) -> tuple[set, set]:
    mask = np.asarray(ds["in_circuit"].isel(checkpoint=c).values, bool)
    src = np.asarray(ds["src"].values)[mask]
    dst = np.asarray(ds["dst"].values)[mask]
    edges = set(zip(src.tolist(), dst.tolist()))
    nodes = set(src.tolist()) | set(dst.tolist())
    return nodes, edges


def circuit_similarity(circuits: xr.Dataset) -> xr.Dataset:
    """Node and edge Jaccard similarity between the circuits of every pair of checkpoints.

    ``circuits`` holds ``in_circuit`` (checkpoint, edge) with ``src`` / ``dst`` coordinates
    (as `checkpoint_circuits` returns). A node is in a circuit when one of its edges is.

    Returns
    -------
    xr.Dataset
        ``node_jaccard`` and ``edge_jaccard`` (checkpoint, checkpoint_b); ``n_nodes`` and
        ``n_edges`` (checkpoint).
    """
    if "in_circuit" not in circuits or "checkpoint" not in circuits["in_circuit"].dims:
        raise InputError("`circuits` must hold `in_circuit` over (checkpoint, edge); "
                         f"got variables {list(circuits.data_vars)}.")
    steps = circuits["checkpoint"].values
    sets = [_nodes_edges(circuits, c) for c in range(len(steps))]
    n = len(steps)
    node_j = np.array([[jaccard(sets[i][0], sets[j][0]) for j in range(n)] for i in range(n)])
    edge_j = np.array([[jaccard(sets[i][1], sets[j][1]) for j in range(n)] for i in range(n)])
    return xr.Dataset(
        {"node_jaccard": (("checkpoint", "checkpoint_b"), node_j),
         "edge_jaccard": (("checkpoint", "checkpoint_b"), edge_j),
         "n_nodes": ("checkpoint", np.array([len(s[0]) for s in sets])),
         "n_edges": ("checkpoint", np.array([len(s[1]) for s in sets]))},
        coords={"checkpoint": steps, "checkpoint_b": steps},
        attrs={"method": "circuit-similarity", "citation": CITATION})


_NODE = re.compile(r"^(?:a(\d+)\.h\d+|m(\d+))$")


def node_layer(node: str, n_layers: int) -> int:
    """Layer of a graph node as the paper maps it: ``a{L}.h{H}`` and ``m{L}`` -> L,
    ``input`` -> 0, ``logits`` -> the last layer."""
    if node == "input":
        return 0
    if node == "logits":
        return n_layers - 1
    m = _NODE.match(str(node))
    if m is None:
        raise InputError(f"`node` must be 'input', 'logits', 'a{{layer}}.h{{head}}' or "
                         f"'m{{layer}}'; got {node!r}.")
    return int(m.group(1) or m.group(2))


def layer_edge_change(before: xr.Dataset, after: xr.Dataset, *, n_layers: int) -> xr.Dataset:
    """Per-layer edge change D_l between two circuits (Wang et al., CircuitLoRA step 2-3).

    Each edge's change is |s_after - s_before| when it is in both circuits, its own |score|
    when it is in only one, and 0 when in neither. D_l sums the changes of the edges whose
    source node is in layer l (`node_layer`: input -> 0). ``before`` and ``after`` each hold
    ``score`` and ``in_circuit`` over the same ``edge`` list (``src`` / ``dst`` coordinates).

    Returns
    -------
    xr.Dataset
        ``edge_change`` (layer) and ``edge_delta`` (edge).
    """
    check_int("n_layers", n_layers, low=1)
    for name, ds in (("before", before), ("after", after)):
        missing = {"score", "in_circuit"} - set(ds.data_vars)
        if missing:
            raise InputError(f"`{name}` must hold `score` and `in_circuit`; missing {sorted(missing)}.")
    if (before.sizes["edge"] != after.sizes["edge"]
            or not np.array_equal(before["src"].values, after["src"].values)
            or not np.array_equal(before["dst"].values, after["dst"].values)):
        raise InputError("`before` and `after` must score the same edges in the same order.")
    sb, sa = before["score"].values.astype(float), after["score"].values.astype(float)
    ib, ia = before["in_circuit"].values.astype(bool), after["in_circuit"].values.astype(bool)
    delta = np.where(ib & ia, np.abs(sa - sb),
                     np.where(ib, np.abs(sb), np.where(ia, np.abs(sa), 0.0)))
    layers = np.array([node_layer(s, n_layers) for s in before["src"].values.tolist()])
    change = np.bincount(layers, weights=delta, minlength=n_layers)[:n_layers]
    return xr.Dataset(
        {"edge_change": ("layer", change), "edge_delta": ("edge", delta)},
        coords={"layer": np.arange(n_layers), "src": ("edge", before["src"].values),
                "dst": ("edge", before["dst"].values)},
        attrs={"method": "layer-edge-change", "citation": CITATION})


def critical_layers(edge_change: xr.DataArray | Sequence[float], *, k: int | None = 5,
                    rule: str = "top-k") -> list[int]:
    """Layers with the largest edge change: the top ``k`` or those >= mean + std."""
    check_choice("rule", rule, ("top-k", "mean+std"))
    d = np.asarray(getattr(edge_change, "values", edge_change), float)
    if rule == "mean+std":
        return [int(i) for i in np.flatnonzero(d >= d.mean() + d.std())]
    k = check_int("k", k, low=1, high=len(d))
    return sorted(int(i) for i in np.argsort(-d, kind="stable")[:k])
