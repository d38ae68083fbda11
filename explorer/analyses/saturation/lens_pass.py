"""The lens pass of the saturation analysis (the model runs here), and its cache in parts.

* `saturation_layers`: one trace per batch of texts reading ``resid_post`` at every layer, a
  chunked logit lens (`explorer.lens.lens_readout`), the strict ranks of the final top-k
  tokens at every layer and their saturation layers; on a remote model each batch is reduced
  inside its trace. Cached whole in the activation store.
* `cache_saturation_parts`: the same pass run and cached in parts of ``part_texts`` texts (with
  a time budget), so a long corpus is filled over several runs; `saturation_layers` with the
  same ``part_texts`` joins the parts into the one-pass result.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import xarray as xr

from explorer._checks import InputError, check_float, check_int, check_prompts
from explorer.analyses.saturation.stats import CITATION, NEVER, saturation_from_ranks

__all__ = ["saturation_layers", "cache_saturation_parts"]

def _strict_ranks(top_id: torch.Tensor, top_prob: torch.Tensor, targets: torch.Tensor,
                  cap: int) -> torch.Tensor:
    """Strict ranks of ``targets`` [R, k] among the top-``cap`` lists [L, R, cap]; >= cap -> cap."""
    hit = top_id.unsqueeze(2) == targets[None, :, :, None]              # [L, R, k, cap]
    found = hit.any(-1)                                                   # [L, R, k]
    p_t = (top_prob.unsqueeze(2) * hit).sum(-1)                           # [L, R, k]
    rank = (top_prob.unsqueeze(2) > p_t.unsqueeze(-1)).sum(-1)            # [L, R, k]
    return torch.where(found, rank, torch.full_like(rank, cap))


def _sample_positions(lengths: Sequence[int], n_sample: int, seed: int) -> np.ndarray:
    """Seeded (prompt, pos) pairs with a next token, sorted; at most ``n_sample``."""
    cand = np.array([(p, i) for p, n in enumerate(lengths) for i in range(n - 1)], dtype=np.int64)
    if len(cand) == 0 or n_sample == 0:
        return np.zeros((0, 2), dtype=np.int64)
    rng = np.random.default_rng(seed)
    pick = rng.choice(len(cand), min(n_sample, len(cand)), replace=False)
    out = cand[np.sort(pick)]
    return out


def saturation_layers(model: Any, texts: Any, *, k: int = 10, rank_cap: int = 50,
                      sample_positions: int = 1000, batch_size: int = 4, seed: int = 0,
                      unembed_dtype: str = "float32", part_texts: int | None = None,
                      store: Any = None, progress: Any = None,
                      edits: Sequence[Any] = ()) -> xr.Dataset:
    """Logit-lens ranks and saturation layers of the final top-k tokens at every position.

    One trace per batch of texts reads ``resid_post`` at every layer; the lens
    (`explorer.lens.lens_readout`) then runs in chunks of rows, so the [layer, pos, vocab]
    logits never sit in memory whole. See the module docstring for the conventions.

    Parameters
    ----------
    model : Model
    texts : str or list of str
        One prompt per text (see `corpus_chunks`).
    k : int, default=10
        Ranks tracked (the view's k slider goes up to it).
    rank_cap : int, default=50
        Ranks are exact below it; a token further down reads as ``rank_cap``.
    sample_positions : int, default=1000
        Positions (seeded, each with a next token) whose hidden states at every layer are
        kept as ``resid_sample`` for the task probe.
    batch_size : int, default=4
    seed : int, default=0
    unembed_dtype : {"float32", "bfloat16"}, default="float32"
        The lens's unembedding (`explorer.lens.lens_readout`): exact float32, or a bfloat16
        screen with the top ``rank_cap + 16`` candidates recomputed in float32 (the same
        ids and ranks below ``rank_cap`` unless the screen misplaces a token by more than
        16 places; probabilities differ by about 1e-3). Part of the cache key.
    part_texts : int, optional
        With ``store``: run and cache the lens pass in parts of this many texts (see
        `cache_saturation_parts`), so a long corpus can be computed over several sessions;
        the result is the same as in one pass.
    store : ActivationStore, optional
        Cache: a repeated call with the same model, texts and parameters is served from it.
    progress : bool or callable(done, total), optional
    edits : sequence of Edit, optional
        Interventions (`explorer.interventions`: Ablate, Scale, Patch, Steer, ...) applied in
        the trace, so the saturation layers are those of the edited model; rows of
        ``prompts``-targeted edits index ``texts``. Recorded in ``attrs["edits"]`` and part
        of the cache key (not with ``part_texts``).

    Returns
    -------
    xarray.Dataset
        ``sat_layer`` (prompt, pos, rank); ``final_rank`` (prompt, pos, layer, rank):
        strict rank at each layer of the final rank-r token (capped); ``top_token_id``,
        ``top_prob`` (prompt, pos, layer, rank): the lens top-k; ``cosine`` (prompt, pos,
        layer): cos(h_l, h_{l-1}), NaN at layer 0; ``mask`` (prompt, pos);
        ``resid_sample`` (sample, layer, d_model) with coords ``sample_prompt``,
        ``sample_pos``. Coords ``token_id``, ``token``, ``next_token_id`` (prompt, pos),
        ``final_token_id`` (prompt, pos, rank).

    References
    ----------
    Lioubashevski et al., ICML 2025.
    """
    from explorer.trace import check_edit_rows, check_edits, provenance

    texts = check_prompts(texts)
    params = _lens_params(model, k=k, rank_cap=rank_cap, sample_positions=sample_positions,
                          seed=seed, unembed_dtype=unembed_dtype)
    batch_size = check_int("batch_size", batch_size, low=1)
    edits = check_edits(edits)
    for e in edits:
        e.validate(model)
    check_edit_rows(edits, len(texts))
    if part_texts is not None:
        part_texts = check_int("part_texts", part_texts, low=1)
        _check_part_texts(part_texts, batch_size)
        if edits:
            raise InputError("`part_texts` caches the unedited lens pass only; pass it "
                             "without `edits` (or `edits` without `part_texts`).")

    def compute() -> xr.Dataset:
        sample = _sample_positions(model.tokenize(texts).lengths, sample_positions, seed)
        if part_texts is None or store is None or part_texts >= len(texts):
            ds = _saturation_pass(model, texts, sample=sample, batch_size=batch_size,
                                  progress=progress, edits=edits, **_pass_params(params))
        else:
            cache_saturation_parts(model, texts, store=store, part_texts=part_texts,
                                   batch_size=batch_size, progress=progress, **params)
            ds = _join_parts(model, texts, store, part_texts, sample, params)
        ds.attrs.update(provenance(model, method="saturation_layers", citation=CITATION,
                                   n_texts=len(texts), edits=edits, **params))
        return ds

    if store is None:
        return compute()
    key = _lens_key_parts(model, texts, params)
    if edits:  # unedited keys stay those of earlier cached results
        key["edits"] = [e.to_dict() for e in edits]
    return store.get_or_compute(key, compute)


def _lens_params(model: Any, *, k: int, rank_cap: int, sample_positions: int, seed: int,
                 unembed_dtype: str) -> dict[str, Any]:
    """The lens pass's parameters, validated; they (and the texts) make its cache key."""
    from explorer._checks import check_choice

    k = check_int("k", k, low=1, high=min(model.vocab_size, 64))
    rank_cap = check_int("rank_cap", rank_cap, low=k, high=model.vocab_size)
    sample_positions = check_int("sample_positions", sample_positions, low=0)
    seed = check_int("seed", seed, low=0)
    unembed_dtype = check_choice("unembed_dtype", unembed_dtype, ("float32", "bfloat16"))
    params = dict(k=k, rank_cap=rank_cap, sample_positions=sample_positions, seed=seed)
    if unembed_dtype != "float32":     # float32 keys stay those of earlier cached results
        params["unembed_dtype"] = unembed_dtype
    return params


def _check_part_texts(part_texts: int, batch_size: int) -> None:
    """Parts must hold whole batches, so every text is traced in the same batch as in one pass."""
    if part_texts % batch_size:
        raise InputError(f"`part_texts` must be a multiple of `batch_size`={batch_size}; "
                         f"got {part_texts}.")


def _pass_params(params: dict[str, Any]) -> dict[str, Any]:
    return dict(k=params["k"], rank_cap=params["rank_cap"],
                unembed_dtype=params.get("unembed_dtype", "float32"))


def _lens_key_parts(model: Any, texts: list[str], params: dict[str, Any]) -> dict[str, Any]:
    return {"model": model.spec.provenance(), "method": "saturation_layers", "texts": texts,
            "params": params}


def _part_key_parts(model: Any, texts: list[str], a: int, b: int, sample: np.ndarray,
                    params: dict[str, Any]) -> dict[str, Any]:
    """Cache key of texts[a:b]'s lens pass: its texts, parameters and sampled positions."""
    rows = sample[(sample[:, 0] >= a) & (sample[:, 0] < b)] - [a, 0]
    return {"model": model.spec.provenance(), "method": "saturation_layers_part",
            "texts": texts[a:b], "params": {**params, "sample": rows.tolist()}}


def cache_saturation_parts(model: Any, texts: Any, *, store: Any, part_texts: int = 16,
                           k: int = 10, rank_cap: int = 50, sample_positions: int = 1000,
                           seed: int = 0, unembed_dtype: str = "float32", batch_size: int = 4,
                           time_budget_s: float | None = None, reverse: bool = False,
                           progress: Any = None) -> dict[str, int]:
    """Run the lens pass of `saturation_layers` part by part into the store.

    A dict of counts: what the run did (parts computed and read), for the command's report.

    Texts are cut into consecutive parts of ``part_texts``; each part not yet in the store
    is computed and stored. With ``time_budget_s`` no new part starts once that many
    seconds have passed (one part always runs), so a long corpus can be filled in several
    short runs (``reverse`` goes from the last part, so two runs can share the work); then
    `saturation_layers` with the same ``part_texts`` joins the parts. The positions
    sampled for the probe are drawn over the whole corpus (as in one pass).

    Returns
    -------
    dict
        ``parts`` (total), ``cached`` (in the store now, all of them if the whole pass
        is stored already), ``computed`` (by this call).
    """
    texts = check_prompts(texts)
    params = _lens_params(model, k=k, rank_cap=rank_cap, sample_positions=sample_positions,
                          seed=seed, unembed_dtype=unembed_dtype)
    part_texts = check_int("part_texts", part_texts, low=1)
    batch_size = check_int("batch_size", batch_size, low=1)
    _check_part_texts(part_texts, batch_size)
    if time_budget_s is not None:
        time_budget_s = check_float("time_budget_s", time_budget_s, low=0.0)
    sample = _sample_positions(model.tokenize(texts).lengths, sample_positions, seed)
    t0 = time.perf_counter()
    bounds = [(a, min(a + part_texts, len(texts))) for a in range(0, len(texts), part_texts)]
    if store.get(store.key(_lens_key_parts(model, texts, params)), verify=False) is not None:
        return {"parts": len(bounds), "cached": len(bounds), "computed": 0}  # the whole pass
    cached = computed = 0
    for a, b in (bounds[::-1] if reverse else bounds):
        parts = _part_key_parts(model, texts, a, b, sample, params)
        key = store.key(parts)
        if store.get(key, verify=False) is not None:
            cached += 1
            continue
        if computed and time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
            continue
        rows = np.asarray(parts["params"]["sample"], dtype=np.int64).reshape(-1, 2)

        def compute(a=a, b=b, rows=rows) -> xr.Dataset:
            return _saturation_pass(model, texts[a:b], sample=rows, batch_size=batch_size,
                                    progress=progress, **_pass_params(params))

        store.get_or_compute(parts, compute)
        cached += 1
        computed += 1
    return {"parts": len(bounds), "cached": cached, "computed": computed}


def _pass_arrays(n: int, n_pos: int, n_layers: int, k: int, rank_cap: int, n_sample: int,
                 d: int) -> tuple[np.ndarray, ...]:
    """The lens pass's arrays before any text is read: saturation layers (never), final
    ranks (the cap), top ids (-1), top probabilities and cosines (NaN), sampled residuals."""
    return (np.full((n, n_pos, k), NEVER, dtype=np.int16),
            np.full((n, n_pos, n_layers, k), rank_cap, dtype=np.int16),
            np.full((n, n_pos, n_layers, k), -1, dtype=np.int32),
            np.full((n, n_pos, n_layers, k), np.nan, dtype=np.float32),
            np.full((n, n_pos, n_layers), np.nan, dtype=np.float32),
            np.zeros((n_sample, n_layers, d), dtype=np.float32))


def _join_parts(model: Any, texts: list[str], store: Any, part_texts: int, sample: np.ndarray,
                params: dict[str, Any]) -> xr.Dataset:
    """The one-pass Dataset of `saturation_layers` assembled from its cached parts."""
    n, k, cap = len(texts), params["k"], params["rank_cap"]
    n_pos, n_layers, d = max(model.tokenize(texts).lengths), model.n_layers, model.spec.d_model
    sat, final_rank, top_id, top_prob, cosine, resid_sample = _pass_arrays(
        n, n_pos, n_layers, k, cap, len(sample), d)
    for a in range(0, n, part_texts):
        b = min(a + part_texts, n)
        part = store.get(store.key(_part_key_parts(model, texts, a, b, sample, params)))
        if part is None:
            raise InputError(f"part {a}:{b} of the saturation lens pass is not in the store; "
                             "run cache_saturation_parts to completion first.")
        w = part.sizes["pos"]
        sat[a:b, :w] = part.sat_layer.values
        final_rank[a:b, :w] = part.final_rank.values
        top_id[a:b, :w] = part.top_token_id.values
        top_prob[a:b, :w] = part.top_prob.values
        cosine[a:b, :w] = part.cosine.values
        in_part = (sample[:, 0] >= a) & (sample[:, 0] < b)
        resid_sample[in_part] = part.resid_sample.values
    return _lens_dataset(model, texts, sat, final_rank, top_id, top_prob, cosine,
                         resid_sample, sample)


def _saturation_pass(model: Any, texts: list[str], *, k: int, rank_cap: int,
                     sample: np.ndarray, batch_size: int, unembed_dtype: str,
                     progress: Any, edits: Sequence[Any] = ()) -> xr.Dataset:
    """The lens pass over ``texts``; ``sample`` [S, 2] are the (prompt, pos) kept whole;
    ``edits`` (checked) apply in every batch's trace."""
    from explorer.lens import lens_readout
    from explorer.trace import edits_for_rows, progress_steps, resolve_mean_ablations, trace

    batch_all = model.tokenize(texts)
    lengths = batch_all.lengths
    n, n_pos, n_layers, d = len(texts), max(lengths), model.n_layers, model.spec.d_model
    sample = np.asarray(sample, dtype=np.int64).reshape(-1, 2)          # [S, 2]
    sat, final_rank, top_id, top_prob, cosine, resid_sample = _pass_arrays(
        n, n_pos, n_layers, k, rank_cap, len(sample), d)
    step = progress_steps(sum(lengths), progress if progress is not None else len(texts) > batch_size,
                          unit="token", desc="saturation")

    if edits and n > batch_size:  # a mean ablation averages over every text, not per batch
        edits = resolve_mean_ablations(model, batch_all.token_ids, edits, batch_size)
    for b0 in range(0, n, batch_size):
        rows = list(range(b0, min(b0 + batch_size, n)))
        batch_edits = edits_for_rows(edits, range(rows[0], rows[-1] + 1)) if edits else ()
        if model.remote:
            batch = model.tokenize([texts[i] for i in rows])
            _remote_saturation_batch(model, batch, rows, k=k, rank_cap=rank_cap, sample=sample,
                                     out=(sat, final_rank, top_id, top_prob, cosine,
                                          resid_sample), edits=batch_edits)
            step(sum(lengths[i] for i in rows))
            continue
        tr = trace(model, [texts[i] for i in rows], sites=("resid_post",), batch_size=len(rows),
                   edits=batch_edits, progress=False)
        resid = tr.resid_post.values                                   # [b, P, L, d] NaN pad
        real = tr.mask.values                                          # [b, P]
        bi, pi = np.nonzero(real)
        h = torch.from_numpy(np.ascontiguousarray(resid[bi, pi]))     # [R, L, d]
        R = h.shape[0]
        with torch.no_grad():
            cos = torch.nn.functional.cosine_similarity(h[:, 1:], h[:, :-1], dim=-1)  # [R, L-1]
            flat = h.transpose(0, 1).reshape(n_layers * R, d)          # [L*R, d]
            out = lens_readout(model, flat, k=rank_cap, unembed_dtype=unembed_dtype)
            ids = out["top_id"].reshape(n_layers, R, rank_cap)         # [L, R, cap]
            probs = out["top_prob"].reshape(n_layers, R, rank_cap)
            targets = ids[-1, :, :k]                                   # [R, k] final top-k
            ranks = _strict_ranks(ids, probs, targets, rank_cap)       # [L, R, k]
        ranks_np = ranks.permute(1, 0, 2).numpy()                      # [R, L, k]
        g = np.asarray(rows)[bi]
        final_rank[g, pi] = ranks_np
        sat[g, pi] = saturation_from_ranks(ranks_np)
        top_id[g, pi] = ids[:, :, :k].permute(1, 0, 2).numpy()
        top_prob[g, pi] = probs[:, :, :k].permute(1, 0, 2).numpy()
        cosine[g, pi, 1:] = cos.numpy()
        for si in np.flatnonzero((sample[:, 0] >= b0) & (sample[:, 0] < b0 + len(rows))):
            p, q = sample[si]
            resid_sample[si] = resid[p - b0, q]
        step(int(real.sum()))

    return _lens_dataset(model, texts, sat, final_rank, top_id, top_prob, cosine,
                         resid_sample, sample)


def _remote_saturation_batch(model: Any, batch: Any, rows: list[int], *, k: int,
                             rank_cap: int, sample: np.ndarray,
                             out: tuple[np.ndarray, ...], edits: Sequence[Any] = ()) -> None:
    """One batch (tokenised ``batch`` of texts ``rows``) of the lens pass on a remote model,
    reduced inside its trace.

    The lens top-``rank_cap`` lists, the ranks of the output's top-k tokens, the cosines
    of consecutive layers and the sampled positions' residuals are computed on the
    server; nothing of size [layer, pos, vocab] or [layer, pos, d_model] comes back.
    Ranks are exact counts there, so a token at rank >= ``rank_cap`` reads as
    ``rank_cap``, as in the local pass.
    """
    from explorer.readouts import Lens, Save
    from explorer.trace import read

    sat, final_rank, top_id, top_prob, cosine, resid_sample = out
    n_layers = model.n_layers
    in_batch = np.flatnonzero((sample[:, 0] >= rows[0]) & (sample[:, 0] <= rows[-1]))
    records = [Lens(rank_cap, ranked=k, cosine=True)]
    if len(in_batch):
        records.append(Save("resid_post", points=[(p - rows[0], q) for p, q in sample[in_batch]]))
    got = read(model, batch, records, edits=edits, batch_size=len(rows), progress=False)
    ids = got.lens_top_id.values[..., :k]                             # [b, P, L, k], -1 pad
    prob = np.exp(got.lens_top_logprob.values[..., :k])
    ranks = np.minimum(got.lens_rank.values, rank_cap).astype(np.int16)
    cos = got.lens_cos.values                                          # [b, P, L], NaN at 0
    for i, length in enumerate(batch.lengths):
        g = rows[i]
        final_rank[g, :length] = ranks[i, :length]
        sat[g, :length] = saturation_from_ranks(ranks[i, :length])
        top_id[g, :length] = ids[i, :length]
        top_prob[g, :length] = prob[i, :length]
        if n_layers > 1:
            cosine[g, :length, 1:] = cos[i, :length, 1:]
    if len(in_batch):
        resid_sample[in_batch] = got.resid_post.values                # [points, L, d]


def _lens_dataset(model: Any, texts: list[str], sat: np.ndarray, final_rank: np.ndarray,
                  top_id: np.ndarray, top_prob: np.ndarray, cosine: np.ndarray,
                  resid_sample: np.ndarray, sample: np.ndarray) -> xr.Dataset:
    """The Dataset of `saturation_layers` from its arrays (token coords from the texts)."""
    batch_all = model.tokenize(texts)
    n, n_pos, n_layers, k = top_id.shape
    token_id = np.full((n, n_pos), -1, dtype=np.int64)
    token = np.full((n, n_pos), "", dtype=object)
    next_id = np.full((n, n_pos), -1, dtype=np.int64)
    for i, length in enumerate(batch_all.lengths):
        token_id[i, :length] = batch_all.token_ids[i]
        token[i, :length] = batch_all.tokens[i]
        next_id[i, :length - 1] = batch_all.token_ids[i][1:]
    mask = token_id >= 0
    final_id = np.where(mask[..., None], top_id[:, :, -1, :], -1)
    return xr.Dataset(
        {
            "sat_layer": (("prompt", "pos", "rank"), sat),
            "final_rank": (("prompt", "pos", "layer", "rank"), final_rank),
            "top_token_id": (("prompt", "pos", "layer", "rank"), top_id),
            "top_prob": (("prompt", "pos", "layer", "rank"), top_prob),
            "cosine": (("prompt", "pos", "layer"), cosine),
            "mask": (("prompt", "pos"), mask),
            "resid_sample": (("sample", "layer", "d_model"), resid_sample),
        },
        coords={
            "prompt": np.arange(n), "pos": np.arange(n_pos), "layer": np.arange(n_layers),
            "rank": np.arange(k), "sample": np.arange(len(sample)),
            "sample_prompt": ("sample", sample[:, 0]), "sample_pos": ("sample", sample[:, 1]),
            "token_id": (("prompt", "pos"), token_id),
            "token": (("prompt", "pos"), token.astype(str)),
            "next_token_id": (("prompt", "pos"), next_id),
            "final_token_id": (("prompt", "pos", "rank"), final_id.astype(np.int64)),
        },
    )
