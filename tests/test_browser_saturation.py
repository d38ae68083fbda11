"""Browser test of the saturation page (apps/saturation.py) on the tiny model.

The page is served in a subprocess on a free 127.0.0.1 port; Playwright drives Debian's
chromium: wait for the Bokeh canvases, click a token (the detail updates), move the k
slider with the keyboard (the Kendall-tau histogram changes). Screenshots go to
``test-artifacts/`` (gitignored).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def page_url(tmp_path_factory):
    port = free_port()
    code = textwrap.dedent(f"""
        import panel as pn
        from apps import theme
        from apps.saturation import SaturationView
        from explorer import load_model

        model = load_model("tiny-llama")
        theme.enable_extension()

        def app():
            view = SaturationView(model, store=None, n_tokens=400, analysis_options=dict(
                n_permutations=100, n_pairs=1, sample_positions=200))
            return view.page()

        pn.serve(app, port={port}, address="127.0.0.1", show=False)
    """)
    log_path = tmp_path_factory.mktemp("saturation-server") / "server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    deadline = time.time() + 240
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited: {log_path.read_text()[-2000:]}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if time.time() > deadline:
                raise RuntimeError("the server did not start in time")
            time.sleep(0.3)
        yield f"http://127.0.0.1:{port}/"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def attribute(page, name: str) -> str:
    return page.locator(f"[{name}]").first.get_attribute(name)


def wait_for_change(page, name: str, old: str, timeout: float = 60) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = attribute(page, name)
        if value != old:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{name} stayed {old!r} for {timeout} s")


def wait_for_value(page, name: str, expected: str, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while attribute(page, name) != expected:
        if time.time() > deadline:
            raise AssertionError(f"{name} is {attribute(page, name)!r}, not {expected!r}, after {timeout} s")
        time.sleep(0.2)


def k_slider_handle(page):
    """The noUiSlider handle of the k slider: the one whose range is 1..10."""
    handles = page.locator(".noUi-handle")
    for i in range(handles.count()):
        h = handles.nth(i)
        if float(h.get_attribute("aria-valuemin")) == 1 and float(h.get_attribute("aria-valuemax")) == 10:
            return h
    raise AssertionError("no slider with range 1..10 (the k slider) on the page")


def test_click_token_and_move_k(page_url, browser):
    page = browser.new_page(viewport={"width": 1500, "height": 1400})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(page_url, timeout=60_000)
    page.locator(".sat-token").first.wait_for(state="attached", timeout=240_000)
    page.locator(".sat-tau-hist canvas").first.wait_for(state="attached", timeout=60_000)
    page.locator(".sat-rank-table canvas").first.wait_for(state="attached", timeout=60_000)
    assert attribute(page, "data-sat-detail") == "none"

    # click a token: the detail header and the table/staircase follow the clicked position
    page.locator(".sat-token[data-pos='7']").click()
    assert wait_for_change(page, "data-sat-detail", "none") == "0:7:5"
    assert "sat-selected" in page.locator(".sat-token[data-pos='7']").get_attribute("class")
    page.locator(".sat-token[data-pos='12']").click()
    assert wait_for_change(page, "data-sat-detail", "0:7:5") == "0:12:5"

    # move k from 5 to 3 with the keyboard: the histogram changes, the detail shows 3 ranks
    before = attribute(page, "data-sat-hist")
    handle = k_slider_handle(page)
    assert float(handle.get_attribute("aria-valuenow")) == 5
    handle.focus()
    handle.press("ArrowLeft")
    handle.press("ArrowLeft")
    wait_for_value(page, "data-sat-detail", "0:12:3")
    assert float(handle.get_attribute("aria-valuenow")) == 3
    assert wait_for_change(page, "data-sat-hist", before) != before
    page.locator(".sat-tau-hist canvas").first.wait_for(state="attached", timeout=30_000)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "saturation_page.png"), full_page=True)
    assert not errors, errors
    page.close()
