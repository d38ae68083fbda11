"""The paper's language-modelling comparison: is an early-saturating rank-2 token a better
guess when the top-1 is wrong?

Lioubashevski et al. (ICML 2025; ``practical_applications/better_language_modeling.py`` of
their code) take the positions where the model's final top-1 is not the true next token and
compare the accuracy of the final rank-2 token between positions whose rank-2 token
saturated early (s_2 <= L - 7) and those where it is fixed only at the last layer
(s_2 = L - 1), with a two-proportion z-test. If the model decides its ranks in order, an
early-decided second choice should be the better guess.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
from scipy.stats import norm

from explorer._checks import check_int
from explorer.analyses._intervals import wilson_interval

__all__ = ["rank2_accuracy_by_saturation", "two_proportion_z_test", "wilson_interval"]


def two_proportion_z_test(x1: int, n1: int, x2: int, n2: int) -> tuple[float, float]:
    """Pooled two-proportion z statistic of x1/n1 - x2/n2 and its two-sided p (the paper's
    ``calculate_proportion_test``); NaNs when a group is empty or the pooled rate is 0 or 1.

    A tuple: (z, p), as a test's result is.
    """
    if n1 == 0 or n2 == 0:
        return math.nan, math.nan
    pooled = (x1 + x2) / (n1 + n2)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n1 + 1 / n2))
    if se == 0:
        return math.nan, math.nan
    z = (x1 / n1 - x2 / n2) / se
    return z, float(2 * norm.sf(abs(z)))


def rank2_accuracy_by_saturation(sat_layer: Any, final_token_id: Any, next_token_id: Any,
                                 n_layers: int, *, early_margin: int = 7,
                                 n_boot: int = 1000, seed: int = 0) -> dict[str, Any]:
    """Rank-2 accuracy where the top-1 is wrong, early (s_2 <= L - ``early_margin``) vs
    last-layer (s_2 = L - 1) saturation of the rank-2 token.

    A dict of scalars: the test's counts, accuracies and p-value, printed as JSON.

    Parameters
    ----------
    sat_layer : array-like of int, shape [..., rank >= 2]
        Saturation layers (`saturation_layers`' ``sat_layer``; -1 never, 0 from the start).
    final_token_id : array-like of int, shape [..., rank >= 2]
        The final layer's ranked tokens.
    next_token_id : array-like of int, shape [...]
        The true next token; negative where there is none (skipped).
    n_layers : int
    early_margin : int, default=7
        The paper's ``num_layers - 7``.

    Returns
    -------
    dict
        Per group (``early``, ``last``): ``n`` positions, ``correct`` and ``accuracy`` with its
        Wilson 95 % interval; ``difference`` (early - last) with a percentile bootstrap
        interval over positions; ``z`` and ``p_value`` of the pooled two-proportion test.
        As in the paper's code, a rank-2 token at its rank from layer 0 on (s_2 = 0 here,
        L in the paper's helper) is in neither group.
    """
    n_layers = check_int("n_layers", n_layers, low=2)
    early_margin = check_int("early_margin", early_margin, low=1, high=n_layers)
    s2 = np.asarray(sat_layer)[..., 1].ravel()
    top = np.asarray(final_token_id)
    top1, top2 = top[..., 0].ravel(), top[..., 1].ravel()
    nxt = np.asarray(next_token_id).ravel()
    wrong = (nxt >= 0) & (top1 >= 0) & (top1 != nxt)
    groups = {"early": wrong & (s2 >= 1) & (s2 <= n_layers - early_margin),
              "last": wrong & (s2 == n_layers - 1)}
    out: dict[str, Any] = {"n_layers": n_layers, "early_margin": early_margin,
                           "n_top1_wrong": int(wrong.sum())}
    hits = {}
    for name, mask in groups.items():
        hit = (top2[mask] == nxt[mask])
        hits[name] = hit
        lo, hi = wilson_interval(int(hit.sum()), int(hit.size))
        out[name] = {"n": int(hit.size), "correct": int(hit.sum()),
                     "accuracy": float(hit.mean()) if hit.size else math.nan,
                     "accuracy_low": lo, "accuracy_high": hi}
    e, l = hits["early"], hits["last"]
    if e.size and l.size:
        rng = np.random.default_rng(seed)
        boot = (e[rng.integers(0, e.size, (n_boot, e.size))].mean(1)
                - l[rng.integers(0, l.size, (n_boot, l.size))].mean(1))
        out["difference"] = float(e.mean() - l.mean())
        out["difference_low"], out["difference_high"] = (float(np.quantile(boot, 0.025)),
                                                         float(np.quantile(boot, 0.975)))
    else:
        out["difference"] = out["difference_low"] = out["difference_high"] = math.nan
    out["z"], out["p_value"] = two_proportion_z_test(int(e.sum()), e.size, int(l.sum()), l.size)
    return out
