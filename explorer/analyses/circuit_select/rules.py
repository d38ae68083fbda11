"""Edge-selection rules: the top-n edges and the paper's greedy construction, dead-node
pruning, and the faithfulness curve of a rule with bootstrap intervals over the pairs."""
from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import xarray as xr

from explorer._checks import InputError, check_choice, check_int
from explorer.analyses.circuits import (faithfulness_curve, node_of, patch_edges_metric,
                                        select_circuit)

__all__ = [
    'SELECTION_RULES', 'edge_nodes', 'prune_dead_nodes', 'greedy_circuit', 'circuit_by_rule',
    'default_sizes', 'rule_faithfulness_curve', 'bootstrap_recovered',
]


SELECTION_RULES = ("top-n", "greedy")


def _node_rank(name: str) -> tuple[int, int, int]:
    """Forward (topological) position of a node: input, then per layer its heads, its MLP,
    and the logits last."""
    if name == "input":
        return (-1, 0, 0)
    if name == "logits":
        return (1 << 30, 0, 0)
    try:
        if name.startswith("a") and ".h" in name:
            return (int(name[1:name.index(".h")]), 0, int(name[name.index(".h") + 2:]))
        if name.startswith("m"):
            return (int(name[1:]), 1, 0)
    except ValueError:
        pass
    raise InputError(f"unknown node {name!r}; nodes are 'input', 'a{{layer}}.h{{head}}', "
                     "'m{layer}' and 'logits'.")


def edge_nodes(scores: xr.Dataset) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Node names in forward order and each edge's source and destination index into them
    (a tuple: the names and the two index arrays are read together by every graph walk)."""
    if not isinstance(scores, xr.Dataset) or "score" not in scores or "edge" not in scores.dims \
            or not {"src", "dst"} <= set(scores.coords):
        raise TypeError("`scores` must be the Dataset returned by edge_scores (a `score` "
                        f"variable over `edge` with `src` and `dst`); got {type(scores).__name__}.")
    # each distinct name once (a graph has hundreds of nodes and up to ~10^5 edges)
    src, src_of_edge = np.unique(scores["src"].values.astype(str), return_inverse=True)
    dst, dst_of_edge = np.unique(scores["dst"].values.astype(str), return_inverse=True)
    # the q/k/v-split graph: an edge into a head's query, key or value input leads into the
    # head (hannamw/EAP-IG: such an edge's child is the AttentionNode)
    dst_nodes = [node_of(d) for d in dst.tolist()]
    names = sorted(set(src.tolist()) | set(dst_nodes), key=_node_rank)
    index = {n: i for i, n in enumerate(names)}
    return names, np.array([index[s] for s in src.tolist()], dtype=int)[src_of_edge.ravel()], \
        np.array([index[d] for d in dst_nodes], dtype=int)[dst_of_edge.ravel()]


def _mask_array(scores: xr.Dataset, mask: np.ndarray, *, rule: str, **attrs: Any) -> xr.DataArray:
    da = xr.DataArray(mask, dims=("edge",), coords=scores["score"].coords, name="in_circuit")
    da.attrs.update(rule=rule, **attrs)
    return da


def prune_dead_nodes(scores: xr.Dataset, in_circuit: Any) -> xr.DataArray:
    """The circuit without dead ends: ``Graph.prune_dead_nodes`` of hannamw/EAP-IG (the version
    behind Hanna et al. 2024).

    One pass from the logits backwards drops every node none of whose out-edges is in the
    circuit, with its in-edges (childless); one pass from the input forwards drops every node
    but the input none of whose in-edges is left, with its out-edges (parentless). What is
    left are the edges on some input -> logits path, the same set `circuits.select_circuit`
    keeps by graph search (tested).
    """
    names, s_idx, t_idx = edge_nodes(scores)
    mask = np.asarray(in_circuit.values if isinstance(in_circuit, xr.DataArray) else in_circuit)
    if mask.dtype != bool or mask.shape != (scores.sizes["edge"],):
        raise InputError(f"`in_circuit` must be a bool array over the {scores.sizes['edge']} edges "
                         f"of `scores`; got dtype {mask.dtype} and shape {mask.shape}.")
    keep = mask.copy()
    n_nodes = len(names)
    out_edges = [np.nonzero(s_idx == k)[0] for k in range(n_nodes)]
    in_edges = [np.nonzero(t_idx == k)[0] for k in range(n_nodes)]
    logits, inp = n_nodes - 1, 0
    for k in range(n_nodes - 2, -1, -1):            # childless, from the last layer down
        if not keep[out_edges[k]].any():
            keep[in_edges[k]] = False
    for k in range(1, n_nodes - 1):                  # parentless, from the first layer up
        if keep[out_edges[k]].any() and not keep[in_edges[k]].any():
            keep[out_edges[k]] = False
    if names[inp] != "input" or names[logits] != "logits":
        keep[:] = False                              # no input or no logits: no path at all
    return _mask_array(scores, keep, rule="pruned", n_chosen=int(mask.sum()))


def greedy_circuit(scores: xr.Dataset, n_edges: int, *, absolute: bool = True) -> xr.DataArray:
    """The greedy circuit of ``n_edges`` edges, built from the logits backwards, then pruned.

    The circuit starts as the logits node. At each of ``n_edges`` steps the edge of largest
    |score| (``absolute``; else largest score) among the edges into a node already in the
    circuit is added, and its source node joins, making its own in-edges candidates. Every
    chosen edge thus leads to the logits; `prune_dead_nodes` then drops the chains that never
    reach the input. This is ``Graph.apply_greedy`` + ``prune_dead_nodes`` of hannamw/EAP-IG,
    the construction of every circuit in Hanna et al., "Have Faith in Faithfulness", COLM
    2024 (ties here go to the earlier edge).

    Returns
    -------
    xr.DataArray
        ``in_circuit`` (edge) bool, as `circuits.select_circuit` returns it;
        ``attrs["n_chosen"]`` is the count before pruning (``n_edges``).
    """
    names, s_idx, t_idx = edge_nodes(scores)
    n_total = len(s_idx)
    n_edges = check_int("n_edges", n_edges, low=0, high=n_total)
    if not isinstance(absolute, bool):
        raise TypeError(f"`absolute` must be a bool; got {type(absolute).__name__}.")
    key = np.asarray(scores["score"].values, dtype=np.float64)
    key = np.abs(key) if absolute else key
    key = np.nan_to_num(key, nan=-np.inf)
    in_edges = [[] for _ in names]
    for e, t in enumerate(t_idx):
        in_edges[t].append(e)
    in_graph = np.zeros(len(names), dtype=bool)
    chosen = np.zeros(n_total, dtype=bool)
    heap: list[tuple[float, int]] = []

    def add_node(k: int) -> None:
        in_graph[k] = True
        for e in in_edges[k]:
            heapq.heappush(heap, (-key[e], e))

    if names and names[-1] == "logits":
        add_node(len(names) - 1)
    for _ in range(n_edges):
        if not heap:
            break
        _, e = heapq.heappop(heap)
        chosen[e] = True
        if not in_graph[s_idx[e]]:
            add_node(int(s_idx[e]))
    pruned = prune_dead_nodes(scores, chosen).values
    return _mask_array(scores, pruned, rule="greedy", n_chosen=int(chosen.sum()),
                       top_n=n_edges, absolute=absolute)


def _top_n(scores: xr.Dataset, n: int) -> xr.DataArray:
    da = select_circuit(scores, top_n=n)
    da.attrs["rule"] = "top-n"
    return da


_RULES: dict[str, Callable[[xr.Dataset, int], xr.DataArray]] = {
    "top-n": _top_n,
    "greedy": greedy_circuit,
}


def circuit_by_rule(scores: xr.Dataset, n_edges: int, rule: str = "top-n") -> xr.DataArray:
    """The pruned circuit of ``n_edges`` chosen edges under ``rule`` (`SELECTION_RULES`):
    ``"top-n"`` is `circuits.select_circuit`, ``"greedy"`` is `greedy_circuit`."""
    check_choice("rule", rule, SELECTION_RULES)
    return _RULES[rule](scores, n_edges)


def default_sizes(n_total: int, max_edges: int = 300, *, low: int = 10,
                  n_points: int = 12) -> list[int]:
    """Log-spaced circuit sizes from ``low`` to ``max_edges`` (at most ``n_total``), distinct."""
    n_total = check_int("n_total", n_total, low=1)
    max_edges = check_int("max_edges", max_edges, low=1)
    high = min(max_edges, n_total)
    low = min(check_int("low", low, low=1), high)
    grid = np.unique(np.round(np.geomspace(low, high, n_points)).astype(int))
    return [int(g) for g in grid]


def rule_faithfulness_curve(model, task, scores: xr.Dataset, *, sizes: Sequence[int],
                            rule: str = "top-n", metric: str = "logit_diff",
                            batch_size: int = 16, per_pair: bool = False,
                            progress: Callable[[int, int], None] | None = None) -> xr.Dataset:
    """Metric recovered by the circuits of ``rule`` at each size, by really patching every
    edge outside the circuit (`circuits.patch_edges_metric`).

    Parameters
    ----------
    sizes : sequence of int
        Numbers of chosen edges (before pruning): top-n, or greedy steps.
    rule : {"top-n", "greedy"}, default="top-n"
    per_pair : bool, default=False
        Patch each prompt pair on its own and keep its values (``pair_metric`` and the pair's
        clean and corrupted metric), for bootstrap intervals (`bootstrap_recovered`). The
        means are the same either way (each is a mean over the pairs). Without it, top-n is
        `circuits.faithfulness_curve` (one pass); greedy patches each distinct circuit with
        `circuits.patch_edges_metric` (its own clean and corrupted runs each time).
    progress : callable(done, total), optional
        Called after each circuit (and pair).

    Returns
    -------
    xr.Dataset
        As `circuits.faithfulness_curve`: over ``n_edges``, ``metric`` (mean over pairs),
        ``recovered`` ((metric - corrupted) / (clean - corrupted), the ratio of means as in
        Hanna et al. 2024), ``accuracy``, ``n_kept`` (edges after pruning); attrs
        ``clean_metric``, ``corrupt_metric``, ``clean_accuracy``, ``corrupt_accuracy``,
        ``rule``, ``n_edges_total``. With ``per_pair``: ``pair_metric`` (n_edges, prompt),
        ``pair_clean_metric`` and ``pair_corrupt_metric`` (prompt).
    """
    check_choice("rule", rule, SELECTION_RULES)
    if not isinstance(per_pair, bool):
        raise TypeError(f"`per_pair` must be a bool; got {type(per_pair).__name__}.")
    if isinstance(sizes, (int, np.integer)) or not isinstance(sizes, Sequence | np.ndarray):
        raise TypeError(f"`sizes` must be a list of ints; got {type(sizes).__name__}.")
    n_total = int(scores.sizes["edge"])
    sizes = [check_int("sizes[i]", int(s) if isinstance(s, np.integer) else s, low=0,
                       high=n_total) for s in sizes]
    if not sizes:
        raise InputError("`sizes` must hold at least one circuit size; got an empty list.")
    if rule == "top-n" and not per_pair:
        # one pass: the clean and corrupted runs shared by every size
        curve = faithfulness_curve(model, task, scores, sizes=sizes, metric=metric,
                                   batch_size=batch_size, progress=progress)
        curve.attrs.update(rule=rule, scores_method=scores.attrs.get("scoring"))
        return curve
    masks = [circuit_by_rule(scores, s, rule) for s in sizes]
    groups = [[i] for i in range(len(task))] if per_pair else [list(range(len(task)))]
    total_steps, done = len(groups) * len(masks), 0
    # [n_edges, group] of metric and accuracy; [group] of clean / corrupted values
    metric_v = np.zeros((len(masks), len(groups)))
    acc_v = np.zeros((len(masks), len(groups)))
    base = {k: np.zeros(len(groups)) for k in ("clean_metric", "corrupt_metric",
                                               "clean_accuracy", "corrupt_accuracy")}
    for g, rows in enumerate(groups):
        sub = task if not per_pair else task.subset(rows)
        seen: dict[bytes, dict[str, Any]] = {}   # equal circuits (often several empty ones)
        for j, mask in enumerate(masks):
            code = np.packbits(mask.values).tobytes()
            if code not in seen:
                seen[code] = patch_edges_metric(model, sub, scores, mask, metric=metric,
                                                batch_size=batch_size)
            res = seen[code]
            metric_v[j, g], acc_v[j, g] = res["metric"], res["accuracy"]
            for k in base:
                base[k][g] = res[k]
            done += 1
            if progress is not None:
                progress(done, total_steps)
    # group means -> means over pairs (each group has one pair, or all of them)
    metric_m, acc_m = metric_v.mean(1), acc_v.mean(1)
    clean, corrupt = float(base["clean_metric"].mean()), float(base["corrupt_metric"].mean())
    span = clean - corrupt
    recovered = (metric_m - corrupt) / span if span != 0 else np.full(len(masks), np.nan)
    data = {"metric": ("n_edges", metric_m), "recovered": ("n_edges", recovered),
            "accuracy": ("n_edges", acc_m),
            "n_kept": ("n_edges", np.array([int(m.values.sum()) for m in masks]))}
    coords: dict[str, Any] = {"n_edges": np.array(sizes)}
    if per_pair:
        data.update(pair_metric=(("n_edges", "prompt"), metric_v),
                    pair_clean_metric=("prompt", base["clean_metric"]),
                    pair_corrupt_metric=("prompt", base["corrupt_metric"]))
        coords["prompt"] = np.arange(len(task))
    attrs = {"clean_metric": clean, "corrupt_metric": corrupt,
             "clean_accuracy": float(base["clean_accuracy"].mean()),
             "corrupt_accuracy": float(base["corrupt_accuracy"].mean()),
             "rule": rule, "metric": metric, "task": getattr(task, "name", "custom"),
             "n_prompts": len(task), "n_edges_total": n_total,
             "scores_method": scores.attrs.get("scoring", scores.attrs.get("method")),
             "citation": "Hanna, Pezzelle, Belinkov, Have Faith in Faithfulness, COLM 2024"}
    return xr.Dataset(data, coords=coords, attrs=attrs)


def bootstrap_recovered(curve: xr.Dataset, *, n_boot: int = 2000, level: float = 0.95,
                        seed: int = 0) -> xr.Dataset:
    """Percentile bootstrap interval of ``recovered`` over prompt pairs.

    Pairs are resampled with replacement; each resample's recovered fraction is the ratio of
    its means, (mean metric - mean corrupted) / (mean clean - mean corrupted), the same
    statistic as the curve's. Needs a curve measured with ``per_pair=True``.

    Returns
    -------
    xr.Dataset
        The curve plus ``recovered_low`` and ``recovered_high`` over ``n_edges`` (or
        ``n_nodes``: a node curve).
    """
    if not isinstance(curve, xr.Dataset) or "pair_metric" not in curve:
        raise InputError("`curve` needs per-pair values; measure it with "
                         "rule_faithfulness_curve(..., per_pair=True).")
    n_boot = check_int("n_boot", n_boot, low=1)
    if isinstance(level, bool) or not isinstance(level, (int, float)) or not 0 < level < 1:
        raise InputError(f"`level` must be a number in (0, 1); got {level!r}.")
    dim = "n_nodes" if "n_nodes" in curve.dims else "n_edges"
    m = np.asarray(curve["pair_metric"].transpose(dim, "prompt").values, dtype=np.float64)
    clean = np.asarray(curve["pair_clean_metric"].values, dtype=np.float64)
    corrupt = np.asarray(curve["pair_corrupt_metric"].values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(clean), size=(n_boot, len(clean)))   # [boot, pair]
    c_mean, k_mean = clean[idx].mean(1), corrupt[idx].mean(1)        # [boot]
    m_mean = m[:, idx].mean(2)                                       # [n_edges, boot]
    with np.errstate(divide="ignore", invalid="ignore"):
        rec = (m_mean - k_mean) / (c_mean - k_mean)
    rec = np.where(np.isfinite(rec), rec, np.nan)
    alpha = (1 - level) / 2
    low = np.nanquantile(rec, alpha, axis=1)
    high = np.nanquantile(rec, 1 - alpha, axis=1)
    out = curve.copy()
    out["recovered_low"] = (dim, low)
    out["recovered_high"] = (dim, high)
    out.attrs.update(bootstrap_n=n_boot, bootstrap_level=level, bootstrap_seed=seed)
    return out
