"""CPU matrix kernels for the logit lens: the fastest float32 GEMM here for its
unembedding, and whether a bfloat16 screen pays.

The lens's unembedding is its largest product ([rows x d_model] x [d_model x vocab]:
49,152 columns on SmolLM2). torch runs it with the MKL bundled in its CPU wheel, which on
some CPUs is far below the hardware's speed: on the 2-core AMD EPYC (Zen 3, AVX2) machines
this project is tested on, SmolLM2's lens product of 448 rows runs at ~60 GFLOP/s with
torch and ~118 with numpy's OpenBLAS. The same CPUs have no native bfloat16 arithmetic, so
a bfloat16 product there is ~5x slower than float32, not faster.

The model's own forward is left on torch's kernels (so a run with and without gradients,
and every analysis's reference computation, round the same way); only the lens readouts,
which are computed outside the forward, take `unembed_product`.

- `gemm_backend` decides once per process, by timing both on one unembedding-like shape,
  whether `unembed_product` runs on torch (``"torch"``) or numpy (``"numpy"``);
  ``EXPLORER_CPU_GEMM=torch|numpy`` forces one.
- `unembed_product` is ``x @ weight.T (+ bias)`` in float32 through that backend, with
  numpy's BLAS limited to torch's thread count. It is plain ``F.linear`` whenever a
  gradient could flow (grad mode on and any operand requiring grad), off the CPU, or for
  other dtypes.
- `bfloat16_matmul_is_fast` tells whether a bfloat16 screen is worth it on this CPU.

Both backends compute float32 products; results differ by float32 rounding only.
"""
from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ._checks import InputError

__all__ = ["gemm_backend", "unembed_product", "bfloat16_matmul_is_fast", "GEMM_BACKENDS"]

GEMM_BACKENDS = ("auto", "torch", "numpy")
_ENV = "EXPLORER_CPU_GEMM"
_SPEEDUP_TO_SWITCH = 1.2
"""numpy must be at least this much faster than torch to be used."""


def _median_s(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[repeats // 2]


@functools.lru_cache(maxsize=1)
def _blas_controller():
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()


def _numpy_product(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).contiguous().numpy()           # [n, d]
    with _blas_controller().limit(limits=torch.get_num_threads(), user_api="blas"):
        out = torch.from_numpy(rows @ weight.numpy().T)               # [n, vocab]
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


@functools.lru_cache(maxsize=1)
def _measured_backend() -> str:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 576, generator=gen)       # 64 lens rows of a SmolLM2-sized model
    w = torch.randn(8192, 576, generator=gen)
    with torch.no_grad():
        try:
            ours = _numpy_product(x, w, None)
        except (RuntimeError, ImportError):
            return "torch"
        if not torch.allclose(ours, F.linear(x, w), rtol=1e-4, atol=1e-3):
            return "torch"
        t_torch = _median_s(lambda: F.linear(x, w))
        t_numpy = _median_s(lambda: _numpy_product(x, w, None))
    return "numpy" if t_torch >= _SPEEDUP_TO_SWITCH * t_numpy else "torch"


def gemm_backend() -> str:
    """``"numpy"`` or ``"torch"``: the float32 CPU GEMM that `unembed_product` uses.

    ``EXPLORER_CPU_GEMM`` (``auto``, ``torch`` or ``numpy``) chooses; ``auto`` (the
    default) times both once per process on a [64 x 576] x [576 x 8192] product and takes
    numpy only where it is at least 1.2x faster.
    """
    choice = os.environ.get(_ENV, "auto").strip().lower() or "auto"
    if choice not in GEMM_BACKENDS:
        raise InputError(f"`{_ENV}` must be one of {', '.join(GEMM_BACKENDS)}; got {choice!r}.")
    return _measured_backend() if choice == "auto" else choice


def _fast_path_ok(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    if x.device.type != "cpu" or weight.device.type != "cpu":
        return False
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.dim() < 1:
        return False
    if weight.dim() != 2 or (bias is not None and (bias.dtype != torch.float32
                                                   or bias.device.type != "cpu")):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (
            bias is not None and bias.requires_grad)):
        return False  # numpy has no backward
    return True


def unembed_product(x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through numpy's BLAS where `gemm_backend` chose it."""
    if _fast_path_ok(x, weight, bias) and gemm_backend() == "numpy":
        return _numpy_product(x, weight.detach(), None if bias is None else bias.detach())
    return F.linear(x, weight, bias)


@functools.lru_cache(maxsize=1)
def bfloat16_matmul_is_fast() -> bool:
    """Whether a bfloat16 matmul beats float32 (`unembed_product`) here, timed once per process.

    True on CPUs with native bfloat16 arithmetic (AVX512-BF16, AMX); on AVX2-only CPUs
    the bfloat16 product is emulated and several times slower than float32.
    """
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 576, generator=gen)
    w = torch.randn(4096, 576, generator=gen)
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    with torch.no_grad():
        t32 = _median_s(lambda: unembed_product(x, w))
        t16 = _median_s(lambda: xb @ wb.T)
    return t16 < t32
