"""The logit lens page's heatmap follows a drag of the steering-strength slider (SmolLM2).

The gallery is served in a child process at 2 torch threads with a 32-token prompt
(`benchmarks/slider_drag.py`, the same code the benchmark figures come from); chromium drags
the handle in 12 px moves and each move is timed from its pointer event to the frame whose
heatmap pixels changed. The targets are p50 <= 150 ms and p90 <= 300 ms on 2 cores; the
assertions allow 4x (p50 <= 600 ms) and 5x (p90 <= 1,500 ms) and every move drawn within
5 s, because the shared 2-core machines this suite runs on are often loaded 5-10x
(benchmarks/README.md gives the figures and the load), while a 10x regression of the
drag (a figure re-created per move, moves queued instead of dropped: 1-2 s a move) fails.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from _browser import free_port

pytestmark = [pytest.mark.browser, pytest.mark.integration, pytest.mark.timing]

ROOT = Path(__file__).resolve().parents[1]
P50_MS, P90_MS = 600.0, 1500.0


def _slider_drag():
    spec = importlib.util.spec_from_file_location("slider_drag", ROOT / "benchmarks" / "slider_drag.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def drag_server(tmp_path_factory):
    from _browser import served_in_subprocess

    port = free_port()
    log = tmp_path_factory.mktemp("slider-drag") / "server.log"
    argv = [str(ROOT / "benchmarks" / "slider_drag.py"), "--serve", str(port), "--threads", "2",
            "--tokens", "32"]
    with served_in_subprocess(argv, port, log, env={"PYTHONPATH": str(ROOT)}) as url:
        yield url + "/"


def test_the_heatmap_follows_a_drag(browser, drag_server):
    sd = _slider_drag()
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(drag_server, timeout=180_000)
    page.locator("[data-lens-digest]").first.wait_for(state="attached", timeout=300_000)
    page.wait_for_function(f"({sd._FRAME_HASH})() !== null", timeout=120_000)
    sd.wait_ready(page, timeout_s=120)   # the page's warm-up preview after its first lens
    each = sd.drag_latencies(page, moves=8, step_px=12, timeout_s=5.0)
    sd.wait_ready(page, timeout_s=120)   # the exact lens on release, and the warm-up again
    each += sd.drag_latencies(page, moves=8, step_px=12, timeout_s=5.0, direction=-1)
    got = sd.summary(each)
    load = os.getloadavg()[0]
    print(f"drag: {got} (load {load:.1f})")
    assert got["missing"] == 0, f"moves not redrawn within 5 s: {got['each_ms']} (load {load:.1f})"
    assert got["p50_ms"] <= P50_MS and got["p90_ms"] <= P90_MS, (got, f"load {load:.1f}")
    page.close()
