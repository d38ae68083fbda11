"""CircuitLoRA vs LoRA: both fine-tuned at the same trainable-parameter count over several seeds,
scored on held-out problems (`circuit_lora_comparison`).
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence

import numpy as np
import xarray as xr

from explorer._checks import InputError, check_int
from explorer.analyses.circuit_lora.adapters import (
    CITATION,
    METHODS,
    Progress,
    allocate_lora_ranks,
    lora_parameter_count,
    uniform_lora_ranks,
)
from explorer.analyses.circuit_lora.answers import answer_accuracy
from explorer.analyses.circuit_lora.training import finetune_lora
from explorer.models import Model
from explorer.trace import provenance

__all__ = ["circuit_lora_comparison"]


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
