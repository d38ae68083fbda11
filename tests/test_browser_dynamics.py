"""Browser tests of the training-dynamics pages (streaming parity, linear ICL): served on a
free local port with tiny training runs made here, driven in headless chromium. Each test
waits for the Bokeh canvases, moves the training-step slider and checks that the page
followed (the summary line names the new checkpoint)."""
from __future__ import annotations

import re

import pytest
from _browser import open_page, press_until, served_in_process, wait_for_canvas, wait_for_text

from explorer.commands._common import torch_threads

pytestmark = pytest.mark.browser

VIEWPORT = {"width": 1500, "height": 1200}


@pytest.fixture(scope="module")
def runs():
    """Tiny runs: a few seconds of training each, single-threaded."""
    from explorer.analyses import linear_icl, parity

    with torch_threads(1):
        prun = parity.train_parity_rnn(hidden_size=16, epochs=20, checkpoint_every=5, max_length=6, seed=0)
        panalysis = parity.parity_analysis(prun, max_length=5, lengths=[10, 100, 1000], n_strings=4)
        icl_runs = {H: linear_icl.train_linear_icl(n_heads=H, steps=60, checkpoint_every=20, batch_size=64,
                                                   n_test=64, test_lengths=[10, 40], seed=0)
                    for H in (1, 2)}
    return {"parity": (prun, panalysis), "icl": icl_runs}


@pytest.fixture(scope="module")
def server(runs):
    pytest.importorskip("panel")
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

    with served_in_process({"parity": parity_page, "linear_icl": icl_page}) as url:
        yield url


def test_parity_page_scrubs_training_and_toggles_the_minimal_automaton(server, browser, runs):
    prun, _ = runs["parity"]
    last_step = int(prun["step"].values[-1])
    page, errors = open_page(browser, f"{server}/parity", viewport=VIEWPORT)
    wait_for_text(page, ".parity-summary", rf"Step {last_step}\b.*merged automaton")
    for css in (".parity-pca", ".parity-automaton", ".parity-accuracy", ".parity-curves", ".parity-phase"):
        wait_for_canvas(page, css)
    # On open the step slider sits on the step the plots show, the last (it once read 0
    # beside "Step 21000"): its handle at the top of its range of checkpoint indices.
    step_handle = page.locator(".parity-controls .noUi-handle").first
    assert (float(step_handle.get_attribute("aria-valuenow"))
            == float(step_handle.get_attribute("aria-valuemax")) == len(prun["step"]) - 1)
    # The step slider is the first slider: Home moves it to step 0.
    handle = ".parity-controls .noUi-handle"
    press_until(page, handle, "Home", ".parity-summary", r"Step 0 \(epoch 0\)")
    press_until(page, handle, "End", ".parity-summary", rf"Step {last_step}\b")
    page.locator(".parity-controls input[type=checkbox]").first.check()
    wait_for_text(page, ".parity-summary", r"Graph: minimal automaton")
    assert not errors, errors
    page.close()


def test_linear_icl_page_switches_heads_and_steps(server, browser, runs):
    page, errors = open_page(browser, f"{server}/linear_icl", viewport=VIEWPORT)
    wait_for_text(page, ".icl-summary", r"H = 2, step 60\b.*ω = \[[^\]]+,[^\]]+\]")
    for css in (".icl-kq", ".icl-ov", ".icl-loss", ".icl-length", ".icl-metrics"):
        wait_for_canvas(page, css)
    press_until(page, ".icl-controls .noUi-handle", "Home", ".icl-summary", r"H = 2, step 0\b")
    page.locator(".icl-controls button", has_text="1").first.click()
    text = wait_for_text(page, ".icl-summary", r"H = 1, step 0\b")
    assert re.search(r"ω = \[[^,\]]+\]", text)  # one head: one omega
    assert not errors, errors
    page.close()
