"""The predictors and the theory of in-context linear regression (He et al., ICML 2025).

Pure numpy, batched over prompts: one step of plain and of debiased gradient descent, ridge
regression (the Bayes-optimal predictor at ``ridge = noise_var * d``), the predictor of an
attention layer with the ideal pattern, the least-squares step size, the Bayes risk (Monte
Carlo and its Marchenko-Pastur limit), and the paper's approximate loss with its optimal
``mu``. `explorer.analyses.linear_icl` trains the model these are compared with and
re-exports every name.
"""
from __future__ import annotations

import math

import numpy as np

from explorer._checks import InputError, check_float, check_int

__all__ = ["gd_predict", "debiased_gd_predict", "ridge_predict", "pattern_predict",
           "fit_step_size", "bayes_risk", "bayes_risk_asymptotic", "approximate_loss",
           "optimal_mu"]


def _as_prompts(X, y, x_q) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    X, y, x_q = (np.asarray(a, dtype=np.float64) for a in (X, y, x_q))
    if X.ndim == 2:  # one prompt
        X, y, x_q = X[None], y[None], x_q[None]
    if X.ndim != 3 or y.shape != X.shape[:2] or x_q.shape != (X.shape[0], X.shape[2]):
        raise InputError(f"expected X (prompt, L, d), y (prompt, L), x_q (prompt, d); got shapes "
                         f"{X.shape}, {y.shape}, {x_q.shape}.")
    return X, y, x_q


def gd_predict(X, y, x_q, step_size: float) -> np.ndarray:
    """One step of gradient descent from beta = 0: ``(eta / L) sum_i y_i x_i^T x_q``."""
    X, y, x_q = _as_prompts(X, y, x_q)
    L = X.shape[1]
    return step_size / L * np.einsum("pl,pld,pd->p", y, X, x_q)


def debiased_gd_predict(X, y, x_q, step_size: float) -> np.ndarray:
    """Debiased gradient descent: ``(eta / L) sum_i y_i (x_i - x_bar)^T x_q``.

    One gradient step from beta = 0 on the least squares loss of the centred covariates,
    ``(1 / 2L) sum_i (y_i - beta^T (x_i - x_bar))^2``; the predictor a symmetric pair of
    softmax heads computes to first order (He et al., ICML 2025, Section 4).
    """
    X, y, x_q = _as_prompts(X, y, x_q)
    L = X.shape[1]
    centred = X - X.mean(axis=1, keepdims=True)
    return step_size / L * np.einsum("pl,pld,pd->p", y, centred, x_q)


def ridge_predict(X, y, x_q, ridge: float) -> np.ndarray:
    """Ridge regression ``beta = (X^T X + ridge I)^-1 X^T y``; with ``ridge = noise_var * d``
    this is the posterior mean under beta ~ N(0, I/d), the Bayes-optimal predictor."""
    X, y, x_q = _as_prompts(X, y, x_q)
    ridge = check_float("ridge", ridge, low=0.0)
    d = X.shape[2]
    gram = np.einsum("pld,ple->pde", X, X) + ridge * np.eye(d)
    beta = np.linalg.solve(gram, np.einsum("pld,pl->pd", X, y)[..., None])[..., 0]
    return (beta * x_q).sum(-1)


def pattern_predict(X, y, x_q, omega, mu) -> np.ndarray:
    """The predictor of an attention layer with the ideal pattern:
    ``sum_h mu_h sum_i y_i softmax_i(omega_h x_i^T x_q)`` (``omega`` already includes the
    1/sqrt(d+1) of the attention scores)."""
    X, y, x_q = _as_prompts(X, y, x_q)
    omega = np.atleast_1d(np.asarray(omega, dtype=np.float64))
    mu = np.atleast_1d(np.asarray(mu, dtype=np.float64))
    if omega.shape != mu.shape or omega.ndim != 1:
        raise InputError(f"`omega` and `mu` must be 1-d with one entry per head; got {omega.shape}, {mu.shape}.")
    s = np.einsum("pld,pd->pl", X, x_q)                                  # [prompt, L]
    logits = omega[None, :, None] * s[:, None, :]                         # [prompt, head, L]
    logits -= logits.max(axis=-1, keepdims=True)
    w = np.exp(logits)
    w /= w.sum(axis=-1, keepdims=True)
    return np.einsum("h,phl,pl->p", mu, w, y)


def fit_step_size(predictions_at_unit_step: np.ndarray, targets: np.ndarray) -> float:
    """Least-squares step size ``eta`` for a predictor linear in eta: argmin ||eta p - t||^2."""
    p = np.asarray(predictions_at_unit_step, dtype=np.float64)
    t = np.asarray(targets, dtype=np.float64)
    denom = float((p * p).sum())
    return float((p * t).sum() / denom) if denom > 0 else 0.0


def bayes_risk(context_length: int, d: int, noise_var: float, *, n_samples: int = 20000,
               seed: int = 0) -> float:
    """Expected squared error of the Bayes-optimal (posterior-mean) predictor, by Monte Carlo.

    With beta ~ N(0, I/d) the posterior covariance is ``noise_var (X^T X + noise_var d I)^-1``,
    so the risk is ``noise_var + noise_var E tr((X^T X + noise_var d I)^-1)``; only X is sampled.
    """
    L = check_int("context_length", context_length, low=1)
    d = check_int("d", d, low=1)
    s2 = check_float("noise_var", noise_var, low=0.0)
    rng = np.random.default_rng(seed)
    total, done = 0.0, 0
    while done < n_samples:
        n = min(4096, n_samples - done)
        X = rng.standard_normal((n, L, d))
        gram = np.einsum("pld,ple->pde", X, X) + s2 * d * np.eye(d)
        total += float(np.trace(np.linalg.inv(gram), axis1=1, axis2=2).sum())
        done += n
    return s2 + s2 * total / n_samples


def bayes_risk_asymptotic(context_length: int, d: int, noise_var: float) -> float:
    """Bayes risk in the limit L, d -> infinity with xi = L / d fixed (Marchenko-Pastur):
    ``(noise_var + 1 - xi + sqrt((xi - 1 + noise_var)^2 + 4 noise_var)) / 2``.

    Derived from ``noise_var + noise_var * gamma * m(-noise_var * gamma)`` with
    ``gamma = 1 / xi`` and m the Stieltjes transform of the Marchenko-Pastur law.
    """
    xi = check_int("context_length", context_length, low=1) / check_int("d", d, low=1)
    s2 = check_float("noise_var", noise_var, low=0.0)
    return 0.5 * (s2 + 1 - xi + math.sqrt((xi - 1 + s2) ** 2 + 4 * s2))


def approximate_loss(omega, mu, *, context_length: int, d: int, noise_var: float) -> float:
    """The paper's approximate loss of the ideal pattern:
    ``1 + s2 - 2 mu^T omega + mu^T (omega omega^T + (1 + s2)/L exp(d omega omega^T)) mu``."""
    omega = np.atleast_1d(np.asarray(omega, dtype=np.float64))
    mu = np.atleast_1d(np.asarray(mu, dtype=np.float64))
    A = np.outer(omega, omega) + (1 + noise_var) / context_length * np.exp(d * np.outer(omega, omega))
    return float(1 + noise_var - 2 * mu @ omega + mu @ A @ mu)


def optimal_mu(omega, *, context_length: int, d: int, noise_var: float) -> np.ndarray:
    """The ``mu`` minimising `approximate_loss` for given ``omega``:
    ``(omega omega^T + (1 + s2)/L exp(d omega omega^T))^-1 omega``."""
    omega = np.atleast_1d(np.asarray(omega, dtype=np.float64))
    A = np.outer(omega, omega) + (1 + noise_var) / context_length * np.exp(d * np.outer(omega, omega))
    return np.linalg.lstsq(A, omega, rcond=None)[0]
