"""CPU kernels: the unembedding GEMM backend and the lens screen choice (explorer._kernels)."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from explorer import _kernels, logit_lens
from explorer._checks import InputError
from explorer.lens import resolve_unembed_dtype


@pytest.fixture()
def backend(monkeypatch):
    def force(name):
        monkeypatch.setenv("EXPLORER_CPU_GEMM", name)
        assert _kernels.gemm_backend() == name
    return force


@pytest.mark.parametrize("name", ["torch", "numpy"])
@pytest.mark.parametrize("shape", [(7, 24), (2, 5, 24), (24,), (0, 24)])
def test_unembed_product_equals_float64_product(backend, name, shape):
    backend(name)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(*shape, generator=gen)
    w = torch.randn(40, 24, generator=gen)
    b = torch.randn(40, generator=gen)
    with torch.no_grad():
        got = _kernels.unembed_product(x, w, b)
    expect = x.double() @ w.double().T + b.double()                 # independent, float64
    assert got.shape == (*shape[:-1], 40) and got.dtype == torch.float32
    np.testing.assert_allclose(got.double().numpy(), expect.numpy(), rtol=1e-5, atol=1e-5)


def test_numpy_backend_keeps_gradients_flowing(backend):
    """numpy has no backward: with grad on, the product is torch's, and gradients match."""
    backend("numpy")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=gen, requires_grad=True)
    w = torch.randn(6, 8, generator=gen)
    x2 = x.detach().clone().requires_grad_(True)
    with torch.enable_grad():  # the test session runs without grad
        _kernels.unembed_product(x, w).square().sum().backward()
        F.linear(x2, w).square().sum().backward()
    assert torch.equal(x.grad, x2.grad)


def test_bad_backend_name_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("EXPLORER_CPU_GEMM", "blas9")
    with pytest.raises(InputError, match="EXPLORER_CPU_GEMM.*auto, torch, numpy.*'blas9'"):
        _kernels.gemm_backend()


def test_gemm_backend_is_timed_at_the_real_shape_and_follows_the_measurement(monkeypatch):
    monkeypatch.delenv("EXPLORER_CPU_GEMM", raising=False)
    monkeypatch.setattr(_kernels, "_GEMM_DECISIONS", {})
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 24, generator=gen)
    shapes = []
    real_numpy = _kernels._numpy_product

    def slow_numpy(x, weight, bias):                 # numpy made 20 ms slower
        shapes.append(tuple(x.shape))
        time.sleep(0.02)
        return real_numpy(x, weight, bias)

    monkeypatch.setattr(_kernels, "_numpy_product", slow_numpy)
    assert _kernels.gemm_backend(100, w) == "torch"
    (entry,) = _kernels.gemm_decisions()
    assert entry["rows"] == 128 and (entry["d_in"], entry["d_out"]) == (24, 300)
    assert entry["numpy_ms"] >= 20 and entry["chosen"] == "torch"
    assert set(shapes) == {(128, 24)}                # timed at the bucketed real shape
    n = len(shapes)
    assert _kernels.gemm_backend(120, w) == "torch" and len(shapes) == n   # decided once
    # torch made slower at another bucket: numpy is chosen there, and used
    real_f = _kernels.F

    class SlowTorch:
        @staticmethod
        def linear(*args, **kwargs):
            time.sleep(0.03)
            return real_f.linear(*args, **kwargs)

    monkeypatch.setattr(_kernels, "_numpy_product", real_numpy)
    monkeypatch.setattr(_kernels, "F", SlowTorch)
    assert _kernels.gemm_backend(5, w) == "numpy"
    assert [e["rows"] for e in _kernels.gemm_decisions()] == [128, 16]
    x = torch.randn(5, 24, generator=gen)
    expect = x.double() @ w.double().T
    np.testing.assert_allclose(_kernels.unembed_product(x, w).double(), expect, rtol=1e-5,
                               atol=1e-5)
    assert _kernels.row_bucket(1) == 16 and _kernels.row_bucket(256) == 256
    assert _kernels.row_bucket(257) == 512 and _kernels.row_bucket(10**6) == 1024


def test_gemm_decision_times_a_slice_of_a_wide_weight(monkeypatch):
    """A weight wider than TIMED_COLUMNS is timed on its first TIMED_COLUMNS rows (the real
    values, the real d_in); the decision is kept under the whole weight's shape."""
    monkeypatch.delenv("EXPLORER_CPU_GEMM", raising=False)
    monkeypatch.setattr(_kernels, "_GEMM_DECISIONS", {})
    monkeypatch.setattr(_kernels, "TIMED_COLUMNS", 64)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(1000, 8, generator=gen)
    seen = []
    real_numpy = _kernels._numpy_product

    def watched(x, weight, bias):
        seen.append(weight.clone())
        return real_numpy(x, weight, bias)

    monkeypatch.setattr(_kernels, "_numpy_product", watched)
    _kernels.gemm_backend(20, w)
    assert seen and all(torch.equal(t, w[:64]) for t in seen)
    (entry,) = _kernels.gemm_decisions()
    assert (entry["rows"], entry["d_in"], entry["d_out"]) == (32, 8, 1000)
    assert entry["timed_d_out"] == 64
    # the product itself runs on the whole weight, whichever backend was chosen
    x = torch.randn(20, 8, generator=gen)
    np.testing.assert_allclose(_kernels.unembed_product(x, w).double(),
                               x.double() @ w.double().T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("times, chosen", [
    ({"float32": 0.030, "bfloat16": 0.010}, "bfloat16"),
    ({"float32": 0.030, "bfloat16": 0.028}, "float32"),   # within 10 %: the exact lens
    ({"float32": 0.010, "bfloat16": 0.050}, "float32"),
])
def test_auto_screen_is_decided_on_the_model_at_the_row_count(tiny_model, monkeypatch,
                                                             times, chosen):
    from explorer import lens

    tiny_model.__dict__.pop("_screen_decisions", None)
    last = {}
    real_read = lens._read_rows

    def read(model, resid, **kw):
        last.update(mode=kw["unembed_dtype"], rows=resid.shape[0], model=model)
        return real_read(model, resid, **kw)

    def fake_median(fn, repeats=5):                  # a clock that reads the preset times
        fn()
        return times[last["mode"]]

    monkeypatch.setattr(lens, "_read_rows", read)
    monkeypatch.setattr(lens, "median_seconds", fake_median)
    try:
        assert resolve_unembed_dtype("auto", tiny_model, 40) == chosen
        assert last["rows"] == 64 and last["model"] is tiny_model
        assert lens.screen_decisions(tiny_model) == [
            {"rows": 64, "chosen": chosen, "float32_ms": times["float32"] * 1e3,
             "bfloat16_ms": times["bfloat16"] * 1e3}]
        # the lens itself resolves "auto" the same way, and computes what that mode computes
        auto = logit_lens(tiny_model, ["The quick brown fox"], k=3, unembed_dtype="auto",
                          chunk_rows=64)
        explicit = logit_lens(tiny_model, ["The quick brown fox"], k=3, unembed_dtype=chosen)
        assert auto.attrs["params"]["unembed_dtype"] == chosen
        for name in ("top_token_id", "top_prob", "final_rank", "final_prob"):
            assert np.array_equal(auto[name].values, explicit[name].values, equal_nan=True)
    finally:
        tiny_model.__dict__.pop("_screen_decisions", None)


def test_auto_without_a_model_uses_the_machine_stand_in():
    expect = "bfloat16" if _kernels.bfloat16_matmul_is_fast() else "float32"
    assert resolve_unembed_dtype("auto") == expect
    assert resolve_unembed_dtype("float32") == "float32"
    with pytest.raises(InputError, match="unembed_dtype"):
        resolve_unembed_dtype("int4")
