"""The phase diagram of the parity task: whether and when the 2-state automaton appears over a
grid of initialisation gain and longest training string (`parity_phase_diagram`, cached by
`stored_parity_phase_diagram`), as JSON-able lists (`phase_summary`).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import xarray as xr

from explorer._checks import InputError, check_float, check_int
from explorer.analyses.parity.automaton import parity_automaton_sizes
from explorer.analyses.parity.generalisation import parity_long_accuracy
from explorer.analyses.parity.network import DEFAULTS, ProgressCallback, _attrs
from explorer.analyses.parity.training import train_parity_rnn

__all__ = ["parity_phase_diagram", "stored_parity_phase_diagram", "phase_summary"]


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
    """The phase diagram as JSON-able lists (rows: gains; columns: max_lengths).

    A dict, not a Dataset: it is the Dataset's headline numbers as nested JSON scalars and
    lists, what the command's ``--json`` prints and a benchmark writes to docs/figures.
    """
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
