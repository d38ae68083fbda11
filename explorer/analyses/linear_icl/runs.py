"""Cached runs: the shipped runs (safetensors), the run and its analysis from the store, and
the summary over runs with different head counts."""
from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from explorer._checks import InputError
from explorer.analyses._training import (datasets_from_safetensors, datasets_to_safetensors,
                                         stored_training_run)
from explorer.analyses.linear_icl.analysis import linear_icl_analysis
from explorer.analyses.linear_icl.model import DEFAULTS, ProgressCallback
from explorer.analyses.linear_icl.training import _check_run, train_linear_icl
from explorer.defaults import DATASETS_DIR

__all__ = [
    'run_key_parts', 'SHIPPED_HEADS', 'SHIPPED_RUNS', 'save_linear_icl_runs_safetensors',
    'load_linear_icl_runs_safetensors', 'linear_icl_run', 'stored_linear_icl_analysis',
    'analysis_summary',
]


def run_key_parts(params: dict[str, Any]) -> dict[str, Any]:
    """The parts of the store key of the training run with ``params`` (`Store.key` hashes them).

    A dict: the store key's parts (JSON), not data.
    """
    return {"method": "linear_icl", "format": 1, **params}


#: The seed-0 runs with `DEFAULTS` for these head counts ship with the project, so the page
#: opens on them instead of training them (about 3 minutes of one CPU core).
SHIPPED_HEADS: tuple[int, ...] = (1, 2, 4)


#: The shipped runs: weights at every checkpoint in float16, losses at full precision, and the
#: `linear_icl_analysis` of those float16 weights; ``scripts/ship_linear_icl_runs.py`` writes it
#: and `tests/test_linear_icl.py` checks that re-training reproduces its first checkpoints.
SHIPPED_RUNS = DATASETS_DIR / "dynamics" / "linear_icl_seed0.safetensors"


_WEIGHTS = ("W_Q", "W_K", "W_V", "W_O")


def save_linear_icl_runs_safetensors(runs: Mapping[int, xr.Dataset], path: str | Path, *,
                                     analyses: Mapping[int, xr.Dataset] | None = None) -> Path:
    """Write runs (by head count; weights as float16) and optionally their analyses as one
    safetensors file.

    Tensors are named ``run_H<n>/<variable>`` and ``analysis_H<n>/<variable>``; dims and attrs
    are JSON in the metadata; no pickle. float16 keeps about 3 significant digits of a weight.
    """
    if not runs:
        raise InputError("`runs` must hold at least one run.")
    parts: dict[str, xr.Dataset] = {}
    for H, run in sorted(runs.items()):
        parts[f"run_H{int(H)}"] = _check_run(run)
        if analyses is not None:
            if H not in analyses:
                raise InputError(f"`analyses` has no analysis for the run with H = {H}.")
            parts[f"analysis_H{int(H)}"] = analyses[H]
    return datasets_to_safetensors(parts, path, half=_WEIGHTS,
                                   metadata={"weights_dtype": "float16", "heads": sorted(map(int, runs))})


def load_linear_icl_runs_safetensors(path: str | Path) -> tuple[dict[int, xr.Dataset], dict[int, xr.Dataset]]:
    """Read a file of `save_linear_icl_runs_safetensors`: the runs by head count (weights back
    in float32, the stored float16 values exactly) and the analyses it holds, by head count.

    A pair of dicts keyed by head count: the runs and their analyses, two Datasets of
    different dims each.
    """
    parts, _ = datasets_from_safetensors(path, as_float32=_WEIGHTS)
    runs = {int(k[len("run_H"):]): _check_run(v) for k, v in parts.items() if k.startswith("run_H")}
    if not runs:
        raise InputError(f"{str(path)!r} holds no linear-ICL run.")
    analyses = {int(k[len("analysis_H"):]): v for k, v in parts.items() if k.startswith("analysis_H")}
    return runs, analyses


def _shipped_run(full: dict[str, Any], store) -> xr.Dataset | None:
    """The shipped run if ``full`` is a default seed-0 setting with a shipped head count (and
    the file is there); its analysis goes into the store under the key
    `stored_linear_icl_analysis` reads."""
    H = full.get("n_heads")
    if {**full, "n_heads": DEFAULTS["n_heads"]} != DEFAULTS or H not in SHIPPED_HEADS \
            or not SHIPPED_RUNS.is_file():
        return None
    runs, analyses = load_linear_icl_runs_safetensors(SHIPPED_RUNS)
    if H not in runs:
        return None
    run = runs[H]
    run.attrs["source"] = (f"shipped with the project ({SHIPPED_RUNS.name}, weights in float16); "
                           "`explorer linear-icl train` re-trains it in full precision")
    if H in analyses:
        a = analyses[H]
        parts = _analysis_parts(run, a.attrs["params"]["n_prompts"], a.attrs["seed"])
        store.put(store.key(parts), a, parts=parts)
    return run


def linear_icl_run(*, store=None, retrain: bool = False, progress: ProgressCallback | None = None,
                   **params: Any) -> xr.Dataset:
    """The training run for ``params`` (see `train_linear_icl`), from the store or trained.

    A default seed-0 run with a head count in `SHIPPED_HEADS`, when the store lacks it, is
    read from `SHIPPED_RUNS` (float16 weights, with its analysis) instead of being trained.
    ``retrain=True`` trains again and replaces the stored run.
    """
    return stored_training_run(run_key_parts, train_linear_icl, DEFAULTS, params, what="linear-ICL",
                               store=store, retrain=retrain, progress=progress, shipped=_shipped_run)


def _analysis_parts(run: xr.Dataset, n_prompts: int, seed: int) -> dict[str, Any]:
    # The run is named by its parameters and a hash of its weights, so a changed run never
    # reads an analysis of another.
    digest = hashlib.sha256()
    for name in _WEIGHTS:
        digest.update(np.ascontiguousarray(run[name].values).tobytes())
    return {"method": "linear_icl_analysis", "format": 1,
            "run": {**run.attrs.get("params", {}), "seed": run.attrs.get("seed", 0)},
            "weights_sha256": digest.hexdigest()[:32], "n_prompts": n_prompts, "seed": seed}


def stored_linear_icl_analysis(run: xr.Dataset, *, store=None, n_prompts: int = 2048,
                               seed: int = 1) -> xr.Dataset:
    """`linear_icl_analysis` of a run, from the store or computed and stored.

    The key holds the run's parameters, seed and a hash of its weights, so the command
    line and the app share one stored analysis per run.
    """
    from explorer.store import ActivationStore

    run = _check_run(run)
    store = ActivationStore() if store is None else store
    parts = _analysis_parts(run, n_prompts, seed)
    return store.get_or_compute(parts, lambda: linear_icl_analysis(
        run, n_prompts=n_prompts, seed=seed)).load()


def analysis_summary(analyses: dict[int, xr.Dataset]) -> dict[str, Any]:
    """Headline numbers of `linear_icl_analysis` for runs with different head counts.

    A dict, not a Dataset: it is the Dataset's headline numbers as nested JSON scalars and
    lists, what the command's ``--json`` prints and a benchmark writes to docs/figures.
    """
    out: dict[str, Any] = {"runs": {}}
    for H, ds in sorted(analyses.items()):
        last = ds.isel(step=-1)
        train_L = int(ds.attrs["params"]["run_params"].get("context_length", DEFAULTS["context_length"]))
        out["runs"][str(H)] = {
            "n_heads": H,
            "train_seconds": ds.attrs.get("train_seconds"),
            "final_test_loss": ds.attrs.get("final_test_loss"),
            "omega": last["omega"].values.tolist(),
            "mu": last["mu"].values.tolist(),
            "kq_identity_error_max": float(last["kq_identity_error_max"]),
            "kq_offdiag_ratio": last["kq_offdiag_ratio"].values.tolist(),
            "ov_offy_ratio_max": float(last["ov_offy_ratio_max"]),
            "mu_sum_ratio": float(last["mu_sum_ratio"]),
            "dgd_r2": float(last["dgd_r2"]),
            "active_heads": int(last["active"].sum()),
            "pattern_step": ds.attrs.get("pattern_step"),
            "pattern_seconds": ds.attrs.get("pattern_seconds"),
            "pattern_r2": float(last["pattern_r2"]),
            "loss_by_context_length": {
                str(int(L)): {"model": float(last["baseline_model"].sel(context_length=L)),
                              "debiased_gd": float(last["baseline_debiased_gd"].sel(context_length=L)),
                              "bayes": float(last["baseline_bayes_expected"].sel(context_length=L))}
                for L in ds["context_length"].values},
            "train_context_length": train_L,
        }
    if "1" in out["runs"] and "2" in out["runs"]:
        a, b = out["runs"]["1"]["final_test_loss"], out["runs"]["2"]["final_test_loss"]
        if a is not None and b is not None:
            out["loss_gap_h1_minus_h2"] = a - b
    return out
