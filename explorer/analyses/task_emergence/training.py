"""Training with checkpoints (`train_task_emergence`), the run as an xarray.Dataset, the model
at a checkpoint, and the run as safetensors."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xarray as xr

from explorer._checks import InputError, check_float, check_int
from explorer.analyses._training import (CheckpointLog, check_checkpoint_step, check_training_run,
                                         run_training_steps, training_attrs)
from explorer.analyses.task_emergence.model import TaskICLTransformer
from explorer.analyses.task_emergence.tasks import (CITATION, DEFAULTS, ProgressCallback, _sample,
                                                    task_bases)

__all__ = [
    'train_task_emergence', 'task_emergence_model', 'save_run_safetensors', 'load_run_safetensors',
]


_ARCH = ("d", "n_examples", "n_layers", "d_model", "n_heads")


def train_task_emergence(
    *,
    d: int = DEFAULTS["d"],
    n_tasks: int = DEFAULTS["n_tasks"],
    rank: int = DEFAULTS["rank"],
    n_examples: int = DEFAULTS["n_examples"],
    noise_std: float = DEFAULTS["noise_std"],
    coef_mean: float = DEFAULTS["coef_mean"],
    coef_std: float = DEFAULTS["coef_std"],
    n_layers: int = DEFAULTS["n_layers"],
    d_model: int = DEFAULTS["d_model"],
    n_heads: int = DEFAULTS["n_heads"],
    lr: float = DEFAULTS["lr"],
    warmup: int = DEFAULTS["warmup"],
    lr_decay: str = DEFAULTS["lr_decay"],
    batch_size: int = DEFAULTS["batch_size"],
    steps: int = DEFAULTS["steps"],
    checkpoint_every: int = DEFAULTS["checkpoint_every"],
    seed: int = DEFAULTS["seed"],
    progress: ProgressCallback | None = None,
) -> xr.Dataset:
    """Train the transformer on the sparse-regression task mixture; keep checkpoints.

    Every step draws a fresh batch of prompts (task uniform over ``n_tasks``); the loss is
    the mean squared error of the query predictions; Adam.

    Parameters
    ----------
    d, n_tasks, rank : int, default=8, 4, 2
        Input dimension, number of latent tasks, rank of each task's basis.
    n_examples : int, default=6
        Context pairs before the query.
    noise_std : float, default=0.1
    coef_mean, coef_std : float, default=1.0, 0.5
        Coordinates of ``w`` in its task's basis are ``N(coef_mean, coef_std^2)``.
    n_layers, d_model, n_heads : int, default=3, 64, 4
    lr : float
        Peak Adam learning rate.
    warmup : int
        Steps of linear warm-up from 0 to ``lr``.
    lr_decay : {"cosine", "none"}
        After the warm-up, ``"cosine"`` decays the rate to 0 at the last step.
    batch_size : int, default=128
    steps : int, default=4000
    checkpoint_every : int, default=100
    seed : int, default=0
        Seeds the bases, the initialisation and the training prompts.
    progress : callable, optional
        ``progress(steps_done, steps)`` at every checkpoint; returning ``False`` stops
        (``attrs["cancelled"]`` is then True).

    Returns
    -------
    xarray.Dataset
        ``weights`` (step, parameter): all parameters flattened in module order (attrs
        ``parameter_names`` and ``parameter_shapes`` say how to cut them); ``bases``
        (task, feature, rank); ``train_loss`` (step; mean since the previous checkpoint);
        coordinates ``wall_seconds`` and ``cpu_seconds`` (step; time since the start of
        training, this process's CPU time for the latter). Attrs: method, params, seed, versions,
        citation, train_seconds (wall), train_cpu_seconds (this process's CPU time, which a
        busy machine inflates less), cancelled.
    """
    d = check_int("d", d, low=1, high=1024)
    n_tasks = check_int("n_tasks", n_tasks, low=2, high=64)
    rank = check_int("rank", rank, low=1, high=d)
    n_examples = check_int("n_examples", n_examples, low=1, high=512)
    noise_std = check_float("noise_std", noise_std, low=0.0)
    coef_mean = check_float("coef_mean", coef_mean)
    coef_std = check_float("coef_std", coef_std, low=0.0)
    lr = check_float("lr", lr, low=0.0)
    warmup = check_int("warmup", warmup, low=0)
    if lr_decay not in ("cosine", "none"):
        raise InputError(f"`lr_decay` must be 'cosine' or 'none'; got {lr_decay!r}.")
    batch_size = check_int("batch_size", batch_size, low=1)
    steps = check_int("steps", steps, low=0)
    checkpoint_every = check_int("checkpoint_every", checkpoint_every, low=1)
    seed = check_int("seed", seed)
    bases_np = task_bases(d, n_tasks, rank, seed=seed)
    model = TaskICLTransformer(d, n_examples, n_layers=n_layers, d_model=d_model, n_heads=n_heads,
                               seed=seed)
    params = {"d": d, "n_tasks": n_tasks, "rank": rank, "n_examples": n_examples,
              "noise_std": noise_std, "coef_mean": coef_mean, "coef_std": coef_std,
              "n_layers": n_layers, "d_model": d_model, "n_heads": n_heads,
              "lr": lr, "warmup": warmup, "lr_decay": lr_decay, "batch_size": batch_size,
              "steps": steps, "checkpoint_every": checkpoint_every}
    bases = torch.as_tensor(bases_np, dtype=torch.float32)
    optimiser = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed + 1)
    log = CheckpointLog()

    def rate(step: int) -> float:
        if step <= warmup:
            return lr * step / warmup
        if lr_decay == "cosine":
            return lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(steps - warmup, 1)))
        return lr

    def checkpoint(step: int) -> None:
        log.record(step, model.flat_weights())

    def step_loss(step: int) -> torch.Tensor:
        for group in optimiser.param_groups:
            group["lr"] = rate(step)
        batch = _sample(bases, batch_size, n_examples, noise_std, None, gen, coef_mean, coef_std)
        return ((model(batch["x"], batch["y"]) - batch["y"][:, -1]) ** 2).mean()

    cancelled = run_training_steps(steps, step_loss, optimiser, losses=log.running,
                                   checkpoint=checkpoint, checkpoint_every=checkpoint_every,
                                   progress=progress)
    timing = log.timing_attrs(cancelled)
    names = [n for n, _ in model.named_parameters()]
    shapes = [list(p.shape) for p in model.parameters()]
    return xr.Dataset(
        {"weights": (("step", "parameter"), np.stack(log.snapshots).astype(np.float32)),
         "bases": (("task", "feature", "rank"), bases_np.astype(np.float32)),
         "train_loss": (("step",), np.asarray(log.train_loss))},
        coords={"step": np.asarray(log.steps, dtype=np.int64),
                "wall_seconds": ("step", np.asarray(log.wall_seconds)),
                "cpu_seconds": ("step", np.asarray(log.cpu_seconds)),
                "task": np.arange(n_tasks), "feature": np.arange(d), "rank": np.arange(rank)},
        attrs=training_attrs("task_emergence_run", params, seed, CITATION,
                             **timing, parameter_names=names, parameter_shapes=shapes),
    )


def _check_run(run: Any) -> xr.Dataset:
    return check_training_run(run, trainer="train_task_emergence", kind="task-emergence",
                              variables=("weights", "bases"), dims=("step",), attrs=("params",))


def task_emergence_model(run: xr.Dataset, step: int) -> TaskICLTransformer:
    """The transformer of ``run`` at checkpoint ``step``."""
    run = _check_run(run)
    step = check_checkpoint_step(run, step)
    p = run.attrs["params"]
    model = TaskICLTransformer(p["d"], p["n_examples"], n_layers=p["n_layers"], d_model=p["d_model"],
                               n_heads=p["n_heads"])
    model.load_flat_weights(run["weights"].sel(step=step).values)
    return model.eval()


def save_run_safetensors(run: xr.Dataset, path: str | Path) -> Path:
    """Write a run as one safetensors file: every checkpoint's parameters by name.

    Tensors are named ``step_<step>/<parameter>``; ``bases``, ``step``, ``train_loss`` and
    ``wall_seconds`` are tensors too; the run's attrs are JSON in the file's metadata.
    """
    from safetensors.torch import save_file

    run = _check_run(run)
    names, shapes = run.attrs["parameter_names"], run.attrs["parameter_shapes"]
    tensors: dict[str, torch.Tensor] = {}
    for step in run["step"].values:
        flat = torch.as_tensor(run["weights"].sel(step=step).values)
        at = 0
        for name, shape in zip(names, shapes):
            n = int(np.prod(shape)) if shape else 1
            tensors[f"step_{int(step)}/{name}"] = flat[at:at + n].reshape(shape).clone()
            at += n
    tensors["bases"] = torch.as_tensor(run["bases"].values).contiguous()
    tensors["step"] = torch.as_tensor(run["step"].values.astype(np.int64))
    tensors["train_loss"] = torch.as_tensor(run["train_loss"].values.astype(np.float64))
    tensors["wall_seconds"] = torch.as_tensor(run["wall_seconds"].values.astype(np.float64))
    if "cpu_seconds" in run.coords:
        tensors["cpu_seconds"] = torch.as_tensor(run["cpu_seconds"].values.astype(np.float64))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"attrs": json.dumps(run.attrs)})
    return path


def load_run_safetensors(path: str | Path) -> xr.Dataset:
    """Read a run written by `save_run_safetensors` (no pickle involved)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise InputError(f"no safetensors run at {str(path)!r}; write one with save_run_safetensors "
                         "or `explorer task-emergence train --out PATH`.")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if "attrs" not in meta:
            raise InputError(f"{str(path)!r} is not a task-emergence run (no attrs in its metadata).")
        attrs = json.loads(meta["attrs"])
        steps = f.get_tensor("step").numpy()
        names = attrs["parameter_names"]
        weights = np.stack([torch.cat([f.get_tensor(f"step_{int(s)}/{n}").flatten() for n in names]).numpy()
                            for s in steps])
        bases = f.get_tensor("bases").numpy()
        loss = f.get_tensor("train_loss").numpy()
        walls = f.get_tensor("wall_seconds").numpy()
        extra = {"cpu_seconds": ("step", f.get_tensor("cpu_seconds").numpy())} if "cpu_seconds" in f.keys() else {}
    n_tasks, d, rank = bases.shape
    return xr.Dataset(
        {"weights": (("step", "parameter"), weights.astype(np.float32)),
         "bases": (("task", "feature", "rank"), bases),
         "train_loss": (("step",), loss)},
        coords={"step": steps, "wall_seconds": ("step", walls), **extra, "task": np.arange(n_tasks),
                "feature": np.arange(d), "rank": np.arange(rank)},
        attrs=attrs)
