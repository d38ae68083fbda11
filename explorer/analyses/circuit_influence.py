"""Influence pruning of an edge circuit, for drawing a large faithful circuit readably.

A faithful EAP / EAP-IG circuit of SmolLM2 has thousands of edges (docs/circuits.md). The
attribution-graph viewers of circuit-tracer and Neuronpedia face graphs of that size and
prune them by *influence on the logits* (``circuit_tracer.graph.prune_graph``,
safety-research/circuit-tracer): the adjacency matrix ``A[target, source]`` holds |edge
weight|, each row is normalised to sum to 1 (the share of a node's input that each of its
in-edges carries), and a node's influence is the logit weight pushed back through every path,
``w @ (Â + Â² + ...)``. They keep the fewest nodes carrying ``node_threshold`` (0.8) of the
node influence (the input and the logits always), recompute the edge influence
``Â[t, s] * (influence[t] + w[t])`` on the graph of the kept nodes, keep the fewest edges
carrying ``edge_threshold`` (0.98) of it, and then drop, until nothing changes, every kept
head or MLP left without a kept in-edge or out-edge.

`influence_pruning` does exactly that on a circuit of the head/MLP graph, with |EAP score| as
the edge weight and the one logits node weighted 1. The circuit itself is not changed: the
pruned subset is what is drawn, and ``drawn_share`` says how much of the circuit's influence
it carries (each edge's influence measured on the whole circuit, not the pruned graph).
`strongest_paths` gives, for each node, the path from the input and the path to the logits
whose product of normalised weights is largest (what a hover shows).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import xarray as xr

from explorer._checks import InputError
from explorer.analyses.circuit_select.rules import edge_nodes

__all__ = ["influence_pruning", "node_influence", "edge_influence", "influence_threshold",
           "strongest_paths", "NODE_THRESHOLD", "EDGE_THRESHOLD"]

NODE_THRESHOLD = 0.8    # circuit-tracer's default node_threshold
EDGE_THRESHOLD = 0.98   # circuit-tracer's default edge_threshold


def _normalised(n_nodes: int, s_idx: np.ndarray, t_idx: np.ndarray, weight: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
    """Row-normalised |weight| matrix Â[target, source] (duplicate node pairs summed, as
    q/k/v edges into one head) and each edge's own normalised weight."""
    a = np.zeros((n_nodes, n_nodes))
    np.add.at(a, (t_idx, s_idx), np.abs(weight))
    rows = np.maximum(a.sum(1), 1e-10)             # circuit-tracer's clamp(min=1e-10)
    return a / rows[:, None], np.abs(weight) / rows[t_idx]


def node_influence(a_hat: np.ndarray, logit_weights: np.ndarray, max_iter: int = 1000
                   ) -> np.ndarray:
    """``w @ (Â + Â² + ...)``: each node's influence on the weighted output nodes through
    every path (``compute_influence`` of circuit-tracer; a DAG's powers vanish)."""
    current = logit_weights @ a_hat
    total = current.copy()
    for _ in range(max_iter):
        if not current.any():
            return total
        current = current @ a_hat
        total += current
    raise InputError(f"influence did not converge in {max_iter} steps: the graph has a cycle.")


def edge_influence(a_hat_edges: np.ndarray, t_idx: np.ndarray, influence: np.ndarray,
                   logit_weights: np.ndarray) -> np.ndarray:
    """Each edge's influence: its normalised weight times its target's influence plus the
    target's own logit weight (``compute_edge_influence`` of circuit-tracer)."""
    return a_hat_edges * (influence + logit_weights)[t_idx]


def influence_threshold(values: np.ndarray, share: float) -> float:
    """The value at which the largest values first carry ``share`` of their sum
    (``find_threshold`` of circuit-tracer): keep ``values >= threshold``."""
    v = np.sort(np.asarray(values, dtype=np.float64))[::-1]
    if not len(v) or v.sum() <= 0:
        return np.inf
    cum = np.cumsum(v) / v.sum()
    i = min(int(np.searchsorted(cum, share)), len(v) - 1)
    return float(v[i])


def _check_share(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) \
            or not 0.0 <= value <= 1.0:
        raise InputError(f"`{name}` must be a number in [0, 1]; got {value!r}.")
    return float(value)


def influence_pruning(scores: xr.Dataset, in_circuit: Any, *,
                      node_threshold: float = NODE_THRESHOLD,
                      edge_threshold: float = EDGE_THRESHOLD) -> xr.Dataset:
    """The influence-pruned subset of a circuit (circuit-tracer's ``prune_graph``).

    Parameters
    ----------
    scores : xr.Dataset
        Edge scores (`circuits.edge_scores`); |score| is the edge weight.
    in_circuit : bool array or DataArray over ``edge``
        The circuit (e.g. `circuits.select_circuit`).
    node_threshold, edge_threshold : float, default=0.8, 0.98
        Shares of the node and of the edge influence that the kept nodes and edges carry.

    Returns
    -------
    xr.Dataset
        Over ``edge``: ``influence`` (the edge's influence on the logits in the whole
        circuit; 0 outside it), ``drawn`` (bool: the pruned subset). Over ``node``:
        ``node_influence`` (in the whole circuit) and ``node_kept`` (bool, after the
        pruning's last pass). Attrs: ``drawn_share`` (sum of ``influence`` over the drawn
        edges / over the circuit), ``n_circuit``, ``n_drawn``, the thresholds, ``citation``.
    """
    names, s_idx, t_idx = edge_nodes(scores)
    mask = np.asarray(in_circuit.values if isinstance(in_circuit, xr.DataArray) else in_circuit)
    if mask.dtype != bool or mask.shape != (scores.sizes["edge"],):
        raise InputError(f"`in_circuit` must be a bool array over the {scores.sizes['edge']} "
                         f"edges of `scores`; got dtype {mask.dtype} and shape {mask.shape}.")
    node_threshold = _check_share("node_threshold", node_threshold)
    edge_threshold = _check_share("edge_threshold", edge_threshold)
    n = len(names)
    weight = np.where(mask, np.asarray(scores["score"].values, dtype=np.float64), 0.0)
    weight = np.nan_to_num(weight)
    w = np.zeros(n)
    if names[-1] == "logits":
        w[-1] = 1.0
    fixed = np.array([m in ("input", "logits") for m in names])

    # the whole circuit: node and edge influence (what the share is measured in)
    a_hat, a_e = _normalised(n, s_idx, t_idx, weight)
    infl = node_influence(a_hat, w)
    e_infl = np.where(mask, edge_influence(a_e, t_idx, infl, w), 0.0)

    # 1. the fewest nodes carrying node_threshold of the influence (input and logits kept)
    node_kept = (infl >= influence_threshold(infl, node_threshold)) | fixed
    # 2. edge influence on the graph of the kept nodes; the fewest edges carrying
    #    edge_threshold of it
    live = mask & node_kept[s_idx] & node_kept[t_idx]
    a_hat2, a_e2 = _normalised(n, s_idx, t_idx, np.where(live, weight, 0.0))
    infl2 = node_influence(a_hat2, w)
    e_infl2 = np.where(live, edge_influence(a_e2, t_idx, infl2, w), 0.0)
    edge_kept = live & (e_infl2 >= influence_threshold(e_infl2[live], edge_threshold)) \
        & (e_infl2 > 0)
    # 3. until nothing changes: a kept head or MLP needs a kept out-edge and a kept in-edge
    while True:
        has_out = np.zeros(n, bool)
        has_in = np.zeros(n, bool)
        has_out[s_idx[edge_kept]] = True
        has_in[t_idx[edge_kept]] = True
        new = node_kept & (fixed | (has_out & has_in))
        edge_kept &= new[s_idx] & new[t_idx]
        if (new == node_kept).all():
            break
        node_kept = new
    total = float(e_infl.sum())
    share = float(e_infl[edge_kept].sum() / total) if total > 0 else float("nan")
    return xr.Dataset(
        {"influence": ("edge", e_infl), "drawn": ("edge", edge_kept),
         "node_influence": ("node", infl), "node_kept": ("node", node_kept)},
        coords={**{k: v for k, v in scores["score"].coords.items()}, "node": names},
        attrs={"drawn_share": share, "n_circuit": int(mask.sum()),
               "n_drawn": int(edge_kept.sum()), "node_threshold": node_threshold,
               "edge_threshold": edge_threshold,
               "citation": "circuit-tracer prune_graph (safety-research/circuit-tracer); "
                           "Ameisen et al., Circuit Tracing, 2025"})


def strongest_paths(scores: xr.Dataset, in_circuit: Any) -> dict[str, tuple[list[int], list[int]]]:
    """For each node of the circuit: (edge indices of the path from the input to it, of the
    path from it to the logits) with the largest product of normalised weights (Â, as in
    `influence_pruning`); an empty list where there is no such path (or the node is an end).

    A dict keyed by node name: the paths are ragged lists of edge indices, which no labelled
    array holds.
    """
    names, s_idx, t_idx = edge_nodes(scores)
    mask = np.asarray(in_circuit.values if isinstance(in_circuit, xr.DataArray) else in_circuit)
    weight = np.where(mask, np.abs(np.asarray(scores["score"].values, dtype=np.float64)), 0.0)
    _, a_e = _normalised(len(names), s_idx, t_idx, weight)
    edges = np.flatnonzero(mask)
    n = len(names)
    best_in = np.zeros(n)
    via_in = np.full(n, -1)
    best_out = np.zeros(n)
    via_out = np.full(n, -1)
    if names[0] == "input":
        best_in[0] = 1.0
    if names[-1] == "logits":
        best_out[-1] = 1.0
    by_dst = sorted(edges, key=lambda e: (t_idx[e], s_idx[e]))   # forward order of targets
    for e in by_dst:
        v = best_in[s_idx[e]] * a_e[e]
        if v > best_in[t_idx[e]]:
            best_in[t_idx[e]], via_in[t_idx[e]] = v, e
    for e in sorted(edges, key=lambda e: (-s_idx[e], -t_idx[e])):   # backward order of sources
        v = best_out[t_idx[e]] * a_e[e]
        if v > best_out[s_idx[e]]:
            best_out[s_idx[e]], via_out[s_idx[e]] = v, e
    out: dict[str, tuple[list[int], list[int]]] = {}
    touched = set(s_idx[edges].tolist()) | set(t_idx[edges].tolist())
    for k in sorted(touched):
        back, node = [], k
        while via_in[node] >= 0:
            back.append(int(via_in[node]))
            node = s_idx[via_in[node]]
        fwd, node = [], k
        while via_out[node] >= 0:
            fwd.append(int(via_out[node]))
            node = t_idx[via_out[node]]
        out[names[k]] = (back[::-1], fwd)
    return out
