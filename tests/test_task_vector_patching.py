"""The causal task-vector test (Han et al.): vectors, patches and accuracies against plain
torch hooks on the Hugging Face module."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from scipy import stats

from explorer._checks import InputError
from explorer.analyses import icl_heads as ih
from explorer.analyses import task_vector_patching as tvp
from explorer.analyses.task_vectors import null_task
from explorer.trace import run_batch
from tests._cli import parse_and_run

TASK = "antonym"


def _ids(model, prompt):
    return torch.tensor([model.tokenizer(prompt, add_special_tokens=False)["input_ids"]])


def _layer_outputs(model, prompt):
    """Each decoder layer's output at the last token of one unpadded prompt (torch hooks)."""
    outs = []
    hooks = [model.hf_layer(x).register_forward_hook(
        lambda _m, _i, out: outs.append((out[0] if isinstance(out, tuple) else out)[0, -1].double()))
        for x in range(model.n_layers)]
    try:
        model.hf(_ids(model, prompt))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(outs)                                   # [layer, d_model]


def _patched_last_logits(model, prompt, layer, vector, mode, alpha=1.0):
    """Next-token logits with layer ``layer``'s output at the last token replaced by (or
    increased by alpha times) ``vector``, by a forward hook."""
    v = torch.as_tensor(vector, dtype=torch.float32)

    def hook(_m, _i, out):
        h = out[0] if isinstance(out, tuple) else out
        h = h.clone()
        h[0, -1] = v if mode == "replace" else h[0, -1] + alpha * v
        return (h, *out[1:]) if isinstance(out, tuple) else h

    handle = model.hf_layer(layer).register_forward_hook(hook)
    try:
        return model.hf(_ids(model, prompt)).logits[0, -1]
    finally:
        handle.remove()


def test_task_vectors_are_the_mean_last_token_layer_outputs(tiny_model):
    prompts, _ = ih.icl_prompts(TASK, n_prompts=5, n_shots=3, seed=2)
    expect = torch.stack([_layer_outputs(tiny_model, p) for p in prompts]).mean(0)
    got = tvp.task_vectors_by_layer(tiny_model, TASK, n_prompts=5, n_shots=3, seed=2)
    np.testing.assert_allclose(got, expect.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["replace", "add"])
def test_patch_edits_equal_a_hooked_forward_in_a_padded_batch(tiny_model, mode):
    prompts, _ = ih.icl_prompts(TASK, n_prompts=4, n_shots=1, seed=5)   # different lengths
    assert len({_ids(tiny_model, p).shape[1] for p in prompts}) > 1
    layer = 1
    vec = np.random.default_rng(0).normal(size=tiny_model.spec.d_model)
    own = np.stack([_layer_outputs(tiny_model, p)[layer].numpy() for p in prompts])
    edits = tvp._patch_edits(layer, vec, own if mode == "replace" else None, 0.7)
    out = run_batch(tiny_model, tiny_model.tokenize(prompts), edits=edits, save_positions=[-1])
    for i, p in enumerate(prompts):
        torch.testing.assert_close(out["logits"][i, -1].float(),
                                   _patched_last_logits(tiny_model, p, layer, vec, mode, 0.7),
                                   rtol=1e-4, atol=1e-4)


def test_accuracies_are_those_of_hooked_forwards(tiny_model):
    kw = dict(n_prompts=4, n_shots=2, seed=0)
    ds = tvp.task_vector_patching(tiny_model, [TASK], layers=[0, 2], **kw)
    assert ds.accuracy.dims == ("task", "vector", "layer") and list(ds.layer.values) == [0, 2]
    vectors = tvp.task_vectors_by_layer(tiny_model, TASK, **kw)
    task = ih.as_icl_task(TASK)
    null = tvp.task_vectors_by_layer(tiny_model, null_task([task], 0), **kw)
    prompts, answers = ih.icl_prompts(TASK, n_prompts=4, n_shots=0, seed=1)
    first = ih.answer_token_ids(tiny_model, answers)
    plain = np.mean([int(tiny_model.hf(_ids(tiny_model, p)).logits[0, -1].argmax()) == t
                     for p, t in zip(prompts, first)])
    np.testing.assert_allclose(ds.accuracy.sel(task=TASK, vector="none").values, plain)
    for layer in (0, 2):
        for name, vec in (("task", vectors[layer]), ("null", null[layer])):
            hits = [int(_patched_last_logits(tiny_model, p, layer, vec, "replace").argmax()) == t
                    for p, t in zip(prompts, first)]
            assert float(ds.accuracy.sel(task=TASK, vector=name, layer=layer)) == \
                pytest.approx(np.mean(hits)), (name, layer)
            ci = stats.binomtest(int(np.sum(hits)), 4).proportion_ci(method="wilson")
            cell = ds.sel(task=TASK, vector=name, layer=layer)
            assert (float(cell.accuracy_low), float(cell.accuracy_high)) == \
                pytest.approx((ci.low, ci.high), abs=1e-9)
    ref_prompts, ref_answers = ih.icl_prompts(TASK, **{**kw, "n_prompts": 4})
    assert float(ds.few_shot_accuracy.sel(task=TASK)) == \
        pytest.approx(ih.few_shot_accuracy(tiny_model, ref_prompts, ref_answers))
    assert ds.attrs["method"] == "task_vector_patching" and ds.attrs["params"]["mode"] == "replace"


def test_bad_arguments_are_named(tiny_model):
    with pytest.raises(InputError, match="`tasks` must hold at least one task"):
        tvp.task_vector_patching(tiny_model, [])
    with pytest.raises(InputError, match="`mode` must be one of 'replace', 'add'"):
        tvp.task_vector_patching(tiny_model, [TASK], mode="swap")
    with pytest.raises(InputError, match=r"`layer` must be an int in \[0, 2\]; got 7"):
        tvp.task_vector_patching(tiny_model, [TASK], layers=[7])


def _cli(argv):
    return parse_and_run("task_vectors", ["task-vectors", "--model", "tiny-llama", *argv])


def test_cli_patching_is_the_library_call(tiny_model, capsys):
    argv = ["--tasks", "antonym,uppercase", "--n-prompts", "3", "--n-shots", "2", "--k", "2",
            "--patching", "--patching-layers", "0,1-2"]
    assert _cli([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["patching"]
    want = tvp.task_vector_patching(tiny_model, ["antonym", "uppercase"], layers=[0, 1, 2],
                                    n_prompts=3, n_shots=2)
    assert out["layers"] == [0, 1, 2] and out["target_shots"] == 0
    for t in ("antonym", "uppercase"):
        for v in ("task", "null", "none"):
            for var in ("accuracy", "accuracy_low", "accuracy_high"):
                np.testing.assert_allclose(out[var][t][v], want[var].sel(task=t, vector=v).values)
    assert _cli(argv) == 0
    text = capsys.readouterr().out
    null_row = next(line for line in text.splitlines() if line.startswith("uppercase") and " null " in line)
    a, lo, hi = (float(want[v].sel(task="uppercase", vector="null", layer=2))
                 for v in ("accuracy", "accuracy_low", "accuracy_high"))
    assert null_row.rstrip().endswith(f"{a:.2f} [{lo:.2f},{hi:.2f}]")
    with pytest.raises(InputError, match=r"--patching-layers must be layer numbers in \[0, 2\].*'5'"):
        _cli([*argv[:-1], "0,5"])
    with pytest.raises(InputError, match=r"got 'x'"):
        _cli([*argv[:-1], "x"])
