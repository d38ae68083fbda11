"""Faithfulness: the metric of a circuit-only model, every edge outside the circuit patched
to its corrupted value."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import xarray as xr

from explorer._checks import InputError, check_int
from explorer.analyses.circuit_tasks import CircuitTask
from explorer.analyses.circuits.forward import _weights_device, circuit_engine, graph_forward
from explorer.analyses.circuits.graph import _graph, is_split, valid_edge_mask
from explorer.analyses.circuits.pairs import (CITATION, Progress, _Prepared, _ad_valid,
                                              _graph_shape, _mean_run, _metric_values,
                                              prepare_pairs, row_batches)
from explorer.analyses.circuits.scores import prepare_circuit_run
from explorer.analyses.circuits.selection import _check_mask, check_scores, select_circuit
from explorer.heads import HeadEngine
from explorer.models import Model
from explorer.trace import progress_steps, provenance, run_on_weights

__all__ = [
    'keep_matrix', 'patched_metrics', 'recovered_fraction', 'patch_edges_metric',
    'faithfulness_curve',
]


def keep_matrix(model: Model, ad: HeadEngine | None, scores: xr.Dataset,
                mask: np.ndarray) -> torch.Tensor:
    """Circuit mask as [src, dst] float over the model's graph."""
    n_layers, n_heads, parallel = _graph_shape(model, ad)
    split_qkv = is_split(scores)
    graph = _graph(n_layers, n_heads, parallel, split_qkv)
    src_index = {n: i for i, n in enumerate(graph.sources)}
    dst_index = {n: i for i, n in enumerate(graph.destinations)}
    keep = torch.zeros(len(graph.sources), len(graph.destinations))
    try:
        for s, t, m in zip(scores["src"].values, scores["dst"].values, mask):
            if m:
                keep[src_index[str(s)], dst_index[str(t)]] = 1.0
    except KeyError as err:
        raise InputError(f"`scores` names node {err.args[0]!r}, which {model.spec.name} does not "
                         "have; were the scores computed on another model?") from None
    valid = torch.from_numpy(valid_edge_mask(n_layers, n_heads, parallel, split_qkv))
    if bool((keep.bool() & ~valid).any()):
        raise InputError("`scores` holds an edge that does not exist in this model's graph.")
    return keep


def patched_metrics(model: Model, ad: HeadEngine | None, task: CircuitTask,
                    keeps: list[torch.Tensor], metric: str, batch_size: int,
                    progress: Progress) -> dict[str, Any]:
    """Metric and accuracy of each circuit (keep matrix) plus clean and corrupted runs.

    A dict of arrays and floats: the parts that `faithfulness_curve` and
    `circuit_select.node_faithfulness_curve` assemble into their Datasets over their own dims.

    ``ad`` is the local model's adapter, or None for a remote model: each batch then runs
    on the server (`run_on_weights`) and only its sums come back."""
    n = len(task)
    total: dict[str, Any] = {"metric": np.zeros(len(keeps)), "hits": np.zeros(len(keeps)),
                             "clean_metric": 0.0, "corrupt_metric": 0.0, "clean_hits": 0.0,
                             "corrupt_hits": 0.0}
    step = progress_steps(n * len(keeps), progress, unit="run", desc="edge patching")
    pairs: dict[str, list[np.ndarray]] = {}
    with model.lock:
        for rows in row_batches(n, batch_size):
            prep = prepare_pairs(model, task, rows)
            if ad is None:
                sums = run_on_weights(model, _patched_batch, prep, [k.bool() for k in keeps],
                                      metric)
                step(len(rows) * len(keeps))
            else:
                sums = _patched_batch(ad, prep.to(_weights_device(model)), keeps, metric,
                                      step=step)
            for key, value in sums.items():
                if key.startswith("pair_"):   # per-pair values follow each other
                    pairs.setdefault(key, []).append(np.asarray(value, dtype=np.float64))
                else:
                    total[key] = total[key] + np.asarray(value, dtype=np.float64)
    per_pair = {k: np.concatenate(v, axis=-1) for k, v in pairs.items()}
    return {**per_pair, "metric": total["metric"] / n, "accuracy": total["hits"] / n,
            "clean_metric": float(total["clean_metric"]) / n,
            "corrupt_metric": float(total["corrupt_metric"]) / n,
            "clean_accuracy": float(total["clean_hits"]) / n,
            "corrupt_accuracy": float(total["corrupt_hits"]) / n}


def _patched_batch(weights: Model | HeadEngine, prep: _Prepared, keeps: list[torch.Tensor],
                   metric: str, step: Callable[[int], None] | None = None) -> dict[str, Any]:
    """One batch where the weights are: summed metric and hits of the clean, the corrupted
    and each circuit-patched run (``keeps``, [src, dst] masks)."""
    if isinstance(weights, Model):  # on the server: build the adapter over the served weights
        device = _weights_device(weights)
        return _patched_batch(circuit_engine(weights), prep.to(device), [k.to(device) for k in keeps],
                              metric, step)
    ad = weights
    n_rows = len(prep.clean.lengths)
    with torch.no_grad():
        clean = graph_forward(ad, prep.clean)
        corrupt = (_mean_run(ad, clean, prep.clean) if prep.mean_baseline
                   else graph_forward(ad, prep.corrupt))
        m_clean = _metric_values(metric, clean.logits, prep, clean.logits)
        m_corrupt = _metric_values(metric, corrupt.logits, prep, clean.logits)
        out = {
            "clean_metric": float(m_clean.sum()), "corrupt_metric": float(m_corrupt.sum()),
            "clean_hits": float((clean.logits.argmax(-1) == prep.answer).sum()),
            "corrupt_hits": float((corrupt.logits.argmax(-1) == prep.answer).sum()),
            "metric": [], "hits": [], "pair_metric": [],
            "pair_clean_metric": m_clean.double().cpu().tolist(),
            "pair_corrupt_metric": m_corrupt.double().cpu().tolist()}
        n_valid = int(_ad_valid(ad, keeps[0].shape[1] != ad.n_layers * (ad.n_heads + 1) + 1)
                      .sum()) if keeps else 0
        for keep in keeps:
            kept = int(keep.bool().sum())
            if kept == 0 or kept == n_valid:
                # no edge kept is the corrupted run, every edge kept the clean one (each
                # destination then reads exactly that run's input): nothing to patch
                logits = corrupt.logits if kept == 0 else clean.logits
            else:
                logits = graph_forward(ad, prep.clean, patch=(corrupt, keep)).logits
            values = _metric_values(metric, logits, prep, clean.logits)
            out["metric"].append(float(values.sum()))
            out["pair_metric"].append(values.double().cpu().tolist())
            out["hits"].append(float((logits.argmax(-1) == prep.answer).sum()))
            if step is not None:
                step(n_rows)
    return out


def recovered_fraction(m: Any, clean: float, corrupt: float) -> Any:
    """``m`` rescaled so the clean run is 1 and the corrupted run 0 (NaN where they agree)."""
    span = clean - corrupt
    return (np.asarray(m) - corrupt) / span if span != 0 else np.full_like(np.asarray(m), np.nan)


def patch_edges_metric(model: Model, task: CircuitTask, scores: xr.Dataset, in_circuit: Any, *,
                       metric: str = "logit_diff", batch_size: int = 16,
                       progress: Progress = None) -> dict[str, Any]:
    """Metric of the circuit-only model: every edge outside the circuit carries its corrupted value.

    Each destination node reads the corrupted run's input plus, for each of its circuit
    edges, the source's output in this run minus its output in the corrupted run. All edges
    in the circuit give the clean run; none gives the corrupted run.

    Returns
    -------
    dict
        ``metric`` (mean over prompts), ``recovered`` ((metric - corrupt) / (clean - corrupt)),
        ``accuracy`` (argmax at the last position equals the answer's first token),
        ``clean_metric``, ``corrupt_metric``, ``clean_accuracy``, ``corrupt_accuracy``,
        ``n_edges`` (circuit size).

    A dict of scalars, not a Dataset: one circuit's numbers over no dimension (its curve,
    `faithfulness_curve`, is the Dataset).
    """
    ad, task, batch_size = prepare_circuit_run(model, task, metric, batch_size)
    scores = check_scores(scores)
    mask = _check_mask(scores, in_circuit)
    keep = keep_matrix(model, ad, scores, mask)
    res = patched_metrics(model, ad, task, [keep], metric, batch_size, progress)
    out = {"metric": float(res["metric"][0]), "accuracy": float(res["accuracy"][0]),
           "n_edges": int(mask.sum())}
    out["recovered"] = float(recovered_fraction(out["metric"], res["clean_metric"], res["corrupt_metric"]))
    out.update({k: float(res[k]) for k in ("clean_metric", "corrupt_metric", "clean_accuracy",
                                           "corrupt_accuracy")})
    return out


def faithfulness_curve(model: Model, task: CircuitTask, scores: xr.Dataset, *,
                       sizes: Sequence[int], metric: str = "logit_diff", batch_size: int = 16,
                       progress: Progress = None) -> xr.Dataset:
    """Metric recovered by the top-n circuits, by really patching every non-circuit edge.

    Parameters
    ----------
    sizes : sequence of int
        Numbers of top edges (by |score|) to keep before pruning.

    Returns
    -------
    xr.Dataset
        Over ``n_edges`` (the requested sizes): ``metric`` (circuit-only model, mean over
        prompts), ``recovered`` (normalised so clean = 1, corrupted = 0), ``accuracy``
        (exact match of the first answer token), ``n_kept`` (edges left after pruning);
        per pair ``pair_metric`` (n_edges, prompt), ``pair_clean_metric`` and
        ``pair_corrupt_metric`` (prompt), for bootstrap intervals over the pairs
        (`circuit_select.bootstrap_recovered`). Attrs: ``clean_metric``, ``corrupt_metric``, ``clean_accuracy``, ``corrupt_accuracy``,
        ``n_edges_total`` and provenance.
    """
    ad, task, batch_size = prepare_circuit_run(model, task, metric, batch_size)
    scores = check_scores(scores)
    if isinstance(sizes, (int, np.integer)) or not isinstance(sizes, Sequence | np.ndarray):
        raise TypeError(f"`sizes` must be a list of ints; got {type(sizes).__name__}.")
    n_total = scores.sizes["edge"]
    sizes = [check_int("sizes[i]", int(s) if isinstance(s, np.integer) else s, low=0, high=n_total)
             for s in sizes]
    if not sizes:
        raise InputError("`sizes` must hold at least one circuit size; got an empty list.")
    masks = [select_circuit(scores, top_n=s).values for s in sizes]
    keeps = [keep_matrix(model, ad, scores, m) for m in masks]
    res = patched_metrics(model, ad, task, keeps, metric, batch_size, progress)
    attrs = provenance(model, method="circuit_faithfulness", task=task.name, metric=metric,
                       sizes=sizes, n_prompts=len(task),
                       scores_params=scores.attrs.get("params", {}))
    attrs.update({k: float(res[k]) for k in ("clean_metric", "corrupt_metric", "clean_accuracy",
                                             "corrupt_accuracy")},
                 n_edges_total=int(n_total), task=task.name, citation=CITATION)
    return xr.Dataset(
        {"metric": ("n_edges", res["metric"]),
         "recovered": ("n_edges", recovered_fraction(res["metric"], res["clean_metric"], res["corrupt_metric"])),
         "accuracy": ("n_edges", res["accuracy"]),
         "n_kept": ("n_edges", np.array([int(m.sum()) for m in masks])),
         "pair_metric": (("n_edges", "prompt"), res["pair_metric"].reshape(len(sizes), -1)),
         "pair_clean_metric": ("prompt", res["pair_clean_metric"]),
         "pair_corrupt_metric": ("prompt", res["pair_corrupt_metric"])},
        coords={"n_edges": np.array(sizes), "prompt": np.arange(len(task))}, attrs=attrs)
