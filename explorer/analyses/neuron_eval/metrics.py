"""The unified metrics of a (unit, concept) pair: binarised activations against the concept
(recall, precision, F1, IoU, AUC, AP, ...) and the correlations."""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import scipy.stats
import xarray as xr

from explorer._checks import InputError, check_choice, check_float, check_int

__all__ = [
    'CITATION', 'METRICS', 'METRIC_RANGES', 'BINARIZATIONS', 'binarize_activations',
    'paired_metrics', 'neuron_metrics',
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


_LOG_FLOOR = 1e-8  # log(c) of an absent concept (as in the paper's code)


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

    A dict metric -> array: the metrics are separate functions and their callers stack them.

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
