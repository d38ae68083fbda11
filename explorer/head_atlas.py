"""The head atlas: every per-head score a session has computed, as one [layer, head] Dataset.

`head_atlas` takes the results the caller already has (the Datasets the analyses return) and
turns each into [layer, head] scores: variables that already are [layer, head] (induction and
FV scores of ``icl_heads``, context / memory scores of ``conflicts``, ...), the mean ablation
effect of ``head_context_memory_scores``, the edge mass in and out of every head of an EAP
edge-score Dataset (``circuits.edge_scores``), and three attention statistics of a trace with
``attn_pattern`` (the Attention page's), and the clean (and edited) direct logit
attribution of `explorer.analyses.answer_dla` (``dla``, ``dla_edited``). Each variable keeps its provenance in its attrs
(``method``, ``params`` as JSON, ``model``, ``source``: which variable, reduced how).
Nothing here imports an analysis: the conversions read only the Datasets' names and attrs.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

import numpy as np
import pandas as pd
import xarray as xr

from . import components as comp
from ._checks import InputError

__all__ = ["head_atlas", "atlas_table", "attention_head_scores", "edge_mass", "head_scores_of",
           "KNOWN_SCORES"]

KNOWN_SCORES: dict[str, tuple[str, str]] = {
    "induction_score": ("induction_scores", "attention on the token after the previous "
                        "occurrence of the current token (Yin & Steinhardt, ICML 2025)"),
    "fv_score": ("fv_scores", "mean indirect effect on the answer of patching the head's "
                 "task-mean output (function vectors, Todd et al., ICLR 2024)"),
    "memory_score": ("head_context_memory_scores", "mean positive part of the direct "
                     "memory-minus-context logit difference (JuICE, ICML 2025)"),
    "context_score": ("head_context_memory_scores", "mean positive part of the direct "
                      "context-minus-memory logit difference (JuICE, ICML 2025)"),
}
"""Per-head variables the analyses return: name -> (method, what it measures). Used when a
merged Dataset lost its ``method`` attr (e.g. the ICL-heads page merges two results)."""

_SAFE = re.compile(r"[^A-Za-z0-9_]+")


def _grid(da: xr.DataArray) -> xr.DataArray:
    return da.transpose("layer", "head").astype(np.float64)


def _provenance(ds: xr.Dataset, *, method: str | None = None, source: str, doc: str = "") -> dict:
    params = ds.attrs.get("params", {})
    out = {"method": method or str(ds.attrs.get("method", "unknown")),
           "model": str(ds.attrs.get("model", "")),
           "params": params if isinstance(params, str) else json.dumps(params, default=str),
           "source": source}
    if doc:
        out["description"] = doc
    edits = ds.attrs.get("edits")
    if isinstance(edits, str):
        edits = json.loads(edits) if edits.strip() else []
    if edits:                                  # computed on an edited model: said with the score
        out["edits"] = json.dumps(edits, default=str)
        labels = ds.attrs.get("workspace_edits")
        if labels:
            out["edit_labels"] = "; ".join(str(t) for t in labels)
    if ds.attrs.get("citation"):
        out["citation"] = str(ds.attrs["citation"])
    return out


def edge_mass(scores: xr.Dataset, n_layers: int, n_heads: int) -> tuple[np.ndarray, np.ndarray]:
    """(in, out) edge mass [layer, head] of an edge-score Dataset: the sum of |score| over the
    edges whose destination (in) or source (out) is the head. Nodes other than heads (MLPs,
    input, logits) are skipped; node names may use any `explorer.components` spelling."""
    src = [comp.parse(str(s)) for s in scores["src"].values]
    dst = [comp.parse(str(t)) for t in scores["dst"].values]
    w = np.abs(np.asarray(scores["score"].values, dtype=np.float64))
    w = np.nan_to_num(w)
    inflow = np.zeros((n_layers, n_heads))
    outflow = np.zeros((n_layers, n_heads))
    src_l = np.array([c.layer if c.is_head else -1 for c in src])
    src_h = np.array([c.head if c.is_head else -1 for c in src])
    dst_l = np.array([c.layer if c.is_head else -1 for c in dst])
    dst_h = np.array([c.head if c.is_head else -1 for c in dst])
    for ls, hs, target in ((src_l, src_h, outflow), (dst_l, dst_h, inflow)):
        keep = (ls >= 0) & (ls < n_layers) & (hs >= 0) & (hs < n_heads)
        np.add.at(target, (ls[keep], hs[keep]), w[keep])
    return inflow, outflow


def attention_head_scores(trace: xr.Dataset) -> dict[str, np.ndarray]:
    """Three statistics [layer, head] of a trace's ``attn_pattern``, averaged over the queries
    after the first token of every prompt (real tokens only): ``first_token_attention`` (weight
    on the first token, the attention sink), ``previous_token_attention`` (weight on the token
    before the query) and ``attention_entropy`` (nats). Prompts of one token are skipped."""
    pats = trace["attn_pattern"].transpose("prompt", "layer", "head", "dst_pos", "src_pos")
    mask = trace["mask"].values
    sums = {k: 0.0 for k in ("first", "prev", "entropy")}
    count = 0
    for p in range(pats.sizes["prompt"]):
        n = int(mask[p].sum())
        if n < 2:
            continue
        a = np.asarray(pats.values[p, :, :, 1:n, :n], dtype=np.float64)   # [layer, head, q, k]
        q = np.arange(1, n)
        sums["first"] = sums["first"] + a[..., 0].sum(-1)
        sums["prev"] = sums["prev"] + a[:, :, q - 1, q - 1].sum(-1)
        with np.errstate(divide="ignore", invalid="ignore"):
            ent = -np.where(a > 0, a * np.log(a), 0.0).sum(-1)            # [layer, head, q]
        sums["entropy"] = sums["entropy"] + ent.sum(-1)
        count += n - 1
    if not count:
        return {}
    return {"first_token_attention": sums["first"] / count,
            "previous_token_attention": sums["prev"] / count,
            "attention_entropy": sums["entropy"] / count}


def _is_edge_scores(ds: xr.Dataset) -> bool:
    return ("score" in ds and ds["score"].dims == ("edge",) and "src" in ds.coords
            and "dst" in ds.coords)


def _is_attention_trace(ds: xr.Dataset) -> bool:
    return "attn_pattern" in ds and "mask" in ds


def head_scores_of(ds: xr.Dataset, n_layers: int, n_heads: int) -> dict[str, xr.DataArray]:
    """The [layer, head] scores one result holds, each with its provenance attrs ({} if none)."""
    if not isinstance(ds, xr.Dataset):
        raise TypeError(f"a result is an xarray.Dataset; got {type(ds).__name__}.")
    coords = {"layer": np.arange(n_layers), "head": np.arange(n_heads)}
    out: dict[str, xr.DataArray] = {}

    def put(name: str, values: Any, prov: dict) -> None:
        out[name] = xr.DataArray(np.asarray(values, dtype=np.float64), dims=("layer", "head"),
                                 coords=coords, attrs=prov)

    if _is_edge_scores(ds):
        inflow, outflow = edge_mass(ds, n_layers, n_heads)
        method = str(ds.attrs.get("method", "circuit_edge_scores"))
        put("eap_in_mass", inflow, _provenance(
            ds, method=method, source="sum of |score| over the edges into the head",
            doc="attribution mass of the edges the head reads"))
        put("eap_out_mass", outflow, _provenance(
            ds, method=method, source="sum of |score| over the edges out of the head",
            doc="attribution mass of the edges the head writes"))
        return out
    if ds.attrs.get("method") == "answer_logit_attribution" and "heads" in ds:
        at = ds.isel(pos=0)
        what = (f"direct contribution to logit({ds.attrs.get('answer', '')!r}) - "
                f"logit({ds.attrs.get('alternative', '')!r}) at position "
                f"{int(at['position'])}, through the final norm frozen at the clean run")
        put("dla", _grid(at["heads"].sel(run="clean")).values, _provenance(
            ds, source="heads of the clean run", doc=what))
        if ds.attrs.get("edits"):
            put("dla_edited", _grid(at["heads"].sel(run="edited")).values, _provenance(
                ds, source="heads of the edited run", doc=what))
        return out
    if _is_attention_trace(ds):
        docs = {"first_token_attention": "mean weight on the first token",
                "previous_token_attention": "mean weight on the previous token",
                "attention_entropy": "mean entropy of the attention row (nats)"}
        for name, values in attention_head_scores(ds).items():
            full = np.full((n_layers, n_heads), np.nan)
            layers = [int(v) for v in ds["layer"].values] if "layer" in ds.coords else range(n_layers)
            full[list(layers)] = values
            put(name, full, _provenance(
                ds, method="attention_pattern", doc=docs[name],
                source="attn_pattern averaged over the queries after the first token"))
        return out
    for name, da in ds.data_vars.items():
        dims = set(da.dims)
        if name == "ablation_effect" and {"layer", "head"} <= dims and "fact" in dims:
            params = ds.attrs.get("params", {})
            if isinstance(params, dict) and params.get("ablation") is False:
                continue  # not computed: zeros
            rest = [d for d in da.dims if d not in ("layer", "head")]
            grid = _grid(da.mean(rest)).reindex(coords)
            put("ablation_effect", grid.values, _provenance(
                ds, source=f"ablation_effect averaged over {', '.join(rest)}",
                doc="change of the memory-minus-context logit difference when the head is "
                    "zero-ablated"))
        elif dims == {"layer", "head"} and np.issubdtype(da.dtype, np.number):
            method, doc = KNOWN_SCORES.get(str(name), (None, ""))
            if "method" in ds.attrs and ds.attrs["method"] not in ("", None):
                method = method or str(ds.attrs["method"])
            put(str(name), _grid(da).reindex(coords).values,
                _provenance(ds, method=method, source=str(name), doc=doc))
    return out


def _shape_of(results: list[xr.Dataset]) -> tuple[int, int]:
    for ds in results:
        spec = ds.attrs.get("model_spec")
        if isinstance(spec, dict) and "n_layers" in spec and "n_heads" in spec:
            return int(spec["n_layers"]), int(spec["n_heads"])
        if "n_layers" in ds.attrs and "n_heads" in ds.attrs:
            return int(ds.attrs["n_layers"]), int(ds.attrs["n_heads"])
        if "layer" in ds.sizes and "head" in ds.sizes and not _is_attention_trace(ds):
            return int(ds.sizes["layer"]), int(ds.sizes["head"])
    raise InputError("cannot tell the model's shape from the results; pass n_layers and "
                     "n_heads.")


def head_atlas(*results: xr.Dataset | Iterable[xr.Dataset], n_layers: int | None = None,
               n_heads: int | None = None, model: Any = None) -> xr.Dataset:
    """One Dataset [layer, head] with a variable per per-head score found in ``results``.

    Parameters
    ----------
    *results : xarray.Dataset (or iterables of them)
        What the analyses returned: ``icl_heads.induction_scores`` / ``fv_scores``,
        ``conflicts.head_context_memory_scores``, ``circuits.edge_scores``, `explorer.trace`
        with ``attn_pattern``, or any Dataset with [layer, head] variables.
    n_layers, n_heads : int, optional
        The model's shape; default from ``model`` or from the results' provenance.
    model : explorer.Model, optional
        The model the results come from (its name and shape are checked).

    Returns
    -------
    xarray.Dataset
        One variable (layer, head) per score; a name an earlier result already gave gets a
        suffix (the circuit task, or a number). Each variable's attrs hold its provenance:
        ``method``, ``model``, ``params`` (JSON), ``source`` and, where known,
        ``description`` and ``citation``. Coordinate ``component`` (layer, head) spells each
        head (``L3.H1``). Results from another model raise InputError.
    """
    flat: list[xr.Dataset] = []
    for r in results:
        if isinstance(r, xr.Dataset):
            flat.append(r)
        elif isinstance(r, Iterable) and not isinstance(r, (str, bytes, dict)):
            flat.extend(r)
        else:
            raise TypeError(f"head_atlas takes xarray.Datasets; got {type(r).__name__}.")
    name = model.spec.name if model is not None else None
    if model is not None:
        n_layers = model.spec.n_layers if n_layers is None else n_layers
        n_heads = model.spec.n_heads if n_heads is None else n_heads
    for ds in flat:
        if not isinstance(ds, xr.Dataset):
            raise TypeError(f"head_atlas takes xarray.Datasets; got {type(ds).__name__}.")
        other = ds.attrs.get("model")
        if other:
            if name is None:
                name = str(other)
            elif other != name:
                raise InputError(f"the results come from different models: {name!r} and "
                                 f"{other!r}; an atlas holds one model's heads.")
    if n_layers is None or n_heads is None:
        if not flat:
            raise InputError("an empty atlas needs n_layers and n_heads (or model).")
        n_layers, n_heads = _shape_of(flat)
    variables: dict[str, xr.DataArray] = {}
    for i, ds in enumerate(flat):
        for key, da in head_scores_of(ds, n_layers, n_heads).items():
            if key in variables:
                tag = ds.attrs.get("task") or ds.attrs.get("params_task")
                base = f"{key}_{_SAFE.sub('_', str(tag)).strip('_')}" if tag else f"{key}_{i}"
                key, k = base, 2
                while key in variables:
                    key, k = f"{base}_{k}", k + 1
            variables[key] = da
    labels = np.array([[str(comp.head(l, h)) for h in range(n_heads)] for l in range(n_layers)],
                      dtype=object)
    atlas = xr.Dataset(variables, coords={"layer": np.arange(n_layers), "head": np.arange(n_heads),
                                          "component": (("layer", "head"), labels)})
    atlas.attrs.update(method="head_atlas", model=name or "", n_layers=int(n_layers),
                       n_heads=int(n_heads), scores=list(variables))
    return atlas


def atlas_table(atlas: xr.Dataset) -> pd.DataFrame:
    """The atlas as a table: one row per head (``component``, ``layer``, ``head``), one column
    per score, in layer-then-head order (what the page shows and its CSV export holds)."""
    n_layers, n_heads = atlas.sizes["layer"], atlas.sizes["head"]
    layer, head = np.meshgrid(atlas["layer"].values, atlas["head"].values, indexing="ij")
    table = {"component": [str(comp.head(int(l), int(h)))
                           for l, h in zip(layer.ravel(), head.ravel())],
             "layer": layer.ravel().astype(int), "head": head.ravel().astype(int)}
    for name, da in atlas.data_vars.items():
        table[str(name)] = da.transpose("layer", "head").values.reshape(n_layers * n_heads)
    return pd.DataFrame(table)
