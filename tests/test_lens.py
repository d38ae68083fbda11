"""Tests for explorer.lens: the logit lens against the model's logits and a by-hand lens."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from explorer._checks import InputError
from explorer.interventions import Steer
from explorer.lens import logit_lens
from explorer.models import TINY_MODELS, load_model, token_text
from explorer.trace import clean_run

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins",
    "One two",
    "Water boils at one hundred degrees",
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def hf_forward(model, prompt):
    """Logits [pos, vocab] and hidden states (L+1 x [pos, d_model]) of one unpadded prompt."""
    ids = torch.tensor([model.tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    out = model.hf(input_ids=ids, output_hidden_states=True)
    return out.logits[0], [h[0] for h in out.hidden_states]


def by_hand_lens_logits(model, resid):
    """unembed(final_norm(resid)), with Gemma 2's final soft cap written out."""
    logits = model.unembed_module(model.final_norm_module(resid))
    cap = getattr(model.hf.config, "final_logit_softcapping", None)
    if model.spec.family == "gemma2" and cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def test_last_layer_is_the_model_output(tiny_model):
    k = 5
    ds = logit_lens(tiny_model, PROMPTS, k=k)
    last = tiny_model.n_layers - 1
    for i, prompt in enumerate(PROMPTS):
        logits, _ = hf_forward(tiny_model, prompt)
        n = logits.shape[0]
        probs = torch.softmax(logits, -1)
        top = probs.topk(k, -1)
        np.testing.assert_array_equal(ds.top_token_id.values[i, :n, -1], top.indices.numpy())
        np.testing.assert_array_equal(ds.final_token_id.values[i, :n], top.indices.numpy())
        np.testing.assert_allclose(ds.top_prob.values[i, :n, -1], top.values.numpy(), atol=1e-5)
        # the final tokens rank 0..k-1 at the last layer, with the model's probabilities
        np.testing.assert_array_equal(ds.final_rank.sel(layer=last).values[i, :n],
                                      np.tile(np.arange(k), (n, 1)))
        np.testing.assert_allclose(ds.final_prob.sel(layer=last).values[i, :n],
                                   top.values.numpy(), atol=1e-5)
        assert list(ds.top_token.values[i, 0, -1]) == [token_text(tiny_model.tokenizer, t)
                                                       for t in top.indices[0].tolist()]
        # padding
        assert (ds.top_token_id.values[i, n:] == -1).all()
        assert np.isnan(ds.top_prob.values[i, n:]).all()
        assert ds["mask"].values[i].sum() == n


@pytest.mark.parametrize("name", TINY_MODELS)
def test_middle_layer_equals_the_lens_by_hand(name):
    model = load_model(name)
    k, layer = 4, 1
    ds = logit_lens(model, PROMPTS, k=k, layers=[layer])
    for i, prompt in enumerate(PROMPTS):
        logits, hidden = hf_forward(model, prompt)
        n = logits.shape[0]
        lens = by_hand_lens_logits(model, hidden[layer + 1])     # [pos, vocab]
        probs = torch.softmax(lens, -1)
        top = probs.topk(k, -1)
        np.testing.assert_array_equal(ds.top_token_id.values[i, :n, 0], top.indices.numpy())
        np.testing.assert_allclose(ds.top_prob.values[i, :n, 0], top.values.numpy(), atol=1e-5)
        final_ids = logits.topk(k, -1).indices                  # [pos, k]
        np.testing.assert_array_equal(ds.final_token_id.values[i, :n], final_ids.numpy())
        target = lens.gather(-1, final_ids)                      # [pos, k]
        rank = (lens.unsqueeze(1) > target.unsqueeze(-1)).sum(-1)  # tokens strictly above
        np.testing.assert_array_equal(ds.final_rank.values[i, :n, 0], rank.numpy())
        np.testing.assert_allclose(ds.final_prob.values[i, :n, 0],
                                   probs.gather(-1, final_ids).numpy(), atol=1e-6)


def test_rank_cap_reads_ranks_at_or_past_the_cap_as_the_cap(tiny_model):
    k, cap = 8, 5
    exact = logit_lens(tiny_model, PROMPTS, k=k)
    capped = logit_lens(tiny_model, PROMPTS, k=k, rank_cap=cap)
    mask = exact["mask"].values                                   # [prompt, pos]
    r_exact = exact.final_rank.values[mask]                       # [real, layer, rank]
    r_capped = capped.final_rank.values[mask]
    below = r_exact < cap
    assert below.any() and (~below).any(), "the case must have ranks on both sides of the cap"
    np.testing.assert_array_equal(r_capped[below], r_exact[below])
    assert (r_capped[~below] == cap).all()
    np.testing.assert_array_equal(capped.top_token_id.values, exact.top_token_id.values)
    np.testing.assert_allclose(capped.final_prob.values[mask], exact.final_prob.values[mask])
    assert capped.attrs["params"]["rank_cap"] == cap


def test_positions_layers_and_batches_select_the_same_values(tiny_model):
    full = logit_lens(tiny_model, PROMPTS, k=3)
    part = logit_lens(tiny_model, PROMPTS, k=3, positions=[-1, 0], layers=[0, 2], batch_size=2)
    assert list(part.pos.values) == [-1, 0] and list(part.layer.values) == [0, 2]
    for i, n in enumerate(full["mask"].values.sum(1)):
        for j, q in enumerate((n - 1, 0)):
            for var in ("top_token_id", "final_rank"):
                np.testing.assert_array_equal(part[var].values[i, j],
                                              full[var].sel(layer=[0, 2]).values[i, q])
            np.testing.assert_allclose(part.top_prob.values[i, j],
                                       full.top_prob.sel(layer=[0, 2]).values[i, q], atol=1e-6)


def test_lens_under_an_edit_with_and_without_resume(tiny_model):
    vec = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 5
    edits = [Steer(1, vec, positions=(-1,))]
    clean = logit_lens(tiny_model, PROMPTS, k=3)
    edited = logit_lens(tiny_model, PROMPTS, k=3, edits=edits)
    resumed = logit_lens(tiny_model, PROMPTS, k=3, edits=edits, resume=clean_run(tiny_model,
                                                                                  PROMPTS))
    for var in ("top_token_id", "final_rank", "final_token_id"):
        np.testing.assert_array_equal(resumed[var].values, edited[var].values)
    np.testing.assert_allclose(resumed.top_prob.values, edited.top_prob.values, atol=1e-6)
    # the layer before the edit reads the clean stream; the edited layer does not
    np.testing.assert_array_equal(edited.top_token_id.sel(layer=0).values,
                                  clean.top_token_id.sel(layer=0).values)
    assert not np.allclose(edited.top_prob.sel(layer=1).values[:, -1],
                           clean.top_prob.sel(layer=1).values[:, -1], equal_nan=True)
    assert [e["kind"] for e in edited.attrs["edits"]] == ["steer"]
    json.dumps(edited.attrs)


def test_a_row_targeted_edit_lands_on_its_prompts_across_batches(tiny_model):
    vec = torch.randn(64, generator=torch.Generator().manual_seed(1)) * 5
    target = Steer(1, vec, prompts=(2,))                       # the third prompt only
    mixed = logit_lens(tiny_model, PROMPTS, k=3, edits=[target], batch_size=2)
    alone = logit_lens(tiny_model, PROMPTS[2:], k=3, edits=[Steer(1, vec)])
    clean = logit_lens(tiny_model, PROMPTS[:2], k=3)
    n = int(alone["mask"].sum())
    np.testing.assert_array_equal(mixed.top_token_id.values[2, :n], alone.top_token_id.values[0, :n])
    np.testing.assert_allclose(mixed.top_prob.values[2, :n], alone.top_prob.values[0, :n], atol=1e-6)
    for i in range(2):
        m = int(clean["mask"].values[i].sum())
        np.testing.assert_allclose(mixed.top_prob.values[i, :m], clean.top_prob.values[i, :m], atol=1e-6)
    with pytest.raises(InputError, match="targets prompt row 3"):
        logit_lens(tiny_model, PROMPTS, k=3, edits=[Steer(1, vec, prompts=(3,))])


def test_bfloat16_unembedding_stays_close(tiny_model):
    exact = logit_lens(tiny_model, PROMPTS, k=1)
    fast = logit_lens(tiny_model, PROMPTS, k=1, unembed_dtype="bfloat16")
    mask = exact["mask"].values
    np.testing.assert_allclose(fast.top_prob.values[mask], exact.top_prob.values[mask], atol=2e-2)


def test_bad_lens_arguments(tiny_model):
    with pytest.raises(InputError, match=r"`k` must be an int in \[1, 512\]; got 0\."):
        logit_lens(tiny_model, PROMPTS, k=0)
    with pytest.raises(InputError, match=r"`rank_cap` must be an int in \[1, 512\]; got 600\."):
        logit_lens(tiny_model, PROMPTS, rank_cap=600)
    with pytest.raises(InputError, match=r"`unembed_dtype` must be one of 'auto', 'float32', "
                                         r"'bfloat16'; got 'float16'"):
        logit_lens(tiny_model, PROMPTS, unembed_dtype="float16")
    with pytest.raises(InputError, match=r"`layer` must be an int in \[0, 2\]; got 5\."):
        logit_lens(tiny_model, PROMPTS, layers=[5])
    with pytest.raises(InputError, match="`prompts` must hold at least one prompt"):
        logit_lens(tiny_model, [])
    with pytest.raises(InputError, match=r"position 5 is out of range for prompt 1 with 2 tokens"):
        logit_lens(tiny_model, PROMPTS, positions=[5])


# -- the packaged SmolLM2 -------------------------------------------------------------------

@pytest.mark.integration
def test_smollm2_says_paris(smollm2):
    prompt = "The capital of France is"
    ds = logit_lens(smollm2, prompt, k=3, positions=[-1], layers=[smollm2.n_layers - 1])
    ids = torch.tensor([smollm2.tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    probs = torch.softmax(smollm2.hf(input_ids=ids).logits[0, -1], -1)
    assert ds.top_token.values[0, 0, 0, 0] == " Paris"
    assert ds.top_token_id.values[0, 0, 0, 0] == int(probs.argmax())
    np.testing.assert_allclose(ds.top_prob.values[0, 0, 0, 0], float(probs.max()), atol=1e-4)
