"""Early- vs late-layer LoRA fine-tuning on a task the model encodes poorly.

Han, Song, Gore, Agrawal, "Emergence and Effectiveness of Task Vectors in In-Context
Learning: An Encoder-Decoder Perspective" (ICML 2025) fine-tune only the first or only the
last layers on a task with low task decodability (TD) and find that tuning the early
layers raises TD and accuracy more. Here:

- `LayerLoRA`: LoRA adapters (`peft`) on the linear maps of chosen layers of a *copy* of
  the model, trained on the next-token loss of the answer's first token after few-shot
  prompts; the adapters are merged into the copy, which is wrapped as a new explorer
  `Model` (the model passed in is never changed).
- `early_late_finetune`: picks the task with the lowest TD, tunes the first and the last
  ``n_layers_tuned`` layers with equal trainable parameters, and reports TD per layer and
  few-shot accuracy before and after for both.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import xarray as xr

from explorer._checks import (
    InputError,
    check_choice,
    check_float,
    check_int,
    check_local_weights,
)
from explorer.analyses.icl_heads import ICLTask, as_icl_task, answer_token_ids, icl_prompts
from explorer.analyses.task_vectors import task_decodability
from explorer.lora import PEFT_PREFIX, LoRAWeights, train_in_jobs
from explorer.models import Model
from explorer.trace import provenance

__all__ = [
    "VARIANTS",
    "split_task",
    "lora_target_modules",
    "LayerLoRA",
    "early_late_finetune",
    "finetune_summary",
]

CITATION = ("S. Han, J. Song, J. Gore, P. Agrawal, \"Emergence and Effectiveness of Task "
            "Vectors in In-Context Learning: An Encoder-Decoder Perspective\", ICML 2025.")

#: The models compared: untouched, first layers tuned, last layers tuned.
VARIANTS = ("base", "early", "late")
#: How `LayerLoRA` trains: peft on a copy, or adapters applied by hooks (no copy).
ENGINES = ("peft", "hooks")


def split_task(task: ICLTask | str, *, seed: int = 0) -> tuple[ICLTask, ICLTask]:
    """A seeded split of a task's pairs into (train, held-out) halves with the same name.

    A tuple: the two halves of one split, always used as a pair.
    """
    task = as_icl_task(task)
    if len(task.pairs) < 10:
        raise InputError(f"task {task.name!r} has {len(task.pairs)} pairs; splitting it "
                         "into train and held-out halves needs at least 10.")
    order = np.random.default_rng([seed, 7]).permutation(len(task.pairs))
    half = len(order) // 2
    train = tuple(task.pairs[i] for i in sorted(order[:half]))
    held = tuple(task.pairs[i] for i in sorted(order[half:]))
    return (ICLTask(task.name, train, task.description),
            ICLTask(task.name, held, task.description))


def lora_target_modules(model: Model, layers: Sequence[int]) -> list[str]:
    """Full names of the linear maps (``nn.Linear`` or GPT-2 ``Conv1D``) inside ``layers``."""
    from transformers.pytorch_utils import Conv1D

    layers = [model.check_layer(l) for l in layers]
    layer_ids = {id(model.hf_layer(l)): l for l in layers}
    names = []
    for name, module in model.hf.named_modules():
        if id(module) in layer_ids:
            prefix = name
            names += [f"{prefix}.{sub}" for sub, m in module.named_modules()
                      if isinstance(m, (torch.nn.Linear, Conv1D))]
    return names


def _copy_hf(model: Model) -> torch.nn.Module:
    """A fresh copy of the Hugging Face model (same config and weights, own tensors)."""
    check_local_weights(model, "LoRA fine-tuning")
    from transformers import AutoModelForCausalLM

    hf = model.hf
    copy = AutoModelForCausalLM.from_config(hf.config, dtype=next(hf.parameters()).dtype)
    copy.load_state_dict(hf.state_dict())
    return copy


class LayerLoRA:
    """LoRA on the linear maps of chosen layers of a copy of the model (Han et al. 2025).

    Parameters
    ----------
    layers : sequence of int
        Layers whose linear maps get adapters; all others stay frozen.
    rank : int, default=4
    alpha : float, default=8.0
        LoRA scaling numerator (the update is ``alpha / rank * B @ A``).
    steps : int, default=30
        Optimiser steps (AdamW), each on ``batch_size`` freshly sampled prompts.
    lr : float, default=1e-3
    batch_size : int, default=4
    n_shots : int, default=3
        Demonstrations per training prompt.
    seed : int, default=0
    engine : {"peft", "hooks"}, optional
        ``"peft"`` trains peft adapters on a copy of the model and merges them
        (``model_``); ``"hooks"`` holds the adapters apart and applies them by hooks where
        the weights are (`explorer.lora.train_in_jobs`), without a copy (``model_`` is
        None). Default: ``"peft"`` for a local model, ``"hooks"`` for a remote one (the
        only choice there).

    Attributes
    ----------
    model_ : explorer.Model or None
        The fine-tuned copy (adapters merged), ready for any analysis; None for a remote
        model, which cannot be copied (use ``lora_``).
    lora_ : explorer.lora.LoRAWeights
        The trained adapters, for analyses that apply them by hooks without a copy
        (`task_vectors.task_decodability`'s ``lora``).
    target_modules_ : list of str
        The adapted linear maps.
    n_trainable_ : int
        Number of trainable (LoRA) parameters.
    trainable_names_ : list of str
        Names of the parameters that had ``requires_grad`` during training.
    loss_ : ndarray [step]
        Training loss per step.
    seconds_ : float
    """

    def __init__(self, layers: Sequence[int], *, rank: int = 4, alpha: float = 8.0,
                 steps: int = 30, lr: float = 1e-3, batch_size: int = 4, n_shots: int = 3,
                 seed: int = 0, engine: str | None = None):
        if isinstance(layers, (int, str)) or not list(layers):
            raise InputError(f"`layers` must be a non-empty list of layer indices; got {layers!r}.")
        self.layers = list(layers)
        self.rank = check_int("rank", rank, low=1)
        self.alpha = check_float("alpha", alpha, low=0.0)
        self.steps = check_int("steps", steps, low=1)
        self.lr = check_float("lr", lr, low=0.0)
        self.batch_size = check_int("batch_size", batch_size, low=1)
        self.n_shots = n_shots
        self.seed = seed
        self.engine = None if engine is None else check_choice("engine", engine, ENGINES)

    def fit(self, model: Model, task: ICLTask | str, *, progress: Any = None) -> LayerLoRA:
        """Train adapters on ``task`` prompts in a copy of ``model``; ``model`` is unchanged.

        With ``engine="hooks"`` (a remote model's only engine) the adapters are held in the
        jobs and applied by hooks (`explorer.lora.train_in_jobs`; on the server for a remote
        model), started from peft's draws for ``seed``; the peft engine's start differs,
        because building its copy draws random numbers first. ``model_`` is then None and
        ``lora_`` holds the result.
        """
        from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

        from explorer.models import wrap_model

        task = as_icl_task(task)
        layers = [model.check_layer(l) for l in self.layers]
        n_shots = check_int("n_shots", self.n_shots, low=0, high=len(task.pairs) - 1)
        self.target_modules_ = lora_target_modules(model, layers)
        t0 = time.perf_counter()
        engine = self.engine or ("hooks" if model.remote else "peft")
        if engine == "hooks":
            return self._fit_by_hooks(model, task, layers, n_shots, progress, t0)
        with torch.random.fork_rng():
            torch.manual_seed(self.seed)
            config = LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=0.0,
                                target_modules=self.target_modules_, bias="none")
            peft_model = get_peft_model(_copy_hf(model), config)
        self.trainable_names_ = [n for n, p in peft_model.named_parameters() if p.requires_grad]
        self.n_trainable_ = int(sum(p.numel() for p in peft_model.parameters()
                                    if p.requires_grad))
        params = [p for p in peft_model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=self.lr, weight_decay=0.0)
        losses = []
        peft_model.eval()   # no dropout: the adapters are the only thing that changes
        with torch.enable_grad():
            for step in range(self.steps):
                prompts, answers = icl_prompts(task, n_prompts=self.batch_size, n_shots=n_shots,
                                               seed=self.seed * 100_003 + step)
                batch = model.tokenize(prompts)
                target = torch.tensor(answer_token_ids(model, answers))
                logits = peft_model(**batch.model_inputs()).logits[:, -1]   # [prompt, vocab]
                loss = torch.nn.functional.cross_entropy(logits.float(), target)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(float(loss.detach()))
                if callable(progress):
                    progress(step + 1, self.steps)
        self.lora_ = LoRAWeights.from_state_dict(
            get_peft_model_state_dict(peft_model),
            {n: self.alpha / self.rank for n in self.target_modules_},
            transposed=model.spec.family == "gpt2")
        merged = peft_model.merge_and_unload()
        layer_text = ",".join(map(str, layers))
        self.model_ = wrap_model(merged, model.tokenizer,
                                 name=f"{model.spec.name}+lora[{layer_text}]",
                                 weights=f"{model.spec.weights}; LoRA r={self.rank} on layers "
                                         f"{layer_text}, {self.steps} steps on {task.name}")
        self.loss_ = np.array(losses)
        self.seconds_ = time.perf_counter() - t0
        return self

    def _step_inputs(self, model: Model, task: ICLTask, n_shots: int, step: int) -> tuple:
        """Step ``step``'s prompts as `explorer.lora.train_in_jobs` takes them: the last
        position of each prompt, scored against the answer's first token."""
        prompts, answers = icl_prompts(task, n_prompts=self.batch_size, n_shots=n_shots,
                                       seed=self.seed * 100_003 + step)
        batch = model.tokenize(prompts)
        n = len(prompts)
        return (batch, torch.arange(n), torch.full((n,), batch.width - 1),
                torch.tensor(answer_token_ids(model, answers)), self.lr)

    def _fit_by_hooks(self, model: Model, task: ICLTask, layers: list[int], n_shots: int,
                      progress: Any, t0: float) -> LayerLoRA:
        from explorer.analyses.circuit_lora import lora_modules

        mods = lora_modules(model)
        spec = [(name, d_in, d_out, self.rank, self.alpha)
                for layer in sorted(layers) for name, d_in, d_out in mods[layer]]
        start = LoRAWeights.init(spec, seed=self.seed, transposed=model.spec.family == "gpt2")
        out = train_in_jobs(model, start, lambda k: self._step_inputs(model, task, n_shots, k),
                            self.steps, progress=progress if callable(progress) else None)
        self.lora_ = out.lora
        self.model_ = None
        self.n_trainable_ = out.lora.n_params()
        self.trainable_names_ = [f"{PEFT_PREFIX}{name}.lora_{ab}.default.weight"
                                 for name in out.lora.names() for ab in "AB"]
        self.loss_ = np.array(out.loss)
        self.seconds_ = time.perf_counter() - t0
        return self


def early_late_finetune(model: Model, tasks: Sequence[ICLTask | str], *,
                        n_layers_tuned: int | None = None, rank: int = 4, steps: int = 30,
                        lr: float = 1e-3, batch_size: int = 4, n_prompts: int = 12,
                        n_shots: int = 3, k: int = 10, seed: int = 0,
                        engine: str | None = None, progress: Any = None) -> xr.Dataset:
    """TD per layer and accuracy before and after LoRA on only the first or only the last layers.

    Every task's pairs are split into train and held-out halves (`split_task`); TD and
    accuracy are measured on held-out prompts. The task with the lowest TD (mean over
    layers, Null task excluded) is the one tuned. The first and the last
    ``n_layers_tuned`` layers (default ``max(1, n_layers // 4)``) get LoRA adapters on the
    same linear maps, hence equal trainable parameters (Han et al., ICML 2025).
    ``engine`` is `LayerLoRA`'s; a remote model trains and is measured on the server.

    Returns
    -------
    xr.Dataset: ``td`` (variant, layer) over all tasks, ``task_td`` (variant, layer) of the
    tuned task, ``accuracy`` (variant) few-shot accuracy on the tuned task,
    ``task_accuracy`` (variant, task), ``train_loss`` (variant, step; NaN for ``base``),
    ``n_trainable`` (variant); attrs ``task``, ``early_layers``, ``late_layers``.
    """
    tasks = [as_icl_task(t) for t in tasks]
    if len(tasks) < 2:
        raise InputError(f"early_late_finetune needs at least 2 tasks; got {len(tasks)}.")
    n_layers = model.spec.n_layers
    if n_layers_tuned is None:
        n_layers_tuned = max(1, n_layers // 4)
    n_layers_tuned = check_int("n_layers_tuned", n_layers_tuned, low=1, high=max(1, n_layers // 2))
    steps = check_int("steps", steps, low=1)
    splits = [split_task(t, seed=seed) for t in tasks]
    held = [h for _, h in splits]
    td_opts = dict(n_prompts=n_prompts, n_shots=n_shots, k=k, seed=seed)
    base = task_decodability(model, held, **td_opts)
    names = [t.name for t in held]
    per_task = base["td_per_task"].sel(task=names).mean("layer").values
    chosen = int(np.argmin(per_task))
    train_task = splits[chosen][0]
    early = list(range(n_layers_tuned))
    late = list(range(n_layers - n_layers_tuned, n_layers))
    results, losses, n_trainable = {"base": base}, {}, {"base": 0}
    for v, layers in (("early", early), ("late", late)):
        def report(done, total, v=v):
            if callable(progress):
                progress(done + (steps if v == "late" else 0), 2 * steps)
        tuned = LayerLoRA(layers, rank=rank, steps=steps, lr=lr, batch_size=batch_size,
                          n_shots=n_shots, seed=seed, engine=engine).fit(model, train_task,
                                                                          progress=report)
        if tuned.model_ is None:  # hooks engine: the adapters are applied where the weights are
            results[v] = task_decodability(model, held, lora=tuned.lora_, **td_opts)
        else:
            results[v] = task_decodability(tuned.model_, held, **td_opts)
        losses[v], n_trainable[v] = tuned.loss_, tuned.n_trainable_
        del tuned
    if n_trainable["early"] != n_trainable["late"]:
        raise RuntimeError(f"early and late adapters differ in size ({n_trainable['early']} vs "
                         f"{n_trainable['late']}); the layers are not alike.")
    task_name = names[chosen]
    loss = np.full((len(VARIANTS), steps), np.nan)
    loss[1], loss[2] = losses["early"], losses["late"]
    all_names = results["base"].task.values.tolist()
    return xr.Dataset(
        {"td": (("variant", "layer"), np.stack([results[v]["td"].values for v in VARIANTS])),
         "task_td": (("variant", "layer"), np.stack(
             [results[v]["td_per_task"].sel(task=task_name).values for v in VARIANTS])),
         "accuracy": (("variant",), np.array(
             [float(results[v]["icl_accuracy"].sel(task=task_name)) for v in VARIANTS])),
         "task_accuracy": (("variant", "task"), np.stack(
             [results[v]["icl_accuracy"].values for v in VARIANTS])),
         "train_loss": (("variant", "step"), loss),
         "n_trainable": (("variant",), np.array([n_trainable[v] for v in VARIANTS]))},
        coords={"variant": list(VARIANTS), "layer": list(range(n_layers)),
                "task": all_names, "step": list(range(steps))},
        attrs={**provenance(model, method="early_late_finetune", n_layers_tuned=n_layers_tuned,
                            rank=rank, steps=steps, lr=lr, batch_size=batch_size,
                            n_prompts=n_prompts, n_shots=n_shots, k=k, seed=seed,
                            citation=CITATION),
               "task": task_name, "early_layers": early, "late_layers": late,
               "base_task_td": dict(zip(names, per_task.round(4).tolist()))})


def finetune_summary(ds: xr.Dataset) -> dict[str, Any]:
    """The JSON-able headline numbers of an `early_late_finetune` result.

    A dict, not a Dataset: it is the Dataset's headline numbers as nested JSON scalars and
    lists, what the command's ``--json`` prints and a benchmark writes to docs/figures.
    """
    out: dict[str, Any] = {"task": ds.attrs["task"], "early_layers": ds.attrs["early_layers"],
                           "late_layers": ds.attrs["late_layers"],
                           "base_task_td": ds.attrs["base_task_td"]}
    for v in ds.variant.values.tolist():
        d = ds.sel(variant=v)
        out[v] = {"accuracy": float(d.accuracy), "td": d.td.values.round(4).tolist(),
                  "task_td": d.task_td.values.round(4).tolist(),
                  "task_td_mean": float(d.task_td.mean()), "td_max": float(d.td.max()),
                  "n_trainable": int(d.n_trainable)}
        if v != "base":
            out[v]["final_train_loss"] = float(d.train_loss.values[-1])
            out[v]["first_train_loss"] = float(d.train_loss.values[0])
    return out
