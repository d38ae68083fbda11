"""Tests for explorer.analyses.similarity: CKA, SVCCA, Jaccard, layer matching.

References are independent computations: the HSIC (kernel) form of CKA with an explicit
centring matrix, classical CCA from covariance matrices, data with known canonical
correlations, and hand-worked label sets and similarity matrices.
"""
from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
import scipy.stats

from explorer._checks import InputError
from explorer.analyses.similarity import (
    canonical_correlations,
    jaccard_index,
    layer_matching,
    layer_matching_accuracy,
    layer_similarity,
    linear_cka,
    perturbed_copy,
    svcca,
)
from explorer.trace import trace

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "One two three four five six seven eight nine ten.",
    "Water boils at one hundred degrees at sea level.",
    "In 1905 the physicist wrote four papers.",
]


def hsic_cka(x: np.ndarray, y: np.ndarray) -> float:
    """CKA from its definition: HSIC(K, L) / sqrt(HSIC(K, K) HSIC(L, L)), K = XX^T, H = I - 11^T/n."""
    n = x.shape[0]
    h = np.eye(n) - np.ones((n, n)) / n
    k, l_ = x @ x.T, y @ y.T
    hsic = lambda a, b: np.trace(a @ h @ b @ h)  # noqa: E731 - the textbook formula, unnormalised
    return hsic(k, l_) / np.sqrt(hsic(k, k) * hsic(l_, l_))


def classical_cca(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Canonical correlations as the singular values of Sxx^-1/2 Sxy Syy^-1/2."""
    xc, yc = x - x.mean(0), y - y.mean(0)
    sxx, syy, sxy = xc.T @ xc, yc.T @ yc, xc.T @ yc
    wx = np.real(scipy.linalg.inv(scipy.linalg.sqrtm(sxx)))
    wy = np.real(scipy.linalg.inv(scipy.linalg.sqrtm(syy)))
    return np.linalg.svd(wx @ sxy @ wy, compute_uv=False)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


# -- CKA ----------------------------------------------------------------------------------

def test_cka_of_a_matrix_with_itself_is_one(rng):
    x = rng.normal(size=(40, 7))
    assert linear_cka(x, x) == pytest.approx(1.0, abs=1e-12)


def test_cka_is_invariant_to_orthogonal_transforms_and_isotropic_scaling(rng):
    x = rng.normal(size=(60, 6))
    y = rng.normal(size=(60, 5)) + x[:, :5]
    q, _ = np.linalg.qr(rng.normal(size=(6, 6)))
    before = linear_cka(x, y)
    assert linear_cka(x @ q, y) == pytest.approx(before, abs=1e-12)
    assert linear_cka(3.5 * x @ q, 0.2 * y) == pytest.approx(before, abs=1e-12)
    assert linear_cka(x @ q, x) == pytest.approx(1.0, abs=1e-12)


def test_cka_matches_the_hsic_kernel_formula(rng):
    x = rng.normal(size=(30, 8))
    y = np.tanh(x[:, :4] @ rng.normal(size=(4, 3))) + 0.3 * rng.normal(size=(30, 3))
    assert linear_cka(x, y) == pytest.approx(hsic_cka(x, y), abs=1e-10)


def test_cka_is_not_invariant_to_anisotropic_scaling(rng):
    x = rng.normal(size=(50, 4))
    y = x * np.array([1.0, 1.0, 10.0, 0.1])
    assert linear_cka(x, y) < 0.9
    assert linear_cka(x, y) == pytest.approx(hsic_cka(x, y), abs=1e-10)


def test_cka_checks_its_inputs():
    with pytest.raises(InputError, match="same tokens"):
        linear_cka(np.ones((5, 2)), np.ones((4, 2)))
    with pytest.raises(InputError, match="2-d array"):
        linear_cka(np.ones(5), np.ones((5, 2)))
    with pytest.raises(InputError, match="NaN"):
        linear_cka(np.full((3, 2), np.nan), np.ones((3, 2)))


# -- SVCCA --------------------------------------------------------------------------------

def test_svcca_of_an_invertible_linear_map_is_one(rng):
    x = rng.normal(size=(200, 5))
    w = rng.normal(size=(5, 5)) + 3 * np.eye(5)
    assert svcca(x, x @ w, variance_kept=1.0) == pytest.approx(1.0, abs=1e-10)


def test_svcca_recovers_known_canonical_correlations(rng):
    n = 20000
    rho = np.array([0.9, 0.6, 0.3])
    z = rng.normal(size=(n, 3))
    y = rho * z + np.sqrt(1 - rho ** 2) * rng.normal(size=(n, 3))
    # mix y with a random rotation: canonical correlations do not change
    q, _ = np.linalg.qr(rng.normal(size=(3, 3)))
    got = canonical_correlations(z, y @ q, variance_kept=1.0)
    np.testing.assert_allclose(got, rho, atol=0.02)
    assert svcca(z, y @ q, variance_kept=1.0) == pytest.approx(rho.mean(), abs=0.02)


def test_canonical_correlations_match_classical_cca(rng):
    x = rng.normal(size=(300, 4))
    y = x[:, :3] @ rng.normal(size=(3, 3)) + rng.normal(size=(300, 3))
    np.testing.assert_allclose(canonical_correlations(x, y, variance_kept=1.0),
                               classical_cca(x, y), atol=1e-8)


def test_svcca_keeps_the_top_directions_only(rng):
    # x has two strong directions and one tiny one; y correlates only with the tiny one
    n = 500
    strong = rng.normal(size=(n, 2)) * 10
    weak = rng.normal(size=(n, 1)) * 0.01
    x = np.hstack([strong, weak])
    y = weak + 0.001 * rng.normal(size=(n, 1))
    assert svcca(x, y, variance_kept=1.0) > 0.95       # the weak direction is kept
    assert svcca(x, y, variance_kept=0.99) < 0.2       # 99% of variance drops it
    assert canonical_correlations(x, y, n_components=2).shape == (1,)


# -- Jaccard and layer matching ----------------------------------------------------------------

def test_jaccard_index_hand_worked():
    a = {(0, 1), (0, 2), (1, 3), (2, 0)}
    b = {(0, 2), (1, 3), (5, 5)}
    assert jaccard_index(a, b) == pytest.approx(2 / 5)
    assert jaccard_index(a, a) == 1.0
    assert jaccard_index(a, set()) == 0.0
    assert np.isnan(jaccard_index([], []))


def test_layer_matching_accuracy_hand_worked():
    s = np.array([[0.9, 0.1, 0.0],
                  [0.2, 0.3, 0.8],    # layer 1 matches layer 2: a miss
                  [0.1, 0.2, 0.7]])
    assert layer_matching_accuracy(s) == pytest.approx(2 / 3)
    ties = np.array([[0.5, 0.5], [0.0, 1.0]])   # layer 0 ties with layer 1: half a hit
    assert layer_matching_accuracy(ties) == pytest.approx((0.5 + 1) / 2)
    assert layer_matching_accuracy(np.stack([s, np.eye(3)])) == pytest.approx((2 / 3 + 1) / 2)
    with pytest.raises(InputError, match="square"):
        layer_matching_accuracy(np.ones((2, 3)))


def test_layer_similarity_of_a_model_with_itself_matches_every_layer(tiny_model):
    ds = trace(tiny_model, PROMPTS, sites=("resid_post",))
    for method in ("cka", "svcca", "itda"):
        out = layer_similarity(ds, ds, method=method, tau=0.3, l0=4)
        sim = out["similarity"].values
        assert sim.shape == (3, 3)
        np.testing.assert_allclose(np.diag(sim), 1.0, atol=1e-9)
        assert out["matched"].values.all()
    # CKA cross-check against the kernel formula on the real tokens
    mask = ds["mask"].values
    x0 = ds["resid_post"].sel(layer=0).values[mask]
    x2 = ds["resid_post"].sel(layer=2).values[mask]
    cka = layer_similarity(ds, ds, method="cka")["similarity"].sel(layer_a=0, layer_b=2)
    assert float(cka) == pytest.approx(hsic_cka(x0.astype(np.float64), x2.astype(np.float64)), abs=1e-8)


def test_itda_layer_similarity_is_the_jaccard_of_the_dictionaries(tiny_model):
    from explorer.analyses.itda import ITDA

    ds = trace(tiny_model, PROMPTS, sites=("resid_post",))
    out = layer_similarity(ds, ds, method="itda", tau=0.2, l0=3)
    a = ITDA(tau=0.2, l0=3).fit(ds, layer=0).atom_labels()
    b = ITDA(tau=0.2, l0=3).fit(ds, layer=1).atom_labels()
    assert float(out["similarity"].sel(layer_a=0, layer_b=1)) == pytest.approx(len(a & b) / len(a | b))


def test_layer_matching_across_two_seeds(tiny_model):
    from explorer import load_model

    other = load_model("tiny-llama", seed=1)
    acts = {"seed0": trace(tiny_model, PROMPTS), "seed1": trace(other, PROMPTS)}
    out = layer_matching(acts, methods=("cka", "itda"), tau=0.3, l0=4)
    assert out["similarity"].dims == ("measure", "model_a", "model_b", "layer_a", "layer_b")
    sim = out["similarity"].sel(measure="cka", model_a="seed0", model_b="seed1").values
    assert float(out["accuracy"].sel(measure="cka")) == pytest.approx(
        layer_matching_accuracy(np.stack([sim, sim.T])))
    np.testing.assert_allclose(out["similarity"].sel(measure="cka", model_a="seed1", model_b="seed0"),
                               sim.T)
    assert np.isnan(out["similarity"].sel(measure="cka", model_a="seed0", model_b="seed0")).all()


def test_layer_similarity_rejects_different_token_streams(tiny_model):
    a = trace(tiny_model, PROMPTS[:2])
    b = trace(tiny_model, PROMPTS[1:3])
    with pytest.raises(InputError, match="same token stream"):
        layer_similarity(a, b)
    with pytest.raises(InputError, match="`method` must be one of"):
        layer_similarity(a, a, method="procrustes")
    with pytest.raises(InputError, match="at least two models"):
        layer_matching({"a": a})
    with pytest.raises(InputError, match="no variable 'mlp_out'"):
        layer_similarity(a, a, site="mlp_out")


def test_perturbed_copy_changes_weights_by_the_given_scale(tiny_model):
    same = perturbed_copy(tiny_model, scale=0.0)
    a = trace(tiny_model, PROMPTS[:1])["resid_post"].values
    np.testing.assert_allclose(trace(same, PROMPTS[:1])["resid_post"].values, a, atol=1e-6)
    noisy = perturbed_copy(tiny_model, scale=0.1, seed=3)
    w0 = tiny_model.hf.model.layers[0].mlp.up_proj.weight
    w1 = noisy.hf.model.layers[0].mlp.up_proj.weight
    rel = float((w1 - w0).std() / w0.std())
    assert rel == pytest.approx(0.1, rel=0.1)
    assert not np.allclose(trace(noisy, PROMPTS[:1])["resid_post"].values, a)
    assert "noise0.1" in noisy.spec.name
    # the original is untouched
    np.testing.assert_allclose(trace(tiny_model, PROMPTS[:1])["resid_post"].values, a)
    assert scipy.stats.pearsonr(w0.flatten(), w1.flatten())[0] > 0.9


def test_min_pos_drops_the_first_token_of_every_prompt(tiny_model):
    ds = trace(tiny_model, PROMPTS)
    mask = ds["mask"].values.copy()
    mask[:, 0] = False
    x0 = ds["resid_post"].sel(layer=0).values[mask].astype(np.float64)
    x1 = ds["resid_post"].sel(layer=1).values[mask].astype(np.float64)
    out = layer_similarity(ds, ds, method="cka", min_pos=1)
    assert out.attrs["n_tokens"] == int(mask.sum())
    assert float(out["similarity"].sel(layer_a=0, layer_b=1)) == pytest.approx(hsic_cka(x0, x1), abs=1e-8)
