"""Cached runs: the run and its analysis from the store, and the shipped analysis."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from explorer._checks import InputError
from explorer.analyses._training import (datasets_from_safetensors, datasets_to_safetensors,
                                         stored_training_run)
from explorer.analyses.task_emergence.analysis import task_emergence_analysis
from explorer.analyses.task_emergence.tasks import DEFAULTS, ProgressCallback
from explorer.analyses.task_emergence.training import _check_run, train_task_emergence
from explorer.defaults import DATASETS_DIR

__all__ = [
    'run_key_parts', 'task_emergence_run', 'stored_task_emergence_analysis', 'SHIPPED_ANALYSIS',
    'save_analysis_safetensors', 'load_analysis_safetensors', 'default_analysis',
]


def run_key_parts(params: dict[str, Any]) -> dict[str, Any]:
    """The parts of the store key of the training run with ``params`` (`Store.key` hashes them).

    A dict: the store key's parts (JSON), not data.
    """
    return {"method": "task_emergence_run", "format": 1, **params}


def task_emergence_run(*, store=None, retrain: bool = False, progress: ProgressCallback | None = None,
                       **params: Any) -> xr.Dataset:
    """The training run for ``params`` (see `train_task_emergence`), from the store or trained."""
    return stored_training_run(run_key_parts, train_task_emergence, DEFAULTS, params,
                               what="task-emergence", store=store, retrain=retrain,
                               progress=progress)


def stored_task_emergence_analysis(run: xr.Dataset, *, store=None, n_per_task: int = 100, k: int = 10,
                                   seed: int = 1) -> xr.Dataset:
    """`task_emergence_analysis` of a run, from the store or computed and stored (keyed by the
    run's parameters and a hash of its weights)."""
    from explorer.store import ActivationStore

    run = _check_run(run)
    store = ActivationStore() if store is None else store
    digest = hashlib.sha256(np.ascontiguousarray(run["weights"].values).tobytes()).hexdigest()[:32]
    parts = {"method": "task_emergence_analysis", "format": 3,
             "run": {**run.attrs["params"], "seed": run.attrs.get("seed", 0)},
             "weights_sha256": digest, "n_per_task": n_per_task, "k": k, "seed": seed}
    return store.get_or_compute(parts, lambda: task_emergence_analysis(
        run, n_per_task=n_per_task, k=k, seed=seed)).load()


#: The analysis of the seed-0 run with `DEFAULTS`, shipped with the project so the page shows
#: it without training (the run's 81 checkpoints would take 50 MB; the analysis is small).
SHIPPED_ANALYSIS = (DATASETS_DIR / "dynamics"
                    / "task_emergence_seed0_analysis.safetensors")


def save_analysis_safetensors(analysis: xr.Dataset, path: str | Path) -> Path:
    """Write a `task_emergence_analysis` as safetensors (the PCA projection in float16)."""
    if not isinstance(analysis, xr.Dataset) or "td" not in analysis or "projection" not in analysis:
        raise InputError("`analysis` must be a Dataset from task_emergence_analysis.")
    return datasets_to_safetensors({"analysis": analysis}, path, half=("projection",))


def load_analysis_safetensors(path: str | Path) -> xr.Dataset:
    """Read a file of `save_analysis_safetensors` (the projection back in float32)."""
    parts, _ = datasets_from_safetensors(path, as_float32=("projection",))
    if "analysis" not in parts:
        raise InputError(f"{str(path)!r} holds no task-emergence analysis.")
    return parts["analysis"]


def default_analysis(*, store=None, progress: ProgressCallback | None = None) -> xr.Dataset:
    """The analysis of the default seed-0 run: from the store if the run is stored there,
    else the shipped one (`SHIPPED_ANALYSIS`), else the run is trained and analysed."""
    from explorer.store import ActivationStore

    store = ActivationStore() if store is None else store
    stored = store.get(store.key(run_key_parts(dict(DEFAULTS))), verify=False)
    if stored is None and SHIPPED_ANALYSIS.is_file():
        analysis = load_analysis_safetensors(SHIPPED_ANALYSIS)
        analysis.attrs["source"] = (f"shipped with the project ({SHIPPED_ANALYSIS.name}); "
                                    "`explorer task-emergence train` trains the run itself")
        return analysis
    run = stored.load() if stored is not None else task_emergence_run(store=store, progress=progress)
    return stored_task_emergence_analysis(run, store=store)
