"""The known-unit meta-evaluation of neuron-explanation metrics (Oikarinen, Yan & Weng, ICML
2025, "known neuron AUPRC"): score every metric by how well it ranks each unit's correct
explanation above the wrong ones.

The paper's procedure (``known_neuron_auprc_eval.ipynb`` of its repository): units whose
correct concept is known (a classifier's output neurons, each its own class); every metric
scores every (unit, concept) pair; the meta-score is the binary AUPRC of those scores,
flattened over all pairs, against the one-hot correct concept. Metrics with a binarisation
parameter pick ``alpha`` (the top fraction of inputs counted active) on a 5 % validation
split of the units, by the same AUPRC, and are reported on the other 95 %.

`known_unit_meta_auprc` does this for any activations / concepts / correct-concept triple;
`itda_known_atom_meta_auprc` supplies the known units of a language model: ITDA atoms, each
explained by its own source token ("the token is the atom's token"; the unit's activation is
the cosine of a token's activation with the atom), against the source tokens of the other
atoms as the wrong explanations. That set is easy: the unit's activation is close to an
indicator of its explanation. `probe_known_unit_meta_auprc` supplies a harder one: linear
probes trained on one half of the probing set to detect a token category (digits,
capitalised tokens, punctuation, number words), each explained by its category on the other
half. `meta_auprc_over_splits` repeats either over validation / test splits of the units and
gives the spread.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import xarray as xr

from explorer._checks import InputError, check_float, check_int
from explorer.analyses.neuron_eval import (
    CITATION,
    METRICS,
    atom_probe_set,
    neuron_metrics,
    token_concepts,
    token_identity_concepts,
)

__all__ = ["known_unit_meta_auprc", "itda_known_atom_meta_auprc", "ALPHA_METRICS",
           "ALPHA_GRID", "pooled_auprc", "probe_known_unit_meta_auprc", "meta_auprc_over_splits"]

#: Metrics that read the binarised activations, so depend on ``alpha`` (tuned on validation).
ALPHA_METRICS = ("recall", "precision", "f1", "iou", "accuracy", "balanced_accuracy",
                 "inverse_balanced_accuracy", "auc", "correlation_top_and_random", "wpmi",
                 "auprc")

#: The paper's grid of ``alpha`` values.
ALPHA_GRID = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)


def pooled_auprc(scores: np.ndarray, correct: np.ndarray) -> float:
    """Binary AUPRC (average precision, scikit-learn) of ``scores`` [unit, concept] against
    the one-hot ``correct`` [unit, concept], flattened over all pairs; NaN scores rank last."""
    from sklearn.metrics import average_precision_score

    s = np.asarray(scores, dtype=np.float64).ravel()
    finite = np.isfinite(s)
    s = np.where(finite, s, s[finite].min() - 1.0 if finite.any() else 0.0)
    return float(average_precision_score(np.asarray(correct, bool).ravel(), s))


def known_unit_meta_auprc(activations: Any, concepts: Any, correct: Sequence[int], *,
                          metrics: Sequence[str] = METRICS, alphas: Sequence[float] = ALPHA_GRID,
                          val_fraction: float = 0.05, seed: int = 0,
                          **options: Any) -> xr.Dataset:
    """Meta-AUPRC of every metric on units whose correct concept is known.

    Parameters
    ----------
    activations : array-like, shape (n_inputs, n_units)
    concepts : array-like, shape (n_inputs, n_concepts), in [0, 1]
    correct : sequence of int, one per unit: the column of ``concepts`` that explains it.
    alphas : the ``alpha`` grid searched on the validation units (metrics in
        `ALPHA_METRICS`; the others take none).
    val_fraction : fraction of units (at least one) for choosing ``alpha``.
    options : passed to `explorer.analyses.neuron_eval.neuron_metrics` (``lam``, ``k``).

    Returns
    -------
    xr.Dataset
        ``meta_auprc`` (metric) on the test units, ``alpha`` (metric; NaN where none is
        used), ``val_auprc`` (metric); attrs ``n_units``, ``n_test_units``, ``n_concepts``,
        ``chance`` (the share of correct pairs, the AUPRC of a random score).
    """
    a = np.asarray(activations, dtype=np.float64)
    c = np.asarray(concepts, dtype=np.float64)
    correct = np.asarray(correct, dtype=np.int64)
    if a.ndim != 2 or c.ndim != 2 or a.shape[0] != c.shape[0]:
        raise InputError(f"`activations` [input, unit] and `concepts` [input, concept] must "
                         f"share the input axis; got {a.shape} and {c.shape}.")
    if correct.shape != (a.shape[1],):
        raise InputError(f"`correct` must give one concept index per unit ({a.shape[1]}); "
                         f"got {correct.shape[0] if correct.ndim else 'a scalar'}.")
    if correct.min(initial=0) < 0 or correct.max(initial=0) >= c.shape[1]:
        raise InputError(f"`correct` holds a concept index outside [0, {c.shape[1] - 1}].")
    check_float("val_fraction", val_fraction, low=0.0, high=0.5)
    alphas = [check_float("alpha", x, low=0.0, high=1.0) for x in alphas]
    if not alphas:
        raise InputError("`alphas` must hold at least one value.")
    n_units = a.shape[1]
    if n_units < 2:
        raise InputError(f"the meta-evaluation needs at least 2 units; got {n_units}.")
    check_int("seed", seed)
    rng = np.random.default_rng(seed)
    order = rng.permutation(n_units)
    n_val = max(1, int(val_fraction * n_units))
    val, test = np.sort(order[:n_val]), np.sort(order[n_val:])
    onehot = np.zeros((n_units, c.shape[1]), bool)
    onehot[np.arange(n_units), correct] = True

    computed: dict[tuple[str, float], xr.DataArray] = {}

    def scores(units: np.ndarray, alpha: float) -> xr.DataArray:
        """Every metric's scores of ``units`` (the validation or the test units) at
        ``alpha``, computed once per (unit set, alpha)."""
        key = ("val" if units is val else "test", alpha)
        if key not in computed:
            computed[key] = neuron_metrics(a[:, units], c, metrics=metrics, alpha=alpha,
                                           seed=seed, **options)["score"]
        return computed[key]

    metrics = list(metrics)
    meta, chosen, val_score = [], [], []
    default = scores(test, alphas[0])
    for m in metrics:
        if m in ALPHA_METRICS and len(alphas) > 1:
            vals = [pooled_auprc(scores(val, x).sel(metric=m).values, onehot[val])
                    for x in alphas]
            best = alphas[int(np.argmax(vals))]
            chosen.append(best)
            val_score.append(max(vals))
            test_scores = scores(test, best).sel(metric=m).values
        else:
            chosen.append(alphas[0] if m in ALPHA_METRICS else np.nan)
            val_score.append(pooled_auprc(scores(val, alphas[0]).sel(metric=m).values,
                                          onehot[val]))
            test_scores = default.sel(metric=m).values
        meta.append(pooled_auprc(test_scores, onehot[test]))
    return xr.Dataset(
        {"meta_auprc": ("metric", np.array(meta)), "alpha": ("metric", np.array(chosen)),
         "val_auprc": ("metric", np.array(val_score))},
        coords={"metric": metrics},
        attrs={"method": "known_unit_meta_auprc", "n_units": int(n_units),
               "n_test_units": int(len(test)), "n_concepts": int(c.shape[1]),
               "chance": float(onehot[test].mean()), "val_fraction": val_fraction,
               "seed": seed, "citation": CITATION})


def itda_known_atom_meta_auprc(itda: Any, activations: Any, *, site: str = "resid_post",
                               layer: int | None = None, min_count: int = 3,
                               max_units: int = 200, min_pos: int = 0,
                               **options: Any) -> xr.Dataset:
    """`known_unit_meta_auprc` on ITDA atoms of a real model: each atom's correct explanation
    is its own source token; the candidate explanations are the distinct source tokens of
    the atoms kept (those whose token occurs at least ``min_count`` times in the probing
    set, at most ``max_units``). Other options go to `known_unit_meta_auprc`."""
    check_int("min_count", min_count, low=1)
    check_int("max_units", max_units, low=2)
    unit_x, tid, _ = atom_probe_set(activations, site=site, layer=layer, min_pos=min_pos)
    atom_ids = np.asarray(itda.atom_token_id_)
    counts = np.array([(tid == t).sum() for t in atom_ids])
    keep = np.flatnonzero((counts >= min_count) & (counts < len(tid)))[:max_units]
    if keep.size < 2:
        raise InputError(f"fewer than 2 atoms have a source token seen at least {min_count} "
                         "times in the probing set; use more prompts or a smaller `min_count`.")
    tokens = np.unique(atom_ids[keep])
    concepts = token_identity_concepts(tid, tokens).values              # [input, token]
    correct = np.searchsorted(tokens, atom_ids[keep])
    acts = unit_x @ np.asarray(itda.atoms_, dtype=np.float64)[keep].T    # [input, unit]
    out = known_unit_meta_auprc(acts, concepts, correct, **options)
    out.attrs.update(units="itda_atoms", explanation="own_token", n_inputs=int(len(tid)))
    return out


def meta_auprc_over_splits(run: Any, *, n_splits: int = 20, level: float = 0.95,
                           seed: int = 0) -> xr.Dataset:
    """A meta-AUPRC and its spread over unit splits: ``run(seed=s)`` (a function returning a
    `known_unit_meta_auprc` Dataset) for ``n_splits`` seeds of the validation / test split.

    Returns ``meta_auprc`` (split, metric), its mean and the central ``level`` percentile
    interval over splits (``meta_auprc_mean`` / ``_low`` / ``_high``, metric), and
    ``chance`` (split): the AUPRC of a random score on each split's test units.
    """
    n_splits = check_int("n_splits", n_splits, low=2)
    level = check_float("level", level, low=0.5, high=0.999)
    runs = [run(seed=seed + s) for s in range(n_splits)]
    meta = np.stack([r["meta_auprc"].values for r in runs])            # [split, metric]
    tail = (1.0 - level) / 2.0
    first = runs[0]
    return xr.Dataset(
        {"meta_auprc": (("split", "metric"), meta),
         "meta_auprc_mean": ("metric", meta.mean(0)),
         "meta_auprc_low": ("metric", np.quantile(meta, tail, axis=0)),
         "meta_auprc_high": ("metric", np.quantile(meta, 1.0 - tail, axis=0)),
         "chance": ("split", np.array([r.attrs["chance"] for r in runs]))},
        coords={"metric": first["metric"].values, "split": np.arange(n_splits)},
        attrs={**{k: v for k, v in first.attrs.items() if k not in ("seed", "chance")},
               "n_splits": n_splits, "level": level, "seed": seed})


def probe_known_unit_meta_auprc(activations: Any, *, site: str = "resid_post",
                                layer: int | None = None, min_pos: int = 0,
                                word_lists: Any = None,
                                families: Sequence[str] = ("digit", "capitalised", "punctuation"),
                                probes_per_concept: int = 8, min_positives: int = 5,
                                probe_seed: int = 0, seed: int = 0,
                                **options: Any) -> xr.Dataset:
    """`known_unit_meta_auprc` on probe units, whose explanation is a token category.

    The probing set's tokens are split in two halves (seeded). For every category of
    `explorer.analyses.neuron_eval.token_concepts` (digits, capitalised tokens,
    punctuation, number words, ``word_lists``) with at least ``min_positives`` tokens in
    each half, ``probes_per_concept`` logistic-regression probes (scikit-learn, balanced
    classes, each on its own bootstrap resample of the first half) are trained to detect
    the category from the unit-norm activation; each probe is a unit, its activation the
    probe's logit on the second half, its correct explanation the category it was trained
    on, and the candidates are all kept categories. Unlike an atom explained by its own
    token, the unit's activation is a learned direction, not a copy of the concept, and the
    concept is a category of many tokens. ``probe_seed`` draws the halves and the
    resamples; ``seed`` the validation / test split of the units (`meta_auprc_over_splits`
    varies it). Other options go to `known_unit_meta_auprc`.
    """
    from sklearn.linear_model import LogisticRegression

    check_int("probes_per_concept", probes_per_concept, low=1)
    check_int("min_positives", min_positives, low=1)
    unit_x, _, tokens = atom_probe_set(activations, site=site, layer=layer, min_pos=min_pos)
    concepts = token_concepts(tokens, word_lists=word_lists, families=families)
    c = concepts.values.astype(np.float64)                              # [input, concept]
    rng = np.random.default_rng([probe_seed, 7])
    order = rng.permutation(len(tokens))
    fit, held = np.sort(order[: len(order) // 2]), np.sort(order[len(order) // 2:])
    keep = [k for k in range(c.shape[1])
            if c[fit, k].sum() >= min_positives and c[held, k].sum() >= min_positives
            and c[fit, k].sum() < len(fit)]
    if len(keep) < 2:
        raise InputError(f"fewer than 2 token categories have {min_positives} tokens in each "
                         "half of the probing set; use more prompts or a smaller "
                         "`min_positives`.")
    acts, correct = [], []
    for j, k in enumerate(keep):
        y = c[fit, k] > 0.5
        for _ in range(probes_per_concept):
            idx = rng.integers(0, len(fit), len(fit))
            while y[idx].all() or not y[idx].any():
                idx = rng.integers(0, len(fit), len(fit))
            probe = LogisticRegression(class_weight="balanced", max_iter=2000)
            probe.fit(unit_x[fit][idx], y[idx])
            acts.append(unit_x[held] @ probe.coef_[0] + probe.intercept_[0])
            correct.append(j)
    out = known_unit_meta_auprc(np.stack(acts, 1), c[held][:, keep], correct, seed=seed,
                                **options)
    out.attrs.update(units="category_probes", explanation="token_category",
                     concepts=[str(concepts["concept"].values[k]) for k in keep],
                     probes_per_concept=probes_per_concept, n_inputs=int(len(held)))
    return out
