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


def _answer_prob_with_heads_set(model, prompt, answer, heads, value):
    """P(answer's first token) with ``heads``' last-token o_proj input := value[layer, head]."""
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
    return float(torch.softmax(logits.float(), -1)[target])


@pytest.mark.parametrize("mean_source", ["cross-task", "per-task", "zero"])
def test_ablated_answer_prob_matches_plain_hooks(tiny_model, mean_source):
    m = tiny_model
    rng = np.random.default_rng(3)
    shape = (m.spec.n_layers, m.spec.n_heads)
    induction, fv = rng.random(shape), rng.random(shape)
    n_prompts, n_shots, seed = 3, 2, 0
    ds = ih.ablation_curves(m, ["antonym"], induction, fv, percents=(0, 25),
                            rankings=["fv"], n_prompts=n_prompts, n_shots=n_shots,
                            loss_sequences=2, loss_tokens=40, seed=seed,
                            mean_source=mean_source, mean_tasks=TASKS, n_boot=200)
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
    want = np.mean([_answer_prob_with_heads_set(m, p, a, heads, value)
                    for p, a in zip(prompts, answers)])
    got = float(ds.answer_prob.sel(ranking="fv", percent=25.0, task="antonym"))
    assert got == pytest.approx(want, abs=1e-5)
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
    low, high = ih._bootstrap_mean_accuracy(correct, n_boot=20000, level=0.9, seed=1)
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
    low, high = ih._bootstrap_mean_accuracy(correct, n_boot=500, level=0.95, seed=0)
    assert float(low[0, 0]) == float(high[0, 0]) == 0.5
