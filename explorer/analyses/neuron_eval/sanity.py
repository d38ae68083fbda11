"""The two sanity checks: does a metric's score drop when a correct explanation loses labels
(missing labels) or gains wrong ones (extra labels)?"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import xarray as xr

from explorer._checks import InputError, check_choice, check_float, check_int
from explorer.analyses.neuron_eval.metrics import (CITATION, METRICS, METRIC_RANGES, _as_2d,
                                                   _check_concepts, paired_metrics)

__all__ = [
    'SANITY_TESTS', 'missing_labels', 'extra_labels', 'sanity_checks', 'synthetic_sanity_checks',
]


SANITY_TESTS = ("missing_labels", "extra_labels")


def missing_labels(concepts: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """c ⊙ Bernoulli(0.5): each positive kept with probability 1/2 (an over-specific explanation)."""
    c = np.asarray(concepts, dtype=np.float64)
    return c * (rng.random(c.shape) > 0.5)


def extra_labels(concepts: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """clip(c + Bernoulli(p)), p = |c| / (|D| - |c|) per concept: |c| doubles in expectation."""
    c = np.asarray(concepts, dtype=np.float64)
    total = c.sum(0, keepdims=True)
    p = total / np.maximum(c.shape[0] - total, 1.0)
    return np.minimum(c + (rng.random(c.shape) < p), 1.0)


_PERTURB: dict[str, Callable[[np.ndarray, np.random.Generator], np.ndarray]] = {
    "missing_labels": missing_labels, "extra_labels": extra_labels}


def sanity_checks(activations: Any, concepts: Any, *, metrics: Sequence[str] = METRICS,
                  n_seeds: int = 100, epsilon: float = 1e-3, pass_fraction: float = 0.9,
                  pass_rule: str = "pooled", binarize: str = "top_quantile", alpha: float = 0.005,
                  threshold: float = 0.0, lam: float = 1.0, k: int = 25, seed: int = 0,
                  progress: Callable[[int, int], None] | None = None) -> xr.Dataset:
    """The missing-labels and extra-labels sanity checks over units with known explanations.

    Column j of ``concepts`` is taken as the correct explanation of unit (column) j of
    ``activations``. For each seed, both perturbations are drawn, every metric is scored
    on the perturbed concept, and Δ = (s(a, c') - s(a, c)) / (max - min of the metric).

    Parameters
    ----------
    activations : array-like, shape (n_inputs, n_units)
    concepts : array-like, shape (n_inputs, n_units)
        The explanation of each unit, paired by column.
    n_seeds : int, default=100
    epsilon : float, default=1e-3
        A decrease counts when Δ < -epsilon.
    pass_fraction : float, default=0.9
        A metric passes a test when its decrease accuracy exceeds this.
    pass_rule : {"pooled", "every_unit"}, default="pooled"
        Decrease accuracy over all (unit, seed) cases, or required of every unit (the
        paper's theoretical test, where each unit is one activation frequency).
    seed : int, default=0
    Other options as in `neuron_metrics`.

    Returns
    -------
    xarray.Dataset
        ``score`` (metric, unit): the unperturbed scores; ``delta`` (test, metric, unit,
        seed); ``mean_delta`` (test, metric, unit); ``decrease_accuracy`` (test, metric,
        unit) over seeds and ``pooled_decrease_accuracy`` (test, metric); ``passed``
        (test, metric) and ``passed_both`` (metric): the pass/fail table.
    """
    a, units = _as_2d("activations", activations, "unit")
    c, _ = _as_2d("concepts", concepts, "concept")
    _check_concepts(c)
    if a.shape != c.shape:
        raise InputError(f"`activations` and `concepts` must pair unit j with concept j (same shape); "
                         f"got {a.shape} and {c.shape}.")
    metrics = [check_choice("metric", m, METRICS) for m in metrics]
    check_int("n_seeds", n_seeds, low=1)
    check_float("epsilon", epsilon, low=0.0)
    check_float("pass_fraction", pass_fraction, low=0.0, high=1.0)
    check_choice("pass_rule", pass_rule, ("pooled", "every_unit"))
    opts = dict(binarize=binarize, alpha=alpha, threshold=threshold, lam=lam, k=k)
    cache: dict[str, np.ndarray] = {}
    base = paired_metrics(a, c, metrics=metrics, seed=seed, _cache=cache, **opts)
    rng = np.random.default_rng(seed)
    raw = np.empty((len(SANITY_TESTS), len(metrics), a.shape[1], n_seeds))
    for s in range(n_seeds):
        for t, test in enumerate(SANITY_TESTS):
            perturbed = _PERTURB[test](c, rng)
            got = paired_metrics(a, perturbed, metrics=metrics, seed=seed + 1 + 2 * s + t,
                                 _cache=cache, **opts)
            for i, m in enumerate(metrics):
                raw[t, i, :, s] = got[m]
        if progress is not None:
            progress(s + 1, n_seeds)
    base_arr = np.stack([base[m] for m in metrics])                 # [metric, unit]
    delta = np.empty_like(raw)
    for i, m in enumerate(metrics):
        rng_m = METRIC_RANGES[m]
        if rng_m is None:                                            # unbounded: observed range
            seen = np.concatenate([base_arr[i].ravel(), raw[:, i].ravel()])
            seen = seen[np.isfinite(seen)]
            lo, hi = (seen.min(), seen.max()) if seen.size else (0.0, 1.0)
        else:
            lo, hi = rng_m
        span = hi - lo if hi > lo else 1.0
        delta[:, i] = (raw[:, i] - base_arr[i][None, :, None]) / span
    with np.errstate(invalid="ignore"):
        decreased = delta < -epsilon                                  # NaN counts as no decrease
    dec_acc = decreased.mean(-1)                                      # [test, metric, unit]
    pooled = decreased.reshape(len(SANITY_TESTS), len(metrics), -1).mean(-1)
    if pass_rule == "pooled":
        passed = pooled > pass_fraction
    else:
        passed = (dec_acc > pass_fraction).all(-1)
    return xr.Dataset(
        {"score": (("metric", "unit"), base_arr),
         "delta": (("test", "metric", "unit", "seed"), delta),
         "mean_delta": (("test", "metric", "unit"), np.nanmean(delta, -1)),
         "decrease_accuracy": (("test", "metric", "unit"), dec_acc),
         "pooled_decrease_accuracy": (("test", "metric"), pooled),
         "passed": (("test", "metric"), passed),
         "passed_both": (("metric",), passed.all(0))},
        coords={"test": list(SANITY_TESTS), "metric": list(metrics), "unit": units,
                "seed": np.arange(n_seeds)},
        attrs={"method": "neuron_sanity_checks", "n_inputs": int(a.shape[0]),
               "params": {**opts, "n_seeds": n_seeds, "epsilon": epsilon,
                          "pass_fraction": pass_fraction, "pass_rule": pass_rule, "seed": seed},
               "citation": CITATION})


def synthetic_sanity_checks(*, frequencies: Sequence[float] = (0.499, 0.1, 0.01, 0.001, 0.0001),
                            n_inputs: int = 100_000, n_seeds: int = 100,
                            metrics: Sequence[str] = METRICS, epsilon: float = 1e-3,
                            seed: int = 0, progress: Callable[[int, int], None] | None = None
                            ) -> xr.Dataset:
    """The paper's theoretical test: units identical to their concepts, one per frequency.

    Unit j fires (activation 1) on the first round(gamma_j n) inputs and its concept is the
    same indicator, so the explanation is perfect; activations are binarised at 0.5 (the
    paper's "already binary"). A metric passes when every frequency passes both tests.

    Returns
    -------
    xarray.Dataset
        As `sanity_checks`, with the unit coordinate the activation frequency gamma.
    """
    check_int("n_inputs", n_inputs, low=10)
    freqs = [check_float("frequency", f, low=0.0, high=1.0) for f in frequencies]
    if not freqs:
        raise InputError("`frequencies` must hold at least one value.")
    counts = [int(f * n_inputs) for f in freqs]
    if min(counts) < 1:
        raise InputError(f"`n_inputs`={n_inputs} gives no positive input at frequency "
                         f"{freqs[counts.index(min(counts))]}; use more inputs.")
    c = np.zeros((n_inputs, len(freqs)))
    for j, n_pos in enumerate(counts):
        c[:n_pos, j] = 1.0
    act = xr.DataArray(c, dims=("input", "unit"), coords={"unit": np.array(freqs)})
    out = sanity_checks(act, c, metrics=metrics, n_seeds=n_seeds, epsilon=epsilon,
                        pass_rule="every_unit", binarize="threshold", threshold=0.5, seed=seed,
                        progress=progress)
    out = out.rename({"unit": "frequency"})
    out.attrs["method"] = "neuron_synthetic_sanity_checks"
    return out
