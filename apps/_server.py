"""What a shared server needs: heavy jobs through one queue, per-session caches with a bound,
memory given back, websocket origins.

Heavy analyses (a circuit, a saturation corpus, ICL head scores, a training run) are CPU-bound
for tens of seconds to minutes. On a shared server they go through one server-wide `JobQueue`
that lets at most ``limit`` of them run at once (default: one per two cores) and keeps the rest
waiting in the order they came, each told its place in line. Light interactions (the lens, a
slider, a selection) never wait in it: they run on their own worker threads.

`BoundedCache` is the per-page cache of results (a least-recently-used mapping with a size
bound), so a long session cannot grow without limit; `release_memory` hands freed heap back to
the operating system after a heavy job or a closed session (glibc keeps it otherwise).
"""
from __future__ import annotations

import collections
import ctypes
import ctypes.util
import gc
import os
import secrets
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["JobQueue", "job_queue", "set_heavy_job_limit", "heavy_job_limit", "BoundedCache",
           "release_memory", "QueueCancelled", "place_text", "served_origins",
           "with_sign_in_pages", "OpenRuns", "open_runs"]

HEAVY_JOBS_ENV = "EXPLORER_HEAVY_JOBS"
"""Environment variable: how many heavy jobs a server runs at once (default: cores // 2, >= 1)."""


class QueueCancelled(Exception):
    """A job left the queue because it was cancelled while waiting."""


class _Ticket:
    __slots__ = ("cancelled", "on_place", "owner")

    def __init__(self, on_place: Callable[[int], None] | None, owner: Any):
        self.cancelled = False
        self.on_place = on_place
        self.owner = owner


class JobQueue:
    """At most ``limit`` heavy jobs run at once; the others wait first come, first served.

    A job takes its turn with ``with queue.turn(cancelled=..., on_place=...)``: the block runs
    once a slot is free and every job that came earlier has started. While it waits,
    ``on_place(k)`` is called whenever its place changes (1: next in line) and a cancelled job
    leaves the line at once (`QueueCancelled`). Thread-safe; callbacks run on the thread that
    changed the line, so they must only schedule work.
    """

    def __init__(self, limit: int):
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Ticket] = collections.deque()
        self._running = 0
        self._limit = 1
        self.limit = limit

    @property
    def limit(self) -> int:
        """How many heavy jobs may run at once."""
        return self._limit

    @limit.setter
    def limit(self, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"the heavy-job limit must be an int >= 1; got {value!r}.")
        with self._cond:
            self._limit = value
            self._cond.notify_all()

    @property
    def running(self) -> int:
        """Heavy jobs running now."""
        return self._running

    @property
    def waiting(self) -> int:
        """Heavy jobs waiting for a slot now."""
        return len(self._waiting)

    def cancel_owner(self, owner: Any) -> int:
        """Take every waiting job of ``owner`` (e.g. a closed session) out of the line."""
        with self._cond:
            gone = [t for t in self._waiting if t.owner is owner]
            for t in gone:
                t.cancelled = True
            self._cond.notify_all()
        return len(gone)

    def cancel(self, ticket: _Ticket) -> None:
        with self._cond:
            ticket.cancelled = True
            self._cond.notify_all()

    @contextmanager
    def turn(self, *, cancelled: Callable[[], bool] = lambda: False,
             on_place: Callable[[int], None] | None = None, owner: Any = None,
             on_ticket: Callable[[_Ticket], None] | None = None) -> Iterator[int]:
        """Wait for a slot, run the block, free the slot. Yields the place the job had on
        arrival (0: it started at once)."""
        ticket = _Ticket(on_place, owner)
        if on_ticket is not None:
            on_ticket(ticket)
        with self._cond:
            arrived = 0 if self._running < self._limit and not self._waiting else len(self._waiting) + 1
            self._waiting.append(ticket)
            last = None
            while True:
                if ticket.cancelled or cancelled():
                    self._waiting.remove(ticket)
                    self._announce()
                    self._cond.notify_all()
                    raise QueueCancelled()
                place = self._waiting.index(ticket) + 1
                if place == 1 and self._running < self._limit:
                    break
                if place != last and on_place is not None:
                    on_place(place)
                last = place
                self._cond.wait(0.5)      # also polls `cancelled` for tokens that do not notify
            self._waiting.popleft()
            self._running += 1
            self._announce()
        try:
            yield arrived
        finally:
            with self._cond:
                self._running -= 1
                self._announce()
                self._cond.notify_all()

    def _announce(self) -> None:
        """Tell every waiting job its place (called with the lock held)."""
        for place, t in enumerate(self._waiting, 1):
            if t.on_place is not None:
                try:
                    t.on_place(place)
                except Exception:  # noqa: BLE001 - a page's callback must not stall the line
                    pass


def _default_limit() -> int:
    text = os.environ.get(HEAVY_JOBS_ENV, "").strip()
    if text:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(f"{HEAVY_JOBS_ENV} must be an int >= 1; got {text!r}.")
        return value
    return max(1, (os.cpu_count() or 2) // 2)


_QUEUE: JobQueue | None = None
_QUEUE_LOCK = threading.Lock()


def job_queue() -> JobQueue:
    """The server-wide queue of heavy jobs (one per process)."""
    global _QUEUE
    with _QUEUE_LOCK:
        if _QUEUE is None:
            _QUEUE = JobQueue(_default_limit())
        return _QUEUE


def set_heavy_job_limit(limit: int) -> None:
    """Set how many heavy jobs this server runs at once (``explorer serve --heavy-jobs``)."""
    job_queue().limit = limit


def heavy_job_limit() -> int:
    """How many heavy jobs this server runs at once."""
    return job_queue().limit


def place_text(place: int, running: int) -> str:
    """The status of a queued job: ``"Waiting for the server: next in line (1 heavy job
    running). Cancel leaves the line."``"""
    where = "next in line" if place == 1 else f"{place}{_ordinal(place)} in line"
    jobs = f"{running} heavy job{'s' if running != 1 else ''} running"
    return f"Waiting for the server: {where} ({jobs}). Cancel leaves the line."


def _ordinal(n: int) -> str:
    if 10 <= n % 100 <= 20:
        return "th"
    return {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")


class BoundedCache(collections.OrderedDict):
    """A least-recently-used mapping that keeps at most ``max_items`` entries and, when
    ``max_bytes`` is set, at most that many bytes of array data (numpy / torch / xarray
    values are measured; other values count 0). The oldest entries go first."""

    def __init__(self, max_items: int = 16, max_bytes: int | None = 256 * 2**20):
        super().__init__()
        if max_items < 1:
            raise ValueError(f"max_items must be >= 1; got {max_items}.")
        self.max_items = max_items
        self.max_bytes = max_bytes

    def __getitem__(self, key: Any) -> Any:
        value = super().__getitem__(key)
        self.move_to_end(key)
        return value

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key] if key in self else default

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.max_items:
            self.popitem(last=False)
        if self.max_bytes is not None:
            while len(self) > 1 and self.nbytes > self.max_bytes:
                self.popitem(last=False)

    @property
    def nbytes(self) -> int:
        """Bytes of array data held."""
        return sum(_nbytes(v) for v in self.values())


def _nbytes(value: Any) -> int:
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    n = getattr(value, "nbytes", None)
    if isinstance(n, int):
        return n
    if hasattr(value, "element_size") and hasattr(value, "numel"):   # torch.Tensor
        return int(value.element_size() * value.numel())
    return 0


def release_memory() -> bool:
    """Collect garbage and hand free heap pages back to the operating system (glibc's
    ``malloc_trim``). Returns whether the trim ran (False off glibc)."""
    gc.collect()
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


def served_origins(address: str, port: int) -> list[str]:
    """The websocket origins a server on ``address:port`` accepts by default: the address it
    binds, and when that is every interface (0.0.0.0 / ::), this machine's host names; always
    127.0.0.1 and localhost. Browsers on other origins cannot open a session."""
    import socket

    hosts = [address.strip("[]")]
    if address in ("0.0.0.0", "::", ""):
        hosts = [socket.gethostname(), socket.getfqdn()]
    hosts += ["127.0.0.1", "localhost"]
    return [f"{h}:{port}" for h in dict.fromkeys(h for h in hosts if h)]


#: The sign-in page, which is also the page after signing out (one template, one look).
SIGN_IN_TEMPLATE = os.path.join(os.path.dirname(__file__), "templates", "sign_in.html")


def with_sign_in_pages(serve_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``serve_kwargs`` with the explorer's own sign-in and sign-out pages when they ask for a
    password sign-in (Panel's default pages load their logo and icon from a CDN, which an
    offline server cannot reach)."""
    out = dict(serve_kwargs)
    if out.get("basic_auth"):
        out.setdefault("basic_login_template", SIGN_IN_TEMPLATE)
    if out.get("basic_auth") or out.get("oauth_provider"):
        out.setdefault("logout_template", SIGN_IN_TEMPLATE)
    return out


# -- study runs open to participants ---------------------------------------------------------

class OpenRuns:
    """The study runs open to participants on this server, by the secret key in their link."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[str, Path] = {}

    def open(self, folder: Path) -> str:
        key = secrets.token_urlsafe(16)
        with self._lock:
            self._runs[key] = Path(folder)
        return key

    def close(self, key: str) -> None:
        with self._lock:
            self._runs.pop(key, None)

    def folder(self, key: str) -> Path | None:
        with self._lock:
            return self._runs.get(key)


open_runs = OpenRuns()   # the server's: `/study?run=<key>` (apps.study_builder)
