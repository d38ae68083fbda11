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

- `gemm_backend` decides whether `unembed_product` runs on torch (``"torch"``) or numpy
  (``"numpy"``), by timing both at the product that will run: the real weight (its first
  `TIMED_COLUMNS` output rows: the per-column cost is the same, and timing SmolLM2's whole
  49,152-row unembedding eight times cost ~2 CPU s at 256 rows, several times the product
  it decides) and the row count rounded up to a power of two (`row_bucket`), once per
  process and shape; the decisions and both timings are in `gemm_decisions`.
  ``EXPLORER_CPU_GEMM=torch|numpy`` forces one.
- `unembed_product` is ``x @ weight.T (+ bias)`` in float32 through that backend, with
  numpy's BLAS limited to torch's thread count. It is plain ``F.linear`` whenever a
  gradient could flow (grad mode on and any operand requiring grad), off the CPU, or for
  other dtypes.
- `bfloat16_matmul_is_fast` tells whether a bfloat16 product is worth it on this CPU (by its
  flags where Linux lists them).

Both backends compute float32 products; results differ by float32 rounding only.
"""
from __future__ import annotations

import functools
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ._checks import InputError

__all__ = ["gemm_backend", "gemm_decisions", "unembed_product", "bfloat16_matmul_is_fast",
           "cpu_flags", "NATIVE_BFLOAT16_FLAGS",
           "row_bucket", "median_seconds", "GEMM_BACKENDS", "ROW_BUCKETS", "TIMED_COLUMNS"]

GEMM_BACKENDS = ("auto", "torch", "numpy")
_ENV = "EXPLORER_CPU_GEMM"
_SPEEDUP_TO_SWITCH = 1.2
"""numpy must be at least this much faster than torch to be used."""


ROW_BUCKETS = (16, 32, 64, 128, 256, 512, 1024)
"""Row counts a kernel decision is timed at (a product's rows rounded up; capped at 1024,
past which the per-row speed no longer changes)."""

TIMED_COLUMNS = 8192
"""How many of the weight's output rows a kernel decision times (its first ones; all of a
smaller weight): enough for the product's per-column speed, a sixth of SmolLM2's vocabulary."""

_DECISIONS_LOCK = threading.Lock()
_GEMM_DECISIONS: dict[tuple[int, int, int], dict[str, Any]] = {}


def row_bucket(rows: int) -> int:
    """``rows`` rounded up to the next of `ROW_BUCKETS` (the last one beyond it)."""
    return next((b for b in ROW_BUCKETS if b >= rows), ROW_BUCKETS[-1])


def median_seconds(fn: Callable[[], object], repeats: int = 5) -> float:
    """Median wall time of ``fn`` over ``repeats`` calls, after one untimed call."""
    return _median_s(fn, repeats)


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


def _gemm_decision(rows: int, weight: torch.Tensor) -> dict[str, Any]:
    """The backend for ``[rows x d] @ weight.T`` here, timed once per (row bucket, shape) on
    the weight's first `TIMED_COLUMNS` rows."""
    vocab, d = weight.shape
    key = (row_bucket(rows), int(d), int(vocab))
    with _DECISIONS_LOCK:
        entry = _GEMM_DECISIONS.get(key)
    if entry is not None:
        return entry
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(key[0], key[1], generator=gen)
    w = weight.detach()[:TIMED_COLUMNS]
    with torch.no_grad():
        t_torch = _median_s(lambda: F.linear(x, w), repeats=3)
        try:
            agrees = torch.allclose(_numpy_product(x, w, None), F.linear(x, w),
                                    rtol=1e-4, atol=1e-3)
        except (RuntimeError, ImportError):
            agrees = False
        t_numpy = _median_s(lambda: _numpy_product(x, w, None), repeats=3) if agrees \
            else math.inf
    entry = {"rows": key[0], "d_in": key[1], "d_out": key[2], "timed_d_out": int(w.shape[0]),
             "chosen": "numpy" if t_torch >= _SPEEDUP_TO_SWITCH * t_numpy else "torch",
             "torch_ms": round(t_torch * 1e3, 3),
             "numpy_ms": None if math.isinf(t_numpy) else round(t_numpy * 1e3, 3)}
    with _DECISIONS_LOCK:
        return _GEMM_DECISIONS.setdefault(key, entry)


def gemm_decisions() -> list[dict[str, Any]]:
    """Every backend decision `gemm_backend` made at a real shape in this process: the
    shape (rows bucket, d_in, d_out), the backend chosen and both timings (ms)."""
    with _DECISIONS_LOCK:
        return [dict(e) for e in _GEMM_DECISIONS.values()]


def gemm_backend(rows: int | None = None, weight: torch.Tensor | None = None) -> str:
    """``"numpy"`` or ``"torch"``: the float32 CPU GEMM that `unembed_product` uses.

    ``EXPLORER_CPU_GEMM`` (``auto``, ``torch`` or ``numpy``) chooses. ``auto`` (the
    default) with ``rows`` and ``weight`` [d_out, d_in] times both backends on that
    product (rows rounded up by `row_bucket`, the real weight), once per process and shape,
    and takes numpy only where it is at least 1.2x faster; without them, on a
    [64 x 576] x [576 x 8192] stand-in (what `explorer bench` reports as the machine's).
    """
    choice = os.environ.get(_ENV, "auto").strip().lower() or "auto"
    if choice not in GEMM_BACKENDS:
        raise InputError(f"`{_ENV}` must be one of {', '.join(GEMM_BACKENDS)}; got {choice!r}.")
    if choice != "auto":
        return choice
    if rows is None or weight is None:
        return _measured_backend()
    return _gemm_decision(rows, weight)["chosen"]


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
    rows = x.numel() // max(x.shape[-1], 1) if x.dim() else 0
    if rows and _fast_path_ok(x, weight, bias) and gemm_backend(rows, weight) == "numpy":
        return _numpy_product(x, weight.detach(), None if bias is None else bias.detach())
    return F.linear(x, weight, bias)


NATIVE_BFLOAT16_FLAGS = ("avx512_bf16", "amx_bf16")
"""x86 CPU flags (Linux ``/proc/cpuinfo``) of native bfloat16 arithmetic."""


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str] | None:
    """The CPU's feature flags as Linux lists them (None where that file is not there)."""
    return _read_flags(path)


def _read_flags(path: str) -> frozenset[str] | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("flags") and ":" in line:
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        return None
    return None


@functools.lru_cache(maxsize=1)
def bfloat16_matmul_is_fast() -> bool:
    """Whether a bfloat16 matmul beats float32 (`unembed_product`) here.

    Decided by the CPU family, not by a timing that noise could flip: on x86 Linux, True
    exactly where the CPU lists native bfloat16 arithmetic (`NATIVE_BFLOAT16_FLAGS`:
    AVX512-BF16 or AMX); on AVX2-only CPUs a bfloat16 product is emulated and several
    times slower than float32. Elsewhere (no ``/proc/cpuinfo``, other architectures) both
    products are timed once per process.
    """
    flags = cpu_flags()
    if flags is not None and ("avx2" in flags or "avx512f" in flags):
        return any(f in flags for f in NATIVE_BFLOAT16_FLAGS)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 576, generator=gen)
    w = torch.randn(4096, 576, generator=gen)
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    with torch.no_grad():
        t32 = _median_s(lambda: unembed_product(x, w))
        t16 = _median_s(lambda: xb @ wb.T)
    return t16 < t32
