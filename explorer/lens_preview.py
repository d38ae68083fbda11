"""A steering slider's preview lens: the layers an edit changes, read over candidate tokens.

While a steering slider moves, the logit lens page shows `steered_lens_preview` and the
exact `explorer.logit_lens` follows on release. What it costs and why:

- Layers before the edit are unchanged by it: their rows are copied from an exact lens of
  the same prompt (``base``, the page's last exact result), not recomputed.
- The layers from the edit on are re-run from the clean run's residual plus the steering
  (`steered_resid_post`), in plain torch without a trace: the norms and the activation as
  formulas (checked once against the model's own modules, whose calls go through the
  tracer's wrappers at ~2 ms each), and every product of the preview on one backend
  (`preview_backend`). With ``precision="auto"`` (the page's) that is bfloat16 where the
  CPU has native bfloat16 arithmetic (`explorer._kernels.bfloat16_matmul_is_fast`: decided
  by the CPU's flags, so it cannot flip between processes): the products read bfloat16
  copies of the weights, half the bytes of float32; the preview is memory-bound (a move
  streams every later layer's weights) and runs ~1.9x faster (SmolLM2, 32 tokens, from
  layer 10: 47 vs 88 ms at 1 thread, Xeon with AMX, 2026-12-04). The residual stream, norms,
  attention and softmax stay float32; each product's output carries bfloat16 rounding
  (relative ~4e-3). Elsewhere, or with ``precision="float32"``, the products are float32:
  torch's GEMM unless the whole preview (forward and readout, as it really runs) is at
  least `PREVIEW_MARGIN` times faster with numpy's in every one of `PREVIEW_ROUNDS` paired
  rounds (`choose_backend`, timed once per process, model, first edited layer and row
  bucket), and the values are the forward's up to float32 rounding. One backend, not one
  per shape: torch's OpenMP threads and numpy's OpenBLAS threads both spin after a call,
  and alternating the two on 2 cores ran the sequence ~10x slower than either alone. The
  preview runs at `PREVIEW_THREADS` torch thread (`preview_threads`): its products are
  small, and on a loaded 2-core machine two threads' barriers spin-waiting for each other
  made a move ~10x slower.
- Those layers are read at candidate tokens only (`explorer.lens.preview_vocabulary`: the
  exact result's top tokens and those the steering vector raises) plus `PREVIEW_SAMPLE`
  tokens drawn with a fixed seed that stand in for the rest of the normaliser: top-k are
  the best of the tokens read with exact logits and estimated probabilities. The final
  layer is read the same way (the preview skips the full 49,152-column unembedding).
- Ranks of the final tokens are not computed: ``final_rank`` / ``final_prob`` are -1 /
  NaN on the previewed layers. ``attrs["params"]["readout"]`` is ``"preview"``.

Only the model families whose blocks this forward implements (`preview_forward_reason`:
Llama-style pre-norm blocks with rotary attention and a gated MLP, e.g. SmolLM2, Llama,
Qwen2, Mistral) take this path; the page falls back to ``logit_lens(preview_vocab=...)``
elsewhere.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import xarray as xr

from ._checks import InputError
from ._kernels import _blas_controller, bfloat16_matmul_is_fast, row_bucket
from .interventions import Edit, Steer
from .lens import PREVIEW_SAMPLE, _preview_vocab, _token_strings
from .models import Model, _get_path
from .trace import CleanRun

__all__ = ["steered_lens_preview", "steered_resid_post", "preview_forward_reason",
           "forward_model_reason", "head_edited_forward", "ZEdit", "Gemm",
           "gemm_choices", "choose_backend", "decide_backend", "preview_backend", "preview_threads",
           "PRECISIONS",
           "PREVIEW_MARGIN", "PREVIEW_THREADS"]

PREVIEW_MARGIN = 1.5
"""numpy is taken for the preview only where the whole preview (forward and readout) runs at
least this many times faster on it than on torch, in every timed round."""
PREVIEW_ROUNDS = 3
"""Paired rounds (torch then numpy, numpy then torch, ...) timed to decide."""

PREVIEW_THREADS = 1
"""torch threads the preview runs at (its products are 32-row GEMMs of < 60 MFLOP each). At
2 threads every product ends in an OpenMP barrier whose threads spin-wait for each other;
on a loaded 2-core machine a thread is often descheduled and the other spins out its time
slice: SmolLM2's preview (32 tokens, from layer 10) took 4.6-5.7 s a move at 2 threads and
0.42-0.45 s at 1 thread at load 13 (2026-12-04, `benchmarks/slider_drag.py`)."""

_THREADS_LOCK = threading.Lock()
_CHOICES_LOCK = threading.Lock()
_CHOICES: dict[tuple, dict[str, Any]] = {}


class Gemm:
    """``x @ weight.T (+ bias)`` with float32 rows in and out, on a given backend:
    ``"torch"`` (float32 ``F.linear``), ``"numpy"`` (float32, numpy's BLAS) or
    ``"bfloat16"`` (``F.linear`` on bfloat16 copies of the rows and the weight, summed in
    float32 by the CPU's native bfloat16 kernels; the output rounded to bfloat16).

    Keeps the float32 weight [d_out, d_in]; the copies the other backends read (numpy's
    contiguous transpose [d_in, d_out], the bfloat16 weight) are made on first use.
    """

    BACKENDS = ("torch", "numpy", "bfloat16")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight.detach().float().contiguous()
        self.bias = None if bias is None else bias.detach().float()
        self._wt: np.ndarray | None = None
        self._wb: torch.Tensor | None = None

    @property
    def wt(self) -> np.ndarray:
        """The weight transposed, contiguous, as numpy [d_in, d_out] (numpy's BLAS is
        fastest on that layout)."""
        if self._wt is None:
            self._wt = np.ascontiguousarray(self.weight.numpy().T)
        return self._wt

    @property
    def wb(self) -> torch.Tensor:
        """The weight in bfloat16 [d_out, d_in]."""
        if self._wb is None:
            self._wb = self.weight.to(torch.bfloat16)
        return self._wb

    def __call__(self, x: torch.Tensor, backend: str = "torch") -> torch.Tensor:
        """x [rows, d_in] float32 -> [rows, d_out] float32."""
        if backend == "numpy":
            out = torch.from_numpy(x.contiguous().numpy() @ self.wt)
        elif backend == "bfloat16":
            out = F.linear(x.to(torch.bfloat16), self.wb).float()
        else:
            out = F.linear(x, self.weight)
        if self.bias is not None:
            out += self.bias
        return out


@contextlib.contextmanager
def preview_threads(n: int = PREVIEW_THREADS):
    """Run the body at at most ``n`` torch threads, then restore the count. torch's count is
    the process's: a job running meanwhile in another thread runs at ``n`` too (slower,
    never wrong); one body at a time changes it (the lens page's previews and its exact
    runs take turns), so a body must not enter it again."""
    with _THREADS_LOCK:
        before = torch.get_num_threads()
        if before > n:
            torch.set_num_threads(n)
        try:
            yield
        finally:
            if before > n:
                torch.set_num_threads(before)


def decide_backend(torch_s: Sequence[float], numpy_s: Sequence[float], *,
                   margin: float = PREVIEW_MARGIN) -> str:
    """``"numpy"`` only where numpy beat torch by ``margin`` in every paired round
    (``torch_s[i]`` and ``numpy_s[i]`` timed back to back), else ``"torch"``.

    torch is the default because the preview runs its norms, rotary and attention on torch
    between the products: numpy's products there alternate OpenBLAS's and OpenMP's spinning
    threads (`benchmarks/gemm_alternation.py`). Requiring the margin in every round, not in
    a median, keeps noise from flipping the choice: a round disturbed by another job can
    only keep torch.
    """
    if not torch_s or len(torch_s) != len(numpy_s):
        raise InputError("decide_backend needs as many numpy timings as torch timings, "
                         f"at least one; got {len(torch_s)} and {len(numpy_s)}.")
    return "numpy" if all(t >= margin * n for t, n in zip(torch_s, numpy_s)) else "torch"


def choose_backend(key: tuple, run: Callable[[str], object], *,
                   rounds: int = PREVIEW_ROUNDS,
                   clock: Callable[[], float] = time.perf_counter) -> str:
    """The backend the preview ``run(backend)`` runs on, for ``key`` (model, first edited
    layer, row bucket): decided once per process by timing the real preview on both
    (`decide_backend`) and kept; `gemm_choices` lists the decisions with their timings.

    ``EXPLORER_CPU_GEMM=torch|numpy`` forces one. Each backend runs once untimed, then in
    up to ``rounds`` paired rounds whose order alternates; the first round numpy does not
    win by the margin ends the timing (torch), so a slow numpy costs one round.
    """
    forced = os.environ.get("EXPLORER_CPU_GEMM", "auto").strip().lower() or "auto"
    if forced in ("torch", "numpy"):
        return forced
    with _CHOICES_LOCK:
        entry = _CHOICES.get(key)
    if entry is not None:
        return entry["chosen"]

    def timed(backend: str) -> float:
        t0 = clock()
        run(backend)
        return clock() - t0

    run("torch")
    run("numpy")
    t_torch: list[float] = []
    t_numpy: list[float] = []
    for i in range(rounds):
        if i % 2 == 0:
            t_torch.append(timed("torch"))
            t_numpy.append(timed("numpy"))
        else:
            t_numpy.append(timed("numpy"))
            t_torch.append(timed("torch"))
        if decide_backend(t_torch, t_numpy) == "torch":
            break
    entry = {"key": list(key), "chosen": decide_backend(t_torch, t_numpy),
             "rounds": len(t_torch), "margin": PREVIEW_MARGIN,
             "torch_ms": [round(t * 1e3, 3) for t in t_torch],
             "numpy_ms": [round(t * 1e3, 3) for t in t_numpy]}
    with _CHOICES_LOCK:
        entry = _CHOICES.setdefault(key, entry)
    return entry["chosen"]


def _blas_limit(backend: str) -> contextlib.AbstractContextManager:
    """numpy's BLAS held to torch's thread count while the numpy backend runs."""
    if backend != "numpy":
        return contextlib.nullcontext()
    return _blas_controller().limit(limits=torch.get_num_threads(), user_api="blas")


PRECISIONS = ("auto", "float32", "bfloat16")


def preview_backend(key: tuple, run: Callable[[str], object], precision: str = "auto") -> str:
    """The backend the preview ``run(backend)`` runs on: ``"bfloat16"`` for ``precision``
    "bfloat16", and for "auto" where the CPU has native bfloat16 arithmetic
    (`explorer._kernels.bfloat16_matmul_is_fast`); otherwise float32 on the backend
    `choose_backend` decides. ``EXPLORER_CPU_GEMM=torch|numpy`` forces a float32 one."""
    if precision not in PRECISIONS:
        raise InputError(f"`precision` must be one of {', '.join(map(repr, PRECISIONS))}; "
                         f"got {precision!r}.")
    forced = os.environ.get("EXPLORER_CPU_GEMM", "auto").strip().lower() or "auto"
    if precision == "bfloat16" or (precision == "auto" and forced not in ("torch", "numpy")
                                   and bfloat16_matmul_is_fast()):
        return "bfloat16"
    return choose_backend(key, run)


def gemm_choices() -> list[dict[str, Any]]:
    """The backend each preview sequence took in this process, with both timings (ms)."""
    with _CHOICES_LOCK:
        return [dict(e) for e in _CHOICES.values()]


# -- the forward from the edit on -----------------------------------------------------------

def preview_forward_reason(model: Model, edits: Sequence[Edit] = ()) -> str | None:
    """Why `steered_resid_post` cannot run ``edits`` on ``model`` (None: it can)."""
    reason = forward_model_reason(model)
    if reason is not None:
        return reason
    if not edits:
        return "no edit to preview"
    for e in edits:
        if not isinstance(e, Steer) or e.positions is not None or e.prompts is not None:
            return "the preview forward applies steer edits at every position only"
        if e.layer >= model.n_layers - 1:
            return "a steer at the last layer reads no residual the clean run keeps"
    return None


def forward_model_reason(model: Model) -> str | None:
    """Why the plain-torch forward (`steered_resid_post`, `head_edited_forward`) cannot run
    ``model``'s blocks (None: it can)."""
    if model.remote:
        return "a remote model runs its lens inside its trace"
    if model.spec.family != "llama" or model.arch.qkv_layout != "separate" \
            or model.arch.attn_out_norm_path or model.arch.mlp_out_norm_path \
            or model.arch.attn_softcap_attr or model.arch.rotary_path is None:
        return f"the preview forward implements Llama-style blocks; {model.spec.name} is not one"
    block = model.hf_layer(0)
    attn = _get_path(block, model.arch.attn_path)
    if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
        return f"{model.spec.name} normalises queries and keys"
    if any(not hasattr(block.mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return f"{model.spec.name}'s MLP is not gated"
    w = model.unembed_module.weight
    if w.device.type != "cpu" or w.dtype != torch.float32:
        return "the preview forward runs float32 weights on the CPU"
    return None


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: x / sqrt(mean(x^2) + eps) * weight (float32 rows)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class _Norm:
    """A model's RMSNorm as the formula (`_rms_norm`) where that is what the module computes
    (checked on a random input at build), else the module itself."""

    def __init__(self, module: torch.nn.Module, d_model: int):
        self.module = module
        weight = getattr(module, "weight", None)
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        self.weight = None if weight is None or eps is None else weight.detach().float()
        self.eps = None if eps is None else float(eps)
        if self.weight is not None:
            x = torch.randn(3, d_model, generator=torch.Generator().manual_seed(1))
            with torch.no_grad():
                if not torch.allclose(module(x).float(), _rms_norm(x, self.weight, self.eps),
                                      rtol=1e-5, atol=1e-6):
                    self.weight = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            return self.module(x).float()
        return _rms_norm(x, self.weight, self.eps)


def _activation(act: torch.nn.Module, width: int) -> Any:
    """``F.silu`` where ``act`` computes it (checked on a random input), else ``act``."""
    x = torch.randn(3, width, generator=torch.Generator().manual_seed(2)) * 4
    with torch.no_grad():
        return F.silu if torch.allclose(act(x), F.silu(x), rtol=1e-6, atol=1e-7) else act


class _Blocks:
    """Per layer: the norms and activation (`_Norm`, `_activation`) and the products as
    `Gemm`s; the rotary tables of the last positions read."""

    def __init__(self, model: Model):
        arch, cfg = model.arch, model.hf.config
        d = model.spec.d_model
        self.norm_attn, self.norm_mlp, self.qkv, self.o, self.gate_up, self.down = \
            [], [], [], [], [], []
        self.act, self.scaling, self.windows = [], [], []
        for layer in range(model.n_layers):
            block = model.hf_layer(layer)
            attn = _get_path(block, arch.attn_path)
            q, k, v = (_get_path(block, p) for p in arch.qkv_paths)
            self.norm_attn.append(_Norm(_get_path(block, arch.attn_norm_path), d))
            self.norm_mlp.append(_Norm(_get_path(block, arch.mlp_norm_path), d))
            bias = None if q.bias is None else torch.cat([q.bias, k.bias, v.bias])
            self.qkv.append(Gemm(torch.cat([q.weight, k.weight, v.weight]), bias))
            o = _get_path(block, arch.o_proj_path)
            self.o.append(Gemm(o.weight, o.bias))
            mlp = block.mlp
            gb = None if mlp.gate_proj.bias is None else torch.cat([mlp.gate_proj.bias,
                                                                    mlp.up_proj.bias])
            self.gate_up.append(Gemm(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), gb))
            self.down.append(Gemm(mlp.down_proj.weight, mlp.down_proj.bias))
            self.act.append(_activation(mlp.act_fn, mlp.down_proj.weight.shape[1]))
            self.scaling.append(float(attn.scaling))
            window = getattr(attn, "sliding_window", None)
            if window is None and getattr(cfg, "use_sliding_window", True):
                window = getattr(cfg, "sliding_window", None)
            self.windows.append(int(window) if window else None)
        self.final_norm = _Norm(model.final_norm_module, d)
        self.rotary = _get_path(model.hf, arch.rotary_path)
        self._rotary_cache: tuple[bytes, torch.Tensor, torch.Tensor] | None = None
        self.name = model.spec.name
        self.params = list(model.hf.parameters())
        self.key = self.version()

    def version(self) -> list[tuple[int, int]]:
        """Where each weight lives and its in-place version: changes after a weight edit."""
        return [(p.data_ptr(), p._version) for p in self.params]

    def products(self, start: int) -> list[Gemm]:
        """The products of the layers after ``start``, in the order the forward runs them."""
        return [g for layer in range(start + 1, len(self.qkv))
                for g in (self.qkv[layer], self.o[layer], self.gate_up[layer], self.down[layer])]

    def rotary_tables(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """cos, sin [1, pos, d_head] for ``positions`` (kept for the last positions read:
        every move of a drag reads the same)."""
        key = positions.numpy().tobytes()
        if self._rotary_cache is None or self._rotary_cache[0] != key:
            cos, sin = self.rotary(x[None], positions)
            self._rotary_cache = (key, cos[0, None].float(), sin[0, None].float())
        return self._rotary_cache[1], self._rotary_cache[2]


def _blocks(model: Model) -> _Blocks:
    """The model's `_Blocks`, built once per model (again after an in-place weight edit)."""
    cached = model.__dict__.get("_preview_blocks")
    if cached is None or cached.key != cached.version():
        cached = model.__dict__["_preview_blocks"] = _Blocks(model)
    return cached


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def steered_resid_post(model: Model, clean: CleanRun, edits: Sequence[Edit], *,
                       backend: str = "torch") -> torch.Tensor:
    """resid_post of every layer from the first edit on, for one prompt: [layer, pos, d_model].

    Starts from the clean run's residual after the first edited layer (``clean.resid_pre``)
    plus its steering, and runs the later blocks in plain torch (`Gemm` products on one
    ``backend``; the norms and activation as checked formulas; the model's
    rotary embedding). Row ``i`` is layer
    ``first_edit + i``. Raises InputError where `preview_forward_reason` gives a reason.
    """
    if backend not in Gemm.BACKENDS:
        raise InputError(f"`backend` must be one of {', '.join(map(repr, Gemm.BACKENDS))}; "
                         f"got {backend!r}.")
    return _steered_forward(model, clean, edits, backend)[0]


def _check_forward(model: Model, clean: CleanRun, edits: Sequence[Edit]) -> None:
    reason = preview_forward_reason(model, edits)
    if reason is not None:
        raise InputError(f"no preview forward here: {reason}.")
    if len(clean.batch.lengths) != 1:
        raise InputError("the preview forward reads one prompt; "
                         f"got a clean run of {len(clean.batch.lengths)}.")


def _steered_forward(model: Model, clean: CleanRun, edits: Sequence[Edit], backend: str
                     ) -> tuple[torch.Tensor, _Blocks]:
    """`steered_resid_post` on ``backend``, with the model's `_Blocks`."""
    _check_forward(model, clean, edits)
    b = _blocks(model)
    steer: dict[int, torch.Tensor] = {}
    for e in edits:
        v = torch.as_tensor(np.asarray(e.vector, dtype=np.float32)) * float(e.alpha)
        steer[e.layer] = steer[e.layer] + v if e.layer in steer else v
    start = min(steer)
    x = clean.resid_pre[start + 1][0].float() + steer[start]                 # [pos, d_model]
    outs = [x]
    _run_layers(model, b, clean, x, start + 1, backend, steer=steer, outs=outs)
    return torch.stack(outs), b                                             # [layer, pos, d]


ZEdit = Callable[[int, torch.Tensor], torch.Tensor]
"""``z_edit(layer, z)``: the head outputs z [pos, n_heads * d_head] (before ``o_proj``) that
layer ``layer`` goes on with, given the ones it computed."""


def _run_layers(model: Model, b: _Blocks, clean: CleanRun, x: torch.Tensor, first: int,
                backend: str, *, steer: dict[int, torch.Tensor] | None = None,
                z_edit: ZEdit | None = None, outs: list[torch.Tensor] | None = None
                ) -> torch.Tensor:
    """Layers ``first`` .. last on the residual ``x`` [pos, d_model] (one prompt, the last
    ``pos`` positions of ``clean``'s batch): ``steer[layer]`` added after a layer,
    ``z_edit`` applied to each layer's head outputs; each layer's output appended to
    ``outs``. Returns the last layer's output."""
    spec = model.spec
    H, G, dh = spec.n_heads, spec.n_kv_heads, spec.d_head
    steer = steer or {}
    p = x.shape[0]
    positions = clean.batch.position_ids[:, -p:]
    with torch.no_grad(), _blas_limit(backend):
        cos, sin = b.rotary_tables(x, positions)                            # [1, pos, d_head]
        masks: dict[int | None, torch.Tensor | None] = {None: None}
        for layer in range(first, spec.n_layers):
            window = b.windows[layer] if b.windows[layer] and b.windows[layer] < p else None
            if window not in masks:
                i = torch.arange(p)
                masks[window] = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)
            qkv = b.qkv[layer](b.norm_attn[layer](x), backend)        # [pos, (H+2G)*dh]
            q = qkv[:, :H * dh].view(p, H, dh).transpose(0, 1)              # [head, pos, dh]
            k = qkv[:, H * dh:(H + G) * dh].view(p, G, dh).transpose(0, 1)  # [kv, pos, dh]
            v = qkv[:, (H + G) * dh:].view(p, G, dh).transpose(0, 1)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            if G != H:
                k = k.repeat_interleave(H // G, dim=0)
                v = v.repeat_interleave(H // G, dim=0)
            mask = masks[window]
            z = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                               scale=b.scaling[layer])       # [head, pos, dh]
            z = z.transpose(0, 1).reshape(p, H * dh)
            if z_edit is not None:
                z = z_edit(layer, z)
            x = x + b.o[layer](z, backend)
            gu = b.gate_up[layer](b.norm_mlp[layer](x), backend)       # [pos, 2*d_mlp]
            gate, up = gu.chunk(2, dim=-1)
            x = x + b.down[layer](b.act[layer](gate) * up, backend)
            if layer in steer:
                x = x + steer[layer]
            if outs is not None:
                outs.append(x)
    return x


def head_edited_forward(model: Model, clean: CleanRun, start: int, z_edit: ZEdit, *,
                        backend: str = "torch", final_norm: bool = False) -> torch.Tensor:
    """The residual after the last layer [pos, d_model] of one prompt, re-run in plain torch
    (the blocks of `steered_resid_post`, one ``backend`` for the products) from the clean
    run's residual before layer ``start`` (``clean.resid_pre[start]``), with ``z_edit``
    (`ZEdit`) applied to the head outputs of every layer from ``start`` on; with
    ``final_norm``, through the model's final norm (what the unembedding reads). Raises
    InputError where `forward_model_reason` gives a reason or ``clean`` holds several
    prompts."""
    reason = forward_model_reason(model)
    if reason is not None:
        raise InputError(f"no preview forward here: {reason}.")
    if backend not in Gemm.BACKENDS:
        raise InputError(f"`backend` must be one of {', '.join(map(repr, Gemm.BACKENDS))}; "
                         f"got {backend!r}.")
    if len(clean.batch.lengths) != 1:
        raise InputError("the preview forward reads one prompt; "
                         f"got a clean run of {len(clean.batch.lengths)}.")
    start = model.check_layer(start, "start")
    x = clean.resid_pre[start][0].float()
    x = x[-int(clean.batch.lengths[0]):]                                     # the real tokens
    b = _blocks(model)
    x = _run_layers(model, b, clean, x, start, backend, z_edit=z_edit)
    if final_norm:
        with torch.no_grad():
            x = b.final_norm(x)
    return x


# -- the preview lens ----------------------------------------------------------------------

_VOCAB_CACHE: dict[str, Any] = {}


def _columns(model: Model, candidates: np.ndarray) -> tuple[Any, Gemm]:
    """The preview's columns (`explorer.lens._preview_vocab`) and their product, kept for
    the last candidate set (a drag reads the same candidates move after move)."""
    key = (id(model), candidates.tobytes())
    hit = _VOCAB_CACHE.get("key")
    if hit is not None and hit == key:
        return _VOCAB_CACHE["pv"], _VOCAB_CACHE["gemm"]
    pv = _preview_vocab(model, torch.as_tensor(candidates), PREVIEW_SAMPLE)
    bias = getattr(model.unembed_module, "bias", None)
    gemm = Gemm(pv.w, None if bias is None else bias.detach().float()[pv.ids])
    _VOCAB_CACHE.update(key=key, pv=pv, gemm=gemm)
    return pv, gemm


def compatible_base(base: xr.Dataset | None, prompt: str, k: int, first_edit: int) -> bool:
    """Whether ``base`` (an exact lens) holds this prompt's unedited rows below ``first_edit``:
    the same prompt and k, every layer read, its own edits (if any) at ``first_edit`` or later."""
    if base is None or base.attrs.get("params", {}).get("readout") != "local":
        return False
    params = base.attrs["params"]
    edits = base.attrs.get("edits", [])
    return (params.get("prompts") == [prompt] and base.sizes["rank"] == k
            and params.get("positions") is None
            and base.sizes["layer"] == params.get("n_layers")
            and all(e["layer"] >= first_edit for e in edits))


def steered_lens_preview(model: Model, prompt: str, *, k: int, edits: Sequence[Steer],
                         clean: CleanRun, base: xr.Dataset, candidates: Any,
                         precision: str = "auto") -> xr.Dataset:
    """The logit lens of ``prompt`` under steering ``edits``, previewed (see the module doc).

    ``base``: an exact `explorer.logit_lens` of the same prompt and k whose layers before
    the first edit are unedited (`compatible_base`); its rows there are copied.
    ``candidates``: token ids read exactly (`explorer.lens.preview_vocabulary`).
    ``precision``: the products' (`preview_backend`): "auto" (bfloat16 where the CPU has
    native bfloat16 arithmetic, else float32), "float32" or "bfloat16". Returns a Dataset
    shaped as ``base`` with ``attrs["params"]["readout"] == "preview"``,
    ``attrs["params"]["preview_dtype"]`` the products' dtype and ``["preview_backend"]``
    their backend (`Gemm.BACKENDS`).
    """
    edits = list(edits)
    first = min(e.layer for e in edits) if edits else model.n_layers
    if not compatible_base(base, prompt, k, first):
        raise InputError("`base` must be an exact lens of the same prompt and k whose edits "
                         f"start at layer {first} or later.")
    _check_forward(model, clean, edits)
    b = _blocks(model)
    cand = np.asarray(candidates, dtype=np.int64).reshape(-1)
    base_final = np.asarray(base.final_token_id.values[0]).reshape(-1)
    pv, gemm = _columns(model, np.unique(np.concatenate([cand, base_final[base_final >= 0]])))
    cap_attr = model.arch.logit_softcap_attr
    cap = getattr(model.hf.config, cap_attr, None) if cap_attr else None

    def run(backend: str) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        resid, _ = _steered_forward(model, clean, edits, backend)          # [G, pos, d]
        n_l, p, d = resid.shape
        with torch.no_grad(), _blas_limit(backend):
            h = b.final_norm(resid.reshape(-1, d))                         # [G*pos, d]
            logits = gemm(h, backend)                                      # [G*pos, c + s]
            if cap:
                logits = torch.tanh(logits / cap) * cap
            top_logit, top_col = logits.topk(min(k, logits.shape[-1]), dim=-1)  # [G*pos, k]
            m = top_logit[:, :1]
            lse = m + ((logits - m).exp_() * pv.weight).sum(-1, keepdim=True).log()
            return (top_logit - lse).exp(), top_col, n_l, p

    rows = clean.resid_pre[first + 1][0].shape[0]                           # positions
    with preview_threads():
        backend = preview_backend((b.name, first, row_bucket(rows)), run, precision)
        top_prob, top_col, n_l, p = run(backend)
    # [G*pos, k] layer-major -> [pos, G, k]
    ids = pv.ids[top_col].reshape(n_l, p, -1).transpose(0, 1).numpy()
    probs = top_prob.reshape(n_l, p, -1).transpose(0, 1).numpy()
    real = base["mask"].values[0]
    cols = np.nonzero(real)[0]
    if len(cols) != p:
        raise InputError("`base` holds another number of tokens than the clean run.")
    out = base.copy(deep=False)
    top_id = base.top_token_id.values.copy()
    top_p = base.top_prob.values.copy()
    f_rank = base.final_rank.values.copy()
    f_prob = base.final_prob.values.copy()
    at = slice(first, model.n_layers)
    top_id[0, cols, at] = ids
    top_p[0, cols, at] = probs
    f_rank[0, :, at] = -1            # not computed in a preview
    f_prob[0, :, at] = np.nan
    final = np.full(base.final_token_id.shape, -1, dtype=np.int64)
    final[0, cols] = ids[:, -1]      # the previewed final layer's top-k
    out["top_token_id"] = (base.top_token_id.dims, top_id)
    out["top_prob"] = (base.top_prob.dims, top_p)
    out["final_rank"] = (base.final_rank.dims, f_rank)
    out["final_prob"] = (base.final_prob.dims, f_prob)
    out = out.assign_coords(
        top_token=(base.top_token.dims, _token_strings(model, top_id)),
        final_token_id=(base.final_token_id.dims, final),
        final_token=(base.final_token_id.dims, _token_strings(model, final)))
    attrs = dict(base.attrs)
    attrs["params"] = {**base.attrs["params"], "readout": "preview",
                       "preview_columns": int(len(pv.ids)), "preview_from_layer": int(first),
                       "unembed_dtype": "float32",
                       "preview_dtype": "bfloat16" if backend == "bfloat16" else "float32",
                       "preview_backend": backend}
    attrs["edits"] = [_edit_record(e) for e in edits]
    out.attrs = attrs
    return out


_RECORDS: dict[int, tuple[tuple, dict]] = {}


def _edit_record(e: Steer) -> dict[str, Any]:
    """``e.to_dict()``, copied once per vector (a drag changes only alpha; a full copy of
    the vector's record costs ~8 ms a move)."""
    key = hash(e.vector)
    hit = _RECORDS.get(key)
    if hit is None or hit[0] != e.vector:
        _RECORDS.clear()
        hit = _RECORDS[key] = (e.vector, e.to_dict())
    return {**hit[1], "alpha": e.alpha, "layer": e.layer}
