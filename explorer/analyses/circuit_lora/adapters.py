"""LoRA adapters of the CircuitLoRA study: which linear modules get LoRA (`lora_modules`), what
a per-layer rank assignment costs in trainable parameters (`lora_parameter_count`), uniform
ranks and CircuitLoRA's allocation with higher ranks on critical layers
(`uniform_lora_ranks`, `allocate_lora_ranks`), and the adapted model (`lora_model`, a peft
model; `lora_weights_init`, the same adapter as hooked `explorer.lora.LoRAWeights`). Also
`CITATION` and the variants compared (`METHODS`).
"""
from __future__ import annotations

import copy
import re
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
import xarray as xr

from explorer._checks import InputError, check_int, check_local_weights
from explorer.lora import LoRAWeights
from explorer.models import Model
from explorer.trace import provenance

__all__ = [
    "CITATION",
    "METHODS",
    "lora_modules",
    "lora_parameter_count",
    "allocate_lora_ranks",
    "uniform_lora_ranks",
    "lora_model",
    "lora_weights_init",
]


CITATION = ("Wang, Hu, Du, Cheng, Wang & Zou, Towards Understanding Fine-Tuning Mechanisms "
            "of LLMs via Circuit Analysis (CircuitLoRA), ICML 2025")
METHODS = ("lora", "circuit-lora")

_ALPHA_PER_RANK = 2.0  # lora_alpha = 2 r: the same scale alpha / r for every rank

Progress = Callable[[int, int], None] | None


def lora_modules(model: Model) -> dict[int, list[tuple[str, int, int]]]:
    """The linear modules LoRA adapts in each layer: ``{layer: [(name, d_in, d_out), ...]}``.

    A dict of ragged lists: the adapter builders look a layer's modules up by layer.

    Every ``nn.Linear`` (and GPT-2 ``Conv1D``) inside a decoder layer: the attention
    projections and the MLP, as in the paper (qkv, attention output, both MLP matrices).
    ``name`` is the module's full name in ``model.hf``.
    """
    from transformers.pytorch_utils import Conv1D

    layers_path = model.arch.layers_path
    out: dict[int, list[tuple[str, int, int]]] = {}
    for layer in range(model.n_layers):
        mods = []
        for sub, mod in model.hf_layer(layer).named_modules():
            if isinstance(mod, torch.nn.Linear):
                mods.append((f"{layers_path}.{layer}.{sub}", mod.in_features, mod.out_features))
            elif isinstance(mod, Conv1D):  # weight [d_in, d_out]
                mods.append((f"{layers_path}.{layer}.{sub}", int(mod.weight.shape[0]),
                             int(mod.weight.shape[1])))
        out[layer] = mods
    return out


def _check_ranks(model: Model, ranks: Mapping[int, int] | Sequence[int]) -> dict[int, int]:
    if not isinstance(ranks, Mapping):
        ranks = dict(enumerate(ranks))
    out = {}
    for layer, r in ranks.items():
        layer = model.check_layer(layer, "ranks layer")
        out[layer] = check_int(f"ranks[{layer}]", r, low=0)
    if not any(out.values()):
        raise InputError("`ranks` must give at least one layer a rank >= 1; got all zeros.")
    return out


def lora_parameter_count(model: Model, ranks: Mapping[int, int] | Sequence[int]) -> int:
    """Trainable LoRA parameters of a per-layer rank assignment: sum of r (d_in + d_out)."""
    ranks = _check_ranks(model, ranks)
    mods = lora_modules(model)
    return int(sum(r * sum(i + o for _, i, o in mods[layer]) for layer, r in ranks.items()))


def uniform_lora_ranks(model: Model, rank: int) -> dict[int, int]:
    """The same rank on every layer (plain LoRA).

    A dict layer -> rank: the per-layer rank form that `lora_parameter_count` and the adapter
    builders take.
    """
    check_int("rank", rank, low=1)
    return {layer: rank for layer in range(model.n_layers)}


def allocate_lora_ranks(model: Model, n_params: int, critical: Sequence[int], *,
                        r_other: int = 2) -> xr.Dataset:
    """CircuitLoRA ranks: ``r_other`` outside the critical layers, the rest of a parameter
    budget spread over the critical layers, so the total hits ``n_params`` as closely as
    integer ranks allow (exactly when the budget is a whole number of rank units).

    The critical layers share the remaining budget as evenly as possible: all get the
    largest rank r_c that fits, then the layers in ``critical`` order get one more while
    the budget lasts. The achieved count never exceeds ``n_params``.

    Returns
    -------
    xr.Dataset
        ``rank`` (layer) and ``critical`` (layer, bool); attrs ``n_params_requested``,
        ``n_params`` (achieved), ``n_params_gap`` (requested - achieved), ``r_other``.
    """
    check_int("n_params", n_params, low=1)
    check_int("r_other", r_other, low=0)
    crit = [model.check_layer(c, "critical layer") for c in critical]
    if not crit:
        raise InputError("`critical` must name at least one layer; got none.")
    if len(set(crit)) != len(crit):
        raise InputError(f"`critical` must not repeat a layer; got {list(critical)}.")
    mods = lora_modules(model)
    unit = {layer: sum(i + o for _, i, o in m) for layer, m in mods.items()}  # params per rank
    ranks = {layer: (0 if layer in crit else r_other) for layer in range(model.n_layers)}
    budget = n_params - sum(r * unit[layer] for layer, r in ranks.items())
    if budget < sum(unit[c] for c in crit):
        need = sum(r * unit[layer] for layer, r in ranks.items()) + sum(unit[c] for c in crit)
        raise InputError(f"`n_params` must be at least {need} for r_other={r_other} and rank >= 1 "
                         f"on {len(crit)} critical layers; got {n_params}.")
    base = budget // sum(unit[c] for c in crit)
    for c in crit:
        ranks[c] = int(base)
    budget -= base * sum(unit[c] for c in crit)
    for c in crit:  # one more rank while the budget lasts
        if unit[c] <= budget:
            ranks[c] += 1
            budget -= unit[c]
    achieved = sum(r * unit[layer] for layer, r in ranks.items())
    layers = np.arange(model.n_layers)
    return xr.Dataset(
        {"rank": ("layer", np.array([ranks[int(l)] for l in layers])),
         "critical": ("layer", np.array([int(l) in crit for l in layers]))},
        coords={"layer": layers},
        attrs={**provenance(model, method="circuit-lora-ranks", critical=crit, r_other=r_other),
               "n_params_requested": int(n_params), "n_params": int(achieved),
               "n_params_gap": int(n_params - achieved), "r_other": int(r_other)})


def _lora_config(model: Model, ranks: Mapping[int, int], dropout: float = 0.0):
    from peft import LoraConfig

    mods = lora_modules(model)
    names = [n for layer, r in ranks.items() if r > 0 for n, _, _ in mods[layer]]
    rank_of = {n: r for layer, r in ranks.items() if r > 0 for n, _, _ in mods[layer]}
    r0 = max(rank_of.values())
    return LoraConfig(
        r=r0, lora_alpha=_ALPHA_PER_RANK * r0, lora_dropout=dropout, target_modules=names,
        rank_pattern={re.escape(n): r for n, r in rank_of.items()},
        alpha_pattern={re.escape(n): _ALPHA_PER_RANK * r for n, r in rank_of.items()},
        fan_in_fan_out=model.spec.family == "gpt2", bias="none")


def lora_model(model: Model, ranks: Mapping[int, int] | Sequence[int], *, seed: int = 0):
    """A peft LoRA model on a deep copy of ``model.hf`` (the shared model is never touched).

    Only the LoRA matrices are trainable; B starts at zero, so the output equals the base
    model's until training. ``seed`` seeds the init of the A matrices.
    """
    from peft import get_peft_model

    check_local_weights(model, "LoRA fine-tuning")
    ranks = _check_ranks(model, ranks)
    hf = copy.deepcopy(model.hf)
    hf.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(hf, _lora_config(model, ranks))
    return peft_model


def lora_weights_init(model: Model, ranks: Mapping[int, int] | Sequence[int], *,
                      seed: int = 0) -> LoRAWeights:
    """The starting adapters of `lora_model` (same modules, ranks, scales and draws) as
    hook-applied `LoRAWeights`, without copying the model (a remote model's path)."""
    ranks = _check_ranks(model, ranks)
    mods = lora_modules(model)
    spec = [(name, d_in, d_out, ranks[layer], _ALPHA_PER_RANK * ranks[layer])
            for layer in sorted(ranks) if ranks[layer] > 0 for name, d_in, d_out in mods[layer]]
    return LoRAWeights.init(spec, seed=seed, transposed=model.spec.family == "gpt2")
