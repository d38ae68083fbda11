"""Choosing the circuit to show from a measured faithfulness curve.

The faithfulness curve (`circuits.faithfulness_curve`) patches every edge outside the top-n
circuit (pruned to input -> logits paths) at a list of sizes n. The circuit worth reading
first is the smallest of those that recovers a chosen share of the metric, as long as it is
small enough to read; when none is, the most faithful one within the cap (Hanna et al., "Have
Faith in Faithfulness", COLM 2024, read circuits the same way: the smallest that is faithful).

Two rules build the circuit of n edges from the edge scores (`SELECTION_RULES`):

- ``"top-n"``: the n edges of largest |score|, pruned to input -> logits paths
  (`circuits.select_circuit`; the EAP-IG library's ``Graph.apply_topn`` + ``prune``).
- ``"greedy"``: the paper's own construction (`greedy_circuit`; ``Graph.apply_greedy`` of
  hannamw/EAP-IG, used for every faithfulness curve of Hanna et al. 2024): start from the
  logits and repeatedly add the highest-|score| edge INTO a node already in the circuit, so
  every chosen edge leads to the logits; then prune dead nodes (`prune_dead_nodes`).

Both work on the q/k/v-split graph too (`circuits.edge_scores(split_qkv=True)`), as the
library does: an edge into a head's query, key or value input is an edge into the head, so a
head joins the circuit (and its in-edges become greedy candidates) through any of the three,
and patching keeps the other inputs' edges at their corrupted values.

`rule_faithfulness_curve` measures either rule's curve by patching (`circuits.
patch_edges_metric`), with per-pair values for bootstrap intervals (`bootstrap_recovered`);
`choose_default_circuit` is the one call that picks the circuit a page opens on.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xarray as xr

from explorer._checks import InputError, check_choice, check_int
from explorer.analyses.circuits import (faithfulness_curve, node_of, patch_edges_metric,
                                        select_circuit)
from explorer.analyses.circuits.faithfulness import keep_matrix, patched_metrics, recovered_fraction
from explorer.analyses.circuits.scores import prepare_circuit_run
from explorer.analyses.circuits.selection import check_scores

__all__ = ["CircuitChoice", "smallest_faithful_circuit", "readable_sizes", "READABLE_TARGETS",
           "SELECTION_RULES", "greedy_circuit", "prune_dead_nodes", "circuit_by_rule",
           "default_sizes", "rule_faithfulness_curve", "bootstrap_recovered", "DefaultCircuit",
           "choose_default_circuit", "next_bisection_size", "merge_curves", "node_scores",
           "node_circuit_edges", "node_faithfulness_curve", "node_ranking", "node_circuit",
           "default_node_sizes", "smallest_faithful_nodes", "measured_node_curve", "default_curve_sizes",
           "measured_default_curve", "CURVE_POINTS", "REFINE_STEPS"]

CURVE_POINTS = 12   # log-spaced top-n sizes a default curve measures first
REFINE_STEPS = 2    # bisection steps narrowing the smallest circuit reaching the target

READABLE_TARGETS = (10, 25, 50, 100, 200, 300)   # pruned circuit sizes a person can read


@dataclass(frozen=True)
class CircuitChoice:
    """One point of a faithfulness curve chosen by `smallest_faithful_circuit`.

    ``n_edges`` is the top-n (the curve's coordinate, before pruning), ``n_kept`` the edges
    left after pruning, ``recovered`` the share of the metric the circuit recovers, and
    ``reached`` whether that share is at least the fraction asked for.
    """

    n_edges: int
    n_kept: int
    recovered: float
    reached: bool


def smallest_faithful_circuit(curve: xr.Dataset, fraction: float = 0.8, *,
                              max_edges: int | None = None) -> CircuitChoice:
    """The smallest measured circuit that recovers at least ``fraction`` of the metric.

    Parameters
    ----------
    curve : xr.Dataset
        From `circuits.faithfulness_curve`: ``recovered`` and ``n_kept`` over ``n_edges``.
    fraction : float, default=0.8
        Share of the clean-minus-corrupted metric the circuit must recover.
    max_edges : int, optional
        The most edges (after pruning) a chosen circuit may have. When no circuit within it
        reaches ``fraction``, the one within it that recovers the most is returned
        (``reached`` False), leaving out the empty circuit; when no non-empty circuit fits,
        the smallest non-empty one, past the cap.

    Returns
    -------
    CircuitChoice
        Sizes are compared after pruning (``n_kept``); of points with equal ``n_kept`` the
        one with the smaller top-n comes first.
    """
    if not isinstance(curve, xr.Dataset) or not {"recovered", "n_kept"} <= set(curve.data_vars):
        raise TypeError("`curve` must be the Dataset of faithfulness_curve (with `recovered` "
                        f"and `n_kept` over `n_edges`); got {type(curve).__name__}.")
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float, np.floating)) \
            or not 0 <= fraction <= 1:
        raise InputError(f"`fraction` must be a number in [0, 1]; got {fraction!r}.")
    if max_edges is not None and (isinstance(max_edges, bool) or not isinstance(
            max_edges, (int, np.integer)) or max_edges < 0):
        raise InputError(f"`max_edges` must be an int >= 0 or None; got {max_edges!r}.")
    top_n = np.asarray(curve["n_edges"].values, dtype=int)
    kept = np.asarray(curve["n_kept"].values, dtype=int)
    rec = np.asarray(curve["recovered"].values, dtype=np.float64)
    order = np.lexsort((top_n, kept))                 # by pruned size, then top-n
    fits = order if max_edges is None else order[kept[order] <= max_edges]
    if not (kept[fits] > 0).any() and (kept > 0).any():
        # pruned sizes jump (one edge can complete hundreds of paths): when no non-empty
        # circuit fits the cap, the smallest non-empty one
        i = int(order[kept[order] > 0][0])
        return CircuitChoice(n_edges=int(top_n[i]), n_kept=int(kept[i]), recovered=float(rec[i]),
                             reached=bool(rec[i] >= fraction))
    if len(fits) == 0:
        raise InputError(f"no point of the curve has at most {max_edges} edges; its smallest "
                         f"circuit has {int(kept.min())}.")
    reaching = fits[np.nan_to_num(rec[fits], nan=-np.inf) >= fraction]
    if len(reaching):
        i, reached = int(reaching[0]), True
    else:   # the most faithful non-empty circuit that fits (the smallest of equals)
        pool = fits[kept[fits] > 0] if (kept[fits] > 0).any() else fits
        best = np.nan_to_num(rec[pool], nan=-np.inf)
        i, reached = int(pool[int(np.argmax(best))]), False
    return CircuitChoice(n_edges=int(top_n[i]), n_kept=int(kept[i]), recovered=float(rec[i]),
                         reached=reached)


def readable_sizes(scores: xr.Dataset, targets: Sequence[int] = READABLE_TARGETS) -> list[int]:
    """Top-n sizes whose pruned circuits first reach each of ``targets`` edges.

    Log-spaced top-n sizes can jump past every readable circuit (on SmolLM2's `add`, the top
    373 edges hold no input -> logits path, the top 532 hundreds of edges), so these sizes
    are measured too. The pruned size never shrinks as n grows (more chosen edges only add
    paths), so each is found by bisection on n (`circuits.select_circuit`, a few ms a call).
    Targets larger than the whole pruned graph are left out.
    """
    n_total = int(scores.sizes["edge"])

    def kept(n: int) -> int:
        return int(select_circuit(scores, top_n=n).sum())

    out = set()
    top = kept(n_total)
    for target in targets:
        if target > top:
            continue
        lo, hi = 0, n_total             # kept(lo) < target <= kept(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if kept(mid) >= target:
                hi = mid
            else:
                lo = mid
        out.add(hi)
    return sorted(out)


# -- the paper's greedy construction ------------------------------------------------------------

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


def _edge_nodes(scores: xr.Dataset) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Node names in forward order and each edge's source and destination index into them."""
    if not isinstance(scores, xr.Dataset) or "score" not in scores or "edge" not in scores.dims \
            or not {"src", "dst"} <= set(scores.coords):
        raise TypeError("`scores` must be the Dataset returned by edge_scores (a `score` "
                        f"variable over `edge` with `src` and `dst`); got {type(scores).__name__}.")
    src = [str(s) for s in scores["src"].values]
    # the q/k/v-split graph: an edge into a head's query, key or value input leads into the
    # head (hannamw/EAP-IG: such an edge's child is the AttentionNode)
    dst = [node_of(str(d)) for d in scores["dst"].values]
    names = sorted(set(src) | set(dst), key=_node_rank)
    index = {n: i for i, n in enumerate(names)}
    return names, np.array([index[s] for s in src], dtype=int), \
        np.array([index[d] for d in dst], dtype=int)


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
    names, s_idx, t_idx = _edge_nodes(scores)
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
    names, s_idx, t_idx = _edge_nodes(scores)
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


# -- faithfulness of a rule ----------------------------------------------------------------------

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


# -- the page's default circuit ------------------------------------------------------------------

@dataclass(frozen=True)
class DefaultCircuit:
    """The circuit a page opens on: the choice, the curve it was chosen from, its edges."""

    choice: CircuitChoice
    curve: xr.Dataset
    in_circuit: xr.DataArray
    rule: str


def choose_default_circuit(model, task, scores: xr.Dataset, *, fraction: float = 0.8,
                           max_edges: int = 300, rule: str = "top-n",
                           sizes: Sequence[int] | None = None, metric: str = "logit_diff",
                           batch_size: int = 16,
                           progress: Callable[[int, int], None] | None = None) -> DefaultCircuit:
    """The smallest circuit of ``rule`` that recovers ``fraction`` of the metric within
    ``max_edges`` edges (or the most faithful one within it), measured by patching.

    ``sizes`` defaults to `default_sizes` up to ``max_edges``; for ``"top-n"`` the sizes
    where the pruned circuit first reaches 10, 25, ... edges (`readable_sizes`) are added,
    since log steps of top-n can jump past every readable circuit. The choice is
    `smallest_faithful_circuit` on the measured curve.
    """
    check_choice("rule", rule, SELECTION_RULES)
    max_edges = check_int("max_edges", max_edges, low=1)
    n_total = int(scores.sizes["edge"])
    if sizes is None:
        grid = set(default_sizes(n_total, max_edges))
        if rule == "top-n":
            grid |= set(readable_sizes(scores, [t for t in READABLE_TARGETS if t <= max_edges]))
        sizes = sorted(grid)
    curve = rule_faithfulness_curve(model, task, scores, sizes=sizes, rule=rule, metric=metric,
                                    batch_size=batch_size, progress=progress)
    choice = smallest_faithful_circuit(curve, fraction, max_edges=max_edges)
    return DefaultCircuit(choice=choice, curve=curve,
                          in_circuit=circuit_by_rule(scores, choice.n_edges, rule), rule=rule)


def next_bisection_size(curve: xr.Dataset, fraction: float, *, dim: str = "n_edges"
                        ) -> int | None:
    """The top-n (or node count, ``dim="n_nodes"``) to measure next to narrow the smallest
    circuit reaching ``fraction``: the geometric midpoint of the first measured size that
    reaches it and the measured size just below; None when the smallest measured size
    reaches it, none does, or the two are neighbours."""
    top_n = np.asarray(curve[dim].values, dtype=int)
    rec = np.nan_to_num(np.asarray(curve["recovered"].values, dtype=np.float64), nan=-np.inf)
    order = np.argsort(top_n, kind="stable")
    top_n, rec = top_n[order], rec[order]
    reach = np.flatnonzero(rec >= fraction)
    if not len(reach) or reach[0] == 0:
        return None
    lo, hi = int(top_n[reach[0] - 1]), int(top_n[reach[0]])
    mid = int(round(np.sqrt(max(lo, 1) * hi)))
    return None if mid <= lo or mid >= hi else mid


def merge_curves(curve: xr.Dataset, more: xr.Dataset, *, dim: str = "n_edges") -> xr.Dataset:
    """Two faithfulness curves of the same scores and pairs as one, by top-n (or node count,
    ``dim="n_nodes"``; ``more``'s points added; the pairs' clean and corrupted values and
    the attrs are ``curve``'s)."""
    new = more.sel({dim: [n for n in more[dim].values if n not in curve[dim].values]})
    out = xr.concat([curve, new], dim=dim, data_vars="minimal", coords="minimal",
                    compat="override", combine_attrs="override").sortby(dim)
    sizes = [int(n) for n in out[dim].values]
    out.attrs["sizes"] = sizes
    return out


# -- node-level circuits -------------------------------------------------------------------------

def node_scores(scores: xr.Dataset) -> xr.DataArray:
    """Attribution of each source node (input, heads, MLPs): the sum of its out-edges' scores.

    An edge's score is (z_u(corrupt) - z_u(clean)) . dM/d(input of v); the input of every
    reader is the sum of the writers, so the sum over a node's out-edges is the attribution
    of patching that node's output everywhere (node-level attribution patching)."""
    names, s_idx, _ = _edge_nodes(scores)
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


# -- the default circuit without a size cap ------------------------------------------------------

def default_curve_sizes(n_total: int, *, points: int = CURVE_POINTS,
                        low: float = 0.001) -> list[int]:
    """0 and about ``points`` log-spaced top-n sizes from ``low`` (0.1 %) of the ``n_total``
    edges (at least 1) to all of them, distinct, ascending."""
    n_total = check_int("n_total", n_total, low=1)
    lo = max(1, int(round(low * n_total)))
    return [0, *np.unique(np.round(np.geomspace(lo, n_total, points)).astype(int)).tolist()]


def measured_default_curve(model, task, scores: xr.Dataset, *, fraction: float = 0.8,
                           sizes: Sequence[int] | None = None,
                           refine_steps: int = REFINE_STEPS, batch_size: int = 16,
                           progress: Callable[[int, int], None] | None = None,
                           check: Callable[[], None] | None = None) -> xr.Dataset:
    """The faithfulness curve a page chooses its default from: top-n circuits measured by
    patching at ``sizes`` (default `default_curve_sizes`), then ``refine_steps`` bisection
    steps (`next_bisection_size`) between the first size that recovers ``fraction`` and the
    size below it, each measured and merged in (`merge_curves`). ``check`` is called between
    measurements (a cancel check). The default is then `smallest_faithful_circuit` of it."""
    sizes = list(sizes) if sizes is not None else default_curve_sizes(int(scores.sizes["edge"]))
    curve = faithfulness_curve(model, task, scores, sizes=sizes, batch_size=batch_size,
                               progress=progress)
    for _ in range(check_int("refine_steps", refine_steps, low=0, high=20)):
        if check is not None:
            check()
        more = next_bisection_size(curve, fraction)
        if more is None:
            break
        curve = merge_curves(curve, faithfulness_curve(model, task, scores, sizes=[more],
                                                       batch_size=batch_size))
    return curve
