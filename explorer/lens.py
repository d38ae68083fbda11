"""Logit lens: read each layer's residual stream through the final norm and unembedding.

Computed in chunks of (layer, position) rows so the [layer x pos x vocab] logits never
sit in memory whole; only the top-k and the ranks of tracked tokens are kept.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import xarray as xr

from ._checks import check_choice, check_int
from .interventions import Edit
from .models import Model
from .trace import CleanRun, check_layers, provenance, run_batch, token_coords

__all__ = ["logit_lens", "lens_readout"]

_UNEMBED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _unembed_weight(model: Model, dtype: torch.dtype) -> torch.Tensor:
    """The unembedding matrix in ``dtype``, converted once per model and dtype."""
    w = model.unembed_module.weight
    if w.dtype == dtype:
        return w
    cache = model.__dict__.setdefault("_unembed_cast", {})
    key = (dtype, w.data_ptr())
    if key not in cache:
        cache.clear()
        cache[key] = w.detach().to(dtype)
    return cache[key]


def lens_readout(model: Model, resid: torch.Tensor, *, k: int, targets: torch.Tensor | None = None,
                 rank_cap: int | None = None, chunk_rows: int = 256,
                 unembed_dtype: str = "float32") -> dict[str, torch.Tensor]:
    """Top-k tokens and probabilities of the lens for residual rows [n, d_model].

    ``targets`` [n, t] are token ids whose rank (0 = top) and probability are returned too.
    Ranks are exact (a count over the vocabulary) unless ``rank_cap`` is set: then ranks
    come from the top ``rank_cap`` tokens and any rank >= rank_cap reads as rank_cap,
    several times faster. Rows are processed ``chunk_rows`` at a time.
    """
    n = resid.shape[0]
    dt = _UNEMBED_DTYPES[unembed_dtype]
    top_ids, top_p, t_rank, t_p = [], [], [], []
    norm = model.final_norm_module
    w = model.unembed_module.weight
    b = getattr(model.unembed_module, "bias", None)
    cap_attr = model.arch.logit_softcap_attr
    cap = getattr(model.hf.config, cap_attr, None) if cap_attr else None
    w_dt = _unembed_weight(model, dt)
    with torch.no_grad():
        for s in range(0, n, chunk_rows):
            h = norm(resid[s:s + chunk_rows])                 # [rows, d_model]
            logits = (h.to(dt) @ w_dt.T).float()              # [rows, vocab]
            if b is not None:
                logits += b
            if cap:
                logits = torch.tanh(logits / cap) * cap
            logp = torch.log_softmax(logits, dim=-1)
            v, i = logp.topk(k, dim=-1)
            top_ids.append(i)
            top_p.append(v.exp())
            if targets is not None:
                tg = targets[s:s + chunk_rows]                # [rows, t]
                if rank_cap is None:
                    tl = logits.gather(-1, tg)                # [rows, t]
                    # uint8 then a sum: ~1.5x faster than summing the bool mask on CPU
                    above = logits.unsqueeze(1) > tl.unsqueeze(-1)     # [rows, t, vocab]
                    t_rank.append(above.to(torch.uint8).sum(-1, dtype=torch.int64))
                else:
                    top = logp.topk(rank_cap, dim=-1).indices           # [rows, cap]
                    hit = top.unsqueeze(1) == tg.unsqueeze(-1)          # [rows, t, cap]
                    first = hit.to(torch.uint8).argmax(-1)
                    t_rank.append(torch.where(hit.any(-1), first, torch.full_like(first, rank_cap)))
                t_p.append(logp.gather(-1, tg).exp())
    out = {"top_id": torch.cat(top_ids), "top_prob": torch.cat(top_p)}
    if targets is not None:
        out["target_rank"] = torch.cat(t_rank)
        out["target_prob"] = torch.cat(t_p)
    return out


def logit_lens(model: Model, prompts: Any, *, k: int = 5, positions: Sequence[int] | None = None,
               layers: Any = None, edits: Sequence[Edit] = (), resume: CleanRun | None = None,
               batch_size: int = 8, unembed_dtype: str = "float32",
               rank_cap: int | None = None, chunk_rows: int = 256) -> xr.Dataset:
    """Per layer and position: the lens's top-k tokens, their probabilities, and the ranks
    at every layer of the final layer's top-k tokens.

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
    unembed_dtype : {"float32", "bfloat16"}, default="float32"
        bfloat16 halves the unembedding time on CPU, at a small error in probabilities.
    rank_cap : int, optional
        Compute ``final_rank`` from the top ``rank_cap`` tokens only (ranks at or beyond the
        cap read as ``rank_cap``); default exact ranks over the whole vocabulary.

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
    check_choice("unembed_dtype", unembed_dtype, _UNEMBED_DTYPES)
    layers = check_layers(model, layers)
    batch_all = model.tokenize(prompts)
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    n_pos = len(positions) if positions is not None else max(batch_all.lengths)
    spec = model.spec
    n = len(prompts)
    top_id = np.full((n, n_pos, len(layers), k), -1, dtype=np.int64)
    top_prob = np.full((n, n_pos, len(layers), k), np.nan, dtype=np.float32)
    final_id = np.full((n, n_pos, k), -1, dtype=np.int64)
    final_rank = np.full((n, n_pos, len(layers), k), -1, dtype=np.int64)
    final_prob = np.full((n, n_pos, len(layers), k), np.nan, dtype=np.float32)

    for s in range(0, n, batch_size):
        rows = range(s, min(s + batch_size, n))
        batch = model.batch_from_ids([batch_all.token_ids[i] for i in rows])
        use_resume = resume if (resume is not None and len(rows) == n) else None
        out = run_batch(model, batch, save={(layer, "resid_post") for layer in layers},
                        edits=edits, save_positions=positions, resume=use_resume)
        logits = out["logits"]                                   # [b, P, vocab]
        if positions is None:
            # gather real tokens only: [rows] of (prompt, padded col, output pos)
            pr, pc, po = [], [], []
            for i, length in enumerate(batch.lengths):
                for j in range(length):
                    pr.append(i), pc.append(batch.width - length + j), po.append(j)
            pr, pc, po = (torch.tensor(x) for x in (pr, pc, po))
        else:
            P = logits.shape[1]
            pr = torch.arange(len(rows)).repeat_interleave(P)
            pc = torch.arange(P).repeat(len(rows))
            po = pc
        final = logits[pr, pc].float().topk(k, dim=-1).indices   # [R, k]
        g = pr + s
        final_id[g, po] = final.numpy()
        resid = torch.stack([out[(layer, "resid_post")][pr, pc] for layer in layers])  # [L, R, d]
        n_l, n_r = resid.shape[:2]
        r = lens_readout(model, resid.reshape(n_l * n_r, -1), k=k,
                         targets=final.repeat(n_l, 1), rank_cap=rank_cap, chunk_rows=chunk_rows,
                         unembed_dtype=unembed_dtype)
        # [L*R, k] -> [R, L, k]
        def per_row(x):
            return x.reshape(n_l, n_r, k).transpose(0, 1).numpy()
        top_id[g, po] = per_row(r["top_id"])
        top_prob[g, po] = per_row(r["top_prob"])
        final_rank[g, po] = per_row(r["target_rank"])
        final_prob[g, po] = per_row(r["target_prob"])

    decode = np.vectorize(lambda i: model.tokenizer.decode([int(i)]) if i >= 0 else "", otypes=[object])
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
            "top_token": (dims4, decode(top_id).astype(str)),
            "final_token_id": (("prompt", "pos", "rank"), final_id),
            "final_token": (("prompt", "pos", "rank"), decode(final_id).astype(str)),
            **tc,
        },
        attrs=provenance(model, method="logit_lens", edits=edits, k=k, positions=positions,
                         layers=layers, prompts=prompts, unembed_dtype=unembed_dtype,
                         rank_cap=rank_cap,
                         n_layers=spec.n_layers),
    )
