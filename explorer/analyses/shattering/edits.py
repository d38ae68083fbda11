"""Knowledge edits: ROME's closed-form rank-one update at one MLP (`rome_update`, `rome_edit`),
MEMIT's least-squares update of one or several facts over several blocks (`memit_update`,
`memit_edits`, `memit_edit`), fine-tuning one MLP (`finetune_edit`), the counterfactual edit
by distance (`counterfactual_target`, `edit_fact`) and the edited copy of the model
(`edited_model`).
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from explorer._checks import InputError, check_choice, check_float, check_int
from explorer.analyses.shattering.graph import KnowledgeGraph, random_walks
from explorer.analyses.shattering.model import KnowledgeGPT, KnowledgeModel

__all__ = [
    "EDIT_METHODS",
    "key_covariance",
    "rome_update",
    "memit_update",
    "KnowledgeEdit",
    "counterfactual_target",
    "rome_edit",
    "memit_edits",
    "memit_edit",
    "finetune_edit",
    "edit_fact",
    "edited_model",
]


def key_covariance(km: KnowledgeModel, layer: int, *, n_walks: int = 2000, seed: int = 0) -> torch.Tensor:
    """Second moment ``C = E[k k^T]`` of block ``layer``'s MLP keys over random walks.

    ROME's covariance over "generic text"; here every position of ``n_walks`` fresh walks.
    """
    layer = check_int("layer", layer, low=0, high=km.n_layers - 1)
    n_walks = check_int("n_walks", n_walks, low=1)
    walks = torch.as_tensor(random_walks(km.graph, n_walks, km.params["walk_length"],
                                         rng=np.random.default_rng(seed + 12345)))
    with torch.no_grad():
        keys = km.model.mlp_keys(walks, layer).reshape(-1, km.model.config["d_mlp"]).double()
    return keys.T @ keys / keys.shape[0]                                    # [d_mlp, d_mlp]


def rome_update(weight: torch.Tensor, cov: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """ROME's rank-one change ``Δ`` with ``(W + Δ) k* = v*``, minimising ``Δ`` in the C-norm.

    ``Δ = (v* - W k*) (C^{-1} k*)^T / ((C^{-1} k*)^T k*)`` (Meng et al., NeurIPS 2022, eq. 2).
    Keys ``k`` with ``(C^{-1} k*)^T k = 0`` are mapped as before.

    Parameters
    ----------
    weight : torch.Tensor, shape (d_out, d_in)
    cov : torch.Tensor, shape (d_in, d_in)
        Key second moment (symmetric positive definite).
    key, value : torch.Tensor, shapes (d_in,), (d_out,)
    """
    if weight.ndim != 2 or cov.shape != (weight.shape[1], weight.shape[1]) \
            or key.shape != (weight.shape[1],) or value.shape != (weight.shape[0],):
        raise InputError(f"shapes must be W (d_out, d_in), C (d_in, d_in), k (d_in,), v (d_out,); got "
                         f"{tuple(weight.shape)}, {tuple(cov.shape)}, {tuple(key.shape)}, {tuple(value.shape)}.")
    w, c, k, v = (t.double() for t in (weight, cov, key, value))
    u = torch.linalg.solve(c, k)                                            # C^{-1} k*
    denom = u @ k
    if not torch.isfinite(denom) or denom <= 0:
        raise InputError("the key covariance is singular along the edited key; ROME is undefined.")
    return (torch.outer(v - w @ k, u) / denom).to(weight.dtype)


@dataclass
class KnowledgeEdit:
    """One edit: new object for ``(entity, relation)`` and the parameter changes that make it."""

    entity: int
    relation: int
    true_object: int
    new_object: int
    distance: int
    method: str
    layer: int
    delta: dict[str, torch.Tensor]
    info: dict[str, Any] = field(default_factory=dict)


def counterfactual_target(graph: KnowledgeGraph, entity: int, relation: int, distance: int) -> int:
    """The entity ``distance`` steps (clockwise) from the true object, on the relation's cycle."""
    n = graph.n_entities
    entity = check_int("entity", entity, low=0, high=n - 1)
    relation = check_int("relation", relation, low=0, high=graph.n_relations - 1)
    distance = check_int("distance", distance, low=1, high=n - 1)
    o, _ = graph.relations[relation]
    return graph.step(int(graph.objects()[entity, relation]), o, distance)


def _target_value(km: KnowledgeModel, layer: int, prompt: torch.Tensor, target: int, *, pos: int,
                  steps: int = 100, lr: float = 0.5, l2: float = 0.01) -> tuple[torch.Tensor, float]:
    """ROME's v*: the MLP output at position ``pos`` that makes ``target`` the next token.

    Optimises an additive change δ to the MLP output at that position for
    ``-log p(target) + l2 ||δ||² / ||v0||²``, with Adam (ROME's learning rate, 0.5).
    """
    model = km.model
    d = model.config["d_model"]
    delta = torch.zeros(d, requires_grad=True)
    opt = torch.optim.Adam([delta], lr=lr)
    with torch.no_grad():
        v0 = model.blocks[layer].mlp["proj"](model.mlp_keys(prompt, layer))[0, pos]
    scale = float(v0.norm() ** 2) + 1e-8
    for _ in range(steps):
        logits = model(prompt, mlp_delta=(layer, pos, delta))[0, -1, :km.graph.n_entities]
        logp = torch.log_softmax(logits, -1)[target]
        loss = -logp + l2 * (delta @ delta) / scale
        opt.zero_grad()
        loss.backward()
        opt.step()
        if logp.item() > math.log(0.99):
            break
    return (v0 + delta.detach()), math.exp(logp.item())


def rome_edit(km: KnowledgeModel, entity: int, relation: int, new_object: int, *, layer: int = 0,
              cov: torch.Tensor | None = None, steps: int = 100, position: str = "last") -> KnowledgeEdit:
    """ROME at block ``layer``'s MLP output projection: ``e r -> new_object``.

    The key k* is the MLP's hidden activation in the prompt ``e r`` at the relation token
    (``position="last"``, the default) or at the entity (``"subject"``, ROME's choice for
    multi-token subjects); v* comes from `_target_value`; the update is `rome_update`.
    In the two-token prompt the subject's MLP output reaches the answer only through one
    attention read in the next block, which here cannot carry a new object (the best v*
    found gives it p ~ 0.1); after the first block's attention, the relation token's key
    holds both the entity and the relation, and an edit there succeeds.
    """
    layer = check_int("layer", layer, low=0, high=km.n_layers - 1)
    check_choice("position", position, ["last", "subject"])
    pos = 1 if position == "last" else 0
    prompt = torch.tensor([[entity, km.graph.n_entities + relation]])
    cov = key_covariance(km, layer) if cov is None else cov
    with torch.enable_grad():
        value, p_opt = _target_value(km, layer, prompt, new_object, pos=pos, steps=steps)
    with torch.no_grad():
        key = km.model.mlp_keys(prompt, layer)[0, pos]
        proj = km.model.blocks[layer].mlp["proj"]
        # The layer computes W k + b: W must map k* to v* - b.
        delta = rome_update(proj.weight, cov, key, value - proj.bias)
    return KnowledgeEdit(entity, relation, -1, new_object, 0, "rome", layer,
                         {f"blocks.{layer}.mlp.proj.weight": delta},
                         {"p_target_at_value": p_opt, "key": key, "value": value, "position": position})


def finetune_edit(km: KnowledgeModel, entity: int, relation: int, new_object: int, *, layer: int = 0,
                  steps: int = 100, lr: float = 2e-3) -> KnowledgeEdit:
    """Fine-tune block ``layer``'s MLP (both matrices and biases) on ``e r -> new_object``.

    Adam on the cross-entropy of the new object for at most ``steps`` steps (stops once its
    probability passes 0.99); every other parameter stays frozen.
    """
    layer = check_int("layer", layer, low=0, high=km.n_layers - 1)
    steps = check_int("steps", steps, low=1)
    lr = check_float("lr", lr, low=0.0)
    model = copy.deepcopy(km.model)
    mlp = model.blocks[layer].mlp
    for par in model.parameters():
        par.requires_grad_(False)
    names = [f"blocks.{layer}.mlp.{n}" for n, _ in mlp.named_parameters()]
    for par in mlp.parameters():
        par.requires_grad_(True)
    opt = torch.optim.Adam(mlp.parameters(), lr=lr)
    prompt = torch.tensor([[entity, km.graph.n_entities + relation]])
    target = torch.tensor([new_object])
    p = 0.0
    with torch.enable_grad():
        for _ in range(steps):
            logits = model(prompt)[:, -1, :km.graph.n_entities]
            loss = nn.functional.cross_entropy(logits, target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            p = math.exp(-loss.item())
            if p > 0.99:
                break
    before = dict(km.model.named_parameters())
    after = dict(model.named_parameters())
    delta = {n: (after[n] - before[n]).detach() for n in names}
    return KnowledgeEdit(entity, relation, -1, new_object, 0, "finetune", layer, delta,
                         {"p_target_before_last_step": p})


def memit_update(cov: torch.Tensor, keys: torch.Tensor, residuals: torch.Tensor) -> torch.Tensor:
    """MEMIT's least-squares change of one layer: ``Δ = R K^T (C + K K^T)^{-1}``.

    ``Δ`` minimises ``||Δ K - R||_F² + tr(Δ C Δ^T)``: it writes the residuals ``R`` on the
    edited keys ``K`` while staying small on the keys the layer usually sees (C-norm)
    (Meng et al., ICLR 2023, eq. 14). By the Woodbury identity
    ``Δ = R (I + K^T C^{-1} K)^{-1} K^T C^{-1}``, so keys ``x`` with ``K^T C^{-1} x = 0``
    (C^{-1}-orthogonal to every edited key) are mapped as before, and for one key
    ``Δ k = r s / (1 + s)`` with ``s = k^T C^{-1} k``.

    Parameters
    ----------
    cov : torch.Tensor, shape (d_in, d_in)
        Key second moment C (symmetric positive definite).
    keys : torch.Tensor, shape (d_in, n_edits)
        Edited keys K, one column per edit (``n_edits`` may be 0).
    residuals : torch.Tensor, shape (d_out, n_edits)
        What the layer's output must gain on each key, R.

    Returns
    -------
    torch.Tensor, shape (d_out, d_in), float64
    """
    if cov.ndim != 2 or cov.shape[0] != cov.shape[1] or keys.ndim != 2 or residuals.ndim != 2 \
            or keys.shape[0] != cov.shape[0] or residuals.shape[1] != keys.shape[1]:
        raise InputError(f"shapes must be C (d_in, d_in), K (d_in, n_edits), R (d_out, n_edits); got "
                         f"{tuple(cov.shape)}, {tuple(keys.shape)}, {tuple(residuals.shape)}.")
    c, k, r = (t.double() for t in (cov, keys, residuals))
    if k.shape[1] == 0:
        return torch.zeros(r.shape[0], c.shape[0], dtype=torch.float64)
    # Δ (C + K K^T) = R K^T; C + K K^T is symmetric, so solve for Δ^T.
    return torch.linalg.solve(c + k @ k.T, k @ r.T).T


def memit_edits(km: KnowledgeModel, requests: Sequence[tuple[int, int, int]], *, layer: int | None = None,
                layers: Sequence[int] | None = None, covs: dict[int, torch.Tensor] | None = None,
                steps: int = 100, position: str = "last") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """MEMIT (Meng et al., ICLR 2023): several facts ``(entity, relation, new_object)`` at once.

    A tuple: the weight changes and the info on how they were found are different kinds of value.

    1. For each fact, the target residual ``z_i = h_i^L + δ_i`` after the last critical block
       ``L`` (``layer``, default the last of ``layers``) at the key position, ``δ_i`` found as
       ROME's v* (`_target_value`: an additive change to block L's output there).
    2. For each block ``l`` of ``layers`` in increasing order, on the model edited so far: the
       keys ``K_l`` at that block's MLP, the remaining residuals ``r_i = z_i - h_i^L``, and
       the change ``Δ_l = R_l K_l^T (C_l + K_l K_l^T)^{-1}`` to its MLP output projection, with
       ``R_l = r / (number of blocks left, this one included)`` (`memit_update`).

    ``layers`` defaults to all blocks up to ``layer``; ``C_l`` is `key_covariance` of the
    unedited model (pass ``covs`` to reuse them). Returns the parameter changes (one entry
    per block of ``layers``, zero for no requests) and info (keys, targets, p at z, layers).
    """
    n_layers = km.n_layers
    if layers is None:
        top = n_layers - 1 if layer is None else check_int("layer", layer, low=0, high=n_layers - 1)
        layers = list(range(top + 1))
    layers = sorted({check_int("layers[i]", l, low=0, high=n_layers - 1) for l in layers})
    if not layers:
        raise InputError("`layers` must name at least one block; got none.")
    critical = layers[-1] if layer is None else check_int("layer", layer, low=0, high=n_layers - 1)
    if critical < layers[-1]:
        raise InputError(f"`layer` (the last critical block) must be >= every edited block; got {critical} "
                         f"with layers {layers}.")
    check_choice("position", position, ["last", "subject"])
    pos = 1 if position == "last" else 0
    n, n_rel = km.graph.n_entities, km.graph.n_relations
    for i, (e, r, t) in enumerate(requests):
        check_int(f"requests[{i}] entity", e, low=0, high=n - 1)
        check_int(f"requests[{i}] relation", r, low=0, high=n_rel - 1)
        check_int(f"requests[{i}] new object", t, low=0, high=n - 1)
    names = [f"blocks.{l}.mlp.proj.weight" for l in layers]
    delta = {name: torch.zeros_like(dict(km.model.named_parameters())[name]) for name in names}
    info: dict[str, Any] = {"layers": layers, "critical_layer": critical, "position": position,
                            "p_target_at_z": [], "targets": None}
    if not requests:
        return delta, info
    covs = {} if covs is None else dict(covs)
    for l in layers:
        if l not in covs:
            covs[l] = key_covariance(km, l)
    prompts = torch.tensor([[e, n + r] for e, r, _ in requests])             # [edit, 2]
    targets = []
    with torch.enable_grad():
        for i, (_, _, t) in enumerate(requests):
            value, p_opt = _target_value(km, critical, prompts[i:i + 1], int(t), pos=pos, steps=steps)
            with torch.no_grad():
                v0 = km.model.blocks[critical].mlp["proj"](km.model.mlp_keys(prompts[i:i + 1], critical))[0, pos]
            targets.append(value - v0)                                       # δ_i
            info["p_target_at_z"].append(p_opt)
    with torch.no_grad():
        z = km.model(prompts, resid_layer=critical)[:, pos].double() + torch.stack(targets).double()  # [edit, d_model]
        model = copy.deepcopy(km.model)
        for j, l in enumerate(layers):
            keys = model.mlp_keys(prompts, l)[:, pos].double()                # [edit, d_mlp]
            resid = z - model(prompts, resid_layer=critical)[:, pos].double()  # [edit, d_model]
            step = memit_update(covs[l], keys.T, resid.T / (len(layers) - j))
            proj = model.blocks[l].mlp["proj"]
            proj.weight.add_(step.to(proj.weight.dtype))
            delta[names[j]] = proj.weight.detach() - km.model.blocks[l].mlp["proj"].weight.detach()
        info["targets"] = z
        info["final_residual_norm"] = float((z - model(prompts, resid_layer=critical)[:, pos].double()).norm())
    return delta, info


def memit_edit(km: KnowledgeModel, entity: int, relation: int, new_object: int, *, layer: int = 0,
               layers: Sequence[int] | None = None, cov: torch.Tensor | dict[int, torch.Tensor] | None = None,
               steps: int = 100, position: str = "last") -> KnowledgeEdit:
    """MEMIT for one fact: `memit_edits` over ``layers`` (default: blocks 0..layer), with the
    critical block ``layer`` or the last of ``layers``, whichever is later.
    ``cov``: one tensor (one block) or a dict by block."""
    layer = check_int("layer", layer, low=0, high=km.n_layers - 1)
    if layers is not None:
        layers = [check_int("layers[i]", l, low=0, high=km.n_layers - 1) for l in layers]
        layer = max([layer, *layers])
    covs = cov
    if isinstance(cov, torch.Tensor):
        blocks = sorted(set(range(layer + 1) if layers is None else layers))
        if len(blocks) != 1:
            raise InputError(f"MEMIT over blocks {blocks} needs `cov` as a dict by block; got one tensor.")
        covs = {blocks[0]: cov}
    delta, info = memit_edits(km, [(entity, relation, new_object)], layer=layer, layers=layers, covs=covs,
                              steps=steps, position=position)
    return KnowledgeEdit(entity, relation, -1, new_object, 0, "memit", layer, delta, info)


#: Edit methods by name: ``method(km, entity, relation, new_object, layer=...)``.
EDIT_METHODS: dict[str, Callable[..., KnowledgeEdit]] = {"rome": rome_edit, "memit": memit_edit,
                                                          "finetune": finetune_edit}


def edit_fact(km: KnowledgeModel, entity: int, relation: int, distance: int, *, method: str = "rome",
              layer: int = 0, cov: torch.Tensor | dict[int, torch.Tensor] | None = None,
              layers: Sequence[int] | None = None) -> KnowledgeEdit:
    """A counterfactual edit: ``e r`` now points ``distance`` steps past its true object.

    ``layer`` is the edited block (ROME, fine-tuning) or MEMIT's last critical block;
    ``layers`` (MEMIT only) the blocks MEMIT spreads the edit over (default 0..layer).
    ``cov``: the key covariance (ROME), or a dict of them by block (MEMIT).
    """
    check_choice("method", method, EDIT_METHODS)
    graph = km.graph
    entity = check_int("entity", entity, low=0, high=graph.n_entities - 1)
    relation = check_int("relation", relation, low=0, high=graph.n_relations - 1)
    distance = check_int("distance", distance, low=1, high=graph.n_entities - 1)
    layer = check_int("layer", layer, low=0, high=km.n_layers - 1)
    new = counterfactual_target(graph, entity, relation, distance)
    if layers is not None and method != "memit":
        raise InputError(f"`layers` is for method 'memit' only; got method {method!r}.")
    kwargs: dict[str, Any] = {"cov": cov} if method in ("rome", "memit") else {}
    if method == "memit":
        kwargs["layers"] = layers
    edit = EDIT_METHODS[method](km, entity, relation, new, layer=layer, **kwargs)
    edit.true_object = int(graph.objects()[entity, relation])
    edit.distance = distance
    return edit


def edited_model(km: KnowledgeModel, edit: KnowledgeEdit, strength: float = 1.0) -> KnowledgeGPT:
    """A copy of the model with ``strength`` times the edit's parameter changes added."""
    strength = check_float("strength", strength)
    model = copy.deepcopy(km.model)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, delta in edit.delta.items():
            params[name].add_(strength * delta)
    return model
