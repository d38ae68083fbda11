"""The automaton a parity network develops: merged hidden states and their Hopcroft
minimisation at one checkpoint (`parity_automaton`), and its size over training
(`parity_automaton_sizes`).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import xarray as xr

from explorer._checks import check_float, check_int
from explorer.analyses.automata import Automaton, merge_states, minimise_automaton
from explorer.analyses.parity.network import ProgressCallback, _attrs, _first_settled_step
from explorer.analyses.parity.states import _hidden_of_prefixes
from explorer.analyses.parity.training import _check_run, parity_model

__all__ = ["parity_automaton", "parity_automaton_sizes"]


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
    transition = _first_settled_step(steps, settled)
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
