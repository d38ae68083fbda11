"""In-context linear regression with multi-head softmax attention (He et al., ICML 2025):
the model against a plain numpy forward, the pattern metrics on hand-set weights, the
debiased-GD predictor against a literal gradient step and against the symmetric head pair,
and the baselines against independent computations."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from explorer._checks import InputError
from explorer.analyses import linear_icl as icl
from explorer.analyses.linear_icl import runs as icl_runs
from explorer.commands._common import torch_threads
from tests._cli import OneCommand
from tests._threads import record_threads


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- helpers --------------------------------------------------------------------------


def _numpy_forward(weights, X, y, x_q):
    """TF(Z, z_q) = sum_h O_h V_h Z softmax(Z^T K_h^T Q_h z_q / sqrt(d+1)), head by head."""
    D = X.shape[-1] + 1
    out = np.zeros(X.shape[0])
    for p in range(X.shape[0]):
        Z = np.concatenate([X[p], y[p][:, None]], axis=1)               # [L, D]
        zq = np.concatenate([x_q[p], [0.0]])
        for h in range(weights["W_Q"].shape[0]):
            q = zq @ weights["W_Q"][h]
            k = Z @ weights["W_K"][h]
            s = k @ q / math.sqrt(D)
            a = np.exp(s - s.max())
            a /= a.sum()
            v = Z @ weights["W_V"][h] @ weights["W_O"][h]
            out[p] += a @ v
    return out


def _pattern_weights(omega, mu, d=5):
    """Weights with the ideal pattern: W_KQ x-block = omega_h sqrt(D) I, W_OV = mu_h e_y."""
    H, D = len(omega), d + 1
    W_Q = np.zeros((H, D, D))
    W_K = np.zeros((H, D, D))
    W_V = np.zeros((H, D, D))
    W_O = np.zeros((H, D))
    for h in range(H):
        W_Q[h, :d, :d] = omega[h] * math.sqrt(D) * np.eye(d)
        W_K[h, :d, :d] = np.eye(d)
        W_V[h, d, 0] = 1.0          # y entry -> first value coordinate
        W_O[h, 0] = mu[h]
    return {"W_Q": W_Q, "W_K": W_K, "W_V": W_V, "W_O": W_O}


def _prompts(n, L, d=5, seed=0):
    t = icl.sample_regression_prompts(n, L, d, seed=seed)
    return (t["X"].double().numpy(), t["y"].double().numpy(), t["x_q"].double().numpy(),
            t["y_q"].double().numpy())


def _single_run(weights):
    return icl.icl_run_from_models([icl.ICLAttention.from_weights(**weights)], n_test=64)


# -- model ----------------------------------------------------------------------------


def test_model_matches_numpy_forward():
    model = icl.ICLAttention(d=3, n_heads=3, seed=7)
    X, y, xq, _ = _prompts(8, 11, d=3)
    with torch.no_grad():
        got = model(torch.tensor(X, dtype=torch.float32), torch.tensor(y, dtype=torch.float32),
                    torch.tensor(xq, dtype=torch.float32)).numpy()
    want = _numpy_forward({k: v.astype(np.float64) for k, v in model.weights().items()}, X, y, xq)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_hand_set_pattern_model_equals_pattern_predictor():
    omega, mu = [0.3, -0.3, 0.1], [1.5, -1.5, 0.4]
    model = icl.ICLAttention.from_weights(**_pattern_weights(omega, mu))
    X, y, xq, _ = _prompts(32, 40)
    with torch.no_grad():
        got = model(*(torch.tensor(a, dtype=torch.float32) for a in (X, y, xq))).double().numpy()
    # Independent: softmax over omega_h x_i.x_q, weighted sum of y_i.
    want = np.zeros(32)
    for h in range(3):
        logits = omega[h] * np.einsum("pld,pd->pl", X, xq)
        w = np.exp(logits - logits.max(1, keepdims=True))
        want += mu[h] * (w / w.sum(1, keepdims=True) * y).sum(1)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(icl.pattern_predict(X, y, xq, omega, mu), want, rtol=1e-10)


def test_initialisation_is_uniform_with_the_fan_in_bound():
    model = icl.ICLAttention(d=5, n_heads=4, init_scale=0.5, seed=0)
    for name in ("W_Q", "W_K", "W_V"):
        w = getattr(model, name).detach().numpy()
        assert np.abs(w).max() <= 0.5 / math.sqrt(6)
        assert np.abs(w).max() > 0.45 / math.sqrt(6)  # the range is used
    assert np.abs(model.W_O.detach().numpy()).max() <= 0.5 / math.sqrt(24)


# -- pattern metrics on hand-set weights ----------------------------------------------


def test_pattern_metrics_of_the_ideal_symmetric_pair():
    pats = icl.attention_patterns(_single_run(_pattern_weights([0.25, -0.25], [1.8, -1.8])))
    at = pats.isel(step=0)
    np.testing.assert_allclose(at["omega"].values, [0.25, -0.25], rtol=1e-6)
    np.testing.assert_allclose(at["mu"].values, [1.8, -1.8], rtol=1e-6)
    for name in ("kq_identity_error", "kq_offdiag_ratio", "kq_diag_cv", "ov_offy_ratio"):
        np.testing.assert_allclose(at[name].values, 0.0, atol=1e-7)
    assert float(at["mu_sum_ratio"]) == pytest.approx(0.0, abs=1e-7)
    # W_KQ = W_Q W_K^T: the x-block is omega sqrt(6) I.
    np.testing.assert_allclose(at["W_KQ"].values[0, :5, :5], 0.25 * math.sqrt(6) * np.eye(5), rtol=1e-6)


def test_pattern_metrics_on_perturbed_weights_match_hand_computation():
    w = _pattern_weights([0.5, 0.2], [1.0, -0.25])
    D = 6
    c = 0.5 * math.sqrt(D)                     # head 0 x-block diagonal
    w["W_Q"][0, 0, 1] = 0.3 * c                # adds W_KQ[0, 1] = 0.3 c (W_K is I on x)
    w["W_Q"][0, 2, 2] = 2 * c                  # diagonal becomes (c, c, 2c, c, c)
    w["W_V"][1, 3, 0] = 0.5                    # head 1 OV gets 0.5 * mu at x4
    w["W_Q"][0, 5, 0] = 9.0                    # query-y row: never acts, must be ignored
    at = icl.attention_patterns(_single_run(w)).isel(step=0)
    diag = np.array([c, c, 2 * c, c, c])
    mean = diag.mean()
    block = np.diag(diag)
    block[0, 1] = 0.3 * c
    # Identity error: distance from the best scaled identity over the block norm.
    err = np.linalg.norm(block - mean * np.eye(5)) / np.linalg.norm(block)
    assert float(at["kq_identity_error"][0]) == pytest.approx(err, rel=1e-6)
    off = (0.3 * c) ** 2
    assert float(at["kq_offdiag_ratio"][0]) == pytest.approx(off / ((diag**2).sum() + off), rel=1e-6)
    assert float(at["kq_diag_cv"][0]) == pytest.approx(diag.std() / mean, rel=1e-6)
    assert float(at["omega"][0]) == pytest.approx(mean / math.sqrt(D), rel=1e-6)
    # OV of head 1: (0, 0, 0, 0.5 mu, 0, mu) with mu = -0.25.
    assert float(at["ov_offy_ratio"][1]) == pytest.approx(0.25 / 1.25, rel=1e-6)
    assert float(at["ov_offy_ratio"][0]) == pytest.approx(0.0, abs=1e-9)
    assert float(at["mu_sum_ratio"]) == pytest.approx(0.75 / 1.25, rel=1e-6)
    assert float(at["kq_identity_error_max"]) == pytest.approx(err, rel=1e-6)


def test_inactive_heads_are_left_out_of_the_worst_head_metrics():
    w = _pattern_weights([0.2, -0.2, 0.3], [1.0, -1.0, 0.01])
    w["W_V"][2, 0, 0] = 5.0                    # the tiny head's OV is mostly off y...
    w["W_Q"][2, 0, 1] = 3.0                    # ...and its KQ far from an identity
    at = icl.attention_patterns(_single_run(w)).isel(step=0)
    np.testing.assert_array_equal(at["active"].values, [True, True, False])
    assert float(at["ov_offy_ratio"][2]) > 0.9 and float(at["kq_identity_error"][2]) > 0.3
    assert float(at["ov_offy_ratio_max"]) == pytest.approx(0.0, abs=1e-9)
    assert float(at["kq_identity_error_max"]) == pytest.approx(0.0, abs=1e-7)


def test_pattern_reached_applies_the_thresholds():
    def reached(omega, mu, **edits):
        w = _pattern_weights(omega, mu)
        for (name, index), value in edits.get("set", {}).items():
            w[name][index] = value
        return bool(icl.pattern_reached(icl.attention_patterns(_single_run(w))).values[0])

    assert reached([0.2, -0.2], [1.0, -1.0])
    assert reached([0.2], [1.0])                               # zero-sum is not asked of H = 1
    assert not reached([0.2, -0.2], [1.0, -0.5])               # |sum mu| / sum |mu| = 1/3
    assert not reached([0.2, -0.2], [1.0, -1.0], set={("W_V", (0, 0, 0)): 0.5})   # OV off y: 0.2
    assert not reached([0.2, -0.2], [1.0, -1.0], set={("W_Q", (1, 0, 2)): -0.3})  # KQ off-diagonal


def test_patterns_follow_the_step_dimension():
    models = [icl.ICLAttention.from_weights(**_pattern_weights([a, -a], [1.0, -1.0])) for a in (0.1, 0.2, 0.4)]
    run = icl.icl_run_from_models(models, steps=[0, 10, 20], n_test=16)
    pats = icl.attention_patterns(run)
    assert pats["omega"].dims == ("step", "head")
    np.testing.assert_allclose(pats["omega"].sel(head=0).values, [0.1, 0.2, 0.4], rtol=1e-6)
    assert pats["W_KQ"].dims == ("step", "head", "query_feature", "key_feature")
    assert list(pats["feature"].values) == ["x1", "x2", "x3", "x4", "x5", "y"]


# -- predictors -----------------------------------------------------------------------


def test_debiased_gd_equals_one_literal_gradient_step_on_centred_least_squares():
    X, y, xq, _ = _prompts(6, 40)
    eta = 0.7
    got = icl.debiased_gd_predict(X, y, xq, eta)
    for p in range(6):
        Xt = torch.tensor(X[p], requires_grad=False)
        beta = torch.zeros(5, dtype=torch.float64, requires_grad=True)
        with torch.enable_grad():
            centred = Xt - Xt.mean(0)
            loss = ((torch.tensor(y[p]) - centred @ beta) ** 2).sum() / (2 * 40)
            (grad,) = torch.autograd.grad(loss, beta)
        beta1 = -eta * grad
        assert got[p] == pytest.approx(float(beta1 @ torch.tensor(xq[p])), rel=1e-10)
    # Plain GD: the same step on the raw covariates.
    Xt = torch.tensor(X[0])
    beta = torch.zeros(5, dtype=torch.float64, requires_grad=True)
    with torch.enable_grad():
        (grad,) = torch.autograd.grad(((torch.tensor(y[0]) - Xt @ beta) ** 2).sum() / 80, beta)
    assert icl.gd_predict(X, y, xq, eta)[0] == pytest.approx(float(-eta * grad @ torch.tensor(xq[0])), rel=1e-10)


@pytest.mark.parametrize("omega", [1e-2, 1e-3])
def test_symmetric_pair_is_debiased_gd_to_second_order(omega):
    # Closed form: mu [softmax(w s) - softmax(-w s)]_i = (2 w mu / L)(s_i - s_bar) + O(w^3).
    X, y, xq, _ = _prompts(64, 40)
    mu = 1.3
    pair = icl.pattern_predict(X, y, xq, [omega, -omega], [mu, -mu])
    dgd = icl.debiased_gd_predict(X, y, xq, 2 * omega * mu)
    rel = np.abs(pair - dgd).max() / np.abs(dgd).max()
    s = np.einsum("pld,pd->pl", X, xq)
    bound = (omega * np.abs(s).max()) ** 2  # relative error O((omega s)^2)
    assert rel < bound
    # ...and it is not the plain GD predictor, which keeps the mean term.
    gd = icl.gd_predict(X, y, xq, 2 * omega * mu)
    assert np.abs(pair - gd).max() / np.abs(gd).max() > 10 * rel


def test_single_head_cannot_cancel_the_mean_of_y():
    # One head: y_bar + (omega / L) sum_i y_i (s_i - s_bar) + O(omega^2): the mean of the
    # context's y (noise for the query) stays in the prediction.
    X, y, xq, _ = _prompts(64, 40)
    omega = 1e-2
    one = icl.pattern_predict(X, y, xq, [omega], [1.0])
    first_order = y.mean(1) + icl.debiased_gd_predict(X, y, xq, omega)
    s = np.einsum("pld,pd->pl", X, xq)
    assert np.abs(one - first_order).max() < (omega * np.abs(s).max()) ** 2 * np.abs(y).max()
    assert np.abs(one - icl.debiased_gd_predict(X, y, xq, omega)).mean() > 5 * np.abs(one - first_order).max()


def test_ridge_matches_augmented_least_squares():
    X, y, xq, _ = _prompts(5, 12, d=4)
    lam = 0.4
    got = icl.ridge_predict(X, y, xq, lam)
    for p in range(5):
        A = np.vstack([X[p], math.sqrt(lam) * np.eye(4)])
        b = np.concatenate([y[p], np.zeros(4)])
        beta = np.linalg.lstsq(A, b, rcond=None)[0]
        assert got[p] == pytest.approx(beta @ xq[p], rel=1e-9)


def test_bayes_risk_matches_simulated_posterior_mean_and_the_asymptotic_formula():
    d, L, s2 = 5, 40, 0.1
    risk = icl.bayes_risk(L, d, s2, n_samples=20000, seed=0)
    # Independent: simulate prompts, predict with the posterior mean, average the error.
    X, y, xq, yq = _prompts(40000, L, d, seed=3)
    empirical = float(((icl.ridge_predict(X, y, xq, s2 * d) - yq) ** 2).mean())
    assert risk == pytest.approx(empirical, rel=0.03)
    # Large d and L at fixed xi = 4: Monte Carlo approaches the Marchenko-Pastur limit.
    big = icl.bayes_risk(200, 50, s2, n_samples=400, seed=0)
    assert big == pytest.approx(icl.bayes_risk_asymptotic(200, 50, s2), rel=0.02)
    # Limits: xi -> infinity gives the noise floor; no context gives the prior variance + noise.
    assert icl.bayes_risk_asymptotic(10**6, 1, s2) == pytest.approx(s2, rel=1e-4)


def test_optimal_mu_minimises_the_approximate_loss():
    kw = {"context_length": 40, "d": 5, "noise_var": 0.1}
    omega = np.array([0.2, -0.25])
    mu = icl.optimal_mu(omega, **kw)
    base = icl.approximate_loss(omega, mu, **kw)
    eps = 1e-5
    for i in range(2):
        bump = np.zeros(2)
        bump[i] = eps
        grad = (icl.approximate_loss(omega, mu + bump, **kw) - icl.approximate_loss(omega, mu - bump, **kw)) / (2 * eps)
        assert abs(grad) < 1e-6
        assert icl.approximate_loss(omega, mu + 100 * bump, **kw) > base


def test_fit_step_size_is_least_squares():
    p = np.array([1.0, 2.0, 3.0])
    assert icl.fit_step_size(p, 2.5 * p) == pytest.approx(2.5)
    assert icl.fit_step_size(np.zeros(3), p) == 0.0


# -- training -------------------------------------------------------------------------


def test_training_run_layout_and_test_loss_against_numpy():
    run = icl.train_linear_icl(n_heads=2, d=3, context_length=10, steps=20, checkpoint_every=10,
                               batch_size=32, test_lengths=[4, 10], n_test=64, seed=3)
    np.testing.assert_array_equal(run["step"].values, [0, 10, 20])
    assert run["W_Q"].dims == ("step", "head", "feature", "d_head")
    assert run["test_loss"].dims == ("step", "context_length")
    for L, seed_offset in ((4, 4), (10, 10)):
        t = icl.sample_regression_prompts(64, L, 3, noise_var=0.1, seed=3 + 10_000 + seed_offset)
        X, y, xq, yq = (t[k].double().numpy() for k in ("X", "y", "x_q", "y_q"))
        for step in (0, 20):
            w = {k: run[k].sel(step=step).values.astype(np.float64) for k in ("W_Q", "W_K", "W_V", "W_O")}
            want = float(((_numpy_forward(w, X, y, xq) - yq) ** 2).mean())
            assert float(run["test_loss"].sel(step=step, context_length=L)) == pytest.approx(want, rel=1e-4)
    assert not np.allclose(run["W_Q"].values[0], run["W_Q"].values[-1])
    json.dumps(run.attrs)
    assert run.attrs["method"] == "linear_icl" and "He" in run.attrs["citation"]


def test_training_is_seeded_and_cancellable():
    kw = {"n_heads": 1, "d": 2, "context_length": 6, "steps": 6, "checkpoint_every": 2,
          "batch_size": 8, "n_test": 8}
    a = icl.train_linear_icl(seed=1, **kw)
    b = icl.train_linear_icl(seed=1, **kw)
    np.testing.assert_array_equal(a["W_Q"].values, b["W_Q"].values)
    c = icl.train_linear_icl(seed=1, progress=lambda done, total: done < 4, **kw)
    assert c.attrs["cancelled"] is True
    np.testing.assert_array_equal(c["step"].values, [0, 2, 4])


def test_short_training_learns_the_pattern_signs():
    # A few hundred Adam steps already pair the two heads with opposite (omega, mu) signs.
    run = icl.train_linear_icl(n_heads=2, steps=600, checkpoint_every=600, batch_size=128,
                               n_test=256, test_lengths=[40], seed=0)
    last = icl.attention_patterns(run).isel(step=-1)
    loss = run["test_loss"].sel(context_length=40).values
    assert loss[-1] < 0.8 * loss[0]
    assert float(last["mu_sum_ratio"]) < float(icl.attention_patterns(run).isel(step=0)["mu_sum_ratio"])


def test_losses_by_length_baselines_are_ordered():
    w = _pattern_weights([0.25, -0.25], [1.8, -1.8])
    run = _single_run(w)
    run.attrs["params"].update({"context_length": 40})
    res = icl.icl_losses_by_length(run, context_lengths=[10, 40], n_prompts=2048, seed=0)
    # Bayes-optimal beats debiased GD and the model; the empirical Bayes loss is close to
    # its Monte Carlo expectation; longer contexts help every predictor.
    assert (res["bayes"] < res["debiased_gd"]).all() and (res["bayes"] < res["model"]).all()
    for name in ("model", "debiased_gd", "gd", "bayes"):
        assert float(res[name].sel(context_length=40)) < float(res[name].sel(context_length=10))
    np.testing.assert_allclose(res["bayes"], res["bayes_expected"], rtol=0.1)
    assert float(res["dgd_r2"].sel(context_length=40)) > 0.9


@pytest.mark.parametrize("kwargs, match", [
    ({"n_heads": 0}, "n_heads"),
    ({"noise_var": -0.1}, "noise_var"),
    ({"steps": -1}, "steps"),
    ({"checkpoint_every": 0}, "checkpoint_every"),
])
def test_training_rejects_bad_parameters(kwargs, match):
    with pytest.raises(InputError, match=match):
        icl.train_linear_icl(**kwargs)


def test_errors_name_the_bad_value():
    with pytest.raises(InputError, match="W_K"):
        icl.ICLAttention.from_weights(np.zeros((2, 6, 6)), np.zeros((2, 5, 5)), np.zeros((2, 6, 6)), np.zeros((2, 6)))
    with pytest.raises(TypeError, match="xarray.Dataset"):
        icl.attention_patterns({"W_Q": 1})
    with pytest.raises(InputError, match="step"):
        icl.icl_model(_single_run(_pattern_weights([0.1], [1.0])), 5)
    with pytest.raises(InputError, match="unknown linear-ICL training parameter"):
        icl.linear_icl_run(heads=2)


def test_cli_train_and_analyse(tmp_path, monkeypatch, capsys):
    command = OneCommand("linear_icl", monkeypatch, capsys)
    args = ["linear-icl", "train", "--heads", "1,2", "--steps", "20", "--checkpoint-every", "10",
            "--json", "--cache", str(tmp_path)]
    trained = command.json(args)
    assert set(trained["runs"]) == {"1", "2"} and trained["runs"]["2"]["n_checkpoints"] == 3
    args[1] = "analyse"
    summary = command.json(args + ["--n-prompts", "64"])
    assert len(summary["runs"]["2"]["omega"]) == 2 and "loss_gap_h1_minus_h2" in summary
    assert command(["linear-icl", "train", "--heads", "0", "--cache", str(tmp_path)]) == 2
    assert "--heads" in capsys.readouterr().err


def test_cli_runs_on_one_thread_and_restores_the_thread_count(tmp_path, monkeypatch, capsys):
    """The command trains on one thread (its default), and leaves torch's thread count as it
    found it; ``--threads`` overrides the default."""
    command = OneCommand("linear_icl", monkeypatch, capsys)
    seen = record_threads(monkeypatch, icl, "linear_icl_run")
    with torch_threads(2):
        args = ["linear-icl", "train", "--heads", "1", "--steps", "4", "--checkpoint-every",
                "2", "--json", "--cache", str(tmp_path)]
        assert command(args) == 0
        assert torch.get_num_threads() == 2 and seen == [1]
        assert command(args + ["--threads", "3"]) == 0
        assert torch.get_num_threads() == 2 and seen == [1, 3]
    capsys.readouterr()


# -- the shipped seed-0 runs ---------------------------------------------------------


def test_safetensors_round_trip_keeps_layout_and_rounds_weights_to_float16(tmp_path):
    runs = {H: icl.train_linear_icl(n_heads=H, d=2, context_length=6, steps=4, checkpoint_every=2,
                                    batch_size=8, n_test=8, test_lengths=[3, 6], seed=H) for H in (1, 3)}
    analyses = {H: icl.attention_patterns(r) for H, r in runs.items()}
    path = icl.save_linear_icl_runs_safetensors(runs, tmp_path / "runs.safetensors", analyses=analyses)
    back, back_analyses = icl.load_linear_icl_runs_safetensors(path)
    assert sorted(back) == [1, 3] and sorted(back_analyses) == [1, 3]
    for H, run in runs.items():
        for name in ("W_Q", "W_K", "W_V", "W_O"):
            assert back[H][name].dtype == np.float32 and back[H][name].dims == run[name].dims
            np.testing.assert_array_equal(back[H][name].values,
                                          run[name].values.astype(np.float16).astype(np.float32))
        np.testing.assert_array_equal(back[H]["test_loss"].values, run["test_loss"].values)  # not rounded
        np.testing.assert_array_equal(back[H]["wall_seconds"].values, run["wall_seconds"].values)
        assert list(back[H]["feature"].values) == list(run["feature"].values)
        assert back[H].attrs == json.loads(json.dumps(run.attrs))
        np.testing.assert_array_equal(back_analyses[H]["W_KQ"].values, analyses[H]["W_KQ"].values)
    with pytest.raises(InputError, match="no analysis for the run with H = 3"):
        icl.save_linear_icl_runs_safetensors(runs, tmp_path / "x.safetensors", analyses={1: analyses[1]})
    with pytest.raises(InputError, match="no safetensors file"):
        icl.load_linear_icl_runs_safetensors(tmp_path / "missing.safetensors")


_shipped = pytest.mark.skipif(not icl.SHIPPED_RUNS.is_file(), reason="the shipped runs are missing")


@_shipped
def test_shipped_runs_are_small_and_their_analyses_are_those_of_their_weights():
    assert icl.SHIPPED_RUNS.stat().st_size < 1_000_000
    runs, analyses = icl.load_linear_icl_runs_safetensors(icl.SHIPPED_RUNS)
    assert sorted(runs) == sorted(analyses) == list(icl.SHIPPED_HEADS)
    for H, run in runs.items():
        assert {**run.attrs["params"], "seed": run.attrs["seed"]} == {
            **icl.DEFAULTS, "n_heads": H, "test_lengths": list(icl.TEST_LENGTHS), "n_test": 2048}
        assert run.sizes["step"] == 81 and run.sizes["head"] == H
        # omega and mu of the shipped analysis, recomputed from the shipped (float16) weights
        # by hand at the last checkpoint: omega = mean diag of the x-block of Q K^T / sqrt(D).
        last = run.isel(step=-1)
        kq = np.einsum("hik,hjk->hij", last["W_Q"].values.astype(np.float64), last["W_K"].values)
        ov = np.einsum("hik,hk->hi", last["W_V"].values.astype(np.float64), last["W_O"].values)
        omega = np.diagonal(kq[:, :5, :5], axis1=1, axis2=2).mean(-1) / math.sqrt(6)
        np.testing.assert_allclose(analyses[H]["omega"].isel(step=-1).values, omega, rtol=1e-6)
        np.testing.assert_allclose(analyses[H]["mu"].isel(step=-1).values, ov[:, -1], rtol=1e-6)
    # The paper's result: two heads pair up (mu summing to ~0) and beat one head.
    assert float(analyses[2]["mu_sum_ratio"].isel(step=-1)) < 0.05
    assert analyses[2].attrs["pattern_step"] is not None
    assert analyses[1].attrs["final_test_loss"] > analyses[2].attrs["final_test_loss"] + 0.05


@pytest.mark.slow
@_shipped
def test_retraining_seed_0_reproduces_the_shipped_first_checkpoints():
    """Same seed, same prompts, same Adam steps: the first 500 steps train to the shipped
    weights up to their float16 rounding (half a float16 step; one step allowed for float
    differences between CPUs), and to the same full-precision losses."""
    runs, _ = icl.load_linear_icl_runs_safetensors(icl.SHIPPED_RUNS)
    for H in icl.SHIPPED_HEADS:
        fresh = icl.train_linear_icl(**{**icl.DEFAULTS, "n_heads": H, "steps": 500})
        shipped = runs[H].isel(step=slice(0, 3))
        np.testing.assert_array_equal(shipped["step"].values, fresh["step"].values)     # 0, 250, 500
        for name in ("W_Q", "W_K", "W_V", "W_O"):
            want = fresh[name].values
            got = shipped[name].values
            ulp = np.spacing(np.abs(got).astype(np.float16)).astype(np.float32)       # float16 step
            assert np.all(np.abs(got - want) <= ulp), (H, name, float(np.abs(got - want).max()))
            assert not np.array_equal(got[0], got[-1])                                 # it trained
        np.testing.assert_allclose(shipped["test_loss"].values, fresh["test_loss"].values, rtol=1e-5)
        np.testing.assert_allclose(shipped["train_loss"].values[1:], fresh["train_loss"].values[1:], rtol=1e-5)


@_shipped
def test_empty_store_reads_the_shipped_run_and_analysis_without_training(tmp_path, monkeypatch):
    from explorer.store import ActivationStore

    store = ActivationStore(tmp_path)
    monkeypatch.setattr(icl_runs, "train_linear_icl", lambda **kw: pytest.fail("trained instead of reading"))
    monkeypatch.setattr(icl_runs, "linear_icl_analysis", lambda *a, **kw: pytest.fail("analysed instead of reading"))
    run = icl.linear_icl_run(store=store, n_heads=4)
    assert "shipped" in run.attrs["source"] and run.sizes["head"] == 4
    analysis = icl.stored_linear_icl_analysis(run, store=store)
    _, shipped = icl.load_linear_icl_runs_safetensors(icl.SHIPPED_RUNS)
    np.testing.assert_array_equal(analysis["dgd_r2"].values, shipped[4]["dgd_r2"].values)
    # Any other setting is trained (a head count not shipped, another seed), not read.
    for other in ({"n_heads": 3}, {"n_heads": 2, "seed": 1}):
        with pytest.raises(pytest.fail.Exception, match="trained instead"):
            icl.linear_icl_run(store=store, **other)
    with pytest.raises(pytest.fail.Exception, match="analysed instead"):
        icl.stored_linear_icl_analysis(run, store=store, n_prompts=64)
