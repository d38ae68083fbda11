"""LoRA matrices held apart from the model, applied by removable forward hooks.

The local fine-tuning methods train `peft` adapters on a copy of the model. A remote (NDIF)
model cannot be copied, and its served weights are shared by every request, so there the
adapters live in the job instead: `LoRAWeights` holds each adapted linear map's A [r, d_in]
and B [d_out, r] and its scale, and `LoRAWeights.hooks` adds ``scale * B A x`` to each map's
output with a forward hook, the computation peft's LoRA layer does (dropout 0). The base
weights are never written; the hooks are removed when the job ends.

- `LoRAWeights.init` draws the starting matrices the way peft 0.21 does for the same seed
  (A Kaiming-uniform, B zero, with peft's random-number consumption), so a remote run
  starts where the local one does (tested against peft).
- `LoRAWeights.state_dict` / `from_state_dict` use peft's key layout, so a checkpoint saved
  by either path loads in the other.
- `LoRAWeights.delta` is the merged update ``scale * B A`` in the module's weight layout, for
  code that reads weights instead of calling the module (the circuit forward).
- `train_in_jobs` trains adapters where the weights are (`explorer.trace.run_on_weights`):
  on a remote model one job per `STEPS_PER_JOB` steps, the adapters and AdamW's state
  carried between jobs; gradients are taken with respect to the adapters only, so the
  served weights are neither written nor given a ``.grad``.
- `last_token_states` reads every layer's residual and the argmax token at the last
  position with adapters applied (what task decodability needs of a fine-tuned model).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from explorer._checks import InputError
from explorer.trace import run_on_weights

__all__ = [
    "PEFT_PREFIX",
    "STEPS_PER_JOB",
    "LoRAWeights",
    "TrainedLoRA",
    "WeightDeltas",
    "adamw",
    "adamw_step",
    "fast_unembed",
    "last_token_states",
    "logits_at",
    "module_at",
    "remove_hooks",
    "train_in_jobs",
]

#: Training steps per job (`train_in_jobs`); a job also ends at each checkpoint.
STEPS_PER_JOB = 10

#: peft's prefix of the adapted module names in `get_peft_model_state_dict`.
PEFT_PREFIX = "base_model.model."


def remove_hooks(handles: Sequence[Any]) -> None:
    """Remove the hooks whose handles are given."""
    for h in handles:
        h.remove()


def adamw(params: Sequence[torch.Tensor], lr: float, state: dict | None) -> torch.optim.AdamW:
    """AdamW (no weight decay) over held-apart tensors, resuming ``state`` (its
    ``state_dict()`` from the previous job) if given."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    if state is not None:
        opt.load_state_dict(state)
    return opt


def adamw_step(loss: torch.Tensor, params: Sequence[torch.Tensor], opt: torch.optim.AdamW,
               clip: float | None = None) -> None:
    """One optimiser step on ``params`` only: gradients by `torch.autograd.grad` with
    respect to them, so the (served, shared) weights are neither written nor given a
    ``.grad``; ``clip`` clips their total gradient norm first."""
    grads = torch.autograd.grad(loss, params)
    for prm, g in zip(params, grads):
        prm.grad = g
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(params, clip)
    opt.step()


def module_at(model: Any, name: str) -> Any:
    """The module (or, on the server, the envoy) ``name`` of ``model.hf``, a layer's sub-module.

    ``name`` is a full name such as ``"model.layers.3.self_attn.q_proj"``; the path is walked
    through `Model.hf_layer` and attributes, which works on a served envoy tree too.
    """
    prefix = model.arch.layers_path + "."
    if not name.startswith(prefix):
        raise InputError(f"LoRA module {name!r} is not inside a layer ({prefix}N...).")
    layer, _, sub = name[len(prefix):].partition(".")
    module = model.hf_layer(int(layer))
    for part in sub.split("."):
        module = getattr(module, part)
    return module


class LoRAWeights:
    """LoRA matrices per adapted module: A [r, d_in], B [d_out, r], scale ``alpha / r``.

    Parameters
    ----------
    A, B : dict of str -> Tensor
        Keyed by the module's full name in ``model.hf``.
    scaling : dict of str -> float
    transposed : bool
        The modules store their weight as [d_in, d_out] (GPT-2 ``Conv1D``); only `delta`
        depends on it.
    """

    def __init__(self, A: Mapping[str, torch.Tensor], B: Mapping[str, torch.Tensor],
                 scaling: Mapping[str, float], *, transposed: bool = False):
        if set(A) != set(B) or set(A) != set(scaling):
            raise InputError("LoRA A, B and scaling must name the same modules.")
        self.A = dict(A)
        self.B = dict(B)
        self.scaling = {k: float(v) for k, v in scaling.items()}
        self.transposed = bool(transposed)

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def init(cls, modules: Sequence[tuple[str, int, int, int, float]], *, seed: int = 0,
             transposed: bool = False) -> LoRAWeights:
        """Starting matrices for ``modules`` = [(name, d_in, d_out, rank, alpha), ...].

        ``modules`` must be in the model's module order (peft adapts them in that order).
        Draws as peft 0.21's default init does under ``torch.manual_seed(seed)``: each
        module's A and B are built as ``nn.Linear`` layers (each drawing its default init),
        then A is redrawn Kaiming-uniform (a = sqrt 5) and B set to zero.
        """
        A, B, scaling = {}, {}, {}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for name, d_in, d_out, r, alpha in modules:
                a = torch.nn.Linear(d_in, r, bias=False)
                torch.nn.Linear(r, d_out, bias=False)  # drawn and discarded: B starts at zero
                torch.nn.init.kaiming_uniform_(a.weight, a=math.sqrt(5))
                A[name] = a.weight.detach().clone()
                B[name] = torch.zeros(d_out, r)
                scaling[name] = alpha / r
        return cls(A, B, scaling, transposed=transposed)

    @classmethod
    def from_state_dict(cls, state: Mapping[str, torch.Tensor], scaling: Mapping[str, float], *,
                        transposed: bool = False) -> LoRAWeights:
        """From peft's layout (``base_model.model.{name}.lora_A.weight`` / ``lora_B``)."""
        A, B = {}, {}
        for key, value in state.items():
            name = key.removeprefix(PEFT_PREFIX)
            for part, into in ((".lora_A.weight", A), (".lora_B.weight", B)):
                if name.endswith(part):
                    into[name[:-len(part)]] = value
                    break
            else:
                raise InputError(f"{key!r} is not a LoRA A or B matrix.")
        missing = set(scaling) - set(A)
        unexpected = set(A) - set(scaling)
        if missing or unexpected or set(A) != set(B):
            raise InputError("the LoRA checkpoint does not match the run's layout: missing "
                             f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}.")
        return cls(A, B, {k: scaling[k] for k in A}, transposed=transposed)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """peft's layout: what `peft.get_peft_model_state_dict` returns for these adapters."""
        out = {}
        for name in self.A:
            out[f"{PEFT_PREFIX}{name}.lora_A.weight"] = self.A[name].detach().contiguous()
            out[f"{PEFT_PREFIX}{name}.lora_B.weight"] = self.B[name].detach().contiguous()
        return out

    # -- use ------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self.A)

    def n_params(self) -> int:
        return int(sum(self.A[n].numel() + self.B[n].numel() for n in self.A))

    def to(self, device: Any) -> LoRAWeights:
        return LoRAWeights({k: v.to(device) for k, v in self.A.items()},
                           {k: v.to(device) for k, v in self.B.items()}, self.scaling,
                           transposed=self.transposed)

    def trainable(self) -> LoRAWeights:
        """A copy whose A and B are fresh leaf tensors that require grad."""
        return LoRAWeights({k: v.detach().clone().requires_grad_(True) for k, v in self.A.items()},
                           {k: v.detach().clone().requires_grad_(True) for k, v in self.B.items()},
                           self.scaling, transposed=self.transposed)

    def parameters(self) -> list[torch.Tensor]:
        """A and B of every module, in module order (A, B, A, B, ...)."""
        out = []
        for name in self.A:
            out += [self.A[name], self.B[name]]
        return out

    def delta(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """The merged update ``scale * B A`` of module ``name`` in its weight layout, or None."""
        if name not in self.A:
            return None
        d = (self.B[name] @ self.A[name]) * self.scaling[name]  # [d_out, d_in]
        d = d.T if self.transposed else d
        return d if dtype is None else d.to(dtype)

    def hooks(self, model: Any, names: Sequence[str] | None = None) -> list[Any]:
        """Register the forward hooks that add each module's LoRA term; return their handles.

        The caller removes them (``handle.remove()``) in a ``finally``; if one cannot be
        registered, those already registered are removed before the error propagates (the
        served modules are shared). ``names`` limits the hooks to some modules (default: all).
        The term is computed in the adapters' dtype and the output keeps the module's, as in
        peft.
        """
        handles = []
        try:
            for name in (self.names() if names is None else names):
                if name not in self.A:
                    continue

                def add(_module, inputs, out, A=self.A[name], B=self.B[name],
                        s=self.scaling[name]):
                    x = inputs[0].to(A.dtype)
                    lora = torch.nn.functional.linear(torch.nn.functional.linear(x, A), B)
                    return (out + lora * s).to(out.dtype)

                handles.append(module_at(model, name).register_forward_hook(add))
        except BaseException:
            remove_hooks(handles)
            raise
        return handles


class WeightDeltas:
    """Full-rank additive updates of chosen linear maps' weights and biases, applied by hooks.

    What a remote model's unlearning trains in place of the weights themselves: each
    chosen ``nn.Linear`` (or GPT-2 ``Conv1D``) inside a layer gets ``out + x dW (+ db)``,
    so the model computes as if its weight were ``W + dW``. Keyed by parameter name
    (``"model.layers.3.mlp.down_proj.weight"``).
    """

    def __init__(self, deltas: Mapping[str, torch.Tensor], transposed: Sequence[str] = ()):
        self.deltas = dict(deltas)
        self.transposed = set(transposed)  # modules whose weight is [d_in, d_out] (Conv1D)

    @classmethod
    def zeros(cls, model: Any, names: Sequence[str]) -> WeightDeltas:
        """Zero updates for the parameters ``names`` of ``model`` (a local or remote one)."""
        from transformers.pytorch_utils import Conv1D

        deltas, transposed = {}, []
        for name in names:
            module_name, _, kind = name.rpartition(".")
            try:
                module = module_at(model, module_name)
            except (InputError, AttributeError, IndexError, ValueError):
                module = None
            if kind not in ("weight", "bias") or not isinstance(module, (torch.nn.Linear, Conv1D)):
                raise InputError(
                    f"{name!r} is not the weight or bias of a linear map inside a layer; "
                    "updates held apart from the weights (a remote model's training) cover "
                    "only those.")
            param = getattr(module, kind)
            deltas[name] = torch.zeros(tuple(param.shape), dtype=torch.float32)
            if isinstance(module, Conv1D):
                transposed.append(module_name)
        return cls(deltas, transposed)

    def n_params(self) -> int:
        return int(sum(d.numel() for d in self.deltas.values()))

    def names(self) -> list[str]:
        return list(self.deltas)

    def to(self, device: Any) -> WeightDeltas:
        return WeightDeltas({k: v.to(device) for k, v in self.deltas.items()}, self.transposed)

    def trainable(self) -> WeightDeltas:
        return WeightDeltas({k: v.detach().clone().requires_grad_(True)
                             for k, v in self.deltas.items()}, self.transposed)

    def parameters(self) -> list[torch.Tensor]:
        return list(self.deltas.values())

    def hooks(self, model: Any) -> list[Any]:
        """Register the forward hooks adding each module's update; return their handles
        (the caller removes them in a ``finally``)."""
        modules: dict[str, dict[str, torch.Tensor]] = {}
        for name, d in self.deltas.items():
            module_name, _, kind = name.rpartition(".")
            modules.setdefault(module_name, {})[kind] = d
        handles = []
        try:
            for module_name, parts in modules.items():
                dw, db = parts.get("weight"), parts.get("bias")

                def add(_module, inputs, out, dw=dw, db=db, t=module_name in self.transposed):
                    x = inputs[0].to(out.dtype)
                    extra = 0
                    if dw is not None:
                        extra = x @ dw.to(out.dtype) if t else torch.nn.functional.linear(
                            x, dw.to(out.dtype))
                    if db is not None:
                        extra = extra + db.to(out.dtype)
                    return out + extra

                handles.append(module_at(model, module_name).register_forward_hook(add))
        except BaseException:
            remove_hooks(handles)
            raise
        return handles


# -- running with adapters where the weights are -------------------------------------------

def fast_unembed(model: Any) -> bool:
    """Whether logits at a few positions can be had by unembedding those positions only
    (``hf.model`` + ``hf.lm_head``, no soft cap): most of a small model's cost is the full
    unembedding."""
    return model.arch.logit_softcap_attr is None and model.arch.layers_path == "model.layers"


def logits_at(hf: Any, fast: bool, batch: Any, rows: torch.Tensor, cols: torch.Tensor
              ) -> torch.Tensor:
    """Logits [n, vocab] at positions (rows, cols) of ``batch`` (local, or the server's tree)."""
    if fast:
        out = hf.model(**batch.model_inputs())
        return hf.lm_head(out.last_hidden_state[rows, cols])
    return hf(**batch.model_inputs()).logits[rows, cols]


@dataclass
class TrainedLoRA:
    """What `train_in_jobs` returns: the adapters and, per step, loss, wall and CPU seconds
    (measured where the steps ran)."""

    lora: LoRAWeights
    loss: list[float]
    seconds: list[float]
    cpu: list[float]


def train_in_jobs(model: Any, lora: LoRAWeights, plan: Callable[[int], tuple], steps: int, *,
                  checkpoints: Sequence[int] = (),
                  on_checkpoint: Callable[[int, LoRAWeights], None] | None = None,
                  progress: Callable[[int, int], Any] | None = None) -> TrainedLoRA:
    """AdamW on hook-applied adapters, the loss cross-entropy of chosen positions' logits.

    ``plan(k)`` gives step k's (0-based) inputs: (batch, rows, cols, targets, lr), the
    positions whose next-token logits are scored and their target tokens. The steps run in
    jobs where the weights are (`run_on_weights`): a remote model's on the server, up to
    `STEPS_PER_JOB` steps per job, a job ending at every step in ``checkpoints`` (which
    then calls ``on_checkpoint(step, adapters)``); ``progress(done, steps)`` after each job.
    """
    ends = sorted({*[c for c in checkpoints if 0 < c < steps], steps,
                   *range(STEPS_PER_JOB, steps, STEPS_PER_JOB)})
    fast = fast_unembed(model)
    opt_state = None
    out = TrainedLoRA(lora, [], [], [])
    done = 0
    for end in ends:
        chunk = [plan(k) for k in range(done, end)]
        with model.lock:  # a local model's hooks are on its shared modules for the job
            res = run_on_weights(model, _train_steps, out.lora, opt_state, chunk, fast)
        out.lora = LoRAWeights(res["A"], res["B"], lora.scaling, transposed=lora.transposed)
        opt_state = res["opt"]
        out.loss += res["loss"]
        out.seconds += res["seconds"]
        out.cpu += res["cpu"]
        done = end
        if end in checkpoints and on_checkpoint is not None:
            on_checkpoint(end, out.lora)
        if progress is not None:
            progress(end, steps)
    return out


def _train_steps(weights: Any, lora: LoRAWeights, opt_state: dict | None, plan: list,
                 fast: bool) -> dict[str, Any]:
    """Some AdamW steps of hook-applied adapters, where the weights are (one job)."""
    device = weights.hf.device
    lora = lora.to(device).trainable()
    params = lora.parameters()
    opt = adamw(params, 0.0, opt_state)  # each step sets its own rate
    losses, seconds, cpu = [], [], []
    handles = lora.hooks(weights)
    try:
        with torch.enable_grad():
            for batch, rows, cols, targets, rate in plan:
                t0, c0 = time.perf_counter(), time.thread_time()
                for group in opt.param_groups:
                    group["lr"] = rate
                logits = logits_at(weights.hf, fast, batch.to(device), rows.to(device),
                                   cols.to(device))
                loss = torch.nn.functional.cross_entropy(logits.float(), targets.to(device))
                adamw_step(loss, params, opt)
                losses.append(float(loss.detach()))
                seconds.append(time.perf_counter() - t0)
                cpu.append(time.thread_time() - c0)
    finally:
        remove_hooks(handles)
    return {"A": {k: v.detach() for k, v in lora.A.items()},
            "B": {k: v.detach() for k, v in lora.B.items()},
            "opt": opt.state_dict(), "loss": losses, "seconds": seconds, "cpu": cpu}


def last_token_states(model: Any, batches: Sequence[Any], lora: LoRAWeights | None
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per batch, every layer's output at the last position [prompt, layer, d_model] and the
    argmax next token there [prompt], with ``lora`` applied: one job where the weights are."""
    with model.lock:
        return run_on_weights(model, _last_token_states, list(batches), lora)


def _last_token_states(weights: Any, batches: list, lora: LoRAWeights | None
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    device = weights.hf.device
    kept: dict[int, torch.Tensor] = {}

    def keep(layer: int):
        def hook(_m, _inp, out):
            h = out[0] if isinstance(out, tuple) else out
            kept[layer] = h[:, -1].detach().float()
        return hook

    handles: list[Any] = []
    out = []
    try:
        if lora is not None:
            handles += lora.to(device).hooks(weights)
        for layer in range(weights.n_layers):
            handles.append(weights.hf_layer(layer).register_forward_hook(keep(layer)))
        with torch.no_grad():
            for batch in batches:
                kept.clear()
                logits = weights.hf(**batch.to(device).model_inputs()).logits[:, -1]
                resid = torch.stack([kept[layer] for layer in range(weights.n_layers)], 1)
                out.append((resid, logits.argmax(-1)))
    finally:
        remove_hooks(handles)
    return out
