"""The Knowledge conflicts page's estimate of how long *Select heads as JuICE does* takes
(`apps._conflicts_estimate`): the run count by hand, the words, the page's button, and the
estimate against a timed selection on tiny-llama."""
from __future__ import annotations

import time

import numpy as np
import pytest

from apps._conflicts_estimate import (KEPT_AFTER_PRUNING, SELECT_LABEL, SelectionTiming,
                                      duration_words, estimated_selection_seconds,
                                      forget_timings, measure_selection_timing,
                                      selection_seconds_range)
from explorer.analyses import conflicts as C

FACTOR = 3.0
"""The estimate and a timed selection on tiny-llama agree within this factor either way (the
machine running the tests is shared, so one run's time moves with its load)."""


def test_estimate_counts_the_runs_by_hand():
    # one run costs 0.1 s a token (the line through (10, 1 s) and (30, 3 s): no fixed part)
    timing = SelectionTiming(tokens=(10, 20, 30), n_alphas=2, clean_seconds=1.0,
                             coherent_seconds=3.0)
    assert timing.run_seconds(20) == pytest.approx(2.0)
    # L=3, H=2: a run at layer l costs (4 - l) / 4 of one at layer 0: 1, 3/4, 1/2, mean 3/4
    depth = np.mean([(3 - layer + 1) / 4 for layer in range(3)])
    run1 = 0.1 * (5 + 10 + 15)                        # run 1 over the facts (tokens / alphas)
    every_head = run1 + 3 * 2 * depth * (1.0 + 2.0 + 3.0)
    assert estimated_selection_seconds(3, 2, timing) == pytest.approx(every_head)
    assert every_head == pytest.approx(30.0)
    pruned = run1 + 3 * 2 * depth * (1.0 + 0.5 * 2.0 + 0.25 * 3.0)
    kept = {"clean": 1.0, "substitution": 0.5, "coherent": 0.25}
    assert estimated_selection_seconds(3, 2, timing, kept) == pytest.approx(pruned)
    for direction in C.DIRECTIONS:
        low, high = selection_seconds_range(3, 2, timing, direction)
        assert low == pytest.approx(run1 + 3 * 2 * depth * sum(
            KEPT_AFTER_PRUNING[direction][k] * s
            for k, s in zip(C.PROMPT_KINDS, (1.0, 2.0, 3.0))))
        assert high == pytest.approx(every_head)
    # a fixed cost per run: (10, 2 s) and (30, 3 s) -> 1.5 s + 0.05 s a token
    fixed = SelectionTiming((10, 20, 30), 2, 2.0, 3.0)
    assert fixed.run_seconds(0) == pytest.approx(1.5) and fixed.run_seconds(20) == pytest.approx(2.5)


def test_pruned_shares_are_those_of_the_shipped_selection_runs():
    """The low end's shares per direction are the heads SmolLM2's 4-fact selection scored per
    prompt type (the evidence runs' JSON), out of its 30 x 9 heads."""
    import json
    from pathlib import Path

    figures = Path(__file__).resolve().parents[1] / "docs" / "figures"
    assert set(KEPT_AFTER_PRUNING) == set(C.DIRECTIONS)
    for direction in C.DIRECTIONS:
        summary = json.loads((figures / f"conflicts_summary_{direction}_select4.json").read_text())
        scored = summary["directions"][direction]["n_scored"]
        assert summary["model"].lower().startswith("smollm2")
        assert {k: pytest.approx(n / 270) for k, n in scored.items()} == KEPT_AFTER_PRUNING[direction]


def test_duration_words():
    assert duration_words(20.4, 49.6) == "about 20–50 s"
    assert duration_words(300, 780) == "about 5–13 min"
    assert duration_words(40, 120) == "about 40 s–2 min"
    assert duration_words(600, 610) == "about 10 min"
    assert duration_words(0.2, 0.3) == "about 1 s"


@pytest.mark.timing
@pytest.mark.slow
def test_estimate_agrees_with_a_timed_selection_on_tiny(tiny_model):
    """Measured on the machine at hand, then the selection itself timed: the estimate with
    the share of heads the run scored is within `FACTOR` of its time, and the time within the
    shown range widened by `FACTOR`."""
    facts = C.load_facts()[:2]
    timing = measure_selection_timing(tiny_model, facts)
    L, H = tiny_model.n_layers, tiny_model.spec.n_heads
    started = time.perf_counter()
    ds = C.juice_head_selection(tiny_model, facts, k=3, prune=True)
    measured = time.perf_counter() - started
    kept = {k: float(np.isfinite(ds.delta_plus.values[i]).mean())
            for i, k in enumerate(C.PROMPT_KINDS)}
    estimate = estimated_selection_seconds(L, H, timing, kept)
    low, high = selection_seconds_range(L, H, timing)
    print(f"tiny-llama, 2 facts: measured {measured:.1f} s, estimate {estimate:.1f} s "
          f"(range {low:.1f}-{high:.1f} s), kept {kept}")
    assert estimate / FACTOR <= measured <= estimate * FACTOR, (measured, estimate)
    assert low / FACTOR <= measured <= high * FACTOR, (measured, low, high)


def test_page_says_the_time_on_the_button(tiny_model):
    import panel as pn

    from apps.conflicts import ConflictsView

    facts = C.load_facts(["country_capital"])[:3]
    forget_timings()                                      # measured by an earlier test
    quiet = ConflictsView(tiny_model, facts=facts, closed_book=False, background=False)
    assert quiet.selection_timing() is None and quiet.select_label() == SELECT_LABEL
    view = ConflictsView(tiny_model, facts=facts, closed_book=False, background=False,
                         estimate_time=True)
    timing = view.selection_timing()
    assert timing is not None and view.bar_rows is not None     # measured after the bars
    prompts = [C.conflict_prompt(facts[0], k) for k in C.PROMPT_KINDS]
    assert timing.tokens == tuple(8 * tiny_model.tokenize([p]).width for p in prompts)
    low, high = selection_seconds_range(tiny_model.n_layers, tiny_model.spec.n_heads, timing)
    label = f"{SELECT_LABEL} ({duration_words(low, high)})"
    context = selection_seconds_range(tiny_model.n_layers, tiny_model.spec.n_heads, timing,
                                      "context")
    assert context[0] > low and context[1] == high   # fewer heads pruned toward the context
    assert view.select_label() == label
    assert view.select_estimate_words().startswith(f"Takes {duration_words(low, high)} here: "
                                                   "1 fact × 8 α × 3 prompt types over 12 heads")
    root = view.__panel__()
    assert [b.label for b in root.select(pn.widgets.Button)
            if b.label.startswith(SELECT_LABEL)] == [label]
    # more facts: measured again on the first three (the example and the next ones)
    view.select_facts = 3
    more = view.selection_timing()
    widths = [tiny_model.tokenize([C.conflict_prompt(f, "coherent") for f in facts]).width]
    assert more is not None and more.tokens[-1] == 3 * 8 * widths[0]
    assert "3 facts × 8 α" in view.select_estimate_words()
    assert [b.label for b in root.select(pn.widgets.Button)
            if b.label.startswith(SELECT_LABEL)] == [view.select_label()]
    # toward the context fewer heads are pruned: the range and the button follow the direction
    view.direction = "context"
    want = selection_seconds_range(tiny_model.n_layers, tiny_model.spec.n_heads, more, "context")
    assert view.selection_seconds() == pytest.approx(want)
    assert [b.label for b in root.select(pn.widgets.Button)
            if b.label.startswith(SELECT_LABEL)] == [f"{SELECT_LABEL} ({duration_words(*want)})"]
    # a second session's page on the model reads the timings measured: no new measurement
    again = ConflictsView(tiny_model, facts=facts, closed_book=False, background=False,
                          estimate_time=True, select_facts=3)
    assert again.selection_timing() is more


def test_a_measurement_in_flight_gives_way_to_a_drag(tiny_model, monkeypatch):
    """Served, the measurement starts after the first bars. A slider's preview stops it at its
    next run (it would slow the drag); the next exact bars start it again, and it completes."""
    import threading

    from apps import _conflicts_estimate as E
    from apps._session import Cancelled
    from apps.conflicts import ConflictsView

    real, started, stopped, calls = E.measure_selection_timing, threading.Event(), threading.Event(), []

    def slow_first(model, facts, *, check=None, **kwargs):  # the real one, after a slow start once
        calls.append(len(facts))
        if len(calls) == 1:
            started.set()
            deadline = time.time() + 30
            while time.time() < deadline:
                try:
                    check()
                except Cancelled:
                    stopped.set()
                    raise
                time.sleep(0.02)
        return real(model, facts, check=check, **kwargs)

    monkeypatch.setattr(E, "measure_selection_timing", slow_first)
    forget_timings()
    facts = C.load_facts(["country_capital"])[:3]
    view = ConflictsView(tiny_model, facts=facts, closed_book=False, background=True,
                         estimate_time=True)
    assert started.wait(60), "no measurement after the first bars"
    view.request_preview("alpha_l", 1.5)                  # a drag
    assert stopped.wait(10) and view.selection_timing() is None
    view.alpha_l = 1.5                                    # the release: exact bars, then again
    deadline = time.time() + 60
    while view.selection_timing() is None and time.time() < deadline:
        time.sleep(0.05)
    assert view.selection_timing() is not None and len(calls) == 2
    view.close()


def test_the_gallery_tells_the_page_it_left_and_the_page_it_shows(tiny_model):
    """Leaving the conflicts page stops its measurement (`page_hidden`: the shown page's work
    comes first); showing it again measures what is missing (`page_shown`)."""
    import functools

    from apps.conflicts import ConflictsView
    from apps.gallery import VIEWS, Gallery

    forget_timings()
    facts = C.load_facts(["country_capital"])[:3]
    small = functools.partial(ConflictsView, facts=facts, closed_book=False, estimate_time=True)
    views = [(t, s, small if s == "conflicts" else f) for t, s, f in VIEWS
             if s in ("conflicts", "study")]
    gallery = Gallery("tiny-llama", views=views, view="conflicts")
    page = gallery.page("conflicts")
    assert page.selection_timing() is not None            # measured after its first bars
    heard = []
    cancel = page.cancel
    page.cancel = lambda name=None: (heard.append(("cancel", name)), cancel(name))
    gallery.view = "study"
    assert heard == [("cancel", "timing")]
    forget_timings()                                      # as if never measured
    assert page.selection_timing() is None
    gallery.view = "conflicts"
    assert page.selection_timing() is not None            # measured again on return
