"""Storage of a trained knowledge model as safetensors (never pickle): `save_knowledge_model`,
`load_knowledge_model`, and the cache folder's copy by parameters (`knowledge_model`,
`is_stored`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from explorer._checks import InputError
from explorer.analyses.shattering.graph import CITATION, ProgressCallback
from explorer.analyses.shattering.model import (
    KnowledgeGPT,
    KnowledgeModel,
    _check_params,
    _graph_from_params,
    train_knowledge_model,
)

__all__ = ["save_knowledge_model", "load_knowledge_model", "knowledge_model", "is_stored"]


_MODEL_FORMAT = 1


def save_knowledge_model(km: KnowledgeModel, path: str | Path) -> Path:
    """Write the weights as safetensors; parameters and history go in its JSON metadata."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": str(_MODEL_FORMAT), "params": json.dumps(km.params),
            "config": json.dumps(km.model.config), "history": json.dumps(km.history),
            "train_seconds": str(km.train_seconds), "citation": CITATION}
    tensors = {k: v.detach().contiguous().clone() for k, v in km.model.state_dict().items()}
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)
    return path


def load_knowledge_model(path: str | Path) -> KnowledgeModel:
    """Read a model written by `save_knowledge_model` (the graph is rebuilt from its seed)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise InputError(f"no stored knowledge model at {str(path)!r}.")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != str(_MODEL_FORMAT):
        raise InputError(f"{str(path)!r} is not a knowledge model of format {_MODEL_FORMAT}.")
    params, config = json.loads(meta["params"]), json.loads(meta["config"])
    model = KnowledgeGPT(**config)
    model.load_state_dict(load_file(str(path)))
    model.eval()
    return KnowledgeModel(model, _graph_from_params(params), params, json.loads(meta["history"]),
                          float(meta["train_seconds"]))


def knowledge_model_path(store, params: dict[str, Any]) -> Path:
    """Where ``store`` keeps the trained knowledge model of ``params`` (a safetensors file)."""
    key = store.key({"method": "knowledge_gpt", "format": _MODEL_FORMAT, **params})
    return Path(store.path) / "shattering" / f"{key}.safetensors"


def knowledge_model(*, store=None, retrain: bool = False, progress: ProgressCallback | None = None,
                    **params: Any) -> KnowledgeModel:
    """The trained model for ``params`` from the cache folder, or trained now and saved.

    Parameters
    ----------
    store : explorer.store.ActivationStore, optional
        Its folder holds ``shattering/<key>.safetensors``; default: the cache folder.
    retrain : bool, default=False
    **params
        Keys of `DEFAULTS`; missing ones take the defaults.
    """
    from explorer.store import ActivationStore

    full = _check_params(params)
    store = ActivationStore() if store is None else store
    path = knowledge_model_path(store, full)
    if path.is_file() and not retrain:
        return load_knowledge_model(path)
    km = train_knowledge_model(progress=progress, **full)
    if km.history["step"] and km.history["step"][-1] == full["steps"]:  # not cancelled
        save_knowledge_model(km, path)
    return km


def is_stored(*, store=None, **params: Any) -> bool:
    """Whether a trained model for ``params`` is in the cache folder."""
    from explorer.store import ActivationStore

    store = ActivationStore() if store is None else store
    return knowledge_model_path(store, _check_params(params)).is_file()
