"""The page's default circuit: a measured curve narrowed by bisection to the smallest circuit
that reaches the target fraction."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import xarray as xr

from explorer._checks import check_choice, check_int
from explorer.analyses.circuit_select.choice import (CURVE_POINTS, CircuitChoice, READABLE_TARGETS,
                                                     REFINE_STEPS, readable_sizes,
                                                     smallest_faithful_circuit)
from explorer.analyses.circuit_select.rules import (SELECTION_RULES, circuit_by_rule,
                                                    default_sizes, rule_faithfulness_curve)
from explorer.analyses.circuits import faithfulness_curve

__all__ = [
    'DefaultCircuit', 'choose_default_circuit', 'next_bisection_size', 'merge_curves',
    'default_curve_sizes', 'measured_default_curve',
]


@dataclass(frozen=True)
class DefaultCircuit:
    """The circuit a page opens on: the choice, the curve it was chosen from, its edges."""

    choice: CircuitChoice
    curve: xr.Dataset
    in_circuit: xr.DataArray
    rule: str


def choose_default_circuit(model, task, scores: xr.Dataset, *, fraction: float = 0.8,
                           max_edges: int = 300, rule: str = "top-n",
                           sizes: Sequence[int] | None = None, metric: str = "logit_diff",
                           batch_size: int = 16,
                           progress: Callable[[int, int], None] | None = None) -> DefaultCircuit:
    """The smallest circuit of ``rule`` that recovers ``fraction`` of the metric within
    ``max_edges`` edges (or the most faithful one within it), measured by patching.

    ``sizes`` defaults to `default_sizes` up to ``max_edges``; for ``"top-n"`` the sizes
    where the pruned circuit first reaches 10, 25, ... edges (`readable_sizes`) are added,
    since log steps of top-n can jump past every readable circuit. The choice is
    `smallest_faithful_circuit` on the measured curve.
    """
    check_choice("rule", rule, SELECTION_RULES)
    max_edges = check_int("max_edges", max_edges, low=1)
    n_total = int(scores.sizes["edge"])
    if sizes is None:
        grid = set(default_sizes(n_total, max_edges))
        if rule == "top-n":
            grid |= set(readable_sizes(scores, [t for t in READABLE_TARGETS if t <= max_edges]))
        sizes = sorted(grid)
    curve = rule_faithfulness_curve(model, task, scores, sizes=sizes, rule=rule, metric=metric,
                                    batch_size=batch_size, progress=progress)
    choice = smallest_faithful_circuit(curve, fraction, max_edges=max_edges)
    return DefaultCircuit(choice=choice, curve=curve,
                          in_circuit=circuit_by_rule(scores, choice.n_edges, rule), rule=rule)


def next_bisection_size(curve: xr.Dataset, fraction: float, *, dim: str = "n_edges"
                        ) -> int | None:
    """The top-n (or node count, ``dim="n_nodes"``) to measure next to narrow the smallest
    circuit reaching ``fraction``: the geometric midpoint of the first measured size that
    reaches it and the measured size just below; None when the smallest measured size
    reaches it, none does, or the two are neighbours."""
    top_n = np.asarray(curve[dim].values, dtype=int)
    rec = np.nan_to_num(np.asarray(curve["recovered"].values, dtype=np.float64), nan=-np.inf)
    order = np.argsort(top_n, kind="stable")
    top_n, rec = top_n[order], rec[order]
    reach = np.flatnonzero(rec >= fraction)
    if not len(reach) or reach[0] == 0:
        return None
    lo, hi = int(top_n[reach[0] - 1]), int(top_n[reach[0]])
    mid = int(round(np.sqrt(max(lo, 1) * hi)))
    return None if mid <= lo or mid >= hi else mid


def merge_curves(curve: xr.Dataset, more: xr.Dataset, *, dim: str = "n_edges") -> xr.Dataset:
    """Two faithfulness curves of the same scores and pairs as one, by top-n (or node count,
    ``dim="n_nodes"``; ``more``'s points added; the pairs' clean and corrupted values and
    the attrs are ``curve``'s)."""
    new = more.sel({dim: [n for n in more[dim].values if n not in curve[dim].values]})
    out = xr.concat([curve, new], dim=dim, data_vars="minimal", coords="minimal",
                    compat="override", combine_attrs="override").sortby(dim)
    sizes = [int(n) for n in out[dim].values]
    out.attrs["sizes"] = sizes
    return out


def default_curve_sizes(n_total: int, *, points: int = CURVE_POINTS,
                        low: float = 0.001) -> list[int]:
    """0 and about ``points`` log-spaced top-n sizes from ``low`` (0.1 %) of the ``n_total``
    edges (at least 1) to all of them, distinct, ascending."""
    n_total = check_int("n_total", n_total, low=1)
    lo = max(1, int(round(low * n_total)))
    return [0, *np.unique(np.round(np.geomspace(lo, n_total, points)).astype(int)).tolist()]


def measured_default_curve(model, task, scores: xr.Dataset, *, fraction: float = 0.8,
                           sizes: Sequence[int] | None = None,
                           refine_steps: int = REFINE_STEPS, batch_size: int = 16,
                           progress: Callable[[int, int], None] | None = None,
                           check: Callable[[], None] | None = None) -> xr.Dataset:
    """The faithfulness curve a page chooses its default from: top-n circuits measured by
    patching at ``sizes`` (default `default_curve_sizes`), then ``refine_steps`` bisection
    steps (`next_bisection_size`) between the first size that recovers ``fraction`` and the
    size below it, each measured and merged in (`merge_curves`). ``check`` is called between
    measurements (a cancel check). The default is then `smallest_faithful_circuit` of it."""
    sizes = list(sizes) if sizes is not None else default_curve_sizes(int(scores.sizes["edge"]))
    curve = faithfulness_curve(model, task, scores, sizes=sizes, batch_size=batch_size,
                               progress=progress)
    for _ in range(check_int("refine_steps", refine_steps, low=0, high=20)):
        if check is not None:
            check()
        more = next_bisection_size(curve, fraction)
        if more is None:
            break
        curve = merge_curves(curve, faithfulness_curve(model, task, scores, sizes=[more],
                                                       batch_size=batch_size))
    return curve
