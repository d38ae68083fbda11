"""Shared pieces of the training-dynamics modules (parity, linear ICL, task emergence).

A terminal progress bar for the command line, the version stamp of a run's attrs, and the
store lookup that returns a stored training run or trains and stores it.
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import xarray as xr

from explorer._checks import InputError

__all__ = ["ProgressCallback", "terminal_progress", "training_versions", "stored_training_run"]

ProgressCallback = Callable[[int, int], Any]


def terminal_progress(label: str, unit: str = "step") -> ProgressCallback:
    """A ``progress(done, total)`` callback drawing a tqdm bar on stderr."""
    from tqdm import tqdm

    bar: dict[str, Any] = {}

    def update(done: int, total: int) -> None:
        if "bar" not in bar:
            bar["bar"] = tqdm(total=total, desc=label, unit=unit, file=sys.stderr, leave=False)
        bar["bar"].update(done - bar["bar"].n)
        if done >= total:
            bar["bar"].close()

    return update


def training_versions() -> dict[str, str]:
    """Versions of explorer, torch, numpy and xarray, for a run's attrs."""
    import numpy as np
    import torch

    from explorer import __version__

    return {"explorer": __version__, "torch": torch.__version__, "numpy": np.__version__,
            "xarray": xr.__version__}


def stored_training_run(parts_of: Callable[[dict[str, Any]], dict[str, Any]],
                        train: Callable[..., xr.Dataset], defaults: Mapping[str, Any],
                        params: Mapping[str, Any], *, what: str, store=None, retrain: bool = False,
                        progress: ProgressCallback | None = None) -> xr.Dataset:
    """The run of ``train(**defaults, **params)``, from the store or trained and stored.

    ``parts_of(full_params)`` names the store entry; ``what`` names the run in the error for
    an unknown parameter.
    """
    from explorer.store import ActivationStore

    unknown = sorted(set(params) - set(defaults))
    if unknown:
        raise InputError(f"unknown {what} training parameter {unknown[0]!r}; allowed: "
                         f"{', '.join(defaults)}.")
    full = {**defaults, **params}
    store = ActivationStore() if store is None else store
    parts = parts_of(full)
    if retrain:
        store.put(store.key(parts), train(**full, progress=progress), parts=parts)
    return store.get_or_compute(parts, lambda: train(**full, progress=progress)).load()
