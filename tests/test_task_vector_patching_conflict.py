"""The conflicting-task form of the task-vector test (Han et al.): task A's vector written
into few-shot prompts of task B, checked against plain torch forward hooks on the Hugging
Face module and answers worked out by hand."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from explorer._checks import InputError
from explorer.analyses import icl_heads as ih
from explorer.analyses import task_vector_patching as tvp
from tests.test_task_vector_patching import _ids, _layer_outputs

TASKS = ["capitalize", "uppercase", "lowercase-first-letter", "antonym"]
KW = dict(n_prompts=4, n_shots=2, seed=3)


def _hooked_argmax(model, prompt, layer, vector):
    """Argmax next token with layer ``layer``'s output at the last token set to ``vector``."""
    v = torch.as_tensor(np.asarray(vector), dtype=torch.float32)

    def hook(_m, _i, out):
        h = (out[0] if isinstance(out, tuple) else out).clone()
        h[0, -1] = v
        return (h, *out[1:]) if isinstance(out, tuple) else h

    handle = model.hf_layer(layer).register_forward_hook(hook)
    try:
        with torch.no_grad():
            return int(model.hf(_ids(model, prompt)).logits[0, -1].argmax())
    finally:
        handle.remove()


def _first(model, answer):
    return model.tokenizer(" " + answer, add_special_tokens=False)["input_ids"][0]


BY_HAND = {"capitalize": lambda x: x[0].upper() + x[1:], "uppercase": lambda x: x.upper(),
           "lowercase-first-letter": lambda x: x[0].lower()}


def test_answer_rules_reproduce_the_shipped_pairs():
    for name, rule in tvp.ANSWER_RULES.items():
        pairs = ih.load_icl_task(name).pairs
        assert all(rule(x) == y for x, y in pairs), name
    assert tvp.task_answer("uppercase", "river") == "RIVER"
    assert tvp.task_answer("choose-middle-of-3", "a, b, c") == "b"
    assert tvp.task_answer("choose-middle-of-3", "river") is None
    assert tvp.task_answer("country-capital", "France") == "Paris"
    assert tvp.task_answer("country-capital", "apple") is None


def test_conflict_predictions_and_rates_match_hooked_forwards(tiny_model):
    layer = 1
    ds = tvp.conflicting_task_patching(tiny_model, TASKS, layers=[layer], n_boot=200, **KW)
    assert list(ds.source.values) == TASKS + ["null", "none"]
    assert ds.follows_source.dims == ("source", "target", "layer")
    # antonym has no answer to capitalize's / uppercase's queries: not run, not scored
    for tgt in ("capitalize", "uppercase"):
        assert int(ds.n_scored.sel(source="antonym", target=tgt)) == 0
        assert np.isnan(float(ds.follows_source.sel(source="antonym", target=tgt, layer=layer)))
    checked = 0
    for src in BY_HAND:
        vprompts, _ = ih.icl_prompts(src, n_prompts=4, n_shots=2, seed=3)
        vector = torch.stack([_layer_outputs(tiny_model, p) for p in vprompts]).mean(0)[layer]
        for tgt in BY_HAND:
            prompts, answers = ih.icl_prompts(tgt, n_prompts=4, n_shots=2, seed=4)
            queries = [p.split("Q: ")[-1].split("\n")[0] for p in prompts]
            a_tok = [_first(tiny_model, BY_HAND[src](q)) for q in queries]
            b_tok = [_first(tiny_model, a) for a in answers]
            scored = [src == tgt or a != b for a, b in zip(a_tok, b_tok)]
            assert int(ds.n_scored.sel(source=src, target=tgt)) == sum(scored)
            got = ds.prediction.sel(source=src, target=tgt, layer=layer).values
            if not any(scored):      # e.g. " Apple" and " APPLE" share a first token here
                assert (got == -1).all()
                continue
            preds = [_hooked_argmax(tiny_model, p, layer, vector) for p in prompts]
            np.testing.assert_array_equal(got, preds)
            want_a = np.mean([p == a for p, a, s in zip(preds, a_tok, scored) if s])
            want_b = np.mean([p == b for p, b, s in zip(preds, b_tok, scored) if s])
            cell = ds.sel(source=src, target=tgt, layer=layer)
            assert float(cell.follows_source) == pytest.approx(want_a)
            assert float(cell.follows_target) == pytest.approx(want_b)
            assert float(cell.follows_source_low) <= want_a <= float(cell.follows_source_high)
            checked += 1
    assert checked >= 3
    # no patch: the plain forward's argmax; its rate over all of the target's prompts
    prompts, answers = ih.icl_prompts("uppercase", n_prompts=4, n_shots=2, seed=4)
    plain = [int(tiny_model.hf(_ids(tiny_model, p)).logits[0, -1].argmax()) for p in prompts]
    np.testing.assert_array_equal(ds.prediction.sel(source="none", target="uppercase",
                                                    layer=layer).values, plain)
    want = np.mean([p == _first(tiny_model, a) for p, a in zip(plain, answers)])
    assert float(ds.follows_target.sel(source="none", target="uppercase", layer=layer)) == \
        pytest.approx(want)
    assert ds.attrs["best_layer"] == layer


def test_bootstrap_interval_is_degenerate_on_constant_hits():
    rng = np.random.default_rng(0)
    mean, low, high = tvp._bootstrap_rate(np.ones(6, bool), np.ones(6, bool), 100, 0.95, rng)
    assert (mean, low, high) == (1.0, 1.0, 1.0)
    hits = np.array([1, 0, 1, 0, 1, 0, 0, 0], bool)
    mean, low, high = tvp._bootstrap_rate(hits, np.ones(8, bool), 2000, 0.95, rng)
    assert mean == 0.375 and 0.0 <= low < 0.375 < high <= 0.75 + 1e-9
    assert np.isnan(tvp._bootstrap_rate(hits, np.zeros(8, bool), 10, 0.95, rng)[0])


def test_conflict_bad_arguments_are_named(tiny_model):
    with pytest.raises(InputError, match="`tasks` must hold at least two tasks; got 1"):
        tvp.conflicting_task_patching(tiny_model, ["antonym"])
    with pytest.raises(InputError, match="`tasks` must be distinct"):
        tvp.conflicting_task_patching(tiny_model, ["antonym", "antonym"])
    with pytest.raises(InputError, match="`mode` must be one of 'replace', 'add'"):
        tvp.conflicting_task_patching(tiny_model, TASKS, mode="swap")
