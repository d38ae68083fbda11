"""Components of a localization: attention heads (``L17.H3``) and MLPs (``L17.MLP``).

Guo et al. (ICML 2025) localize over attention heads and MLPs: output tracing (causal
tracing, attribution patching) scores every component, and the top ones by absolute score
are taken until their parameters match the fact-lookup budget (their
``get_top_components_no_subcomponents*``). This module names the components
(`component_names`), says which parameter entries each one owns (`component_masks`: an MLP
owns its whole gate / up / down matrices; a head owns its rows of ``q_proj`` (and of the
bias if any) and its columns of ``o_proj``: the entries no other head reads or writes),
counts them (`component_parameter_count`) and picks components for a budget
(`top_components`, `localized_components`).

Keys and values of a head are shared by the query heads of a group under grouped-query
attention (SmolLM2-135M: 9 query heads, 3 key/value heads), so they belong to no single
head and a head component leaves them untouched.
"""
from __future__ import annotations

import random
import re
from collections.abc import Sequence

import numpy as np
import torch
import xarray as xr

from explorer._checks import InputError, check_choice, check_int
from explorer.analyses.unlearning.facts import METHODS
from explorer.analyses.unlearning.probe import fact_lookup_layers
from explorer.models import Model, submodule_at

__all__ = ["component_names", "parse_component", "component_masks", "component_parameter_count",
           "mlp_budget", "top_components", "component_scores", "localized_components",
           "component_label", "top_layers"]

_NAME = re.compile(r"^L(\d+)\.(MLP|H(\d+))$")


def component_names(model: Model, *, heads: bool = True) -> list[str]:
    """Every component in layer order: the heads of a layer, then its MLP."""
    out = []
    for layer in range(model.n_layers):
        if heads:
            out += [f"L{layer}.H{h}" for h in range(model.spec.n_heads)]
        out.append(f"L{layer}.MLP")
    return out


def parse_component(model: Model, name: str) -> tuple[int, int | None]:
    """(layer, head) of ``"L3.H1"``; (layer, None) of ``"L3.MLP"``.

    A tuple: (layer, head), as a component's address is.
    """
    m = _NAME.match(str(name))
    if m is None:
        raise InputError(f"component {name!r} is not a head ('L3.H1') or an MLP ('L3.MLP').")
    layer = int(m.group(1))
    if layer >= model.n_layers:
        raise InputError(f"component {name!r}: layer must be in [0, {model.n_layers - 1}]; got {layer}.")
    if m.group(3) is None:
        return layer, None
    head = int(m.group(3))
    if head >= model.spec.n_heads:
        raise InputError(f"component {name!r}: head must be in [0, {model.spec.n_heads - 1}]; "
                         f"got {head}.")
    return layer, head


def _named(model: Model, hf: torch.nn.Module | None = None) -> dict[int, str]:
    hf = model.hf if hf is None else hf
    return {id(p): n for n, p in hf.named_parameters()}


def _head_modules(model: Model, layer: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(q_proj, o_proj) of a layer: a separate query projection and an output projection
    laid out as ``nn.Linear`` ([out, in]); other layouts have no per-head slices here."""
    paths = model.arch.qkv_paths
    block = model.hf_layer(layer)
    if len(paths) != 3 or model.arch.o_proj_transposed:
        raise InputError(f"{model.spec.family} models fuse the query, key and value projections "
                         "(or store the output projection transposed); head components need "
                         "separate q_proj / o_proj linear maps. Use the MLP localizations.")
    q = submodule_at(block, paths[0])
    o = model.o_proj(layer)
    if not isinstance(q, torch.nn.Linear) or not isinstance(o, torch.nn.Linear):
        raise InputError(f"{model.spec.family} attention projections are not nn.Linear; head "
                         "components need them. Use the MLP localizations.")
    return q, o


def component_masks(model: Model, components: Sequence[str]) -> dict[str, torch.Tensor | None]:
    """Parameter name -> the entries the components own: None for a whole tensor (an MLP's
    matrices and biases), else a boolean mask of the tensor's shape (the union of the
    chosen heads' ``q_proj`` rows and ``o_proj`` columns in that layer).

    A dict keyed by parameter name: the masks differ in shape, and the masked update looks them
    up by name.
    """
    names = _named(model)
    out: dict[str, torch.Tensor | None] = {}
    dh = model.spec.d_head
    for comp in components:
        layer, head = parse_component(model, comp)
        if head is None:
            mlp = submodule_at(model.hf_layer(layer), model.arch.mlp_path)
            for p in mlp.parameters():
                out[names[id(p)]] = None
            continue
        q, o = _head_modules(model, layer)
        rows = slice(head * dh, (head + 1) * dh)
        for param, index in ((q.weight, (rows, slice(None))), (q.bias, (rows,)),
                             (o.weight, (slice(None), rows))):
            if param is None:
                continue
            name = names[id(param)]
            if name in out and out[name] is None:
                continue
            mask = out.get(name)
            if mask is None:
                mask = torch.zeros(param.shape, dtype=torch.bool)
            mask[index] = True
            out[name] = mask
    return out


def component_parameter_count(model: Model, component: str) -> int:
    """Number of parameter entries one component owns (see `component_masks`)."""
    masks = component_masks(model, [component])
    params = dict(model.hf.named_parameters())
    return int(sum(params[n].numel() if m is None else int(m.sum()) for n, m in masks.items()))


def mlp_budget(model: Model, n_layers: int) -> int:
    """The parameter budget of ``n_layers`` MLP layers (every localization gets it)."""
    n_layers = check_int("n_layers", n_layers, low=1, high=model.n_layers)
    return n_layers * component_parameter_count(model, "L0.MLP")


def top_components(model: Model, scores: xr.DataArray | dict[str, float], budget: int) -> list[str]:
    """Components by descending absolute score, taken until their parameters reach ``budget``
    (the last one taken may pass it, as in Guo et al.'s ``param_count`` selection); returned
    in layer order (heads before the MLP of a layer)."""
    if isinstance(scores, xr.DataArray):
        scores = dict(zip(scores["component"].values.tolist(), scores.values.tolist()))
    budget = check_int("budget", budget, low=1)
    order = sorted(scores, key=lambda c: -abs(float(scores[c])))  # stable: ties keep order
    chosen, spent = [], 0
    sizes: dict[str, int] = {}
    for comp in order:
        if spent >= budget:
            break
        kind = "MLP" if comp.endswith("MLP") else "head"
        if kind not in sizes:
            sizes[kind] = component_parameter_count(model, comp)
        chosen.append(comp)
        spent += sizes[kind]
    rank = {c: i for i, c in enumerate(component_names(model))}
    return sorted(chosen, key=lambda c: rank[c])


def component_label(components: Sequence[str]) -> str:
    """A short label: the MLP layers, then the heads by layer, e.g.
    ``"MLP 0,6; 12 heads in L3-L29"``."""
    mlps = [int(c[1:].split(".")[0]) for c in components if c.endswith("MLP")]
    heads = [int(c[1:].split(".")[0]) for c in components if not c.endswith("MLP")]
    parts = []
    if mlps:
        parts.append("MLP " + ",".join(map(str, mlps)))
    if heads:
        span = f"L{min(heads)}" if min(heads) == max(heads) else f"L{min(heads)}-L{max(heads)}"
        parts.append(f"{len(heads)} head{'s' if len(heads) != 1 else ''} in {span}")
    return "; ".join(parts) or "-"


def localized_components(model: Model, method: str, n_layers: int, *,
                         probe: xr.Dataset | None = None, trace: xr.Dataset | None = None,
                         attribution: xr.Dataset | None = None, seed: int = 0) -> list[str]:
    """The components a localization trains for a budget of ``n_layers`` MLP layers.

    ``fact_lookup``: the MLP layers of the probe's steepest rise (`fact_lookup_layers`).
    ``causal_tracing`` / ``attribution_patching``: heads and MLPs by the absolute mean
    effect over the facts (``restore_head`` / ``restore_mlp`` minus ``p_corrupt``; ``ap_head``
    / ``ap_mlp``), taken until the parameters reach the fact-lookup budget (`top_components`).
    ``causal_tracing_mlp`` / ``attribution_patching_mlp``: the top ``n_layers`` MLPs alone.
    ``random``: seeded MLP layers; ``all``: every MLP (method ``all`` trains every parameter).
    """
    check_choice("method", method, METHODS)
    n_layers = check_int("n_layers", n_layers, low=1, high=model.n_layers)
    if method in ("causal_tracing", "attribution_patching"):
        data = trace if method == "causal_tracing" else attribution
        if data is None:
            arg = "trace" if method == "causal_tracing" else "attribution"
            raise InputError(f"method {method!r} needs the `{arg}` dataset.")
        return top_components(model, component_scores(data), mlp_budget(model, n_layers))
    return [f"L{x}.MLP" for x in _mlp_layers(model, method, n_layers, probe=probe, trace=trace,
                                             attribution=attribution, seed=seed)]


def component_scores(data: xr.Dataset) -> xr.DataArray:
    """Mean score over the facts per component (dim ``component``, names as
    `component_names`): for a causal trace the restore effect p(restored) - p(corrupted)
    of every head and MLP, for attribution patching its head and MLP scores."""
    if "restore_head" in data:
        head = (data.restore_head - data.p_corrupt).mean("fact")     # [layer, head]
        mlp = (data.restore_mlp - data.p_corrupt).mean("fact")       # [layer]
    elif "ap_head" in data:
        head, mlp = data.ap_head.mean("fact"), data.ap_mlp.mean("fact")
    else:
        raise InputError("component scores need a causal trace with `restore_head` or an "
                         "attribution with `ap_head` (heads=True when computing them).")
    names, values = [], []
    for li, layer in enumerate(mlp["layer"].values.tolist()):
        for hi, h in enumerate(head["head"].values.tolist()):
            names.append(f"L{layer}.H{h}")
            values.append(float(head.values[li, hi]))
        names.append(f"L{layer}.MLP")
        values.append(float(mlp.values[li]))
    return xr.DataArray(np.array(values), dims="component", coords={"component": names})


def top_layers(scores: Sequence[float], n_layers: int) -> list[int]:
    """The ``n_layers`` layers with the highest scores, in layer order."""
    scores = np.asarray(scores, dtype=float)
    n_layers = check_int("n_layers", n_layers, low=1, high=len(scores))
    return sorted(int(i) for i in np.argsort(-scores, kind="stable")[:n_layers])


def _mlp_layers(model: Model, method: str, n_layers: int, *, probe: xr.Dataset | None,
                trace: xr.Dataset | None, attribution: xr.Dataset | None, seed: int) -> list[int]:
    """`localization.localized_layers` of the methods that pick whole MLP layers only."""
    check_choice("method", method, METHODS)
    L = model.n_layers
    n_layers = check_int("n_layers", n_layers, low=1, high=L)
    method = {"causal_tracing": "causal_tracing_mlp",
              "attribution_patching": "attribution_patching_mlp"}.get(method, method)
    needs = {"fact_lookup": ("probe", probe), "causal_tracing_mlp": ("trace", trace),
             "attribution_patching_mlp": ("attribution", attribution)}
    if method in needs and needs[method][1] is None:
        raise InputError(f"method {method!r} needs the `{needs[method][0]}` dataset.")
    if method == "fact_lookup":
        return fact_lookup_layers(probe, n_layers)
    if method == "causal_tracing_mlp":
        return top_layers(trace.restore_mlp.mean("fact").values, n_layers)
    if method == "attribution_patching_mlp":
        return top_layers(attribution.ap_mlp.mean("fact").values, n_layers)
    if method == "random":
        return sorted(random.Random(seed).sample(range(L), n_layers))
    return list(range(L))
