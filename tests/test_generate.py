"""explorer.generate against Hugging Face's own greedy generate and a hand loop of run_with."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import explorer
from explorer._checks import InputError
from explorer.interventions import Steer

PROMPT = "The cat sat on the"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_without_edits_it_is_greedy_generate(tiny_model):
    ids = torch.tensor([tiny_model.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        hf = tiny_model.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                    do_sample=False, pad_token_id=tiny_model.tokenizer.eos_token_id)
    got = explorer.generate(tiny_model, PROMPT, max_new_tokens=8)
    assert list(got.prompt_ids) == ids[0].tolist()
    assert list(got.token_ids) == hf[0, ids.shape[1]:].tolist()
    assert torch.equal(got.as_torch(), hf)
    assert got.full_text == tiny_model.tokenizer.decode(hf[0])
    assert got.full_text.endswith(got.text) and len(got.token_ids) == 8


def test_with_a_steering_edit_it_is_a_hand_loop_of_run_with(tiny_model):
    d = tiny_model.spec.d_model
    vec = torch.randn(d, generator=torch.Generator().manual_seed(3)) * 4.0
    edits = [Steer(1, vec, alpha=3.0, positions=(-1,)), Steer(0, vec, alpha=-1.0)]
    ids = tiny_model.tokenize([PROMPT]).token_ids[0]
    for _ in range(6):                                     # the hand loop: argmax steps
        ds = explorer.run_with(tiny_model, [ids], edits)
        ids = [*ids, int(np.nanargmax(ds.logits.explorer.last.values[0]))]
    got = explorer.generate(tiny_model, PROMPT, edits=edits, max_new_tokens=6)
    plain = explorer.generate(tiny_model, PROMPT, max_new_tokens=6)
    assert list(got.prompt_ids) + list(got.token_ids) == ids
    assert got.token_ids != plain.token_ids, "the steering changed nothing: a vacuous check"
    assert got.tokens == tuple(tiny_model.str_tokens(list(got.token_ids)))


def test_a_batch_of_prompts_matches_each_alone(tiny_model):
    prompts = [PROMPT, "Water boils at one hundred degrees and"]
    both = explorer.generate(tiny_model, prompts, max_new_tokens=5)
    for p, g in zip(prompts, both):
        assert g.token_ids == explorer.generate(tiny_model, p, max_new_tokens=5).token_ids


def test_sampling_is_seeded_and_checked(tiny_model):
    a = explorer.generate(tiny_model, PROMPT, max_new_tokens=6, temperature=1.5, seed=7)
    b = explorer.generate(tiny_model, PROMPT, max_new_tokens=6, temperature=1.5, seed=7)
    assert a == b
    with pytest.raises(InputError, match="`seed` seeds sampling; it needs a `temperature`"):
        explorer.generate(tiny_model, PROMPT, seed=1)
    with pytest.raises(InputError, match=r"`temperature` must be a number in \[0.0, inf\]"):
        explorer.generate(tiny_model, PROMPT, temperature=-1)
    with pytest.raises(InputError, match="exceed tiny-llama's context"):
        explorer.generate(tiny_model, PROMPT, max_new_tokens=10_000)


def test_str_tokens_cfg_and_torch_results(tiny_model):
    ds = explorer.trace(tiny_model, [PROMPT, "One two"])
    assert tiny_model.str_tokens(PROMPT) == [str(t) for t in ds.token.values[0]]
    assert tiny_model.str_tokens([PROMPT, "One two"]) == [tiny_model.str_tokens(PROMPT),
                                                          tiny_model.str_tokens("One two")]
    ids = tiny_model.tokenizer("One two", add_special_tokens=False)["input_ids"]
    assert tiny_model.str_tokens(ids) == [str(t) for t in ds.token.values[1, :len(ids)]]
    cfg = tiny_model.cfg
    assert cfg is tiny_model.spec
    hf = tiny_model.hf.config
    assert (cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_vocab, cfg.n_key_value_heads) == (
        hf.num_hidden_layers, hf.num_attention_heads, hf.hidden_size, hf.vocab_size,
        hf.num_key_value_heads)
    assert cfg.d_head == hf.hidden_size // hf.num_attention_heads
    assert tiny_model.d_mlp == hf.intermediate_size
    t = ds.resid_post.explorer.as_torch()
    assert isinstance(t, torch.Tensor) and tuple(t.shape) == ds.resid_post.shape
    np.testing.assert_array_equal(t.numpy(), ds.resid_post.values)
