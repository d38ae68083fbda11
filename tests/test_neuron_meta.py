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
