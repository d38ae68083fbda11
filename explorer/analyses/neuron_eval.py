"""Evaluating neuron explanations: the unified metrics and the two sanity checks.

A unit (a neuron, an ITDA atom, a probe) has activations a over a probing set D; an
explanation is a concept with presence c in [0, 1] per input. Every metric scores the
pair (a, c); they differ in how they binarise a (the top ceil(alpha |D|) inputs, or a
threshold) and what they compare. The metrics keep the orientation of the paper's code
(Oikarinen et al., 2025): **recall** = |B(a) ∩ c| / |B(a)| and **precision** =
|B(a) ∩ c| / |c|, with B(a) the binarised activations and c the binarised concept
(c >= 0.5).

The sanity checks perturb a correct explanation and ask whether the score drops:
*missing labels* keeps each positive with probability 0.5 (an over-specific
explanation); *extra labels* adds positives with probability |c| / (|D| - |c|), doubling
|c| in expectation (an over-general one). The score change is normalised by the metric's
range; "decrease accuracy" is the fraction of (unit, seed) cases where it fell by more than
epsilon; a metric passes when its decrease accuracy exceeds 90% on both tests.

References
----------
T. Oikarinen, G. Yan, T.-W. Weng, "Evaluating Neuron Explanations: A Unified Framework with
Sanity Checks", ICML 2025.

S. Bills et al., "Language models can explain neurons in language models", 2023
(the top-and-random correlation).
"""
from __future__ import annotations

import math
import string
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import scipy.stats
import xarray as xr

from explorer._checks import InputError, check_choice, check_float, check_int

__all__ = [
    "METRICS",
    "METRIC_RANGES",
    "BINARIZATIONS",
    "binarize_activations",
    "neuron_metrics",
    "paired_metrics",
    "missing_labels",
    "extra_labels",
    "sanity_checks",
    "synthetic_sanity_checks",
    "token_concepts",
    "token_identity_concepts",
    "atom_probe_set",
    "itda_atom_sanity_checks",
    "ATOM_EXPLANATIONS",
    "NUMBER_WORDS",
]

CITATION = ("Oikarinen, Yan, Weng, 'Evaluating Neuron Explanations: A Unified Framework with "
            "Sanity Checks', ICML 2025")

#: Every metric of the framework, in the order of the paper's table.
METRICS = (
    "recall", "precision", "f1", "iou", "accuracy", "balanced_accuracy",
    "inverse_balanced_accuracy", "auc", "inverse_auc", "correlation", "spearman",
    "correlation_top_and_random", "cosine", "wpmi", "mad", "auprc", "inverse_auprc",
)

#: (min, max) of each metric, used to normalise score changes; None: unbounded, so the
#: sanity checks use the range of the scores they observe (as the paper's code does).
METRIC_RANGES: dict[str, tuple[float, float] | None] = {
    "recall": (0.0, 1.0), "precision": (0.0, 1.0), "f1": (0.0, 1.0), "iou": (0.0, 1.0),
    "accuracy": (0.0, 1.0), "balanced_accuracy": (0.0, 1.0), "inverse_balanced_accuracy": (0.0, 1.0),
    "auc": (0.0, 1.0), "inverse_auc": (0.0, 1.0), "correlation": (-1.0, 1.0),
    "spearman": (-1.0, 1.0), "correlation_top_and_random": (-1.0, 1.0), "cosine": (-1.0, 1.0),
    "wpmi": None, "mad": None, "auprc": (0.0, 1.0), "inverse_auprc": (0.0, 1.0),
}

#: How activations become "active" inputs B(a).
BINARIZATIONS = ("top_quantile", "threshold")

SANITY_TESTS = ("missing_labels", "extra_labels")

#: A default word list for token concepts: English number words.
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                "ten", "eleven", "twelve", "twenty", "thirty", "hundred", "thousand", "million",
                "first", "second", "third", "half")

_LOG_FLOOR = 1e-8  # log(c) of an absent concept (as in the paper's code)


# -- inputs -------------------------------------------------------------------------------

def _as_2d(name: str, x: Any, dim: str) -> tuple[np.ndarray, np.ndarray]:
    """[input, column] float64 array and the column labels (coords when a DataArray)."""
    if isinstance(x, xr.DataArray):
        if x.ndim != 2 or "input" not in x.dims:
            raise InputError(f"`{name}` must be a 2-d DataArray with an 'input' dim; got dims {x.dims}.")
        other = [d for d in x.dims if d != "input"][0]
        labels = np.asarray(x[other].values) if other in x.coords else np.arange(x.sizes[other])
        arr = np.asarray(x.transpose("input", other).values, dtype=np.float64)
    else:
        arr = np.asarray(x, dtype=np.float64)
        if arr.ndim == 1:
            arr = arr[:, None]
        if arr.ndim != 2:
            raise InputError(f"`{name}` must be [input, {dim}]; got shape {arr.shape}.")
        labels = np.arange(arr.shape[1])
    if arr.shape[0] < 2:
        raise InputError(f"`{name}` needs at least 2 inputs; got {arr.shape[0]}.")
    if not np.isfinite(arr).all():
        raise InputError(f"`{name}` holds NaN or inf.")
    return arr, labels


def _check_concepts(c: np.ndarray) -> None:
    if c.min() < 0 or c.max() > 1:
        raise InputError(f"`concepts` must be in [0, 1] (labels or probabilities); got values in "
                         f"[{c.min():g}, {c.max():g}].")


def binarize_activations(activations: Any, *, binarize: str = "top_quantile", alpha: float = 0.005,
                         threshold: float = 0.0) -> np.ndarray:
    """B(a): which inputs count as "active" for each unit.

    Parameters
    ----------
    activations : array-like, shape (n_inputs, n_units)
    binarize : {"top_quantile", "threshold"}, default="top_quantile"
        ``top_quantile``: the inputs at or above the ceil(alpha n)-th largest activation
        (ties included, as in the paper's code); ``threshold``: activation >= threshold.
    alpha : float, default=0.005
    threshold : float, default=0.0

    Returns
    -------
    numpy.ndarray of bool, shape (n_inputs, n_units)
    """
    a, _ = _as_2d("activations", activations, "unit")
    check_choice("binarize", binarize, BINARIZATIONS)
    if binarize == "threshold":
        return a >= check_float("threshold", threshold)
    alpha = check_float("alpha", alpha, low=0.0, high=1.0)
    if alpha == 0:
        raise InputError("`alpha` must be > 0 for binarize='top_quantile'; got 0.0.")
    k = math.ceil(alpha * a.shape[0])
    cutoff = -np.partition(-a, k - 1, axis=0)[k - 1]        # k-th largest per unit
    return a >= cutoff[None, :]


# -- the metrics (paired columns, broadcasting) ----------------------------------------------

def _div(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / max(den, 1): the paper's clamp, so an empty set scores 0."""
    return num / np.maximum(den, 1.0)


def _ranks(x: np.ndarray) -> np.ndarray:
    """Average ranks (1-based, ties share their mean rank) down each column."""
    return scipy.stats.rankdata(x, axis=0, method="average")


def _rank_auc(target: np.ndarray, score_ranks: np.ndarray) -> np.ndarray:
    """ROC AUC from ranks (Mann-Whitney), ties counting one half; NaN without both classes."""
    n = target.shape[0]
    n1 = target.sum(0)
    sum_r = (target * score_ranks).sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        auc = (sum_r - n1 * (n1 + 1) / 2) / (n1 * (n - n1))
    return np.where((n1 > 0) & (n1 < n), auc, np.nan)


def _average_precision(target: np.ndarray, score: np.ndarray) -> np.ndarray:
    """Average precision (area under the step PR curve; tied scores form one threshold)."""
    n, p = np.broadcast_shapes(target.shape, score.shape)
    target = np.broadcast_to(target, (n, p))
    out = np.full(p, np.nan)
    shared = score.shape[1] == 1
    cols = [slice(None)] if shared else [slice(j, j + 1) for j in range(p)]
    for col in cols:
        s = score[:, 0] if shared else score[:, col][:, 0]
        order = np.argsort(-s, kind="stable")
        s_sorted = s[order]
        ends = np.r_[np.flatnonzero(np.diff(s_sorted) != 0), n - 1]   # last index of each tie group
        t = target[order] if shared else target[:, col][order]        # [n, 1 or p]
        tp = np.cumsum(t, axis=0)[ends]                                 # [groups, cols]
        n1 = t.sum(0)
        prec = tp / (ends + 1)[:, None]
        with np.errstate(invalid="ignore", divide="ignore"):
            rec = tp / n1
        rec_prev = np.vstack([np.zeros((1, rec.shape[1])), rec[:-1]])
        ap = ((rec - rec_prev) * prec).sum(0)
        out[col] = np.where(n1 > 0, ap, np.nan)
    return out


def _pearson(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Pearson correlation down paired columns; 0 where either is constant (as the code does)."""
    x = x - x.mean(0)
    y = y - y.mean(0)
    sx = np.sqrt((x ** 2).mean(0))
    sy = np.sqrt((y ** 2).mean(0))
    return (x * y).mean(0) / (np.maximum(sx, 1e-9) * np.maximum(sy, 1e-9))


def _top_and_random(a: np.ndarray, c: np.ndarray, b: np.ndarray, k: int, rng: np.random.Generator
                    ) -> np.ndarray:
    """Correlation on k of the active inputs plus k random inputs (Bills et al., 2023)."""
    n, p = np.broadcast_shapes(a.shape, c.shape, b.shape)
    a, c, b = (np.broadcast_to(v, (n, p)) for v in (a, c, b))
    out = np.empty(p)
    for j in range(p):
        top = np.flatnonzero(b[:, j])
        top = rng.permutation(top)[:k]
        rand = rng.permutation(n)[:k]
        ids = np.concatenate([top, rand])
        out[j] = _pearson(a[ids, j][:, None], c[ids, j][:, None])[0]
    return out


def paired_metrics(activations: Any, concepts: Any, *, metrics: Sequence[str] = METRICS,
                   binarize: str = "top_quantile", alpha: float = 0.005, threshold: float = 0.0,
                   lam: float = 1.0, k: int = 25, seed: int = 0,
                   _cache: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Scores of unit j against concept j for every column j: {metric: [n_pairs]}.

    ``activations`` and ``concepts`` are [n_inputs, n_pairs] (either may have one column,
    broadcast to the other). See `neuron_metrics` for the options.
    """
    a, _ = _as_2d("activations", activations, "unit")
    c, _ = _as_2d("concepts", concepts, "concept")
    _check_concepts(c)
    if a.shape[0] != c.shape[0]:
        raise InputError(f"`activations` and `concepts` must cover the same inputs; got "
                         f"{a.shape[0]} and {c.shape[0]}.")
    metrics = [check_choice("metric", m, METRICS) for m in metrics]
    cache = {} if _cache is None else _cache
    if "b" not in cache:
        cache["b"] = binarize_activations(a, binarize=binarize, alpha=alpha, threshold=threshold
                                          ).astype(np.float64)
    b = cache["b"]
    cb = (c >= 0.5).astype(np.float64)
    n = a.shape[0]
    tp = (b * cb).sum(0)
    n_b = np.broadcast_to(b.sum(0), tp.shape)
    n_c = np.broadcast_to(cb.sum(0), tp.shape)
    fp, fn = n_b - tp, n_c - tp
    tn = n - tp - fp - fn
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for m in metrics:
        if m == "recall":
            v = _div(tp, n_b)
        elif m == "precision":
            v = _div(tp, n_c)
        elif m == "f1":
            v = _div(2 * tp, 2 * tp + fp + fn)
        elif m == "iou":
            v = _div(tp, n_b + n_c - tp)
        elif m == "accuracy":
            v = (tp + tn) / n
        elif m == "balanced_accuracy":
            v = (_div(tp, n_b) + _div(tn, n - n_b)) / 2
        elif m == "inverse_balanced_accuracy":
            v = (_div(tp, n_c) + _div(tn, n - n_c)) / 2
        elif m == "auc":                 # concept score ranked, neuron-binarised labels
            v = _rank_auc(b, _ranks(c))
        elif m == "inverse_auc":         # activation ranked, concept labels
            if "ranks_a" not in cache:
                cache["ranks_a"] = _ranks(a)
            v = _rank_auc(cb, cache["ranks_a"])
        elif m == "correlation":
            v = _pearson(a, c)
        elif m == "spearman":
            if "ranks_a" not in cache:
                cache["ranks_a"] = _ranks(a)
            v = _pearson(cache["ranks_a"], _ranks(c))
        elif m == "correlation_top_and_random":
            v = _top_and_random(a, c, b, k, rng)
        elif m == "cosine":
            v = (a * c).sum(0) / (np.maximum(np.linalg.norm(a, axis=0), 1e-9)
                                  * np.maximum(np.linalg.norm(c, axis=0), 1e-9))
        elif m == "wpmi":
            logc = np.log(np.maximum(c, _LOG_FLOOR))
            v = _div((b * logc).sum(0), n_b) - lam * np.log(np.maximum(c.mean(0), _LOG_FLOOR))
        elif m == "mad":
            v = _div((a * cb).sum(0), n_c) - _div((a * (1 - cb)).sum(0), n - n_c)
        elif m == "auprc":               # score = concept, target = binarised activations
            v = _average_precision(b, c)
        else:                            # inverse_auprc: score = activation, target = concept
            v = _average_precision(cb, a)
        out[m] = np.broadcast_to(np.asarray(v, dtype=np.float64), tp.shape).copy()
    return out


def neuron_metrics(activations: Any, concepts: Any, *, metrics: Sequence[str] = METRICS,
                   binarize: str = "top_quantile", alpha: float = 0.005, threshold: float = 0.0,
                   lam: float = 1.0, k: int = 25, seed: int = 0) -> xr.Dataset:
    """Every metric for every (unit, concept) pair: the unified framework's scores.

    Parameters
    ----------
    activations : array-like or DataArray, shape (n_inputs, n_units)
        Unit activations over the probing set (a DataArray with dims (input, unit) keeps
        its unit labels).
    concepts : array-like or DataArray, shape (n_inputs, n_concepts)
        Concept presence in [0, 1]; binarised at 0.5 where a metric needs labels.
    metrics : sequence of str, default=METRICS
    binarize : {"top_quantile", "threshold"}, default="top_quantile"
    alpha : float, default=0.005
        Top fraction of inputs counted active (``top_quantile``).
    threshold : float, default=0.0
        Activation at or above which an input is active (``threshold``).
    lam : float, default=1.0
        WPMI's weight on the concept's prior log-probability.
    k : int, default=25
        Inputs of each kind for the top-and-random correlation.
    seed : int, default=0
        Randomness of the top-and-random sampling.

    Returns
    -------
    xarray.Dataset
        ``score`` (metric, unit, concept); ``n_active`` (unit) and ``n_concept`` (concept).

    References
    ----------
    Oikarinen, Yan, Weng, "Evaluating Neuron Explanations: A Unified Framework with Sanity
    Checks", ICML 2025.
    """
    a, units = _as_2d("activations", activations, "unit")
    c, concept_labels = _as_2d("concepts", concepts, "concept")
    metrics = [check_choice("metric", m, METRICS) for m in metrics]
    if not metrics:
        raise InputError("`metrics` must name at least one metric.")
    check_int("k", k, low=1)
    check_float("lam", lam)
    b = binarize_activations(a, binarize=binarize, alpha=alpha, threshold=threshold).astype(np.float64)
    cache = {"b": b}
    score = np.empty((len(metrics), a.shape[1], c.shape[1]))
    for j in range(c.shape[1]):
        s = paired_metrics(a, c[:, j: j + 1], metrics=metrics, binarize=binarize, alpha=alpha,
                           threshold=threshold, lam=lam, k=k, seed=seed + j, _cache=cache)
        for i, m in enumerate(metrics):
            score[i, :, j] = s[m]
    return xr.Dataset(
        {"score": (("metric", "unit", "concept"), score),
         "n_active": ("unit", b.sum(0).astype(np.int64)),
         "n_concept": ("concept", (c >= 0.5).sum(0).astype(np.int64))},
        coords={"metric": list(metrics), "unit": units, "concept": concept_labels},
        attrs={"method": "neuron_metrics", "n_inputs": int(a.shape[0]),
               "params": {"binarize": binarize, "alpha": alpha, "threshold": threshold, "lam": lam,
                          "k": k, "seed": seed},
               "citation": CITATION})


# -- sanity checks ----------------------------------------------------------------------------

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


# -- token-level concepts ------------------------------------------------------------------------

def _is_punctuation(s: str) -> bool:
    return bool(s) and all(ch in string.punctuation or unicodedata.category(ch).startswith("P") for ch in s)


_CONCEPT_TESTS: dict[str, Callable[[str], bool]] = {
    "digit": lambda s: bool(s) and any(ch.isdigit() for ch in s) and all(ch.isdigit() or ch in ".,"
                                                                          for ch in s),
    "capitalised": lambda s: bool(s) and s[0].isupper(),
    "punctuation": _is_punctuation,
}


def token_concepts(tokens: Any, *, word_lists: Mapping[str, Sequence[str]] | None = None,
                   families: Sequence[str] = ("digit", "capitalised", "punctuation")) -> xr.DataArray:
    """Binary token-level concepts: digits, capitalised tokens, punctuation, word lists.

    Tokens are tested with surrounding whitespace stripped (" Paris" is capitalised). A
    word-list concept holds where the lower-cased stripped token is in the list.

    Parameters
    ----------
    tokens : sequence of str, shape (n_inputs,)
    word_lists : mapping of name -> words, optional
        Default: ``{"number_word": NUMBER_WORDS}``.
    families : sequence of {"digit", "capitalised", "punctuation"}

    Returns
    -------
    xarray.DataArray of float, dims (input, concept)
    """
    toks = [str(t).strip() for t in np.asarray(tokens).ravel()]
    if not toks:
        raise InputError("`tokens` is empty.")
    lists = {"number_word": NUMBER_WORDS} if word_lists is None else dict(word_lists)
    cols, names = [], []
    for fam in families:
        check_choice("family", fam, _CONCEPT_TESTS)
        cols.append([_CONCEPT_TESTS[fam](t) for t in toks])
        names.append(fam)
    for name, words in lists.items():
        vocab = {w.lower() for w in words}
        cols.append([t.lower() in vocab for t in toks])
        names.append(str(name))
    data = np.array(cols, dtype=np.float64).T.reshape(len(toks), len(names))
    return xr.DataArray(data, dims=("input", "concept"), coords={"concept": names},
                        attrs={"description": "token-level concepts (1 = present)"})


def token_identity_concepts(token_ids: Any, ids: Sequence[int], *, names: Sequence[str] | None = None
                            ) -> xr.DataArray:
    """Concept j holds where the input's token id is ``ids[j]`` ("the token is ' the'")."""
    tid = np.asarray(token_ids).ravel()
    ids = [int(i) for i in ids]
    data = (tid[:, None] == np.array(ids)[None, :]).astype(np.float64)
    labels = list(names) if names is not None else [str(i) for i in ids]
    return xr.DataArray(data, dims=("input", "concept"), coords={"concept": labels})


# -- real units: ITDA atoms with their own token as explanation ----------------------------------

#: How `itda_atom_sanity_checks` explains an atom, from its label alone.
ATOM_EXPLANATIONS = ("own_token", "token_family")


def atom_probe_set(activations: Any, *, site: str = "resid_post", layer: int | None = None,
                   min_pos: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The probing set of the ITDA-atom evaluations, from a traced activation Dataset.

    Returns ``(unit_x, token_id, token)``: every kept token's activation scaled to unit norm
    (float64, [input, d_model], so ``unit_x @ atom`` is the cosine an atom's activation is
    defined by), its token id and its token text (positions below ``min_pos`` left out).
    """
    from .itda import activation_chunks

    xs, ids, toks = [], [], []
    for chunk in activation_chunks(activations, site=site, layer=layer, min_pos=min_pos):
        xs.append(chunk["x"])
        ids.append(chunk["token_id"])
        toks.append(chunk["token"])
    x = np.concatenate(xs).astype(np.float64)
    unit_x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-30)
    return unit_x, np.concatenate(ids), np.concatenate(toks)


def itda_atom_sanity_checks(itda: Any, activations: Any, *, site: str = "resid_post",
                            layer: int | None = None, explanation: str = "own_token",
                            min_count: int = 3, max_units: int = 200, min_pos: int = 0,
                            word_lists: Mapping[str, Sequence[str]] | None = None,
                            **options: Any) -> xr.Dataset:
    """Sanity checks on ITDA atoms of a real model, each explained through its own label.

    Unit = an atom; its activation on a token = the cosine between the token's activation
    and the atom. The explanation comes from the atom's source token, known in advance
    (no metric picks it):

    * ``"own_token"``: "the token is the atom's source token";
    * ``"token_family"``: the token-level concept (`token_concepts`: digit, capitalised,
      punctuation, a word list) the source token belongs to; atoms whose token is in no
      family, or in more than one, are skipped.

    Units whose concept holds on fewer than ``min_count`` tokens of ``activations`` (the
    probing set) are skipped; positions below ``min_pos`` are left out of the probing set.
    Other options go to `sanity_checks`.

    Returns
    -------
    xarray.Dataset
        As `sanity_checks` (pooled rule), with ``atom_token``, ``explanation`` and
        ``n_concept`` (unit).
    """
    check_choice("explanation", explanation, ATOM_EXPLANATIONS)
    check_int("min_count", min_count, low=1)
    check_int("max_units", max_units, low=1)
    unit_x, tid, tokens = atom_probe_set(activations, site=site, layer=layer, min_pos=min_pos)
    atoms = itda.atoms_.astype(np.float64)
    if explanation == "own_token":
        atom_ids = itda.atom_token_id_
        concepts_all = None
        names = itda.atom_token_.astype(str)
        counts = np.array([(tid == t).sum() for t in atom_ids])
        eligible = (counts >= min_count) & (counts < len(tid))
    else:
        probe = token_concepts(tokens, word_lists=word_lists)                    # [input, family]
        src = token_concepts(itda.atom_token_, word_lists=word_lists).values     # [atom, family]
        fam_counts = probe.values.sum(0)
        single = src.sum(1) == 1
        fam_of = np.where(single, src.argmax(1), -1)
        concepts_all = probe.values
        names = np.array([str(probe["concept"].values[f]) if f >= 0 else "" for f in fam_of])
        counts = np.array([fam_counts[f] if f >= 0 else 0 for f in fam_of])
        eligible = (fam_of >= 0) & (counts >= min_count) & (counts < len(tid))
    keep = np.flatnonzero(eligible)[:max_units]
    if keep.size == 0:
        raise InputError(f"no atom's explanation ({explanation}) holds on at least {min_count} tokens of "
                         "the probing set; use more prompts or a smaller `min_count`.")
    acts = unit_x @ atoms[keep].T                                     # [n_inputs, units]
    if concepts_all is None:
        concepts = token_identity_concepts(tid, atom_ids[keep]).values
    else:
        concepts = concepts_all[:, fam_of[keep]]
    options.setdefault("pass_rule", "pooled")
    out = sanity_checks(xr.DataArray(acts, dims=("input", "unit"), coords={"unit": keep}),
                        concepts, **options)
    out.attrs["explanation"] = explanation
    return out.assign(atom_token=("unit", itda.atom_token_[keep]), explanation=("unit", names[keep]),
                      n_concept=("unit", counts[keep].astype(np.int64)))
