"""The statistics of saturation, pure numpy (no model): saturation layers from lens ranks,
the position filter, the order test and the task probe.

* `saturation_from_ranks`, `kept_positions`: s_j per rank from the ranks of the final top-k
  tokens at every layer, and the s_1 <= max_ratio * L position filter (`NEVER`: not saturated).
* `strict_kendall_tau`, `order_test`, `tau_per_position`: strict Kendall tau between rank and
  saturation layer (ties discordant), its mean over positions with a seeded permutation test.
* `task_labels`, `task_probe`: how many leading ranks are decided at each layer, and a
  cross-validated logistic-regression probe of it from the hidden state, against a
  random-feature control.

The conventions are those of the package docstring (`explorer.analyses.saturation`).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import xarray as xr

from explorer._checks import InputError, check_float, check_int

__all__ = ["CITATION", "NEVER", "saturation_from_ranks", "kept_positions", "strict_kendall_tau",
           "order_test", "tau_per_position", "task_labels", "task_probe"]

CITATION = ("D. Lioubashevski, T. Schlank, G. Stanovsky, A. Goldstein, \"Looking Beyond the "
            "Top-1: Transformers Determine Top Tokens in Order\", ICML 2025.")

#: ``s_j`` of a token that is not at its final rank even at the last layer (ties only).
NEVER = -1


# -- saturation layers (pure) ------------------------------------------------------------

def saturation_from_ranks(ranks: Any) -> np.ndarray:
    """Saturation layer of each rank from the lens ranks of the final top-k tokens.

    Parameters
    ----------
    ranks : array-like of int, shape [..., layer, rank]
        ``ranks[..., l, j]``: rank (0 = top, strict) at layer l of the token that is
        rank j at the last layer.

    Returns
    -------
    numpy.ndarray of int64, shape [..., rank]
        ``s_j``: the smallest layer from which that token is at rank j at every later
        layer; 0 if it is there at every layer; `NEVER` (-1) if not even at the last layer.

    Examples
    --------
    >>> saturation_from_ranks([[3, 0], [0, 4], [0, 1], [0, 1]]).tolist()
    [1, 2]
    """
    r = np.asarray(ranks)
    if r.ndim < 2:
        raise InputError(f"`ranks` must have at least 2 dims [..., layer, rank]; got shape {r.shape}.")
    n_layers, k = r.shape[-2:]
    held = r == np.arange(k)                                  # [..., layer, rank]
    # layers from the end on which the token has held its rank without a break
    tail = np.cumprod(held[..., ::-1, :], axis=-2).sum(axis=-2)   # [..., rank]
    s = n_layers - tail
    return np.where(tail == 0, NEVER, s).astype(np.int64)


def kept_positions(sat_layer: Any, n_layers: int, *, max_ratio: float = 0.85) -> np.ndarray:
    """Positions whose top-1 saturates within the first ``max_ratio`` of the layers.

    True where ``0 <= s_1`` and ``s_1 + 1 <= max_ratio * n_layers`` (layers counted from 1,
    as in the paper's s_1 <= 0.85 L). ``sat_layer`` is [..., rank]; returns [...] bool.
    """
    max_ratio = check_float("max_ratio", max_ratio, low=0.0, high=1.0)
    s1 = np.asarray(sat_layer)[..., 0]
    return (s1 >= 0) & (s1 + 1 <= max_ratio * n_layers + 1e-9)


# -- order test --------------------------------------------------------------------------

def strict_kendall_tau(sat: Any) -> np.ndarray:
    """Strict Kendall tau between rank (0, 1, 2, ...) and saturation layers, per row.

    ``tau = (concordant - discordant) / pairs`` over rank pairs i < j, where a pair is
    concordant if ``s_i < s_j`` and discordant otherwise: ties count as discordant, so a
    row of equal layers scores -1 (Lioubashevski et al., ICML 2025).

    Parameters
    ----------
    sat : array-like, shape [..., m]
        Saturation layers of ranks 0..m-1 (m >= 2).

    Returns
    -------
    numpy.ndarray of float, shape [...]

    Examples
    --------
    >>> strict_kendall_tau([[1, 2, 3], [3, 2, 1], [2, 2, 2]]).tolist()
    [1.0, -1.0, -1.0]
    """
    s = np.asarray(sat)
    m = s.shape[-1]
    if m < 2:
        raise InputError(f"strict Kendall tau needs at least 2 ranks per row; got {m}.")
    i, j = np.triu_indices(m, 1)
    conc = (s[..., j] > s[..., i]).sum(-1)
    pairs = len(i)
    return (2 * conc - pairs) / pairs


def _tau_prefix_lengths(sat: np.ndarray, n_layers: int) -> np.ndarray:
    """Length of the prefix of ranks that saturate before the last layer."""
    valid = (sat >= 0) & (sat < n_layers - 1)
    return np.cumprod(valid, axis=-1).sum(-1)


def order_test(sat_layer: Any, n_layers: int, *, k: int = 5, min_ranks: int = 3,
               n_permutations: int = 1000, seed: int = 0) -> dict[str, Any]:
    """Do the top-k tokens saturate in rank order? Mean strict Kendall tau + permutation test.

    A dict of scalars: the test's statistics, which `saturation_summary` prints as they are.

    Per position the list (s_1..s_k) is cut before the first rank that saturates only at
    the last layer or never; positions with fewer than ``min_ranks`` ranks left are not
    counted. The null shuffles each position's list independently (``n_permutations``
    times, seeded); ``p = (1 + #{null mean >= observed mean}) / (1 + n_permutations)``.

    Parameters
    ----------
    sat_layer : array-like of int, shape [position, rank]
    n_layers : int
    k : int, default=5
        Ranks considered (at most ``sat_layer.shape[-1]``).
    min_ranks : int, default=3
    n_permutations : int, default=1000
    seed : int, default=0

    Returns
    -------
    dict
        ``tau`` [position] (NaN where not counted), ``tau_shuffled`` [position] (one
        shuffle of each counted position: the null shape for a histogram), ``mean_tau``,
        ``p_value``, ``null_mean_tau`` [n_permutations], ``n_positions`` (counted).

    References
    ----------
    Lioubashevski et al., ICML 2025 (strict tau, 1,000 permutations).
    """
    s = np.asarray(sat_layer)
    if s.ndim != 2:
        raise InputError(f"`sat_layer` must be [position, rank]; got shape {s.shape}.")
    k = check_int("k", k, low=2, high=s.shape[1])
    min_ranks = check_int("min_ranks", min_ranks, low=2, high=k)
    n_permutations = check_int("n_permutations", n_permutations, low=1)
    s = s[:, :k]
    m = _tau_prefix_lengths(s, n_layers)
    use = m >= min_ranks
    n = s.shape[0]
    tau = np.full(n, np.nan)
    shuffled = np.full(n, np.nan)
    null_sum = np.zeros(n_permutations)
    rng = np.random.default_rng(seed)
    for mm in np.unique(m[use]):
        idx = np.flatnonzero(m == mm)
        rows = s[idx, :mm]                                   # [n_g, mm]
        tau[idx] = strict_kendall_tau(rows)
        step = max(1, 4_000_000 // (len(idx) * mm))
        for b0 in range(0, n_permutations, step):
            nb = min(step, n_permutations - b0)
            order = rng.random((nb, len(idx), mm)).argsort(-1)   # [nb, n_g, mm]
            perm = np.take_along_axis(np.broadcast_to(rows, order.shape), order, -1)
            t = strict_kendall_tau(perm)                          # [nb, n_g]
            null_sum[b0:b0 + nb] += t.sum(1)
            if b0 == 0:
                shuffled[idx] = t[0]
    n_used = int(use.sum())
    if n_used == 0:
        return {"tau": tau, "tau_shuffled": shuffled, "mean_tau": float("nan"),
                "p_value": float("nan"), "null_mean_tau": np.full(n_permutations, np.nan),
                "n_positions": 0}
    mean = float(np.nanmean(tau))
    null_mean = null_sum / n_used
    p = (1 + int((null_mean >= mean - 1e-12).sum())) / (1 + n_permutations)
    return {"tau": tau, "tau_shuffled": shuffled, "mean_tau": mean, "p_value": float(p),
            "null_mean_tau": null_mean, "n_positions": n_used}


def tau_per_position(sat_layer: Any, n_layers: int, *, k: int = 5, min_ranks: int = 3) -> np.ndarray:
    """Strict Kendall tau of each position's (s_1..s_k), cut as in `order_test`.

    ``sat_layer`` is [..., rank]; returns [...] float64, NaN where fewer than
    ``min_ranks`` ranks saturate before the last layer.
    """
    s = np.asarray(sat_layer)[..., :k]
    m = _tau_prefix_lengths(s, n_layers)
    tau = np.full(m.shape, np.nan)
    for mm in np.unique(m[m >= min_ranks]):
        sel = m == mm
        tau[sel] = strict_kendall_tau(s[sel][:, :mm])
    return tau


# -- task probe --------------------------------------------------------------------------

def task_labels(sat_layer: Any, n_layers: int, *, n_tasks: int = 4) -> np.ndarray:
    """Task index per layer: how many of the top tokens are already decided there.

    At layer l the label is the number m of leading ranks whose saturation layer is at
    most l (ranks 1..m all fixed), capped at ``n_tasks - 1``. Label 0: the top-1 is still
    open; 1: the top-1 is fixed and rank 2 is open; and so on. (The paper numbers tasks
    from 1 and starts task i+1 one layer after s_i; here a layer at s_i already counts
    rank i as decided, which makes "label >= 1" exactly the oracle exit layer s_1.)

    Parameters
    ----------
    sat_layer : array-like of int, shape [position, rank]
    n_layers : int
    n_tasks : int, default=4

    Returns
    -------
    numpy.ndarray of int64, shape [position, layer]

    Examples
    --------
    >>> task_labels([[1, 2, 0]], 4, n_tasks=4).tolist()
    [[0, 1, 3, 3]]
    """
    s = np.asarray(sat_layer)
    n_tasks = check_int("n_tasks", n_tasks, low=2, high=s.shape[-1] + 1)
    s = s[:, :n_tasks - 1]
    layers = np.arange(n_layers)
    decided = (s[:, None, :] >= 0) & (s[:, None, :] <= layers[None, :, None])  # [pos, layer, rank]
    return np.cumprod(decided, axis=-1).sum(-1).astype(np.int64)


def _balanced_accuracy(y_true: np.ndarray, y_pred: np.ndarray, classes: Sequence[int]) -> float:
    """Mean recall over the classes present in ``y_true`` (NaN if none)."""
    recalls = [np.mean(y_pred[y_true == c] == c) for c in classes if np.any(y_true == c)]
    return float(np.mean(recalls)) if recalls else float("nan")


def _cv_probe(x: np.ndarray, y: np.ndarray, folds: np.ndarray, train_mask: np.ndarray,
              eval_mask: np.ndarray, classes: list[int], min_layer: int, max_per_class: int,
              rng: np.random.Generator) -> np.ndarray:
    """Out-of-fold predictions [position, layer] of a scaled logistic regression."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    n, n_layers, d = x.shape
    pred = np.full((n, n_layers), -1, dtype=np.int64)
    layer_ok = np.arange(n_layers) >= min_layer
    for f in np.unique(folds):
        train = (folds != f) & train_mask
        sample_ok = train[:, None] & layer_ok[None, :] & np.isin(y, classes)   # [pos, layer]
        pos_i, lay_i = np.nonzero(sample_ok)
        labels = y[pos_i, lay_i]
        counts = [int((labels == c).sum()) for c in classes]
        per_class = min(min(counts), max_per_class)
        pick = np.concatenate([rng.choice(np.flatnonzero(labels == c), per_class, replace=False)
                               for c in classes])
        clf = make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000))
        clf.fit(x[pos_i[pick], lay_i[pick]], labels[pick])
        test = np.flatnonzero(folds == f)
        pred[test] = clf.predict(x[test].reshape(-1, d)).reshape(len(test), n_layers)
    return pred


def _bootstrap_difference(y: np.ndarray, a: np.ndarray, b: np.ndarray, scored: np.ndarray,
                          classes: list[int], n_boot: int,
                          rng: np.random.Generator) -> tuple[float, float]:
    """95 % percentile interval of balanced accuracy(a) - balanced accuracy(b) over
    positions resampled with replacement (all layers of a position move together)."""
    n = y.shape[0]
    diffs = []
    for _ in range(n_boot):
        pick = rng.integers(0, n, n)
        ys, sc = y[pick], scored[pick]
        diffs.append(_balanced_accuracy(ys[sc], a[pick][sc], classes)
                     - _balanced_accuracy(ys[sc], b[pick][sc], classes))
    diffs = np.asarray(diffs)
    diffs = diffs[np.isfinite(diffs)]
    if not len(diffs):
        return float("nan"), float("nan")
    return float(np.percentile(diffs, 2.5)), float(np.percentile(diffs, 97.5))


def task_probe(features: Any, labels: Any, *, train_mask: Any = None, n_splits: int = 5,
               min_layer: int = 0, max_per_class: int = 1000, min_per_class: int = 5,
               control: bool = True, baselines: bool = True, n_boot: int = 1000,
               seed: int = 0) -> xr.Dataset:
    """Cross-validated task probe: which task (`task_labels`) is a hidden state on?

    Scikit-learn ``StandardScaler`` + ``LogisticRegression`` (multinomial, max_iter=1000)
    on hidden states of all layers pooled, with classes balanced by subsampling in each
    training fold. Folds split *positions* (all layers of a position are in one fold), so
    no token is seen in training and test. A control fits the same on Gaussian random
    features with the real features' per-dimension mean and std (expected: chance).

    The task labels rise with depth by construction, so a probe can score well from the
    layer alone. Two baselines measure that (``baselines``): a probe on the layer index
    only (one-hot; the best any depth-only rule can do under balanced training) and one on
    the residuals shuffled across positions within each layer (each layer's distribution
    kept, the token-to-label link broken). ``probe_minus_depth`` is the real probe's
    balanced accuracy minus the depth-only one, with a bootstrap interval over positions.

    Parameters
    ----------
    features : array-like of float, shape [position, layer, d_model]
    labels : array-like of int, shape [position, layer]
        Task index per layer; negative values are unlabelled and skipped.
    train_mask : array-like of bool, shape [position], optional
        Positions that may be trained on and scored (e.g. `kept_positions`); all others
        still get out-of-fold predictions (for early exit). Default: all.
    n_splits : int, default=5
    min_layer : int, default=0
        Layers below it are neither trained on nor scored (the paper's MIN_LAYER_FOR_PROBING).
    max_per_class : int, default=1000
        Cap on training samples per class and fold.
    min_per_class : int, default=5
        Classes with fewer training samples in any fold are left out.
    control : bool, default=True
    baselines : bool, default=True
        Fit the depth-only and shuffled-residual baselines.
    n_boot : int, default=1000
        Bootstrap resamples of positions for the probe-minus-depth interval (95 %).
    seed : int, default=0

    Returns
    -------
    xarray.Dataset
        ``probe_task`` (sample, layer): out-of-fold predicted task; ``probe_layer_accuracy``
        and ``control_layer_accuracy`` (layer): balanced accuracy per layer;
        ``probe_class_recall`` (layer, task); attrs ``balanced_accuracy``,
        ``control_balanced_accuracy``, ``chance`` (1 / number of classes), ``classes``.
        With ``baselines``: ``depth_layer_accuracy`` and ``shuffled_layer_accuracy``
        (layer), attrs ``depth_balanced_accuracy``, ``shuffled_balanced_accuracy``,
        ``probe_minus_depth`` and its ``probe_minus_depth_low`` / ``_high`` (95 %
        bootstrap over positions) and ``probe_beats_depth`` (the interval above 0).

    References
    ----------
    Lioubashevski et al., ICML 2025, "task transition" probing.
    """
    x = np.asarray(features, dtype=np.float32)
    y = np.asarray(labels, dtype=np.int64)
    if x.ndim != 3 or y.shape != x.shape[:2]:
        raise InputError(f"`features` must be [position, layer, d_model] and `labels` "
                         f"[position, layer]; got {x.shape} and {y.shape}.")
    n, n_layers, _ = x.shape
    n_splits = check_int("n_splits", n_splits, low=2, high=max(2, n))
    min_layer = check_int("min_layer", min_layer, low=0, high=n_layers - 1)
    max_per_class = check_int("max_per_class", max_per_class, low=1)
    min_per_class = check_int("min_per_class", min_per_class, low=1)
    train_mask = np.ones(n, bool) if train_mask is None else np.asarray(train_mask, bool)
    if n < n_splits:
        raise InputError(f"the probe needs at least n_splits={n_splits} positions; got {n}.")
    rng = np.random.default_rng(seed)
    folds = np.empty(n, dtype=np.int64)
    folds[rng.permutation(n)] = np.arange(n) % n_splits
    layer_ok = np.arange(n_layers) >= min_layer
    classes = []
    for c in np.unique(y[y >= 0]):
        per_fold = [int(((y == c) & ((folds != f) & train_mask)[:, None] & layer_ok).sum())
                    for f in range(n_splits)]
        if min(per_fold) >= min_per_class:
            classes.append(int(c))
    if len(classes) < 2:
        raise InputError(
            f"the probe needs at least 2 tasks with >= {min_per_class} training samples in "
            f"every fold; got {len(classes)} (labels {np.unique(y[y >= 0]).tolist()}). Use more "
            "text or positions.")

    scored = train_mask[:, None] & layer_ok[None, :] & np.isin(y, classes)   # [pos, layer]

    def evaluate(pred):
        overall = _balanced_accuracy(y[scored], pred[scored], classes)
        per_layer = np.array([_balanced_accuracy(y[scored[:, l], l], pred[scored[:, l], l], classes)
                              for l in range(n_layers)])
        recall = np.full((n_layers, len(classes)), np.nan)
        for l in range(n_layers):
            for ci, c in enumerate(classes):
                sel = scored[:, l] & (y[:, l] == c)
                if sel.any():
                    recall[l, ci] = np.mean(pred[sel, l] == c)
        return overall, per_layer, recall

    pred = _cv_probe(x, y, folds, train_mask, scored, classes, min_layer, max_per_class, rng)
    acc, layer_acc, recall = evaluate(pred)
    data = {
        "probe_task": (("sample", "layer"), pred),
        "probe_layer_accuracy": (("layer",), layer_acc),
        "probe_class_recall": (("layer", "task"), recall),
    }
    attrs = {"balanced_accuracy": acc, "chance": 1.0 / len(classes), "classes": classes,
             "n_splits": n_splits, "min_layer": min_layer}
    if control:
        flat = x.reshape(-1, x.shape[-1])
        mu, sd = flat.mean(0), flat.std(0)
        noise = rng.standard_normal(x.shape, dtype=np.float32) * sd + mu
        cpred = _cv_probe(noise, y, folds, train_mask, scored, classes, min_layer, max_per_class, rng)
        cacc, clayer, _ = evaluate(cpred)
        data["control_layer_accuracy"] = (("layer",), clayer)
        attrs["control_balanced_accuracy"] = cacc
    if baselines:
        n_boot = check_int("n_boot", n_boot, low=1)
        depth = np.broadcast_to(np.eye(n_layers, dtype=np.float32)[None], (n, n_layers, n_layers))
        dpred = _cv_probe(np.ascontiguousarray(depth), y, folds, train_mask, scored, classes,
                          min_layer, max_per_class, rng)
        dacc, dlayer, _ = evaluate(dpred)
        shuffled = np.stack([x[rng.permutation(n), layer] for layer in range(n_layers)], 1)
        spred = _cv_probe(shuffled, y, folds, train_mask, scored, classes, min_layer,
                          max_per_class, rng)
        sacc, slayer, _ = evaluate(spred)
        data["depth_layer_accuracy"] = (("layer",), dlayer)
        data["shuffled_layer_accuracy"] = (("layer",), slayer)
        low, high = _bootstrap_difference(y, pred, dpred, scored, classes, n_boot, rng)
        attrs.update(depth_balanced_accuracy=dacc, shuffled_balanced_accuracy=sacc,
                     probe_minus_depth=acc - dacc, probe_minus_depth_low=low,
                     probe_minus_depth_high=high, probe_beats_depth=bool(low > 0))
    return xr.Dataset(data, coords={"layer": np.arange(n_layers), "task": np.array(classes)},
                      attrs=attrs)
