"""The token-loss difference over long contexts under head ablation (Yin & Steinhardt 2025).

Olsson et al.'s in-context learning score, as the paper's ``evaluate_icl_score.py`` computes
it: sequences of ``late + 5`` tokens starting with the tokenizer's BOS token, the per-token
loss at index ``early`` (50) minus the loss at index ``late`` (500), where index i is the
loss of predicting token i + 1 from tokens 0..i. Positive values mean the later token is
predicted better: the model uses its context.

Ablation value (``ablation``):

- ``"bos"`` (the paper's code): its ablation writes the value vectors of a run on random
  tokens; that run is one token longer than the sequence, so the assignment takes its
  fallback and writes the value at the random run's first position, the BOS token, at
  every position. A head whose value vectors are all v(BOS) outputs v(BOS) at every
  position (its attention weights sum to one), so here each ablated head's output (its
  ``attn_z`` slice) is replaced by its output at position 0 of a run on the BOS token.
- ``"mean"``: the head's mean output over every token of the evaluated sequences
  (`mean_head_outputs`), at every position.

The per-token loss is `icl_heads.token_losses` (the one the short-window
`icl_heads.token_loss_difference` reads too; re-exported here). The sequences are windows of
the shipped prose corpus (`icl_heads.corpus_token_ids`); the interval on each figure is a percentile bootstrap over sequences, and the change against
no ablation is paired (the same resampled sequences).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import xarray as xr

from explorer._checks import InputError, check_choice, check_float, check_int
from explorer.analyses.icl_heads import (CITATION, RANKINGS, ablation_edits, check_head_scores,
                                         check_rankings, corpus_token_ids, ranked_head_sets,
                                         token_losses)
from explorer.models import Model
from explorer.trace import provenance, trace

__all__ = ["ABLATIONS", "bos_head_outputs", "mean_head_outputs", "token_losses",
           "long_context_token_loss"]

ABLATIONS = ("bos", "mean")


def bos_head_outputs(model: Model) -> np.ndarray:
    """Every head's output (``attn_z`` slice) at position 0 of a run on the BOS token alone:
    [layer, head, d_head]. Needs a tokenizer with a BOS token."""
    bos = model.tokenizer.bos_token_id
    if bos is None:
        raise InputError(f"{model.spec.name}'s tokenizer has no BOS token; use ablation='mean'.")
    return trace(model, [[int(bos)]], sites="attn_z").attn_z.values[0, 0]  # [layer, head, d_head]


def mean_head_outputs(model: Model, sequences: Sequence[Sequence[int]], *,
                      batch_size: int = 4) -> np.ndarray:
    """Every head's output (``attn_z`` slice) averaged over every token of ``sequences``
    (one length, no padding): [layer, head, d_head]."""
    spec = model.spec
    total, count = np.zeros((spec.n_layers, spec.n_heads, spec.d_head)), 0
    for i in range(0, len(sequences), batch_size):   # a chunk at a time: [seq, pos, layer, ...]
        z = trace(model, list(sequences[i:i + batch_size]), sites="attn_z").attn_z.values
        total += z.astype(np.float64).sum((0, 1))
        count += z.shape[0] * z.shape[1]
    return total / count



def _interval(values: np.ndarray, idx: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray]:
    """Percentile bootstrap of the mean over the last axis of ``values`` (resampled by ``idx``
    [boot, sequence])."""
    means = values[..., idx].mean(-1)                                  # [..., boot]
    tail = (1.0 - level) / 2.0
    return np.quantile(means, tail, axis=-1), np.quantile(means, 1.0 - tail, axis=-1)


def long_context_token_loss(model: Model, induction: np.ndarray, fv: np.ndarray, *,
                            percents: Sequence[float] = (0, 1, 3, 5, 10, 20),
                            rankings: Sequence[str] = RANKINGS, exclude_fraction: float = 0.02,
                            n_sequences: int = 64, early: int = 50, late: int = 500,
                            ablation: str = "bos", n_boot: int = 2000,
                            confidence_level: float = 0.95, seed: int = 0,
                            progress: Any = None) -> xr.Dataset:
    """Token-loss difference (loss at ``early`` minus loss at ``late``) with the top p% heads
    of each ranking ablated (`icl_heads.ranked_head_sets`: FV, induction, each excluding the
    other's top ``exclude_fraction``, random), over up to ``n_sequences`` corpus sequences
    of ``late + 5`` tokens (BOS first, as the paper's TransformerLens loader makes them).

    Returns
    -------
    xr.Dataset: ``loss_early``, ``loss_late`` (ranking, percent, sequence);
    ``token_loss_difference`` (ranking, percent) with ``_low`` / ``_high`` (the bootstrap
    interval over sequences); ``change`` (ranking, percent): the difference minus the
    unablated one, with its paired interval ``change_low`` / ``change_high``; ``ablated``
    (ranking, percent): the heads, as "L.H" strings joined by spaces.
    """
    ablation = check_choice("ablation", ablation, ABLATIONS)
    early = check_int("early", early, low=1)
    late = check_int("late", late, low=early + 1)
    n_sequences = check_int("n_sequences", n_sequences, low=2)
    n_boot = check_int("n_boot", n_boot, low=10)
    level = check_float("confidence_level", confidence_level, low=0.5, high=0.999)
    percents = [check_float("percent", p, low=0.0, high=100.0) for p in percents]
    names = check_rankings(rankings)
    induction, fv = check_head_scores(model, induction, fv)
    bos = model.tokenizer.bos_token_id
    body = late + 5 - (0 if bos is None else 1)
    sequences = corpus_token_ids(model, n_sequences, body)
    if len(sequences) < 2:
        raise InputError(f"the corpus holds {len(sequences)} window(s) of {body} tokens; "
                         f"need at least 2 (lower `late`).")
    if bos is not None:
        sequences = [[int(bos), *s] for s in sequences]
    value = (bos_head_outputs(model) if ablation == "bos"
             else mean_head_outputs(model, sequences))
    heads_at = ranked_head_sets(induction, fv, percents, rankings=names,
                                exclude_fraction=exclude_fraction, seed=seed)
    sets = sorted({tuple(h) for h in heads_at.values()}, key=lambda h: (len(h), h))
    losses: dict[tuple, np.ndarray] = {}
    for done, heads in enumerate(sets, 1):
        edits = ablation_edits(list(heads), value, positions=None) if heads else []
        losses[heads] = token_losses(model, sequences, [early, late], edits)
        if callable(progress):
            progress(done, len(sets))
    R, P, S = len(names), len(percents), len(sequences)
    early_loss, late_loss = np.zeros((R, P, S)), np.zeros((R, P, S))
    ablated = np.empty((R, P), dtype=object)
    for (r, j), heads in heads_at.items():
        early_loss[r, j], late_loss[r, j] = losses[tuple(heads)].T
        ablated[r, j] = " ".join(f"{l}.{h}" for l, h in heads)
    diff = early_loss - late_loss
    base = losses[()][:, 0] - losses[()][:, 1]
    idx = np.random.default_rng(seed).integers(0, S, size=(n_boot, S))
    low, high = _interval(diff, idx, level)
    change = diff - base
    c_low, c_high = _interval(change, idx, level)
    dims = ("ranking", "percent")
    return xr.Dataset(
        {"loss_early": ((*dims, "sequence"), early_loss),
         "loss_late": ((*dims, "sequence"), late_loss),
         "token_loss_difference": (dims, diff.mean(-1)),
         "token_loss_difference_low": (dims, low), "token_loss_difference_high": (dims, high),
         "change": (dims, change.mean(-1)), "change_low": (dims, c_low),
         "change_high": (dims, c_high), "ablated": (dims, ablated)},
        coords={"ranking": names, "percent": percents, "sequence": np.arange(S)},
        attrs=provenance(model, method="long_context_token_loss", citation=CITATION,
                         percents=percents, rankings=names, exclude_fraction=exclude_fraction,
                         n_sequences=S, early=early, late=late, sequence_tokens=late + 5,
                         bos=bos is not None, ablation=ablation, n_boot=n_boot,
                         confidence_level=level, seed=seed))
