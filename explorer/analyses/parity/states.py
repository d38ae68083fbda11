"""The hidden states of a parity network after every string up to a length, and their PCA
(`parity_hidden_states`, `parity_hidden_pca`).
"""
from __future__ import annotations

import numpy as np
import torch
import xarray as xr

from explorer._checks import check_int
from explorer.analyses.parity.network import ParityRNN, _attrs, parity_strings
from explorer.analyses.parity.training import parity_model

__all__ = ["parity_hidden_states", "parity_hidden_pca"]


def _hidden_of_prefixes(model: ParityRNN, max_length: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Hidden state and readout after every string of length 0..max_length (row 0 = empty).

    Every string of length < max_length is a prefix of the length-max_length strings, so
    one forward pass over those 2**max_length strings gives all states.
    """
    full, _ = parity_strings(max_length, min_length=max_length)       # [2**n, n]
    with torch.no_grad():
        out, hidden = model(torch.as_tensor(full, dtype=torch.long))   # [2**n, n, *]
        h0 = model.h0[None]
        out0 = model.readout(h0)
    n_states = 2 ** (max_length + 1) - 1
    states = np.empty((n_states, model.hidden_size), dtype=np.float64)
    outputs = np.empty((n_states, 2), dtype=np.float64)
    states[0], outputs[0] = h0[0].numpy(), out0[0].numpy()
    values = np.arange(2**max_length)
    for length in range(1, max_length + 1):
        prefix_value = values >> (max_length - length)                # [2**n]
        rows = 2**length - 1 + prefix_value                            # state index of the prefix
        states[rows] = hidden[:, length - 1].numpy()
        outputs[rows] = out[:, length - 1].numpy()
    names = [""]
    for length in range(1, max_length + 1):
        names += [format(v, f"0{length}b") for v in range(2**length)]
    return states, outputs, names


def parity_hidden_states(run: xr.Dataset, step: int, *, max_length: int = 8) -> xr.Dataset:
    """Hidden state after every string of length 0..max_length at one checkpoint.

    Returns
    -------
    xarray.Dataset
        ``hidden`` (prefix, unit) and ``readout`` (prefix, output); coordinates ``string``
        (the prefix as '0'/'1' text, '' for the start state), ``length`` and ``parity``
        (prefix). Prefixes are ordered by length, then as binary numbers.
    """
    max_length = check_int("max_length", max_length, low=1, high=12)
    model = parity_model(run, step)
    states, outputs, names = _hidden_of_prefixes(model, max_length)
    return xr.Dataset(
        {"hidden": (("prefix", "unit"), states.astype(np.float32)),
         "readout": (("prefix", "output"), outputs.astype(np.float32))},
        coords={"prefix": np.arange(len(names)), "string": ("prefix", np.asarray(names, dtype="U")),
                "length": ("prefix", np.asarray([len(s) for s in names])),
                "parity": ("prefix", np.asarray([s.count("1") % 2 for s in names])),
                "unit": np.arange(model.hidden_size), "output": [0, 1]},
        attrs=_attrs("parity_hidden_states", {"step": int(step), "max_length": max_length},
                     run.attrs.get("seed", 0)),
    )


def parity_hidden_pca(run: xr.Dataset, step: int, *, max_length: int = 8,
                      n_components: int = 2) -> xr.Dataset:
    """Principal components of the hidden states at one checkpoint (for the PCA view).

    Signs are fixed so that each component's largest loading is positive, so the picture
    does not flip between neighbouring checkpoints for no reason.

    Returns
    -------
    xarray.Dataset
        ``pc`` (prefix, component) and ``explained_variance_ratio`` (component); the
        prefix coordinates of `parity_hidden_states`.
    """
    n_components = check_int("n_components", n_components, low=1, high=10)
    hs = parity_hidden_states(run, step, max_length=max_length)
    h = hs["hidden"].values.astype(np.float64)
    h = np.where(np.isfinite(h), h, 0.0)
    centred = h - h.mean(axis=0)
    _, s, vt = np.linalg.svd(centred, full_matrices=False)
    k = min(n_components, vt.shape[0])
    comps = vt[:k]                                                     # [component, unit]
    signs = np.sign(comps[np.arange(k), np.abs(comps).argmax(axis=1)])
    comps = comps * np.where(signs == 0, 1, signs)[:, None]
    total = float((s**2).sum())
    ratio = (s[:k] ** 2) / total if total > 0 else np.zeros(k)
    return xr.Dataset(
        {"pc": (("prefix", "component"), (centred @ comps.T).astype(np.float32)),
         "explained_variance_ratio": (("component",), ratio)},
        coords={**{c: hs.coords[c] for c in ("prefix", "string", "length", "parity")},
                "component": np.arange(1, k + 1)},
        attrs=_attrs("parity_hidden_pca", {"step": int(step), "max_length": max_length,
                                           "n_components": n_components}, run.attrs.get("seed", 0)),
    )
