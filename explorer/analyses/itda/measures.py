"""The measures of an ITDA dictionary: reconstruction error, L0 and fraction of variance
explained (`itda_reconstruction`, streamed), the same over a range of tau (`itda_tau_sweep`),
each atom's top examples (`itda_atom_examples`), and the next-token loss with a
reconstruction spliced into the model (`downstream_loss`, `itda_downstream_loss`).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import xarray as xr

from explorer._checks import InputError, check_choice, check_float, check_int
from explorer.analyses.itda.activations import _check_data, activation_chunks
from explorer.analyses.itda.dictionary import CITATION, ITDA
from explorer.analyses.itda.pursuit import ENCODERS, _decode, _distinct_nonzero, matching_pursuit
from explorer.models import Model

__all__ = ["itda_reconstruction", "itda_tau_sweep", "itda_atom_examples", "downstream_loss",
           "itda_downstream_loss"]

def _reconstruction_sums(itda: ITDA, activations: Any, *, site: str, layer: int | None, min_pos: int):
    """Per-token error and L0 plus the sums FVE needs, streamed."""
    per_tok = []
    sse = 0.0
    n = 0
    s1 = None
    s2 = 0.0
    for chunk in activation_chunks(activations, site=site, layer=layer, min_pos=min_pos):
        x = torch.as_tensor(chunk["x"])
        if x.shape[0] == 0:
            continue
        idx, coef = matching_pursuit(x, itda._atoms[: itda.n_atoms], itda.l0, method=itda.method)
        xhat = _decode(idx, coef, itda._atoms[: itda.n_atoms])
        res = ((x - xhat) ** 2).sum(1).double()
        norm2 = (x.double() ** 2).sum(1)
        l0 = _distinct_nonzero(idx, coef, norm2.sqrt())
        per_tok.append((chunk["prompt"], chunk["pos"], (res / norm2.clamp_min(1e-30)).numpy(), l0.numpy()))
        sse += float(res.sum())
        xs = x.double()
        s1 = xs.sum(0) if s1 is None else s1 + xs.sum(0)
        s2 += float((xs ** 2).sum())
        n += x.shape[0]
    if n == 0:
        raise InputError("the activations hold no real tokens.")
    total_var = s2 - float((s1 ** 2).sum()) / n                 # sum ||x - mean||^2
    return per_tok, sse, total_var, n


def itda_reconstruction(itda: ITDA, activations: Any, *, site: str = "resid_post",
                        layer: int | None = None, min_pos: int = 0) -> xr.Dataset:
    """How well a dictionary reconstructs ``activations``: per token and overall.

    Returns
    -------
    xarray.Dataset
        ``error`` (token): relative squared error ||x - x_hat||^2 / ||x||^2; ``l0`` (token):
        distinct atoms used; coords ``prompt``/``pos`` (token). Scalars ``mean_error``,
        ``mean_l0``, ``fve`` (fraction of variance explained, 1 - SSE / sum ||x - mean||^2)
        and ``n_atoms``.
    """
    _check_data(activations)
    itda._check_fitted()
    per_tok, sse, total_var, n = _reconstruction_sums(itda, activations, site=site, layer=layer,
                                                       min_pos=min_pos)
    prompt = np.concatenate([p[0] for p in per_tok])
    pos = np.concatenate([p[1] for p in per_tok])
    err = np.concatenate([p[2] for p in per_tok])
    l0 = np.concatenate([p[3] for p in per_tok])
    return xr.Dataset(
        {"error": ("token", err), "l0": ("token", l0),
         "mean_error": float(err.mean()), "mean_l0": float(l0.mean()),
         "fve": 1.0 - sse / total_var if total_var > 0 else float("nan"),
         "n_atoms": itda.n_atoms},
        coords={"prompt": ("token", prompt), "pos": ("token", pos)},
        attrs={"method": "itda_reconstruction", "site": site, "layer": -1 if layer is None else int(layer),
               "params": {"tau": itda.tau, "l0": itda.l0, "encoder": itda.method, "min_pos": min_pos},
               "citation": CITATION})


def itda_tau_sweep(activations: Any, *, taus: Sequence[float] = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7),
                   l0: int = 8, method: str = "mp", site: str = "resid_post", layer: int | None = None,
                   batch_size: int = 256, eval_activations: Any = None, min_pos: int = 0,
                   progress: Callable[[int, int], None] | None = None) -> xr.Dataset:
    """Dictionary size, reconstruction error, L0 and FVE as functions of ``tau``.

    One dictionary per tau, built on ``activations`` and measured on ``eval_activations``
    (default: the same activations).

    Returns
    -------
    xarray.Dataset
        Over ``tau``: ``n_atoms``, ``mean_error``, ``mean_l0``, ``fve``, ``fit_seconds``.
    """
    _check_data(activations)
    taus = [check_float("tau", t, low=0.0, high=1.0) for t in taus]
    if not taus:
        raise InputError("`taus` must hold at least one value.")
    check_int("l0", l0, low=1)
    check_choice("method", method, ENCODERS)
    evals = activations if eval_activations is None else eval_activations
    rows = []
    for i, tau in enumerate(taus):
        itda = ITDA(tau=tau, l0=l0, method=method, batch_size=batch_size).fit(
            activations, site=site, layer=layer, min_pos=min_pos)
        rec = itda_reconstruction(itda, evals, site=site, layer=layer, min_pos=min_pos)
        rows.append((itda.n_atoms, float(rec["mean_error"]), float(rec["mean_l0"]), float(rec["fve"]),
                     itda.fit_seconds_))
        if progress is not None:
            progress(i + 1, len(taus))
    arr = np.array(rows, dtype=np.float64)
    return xr.Dataset(
        {"n_atoms": ("tau", arr[:, 0].astype(np.int64)), "mean_error": ("tau", arr[:, 1]),
         "mean_l0": ("tau", arr[:, 2]), "fve": ("tau", arr[:, 3]), "fit_seconds": ("tau", arr[:, 4])},
        coords={"tau": np.array(taus)},
        attrs={"method": "itda_tau_sweep", "site": site, "layer": -1 if layer is None else int(layer),
               "params": {"l0": l0, "encoder": method, "batch_size": batch_size, "min_pos": min_pos},
               "citation": CITATION})


def itda_atom_examples(itda: ITDA, activations: xr.Dataset, *, k: int = 5, atoms: Sequence[int] | None = None,
                       site: str = "resid_post", layer: int | None = None, min_pos: int = 0) -> xr.Dataset:
    """Top examples of each atom: the tokens whose codes give it the largest coefficients.

    Parameters
    ----------
    itda : ITDA
    activations : xarray.Dataset
        Traced activations with ``token`` coords (the probing set).
    k : int, default=5
        Examples per atom.
    atoms : sequence of int, optional
        Atoms to report (default all).

    Returns
    -------
    xarray.Dataset
        Over (atom, rank): ``coefficient`` (NaN where the atom has fewer than k uses),
        ``prompt``, ``pos``, ``token``. Over atom: ``source_prompt``, ``source_pos``,
        ``source_token``, ``n_uses`` (tokens whose code uses the atom).
    """
    itda._check_fitted()
    check_int("k", k, low=1)
    atom_ids = np.arange(itda.n_atoms) if atoms is None else np.array(
        [check_int("atom", a, low=0, high=itda.n_atoms - 1) for a in atoms], dtype=np.int64)
    n_atoms = len(atom_ids)
    best_c = np.full((n_atoms, k), -np.inf)
    best_p = np.full((n_atoms, k), -1, dtype=np.int64)
    best_q = np.full((n_atoms, k), -1, dtype=np.int64)
    best_t = np.full((n_atoms, k), "", dtype=object)
    uses = np.zeros(n_atoms, dtype=np.int64)
    for chunk in activation_chunks(activations, site=site, layer=layer, min_pos=min_pos):
        if chunk["x"].shape[0] == 0:
            continue
        dense = itda.dense_codes(chunk["x"])[:, atom_ids]      # [n, atoms]
        uses += (dense != 0).sum(0)
        for a in range(n_atoms):
            col = dense[:, a]
            nz = np.flatnonzero(col != 0)
            if nz.size == 0:
                continue
            top = nz[np.argsort(-col[nz], kind="stable")[:k]]
            cand_c = np.concatenate([best_c[a], col[top]])
            cand_p = np.concatenate([best_p[a], chunk["prompt"][top]])
            cand_q = np.concatenate([best_q[a], chunk["pos"][top]])
            cand_t = np.concatenate([best_t[a], chunk["token"][top].astype(object)])
            order = np.argsort(-cand_c, kind="stable")[:k]
            best_c[a], best_p[a], best_q[a], best_t[a] = (cand_c[order], cand_p[order],
                                                          cand_q[order], cand_t[order])
    best_c[~np.isfinite(best_c)] = np.nan
    return xr.Dataset(
        {"coefficient": (("atom", "rank"), best_c), "prompt": (("atom", "rank"), best_p),
         "pos": (("atom", "rank"), best_q), "token": (("atom", "rank"), best_t.astype(str)),
         "source_prompt": ("atom", itda.atom_prompt_[atom_ids]),
         "source_pos": ("atom", itda.atom_pos_[atom_ids]),
         "source_token": ("atom", itda.atom_token_[atom_ids]), "n_uses": ("atom", uses)},
        coords={"atom": atom_ids, "rank": np.arange(k)},
        attrs={"method": "itda_atom_examples", "site": site, "k": k, "citation": CITATION})


def _next_token_loss(logits: np.ndarray, ids: Sequence[int]) -> float:
    """Mean cross-entropy of predicting ids[1:] from logits[:-1] ([n_pos, vocab])."""
    lg = torch.as_tensor(logits[: len(ids) - 1], dtype=torch.float64)
    return float(torch.nn.functional.cross_entropy(lg, torch.as_tensor(ids[1:])))


def downstream_loss(model: Model, prompts: Sequence[str], reconstruct: Callable[[np.ndarray], np.ndarray],
                    *, layer: int, site: str = "resid_post", min_pos: int = 0,
                    method: str = "downstream_loss", progress: Callable[[int, int], None] | None = None,
                    **params: Any) -> xr.Dataset:
    """Next-token loss when ``reconstruct(x)`` replaces the real activation x at ``layer``.

    For each prompt: the clean loss H_orig, the loss H* with every position's residual
    replaced by its reconstruction, and H_0 with it zero-ablated; the CE loss score
    (H* - H_0) / (H_orig - H_0) is 1 for a perfect reconstruction and 0 for one no better
    than zeros (Leask et al., 2025, via SAEBench). Works for any reconstruction: an ITDA
    dictionary (`itda_downstream_loss`), an SAE, a projection.

    The replacement is applied with `explorer.interventions.Steer` records, one per
    position, adding (x_hat - x) at resid_post; one run per prompt, resumed from a cached
    clean run so layers before ``layer`` are not recomputed.

    Parameters
    ----------
    model : Model
    prompts : sequence of str
        Each needs at least 2 tokens.
    reconstruct : callable([n, d_model] array) -> [n, d_model] array
    layer : int
    site : {"resid_post", "resid_pre"}, default="resid_post"
        ``resid_pre`` of layer l (l >= 1) is resid_post of layer l - 1.
    min_pos : int, default=0
        Positions below this keep their real activation in both edited runs (``1`` leaves
        the attention-sink first token alone, as SAE evaluations leave BOS alone).

    Returns
    -------
    xarray.Dataset
        Over prompt: ``loss_clean``, ``loss_reconstructed``, ``loss_zero``; scalars
        ``ce_loss_score`` (from the prompt-mean losses) and ``mean_error`` (relative, over
        the replaced positions).
    """
    from explorer.interventions import Steer
    from explorer.trace import clean_run, provenance, run_with, trace

    check_choice("site", site, ("resid_post", "resid_pre"))
    layer = model.check_layer(layer)
    check_int("min_pos", min_pos, low=0)
    steer_layer = layer
    if site == "resid_pre":
        if layer == 0:
            raise InputError("`site` 'resid_pre' needs `layer` >= 1 (it is resid_post of layer - 1); got 0.")
        steer_layer = layer - 1
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    batch = model.tokenize(prompts)                          # validates every prompt up front
    short = [i for i, n in enumerate(batch.lengths) if n < max(2, min_pos + 1)]
    if short:
        raise InputError(f"`prompts[{short[0]}]` has {batch.lengths[short[0]]} token(s); the loss needs "
                         f"at least 2 and one at or after `min_pos`={min_pos}.")
    rows, errs = [], []
    for i, prompt in enumerate(prompts):
        ids = batch.token_ids[i]
        n = len(ids)
        ds = trace(model, [prompt], sites=("resid_post",), layers=[steer_layer], progress=False)
        x = ds["resid_post"].sel(layer=steer_layer).values[0, :n]          # [pos, d]
        xhat = np.asarray(reconstruct(x), dtype=np.float32)
        if xhat.shape != x.shape:
            raise InputError(f"`reconstruct` returned shape {xhat.shape} for input {x.shape}.")
        replaced = range(min_pos, n)
        errs.extend((((x - xhat) ** 2).sum(1) / np.maximum((x ** 2).sum(1), 1e-30))[min_pos:].tolist())
        cr = clean_run(model, [prompt])
        clean = _next_token_loss(cr.logits[0].float().numpy(), ids)
        recon_edits = [Steer(layer=steer_layer, vector=xhat[p] - x[p], positions=(p,)) for p in replaced]
        zero_edits = [Steer(layer=steer_layer, vector=-x[p], positions=(p,)) for p in replaced]
        recon = _next_token_loss(run_with(model, [prompt], recon_edits, resume=cr)["logits"].values[0], ids)
        zero = _next_token_loss(run_with(model, [prompt], zero_edits, resume=cr)["logits"].values[0], ids)
        rows.append((clean, recon, zero))
        if progress is not None:
            progress(i + 1, len(prompts))
    arr = np.array(rows)
    h_orig, h_star, h_zero = arr.mean(0)
    score = (h_star - h_zero) / (h_orig - h_zero) if h_orig != h_zero else float("nan")
    return xr.Dataset(
        {"loss_clean": ("prompt", arr[:, 0]), "loss_reconstructed": ("prompt", arr[:, 1]),
         "loss_zero": ("prompt", arr[:, 2]), "ce_loss_score": float(score),
         "mean_error": float(np.mean(errs))},
        coords={"prompt": np.arange(len(prompts))},
        attrs=provenance(model, method=method, layer=layer, site=site, prompts=prompts,
                         min_pos=min_pos, citation=CITATION, **params))


def itda_downstream_loss(model: Model, prompts: Sequence[str], itda: ITDA, *, layer: int,
                         site: str = "resid_post", min_pos: int = 0,
                         progress: Callable[[int, int], None] | None = None) -> xr.Dataset:
    """Next-token loss with the ITDA reconstruction spliced in at ``layer`` (see `downstream_loss`)."""
    itda._check_fitted()
    if itda._d != model.spec.d_model:
        raise InputError(f"the dictionary has d_model={itda._d}; {model.spec.name} has {model.spec.d_model}.")
    return downstream_loss(model, prompts, itda.reconstruct, layer=layer, site=site, min_pos=min_pos,
                           method="itda_downstream_loss", progress=progress, tau=itda.tau, l0=itda.l0,
                           encoder=itda.method, n_atoms=itda.n_atoms)
