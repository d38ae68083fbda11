"""`explorer bench pages`: each gallery page's first result and its slider's drag, timed in
headless chromium.

Run here at its smallest (tiny-llama, the logit lens only, one drag of three steps) for the
shape of its result and the consistency of its figures; the full run's figures are in
benchmarks/README.md.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from explorer._checks import InputError
from explorer.bench import run_bench
from explorer.benches.pages import page_table, percentile


@pytest.mark.parametrize("values,q", [([5.0], 50), ([1.0, 2.0], 50), ([3.0, 1.0, 2.0, 10.0], 90),
                                      ([7.0, 1.5, 4.0, 4.0, 9.0, 2.0], 10)])
def test_percentile_is_numpys_linear_one(values, q):
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


@pytest.mark.parametrize("options,match", [({"runs": 0}, r"`runs` must be an int in \[1, 20\]"),
                                           ({"pages": " , "}, "must list page slugs"),
                                           ({"moves": 0}, r"`moves` must be an int in \[1, 40\]"),
                                           ({"quiet_s": 0.0}, "quiet_s")])
def test_bad_options_are_refused_before_anything_starts(options, match):
    with pytest.raises(InputError, match=match):
        run_bench("pages", model="tiny-llama", **options)


def test_the_table_has_a_row_per_page_and_dashes_for_what_was_not_measured():
    result = {"params": {"per_page": {
        "lens": {"first_result_ms": 812.4, "settled_ms": 1500.0,
                 "drag": {"p50_ms": 120.0, "p90_ms": 230.6, "missing": 0,
                          "release_exact_ms": 410.2}},
        "parity": {"first_result_ms": None, "settled_ms": 30.0}}}}
    lines = page_table(result).splitlines()
    assert lines[0].split()[:3] == ["page", "first", "result"]
    assert set(lines[1]) == {"-"}
    assert lines[2].split() == ["lens", "812", "1500", "120", "231", "0", "410"]
    assert lines[3].split() == ["parity", "-", "30", "-", "-", "-", "-"]


@pytest.mark.browser
@pytest.mark.slow
def test_pages_bench_on_the_tiny_model(capsys):
    from explorer import cli

    status = cli.main(["bench", "pages", "--model", "tiny-llama", "--pages", "lens", "--runs", "1",
                       "--option", "drags=1", "--option", "moves=3", "--option", "timeout_s=240",
                       "--json"])
    assert status == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bench"] == "pages" and out["params"]["pages"] == ["lens"]
    f, lens = out["figures"], out["params"]["per_page"]["lens"]
    assert 0 < lens["first_result_ms"] <= lens["settled_ms"]
    assert f["lens_first_result_ms"] == lens["first_result_ms"]
    drag = lens["drag"]
    drawn = [ms for ms in drag["each_ms"] if ms is not None]
    assert 1 <= drag["steps"] <= 3 and drag["missing"] == drag["steps"] - len(drawn)
    assert drawn and all(ms > 0 for ms in drawn)
    assert 0 < f["lens_drag_p50_ms"] <= f["lens_drag_p90_ms"] <= drag["max_ms"] == max(drawn)
    assert f["lens_drag_p50_ms"] == pytest.approx(np.percentile(drawn, 50), abs=0.06)
    assert f["lens_drag_p90_ms"] == pytest.approx(np.percentile(drawn, 90), abs=0.06)
    # the parts of a step lie inside it: event → message sent → last message in → frame
    assert 0 <= drag["input_p50_ms"] and 0 < drag["server_p50_ms"] and 0 <= drag["paint_p50_ms"]
    assert drag["input_p50_ms"] + drag["server_p50_ms"] <= drag["max_ms"]
    assert f["lens_release_exact_ms"] > 0
    assert 0 < f["signature_ms"] < 1000 and f["frame_idle_ms"] > 0


def test_the_buttons_pressed_before_a_drag_are_buttons_of_their_pages(tiny_model):
    """`PREPARE` names a button of each page it lists, and only pages with a live slider."""
    import panel as pn

    from apps.conflicts import ConflictsView
    from explorer.analyses.conflicts import load_facts
    from explorer.benches.pages import PREPARE, SLIDERS

    assert set(PREPARE) <= set(SLIDERS)
    view = ConflictsView(tiny_model, facts=load_facts(["country_capital"])[:1],
                         closed_book=False, background=False)
    labels = [b.label for b in view.__panel__().select(pn.widgets.Button)]
    assert PREPARE["conflicts"] in labels
    from apps.circuits import CircuitsView

    circuits = CircuitsView(tiny_model, background=False, autostart=False)
    assert PREPARE["circuits"] in [b.label for b in circuits.__panel__().select(pn.widgets.Button)]
