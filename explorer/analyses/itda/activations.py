"""Reading activations for ITDA: `activation_chunks` streams the real tokens' activations
with their (prompt, pos, token) labels, chunk by chunk, from a trace or store Dataset (lazy,
dask-backed ones one stored chunk at a time), a list of them, or a plain array;
`cached_activations` traces prompts once and keeps the activations in the store.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import xarray as xr

from explorer._checks import InputError, check_int
from explorer.models import Model

__all__ = ["activation_chunks", "cached_activations"]

def _select_site(data: xr.Dataset | xr.DataArray, site: str, layer: int | None) -> xr.DataArray:
    """The (prompt, pos, d_model) DataArray of ``site`` at ``layer``."""
    if isinstance(data, xr.Dataset):
        if site not in data:
            raise InputError(f"the activations have no variable {site!r}; they have "
                             f"{', '.join(map(str, data.data_vars))}.")
        var = data[site]
        if "mask" in data and "mask" not in var.coords:
            var = var.assign_coords(mask=data["mask"])
    elif isinstance(data, xr.DataArray):
        var = data
    else:  # pragma: no cover - callers check first
        raise TypeError(type(data).__name__)
    if "layer" in var.dims:
        layers = [int(v) for v in var["layer"].values]
        if layer is None:
            if len(layers) != 1:
                raise InputError(f"the activations hold layers {layers}; pass `layer` to pick one.")
            layer = layers[0]
        if layer not in layers:
            raise InputError(f"`layer` must be one of the traced layers {layers}; got {layer}.")
        var = var.sel(layer=layer)
    missing = {"prompt", "pos"} - set(var.dims)
    if missing or var.ndim != 3:
        raise InputError(f"activations must have dims (prompt, pos, d_model); got {var.dims}.")
    return var.transpose("prompt", "pos", ...)


def activation_chunks(data: Any, *, site: str = "resid_post", layer: int | None = None,
                      chunk_prompts: int = 64, labels: Any = None, tokens: Any = None,
                      min_pos: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """Yield the real tokens' activations chunk by chunk, with their labels.

    ``data`` is a Dataset from `trace` or the store (prompt, pos, layer, d_model plus
    ``mask``; a dask-backed one is read one stored chunk at a time), a DataArray
    (prompt, pos, d_model), or an array [n, d] (then ``labels`` [n, 2] give (prompt, pos)
    per row, default (0, row), and ``tokens`` [n] their strings). Tokens at positions below
    ``min_pos`` are left out: ``min_pos=1`` drops each prompt's first token, which in many
    models (SmolLM2 included) carries an attention-sink norm a hundred times the others'.

    A list of Datasets (as `cached_activations` returns with ``chunk_prompts``) is read one
    after the other.

    Yields
    ------
    dict with ``x`` [n, d] float32, ``prompt`` [n], ``pos`` [n], ``token`` [n] (str) and
    ``token_id`` [n] (-1 when unknown).
    """
    check_int("min_pos", min_pos, low=0)
    if isinstance(data, (list, tuple)) and data and all(isinstance(d, xr.Dataset) for d in data):
        for part in data:
            yield from activation_chunks(part, site=site, layer=layer, chunk_prompts=chunk_prompts,
                                         min_pos=min_pos)
        return
    if isinstance(data, (xr.Dataset, xr.DataArray)):
        var = _select_site(data, site, layer)
        chunks = var.chunks
        if chunks is not None:
            sizes = list(chunks[0])                      # dask: one stored chunk at a time
        else:
            n_prompts = var.sizes["prompt"]
            sizes = [min(chunk_prompts, n_prompts - s) for s in range(0, n_prompts, chunk_prompts)]
        prompt_ids = np.asarray(var["prompt"].values)
        pos_ids = np.asarray(var["pos"].values)
        start = 0
        for size in sizes:
            part = var.isel(prompt=slice(start, start + size))
            x = np.asarray(part.values, dtype=np.float32)                  # [p, pos, d]
            if "mask" in part.coords:
                mask = np.asarray(part["mask"].values, dtype=bool)
            else:
                mask = np.isfinite(x).all(-1)
            mask = mask & (pos_ids >= min_pos)[None, :]
            pi, qi = np.nonzero(mask)
            tok = (np.asarray(part["token"].values)[pi, qi].astype(str) if "token" in part.coords
                   else np.full(len(pi), "", dtype=object).astype(str))
            tid = (np.asarray(part["token_id"].values)[pi, qi] if "token_id" in part.coords
                   else np.full(len(pi), -1))
            yield {"x": x[pi, qi], "prompt": prompt_ids[start + pi], "pos": pos_ids[qi],
                   "token": tok, "token_id": np.asarray(tid, dtype=np.int64)}
            start += size
        return
    x = data.detach().cpu().numpy() if isinstance(data, torch.Tensor) else np.asarray(data)
    if x.ndim != 2:
        raise InputError(f"an activation array must be 2-d [token, d_model]; got shape {x.shape}.")
    n = x.shape[0]
    if labels is None:
        lab = np.stack([np.zeros(n, dtype=np.int64), np.arange(n)], axis=1)
    else:
        lab = np.asarray(labels, dtype=np.int64)
        if lab.shape != (n, 2):
            raise InputError(f"`labels` must have shape ({n}, 2) (prompt, pos per row); got {lab.shape}.")
    tok = np.asarray(tokens).astype(str) if tokens is not None else np.full(n, "").astype(str)
    if tok.shape != (n,):
        raise InputError(f"`tokens` must have one string per row ({n}); got shape {tok.shape}.")
    keep = lab[:, 1] >= min_pos
    x, lab, tok = x[keep], lab[keep], tok[keep]
    n = x.shape[0]
    step = max(1, chunk_prompts) * 64
    for s in range(0, n, step):
        yield {"x": np.asarray(x[s:s + step], dtype=np.float32), "prompt": lab[s:s + step, 0],
               "pos": lab[s:s + step, 1], "token": tok[s:s + step],
               "token_id": np.full(min(step, n - s), -1, dtype=np.int64)}


def _check_data(data: Any, name: str = "activations") -> None:
    if isinstance(data, (list, tuple)) and data and all(isinstance(d, xr.Dataset) for d in data):
        return
    if not isinstance(data, (xr.Dataset, xr.DataArray, np.ndarray, torch.Tensor)):
        raise TypeError(f"`{name}` must be an xarray Dataset/DataArray of activations, a list of "
                        f"Datasets (`cached_activations(..., chunk_prompts=N)`), or an array "
                        f"[token, d_model]; got {type(data).__name__}.")


def cached_activations(model: Model, prompts: Sequence[str], *, site: str = "resid_post",
                       layers: Any = None, store: Any = None, batch_size: int = 8,
                       chunk_prompts: int | None = None, progress: Any = None
                       ) -> xr.Dataset | list[xr.Dataset]:
    """Trace ``prompts`` once and keep the activations in the store (lazy on later reads).

    The store key covers the model provenance, the prompts, the site and the layers, so a
    second call with the same inputs reads the stored zarr chunk by chunk instead of
    running the model.

    Parameters
    ----------
    model : Model
    prompts : sequence of str
    site : str, default="resid_post"
    layers : int or sequence of int, optional (default all)
    store : ActivationStore, optional
        Default: ``ActivationStore()`` (``$EXPLORER_CACHE``).
    chunk_prompts : int, optional
        Trace and store this many prompts at a time, one store entry each, and return the
        list of lazy Datasets (prompt coords numbered globally): memory then stays bounded
        while tracing too. Every ITDA function reads such a list as one stream.

    Returns
    -------
    xarray.Dataset, or a list of them with ``chunk_prompts``
    """
    from explorer.store import ActivationStore
    from explorer.trace import check_layers, check_sites, trace

    check_sites((site,))
    layer_list = check_layers(model, layers)
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    store = ActivationStore() if store is None else store
    model_parts = model.spec.provenance()
    model_parts.pop("versions", None)

    def one(part: list[str], start: int) -> xr.Dataset:
        parts = {"model": model_parts, "method": "trace", "prompts": part, "sites": [site],
                 "layers": layer_list, "dtype": "float32"}
        ds = store.get_or_compute(parts, lambda: trace(model, part, sites=(site,), layers=layer_list,
                                                       batch_size=batch_size, progress=progress))
        return ds.assign_coords(prompt=np.arange(start, start + len(part))) if start else ds

    if chunk_prompts is None:
        return one(prompts, 0)
    check_int("chunk_prompts", chunk_prompts, low=1)
    return [one(prompts[s: s + chunk_prompts], s) for s in range(0, len(prompts), chunk_prompts)]
