"""The picture of one edit: the entity representations along the edit (multiples of its
parameter change), projected with PCA or Isomap fitted on the unedited ones, with the
shattering ratio at each strength (`edit_embedding`).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import xarray as xr

from explorer._checks import check_choice, check_float, check_int
from explorer.analyses.shattering.edits import KnowledgeEdit, edited_model
from explorer.analyses.shattering.evaluation import (
    _attrs,
    distance_matrix,
    entity_representations,
    shattering_ratio,
)
from explorer.analyses.shattering.model import KnowledgeModel

__all__ = ["edit_embedding", "PROJECTIONS"]


#: Projections offered by `edit_embedding`.
PROJECTIONS: tuple[str, ...] = ("pca", "isomap")


def edit_embedding(km: KnowledgeModel, edit: KnowledgeEdit, strengths: Sequence[float] = (0.0, 1.0), *,
                   layer: int | None = None, projection: str = "pca", n_components: int = 3,
                   n_neighbors: int = 8) -> xr.Dataset:
    """Entity representations along the edit, projected with a map fitted on the unedited ones.

    Parameters
    ----------
    strengths : sequence of float
        Multiples of the edit's parameter change (0 = unedited, 1 = the edit).
    layer : int, optional
        Block whose output is read (default: the last).
    projection : {"pca", "isomap"}, default="pca"
        ``"pca"``: the principal components of the unedited representations (each signed so
        that its largest loading is positive); every strength is projected on them.
        ``"isomap"``: scikit-learn's Isomap (Nishi et al.'s picture) fitted on the unedited
        representations with ``n_neighbors`` neighbours; edited ones are placed with its
        out-of-sample ``transform``.
    n_components : int, default=3
        Number of components kept (1 to min(entities - 1, d_model)).

    Returns
    -------
    xarray.Dataset
        ``projection`` (strength, entity, component) the projected coordinates (components
        ``PC1``, ``PC2``, ... or ``Isomap1``, ...); ``R`` (strength) the shattering ratio, on
        the full representations; ``cycle_position`` (order, entity) the place of each entity
        on each cycle; ``explained_variance_ratio`` (component), NaN for Isomap.
    """
    strengths = [check_float("strengths[i]", s) for s in strengths]
    check_choice("projection", projection, PROJECTIONS)
    n = km.graph.n_entities
    base = entity_representations(km.model, n, layer=layer).double().numpy()
    n_components = check_int("n_components", n_components, low=1, high=min(n - 1, base.shape[1]))
    reps_at = [base if a == 0.0 else entity_representations(edited_model(km, edit, a), n, layer=layer)
               .double().numpy() for a in strengths]
    d0 = distance_matrix(base)
    ratios = [shattering_ratio(d0, distance_matrix(reps)) for reps in reps_at]
    if projection == "pca":
        mean = base.mean(0)
        _, s, vt = np.linalg.svd(base - mean, full_matrices=False)
        basis = vt[:n_components]                                           # [component, d_model]
        rows = np.arange(n_components)
        basis = basis * np.sign(basis[rows, np.abs(basis).argmax(1)])[:, None]
        coords = [(reps - mean) @ basis.T for reps in reps_at]
        var = s ** 2
        ratio = var[:n_components] / var.sum()
        names = [f"PC{i + 1}" for i in range(n_components)]
    else:
        from sklearn.manifold import Isomap

        n_neighbors = check_int("n_neighbors", n_neighbors, low=2, high=n - 1)
        iso = Isomap(n_neighbors=n_neighbors, n_components=n_components).fit(base)
        coords = [iso.transform(reps) for reps in reps_at]
        ratio = np.full(n_components, np.nan)
        names = [f"Isomap{i + 1}" for i in range(n_components)]
    return xr.Dataset(
        {"projection": (("strength", "entity", "component"), np.asarray(coords)),
         "R": (("strength",), np.asarray(ratios)),
         "cycle_position": (("order", "entity"), km.graph.position),
         "explained_variance_ratio": (("component",), ratio)},
        coords={"strength": strengths, "entity": km.graph.entity_names, "component": names,
                "order": list(range(km.graph.orders.shape[0]))},
        attrs=_attrs("edit_embedding", km, {"strengths": strengths, "layer": layer, "projection": projection,
                                            "n_components": n_components,
                                            **({"n_neighbors": n_neighbors} if projection == "isomap" else {})},
                     edit=edit_attrs(km, edit)))


def edit_attrs(km: KnowledgeModel, edit: KnowledgeEdit) -> dict[str, Any]:
    """``edit`` as JSON-able attributes, entities and relation by name (for Dataset attrs)."""
    g = km.graph
    return {"entity": g.entity_names[edit.entity], "relation": g.relation_names[edit.relation],
            "true_object": g.entity_names[edit.true_object], "new_object": g.entity_names[edit.new_object],
            "distance": edit.distance, "method": edit.method, "layer": edit.layer,
            "layers": [int(l) for l in edit.info.get("layers", [edit.layer])]}
