"""The lens page's preview forward (`explorer.lens_preview`): the layers from a steering edit
on, re-run in plain torch from the clean run, and their lens read over candidate tokens.

Checked against forward hooks on the Hugging Face layers (the steering added to a layer's
output by hand), against the exact `logit_lens` where the candidates cover the vocabulary
(tiny-llama's 512 tokens are fewer than the preview's sample), and on the page.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from apps.lens import LensView, is_preview
from explorer import lens_preview as lp
from explorer._checks import InputError
from explorer._kernels import row_bucket
from explorer.interventions import Steer
from explorer.lens import logit_lens, preview_vocabulary
from explorer.trace import clean_run
from tests.test_apps import _layer_outputs

PROMPT = "The capital of France is"


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path / "cache"))


def _vector(model, seed=0):
    g = np.random.default_rng(seed)
    return g.standard_normal(model.spec.d_model).astype(np.float32)


@pytest.mark.parametrize("layer", [0, 1])
def test_the_forward_from_the_edit_on_is_the_hooked_forward(tiny_model, layer):
    v, alpha = _vector(tiny_model), 3.0
    clean = clean_run(tiny_model, [PROMPT])
    got = lp.steered_resid_post(tiny_model, clean, [Steer(layer, v, alpha)])
    want = _layer_outputs(tiny_model, PROMPT, steer=(layer, v, alpha))     # [layer, pos, d]
    assert got.shape == (tiny_model.n_layers - layer, *want.shape[1:])
    torch.testing.assert_close(got, want[layer:].float(), rtol=1e-4, atol=1e-5)


def test_two_edits_add_up_at_their_layers(tiny_model):
    a, b = _vector(tiny_model, 1), _vector(tiny_model, 2)
    clean = clean_run(tiny_model, [PROMPT])
    got = lp.steered_resid_post(tiny_model, clean, [Steer(0, a, 1.5), Steer(1, b, -2.0)])
    want = _layer_outputs(tiny_model, PROMPT, steers=[(0, a, 1.5), (1, b, -2.0)])   # by hooks
    torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-5)


def test_over_the_whole_vocabulary_the_preview_is_the_exact_lens(tiny_model):
    """tiny-llama's 512 tokens all fall in the preview's columns: ids exact, probabilities
    to float32 rounding; the layers before the edit are the base's, bit for bit."""
    v, k, layer = _vector(tiny_model), 3, 1
    base = logit_lens(tiny_model, [PROMPT], k=k)
    clean = clean_run(tiny_model, [PROMPT])
    edits = [Steer(layer, v, 2.0)]
    cand = preview_vocabulary(tiny_model, results=[base], directions=[v])
    pre = lp.steered_lens_preview(tiny_model, PROMPT, k=k, edits=edits, clean=clean, base=base,
                                  candidates=cand)
    exact = logit_lens(tiny_model, [PROMPT], k=k, edits=edits)
    assert pre.attrs["params"]["readout"] == "preview"
    assert pre.attrs["params"]["preview_columns"] == tiny_model.hf.config.vocab_size
    np.testing.assert_array_equal(pre.top_token_id.values[..., :layer, :],
                                  base.top_token_id.values[..., :layer, :])
    np.testing.assert_array_equal(pre.top_token_id.values, exact.top_token_id.values)
    np.testing.assert_allclose(pre.top_prob.values, exact.top_prob.values, rtol=1e-4, atol=1e-6)
    assert (pre.final_rank.values[:, :, layer:] == -1).all()   # [prompt, pos, layer, rank]: not computed
    np.testing.assert_array_equal(pre.final_token_id.values[0, :, 0],
                                  exact.top_token_id.values[0, :, -1, 0])


def test_a_preview_needs_a_matching_exact_base(tiny_model):
    v = _vector(tiny_model)
    clean = clean_run(tiny_model, [PROMPT])
    other = logit_lens(tiny_model, ["Another prompt here"], k=3)
    with pytest.raises(InputError, match="same prompt and k"):
        lp.steered_lens_preview(tiny_model, PROMPT, k=3, edits=[Steer(1, v, 1.0)], clean=clean,
                                base=other, candidates=np.arange(10))
    assert not lp.compatible_base(logit_lens(tiny_model, [PROMPT], k=2), PROMPT, 3, 1)


def test_models_the_forward_does_not_cover_are_named(tiny_model, tiny_gpt2):
    v = _vector(tiny_model)
    assert lp.preview_forward_reason(tiny_model, [Steer(1, v, 1.0)]) is None
    assert "Llama-style" in lp.preview_forward_reason(tiny_gpt2, [Steer(0, _vector(tiny_gpt2), 1)])
    assert "last layer" in lp.preview_forward_reason(
        tiny_model, [Steer(tiny_model.n_layers - 1, v, 1.0)])
    assert "every position" in lp.preview_forward_reason(
        tiny_model, [Steer(1, v, 1.0, positions=[0])])
    with pytest.raises(InputError, match="no preview forward"):
        lp.steered_resid_post(tiny_gpt2, clean_run(tiny_gpt2, [PROMPT]),
                              [Steer(0, _vector(tiny_gpt2), 1.0)])


def test_norms_and_activation_are_the_modules_or_the_modules_themselves():
    d = 8
    rms = torch.nn.RMSNorm(d, eps=1e-5)
    with torch.no_grad():
        rms.weight.uniform_(0.5, 1.5)
    rms.variance_epsilon = 1e-5
    x = torch.randn(4, d)
    norm = lp._Norm(rms, d)
    assert norm.weight is not None                       # the formula is used
    torch.testing.assert_close(norm(x), rms(x))
    ln = torch.nn.LayerNorm(d)                           # has weight and eps, but centres
    assert lp._Norm(ln, d).weight is None                # so the module itself is called
    torch.testing.assert_close(lp._Norm(ln, d)(x), ln(x))
    assert lp._activation(torch.nn.SiLU(), 5) is torch.nn.functional.silu
    gelu = torch.nn.GELU()
    assert lp._activation(gelu, 5) is gelu


def test_one_backend_for_all_products_timed_as_a_sequence():
    g = torch.Generator().manual_seed(0)
    gemms = [lp.Gemm(torch.randn(24, 16, generator=g), torch.randn(24, generator=g)),
             lp.Gemm(torch.randn(16, 24, generator=g))]
    x = torch.randn(5, 16, generator=g)
    want = x @ gemms[0].weight.T + gemms[0].bias
    for backend in ("torch", "numpy"):
        torch.testing.assert_close(gemms[0](x, backend), want, rtol=1e-5, atol=1e-5)
    chosen = lp.choose_backend(("test-sequence",), gemms, rows=5)
    entry = [e for e in lp.gemm_choices() if e["shapes"] == [(16, 24), (24, 16)]
             and e["rows"] == row_bucket(5)][-1]
    assert chosen == entry["chosen"] in ("torch", "numpy")
    assert entry["products"] == 2 and entry["torch_ms"] > 0 and entry["numpy_ms"] > 0
    faster_numpy = entry["torch_ms"] >= lp._SPEEDUP_TO_SWITCH * entry["numpy_ms"]
    assert chosen == ("numpy" if faster_numpy else "torch")
    assert lp.choose_backend(("test-sequence",), gemms, rows=6) == chosen   # same bucket: kept


def test_the_page_drags_through_the_preview_forward(tiny_model):
    view = LensView(tiny_model, prompt=PROMPT, k=3, steer_layer=1)
    slider = view.alpha_slider()
    slider.value = 2.5                                   # a drag: value, not value_throttled
    pre = view.preview
    assert is_preview(pre) and pre.attrs["params"]["readout"] == "preview"
    assert pre.attrs["params"]["preview_from_layer"] == 1
    vector = view._steering_vector(view._run_params())
    exact = logit_lens(tiny_model, [PROMPT], k=3, edits=[Steer(1, vector, 2.5)])
    np.testing.assert_array_equal(pre.top_token_id.values, exact.top_token_id.values)
    view.close()
