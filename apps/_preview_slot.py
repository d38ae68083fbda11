"""A live slider's preview path: one preview computing at a time, the newest move waiting in a
single slot, older moves dropped (never queued); and the slider itself (`live_slider`).

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

import panel as pn
import param

from apps._session import CancelToken

__all__ = ["PreviewSlot", "live_slider"]


class _DragSlider(pn.widgets.FloatSlider):
    """A float slider whose moves reach the server at once: Panel holds a widget's browser
    changes 50 ms to merge bursts (its debounce), which a drag's preview does itself (one
    preview computes, the newest move waits, older ones are dropped)."""

    _priority_changes = ["value"]


def live_slider(owner: param.Parameterized, name: str,
                preview: Callable[[float], None]) -> pn.widgets.FloatSlider:
    """A slider for the float Parameter ``name`` of ``owner`` (its label, bounds and step): a
    move (``value``) calls ``preview`` with the new value, a release (``value_throttled``)
    sets the Parameter (the exact run follows), and the Parameter set elsewhere (a link, a
    state) moves the slider without a preview."""
    spec = owner.param[name]
    slider = _DragSlider(label=spec.label, start=spec.bounds[0], end=spec.bounds[1],
                         step=spec.step, value=getattr(owner, name), sizing_mode="stretch_width")
    syncing = False

    def dragged(event: param.parameterized.Event) -> None:
        if not syncing and event.new != getattr(owner, name):
            preview(event.new)

    def released(event: param.parameterized.Event) -> None:
        if not syncing and event.new is not None:
            setattr(owner, name, event.new)

    def synced(event: param.parameterized.Event) -> None:
        nonlocal syncing
        syncing = True
        try:
            slider.value = event.new
        finally:
            syncing = False

    slider.param.watch(dragged, "value")
    slider.param.watch(released, "value_throttled")
    owner.param.watch(synced, name)
    return slider


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
