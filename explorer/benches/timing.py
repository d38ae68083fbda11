"""Timing helpers shared by `explorer.bench`, its benches and the commands' speed checks:
paired rounds of wall and CPU time, medians in milliseconds, paired ratios."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

__all__ = ["interleaved_times", "median_ms", "paired_ratio"]


def interleaved_times(fns: dict[str, Callable[[], Any]], *, repeats: int, warmup: int = 1
                      ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall and process-CPU seconds of each function over ``repeats`` rounds.

    Within a round the functions run in turn; the order rotates from round to round so
    that no function always follows another. CPU time (all threads of this process) is
    what to compare on a busy machine at one torch thread: other processes do not add
    to it, while they do stretch wall time.
    """
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            c0, t0 = time.process_time(), time.perf_counter()
            fns[name]()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return wall, cpu


def median_ms(times: list[float]) -> float:
    """The median of ``times`` (seconds), in milliseconds."""
    return statistics.median(times) * 1e3


def paired_ratio(a: list[float], b: list[float]) -> float:
    """Median over rounds of a[i] / b[i]."""
    return statistics.median(x / y for x, y in zip(a, b))
