"""A live slider's preview path: one preview computing at a time, the newest move waiting in a
single slot, older moves dropped (never queued).

The logit lens's steering slider and the Knowledge conflicts α sliders share it. A page makes
one `PreviewSlot` with the function that submits a preview job (its runner lane and job) and
calls `request` on each move, `warm` for a preview that runs only when the path is idle,
`landed` when a preview's result reaches the page, `next` once it is drawn (the waiting move
starts), `drop_pending` when an exact run makes the waiting move stale, and `reset` when the
page cancels its previews. A preview cancelled from outside the page (the sidebar's stop
button cancels the session's runners) frees the path, else the next move would wait for a
preview that never lands.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from apps._session import CancelToken

__all__ = ["PreviewSlot"]


class PreviewSlot:
    """The single-slot preview path of one page (thread-safe: moves arrive on the session's
    loop, cancels from any thread).

    ``submit(request, lane)`` starts the preview job of ``request`` on the page's runner
    ``lane`` and returns its token, or None where the page is closed.
    """

    def __init__(self, submit: Callable[[Any, str], CancelToken | None]) -> None:
        self._submit = submit
        self._lock = threading.Lock()
        self.busy = False            # a preview is computing (or drawing)
        self.pending: Any = None     # the newest move that waits for it
        self._token: CancelToken | None = None

    def request(self, request: Any) -> None:
        """A move: start its preview now if the path is idle, else make it the one waiting
        (replacing an older one)."""
        with self._lock:
            if self.busy:
                self.pending = request
                return
            self.busy = True
        self._start(request, "preview")

    def warm(self, request: Any, lane: str = "warm") -> bool:
        """Start ``request`` on ``lane`` only if the path is idle (a warm-up that a move must
        not wait behind); whether it started."""
        with self._lock:
            if self.busy:
                return False
            self.busy = True
        self._start(request, lane)
        return True

    def landed(self) -> None:
        """The preview in flight delivered its result: a later cancel of its token frees
        nothing."""
        with self._lock:
            self._token = None

    def next(self) -> None:
        """Start the move waiting in the slot, if any; else the path is idle."""
        with self._lock:
            request, self.pending = self.pending, None
            if request is None:
                self.busy = False
        if request is not None:
            self._start(request, "preview")

    def drop_pending(self) -> None:
        """An exact run was asked for: the move waiting is stale."""
        with self._lock:
            self.pending = None

    def reset(self) -> None:
        """The page cancelled its previews: the path is idle and nothing waits."""
        with self._lock:
            self.busy = False
            self.pending = None
            self._token = None

    def _start(self, request: Any, lane: str) -> None:
        token = self._submit(request, lane)
        if token is None:                  # the page is closed: nothing more runs
            self.reset()
            return
        with self._lock:
            self._token = token
        token.on_cancel.append(lambda t=token: self._cancelled(t))

    def _cancelled(self, token: CancelToken) -> None:
        with self._lock:
            if self._token is token:
                self._token = None
                self.busy = False
                self.pending = None
