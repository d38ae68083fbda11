"""The per-head engine (explorer.heads) on every family's tiny model.

Checked against plain Hugging Face forwards of ``model.hf`` and torch hooks on its modules:
the engine's logits, each head's write (the o_proj input sliced by head, through Gemma-2's
post-attention norm), each MLP's write, and heads reading different inputs.
"""
from __future__ import annotations

import pytest
import torch
import transformers

from explorer import load_model
from explorer.heads import (
    HeadEngine,
    UnsupportedModelError,
    causal_mask,
    check_engine_family,
    parallel_attn_mlp,
)
from explorer.models import TINY_MODELS, _get_path, _tiny_tokenizer, wrap_model

# 13 and 7 tokens: left padding, and wider than tiny-gemma2's sliding window (8)
PROMPTS = ["The quick brown fox jumps over the lazy dog. A journey of", "One two three"]


def noisy_norms(name: str):
    """The tiny model with random norm gains and biases (Gemma's init is all zeros, which
    would hide a wrong gain offset)."""
    m = load_model(name)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for pname, p in m.hf.named_parameters():
            if "norm" in pname or ".ln" in pname:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return m


@pytest.fixture(scope="module", params=TINY_MODELS)
def family_model(request):
    return noisy_norms(request.param)


def _hooked_run(m, batch):
    """A plain model.hf forward recording each layer's o_proj input and output, the
    attention output as it reaches the stream, and each MLP's write."""
    arch = m.arch
    rec, handles = {}, []
    for layer in range(m.n_layers):
        block = m.hf_layer(layer)
        o = m.o_proj(layer)
        handles.append(o.register_forward_hook(
            lambda mod, args, out, _l=layer: rec.update({("z", _l): args[0], ("o", _l): out})))
        if arch.attn_out_norm_path:
            handles.append(_get_path(block, arch.attn_out_norm_path).register_forward_hook(
                lambda mod, args, out, _l=layer: rec.__setitem__(("attn", _l), out)))
        mlp_site = arch.mlp_out_norm_path or arch.mlp_path
        handles.append(_get_path(block, mlp_site).register_forward_hook(
            lambda mod, args, out, _l=layer: rec.__setitem__(("mlp", _l), out)))
    try:
        with torch.no_grad():
            logits = m.hf(**batch.model_inputs()).logits
    finally:
        for h in handles:
            h.remove()
    return logits, rec


def test_engine_forward_reproduces_hf_logits_and_writes(family_model):
    m = family_model
    batch = m.tokenize(PROMPTS)
    assert batch.width == 13 and min(batch.lengths) < batch.width   # padded
    engine = HeadEngine(m)
    with torch.no_grad():
        run = engine.forward(batch)
    logits, rec = _hooked_run(m, batch)
    real = batch.attention_mask.bool()
    torch.testing.assert_close(run.logits[real], logits[real], atol=2e-5, rtol=1e-4)
    H = m.spec.n_heads
    for layer in range(m.n_layers):
        z = rec[("z", layer)].reshape(*batch.input_ids.shape, H, -1)     # [prompt, pos, head, d_head]
        slices = torch.einsum("bphe,hed->hbpd", z, m.W_O(layer))        # [head, prompt, pos, d_model]
        if m.arch.attn_out_norm_path:  # Gemma-2: the norm is x * scale * gain, one factor per x
            o = rec[("o", layer)]
            slices = slices * (rec[("attn", layer)] / o)[None]
        torch.testing.assert_close(run.head_out[layer][:, real], slices[:, real], atol=1e-5,
                                   rtol=1e-4)
        torch.testing.assert_close(run.mlp_out[layer][real], rec[("mlp", layer)][real],
                                   atol=1e-5, rtol=1e-4)


def test_heads_reading_their_own_inputs(family_model):
    """Head h reading resid + noise_h gives what the Hugging Face attention gives for head h
    when its norm reads resid + noise_h (a pre-hook on the attention's input norm)."""
    m = family_model
    arch = m.arch
    batch = m.tokenize(PROMPTS[:1])
    engine = HeadEngine(m)
    layer = 1
    H = m.spec.n_heads
    with torch.no_grad():
        x = engine.forward(batch).resid_pre[layer]                         # [prompt, pos, d_model]
        noise = 0.5 * torch.randn(H, *x.shape, generator=torch.Generator().manual_seed(3))
        engine.attn_out_norm[layer] = None   # compare o_proj slices (the post-norm split is above)
        ctx = engine.prepare(x, batch)
        got = engine.heads(layer, x[None] + noise, causal_mask(batch), ctx)  # [head, prompt, pos, d]
    block = m.hf_layer(layer)
    norm = _get_path(block, arch.attn_norm_path)
    for h in range(H):
        rec = {}
        handles = [
            norm.register_forward_pre_hook(lambda mod, args, _h=h: (x + noise[_h],)),
            m.o_proj(layer).register_forward_pre_hook(
                lambda mod, args: rec.__setitem__("z", args[0]))]
        try:  # only this layer's attention norm reads the perturbed stream
            with torch.no_grad():
                m.hf(**batch.model_inputs())
        finally:
            for hd in handles:
                hd.remove()
        z = rec["z"].reshape(*x.shape[:2], H, -1)[:, :, h]                # [prompt, pos, d_head]
        want = z @ m.W_O(layer)[h]
        torch.testing.assert_close(got[h], want, atol=1e-5, rtol=1e-4)


def test_gemma2_window_and_softcap_matter():
    """The tiny Gemma-2's sliding window (8) changes its logits on a 13-token prompt, so the
    logits test above exercises it; a tight attention soft cap (0.5, set in the model's
    config and attention modules) changes them too, and the engine still matches."""
    m = noisy_norms("tiny-gemma2")
    with torch.no_grad():  # sharper attention than the random init's (scores of order 1)
        for layer in range(m.n_layers):
            m.hf_layer(layer).self_attn.q_proj.weight.mul_(10.0)
            m.hf_layer(layer).self_attn.k_proj.weight.mul_(10.0)
    batch = m.tokenize(PROMPTS)
    real = batch.attention_mask.bool()
    engine = HeadEngine(m)
    assert engine.windows == [8, None, 8] and engine.attn_softcap == 50.0
    with torch.no_grad():
        ref = engine.forward(batch).logits
        engine.windows = [None] * 3
        no_window = engine.forward(batch).logits
    assert (ref - no_window)[real].abs().max() > 1e-4
    m.hf.config.attn_logit_softcapping = 0.5
    for layer in range(m.n_layers):
        m.hf_layer(layer).self_attn.attn_logit_softcapping = 0.5
    with torch.no_grad():
        capped = HeadEngine(m).forward(batch).logits
        hf = m.hf(**batch.model_inputs()).logits
    assert (capped - ref)[real].abs().max() > 1e-3
    torch.testing.assert_close(capped[real], hf[real], atol=2e-5, rtol=1e-4)


def test_family_facts():
    assert parallel_attn_mlp(load_model("tiny-neox"))
    assert not any(parallel_attn_mlp(load_model(n)) for n in TINY_MODELS if n != "tiny-neox")
    neox = HeadEngine(load_model("tiny-neox"))
    assert neox.parallel and neox.b[0] is not None             # fused q/k/v with biases
    qwen = HeadEngine(load_model("tiny-qwen2"))
    assert qwen.b[0].shape == (4, 3 * 16) and qwen.rep.tolist() == [0, 0, 1, 1]   # GQA


def test_sliding_window_mask_matches_hand_count():
    m = load_model("tiny-llama")
    batch = m.tokenize(["One two three four five six"])
    mask = causal_mask(batch, window=2)[0, 0]
    want = torch.tensor([[i - 2 < j <= i for j in range(6)] for i in range(6)])
    assert torch.equal(mask, want)


def test_qk_norm_is_refused():
    """Qwen3 (queries and keys normalised per head) maps to the llama family but has no
    per-head forward here: a clear error, not wrong numbers."""
    cfg = transformers.AutoConfig.for_model(
        "qwen3", num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        hidden_size=32, head_dim=16, intermediate_size=64, vocab_size=512,
        max_position_embeddings=64)
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    m = wrap_model(hf, _tiny_tokenizer(), name="tiny-qwen3", weights="random")
    with pytest.raises(UnsupportedModelError, match="normalises queries and keys"):
        check_engine_family(m)
    with pytest.raises(UnsupportedModelError, match="normalises queries and keys"):
        HeadEngine(m)
