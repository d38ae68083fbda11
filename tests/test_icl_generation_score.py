"""The paper's ICL score: F1 of an answer parsed from 5 generated tokens, under mean ablation.

The scoring is checked on hand-worked strings; the generation against the paper's own
procedure run with plain torch: ``model.hf.generate`` with its key/value cache and a
pre-hook on ``o_proj`` that overwrites the ablated heads' slice at the newest token of every
forward (the ``last_token_only`` replacement of their ``replace_activation_w_avg``).
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from explorer._checks import InputError
from explorer.analyses import icl_heads as ih


@pytest.mark.parametrize("generated, reference, expected", [
    (" Paris\n\nQ: Rome\nA: Italy", "Paris", 1.0),           # stops at the newline
    (" paris.", "Paris", 1.0),                                # case and punctuation
    (" The United States", "United States", 1.0),             # articles dropped
    (" new york city", "New York", 2 * (2 / 3) * 1 / (2 / 3 + 1)),
    (" Berlin", "Paris", 0.0),
    ("\n\n", "Paris", 0.0),                                   # nothing parses
    (" an apple a day", "apple", 2 * (1 / 2) * 1 / (1 / 2 + 1)),  # 'apple day' vs 'apple'
])
def test_parsed_f1_by_hand(generated, reference, expected):
    assert ih.parsed_f1(generated, reference) == pytest.approx(expected)


def test_parse_takes_the_first_word_run():
    assert ih.parse_generation(" cold\nQ: hot") == " cold"
    assert ih.parse_generation("?? big, small") == " big"
    assert ih.parse_generation("") == ""


def _paper_generation(model, prompt, heads, mean_z, n_new=ih.ANSWER_TOKENS):
    """The paper's ablated generation: cached greedy decoding, the heads' o_proj input slice
    replaced by the mean at the newest token of every forward. Returns the new token ids."""
    d = model.spec.d_head
    handles = []
    for layer in sorted({l for l, _ in heads}):
        mine = [h for l, h in heads if l == layer]

        def hook(mod, args, layer=layer, mine=mine):
            z = args[0].clone()
            for h in mine:
                z[-1, -1, h * d:(h + 1) * d] = torch.as_tensor(mean_z[layer, h], dtype=z.dtype)
            return (z,)
        handles.append(model.o_proj(layer).register_forward_pre_hook(hook))
    ids = torch.tensor([model.tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    eos = model.tokenizer.eos_token_id
    try:
        out = model.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                                do_sample=False, pad_token_id=eos, eos_token_id=eos)
    finally:
        for h in handles:
            h.remove()
    new = out[0, ids.shape[1]:].tolist()
    return new[:new.index(eos)] if eos in new else new


def _hooked_last_logits(model, prompt, heads, mean_z):
    """Last-position logits of one prompt with the heads' slice set to the mean there."""
    d = model.spec.d_head

    def hook(mod, args, layer):
        z = args[0].clone()
        for l, h in heads:
            if l == layer:
                z[:, -1, h * d:(h + 1) * d] = torch.as_tensor(mean_z[l, h], dtype=z.dtype)
        return (z,)
    handles = [model.o_proj(l).register_forward_pre_hook(
        lambda mod, args, l=l: hook(mod, args, l)) for l in sorted({l for l, _ in heads})]
    ids = torch.tensor([model.tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    try:
        with torch.no_grad():
            return model.hf(ids).logits[0, -1].float()
    finally:
        for h in handles:
            h.remove()


@pytest.mark.integration
@pytest.mark.slow
def test_ablated_generations_match_the_papers_cached_hooked_generation(smollm2):
    """On SmolLM2: the random tiny models generate one repeated token whatever is ablated,
    so only a trained model tells the paper's ablation of every generated token from an
    ablation of the newest token alone (the two differ on every prompt here)."""
    m = smollm2
    spec = m.spec
    rng = np.random.default_rng(0)
    mean_z = rng.normal(size=(spec.n_layers, spec.n_heads, spec.d_head)).astype(np.float32)
    prompts, answers = ih.icl_prompts("antonym", n_prompts=2, n_shots=3, seed=4)
    heads = [(l, h) for l in range(0, spec.n_layers, 3) for h in range(spec.n_heads)]
    first_ids = ih.answer_token_ids(m, answers)
    for hs in ([], heads):
        texts, first = ih.ablated_generations(m, prompts, hs, mean_z, answer_ids=first_ids)
        for i, p in enumerate(prompts):
            assert texts[i] == m.tokenizer.decode(_paper_generation(m, p, hs, mean_z))
            logits = _hooked_last_logits(m, p, hs, mean_z)
            assert first[i] == pytest.approx(float(torch.softmax(logits, -1)[first_ids[i]]),
                                             abs=1e-5)
    plain, _ = ih.ablated_generations(m, prompts, [], mean_z)
    assert plain != texts          # the ablation changes what is generated


def test_ablation_curves_f1_scores_the_papers_generation(tiny_model):
    m = tiny_model
    spec = m.spec
    rng = np.random.default_rng(5)
    shape = (spec.n_layers, spec.n_heads)
    kw = dict(percents=(0, 25), rankings=["fv", "random"], n_prompts=2, n_shots=2,
              loss_sequences=2, loss_tokens=24, seed=0, mean_source="zero", n_boot=20)
    ds = ih.ablation_curves(m, ["antonym"], rng.random(shape), rng.random(shape), score="f1",
                            **kw)
    assert ds.attrs["params"]["score"] == "f1"
    assert ds.attrs["params"]["answer_tokens"] == 5
    assert ds.attrs["params"]["ablation_method"] == "generate"
    prompts, answers = ih.icl_prompts("antonym", n_prompts=2, n_shots=2, seed=1)
    zero = np.zeros((spec.n_layers, spec.n_heads, spec.d_head), dtype=np.float32)
    for ranking in ("fv", "random"):
        for pct in (0.0, 25.0):
            heads = [tuple(h) for h in json.loads(str(ds.ablated.sel(ranking=ranking,
                                                                      percent=pct).values))]
            want = [ih.parsed_f1(m.tokenizer.decode(_paper_generation(m, p, heads, zero)), a)
                    for p, a in zip(prompts, answers)]
            got = ds.correct.sel(ranking=ranking, percent=pct, task="antonym").values
            np.testing.assert_allclose(got, want, atol=1e-12)
            assert float(ds.accuracy.sel(ranking=ranking, percent=pct, task="antonym")) == \
                pytest.approx(np.mean(want))
    with pytest.raises(InputError, match="last-token path cannot"):
        ih.ablation_curves(m, ["antonym"], rng.random(shape), rng.random(shape), score="f1",
                           method="last_token", **kw)
    with pytest.raises(InputError, match="score"):
        ih.ablation_curves(m, ["antonym"], rng.random(shape), rng.random(shape), score="bleu",
                           **kw)
