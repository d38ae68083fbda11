"""Browser tests of the training-dynamics pages (streaming parity, linear ICL): served on a
free local port with tiny training runs made here, driven in headless chromium. Each test
waits for the Bokeh canvases, moves the training-step slider and checks that the page
followed (the summary line names the new checkpoint)."""
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
def runs():
    """Tiny runs: a few seconds of training each, single-threaded."""
    import torch

    from explorer.analyses import linear_icl, parity

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        prun = parity.train_parity_rnn(hidden_size=16, epochs=20, checkpoint_every=5, max_length=6, seed=0)
        panalysis = parity.parity_analysis(prun, max_length=5, lengths=[10, 100, 1000], n_strings=4)
        icl_runs = {H: linear_icl.train_linear_icl(n_heads=H, steps=60, checkpoint_every=20, batch_size=64,
                                                   n_test=64, test_lengths=[10, 40], seed=0)
                    for H in (1, 2)}
    finally:
        torch.set_num_threads(before)
    return {"parity": (prun, panalysis), "icl": icl_runs}


@pytest.fixture(scope="module")
def server(runs):
    pn = pytest.importorskip("panel")
    from apps import theme
    from apps.linear_icl import LinearICLView
    from apps.parity import ParityView

    import numpy as np
    import xarray as xr

    prun, panalysis = runs["parity"]
    phase = xr.Dataset(  # a hand-made 1 x 2 phase diagram for the heatmap
        {"is_parity_automaton": (("gain", "max_length"), [[1.0, 0.0]]),
         "transition_epoch": (("gain", "max_length"), [[540.0, np.nan]]),
         "final_n_states_minimal": (("gain", "max_length"), [[2.0, 13.0]]),
         "long_accuracy": (("gain", "max_length"), [[1.0, 0.5]])},
        coords={"gain": [0.1], "max_length": [6, 8]}, attrs={"params": {"epochs": 1000}})

    def parity_page():
        return theme.page([ParityView(run=prun, analysis=panalysis, phase=phase, max_length=5)],
                          title="Parity")

    def icl_page():
        return theme.page([LinearICLView(runs=runs["icl"])], title="Linear ICL")

    theme.enable_extension()
    port = free_port()
    srv = pn.serve({"parity": parity_page, "linear_icl": icl_page}, port=port, address="127.0.0.1",
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
    page = browser.new_page(viewport={"width": 1500, "height": 1200})
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    # Generous timeouts: the machine running the suite may be busy.
    page.goto(url, timeout=180_000)
    page.wait_for_selector(".bk-Canvas canvas, canvas", state="attached", timeout=300_000)
    return page, errors


# Panel panes render inside a shadow root, after their <style> elements
_SHADOW_TEXT = """el => el.shadowRoot
    ? Array.from(el.shadowRoot.children).filter(c => !['STYLE', 'LINK'].includes(c.tagName))
        .map(c => c.innerText).join(' ')
    : el.innerText"""


def wait_for_text(page, selector: str, pattern: str, timeout: float = 240) -> str:
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


def wait_for_canvas(page, selector: str, timeout: float = 240) -> None:
    page.wait_for_selector(f"{selector} canvas", state="attached", timeout=timeout * 1000)


def test_parity_page_scrubs_training_and_toggles_the_minimal_automaton(server, browser, runs):
    prun, _ = runs["parity"]
    last_step = int(prun["step"].values[-1])
    page, errors = open_page(browser, f"{server}/parity")
    wait_for_text(page, ".parity-summary", rf"Step {last_step}\b.*merged automaton")
    for css in (".parity-pca", ".parity-automaton", ".parity-accuracy", ".parity-curves", ".parity-phase"):
        wait_for_canvas(page, css)
    # The step slider is the first slider: Home moves it to step 0.
    handle = page.locator(".parity-controls .noUi-handle").first
    handle.focus()
    handle.press("Home")
    wait_for_text(page, ".parity-summary", r"Step 0 \(epoch 0\)")
    handle.press("End")
    wait_for_text(page, ".parity-summary", rf"Step {last_step}\b")
    page.locator(".parity-controls input[type=checkbox]").first.check()
    wait_for_text(page, ".parity-summary", r"Graph: minimal automaton")
    assert not errors, errors
    page.close()


def test_linear_icl_page_switches_heads_and_steps(server, browser, runs):
    page, errors = open_page(browser, f"{server}/linear_icl")
    wait_for_text(page, ".icl-summary", r"H = 2, step 60\b.*ω = \[[^\]]+,[^\]]+\]")
    for css in (".icl-kq", ".icl-ov", ".icl-loss", ".icl-length", ".icl-metrics"):
        wait_for_canvas(page, css)
    handle = page.locator(".icl-controls .noUi-handle").first
    handle.focus()
    handle.press("Home")
    wait_for_text(page, ".icl-summary", r"H = 2, step 0\b")
    page.locator(".icl-controls button", has_text="1").first.click()
    text = wait_for_text(page, ".icl-summary", r"H = 1, step 0\b")
    assert re.search(r"ω = \[[^,\]]+\]", text)  # one head: one omega
    assert not errors, errors
    page.close()
