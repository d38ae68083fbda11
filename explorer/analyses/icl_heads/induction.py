"""Induction scores: attention to the token after the previous occurrence of the current token
on repeated random-token sequences (TransformerLens ``detect_head``)."""
from __future__ import annotations

import numpy as np
import xarray as xr

from explorer._checks import check_choice, check_int
from explorer.analyses.icl_heads.tasks import CITATION, ICLTask, icl_prompts
from explorer.models import Model
from explorer.trace import provenance, trace

__all__ = [
    'induction_pattern', 'induction_score_from_patterns', 'induction_scores', 'head_attention',
]


def induction_pattern(ids: np.ndarray) -> np.ndarray:
    """P[i, j] = 1 iff token[j-1] == token[i] and 1 <= j <= i (the induction target)."""
    ids = np.asarray(ids)
    n = len(ids)
    p = np.zeros((n, n))
    for i in range(n):
        for j in range(1, i + 1):
            if ids[j - 1] == ids[i]:
                p[i, j] = 1.0
    return p


def induction_score_from_patterns(patterns: np.ndarray, ids: np.ndarray,
                                  measure: str = "abs") -> np.ndarray:
    """Induction score per head from attention weights.

    Parameters
    ----------
    patterns : array [sequence, layer, head, dst, src]
    ids : array [sequence, pos]
    measure : {"abs", "mul"}, default="abs"
        ``mul``: sum(A * P) / sum(A), the attention mass on induction targets.
        ``abs``: 1 - (1/n) sum_i ||A_i - P_i||_1 (TransformerLens ``detect_head``,
        ``error_measure="abs"``, as used by Yin & Steinhardt).

    Returns
    -------
    array [layer, head], averaged over sequences.
    """
    check_choice("measure", measure, ("mul", "abs"))
    scores = []
    for a, row in zip(patterns, ids):
        p = induction_pattern(row)                   # [dst, src]
        a = np.nan_to_num(a.astype(np.float64))      # [layer, head, dst, src]
        if measure == "mul":
            s = (a * p).sum((-2, -1)) / a.sum((-2, -1))
        else:
            s = 1.0 - np.abs(a - p).sum(-1).mean(-1)
        scores.append(s)
    return np.mean(scores, axis=0)


def _random_repeat_ids(model: Model, n_sequences: int, half_len: int, seed: int) -> np.ndarray:
    """[BOS?, r_1..r_n, r_1..r_n] with r_i uniform over the non-special vocabulary."""
    special = set(model.tokenizer.all_special_ids)
    allowed = np.array([i for i in range(model.spec.vocab_size) if i not in special])
    rng = np.random.default_rng(seed)
    r = rng.choice(allowed, size=(n_sequences, half_len))
    ids = np.concatenate([r, r], axis=1)
    bos = model.tokenizer.bos_token_id
    if bos is not None:
        ids = np.concatenate([np.full((n_sequences, 1), bos), ids], axis=1)
    return ids


def induction_scores(model: Model, *, n_sequences: int = 16, half_len: int = 50, seed: int = 42,
                     measure: str = "abs", batch_size: int = 8, edits=()) -> xr.Dataset:
    """Induction score of every head on repeated random-token sequences.

    Yin & Steinhardt (ICML 2025) score heads with TransformerLens ``detect_head`` on
    ``[BOS, r_1..r_50, r_1..r_50]`` with ``error_measure="abs"``; those are the defaults here
    (``half_len=50``, ``measure="abs"``, seed 42). The paper averages 1,000 sequences; the default
    16 is a CPU-sized sample (``n_sequences=1000`` is the paper's; the patterns are read one
    batch at a time, so memory does not grow with it). ``measure="mul"`` is the attention
    mass on the induction target (see `induction_score_from_patterns`).
    ``edits`` (intervention records) apply to every run: the scores of the edited model.

    Returns
    -------
    xr.Dataset with ``induction_score`` (layer, head) and ``sequence_ids`` (sequence, pos).
    """
    n_sequences = check_int("n_sequences", n_sequences, low=1)
    half_len = check_int("half_len", half_len, low=2)
    batch_size = check_int("batch_size", batch_size, low=1)
    check_choice("measure", measure, ("mul", "abs"))
    ids = _random_repeat_ids(model, n_sequences, half_len, seed)
    layers = range(model.spec.n_layers)
    parts = []
    for start in range(0, n_sequences, batch_size):     # one batch's patterns at a time
        chunk = ids[start:start + batch_size]
        patterns = trace(model, chunk.tolist(), sites="attn_pattern", edits=edits,
                         batch_size=batch_size, progress=False).attn_pattern.values
        parts.append(induction_score_from_patterns(patterns, chunk, measure) * len(chunk))
    score = np.sum(parts, axis=0) / n_sequences
    return xr.Dataset(
        {"induction_score": (("layer", "head"), score),
         "sequence_ids": (("sequence", "pos"), ids)},
        coords={"layer": list(layers), "head": list(range(model.spec.n_heads))},
        attrs=provenance(model, method="induction_scores", n_sequences=n_sequences,
                         half_len=half_len, seed=seed, measure=measure, edits=list(edits),
                         citation=CITATION))


def head_attention(model: Model, layer: int, head: int, *, task: ICLTask | str = "antonym",
                   half_len: int = 10, n_shots: int = 3, seed: int = 42,
                   edits=()) -> dict[str, xr.Dataset]:
    """One head's attention on a repeated random-token sequence and on an ICL prompt.

    Returns ``{"repeat": ds, "icl": ds}``, each with ``attention`` (dst_pos, src_pos) and
    ``token`` (pos) coordinates, for the view's query x key heatmaps.

    A dict of two Datasets, not one: the two sequences differ in length and tokens, so their
    (dst_pos, src_pos) grids do not share coordinates.
    """
    layer, head = model.check_layer(layer), model.check_head(head)
    repeat = _random_repeat_ids(model, 1, half_len, seed)[0].tolist()
    prompt, _ = icl_prompts(task, n_prompts=1, n_shots=n_shots, seed=seed)
    icl = model.tokenizer(prompt[0], add_special_tokens=False)["input_ids"]
    out = {}
    for name, ids in (("repeat", repeat), ("icl", icl)):
        read = trace(model, [ids], sites="attn_pattern", layers=[layer], edits=edits)
        att = read.attn_pattern.values[0, 0, head]                    # [dst, src]
        tokens = list(read.token.values[0])
        out[name] = xr.Dataset(
            {"attention": (("dst_pos", "src_pos"), att)},
            coords={"dst_pos": range(len(ids)), "src_pos": range(len(ids)),
                    "token": ("pos", tokens), "pos": range(len(ids))},
            attrs=provenance(model, method="head_attention", layer=layer, head=head,
                             example=name, seed=seed, edits=list(edits)))
    return out
