"""Fine-tuning circuits and CircuitLoRA: how circuits change under LoRA, and ranks by that change.

Wang, Hu, Du, Cheng, Wang & Zou, "Towards Understanding Fine-Tuning Mechanisms of LLMs via
Circuit Analysis" (CircuitLoRA, ICML 2025). A model is fine-tuned with LoRA on an arithmetic
task and the adapter is saved at checkpoints (safetensors); the circuit of each checkpoint
comes from `explorer.analyses.circuits` (EAP / EAP-IG edge scores, top-n edges). Node sets
stay similar across fine-tuning while edge sets change more (`circuit_similarity`). The
per-layer edge change (`layer_edge_change`) picks critical layers, which CircuitLoRA gives a
higher LoRA rank than the rest at the same trainable-parameter count as uniform LoRA
(`allocate_lora_ranks`, `circuit_lora_comparison`).

- `lora_modules`, `lora_parameter_count`, `allocate_lora_ranks`: which linear modules get
  LoRA and how many trainable parameters a per-layer rank assignment costs.
- `finetune_lora`: LoRA training on (prompt, answer) pairs, loss on the answer tokens only,
  optional warm-up and linear decay (`lr_at`), adapter checkpoints as safetensors;
  `load_checkpoint` merges one into a copy of the model. `select_lr` picks a learning rate
  from a sweep by validation accuracy.
- `answer_accuracy`: exact-match accuracy of the greedy answer, answer-token accuracy, loss.
- `checkpoint_circuits`, `jaccard`, `circuit_similarity`: circuits per checkpoint and their
  node / edge Jaccard similarity.
- `layer_edge_change`, `critical_layers`, `circuit_lora_comparison`.
"""
from __future__ import annotations

import copy
import hashlib
import json
import re
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xarray as xr

from explorer._checks import InputError, check_choice, check_float, check_int, check_local_weights
from explorer.lora import LoRAWeights, fast_unembed, logits_at, remove_hooks, train_in_jobs
from explorer.models import Model, cache_dir, wrap_model
from explorer.trace import provenance, run_on_weights

__all__ = [
    "CITATION",
    "METHODS",
    "lora_modules",
    "lora_parameter_count",
    "allocate_lora_ranks",
    "uniform_lora_ranks",
    "lora_model",
    "lora_weights_init",
    "finetune_lora",
    "lr_at",
    "select_lr",
    "checkpoint_steps",
    "load_checkpoint",
    "read_checkpoint",
    "answer_accuracy",
    "checkpoint_circuits",
    "layer_change_noise_floor",
    "CHECKPOINT_METHOD",
    "CHECKPOINT_METRIC",
    "jaccard",
    "circuit_similarity",
    "node_layer",
    "layer_edge_change",
    "critical_layers",
    "circuit_lora_comparison",
    "comparison_summary",
    "run_summary",
    "save_netcdf",
]

CITATION = ("Wang, Hu, Du, Cheng, Wang & Zou, Towards Understanding Fine-Tuning Mechanisms "
            "of LLMs via Circuit Analysis (CircuitLoRA), ICML 2025")
METHODS = ("lora", "circuit-lora")
_RUN_FILE = "run.json"
_ALPHA_PER_RANK = 2.0  # lora_alpha = 2 r: the same scale alpha / r for every rank

Progress = Callable[[int, int], None] | None


# -- LoRA modules, parameter counts, rank allocation -----------------------------------------

def lora_modules(model: Model) -> dict[int, list[tuple[str, int, int]]]:
    """The linear modules LoRA adapts in each layer: ``{layer: [(name, d_in, d_out), ...]}``.

    Every ``nn.Linear`` (and GPT-2 ``Conv1D``) inside a decoder layer: the attention
    projections and the MLP, as in the paper (qkv, attention output, both MLP matrices).
    ``name`` is the module's full name in ``model.hf``.
    """
    from transformers.pytorch_utils import Conv1D

    layers_path = model.arch.layers_path
    out: dict[int, list[tuple[str, int, int]]] = {}
    for layer in range(model.n_layers):
        mods = []
        for sub, mod in model.hf_layer(layer).named_modules():
            if isinstance(mod, torch.nn.Linear):
                mods.append((f"{layers_path}.{layer}.{sub}", mod.in_features, mod.out_features))
            elif isinstance(mod, Conv1D):  # weight [d_in, d_out]
                mods.append((f"{layers_path}.{layer}.{sub}", int(mod.weight.shape[0]),
                             int(mod.weight.shape[1])))
        out[layer] = mods
    return out


def _check_ranks(model: Model, ranks: Mapping[int, int] | Sequence[int]) -> dict[int, int]:
    if not isinstance(ranks, Mapping):
        ranks = dict(enumerate(ranks))
    out = {}
    for layer, r in ranks.items():
        layer = model.check_layer(layer, "ranks layer")
        out[layer] = check_int(f"ranks[{layer}]", r, low=0)
    if not any(out.values()):
        raise InputError("`ranks` must give at least one layer a rank >= 1; got all zeros.")
    return out


def lora_parameter_count(model: Model, ranks: Mapping[int, int] | Sequence[int]) -> int:
    """Trainable LoRA parameters of a per-layer rank assignment: sum of r (d_in + d_out)."""
    ranks = _check_ranks(model, ranks)
    mods = lora_modules(model)
    return int(sum(r * sum(i + o for _, i, o in mods[layer]) for layer, r in ranks.items()))


def uniform_lora_ranks(model: Model, rank: int) -> dict[int, int]:
    """The same rank on every layer (plain LoRA)."""
    check_int("rank", rank, low=1)
    return {layer: rank for layer in range(model.n_layers)}


def allocate_lora_ranks(model: Model, n_params: int, critical: Sequence[int], *,
                        r_other: int = 2) -> xr.Dataset:
    """CircuitLoRA ranks: ``r_other`` outside the critical layers, the rest of a parameter
    budget spread over the critical layers, so the total hits ``n_params`` as closely as
    integer ranks allow (exactly when the budget is a whole number of rank units).

    The critical layers share the remaining budget as evenly as possible: all get the
    largest rank r_c that fits, then the layers in ``critical`` order get one more while
    the budget lasts. The achieved count never exceeds ``n_params``.

    Returns
    -------
    xr.Dataset
        ``rank`` (layer) and ``critical`` (layer, bool); attrs ``n_params_requested``,
        ``n_params`` (achieved), ``n_params_gap`` (requested - achieved), ``r_other``.
    """
    check_int("n_params", n_params, low=1)
    check_int("r_other", r_other, low=0)
    crit = [model.check_layer(c, "critical layer") for c in critical]
    if not crit:
        raise InputError("`critical` must name at least one layer; got none.")
    if len(set(crit)) != len(crit):
        raise InputError(f"`critical` must not repeat a layer; got {list(critical)}.")
    mods = lora_modules(model)
    unit = {layer: sum(i + o for _, i, o in m) for layer, m in mods.items()}  # params per rank
    ranks = {layer: (0 if layer in crit else r_other) for layer in range(model.n_layers)}
    budget = n_params - sum(r * unit[layer] for layer, r in ranks.items())
    if budget < sum(unit[c] for c in crit):
        need = sum(r * unit[layer] for layer, r in ranks.items()) + sum(unit[c] for c in crit)
        raise InputError(f"`n_params` must be at least {need} for r_other={r_other} and rank >= 1 "
                         f"on {len(crit)} critical layers; got {n_params}.")
    base = budget // sum(unit[c] for c in crit)
    for c in crit:
        ranks[c] = int(base)
    budget -= base * sum(unit[c] for c in crit)
    for c in crit:  # one more rank while the budget lasts
        if unit[c] <= budget:
            ranks[c] += 1
            budget -= unit[c]
    achieved = sum(r * unit[layer] for layer, r in ranks.items())
    layers = np.arange(model.n_layers)
    return xr.Dataset(
        {"rank": ("layer", np.array([ranks[int(l)] for l in layers])),
         "critical": ("layer", np.array([int(l) in crit for l in layers]))},
        coords={"layer": layers},
        attrs={**provenance(model, method="circuit-lora-ranks", critical=crit, r_other=r_other),
               "n_params_requested": int(n_params), "n_params": int(achieved),
               "n_params_gap": int(n_params - achieved), "r_other": int(r_other)})


# -- LoRA model, training, checkpoints -----------------------------------------------------

def _lora_config(model: Model, ranks: Mapping[int, int], dropout: float = 0.0):
    from peft import LoraConfig

    mods = lora_modules(model)
    names = [n for layer, r in ranks.items() if r > 0 for n, _, _ in mods[layer]]
    rank_of = {n: r for layer, r in ranks.items() if r > 0 for n, _, _ in mods[layer]}
    r0 = max(rank_of.values())
    return LoraConfig(
        r=r0, lora_alpha=_ALPHA_PER_RANK * r0, lora_dropout=dropout, target_modules=names,
        rank_pattern={re.escape(n): r for n, r in rank_of.items()},
        alpha_pattern={re.escape(n): _ALPHA_PER_RANK * r for n, r in rank_of.items()},
        fan_in_fan_out=model.spec.family == "gpt2", bias="none")


def lora_model(model: Model, ranks: Mapping[int, int] | Sequence[int], *, seed: int = 0):
    """A peft LoRA model on a deep copy of ``model.hf`` (the shared model is never touched).

    Only the LoRA matrices are trainable; B starts at zero, so the output equals the base
    model's until training. ``seed`` seeds the init of the A matrices.
    """
    from peft import get_peft_model

    check_local_weights(model, "LoRA fine-tuning")
    ranks = _check_ranks(model, ranks)
    hf = copy.deepcopy(model.hf)
    hf.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(hf, _lora_config(model, ranks))
    return peft_model


def _encode(model: Model, prompts: Sequence[str], answers: Sequence[str]) -> list[tuple[list[int], list[int]]]:
    if len(prompts) != len(answers):
        raise InputError(f"`prompts` and `answers` must have the same length; got {len(prompts)} "
                         f"and {len(answers)}.")
    if not prompts:
        raise InputError("`prompts` must hold at least one problem; got none.")
    tok = model.tokenizer
    out = []
    for i, (p, a) in enumerate(zip(prompts, answers)):
        p_ids = tok(p, add_special_tokens=False)["input_ids"]
        a_ids = tok(a, add_special_tokens=False)["input_ids"]
        if not p_ids or not a_ids:
            raise InputError(f"problem {i} ({p!r} -> {a!r}) tokenises to an empty prompt or answer.")
        out.append((p_ids, a_ids))
    return out


def _answer_positions(model: Model, pairs: Sequence[tuple[list[int], list[int]]]
                      ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch of ``pairs`` (prompt + answer) and, per answer token, the (row, column)
    whose next-token prediction it is and the token: (batch, rows, cols, targets)."""
    batch = model.batch_from_ids([p + a for p, a in pairs])
    w = batch.width
    rows, cols, targets = [], [], []
    for i, (p, a) in enumerate(pairs):
        start = w - len(a) - 1  # the position whose next-token prediction is a[0]
        for j, t in enumerate(a):
            rows.append(i)
            cols.append(start + j)
            targets.append(t)
    return batch, torch.tensor(rows), torch.tensor(cols), torch.tensor(targets)


def _answer_logits(hf: torch.nn.Module, model: Model, pairs: Sequence[tuple[list[int], list[int]]]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits predicting each answer token: ([n_ans_total, vocab], targets, row of each)."""
    batch, rows, cols, targets = _answer_positions(model, pairs)
    fast = fast_unembed(model) and hasattr(hf, "lm_head")
    return logits_at(hf, fast, batch, rows, cols), targets, rows


def _base_hf(peft_or_hf: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a peft wrapper (module tree with LoRA layers injected)."""
    return peft_or_hf.get_base_model() if hasattr(peft_or_hf, "get_base_model") else peft_or_hf


def answer_accuracy(model: Model, prompts: Sequence[str], answers: Sequence[str], *,
                    hf: torch.nn.Module | LoRAWeights | None = None,
                    batch_size: int = 32) -> xr.Dataset:
    """Exact-match accuracy of the greedy answer, per-token accuracy and answer loss.

    The greedy continuation equals the answer exactly when the argmax at every answer
    position (given the right prefix) is the answer token, so one forward pass decides it.
    ``hf`` evaluates another module with the same tokenizer (a peft LoRA model), or
    ``model`` with `LoRAWeights` applied by hooks (what `finetune_lora` returns for a remote
    model); default ``model`` itself. A remote model is evaluated on the server
    (`explorer.trace.run_on_weights`, one job), and only the per-token results come back.

    Returns
    -------
    xr.Dataset
        ``correct`` (prompt, bool), ``answer_loss`` (prompt, mean NLL of the answer tokens);
        attrs ``accuracy``, ``token_accuracy``, ``loss``.
    """
    check_int("batch_size", batch_size, low=1)
    pairs = _encode(model, prompts, answers)
    chunks = [_answer_positions(model, pairs[s:s + batch_size])
              for s in range(0, len(pairs), batch_size)]
    fast = fast_unembed(model)
    if isinstance(hf, LoRAWeights) or (hf is None and model.remote):
        lora = hf if isinstance(hf, LoRAWeights) else None
        with model.lock:  # hooks on a local model's shared modules, for this call only
            scored = run_on_weights(model, _score_answers, None, chunks, fast, lora)
    else:
        module = _base_hf(hf if hf is not None else model.hf)
        scored = _score_answers(model, module, chunks, fast and hasattr(module, "lm_head"), None)
    correct, losses, tok_ok, n_tok = [], [], 0, 0
    for (_, rows, _, _), (ok, nll) in zip(chunks, scored):
        for i in range(int(rows.max()) + 1):
            sel = rows == i
            correct.append(bool(ok[sel].all()))
            losses.append(float(nll[sel].mean()))
        tok_ok += int(ok.sum())
        n_tok += int(ok.numel())
    correct_a = np.array(correct)
    return xr.Dataset(
        {"correct": ("prompt", correct_a), "answer_loss": ("prompt", np.array(losses))},
        coords={"prompt_text": ("prompt", list(prompts)), "answer": ("prompt", list(answers))},
        attrs={**provenance(model, method="answer-accuracy"),
               "accuracy": float(correct_a.mean()), "token_accuracy": tok_ok / max(n_tok, 1),
               "loss": float(np.mean(losses))})


def _score_answers(weights: Model, hf: Any, chunks: list, fast: bool,
                   lora: LoRAWeights | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per chunk, (argmax == answer, NLL) of every answer token; runs where the weights are.

    ``hf`` is the module to run (None: ``weights.hf``, the only choice on the server);
    ``lora`` adds adapters by hooks for this call.
    """
    hf = weights.hf if hf is None else hf
    device = hf.device
    handles = [] if lora is None else lora.to(device).hooks(weights)
    out = []
    try:
        with torch.no_grad():
            for batch, rows, cols, targets in chunks:
                logits = logits_at(hf, fast, batch.to(device), rows.to(device), cols.to(device))
                targets = targets.to(device)
                nll = torch.nn.functional.cross_entropy(logits.float(), targets, reduction="none")
                out.append((logits.argmax(-1) == targets, nll))
    finally:
        remove_hooks(handles)
    return out


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
    pairs = _encode(model, prompts, answers)
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
    draws = _batch_draws(len(pairs), batch_size, steps, seed)
    if 0 in ckpts:
        save(0, lora.state_dict() if peft_model is None else get_peft_model_state_dict(peft_model))
    if peft_model is None:
        lora, losses, seconds, cpu = _train_by_hooks(
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


def _batch_draws(n: int, batch_size: int, steps: int, seed: int) -> list[list[int]]:
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


def lora_weights_init(model: Model, ranks: Mapping[int, int] | Sequence[int], *,
                      seed: int = 0) -> LoRAWeights:
    """The starting adapters of `lora_model` (same modules, ranks, scales and draws) as
    hook-applied `LoRAWeights`, without copying the model (a remote model's path)."""
    ranks = _check_ranks(model, ranks)
    mods = lora_modules(model)
    spec = [(name, d_in, d_out, ranks[layer], _ALPHA_PER_RANK * ranks[layer])
            for layer in sorted(ranks) if ranks[layer] > 0 for name, d_in, d_out in mods[layer]]
    return LoRAWeights.init(spec, seed=seed, transposed=model.spec.family == "gpt2")


def _train_by_hooks(model: Model, lora: LoRAWeights, pairs: Sequence[tuple[list[int], list[int]]],
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


def _read_run(folder: str | Path) -> tuple[Path, dict]:
    folder = Path(folder)
    run_file = folder / _RUN_FILE
    if not run_file.is_file():
        raise InputError(f"{str(folder)!r} is not a fine-tuning run folder (no {_RUN_FILE}).")
    return folder, json.loads(run_file.read_text())


def checkpoint_steps(folder: str | Path) -> list[int]:
    """The steps saved in a run folder, ascending."""
    folder, _ = _read_run(folder)
    return sorted(int(p.stem.split("-")[1]) for p in folder.glob("step-*.safetensors"))


def _checkpoint_file(model: Model, folder: str | Path, step: int) -> tuple[Path, dict[int, int]]:
    """The checkpoint file of ``step`` in a run of ``model``, and the run's ranks."""
    folder, run = _read_run(folder)
    saved = checkpoint_steps(folder)
    check_choice("step", step, saved)
    if run["model"] != model.spec.name or run.get("weights") != model.spec.weights:
        raise InputError(f"run {str(folder)!r} fine-tuned {run['model']!r} "
                         f"({run.get('weights')}); got {model.spec.name!r} ({model.spec.weights}).")
    return folder / f"step-{step}.safetensors", {int(k): int(v) for k, v in run["ranks"].items()}


def read_checkpoint(model: Model, folder: str | Path, step: int) -> LoRAWeights:
    """The adapters saved at ``step`` as `LoRAWeights`, nothing merged (local or remote model).

    Pass them to `circuits.edge_scores` (``lora=``) or `answer_accuracy` (``hf=``); this is
    how a remote model's checkpoints are analysed, since its weights cannot be copied.
    """
    from safetensors.torch import load_file

    path, ranks = _checkpoint_file(model, folder, step)
    ranks = _check_ranks(model, ranks)
    scaling = {n: _ALPHA_PER_RANK for layer, r in ranks.items() if r > 0
               for n, _, _ in lora_modules(model)[layer]}  # alpha / r = 2 for every rank
    return LoRAWeights.from_state_dict(load_file(str(path)), scaling,
                                       transposed=model.spec.family == "gpt2")


def load_checkpoint(model: Model, folder: str | Path, step: int) -> Model:
    """The model with the adapter of ``step`` merged into a copy of its weights.

    The result is a plain `Model` (same module tree as ``model``) that every analysis can
    trace; its spec name is ``"{name}+lora@{step}"`` and its weights id names the file.
    A remote model cannot be copied: use `read_checkpoint` and pass the adapters on.
    """
    from peft import get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    path, ranks = _checkpoint_file(model, folder, step)
    if model.remote:
        raise InputError("load_checkpoint merges the adapters into a copy of the weights, which "
                         "a remote (NDIF) model does not have here; use read_checkpoint() and "
                         "pass the adapters to edge_scores(lora=...) or answer_accuracy(hf=...).")
    hf = copy.deepcopy(model.hf)
    peft_model = get_peft_model(hf, _lora_config(model, ranks))
    result = set_peft_model_state_dict(peft_model, load_file(str(path)))
    if getattr(result, "unexpected_keys", None):
        raise InputError(f"{str(path)!r} holds weights this run's LoRA layout lacks: "
                         f"{result.unexpected_keys[:3]}.")
    merged = peft_model.merge_and_unload()
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return wrap_model(merged, model.tokenizer, name=f"{model.spec.name}+lora@{step}",
                      weights=f"{model.spec.weights}+lora:{digest}")


# -- circuits per checkpoint, similarity, edge change ----------------------------------------

#: The edge method and metric Wang et al. score fine-tuning checkpoints with (EAP-IG on KL).
CHECKPOINT_METHOD, CHECKPOINT_METRIC = "eap-ig", "kl"


def _default_metric(method: str) -> str:
    return CHECKPOINT_METRIC if method == "eap-ig" else "logit_diff"


def _circuit_of(model: Model, task: Any, *, method: str, metric: str, ig_steps: int,
                top_percent: float, batch_size: int, lora: Any = None) -> tuple[Any, Any]:
    """Edge scores of ``task`` and the circuit: the top ``top_percent`` % by |score|, pruned."""
    from explorer.analyses import circuits as ca

    s = ca.edge_scores(model, task, method=method, steps=ig_steps, metric=metric,
                       batch_size=batch_size, lora=lora)
    top_n = max(1, int(round(top_percent / 100 * s.sizes["edge"])))
    return s["score"], ca.select_circuit(s, top_n=top_n)


def checkpoint_circuits(model: Model, folder: str | Path, task: Any, *,
                        steps: Sequence[int] | None = None, method: str = CHECKPOINT_METHOD,
                        top_percent: float = 5.0, metric: str | None = None,
                        ig_steps: int = 5, batch_size: int = 16,
                        progress: Progress = None) -> xr.Dataset:
    """Edge scores and the circuit of each saved checkpoint of a run.

    Uses `explorer.analyses.circuits.edge_scores` and `select_circuit` on the model with
    each checkpoint's adapter merged (`load_checkpoint`); a remote model is scored on the
    server with the adapters applied there (`read_checkpoint`, ``lora=``). The circuit is the top
    ``top_percent`` % of edges by |score| (the paper: 5 %), pruned to input -> logits paths.
    The default scoring is the paper's, EAP-IG (``ig_steps`` interpolation steps) on the KL
    divergence from the clean run; ``method="eap"`` is the cheaper first-order alternative
    (one backward per batch instead of ``ig_steps``). ``metric`` None means KL for EAP-IG
    and the logit difference for EAP (whose gradient of KL at the clean run is zero).

    Returns
    -------
    xr.Dataset
        ``score`` (checkpoint, edge) and ``in_circuit`` (checkpoint, edge), with the edge
        coordinates of `edge_scores` (``src``, ``dst``, ``src_layer``, ``dst_layer``).
    """
    top_percent = check_float("top_percent", top_percent, low=0.0, high=100.0)
    metric = _default_metric(method) if metric is None else metric
    steps = checkpoint_steps(folder) if steps is None else list(steps)
    if not steps:
        raise InputError(f"run {str(folder)!r} has no checkpoints.")
    opts = dict(method=method, metric=metric, ig_steps=ig_steps, top_percent=top_percent,
                batch_size=batch_size)
    scores, circuits = [], []
    for i, step in enumerate(steps):
        if model.remote:  # the adapters go with each job; the served weights stay as they are
            score, circuit = _circuit_of(model, task, lora=read_checkpoint(model, folder, step),
                                         **opts)
        else:
            m = load_checkpoint(model, folder, step)
            score, circuit = _circuit_of(m, task, **opts)
            del m
        scores.append(score)
        circuits.append(circuit)
        if progress is not None:
            progress(i + 1, len(steps))
    ds = xr.Dataset({"score": xr.concat(scores, "checkpoint"),
                     "in_circuit": xr.concat(circuits, "checkpoint")})
    ds = ds.assign_coords(checkpoint=np.array(steps))
    ds.attrs = {**provenance(model, method="checkpoint-circuits", edge_method=method,
                             top_percent=top_percent, metric=metric, ig_steps=ig_steps,
                             task=getattr(task, "name", "")),
                "folder": str(folder), "citation": CITATION}
    return ds


def layer_change_noise_floor(model: Model, tasks: Sequence[Any], *,
                             method: str = CHECKPOINT_METHOD, metric: str | None = None,
                             ig_steps: int = 5, top_percent: float = 5.0,
                             batch_size: int = 16) -> xr.Dataset:
    """The per-layer edge change D_l that prompt sampling alone gives, on one set of weights.

    Each of ``tasks`` is the same task on a different sample of prompts (e.g.
    ``make_task(name, n, seed=s)`` for several seeds). Their circuits are computed on
    ``model`` as `checkpoint_circuits` computes a checkpoint's, and D_l
    (`layer_edge_change`) is taken between every pair: a per-layer change between two
    checkpoints that is not above this floor cannot be told from prompt resampling.

    Returns
    -------
    xr.Dataset
        ``edge_change`` (pair, layer), ``noise_mean`` and ``noise_max`` (layer); the pair
        coordinate names the two samples (``"0-1"``).
    """
    if len(tasks) < 2:
        raise InputError(f"`tasks` must hold at least 2 prompt samples; got {len(tasks)}.")
    top_percent = check_float("top_percent", top_percent, low=0.0, high=100.0)
    metric = _default_metric(method) if metric is None else metric
    opts = dict(method=method, metric=metric, ig_steps=ig_steps, top_percent=top_percent,
                batch_size=batch_size)
    samples = []
    for task in tasks:
        score, circuit = _circuit_of(model, task, **opts)
        samples.append(xr.Dataset({"score": score, "in_circuit": circuit}))
    pairs = [(i, j) for i in range(len(samples)) for j in range(i + 1, len(samples))]
    change = np.stack([layer_edge_change(samples[i], samples[j], n_layers=model.n_layers)
                       ["edge_change"].values for i, j in pairs])          # [pair, layer]
    return xr.Dataset(
        {"edge_change": (("pair", "layer"), change),
         "noise_mean": ("layer", change.mean(0)), "noise_max": ("layer", change.max(0))},
        coords={"pair": [f"{i}-{j}" for i, j in pairs], "layer": np.arange(model.n_layers)},
        attrs={**provenance(model, method="layer-change-noise-floor", edge_method=method,
                            metric=metric, ig_steps=ig_steps, top_percent=top_percent,
                            n_samples=len(tasks)), "citation": CITATION})


def jaccard(a: Iterable[Any], b: Iterable[Any]) -> float:
    """|A ∩ B| / |A ∪ B|; 1.0 for two empty sets."""
    a, b = set(a), set(b)
    union = a | b
    return 1.0 if not union else len(a & b) / len(union)


def _nodes_edges(ds: xr.Dataset, c: int) -> tuple[set, set]:
    mask = np.asarray(ds["in_circuit"].isel(checkpoint=c).values, bool)
    src = np.asarray(ds["src"].values)[mask]
    dst = np.asarray(ds["dst"].values)[mask]
    edges = set(zip(src.tolist(), dst.tolist()))
    nodes = set(src.tolist()) | set(dst.tolist())
    return nodes, edges


def circuit_similarity(circuits: xr.Dataset) -> xr.Dataset:
    """Node and edge Jaccard similarity between the circuits of every pair of checkpoints.

    ``circuits`` holds ``in_circuit`` (checkpoint, edge) with ``src`` / ``dst`` coordinates
    (as `checkpoint_circuits` returns). A node is in a circuit when one of its edges is.

    Returns
    -------
    xr.Dataset
        ``node_jaccard`` and ``edge_jaccard`` (checkpoint, checkpoint_b); ``n_nodes`` and
        ``n_edges`` (checkpoint).
    """
    if "in_circuit" not in circuits or "checkpoint" not in circuits["in_circuit"].dims:
        raise InputError("`circuits` must hold `in_circuit` over (checkpoint, edge); "
                         f"got variables {list(circuits.data_vars)}.")
    steps = circuits["checkpoint"].values
    sets = [_nodes_edges(circuits, c) for c in range(len(steps))]
    n = len(steps)
    node_j = np.array([[jaccard(sets[i][0], sets[j][0]) for j in range(n)] for i in range(n)])
    edge_j = np.array([[jaccard(sets[i][1], sets[j][1]) for j in range(n)] for i in range(n)])
    return xr.Dataset(
        {"node_jaccard": (("checkpoint", "checkpoint_b"), node_j),
         "edge_jaccard": (("checkpoint", "checkpoint_b"), edge_j),
         "n_nodes": ("checkpoint", np.array([len(s[0]) for s in sets])),
         "n_edges": ("checkpoint", np.array([len(s[1]) for s in sets]))},
        coords={"checkpoint": steps, "checkpoint_b": steps},
        attrs={"method": "circuit-similarity", "citation": CITATION})


_NODE = re.compile(r"^(?:a(\d+)\.h\d+|m(\d+))$")


def node_layer(node: str, n_layers: int) -> int:
    """Layer of a graph node as the paper maps it: ``a{L}.h{H}`` and ``m{L}`` -> L,
    ``input`` -> 0, ``logits`` -> the last layer."""
    if node == "input":
        return 0
    if node == "logits":
        return n_layers - 1
    m = _NODE.match(str(node))
    if m is None:
        raise InputError(f"`node` must be 'input', 'logits', 'a{{layer}}.h{{head}}' or "
                         f"'m{{layer}}'; got {node!r}.")
    return int(m.group(1) or m.group(2))


def layer_edge_change(before: xr.Dataset, after: xr.Dataset, *, n_layers: int) -> xr.Dataset:
    """Per-layer edge change D_l between two circuits (Wang et al., CircuitLoRA step 2-3).

    Each edge's change is |s_after - s_before| when it is in both circuits, its own |score|
    when it is in only one, and 0 when in neither. D_l sums the changes of the edges whose
    source node is in layer l (`node_layer`: input -> 0). ``before`` and ``after`` each hold
    ``score`` and ``in_circuit`` over the same ``edge`` list (``src`` / ``dst`` coordinates).

    Returns
    -------
    xr.Dataset
        ``edge_change`` (layer) and ``edge_delta`` (edge).
    """
    check_int("n_layers", n_layers, low=1)
    for name, ds in (("before", before), ("after", after)):
        missing = {"score", "in_circuit"} - set(ds.data_vars)
        if missing:
            raise InputError(f"`{name}` must hold `score` and `in_circuit`; missing {sorted(missing)}.")
    if (before.sizes["edge"] != after.sizes["edge"]
            or not np.array_equal(before["src"].values, after["src"].values)
            or not np.array_equal(before["dst"].values, after["dst"].values)):
        raise InputError("`before` and `after` must score the same edges in the same order.")
    sb, sa = before["score"].values.astype(float), after["score"].values.astype(float)
    ib, ia = before["in_circuit"].values.astype(bool), after["in_circuit"].values.astype(bool)
    delta = np.where(ib & ia, np.abs(sa - sb),
                     np.where(ib, np.abs(sb), np.where(ia, np.abs(sa), 0.0)))
    layers = np.array([node_layer(s, n_layers) for s in before["src"].values.tolist()])
    change = np.bincount(layers, weights=delta, minlength=n_layers)[:n_layers]
    return xr.Dataset(
        {"edge_change": ("layer", change), "edge_delta": ("edge", delta)},
        coords={"layer": np.arange(n_layers), "src": ("edge", before["src"].values),
                "dst": ("edge", before["dst"].values)},
        attrs={"method": "layer-edge-change", "citation": CITATION})


def critical_layers(edge_change: xr.DataArray | Sequence[float], *, k: int | None = 5,
                    rule: str = "top-k") -> list[int]:
    """Layers with the largest edge change: the top ``k`` or those >= mean + std."""
    check_choice("rule", rule, ("top-k", "mean+std"))
    d = np.asarray(getattr(edge_change, "values", edge_change), float)
    if rule == "mean+std":
        return [int(i) for i in np.flatnonzero(d >= d.mean() + d.std())]
    k = check_int("k", k, low=1, high=len(d))
    return sorted(int(i) for i in np.argsort(-d, kind="stable")[:k])


# -- CircuitLoRA vs LoRA ---------------------------------------------------------------------

def circuit_lora_comparison(model: Model, train: tuple[Sequence[str], Sequence[str]],
                            test: tuple[Sequence[str], Sequence[str]], critical: Sequence[int], *,
                            rank: int = 4, r_other: int = 2, seeds: Sequence[int] = (0, 1, 2),
                            steps: int = 20, batch_size: int = 8, lr: float = 1e-3,
                            progress: Progress = None) -> xr.Dataset:
    """Held-out accuracy of uniform LoRA (rank ``rank``) vs CircuitLoRA at the same count.

    CircuitLoRA gives ``r_other`` to non-critical layers and spreads the rest of uniform
    LoRA's trainable-parameter count over ``critical`` (`allocate_lora_ranks`). Each method
    trains with each seed (same problems, same batches per seed) and is scored on ``test``.

    Returns
    -------
    xr.Dataset
        ``accuracy``, ``token_accuracy``, ``loss`` (variant, seed), ``train_loss`` (variant,
        seed, step), ``trainable_params`` and ``rank`` (variant, layer), variants
        ``"lora"`` and ``"circuit-lora"``; attrs
        ``base_accuracy`` (before fine-tuning), ``critical``, ``seconds_per_step``.
    """
    check_int("rank", rank, low=1)
    seeds = [check_int("seed", s) for s in seeds]
    if not seeds:
        raise InputError("`seeds` must hold at least one seed; got none.")
    uniform = uniform_lora_ranks(model, rank)
    n_params = lora_parameter_count(model, uniform)
    alloc = allocate_lora_ranks(model, n_params, critical, r_other=r_other)
    plans = {"lora": uniform, "circuit-lora": {int(l): int(r) for l, r in
                                               zip(alloc.layer.values, alloc["rank"].values)}}
    base = answer_accuracy(model, *test)
    shape = (len(METHODS), len(seeds))
    acc, tok_acc, loss = np.zeros(shape), np.zeros(shape), np.zeros(shape)
    train_loss = np.zeros((*shape, steps))
    counts, secs, cpu = [], [], []
    done, total = 0, len(METHODS) * len(seeds)
    for mi, method in enumerate(METHODS):
        counts.append(lora_parameter_count(model, plans[method]))
        for si, seed in enumerate(seeds):
            ds, peft_model = finetune_lora(model, *train, ranks=plans[method], steps=steps,
                                           batch_size=batch_size, lr=lr, seed=seed)
            ev = answer_accuracy(model, *test, hf=peft_model)
            acc[mi, si], tok_acc[mi, si], loss[mi, si] = (ev.attrs["accuracy"],
                                                          ev.attrs["token_accuracy"],
                                                          ev.attrs["loss"])
            train_loss[mi, si] = ds["loss"].values
            secs += ds["step_seconds"].values.tolist()
            cpu += ds["step_cpu_seconds"].values.tolist()
            del peft_model
            done += 1
            if progress is not None:
                progress(done, total)
    rank_table = np.array([[plans[m][l] for l in range(model.n_layers)] for m in METHODS])
    return xr.Dataset(
        {"accuracy": (("variant", "seed"), acc), "token_accuracy": (("variant", "seed"), tok_acc),
         "loss": (("variant", "seed"), loss),
         "train_loss": (("variant", "seed", "step"), train_loss),
         "trainable_params": ("variant", np.array(counts)),
         "rank": (("variant", "layer"), rank_table)},
        coords={"variant": list(METHODS), "seed": seeds, "step": np.arange(1, steps + 1),
                "layer": np.arange(model.n_layers)},
        attrs={**provenance(model, method="circuit-lora-comparison", rank=rank, r_other=r_other,
                            steps=steps, batch_size=batch_size, lr=lr, n_train=len(train[0]),
                            n_test=len(test[0])),
               "critical": [int(c) for c in critical], "base_accuracy": base.attrs["accuracy"],
               "base_loss": base.attrs["loss"],
               "seconds_per_step": float(statistics.median(secs)),
               "cpu_seconds_per_step": float(statistics.median(cpu)), "citation": CITATION})


# -- the whole study -------------------------------------------------------------------------

def run_summary(model: Model, *, task: str = "add", n_train: int = 256, n_test: int = 100,
                n_circuit: int = 16, steps: int = 20, batch_size: int = 8, lr: float = 1e-3,
                probe_rank: int = 2, rank: int = 4, r_other: int = 2, k: int = 5,
                top_percent: float = 5.0, method: str = CHECKPOINT_METHOD,
                seeds: Sequence[int] = (0, 1, 2),
                n_checkpoints: int = 3, folder: str | Path | None = None,
                log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The whole study: a cheap LoRA with checkpoints, circuits per checkpoint, node/edge
    Jaccard, per-layer edge change, critical layers, CircuitLoRA vs LoRA. JSON-able dict;
    the datasets are saved as netCDF beside the checkpoints."""
    from explorer.analyses import circuits as ca

    say = log or (lambda s: None)
    check_int("n_checkpoints", n_checkpoints, low=1, high=steps)
    data = ca.make_task(task, n_train + n_test, seed=0)
    prompts, answers = list(data.clean), list(data.answer)
    train = (prompts[:n_train], answers[:n_train])
    test = (prompts[n_train:], answers[n_train:])
    circuit_task = ca.make_task(task, n_circuit, seed=1)
    folder = Path(folder) if folder is not None else _run_folder(model, f"{task}-r{probe_rank}")
    ckpts = sorted({0, *np.linspace(0, steps, n_checkpoints + 1).round().astype(int).tolist()})
    t0 = time.perf_counter()
    probe, peft_model = finetune_lora(model, *train, ranks=uniform_lora_ranks(model, probe_rank),
                                      steps=steps, batch_size=batch_size, lr=lr, seed=0,
                                      checkpoints=ckpts, folder=folder)
    probe_acc = answer_accuracy(model, *test, hf=peft_model).attrs["accuracy"]
    del peft_model
    say(f"probe LoRA: {time.perf_counter() - t0:.0f} s, "
        f"{float(np.median(probe.step_seconds)):.2f} s/step "
        f"({float(np.median(probe.step_cpu_seconds)):.2f} s CPU)")
    t1 = time.perf_counter()
    circuits = checkpoint_circuits(model, folder, circuit_task, method=method,
                                   top_percent=top_percent, batch_size=min(n_circuit, 8))
    sim = circuit_similarity(circuits)
    say(f"circuits of {len(ckpts)} checkpoints: {time.perf_counter() - t1:.0f} s")
    change = layer_edge_change(circuits.isel(checkpoint=0), circuits.isel(checkpoint=-1),
                               n_layers=model.n_layers)
    crit = critical_layers(change["edge_change"], k=min(k, model.n_layers))
    t2 = time.perf_counter()
    comp = circuit_lora_comparison(model, train, test, crit, rank=rank, r_other=r_other,
                                   seeds=seeds, steps=steps, batch_size=batch_size, lr=lr)
    t3 = time.perf_counter()
    say(f"comparison: {t3 - t2:.0f} s")
    save_netcdf(circuits, folder / "circuits.nc")
    save_netcdf(comp, folder / "comparison.nc")
    first, last = 0, len(ckpts) - 1
    return {
        "model": model.spec.name, "task": task, "folder": str(folder),
        "seconds": {"probe": t1 - t0, "circuits": t2 - t1, "comparison": t3 - t2},
        "steps": steps, "batch_size": batch_size, "lr": lr,
        "seconds_per_step": float(np.median(probe.step_seconds)),
        "cpu_seconds_per_step": float(np.median(probe.step_cpu_seconds)),
        "probe": {"rank": probe_rank, "final_loss": float(probe.loss[-1]),
                  "accuracy": probe_acc, "checkpoints": ckpts},
        "similarity": {
            "checkpoints": ckpts,
            "node_jaccard_vs_first": sim.node_jaccard.isel(checkpoint_b=first).values.tolist(),
            "edge_jaccard_vs_first": sim.edge_jaccard.isel(checkpoint_b=first).values.tolist(),
            "node_jaccard_first_last": float(sim.node_jaccard[first, last]),
            "edge_jaccard_first_last": float(sim.edge_jaccard[first, last]),
            "n_nodes": sim.n_nodes.values.tolist(), "n_edges": sim.n_edges.values.tolist()},
        "edge_change": change.edge_change.values.tolist(), "critical": crit,
        "comparison": comparison_summary(comp),
    }


def comparison_summary(comp: xr.Dataset) -> dict[str, Any]:
    """JSON-able table of `circuit_lora_comparison`: per-seed accuracy, mean and spread."""
    def spread(da: xr.DataArray) -> float:
        return float(da.std(ddof=1)) if da.sizes["seed"] > 1 else 0.0

    variants = [str(v) for v in comp["variant"].values]
    pick = {v: comp.sel({"variant": v}) for v in variants}
    return {
        "base_accuracy": float(comp.attrs["base_accuracy"]),
        "critical": [int(c) for c in np.atleast_1d(comp.attrs["critical"])],
        "trainable_params": {v: int(pick[v].trainable_params) for v in variants},
        "ranks": {v: pick[v]["rank"].values.tolist() for v in variants},
        "seeds": comp["seed"].values.tolist(),
        "accuracy": {v: pick[v].accuracy.values.tolist() for v in variants},
        "accuracy_mean": {v: float(pick[v].accuracy.mean()) for v in variants},
        "accuracy_std": {v: spread(pick[v].accuracy) for v in variants},
        "loss": {v: pick[v].loss.values.tolist() for v in variants},
        "loss_mean": {v: float(pick[v].loss.mean()) for v in variants},
        "loss_std": {v: spread(pick[v].loss) for v in variants},
        "token_accuracy_mean": {v: float(pick[v].token_accuracy.mean()) for v in variants},
        "cpu_seconds_per_step": float(comp.attrs["cpu_seconds_per_step"]),
        "seconds_per_step": float(comp.attrs["seconds_per_step"]),
    }


def save_netcdf(ds: xr.Dataset, path: str | Path) -> Path:
    """Write ``ds`` as netCDF, with attrs netCDF cannot hold (dicts, None, bools) as JSON."""
    def plain(attrs: dict) -> dict:
        return {k: (json.dumps(v) if isinstance(v, (dict, bool, type(None))) or (
            isinstance(v, (list, tuple)) and any(isinstance(x, (dict, list)) for x in v)) else v)
            for k, v in attrs.items()}

    out = ds.copy()
    out.attrs = plain(ds.attrs)
    for name in out.variables:
        out[name].attrs = plain(out[name].attrs)
        if out[name].dtype == object:
            out[name] = out[name].astype(str)
    out.to_netcdf(path)
    return Path(path)
