"""Tests for explorer.analyses.saturation against hand-worked cases and independent computations.

Saturation layers are checked on hand-built rank sequences (ties, never-changing tokens)
and against a brute-force reading of the definition; the lens pass against a plain
Hugging Face forward with ``output_hidden_states`` and full-vocabulary ranks; strict
Kendall tau against scipy; the permutation p-value against scipy's exact permutation
test; the intervention against a plain torch forward hook.
"""
from __future__ import annotations

import argparse
import io
import itertools
import json
import statistics
from contextlib import redirect_stdout

import numpy as np
import pytest
import scipy.stats
import torch

from explorer._checks import InputError
from explorer.analyses import saturation as sat
from explorer.analyses.saturation import analysis as sat_analysis
from explorer.analyses.saturation import lens_pass as sat_lens
from explorer.analyses.saturation import (
    NEVER,
    corpus_chunks,
    early_exit,
    exit_layers,
    exit_metrics,
    inject_residual,
    intervention_pairs,
    kept_positions,
    load_corpus,
    order_test,
    random_init_twin,
    saturation_from_ranks,
    saturation_layers,
    strict_kendall_tau,
    task_labels,
    task_probe,
)
from explorer.commands import saturation as sat_cmd
from explorer.models import load_model
from explorer.store import ActivationStore

TEXTS = [
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a step.",
    "The capital of France is Paris; the capital of Italy is Rome. One two three four five six.",
    "She said that he would come back tomorrow, and they would go to the market together.",
    "In 1905 the physicist wrote four papers that changed how people think about light and time.",
]


# -- saturation layers on hand-built rank sequences ----------------------------------------

def brute_force_saturation(ranks: np.ndarray) -> np.ndarray:
    """The definition read literally: the first layer from which rank j holds to the end."""
    n_layers, k = ranks.shape
    out = []
    for j in range(k):
        s = NEVER
        for layer in range(n_layers):
            if all(ranks[m, j] == j for m in range(layer, n_layers)):
                s = layer
                break
        out.append(s)
    return np.array(out)


def test_saturation_hand_built_sequences():
    # layers x ranks: rank 0 settles at layer 1, rank 1 at layer 2, rank 2 at layer 3
    ranks = np.array([[3, 0, 7],
                      [0, 4, 1],
                      [0, 1, 9],
                      [0, 1, 2]])
    assert saturation_from_ranks(ranks).tolist() == [1, 2, 3]


def test_saturation_never_changing_token_is_layer_zero():
    # the top-1 is the top-1 at every layer: s = 0 (not L, the paper's top-k helper's edge value)
    ranks = np.array([[0, 5], [0, 1], [0, 1]])
    assert saturation_from_ranks(ranks).tolist() == [0, 1]


def test_saturation_only_at_last_layer_and_leaving_and_returning():
    # rank 0 holds at layers 0 and 2-3 but not 1: it saturates at 2; rank 1 only at the end
    ranks = np.array([[0, 2], [3, 0], [0, 2], [0, 1]])
    assert saturation_from_ranks(ranks).tolist() == [2, 3]


def test_saturation_ties():
    # strict ranks: at layer 2 the final rank-1 token ties with the top token (both rank 0),
    # so it is not at rank 1 there and saturates only at layer 3
    ranks = np.array([[1, 0], [0, 1], [0, 0], [0, 1]])
    assert saturation_from_ranks(ranks).tolist() == [1, 3]
    # a tie at the last layer itself: the lower-placed token never holds its rank
    ranks = np.array([[0, 0], [0, 0]])
    assert saturation_from_ranks(ranks).tolist() == [0, NEVER]


def test_saturation_matches_brute_force_on_random_sequences():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n_layers, k = rng.integers(1, 7), rng.integers(1, 5)
        ranks = rng.integers(0, k + 1, size=(n_layers, k))
        ranks[-1] = np.where(rng.random(k) < 0.8, np.arange(k), ranks[-1])
        assert saturation_from_ranks(ranks).tolist() == brute_force_saturation(ranks).tolist()
    batch = rng.integers(0, 3, size=(5, 4, 6, 3))
    expected = np.array([[brute_force_saturation(batch[a, b]) for b in range(4)] for a in range(5)])
    np.testing.assert_array_equal(saturation_from_ranks(batch), expected)


def test_saturation_from_ranks_rejects_1d():
    with pytest.raises(InputError, match=r"`ranks` must have at least 2 dims"):
        saturation_from_ranks([0, 1, 2])


def test_kept_positions_filter_and_ratio():
    s = np.array([[24, 25], [25, 26], [NEVER, 3], [0, 1], [14, 20], [15, 20]])
    # L = 30: s_1 + 1 <= 0.85 * 30 = 25.5 keeps s_1 <= 24
    assert kept_positions(s, 30).tolist() == [True, False, False, True, True, True]
    # configurable: 0.5 * 30 = 15 keeps s_1 <= 14
    assert kept_positions(s, 30, max_ratio=0.5).tolist() == [False, False, False, True, True, False]
    with pytest.raises(InputError, match=r"`max_ratio` must be a number in \[0.0, 1.0\]"):
        kept_positions(s, 30, max_ratio=1.5)


# -- order test ---------------------------------------------------------------------------

def test_strict_tau_without_ties_equals_scipy():
    rng = np.random.default_rng(1)
    for m in range(2, 9):
        for _ in range(20):
            s = rng.permutation(40)[:m]
            expected = scipy.stats.kendalltau(np.arange(m), s).statistic
            assert strict_kendall_tau(s) == pytest.approx(expected)


def test_strict_tau_with_ties_counts_them_discordant():
    # scipy's tau-b = (C - D) / sqrt(P (P - T)) with T tied pairs in s; strict = (C - D - T) / P
    rng = np.random.default_rng(2)
    checked = 0
    for m in range(3, 9):
        for _ in range(30):
            s = rng.integers(0, 4, size=m)
            pairs = m * (m - 1) // 2
            tied = sum(s[i] == s[j] for i, j in itertools.combinations(range(m), 2))
            if tied == pairs:
                assert strict_kendall_tau(s) == -1.0
                continue
            tau_b = scipy.stats.kendalltau(np.arange(m), s, variant="b").statistic
            expected = tau_b * np.sqrt((pairs - tied) / pairs) - tied / pairs
            assert strict_kendall_tau(s) == pytest.approx(expected)
            checked += 1
    assert checked > 100
    assert strict_kendall_tau([[5, 5, 5], [1, 2, 2]]).tolist() == pytest.approx([-1.0, 1 / 3])


def test_order_test_ordered_vs_shuffled():
    n_layers = 30
    ordered = np.array([[2, 5, 9, 12, 20], [1, 3, 4, 8, 10], [10, 11, 12, 13, 14]] * 20)
    res = order_test(ordered, n_layers, k=5, n_permutations=1000, seed=0)
    assert res["mean_tau"] == 1.0
    assert res["p_value"] == pytest.approx(1 / 1001)
    assert res["n_positions"] == 60
    # each list and its reverse: mean tau exactly 0, far from significant
    rng = np.random.default_rng(3)
    rows = [rng.permutation(20)[:5] for _ in range(30)]
    shuffled = np.array(rows + [r[::-1] for r in rows])
    res = order_test(shuffled, n_layers, k=5, n_permutations=1000, seed=0)
    assert res["mean_tau"] == pytest.approx(0.0)
    assert res["p_value"] > 0.2


def test_order_test_p_value_matches_scipy_exact_permutation_test():
    # one position, four ranks: the exact one-sided p over all 24 orders, from scipy
    s = np.array([[3, 1, 7, 9]])
    exact = scipy.stats.permutation_test(
        (np.arange(4), s[0]), lambda x, y: strict_kendall_tau(y[np.argsort(x)]),
        permutation_type="pairings", n_resamples=np.inf, alternative="greater").pvalue
    res = order_test(s, 30, k=4, n_permutations=4000, seed=0)
    assert res["p_value"] == pytest.approx(exact, abs=0.02)


def test_order_test_truncates_and_skips_short_lists():
    n_layers = 10
    s = np.array([
        [1, 2, 3, 9, 4],       # rank 3 saturates only at the last layer: prefix (1, 2, 3)
        [1, 2, NEVER, 3, 4],   # a never-saturating rank cuts the list to 2: not counted
        [3, 2, 1, 5, 6],       # all five count
    ])
    res = order_test(s, n_layers, k=5, n_permutations=10, seed=0)
    assert res["tau"][0] == pytest.approx(1.0)
    assert np.isnan(res["tau"][1])
    assert res["tau"][2] == pytest.approx(strict_kendall_tau([3, 2, 1, 5, 6]))
    assert res["n_positions"] == 2
    with pytest.raises(InputError, match=r"`k` must be an int in \[2, 5\]; got 6"):
        order_test(s, n_layers, k=6)


# -- task probe ---------------------------------------------------------------------------

def test_task_labels_hand_worked():
    # s = (1, 2, 0): rank 3 fixed from layer 0 but rank 1 only from 1: labels count leading ranks
    assert task_labels([[1, 2, 0]], 4, n_tasks=4).tolist() == [[0, 1, 3, 3]]
    assert task_labels([[1, 2, 0]], 4, n_tasks=2).tolist() == [[0, 1, 1, 1]]
    assert task_labels([[NEVER, 0]], 3, n_tasks=3).tolist() == [[0, 0, 0]]
    assert task_labels([[0, NEVER, 0]], 2).tolist() == [[1, 1]]


def _separable(n=120, n_layers=6, d=8, seed=0):
    rng = np.random.default_rng(seed)
    s1 = rng.integers(0, n_layers, size=n)
    s2 = np.minimum(s1 + rng.integers(1, 3, size=n), n_layers - 1)
    labels = task_labels(np.stack([s1, s2], 1), n_layers, n_tasks=3)      # [n, layer]
    centres = rng.normal(0, 4, size=(3, d))
    x = centres[labels] + rng.normal(0, 1, size=(n, n_layers, d))
    return x.astype(np.float32), labels


def test_task_probe_on_separable_data_and_control_at_chance():
    x, y = _separable()
    res = task_probe(x, y, seed=0)
    assert res.attrs["chance"] == pytest.approx(1 / 3)
    assert res.attrs["balanced_accuracy"] > 0.95
    assert abs(res.attrs["control_balanced_accuracy"] - 1 / 3) < 0.12
    # per-layer scores and the out-of-fold predictions agree with a direct recount
    pred = res.probe_task.values
    layer = 3
    recalls = [np.mean(pred[y[:, layer] == c, layer] == c) for c in range(3) if (y[:, layer] == c).any()]
    assert res.probe_layer_accuracy.values[layer] == pytest.approx(np.mean(recalls))


def test_depth_only_and_shuffled_baselines_on_hand_made_cases():
    rng = np.random.default_rng(1)
    n, n_layers, d = 160, 6, 8
    # (a) the label is the depth (0 below layer 3, 1 from it) and the features are noise:
    # depth alone is perfect, and the probe cannot beat it
    y = np.broadcast_to((np.arange(n_layers) >= 3).astype(int), (n, n_layers)).copy()
    res = task_probe(rng.normal(size=(n, n_layers, d)).astype(np.float32), y, seed=0)
    assert res.attrs["depth_balanced_accuracy"] == 1.0
    np.testing.assert_array_equal(res.depth_layer_accuracy.values, 1.0)
    assert res.attrs["probe_beats_depth"] is False
    assert res.attrs["probe_minus_depth_high"] <= 0.05
    # (b) the label is the token's, the same at every layer, and the features carry it:
    # depth alone and shuffled residuals are at chance, the probe is not
    lab = rng.integers(0, 2, size=n)
    y = np.repeat(lab[:, None], n_layers, 1)
    x = (np.where(lab, 2.0, -2.0)[:, None, None] + rng.normal(size=(n, n_layers, d))
         ).astype(np.float32)
    res = task_probe(x, y, seed=0)
    assert res.attrs["balanced_accuracy"] > 0.95
    assert abs(res.attrs["depth_balanced_accuracy"] - 0.5) < 0.1
    assert abs(res.attrs["shuffled_balanced_accuracy"] - 0.5) < 0.1
    lo, hi = res.attrs["probe_minus_depth_low"], res.attrs["probe_minus_depth_high"]
    assert lo <= res.attrs["probe_minus_depth"] <= hi and lo > 0.3
    assert res.attrs["probe_beats_depth"] is True
    # the depth-only probe's predictions depend on the layer alone within each fold: at
    # most one predicted class per layer and fold (checked through the whole layer column)
    res_sep = task_probe(*_separable(), seed=0)
    depth_acc = res_sep.depth_layer_accuracy.values
    assert np.all((depth_acc >= 0) & (depth_acc <= 1))
    assert res_sep.attrs["chance"] < res_sep.attrs["depth_balanced_accuracy"] < \
        res_sep.attrs["balanced_accuracy"]
    off = task_probe(x, y, seed=0, baselines=False)
    assert "depth_balanced_accuracy" not in off.attrs and "depth_layer_accuracy" not in off


def test_task_probe_needs_two_classes():
    x = np.zeros((20, 3, 4), np.float32)
    with pytest.raises(InputError, match=r"at least 2 tasks"):
        task_probe(x, np.zeros((20, 3), int))
    with pytest.raises(InputError, match=r"`features` must be \[position, layer, d_model\]"):
        task_probe(np.zeros((20, 4)), np.zeros((20, 3), int))


# -- early exit ---------------------------------------------------------------------------

def test_exit_layers_and_metrics_constructed_case():
    score = np.array([[0.1, 0.6, 0.9], [0.7, 0.2, 0.1], [0.0, 0.0, np.nan]])
    assert exit_layers(score, 0.5).tolist() == [1, 0, 2]
    top1 = np.array([[5, 6, 7], [7, 7, 7], [1, 2, 3]])
    final = np.array([7, 7, 3])
    nxt = np.array([6, 8, -1])
    m = exit_metrics([1, 0, 2], top1, final, nxt, 3)
    # emitted 6, 7, 3: agree with the model on 2 of 3, with the true token on 1 of the 2 with one
    assert m["accuracy"] == pytest.approx(2 / 3)
    assert m["accuracy_true"] == pytest.approx(1 / 2)
    # speed-up = L * N / sum(exit + 1) = 3 * 3 / (2 + 1 + 3)
    assert m["speedup"] == pytest.approx(9 / 6)


def test_early_exit_probe_oracle_and_baselines():
    n_layers = 4
    top1 = np.array([[1, 2, 2, 2], [3, 3, 4, 4], [5, 5, 5, 5]])
    s1 = saturation_from_ranks((top1 != top1[:, -1:]).astype(int)[..., None])[:, 0]
    assert s1.tolist() == [1, 2, 0]
    probs = np.zeros((3, n_layers, 2))
    probs[..., 0] = [[0.5, 0.9, 0.9, 0.9], [0.4, 0.45, 0.8, 0.9], [0.95, 0.95, 0.95, 0.95]]
    probs[..., 1] = 0.05
    cosine = np.array([[np.nan, 0.5, 0.99, 0.99], [np.nan, 0.99, 0.5, 0.99], [np.nan, 0.9, 0.9, 0.9]])
    probe_task = np.array([[0, 1, 1, 1], [0, 0, 0, 1], [1, 1, 1, 1]])
    nxt = np.array([2, 9, 5])
    ee = early_exit(top1, probs, cosine, s1, probe_task, nxt, margin_thetas=[0.0, 0.5, 0.95],
                    cosine_thetas=[0.95])
    # oracle exits at s_1 = (1, 2, 0): always right, speed-up 12 / (2 + 3 + 1)
    assert ee.attrs["oracle"]["accuracy"] == 1.0
    assert ee.attrs["oracle"]["speedup"] == pytest.approx(12 / 6)
    # probe exits at (1, 3, 0): also right, speed-up 12 / 7
    assert ee.attrs["probe"]["accuracy"] == 1.0
    assert ee.attrs["probe"]["speedup"] == pytest.approx(12 / 7)
    # margin >= 0 exits at layer 0 everywhere: emits (1, 3, 5), right once, speed-up 4
    assert ee.margin_accuracy.values[0] == pytest.approx(1 / 3)
    assert ee.margin_speedup.values[0] == pytest.approx(4.0)
    # margin >= 0.5: p1 - p2 reaches 0.5 at layers (1, 2, 0)
    assert ee.margin_accuracy.values[1] == 1.0
    assert ee.margin_speedup.values[1] == pytest.approx(12 / 6)
    # cosine >= 0.95 exits at (2, 1, 3): emits (2, 3, 5)
    assert ee.cosine_accuracy.values[0] == pytest.approx(2 / 3)
    assert ee.cosine_accuracy_true.values[0] == pytest.approx(2 / 3)
    eq = ee.attrs["equal_accuracy"]
    assert eq["margin"] == pytest.approx(2.0)     # best speed-up among thetas at accuracy 1
    assert np.isnan(eq["cosine"])


# -- the lens pass on a tiny model ------------------------------------------------------------

def reference_ranks(model, text, k, cap):
    """Lens ranks from a plain HF forward: final norm + unembed of every block output."""
    ids = torch.tensor([model.tokenize([text]).token_ids[0]])
    with torch.no_grad():
        out = model.hf(ids, output_hidden_states=True)
        hidden = []
        hooks = [model.hf_layer(i).register_forward_hook(
            lambda mod, inp, o: hidden.append((o[0] if isinstance(o, tuple) else o).clone()))
            for i in range(model.n_layers)]
        model.hf(ids)
        for h in hooks:
            h.remove()
        logits = torch.stack([model.lens_logits(h[0]) for h in hidden])      # [L, pos, vocab]
    final = logits[-1].topk(k, dim=-1).indices                                # [pos, k]
    t_logit = logits.gather(-1, final[None].expand(model.n_layers, -1, -1))   # [L, pos, k]
    ranks = (logits[:, :, None, :] > t_logit[..., None]).sum(-1)             # [L, pos, k]
    return final.numpy(), np.minimum(ranks.numpy(), cap).transpose(1, 0, 2), out.logits[0].numpy()


def test_saturation_layers_against_plain_forward(tiny_model):
    ds = saturation_layers(tiny_model, TEXTS[:2], k=4, rank_cap=20, sample_positions=7, seed=0)
    for p, text in enumerate(TEXTS[:2]):
        final, ranks, logits = reference_ranks(tiny_model, text, 4, 20)
        n = len(final)
        assert ds.mask.values[p].sum() == n
        np.testing.assert_array_equal(ds.final_token_id.values[p, :n], final)
        np.testing.assert_array_equal(ds.final_rank.values[p, :n], ranks)
        np.testing.assert_array_equal(ds.sat_layer.values[p, :n],
                                      [brute_force_saturation(r) for r in ranks])
        # the last layer's lens is the model's own output
        np.testing.assert_array_equal(final[:, 0], logits.argmax(-1))
    assert ds.sizes["sample"] == 7 and ds.resid_sample.shape == (7, 3, 64)
    assert (ds.sample_pos.values < ds.mask.sum("pos").values[ds.sample_prompt.values] - 1).all()
    assert ds.attrs["method"] == "saturation_layers" and "Lioubashevski" in ds.attrs["params"]["citation"]


def test_saturation_layers_cosine_and_samples_match_trace(tiny_model):
    from explorer.trace import trace

    ds = saturation_layers(tiny_model, TEXTS[:2], k=2, sample_positions=5, seed=1)
    tr = trace(tiny_model, TEXTS[:2], sites=("resid_post",))
    h = tr.resid_post.values                                               # [prompt, pos, L, d]
    cos = (h[..., 1:, :] * h[..., :-1, :]).sum(-1) / (
        np.linalg.norm(h[..., 1:, :], axis=-1) * np.linalg.norm(h[..., :-1, :], axis=-1))
    m = ds.mask.values
    np.testing.assert_allclose(ds.cosine.values[..., 1:][m], cos[m], rtol=1e-5)
    assert np.isnan(ds.cosine.values[..., 0]).all()
    sp, sq = ds.sample_prompt.values, ds.sample_pos.values
    np.testing.assert_allclose(ds.resid_sample.values, h[sp, sq], rtol=1e-6)


def test_saturation_layers_input_errors(tiny_model):
    with pytest.raises(InputError, match=r"`k` must be an int in \[1, 64\]; got 0"):
        saturation_layers(tiny_model, TEXTS, k=0)
    with pytest.raises(InputError, match=r"`rank_cap` must be an int in \[5, 512\]; got 2"):
        saturation_layers(tiny_model, TEXTS, k=5, rank_cap=2)
    with pytest.raises(InputError, match=r"`prompts` must hold at least one prompt"):
        saturation_layers(tiny_model, [])


@pytest.mark.slow
def test_analysis_is_served_from_the_store(tiny_model, tmp_path, monkeypatch):
    store = ActivationStore(tmp_path)
    kw = dict(k=5, n_permutations=50, sample_positions=60, n_pairs=1, seed=0, store=store)
    first = sat.saturation_analysis(tiny_model, TEXTS, **kw).load()
    assert "tau" in first and first.attrs["summary"]["n_tokens"] == int(first.mask.sum())

    def boom(*a, **k):
        raise AssertionError("recomputed instead of read from the store")

    # patched where they are called (the submodules), so a miss would raise
    monkeypatch.setattr(sat_lens, "_saturation_pass", boom)
    monkeypatch.setattr(sat_analysis, "saturation_from_lens", boom)
    with pytest.raises(AssertionError, match="recomputed"):
        sat.saturation_analysis(tiny_model, TEXTS[:1], **kw)
    second = sat.saturation_analysis(tiny_model, TEXTS, **kw).load()
    np.testing.assert_array_equal(first.sat_layer.values, second.sat_layer.values)
    np.testing.assert_array_equal(first.tau.values, second.tau.values)
    assert second.attrs["summary"] == first.attrs["summary"]
    # the lens pass alone is cached too: a new probe setting re-analyses without re-tracing
    monkeypatch.undo()
    monkeypatch.setattr(sat_lens, "_saturation_pass", boom)
    third = sat.saturation_analysis(tiny_model, TEXTS, **{**kw, "n_permutations": 20})
    np.testing.assert_array_equal(third.sat_layer.values, first.sat_layer.values)


def test_lens_pass_in_cached_parts_equals_one_pass(tiny_model, tmp_path, monkeypatch):
    texts = TEXTS + TEXTS[:2]
    kw = dict(k=4, rank_cap=20, sample_positions=30, seed=2, batch_size=2)
    one = saturation_layers(tiny_model, texts, **kw)
    store = ActivationStore(tmp_path)
    status = sat.cache_saturation_parts(tiny_model, texts, store=store, part_texts=2,
                                        time_budget_s=0, **kw)
    assert status == {"parts": 3, "cached": 1, "computed": 1}          # one part, then stop
    status = sat.cache_saturation_parts(tiny_model, texts, store=store, part_texts=2, **kw)
    assert status == {"parts": 3, "cached": 3, "computed": 2}
    monkeypatch.setattr(sat_lens, "_saturation_pass", None)            # everything is cached
    with pytest.raises(TypeError):                                     # (the patch is live)
        saturation_layers(tiny_model, texts[:1], **kw)
    joined = saturation_layers(tiny_model, texts, part_texts=2, store=store, **kw).load()
    for name in one.variables:
        np.testing.assert_array_equal(joined[name].values, one[name].values, err_msg=name)
    with pytest.raises(InputError, match=r"`part_texts` must be a multiple of `batch_size`=2; got 3"):
        sat.cache_saturation_parts(tiny_model, texts, store=store, part_texts=3, **kw)


def test_bfloat16_screen_gives_the_float32_ranks(tiny_model):
    exact = saturation_layers(tiny_model, TEXTS, k=5, rank_cap=20, sample_positions=0)
    screened = saturation_layers(tiny_model, TEXTS, k=5, rank_cap=20, sample_positions=0,
                                 unembed_dtype="bfloat16")
    for name in ("final_rank", "sat_layer", "top_token_id"):
        np.testing.assert_array_equal(screened[name].values, exact[name].values, err_msg=name)
    np.testing.assert_allclose(screened.top_prob.values, exact.top_prob.values, atol=5e-3)
    assert screened.attrs["params"]["unembed_dtype"] == "bfloat16"
    with pytest.raises(InputError, match=r"`unembed_dtype` must be one of 'float32', 'bfloat16'; got 'fp16'"):
        saturation_layers(tiny_model, TEXTS, unembed_dtype="fp16")


def test_saturation_over_store_on_a_local_cluster(tiny_model, tmp_path):
    from explorer.distributed import open_entry

    store = ActivationStore(tmp_path)
    kw = dict(k=6, n_permutations=40, sample_positions=0, n_pairs=0, seed=1, store=store)
    in_memory = sat.saturation_analysis(tiny_model, TEXTS, **{**kw, "store": None})
    lens = saturation_layers(tiny_model, TEXTS, k=6, sample_positions=0, seed=1, store=store)
    [key] = [e["key"] for e in store.ls() if e["parts"]["method"] == "saturation_layers"]
    lazy = open_entry(store, key, memory_limit=4096)                   # small dask chunks
    assert lazy.final_rank.chunks is not None and len(lazy.final_rank.chunks[0]) > 1
    out = sat.saturation_over_store(lazy, k_orders=(3, 4, 5, 6), pos_chunk=8, scheduler="local",
                                    scheduler_options=dict(n_workers=1, processes=False))
    np.testing.assert_array_equal(out.sat_layer.values, in_memory.sat_layer.values)
    np.testing.assert_array_equal(out.kept.values, in_memory.kept.values)
    np.testing.assert_array_equal(out.tau.values.astype(np.float32), in_memory.tau.values)
    # independently: s_j of every position from the stored ranks, read literally
    ranks = lens.final_rank.values[lens.mask.values]
    np.testing.assert_array_equal(out.sat_layer.values[lens.mask.values],
                                  [brute_force_saturation(r) for r in ranks])
    # the whole analysis with a scheduler: the same numbers
    via_dask = sat.saturation_analysis(tiny_model, TEXTS, scheduler="synchronous", **kw)
    for name in ("sat_layer", "kept", "tau", "mean_tau", "p_value", "null_mean_tau"):
        np.testing.assert_array_equal(via_dask[name].values, in_memory[name].values, err_msg=name)
    with pytest.raises(InputError, match=r"`scheduler` must be one of 'threads', 'synchronous', 'local'; got 'thread'"):
        sat.saturation_over_store(lazy, scheduler="thread")
    with pytest.raises(InputError, match=r"`lens` has no 'final_rank'"):
        sat.saturation_over_store(lazy.drop_vars("final_rank"))


def test_analysis_order_results_match_order_test(tiny_model):
    ds = sat.saturation_analysis(tiny_model, TEXTS, k=6, n_permutations=30, sample_positions=0,
                                 n_pairs=0, seed=4)
    kept = ds.kept.values
    assert (kept == (kept_positions(ds.sat_layer.values, 3) & ds.mask.values)).all()
    ref = order_test(ds.sat_layer.values[kept], 3, k=4, n_permutations=30, seed=4)
    sel = ds.sel(k_order=4)
    np.testing.assert_array_equal(sel.tau.values[kept], ref["tau"])
    assert float(sel.p_value) == ref["p_value"]
    assert ds.sizes["pair"] == 0 and "probe_task" not in ds


# -- intervention -------------------------------------------------------------------------

def test_inject_residual_matches_a_torch_hook(tiny_model):
    text, src, tgt, layer = TEXTS[1], 3, 10, 1
    ids = torch.tensor([tiny_model.tokenize([text]).token_ids[0]])
    with torch.no_grad():
        clean = tiny_model.hf(ids, output_hidden_states=True)
        h_src = clean.hidden_states[layer + 1][0, src].clone()

        def hook(mod, inp, out):
            (out[0] if isinstance(out, tuple) else out)[0, tgt] = h_src
            return out

        handle = tiny_model.hf_layer(layer).register_forward_hook(hook)
        edited = tiny_model.hf(ids).logits[0, tgt]
        handle.remove()
    r = inject_residual(tiny_model, text, source_pos=src, target_pos=tgt, layer=layer)
    assert r["top1_before"] == int(clean.logits[0, tgt].argmax())
    assert r["top1_after"] == int(edited.argmax())
    assert r["prediction_changed"] == (r["top1_before"] != r["top1_after"])
    assert r["s1_after"] == saturation_from_ranks(np.array(r["rank_after"])[:, None])[0]
    # below the injection layer the target reads as before; at it, as the source
    assert r["rank_after"][-1] == 0
    with pytest.raises(InputError, match=r"`layer` must be an int in \[0, 1\]; got 2"):
        inject_residual(tiny_model, text, source_pos=src, target_pos=tgt, layer=2)
    with pytest.raises(InputError, match=r"`target_pos` must be an int in \[0, "):
        inject_residual(tiny_model, text, source_pos=src, target_pos=999, layer=0)


def test_intervention_pairs_constructed_case():
    s = np.full((1, 8, 2), 20)
    s[0, :, 0] = [2, 15, 3, 14, 1, 20, 0, 5]
    top1 = np.array([[7, 7, 8, 8, 9, 9, 3, 4]])
    mask = np.ones((1, 8), bool)
    kw = dict(min_gap=10, min_sat_layer=0, max_distance=3)
    pairs = intervention_pairs(s, top1, mask, 30, n_pairs=10, seed=0, **kw)
    # same prediction, gap >= 10, distance <= 3: (0 -> 1), (2 -> 3), (4 -> 5)
    assert sorted(map(tuple, pairs.tolist())) == [(0, 0, 1), (0, 2, 3), (0, 4, 5)]
    assert intervention_pairs(s, top1, mask, 30, n_pairs=1, **kw).shape == (1, 3)
    # the largest gap first: (4 -> 5) has 19
    assert intervention_pairs(s, top1, mask, 30, **kw)[0].tolist() == [0, 4, 5]


def test_intervention_pairs_minimum_saturation_layer():
    # early tokens saturating at 2, 8, 12; late ones at 20, 22, 25; one prediction per pair
    s = np.full((1, 6, 2), 29)
    s[0, :, 0] = [2, 20, 8, 22, 12, 25]
    top1 = np.array([[5, 5, 6, 6, 7, 7]])
    mask = np.ones((1, 6), bool)
    kw = dict(min_gap=10, max_distance=1, n_pairs=10)
    every = intervention_pairs(s, top1, mask, 30, min_sat_layer=0, **kw)
    assert sorted(map(tuple, every.tolist())) == [(0, 0, 1), (0, 2, 3), (0, 4, 5)]
    # the paper's rule: both saturation layers >= 10 (of 48 layers; here given directly)
    assert intervention_pairs(s, top1, mask, 30, min_sat_layer=10, **kw).tolist() == [[0, 4, 5]]
    # s_1 = 8 passes 8 but not 9
    assert sorted(map(tuple, intervention_pairs(s, top1, mask, 30, min_sat_layer=8, **kw).tolist())) \
        == [(0, 2, 3), (0, 4, 5)]
    assert intervention_pairs(s, top1, mask, 30, min_sat_layer=9, **kw).tolist() == [[0, 4, 5]]
    # the default scales the paper's 10 of 48 layers: 6 for 30 layers, 10 for 48
    assert sorted(map(tuple, intervention_pairs(s, top1, mask, 30, **kw).tolist())) \
        == [(0, 2, 3), (0, 4, 5)]
    assert intervention_pairs(s, top1, mask, 48, **kw).tolist() == [[0, 4, 5]]
    with pytest.raises(InputError, match=r"`min_sat_layer` must be an int in \[0, 29\]; got 30"):
        intervention_pairs(s, top1, mask, 30, min_sat_layer=30)
    with pytest.raises(InputError, match=r"`min_gap` must be an int in \[1, 30\]; got 0"):
        intervention_pairs(s, top1, mask, 30, min_gap=0)


def test_min_sat_layer_is_part_of_the_cache_key(tiny_model, tmp_path, monkeypatch):
    store = ActivationStore(tmp_path)
    kw = dict(k=3, n_permutations=10, sample_positions=0, n_pairs=4, min_gap=1, seed=0,
              store=store)
    a = sat.saturation_analysis(tiny_model, TEXTS, min_sat_layer=0, **kw).load()
    calls = []
    real = sat_analysis.saturation_from_lens
    monkeypatch.setattr(sat_analysis, "saturation_from_lens", lambda *a, **k: calls.append(k) or real(*a, **k))
    b = sat.saturation_analysis(tiny_model, TEXTS, min_sat_layer=1, **kw).load()
    assert len(calls) == 1 and calls[0]["min_sat_layer"] == 1       # not served from a's entry
    assert a.attrs["params"]["min_sat_layer"] == 0 and b.attrs["params"]["min_sat_layer"] == 1
    s1 = b.sat_layer.values[..., 0]
    for p, e, l in zip(b.pair_prompt.values, b.pair_early.values, b.pair_late.values):
        assert s1[p, e] >= 1 and s1[p, l] >= 1 and s1[p, l] - s1[p, e] >= 1
    sat.saturation_analysis(tiny_model, TEXTS, min_sat_layer=1, **kw)
    assert len(calls) == 1                                               # now it is


# -- random-init twin, corpus, CLI, bench ----------------------------------------------------

def test_random_init_twin(tiny_model):
    a = random_init_twin(tiny_model, seed=3)
    b = random_init_twin(tiny_model, seed=3)
    c = random_init_twin(tiny_model, seed=4)
    assert a.spec.n_layers == tiny_model.spec.n_layers and a.spec.d_model == tiny_model.spec.d_model
    assert a.spec.weights == "random-init:seed=3" and a.spec.name.endswith("-random-init")
    wa, wb, wc = (m.unembed_module.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert not torch.equal(wa, tiny_model.unembed_module.weight)
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(a.hf(ids).logits, b.hf(ids).logits)


def test_load_corpus_and_chunks(tiny_model, tmp_path):
    docs = load_corpus()
    assert len(docs) >= 10
    chunks = corpus_chunks(tiny_model, docs[:2], chunk_tokens=64)
    for c in chunks:
        assert len(tiny_model.tokenizer(c, add_special_tokens=False)["input_ids"]) <= 64
    # every word of the documents is in some chunk, in order
    assert " ".join(" ".join(c.split()) for c in chunks) == " ".join(" ".join(d.split()) for d in docs[:2])
    few = corpus_chunks(tiny_model, docs, chunk_tokens=64, max_tokens=100)
    assert sum(len(tiny_model.tokenizer(c, add_special_tokens=False)["input_ids"]) for c in few) <= 100
    with pytest.raises(InputError, match=r"neither a folder nor a file"):
        load_corpus(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match=r"holds no non-empty \.txt document"):
        load_corpus(tmp_path / "empty")


def run_cli(argv):
    parser = argparse.ArgumentParser(prog="explorer")
    sat_cmd.register_cli(parser.add_subparsers())
    args = parser.parse_args(argv)
    buf = io.StringIO()
    with redirect_stdout(buf):
        code = args.func(args)
    return code, buf.getvalue()


def test_cli_saturation_json(tmp_path):
    corpus = tmp_path / "doc.txt"
    corpus.write_text("\n\n".join(TEXTS * 3))
    code, out = run_cli(["saturation", "--model", "tiny-llama", "--corpus", str(corpus),
                         "--k", "5", "--permutations", "20", "--sample-positions", "100",
                         "--pairs", "1", "--no-cache", "--json"])
    assert code == 0
    summary = json.loads(out)
    assert summary.pop("model") == "tiny-llama" and summary.pop("seconds") >= 0
    # the same analysis called as a library, with its own defaults for every other option
    model = load_model("tiny-llama")
    texts = sat.corpus_chunks(model, sat.load_corpus(str(corpus)))
    ds = sat.saturation_analysis(model, texts, k=5, n_permutations=20, sample_positions=100,
                                 n_pairs=1, progress=False)
    expect = json.loads(json.dumps(sat.saturation_summary(ds, k=5), default=float))
    assert summary == expect
    assert summary["n_layers"] == 3 and summary["n_tokens"] > 50


def test_cli_saturation_scheduler(tmp_path, monkeypatch):
    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "doc.txt"
    corpus.write_text("\n\n".join(TEXTS))
    argv = ["saturation", "--model", "tiny-llama", "--corpus", str(corpus), "--k", "5",
            "--permutations", "20", "--sample-positions", "0", "--pairs", "0", "--json"]
    _, plain = run_cli([*argv, "--no-cache"])
    code, out = run_cli([*argv, "--scheduler", "synchronous"])
    assert code == 0
    a, b = json.loads(plain), json.loads(out)
    for key in ("n_tokens", "kept_fraction", "mean_tau", "p_value", "n_order_positions"):
        assert a[key] == b[key], key
    with pytest.raises(InputError, match=r"`--scheduler` works over the cache"):
        run_cli([*argv, "--scheduler", "threads", "--no-cache"])
    with pytest.raises(InputError, match=r"`scheduler` must be one of"):
        run_cli([*argv, "--scheduler", "nope"])


def test_speedup_at_accuracy_on_constructed_curves():
    """Hand-worked: the fastest theta reaching each target; single points reach it or not."""
    import xarray as xr

    ds = xr.Dataset(
        {"margin_accuracy": ("theta_margin", [0.7, 0.9, 1.0]),
         "margin_accuracy_true": ("theta_margin", [0.20, 0.37, 0.40]),
         "margin_speedup": ("theta_margin", [3.0, 2.0, 1.0]),
         "cosine_accuracy": ("theta_cosine", [0.85, 0.96]),
         "cosine_accuracy_true": ("theta_cosine", [0.30, 0.39]),
         "cosine_speedup": ("theta_cosine", [1.5, 1.2]),
         "early_exit_summary": ((), json.dumps({
             "probe": {"accuracy": 0.5, "accuracy_true": 0.38, "speedup": 2.5},
             "oracle": {"accuracy": 1.0, "accuracy_true": 0.40, "speedup": 1.14},
             "equal_accuracy": {}, "n_positions": 10}))},
        coords={"theta_margin": [0.0, 0.5, 1.0], "theta_cosine": [0.9, 0.99]})
    nan = float("nan")
    full = sat.speedup_at_accuracy(ds)
    assert full["full_model_accuracy"] == 1.0 and full["required_accuracy"] == [0.8, 0.9, 0.95, 0.99]
    assert full["margin"]["speedup"] == [2.0, 2.0, 1.0, 1.0]
    assert full["margin"]["theta"] == [0.5, 0.5, 1.0, 1.0]
    np.testing.assert_array_equal(full["cosine"]["speedup"], [1.5, 1.2, 1.2, nan])
    np.testing.assert_array_equal(full["probe"]["speedup"], [nan] * 4)
    assert full["oracle"]["speedup"] == [1.14] * 4
    # against the true token the targets are fractions of the full model's 0.40
    true = sat.speedup_at_accuracy(ds, [0.5, 0.9, 0.95], against="true next token")
    assert true["full_model_accuracy"] == 0.40
    np.testing.assert_allclose(true["required_accuracy"], [0.20, 0.36, 0.38])
    assert true["margin"]["speedup"] == [3.0, 2.0, 1.0]
    assert true["cosine"]["speedup"] == [1.5, 1.2, 1.2]
    np.testing.assert_array_equal(true["probe"]["speedup"], [2.5, 2.5, 2.5])
    with pytest.raises(InputError, match="`against` must be one of"):
        sat.speedup_at_accuracy(ds, against="oracle")
    with pytest.raises(InputError, match="no early-exit curves"):
        sat.speedup_at_accuracy(ds.drop_vars("early_exit_summary"))


def test_cli_second_run_is_served_from_the_cache(tmp_path, monkeypatch, capsys):
    """`explorer saturation --json` twice over one cache folder: the second run computes
    nothing (no lens pass, no analysis, no model run) and prints the same summary."""
    import importlib

    from explorer import cli

    cache = tmp_path / "cache"
    monkeypatch.setenv("EXPLORER_CACHE", str(cache))
    corpus = tmp_path / "doc.txt"
    corpus.write_text("\n\n".join(TEXTS))
    argv = ["saturation", "--model", "tiny-llama", "--corpus", str(corpus), "--k", "5",
            "--permutations", "20", "--sample-positions", "0", "--pairs", "0", "--json"]
    calls = []
    analyse = sat_analysis.saturation_from_lens
    monkeypatch.setattr(sat_analysis, "saturation_from_lens",
                        lambda *a, **k: calls.append(k) or analyse(*a, **k))
    assert cli.main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert len(calls) == 1 and any(cache.rglob("*"))

    def recomputed(*a, **k):
        raise AssertionError("the second run recomputed")

    for module, name in ((sat_analysis, "saturation_from_lens"), (sat_analysis, "saturation_layers"),
                         (importlib.import_module("explorer.trace"), "run_batch")):
        monkeypatch.setattr(module, name, recomputed)
    assert cli.main(argv) == 0
    second = json.loads(capsys.readouterr().out)
    assert first.pop("seconds") >= 0 and second.pop("seconds") >= 0
    assert second == first
    assert first["model"] == "tiny-llama" and first["n_layers"] == 3 and "mean_tau" in first


@pytest.mark.slow
def test_bench_saturation_on_tiny_model(tiny_model, monkeypatch):
    from explorer import _kernels

    floor_rows = []                       # the floor's products (the lens binds its own name)
    real = _kernels.unembed_product
    monkeypatch.setattr(_kernels, "unembed_product",
                        lambda x, w, b=None: floor_rows.append(x.shape[0]) or real(x, w, b))
    from explorer.benches import timing

    rounds = []                           # the per-round wall and CPU times, as timed
    timed = timing.interleaved_times
    monkeypatch.setattr(timing, "interleaved_times",
                        lambda *a, **kw: rounds.append(timed(*a, **kw)) or rounds[-1])
    res = sat_cmd.bench_saturation(tiny_model, n_tokens=200, clicks=8)
    params, figures = res["params"], res["figures"]
    assert params["n_tokens"] <= 200 and params["lens_rows"] == params["n_tokens"] * 3
    # medians over the rounds: the times in ms, the ratios of each round's pair
    (wall, cpu), = rounds
    assert len(wall["forward"]) == params["repeats"]
    assert figures["forward_ms"] == round(statistics.median(wall["forward"]) * 1000, 1)
    assert figures["analysis_ms"] == round(statistics.median(wall["analysis"]) * 1000, 1)
    assert figures["lens_gemm_floor_ms"] == round(statistics.median(wall["floor"]) * 1000, 3)
    for key, (num, den, times) in {"analysis_vs_forward_ratio": ("analysis", "forward", wall),
                                   "analysis_vs_forward_cpu_ratio": ("analysis", "forward", cpu),
                                   "saturation_vs_floor_ratio": ("analysis", "floor", wall)}.items():
        per_round = [a / b for a, b in zip(times[num], times[den])]
        assert figures[key] == pytest.approx(statistics.median(per_round), abs=5e-4), key
    # the floor multiplies exactly the lens's rows by the unembedding, 256 at a time
    assert sum(floor_rows) == params["lens_rows"] and max(floor_rows) <= 256
    for key, value in figures.items():
        assert key.endswith(("_ratio", "_ms", "_mb")) and isinstance(value, float)
    # the page's click latency on this result: 8 clicks at k = 5 and 8 at k = 10
    assert params["clicks"] == 8 and "click" in res["notes"]
    assert 0 < figures["click_ms"] <= figures["click_p90_ms"] <= figures["click_max_ms"]
    assert {"click_k5_ms", "click_k10_ms", "click_cpu_ms"} <= set(figures)
    with pytest.raises(InputError, match=r"`n_tokens` must be an int in \[8, inf\]; got 2"):
        sat_cmd.bench_saturation(tiny_model, n_tokens=2)


def test_bench_saturation_is_the_registered_bench():
    from explorer.bench import run_bench

    res = run_bench("saturation", model="tiny-llama", n_tokens=120, repeats=2,
                    unembed_dtype="bfloat16", threads=1, clicks=0)
    assert res["bench"] == "saturation" and res["params"]["repeats"] == 2
    assert not any(key.startswith("click") for key in res["figures"])
    assert res["params"]["unembed_dtype"] == "bfloat16"
    assert {"analysis_vs_forward_ratio", "analysis_vs_forward_cpu_ratio", "forward_peak_mb",
            "analysis_peak_mb"} <= set(res["figures"])
    assert len(res["machine"]["loadavg_1min"]) == 2
    with pytest.raises(InputError, match=r"`unembed_dtype` must be one of 'float32', 'bfloat16'"):
        run_bench("saturation", model="tiny-llama", n_tokens=120, unembed_dtype="half")


# -- SmolLM2 ------------------------------------------------------------------------------

@pytest.mark.integration
def test_shipped_corpus_has_20k_tokens(smollm2):
    chunks = corpus_chunks(smollm2, load_corpus())
    n = sum(len(smollm2.tokenizer(c, add_special_tokens=False)["input_ids"]) for c in chunks)
    assert n >= 20_000


@pytest.mark.slow
@pytest.mark.integration
def test_smollm2_top_tokens_saturate_in_order(smollm2):
    texts = corpus_chunks(smollm2, load_corpus(), max_tokens=400)
    ds = saturation_layers(smollm2, texts, k=5, sample_positions=0)
    s = ds.sat_layer.values[ds.mask.values]
    kept = kept_positions(s, smollm2.n_layers)
    res = order_test(s[kept], smollm2.n_layers, k=5, n_permutations=500, seed=0)
    assert res["n_positions"] >= 10
    assert res["mean_tau"] > 0.3 and res["p_value"] < 0.01


# -- the view (headless) --------------------------------------------------------------------

@pytest.fixture(scope="module")
def view(tiny_model):
    from apps.saturation import SaturationView

    v = SaturationView(tiny_model, store=None, background=False, n_tokens=400,
                       analysis_options=dict(n_permutations=100, n_pairs=1, sample_positions=200,
                                             min_sat_layer=0))   # 3 layers: no pair has s_1 >= 1
    yield v
    v.close()


def test_view_detail_is_read_from_the_result(view):
    ds = view.result
    assert view.error == "" and ds is not None and ds.attrs["model"] == "tiny-llama"
    view.param.update(text=0, selected=7, k=4)
    d = view.detail()
    np.testing.assert_array_equal(d["sat"], ds.sat_layer.values[0, 7, :4])
    cells = dict(zip(zip(d["layer"].tolist(), d["rank"].tolist()), d["probability"].tolist()))
    assert cells[(2, 1)] == pytest.approx(float(ds.top_prob.values[0, 7, 2, 0]))
    expected_sat = [(l, r + 1) for l in range(3) for r in range(4)
                    if 0 <= ds.sat_layer.values[0, 7, r] <= l]
    got_sat = [(l, r) for l, r, m in zip(d["layer"], d["rank"], d["saturated"]) if m]
    assert got_sat == expected_sat


def smollm2_shaped_result(tokenizer, *, n_layers=30, k=10, n_pos=240, seed=0):
    """A synthetic saturation result of SmolLM2's shape (30 layers x 10 ranks, one text)."""
    import xarray as xr

    rng = np.random.default_rng(seed)
    vocab = min(len(tokenizer), 5000)
    top_id = rng.integers(1, vocab, (1, n_pos, n_layers, k))
    prob = np.sort(rng.dirichlet(np.ones(k + 2), (1, n_pos, n_layers))[..., :k], axis=-1)[..., ::-1]
    prob[:, :, -3:, 0] = 0.9                  # confident at the top: labels both black and white
    s = np.sort(rng.integers(-1, n_layers, (1, n_pos, k)), axis=-1)
    ids = rng.integers(1, vocab, (1, n_pos))
    dims3, dims4 = ("prompt", "pos", "rank"), ("prompt", "pos", "layer", "rank")
    return xr.Dataset(
        {"sat_layer": (dims3, s), "top_token_id": (dims4, top_id),
         "top_prob": (dims4, prob.astype(np.float32)), "mask": (("prompt", "pos"), np.ones((1, n_pos), bool)),
         "kept": (("prompt", "pos"), s[..., 0] + 1 <= 0.85 * n_layers)},
        coords={"token_id": (("prompt", "pos"), ids),
                "token": (("prompt", "pos"), np.array([[tokenizer.decode([int(i)]) for i in ids[0]]], object)),
                "final_token_id": (dims3, top_id[:, :, -1, :])},
        attrs={"model": "synthetic-30-layer"})


@pytest.fixture
def smollm2_shaped_view(tiny_model):
    import types

    from apps.saturation import SaturationView

    model = types.SimpleNamespace(tokenizer=tiny_model.tokenizer,
                                  spec=types.SimpleNamespace(n_layers=30, name="synthetic"))
    v = SaturationView(model, store=None, background=False,
                       result=smollm2_shaped_result(tiny_model.tokenizer))
    yield v
    v.close()


def test_click_updates_the_rendered_detail_plots_in_place(smollm2_shaped_view, monkeypatch):
    """A click on a 30-layer result replaces the data of the plots a session shows, equal
    to what HoloViews draws from scratch, with no new Bokeh model and no model run."""
    import importlib

    import holoviews as hv
    import panel as pn
    from bokeh.document import Document
    from bokeh.models import ColorMapper, GlyphRenderer
    from panel.io.state import set_curdoc

    from apps.saturation import (_RANK_TABLE_OPTS, _STAIRCASE_OPTS, DETAIL_GLYPHS,
                                 rank_table_elements)

    def no_trace(*a, **k):
        raise AssertionError("a click must not run the model")

    monkeypatch.setattr(importlib.import_module("explorer.trace"), "run_batch", no_trace)
    view = smollm2_shaped_view
    ds = view.result
    doc = Document()
    with set_curdoc(doc):
        doc.add_root(view.__panel__().get_root(doc))
        view.k = 10                               # (re-renders the histogram: not a click)
        ids_before = {m.id for m in doc.models}
        view._strip_widget.selected = 17          # as the strip does on a browser click
    assert view.selected == 17
    assert {m.id for m in doc.models} == ids_before                   # nothing added or replaced
    sources = {g: [s for s in srcs if s.document is doc] for g, srcs in view.detail_sources().items()}
    assert all(len(sources[g]) == 1 for g in DETAIL_GLYPHS), sources
    got = {g: sources[g][0].data for g in DETAIL_GLYPHS}
    # the label colours are read from their column as colours (not mapped as numbers)
    text = [r.glyph for r in doc.select({"type": GlyphRenderer})
            if r.data_source is sources["labels"][0]]
    assert len(text) == 1 and text[0].text_color.field == "text_color"
    assert not isinstance(text[0].text_color.transform, ColorMapper)
    # independent reading of the result: cell (layer l, rank r) holds top_prob[0, 17, l, r]
    prob = ds.top_prob.values[0, 17]                                   # [layer, rank]
    np.testing.assert_allclose(got["cells"]["probability"], prob.ravel())
    np.testing.assert_array_equal(got["cells"]["x0"], np.tile(np.arange(10) + 0.5, 30))
    np.testing.assert_array_equal(got["cells"]["y0"], np.repeat(np.arange(30) - 0.5, 10))
    words = [view.decode([t])[int(t)][:9] for t in ds.top_token_id.values[0, 17].ravel()]
    assert list(got["labels"]["token"]) == words
    s = ds.sat_layer.values[0, 17]
    assert len(got["saturated"]["left"]) == sum(30 - x for x in s if x >= 0)
    np.testing.assert_array_equal(got["points"]["saturation layer"], s[s >= 0])
    header = view._header.object
    assert 'data-sat-detail="0:17:10"' in header
    assert "s_1..s_10 = " + ", ".join("never" if x < 0 else str(x) for x in s) in header
    # the same detail drawn by HoloViews from scratch has the same columns and values
    fresh = {}

    def keep(glyph):
        return lambda plot, element: fresh.setdefault(glyph, plot.handles["source"].data)

    d = view.detail()
    table = rank_table_elements(d).opts(*_RANK_TABLE_OPTS).opts(
        hv.opts.Rectangles("Cells", hooks=[keep("cells")]), hv.opts.Labels(hooks=[keep("labels")]),
        hv.opts.Rectangles("Saturated", hooks=[keep("saturated")]))
    s_ok = s[s >= 0]          # the staircase as HoloViews draws steps-mid itself
    stair = (hv.Curve((np.arange(1, 11)[s >= 0], s_ok), "rank", "saturation layer")
             * hv.Scatter((np.arange(1, 11)[s >= 0], s_ok), "rank", "saturation layer")).opts(
        *_STAIRCASE_OPTS).opts(hv.opts.Curve(interpolation="steps-mid", hooks=[keep("steps")]),
                               hv.opts.Scatter(hooks=[keep("points")]))
    other = Document()
    for pane in (pn.pane.HoloViews(table), pn.pane.HoloViews(stair)):
        other.add_root(pane.get_root(other))
    for glyph in DETAIL_GLYPHS:
        assert set(got[glyph]) == set(fresh[glyph]), glyph
        for col, values in fresh[glyph].items():
            np.testing.assert_array_equal(np.asarray(got[glyph][col]), np.asarray(values),
                                          err_msg=f"{glyph}.{col}")


@pytest.mark.slow
def test_click_latency_on_a_30_layer_result(smollm2_shaped_view):
    """The page's click path on data of SmolLM2's shape: a few ms of CPU.

    Before the plots were updated in place (a DynamicMap refresh and a re-rendered header
    pane, each re-walking the document's models) a click cost about 150 ms of CPU here.
    """
    from apps._page_benches import click_latency

    view = smollm2_shaped_view
    for k in (5, 10):
        t = click_latency(view, list(range(3, 33)), k=k)
        assert len(t["cpu"]) == 30 and view.selected == 32 and view.k == k
        # process CPU time: on a shared machine other jobs stretch wall time, not this.
        # A click costs ~3 ms of CPU here (2 cores, load 6); 40 ms is ~13x that, and far
        # below the ~150 ms the page cost before its in-place updates
        assert np.median(t["cpu"]) < 0.040, (k, np.round(t["cpu"], 4).tolist())


def test_view_k_changes_the_histogram(view):
    from apps.saturation import plot_tau_histogram, tau_histogram_data

    ds = view.result
    h3, h5 = tau_histogram_data(ds, 3), tau_histogram_data(ds, 5)
    tau3 = ds.tau.sel(k_order=3).values
    np.testing.assert_array_equal(h3["observed"], np.histogram(tau3[np.isfinite(tau3)], h3["edges"])[0])
    assert (h3["observed"] != h5["observed"]).any() or (h3["null"] != h5["null"]).any()
    assert tau_histogram_data(ds, 2) is None
    assert "k ≥ 3" in plot_tau_histogram(None).text


def test_view_intervention_matches_the_analysis_function(view, tiny_model):
    pairs = view.pairs()
    assert len(pairs) == 1
    p, early, late = pairs[0]
    view.inj_layer = 1 if view.inj_layer == 0 else 0
    r = view.intervention
    direct = inject_residual(tiny_model, view.texts()[p], source_pos=early, target_pos=late,
                             layer=view.inj_layer)
    assert r["s1_after"] == direct["s1_after"] and r["top1_after"] == direct["top1_after"]
    assert r["s1_before"] == direct["s1_before"]


@pytest.mark.slow
def test_view_random_init_toggle_and_layout(view):
    import panel as pn

    layout = view.__panel__()
    assert isinstance(layout, pn.Row)
    view.weights = "random-init"
    assert view.result.attrs["model"] == "tiny-llama-random-init"
    assert view.result.attrs["model_spec"]["weights"] == "random-init:seed=0"
    view.weights = "trained"
    assert view.result.attrs["model"] == "tiny-llama"


@pytest.mark.slow
def test_view_opens_on_request_or_from_the_store(tiny_model, tmp_path, monkeypatch):
    """A run estimated over the open budget waits for the Analyse button (nothing runs on
    open); its result is `saturation_analysis`'s own; a later page opens on the stored
    result without running the model; captions carry the order test's numbers."""
    import importlib

    import explorer
    from apps import saturation as page
    from explorer.analyses import saturation as sat_mod

    options = dict(n_permutations=50, n_pairs=0, sample_positions=100, min_sat_layer=0)
    store = explorer.ActivationStore(tmp_path / "store")
    monkeypatch.setattr(page, "OPEN_BUDGET_S", 0.0)
    v = page.SaturationView(tiny_model, store=store, background=False, n_tokens=128,
                            analysis_options=options)
    assert v.result is None and "Press **Analyse**" in v.status
    assert v._run_button.name.startswith("Analyse 128 tokens (about ")
    v._run_button.clicks += 1
    want = sat_mod.saturation_analysis(tiny_model, v.texts(), **options)
    np.testing.assert_array_equal(v.result.sat_layer.values, want.sat_layer.values)
    h = page.tau_histogram_data(v.result, 5)
    assert f"mean **{float(want.mean_tau.sel(k_order=5)):.3f}**" in page.tau_caption(h)
    assert f"p = **{float(want.p_value.sel(k_order=5)):.4f}**" in page.tau_caption(h)
    v.close()

    def no_trace(*a, **k):
        raise AssertionError("opening on a stored result must not run the model")

    monkeypatch.setattr(importlib.import_module("explorer.trace"), "run_batch", no_trace)
    again = page.SaturationView(tiny_model, store=store, background=False, n_tokens=128,
                                analysis_options=options)
    np.testing.assert_array_equal(again.result.sat_layer.values, want.sat_layer.values)
    again.close()
    other = page.SaturationView(tiny_model, store=store, background=False, n_tokens=192,
                                analysis_options=options)      # not stored: waits again
    assert other.result is None
    other.close()
