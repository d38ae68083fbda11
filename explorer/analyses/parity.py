"""Streaming parity: a ReLU RNN trained from scratch, and the automaton it develops.

van Rossem & Saxe (ICML 2025) train a small-init recurrent network on the parity of
every binary string of length 1-10. Early in training the hidden states of different
strings spread apart (a tree that memorises the training set); later, states whose
continuations agree merge, and the network collapses onto a 2-state automaton. From then
on it computes parity for strings of any length ("infinite generalisation").

This module trains the network and stores its weights at checkpoints as one
``xarray.Dataset`` with a ``step`` dimension (`train_parity_rnn`), and reads it back at
any checkpoint: hidden states and their PCA (`parity_hidden_states`, `parity_hidden_pca`),
the automaton of merged states and its Hopcroft minimisation (`parity_automaton`), the
automaton size over training (`parity_automaton_sizes`), and accuracy on long strings
(`parity_long_accuracy`). `parity_run` caches a run in the `ActivationStore`; the seed-0
run with the default settings comes with the project (`SHIPPED_RUN`, float16 weights and
their analysis in one safetensors file), so it is read, not trained, on first use.

References
----------
L. van Rossem and A. M. Saxe, "Algorithm Development in Neural Networks: Insights from
the Streaming Parity Task", ICML 2025.
"""
from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xarray as xr
from torch import nn

from explorer._checks import InputError, check_choice, check_float, check_int
from explorer.analyses._training import (datasets_from_safetensors, datasets_to_safetensors,
                                         stored_training_run, training_versions)
from explorer.analyses.automata import Automaton, merge_states, minimise_automaton

__all__ = [
    "CITATION",
    "DEFAULTS",
    "ParityRNN",
    "parity_strings",
    "train_parity_rnn",
    "parity_model",
    "parity_run_from_models",
    "parity_hidden_states",
    "parity_hidden_pca",
    "parity_automaton",
    "parity_automaton_sizes",
    "parity_long_accuracy",
    "parity_run",
    "SHIPPED_RUN",
    "save_parity_run_safetensors",
    "load_parity_run_safetensors",
    "parity_analysis",
    "stored_parity_analysis",
    "parity_phase_diagram",
    "stored_parity_phase_diagram",
    "phase_summary",
    "analysis_summary",
]

CITATION = ("L. van Rossem and A. M. Saxe, \"Algorithm Development in Neural Networks: Insights "
            "from the Streaming Parity Task\", ICML 2025.")

#: The paper's setting (METHODS.md section 9): ReLU RNN, 100 units, Xavier-normal gain 0.1,
#: h0 = ones, MSE on a one-hot parity target, SGD lr 0.02, batch 128, strings of length 1-10.
DEFAULTS: dict[str, Any] = {
    "hidden_size": 100,
    "gain": 0.1,
    "lr": 0.02,
    "optimizer": "sgd",
    "batch_size": 128,
    "epochs": 1000,
    "max_length": 10,
    "checkpoint_every": 10,
    "seed": 0,
}

#: Long-string lengths of the generalisation test (up to 10,000, as in the paper).
LONG_LENGTHS: tuple[int, ...] = (10, 25, 50, 100, 250, 1000, 2500, 10000)

ProgressCallback = Callable[[int, int], Any]

_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,    # plain SGD, no momentum
    "adam": lambda params, lr: torch.optim.Adam(params, lr=lr, amsgrad=True),
}


# -- model ----------------------------------------------------------------------------

class ParityRNN(nn.Module):
    """One-layer ReLU RNN with a linear readout to the two parity classes.

    ``h_t = relu(W_ih x_t + W_hh h_{t-1} + b_h)``, ``y_t = W_out h_t + b_out``, with one-hot
    inputs ``x_t`` and a fixed start state ``h0`` (ones in the paper).

    Parameters
    ----------
    hidden_size : int, default=100
    gain : float, default=0.1
        Xavier-normal gain of both weight matrices and the readout; biases start at 0.
    seed : int, default=0
        Seed of the initialisation.
    """

    def __init__(self, hidden_size: int = 100, *, gain: float = 0.1, seed: int = 0) -> None:
        super().__init__()
        check_int("hidden_size", hidden_size, low=1)
        gain = check_float("gain", gain, low=0.0)
        self.rnn = nn.RNN(2, hidden_size, num_layers=1, nonlinearity="relu", batch_first=True)
        self.readout = nn.Linear(hidden_size, 2)
        self.register_buffer("h0", torch.ones(hidden_size))
        gen = torch.Generator().manual_seed(int(seed))
        with torch.no_grad():
            for par in self.parameters():
                if par.ndim == 2:  # Xavier normal: std = gain * sqrt(2 / (fan_in + fan_out))
                    std = gain * (2.0 / (par.shape[0] + par.shape[1])) ** 0.5
                    par.copy_(torch.randn(par.shape, generator=gen) * std)
                else:
                    par.zero_()

    @property
    def hidden_size(self) -> int:
        return int(self.h0.shape[0])

    def forward(self, symbols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states and readouts after every symbol.

        Parameters
        ----------
        symbols : torch.Tensor of int, shape (batch, time)
            Binary strings (0/1), one per row.

        Returns
        -------
        outputs : torch.Tensor, shape (batch, time, 2)
        hidden : torch.Tensor, shape (batch, time, hidden_size)
        """
        x = nn.functional.one_hot(symbols.long(), 2).to(self.h0.dtype)  # [batch, time, 2]
        h0 = self.h0.expand(1, symbols.shape[0], -1).contiguous()       # [1, batch, hidden]
        hidden, _ = self.rnn(x, h0)                                      # [batch, time, hidden]
        return self.readout(hidden), hidden

    def weights(self) -> dict[str, np.ndarray]:
        """The weights as numpy arrays (the two RNN biases summed into ``b_h``)."""
        r = self.rnn
        return {
            "W_ih": r.weight_ih_l0.detach().numpy().copy(),
            "W_hh": r.weight_hh_l0.detach().numpy().copy(),
            "b_h": (r.bias_ih_l0 + r.bias_hh_l0).detach().numpy().copy(),
            "W_out": self.readout.weight.detach().numpy().copy(),
            "b_out": self.readout.bias.detach().numpy().copy(),
            "h0": self.h0.detach().numpy().copy(),
        }

    @classmethod
    def from_weights(cls, W_ih, W_hh, b_h, W_out, b_out, h0=None) -> "ParityRNN":
        """A network with the given weights (shapes as in `weights`); ``h0`` defaults to ones."""
        W_hh = torch.as_tensor(np.asarray(W_hh), dtype=torch.float32)
        n = W_hh.shape[0]
        shapes = {"W_ih": (n, 2), "W_hh": (n, n), "b_h": (n,), "W_out": (2, n), "b_out": (2,)}
        given = {"W_ih": W_ih, "W_hh": W_hh, "b_h": b_h, "W_out": W_out, "b_out": b_out}
        for name, value in given.items():
            if tuple(np.shape(value)) != shapes[name]:
                raise InputError(f"`{name}` must have shape {shapes[name]}; got {tuple(np.shape(value))}.")
        model = cls(n, gain=0.0)
        with torch.no_grad():
            model.rnn.weight_ih_l0.copy_(torch.as_tensor(np.asarray(W_ih), dtype=torch.float32))
            model.rnn.weight_hh_l0.copy_(W_hh)
            model.rnn.bias_ih_l0.copy_(torch.as_tensor(np.asarray(b_h), dtype=torch.float32))
            model.rnn.bias_hh_l0.zero_()
            model.readout.weight.copy_(torch.as_tensor(np.asarray(W_out), dtype=torch.float32))
            model.readout.bias.copy_(torch.as_tensor(np.asarray(b_out), dtype=torch.float32))
            if h0 is not None:
                if tuple(np.shape(h0)) != (n,):
                    raise InputError(f"`h0` must have shape {(n,)}; got {tuple(np.shape(h0))}.")
                model.h0.copy_(torch.as_tensor(np.asarray(h0), dtype=torch.float32))
        return model


# -- data -----------------------------------------------------------------------------

def parity_strings(max_length: int, *, min_length: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Every binary string of length ``min_length..max_length``, padded with zeros.

    Strings are ordered by length, then as binary numbers (first symbol most significant),
    so the string of length ``l`` and value ``v`` sits at row ``2**l - 2**min_length + v``.

    Returns
    -------
    symbols : numpy.ndarray of int8, shape (n_strings, max_length)
    lengths : numpy.ndarray of int64, shape (n_strings,)
    """
    max_length = check_int("max_length", max_length, low=1, high=20)
    min_length = check_int("min_length", min_length, low=1, high=max_length)
    rows, lengths = [], []
    for length in range(min_length, max_length + 1):
        values = np.arange(2**length)
        bits = (values[:, None] >> np.arange(length - 1, -1, -1)[None, :]) & 1  # [string, pos]
        padded = np.zeros((2**length, max_length), dtype=np.int8)
        padded[:, :length] = bits
        rows.append(padded)
        lengths.append(np.full(2**length, length))
    return np.concatenate(rows), np.concatenate(lengths).astype(np.int64)


def _prefix_names(symbols: np.ndarray, lengths: np.ndarray) -> list[str]:
    return ["".join(str(int(b)) for b in row[:n]) for row, n in zip(symbols, lengths)]


# -- training -------------------------------------------------------------------------

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
    check_choice("optimizer", optimizer, _OPTIMIZERS)
    batch_size = check_int("batch_size", batch_size, low=1)
    epochs = check_int("epochs", epochs, low=0)
    max_length = check_int("max_length", max_length, low=1, high=16)
    checkpoint_every = check_int("checkpoint_every", checkpoint_every, low=1)
    seed = check_int("seed", seed)
    params = {"hidden_size": hidden_size, "gain": gain, "lr": lr, "optimizer": optimizer,
              "batch_size": batch_size,
              "epochs": epochs, "max_length": max_length, "checkpoint_every": checkpoint_every}

    symbols, last, parity, target = _training_set(max_length)
    n = symbols.shape[0]

    model = ParityRNN(hidden_size, gain=gain, seed=seed)
    optimiser = _OPTIMIZERS[optimizer](model.parameters(), lr=lr)
    order_gen = torch.Generator().manual_seed(int(seed) + 1)
    by_length = [torch.nonzero(last == k - 1).flatten() for k in range(1, max_length + 1)]
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
                length = int(last[idx[0]]) + 1
                out, _ = model(symbols[idx, :length])                  # [batch, length, 2]
                loss = ((out[:, -1] - target[idx]) ** 2).mean()
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


def _attrs(method: str, params: dict, seed: int, **extra: Any) -> dict:
    return {"method": method, "params": params, "seed": int(seed),
            "versions": training_versions(), "citation": CITATION, **extra}


def _check_run(run: Any) -> xr.Dataset:
    if not isinstance(run, xr.Dataset):
        raise TypeError(f"`run` must be an xarray.Dataset from train_parity_rnn; got {type(run).__name__}.")
    missing = [v for v in ("W_ih", "W_hh", "b_h", "W_out", "b_out", "h0") if v not in run]
    if missing or "step" not in run.dims:
        raise InputError(f"`run` is not a parity training run (missing {', '.join(missing) or 'step'}); "
                         "make one with train_parity_rnn.")
    return run


def _check_step(run: xr.Dataset, step: int) -> int:
    steps = run["step"].values
    step = check_int("step", step)
    if step not in steps:
        shown = ", ".join(str(int(x)) for x in steps[:3]) + (f", ..., {int(steps[-1])}" if len(steps) > 3 else "")
        raise InputError(f"`step` must be a checkpoint step of the run ({shown}); got {step}.")
    return step


def parity_model(run: xr.Dataset, step: int) -> ParityRNN:
    """The network of ``run`` at checkpoint ``step``."""
    run = _check_run(run)
    step = _check_step(run, step)
    at = run.sel(step=step)
    return ParityRNN.from_weights(at["W_ih"].values, at["W_hh"].values, at["b_h"].values,
                                  at["W_out"].values, at["b_out"].values, run["h0"].values)


# -- hidden states --------------------------------------------------------------------

def _hidden_of_prefixes(model: ParityRNN, max_length: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Hidden state and readout after every string of length 0..max_length (row 0 = empty).

    Every string of length < max_length is a prefix of the length-max_length strings, so
    one forward pass over those 2**max_length strings gives all states.
    """
    full, _ = parity_strings(max_length, min_length=max_length)       # [2**n, n]
    with torch.no_grad():
        out, hidden = model(torch.as_tensor(full, dtype=torch.long))   # [2**n, n, *]
        h0 = model.h0[None]
        out0 = model.readout(h0)
    n_states = 2 ** (max_length + 1) - 1
    states = np.empty((n_states, model.hidden_size), dtype=np.float64)
    outputs = np.empty((n_states, 2), dtype=np.float64)
    states[0], outputs[0] = h0[0].numpy(), out0[0].numpy()
    values = np.arange(2**max_length)
    for length in range(1, max_length + 1):
        prefix_value = values >> (max_length - length)                # [2**n]
        rows = 2**length - 1 + prefix_value                            # state index of the prefix
        states[rows] = hidden[:, length - 1].numpy()
        outputs[rows] = out[:, length - 1].numpy()
    names = [""]
    for length in range(1, max_length + 1):
        names += [format(v, f"0{length}b") for v in range(2**length)]
    return states, outputs, names


def parity_hidden_states(run: xr.Dataset, step: int, *, max_length: int = 8) -> xr.Dataset:
    """Hidden state after every string of length 0..max_length at one checkpoint.

    Returns
    -------
    xarray.Dataset
        ``hidden`` (prefix, unit) and ``readout`` (prefix, output); coordinates ``string``
        (the prefix as '0'/'1' text, '' for the start state), ``length`` and ``parity``
        (prefix). Prefixes are ordered by length, then as binary numbers.
    """
    max_length = check_int("max_length", max_length, low=1, high=12)
    model = parity_model(run, step)
    states, outputs, names = _hidden_of_prefixes(model, max_length)
    return xr.Dataset(
        {"hidden": (("prefix", "unit"), states.astype(np.float32)),
         "readout": (("prefix", "output"), outputs.astype(np.float32))},
        coords={"prefix": np.arange(len(names)), "string": ("prefix", np.asarray(names, dtype="U")),
                "length": ("prefix", np.asarray([len(s) for s in names])),
                "parity": ("prefix", np.asarray([s.count("1") % 2 for s in names])),
                "unit": np.arange(model.hidden_size), "output": [0, 1]},
        attrs=_attrs("parity_hidden_states", {"step": int(step), "max_length": max_length},
                     run.attrs.get("seed", 0)),
    )


def parity_hidden_pca(run: xr.Dataset, step: int, *, max_length: int = 8,
                      n_components: int = 2) -> xr.Dataset:
    """Principal components of the hidden states at one checkpoint (for the PCA view).

    Signs are fixed so that each component's largest loading is positive, so the picture
    does not flip between neighbouring checkpoints for no reason.

    Returns
    -------
    xarray.Dataset
        ``pc`` (prefix, component) and ``explained_variance_ratio`` (component); the
        prefix coordinates of `parity_hidden_states`.
    """
    n_components = check_int("n_components", n_components, low=1, high=10)
    hs = parity_hidden_states(run, step, max_length=max_length)
    h = hs["hidden"].values.astype(np.float64)
    h = np.where(np.isfinite(h), h, 0.0)
    centred = h - h.mean(axis=0)
    _, s, vt = np.linalg.svd(centred, full_matrices=False)
    k = min(n_components, vt.shape[0])
    comps = vt[:k]                                                     # [component, unit]
    signs = np.sign(comps[np.arange(k), np.abs(comps).argmax(axis=1)])
    comps = comps * np.where(signs == 0, 1, signs)[:, None]
    total = float((s**2).sum())
    ratio = (s[:k] ** 2) / total if total > 0 else np.zeros(k)
    return xr.Dataset(
        {"pc": (("prefix", "component"), (centred @ comps.T).astype(np.float32)),
         "explained_variance_ratio": (("component",), ratio)},
        coords={**{c: hs.coords[c] for c in ("prefix", "string", "length", "parity")},
                "component": np.arange(1, k + 1)},
        attrs=_attrs("parity_hidden_pca", {"step": int(step), "max_length": max_length,
                                           "n_components": n_components}, run.attrs.get("seed", 0)),
    )


# -- automaton ------------------------------------------------------------------------

def _extract_automaton(states: np.ndarray, outputs: np.ndarray, max_length: int,
                       threshold: float) -> dict[str, Any]:
    """Merge states, build the transition table of the groups, minimise it."""
    finite_states = states[np.isfinite(states).all(axis=1)]
    spread = float(np.linalg.norm(finite_states.std(axis=0))) if len(finite_states) else 0.0
    merge_distance = threshold * spread
    group = merge_states(states, merge_distance)                      # [prefix]
    n_groups = int(group.max()) + 1
    # Transitions: prefix s = p + a goes from group(p) to group(s) on symbol a.
    votes = np.zeros((n_groups, 2, n_groups), dtype=np.int64)
    for length in range(1, max_length + 1):
        idx = np.arange(2**length - 1, 2 ** (length + 1) - 1)         # prefixes of this length
        value = idx - (2**length - 1)
        parent = np.where(length == 1, 0, 2 ** (length - 1) - 1 + (value >> 1))
        symbol = value & 1
        np.add.at(votes, (group[parent], symbol, group[idx]), 1)
    has = votes.sum(axis=2) > 0                                        # [group, symbol]
    transitions = np.where(has, votes.argmax(axis=2), -1)
    # Sequences that disagree with the majority transition (0 for a deterministic graph).
    conflicts = int((votes.sum(axis=2) - votes.max(axis=2)).sum())
    _, first = np.unique(group, return_index=True)                   # first member per group
    readout = np.nan_to_num(outputs[first], nan=0.0)
    out_class = readout.argmax(axis=1)
    merged = Automaton(transitions, out_class, initial=int(group[0]))
    minimal, block_of = minimise_automaton(merged)
    size = np.bincount(group, minlength=n_groups)
    return {"group": group, "transitions": transitions, "outputs": out_class, "size": size,
            "merged": merged, "minimal": minimal, "block_of": block_of, "conflicts": conflicts,
            "merge_distance": merge_distance, "first": first}


def parity_automaton(run: xr.Dataset, step: int, *, max_length: int = 8,
                     threshold: float = 0.01) -> xr.Dataset:
    """The automaton of merged hidden states at one checkpoint, and its minimal form.

    States of all strings of length 0..max_length are grouped greedily (`merge_states`)
    with merge distance ``threshold * ||std(h)||`` (std over the states, per unit; the
    paper's ``thresh_factor`` 0.01). The transition on symbol ``a`` from a group goes to
    the group of ``p + a`` for its prefixes ``p`` (majority if they disagree); a group's
    output is the readout class of its first member. The automaton is *finite* when every
    reachable group has both transitions; strings of length max_length have none unless
    they merged with shorter ones. Hopcroft minimisation gives the minimal automaton.

    Parameters
    ----------
    run : xarray.Dataset
        From `train_parity_rnn`.
    step : int
        A checkpoint step of ``run``.
    max_length : int, default=8
        Longest analysed string.
    threshold : float, default=0.01
        Merge distance as a fraction of the state spread.

    Returns
    -------
    xarray.Dataset
        Merged automaton: ``transitions`` (state, symbol; -1 undefined), ``output``,
        ``n_members`` and ``minimal_state`` (state); minimal automaton: ``min_transitions``
        (min_state, symbol), ``min_output`` (min_state); ``state_of`` (prefix) with the
        prefix coordinates of `parity_hidden_states`. Attrs: ``n_states``,
        ``n_states_minimal``, ``finite``, ``initial``, ``conflicts``, ``merge_distance``.

    References
    ----------
    L. van Rossem and A. M. Saxe, ICML 2025 (automaton extraction and Hopcroft reduction).
    """
    max_length = check_int("max_length", max_length, low=1, high=12)
    threshold = check_float("threshold", threshold, low=0.0)
    model = parity_model(run, step)
    states, outputs, names = _hidden_of_prefixes(model, max_length)
    a = _extract_automaton(states, outputs, max_length, threshold)
    merged, minimal = a["merged"], a["minimal"]
    return xr.Dataset(
        {"transitions": (("state", "symbol"), a["transitions"]),
         "output": (("state",), a["outputs"]),
         "n_members": (("state",), a["size"]),
         "minimal_state": (("state",), a["block_of"]),
         "min_transitions": (("min_state", "symbol"), minimal.transitions),
         "min_output": (("min_state",), minimal.outputs),
         "state_of": (("prefix",), a["group"])},
        coords={"state": np.arange(merged.n_states), "min_state": np.arange(minimal.n_states),
                "symbol": [0, 1], "prefix": np.arange(len(names)),
                "string": ("prefix", np.asarray(names, dtype="U")),
                "length": ("prefix", np.asarray([len(s) for s in names])),
                "parity": ("prefix", np.asarray([s.count("1") % 2 for s in names]))},
        attrs=_attrs("parity_automaton", {"step": int(step), "max_length": max_length,
                                          "threshold": threshold}, run.attrs.get("seed", 0),
                     n_states=merged.n_states, n_states_minimal=minimal.n_states,
                     finite=merged.complete, initial=merged.initial, conflicts=a["conflicts"],
                     merge_distance=a["merge_distance"], citation_hopcroft="J. Hopcroft, 1971."),
    )


def parity_automaton_sizes(run: xr.Dataset, *, max_length: int = 8, threshold: float = 0.01,
                           progress: ProgressCallback | None = None) -> xr.Dataset:
    """Automaton size at every checkpoint: the phase transition to 2 states.

    Returns
    -------
    xarray.Dataset
        Over ``step``: ``n_states`` (merged groups), ``n_states_minimal`` (after Hopcroft),
        ``finite`` (bool), ``conflicts``; and ``mergers`` and ``splits`` between consecutive
        checkpoints, from the change in states (removed r, added a):
        mergers = (2r - a) / 3, splits = (2a - r) / 3 (the paper's counting);
        ``is_parity_automaton``: the minimal automaton is the 2-state parity automaton
        (finite, even start state, each 1 flips the state, each 0 keeps it). Attr
        ``transition_step``: the first checkpoint from which on it stays the parity
        automaton (None if it never settles).
    """
    run = _check_run(run)
    max_length = check_int("max_length", max_length, low=1, high=12)
    threshold = check_float("threshold", threshold, low=0.0)
    steps = run["step"].values
    n_states, n_min, finite, conflicts, mergers, splits, is_parity = [], [], [], [], [], [], []
    previous: set | None = None
    for i, step in enumerate(steps):
        model = parity_model(run, int(step))
        states, outputs, _ = _hidden_of_prefixes(model, max_length)
        a = _extract_automaton(states, outputs, max_length, threshold)
        n_states.append(a["merged"].n_states)
        n_min.append(a["minimal"].n_states)
        finite.append(a["merged"].complete)
        conflicts.append(a["conflicts"])
        is_parity.append(_is_parity_automaton(a["minimal"]))
        # A state is identified by the set of prefixes it holds.
        groups = a["group"]
        current = {frozenset(np.flatnonzero(groups == g).tolist()) for g in range(a["merged"].n_states)}
        if previous is None:
            mergers.append(0.0)
            splits.append(0.0)
        else:
            removed, added = len(previous - current), len(current - previous)
            mergers.append((2 * removed - added) / 3)
            splits.append((2 * added - removed) / 3)
        previous = current
        if progress is not None and progress(i + 1, len(steps)) is False:
            steps = steps[:i + 1]
            break
    finite_arr = np.asarray(finite)
    n_min_arr = np.asarray(n_min)
    settled = np.asarray(is_parity)
    transition = None
    for i in range(len(steps)):
        if settled[i:].all():
            transition = int(steps[i])
            break
    return xr.Dataset(
        {"n_states": (("step",), np.asarray(n_states)),
         "n_states_minimal": (("step",), n_min_arr),
         "finite": (("step",), finite_arr),
         "is_parity_automaton": (("step",), settled),
         "conflicts": (("step",), np.asarray(conflicts)),
         "mergers": (("step",), np.asarray(mergers)),
         "splits": (("step",), np.asarray(splits))},
        coords={"step": steps, "epoch": ("step", run["epoch"].values[:len(steps)])},
        attrs=_attrs("parity_automaton_sizes", {"max_length": max_length, "threshold": threshold},
                     run.attrs.get("seed", 0), transition_step=transition,
                     transition_epoch=None if transition is None else
                     int(run["epoch"].sel(step=transition))),
    )


def _is_parity_automaton(minimal: Automaton) -> bool:
    """True for the 2-state parity automaton: start even (output 0), 0 keeps, 1 flips."""
    return (minimal.n_states == 2 and minimal.outputs.tolist() == [0, 1]
            and minimal.transitions.tolist() == [[0, 1], [1, 0]])


# -- generalisation -------------------------------------------------------------------

def parity_long_accuracy(run: xr.Dataset, *, lengths: Sequence[int] = LONG_LENGTHS,
                         n_strings: int = 20, seed: int = 0, steps: Sequence[int] | None = None,
                         progress: ProgressCallback | None = None) -> xr.Dataset:
    """Accuracy on random strings much longer than the training strings, per checkpoint.

    ``n_strings`` random strings of the longest length are drawn once, as
    ``numpy.random.default_rng(seed).integers(0, 2, (n_strings, max(lengths)), dtype=int8)``; the
    accuracy at length ``l`` is read from the network's output after their first ``l``
    symbols (every prefix of a uniform random string is a uniform random string), so one
    forward pass per checkpoint covers every length.

    Parameters
    ----------
    run : xarray.Dataset
        From `train_parity_rnn`.
    lengths : sequence of int, default=(10, 25, 50, 100, 250, 1000, 2500, 10000)
    n_strings : int, default=20
    seed : int, default=0
    steps : sequence of int, optional
        Checkpoints to test (default: all).

    Returns
    -------
    xarray.Dataset
        ``accuracy`` (step, length) in [0, 1]; ``all_correct`` (step): accuracy 1 at every
        length. Attr ``generalisation_step``: the first checkpoint from which on every
        length is solved (None if never).
    """
    run = _check_run(run)
    lengths = sorted({check_int("lengths[i]", int(n), low=1, high=1_000_000) for n in lengths})
    if not lengths:
        raise InputError("`lengths` must hold at least one length; got none.")
    n_strings = check_int("n_strings", n_strings, low=1)
    seed = check_int("seed", seed)
    steps = run["step"].values if steps is None else np.asarray([_check_step(run, s) for s in steps])
    rng = np.random.default_rng(seed)
    strings = rng.integers(0, 2, size=(n_strings, lengths[-1]), dtype=np.int8)
    parity = np.cumsum(strings, axis=1, dtype=np.int64) % 2            # [string, pos]
    want = parity[:, np.asarray(lengths) - 1]                          # [string, length]
    symbols = torch.as_tensor(strings, dtype=torch.long)
    accuracy = np.empty((len(steps), len(lengths)))
    # Strings per forward: the hidden states of a chunk (float32) stay under ~64 MB.
    hidden_size = int(run.sizes["unit"])
    chunk = max(1, 16_000_000 // (lengths[-1] * hidden_size))
    for i, step in enumerate(steps):
        model = parity_model(run, int(step))
        predicted = np.empty_like(want)
        with torch.no_grad():
            for j in range(0, n_strings, chunk):
                out, _ = model(symbols[j:j + chunk])                   # [chunk, time, 2]
                picked = out[:, torch.as_tensor(lengths) - 1]          # [chunk, length, 2]
                # A diverged state (nan) counts as wrong.
                ok = torch.isfinite(picked).all(-1)
                predicted[j:j + chunk] = np.where(ok.numpy(), picked.argmax(-1).numpy(), -1)
        accuracy[i] = (predicted == want).mean(axis=0)
        if progress is not None and progress(i + 1, len(steps)) is False:
            steps, accuracy = steps[:i + 1], accuracy[:i + 1]
            break
    all_correct = (accuracy == 1.0).all(axis=1)
    generalised = None
    for i in range(len(steps)):
        if all_correct[i:].all():
            generalised = int(steps[i])
            break
    return xr.Dataset(
        {"accuracy": (("step", "length"), accuracy), "all_correct": (("step",), all_correct)},
        coords={"step": np.asarray(steps), "length": np.asarray(lengths),
                "epoch": ("step", run["epoch"].sel(step=np.asarray(steps)).values)},
        attrs=_attrs("parity_long_accuracy", {"lengths": lengths, "n_strings": n_strings},
                     seed, generalisation_step=generalised),
    )


# -- cached runs ----------------------------------------------------------------------

def _run_parts(params: dict[str, Any]) -> dict[str, Any]:
    return {"method": "parity_rnn", "format": 1, **params}


#: The seed-0 run with `DEFAULTS`, shipped with the project: its weights at every checkpoint
#: in float16 and the `parity_analysis` of those float16 weights (``explorer parity train``
#: re-trains it in full precision; `tests/test_parity.py` checks that the two agree).
SHIPPED_RUN = Path(__file__).resolve().parents[2] / "datasets" / "dynamics" / "parity_seed0.safetensors"

_WEIGHTS = ("W_ih", "W_hh", "b_h", "W_out", "b_out")


def save_parity_run_safetensors(run: xr.Dataset, path: str | Path, *,
                                analysis: xr.Dataset | None = None) -> Path:
    """Write a run (weights as float16) and optionally its analysis as one safetensors file.

    Tensors are named ``run/<variable>`` and ``analysis/<variable>``; dims and attrs are
    JSON in the metadata; no pickle. float16 keeps about 3 significant digits of each
    weight and halves the file (101 checkpoints of the default run: 2.1 MB).
    """
    run = _check_run(run)
    parts = {"run": run} if analysis is None else {"run": run, "analysis": analysis}
    return datasets_to_safetensors(parts, path, half=_WEIGHTS, metadata={"weights_dtype": "float16"})


def load_parity_run_safetensors(path: str | Path) -> tuple[xr.Dataset, xr.Dataset | None]:
    """Read a file of `save_parity_run_safetensors`: the run (weights back in float32, the
    stored float16 values exactly) and its analysis, or None if the file has none."""
    parts, _ = datasets_from_safetensors(path, as_float32=_WEIGHTS)
    if "run" not in parts:
        raise InputError(f"{str(path)!r} holds no parity run.")
    return _check_run(parts["run"]), parts.get("analysis")


def _shipped_run(full: dict[str, Any], store) -> xr.Dataset | None:
    """The shipped run if ``full`` is the default seed-0 setting (and the file is there); its
    analysis goes into the store under the key `stored_parity_analysis` reads."""
    if full != DEFAULTS or not SHIPPED_RUN.is_file():
        return None
    run, analysis = load_parity_run_safetensors(SHIPPED_RUN)
    run.attrs["source"] = (f"shipped with the project ({SHIPPED_RUN.name}, weights in float16); "
                           "`explorer parity train` re-trains it in full precision")
    if analysis is not None:
        p = analysis.attrs["params"]
        parts = _analysis_parts(run, p["max_length"], p["threshold"], p["n_strings"], analysis.attrs["seed"])
        store.put(store.key(parts), analysis, parts=parts)
    return run


def parity_run(*, store=None, retrain: bool = False, progress: ProgressCallback | None = None,
               **params: Any) -> xr.Dataset:
    """The training run for ``params`` (see `train_parity_rnn`), from the store or trained.

    The default seed-0 run, when the store lacks it, is read from `SHIPPED_RUN` (float16
    weights, with its analysis) instead of being trained (about 2 minutes).

    Parameters
    ----------
    store : explorer.store.ActivationStore, optional
        Default: the store in the cache folder (``$EXPLORER_CACHE``).
    retrain : bool, default=False
        Train again and replace the stored run.
    **params
        Arguments of `train_parity_rnn`; missing ones take `DEFAULTS`.
    """
    return stored_training_run(_run_parts, train_parity_rnn, DEFAULTS, params, what="parity",
                               store=store, retrain=retrain, progress=progress, shipped=_shipped_run)


def parity_analysis(run: xr.Dataset, *, max_length: int = 8, threshold: float = 0.01,
                    lengths: Sequence[int] = LONG_LENGTHS, n_strings: int = 20,
                    seed: int = 0) -> xr.Dataset:
    """Automaton sizes and long-string accuracy over training, in one Dataset (step dim)."""
    sizes = parity_automaton_sizes(run, max_length=max_length, threshold=threshold)
    acc = parity_long_accuracy(run, lengths=lengths, n_strings=n_strings, seed=seed)
    ds = xr.merge([sizes, acc, run[["train_loss", "train_accuracy"]]], compat="override",
                  combine_attrs="drop")
    ds.attrs = _attrs("parity_analysis", {"max_length": max_length, "threshold": threshold,
                                          "lengths": list(map(int, acc["length"].values)),
                                          "n_strings": n_strings, "run_params": run.attrs.get("params")},
                      seed, transition_step=sizes.attrs["transition_step"],
                      transition_epoch=sizes.attrs["transition_epoch"],
                      generalisation_step=acc.attrs["generalisation_step"],
                      train_seconds=run.attrs.get("train_seconds"),
                      transition_seconds=_wall_at(run, sizes.attrs["transition_step"]),
                      generalisation_seconds=_wall_at(run, acc.attrs["generalisation_step"]))
    return ds


def _wall_at(run: xr.Dataset, step: int | None) -> float | None:
    """Training time until checkpoint ``step`` (None if unknown)."""
    if step is None or "wall_seconds" not in run.coords:
        return None
    wall = float(run["wall_seconds"].sel(step=step))
    return None if np.isnan(wall) else round(wall, 3)


def _analysis_parts(run: xr.Dataset, max_length: int, threshold: float, n_strings: int,
                    seed: int) -> dict[str, Any]:
    # The run is named by its parameters and a hash of its weights, so a changed run never
    # reads an analysis of another.
    digest = hashlib.sha256()
    for name in ("W_ih", "W_hh", "W_out"):
        digest.update(np.ascontiguousarray(run[name].values).tobytes())
    return {"method": "parity_analysis", "format": 1,
            "run": {**run.attrs.get("params", {}), "seed": run.attrs.get("seed", 0)},
            "weights_sha256": digest.hexdigest()[:32],
            "max_length": max_length, "threshold": threshold, "n_strings": n_strings, "seed": seed}


def stored_parity_analysis(run: xr.Dataset, *, store=None, max_length: int = 8,
                           threshold: float = 0.01, n_strings: int = 20,
                           seed: int = 0) -> xr.Dataset:
    """`parity_analysis` of a trained run, from the store or computed and stored.

    The key holds the run's training parameters and seed, so the command line and the
    app share one stored analysis per run and setting.
    """
    from explorer.store import ActivationStore

    run = _check_run(run)
    store = ActivationStore() if store is None else store
    parts = _analysis_parts(run, max_length, threshold, n_strings, seed)
    return store.get_or_compute(parts, lambda: parity_analysis(
        run, max_length=max_length, threshold=threshold, n_strings=n_strings, seed=seed)).load()


def analysis_summary(analysis: xr.Dataset) -> dict[str, Any]:
    """The headline numbers of `parity_analysis`, JSON-able."""
    last = analysis.isel(step=-1)
    return {
        "transition_step": analysis.attrs["transition_step"],
        "transition_epoch": analysis.attrs["transition_epoch"],
        "generalisation_step": analysis.attrs["generalisation_step"],
        "final_n_states": int(last["n_states"]),
        "final_n_states_minimal": int(last["n_states_minimal"]),
        "final_finite": bool(last["finite"]),
        "final_accuracy": {int(n): float(a) for n, a in zip(analysis["length"].values,
                                                            last["accuracy"].values)},
        "final_train_loss": float(last["train_loss"]),
        "train_seconds": analysis.attrs.get("train_seconds"),
        "transition_seconds": analysis.attrs.get("transition_seconds"),
        "generalisation_seconds": analysis.attrs.get("generalisation_seconds"),
    }


# -- phase diagram --------------------------------------------------------------------

#: The reduced grid of the phase diagram: initialisation gain x longest training string.
PHASE_GAINS: tuple[float, ...] = (0.1, 0.3, 1.0)
PHASE_MAX_LENGTHS: tuple[int, ...] = (4, 6, 8)


def parity_phase_diagram(gains: Sequence[float] = PHASE_GAINS,
                         max_lengths: Sequence[int] = PHASE_MAX_LENGTHS, *,
                         epochs: int = DEFAULTS["epochs"], hidden_size: int = DEFAULTS["hidden_size"],
                         lr: float = DEFAULTS["lr"], checkpoint_every: int = 25,
                         analysis_max_length: int = 6, threshold: float = 0.01,
                         lengths: Sequence[int] = (100, 1000), n_strings: int = 20, seed: int = 0,
                         progress: ProgressCallback | None = None) -> xr.Dataset:
    """Whether and when the 2-state automaton appears, over a grid of (gain, max_length).

    van Rossem & Saxe's effective theory predicts that states merge only with a small
    initialisation and long enough training strings (enough shared continuations). Each
    cell trains one network with the paper's other settings (`train_parity_rnn`) on all
    strings of length 1..max_length and extracts its automaton at every checkpoint from
    the strings of length ``<= analysis_max_length`` (`parity_automaton_sizes`).

    Parameters
    ----------
    gains : sequence of float, default=(0.1, 0.3, 1.0)
    max_lengths : sequence of int, default=(4, 6, 8)
        Longest training string.
    epochs, hidden_size, lr : as in `train_parity_rnn`
    checkpoint_every : int, default=25
    analysis_max_length : int, default=6
    threshold : float, default=0.01
    lengths : sequence of int, default=(100, 1000)
        Random-string lengths of the generalisation test (`parity_long_accuracy`).
    n_strings : int, default=20
    seed : int, default=0
    progress : callable, optional
        ``progress(cells_done, n_cells)`` after each cell; returning ``False`` stops (cells
        not trained stay NaN and ``attrs["cancelled"]`` is True).

    Returns
    -------
    xarray.Dataset
        Over (gain, max_length): ``is_parity_automaton`` (the minimal automaton is the
        parity automaton at the end of training and from ``transition_epoch`` on),
        ``transition_epoch`` (NaN if never), ``final_n_states_minimal``,
        ``final_n_states`` (merged), ``long_accuracy`` (worst accuracy over ``lengths`` at
        the end), ``final_train_loss``, ``train_seconds``. Attrs: the settings and
        ``total_seconds``.
    """
    gains = [check_float("gains[i]", g, low=0.0) for g in gains]
    max_lengths = [check_int("max_lengths[i]", m, low=1, high=16) for m in max_lengths]
    if not gains or not max_lengths:
        raise InputError("`gains` and `max_lengths` must each hold at least one value; got "
                         f"{len(gains)} and {len(max_lengths)}.")
    if len(set(gains)) != len(gains) or len(set(max_lengths)) != len(max_lengths):
        raise InputError(f"`gains` and `max_lengths` must not repeat values; got {gains} and {max_lengths}.")
    epochs = check_int("epochs", epochs, low=1)
    analysis_max_length = check_int("analysis_max_length", analysis_max_length, low=1, high=12)
    shape = (len(gains), len(max_lengths))
    names = ("is_parity_automaton", "transition_epoch", "final_n_states_minimal", "final_n_states",
             "long_accuracy", "final_train_loss", "train_seconds")
    out = {n: np.full(shape, np.nan) for n in names}
    start = time.perf_counter()
    cancelled = False
    n_cells = len(gains) * len(max_lengths)
    for i, gain in enumerate(gains):
        for j, max_length in enumerate(max_lengths):
            run = train_parity_rnn(hidden_size=hidden_size, gain=gain, lr=lr, epochs=epochs,
                                   max_length=max_length, checkpoint_every=checkpoint_every, seed=seed)
            sizes = parity_automaton_sizes(run, max_length=analysis_max_length, threshold=threshold)
            acc = parity_long_accuracy(run, lengths=lengths, n_strings=n_strings, seed=seed,
                                       steps=[int(run["step"].values[-1])])
            transition = sizes.attrs["transition_epoch"]
            out["is_parity_automaton"][i, j] = float(transition is not None)
            out["transition_epoch"][i, j] = np.nan if transition is None else transition
            out["final_n_states_minimal"][i, j] = int(sizes["n_states_minimal"].values[-1])
            out["final_n_states"][i, j] = int(sizes["n_states"].values[-1])
            out["long_accuracy"][i, j] = float(acc["accuracy"].values[-1].min())
            out["final_train_loss"][i, j] = float(run["train_loss"].values[-1])
            out["train_seconds"][i, j] = run.attrs["train_seconds"]
            if progress is not None and progress(i * len(max_lengths) + j + 1, n_cells) is False:
                cancelled = True
                break
        if cancelled:
            break
    ds = xr.Dataset({n: (("gain", "max_length"), v) for n, v in out.items()},
                    coords={"gain": np.asarray(gains), "max_length": np.asarray(max_lengths)},
                    attrs=_attrs("parity_phase_diagram",
                                 {"epochs": epochs, "hidden_size": hidden_size, "lr": lr,
                                  "checkpoint_every": checkpoint_every,
                                  "analysis_max_length": analysis_max_length, "threshold": threshold,
                                  "lengths": [int(n) for n in lengths], "n_strings": n_strings},
                                 seed, total_seconds=round(time.perf_counter() - start, 3),
                                 cancelled=cancelled))
    ds["is_parity_automaton"].attrs["long_name"] = "2-state parity automaton at the end (1) or not (0)"
    return ds


def _phase_parts(gains: Sequence[float], max_lengths: Sequence[int], settings: dict[str, Any]) -> dict[str, Any]:
    # Every setting, defaults filled in, so the command line and the page find the same entry.
    import inspect

    defaults = {name: par.default for name, par in inspect.signature(parity_phase_diagram).parameters.items()
                if par.kind is inspect.Parameter.KEYWORD_ONLY and name not in ("lengths", "progress")}
    return {"method": "parity_phase_diagram", "format": 1, "gains": [float(g) for g in gains],
            "max_lengths": [int(m) for m in max_lengths], **defaults, **settings}


def stored_parity_phase_diagram(gains: Sequence[float] = PHASE_GAINS,
                                max_lengths: Sequence[int] = PHASE_MAX_LENGTHS, *, store=None,
                                compute: bool = True, recompute: bool = False,
                                progress: ProgressCallback | None = None,
                                **settings: Any) -> xr.Dataset | None:
    """`parity_phase_diagram` from the store, or computed and stored.

    With ``compute=False`` a missing diagram gives None instead (the page uses this: a grid
    takes minutes). ``settings`` are the keyword options of `parity_phase_diagram`.
    """
    from explorer.store import ActivationStore

    allowed = {"epochs", "hidden_size", "lr", "checkpoint_every", "analysis_max_length", "threshold",
               "n_strings", "seed"}
    unknown = sorted(set(settings) - allowed)
    if unknown:
        raise InputError(f"unknown phase-diagram setting {unknown[0]!r}; allowed: {', '.join(sorted(allowed))}.")
    store = ActivationStore() if store is None else store
    parts = _phase_parts(gains, max_lengths, settings)
    key = store.key(parts)
    if not recompute:
        found = store.get(key)
        if found is not None:
            return found.load()
    if not compute:
        return None
    ds = parity_phase_diagram(gains, max_lengths, progress=progress, **settings)
    store.put(key, ds, parts=parts)
    return ds


def phase_summary(phase: xr.Dataset) -> dict[str, Any]:
    """The phase diagram as JSON-able lists (rows: gains; columns: max_lengths)."""
    def grid(name: str) -> list[list[Any]]:
        return [[None if np.isnan(v) else (int(v) if name != "long_accuracy" and name != "final_train_loss"
                                           and name != "train_seconds" else round(float(v), 6))
                 for v in row] for row in phase[name].values]

    return {"gains": [float(g) for g in phase["gain"].values],
            "max_lengths": [int(m) for m in phase["max_length"].values],
            **{name: grid(name) for name in ("is_parity_automaton", "transition_epoch",
                                             "final_n_states_minimal", "long_accuracy",
                                             "final_train_loss", "train_seconds")},
            "settings": phase.attrs["params"], "seed": phase.attrs["seed"],
            "total_seconds": phase.attrs["total_seconds"], "cancelled": phase.attrs["cancelled"]}
