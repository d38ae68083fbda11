"""The logit lens page's preview controller: while the steering slider moves, one preview
computes at a time and the newest move waits in one slot (older ones are dropped); a
preview newer than the last exact result is drawn in place; releasing the slider runs the
exact lens. The slider (`apps._preview_slot.live_slider`) sends each move at once (no
debounce)."""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import time

import panel as pn
from panel.io.document import hold

from apps._preview_slot import live_slider
from apps._provenance import Provenance
from apps._session import CancelToken, Cancelled

__all__ = ["PreviewPart"]


class PreviewPart:
    """The steering slider's preview of `apps.lens.LensView`."""

    overlap_previews = True
    """Served, start the preview of the move waiting in the slot before drawing the one
    just delivered (`_show_preview`); benchmarks/lens_drag_profile.py turns it off on the
    class to measure what it gives."""

    @property
    def previewing(self) -> bool:
        """Whether the heatmap shows a preview (the slider is moving, or its exact result
        is still computing): the gallery leaves the page's snippet and link as they are
        until the exact result is in."""
        return self.preview is not None

    def _mark_preview_ready(self, ready: bool) -> None:
        """The steering slider carries the CSS class ``preview-ready`` while a drag's first
        move finds the preview's inputs ready (`_warm_preview` done for the exact result
        shown); a page script or a test can wait on it."""
        slider = self._alpha_slider
        if slider is None:
            return
        classes = [c for c in slider.css_classes if c != "preview-ready"]
        slider.css_classes = classes + ["preview-ready"] if ready else classes

    def request_preview(self, alpha: float) -> None:
        """Draw a preview at steering strength ``alpha`` (the slider is being dragged).

        One preview computes at a time; a request made meanwhile waits in a single slot
        that the next request overwrites, so stale positions are dropped, never queued.
        The exact run follows when the slider is released (`alpha` is set).
        """
        if not self._page_loaded:
            return
        self._seq += 1
        request = (self._seq, {**self._run_params(), "alpha": float(alpha)})
        self._preview_asked = (self._seq, time.perf_counter())
        self._slot.request(request)

    def _submit_preview(self, request: tuple[int, dict], lane: str) -> CancelToken | None:
        """Start the preview job of ``request`` on the runner ``lane`` (`PreviewSlot`)."""
        return self.submit(lane, lambda token: self._preview_job(request, token))

    @property
    def preview_timings(self) -> collections.deque:
        """Server-side milliseconds of the last previews drawn (at most 64), oldest first:
        ``queue_ms`` (from the slider's move to the job's start; None for a move that
        waited in the slot), ``compute_ms`` (the preview's lens), ``deliver_ms`` (from the
        job's end to the session's event loop drawing it) and ``draw_ms`` (the redraw and
        the document patch it sends)."""
        try:
            return self._preview_timings
        except AttributeError:
            self._preview_timings: collections.deque = collections.deque(maxlen=64)
            return self._preview_timings

    def _preview_job(self, request: tuple[int, dict], token: CancelToken) -> tuple:
        seq, p = request
        start = time.perf_counter()
        try:
            return seq, p, self._compute_preview(p, token), None, (start, time.perf_counter())
        except Cancelled:
            raise
        except Exception as exc:  # a failed preview is not shown; the exact run reports
            return seq, p, None, exc, (start, time.perf_counter())

    def _show_preview(self, out: tuple) -> None:
        # a warm-up (`_warm_preview`) has seq == _exact_seq: not drawn
        seq, p, ds, exc, (began, ended) = out
        self._slot.landed()
        if seq == self._exact_seq:
            self._mark_preview_ready(exc is None)
        start = time.perf_counter()
        # served, the move waiting in the slot starts computing (a worker thread) while this
        # preview is drawn (the session's event loop, which delivers the next one only after
        # this callback): a drag's previews come one draw sooner each
        overlap = self.overlap_previews and self._background and self._doc is not None
        if overlap:
            self._slot.next()
        if exc is None and seq > self._exact_seq and ds is not None:
            # the status stays the same through a drag (the title names alpha): a changed
            # status line re-lays the page out in the browser on every move. A redraw in
            # place (no new Bokeh models) reaches the browser as one document patch
            # (Panel's `hold`): data, title and line drawn in one repaint.
            held = hold(self._doc) if self._doc is not None and self._draws_in_place(ds) \
                else contextlib.nullcontext()
            with held:
                self.param.update(preview=ds, shown_record=self.preview_record(p),
                                  status="Preview: top tokens among candidates, "
                                         "estimated probabilities; exact on release")
            asked = getattr(self, "_preview_asked", None)
            self.preview_timings.append({
                "queue_ms": 1000 * (began - asked[1]) if asked and asked[0] == seq else None,
                "compute_ms": 1000 * (ended - began), "deliver_ms": 1000 * (start - ended),
                "draw_ms": 1000 * (time.perf_counter() - start)})
        if not overlap:
            self._slot.next()

    def preview_record(self, p: dict) -> Provenance:
        """The record of a preview at ``p``: the shown lens's prompt and workspace edits (the
        edited heatmap below stays the exact one) with ``p``'s steering."""
        shown = self.shown_record
        edits = self.edits if shown is None else ()
        record = self.lens_record(p, list(edits))
        if shown is not None:
            record = dataclasses.replace(record, edits=shown.edits)
        return dataclasses.replace(self.stamped(record), settings=(("preview", True),))

    def _warm_preview(self) -> None:
        """Served, after an exact result: compute one preview that is not drawn, so that the
        first move of the next drag finds the steering vector, the clean run, the preview's
        blocks, candidates and GEMM backend ready (seconds on a busy machine) instead of
        making the hand wait for them. It is a preview request like a move's: a move made
        meanwhile waits in the single slot. It runs on its own runner ("warm"), whose jobs
        light the sidebar's stop button (the first one builds the preview's blocks: seconds),
        where a drag's moves do not."""
        if not self._background or self._model.remote or self.result is None:
            return
        alpha = self.alpha if self.alpha != 0 else self.param.alpha.step
        self._slot.warm((self._exact_seq, {**self._run_params(), "alpha": float(alpha)}))

    def alpha_slider(self) -> pn.widgets.FloatSlider:
        """The steering-strength slider: a preview while it moves (``value``), the exact
        lens on release (``value_throttled`` sets `alpha`)."""
        if self._alpha_slider is None:
            self._alpha_slider = live_slider(self, "alpha", self.request_preview)
        return self._alpha_slider
