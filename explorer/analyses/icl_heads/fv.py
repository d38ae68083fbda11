"""Function-vector (FV) scores (Todd et al., ICLR 2024): the causal indirect effect of writing
a head's task-mean output at the last token into shuffled-label prompts."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import xarray as xr

from explorer._checks import InputError, check_choice, check_int
from explorer.analyses.icl_heads.last_token import (_remote_last_token_probs, fv_last_token_probs,
                                                    last_token_cache, last_token_problem)
from explorer.analyses.icl_heads.tasks import (CITATION, ICLTask, answer_token_ids, as_icl_task,
                                               icl_prompts, last_token_probs)
from explorer.interventions import Ablate
from explorer.models import Model
from explorer.trace import clean_run, provenance, trace

__all__ = [
    'FV_METHODS', 'task_mean_z', 'heads_of_layers', 'head_chunks', 'fv_patched_probs', 'fv_scores',
]


FV_METHODS = ("auto", "last_token", "resume")


def task_mean_z(model: Model, prompts: Sequence[str], edits=()) -> np.ndarray:
    """Mean over prompts of every head's output (the ``attn_z`` slice) at the last token
    (of the model under ``edits``, if any).

    Returns an array [layer, head, d_head] (the ā of Todd et al.).
    """
    z = trace(model, list(prompts), sites="attn_z", positions=[-1], edits=edits,
              batch_size=len(prompts), progress=False).attn_z.values   # [prompt, 1, layer, head, d_head]
    return z[:, 0].mean(0)


def heads_of_layers(model: Model, layers: Sequence[int] | None) -> list[tuple[int, int]]:
    """Every ``(layer, head)`` of ``layers`` (all layers when ``None``), layer-major."""
    layers = range(model.spec.n_layers) if layers is None else [model.check_layer(l) for l in layers]
    return [(l, h) for l in layers for h in range(model.spec.n_heads)]


def head_chunks(heads: Sequence[tuple[int, int]], size: int) -> list[list[tuple[int, int]]]:
    """Heads (layer-major) in chunks of at most ``size``, whole layers together where they fit.

    A chunk's trace resumes at its lowest layer, so chunks of whole neighbouring layers
    waste the least; a layer with more than ``size`` heads is split.
    """
    by_layer: dict[int, list[tuple[int, int]]] = {}
    for layer, head in heads:
        by_layer.setdefault(layer, []).append((layer, head))
    chunks: list[list[tuple[int, int]]] = []
    current: list[tuple[int, int]] = []
    for group in by_layer.values():
        if current and len(current) + len(group) > size:
            chunks.append(current)
            current = []
        while len(group) > size:
            chunks.append(group[:size])
            group = group[size:]
        current = current + group
    if current:
        chunks.append(current)
    return chunks


def fv_patched_probs(model: Model, cache: Any, heads: Sequence[tuple[int, int]],
                     mean_z: np.ndarray, target: torch.Tensor) -> torch.Tensor:
    """Answer-token probability with each head's last-token output set to its mean: [head, prompt].

    One trace for all ``heads``: the batch of ``cache`` (a `CleanRun`) is repeated once per
    head (`CleanRun.repeat`), head j's ``Ablate`` acts on the j-th copy only (its
    ``prompts``), and the run resumes at the lowest layer among the heads. ``mean_z`` is
    [layer, head, d_head]; ``target`` holds one token id per prompt.
    """
    n, k = len(cache.batch.lengths), len(heads)
    big = cache.repeat(k) if k > 1 else cache
    edits = [Ablate(layer, head, mode="mean", value=mean_z[layer, head], positions=(-1,),
                    prompts=tuple(range(j * n, (j + 1) * n)) if k > 1 else None)
             for j, (layer, head) in enumerate(heads)]
    p = last_token_probs(model, big.batch, edits, resume=big)          # [head * prompt, vocab]
    return p[torch.arange(k * n), target.repeat(k)].reshape(k, n)


def fv_scores(model: Model, tasks: Sequence[ICLTask | str], *, n_prompts: int = 8,
              n_shots: int = 5, seed: int = 0, layers: Sequence[int] | None = None,
              progress: Any = None, max_rows: int = 256, method: str = "auto") -> xr.Dataset:
    """Function-vector score of every head: the causal indirect effect (Todd et al. 2024).

    For each task, ā_{l,h} is the head's mean output at the last token over clean
    ``n_shots``-shot prompts. The same prompts with shuffled demonstration labels are run
    with head (l, h)'s last-token output replaced by ā_{l,h}; the indirect effect is the
    gain in the probability of the answer's first token. The FV score is its mean over tasks.

    Heads are patched in batches (`fv_patched_probs`): one trace scores a chunk of heads
    by repeating the corrupted prompts once per head (at most ``max_rows`` rows, whole
    neighbouring layers together) and patching head j in the j-th copy only, resuming at
    the chunk's lowest layer from a cached clean run of the corrupted prompts. Each copy is
    computed exactly as a run with only its head patched. ``progress(done, total)`` is
    called after each chunk, counting head-task pairs.

    ``method``: ``"last_token"`` runs only the last token of each patched copy
    (`fv_last_token_probs`), over keys and values of the earlier positions computed once
    per task (`last_token_cache`): the patch is at the last token, which no earlier
    position sees. ``"resume"`` recomputes every position from the chunk's lowest layer
    (`fv_patched_probs`). ``"auto"`` (default) is ``"last_token"`` where
    `last_token_problem` finds none, else ``"resume"``; an explicit ``"last_token"`` on a
    model it cannot serve raises InputError. ``attrs["params"]["fv_method"]`` records the
    one used.

    Returns
    -------
    xr.Dataset: ``fv_score`` (layer, head), ``indirect_effect`` (task, layer, head),
    ``mean_z`` (task, layer, head, d_head), ``corrupted_prob``/``clean_prob`` (task).
    """
    tasks = [as_icl_task(t) for t in tasks]
    if not tasks:
        raise InputError("`tasks` must name at least one task; got an empty list.")
    max_rows = check_int("max_rows", max_rows, low=1)
    method = check_choice("method", method, FV_METHODS)
    if method == "auto":
        method = "resume" if last_token_problem(model) else "last_token"
    spec = model.spec
    heads = heads_of_layers(model, layers)
    ie = np.full((len(tasks), spec.n_layers, spec.n_heads), np.nan)
    mean_z = np.zeros((len(tasks), spec.n_layers, spec.n_heads, spec.d_head))
    p_clean, p_corr = np.zeros(len(tasks)), np.zeros(len(tasks))
    total, done = len(tasks) * len(heads), 0
    for t, task in enumerate(tasks):
        clean, answers = icl_prompts(task, n_prompts=n_prompts, n_shots=n_shots, seed=seed)
        corrupted, _ = icl_prompts(task, n_prompts=n_prompts, n_shots=n_shots, seed=seed,
                                   shuffle_labels=True)
        target = torch.tensor(answer_token_ids(model, answers))
        rows = torch.arange(len(target))
        mean_z[t] = task_mean_z(model, clean)
        p_clean[t] = float(last_token_probs(model, model.tokenize(clean))[rows, target].mean())
        chunks = list(head_chunks(heads, max(1, max_rows // len(target))))
        remote_p = None
        if method == "last_token" and model.remote:  # the task's runs as one NDIF session
            base, remote_p = _remote_last_token_probs(model, corrupted, chunks, mean_z[t],
                                                      target)
        elif method == "last_token":
            prefix = last_token_cache(model, model.tokenize(corrupted))
            base = fv_last_token_probs(model, prefix, [], None, target)[0]     # [prompt]
        else:
            cache = clean_run(model, corrupted)
            base = torch.softmax(cache.logits[:, -1].float(), -1)[rows, target]
        p_corr[t] = float(base.mean())
        for i, chunk in enumerate(chunks):
            if remote_p is not None:
                p = remote_p[i]
            elif method == "last_token":
                p = fv_last_token_probs(model, prefix, chunk, mean_z[t], target)
            else:
                p = fv_patched_probs(model, cache, chunk, mean_z[t], target)  # [head, prompt]
            gain = (p - base).mean(1)
            for (layer, head), g in zip(chunk, gain.tolist()):
                ie[t, layer, head] = g
            done += len(chunk)
            if callable(progress):
                progress(done, total)
    return xr.Dataset(
        {"fv_score": (("layer", "head"), ie.mean(0)),
         "indirect_effect": (("task", "layer", "head"), ie),
         "mean_z": (("task", "layer", "head", "d_head"), mean_z),
         "clean_prob": (("task",), p_clean),
         "corrupted_prob": (("task",), p_corr)},
        coords={"task": [t.name for t in tasks], "layer": list(range(spec.n_layers)),
                "head": list(range(spec.n_heads))},
        attrs=provenance(model, method="fv_scores", n_prompts=n_prompts, n_shots=n_shots,
                         seed=seed, layers=None if layers is None else list(layers),
                         fv_method=method, citation=CITATION))
