"""Localization by causal tracing and attribution patching: restore one component's clean
output (a layer's residual at one position, an MLP, or one attention head) in a run with
noised subject embeddings (`causal_trace`), its linear estimate from one gradient
(`attribution_patching`), and the MLP layers each localization method picks for a budget
(`top_layers`, `localized_layers`; the components with heads are `components`'s).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xarray as xr

from explorer._checks import InputError, check_float, check_int
from explorer.analyses.unlearning.facts import (
    CITATION,
    AttributeFact,
    Progress,
    attribute_token_ids,
    fact_prompt,
    subject_positions,
)
from explorer.analyses.unlearning.components import _mlp_layers, localized_components, top_layers
from explorer.interventions import Set
from explorer.models import Model
from explorer.readouts import Grad, Save
from explorer.trace import provenance, read, run_on_weights, run_with, trace

__all__ = ["causal_trace", "attribution_patching", "top_layers", "localized_layers"]


def _mlp_module(model: Model, layer: int) -> torch.nn.Module:
    block = model.hf_layer(layer)
    if not hasattr(block, "mlp"):
        raise InputError(f"{model.spec.family} layers have no `mlp` module; unlearning needs one.")
    return block.mlp


def _noise_std(model: Model) -> float:
    """Standard deviation of the token embedding outputs (the noise unit of ROME); read on
    the server for a remote model."""
    return float(run_on_weights(model, _embedding_std))


def _embedding_std(weights: Model) -> float:
    """Std of the token embedding module's outputs over the vocabulary: its weight's std
    times the scale the module applies (Gemma's sqrt(d_model); 1 elsewhere), read off the
    row of largest norm."""
    emb = weights.hf.get_input_embeddings()
    w = emb.weight.float()
    row = w.norm(dim=-1).argmax()
    with torch.no_grad():
        scale = emb(row[None].to(emb.weight.device)).float().norm() / w[row].norm()
    return float(w.std() * scale)


def _fact_noise(model: Model, facts: Sequence[AttributeFact], noise_scale: float,
                seed: int) -> list[torch.Tensor]:
    """Gaussian noise per fact, [n_subject_tokens, d_model]: one generator seeded with
    ``seed`` draws each fact's block in order, scaled by noise_scale * embedding std."""
    g = torch.Generator().manual_seed(seed)
    std = _noise_std(model)
    return [torch.randn(len(subject_positions(model, f)), model.spec.d_model, generator=g)
            * noise_scale * std for f in facts]


def _clean_states(model: Model, prompt: str
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Clean resid_post and mlp_out per layer, each [pos, d_model], and the input of each
    layer's output projection (attn_z), [pos, head * d_head], from one core trace."""
    read = trace(model, [prompt], sites=("resid_post", "mlp_out", "attn_z"))
    per_layer = {s: [torch.from_numpy(x) for x in np.moveaxis(read[s].values[0], 1, 0)]
                 for s in ("resid_post", "mlp_out", "attn_z")}          # [pos, ...] per layer
    return (per_layer["resid_post"], per_layer["mlp_out"],
            [z.reshape(z.shape[0], -1) for z in per_layer["attn_z"]])


def _corrupted_probs(model: Model, ids: torch.Tensor, subj: list[int], noise: torch.Tensor,
                     target: int, restores: Sequence[tuple[str, int, int | None]],
                     resid: list[torch.Tensor], mlp: list[torch.Tensor],
                     z: list[torch.Tensor] | None = None) -> torch.Tensor:
    """p(target) at the last position for one corrupted run per restore.

    ``restores`` rows are ("resid", layer, pos): that layer's output at pos set to its
    clean value; ("mlp", layer, None): that MLP's output at every position set clean;
    ("head", layer, head): that head's slice of the output projection's input (its
    attention output, ``attn_z``) set clean at every position, so the head writes its
    clean output through its slice of W_O; ("none", -1, None): corrupted only. ``ids``
    [pos]; the subject's token embeddings get ``noise`` (added at resid_pre of layer 0:
    the embedding module's output, plus GPT-2's position embedding). The runs are one
    batch of `run_with`, one row per restore, the noise and the restores `Set` edits (a
    remote model runs it on the server).
    """
    dh = model.spec.d_head
    edits = [Set("resid_pre", 0, noise, add=True, positions=tuple(int(p) for p in subj))]
    for row, (kind, layer, x) in enumerate(restores):
        if kind == "resid":
            edits.append(Set("resid_post", layer, resid[layer][x], positions=(x,),
                             prompts=(row,)))
        elif kind == "mlp":
            edits.append(Set("mlp_out", layer, mlp[layer], prompts=(row,)))
        elif kind == "head":
            edits.append(Set("attn_z", layer, z[layer][:, x * dh:(x + 1) * dh], head=x,
                             prompts=(row,)))
    rows = [[int(t) for t in ids]] * len(restores)
    logits = run_with(model, rows, edits, positions=[-1]).logits.values[:, 0]  # [run, vocab]
    return torch.softmax(torch.from_numpy(logits).float(), -1)[:, target]


def causal_trace(model: Model, facts: Sequence[AttributeFact], *, noise_scale: float = 3.0,
                 seed: int = 0, positions: bool | Sequence[int] = True, heads: bool = True,
                 batch_size: int = 64, progress: Progress = None) -> xr.Dataset:
    """Causal tracing (Meng et al. 2022, as used by Guo et al., ICML 2025).

    The subject embeddings get Gaussian noise (``noise_scale`` times the embedding std;
    see `_fact_noise`); one layer's clean state is restored at a time and p(answer) at the
    last position is read. ``restore_resid`` restores a layer's output (resid_post) at one
    position (the layer x position heatmap: every position when ``positions`` is True,
    the listed per-prompt positions (negative from the end) when a list, none when False);
    ``restore_mlp`` restores one MLP's output at every position (the MLP localization);
    with ``heads``, ``restore_head`` restores one attention head's output at every position
    (its slice of the output projection's input; Guo et al.'s per-head ``result`` patch),
    for the component localization (`components.localized_components`).

    Returns
    -------
    xr.Dataset
        ``restore_resid`` (fact, layer, pos) NaN past a prompt's end; ``restore_mlp``
        (fact, layer); ``restore_head`` (fact, layer, head) with ``heads``; ``p_clean``,
        ``p_corrupt`` (fact); coord ``token`` (fact, pos).
    """
    facts = list(facts)
    if not facts:
        raise InputError("`facts` must hold at least one fact; got an empty list.")
    noise_scale = check_float("noise_scale", noise_scale, low=0.0)
    batch_size = check_int("batch_size", batch_size, low=1)
    L = model.n_layers
    noises = _fact_noise(model, facts, noise_scale, seed)
    prompts = [fact_prompt(f, "trained") for f in facts]
    tok_ids = [model.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    T = max(len(t) for t in tok_ids)
    resid_map = np.full((len(facts), L, T), np.nan)
    mlp_map = np.zeros((len(facts), L))
    H = model.spec.n_heads
    head_map = np.zeros((len(facts), L, H))
    p_clean = np.zeros(len(facts))
    p_corrupt = np.zeros(len(facts))
    tokens = np.full((len(facts), T), "", dtype=object)
    ans = attribute_token_ids(model, facts[0].attributes)
    for fi, (f, ids, noise) in enumerate(zip(facts, tok_ids, noises)):
        n = len(ids)
        target = ans[f.attributes.index(f.attribute)]
        subj = subject_positions(model, f)
        resid, mlp, z = _clean_states(model, prompts[fi])
        restores: list[tuple[str, int, int | None]] = [("none", -1, None)]
        restores += [("mlp", x, None) for x in range(L)]
        n_head_rows = L * H if heads else 0
        restores += [("head", x, h) for x in range(L) for h in range(H)] if heads else []
        if positions is True:
            pos = list(range(n))
        elif positions is False:
            pos = []
        else:
            pos = sorted({p + n if p < 0 else p for p in positions if -n <= p < n})
        restores += [("resid", x, p) for x in range(L) for p in pos]
        ids_t = torch.tensor(ids)
        probs = torch.cat([_corrupted_probs(model, ids_t, subj, noise, target,
                                            restores[r0:r0 + batch_size], resid, mlp, z)
                           for r0 in range(0, len(restores), batch_size)]).numpy()
        with torch.no_grad():
            lg = run_with(model, [prompts[fi]], positions=[-1]).logits.values
        p_clean[fi] = float(torch.softmax(torch.from_numpy(lg[0, 0]), -1)[target])
        p_corrupt[fi] = probs[0]
        mlp_map[fi] = probs[1:L + 1]
        if heads:
            head_map[fi] = probs[L + 1:L + 1 + n_head_rows].reshape(L, H)
        if pos:
            resid_map[fi][:, pos] = probs[L + 1 + n_head_rows:].reshape(L, len(pos))
        tokens[fi, :n] = model.token_strings(ids)
        if progress:
            progress(fi + 1, len(facts))
    data = {"restore_resid": (("fact", "layer", "pos"), resid_map),
            "restore_mlp": (("fact", "layer"), mlp_map),
            "p_clean": ("fact", p_clean), "p_corrupt": ("fact", p_corrupt)}
    if heads:
        data["restore_head"] = (("fact", "layer", "head"), head_map)
    ds = xr.Dataset(
        data,
        coords={"fact": np.arange(len(facts)), "layer": np.arange(L), "pos": np.arange(T),
                **({"head": np.arange(H)} if heads else {}),
                "subject": ("fact", [f.subject for f in facts]),
                "token": (("fact", "pos"), tokens.astype(str))},
        attrs=provenance(model, method="causal_trace", noise_scale=noise_scale, seed=seed,
                         heads=heads, noise_std=_noise_std(model)),
    )
    ds.attrs["citation"] = CITATION
    return ds


def attribution_patching(model: Model, facts: Sequence[AttributeFact], *,
                         noise_scale: float = 3.0, seed: int = 0,
                         progress: Progress = None) -> xr.Dataset:
    """Attribution patching of each MLP and attention head (Nanda 2023; Syed et al. 2023;
    used by Guo et al.).

    In the corrupted run (the same noise as `causal_trace` with the same seed) the score of
    MLP l is sum over positions of grad_{mlp_out l} p(answer) . (clean - corrupted mlp_out l),
    the first-order estimate of ``restore_mlp - p_corrupt``; the score of head h of layer l
    is the same product on that head's slice of the output projection's input (``attn_z``),
    the first-order estimate of ``restore_head - p_corrupt``. The corrupted run is one
    trace with the noise as a `Set` edit and gradient readouts (on a remote model, one NDIF
    session that turns gradient tracking on around it).

    Returns
    -------
    xr.Dataset
        ``ap_mlp`` (fact, layer); ``ap_head`` (fact, layer, head).
    """
    facts = list(facts)
    if not facts:
        raise InputError("`facts` must hold at least one fact; got an empty list.")
    noise_scale = check_float("noise_scale", noise_scale, low=0.0)
    L = model.n_layers
    noises = _fact_noise(model, facts, noise_scale, seed)
    ans = attribute_token_ids(model, facts[0].attributes)
    H = model.spec.n_heads
    scores = np.zeros((len(facts), L))
    head_scores = np.zeros((len(facts), L, H))
    for fi, (f, noise) in enumerate(zip(facts, noises)):
        prompt = fact_prompt(f, "trained")
        target = ans[f.attributes.index(f.attribute)]
        subj = torch.tensor(subject_positions(model, f))
        _, clean, clean_z = _clean_states(model, prompt)
        ids = torch.tensor(model.tokenizer(prompt, add_special_tokens=False)["input_ids"])[None]
        mlp_s, head_s = _traced_attribution(model, ids, subj, noise, target, clean, clean_z)
        scores[fi], head_scores[fi] = mlp_s.numpy(), head_s.numpy()
        if progress:
            progress(fi + 1, len(facts))
    ds = xr.Dataset({"ap_mlp": (("fact", "layer"), scores),
                     "ap_head": (("fact", "layer", "head"), head_scores)},
                    coords={"fact": np.arange(len(facts)), "layer": np.arange(L),
                            "head": np.arange(H),
                            "subject": ("fact", [f.subject for f in facts])},
                    attrs=provenance(model, method="attribution_patching",
                                     noise_scale=noise_scale, seed=seed))
    ds.attrs["citation"] = CITATION
    return ds


def _traced_attribution(model: Model, ids: torch.Tensor, subj: torch.Tensor,
                        noise: torch.Tensor, target: int, clean: list[torch.Tensor],
                        clean_z: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """([layer], [layer, head]): grad_{mlp_out l} p(target) . (clean - corrupted mlp_out l),
    and per head the same on its slice of the o_proj input, from one trace (`read`): the
    noise is a `Set` edit at resid_pre 0, the corrupted values `Save` and their gradients
    `Grad` records."""
    edits = [Set("resid_pre", 0, noise, add=True, positions=tuple(int(p) for p in subj))]
    sites = ("attn_z", "mlp_out")
    ds = read(model, [ids[0].tolist()], [Save("attn_z"), Save("mlp_out"),
                                         Grad(sites, [target])], edits=edits, progress=False)
    per_layer = {name: [torch.from_numpy(x).reshape(x.shape[0], -1)       # [pos, ...]
                        for x in np.moveaxis(ds[name].values[0], 1, 0)]
                 for name in ("mlp_out", "attn_z", "grad_mlp_out", "grad_attn_z")}
    return _grad_times_delta(model, clean, clean_z, per_layer["mlp_out"], per_layer["attn_z"],
                             per_layer["grad_mlp_out"], per_layer["grad_attn_z"])


def _grad_times_delta(model: Model, clean: list[torch.Tensor], clean_z: list[torch.Tensor],
                      acts: list[torch.Tensor], zs: list[torch.Tensor],
                      g_mlp: Sequence[torch.Tensor], g_z: Sequence[torch.Tensor]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per layer, sum over positions of grad . (clean - corrupted) for the MLP output
    ([layer]) and per head on its slice of the o_proj input ([layer, head]); every
    tensor is one prompt's [pos, ...]."""
    L, H, dh = model.n_layers, model.spec.n_heads, model.spec.d_head
    scores = torch.zeros(L, dtype=torch.float64)
    head_scores = torch.zeros(L, H, dtype=torch.float64)
    for x in range(L):
        delta = clean[x].float() - acts[x].detach().float()     # [pos, d_model]
        scores[x] = float((g_mlp[x].float() * delta).sum())
        dz = clean_z[x].float() - zs[x].detach().float()        # [pos, head * d_head]
        prod = (g_z[x].float() * dz).reshape(dz.shape[0], H, dh)
        head_scores[x] = prod.sum((0, 2)).double()
    return scores, head_scores


def localized_layers(model: Model, method: str, n_layers: int, *, probe: xr.Dataset | None = None,
                     trace: xr.Dataset | None = None, attribution: xr.Dataset | None = None,
                     seed: int = 0) -> list[int]:
    """The MLP layers a localization method trains for a budget of ``n_layers`` MLPs.

    ``fact_lookup`` needs ``probe``; ``causal_tracing(_mlp)`` ``trace``,
    ``attribution_patching(_mlp)`` ``attribution``: the ``_mlp`` variants take the top
    ``n_layers`` MLPs by mean restore_mlp / ap_mlp over the facts, the component methods
    the MLPs among their components (`components.localized_components`, which may also
    hold heads); ``random`` draws seeded layers; ``all`` returns every layer (it trains
    every parameter).
    """
    if method in ("causal_tracing", "attribution_patching"):
        comps = localized_components(model, method, n_layers, probe=probe, trace=trace,
                                     attribution=attribution, seed=seed)
        return [int(c[1:].split(".")[0]) for c in comps if c.endswith("MLP")]
    return _mlp_layers(model, method, n_layers, probe=probe, trace=trace,
                       attribution=attribution, seed=seed)
