"""Training the parity RNN and the run Dataset: `train_parity_rnn` (the paper's recipe, weights
kept at checkpoints along a ``step`` dimension), a run made of given networks
(`parity_run_from_models`) and the network of a run at one checkpoint (`parity_model`).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import xarray as xr
from torch import nn

from explorer._checks import InputError, check_choice, check_float, check_int
from explorer.analyses._training import check_checkpoint_step, check_training_run
from explorer.analyses.parity.network import DEFAULTS, ParityRNN, ProgressCallback, _attrs, parity_strings

__all__ = ["train_parity_rnn", "parity_model", "parity_run_from_models", "BATCHINGS"]

BATCHINGS = ("per-length", "uniform")
"""How `train_parity_rnn` forms minibatches (see its ``batching``)."""


#: The optimisers `train_parity_rnn` accepts, by the name its ``optimizer`` option takes.
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,    # plain SGD, no momentum
    "adam": lambda params, lr: torch.optim.Adam(params, lr=lr, amsgrad=True),
}


def train_parity_rnn(
    *,
    hidden_size: int = DEFAULTS["hidden_size"],
    gain: float = DEFAULTS["gain"],
    lr: float = DEFAULTS["lr"],
    optimizer: str = DEFAULTS["optimizer"],
    batch_size: int = DEFAULTS["batch_size"],
    epochs: int = DEFAULTS["epochs"],
    max_length: int = DEFAULTS["max_length"],
    checkpoint_every: int = DEFAULTS["checkpoint_every"],
    seed: int = DEFAULTS["seed"],
    batching: str = "per-length",
    progress: ProgressCallback | None = None,
) -> xr.Dataset:
    """Train the parity RNN on every binary string of length 1..max_length; keep checkpoints.

    The paper's recipe: targets are the one-hot parity of each whole string (many-to-one),
    loss the mean squared error of the readout after the last symbol. As in the paper's
    code, where each length is its own data set, a minibatch holds strings of one length:
    the 2 strings of length 1 make one batch that weighs as much as a batch of 128 strings
    of length 10. Short strings thus carry much of the gradient, which is what lets the
    network learn parity bit by bit; uniform batches over all lengths stall on the 0.25
    loss plateau.

    Parameters
    ----------
    hidden_size : int, default=100
    gain : float, default=0.1
        Initialisation scale (small gain gives the rich, merging regime).
    lr : float, default=0.02
    batch_size : int, default=128
    epochs : int, default=1000
    max_length : int, default=10
        Train on all 2**(max_length+1) - 2 strings of length 1..max_length.
    batching : {"per-length", "uniform"}, default="per-length"
        ``"per-length"``: every minibatch holds strings of one length (the paper's code);
        ``"uniform"``: minibatches drawn from all strings shuffled together, each string
        read out after its own last symbol (the control that shows why the recipe matters;
        recorded in the run's params only when chosen, so default runs keep their key).
    checkpoint_every : int, default=10
        Store the weights every this many epochs (and at step 0).
    seed : int, default=0
        Seeds the initialisation and the minibatch order.
    progress : callable, optional
        Called as ``progress(epochs_done, epochs)`` after each epoch; returning ``False``
        stops training early (the Dataset then holds the checkpoints so far and
        ``attrs["cancelled"]`` is True).

    Returns
    -------
    xarray.Dataset
        Dims ``step`` (optimiser steps at the checkpoints), ``unit``, ``src_unit``,
        ``symbol``, ``output``. Variables ``W_ih`` (step, unit, symbol), ``W_hh`` (step,
        unit, src_unit), ``b_h`` (step, unit), ``W_out`` (step, output, unit), ``b_out``
        (step, output), ``h0`` (unit), ``train_loss`` and ``train_accuracy`` (step, on the
        whole training set). Coordinates ``epoch`` and ``wall_seconds`` (training time until
        the checkpoint) over step. Attrs: method, params, seed, versions, citation,
        train_seconds, cancelled.

    References
    ----------
    L. van Rossem and A. M. Saxe, ICML 2025.
    """
    hidden_size = check_int("hidden_size", hidden_size, low=1, high=4096)
    gain = check_float("gain", gain, low=0.0)
    lr = check_float("lr", lr, low=0.0)
    check_choice("optimizer", optimizer, OPTIMIZERS)
    batch_size = check_int("batch_size", batch_size, low=1)
    epochs = check_int("epochs", epochs, low=0)
    max_length = check_int("max_length", max_length, low=1, high=16)
    checkpoint_every = check_int("checkpoint_every", checkpoint_every, low=1)
    seed = check_int("seed", seed)
    check_choice("batching", batching, BATCHINGS)
    params = {"hidden_size": hidden_size, "gain": gain, "lr": lr, "optimizer": optimizer,
              "batch_size": batch_size,
              "epochs": epochs, "max_length": max_length, "checkpoint_every": checkpoint_every}
    if batching != "per-length":
        params["batching"] = batching

    symbols, last, parity, target = _training_set(max_length)
    n = symbols.shape[0]

    model = ParityRNN(hidden_size, gain=gain, seed=seed)
    optimiser = OPTIMIZERS[optimizer](model.parameters(), lr=lr)
    order_gen = torch.Generator().manual_seed(int(seed) + 1)
    by_length = [torch.nonzero(last == k - 1).flatten() for k in range(1, max_length + 1)]
    if batching == "uniform":
        by_length = [torch.arange(n)]                 # one pool: batches mix the lengths
    steps_per_epoch = sum(-(-len(rows) // batch_size) for rows in by_length)

    snapshots: list[dict[str, np.ndarray]] = []
    epoch_of: list[int] = []
    metrics: list[tuple[float, float]] = []
    walls: list[float] = []
    start = time.perf_counter()

    def checkpoint(epoch: int) -> None:
        walls.append(time.perf_counter() - start)  # training time so far, before measuring
        metrics.append(_training_metrics(model, symbols, last, parity, target))
        snapshots.append(model.weights())
        epoch_of.append(epoch)

    cancelled = False
    with torch.enable_grad():
        checkpoint(0)
        for epoch in range(1, epochs + 1):
            for idx in _epoch_batches(by_length, batch_size, order_gen):
                length = int(last[idx].max()) + 1
                out, _ = model(symbols[idx, :length])                  # [batch, length, 2]
                final = out[torch.arange(len(idx)), last[idx]]         # after each string's end
                loss = ((final - target[idx]) ** 2).mean()
                optimiser.zero_grad(set_to_none=True)
                loss.backward()
                optimiser.step()
            if epoch % checkpoint_every == 0 or epoch == epochs:
                checkpoint(epoch)
            if progress is not None and progress(epoch, epochs) is False:
                cancelled = True
                if epoch_of[-1] != epoch:
                    checkpoint(epoch)
                break
    seconds = time.perf_counter() - start
    return _run_dataset(
        snapshots, [e * steps_per_epoch for e in epoch_of], epoch_of, metrics,
        _attrs("parity_rnn", params, seed, train_seconds=round(seconds, 3), cancelled=cancelled,
               steps_per_epoch=steps_per_epoch, n_train=n), wall_seconds=walls)


def _epoch_batches(by_length: list[torch.Tensor], batch_size: int,
                   gen: torch.Generator) -> list[torch.Tensor]:
    """One epoch of minibatches: each holds strings of one length (shuffled within the
    length), and the batches of all lengths come in a shuffled order."""
    batches = []
    for rows in by_length:
        perm = rows[torch.randperm(len(rows), generator=gen)]
        batches.extend(perm[i:i + batch_size] for i in range(0, len(perm), batch_size))
    order = torch.randperm(len(batches), generator=gen)
    return [batches[int(i)] for i in order]


def _training_set(max_length: int):
    symbols_np, lengths_np = parity_strings(max_length)
    symbols = torch.as_tensor(symbols_np, dtype=torch.long)           # [string, pos]
    last = torch.as_tensor(lengths_np - 1)                            # [string]
    parity = torch.as_tensor(symbols_np.sum(axis=1) % 2)              # padding adds 0
    target = nn.functional.one_hot(parity, 2).float()                 # [string, 2]
    return symbols, last, parity, target


def _training_metrics(model: ParityRNN, symbols, last, parity, target) -> tuple[float, float]:
    """MSE and accuracy of the readout after the last symbol, over the whole training set."""
    with torch.no_grad():
        out, _ = model(symbols)
        final = out[torch.arange(symbols.shape[0]), last]             # [string, 2]
        loss = float(((final - target) ** 2).mean())
        accuracy = float((final.argmax(-1) == parity).float().mean())
    return loss, accuracy


def _run_dataset(snapshots, steps, epochs, metrics, attrs, wall_seconds=None) -> xr.Dataset:
    def stack(name: str) -> np.ndarray:
        return np.stack([s[name] for s in snapshots]).astype(np.float32)

    hidden_size = snapshots[0]["h0"].shape[0]
    ds = xr.Dataset(
        {
            "W_ih": (("step", "unit", "symbol"), stack("W_ih")),
            "W_hh": (("step", "unit", "src_unit"), stack("W_hh")),
            "b_h": (("step", "unit"), stack("b_h")),
            "W_out": (("step", "output", "unit"), stack("W_out")),
            "b_out": (("step", "output"), stack("b_out")),
            "h0": (("unit",), snapshots[0]["h0"].astype(np.float32)),
            "train_loss": (("step",), np.asarray([m[0] for m in metrics])),
            "train_accuracy": (("step",), np.asarray([m[1] for m in metrics])),
        },
        coords={"step": np.asarray(steps, dtype=np.int64),
                "epoch": ("step", np.asarray(epochs, dtype=np.int64)),
                "wall_seconds": ("step", np.asarray(wall_seconds if wall_seconds is not None
                                                    else [np.nan] * len(steps), dtype=np.float64)),
                "unit": np.arange(hidden_size), "src_unit": np.arange(hidden_size),
                "symbol": [0, 1], "output": [0, 1]},
        attrs=attrs,
    )
    ds["train_loss"].attrs["long_name"] = "training MSE (whole training set)"
    return ds


def parity_run_from_models(models: Sequence[ParityRNN], *, steps: Sequence[int] | None = None,
                           max_length: int = DEFAULTS["max_length"]) -> xr.Dataset:
    """A run Dataset (the layout of `train_parity_rnn`) holding the given networks.

    For analysing networks made by hand or elsewhere with the same tools: one checkpoint
    per network, at ``steps`` (default 0, 1, 2, ...). ``train_loss`` and
    ``train_accuracy`` are measured on the strings of length 1..max_length.
    """
    models = list(models)
    if not models or not all(isinstance(m, ParityRNN) for m in models):
        raise InputError("`models` must be a non-empty list of ParityRNN networks.")
    steps = list(range(len(models))) if steps is None else [check_int("steps[i]", s) for s in steps]
    if len(steps) != len(models) or sorted(set(steps)) != steps:
        raise InputError(f"`steps` must be {len(models)} increasing ints, one per model; got {steps}.")
    data = _training_set(check_int("max_length", max_length, low=1, high=16))
    metrics = [_training_metrics(m, *data) for m in models]
    return _run_dataset([m.weights() for m in models], steps, steps, metrics,
                        _attrs("parity_rnn", {"max_length": max_length, "from_models": True}, 0))


def _check_run(run: Any) -> xr.Dataset:
    return check_training_run(run, trainer="train_parity_rnn", kind="parity",
                              variables=("W_ih", "W_hh", "b_h", "W_out", "b_out", "h0"),
                              dims=("step",))


def parity_model(run: xr.Dataset, step: int) -> ParityRNN:
    """The network of ``run`` at checkpoint ``step``."""
    run = _check_run(run)
    step = check_checkpoint_step(run, step)
    at = run.sel(step=step)
    return ParityRNN.from_weights(at["W_ih"].values, at["W_hh"].values, at["b_h"].values,
                                  at["W_out"].values, at["b_out"].values, run["h0"].values)
