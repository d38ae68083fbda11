"""Many single edits: the shattering ratio and the accuracy drop of each, with the fit of one on
the other (`edit_sweep`), cached in the store (`stored_edit_sweep`), and its headline
numbers (`sweep_summary`).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import xarray as xr

from explorer._checks import InputError, check_choice, check_int
from explorer.analyses.shattering.edits import EDIT_METHODS, edit_fact, edited_model, key_covariance
from explorer.analyses.shattering.evaluation import (
    _attrs,
    distance_matrix,
    entity_representations,
    fact_accuracy,
    shattering_ratio,
)
from explorer.analyses.shattering.graph import SPLITS, KnowledgeGraph, ProgressCallback
from explorer.analyses.shattering.model import KnowledgeModel

__all__ = ["edit_sweep", "stored_edit_sweep", "sweep_summary"]


def edit_sweep(km: KnowledgeModel, *, n_edits: int = 80, distances: Sequence[int] = (1, 2, 3, 4),
               method: str = "rome", layer: int = 0, layers: Sequence[int] | None = None, seed: int = 0,
               progress: ProgressCallback | None = None) -> xr.Dataset:
    """Many single counterfactual edits (each on the unedited model): R and accuracy drops.

    Edited facts are drawn at random from the correctly recalled direct facts; edit ``i``
    uses distance ``distances[i % len(distances)]``, so every distance gets the same
    number of edits. ``layer``: the edited block, or MEMIT's last critical block, with
    ``layers`` the blocks MEMIT spreads each edit over (default 0..layer).

    Returns
    -------
    xarray.Dataset
        Over ``edit``: ``entity``, ``relation``, ``distance``, ``R``, ``success`` (the edited
        fact now gives the new object), ``accuracy_after`` (edit, split) on all other facts;
        ``accuracy_before`` (split); ``accuracy_drop`` (edit, split). Attrs: the least-squares
        fit of the ``all`` accuracy drop on R (``slope``, ``intercept``, ``r2``) and
        ``R_by_distance`` (mean R per distance).
    """
    check_choice("method", method, EDIT_METHODS)
    n_edits = check_int("n_edits", n_edits, low=2)
    distances = [check_int("distances[i]", d, low=1, high=km.graph.n_entities - 1) for d in distances]
    if not distances:
        raise InputError("`distances` must hold at least one distance; got none.")
    layer = check_int("layer", layer, low=0, high=km.n_layers - 1)
    graph = km.graph
    base = fact_accuracy(km)
    base_correct = base["correct"].values
    candidates = np.argwhere((graph.split == "direct") & base_correct)
    if len(candidates) == 0:
        raise InputError("the model recalls no direct fact correctly; train it longer.")
    rng = np.random.default_rng(seed)
    picks = candidates[rng.choice(len(candidates), size=n_edits, replace=len(candidates) < n_edits)]
    if method == "memit":
        layers = sorted({check_int("layers[i]", l, low=0, high=km.n_layers - 1)
                         for l in (range(layer + 1) if layers is None else layers)})
        cov: Any = {l: key_covariance(km, l) for l in layers}
    elif layers is not None:
        raise InputError(f"`layers` is for method 'memit' only; got method {method!r}.")
    else:
        cov = key_covariance(km, layer) if method == "rome" else None
    n = graph.n_entities
    d0 = distance_matrix(entity_representations(km.model, n))
    rows: dict[str, list] = {k: [] for k in ("entity", "relation", "distance", "new_object", "R",
                                             "success", "before", "after")}
    for i, (e, r) in enumerate(picks):
        dist = distances[i % len(distances)]
        edit = edit_fact(km, int(e), int(r), dist, method=method, layer=layer, cov=cov, layers=layers)
        model = edited_model(km, edit)
        acc = fact_accuracy(km, model, exclude=[(int(e), int(r))])
        before = _split_accuracy(graph, base_correct, (int(e), int(r)))
        rows["entity"].append(int(e))
        rows["relation"].append(int(r))
        rows["distance"].append(dist)
        rows["new_object"].append(edit.new_object)
        rows["R"].append(shattering_ratio(d0, distance_matrix(entity_representations(model, n))))
        rows["success"].append(int(acc["prediction"].values[e, r]) == edit.new_object)
        rows["before"].append(before)
        rows["after"].append(acc["accuracy"].values)
        if progress is not None and progress(i + 1, n_edits) is False:
            break
    R = np.asarray(rows["R"])
    before = np.asarray(rows["before"])
    after = np.asarray(rows["after"])
    drop = before - after                                                   # [edit, split]
    fit = _linear_fit(R, drop[:, -1])
    by_distance = {int(d): float(R[np.asarray(rows["distance"]) == d].mean())
                   for d in sorted(set(rows["distance"]))}
    drop_by_distance = {int(d): float(drop[np.asarray(rows["distance"]) == d, -1].mean())
                        for d in sorted(set(rows["distance"]))}
    return xr.Dataset(
        {"entity": (("edit",), np.asarray(rows["entity"])),
         "relation": (("edit",), np.asarray(rows["relation"])),
         "distance": (("edit",), np.asarray(rows["distance"])),
         "new_object": (("edit",), np.asarray(rows["new_object"])),
         "R": (("edit",), R), "success": (("edit",), np.asarray(rows["success"])),
         "accuracy_before": (("split",), base["accuracy"].values),
         "accuracy_after": (("edit", "split"), after),
         "accuracy_drop": (("edit", "split"), drop)},
        coords={"edit": np.arange(len(R)), "split": [*SPLITS, "all"]},
        attrs=_attrs("edit_sweep", km, {"n_edits": n_edits, "distances": distances,
                                        "edit_method": method, "layer": layer, "sweep_seed": seed,
                                        **({"layers": list(layers)} if method == "memit" else {})},
                     **fit,
                     R_by_distance={str(k): v for k, v in by_distance.items()},
                     accuracy_drop_by_distance={str(k): v for k, v in drop_by_distance.items()},
                     success_rate=float(np.mean(rows["success"]))))


def _split_accuracy(graph: KnowledgeGraph, correct: np.ndarray, skip: tuple[int, int]) -> np.ndarray:
    keep = np.ones_like(correct)
    keep[skip] = False
    return np.asarray([correct[keep & ((graph.split == s) if s != "all" else True)].mean()
                       for s in (*SPLITS, "all")])


def _linear_fit(x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Least-squares line ``y = slope x + intercept`` and its r²."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) < 2 or np.ptp(x) == 0:
        return {"slope": float("nan"), "intercept": float("nan"), "r2": float("nan")}
    slope, intercept = np.polyfit(x, y, 1)
    resid = y - (slope * x + intercept)
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1 - float((resid ** 2).sum()) / ss_tot if ss_tot > 0 else float("nan")
    return {"slope": float(slope), "intercept": float(intercept), "r2": r2}


def stored_edit_sweep(km: KnowledgeModel, *, store=None, progress: ProgressCallback | None = None,
                      **options: Any) -> xr.Dataset:
    """`edit_sweep` from the store, or computed and stored (keyed by the model's weights)."""
    from explorer.store import ActivationStore

    store = ActivationStore() if store is None else store
    opts = {"n_edits": 80, "distances": [1, 2, 3, 4], "method": "rome", "layer": 0, "seed": 0, **options}
    opts["distances"] = [int(d) for d in opts["distances"]]
    if opts.get("layers") is not None:
        opts["layers"] = sorted({int(l) for l in opts["layers"]})
    else:
        opts.pop("layers", None)   # no key change for sweeps stored before MEMIT
    parts = {"method": "shattering_edit_sweep", "format": 1, "params": km.params,
             "weights_sha256": km.weights_sha256(), **{f"sweep_{k}": v for k, v in opts.items()}}
    return store.get_or_compute(parts, lambda: edit_sweep(km, progress=progress, **opts)).load()


def sweep_summary(sweep: xr.Dataset) -> dict[str, Any]:
    """Headline numbers of an `edit_sweep`, JSON-able.

    A dict, not a Dataset: it is the Dataset's headline numbers as nested JSON scalars and
    lists, what the command's ``--json`` prints and a benchmark writes to docs/figures.
    """
    a = sweep.attrs
    return {"method": a["params"]["edit_method"], "n_edits": int(sweep.sizes["edit"]),
            "layer": a["params"]["layer"], **({"layers": list(a["params"]["layers"])}
                                              if "layers" in a["params"] else {}),
            "success_rate": a["success_rate"],
            "accuracy_before": dict(zip(sweep["split"].values.tolist(),
                                        map(float, sweep["accuracy_before"].values))),
            "mean_accuracy_drop": dict(zip(sweep["split"].values.tolist(),
                                           map(float, sweep["accuracy_drop"].mean("edit").values))),
            "r2": a["r2"], "slope": a["slope"], "intercept": a["intercept"],
            "R_by_distance": a["R_by_distance"], "accuracy_drop_by_distance": a["accuracy_drop_by_distance"]}
