"""The ICL ablation's mean source (Yin & Steinhardt 2025): the cross-task mean the paper
ablates with, the per-task and zero alternatives, and the bootstrap interval over prompts,
each checked against plain torch hooks on the HF model or scipy."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from scipy import stats

from explorer._checks import InputError
from explorer.analyses import icl_heads as ih
from explorer.analyses.icl_heads import last_token as ih_last_token
from tests._cli import parse_and_run

TASKS = ["antonym", "uppercase"]


def _ids(model, prompt):
    return torch.tensor([model.tokenizer(prompt, add_special_tokens=False)["input_ids"]])


def _o_proj(model, layer):
    return model.hf.model.layers[layer].self_attn.o_proj


def _last_z_all_layers(model, prompt):
    """o_proj input at the last token of one prompt, per layer: [layer, head, d_head]."""
    spec, got = model.spec, {}
    hooks = [_o_proj(model, l).register_forward_pre_hook(
        lambda mod, args, l=l: got.__setitem__(l, args[0][0, -1].detach().clone()))
        for l in range(spec.n_layers)]
    try:
        with torch.no_grad():
            model.hf(_ids(model, prompt))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack([got[l] for l in range(spec.n_layers)]).reshape(
        spec.n_layers, spec.n_heads, spec.d_head).numpy()


def test_cross_task_mean_is_the_average_of_task_means(tiny_model):
    m = tiny_model
    got = ih.cross_task_mean_z(m, TASKS, n_prompts=3, n_shots=2, seed=5)
    per_task = []
    for task in TASKS:
        prompts, _ = ih.icl_prompts(task, n_prompts=3, n_shots=2, seed=5)
        per_task.append(np.mean([_last_z_all_layers(m, p) for p in prompts], 0))
    np.testing.assert_allclose(got, np.mean(per_task, 0), atol=1e-5)
    # and it differs from either task's own mean (otherwise the option would change nothing)
    assert np.abs(got - per_task[0]).max() > 1e-3
    with pytest.raises(InputError, match="at least one task"):
        ih.cross_task_mean_z(m, [])


def _answer_prob_with_heads_set(model, prompt, answer, heads, value, argmax=False):
    """P(answer's first token) with ``heads``' last-token o_proj input := value[layer, head]
    (and, with ``argmax``, whether that token is the argmax)."""
    spec = model.spec
    by_layer = {}
    for l, h in heads:
        by_layer.setdefault(l, []).append(h)

    def make(l):
        def pre(mod, args):
            x = args[0].clone()                                  # [1, pos, n_heads * d_head]
            for h in by_layer[l]:
                x[0, -1, h * spec.d_head:(h + 1) * spec.d_head] = torch.as_tensor(value[l, h])
            return (x,)
        return pre

    hooks = [_o_proj(model, l).register_forward_pre_hook(make(l)) for l in by_layer]
    try:
        with torch.no_grad():
            logits = model.hf(_ids(model, prompt)).logits[0, -1]
    finally:
        for h in hooks:
            h.remove()
    target = model.tokenizer(" " + answer, add_special_tokens=False)["input_ids"][0]
    p = float(torch.softmax(logits.float(), -1)[target])
    return (p, int(logits.argmax()) == target) if argmax else p


@pytest.mark.parametrize("method", ["last_token", "full"])
@pytest.mark.parametrize("mean_source", ["cross-task", "per-task", "zero"])
def test_ablated_answer_prob_matches_plain_hooks(tiny_model, mean_source, method):
    m = tiny_model
    rng = np.random.default_rng(3)
    shape = (m.spec.n_layers, m.spec.n_heads)
    induction, fv = rng.random(shape), rng.random(shape)
    n_prompts, n_shots, seed = 3, 2, 0
    ds = ih.ablation_curves(m, ["antonym"], induction, fv, percents=(0, 25),
                            rankings=["fv"], n_prompts=n_prompts, n_shots=n_shots,
                            loss_sequences=2, loss_tokens=40, seed=seed,
                            mean_source=mean_source, mean_tasks=TASKS, n_boot=200,
                            method=method)
    assert ds.attrs["params"]["ablation_method"] == method
    heads = [tuple(h) for h in json.loads(str(ds.ablated.sel(ranking="fv", percent=25.0).values))]
    assert len(heads) == 3
    spec = m.spec
    if mean_source == "zero":
        value = np.zeros((spec.n_layers, spec.n_heads, spec.d_head))
    elif mean_source == "per-task":
        src, _ = ih.icl_prompts("antonym", n_prompts=n_prompts, n_shots=n_shots, seed=seed + 2)
        value = np.mean([_last_z_all_layers(m, p) for p in src], 0)
    else:
        value = np.mean([np.mean([_last_z_all_layers(m, p) for p in ih.icl_prompts(
            t, n_prompts=n_prompts, n_shots=n_shots, seed=seed + 2)[0]], 0) for t in TASKS], 0)
    prompts, answers = ih.icl_prompts("antonym", n_prompts=n_prompts, n_shots=n_shots, seed=seed + 1)
    want = [_answer_prob_with_heads_set(m, p, a, heads, value, argmax=True)
            for p, a in zip(prompts, answers)]
    got = float(ds.answer_prob.sel(ranking="fv", percent=25.0, task="antonym"))
    assert got == pytest.approx(np.mean([w[0] for w in want]), abs=1e-5)
    np.testing.assert_array_equal(ds.correct.sel(ranking="fv", percent=25.0, task="antonym"),
                                  [float(w[1]) for w in want])
    assert ds.attrs["params"]["mean_source"] == mean_source
    assert ds.correct.dims == ("ranking", "percent", "task", "prompt")
    np.testing.assert_allclose(ds.correct.mean("prompt").values, ds.accuracy.values)


def test_mean_source_is_validated(tiny_model):
    shape = (tiny_model.spec.n_layers, tiny_model.spec.n_heads)
    with pytest.raises(InputError, match="Did you mean 'cross-task'"):
        ih.ablation_curves(tiny_model, ["antonym"], np.zeros(shape), np.zeros(shape),
                           mean_source="cross_task")


def test_bootstrap_interval_matches_scipy_on_one_task():
    rng = np.random.default_rng(0)
    hits = (rng.random(40) < 0.6).astype(float)
    correct = hits[None, None, None, :]                      # [ranking, percent, task, prompt]
    low, high = ih.bootstrap_mean_accuracy(correct, n_boot=20000, level=0.9, seed=1)
    ref = stats.bootstrap((hits,), np.mean, n_resamples=20000, confidence_level=0.9,
                          method="percentile", random_state=2).confidence_interval
    # both are Monte-Carlo percentiles of the same resampling distribution, whose support is
    # spaced 1/40 apart: they agree to one step of it
    assert float(low[0, 0]) == pytest.approx(ref.low, abs=1 / 40 + 1e-9)
    assert float(high[0, 0]) == pytest.approx(ref.high, abs=1 / 40 + 1e-9)
    assert float(low[0, 0]) < hits.mean() < float(high[0, 0])


def test_bootstrap_resamples_within_tasks():
    # task 0 always right, task 1 always wrong: every resample within tasks gives exactly 0.5
    correct = np.stack([np.ones(6), np.zeros(6)])[None, None]
    low, high = ih.bootstrap_mean_accuracy(correct, n_boot=500, level=0.95, seed=0)
    assert float(low[0, 0]) == float(high[0, 0]) == 0.5


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2", "tiny-neox", "tiny-gemma2"])
def test_last_token_and_full_ablation_agree_on_every_point(name):
    from explorer import load_model

    m = load_model(name)
    rng = np.random.default_rng(7)
    shape = (m.spec.n_layers, m.spec.n_heads)
    induction, fv = rng.random(shape), rng.random(shape)
    kw = dict(percents=(0, 10, 30, 60), n_prompts=4, n_shots=2, loss_sequences=2,
              loss_tokens=40, exclude_fraction=0.1, mean_tasks=TASKS, n_boot=50)
    fast = ih.ablation_curves(m, ["antonym", "capitalize"], induction, fv, method="last_token",
                              max_rows=9, **kw)      # several copies a run, split over runs
    slow = ih.ablation_curves(m, ["antonym", "capitalize"], induction, fv, method="full", **kw)
    np.testing.assert_allclose(fast.answer_prob, slow.answer_prob, atol=1e-5)
    np.testing.assert_array_equal(fast.correct, slow.correct)
    np.testing.assert_array_equal(fast.ablated, slow.ablated)
    np.testing.assert_allclose(fast.token_loss_difference, slow.token_loss_difference)


def test_last_token_ablation_refused_where_it_cannot_run(monkeypatch):
    """A family outside LAST_TOKEN_FAMILIES (here Gemma 2 taken out of it) is refused."""
    from explorer import load_model

    gemma = load_model("tiny-gemma2")
    monkeypatch.setattr(ih_last_token, "LAST_TOKEN_FAMILIES", ("llama", "gpt2", "gpt_neox"))
    shape = (gemma.spec.n_layers, gemma.spec.n_heads)
    with pytest.raises(InputError, match="method='last_token'.*gpt_neox families"):
        ih.ablation_curves(gemma, ["antonym"], np.zeros(shape), np.zeros(shape),
                           method="last_token")
    with pytest.raises(InputError, match="Did you mean 'last_token'"):
        ih.ablation_curves(gemma, ["antonym"], np.zeros(shape), np.zeros(shape),
                           method="last-token")
    with pytest.raises(InputError, match="at least one evaluation task"):
        ih.ablation_curves(gemma, [], np.zeros(shape), np.zeros(shape))


def test_default_mean_pool_leaves_out_the_evaluated_tasks(tiny_model):
    shape = (tiny_model.spec.n_layers, tiny_model.spec.n_heads)
    ds = ih.ablation_curves(tiny_model, ["antonym"], np.zeros(shape), np.zeros(shape),
                            percents=(0,), rankings=["fv"], n_prompts=2, n_shots=2,
                            loss_sequences=2, loss_tokens=40, n_boot=20)
    pool = ds.attrs["params"]["mean_tasks"]
    assert "antonym" not in pool
    assert sorted(pool + ["antonym"]) == ih.icl_task_names()


def test_chance_accuracy_by_hand(tmp_path):
    (tmp_path / "pick.json").write_text(json.dumps({"pairs": [
        {"input": "a, b, c", "output": "b"}, {"input": "d, e", "output": "d"}]}))
    (tmp_path / "const.json").write_text(json.dumps({"pairs": [
        {"input": "x", "output": "yes"}, {"input": "y", "output": "yes"},
        {"input": "z", "output": "no"}, {"input": "w", "output": "maybe"}]}))
    assert ih.chance_accuracy(ih.load_icl_task("pick", tmp_path)) == pytest.approx((1 / 3 + 1 / 2) / 2)
    assert ih.chance_accuracy(ih.load_icl_task("const", tmp_path)) == pytest.approx(2 / 4)
    assert ih.chance_accuracy("choose-first-of-3") == pytest.approx(1 / 3)
    assert ih.chance_accuracy("capitalize") == pytest.approx(1 / 30)


def test_task_screen_against_plain_forwards_and_scipy_wilson(tiny_model):
    m = tiny_model
    ds = ih.task_screen(m, ["antonym", "choose-first-of-3"], n_prompts=5, n_shots=2, seed=9)
    for task in ("antonym", "choose-first-of-3"):
        prompts, answers = ih.icl_prompts(task, n_prompts=5, n_shots=2, seed=9)
        hits = []
        for p, a in zip(prompts, answers):
            logits = m.hf(_ids(m, p)).logits[0, -1]
            hits.append(int(logits.argmax()) == m.tokenizer(" " + a, add_special_tokens=False)
                        ["input_ids"][0])
        k = int(np.sum(hits))
        ci = stats.binomtest(k, 5).proportion_ci(confidence_level=0.95, method="wilson")
        row = ds.sel(task=task)
        assert float(row.accuracy) == pytest.approx(k / 5)
        assert float(row.accuracy_low) == pytest.approx(ci.low, abs=1e-9)
        assert float(row.accuracy_high) == pytest.approx(ci.high, abs=1e-9)
        assert bool(row.above_chance) == (ci.low > ih.chance_accuracy(task))
    with pytest.raises(InputError, match="at least one task"):
        ih.task_screen(m, [])


def _cli(argv):
    return parse_and_run("icl_heads", ["icl-heads", "--model", "tiny-llama", *argv])


def test_cli_mean_source_and_intervals_are_the_library_call(tiny_model, capsys):
    argv = ["--tasks", "antonym", "--eval-tasks", "capitalize,uppercase", "--percents", "0,25",
            "--n-prompts", "3", "--n-shots", "2", "--mean-source", "zero", "--n-boot", "300"]
    assert _cli([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    ind = ih.induction_scores(tiny_model, seed=0)["induction_score"].values
    fv = ih.fv_scores(tiny_model, ["antonym"], n_prompts=3, n_shots=2, seed=0)["fv_score"].values
    want = ih.ablation_curves(tiny_model, ["capitalize", "uppercase"], ind, fv,
                              percents=[0, 25], exclude_fraction=0.02, n_prompts=3, n_shots=2,
                              seed=0, mean_source="zero", n_boot=300)
    assert out["mean_source"] == "zero" and out["mean_tasks"] is None
    for var in ("mean_accuracy", "mean_accuracy_low", "mean_accuracy_high", "mean_answer_prob"):
        for r in ih.RANKINGS:
            np.testing.assert_allclose(out[var][r], want[var].sel(ranking=r).values, atol=1e-9)
    # the text output prints every ranking's accuracy with its interval
    assert _cli(argv) == 0
    text = capsys.readouterr().out
    assert "zero mean" in text and "95% bootstrap interval" in text
    fv_row = next(line for line in text.splitlines() if line.startswith("fv "))
    lo, hi = want.mean_accuracy_low.sel(ranking="fv").values, \
        want.mean_accuracy_high.sel(ranking="fv").values
    assert f"[{lo[1]:.2f}, {hi[1]:.2f}]" in fv_row
    with pytest.raises(SystemExit):
        _cli([*argv[:-4], "--mean-source", "mean"])
    assert "invalid choice: 'mean'" in capsys.readouterr().err


def test_cli_above_chance_refuses_when_no_task_is(tiny_model):
    # a random-init model does no task above chance (checked here), so nothing is evaluated
    screen = ih.task_screen(tiny_model, n_prompts=2, n_shots=2, seed=100)
    assert not screen.above_chance.values.any()
    with pytest.raises(InputError, match="no shipped task is above chance"):
        _cli(["--tasks", "antonym", "--eval-tasks", "above-chance", "--percents", "0",
              "--n-prompts", "2", "--n-shots", "2", "--json"])


@pytest.mark.slow
@pytest.mark.integration
def test_smollm2_screen_and_last_token_ablation(smollm2):
    """On SmolLM2: the screen keeps the tasks it does (capitalize few-shot) and drops those
    it does not; the last-token ablation equals the full-sequence one on a real model."""
    screen = ih.task_screen(smollm2, ["capitalize", "english-french"], n_prompts=8,
                            n_shots=3, seed=100)
    assert bool(screen.above_chance.sel(task="capitalize"))
    assert not bool(screen.above_chance.sel(task="english-french"))
    rng = np.random.default_rng(0)
    shape = (smollm2.spec.n_layers, smollm2.spec.n_heads)
    kw = dict(percents=(0, 5), rankings=["random"], n_prompts=3, n_shots=2, loss_sequences=2,
              loss_tokens=24, mean_tasks=["antonym"], n_boot=20)
    a, b = rng.random(shape), rng.random(shape)
    fast = ih.ablation_curves(smollm2, ["capitalize"], a, b, method="last_token", **kw)
    slow = ih.ablation_curves(smollm2, ["capitalize"], a, b, method="full", **kw)
    np.testing.assert_allclose(fast.answer_prob, slow.answer_prob, atol=1e-4)
