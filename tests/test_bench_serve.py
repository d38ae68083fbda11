"""`explorer bench serve`: a served gallery measured from real browser sessions.

Run here at its smallest (tiny-llama, 2 sessions, one heavy job) for the shape of its result
and the consistency of its figures; the full run's figures are in benchmarks/README.md.
"""
from __future__ import annotations

import pytest

from explorer._checks import InputError
from explorer.bench import run_bench


@pytest.mark.parametrize("options,match", [({"sessions": ""}, "must list session counts"),
                                           ({"sessions": "2,x"}, "must list session counts"),
                                           ({"sessions": "0"}, r"`sessions` must be an int in \[1, 64\]"),
                                           ({"heavy": -1}, r"`heavy` must be an int in \[0, 63\]")])
def test_bad_options_are_refused_before_anything_starts(options, match):
    with pytest.raises(InputError, match=match):
        run_bench("serve", model="tiny-llama", **options)


@pytest.mark.browser
@pytest.mark.slow
def test_serve_bench_on_the_tiny_model(monkeypatch):
    from explorer.benches import serve

    # No wait after the sessions close (the server drops a closed session after 15-32 s, so
    # a short wait changes none of the figures checked here, only the test's time), and 1 s
    # rather than 5 s for the one heavy tab to show a queue wait: the server runs at least
    # one heavy job at once, so a single heavy job never waits.
    monkeypatch.setattr(serve, "QUEUE_WAIT_GRACE_S", 1.0)
    out = run_bench("serve", model="tiny-llama", sessions="2", heavy=1, updates=1,
                    idle_sessions=2, close_wait_s=0, timeout_s=300)
    f, per_n = out["figures"], out["params"]["per_n"]
    assert set(per_n) == {"2"}
    entry = per_n["2"]
    assert entry["light_sessions"] == 1 and entry["heavy_sessions"] == 1
    assert len(entry["queue_wait_ms"]) == 1 and entry["queue_wait_ms"][0] >= 0
    assert f["lens_open_quiet_ms"] > 0 and f["lens_update_quiet_ms"] > 0
    assert f["lens_open_loaded_ms"] == entry["lens_open_ms"]
    assert f["lens_open_loaded_ratio"] == pytest.approx(entry["lens_open_ms"] / f["lens_open_quiet_ms"])
    assert f["after_close_vs_one_session_ratio"] == pytest.approx(
        entry["server_after_close_mb"] / f["server_one_session_mb"])
    # the server holds the model: every reading is well above an empty interpreter
    for key in ("server_no_session_mb", "server_one_session_mb", "server_after_close_mb"):
        assert 100 < f[key] < 24_000, key
    assert entry["server_peak_mb"] >= entry["server_after_close_mb"] * 0.5
    assert f["idle_session_mb"] > 0
