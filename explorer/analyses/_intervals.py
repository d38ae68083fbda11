"""Confidence intervals the analyses share."""
from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["wilson_interval"]


def wilson_interval(hits: Any, n: int, level: float = 0.95) -> tuple[Any, Any]:
    """Wilson score interval of the proportion ``hits / n`` at confidence ``level``
    (Wilson 1927; Newcombe 1998, method 3): a (low, high) pair, as an interval is; floats
    for a number of hits, arrays for an array of them; NaNs when ``n`` is 0."""
    from scipy.stats import norm

    scalar = np.ndim(hits) == 0
    if n == 0:
        nan = np.full(np.shape(hits), np.nan)
        return (float(nan), float(nan)) if scalar else (nan, nan.copy())
    z = float(norm.ppf(0.5 + level / 2))
    p = np.asarray(hits, dtype=np.float64) / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    low, high = np.clip(centre - half, 0.0, 1.0), np.clip(centre + half, 0.0, 1.0)
    return (float(low), float(high)) if scalar else (low, high)
