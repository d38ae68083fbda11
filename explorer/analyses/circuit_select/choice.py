"""The smallest faithful circuit on a measured curve, and circuit sizes a person can read."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xarray as xr

from explorer._checks import InputError
from explorer.analyses.circuits import select_circuit

__all__ = [
    'CURVE_POINTS', 'REFINE_STEPS', 'READABLE_TARGETS', 'CircuitChoice',
    'smallest_faithful_circuit', 'readable_sizes',
]


CURVE_POINTS = 12   # log-spaced top-n sizes a default curve measures first


REFINE_STEPS = 2    # bisection steps narrowing the smallest circuit reaching the target


READABLE_TARGETS = (10, 25, 50, 100, 200, 300)   # pruned circuit sizes a person can read


@dataclass(frozen=True)
class CircuitChoice:
    """One point of a faithfulness curve chosen by `smallest_faithful_circuit`.

    ``n_edges`` is the top-n (the curve's coordinate, before pruning), ``n_kept`` the edges
    left after pruning, ``recovered`` the share of the metric the circuit recovers, and
    ``reached`` whether that share is at least the fraction asked for.
    """

    n_edges: int
    n_kept: int
    recovered: float
    reached: bool


def smallest_faithful_circuit(curve: xr.Dataset, fraction: float = 0.8, *,
                              max_edges: int | None = None) -> CircuitChoice:
    """The smallest measured circuit that recovers at least ``fraction`` of the metric.

    Parameters
    ----------
    curve : xr.Dataset
        From `circuits.faithfulness_curve`: ``recovered`` and ``n_kept`` over ``n_edges``.
    fraction : float, default=0.8
        Share of the clean-minus-corrupted metric the circuit must recover.
    max_edges : int, optional
        The most edges (after pruning) a chosen circuit may have. When no circuit within it
        reaches ``fraction``, the one within it that recovers the most is returned
        (``reached`` False), leaving out the empty circuit; when no non-empty circuit fits,
        the smallest non-empty one, past the cap.

    Returns
    -------
    CircuitChoice
        Sizes are compared after pruning (``n_kept``); of points with equal ``n_kept`` the
        one with the smaller top-n comes first.
    """
    if not isinstance(curve, xr.Dataset) or not {"recovered", "n_kept"} <= set(curve.data_vars):
        raise TypeError("`curve` must be the Dataset of faithfulness_curve (with `recovered` "
                        f"and `n_kept` over `n_edges`); got {type(curve).__name__}.")
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float, np.floating)) \
            or not 0 <= fraction <= 1:
        raise InputError(f"`fraction` must be a number in [0, 1]; got {fraction!r}.")
    if max_edges is not None and (isinstance(max_edges, bool) or not isinstance(
            max_edges, (int, np.integer)) or max_edges < 0):
        raise InputError(f"`max_edges` must be an int >= 0 or None; got {max_edges!r}.")
    top_n = np.asarray(curve["n_edges"].values, dtype=int)
    kept = np.asarray(curve["n_kept"].values, dtype=int)
    rec = np.asarray(curve["recovered"].values, dtype=np.float64)
    order = np.lexsort((top_n, kept))                 # by pruned size, then top-n
    fits = order if max_edges is None else order[kept[order] <= max_edges]
    if not (kept[fits] > 0).any() and (kept > 0).any():
        # pruned sizes jump (one edge can complete hundreds of paths): when no non-empty
        # circuit fits the cap, the smallest non-empty one
        i = int(order[kept[order] > 0][0])
        return CircuitChoice(n_edges=int(top_n[i]), n_kept=int(kept[i]), recovered=float(rec[i]),
                             reached=bool(rec[i] >= fraction))
    if len(fits) == 0:
        raise InputError(f"no point of the curve has at most {max_edges} edges; its smallest "
                         f"circuit has {int(kept.min())}.")
    reaching = fits[np.nan_to_num(rec[fits], nan=-np.inf) >= fraction]
    if len(reaching):
        i, reached = int(reaching[0]), True
    else:   # the most faithful non-empty circuit that fits (the smallest of equals)
        pool = fits[kept[fits] > 0] if (kept[fits] > 0).any() else fits
        best = np.nan_to_num(rec[pool], nan=-np.inf)
        i, reached = int(pool[int(np.argmax(best))]), False
    return CircuitChoice(n_edges=int(top_n[i]), n_kept=int(kept[i]), recovered=float(rec[i]),
                         reached=reached)


def readable_sizes(scores: xr.Dataset, targets: Sequence[int] = READABLE_TARGETS) -> list[int]:
    """Top-n sizes whose pruned circuits first reach each of ``targets`` edges.

    Log-spaced top-n sizes can jump past every readable circuit (on SmolLM2's `add`, the top
    373 edges hold no input -> logits path, the top 532 hundreds of edges), so these sizes
    are measured too. The pruned size never shrinks as n grows (more chosen edges only add
    paths), so each is found by bisection on n (`circuits.select_circuit`, a few ms a call).
    Targets larger than the whole pruned graph are left out.
    """
    n_total = int(scores.sizes["edge"])

    def kept(n: int) -> int:
        return int(select_circuit(scores, top_n=n).sum())

    out = set()
    top = kept(n_total)
    for target in targets:
        if target > top:
            continue
        lo, hi = 0, n_total             # kept(lo) < target <= kept(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if kept(mid) >= target:
                hi = mid
            else:
                lo = mid
        out.add(hi)
    return sorted(out)
