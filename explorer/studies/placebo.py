"""Placebo explanations: the form of the real explanation without its information.

A placebo condition answers "does *any* explanation-shaped display help, or this one?".
Each generator keeps what a participant can see of the form (shape, the set of values
shown, how many heads are highlighted, that it is a genuine model readout) and breaks the
link to the item it is shown with:

- `shuffled_attributions`: the same scores on a uniformly random permutation of the cells.
- `random_heads`: the ``top`` highlighted heads (largest ``|score|``) move to uniformly
  random heads (their scores swap places with what was there); the rest stays.
- `mismatched_example`: each item shows the real explanation of a different item (a
  uniform random derangement), so it is a genuine readout of the same model, but of
  another prompt.

References
----------
U. Pičulin, M. Petek, I. Ograjenšek and E. Štrumbelj, "Position: Explainable AI Cannot
Advance Without Better User Studies", ICML 2025 (placebo explanations as a control).
"""
from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import numpy as np

from explorer._checks import InputError, check_choice, check_int

__all__ = ["shuffled_attributions", "random_heads", "mismatched_example", "placebo_explanations"]


def shuffled_attributions(scores: Any, *, rng: np.random.Generator) -> np.ndarray:
    """The same scores on a uniformly random permutation of the cells.

    Parameters
    ----------
    scores : array-like
        Any shape, e.g. (layer, head) head scores or (pos,) token attributions.
    rng : numpy.random.Generator

    Returns
    -------
    numpy.ndarray
        Same shape and the same multiset of values as ``scores``.
    """
    scores = np.asarray(scores, dtype=float)
    flat = scores.reshape(-1)
    return flat[rng.permutation(flat.size)].reshape(scores.shape)


def random_heads(scores: Any, *, top: int, rng: np.random.Generator) -> np.ndarray:
    """Move the ``top`` highlighted heads (largest ``|score|``) to uniformly random heads.

    The ``top`` largest-magnitude scores go, in their order, to ``top`` distinct heads drawn
    uniformly at random; the scores that sat on those heads move to the vacated heads. The
    multiset of values and the number of highlighted heads are unchanged; which heads are
    highlighted is independent of ``scores``.

    Parameters
    ----------
    scores : array-like, shape (layer, head)
    top : int
        Heads highlighted in the display.
    rng : numpy.random.Generator

    Returns
    -------
    numpy.ndarray, shape (layer, head)
    """
    scores = np.asarray(scores, dtype=float)
    if scores.ndim != 2:
        raise InputError(f"`scores` must be a 2-d array [layer, head]; got shape {scores.shape}.")
    flat = scores.reshape(-1)
    top = check_int("top", top, low=1, high=flat.size)
    source = np.argsort(-np.abs(flat), kind="stable")[:top]    # the highlighted cells
    target = rng.choice(flat.size, size=top, replace=False)     # where they go
    out = flat.copy()
    # displaced = cells among the targets that are not themselves sources; they receive the
    # values of the vacated cells (sources that are not targets), in random order
    moved = set(target.tolist())
    vacated = [c for c in source.tolist() if c not in moved]
    displaced = [c for c in target.tolist() if c not in set(source.tolist())]
    out[target] = flat[source]
    if displaced:
        out[np.array(vacated)] = flat[np.array(displaced)][rng.permutation(len(displaced))]
    return out.reshape(scores.shape)


def mismatched_example(n_items: int, *, rng: np.random.Generator) -> np.ndarray:
    """A uniform random derangement: item ``i`` shows the explanation of item ``out[i] != i``.

    Parameters
    ----------
    n_items : int
        At least 2.
    rng : numpy.random.Generator

    Returns
    -------
    numpy.ndarray of int, shape (n_items,)
        A permutation of ``0..n_items-1`` with no fixed point.
    """
    n_items = check_int("n_items", n_items, low=2)
    while True:  # rejection: about 1/e of permutations are derangements
        perm = rng.permutation(n_items)
        if not np.any(perm == np.arange(n_items)):
            return perm


def placebo_explanations(kind: str, explanations: Sequence[dict[str, Any]], *,
                         rng: np.random.Generator) -> list[dict[str, Any]]:
    """Placebo versions of the real explanations of a study's items.

    Parameters
    ----------
    kind : {"shuffled_attributions", "random_heads", "mismatched_example"}
    explanations : sequence of dict
        The real explanation of each item, in item order (see `explorer.studies.items`).
    rng : numpy.random.Generator

    Returns
    -------
    list of dict
        One placebo explanation per item, of the same form; each records ``placebo`` (the
        kind) and, for ``mismatched_example``, ``source_item`` (the donor's index).
    """
    check_choice("placebo", kind, ("shuffled_attributions", "random_heads", "mismatched_example"))
    if kind == "mismatched_example":
        donors = mismatched_example(len(explanations), rng=rng)
        out = []
        for donor in donors.tolist():
            e = copy.deepcopy(explanations[donor])
            e.update(placebo=kind, source_item=int(donor))
            out.append(e)
        return out
    out = []
    for real in explanations:
        if real.get("kind") != "head_attribution":
            raise InputError(f"placebo {kind!r} needs 'head_attribution' explanations; "
                             f"got {real.get('kind')!r}.")
        scores = np.asarray(real["scores"], dtype=float)
        if kind == "shuffled_attributions":
            new = shuffled_attributions(scores, rng=rng)
        else:
            new = random_heads(scores, top=int(real["top"]), rng=rng)
        e = copy.deepcopy(real)
        e.update(scores=new.tolist(), placebo=kind)
        out.append(e)
    return out
