"""Edge attribution scores: EAP (Syed et al. 2023) and EAP-IG (Hanna et al. 2024)."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
import xarray as xr

from explorer._checks import InputError, check_choice, check_int
from explorer.analyses.circuit_tasks import CircuitTask
from explorer.analyses.circuits.forward import _Run, _weights_device, circuit_engine, graph_forward
from explorer.analyses.circuits.graph import _check_bool, _graph, input_of, node_of
from explorer.analyses.circuits.pairs import (CITATION, METRICS, Progress, _Prepared, _ad_valid,
                                              _frozen, _graph_shape, _mean_run, _metric_values,
                                              check_task, prepare_pairs, row_batches)
from explorer.heads import HeadEngine, check_engine_family
from explorer.lora import LoRAWeights, remove_hooks
from explorer.models import Batch, Model
from explorer.trace import progress_steps, provenance, run_on_weights

__all__ = ['METHODS', 'prepare_circuit_run', 'edge_scores']


METHODS = ("eap", "eap-ig")


def prepare_circuit_run(model: Model, task: Any, metric: str, batch_size: Any,
                        lora: LoRAWeights | None = None
                        ) -> tuple[HeadEngine | None, CircuitTask, int]:
    """The checked inputs of a circuit run: the per-head engine (None for a remote model,
    whose runs build theirs on the server), the task and the batch size. A tuple: three
    unrelated values that the scoring and patching functions unpack at once."""
    task = check_task(task)
    check_choice("metric", metric, METRICS)
    batch_size = check_int("batch_size", batch_size, low=1)
    if lora is not None and not isinstance(lora, LoRAWeights):
        raise TypeError(f"`lora` must be explorer.lora.LoRAWeights (circuit_lora.read_checkpoint); "
                        f"got {type(lora).__name__}.")
    if model.remote:  # checked here; the adapter is built on the server
        check_engine_family(model)
        return None, task, batch_size
    return circuit_engine(model, lora), task, batch_size


def edge_scores(model: Model, task: CircuitTask, *, method: str = "eap", steps: int = 5,
                metric: str = "logit_diff", batch_size: int = 16,
                lora: LoRAWeights | None = None, split_qkv: bool = False,
                progress: Progress = None) -> xr.Dataset:
    """Attribution score of every edge of the head/MLP graph (EAP or EAP-IG).

    Parameters
    ----------
    model : Model
        A model of a supported family (`SUPPORTED_FAMILIES`), local or remote (each batch runs
        on the server).
    task : CircuitTask
        Clean/corrupted prompt pairs (each pair the same token length) and targets.
    method : {"eap", "eap-ig"}, default="eap"
        EAP: gradient at the clean run (one corrupted forward, one clean forward + backward
        per batch). EAP-IG: gradients averaged over ``steps`` runs on input embeddings
        interpolated between corrupted and clean. The positions where every pair's tokens
        agree (their shared prefix) run once; the other runs cover only the later ones.
    steps : int, default=5
        Interpolation steps of EAP-IG (ignored by EAP).
    metric : {"logit_diff", "kl"}, default="logit_diff"
        Logit of the answer minus logit of the wrong target at the last position, or
        KL(clean || run) of the next-token distribution. KL has zero gradient at the clean
        run, so it needs ``method="eap-ig"``.
    batch_size : int, default=16
    lora : explorer.lora.LoRAWeights, optional
        Score the model with these LoRA adapters (a fine-tuning checkpoint,
        `circuit_lora.read_checkpoint`) without merging them into a copy: merged into the
        attention weights the circuit forward reads, added by hooks to the MLP. This is how
        a remote model's fine-tuned circuits are scored; a local model may use it too.
    split_qkv : bool, default=False
        Score the graph of Hanna et al. 2024's code: each head's query, key and value inputs
        are separate destinations (``dst`` ``a{L}.h{H}<q>`` / ``<k>`` / ``<v>``; SmolLM2:
        123,211 edges instead of 44,371). An edge's three scores sum to its combined score.
    progress : callable(done, total) or bool, optional

    Returns
    -------
    xr.Dataset
        ``score`` (edge): estimated change of the mean metric when the edge alone is patched
        to its corrupted value. Coordinates ``src``, ``dst`` (node names; split: head inputs),
        ``src_layer``, ``dst_layer`` (`CircuitGraph.layer_of`), and with ``split_qkv``
        ``dst_node`` (the head of a q/k/v input) and ``dst_input`` ("q", "k", "v" or "").
        Attrs: provenance, ``task``, ``n_prompts``, ``clean_metric`` and ``corrupt_metric``
        (means over prompts), ``n_layers``, ``n_heads``, ``split_qkv``.

    References
    ----------
    Hanna, Pezzelle, Belinkov, COLM 2024 (EAP-IG); Wang et al., ICML 2025.
    """
    check_choice("method", method, METHODS)
    steps = check_int("steps", steps, low=1, high=1000)
    ad, task, batch_size = prepare_circuit_run(model, task, metric, batch_size, lora)
    split_qkv = _check_bool("split_qkv", split_qkv)
    if method == "eap" and metric == "kl":
        raise InputError("metric='kl' has zero gradient at the clean run, so every EAP score would "
                         "be 0; use method='eap-ig' with metric='kl', or metric='logit_diff'.")
    n_layers, n_heads, parallel = _graph_shape(model, ad)
    graph = _graph(n_layers, n_heads, parallel, split_qkv)
    n = len(task)
    batches = row_batches(n, batch_size)
    step = progress_steps(n, progress, unit="prompt", desc=f"{method} scores")
    total = torch.zeros(len(graph.edges), dtype=torch.float64)  # the valid edges, in edge order
    clean_sum = corrupt_sum = 0.0
    with model.lock, _frozen(model):
        handles = [] if ad is None else ad.lora_hooks()
        try:
            for rows in batches:
                prep = prepare_pairs(model, task, rows)
                if ad is None:  # remote: the batch runs on the server, its scores come back
                    scores, m_clean, m_corrupt = run_on_weights(model, _eap_batch, prep, method,
                                                                steps, metric, lora, split_qkv)
                else:
                    scores, m_clean, m_corrupt = _eap_batch(ad, prep.to(_weights_device(model)),
                                                            method, steps, metric,
                                                            split_qkv=split_qkv)
                total += scores.double()
                clean_sum += m_clean
                corrupt_sum += m_corrupt
                step(len(rows))
        finally:
            remove_hooks(handles)
    score = (total / n).numpy()
    src = [e[0] for e in graph.edges]
    dst = [e[1] for e in graph.edges]
    attrs = provenance(model, method=f"circuit_{method.replace('-', '_')}", task=task.name,
                       scoring=method, steps=steps if method == "eap-ig" else None, metric=metric,
                       batch_size=batch_size, n_prompts=n, split_qkv=split_qkv)
    attrs.update(task=task.name, n_prompts=n, clean_metric=clean_sum / n,
                 corrupt_metric=corrupt_sum / n, n_layers=n_layers, n_heads=n_heads,
                 split_qkv=split_qkv, citation=CITATION)
    coords = {"src": ("edge", src), "dst": ("edge", dst),
              "src_layer": ("edge", [graph.layer_of(s) for s in src]),
              "dst_layer": ("edge", [graph.layer_of(t) for t in dst])}
    if split_qkv:
        coords.update(dst_node=("edge", [node_of(t) for t in dst]),
                      dst_input=("edge", [input_of(t) for t in dst]))
    return xr.Dataset({"score": ("edge", score.astype(np.float32))}, coords=coords, attrs=attrs)


def _stack_inputs(inputs: list[torch.Tensor]) -> torch.Tensor:
    """Destination inputs (or their gradients) in dst order: [dst, prompt, pos, d_model]."""
    return torch.cat(inputs, dim=0)


_CONTRACT_BLOCKS = 3  # source row blocks of the score product (see _contract)


def _contract(delta: torch.Tensor, grad: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Scores [src, dst] = sum over prompt, pos, d_model of delta[src] * grad[dst], on valid edges."""
    n_src, n_dst = valid.shape
    dl = delta.reshape(n_src, -1)                                   # [src, prompt*pos*d_model]
    gl = grad.reshape(n_dst, -1)                                    # [dst, prompt*pos*d_model]
    # later sources feed only later destinations: three row blocks of sources, each times the
    # destinations from its first edge on, skip the empty lower-left corner (~1/4 of the
    # arithmetic) while reading the sources once; more, smaller blocks measured slower
    out = delta.new_zeros(n_src, n_dst)
    bounds = [round(i * n_src / _CONTRACT_BLOCKS) for i in range(_CONTRACT_BLOCKS + 1)]
    for a, b in zip(bounds[:-1], bounds[1:]):
        cols = valid[a:b].any(0).nonzero()
        if b > a and len(cols):
            c0 = int(cols[0])
            torch.mm(dl[a:b], gl[c0:].T, out=out[a:b, c0:])
    return out * valid.to(delta.device, delta.dtype)


def _eap_batch(weights: Model | HeadEngine, prep: _Prepared, method: str, steps: int,
               metric: str, lora: LoRAWeights | None = None,
               split_qkv: bool = False) -> tuple[torch.Tensor, float, float]:
    """One batch where the weights are: summed (over prompts) scores of the valid edges
    [edge], in `CircuitGraph.edges` order, and the summed clean and corrupted metrics.

    ``weights`` is a local model's adapter, or (on the server, `run_on_weights`) a Model
    over the served weights (with ``lora``'s adapters, hooked for this batch only). Only
    the scores of existing edges are returned (about half of the [src, dst] matrix), so a
    remote run sends back one float per edge.
    """
    if isinstance(weights, Model):  # on the server: build the adapter over the served weights
        # (not _frozen: only activations are differentiated, so weights that require grad
        # change nothing but memory, and a served model's flags are not this run's to flip)
        ad = circuit_engine(weights, lora)
        handles = ad.lora_hooks()
        try:
            return _eap_batch(ad, prep.to(_weights_device(weights)), method, steps, metric,
                              split_qkv=split_qkv)
        finally:
            remove_hooks(handles)
    ad = weights
    # an engine that can read back keys and values runs the shared prefix once (a mean
    # baseline differs from the clean run at every position: no shared prefix)
    start = _shared_prefix(prep) if hasattr(ad, "prefix_kv") and not prep.mean_baseline else 0
    with torch.no_grad():  # the shared prefix once, then the corrupted run after it
        past = ad.prefix_kv(prep.clean, start) if start else None
        if prep.mean_baseline:
            corrupt = _mean_run(ad, graph_forward(ad, prep.clean), prep.clean)
        else:
            corrupt = graph_forward(ad, prep.corrupt, start=start, past=past)
    scores, m_clean, m_corrupt = _batch_scores(ad, prep, corrupt, method, steps, metric,
                                               start, past, split_qkv)
    valid = torch.from_numpy(_ad_valid(ad, split_qkv)).to(scores.device)
    return scores[valid], m_clean, m_corrupt


def _shared_prefix(prep: _Prepared) -> int:
    """Number of leading positions where every clean prompt has the same tokens as its
    corrupted one (at most the width minus one: the last position is always run).

    A causal model computes those positions the same in both runs (same tokens, positions
    and padding), so every source's corrupted-minus-clean output is exactly zero there and
    adds nothing to any score; and a destination's input at a later position has the same
    gradient whether the earlier positions are recomputed or their keys and values are
    read back (`HeadEngine.prefix_kv`), since nothing there depends on it.
    """
    differs = (prep.clean.input_ids != prep.corrupt.input_ids).any(0)   # [pos]
    at = differs.nonzero().flatten()
    width = prep.clean.width
    return min(int(at[0]) if len(at) else width, width - 1)


def _source_deltas(corrupt_outs: torch.Tensor, clean_outs: torch.Tensor, batch: Batch,
                   start: int) -> torch.Tensor:
    """Corrupted minus clean source outputs [src, prompt, pos, d_model] over the positions
    from ``start`` on, written over ``clean_outs``; padding reads nothing (zero)."""
    delta = torch.sub(corrupt_outs, clean_outs, out=clean_outs)   # [src, prompt, pos, d_model]
    keys = batch.attention_mask[:, start:]
    if not bool(keys.all()):
        delta *= keys.to(delta.dtype)[None, :, :, None]
    return delta


def _batch_scores(ad: HeadEngine, prep: _Prepared, corrupt: _Run, method: str, steps: int,
                  metric: str, start: int = 0,
                  past: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                  split_qkv: bool = False) -> tuple[torch.Tensor, float, float]:
    """Summed (over prompts) edge scores [src, dst] of one batch, and summed metrics.

    ``corrupt`` covers the positions from ``start`` on (`_shared_prefix`); every gradient
    run covers the same positions, reading the shared prefix's keys and values ``past``."""
    x_clean = ad.embed(prep.clean)[:, start:]                     # [prompt, pos, d_model]
    alphas = [1.0] if method == "eap" else [k / steps for k in range(steps, 0, -1)]
    grad_sum = None  # [dst, prompt, pos, d_model], summed over the runs, divided at the end
    delta = None
    clean_logits = None
    with torch.enable_grad():
        for alpha in alphas:  # the first run is the clean one (alpha = 1)
            x = corrupt.outs[0] + alpha * (x_clean - corrupt.outs[0])
            x = x.detach().requires_grad_(True)  # the only leaf: weights are frozen
            run = graph_forward(ad, prep.clean, embeds=x, start=start, past=past,
                           split_qkv=split_qkv)
            if alpha == 1.0:
                clean_logits = run.logits.detach()
            m = _metric_values(metric, run.logits, prep, clean_logits).sum()
            grads = torch.autograd.grad(m, run.inputs)
            if delta is None:
                # corrupted minus clean source outputs, written over the clean ones
                delta = _source_deltas(corrupt.outs, run.outs.detach(), prep.clean, start)
            if grad_sum is None:
                grad_sum = _stack_inputs(list(grads))
            else:  # accumulate in place: no second [dst, ...] tensor
                at = 0
                for gr in grads:
                    grad_sum[at:at + gr.shape[0]] += gr
                    at += gr.shape[0]
            del run, grads, m
    valid = torch.from_numpy(_ad_valid(ad, split_qkv)).to(delta.device)
    scores = _contract(delta, grad_sum, valid)
    scores /= len(alphas)                                         # mean gradient over the runs
    with torch.no_grad():
        m_clean = float(_metric_values(metric, clean_logits, prep, clean_logits).sum())
        m_corrupt = float(_metric_values(metric, corrupt.logits, prep, clean_logits).sum())
    return scores, m_clean, m_corrupt
