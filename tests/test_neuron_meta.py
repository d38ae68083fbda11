"""Known-unit meta-AUPRC of the neuron-explanation metrics (Oikarinen et al.'s meta-evaluation)."""
from __future__ import annotations

import numpy as np
import pytest

from explorer._checks import InputError
from explorer.analyses import neuron_meta as nm
from explorer.analyses.neuron_eval import neuron_metrics


def test_pooled_auprc_hand_worked():
    eye = np.eye(2, dtype=bool)
    assert nm.pooled_auprc([[0.9, 0.1], [0.2, 0.8]], eye) == pytest.approx(1.0)
    # ranked 0.9 (wrong), 0.8 (wrong), 0.2 (right), 0.1 (right): (1/3 + 2/4) / 2
    assert nm.pooled_auprc([[0.1, 0.9], [0.8, 0.2]], eye) == pytest.approx((1 / 3 + 1 / 2) / 2)
    # NaN scores rank last
    assert nm.pooled_auprc([[np.nan, 0.9], [0.8, 0.2]], eye) == pytest.approx((1 / 3 + 1 / 2) / 2)


def _known_units(n=3000, n_concepts=12, noise=0.5, seed=0):
    """Concepts present with various frequencies; unit j = concept j plus noise."""
    rng = np.random.default_rng(seed)
    freq = np.geomspace(0.3, 0.005, n_concepts)
    c = (rng.random((n, n_concepts)) < freq).astype(float)
    a = c + noise * rng.normal(size=c.shape)
    return a, c, np.arange(n_concepts)


def test_metrics_that_explain_known_units_score_high_and_random_units_score_chance():
    a, c, correct = _known_units()
    metrics = ("correlation", "inverse_auprc", "f1", "accuracy")
    out = nm.known_unit_meta_auprc(a, c, correct, metrics=metrics, val_fraction=0.25,
                                   alphas=(0.01, 0.05, 0.2))
    assert out.attrs["n_test_units"] == 9 and out.attrs["chance"] == pytest.approx(1 / 12)
    for m in ("correlation", "f1"):
        assert float(out.meta_auprc.sel(metric=m)) > 0.9, m
    # every metric ranks correct explanations far above chance (inverse AUPRC lower: its
    # scores are not comparable across concepts of different frequencies, and the meta-score
    # pools all pairs)
    assert (out.meta_auprc.values > 0.8).all()
    assert np.isnan(float(out.alpha.sel(metric="correlation")))       # takes no alpha
    # the chosen alpha is the one with the best validation AUPRC, recomputed here
    order = np.random.default_rng(0).permutation(12)
    val, test = np.sort(order[:3]), np.sort(order[3:])
    onehot = np.eye(12, dtype=bool)
    by_alpha = {x: nm.pooled_auprc(neuron_metrics(a[:, val], c, metrics=["f1"], alpha=x)
                                   ["score"].sel(metric="f1").values, onehot[val])
                for x in (0.01, 0.05, 0.2)}
    best = max(by_alpha, key=by_alpha.get)
    assert float(out.alpha.sel(metric="f1")) == best
    expect = nm.pooled_auprc(neuron_metrics(a[:, test], c, metrics=["f1"], alpha=best)
                             ["score"].sel(metric="f1").values, onehot[test])
    assert float(out.meta_auprc.sel(metric="f1")) == pytest.approx(expect)
    # units unrelated to the concepts: every metric near the chance AUPRC
    rnd = nm.known_unit_meta_auprc(np.random.default_rng(1).normal(size=a.shape), c, correct,
                                   metrics=("correlation", "inverse_auprc"), val_fraction=0.25)
    assert (rnd.meta_auprc.values < 0.35).all()


def test_itda_atoms_as_known_units(tiny_model):
    from explorer.analyses.itda import ITDA
    from explorer.trace import trace

    prompts = ["the cat and the dog and the bird", "the sun and the moon and the sea",
               "the red and the blue and the green", "the one and the two and the three"]
    ds = trace(tiny_model, prompts)
    itda = ITDA(tau=0.3, l0=4).fit(ds.isel(prompt=slice(0, 2)), layer=1)
    out = nm.itda_known_atom_meta_auprc(itda, ds.isel(prompt=slice(2, 4)), layer=1,
                                        min_count=2, metrics=("correlation", "f1"),
                                        alphas=(0.1,), val_fraction=0.2)
    assert out.attrs["units"] == "itda_atoms" and out.attrs["n_units"] >= 2
    assert 0 <= float(out.meta_auprc.sel(metric="correlation")) <= 1
    assert out.attrs["chance"] == pytest.approx(1 / out.attrs["n_concepts"])


def test_bad_inputs_are_named():
    a, c, correct = _known_units(n=200, n_concepts=4)
    with pytest.raises(InputError, match="one concept index per unit"):
        nm.known_unit_meta_auprc(a, c, correct[:3])
    with pytest.raises(InputError, match=r"outside \[0, 3\]"):
        nm.known_unit_meta_auprc(a, c, [0, 1, 2, 9])
    with pytest.raises(InputError, match="share the input axis"):
        nm.known_unit_meta_auprc(a[:10], c, correct)


def test_split_intervals_are_percentiles_over_seeds():
    import xarray as xr

    def run(seed):   # a stand-in meta-evaluation whose score is known per seed
        return xr.Dataset({"meta_auprc": ("metric", [seed / 10.0, 1.0])},
                          coords={"metric": ["f1", "iou"]}, attrs={"chance": 0.1 * seed, "seed": seed})

    out = nm.meta_auprc_over_splits(run, n_splits=5, level=0.5, seed=1)
    np.testing.assert_allclose(out.meta_auprc.sel(metric="f1").values, [0.1, 0.2, 0.3, 0.4, 0.5])
    assert float(out.meta_auprc_mean.sel(metric="f1")) == pytest.approx(0.3)
    assert float(out.meta_auprc_low.sel(metric="f1")) == pytest.approx(np.quantile([.1, .2, .3, .4, .5], 0.25))
    assert float(out.meta_auprc_high.sel(metric="f1")) == pytest.approx(np.quantile([.1, .2, .3, .4, .5], 0.75))
    assert float(out.meta_auprc_low.sel(metric="iou")) == 1.0
    np.testing.assert_allclose(out.chance.values, [0.1, 0.2, 0.3, 0.4, 0.5])
    with pytest.raises(InputError, match="`n_splits` must be an int"):
        nm.meta_auprc_over_splits(run, n_splits=1)


def test_probe_units_against_sklearn_probes_and_average_precision(tiny_model):
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import average_precision_score

    from explorer.analyses.neuron_eval import atom_probe_set, token_concepts
    from explorer.trace import trace

    prompts = ["Anna met Bob in Rome, then Carl.", "Dan and Eve saw 12 cats, 3 dogs.",
               "Fay, Gus and Hal: 7 days, 45 nights!", "Ivy paid 90 coins; Jon paid 8.",
               "Kim, Lou and Max: 6 cups, 21 plates.", "Ned saw 4 owls, 17 bats; Ola 5."]
    ds = trace(tiny_model, prompts)
    out = nm.probe_known_unit_meta_auprc(ds, layer=1, probes_per_concept=2, min_positives=2,
                                         metrics=("correlation", "f1"), alphas=(0.1,),
                                         val_fraction=0.2, seed=3)
    # the same probes, trained here with scikit-learn, and the pooled AUPRC of one metric
    unit_x, _, tokens = atom_probe_set(ds, layer=1)
    c = token_concepts(tokens)
    rng = np.random.default_rng([0, 7])
    order = rng.permutation(len(tokens))
    fit, held = np.sort(order[: len(order) // 2]), np.sort(order[len(order) // 2:])
    names = list(out.attrs["concepts"])
    acts, correct = [], []
    for j, name in enumerate(names):
        y = c.sel(concept=name).values[fit] > 0.5
        for _ in range(2):
            idx = rng.integers(0, len(fit), len(fit))
            while y[idx].all() or not y[idx].any():
                idx = rng.integers(0, len(fit), len(fit))
            p = LogisticRegression(class_weight="balanced", max_iter=2000).fit(unit_x[fit][idx], y[idx])
            acts.append(p.decision_function(unit_x[held]))
            correct.append(j)
    acts = np.stack(acts, 1)
    cc = c.sel(concept=names).values[held]
    order = np.random.default_rng(3).permutation(acts.shape[1])
    test = np.sort(order[max(1, int(0.2 * acts.shape[1])):])
    za = (acts[:, test] - acts[:, test].mean(0)) / acts[:, test].std(0)
    zc = (cc - cc.mean(0)) / cc.std(0)
    corr = za.T @ zc / len(held)                                    # Pearson [unit, concept]
    onehot = np.eye(len(names), dtype=bool)[np.array(correct)[test]]
    assert float(out.meta_auprc.sel(metric="correlation")) == pytest.approx(
        average_precision_score(onehot.ravel(), corr.ravel()), abs=1e-6)
    assert out.attrs["units"] == "category_probes" and out.attrs["chance"] == pytest.approx(onehot.mean())
    with pytest.raises(InputError, match="fewer than 2 token categories"):
        nm.probe_known_unit_meta_auprc(ds, layer=1, min_positives=1000)
