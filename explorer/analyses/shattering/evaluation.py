"""Scoring a knowledge model: top-1 accuracy by fact split (`fact_accuracy`), the entity
representations (`entity_representations`), their pairwise distances (`distance_matrix`) and
the shattering ratio ``R = ||D* - D0||_F / ||D0||_F`` (`shattering_ratio`).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import xarray as xr

from explorer._checks import InputError, check_int
from explorer.analyses.shattering.graph import CITATION, SPLITS, KnowledgeGraph
from explorer.analyses.shattering.model import KnowledgeGPT, KnowledgeModel

__all__ = ["fact_accuracy", "entity_representations", "distance_matrix", "shattering_ratio"]


def _fact_logits(model: KnowledgeGPT, graph: KnowledgeGraph) -> torch.Tensor:
    """Logits over entities after the prompt ``e r`` for every fact, ``[entity, relation, entity]``."""
    n, n_rel = graph.n_entities, graph.n_relations
    e = torch.arange(n).repeat_interleave(n_rel)
    r = torch.arange(n_rel).repeat(n) + n
    with torch.no_grad():
        logits = model(torch.stack([e, r], 1))[:, -1, :n]                  # [fact, entity]
    return logits.reshape(n, n_rel, n)


def fact_accuracy(km: KnowledgeModel, model: KnowledgeGPT | None = None, *,
                  exclude: Sequence[tuple[int, int]] = ()) -> xr.Dataset:
    """Top-1 accuracy on every fact ``e r -> e'``, by split.

    Parameters
    ----------
    km : KnowledgeModel
    model : KnowledgeGPT, optional
        An edited copy to score (default ``km.model``).
    exclude : sequence of (entity, relation)
        Facts left out of the split accuracies (the edited fact).

    Returns
    -------
    xarray.Dataset
        ``correct`` (entity, relation) bool; ``accuracy`` (split) over direct, logical,
        compositional facts and ``all``.
    """
    graph = km.graph
    model = km.model if model is None else model
    pred = _fact_logits(model, graph).argmax(-1).numpy()
    correct = pred == graph.objects()
    keep = np.ones_like(correct)
    for e, r in exclude:
        keep[e, r] = False
    acc = []
    for split in (*SPLITS, "all"):
        sel = keep & ((graph.split == split) if split != "all" else True)
        acc.append(float(correct[sel].mean()) if sel.any() else float("nan"))
    return xr.Dataset(
        {"correct": (("entity", "relation"), correct), "accuracy": (("split",), np.asarray(acc)),
         "prediction": (("entity", "relation"), pred)},
        coords={"entity": graph.entity_names, "relation": graph.relation_names,
                "split": [*SPLITS, "all"]},
        attrs=_attrs("fact_accuracy", km))


def entity_representations(model: KnowledgeGPT, n_entities: int, *, layer: int | None = None) -> torch.Tensor:
    """Residual stream after block ``layer`` (default: the last) at entity tokens on their own.

    Returns ``[entity, d_model]``: the prompt is the single entity token, so the rows are
    what any fact about that entity starts from.
    """
    n_layers = len(model.blocks)
    layer = n_layers - 1 if layer is None else check_int("layer", layer, low=0, high=n_layers - 1)
    with torch.no_grad():
        return model(torch.arange(n_entities)[:, None], resid_layer=layer)[:, 0]


def distance_matrix(reps: torch.Tensor | np.ndarray) -> np.ndarray:
    """Pairwise Euclidean distances between rows, ``[entity, entity]`` (float64)."""
    x = np.asarray(reps, dtype=np.float64)
    sq = (x * x).sum(1)
    d2 = np.maximum(sq[:, None] + sq[None, :] - 2 * x @ x.T, 0.0)
    np.fill_diagonal(d2, 0.0)
    return np.sqrt(d2)


def shattering_ratio(d0: np.ndarray, d_edit: np.ndarray) -> float:
    """``R = ||D* - D0||_F / ||D0||_F`` (Nishi et al., ICML 2025)."""
    d0, d_edit = np.asarray(d0, dtype=np.float64), np.asarray(d_edit, dtype=np.float64)
    if d0.shape != d_edit.shape or d0.ndim != 2:
        raise InputError(f"distance matrices must be 2-D and of one shape; got {d0.shape} and {d_edit.shape}.")
    norm = np.linalg.norm(d0)
    if norm == 0:
        raise InputError("the unedited distance matrix is all zero; R is undefined.")
    return float(np.linalg.norm(d_edit - d0) / norm)


def _attrs(method: str, km: KnowledgeModel, params: dict[str, Any] | None = None,
           **results: Any) -> dict[str, Any]:
    import explorer

    return {**results, "method": method, "model": "knowledge_gpt", "model_params": dict(km.params),
            "params": params or {}, "seed": km.params["seed"], "citation": CITATION,
            "versions": {"explorer": getattr(explorer, "__version__", "0"), "torch": torch.__version__,
                         "numpy": np.__version__}}
