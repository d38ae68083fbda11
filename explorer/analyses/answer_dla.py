"""Direct logit attribution of an answer against an alternative, clean and edited.

Which heads and MLPs write logit(answer) - logit(alternative) straight into the residual
stream at a prompt's position (the last one by default): each writer's output read through
the final norm *as frozen at the clean run* (its scale fixed to the clean run's) and the
unembedding's answer-minus-alternative direction. The same attribution under the workspace's
edits sits beside it, read through the same frozen norm, so the two runs' numbers are in one
unit and their difference is what the edits changed in each writer's direct effect.

The terms come from the trace's `explorer.readouts.DLA` record (computed inside the one
nnsight trace, so a remote run sends back only these scalars). Where the residual stream is
a plain sum (not Gemma 2's post-norms, nor a logit soft cap) the clean run's terms add up to
its logit difference.

References
----------
Elhage et al., "A Mathematical Framework for Transformer Circuits" (2021), direct logit
attribution; Wang et al., "Interpretability in the Wild" (ICLR 2023).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import xarray as xr

from explorer import components
from explorer._checks import InputError, absolute_position, check_prompts
from explorer.interventions import Edit
from explorer.models import Model
from explorer.readouts import DLA, Logits, Save
from explorer.trace import (as_batch, check_edits, check_positions, final_norm_kind, provenance,
                            read)

__all__ = ["answer_logit_attribution", "answer_token_id", "top_tokens", "RUNS", "TERMS"]

RUNS = ("clean", "edited")
"""The ``run`` coordinate: the clean model and the model under the edits."""

TERMS = ("embed", "heads", "attn_bias", "mlp", "norm_bias")
"""The writers' variables, whose sum is the attributed logit difference (``total``)."""


def answer_token_id(model: Model, token: Any, *, name: str = "answer") -> int:
    """The token id ``token`` names: an int id, or text that tokenises to exactly one token
    (a leading space counts: ``" Paris"`` is not ``"Paris"``)."""
    if isinstance(token, (bool, np.bool_)):
        raise InputError(f"`{name}` must be a token id or a one-token text; got {token!r}.")
    if isinstance(token, (int, np.integer)):
        if not 0 <= int(token) < model.vocab_size:
            raise InputError(f"`{name}` must be a token id in [0, {model.vocab_size - 1}]; "
                             f"got {int(token)}.")
        return int(token)
    if not isinstance(token, str) or token == "":
        raise InputError(f"`{name}` must be a token id or a one-token text; got {token!r}.")
    ids = model.tokenizer(token, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        pieces = model.token_strings(ids)
        raise InputError(f"`{name}` must be one token; {token!r} is {len(ids)} tokens "
                         f"{pieces!r}. Type one of them, or a token id.")
    return int(ids[0])


def top_tokens(model: Model, prompt: str, k: int = 2) -> list[int]:
    """The clean model's ``k`` most likely next tokens after ``prompt`` (ids, best first)."""
    ds = read(model, [prompt], [Logits()], positions=[-1], progress=False)
    logits = torch.from_numpy(np.asarray(ds.logits.values[0, 0], dtype=np.float64))
    return logits.topk(k).indices.tolist()


def answer_logit_attribution(model: Model, prompt: str, *, answer: Any = None,
                             alternative: Any = None, edits: Sequence[Edit] = (),
                             positions: Sequence[int] = (-1,)) -> xr.Dataset:
    """Each head's and MLP's direct contribution to logit(answer) - logit(alternative).

    Parameters
    ----------
    model : Model
    prompt : str
    answer, alternative : int or str, optional
        Token ids or one-token texts; default the clean model's top and second token at
        the prompt's last position.
    edits : sequence of Edit, default=()
        The edited run's interventions (the clean run has none).
    positions : sequence of int, default=(-1,)
        Positions where the logits are read (negative from the end).

    Returns
    -------
    xarray.Dataset
        Over ``run`` ("clean", "edited") and ``pos``: ``head`` (run, pos, layer, head),
        ``mlp`` and ``attn_bias`` (run, pos, layer), ``embed`` and ``norm_bias`` (the final
        norm's and unembedding's biases) (run, pos), ``total`` their sum and ``logit_diff``
        (run, pos) the run's own logit difference. Every writer is read through the final
        norm at the clean run's scale, so the edited terms need not add up to the edited
        logit difference. Coords ``head_component`` ("L3.H1") and ``mlp_component``
        ("L3.MLP"), ``token`` and ``position`` (the absolute index) over pos; attrs: the
        provenance, prompt, answer and alternative (ids and text), positions and edits.
    """
    prompt = check_prompts(prompt)[0] if isinstance(prompt, str) else _one_prompt(prompt)
    edits = check_edits(edits)
    positions = check_positions(list(positions))
    if not positions:
        raise InputError("`positions` must name at least one position; got none.")
    batch, _ = as_batch(model, [prompt])
    n = batch.lengths[0]
    absolute = [absolute_position(p, n) for p in positions]
    picked = "given"
    if answer is None or alternative is None:
        top = top_tokens(model, prompt, 3)
        picked = "top-1 and top-2 of the clean run" if answer is None and alternative is None \
            else "partly given; the rest from the clean run's top tokens"
    a_id = answer_token_id(model, answer) if answer is not None else top[0]
    if alternative is not None:
        b_id = answer_token_id(model, alternative, name="alternative")
    else:
        b_id = next(t for t in top if t != a_id)
    if a_id == b_id:
        raise InputError(f"`alternative` must differ from `answer`; both are token {a_id} "
                         f"{model.token_strings([a_id])[0]!r}.")

    clean, s_clean = _attribution(model, batch, a_id, b_id, positions, [])
    if edits:
        edited, s_edited = _attribution(model, batch, a_id, b_id, positions, edits)
        frozen = s_clean / s_edited                                  # [pos]
        for name in ("embed", "heads", "attn_bias", "mlp"):
            edited[name] = edited[name] * frozen.reshape((-1,) + (1,) * (edited[name].ndim - 1))
    else:
        edited = {k: v.copy() for k, v in clean.items()}
    stacked = {k: np.stack([clean[k], edited[k]]) for k in clean}
    total = sum(stacked[t].reshape(2, len(positions), -1).sum(-1) for t in TERMS)

    L, H = model.spec.n_layers, model.spec.n_heads
    a_text, b_text = model.token_strings([a_id, b_id])
    data = {
        "heads": (("run", "pos", "layer", "head"), stacked["heads"]),
        "mlp": (("run", "pos", "layer"), stacked["mlp"]),
        "attn_bias": (("run", "pos", "layer"), stacked["attn_bias"]),
        "embed": (("run", "pos"), stacked["embed"]),
        "norm_bias": (("run", "pos"), stacked["norm_bias"]),
        "total": (("run", "pos"), total),
        "logit_diff": (("run", "pos"), stacked["logit_diff"]),
    }
    coords = {
        "run": list(RUNS), "pos": np.array(positions), "layer": np.arange(L),
        "head": np.arange(H),
        "position": ("pos", np.array(absolute)),
        "token": ("pos", np.array([batch.tokens[0][q] for q in absolute], dtype=str)),
        "head_component": (("layer", "head"),
                           np.array([[str(components.head(la, h)) for h in range(H)]
                                     for la in range(L)], dtype=str)),
        "mlp_component": ("layer", np.array([str(components.mlp(la)) for la in range(L)],
                                            dtype=str)),
    }
    attrs = provenance(model, method="answer_logit_attribution", edits=edits, prompt=prompt,
                       answer_id=a_id, alternative_id=b_id, positions=positions,
                       norm="final norm frozen at the clean run", picked=picked)
    attrs.update(prompt=prompt, answer=a_text, alternative=b_text, answer_id=a_id,
                 alternative_id=b_id, n_tokens=n)
    return xr.Dataset(data, coords=coords, attrs=attrs)


def _one_prompt(prompt: Any) -> str:
    prompts = check_prompts(prompt)
    if len(prompts) != 1:
        raise InputError(f"`prompt` must be one prompt; got {len(prompts)}.")
    return prompts[0]


def _attribution(model: Model, batch: Any, a_id: int, b_id: int, positions: list[int],
                 edits: list[Edit]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """One run's answer-minus-alternative terms at ``positions`` (at the run's own final-norm
    scale) and that scale [pos]."""
    last = model.spec.n_layers - 1
    ds = read(model, batch, [DLA([[a_id, b_id]]), Save("resid_post")], edits=edits,
              positions=positions, progress=False)
    one = ds.isel(prompt=0)

    def diff(name: str) -> np.ndarray:
        v = one[name]
        return (v.isel(target=0) - v.isel(target=1)).values

    out = {"embed": diff("embed"), "heads": diff("heads"), "attn_bias": diff("attn_bias"),
           "mlp": diff("mlp"), "norm_bias": diff("norm_bias"), "logit_diff": diff("logit")}
    centred, eps = final_norm_kind(model)
    x = torch.from_numpy(np.asarray(one.resid_post.sel(layer=last).values, dtype=np.float64))
    if centred:                                                   # [pos, d_model]
        x = x - x.mean(-1, keepdim=True)
    scale = (1.0 / torch.sqrt(x.pow(2).mean(-1) + eps)).numpy()   # [pos]
    return out, scale
