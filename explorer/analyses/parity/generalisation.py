"""Infinite generalisation: the accuracy of a parity network on random strings much longer
than the training strings, per checkpoint (`parity_long_accuracy`).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xarray as xr

from explorer._checks import InputError, check_int
from explorer.analyses._training import check_checkpoint_step
from explorer.analyses.parity.network import LONG_LENGTHS, ProgressCallback, _attrs
from explorer.analyses.parity.network import _first_settled_step
from explorer.analyses.parity.training import _check_run, parity_model

__all__ = ["parity_long_accuracy"]


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
    steps = run["step"].values if steps is None else np.asarray([check_checkpoint_step(run, s) for s in steps])
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
    generalised = _first_settled_step(steps, all_correct)
    return xr.Dataset(
        {"accuracy": (("step", "length"), accuracy), "all_correct": (("step",), all_correct)},
        coords={"step": np.asarray(steps), "length": np.asarray(lengths),
                "epoch": ("step", run["epoch"].sel(step=np.asarray(steps)).values)},
        attrs=_attrs("parity_long_accuracy", {"lengths": lengths, "n_strings": n_strings},
                     seed, generalisation_step=generalised),
    )
