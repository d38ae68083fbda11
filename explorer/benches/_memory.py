"""The peak-memory sampler of the benches: resident memory sampled in a thread."""
from __future__ import annotations

import threading
from typing import Any

__all__ = ["PeakRSS", "rss_bytes"]


def rss_bytes(pid: int | None = None) -> int:
    """Resident memory of process ``pid`` (default: this one), in bytes."""
    import psutil

    return psutil.Process(pid).memory_info().rss


class PeakRSS:
    """Peak resident memory of a process while the ``with`` body runs.

    A thread samples the resident set of process ``pid`` (default: this one) every
    ``interval`` seconds from entry to exit, and once more at exit. ``base`` is the
    level at entry, ``peak`` the highest level seen (bytes); ``delta_mb`` the peak above
    the base and ``peak_mb`` the peak itself, in MiB.
    """

    def __init__(self, pid: int | None = None, *, interval: float = 0.005):
        import psutil

        self._process = psutil.Process(pid)
        self.interval = interval
        self.base = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _rss(self) -> int:
        return self._process.memory_info().rss

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            self._stop.wait(self.interval)

    def __enter__(self) -> "PeakRSS":
        self.base = self.peak = self._rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def delta_mb(self) -> float:
        return (self.peak - self.base) / 2**20

    @property
    def peak_mb(self) -> float:
        return self.peak / 2**20
