"""Training the model with checkpoints (`train_linear_icl`), the run as an xarray.Dataset, and
the model at a checkpoint (`icl_model`)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import xarray as xr

from explorer._checks import InputError, check_float, check_int
from explorer.analyses._training import (CheckpointLog, check_checkpoint_step,
                                         check_training_run, run_training_steps, training_attrs)
from explorer.analyses.linear_icl.model import (CITATION, DEFAULTS, ICLAttention, ProgressCallback,
                                                TEST_LENGTHS, sample_regression_prompts)

__all__ = ['train_linear_icl', 'icl_run_from_models', 'icl_model']


def train_linear_icl(
    *,
    n_heads: int = DEFAULTS["n_heads"],
    d: int = DEFAULTS["d"],
    context_length: int = DEFAULTS["context_length"],
    noise_var: float = DEFAULTS["noise_var"],
    lr: float = DEFAULTS["lr"],
    batch_size: int = DEFAULTS["batch_size"],
    steps: int = DEFAULTS["steps"],
    checkpoint_every: int = DEFAULTS["checkpoint_every"],
    init_scale: float = DEFAULTS["init_scale"],
    seed: int = DEFAULTS["seed"],
    test_lengths: Sequence[int] = TEST_LENGTHS,
    n_test: int = 2048,
    progress: ProgressCallback | None = None,
) -> xr.Dataset:
    """Train one layer of multi-head softmax attention on in-context linear regression.

    Every step draws a fresh batch of prompts; the loss is the squared error of the query
    prediction; Adam. At every checkpoint the weights are stored and the test loss is
    measured on a fixed set of prompts at each context length in ``test_lengths``.

    Parameters
    ----------
    n_heads : int, default=2
    d : int, default=5
    context_length : int, default=40
        L of the training prompts.
    noise_var : float, default=0.1
    lr : float, default=1e-3
    batch_size : int, default=256
    steps : int, default=20000
    checkpoint_every : int, default=250
    init_scale : float, default=1.0
    seed : int, default=0
        Seeds the initialisation, the training prompts and the test prompts.
    test_lengths : sequence of int, default=(5, 10, 20, 40, 80, 160)
    n_test : int, default=2048
        Test prompts per context length.
    progress : callable, optional
        ``progress(steps_done, steps)`` at every checkpoint; returning ``False`` stops.

    Returns
    -------
    xarray.Dataset
        Dims ``step``, ``head``, ``feature`` (token entries x1..xd, y), ``d_head``,
        ``context_length``. Variables ``W_Q``, ``W_K``, ``W_V`` (step, head, feature,
        d_head), ``W_O`` (step, head, d_head), ``train_loss`` (step; mean over the steps
        since the previous checkpoint), ``test_loss`` (step, context_length); coordinate
        ``wall_seconds`` (step): training time until the checkpoint. Attrs: method, params,
        seed, versions, citation, train_seconds (wall), train_cpu_seconds (this process), cancelled.

    References
    ----------
    J. He, X. Pan, S. Chen and Z. Yang, ICML 2025.
    """
    n_heads = check_int("n_heads", n_heads, low=1, high=64)
    d = check_int("d", d, low=1, high=256)
    context_length = check_int("context_length", context_length, low=1)
    noise_var = check_float("noise_var", noise_var, low=0.0)
    lr = check_float("lr", lr, low=0.0)
    batch_size = check_int("batch_size", batch_size, low=1)
    steps = check_int("steps", steps, low=0)
    checkpoint_every = check_int("checkpoint_every", checkpoint_every, low=1)
    init_scale = check_float("init_scale", init_scale, low=0.0)
    seed = check_int("seed", seed)
    test_lengths = sorted({check_int("test_lengths[i]", int(n), low=1) for n in test_lengths})
    n_test = check_int("n_test", n_test, low=1)
    params = {"n_heads": n_heads, "d": d, "context_length": context_length, "noise_var": noise_var,
              "lr": lr, "batch_size": batch_size, "steps": steps,
              "checkpoint_every": checkpoint_every, "init_scale": init_scale,
              "test_lengths": test_lengths, "n_test": n_test}

    model = ICLAttention(d, n_heads, init_scale=init_scale, seed=seed)
    optimiser = torch.optim.Adam(model.parameters(), lr=lr)
    data_gen = torch.Generator().manual_seed(int(seed) + 1)
    tests = {L: sample_regression_prompts(n_test, L, d, noise_var=noise_var, seed=int(seed) + 10_000 + L)
             for L in test_lengths}

    log, test_losses = CheckpointLog(), []

    def checkpoint(step: int) -> None:
        with torch.no_grad():
            test_losses.append([float(((model(t["X"], t["y"], t["x_q"]) - t["y_q"]) ** 2).mean())
                                for t in tests.values()])
        log.record(step, model.weights())

    def step_loss(_step: int) -> torch.Tensor:
        batch = sample_regression_prompts(batch_size, context_length, d, noise_var=noise_var,
                                          generator=data_gen)
        return ((model(batch["X"], batch["y"], batch["x_q"]) - batch["y_q"]) ** 2).mean()

    cancelled = run_training_steps(steps, step_loss, optimiser, losses=log.running,
                                   checkpoint=checkpoint, checkpoint_every=checkpoint_every,
                                   progress=progress)
    return _run_dataset(log.snapshots, log.steps, log.train_loss, test_losses, test_lengths,
                        training_attrs("linear_icl", params, seed, CITATION,
                                       **log.timing_attrs(cancelled)),
                        wall_seconds=log.wall_seconds)


def _run_dataset(snapshots, steps, train_losses, test_losses, test_lengths, attrs,
                 wall_seconds=None) -> xr.Dataset:
    H, D = snapshots[0]["W_Q"].shape[:2]
    features = [f"x{i + 1}" for i in range(D - 1)] + ["y"]

    def stack(name):
        return np.stack([s[name] for s in snapshots]).astype(np.float32)

    dims = ("step", "head", "feature", "d_head")
    return xr.Dataset(
        {"W_Q": (dims, stack("W_Q")), "W_K": (dims, stack("W_K")), "W_V": (dims, stack("W_V")),
         "W_O": (("step", "head", "d_head"), stack("W_O")),
         "train_loss": (("step",), np.asarray(train_losses, dtype=np.float64)),
         "test_loss": (("step", "context_length"), np.asarray(test_losses, dtype=np.float64))},
        coords={"step": np.asarray(steps, dtype=np.int64), "head": np.arange(H),
                "feature": features, "d_head": np.arange(D),
                "context_length": np.asarray(test_lengths, dtype=np.int64),
                "wall_seconds": ("step", np.asarray(wall_seconds if wall_seconds is not None
                                                    else [np.nan] * len(steps), dtype=np.float64))},
        attrs=attrs,
    )


def icl_run_from_models(models: Sequence[ICLAttention], *, steps: Sequence[int] | None = None,
                        noise_var: float = DEFAULTS["noise_var"],
                        test_lengths: Sequence[int] = TEST_LENGTHS, n_test: int = 2048,
                        seed: int = 0) -> xr.Dataset:
    """A run Dataset (the layout of `train_linear_icl`) holding the given models, e.g.
    hand-set weights, one checkpoint each, with their test losses."""
    models = list(models)
    if not models or not all(isinstance(m, ICLAttention) for m in models):
        raise InputError("`models` must be a non-empty list of ICLAttention models.")
    steps = list(range(len(models))) if steps is None else [int(s) for s in steps]
    test_lengths = sorted({check_int("test_lengths[i]", int(n), low=1) for n in test_lengths})
    d = models[0].d
    tests = [sample_regression_prompts(n_test, L, d, noise_var=noise_var, seed=seed + 10_000 + L)
             for L in test_lengths]
    losses = []
    with torch.no_grad():
        for m in models:
            losses.append([float(((m(t["X"], t["y"], t["x_q"]) - t["y_q"]) ** 2).mean()) for t in tests])
    params = {"d": d, "n_heads": models[0].n_heads, "noise_var": noise_var,
              "test_lengths": test_lengths, "n_test": n_test, "from_models": True}
    return _run_dataset([m.weights() for m in models], steps, [float("nan")] * len(models), losses,
                        test_lengths, training_attrs("linear_icl", params, seed, CITATION))


def _check_run(run: Any) -> xr.Dataset:
    return check_training_run(run, trainer="train_linear_icl", kind="linear-ICL",
                              variables=("W_Q", "W_K", "W_V", "W_O"))


def icl_model(run: xr.Dataset, step: int) -> ICLAttention:
    """The model of ``run`` at checkpoint ``step``."""
    run = _check_run(run)
    at = run.sel(step=check_checkpoint_step(run, step))
    return ICLAttention.from_weights(at["W_Q"].values, at["W_K"].values, at["W_V"].values,
                                     at["W_O"].values)
