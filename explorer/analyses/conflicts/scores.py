"""Each head's direct contribution to the memory and the context answer logit and its causal
effect on their difference by zero ablation."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xarray as xr

from explorer._checks import InputError, check_choice, check_int
from explorer.analyses.conflicts.facts import (CITATION, Fact, PROMPT_KINDS, Progress,
                                               _first_token, conflict_prompt)
from explorer.interventions import Ablate
from explorer.models import Model
from explorer.trace import logit_attribution, provenance, run_with

__all__ = ['head_context_memory_scores']


def head_context_memory_scores(model: Model, facts: Sequence[Fact], *,
                               kinds: Sequence[str] = PROMPT_KINDS, ablation: bool = True,
                               batch_size: int = 16, progress: Progress = None) -> xr.Dataset:
    """Each head's direct and causal effect on memory vs context answer (JuICE, ICML 2025).

    The final residual at the last position is the sum of the embedding, every head's
    output, the attention output biases and every MLP output. Each component goes through
    the final norm linearised at the actual run (its scale fixed to the run's value) and
    the unembedding; the memory minus context answer logit difference splits exactly
    into these terms (plus the norm bias). ``ablation`` also zero-ablates each head in
    turn and records the change in the actual logit difference.

    Parameters
    ----------
    model : Model
    facts : sequence of Fact
    kinds : subset of {"clean", "substitution", "coherent"}
    ablation : bool, default=True
    batch_size : int, default=16
    progress : callable(done, total), optional

    Returns
    -------
    xr.Dataset
        ``direct_memory``, ``direct_context``, ``direct_diff`` (kind, fact, layer, head);
        ``embed_diff``, ``norm_bias_diff``, ``logit_diff`` (kind, fact); ``mlp_diff``,
        ``attn_bias_diff`` (kind, fact, layer); ``ablation_effect`` (kind, fact, layer,
        head): logit difference after ablation minus before; ``memory_score`` and
        ``context_score`` (layer, head): the mean positive part of ``direct_diff`` and of
        its negative. Heads high on both push memory on some prompts and context on
        others (the superposition heads of the paper).

    References
    ----------
    Li, Chen & Tong, "Taming Knowledge Conflicts in Language Models", ICML 2025.
    """
    facts = list(facts)
    if not facts:
        raise InputError("`facts` must hold at least one fact; got an empty list.")
    kinds = [check_choice("kind", k, PROMPT_KINDS) for k in kinds]
    batch_size = check_int("batch_size", batch_size, low=1)
    spec = model.spec
    L, H = spec.n_layers, spec.n_heads
    n = len(facts)
    mem_ids = torch.tensor([_first_token(model, f.memory) for f in facts])
    ctx_ids = torch.tensor([_first_token(model, f.context) for f in facts])
    shape = (len(kinds), n)
    direct = np.zeros((*shape, 2, L, H))
    embed = np.zeros((*shape,))
    nbias = np.zeros(shape)
    logit = np.zeros(shape)
    mlp = np.zeros((*shape, L))
    abias = np.zeros((*shape, L))
    effect = np.full((*shape, L, H), np.nan)
    total = len(kinds) * n * ((L * H) if ablation else 1)
    done = 0

    def mem_minus_ctx(t: torch.Tensor) -> np.ndarray:
        """[prompt, 2, ...] terms (memory, context) -> memory minus context."""
        return (t[:, 0] - t[:, 1]).numpy()

    for ki, kind in enumerate(kinds):
        for b0 in range(0, n, batch_size):
            sl = slice(b0, min(b0 + batch_size, n))
            batch = model.tokenize([conflict_prompt(f, kind) for f in facts[sl]])
            # the split is computed inside the trace (only these scalars leave a remote run)
            ids = torch.stack([mem_ids[sl], ctx_ids[sl]], 1)             # [prompt, 2]
            read = logit_attribution(model, batch, ids)                   # at the last token
            dla = {part: torch.from_numpy(read[part].values[:, 0]) for part in
                   ("embed", "heads", "attn_bias", "mlp", "norm_bias")}   # drop the pos dim
            embed[ki, sl] = mem_minus_ctx(dla["embed"])
            direct[ki, sl] = dla["heads"].permute(0, 3, 1, 2).numpy()     # [prompt, 2, L, H]
            abias[ki, sl] = mem_minus_ctx(dla["attn_bias"].transpose(1, 2))
            mlp[ki, sl] = mem_minus_ctx(dla["mlp"].transpose(1, 2))
            nbias[ki, sl] = mem_minus_ctx(dla["norm_bias"])
            idx = torch.arange(len(ids))
            base = read.logit.values[:, 0, 0] - read.logit.values[:, 0, 1]   # memory - context
            logit[ki, sl] = base
            if ablation:
                for layer in range(L):
                    for head in range(H):
                        lg2 = torch.from_numpy(run_with(
                            model, batch, [Ablate(layer, head)], positions=[-1]
                        ).logits.values[:, 0]).double()
                        effect[ki, sl, layer, head] = (
                            lg2[idx, mem_ids[sl]] - lg2[idx, ctx_ids[sl]]).numpy() - base
                        done += sl.stop - sl.start
                        if progress:
                            progress(done, total)
            else:
                done += sl.stop - sl.start
                if progress:
                    progress(done, total)
    diff = direct[:, :, 0] - direct[:, :, 1]
    dims4 = ("kind", "fact", "layer", "head")
    ds = xr.Dataset(
        {
            "direct_memory": (dims4, direct[:, :, 0]),
            "direct_context": (dims4, direct[:, :, 1]),
            "direct_diff": (dims4, diff),
            "embed_diff": (("kind", "fact"), embed),
            "norm_bias_diff": (("kind", "fact"), nbias),
            "logit_diff": (("kind", "fact"), logit),
            "mlp_diff": (("kind", "fact", "layer"), mlp),
            "attn_bias_diff": (("kind", "fact", "layer"), abias),
            "ablation_effect": (dims4, effect),
            "memory_score": (("layer", "head"), np.clip(diff, 0, None).mean((0, 1))),
            "context_score": (("layer", "head"), np.clip(-diff, 0, None).mean((0, 1))),
        },
        coords={"kind": list(kinds), "fact": np.arange(n), "layer": np.arange(L),
                "head": np.arange(H),
                "subject": ("fact", [f.subject for f in facts]),
                "relation": ("fact", [f.relation for f in facts]),
                "memory_answer": ("fact", [f.memory for f in facts]),
                "context_answer": ("fact", [f.context for f in facts])},
        attrs=provenance(model, method="head_context_memory_scores", kinds=list(kinds),
                         ablation=ablation, n_facts=n),
    )
    ds.attrs["citation"] = CITATION
    return ds
