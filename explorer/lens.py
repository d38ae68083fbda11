"""Logit lens: read each layer's residual stream through the final norm and unembedding.

Computed in chunks of (layer, position) rows so the [layer x pos x vocab] logits never
sit in memory whole; only the top-k and the ranks of tracked tokens are kept.

Four things keep an interactive edit (a steering slider) fast without giving up exactness:

- Rows are read in chunks of whole layers, split at the first edited layer, so a chunk of
  layers before the edit is computed in exactly the same way with and without the edit.
  With ``resume`` those readouts are computed once and kept on the `CleanRun`; each later
  edit reads only the layers from the edit on (`logit_lens`, ``reuse_clean``).
- The last layer's lens is the model's output, read from the run's own logits.
- Exact ranks (a count of the logits above each tracked token) use uint8 partial sums,
  and tokens inside the top candidates are ranked from the candidates alone.
- ``unembed_dtype="bfloat16"`` screens the vocabulary in bfloat16, recomputes the top
  candidates in float32, and takes the softmax normaliser from the screen with the
  candidates' float32 values swapped in ("screen then refine"): top-k ids and probabilities
  almost always equal the float32 ones, at about half the cost where the CPU has native
  bfloat16 arithmetic (see `lens_readout`). Elsewhere (AVX2-only CPUs) a bfloat16 product
  is several times slower than float32, so ``unembed_dtype="auto"`` takes the screen only
  where it measured at least 10 % faster than the exact float32 lens, timed on this model's
  unembedding at the row count the call will use (`resolve_unembed_dtype`, decisions in
  `screen_decisions`); the exact lens otherwise.

Layer convention: the lens at ``layer`` l reads ``resid_post`` of layer l, the output of
block l, so the ``layer`` coordinate runs 0 .. n_layers-1 with no embedding row, and layer
n_layers-1 is the model's own output. In TransformerLens terms, layer l is
``blocks.{l}.hook_resid_post``, which is ``blocks.{l+1}.hook_resid_pre``: a TransformerLens
logit lens over ``accumulated_resid`` labels the same row l+1 (its row 0 being the
embedding, ``hook_embed``, which this lens does not read; `trace` with
``sites="resid_pre"`` at layer 0 gives it).

The float32 unembedding goes through `explorer._kernels.unembed_product`: numpy's BLAS
where it measured faster than torch's (2x on AMD EPYC), torch's otherwise.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
import xarray as xr

from ._checks import InputError, check_choice, check_int
from ._kernels import bfloat16_matmul_is_fast, median_seconds, row_bucket, unembed_product
from .interventions import Edit, first_edit_layer
from .models import Model
from .readouts import Lens
from .trace import (CleanRun, check_edit_rows, check_edits, check_layers, edits_for_rows, read,
                    provenance, resolve_mean_ablations, run_batch, token_coords)

__all__ = ["logit_lens", "lens_readout", "resolve_unembed_dtype", "screen_decisions",
           "preview_vocabulary", "SCREEN_CANDIDATES", "SCREEN_MIN_SPEEDUP", "PREVIEW_SAMPLE",
           "CLEAN_READOUT_BUDGET_MB", "UNEMBED_CHOICES"]

_UNEMBED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
UNEMBED_CHOICES = ("auto", *_UNEMBED_DTYPES)


SCREEN_MIN_SPEEDUP = 1.1
"""``auto`` takes the bfloat16 screen only where it is at least this much faster than the
exact float32 lens (the exact one is preferred when they are close)."""

_SCREEN_KEY = "_screen_decisions"  # per-model dict attached to the Model: bucket -> entry


def resolve_unembed_dtype(unembed_dtype: str, model: Model | None = None,
                          rows: int | None = None) -> str:
    """``"float32"`` or ``"bfloat16"`` for an ``unembed_dtype`` option.

    ``"auto"`` with ``model`` and ``rows`` (the rows one unembedding will hold) times the
    lens readout of that many rows both ways on this model (once per model and row bucket,
    see `screen_decisions`) and takes the bfloat16 screen only where it is at least
    `SCREEN_MIN_SPEEDUP` times faster; without them (or off the CPU), where a bfloat16
    matmul beats float32 on a stand-in product (`bfloat16_matmul_is_fast`).
    """
    check_choice("unembed_dtype", unembed_dtype, UNEMBED_CHOICES)
    if unembed_dtype != "auto":
        return unembed_dtype
    if model is None or rows is None or model.remote \
            or model.unembed_module.weight.device.type != "cpu":
        return "bfloat16" if bfloat16_matmul_is_fast() else "float32"
    return _screen_decision(model, rows)["chosen"]


def _screen_decision(model: Model, rows: int) -> dict[str, Any]:
    decisions = model.__dict__.setdefault(_SCREEN_KEY, {})
    bucket = row_bucket(max(int(rows), 1))
    if bucket in decisions:
        return decisions[bucket]
    gen = torch.Generator().manual_seed(0)
    resid = torch.randn(bucket, model.spec.d_model, generator=gen)
    times = {}
    with torch.no_grad():
        for mode in ("float32", "bfloat16"):
            n_cand = _n_candidates(model, 10, None, mode, SCREEN_CANDIDATES)
            times[mode] = median_seconds(
                lambda: _read_rows(model, resid, k=10, n_cand=n_cand, unembed_dtype=mode),
                repeats=3)
    chosen = "bfloat16" if times["float32"] >= SCREEN_MIN_SPEEDUP * times["bfloat16"] \
        else "float32"
    entry = {"rows": bucket, "chosen": chosen, "float32_ms": round(times["float32"] * 1e3, 3),
             "bfloat16_ms": round(times["bfloat16"] * 1e3, 3)}
    return decisions.setdefault(bucket, entry)


def screen_decisions(model: Model) -> list[dict[str, Any]]:
    """The ``auto`` decisions made on ``model`` in this process: the row bucket, the mode
    chosen and the readout time of each mode (ms, k = 10)."""
    return [dict(e) for e in model.__dict__.get(_SCREEN_KEY, {}).values()]

SCREEN_CANDIDATES = 32
"""Tokens per row that the bfloat16 screen hands to the float32 refinement (at least)."""

CLEAN_READOUT_BUDGET_MB = 256.0
"""Memory a `CleanRun` may hold for reused lens readouts; past it, layers are recomputed."""

_CACHE_ATTR = "_lens_readouts"  # attribute attached to a CleanRun


def _unembed_weight(model: Model, dtype: torch.dtype) -> torch.Tensor:
    """The unembedding matrix in ``dtype``, converted once per model and dtype."""
    w = model.unembed_module.weight
    if w.dtype == dtype:
        return w
    cache = model.__dict__.setdefault("_unembed_cast", {})
    key = (dtype, w.data_ptr(), w._version)  # a new key after an in-place weight edit
    if key not in cache:
        for old in [k for k in cache if k[0] == dtype]:
            del cache[old]
        cache[key] = w.detach().to(dtype)
    return cache[key]


def _unembed_extras(model: Model) -> tuple[torch.Tensor | None, float | None]:
    """The unembedding bias (or None) and the family's final logit soft cap (or None)."""
    b = getattr(model.unembed_module, "bias", None)
    cap_attr = model.arch.logit_softcap_attr
    cap = getattr(model.hf.config, cap_attr, None) if cap_attr else None
    return (None if b is None else b.detach().float()), cap


def _finish(logits: torch.Tensor, bias: torch.Tensor | None, cap: float | None) -> torch.Tensor:
    """Add the bias and apply the soft cap to float32 logits (in place where it can)."""
    if bias is not None:
        logits += bias
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def _norm_gain(model: Model) -> torch.Tensor:
    """Per-dimension gain [d_model] of the final norm, probed with a zero-mean +-1 vector."""
    d = model.spec.d_model
    x = torch.ones(d)
    x[1::2] = -1.0
    like = next(model.final_norm_module.parameters(), x)
    probe = torch.stack([x, -x]).to(device=like.device, dtype=like.dtype)
    with torch.no_grad():
        y = model.final_norm_module(probe).float()
    return ((y[0] - y[1]) / 2).cpu() * x  # LayerNorm's bias and mean cancel; RMSNorm: its gain


def _screen_weight(model: Model) -> tuple[torch.Tensor, torch.Tensor]:
    """The bfloat16 screen's dims ``hi_dims`` and matrix [vocab, d_model + len(hi_dims)].

    Rounding the normed residual to bfloat16 shifts every logit of a row coherently (the
    error is the logit of the rounding residual), and the dims with the largest final-norm
    gain carry most of it. Their residual rides along as extra columns: on SmolLM2 this
    cuts the normaliser error ~3x for ~6% more work.
    """
    w = model.unembed_module.weight
    cache = model.__dict__.setdefault("_unembed_screen", {})
    key = (w.data_ptr(), w._version)
    if key not in cache:
        cache.clear()
        d = model.spec.d_model
        hi_dims = _norm_gain(model).abs().topk(min(32, max(1, d // 8))).indices.sort().values
        hi_dims = hi_dims.to(w.device)
        wb = w.detach().to(torch.bfloat16)
        cache[key] = (hi_dims, torch.cat([wb, wb[:, hi_dims]], 1).contiguous())
    return cache[key]


def _logits_at(model: Model, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Float32 lens logits of final-normed rows h [m, d_model] at token ids [m, c] only."""
    w = _unembed_weight(model, torch.float32)
    bias, cap = _unembed_extras(model)
    out = torch.bmm(w[ids], h.unsqueeze(-1)).squeeze(-1)     # [m, c, d] @ [m, d, 1] -> [m, c]
    return _finish(out, None if bias is None else bias[ids], cap)


def _count_above(values: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """How many entries of each row of ``values`` [m, n] exceed each threshold [m, t]; exact.

    Sums uint8 flags in groups of 128 (which cannot overflow) before widening: about 3x
    faster on CPU than summing a bool or int64 mask over the whole row.
    """
    m, n = values.shape
    group = 128
    main = n - n % group
    out = torch.empty(thresholds.shape, dtype=torch.int64, device=values.device)
    above = torch.empty((m, n), dtype=torch.bool, device=values.device)
    for j in range(thresholds.shape[1]):
        torch.gt(values, thresholds[:, j:j + 1], out=above)
        flags = above.view(torch.uint8)
        if main:
            head = flags if main == n else flags[:, :main].contiguous()
            count = head.view(m, main // group, group).sum(-1, dtype=torch.uint8).sum(
                -1, dtype=torch.int64)
        else:
            count = torch.zeros(m, dtype=torch.int64, device=values.device)
        if main < n:
            count += flags[:, main:].sum(-1, dtype=torch.int64)
        out[:, j] = count
    return out


@dataclass
class _Readout:
    """What the lens keeps of a chunk of rows [m, ...] before the tracked tokens are known."""

    top_id: torch.Tensor        # [m, k]
    top_prob: torch.Tensor      # [m, k]
    cand_id: torch.Tensor       # [m, c] candidates, by float32 logit, descending
    cand_logit: torch.Tensor    # [m, c] their float32 logits
    cand_screen: torch.Tensor   # [m, c] the values the full-row count compares against
    lse: torch.Tensor           # [m] log of the softmax normaliser
    logits: torch.Tensor        # [m, vocab] float32 logits, or the bfloat16 screen
    h: torch.Tensor | None      # [m, d_model] final-normed rows (bfloat16 mode)

    @property
    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for f in fields(self)
                   if isinstance(v := getattr(self, f.name), torch.Tensor))


def _n_candidates(model: Model, k: int, rank_cap: int | None, unembed_dtype: str,
                  screen_candidates: int) -> int:
    """Candidates per row: the top-k, the ranks below the cap, and a margin for the screen."""
    c = max(k, rank_cap or 0, SCREEN_CANDIDATES if unembed_dtype == "float32" else 0)
    if unembed_dtype != "float32":
        c = max(c, screen_candidates, 2 * k, (rank_cap or 0) + 16)
    return min(c, model.vocab_size)


_BLOCK_ROWS = 16
"""Rows per block for the full-vocabulary passes (a float32 block stays in cache)."""


def _sum_exp(logits: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """sum(exp(logits - shift)) per row of float32 ``logits`` [m, vocab] -> [m, 1], a block
    of rows at a time: no full-size temporary, ~3x faster on CPU than one pass."""
    out = torch.empty_like(shift)
    for r in range(0, logits.shape[0], _BLOCK_ROWS):
        sl = slice(r, r + _BLOCK_ROWS)
        out[sl] = (logits[sl] - shift[sl]).exp_().sum(-1, keepdim=True)
    return out


def _readout_of_logits(logits: torch.Tensor, *, k: int, n_cand: int) -> _Readout:
    """The readout of float32 logit rows [m, vocab]: top-k and normaliser, targets open."""
    cand_logit, cand_id = logits.topk(n_cand, dim=-1)            # sorted, descending
    m = cand_logit[:, :1]
    lse = (m + _sum_exp(logits, m).log()).squeeze(-1)
    return _Readout(top_id=cand_id[:, :k], top_prob=(cand_logit[:, :k] - lse[:, None]).exp(),
                    cand_id=cand_id, cand_logit=cand_logit, cand_screen=cand_logit,
                    lse=lse, logits=logits, h=None)


def _read_rows(model: Model, resid: torch.Tensor, *, k: int, n_cand: int,
               unembed_dtype: str) -> _Readout:
    """The lens of residual rows [m, d_model]: top-k and normaliser, targets still open."""
    bias, cap = _unembed_extras(model)
    h = model.final_norm_module(resid).float()                  # [m, d_model]
    if unembed_dtype == "float32":
        logits = _finish(unembed_product(h, _unembed_weight(model, torch.float32)), bias,
                         cap)                                    # [m, vocab]
        return _readout_of_logits(logits, k=k, n_cand=n_cand)
    # screen then refine: bfloat16 logits pick the candidates, float32 recomputes them
    hi_dims, w_screen = _screen_weight(model)
    hb = h.to(torch.bfloat16)
    residual = (h[:, hi_dims] - hb[:, hi_dims].float()).to(torch.bfloat16)    # [m, n_hi]
    screen = torch.cat([hb, residual], 1) @ w_screen.T                     # [m, vocab]
    # one pass over the screen in blocks of rows: float32 values, candidates, normaliser
    rows = screen.shape[0]
    cand_id = torch.empty((rows, n_cand), dtype=torch.long, device=screen.device)
    cand_screen = torch.empty((rows, n_cand), device=screen.device)
    screen_sum = torch.empty((rows, 1), device=screen.device)
    for r in range(0, rows, _BLOCK_ROWS):
        sl = slice(r, r + _BLOCK_ROWS)
        block = _finish(screen[sl].float(), bias, cap)          # [B, vocab] float32
        torch.topk(block, n_cand, dim=-1, out=(cand_screen[sl], cand_id[sl]))
        screen_sum[sl] = block.sub_(cand_screen[sl, :1]).exp_().sum(-1, keepdim=True)
    screen_max = cand_screen[:, :1]
    exact = _logits_at(model, h, cand_id)                       # [m, c] float32
    cand_logit, order = exact.sort(dim=-1, descending=True)
    cand_id = cand_id.gather(-1, order)
    cand_screen = cand_screen.gather(-1, order)                 # [m, c]
    m = cand_logit[:, :1]
    # normaliser: every token's screen value, with the candidates' exact values swapped in
    others = (screen_sum - (cand_screen - screen_max).exp().sum(-1, keepdim=True)).clamp_(min=0)
    z = others * (screen_max - m).exp() + (cand_logit - m).exp().sum(-1, keepdim=True)
    lse = (m + z.log()).squeeze(-1)
    return _Readout(top_id=cand_id[:, :k], top_prob=(cand_logit[:, :k] - lse[:, None]).exp(),
                    cand_id=cand_id, cand_logit=cand_logit, cand_screen=cand_screen, lse=lse,
                    logits=screen, h=h)


PREVIEW_SAMPLE = 1024
"""Tokens outside a preview's candidates read to estimate the rest of its normaliser."""


@dataclass
class _PreviewVocab:
    """The columns a preview lens reads: candidates, then a random sample of the others."""

    ids: torch.Tensor        # [c + s] token ids, candidates first
    weight: torch.Tensor     # [c + s] each column's share of the normaliser (1 or (V - c) / s)
    index: torch.Tensor      # [vocab] column of each token id, -1 if not read
    w: torch.Tensor          # [c + s, d_model] their unembedding rows, float32


def _preview_vocab(model: Model, candidates: torch.Tensor, sample: int) -> _PreviewVocab:
    """Candidates (unique ids) plus ``sample`` other tokens drawn with a fixed seed."""
    vocab = model.vocab_size
    cand = torch.unique(candidates.long().clamp(0, vocab - 1))
    is_cand = torch.zeros(vocab, dtype=torch.bool)
    is_cand[cand] = True
    rest = (~is_cand).nonzero().squeeze(-1)
    n_s = min(sample, len(rest))
    pick = rest[torch.randperm(len(rest), generator=torch.Generator().manual_seed(0))[:n_s]]
    ids = torch.cat([cand, pick])
    weight = torch.ones(len(ids))
    if n_s:
        weight[len(cand):] = len(rest) / n_s
    index = torch.full((vocab,), -1, dtype=torch.long)
    index[ids] = torch.arange(len(ids))
    w = _unembed_weight(model, torch.float32)
    return _PreviewVocab(ids, weight, index, w[ids.to(w.device)].float().contiguous())


def _preview_rows(model: Model, resid: torch.Tensor, pv: _PreviewVocab, *, k: int,
                  n_cand: int) -> _Readout:
    """The lens of rows [m, d_model] over a preview's columns only (ids are column indices).

    Logits are exact float32 on the columns read; the normaliser counts each sampled
    column for the (V - c) / s tokens it stands in for (an unbiased estimate of the
    unread tokens' share).
    """
    bias, cap = _unembed_extras(model)
    h = model.final_norm_module(resid).float()                  # [m, d_model]
    logits = h @ pv.w.T                                         # [m, c + s]
    if bias is not None:
        logits += bias[pv.ids]
    if cap:
        logits = torch.tanh(logits / cap) * cap
    n_cand = min(n_cand, logits.shape[-1])
    cand_logit, cand_id = logits.topk(n_cand, dim=-1)
    m = cand_logit[:, :1]
    lse = (m + ((logits - m).exp() * pv.weight).sum(-1, keepdim=True).log()).squeeze(-1)
    return _Readout(top_id=cand_id[:, :k], top_prob=(cand_logit[:, :k] - lse[:, None]).exp(),
                    cand_id=cand_id, cand_logit=cand_logit, cand_screen=cand_logit,
                    lse=lse, logits=logits, h=None)


def preview_vocabulary(model: Model, *, results: Sequence[xr.Dataset] = (),
                       directions: Sequence[Any] = (), per_direction: int = 512,
                       limit: int = 4096) -> np.ndarray:
    """Candidate token ids for a preview lens (`logit_lens` ``preview_vocab``).

    The top tokens of earlier lens results (``top_token_id`` and ``final_token_id``) and
    the ``per_direction`` tokens each vector of ``directions`` [d_model] (e.g. a steering
    vector times the sign of its strength) raises most through the final norm's gain and
    the unembedding. At most ``limit`` ids.
    """
    ids = []
    for ds in results:
        for name in ("top_token_id", "final_token_id"):
            if name in ds.variables:
                v = np.asarray(ds[name].values).reshape(-1)
                ids.append(v[v >= 0])
    w = _unembed_weight(model, torch.float32)
    gain = _norm_gain(model).to(w.device)
    for vec in directions:
        d = torch.as_tensor(np.asarray(vec, dtype=np.float32), device=w.device) * gain
        with torch.no_grad():
            ids.append((w @ d).topk(min(per_direction, model.vocab_size)).indices.cpu().numpy())
    if not ids:
        return np.zeros(0, dtype=np.int64)
    flat = np.concatenate(ids).astype(np.int64)
    _, first = np.unique(flat, return_index=True)
    return flat[np.sort(first)][:limit]        # unique, in the order given


def _read_targets(model: Model, r: _Readout, targets: torch.Tensor, *,
                  rank_cap: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank (0 = top) and probability of token ids ``targets`` [m, t] in the rows of ``r``.

    Rank = candidates with a higher float32 logit + other tokens with a higher full-row
    value (the float32 logit, or the bfloat16 screen), min ``rank_cap``. A target at or
    above the lowest candidate's value has no other token above it, so only deeper
    targets pay for a full-row count.
    """
    screened = r.h is not None
    if screened:
        tl = _logits_at(model, r.h, targets)                    # [m, t] exact float32
    else:
        tl = r.logits.gather(-1, targets)
    prob = (tl - r.lse[:, None]).exp()
    rank = (r.cand_logit.unsqueeze(1) > tl.unsqueeze(-1)).sum(-1)   # [m, t] among candidates
    deep = tl < r.cand_screen.min(-1, keepdim=True).values          # others may rank above
    if rank_cap is not None:
        deep &= rank < rank_cap
    need = deep.any(-1)
    if need.any():
        rows = slice(None) if need.all() else need.nonzero().squeeze(-1)  # no copy if all
        full = r.logits[rows]
        if screened:
            bias, cap = _unembed_extras(model)
            full = _finish(full.float(), bias, cap)
        tl_rows = tl[rows]
        others = _count_above(full, tl_rows) - (
            r.cand_screen[rows].unsqueeze(1) > tl_rows.unsqueeze(-1)).sum(-1)
        rank[rows] += torch.where(deep[rows], others, 0)
    if rank_cap is not None:
        rank = rank.clamp(max=rank_cap)
    return rank, prob


def lens_readout(model: Model, resid: torch.Tensor, *, k: int, targets: torch.Tensor | None = None,
                 rank_cap: int | None = None, chunk_rows: int = 256,
                 unembed_dtype: str = "float32",
                 screen_candidates: int = SCREEN_CANDIDATES) -> dict[str, torch.Tensor]:
    """Top-k tokens and probabilities of the lens for residual rows [n, d_model].

    ``targets`` [n, t] are token ids whose rank (0 = top) and probability are returned too.
    Ranks are exact (a count over the vocabulary) unless ``rank_cap`` is set: then any
    rank >= rank_cap reads as rank_cap, and only ranks below the cap are counted. Rows
    are processed ``chunk_rows`` at a time.

    ``unembed_dtype="bfloat16"`` screens the vocabulary in bfloat16 and recomputes the top
    ``max(screen_candidates, 2k, rank_cap + 16)`` tokens of each row in float32: top-k ids
    and probabilities, and the target probabilities, use float32 logits; the normaliser
    takes the other tokens' bfloat16 values; ranks beyond the candidates are counted on
    the bfloat16 screen (approximate: off by a few places among thousands). On SmolLM2-135M
    text (7,680 layer x position rows) the top-5 ids agreed with float32 on every row and
    probabilities differed by at most 1.3e-3 (``explorer bench slider`` measures it).
    It is faster only on CPUs with native bfloat16; ``unembed_dtype="auto"`` uses it there
    and float32 elsewhere (`resolve_unembed_dtype`).

    Returns
    -------
    dict
        ``top_id``, ``top_prob`` [n, k]; with targets, ``target_rank``, ``target_prob`` [n, t].
    """
    check_int("chunk_rows", chunk_rows, low=1)
    check_int("screen_candidates", screen_candidates, low=1)
    unembed_dtype = resolve_unembed_dtype(unembed_dtype, model,
                                          min(chunk_rows, max(int(resid.shape[0]), 1)))
    n_cand = _n_candidates(model, k, rank_cap, unembed_dtype, screen_candidates)
    parts: dict[str, list[torch.Tensor]] = {"top_id": [], "top_prob": [], "target_rank": [],
                                            "target_prob": []}
    with torch.no_grad():
        for s in range(0, resid.shape[0], chunk_rows):
            r = _read_rows(model, resid[s:s + chunk_rows], k=k, n_cand=n_cand,
                           unembed_dtype=unembed_dtype)
            parts["top_id"].append(r.top_id)
            parts["top_prob"].append(r.top_prob)
            if targets is not None:
                rank, prob = _read_targets(model, r, targets[s:s + chunk_rows], rank_cap=rank_cap)
                parts["target_rank"].append(rank)
                parts["target_prob"].append(prob)
    return {name: torch.cat(v) for name, v in parts.items() if v}


class _CleanReadouts:
    """Lens readouts of clean layer groups, kept on a `CleanRun` within a memory budget."""

    def __init__(self, budget_bytes: float):
        self.entries: dict[tuple, list[_Readout]] = {}
        self.nbytes = 0
        self.budget_bytes = budget_bytes

    def get(self, key: tuple) -> list[_Readout] | None:
        return self.entries.get(key)

    def fits(self, nbytes: float) -> bool:
        return self.nbytes + nbytes <= self.budget_bytes

    def put(self, key: tuple, readouts: list[_Readout]) -> None:
        size = sum(r.nbytes for r in readouts)
        if key not in self.entries and self.nbytes + size <= self.budget_bytes:
            self.entries[key] = readouts
            self.nbytes += size


def _clean_readouts(resume: CleanRun) -> _CleanReadouts:
    cache = getattr(resume, _CACHE_ATTR, None)
    if cache is None:
        cache = _CleanReadouts(CLEAN_READOUT_BUDGET_MB * 2**20)
        setattr(resume, _CACHE_ATTR, cache)
    return cache


def _token_strings(model: Model, ids: np.ndarray) -> np.ndarray:
    """Each id decoded on its own ("" for -1), each distinct id once per model."""
    known = model.__dict__.setdefault("_token_strings", {})
    distinct, where = np.unique(ids, return_inverse=True)
    strings = []
    for i in distinct.tolist():
        if i not in known:
            known[i] = model.token_strings([i])[0] if i >= 0 else ""
        strings.append(known[i])
    return np.array(strings, dtype=str)[where].reshape(ids.shape)


def _layer_groups(layers: list[int], first_edit: int, rows_per_layer: int,
                  chunk_rows: int) -> list[tuple[int, ...]]:
    """Layers in chunks of about ``chunk_rows`` rows; no chunk spans the first edited layer.

    Chunks before the edit are the ones a clean read makes too, so their readouts can be
    reused, bit for bit: the same rows go through the same matrix shapes.
    """
    per = max(1, chunk_rows // max(1, rows_per_layer))
    before = [layer for layer in layers if layer < first_edit]
    after = [layer for layer in layers if layer >= first_edit]
    return [tuple(part[i:i + per]) for part in (before, after) for i in range(0, len(part), per)]


def logit_lens(model: Model, prompts: Any, *, k: int = 5, positions: Sequence[int] | None = None,
               layers: Any = None, edits: Sequence[Edit] = (), resume: CleanRun | None = None,
               batch_size: int = 8, unembed_dtype: str = "float32",
               rank_cap: int | None = None, chunk_rows: int = 256,
               screen_candidates: int = SCREEN_CANDIDATES,
               reuse_clean: bool = True, preview_vocab: Any = None) -> xr.Dataset:
    """Per layer and position: the lens's top-k tokens, their probabilities, and the ranks
    at every layer of the final layer's top-k tokens (nostalgebraist, "interpreting GPT:
    the logit lens", 2020).

    Layer l is ``resid_post`` of layer l (the block's output; TransformerLens'
    ``blocks.{l}.hook_resid_post``, row l+1 of its ``accumulated_resid``); there is no
    embedding row, and the last layer is the model's output (see the module docstring).

    Parameters
    ----------
    model : Model
    prompts : str or list of str
    k : int, default=5
        Number of top tokens kept per (layer, position).
    positions : sequence of int, optional
        Per-prompt positions (negative from the end); default every token.
    layers : int or sequence of int, optional
        Layers to read; default all. The final model output is always the reference.
    edits : sequence of Edit
        Interventions applied before reading.
    resume : CleanRun, optional
        Clean residuals of the same prompts: layers before the first edit are not re-run.
    unembed_dtype : {"float32", "bfloat16", "auto"}, default="float32"
        "bfloat16" screens the vocabulary in bfloat16 and recomputes the top candidates in
        float32 (see `lens_readout`): on CPUs with native bfloat16 about half the
        unembedding time, top-k ids and probabilities almost always equal to float32's.
        "float32" is exact. "auto" is "bfloat16" where this CPU's bfloat16 matmul is the
        faster one, else "float32". A remote model reduces the lens inside its trace, in
        float32, whatever this says.
    rank_cap : int, optional
        Ranks at or beyond the cap read as ``rank_cap``, and only ranks below it are
        counted; default exact ranks over the whole vocabulary.
    chunk_rows : int, default=256
        Rows (layer x position) unembedded at a time.
    screen_candidates : int, default=32
        bfloat16 mode: at least this many screened tokens per row are recomputed in float32.
    reuse_clean : bool, default=True
        With ``resume``: keep the readouts of the layers before the first edit on the
        CleanRun (up to `CLEAN_READOUT_BUDGET_MB`) and reuse them; results are identical
        to recomputing them.
    preview_vocab : sequence of int, optional
        A preview, not the lens: the layers not reused from ``resume`` are read only at
        these token ids (and the final layer's top-k), plus `PREVIEW_SAMPLE` other tokens
        drawn with a fixed seed that stand in for the rest of the vocabulary in the
        normaliser. Top-k are the best of the tokens read, with exact logits and estimated
        probabilities; ranks count the tokens read only. The final layer (the model's
        output) stays exact. About 10x less unembedding work for a slider's preview while
        it moves (`preview_vocabulary` gives candidates); ``attrs["readout"]`` is
        ``"preview"``. Ignored by a remote model.

    Returns
    -------
    xarray.Dataset
        ``top_token_id``, ``top_prob`` (prompt, pos, layer, rank); ``final_rank``,
        ``final_prob`` (prompt, pos, layer, rank): rank (0 = top) and probability at each
        layer of the token that is rank ``rank`` in the model's output; ``mask``
        (prompt, pos). Coords ``top_token`` (strings), ``final_token_id``, ``final_token``.
    """
    k = check_int("k", k, low=1, high=model.vocab_size)
    if rank_cap is not None:
        rank_cap = check_int("rank_cap", rank_cap, low=1, high=model.vocab_size)
    check_int("chunk_rows", chunk_rows, low=1)
    check_int("screen_candidates", screen_candidates, low=1)
    unembed_dtype = resolve_unembed_dtype(unembed_dtype, model, chunk_rows)
    layers = check_layers(model, layers)
    edits = check_edits(edits)
    if model.remote and resume is not None:
        raise InputError("`resume` keeps every layer's residual on this machine, which a "
                         "remote model does not; run the remote lens without it.")
    batch_all = model.tokenize(prompts)
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    n_pos = len(positions) if positions is not None else max(batch_all.lengths)
    spec = model.spec
    n = len(prompts)
    check_edit_rows(edits, n)
    n_cand = _n_candidates(model, k, rank_cap, unembed_dtype, screen_candidates)
    first_edit = first_edit_layer(edits) if edits else None
    first_edit = spec.n_layers if first_edit is None else first_edit
    top_id = np.full((n, n_pos, len(layers), k), -1, dtype=np.int64)
    top_prob = np.full((n, n_pos, len(layers), k), np.nan, dtype=np.float32)
    final_id = np.full((n, n_pos, k), -1, dtype=np.int64)
    final_rank = np.full((n, n_pos, len(layers), k), -1, dtype=np.int64)
    final_prob = np.full((n, n_pos, len(layers), k), np.nan, dtype=np.float32)
    layer_index = {layer: i for i, layer in enumerate(layers)}
    edits_run = edits
    if model.remote:  # reduced inside the trace: only [prompt, pos, layer, k] comes back
        got = read(model, batch_all, [Lens(k, tuple(layers))], edits=edits, positions=positions,
                   batch_size=batch_size, progress=False)
        final_id[:] = got.lens_final_id.values
        top_id[:] = got.lens_top_id.values
        top_prob[:] = np.exp(got.lens_top_logprob.values)
        rank = got.lens_rank.values
        final_rank[:] = rank if rank_cap is None else np.minimum(rank, rank_cap)
        final_prob[:] = np.exp(got.lens_logprob.values)
    elif n > batch_size:  # a mean ablation averages over every prompt, as in `read`
        edits_run = resolve_mean_ablations(model, batch_all.token_ids, edits, batch_size)

    local_batches = () if model.remote else range(0, n, batch_size)  # remote: read above
    for s in local_batches:
        rows = range(s, min(s + batch_size, n))
        batch = model.batch_from_ids([batch_all.token_ids[i] for i in rows])
        batch_edits = edits_for_rows(edits_run, rows) if len(rows) < n else edits
        use_resume = resume if (resume is not None and len(rows) == n) else None
        if positions is None:
            # gather real tokens only: [rows] of (prompt, padded col, output pos)
            pr, pc, po = [], [], []
            for i, length in enumerate(batch.lengths):
                for j in range(length):
                    pr.append(i), pc.append(batch.width - length + j), po.append(j)
            pr, pc, po = (torch.tensor(x) for x in (pr, pc, po))
        else:
            P = len(positions)
            pr = torch.arange(len(rows)).repeat_interleave(P)
            pc = torch.arange(P).repeat(len(rows))
            po = pc
        n_r = len(pr)
        g = (pr + s).numpy()
        po_np = po.numpy()
        # the last layer's lens is the model's output: read it from the run's own logits
        from_logits = layers[-1] == spec.n_layers - 1
        groups = _layer_groups(layers[:-1] if from_logits else layers, first_edit, n_r,
                               chunk_rows)
        cache = _clean_readouts(use_resume) if (use_resume is not None and reuse_clean) else None
        w = model.unembed_module.weight
        base_key = (spec.name, spec.weights, w.data_ptr(), w._version,
                    None if positions is None else tuple(positions), k, n_cand, unembed_dtype,
                    chunk_rows)
        cached = {}
        if cache is not None:
            for group in groups:
                if group[-1] < first_edit and (hit := cache.get((*base_key, group))) is not None:
                    cached[group] = hit
        needed = [layer for group in groups if group not in cached for layer in group]
        out = run_batch(model, batch, save={(layer, "resid_post") for layer in needed},
                        edits=batch_edits, save_positions=positions, resume=use_resume)
        final_logits = out["logits"][pr, pc].float()             # [R, vocab]
        final = final_logits.topk(k, dim=-1).indices             # [R, k]
        final_id[g, po_np] = final.numpy()
        pv = None if preview_vocab is None else _preview_vocab(
            model, torch.cat([torch.as_tensor(np.asarray(preview_vocab, dtype=np.int64)),
                              final.reshape(-1)]), PREVIEW_SAMPLE)
        row_bytes = 4 * (spec.vocab_size if unembed_dtype == "float32" else spec.vocab_size // 2)
        plan = [(group, cached.get(group)) for group in groups]
        if from_logits:
            plan.append(((spec.n_layers - 1,), (
                _readout_of_logits(final_logits[c:c + chunk_rows], k=k, n_cand=n_cand)
                for c in range(0, n_r, chunk_rows))))
        with torch.no_grad():
            for group, readouts in plan:
                targets = final.repeat(len(group), 1)            # [G*R, k] layer-major
                previewed = readouts is None and pv is not None  # not reused, not the output
                keep = (readouts is None and not previewed and cache is not None
                        and group[-1] < first_edit and cache.fits(len(group) * n_r * row_bytes))
                if readouts is None:
                    resid = torch.cat([out[(layer, "resid_post")][pr, pc] for layer in group])
                    chunks = (resid[c:c + chunk_rows] for c in range(0, resid.shape[0], chunk_rows))
                    if previewed:  # column indices into pv; mapped back to token ids below
                        readouts = (_preview_rows(model, x, pv, k=k, n_cand=n_cand)
                                    for x in chunks)
                        targets = pv.index[targets]
                    else:
                        readouts = (_read_rows(model, x, k=k, n_cand=n_cand,
                                               unembed_dtype=unembed_dtype) for x in chunks)
                columns: dict[str, list[torch.Tensor]] = {"top_id": [], "top_prob": [],
                                                          "rank": [], "prob": []}
                kept, c0 = [], 0
                for r in readouts:  # one chunk's full-vocab rows at a time unless kept
                    m = r.top_id.shape[0]
                    rank, prob = _read_targets(model, r, targets[c0:c0 + m], rank_cap=rank_cap)
                    c0 += m
                    top = pv.ids[r.top_id] if previewed else r.top_id
                    for name, x in (("top_id", top), ("top_prob", r.top_prob),
                                    ("rank", rank), ("prob", prob)):
                        columns[name].append(x)
                    if keep:
                        kept.append(r)
                if keep:
                    cache.put((*base_key, group), kept)

                def per_row(x, _n_l=len(group)):
                    # [G*R, k] -> [R, G, k]
                    return torch.cat(x).reshape(_n_l, n_r, k).transpose(0, 1).numpy()
                at = (g[:, None], po_np[:, None], [layer_index[layer] for layer in group])
                top_id[at] = per_row(columns["top_id"])
                top_prob[at] = per_row(columns["top_prob"])
                final_rank[at] = per_row(columns["rank"])
                final_prob[at] = per_row(columns["prob"])

    tc = token_coords(model, batch_all, positions, n_pos)
    mask = tc.pop("mask")
    dims4 = ("prompt", "pos", "layer", "rank")
    return xr.Dataset(
        {
            "top_token_id": (dims4, top_id),
            "top_prob": (dims4, top_prob),
            "final_rank": (dims4, final_rank),
            "final_prob": (dims4, final_prob),
            "mask": (("prompt", "pos"), mask),
        },
        coords={
            "prompt": np.arange(n),
            "pos": np.array(positions) if positions is not None else np.arange(n_pos),
            "layer": np.array(layers),
            "rank": np.arange(k),
            "top_token": (dims4, _token_strings(model, top_id)),
            "final_token_id": (("prompt", "pos", "rank"), final_id),
            "final_token": (("prompt", "pos", "rank"), _token_strings(model, final_id)),
            **tc,
        },
        attrs=provenance(model, method="logit_lens", edits=edits, k=k, positions=positions,
                         layers=layers, prompts=prompts,
                         unembed_dtype="float32" if model.remote else unembed_dtype,
                         readout="in-trace" if model.remote else (
                             "local" if preview_vocab is None else "preview"),
                         preview_columns=None if (preview_vocab is None or model.remote)
                         else int(len(pv.ids)),
                         rank_cap=rank_cap, screen_candidates=screen_candidates,
                         n_layers=spec.n_layers),
    )
