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
from explorer.commands._common import torch_threads
from explorer.interventions import Steer
from explorer.lens import logit_lens, preview_vocabulary
from explorer.trace import clean_run
from tests._threads import record_threads
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
                                  candidates=cand, precision="float32")
    exact = logit_lens(tiny_model, [PROMPT], k=k, edits=edits)
    assert pre.attrs["params"]["readout"] == "preview"
    assert pre.attrs["params"]["preview_dtype"] == "float32"
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


def test_both_backends_compute_the_same_product():
    g = torch.Generator().manual_seed(0)
    gemm = lp.Gemm(torch.randn(24, 16, generator=g), torch.randn(24, generator=g))
    x = torch.randn(5, 16, generator=g)
    want = x @ gemm.weight.T + gemm.bias
    for backend in ("torch", "numpy"):
        torch.testing.assert_close(gemm(x, backend), want, rtol=1e-5, atol=1e-5)


def test_the_bfloat16_product_is_the_rounded_operands_product():
    """bfloat16 rows times bfloat16 weights, summed exactly (float64 here), the sum rounded
    to bfloat16 (one unit in the last place apart for another summation order), plus the
    float32 bias; and it is not the float32 product (the rounding is there)."""
    g = torch.Generator().manual_seed(0)
    gemm = lp.Gemm(torch.randn(48, 64, generator=g), torch.randn(48, generator=g))
    x = torch.randn(7, 64, generator=g)
    bf = torch.bfloat16
    exact = x.to(bf).double() @ gemm.weight.to(bf).double().T
    want = exact.to(bf).float() + gemm.bias
    got = gemm(x, "bfloat16")
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-6)
    assert not torch.allclose(got, x @ gemm.weight.T + gemm.bias, rtol=1e-5, atol=1e-5)
    with pytest.raises(InputError, match="`backend` must be one of"):
        lp.steered_resid_post(None, None, [], backend="float16")


def test_bfloat16_is_decided_by_the_cpu_flags(tmp_path, monkeypatch):
    from explorer import _kernels

    info = tmp_path / "cpuinfo"
    cases = {"fpu sse2 avx2 fma": False, "avx2 avx512f avx512_bf16": True,
             "avx2 avx512f amx_bf16 amx_tile": True, "avx2 avx512f avx512bw": False}
    try:
        for flags, want in cases.items():
            info.write_text(f"processor\t: 0\nflags\t\t: {flags}\nbugs\t\t: none\n")
            monkeypatch.setattr(_kernels, "cpu_flags", lambda: _kernels._read_flags(str(info)))
            _kernels.bfloat16_matmul_is_fast.cache_clear()
            assert _kernels.bfloat16_matmul_is_fast() is want, flags
    finally:
        monkeypatch.undo()
        _kernels.bfloat16_matmul_is_fast.cache_clear()
    assert _kernels.cpu_flags(str(tmp_path / "absent")) is None


def test_auto_precision_is_bfloat16_exactly_where_the_cpu_has_it(tiny_model, monkeypatch):
    from explorer import _kernels

    monkeypatch.delenv("EXPLORER_CPU_GEMM", raising=False)
    clean = clean_run(tiny_model, [PROMPT])
    base = logit_lens(tiny_model, [PROMPT], k=3)
    edits = [Steer(1, _vector(tiny_model), 3.0)]
    cand = preview_vocabulary(tiny_model, results=[base], directions=[edits[0].vector])

    def preview(precision):
        return lp.steered_lens_preview(tiny_model, PROMPT, k=3, edits=edits, clean=clean,
                                       base=base, candidates=cand, precision=precision)

    native = _kernels.bfloat16_matmul_is_fast()
    assert preview("auto").attrs["params"]["preview_dtype"] == ("bfloat16" if native
                                                                  else "float32")
    monkeypatch.setenv("EXPLORER_CPU_GEMM", "torch")            # a forced float32 backend
    assert preview("auto").attrs["params"]["preview_dtype"] == "float32"
    assert preview("bfloat16").attrs["params"]["preview_dtype"] == "bfloat16"
    with pytest.raises(InputError, match="`precision` must be one of"):
        preview("float16")


def test_the_bfloat16_preview_follows_the_float32_one(tiny_model):
    """bfloat16 products move each layer's residual by bfloat16 rounding only: every
    resid_post within 2 % of its norm, probabilities within 0.02 of the float32 preview."""
    clean = clean_run(tiny_model, [PROMPT])
    edits = [Steer(0, _vector(tiny_model), 2.0)]
    r32 = lp.steered_resid_post(tiny_model, clean, edits, backend="torch")
    r16 = lp.steered_resid_post(tiny_model, clean, edits, backend="bfloat16")
    rel = (r16 - r32).norm(dim=-1) / r32.norm(dim=-1)
    assert rel.max() < 0.02 and rel[1:].min() > 0           # rounded, and only rounded
    base = logit_lens(tiny_model, [PROMPT], k=3)
    cand = preview_vocabulary(tiny_model, results=[base], directions=[edits[0].vector])
    out = {p: lp.steered_lens_preview(tiny_model, PROMPT, k=3, edits=edits, clean=clean,
                                      base=base, candidates=cand, precision=p)
           for p in ("float32", "bfloat16")}
    np.testing.assert_allclose(out["bfloat16"].top_prob.values, out["float32"].top_prob.values,
                               atol=0.02)


class _FakeClock:
    """A clock that each ``run(backend)`` advances by that backend's cost times a noise
    factor drawn uniformly from [1 - noise, 1 + noise] (seeded)."""

    def __init__(self, cost: dict[str, float], noise: float, seed: int):
        self.now, self.cost, self.noise = 0.0, cost, noise
        self.rng = np.random.default_rng(seed)
        self.calls: list[str] = []

    def __call__(self) -> float:
        return self.now

    def run(self, backend: str) -> None:
        self.calls.append(backend)
        self.now += self.cost[backend] * self.rng.uniform(1 - self.noise, 1 + self.noise)


def test_decide_backend_needs_the_margin_in_every_round():
    m = lp.PREVIEW_MARGIN
    assert lp.decide_backend([m * 1.0], [1.0]) == "numpy"
    assert lp.decide_backend([m * 0.99], [1.0]) == "torch"
    assert lp.decide_backend([3.0, 3.0, 1.2], [1.0, 1.0, 1.0]) == "torch"  # one round lost
    with pytest.raises(InputError, match="as many numpy timings as torch timings"):
        lp.decide_backend([1.0], [])


@pytest.mark.parametrize("numpy_cost", [1 / 3, 1.0, 1.25, 4.0])
def test_noise_cannot_flip_the_choice(numpy_cost, monkeypatch):
    """Each run's time off by up to +-25 % (uniform; a loaded machine): 200 fresh decisions
    keep torch every time where numpy is as fast or slower (4x: the preview numpy gave
    on a 2-core EPYC, 436 against 101 ms), and take numpy every time where it is 3x faster
    (the worst noisy round is then 0.75 / (1.25 / 3) = 1.8x, above the margin)."""
    monkeypatch.delenv("EXPLORER_CPU_GEMM", raising=False)
    want = "numpy" if numpy_cost < 1 else "torch"
    for seed in range(200):
        clock = _FakeClock({"torch": 1.0, "numpy": numpy_cost}, noise=0.25, seed=seed)
        monkeypatch.setattr(lp, "_CHOICES", {})
        assert lp.choose_backend(("fake",), clock.run, clock=clock) == want


def test_choice_is_timed_on_the_run_once_and_kept(monkeypatch):
    monkeypatch.delenv("EXPLORER_CPU_GEMM", raising=False)
    monkeypatch.setattr(lp, "_CHOICES", {})
    clock = _FakeClock({"torch": 1.0, "numpy": 3.0}, noise=0.0, seed=0)
    assert lp.choose_backend(("m", 3, 32), clock.run, clock=clock) == "torch"
    # one untimed run each, then one paired round: numpy lost it, no more rounds
    assert clock.calls == ["torch", "numpy", "torch", "numpy"]
    assert lp.choose_backend(("m", 3, 32), clock.run, clock=clock) == "torch"
    assert len(clock.calls) == 4                                   # kept, not timed again
    entry = lp.gemm_choices()[-1]
    assert entry["key"] == ["m", 3, 32] and entry["torch_ms"] == [1000.0]
    assert entry["numpy_ms"] == [3000.0] and entry["rounds"] == 1
    fast = _FakeClock({"torch": 2.0, "numpy": 1.0}, noise=0.0, seed=0)
    assert lp.choose_backend(("m", 4, 32), fast.run, clock=fast) == "numpy"
    assert fast.calls.count("numpy") == 1 + lp.PREVIEW_ROUNDS     # all rounds confirm it
    monkeypatch.setenv("EXPLORER_CPU_GEMM", "numpy")
    assert lp.choose_backend(("m", 3, 32), clock.run, clock=clock) == "numpy"  # forced


def test_the_preview_runs_on_the_chosen_backend(tiny_model, monkeypatch):
    """The preview lens is the same on either backend (float32 rounding), and it runs on
    the one `choose_backend` returns."""
    monkeypatch.delenv("EXPLORER_CPU_GEMM", raising=False)
    clean = clean_run(tiny_model, [PROMPT])
    base = logit_lens(tiny_model, [PROMPT], k=3)
    edits = [Steer(1, _vector(tiny_model), 3.0)]
    cand = preview_vocabulary(tiny_model, results=[base], directions=[edits[0].vector])
    out = {}
    for backend in ("torch", "numpy"):
        monkeypatch.setattr(lp, "_CHOICES", {})
        seen = []
        real = lp._steered_forward
        monkeypatch.setattr(lp, "choose_backend", lambda key, run, b=backend: b)
        monkeypatch.setattr(lp, "_steered_forward",
                            lambda *a, real=real, seen=seen: seen.append(a[-1]) or real(*a))
        out[backend] = lp.steered_lens_preview(tiny_model, PROMPT, k=3, edits=edits,
                                               clean=clean, base=base, candidates=cand,
                                               precision="float32")
        assert seen == [backend]
    np.testing.assert_array_equal(out["torch"].top_token_id.values,
                                  out["numpy"].top_token_id.values)
    np.testing.assert_allclose(out["torch"].top_prob.values, out["numpy"].top_prob.values,
                               rtol=1e-4, atol=1e-6)


def test_the_page_drags_through_the_preview_forward(tiny_model, monkeypatch):
    monkeypatch.setenv("EXPLORER_CPU_GEMM", "torch")    # float32 products: exact ids
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


def test_a_drag_back_to_zero_previews_the_unedited_lens_through_the_forward(tiny_model,
                                                                            monkeypatch):
    """After a steered exact result, a move to alpha 0 runs the preview forward (a zero
    steering) rather than a whole lens, and shows the unedited lens without a steer."""
    monkeypatch.setenv("EXPLORER_CPU_GEMM", "torch")    # float32 products: exact ids
    view = LensView(tiny_model, prompt=PROMPT, k=3, steer_layer=1, alpha=2.0)
    view.wait()
    assert view.result.attrs["edits"]                    # the exact result is steered
    calls = []
    real = lp.steered_lens_preview
    monkeypatch.setattr("apps.lens.steered_lens_preview",
                        lambda *a, **k: calls.append(k["edits"]) or real(*a, **k))
    view.alpha_slider().value = 0.0
    pre = view.preview
    assert is_preview(pre) and len(calls) == 1 and calls[0][0].alpha == 0.0
    assert pre.attrs["edits"] == []
    exact = logit_lens(tiny_model, [PROMPT], k=3)
    np.testing.assert_array_equal(pre.top_token_id.values, exact.top_token_id.values)
    view.close()


def test_the_preview_runs_at_one_thread_and_restores_the_count(tiny_model, monkeypatch):
    clean = clean_run(tiny_model, [PROMPT])
    base = logit_lens(tiny_model, [PROMPT], k=3)
    edits = [Steer(1, _vector(tiny_model), 3.0)]
    cand = preview_vocabulary(tiny_model, results=[base], directions=[edits[0].vector])
    seen = record_threads(monkeypatch, lp, "_steered_forward")
    with torch_threads(2):
        lp.steered_lens_preview(tiny_model, PROMPT, k=3, edits=edits, clean=clean, base=base,
                                candidates=cand)
        assert seen and set(seen) == {lp.PREVIEW_THREADS}
        assert torch.get_num_threads() == 2
