"""Browser tests of the ITDA and neuron-evaluation pages: served, driven in headless chromium.

Each page is served on a free local port with the tiny random-init model; Playwright drives
Debian's chromium. The tests wait for the Bokeh canvases, move a control and check that the
page recomputed (the dictionary summary, the metric table, the animated seed).
"""
from __future__ import annotations

import re
import socket
import time

import pytest

pytestmark = pytest.mark.browser


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_model):
    pn = pytest.importorskip("panel")
    from apps import theme
    from apps.itda import ITDAView
    from apps.neuron_eval import NeuronEvalView

    def itda_page():
        return theme.page([ITDAView(tiny_model, layer=1)], title="ITDA")

    def neuron_page():
        return theme.page([NeuronEvalView(tiny_model, layer=1, n_seeds=3)], title="Neuron evaluation")

    theme.enable_extension()
    port = free_port()
    srv = pn.serve({"itda": itda_page, "neuron": neuron_page}, port=port, address="127.0.0.1",
                   threaded=True, show=False, websocket_origin=[f"127.0.0.1:{port}"])
    deadline = time.time() + 30
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.2)
    yield f"http://127.0.0.1:{port}"
    srv.stop()


def open_page(browser, url):
    page = browser.new_page(viewport={"width": 1500, "height": 1100})
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(url, timeout=60_000)
    page.wait_for_selector(".bk-Canvas canvas, canvas", state="attached", timeout=120_000)
    return page, errors


# Panel panes render inside a shadow root, after their <style> elements
_SHADOW_TEXT = """el => el.shadowRoot
    ? Array.from(el.shadowRoot.children).filter(c => !['STYLE', 'LINK'].includes(c.tagName))
        .map(c => c.innerText).join(' ')
    : el.innerText"""


def wait_for_text(page, selector: str, pattern: str, timeout: float = 120) -> str:
    deadline = time.time() + timeout
    last = ""
    while time.time() < deadline:
        loc = page.locator(selector)
        if loc.count():
            last = loc.first.evaluate(_SHADOW_TEXT)
            if re.search(pattern, last):
                return last
        page.wait_for_timeout(250)
    raise AssertionError(f"{selector!r} never matched {pattern!r}; last text: {last!r}")


def test_itda_page_renders_and_tau_slider_rebuilds_the_dictionary(server, browser):
    page, errors = open_page(browser, f"{server}/itda")
    before = wait_for_text(page, ".itda-summary", r"\d+ atoms from \d+ tokens")
    assert page.locator(".itda-curves canvas").count() >= 1         # size / error / L0 curves
    assert page.locator(".itda-similarity canvas").count() >= 1     # the layer heatmap
    wait_for_text(page, ".itda-atoms", r"Atom 0")
    assert page.locator(".itda-atoms mark").count() >= 1            # highlighted tokens
    n_before = int(re.search(r"(\d+) atoms", before).group(1))
    # move the tau slider to its minimum with the keyboard: far more atoms
    handle = page.locator(".itda-controls .noUi-handle").nth(1)      # layer, tau, l0, noise
    handle.focus()
    handle.press("Home")
    after = wait_for_text(page, ".itda-summary", rf"\b(?!{n_before}\b)\d+ atoms from \d+ tokens")
    n_after = int(re.search(r"(\d+) atoms", after).group(1))
    assert n_after > n_before
    # browse another atom
    box = page.locator(".itda-controls input[type=text], .itda-controls input[type=number]").first
    box.fill("2")
    box.press("Enter")
    wait_for_text(page, ".itda-atoms", r"Atom 2")
    assert not errors, errors
    page.close()


def test_neuron_eval_page_shows_metrics_animation_and_pass_fail_table(server, browser):
    page, errors = open_page(browser, f"{server}/neuron")
    caption = wait_for_text(page, ".neuron-score-table", r"Unit: atom 0 of \d+.*seed 0")
    assert "f1" in caption and "auprc" in caption
    assert page.locator(".neuron-deltas canvas").count() >= 1
    assert page.locator(".neuron-strips canvas").count() >= 1
    # the pass/fail table of the synthetic units matches the paper's verdicts
    wait_for_text(page, ".neuron-passfail-pane", r"synthetic units")
    assert page.locator("td.verdict[data-metric='iou']").first.inner_text() == "pass"
    assert page.locator("td.verdict[data-metric='recall']").first.inner_text() == "fail"
    assert page.locator("td.verdict[data-metric='precision']").first.inner_text() == "fail"
    # pick another unit: the scores follow
    unit_box = page.locator(".neuron-controls input[type=text], .neuron-controls input[type=number]").first
    unit_box.fill("3")
    unit_box.press("Enter")
    wait_for_text(page, ".neuron-score-table", r"Unit: atom 3 of")
    # play the seed: both perturbations are redrawn seed after seed
    page.locator(".neuron-controls button.play").click()
    wait_for_text(page, ".neuron-score-table", r"seed [1-9]", timeout=60)
    assert not errors, errors
    page.close()
