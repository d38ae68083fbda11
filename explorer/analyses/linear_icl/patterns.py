"""The patterns training settles on, checkpoint by checkpoint: each head's key-query scale
``omega_h``, its output-value ``mu_h``, and whether the heads pair up."""
from __future__ import annotations

import math

import numpy as np
import xarray as xr

from explorer.analyses._training import training_attrs
from explorer.analyses.linear_icl.model import CITATION
from explorer.analyses.linear_icl.training import _check_run

__all__ = ['attention_patterns', 'PATTERN_THRESHOLDS', 'pattern_reached']


def attention_patterns(run: xr.Dataset) -> xr.Dataset:
    """Key-query and output-value patterns of every head (at every checkpoint).

    ``W_KQ^h = W_Q^h (W_K^h)^T`` (query feature x key feature) and ``W_OV^h = W_V^h W_O^h``
    (one weight per feature). With D = d + 1 and the x-block ``B = W_KQ[:d, :d]``:

    - ``omega`` = mean(diag B) / sqrt(D): the effective softmax coefficient, so that the
      ideal pattern computes `pattern_predict` with this omega;
    - ``kq_identity_error`` = ||B - (tr B / d) I||_F / ||B||_F: distance of the x-block from
      its best scaled identity (0 = diagonal and homogeneous);
    - ``kq_offdiag_ratio``: energy of the active rows of W_KQ outside the x-block diagonal
      over their total energy (covers the off-diagonal x entries and the y column). The
      row of the query's y entry is left out: that entry is always 0, so the row never acts
      and never receives a gradient;
    - ``kq_diag_cv``: coefficient of variation of diag B (0 = homogeneous);
    - ``mu`` = W_OV[y]: the weight given to y_i;
    - ``ov_offy_ratio`` = ||W_OV[:d]||^2 / ||W_OV||^2: OV energy off the y entry (0 = ideal);
    - ``mu_sum_ratio`` = |sum_h mu_h| / sum_h |mu_h| (0 = the heads cancel: zero-sum);
    - ``active``: the head's |mu| is at least 5% of the largest |mu| (a head that carries
      nothing has no meaningful pattern; with H > 2 some heads die out);
    - ``kq_identity_error_max``, ``ov_offy_ratio_max``: worst active head.

    Parameters
    ----------
    run : xarray.Dataset
        A run from `train_linear_icl` (or any Dataset with ``W_Q``, ``W_K``, ``W_V``, ``W_O``
        with dims (..., head, feature, d_head)).

    Returns
    -------
    xarray.Dataset
        ``W_KQ`` (..., head, query_feature, key_feature), ``W_OV`` (..., head, feature), and
        the metrics above over (..., head) or (...).

    References
    ----------
    J. He, X. Pan, S. Chen and Z. Yang, ICML 2025 (Section 3, "diagonal & homogeneous"
    KQ and "last-entry-only, zero-sum" OV patterns).
    """
    run = _check_run(run)
    Wq, Wk, Wv = (run[n].transpose(..., "head", "feature", "d_head").values.astype(np.float64)
                  for n in ("W_Q", "W_K", "W_V"))
    Wo = run["W_O"].transpose(..., "head", "d_head").values.astype(np.float64)
    kq = np.einsum("...ik,...jk->...ij", Wq, Wk)                          # [..., head, q_feat, k_feat]
    ov = np.einsum("...ik,...k->...i", Wv, Wo)                            # [..., head, feature]
    D = kq.shape[-1]
    d = D - 1
    block = kq[..., :d, :d]
    diag = np.diagonal(block, axis1=-2, axis2=-1)                         # [..., head, d]
    diag_mean = diag.mean(-1)
    omega = diag_mean / math.sqrt(D)
    block_norm = np.sqrt((block**2).sum((-2, -1)))
    resid = block - diag_mean[..., None, None] * np.eye(d)
    identity_error = np.sqrt((resid**2).sum((-2, -1))) / np.where(block_norm > 0, block_norm, np.nan)
    total = (kq[..., :d, :] ** 2).sum((-2, -1))                          # rows the query uses
    offdiag = total - (diag**2).sum(-1)
    offdiag_ratio = offdiag / np.where(total > 0, total, np.nan)
    diag_cv = diag.std(-1) / np.where(np.abs(diag_mean) > 0, np.abs(diag_mean), np.nan)
    mu = ov[..., -1]
    ov_total = (ov**2).sum(-1)
    offy = (ov[..., :-1] ** 2).sum(-1) / np.where(ov_total > 0, ov_total, np.nan)
    active = np.abs(mu) >= 0.05 * np.abs(mu).max(-1, keepdims=True)
    mu_abs = np.abs(mu).sum(-1)
    mu_sum_ratio = np.abs(mu.sum(-1)) / np.where(mu_abs > 0, mu_abs, np.nan)

    lead = tuple(d_ for d_ in run["W_Q"].dims if d_ not in ("head", "feature", "d_head"))
    features = list(run["feature"].values) if "feature" in run.coords else [f"x{i + 1}" for i in range(d)] + ["y"]
    coords = {c: run.coords[c] for c in lead if c in run.coords}
    coords.update({"head": run["head"].values if "head" in run.coords else np.arange(kq.shape[-3]),
                   "query_feature": features, "key_feature": features, "feature": features})
    H = (*lead, "head")
    return xr.Dataset(
        {"W_KQ": ((*H, "query_feature", "key_feature"), kq.astype(np.float32)),
         "W_OV": ((*H, "feature"), ov.astype(np.float32)),
         "omega": (H, omega), "mu": (H, mu),
         "kq_identity_error": (H, identity_error), "kq_offdiag_ratio": (H, offdiag_ratio),
         "kq_diag_cv": (H, diag_cv), "ov_offy_ratio": (H, offy),
         "mu_sum_ratio": (lead, mu_sum_ratio),
         "active": (H, active),
         "kq_identity_error_max": (lead, _nanmax(np.where(active, identity_error, np.nan))),
         "ov_offy_ratio_max": (lead, _nanmax(np.where(active, offy, np.nan)))},
        coords=coords,
        attrs=training_attrs("attention_patterns", {}, run.attrs.get("seed", 0), CITATION),
    )


def _nanmax(x: np.ndarray) -> np.ndarray:
    """Max over the last axis ignoring NaN; NaN (without a warning) where all are NaN."""
    filled = np.where(np.isnan(x), -np.inf, x).max(axis=-1)
    return np.where(np.isneginf(filled), np.nan, filled)


#: Thresholds of `pattern_reached`: the paper's patterns, numerically.
PATTERN_THRESHOLDS: dict[str, float] = {
    "kq_identity_error_max": 0.1,   # x-block within 10% (Frobenius) of a scaled identity
    "ov_offy_ratio_max": 0.01,      # <1% of OV energy off the y entry
    "mu_sum_ratio": 0.05,           # heads cancel to 5% (only asked of H >= 2)
}


def pattern_reached(patterns: xr.Dataset, thresholds: dict[str, float] | None = None) -> xr.DataArray:
    """Whether every active head shows the paper's pattern, per checkpoint.

    KQ x-block close to a scaled identity, OV on the y entry only, and (with two or more
    heads) the heads' mu summing to about zero; thresholds in `PATTERN_THRESHOLDS`.
    """
    limits = {**PATTERN_THRESHOLDS, **(thresholds or {})}
    ok = (patterns["kq_identity_error_max"] < limits["kq_identity_error_max"]) & \
         (patterns["ov_offy_ratio_max"] < limits["ov_offy_ratio_max"])
    if patterns.sizes["head"] >= 2:
        ok = ok & (patterns["mu_sum_ratio"] < limits["mu_sum_ratio"])
    return ok.rename("pattern_reached")


def _first_settled(flags: np.ndarray) -> int | None:
    """Index from which ``flags`` stays True to the end, or None."""
    for i in range(len(flags)):
        if flags[i:].all():
            return i
    return None
