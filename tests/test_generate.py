"""explorer.generate against Hugging Face's own greedy generate and a hand loop of run_with."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import explorer
from explorer._checks import InputError
from explorer.interventions import Ablate, Steer

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


def _hooked_generation(model, prompt, n_new, step_hooks):
    """Greedy generation of one unpadded prompt by plain forwards of ``model.hf``, the hooks
    of step s (``step_hooks(s)``: (module, forward hook or pre-hook, is_pre) triples)
    registered for that step's forward only. Returns the new ids and the first step's logits."""
    ids = model.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    first = None
    for s in range(n_new):
        handles = [mod.register_forward_pre_hook(hook) if pre else mod.register_forward_hook(hook)
                   for mod, hook, pre in step_hooks(s)]
        try:
            with torch.no_grad():
                logits = model.hf(torch.tensor([ids])).logits[0, -1].float()
        finally:
            for h in handles:
                h.remove()
        first = logits if first is None else first
        ids = [*ids, int(logits.argmax())]
    return ids[len(ids) - n_new:], first


def test_step_edits_are_a_hand_loop_of_hooked_forwards(tiny_model):
    """Edits that change with the step: a mean ablation of two heads at the last prompt
    token and every generated token (the ICL heads' generation), a steering vector of its
    own per step at the newest token, and a steering of every token at every step. The
    random model's tokens hardly see the earlier positions; the ablation's growth shows in
    the tokens of a trained model (tests/test_icl_generation_score.py, SmolLM2)."""
    m = tiny_model
    spec = m.spec
    d = spec.d_head
    g = torch.Generator().manual_seed(11)
    n_new, layer, heads = 5, 1, (0, 2)
    mean = {h: torch.randn(d, generator=g) * 3.0 for h in heads}
    per_step = [torch.randn(spec.d_model, generator=g) * 4.0 for _ in range(n_new)]
    always = torch.randn(spec.d_model, generator=g)
    edits = [Steer(2, always, alpha=0.5)]

    def step_edits(s):
        positions = tuple(range(-(s + 1), 0))
        return [*(Ablate(layer, h, mode="mean", value=mean[h], positions=positions)
                  for h in heads),
                Steer(0, per_step[s], alpha=2.0, positions=(-1,))]

    def step_hooks(s):
        def ablate(mod, args):
            z = args[0].clone()                                  # [1, pos, head * d_head]
            for h in heads:
                z[:, -(s + 1):, h * d:(h + 1) * d] = mean[h]
            return (z, *args[1:])

        def add(vec, last_only):
            def hook(mod, args, out):
                h = (out[0] if isinstance(out, tuple) else out).clone()
                if last_only:
                    h[:, -1] += vec
                else:
                    h += vec
                return (h, *out[1:]) if isinstance(out, tuple) else h
            return hook
        return [(m.o_proj(layer), ablate, True),
                (m.hf_layer(0), add(2.0 * per_step[s], True), False),
                (m.hf_layer(2), add(0.5 * always, False), False)]

    prompts = [PROMPT, "Water boils at one hundred degrees and then"]   # two lengths: padded
    got = explorer.generate(m, prompts, edits=edits, step_edits=step_edits,
                            max_new_tokens=n_new, stop_at_eos=False, first_logits=True)
    alone = explorer.generate(m, prompts, edits=edits, step_edits=step_edits,
                              max_new_tokens=n_new, stop_at_eos=False, decode="alone")
    fixed = explorer.generate(m, prompts, edits=[*edits, *step_edits(0)],
                              max_new_tokens=n_new, stop_at_eos=False)
    for i, p in enumerate(prompts):
        want, first = _hooked_generation(m, p, n_new, step_hooks)
        assert list(got[i].token_ids) == want
        torch.testing.assert_close(got[i].first_logits, first, atol=1e-4, rtol=1e-4)
        assert alone[i] == got[i]                    # the same generation, first_logits aside
        assert alone[i].first_logits is None
        assert alone[i].text == m.tokenizer.decode(want)
        head = m.tokenizer.decode(list(got[i].prompt_ids))
        assert got[i].text == m.tokenizer.decode([*got[i].prompt_ids, *want])[len(head):]
    assert [x.token_ids for x in fixed] != [x.token_ids for x in got], \
        "step 0's edits at every step generate the same: the steps are not told apart"


def test_step_edits_and_decode_are_checked(tiny_model):
    with pytest.raises(TypeError, match="`step_edits` must be a function of the step"):
        explorer.generate(tiny_model, PROMPT, step_edits=[Steer(0, [0.0] * 64)])
    with pytest.raises(TypeError, match=r"`step_edits\(0\)` must return edit records"):
        explorer.generate(tiny_model, PROMPT, step_edits=lambda s: {"layer": 0})
    with pytest.raises(InputError, match=r"targets prompt row 3, but the batch has 1 prompt"):
        explorer.generate(tiny_model, PROMPT,
                          step_edits=lambda s: [Steer(0, [0.0] * 64, prompts=(3,))])
    with pytest.raises(InputError, match="`decode` must be one of 'with_prompt', 'alone'; "
                                         "got 'raw'"):
        explorer.generate(tiny_model, PROMPT, decode="raw")
