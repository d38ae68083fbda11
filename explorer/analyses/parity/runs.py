"""Cached parity runs and their analysis: the run for a setting from the store or trained
(`parity_run`), the shipped seed-0 run (`SHIPPED_RUN`) and its safetensors format
(`save_parity_run_safetensors`, `load_parity_run_safetensors`), the analysis over training
(`parity_analysis`, cached by `stored_parity_analysis`) and its headline numbers
(`analysis_summary`).
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from explorer.defaults import DATASETS_DIR
from explorer._checks import InputError
from explorer.analyses._training import (
    datasets_from_safetensors,
    datasets_to_safetensors,
    stored_training_run,
)
from explorer.analyses.parity.automaton import parity_automaton_sizes
from explorer.analyses.parity.generalisation import parity_long_accuracy
from explorer.analyses.parity.network import DEFAULTS, LONG_LENGTHS, ProgressCallback, _attrs
from explorer.analyses.parity.training import _check_run, train_parity_rnn

__all__ = [
    "parity_run",
    "SHIPPED_RUN",
    "save_parity_run_safetensors",
    "load_parity_run_safetensors",
    "parity_analysis",
    "stored_parity_analysis",
    "analysis_summary",
]


def run_key_parts(params: dict[str, Any]) -> dict[str, Any]:
    """The parts of the store key of the training run with ``params`` (`Store.key` hashes them)."""
    return {"method": "parity_rnn", "format": 1, **params}


#: The seed-0 run with `DEFAULTS`, shipped with the project: its weights at every checkpoint
#: in float16 and the `parity_analysis` of those float16 weights (``explorer parity train``
#: re-trains it in full precision; `tests/test_parity.py` checks that the two agree).
SHIPPED_RUN = DATASETS_DIR / "dynamics" / "parity_seed0.safetensors"

_WEIGHTS = ("W_ih", "W_hh", "b_h", "W_out", "b_out")


def save_parity_run_safetensors(run: xr.Dataset, path: str | Path, *,
                                analysis: xr.Dataset | None = None) -> Path:
    """Write a run (weights as float16) and optionally its analysis as one safetensors file.

    Tensors are named ``run/<variable>`` and ``analysis/<variable>``; dims and attrs are
    JSON in the metadata; no pickle. float16 keeps about 3 significant digits of each
    weight and halves the file (101 checkpoints of the default run: 2.1 MB).
    """
    run = _check_run(run)
    parts = {"run": run} if analysis is None else {"run": run, "analysis": analysis}
    return datasets_to_safetensors(parts, path, half=_WEIGHTS, metadata={"weights_dtype": "float16"})


def load_parity_run_safetensors(path: str | Path) -> tuple[xr.Dataset, xr.Dataset | None]:
    """Read a file of `save_parity_run_safetensors`: the run (weights back in float32, the
    stored float16 values exactly) and its analysis, or None if the file has none.

    A tuple: the file holds two Datasets, the run and its analysis.
    """
    parts, _ = datasets_from_safetensors(path, as_float32=_WEIGHTS)
    if "run" not in parts:
        raise InputError(f"{str(path)!r} holds no parity run.")
    return _check_run(parts["run"]), parts.get("analysis")


def _shipped_run(full: dict[str, Any], store) -> xr.Dataset | None:
    """The shipped run if ``full`` is the default seed-0 setting (and the file is there); its
    analysis goes into the store under the key `stored_parity_analysis` reads."""
    if full != DEFAULTS or not SHIPPED_RUN.is_file():
        return None
    run, analysis = load_parity_run_safetensors(SHIPPED_RUN)
    run.attrs["source"] = (f"shipped with the project ({SHIPPED_RUN.name}, weights in float16); "
                           "`explorer parity train` re-trains it in full precision")
    if analysis is not None:
        p = analysis.attrs["params"]
        parts = _analysis_parts(run, p["max_length"], p["threshold"], p["n_strings"], analysis.attrs["seed"])
        store.put(store.key(parts), analysis, parts=parts)
    return run


def parity_run(*, store=None, retrain: bool = False, progress: ProgressCallback | None = None,
               **params: Any) -> xr.Dataset:
    """The training run for ``params`` (see `train_parity_rnn`), from the store or trained.

    The default seed-0 run, when the store lacks it, is read from `SHIPPED_RUN` (float16
    weights, with its analysis) instead of being trained (about 2 minutes).

    Parameters
    ----------
    store : explorer.store.ActivationStore, optional
        Default: the store in the cache folder (``$EXPLORER_CACHE``).
    retrain : bool, default=False
        Train again and replace the stored run.
    **params
        Arguments of `train_parity_rnn`; missing ones take `DEFAULTS`.
    """
    return stored_training_run(run_key_parts, train_parity_rnn, DEFAULTS, params, what="parity",
                               store=store, retrain=retrain, progress=progress, shipped=_shipped_run)


def parity_analysis(run: xr.Dataset, *, max_length: int = 8, threshold: float = 0.01,
                    lengths: Sequence[int] = LONG_LENGTHS, n_strings: int = 20,
                    seed: int = 0) -> xr.Dataset:
    """Automaton sizes and long-string accuracy over training, in one Dataset (step dim)."""
    sizes = parity_automaton_sizes(run, max_length=max_length, threshold=threshold)
    acc = parity_long_accuracy(run, lengths=lengths, n_strings=n_strings, seed=seed)
    ds = xr.merge([sizes, acc, run[["train_loss", "train_accuracy"]]], compat="override",
                  combine_attrs="drop")
    ds.attrs = _attrs("parity_analysis", {"max_length": max_length, "threshold": threshold,
                                          "lengths": list(map(int, acc["length"].values)),
                                          "n_strings": n_strings, "run_params": run.attrs.get("params")},
                      seed, transition_step=sizes.attrs["transition_step"],
                      transition_epoch=sizes.attrs["transition_epoch"],
                      generalisation_step=acc.attrs["generalisation_step"],
                      train_seconds=run.attrs.get("train_seconds"),
                      transition_seconds=_wall_at(run, sizes.attrs["transition_step"]),
                      generalisation_seconds=_wall_at(run, acc.attrs["generalisation_step"]))
    return ds


def _wall_at(run: xr.Dataset, step: int | None) -> float | None:
    """Training time until checkpoint ``step`` (None if unknown)."""
    if step is None or "wall_seconds" not in run.coords:
        return None
    wall = float(run["wall_seconds"].sel(step=step))
    return None if np.isnan(wall) else round(wall, 3)


def _analysis_parts(run: xr.Dataset, max_length: int, threshold: float, n_strings: int,
                    seed: int) -> dict[str, Any]:
    # The run is named by its parameters and a hash of its weights, so a changed run never
    # reads an analysis of another.
    digest = hashlib.sha256()
    for name in ("W_ih", "W_hh", "W_out"):
        digest.update(np.ascontiguousarray(run[name].values).tobytes())
    return {"method": "parity_analysis", "format": 1,
            "run": {**run.attrs.get("params", {}), "seed": run.attrs.get("seed", 0)},
            "weights_sha256": digest.hexdigest()[:32],
            "max_length": max_length, "threshold": threshold, "n_strings": n_strings, "seed": seed}


def stored_parity_analysis(run: xr.Dataset, *, store=None, max_length: int = 8,
                           threshold: float = 0.01, n_strings: int = 20,
                           seed: int = 0) -> xr.Dataset:
    """`parity_analysis` of a trained run, from the store or computed and stored.

    The key holds the run's training parameters and seed, so the command line and the
    app share one stored analysis per run and setting.
    """
    from explorer.store import ActivationStore

    run = _check_run(run)
    store = ActivationStore() if store is None else store
    parts = _analysis_parts(run, max_length, threshold, n_strings, seed)
    return store.get_or_compute(parts, lambda: parity_analysis(
        run, max_length=max_length, threshold=threshold, n_strings=n_strings, seed=seed)).load()


def analysis_summary(analysis: xr.Dataset) -> dict[str, Any]:
    """The headline numbers of `parity_analysis`, JSON-able.

    A dict, not a Dataset: it is the Dataset's headline numbers as nested JSON scalars and
    lists, what the command's ``--json`` prints and a benchmark writes to docs/figures.
    """
    last = analysis.isel(step=-1)
    return {
        "transition_step": analysis.attrs["transition_step"],
        "transition_epoch": analysis.attrs["transition_epoch"],
        "generalisation_step": analysis.attrs["generalisation_step"],
        "final_n_states": int(last["n_states"]),
        "final_n_states_minimal": int(last["n_states_minimal"]),
        "final_finite": bool(last["finite"]),
        "final_accuracy": {int(n): float(a) for n, a in zip(analysis["length"].values,
                                                            last["accuracy"].values)},
        "final_train_loss": float(last["train_loss"]),
        "train_seconds": analysis.attrs.get("train_seconds"),
        "transition_seconds": analysis.attrs.get("transition_seconds"),
        "generalisation_seconds": analysis.attrs.get("generalisation_seconds"),
    }
