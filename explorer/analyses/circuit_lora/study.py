"""The whole CircuitLoRA study on one model: fine-tune, circuits per checkpoint, critical layers
and the comparison (`run_summary`), the comparison's JSON table (`comparison_summary`), and
writing a result as netCDF (`save_netcdf`).
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from explorer._checks import check_int
from explorer.analyses.circuit_lora.adapters import uniform_lora_ranks
from explorer.analyses.circuit_lora.answers import answer_accuracy
from explorer.analyses.circuit_lora.circuit_change import (
    CHECKPOINT_METHOD,
    checkpoint_circuits,
    circuit_similarity,
    critical_layers,
    layer_edge_change,
)
from explorer.analyses.circuit_lora.comparison import circuit_lora_comparison
from explorer.analyses.circuit_lora.training import _run_folder, finetune_lora
from explorer.models import Model

__all__ = ["comparison_summary", "run_summary", "save_netcdf"]


def run_summary(model: Model, *, task: str = "add", n_train: int = 256, n_test: int = 100,
                n_circuit: int = 16, steps: int = 20, batch_size: int = 8, lr: float = 1e-3,
                probe_rank: int = 2, rank: int = 4, r_other: int = 2, k: int = 5,
                top_percent: float = 5.0, method: str = CHECKPOINT_METHOD,
                seeds: Sequence[int] = (0, 1, 2),
                n_checkpoints: int = 3, folder: str | Path | None = None,
                log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The whole study: a cheap LoRA with checkpoints, circuits per checkpoint, node/edge
    Jaccard, per-layer edge change, critical layers, CircuitLoRA vs LoRA. JSON-able dict;
    the datasets are saved as netCDF beside the checkpoints.

    A dict, not a Dataset: several Datasets of different dims (saved beside the checkpoints)
    and the study's JSON headline numbers, what the benchmark writes to docs/figures."""
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
    """JSON-able table of `circuit_lora_comparison`: per-seed accuracy, mean and spread.

    A dict, not a Dataset: it is the Dataset's headline numbers as nested JSON scalars and
    lists, what the command's ``--json`` prints and a benchmark writes to docs/figures.
    """
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
