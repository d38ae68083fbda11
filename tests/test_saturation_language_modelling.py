"""The paper's language-modelling comparison (rank-2 accuracy where the top-1 is wrong,
early vs last-layer s_2) on hand-built cases, against scipy and published values."""
from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chi2_contingency

from explorer._checks import InputError
from explorer.analyses.saturation.language_modelling import (
    rank2_accuracy_by_saturation,
    two_proportion_z_test,
    wilson_interval,
)

L = 30


def test_groups_and_accuracies_on_a_hand_built_case():
    # [position, rank]: s_1, s_2; final top-1, top-2; next token
    rows = [  # (s2, top1, top2, next)  -> group
        (5, 1, 2, 2),     # top-1 wrong, s_2 early, rank 2 right   -> early hit
        (23, 1, 2, 3),    # top-1 wrong, s_2 = L - 7, rank 2 wrong -> early miss
        (24, 1, 2, 2),    # s_2 = L - 6: neither group
        (29, 1, 2, 2),    # last layer, rank 2 right -> last hit
        (29, 1, 2, 4),    # last miss
        (29, 1, 2, 5),    # last miss
        (5, 7, 2, 7),     # top-1 right: skipped
        (0, 1, 2, 2),     # s_2 = 0 (at rank 2 from the start): neither group
        (-1, 1, 2, 2),    # never: neither
        (5, 1, 2, -1),    # no next token: skipped
    ]
    s2, top1, top2, nxt = map(np.array, zip(*rows))
    sat = np.stack([np.zeros_like(s2), s2], -1)[None]            # [prompt, pos, rank]
    final = np.stack([top1, top2], -1)[None]
    out = rank2_accuracy_by_saturation(sat, final, nxt[None], L, n_boot=500)
    assert out["n_top1_wrong"] == 8
    assert (out["early"]["n"], out["early"]["correct"]) == (2, 1)
    assert (out["last"]["n"], out["last"]["correct"]) == (3, 1)
    assert out["difference"] == pytest.approx(0.5 - 1 / 3)
    assert out["difference_low"] <= out["difference"] <= out["difference_high"]
    table = np.array([[1, 1], [1, 2]])                           # [group, hit/miss]
    chi2, p, *_ = chi2_contingency(table, correction=False)
    assert out["z"] ** 2 == pytest.approx(chi2) and out["p_value"] == pytest.approx(p)


def test_z_test_equals_the_uncorrected_chi_square():
    z, p = two_proportion_z_test(40, 100, 25, 100)
    chi2, pc, *_ = chi2_contingency(np.array([[40, 60], [25, 75]]), correction=False)
    assert z > 0 and z * z == pytest.approx(chi2) and p == pytest.approx(pc)
    assert np.isnan(two_proportion_z_test(0, 0, 3, 10)[0])
    assert np.isnan(two_proportion_z_test(0, 5, 0, 10)[1])        # pooled rate 0


def test_wilson_interval_published_values():
    # Newcombe (1998), Table I: 81/263 -> 0.2553 to 0.3662; 15/148 -> 0.0624 to 0.1605
    assert wilson_interval(81, 263) == pytest.approx((0.2553, 0.3662), abs=1e-4)
    assert wilson_interval(15, 148) == pytest.approx((0.0624, 0.1605), abs=1e-4)
    lo, hi = wilson_interval(0, 10)
    assert lo == pytest.approx(0.0, abs=1e-12) and 0.27 < hi < 0.28
    assert all(np.isnan(wilson_interval(0, 0)))


def test_bad_arguments_are_named():
    with pytest.raises(InputError, match="`early_margin` must be an int in"):
        rank2_accuracy_by_saturation(np.zeros((1, 2)), np.zeros((1, 2)), np.zeros(1), L,
                                     early_margin=0)
