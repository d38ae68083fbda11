"""The streaming-parity network and its data: `ParityRNN` (a one-layer ReLU RNN with a linear
readout), every binary string up to a length (`parity_strings`), the paper's settings
(`DEFAULTS`), the long-string lengths of the generalisation test (`LONG_LENGTHS`) and
`CITATION`.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from explorer._checks import InputError, check_float, check_int
from explorer.analyses._training import training_attrs

__all__ = ["CITATION", "DEFAULTS", "ParityRNN", "parity_strings"]


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


def parity_strings(max_length: int, *, min_length: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Every binary string of length ``min_length..max_length``, padded with zeros.

    A tuple: the padded strings and their lengths, read together by every caller.

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


def _attrs(method: str, params: dict, seed: int, **extra: Any) -> dict:
    return training_attrs(method, params, seed, CITATION, **extra)


def _first_settled_step(steps: Sequence[int], holds: np.ndarray) -> int | None:
    """The first step from which ``holds`` stays true at every later step (None if never)."""
    for i in range(len(steps)):
        if holds[i:].all():
            return int(steps[i])
    return None
