"""Tests for explorer.analyses.neuron_eval: metrics, perturbations, sanity checks, concepts.

Every metric is checked against a hand-worked confusion matrix (10 inputs), the ranking
metrics also against scikit-learn and scipy, the perturbations against their expected
sizes, and the synthetic pass/fail table against the verdicts the paper derives.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import scipy.stats
import xarray as xr
from sklearn.metrics import average_precision_score, roc_auc_score

from explorer._checks import InputError
from explorer.analyses.neuron_eval import (
    METRICS,
    binarize_activations,
    extra_labels,
    itda_atom_sanity_checks,
    missing_labels,
    neuron_metrics,
    paired_metrics,
    sanity_checks,
    synthetic_sanity_checks,
    token_concepts,
    token_identity_concepts,
)

# 10 inputs; the top 30% (alpha=0.3) are inputs 0, 1, 2.
ACT = np.array([9, 8, 7, 6, 5, 4, 3, 2, 1, 0], dtype=float)
CONCEPT = np.array([1, 0, 1, 0, 0, 1, 0, 1, 0, 0], dtype=float)
# B = {0,1,2}, c = {0,2,5,7}: TP = 2, FP = 1, FN = 2, TN = 5.
HAND = {
    "recall": 2 / 3,                         # |B ∩ c| / |B|, the code's orientation
    "precision": 2 / 4,                      # |B ∩ c| / |c|
    "f1": 2 * 2 / (2 * 2 + 1 + 2),
    "iou": 2 / 5,
    "accuracy": (2 + 5) / 10,
    "balanced_accuracy": (2 / 3 + 5 / 7) / 2,
    "inverse_balanced_accuracy": (2 / 4 + 5 / 6) / 2,
    # score = concept (ties), target = B: pos scores {1,0,1} vs neg {0,0,1,0,1,0,0}
    "auc": (10 + 0.5 * 4 + 0.5 * 5) / 21,
    # score = activation, target = concept: pos {9,7,4,2} vs neg {8,6,5,3,1,0}
    "inverse_auc": (6 + 5 + 3 + 2) / 24,
    "cosine": 22 / (math.sqrt(285) * 2),
    "wpmi": (0 + math.log(1e-8) + 0) / 3 - math.log(0.4),
    "mad": 22 / 4 - 23 / 6,
    # thresholds c >= 1: P = 2/4, R = 2/3; c >= 0: P = 3/10, R = 1
    "auprc": (2 / 3) * (2 / 4) + (1 / 3) * (3 / 10),
    # ranked by activation, precision at each positive: 1/1, 2/3, 3/6, 4/8
    "inverse_auprc": (1 + 2 / 3 + 3 / 6 + 4 / 8) / 4,
}


def test_every_metric_against_the_hand_worked_confusion_matrix():
    got = paired_metrics(ACT, CONCEPT, alpha=0.3)
    for metric, expected in HAND.items():
        assert got[metric][0] == pytest.approx(expected, abs=1e-12), metric
    assert got["correlation"][0] == pytest.approx(scipy.stats.pearsonr(ACT, CONCEPT)[0], abs=1e-12)
    assert got["spearman"][0] == pytest.approx(scipy.stats.spearmanr(ACT, CONCEPT)[0], abs=1e-12)
    # top-and-random with k above the set sizes: all 3 active plus all 10 inputs
    ids = np.r_[0, 1, 2, np.arange(10)]
    assert got["correlation_top_and_random"][0] == pytest.approx(
        scipy.stats.pearsonr(ACT[ids], CONCEPT[ids])[0], abs=1e-12)
    assert set(got) == set(METRICS)


def test_ranking_metrics_agree_with_scikit_learn():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(300, 4))
    c = (rng.random((300, 1)) < 0.2).astype(float)
    c_prob = rng.random((300, 1))                  # concept probabilities, continuous scores
    b = binarize_activations(a, alpha=0.1)
    got = paired_metrics(a, c, alpha=0.1)
    got_prob = paired_metrics(a, c_prob, alpha=0.1)
    for j in range(4):
        assert got["inverse_auc"][j] == pytest.approx(roc_auc_score(c[:, 0], a[:, j]))
        assert got["inverse_auprc"][j] == pytest.approx(average_precision_score(c[:, 0], a[:, j]))
        assert got_prob["auc"][j] == pytest.approx(roc_auc_score(b[:, j], c_prob[:, 0]))
        assert got_prob["auprc"][j] == pytest.approx(average_precision_score(b[:, j], c_prob[:, 0]))
        assert got["auprc"][j] == pytest.approx(average_precision_score(b[:, j], c[:, 0]))


def test_neuron_metrics_fills_every_unit_concept_pair():
    rng = np.random.default_rng(1)
    a = xr.DataArray(rng.normal(size=(200, 3)), dims=("input", "unit"), coords={"unit": ["u0", "u1", "u2"]})
    c = xr.DataArray((rng.random((200, 2)) < 0.3).astype(float), dims=("input", "concept"),
                     coords={"concept": ["x", "y"]})
    ds = neuron_metrics(a, c, alpha=0.05)
    assert ds["score"].dims == ("metric", "unit", "concept")
    for u in range(3):
        for k, name in enumerate(["x", "y"]):
            pair = paired_metrics(a.values[:, u], c.values[:, k], alpha=0.05)
            for m in METRICS:
                if m == "correlation_top_and_random":
                    continue                                # random sample differs by seed
                np.testing.assert_allclose(ds["score"].sel(metric=m, unit=f"u{u}", concept=name),
                                           pair[m][0], atol=1e-12)
    assert list(ds["n_active"].values) == [10, 10, 10]


def test_binarisation_choices():
    a = np.array([3.0, 3.0, 3.0, 1.0, 0.0])
    np.testing.assert_array_equal(binarize_activations(a, alpha=0.2)[:, 0], [1, 1, 1, 0, 0])  # ties kept
    np.testing.assert_array_equal(binarize_activations(a, alpha=0.8)[:, 0], [1, 1, 1, 1, 0])
    np.testing.assert_array_equal(binarize_activations(a, binarize="threshold", threshold=1.0)[:, 0],
                                  [1, 1, 1, 1, 0])
    # the choice changes the scores: threshold 0.5 on ACT keeps 9 inputs
    assert paired_metrics(ACT, CONCEPT, binarize="threshold", threshold=0.5)["recall"][0] == pytest.approx(4 / 9)
    with pytest.raises(InputError, match="`binarize` must be one of 'top_quantile', 'threshold'"):
        binarize_activations(a, binarize="topk")
    with pytest.raises(InputError, match="`alpha` must be > 0"):
        binarize_activations(a, alpha=0.0)


def test_perturbations_halve_and_double_the_concept():
    rng = np.random.default_rng(2)
    c = np.zeros((20000, 2))
    c[:1000, 0] = 1
    c[:200, 1] = 1
    miss = np.stack([missing_labels(c, rng) for _ in range(50)])
    extra = np.stack([extra_labels(c, rng) for _ in range(50)])
    assert (miss <= c).all() and (extra >= c).all()                  # subsets and supersets
    np.testing.assert_allclose(miss.sum(1).mean(0), [500, 100], rtol=0.03)
    np.testing.assert_allclose(extra.sum(1).mean(0), [2000, 400], rtol=0.03)


def test_sanity_check_deltas_replay_the_perturbations():
    c = np.zeros((500, 2))
    c[:50, 0] = 1
    c[:12, 1] = 1   # (one seed in 4096 would drop all 12: precision is then 0)
    out = sanity_checks(c, c, metrics=("iou", "recall", "precision"), n_seeds=4, binarize="threshold",
                        threshold=0.5, seed=7)
    rng = np.random.default_rng(7)
    for s in range(4):
        cm = missing_labels(c, rng)
        ce = extra_labels(c, rng)
        # a == c: IoU(a, c') = |c ∩ c'| / |c ∪ c'|, from 1; recall drops only with missing labels
        iou_m = cm.sum(0) / c.sum(0)
        iou_e = c.sum(0) / ce.sum(0)
        np.testing.assert_allclose(out["delta"].sel(test="missing_labels", metric="iou", seed=s), iou_m - 1)
        np.testing.assert_allclose(out["delta"].sel(test="extra_labels", metric="iou", seed=s), iou_e - 1)
        np.testing.assert_allclose(out["delta"].sel(test="missing_labels", metric="recall", seed=s), iou_m - 1)
    assert (out["delta"].sel(test="extra_labels", metric="recall") == 0).all()
    assert (out["delta"].sel(test="missing_labels", metric="precision") == 0).all()
    assert out["passed_both"].sel(metric="iou") and not out["passed_both"].sel(metric="recall")


def test_synthetic_pass_fail_table_matches_the_paper():
    ds = synthetic_sanity_checks(frequencies=(0.499, 0.1, 0.01, 0.001), n_inputs=20000, n_seeds=10)
    passed = {str(m): bool(ds["passed_both"].sel(metric=m)) for m in ds["metric"].values}
    # Oikarinen et al. (2025), table 2: these pass both tests ...
    for m in ("f1", "iou", "correlation", "cosine", "wpmi", "auprc"):
        assert passed[m], m
    # ... and these fail one of them
    for m in ("recall", "precision", "accuracy", "balanced_accuracy", "inverse_balanced_accuracy",
              "auc", "inverse_auc", "mad", "inverse_auprc", "correlation_top_and_random"):
        assert not passed[m], m
    assert float(ds["decrease_accuracy"].sel(test="extra_labels", metric="recall").max()) == 0.0
    assert ds["decrease_accuracy"].dims == ("test", "metric", "frequency")


def test_token_concepts_hand_worked():
    tokens = [" The", " 1905", ",", " two", "cat", "!?", " Two", " 3.5", "\n"]
    c = token_concepts(tokens)
    assert list(c["concept"].values) == ["digit", "capitalised", "punctuation", "number_word"]
    np.testing.assert_array_equal(c.sel(concept="digit"), [0, 1, 0, 0, 0, 0, 0, 1, 0])
    np.testing.assert_array_equal(c.sel(concept="capitalised"), [1, 0, 0, 0, 0, 0, 1, 0, 0])
    np.testing.assert_array_equal(c.sel(concept="punctuation"), [0, 0, 1, 0, 0, 1, 0, 0, 0])
    np.testing.assert_array_equal(c.sel(concept="number_word"), [0, 0, 0, 1, 0, 0, 1, 0, 0])
    animals = token_concepts(tokens, word_lists={"animal": ["cat", "dog"]}, families=())
    np.testing.assert_array_equal(animals.sel(concept="animal"), [0, 0, 0, 0, 1, 0, 0, 0, 0])
    ident = token_identity_concepts([5, 7, 5, 1], [5, 1], names=["five", "one"])
    np.testing.assert_array_equal(ident.values, [[1, 0], [0, 0], [1, 0], [0, 1]])


def test_itda_atoms_as_real_units(tiny_model):
    from explorer.analyses.itda import ITDA
    from explorer.trace import trace

    prompts = ["the cat and the dog and the bird", "the sun and the moon and the sea",
               "the red and the blue and the green", "the one and the two and the three"]
    ds = trace(tiny_model, prompts)
    itda = ITDA(tau=0.3, l0=4).fit(ds.isel(prompt=slice(0, 2)), layer=1)
    out = itda_atom_sanity_checks(itda, ds.isel(prompt=slice(2, 4)), layer=1, min_count=2, n_seeds=3,
                                  metrics=("f1", "correlation"), alpha=0.1)
    probe = ds.isel(prompt=slice(2, 4))
    ids = probe["token_id"].values[probe["mask"].values]
    for u, tok in zip(out["unit"].values, out["atom_token"].values):
        assert tok == itda.atom_token_[u]
        assert int(out["n_concept"].sel(unit=u)) == int((ids == itda.atom_token_id_[u]).sum()) >= 2
    # the unperturbed score is the metric of the atom's cosine against its own token
    x = probe["resid_post"].sel(layer=1).values[probe["mask"].values]
    u = int(out["unit"].values[0])
    cos = (x / np.linalg.norm(x, axis=1, keepdims=True)) @ itda.atoms_[u]
    ref = paired_metrics(cos, (ids == itda.atom_token_id_[u]).astype(float), alpha=0.1)["f1"][0]
    assert float(out["score"].sel(metric="f1", unit=u)) == pytest.approx(ref)


def test_itda_atoms_explained_by_their_token_family(tiny_model):
    from explorer.analyses.itda import ITDA
    from explorer.trace import trace

    prompts = ["Anna met Bob in Rome, then Carl.", "Dan and Eve saw 12 cats, 3 dogs.",
               "Fay, Gus and Hal: 7 days, 45 nights!", "Ivy paid 90 coins; Jon paid 8."]
    ds = trace(tiny_model, prompts)
    itda = ITDA(tau=0.1, l0=4).fit(ds, layer=1)
    out = itda_atom_sanity_checks(itda, ds, layer=1, explanation="token_family", min_count=2, n_seeds=2,
                                  metrics=("iou",), alpha=0.1)
    tokens = ds["token"].values[ds["mask"].values]
    fam = token_concepts(tokens)
    for u, name in zip(out["unit"].values, out["explanation"].values):
        src = token_concepts([itda.atom_token_[u]])
        assert src.sel(concept=name).item() == 1 and float(src.sum()) == 1   # its one family
        assert int(out["n_concept"].sel(unit=u)) == int(fam.sel(concept=name).sum())
    assert set(out["explanation"].values) <= {"digit", "capitalised", "punctuation", "number_word"}
    with pytest.raises(InputError, match="`explanation` must be one of"):
        itda_atom_sanity_checks(itda, ds, layer=1, explanation="best")


def test_user_errors_name_the_bad_value():
    with pytest.raises(InputError, match="`metric` must be one of"):
        paired_metrics(ACT, CONCEPT, metrics=("f2",))
    with pytest.raises(InputError, match=r"must be in \[0, 1\]"):
        paired_metrics(ACT, CONCEPT * 2)
    with pytest.raises(InputError, match="same inputs"):
        paired_metrics(ACT, CONCEPT[:5])
    with pytest.raises(InputError, match="same shape"):
        sanity_checks(np.ones((10, 2)), np.ones((10, 3)))
    with pytest.raises(InputError, match="no positive input"):
        synthetic_sanity_checks(frequencies=(0.0001,), n_inputs=100)
    with pytest.raises(InputError, match="`pass_rule` must be one of"):
        sanity_checks(ACT, CONCEPT, pass_rule="most")


def test_cli_neuron_eval_synthetic_json(monkeypatch, capsys):
    from explorer import cli

    monkeypatch.setattr(cli, "COMMAND_MODULES", ("explorer.commands.neuron_eval",))
    code = cli.main(["neuron-eval", "--synthetic", "--n-inputs", "5000", "--frequencies", "0.3,0.01",
                     "--seeds", "5", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["metric"]: r for r in out["table"]}
    assert rows["iou"]["passed"] and not rows["recall"]["passed"]
    assert rows["recall"]["extra_labels"] == 0.0 and rows["recall"]["missing_labels"] == 1.0
    assert len(rows["f1"]["per_frequency"]["missing_labels"]) == 2
    # every number is the library's on the same arguments
    ds = synthetic_sanity_checks(frequencies=[0.3, 0.01], n_inputs=5000, n_seeds=5, epsilon=1e-3)
    assert set(rows) == {str(m) for m in ds.metric.values}
    for m, row in rows.items():
        for test in ("missing_labels", "extra_labels"):
            assert row[test] == pytest.approx(float(ds.pooled_decrease_accuracy.sel(test=test, metric=m)))
            assert row["per_frequency"][test] == pytest.approx(
                ds.decrease_accuracy.sel(test=test, metric=m).values.tolist())
            assert row[f"passed_{test.split('_')[0]}"] == bool(ds.passed.sel(test=test, metric=m))
        assert row["passed"] == bool(ds.passed_both.sel(metric=m))
    assert cli.main(["neuron-eval", "--json"]) == 2
    assert "--synthetic, or --prompts" in capsys.readouterr().err


def test_cli_neuron_eval_real_units(tiny_model, tmp_path, monkeypatch, capsys):
    from explorer import cli

    monkeypatch.setattr(cli, "COMMAND_MODULES", ("explorer.commands.neuron_eval",))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(["the cat and the dog and the bird", "the sun and the moon and the sea",
                                   "the red and the blue and the green", "the one and the two and the three"]))
    code = cli.main(["neuron-eval", "--model", "tiny-llama", "--prompts", str(prompts), "--layer", "1",
                     "--seeds", "3", "--alpha", "0.1", "--cache", str(tmp_path / "cache"), "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["units"] == "itda_atoms (own_token)" and out["n_units"] >= 1
    assert {r["metric"] for r in out["table"]} == set(METRICS)
    # the same pipeline through the library: first half of the prompts builds, second probes
    from explorer.analyses.itda import ITDA, cached_activations

    lines = prompts.read_text().splitlines()
    acts = cached_activations(tiny_model, lines, layers=[1])
    itda = ITDA(tau=0.3, l0=8).fit(acts.isel(prompt=slice(0, 2)), layer=1, min_pos=1)
    ds = itda_atom_sanity_checks(itda, acts.isel(prompt=slice(2, None)), layer=1, n_seeds=3,
                                 epsilon=1e-3, alpha=0.1, explanation="own_token", min_pos=1)
    assert out["n_units"] == ds.sizes["unit"] and out["n_inputs"] == ds.attrs["n_inputs"]
    for row in out["table"]:
        m = row["metric"]
        for test in ("missing_labels", "extra_labels"):
            assert row[test] == pytest.approx(float(ds.pooled_decrease_accuracy.sel(test=test, metric=m)))
        assert row["passed"] == bool(ds.passed_both.sel(metric=m))


def test_neuron_eval_view_scores_the_chosen_unit_and_concept(tiny_model):
    import panel as pn

    from apps.itda import probe_prompts
    from apps.neuron_eval import NeuronEvalView, pass_fail_html
    from explorer.analyses.itda import ITDA
    from explorer.trace import trace

    view = NeuronEvalView(tiny_model, background=False, layer=1, n_seeds=2, unit=4,
                          concept="capitalised", alpha=0.05)
    ds = trace(tiny_model, probe_prompts(view.probe_text), layers=[1])
    itda = ITDA(tau=view.tau, l0=8).fit(ds, layer=1, min_pos=1)       # first tokens left out
    mask = ds["mask"].values.copy()
    mask[:, 0] = False
    x = ds["resid_post"].sel(layer=1).values[mask]
    cos = (x / np.linalg.norm(x, axis=1, keepdims=True)) @ itda.atoms_[4]
    caps = token_concepts(ds["token"].values[mask]).sel(concept="capitalised").values
    ref = paired_metrics(cos, caps, alpha=0.05)
    table = view.table.set_index("metric")
    for m in ("f1", "iou", "auprc", "correlation", "inverse_auc"):
        assert table.loc[m, "score"] == pytest.approx(ref[m][0]), m
    # the seed redraws the perturbations, not the scores (but top-and-random's own sample)
    before = view.table.copy()
    view.seed = 5
    fixed = before["metric"] != "correlation_top_and_random"
    np.testing.assert_allclose(view.table["score"][fixed], before["score"][fixed])
    assert not np.allclose(view.table["missing_labels"], before["missing_labels"])
    rng = np.random.default_rng(5)
    dropped = caps * (rng.random((caps.size, 1))[:, 0] > 0.5)
    strip = view.strips[0]
    top = np.argsort(-cos, kind="stable")[: len(strip)]
    assert (strip["status"] == "dropped (missing labels)").sum() == int(((caps - dropped)[top] > 0).sum())
    page = pass_fail_html(view.synthetic, view.real)
    assert "data-metric='iou'>pass" in page and "data-metric='recall'>fail" in page
    assert isinstance(view.__panel__(), pn.Row)
    # every control shows its label and has its doc as a tooltip
    panel = view.controls()
    widgets = list(panel.select(pn.widgets.Widget))
    tips = [t.value for t in panel.select(pn.widgets.TooltipIcon)]
    labels = [w.name for w in widgets] + [str(h.object) for h in panel.select(pn.pane.HTML)]
    for name in ("probe_text", "layer", "tau", "unit", "concept", "binarize", "alpha", "threshold", "seed"):
        p = view.param[name]
        assert p.doc and (p.doc in tips or any(getattr(w, "description", None) == p.doc for w in widgets)), name
        assert any(p.label in text for text in labels), name
    (player,) = panel.select(pn.widgets.Player)
    player.value = 7                                              # the player drives the seed
    assert view.seed == 7 and "seed 7" in view.caption
    # scope and link: its own probing set, edits not applicable (and why); the link carries
    # the page's settings, each a Parameter
    scope = view.scope()
    n = len(probe_prompts(view.probe_text))
    assert scope.on == f"its own probing prompts ({n}, the box on the left), not your prompt"
    assert scope.edits.startswith("not applicable: ")
    assert set(view.link_params) == {"probe_text", "layer", "tau", "unit", "concept", "binarize",
                                     "alpha", "threshold", "seed"}


def test_metric_deltas_legend_sits_above_the_frame():
    import holoviews as hv
    import pandas as pd
    from bokeh.models import Legend

    from apps.neuron_eval import plot_metric_deltas

    hv.extension("bokeh", logo=False)
    table = pd.DataFrame({"metric": ["f1", "iou"], "score": [0.5, 0.4],
                          "missing_labels": [-0.1, -0.2], "extra_labels": [-0.3, 0.1]})
    fig = hv.render(plot_metric_deltas(table), backend="bokeh")
    legends = fig.select(type=Legend)
    assert len(legends) == 1
    (legend,) = legends
    assert legend in fig.above and legend not in fig.center        # outside the frame
    assert legend.orientation == "horizontal"
    assert legend.items                                         # the perturbations named


def test_missing_labels_that_drop_nothing_give_zero_deltas_and_the_page_says_why(tiny_model):
    """With few positives, missing labels (keep each with p = 1/2) can keep them all: then the
    perturbed concept is the original, every Δ missing is exactly 0 (the right value), and the
    page says so; on a seed that drops one, no note."""
    from apps.neuron_eval import NeuronEvalView, concept_vector, unchanged_note

    view = NeuronEvalView(tiny_model, background=False, layer=1, n_seeds=2, unit=0)
    c = concept_vector(view._unit_data(view._params()), view.unit, view.concept)   # cached
    pos = c > 0
    assert 0 < pos.sum() <= 8

    def keeps_all(seed):   # the draw missing_labels makes first from default_rng(seed)
        return bool((np.random.default_rng(seed).random(c.size)[pos] > 0.5).all())

    keep = next(s for s in range(200) if keeps_all(s))
    drop = next(s for s in range(200) if not keeps_all(s))
    view.seed = keep
    assert (view.table["missing_labels"] == 0).all()
    assert f"dropped none of the {int(pos.sum())} positive" in view.note
    view.seed = drop
    assert (view.table["missing_labels"] != 0).any() and "Missing labels" not in view.note
    assert unchanged_note(c, {"missing_labels": c * 0, "extra_labels": c}, 3).startswith(
        "Extra labels with seed 3 added no positive")
    view.close()
