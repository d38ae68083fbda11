"""Fact lookup by probing: a cross-validated logistic-regression probe for the attribute
(`probe_accuracy`) on the last subject token after each layer (`attribute_probe_curve`), and
the window of MLP layers where its accuracy rises most (`fact_lookup_layers`).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xarray as xr

from explorer._checks import InputError, check_int
from explorer.analyses.unlearning.facts import (
    CITATION,
    AttributeFact,
    Progress,
    fact_prompt,
    subject_positions,
)
from explorer.models import Model
from explorer.trace import provenance, trace

__all__ = ["probe_accuracy", "attribute_probe_curve", "fact_lookup_layers"]


def probe_accuracy(features: np.ndarray, labels: np.ndarray, *, n_folds: int = 4,
                   seed: int = 0) -> float:
    """Cross-validated accuracy of a multinomial logistic-regression probe
    (standardised features, L2 penalty, stratified ``n_folds``-fold split)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold, cross_val_score
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    features = np.asarray(features, dtype=np.float64)
    labels = np.asarray(labels)
    if features.ndim != 2 or len(features) != len(labels):
        raise InputError(f"`features` must be [example, feature] with one label per row; got "
                         f"{features.shape} and {labels.shape}.")
    n_folds = check_int("n_folds", n_folds, low=2)
    _, counts = np.unique(labels, return_counts=True)
    if len(counts) < 2:
        raise InputError(f"a probe needs labels of at least 2 classes; got {len(counts)}.")
    if counts.min() < n_folds:
        raise InputError(f"every class needs at least `n_folds`={n_folds} examples; the "
                         f"smallest has {counts.min()}.")
    probe = make_pipeline(StandardScaler(), LogisticRegression(C=0.1, max_iter=2000))
    folds = StratifiedKFold(n_folds, shuffle=True, random_state=seed)
    return float(cross_val_score(probe, features, labels, cv=folds).mean())


def attribute_probe_curve(model: Model, facts: Sequence[AttributeFact], *, n_folds: int = 4,
                          seed: int = 0, batch_size: int = 32, progress: Progress = None,
                          ) -> xr.Dataset:
    """Probe accuracy for the attribute on the last subject token, per layer.

    Reads ``resid_post`` of every layer (after its MLP) and ``resid_pre`` of layer 0 (the
    embedding) at the last subject token of each trained-format prompt.

    Returns
    -------
    xr.Dataset
        ``probe_accuracy`` (layer), ``embed_accuracy`` scalar, ``chance`` scalar (the
        largest class share).
    """
    facts = list(facts)
    if len(facts) < 2:
        raise InputError(f"`facts` must hold at least 2 facts; got {len(facts)}.")
    L = model.n_layers
    labels = np.array([f.attribute for f in facts])
    feats = [[] for _ in range(L + 1)]  # embed, then layer 0..L-1
    for b0 in range(0, len(facts), batch_size):
        chunk = facts[b0:b0 + batch_size]
        read = trace(model, [fact_prompt(f, "trained") for f in chunk],
                     sites=("resid_pre", "resid_post"), batch_size=len(chunk), progress=False)
        rows = np.arange(len(chunk))
        cols = np.array([subject_positions(model, f)[-1] for f in chunk])  # unpadded positions
        feats[0].append(read.resid_pre.values[rows, cols, 0])
        for layer in range(L):
            feats[layer + 1].append(read.resid_post.values[rows, cols, layer])
        if progress:
            progress(min(b0 + batch_size, len(facts)), len(facts) + L + 1)
    accs = []
    for i, f in enumerate(feats):
        accs.append(probe_accuracy(np.concatenate(f), labels, n_folds=n_folds, seed=seed))
        if progress:
            progress(len(facts) + i + 1, len(facts) + L + 1)
    _, counts = np.unique(labels, return_counts=True)
    ds = xr.Dataset({"probe_accuracy": ("layer", np.array(accs[1:])),
                     "embed_accuracy": accs[0], "chance": counts.max() / counts.sum()},
                    coords={"layer": np.arange(L)},
                    attrs=provenance(model, method="attribute_probe_curve", n_folds=n_folds,
                                     seed=seed, n_facts=len(facts)))
    ds.attrs["citation"] = CITATION
    return ds


def fact_lookup_layers(probe: xr.Dataset, n_layers: int) -> list[int]:
    """The ``n_layers`` consecutive layers over which the probe accuracy rises most
    (accuracy after the window minus accuracy before it, the embedding before layer 0)."""
    acc = np.concatenate([[float(probe.embed_accuracy)], probe.probe_accuracy.values])
    L = len(acc) - 1
    n_layers = check_int("n_layers", n_layers, low=1, high=L)
    gains = [acc[s + n_layers] - acc[s] for s in range(L - n_layers + 1)]
    start = int(np.argmax(gains))  # first window on ties: lookup happens early
    return list(range(start, start + n_layers))
