"""The logit lens page's drag pipeline: served, the move waiting in the preview slot starts
computing before the preview just delivered is drawn (the worker computes while the
session's event loop draws); inline (a notebook, a test), the preview is drawn first, so a
newer preview delivered at once cannot be drawn over by an older one."""
from __future__ import annotations

import time

import panel as pn
import pytest
from bokeh.document import Document
from panel.io.state import set_curdoc

from apps._lens_heatmap import is_preview
from apps._session import CancelToken
from apps.lens import LensView

PROMPT = "The capital of France is"


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path / "cache"))


def _delivered_with_a_move_waiting(view: LensView) -> tuple[list, list, object]:
    """Deliver a preview at alpha 1 while a move to alpha 2 waits in the slot; what was
    started (the waiting move's seq, with the previews drawn by then) and drawn."""
    p = {**view._run_params(), "alpha": 1.0}
    preview = view._compute_preview(p, CancelToken())
    assert is_preview(preview)
    started, drawn = [], []
    # the slot's submit: record the waiting move's start (its seq and the previews drawn by
    # then) instead of computing it
    view._slot._submit = lambda request, lane: (started.append((request[0], list(drawn))),
                                                CancelToken())[1]
    view.param.watch(lambda e: drawn.append(e.new is preview), "preview")
    view._seq += 2
    seq = view._seq - 1
    view._slot.busy = True
    view._slot.pending = (view._seq, {**p, "alpha": 2.0})
    now = time.perf_counter()
    view._show_preview((seq, p, preview, None, (now, now)))
    return started, drawn, preview


def test_served_the_waiting_move_starts_before_the_preview_is_drawn(tiny_model):
    view = LensView(tiny_model, prompt=PROMPT, k=2, steer_layer=1).wait()
    doc = Document()
    with set_curdoc(doc):
        doc.add_root(pn.panel(view).get_root(doc))
        view._background, view._doc = True, doc       # as in a served session
        try:
            started, drawn, preview = _delivered_with_a_move_waiting(view)
        finally:
            view._background, view._doc = False, None
            view.close()
    assert started == [(view._seq, [])]       # asked for before anything was drawn
    assert drawn == [True] and view.preview is preview
    assert view._slot.pending is None and view._slot.busy
    timing = view.preview_timings[-1]
    assert timing["compute_ms"] == 0 and timing["draw_ms"] > 0


def test_inline_the_preview_is_drawn_before_the_waiting_move_starts(tiny_model):
    view = LensView(tiny_model, prompt=PROMPT, k=2, steer_layer=1).wait()
    try:
        started, drawn, preview = _delivered_with_a_move_waiting(view)
    finally:
        view.close()
    assert started == [(view._seq, [True])]   # after the preview was drawn
    assert drawn == [True] and view.preview is preview
