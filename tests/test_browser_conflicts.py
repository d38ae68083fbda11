"""Browser test of the knowledge-conflicts page (apps/conflicts.py) on the tiny model.

The page is served in a subprocess on a free 127.0.0.1 port; Playwright drives Debian's
chromium: wait for the head scores and the bars, click a cell of the layer x head heatmap
(the head joins S+), move the alpha_l slider with the keyboard (the "after" bars change),
press "Score the whole split" (a results table appears). A screenshot goes to
``test-artifacts/`` (gitignored).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests._browser import free_port

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"


@pytest.fixture(scope="module")
def page_url(tmp_path_factory):
    port = free_port()
    code = textwrap.dedent(f"""
        import socket
        import panel as pn
        import torch
        torch.set_num_threads(1)
        from apps import theme
        from apps.conflicts import ConflictsView
        from explorer import load_model
        from explorer.analyses.conflicts import load_facts

        model = load_model("tiny-llama")
        facts = load_facts(["country_capital"])[:3]
        theme.enable_extension()

        def app():
            view = ConflictsView(model, facts=facts, closed_book=False, n_new=2)
            return theme.page([view], title="Knowledge conflicts")

        server = pn.serve({{"conflicts": app}}, port={port}, address="127.0.0.1", threaded=True,
                          show=False)
        server.join()
    """)
    log_path = tmp_path_factory.mktemp("conflicts-server") / "server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    import socket

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
        yield f"http://127.0.0.1:{port}/conflicts"
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


def wait_for(page, name: str, predicate, timeout: float = 120) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = attribute(page, name)
        if predicate(value):
            return value
        time.sleep(0.2)
    raise AssertionError(f"{name} is {attribute(page, name)!r} after {timeout} s")


def slider_handle(page, low: float, high: float):
    handles = page.locator(".noUi-handle")
    for i in range(handles.count()):
        h = handles.nth(i)
        if (float(h.get_attribute("aria-valuemin")) == low
                and float(h.get_attribute("aria-valuemax")) == high):
            return h
    raise AssertionError(f"no slider with range {low}..{high}")


def test_click_a_head_move_alpha_and_score_the_split(page_url, browser):
    page = browser.new_page(viewport={"width": 1500, "height": 1300})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(page_url, timeout=60_000)
    page.locator(".cf-state").first.wait_for(state="attached", timeout=240_000)
    wait_for(page, "data-cf-scores", lambda v: v == "ready")
    before = wait_for(page, "data-cf-after", lambda v: v != "none")
    assert attribute(page, "data-cf-plus") == ""
    # the heatmap is the first plot; wait for it to render, then click inside its frame
    canvas = page.locator(".bk-Canvas").first
    canvas.wait_for(state="visible", timeout=60_000)
    time.sleep(1.5)
    box = canvas.bounding_box()
    page.mouse.click(box["x"] + 0.45 * box["width"], box["y"] + 0.5 * box["height"])
    plus = wait_for(page, "data-cf-plus", lambda v: v != "", timeout=30)
    assert plus.startswith("L") and ".H" in plus and "," not in plus
    # a head with alpha_l = 1 already changes the "after" bars; one slider step more changes them again
    after1 = wait_for(page, "data-cf-after", lambda v: v != before, timeout=60)
    handle = slider_handle(page, 0, 5)
    handle.focus()
    handle.press("ArrowRight")
    wait_for(page, "data-cf-after", lambda v: v != after1, timeout=60)
    assert attribute(page, "data-cf-accuracy") == "none"
    page.get_by_role("button", name="Score the whole split").click()
    assert wait_for(page, "data-cf-accuracy", lambda v: v != "none", timeout=120) == "3"
    table = page.locator("table").filter(has_text="JuICE dual run")
    table.first.wait_for(state="visible", timeout=30_000)
    assert "to context, substitution" in table.first.inner_text()
    time.sleep(1.5)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "conflicts_page.png"), full_page=True)
    assert not errors, errors
    page.close()
