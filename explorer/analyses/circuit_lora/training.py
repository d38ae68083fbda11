"""LoRA fine-tuning: `finetune_lora` (loss on the answer tokens only, optional warm-up and
linear decay by `lr_at`, adapter checkpoints as safetensors in a run folder; on a remote model
by hooked updates in jobs), and `select_lr`, which picks a learning rate from a sweep by
validation accuracy.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xarray as xr

from explorer._checks import InputError, check_choice, check_float, check_int
from explorer.analyses.circuit_lora.adapters import (
    CITATION,
    Progress,
    _check_ranks,
    lora_model,
    lora_weights_init,
)
from explorer.analyses.circuit_lora.answers import _answer_logits, _answer_positions, _base_hf, encode_answers
from explorer.analyses.circuit_lora.checkpoints import _RUN_FILE
from explorer.lora import LoRAWeights, train_in_jobs
from explorer.models import Model, cache_dir
from explorer.trace import provenance

__all__ = ["finetune_lora", "lr_at", "select_lr"]


def _run_folder(model: Model, tag: str) -> Path:
    return cache_dir() / "circuit_lora" / f"{model.spec.name.replace('/', '_')}-{tag}"


SCHEDULES = ("constant", "linear")


def lr_at(step: int, *, lr: float, steps: int, warmup: int = 0, schedule: str = "constant") -> float:
    """Learning rate of training step ``step`` (1-based) of ``steps``.

    ``lr * step / warmup`` while ``step <= warmup``; afterwards ``lr`` (``"constant"``) or
    ``lr * (steps - step + 1) / (steps - warmup)`` (``"linear"``: ``lr`` on the first step
    after the warm-up, down to ``lr / (steps - warmup)`` on the last).
    """
    check_choice("schedule", schedule, SCHEDULES)
    if warmup and step <= warmup:
        return lr * step / warmup
    if schedule == "constant":
        return lr
    return lr * max(0.0, (steps - step + 1) / max(1, steps - warmup))


def select_lr(lrs: Sequence[float], val_accuracy: Sequence[float],
              val_loss: Sequence[float]) -> float:
    """The learning rate with the highest validation accuracy; ties go to the lower
    validation loss, then to the smaller learning rate."""
    if not (len(lrs) == len(val_accuracy) == len(val_loss)) or not lrs:
        raise InputError(f"`lrs`, `val_accuracy` and `val_loss` must be non-empty and of one "
                         f"length; got {len(lrs)}, {len(val_accuracy)}, {len(val_loss)}.")
    best = min(range(len(lrs)), key=lambda i: (-float(val_accuracy[i]), float(val_loss[i]),
                                               float(lrs[i])))
    return float(lrs[best])


def finetune_lora(model: Model, prompts: Sequence[str], answers: Sequence[str], *,
                  ranks: Mapping[int, int] | Sequence[int], steps: int = 30, batch_size: int = 8,
                  lr: float = 1e-3, seed: int = 0, checkpoints: Sequence[int] = (),
                  folder: str | Path | None = None, warmup: int = 0,
                  schedule: str = "constant", progress: Progress = None
                  ) -> tuple[xr.Dataset, Any]:
    """Fine-tune LoRA adapters on (prompt, answer) pairs; save adapter checkpoints.

    A tuple: the training record (a Dataset) and the trained model are different kinds of value.

    Loss: cross-entropy of the answer tokens only (teacher forcing). AdamW; the learning
    rate of step k (1-based) is `lr_at` (``lr`` k / ``warmup`` during the warm-up, then
    ``lr`` for ``schedule="constant"`` or a linear decay towards 0 for ``"linear"``);
    each step takes ``batch_size`` problems drawn without replacement
    (reshuffled each epoch) from a ``seed``-ed generator. The adapter is saved as
    ``folder/step-{k}.safetensors`` (LoRA matrices only) at each step in ``checkpoints``
    (0 = before training); ``folder/run.json`` records the ranks and settings so that
    `load_checkpoint` can rebuild the model. Gradients are enabled inside this function
    only; the shared ``model`` is never modified (training runs on a copy).

    A remote model trains on the server, where its weights cannot be copied: the adapters
    are `explorer.lora.LoRAWeights` held in the job and added by forward hooks, started as
    peft starts them for the same seed. Each job runs up to `explorer.lora.STEPS_PER_JOB` steps (and
    ends at every checkpoint); the adapters and the optimiser state travel between jobs,
    the served weights are never written and get no gradients. The served model stays in
    its eval mode, so the base model's own dropout is off (it is zero for Llama models).

    Returns
    -------
    (xr.Dataset, peft model or LoRAWeights)
        ``loss``, ``lr`` (the learning rate the step used), ``step_seconds`` (wall) and
        ``step_cpu_seconds`` (this thread's CPU time, robust to a busy machine) over step;
        attrs ``folder``, ``checkpoints``,
        ``trainable_params``, ``ranks``. The trained peft model (a remote model: the trained
        `LoRAWeights`) is returned for evaluation (`answer_accuracy`'s ``hf``).
        On a remote model the timings are measured on the server.
    """
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    steps = check_int("steps", steps, low=1)
    batch_size = check_int("batch_size", batch_size, low=1)
    lr = check_float("lr", lr, low=0.0)
    warmup = check_int("warmup", warmup, low=0)
    check_choice("schedule", schedule, SCHEDULES)
    ranks = _check_ranks(model, ranks)
    ckpts = sorted({check_int("checkpoint", c, low=0, high=steps) for c in checkpoints})
    pairs = encode_answers(model, prompts, answers)
    if ckpts and folder is None:
        raise InputError("`folder` is required when `checkpoints` are saved.")
    folder = Path(folder) if folder is not None else None
    if model.remote:  # adapters held in the job, applied by hooks: the served weights are shared
        peft_model = None
        lora = lora_weights_init(model, ranks, seed=seed)
        n_trainable = lora.n_params()
    else:
        peft_model = lora_model(model, ranks, seed=seed)
        params = [p for p in peft_model.parameters() if p.requires_grad]
        n_trainable = int(sum(p.numel() for p in params))
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / _RUN_FILE).write_text(json.dumps({
            "model": model.spec.name, "weights": model.spec.weights,
            "ranks": {str(k): v for k, v in ranks.items()}, "steps": steps,
            "batch_size": batch_size, "lr": lr, "warmup": warmup, "schedule": schedule,
            "seed": seed, "checkpoints": ckpts,
            "trainable_params": n_trainable, "citation": CITATION}, indent=1))

    def save(step: int, state: Mapping[str, torch.Tensor]) -> None:
        save_file({k: v.detach().contiguous().clone() for k, v in state.items()},
                  str(folder / f"step-{step}.safetensors"))

    rates = [lr_at(k, lr=lr, steps=steps, warmup=warmup, schedule=schedule)
             for k in range(1, steps + 1)]
    draws = batch_draws(len(pairs), batch_size, steps, seed)
    if 0 in ckpts:
        save(0, lora.state_dict() if peft_model is None else get_peft_model_state_dict(peft_model))
    if peft_model is None:
        lora, losses, seconds, cpu = train_by_hooks(
            model, lora, pairs, draws, rates, ckpts,
            lambda step, w: save(step, w.state_dict()), progress)
        tuned: Any = lora
    else:
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        hf = _base_hf(peft_model)
        losses, seconds, cpu = [], [], []
        with torch.enable_grad():
            peft_model.train()
            for step in range(1, steps + 1):
                t0, c0 = time.perf_counter(), time.thread_time()
                for group in opt.param_groups:
                    group["lr"] = rates[step - 1]
                logits, targets, _ = _answer_logits(hf, model, [pairs[i] for i in draws[step - 1]])
                loss = torch.nn.functional.cross_entropy(logits.float(), targets)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(float(loss.detach()))
                seconds.append(time.perf_counter() - t0)
                cpu.append(time.thread_time() - c0)
                if step in ckpts:
                    save(step, get_peft_model_state_dict(peft_model))
                if progress is not None:
                    progress(step, steps)
        peft_model.eval()
        tuned = peft_model
    ds = xr.Dataset(
        {"loss": ("step", np.array(losses)), "lr": ("step", np.array(rates)),
         "step_seconds": ("step", np.array(seconds)),
         "step_cpu_seconds": ("step", np.array(cpu))},
        coords={"step": np.arange(1, steps + 1)},
        attrs={**provenance(model, method="finetune-lora", steps=steps, batch_size=batch_size,
                            lr=lr, warmup=warmup, schedule=schedule, seed=seed,
                            n_problems=len(pairs)),
               "folder": "" if folder is None else str(folder), "checkpoints": ckpts,
               "trainable_params": n_trainable,
               "ranks": {str(k): int(v) for k, v in ranks.items()}, "citation": CITATION})
    return ds, tuned


def batch_draws(n: int, batch_size: int, steps: int, seed: int) -> list[list[int]]:
    """The problems of each step: drawn without replacement, reshuffled each epoch."""
    rng = np.random.default_rng(seed)
    order: list[int] = []
    draws = []
    for _ in range(steps):
        if len(order) < batch_size:
            order += rng.permutation(n).tolist()
        draws.append(order[:batch_size])
        order = order[batch_size:]
    return draws


def train_by_hooks(model: Model, lora: LoRAWeights, pairs: Sequence[tuple[list[int], list[int]]],
                    draws: list[list[int]], rates: list[float], ckpts: Sequence[int],
                    save: Callable[[int, LoRAWeights], None], progress: Progress
                    ) -> tuple[LoRAWeights, list[float], list[float], list[float]]:
    """`finetune_lora`'s loop with hook-applied adapters (`explorer.lora.train_in_jobs`):
    the trained adapters and the per-step loss, wall and CPU seconds."""
    def plan(k: int) -> tuple:
        return (*_answer_positions(model, [pairs[i] for i in draws[k]]), rates[k])

    out = train_in_jobs(model, lora, plan, len(draws), checkpoints=ckpts, on_checkpoint=save,
                        progress=progress)
    return out.lora, out.loss, out.seconds, out.cpu
