"""CPU kernels: the unembedding GEMM backend and the lens screen choice (explorer._kernels)."""
from __future__ import annotations

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


def test_auto_screen_resolves_by_the_measured_speed(tiny_model):
    expect = "bfloat16" if _kernels.bfloat16_matmul_is_fast() else "float32"
    assert resolve_unembed_dtype("auto") == expect
    auto = logit_lens(tiny_model, ["The quick brown fox"], k=3, unembed_dtype="auto")
    explicit = logit_lens(tiny_model, ["The quick brown fox"], k=3, unembed_dtype=expect)
    assert auto.attrs["params"]["unembed_dtype"] == expect
    for name in ("top_token_id", "top_prob", "final_rank", "final_prob"):
        assert np.array_equal(auto[name].values, explicit[name].values, equal_nan=True), name
    with pytest.raises(InputError, match="unembed_dtype"):
        resolve_unembed_dtype("int4")
