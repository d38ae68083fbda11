"""Node-level circuits: nodes ranked by their edges' scores, the circuit of the top-k nodes and
its faithfulness curve."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import xarray as xr

from explorer._checks import InputError, check_int
from explorer.analyses.circuit_select.choice import (CURVE_POINTS, CircuitChoice, REFINE_STEPS,
                                                     smallest_faithful_circuit)
from explorer.analyses.circuit_select.default import merge_curves, next_bisection_size
from explorer.analyses.circuit_select.rules import edge_nodes, _mask_array
from explorer.analyses.circuits import node_of
from explorer.analyses.circuits.faithfulness import keep_matrix, patched_metrics, recovered_fraction
from explorer.analyses.circuits.scores import prepare_circuit_run
from explorer.analyses.circuits.selection import check_scores

__all__ = [
    'node_scores', 'node_ranking', 'node_circuit_edges', 'node_circuit', 'node_faithfulness_curve',
    'default_node_sizes', 'smallest_faithful_nodes', 'measured_node_curve',
]


def node_scores(scores: xr.Dataset) -> xr.DataArray:
    """Attribution of each source node (input, heads, MLPs): the sum of its out-edges' scores.

    An edge's score is (z_u(corrupt) - z_u(clean)) . dM/d(input of v); the input of every
    reader is the sum of the writers, so the sum over a node's out-edges is the attribution
    of patching that node's output everywhere (node-level attribution patching)."""
    names, s_idx, _ = edge_nodes(scores)
    total = np.zeros(len(names))
    np.add.at(total, s_idx, np.asarray(scores["score"].values, dtype=np.float64))
    keep = [i for i, n in enumerate(names) if n != "logits"]
    return xr.DataArray(total[keep], dims=("node",), coords={"node": [names[i] for i in keep]},
                        name="node_score")


def node_ranking(scores: xr.Dataset) -> list[str]:
    """Source nodes (input, heads, MLPs) by |`node_scores`|, largest first (ties in forward
    order)."""
    ns = node_scores(scores)
    return [str(n) for n in ns["node"].values[np.argsort(-np.abs(ns.values), kind="stable")]]


def node_circuit_edges(scores: xr.Dataset, nodes: Sequence[str]) -> np.ndarray:
    """Bool mask over the edges: every out-edge of the kept ``nodes``. Patching the others
    (`circuits.patch_edges_metric`) gives every reader a left-out node's corrupted output:
    node patching (a node's output replaced by its value on the corrupted prompt)."""
    kept = np.isin(np.asarray(scores["src"].values).astype(str), list(nodes))
    return kept


def node_circuit(scores: xr.Dataset, n_nodes: int) -> xr.DataArray:
    """The node circuit of the top ``n_nodes`` nodes by |node score| (`node_ranking`) as an
    edge mask: the edges between kept nodes and from kept nodes to the logits.

    Patched (`circuits.patch_edges_metric`) it gives the same metric as node patching
    (`node_circuit_edges`): an edge into a left-out node is patched here and kept there,
    but the left-out node's own output is corrupted either way, so no reader sees the
    difference. It is the picture of the node circuit: what runs clean between its nodes.
    """
    order = node_ranking(scores)
    n_nodes = check_int("n_nodes", n_nodes, low=0, high=len(order))
    kept = set(order[:n_nodes])
    src = np.asarray(scores["src"].values).astype(str)
    dst = [node_of(str(d)) for d in scores["dst"].values]
    mask = np.isin(src, list(kept)) & np.array([d in kept or d == "logits" for d in dst],
                                               dtype=bool)
    return _mask_array(scores, mask, rule="nodes", n_nodes=n_nodes, nodes=order[:n_nodes])


def node_faithfulness_curve(model, task, scores: xr.Dataset, *, sizes: Sequence[int],
                            metric: str = "logit_diff", batch_size: int = 16,
                            progress: Callable[[int, int], None] | None = None) -> xr.Dataset:
    """Metric recovered by the top-k nodes by |`node_scores`| (the input counts as a node),
    every other node's output patched to its corrupted value, at each k of ``sizes``.

    Returns
    -------
    xr.Dataset
        Over ``n_nodes``: ``metric``, ``recovered`` (clean = 1, corrupted = 0), ``accuracy``,
        ``n_edges_kept`` (the edges between kept nodes and to the logits, `node_circuit`);
        per pair ``pair_metric`` (n_nodes, prompt), ``pair_clean_metric`` and
        ``pair_corrupt_metric`` (prompt), for `bootstrap_recovered`; ``order`` (attr: the
        ranking).
    """
    ad, task, batch_size = prepare_circuit_run(model, task, metric, batch_size)
    scores = check_scores(scores)
    order = node_ranking(scores)
    if isinstance(sizes, (int, np.integer)) or not isinstance(sizes, Sequence | np.ndarray):
        raise TypeError(f"`sizes` must be a list of ints; got {type(sizes).__name__}.")
    sizes = [check_int("sizes[i]", int(k), low=0, high=len(order)) for k in sizes]
    if not sizes:
        raise InputError("`sizes` must hold at least one node count; got an empty list.")
    masks = [node_circuit(scores, k).values for k in sizes]
    keeps = [keep_matrix(model, ad, scores, m) for m in masks]
    res = patched_metrics(model, ad, task, keeps, metric, batch_size, progress)
    rec = recovered_fraction(res["metric"], res["clean_metric"], res["corrupt_metric"])
    return xr.Dataset(
        {"metric": ("n_nodes", res["metric"]), "recovered": ("n_nodes", rec),
         "accuracy": ("n_nodes", res["accuracy"]),
         "n_edges_kept": ("n_nodes", np.array([int(m.sum()) for m in masks])),
         "pair_metric": (("n_nodes", "prompt"), res["pair_metric"].reshape(len(sizes), -1)),
         "pair_clean_metric": ("prompt", res["pair_clean_metric"]),
         "pair_corrupt_metric": ("prompt", res["pair_corrupt_metric"])},
        coords={"n_nodes": np.array(sizes), "prompt": np.arange(len(task))},
        attrs={"clean_metric": float(res["clean_metric"]),
               "corrupt_metric": float(res["corrupt_metric"]),
               "clean_accuracy": float(res["clean_accuracy"]), "order": order,
               "n_nodes_total": len(order), "metric": metric, "sizes": sizes,
               "task": getattr(task, "name", "custom"), "n_prompts": len(task)})


def default_node_sizes(n_total: int, *, points: int = CURVE_POINTS) -> list[int]:
    """0 and about ``points`` log-spaced node counts from 1 to all ``n_total`` nodes."""
    n_total = check_int("n_total", n_total, low=1)
    return [0, *np.unique(np.round(np.geomspace(1, n_total, points)).astype(int)).tolist()]


def smallest_faithful_nodes(curve: xr.Dataset, fraction: float = 0.8) -> CircuitChoice:
    """The smallest measured node circuit of a node curve (`node_faithfulness_curve`) that
    recovers at least ``fraction``; when none does, the most faithful non-empty one
    (``reached`` False). ``n_edges`` and ``n_kept`` of the choice hold its node count."""
    if not isinstance(curve, xr.Dataset) or "n_nodes" not in curve.dims:
        raise TypeError("`curve` must be the Dataset of node_faithfulness_curve (over "
                        f"`n_nodes`); got {type(curve).__name__}.")
    view = curve.rename(n_nodes="n_edges")
    view["n_kept"] = ("n_edges", np.asarray(curve["n_nodes"].values, dtype=int))
    return smallest_faithful_circuit(view, fraction)


def measured_node_curve(model, task, scores: xr.Dataset, *, fraction: float = 0.8,
                        sizes: Sequence[int] | None = None, refine_steps: int = REFINE_STEPS,
                        batch_size: int = 16,
                        progress: Callable[[int, int], None] | None = None,
                        check: Callable[[], None] | None = None) -> xr.Dataset:
    """The node-level counterpart of `measured_default_curve`: node circuits measured by
    patching at ``sizes`` (default `default_node_sizes`), then ``refine_steps`` bisection
    steps between the first node count that recovers ``fraction`` and the count below it.
    The node default is then `smallest_faithful_nodes` of it."""
    n_total = int(node_scores(scores).sizes["node"])
    sizes = list(sizes) if sizes is not None else default_node_sizes(n_total)
    curve = node_faithfulness_curve(model, task, scores, sizes=sizes, batch_size=batch_size,
                                    progress=progress)
    for _ in range(check_int("refine_steps", refine_steps, low=0, high=20)):
        if check is not None:
            check()
        more = next_bisection_size(curve, fraction, dim="n_nodes")
        if more is None:
            break
        extra = node_faithfulness_curve(model, task, scores, sizes=[more],
                                        batch_size=batch_size)
        curve = merge_curves(curve, extra, dim="n_nodes")
    return curve
