"""The per-head engine run from a later position, reading the earlier positions' keys and
values (`HeadEngine.prefix_kv`), as EAP runs the clean and corrupted prompts after their
shared prefix: checked against plain Hugging Face forwards of the whole prompts."""
from __future__ import annotations

import pytest
import torch

from explorer.heads import HeadEngine
from explorer.models import TINY_MODELS
from tests.test_engine import PROMPTS, _hooked_run, noisy_norms


@pytest.fixture(scope="module", params=TINY_MODELS)
def family_model(request):
    return noisy_norms(request.param)


@pytest.mark.parametrize("start", [1, 5, 10])
def test_run_after_a_prefix_reproduces_hf_at_later_positions(family_model, start):
    """Logits, head writes and MLP writes at positions >= start equal the Hugging Face
    forward's of the whole (left-padded) prompts; start 10 puts every query past
    tiny-gemma2's sliding window (8) from position 0."""
    m = family_model
    batch = m.tokenize(PROMPTS)
    assert batch.width == 13 and min(batch.lengths) < batch.width   # padded
    engine = HeadEngine(m)
    with torch.no_grad():
        past = engine.prefix_kv(batch, start)
        run = engine.forward(batch, start=start, past=past)
    assert len(past) == m.n_layers and past[0][0].shape[2] == start
    logits, rec = _hooked_run(m, batch)
    real = batch.attention_mask.bool()[:, start:]
    torch.testing.assert_close(run.logits[real], logits[:, start:][real], atol=2e-5, rtol=1e-4)
    H = m.spec.n_heads
    for layer in range(m.n_layers):
        z = rec[("z", layer)].reshape(*batch.input_ids.shape, H, -1)[:, start:]
        slices = torch.einsum("bphe,hed->hbpd", z, m.W_O(layer))        # [head, prompt, pos, d_model]
        if m.arch.attn_out_norm_path:  # Gemma-2: one norm factor per position
            slices = slices * (rec[("attn", layer)] / rec[("o", layer)])[None, :, start:]
        torch.testing.assert_close(run.head_out[layer][:, real], slices[:, real], atol=1e-5,
                                   rtol=1e-4)
        torch.testing.assert_close(run.mlp_out[layer][real], rec[("mlp", layer)][:, start:][real],
                                   atol=1e-5, rtol=1e-4)


def test_run_after_a_prefix_needs_its_keys_and_values(tiny_model):
    engine = HeadEngine(tiny_model)
    batch = tiny_model.tokenize(PROMPTS)
    with pytest.raises(ValueError, match="start=3, past missing"):
        engine.forward(batch, start=3)
