"""The last-token path: the prompts' key/value prefix run once, then only the last token per
edit set, for the FV scores and the ablations of the supported families."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from explorer._checks import InputError, check_local_weights
# The families whose cached last-token run equals the full forward: the families of the
# architecture table (tested on each, with sliding attention windows narrower than the prompts:
# Gemma 2, Mistral, Qwen2), listed once in explorer.heads.
from explorer.heads import ENGINE_FAMILIES as LAST_TOKEN_FAMILIES
from explorer.interventions import Ablate
from explorer.models import Model
from explorer.trace import (KeyValuePrefix, TraceRequest, key_value_prefix, run_batch,
                            runs_over_prefix)

__all__ = ['LAST_TOKEN_FAMILIES', 'last_token_problem', 'last_token_cache', 'fv_last_token_probs',
           'ablated_last_token']


def last_token_problem(model: Model) -> str | None:
    """Why `last_token_cache` cannot serve ``model`` (None when it can).

    The last-token path runs the trace over a key/value prefix (`explorer.trace.
    KeyValuePrefix`; a remote model's runs of a task are one session on the server,
    `explorer.trace.runs_over_prefix`). The families checked to give the full forward's
    logits are `LAST_TOKEN_FAMILIES` (Llama, Qwen2/3, Mistral; GPT-2; GPT-NeoX / Pythia;
    Gemma 2, whose family entry Gemma 3 shares untested), sliding-window layers included:
    the prefix keeps the model's own cache layers, whose count of the tokens seen places
    the window.
    """
    if model.arch.family not in LAST_TOKEN_FAMILIES:
        return (f"the last-token path handles the {', '.join(LAST_TOKEN_FAMILIES)} families; "
                f"{model.spec.name} is {model.arch.family}")
    return None


def last_token_cache(model: Model, batch: Any) -> KeyValuePrefix:
    """Run ``batch`` without its last column once, keeping every layer's keys and values
    (`explorer.trace.key_value_prefix`), for the last-token runs of this model family."""
    problem = last_token_problem(model)
    if problem:
        raise InputError(f"fv_scores(method='last_token') cannot run: {problem}.")
    check_local_weights(model, "the last-token cache (fv_scores runs it on the server)")
    if batch.width < 2:
        raise InputError("the last-token path needs prompts of at least 2 tokens.")
    return key_value_prefix(model, batch)


def _last_token_edits(by_layer: dict[int, list[tuple[int, int]]], mean_z: Any, n: int,
                      k: int) -> list[Ablate]:
    """In copy j of ``k`` (rows j*n to (j+1)*n), head ``head`` of ``layer`` (each ``(j,
    head)`` of ``by_layer[layer]``) set to ``mean_z[layer, head]`` at the last token."""
    return [Ablate(layer, head, mode="mean", value=np.asarray(mean_z[layer, head]),
                   positions=(-1,), prompts=tuple(range(j * n, (j + 1) * n)) if k > 1 else None)
            for layer in sorted(by_layer) for j, head in by_layer[layer]]


def fv_last_token_probs(model: Model, prefix: KeyValuePrefix, heads: Sequence[tuple[int, int]],
                        mean_z: np.ndarray | None, target: torch.Tensor) -> torch.Tensor:
    """Answer-token probability with each head's last-token output set to its mean: [head, prompt].

    Same result as `fv_patched_probs`, computing only the last token: one trace over ``k``
    copies of the prompts runs the last column over the cached keys and values of the
    earlier positions (``prefix.repeat(k)``), with head j's slice of the ``o_proj`` input
    set to ``mean_z[layer, head]`` in copy j (an ``Ablate`` record on copy j's rows). With
    no ``heads`` (and ``mean_z`` None) it returns the unpatched probabilities, [1, prompt].
    """
    check_local_weights(model, "the last-token run (fv_scores runs it on the server)")
    n = len(prefix.batch.lengths)
    k, edits = _chunk_edits(heads, mean_z, n)
    big = prefix.repeat(k)
    out = run_batch(model, big.batch, edits=edits, prefix=big,
                    readouts=_answer_readout(target, k))
    return out["prob"].reshape(k, n)


def _chunk_edits(heads: Sequence[tuple[int, int]], mean_z: Any, n: int
                 ) -> tuple[int, list[Ablate]]:
    """(copies, edits) of a chunk of ``heads``: head j set to its mean in copy j (one
    unedited copy when there are none)."""
    by_layer: dict[int, list[tuple[int, int]]] = {}
    for j, (layer, head) in enumerate(heads):
        by_layer.setdefault(layer, []).append((j, head))
    k = max(1, len(heads))
    return k, _last_token_edits(by_layer, mean_z, n, k)


def _answer_readout(target: torch.Tensor, k: int) -> TraceRequest:
    """The probability of each prompt's ``target`` token at the last position, in ``k``
    copies of the prompts, and nothing else (no logits cross the network)."""
    return TraceRequest(save_positions=[-1], logits=False, prob_ids=target.repeat(k))


def _last_token_logits(model: Model, prefix: KeyValuePrefix,
                       by_layer: dict[int, list[tuple[int, int]]], mean_z: Any,
                       k: int) -> torch.Tensor:
    """Logits of the batch's last token run in ``k`` copies over the cached keys and values
    of the earlier positions, with `_last_token_edits`: [k * prompt, vocab], copy-major."""
    big = prefix.repeat(k)
    edits = _last_token_edits(by_layer, mean_z, len(prefix.batch.lengths), k)
    out = run_batch(model, big.batch, edits=edits, prefix=big,
                    readouts=TraceRequest(save_positions=[-1]))
    return out["logits"][:, -1].float()


def ablated_last_token(model: Model, prefix: KeyValuePrefix,
                       head_sets: Sequence[Sequence[tuple[int, int]]], mean_z: np.ndarray,
                       target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean ablation at the last token, one copy of the prompts per head set.

    Copy j runs the batch's last token over the cached keys and values of the earlier
    positions (`last_token_cache`) with every head ``(layer, head)`` of ``head_sets[j]``
    writing ``mean_z[layer, head]`` into its slice of the ``o_proj`` input (``Ablate``
    records on copy j's rows): the ablation of Yin & Steinhardt, which replaces the heads'
    output at the last token only, so no earlier position changes. An empty set is the
    unablated run.

    Returns
    -------
    (correct, prob): [set, prompt] tensors: whether the argmax next token is ``target``,
    and the probability of ``target``.

    A pair of tensors, not a Dataset: the inner step whose values `ablation_curves` gathers
    into its Dataset.
    """
    check_local_weights(model, "the last-token ablation")
    n, k = len(prefix.batch.lengths), len(head_sets)
    if k == 0:
        raise InputError("`head_sets` must hold at least one set of heads.")
    by_layer: dict[int, list[tuple[int, int]]] = {}
    for j, heads in enumerate(head_sets):
        for layer, head in heads:
            by_layer.setdefault(int(layer), []).append((j, int(head)))

    logits = _last_token_logits(model, prefix, by_layer, mean_z, k)     # [set * prompt, vocab]
    rows = torch.arange(k * n, device=logits.device)
    tgt = target.to(logits.device).repeat(k)
    prob = torch.softmax(logits, dim=-1)[rows, tgt].reshape(k, n)
    correct = (logits.argmax(-1) == tgt).reshape(k, n)
    return correct.cpu(), prob.cpu()


def _remote_last_token_probs(model: Model, prompts: list[str],
                             chunks: list[list[tuple[int, int]]], mean_z: np.ndarray,
                             target: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A remote model's last-token runs of one task, in one session on the server
    (`explorer.trace.runs_over_prefix`): the unpatched probabilities [prompt] and, per chunk
    of heads, the patched ones [head, prompt]."""
    n = len(prompts)
    runs = [(k, edits, _answer_readout(target, k)) for k, edits in
            [(1, [])] + [_chunk_edits(chunk, mean_z, n) for chunk in chunks]]
    outs = runs_over_prefix(model, model.tokenize(prompts), runs)
    probs = [out["prob"].reshape(k, n) for (k, _, _), out in zip(runs, outs)]
    return probs[0][0], probs[1:]
