"""Browser tests of the ITDA and neuron-evaluation pages: served, driven in headless chromium.

Each page is served on a free local port with the tiny random-init model; Playwright drives
Debian's chromium. The tests wait for the Bokeh canvases, move a control and check that the
page recomputed (the dictionary summary, the metric table, the animated seed).
"""
from __future__ import annotations

import re

import pytest
from _browser import open_page, served_in_process, wait_for_text

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def server(tiny_model):
    pytest.importorskip("panel")
    from apps import theme
    from apps.itda import ITDAView
    from apps.neuron_eval import NeuronEvalView

    def itda_page():
        return theme.page([ITDAView(tiny_model, layer=1)], title="ITDA")

    def neuron_page():
        return theme.page([NeuronEvalView(tiny_model, layer=1, n_seeds=3)], title="Neuron evaluation")

    with served_in_process({"itda": itda_page, "neuron": neuron_page}) as url:
        yield url


def test_itda_page_renders_and_tau_slider_rebuilds_the_dictionary(server, browser):
    page, errors = open_page(browser, f"{server}/itda")
    before = wait_for_text(page, ".itda-summary", r"\d+ atoms from \d+ tokens")
    assert page.locator(".itda-curves canvas").count() >= 1         # size / error / L0 curves
    wait_for_text(page, ".itda-similarity-status", r"Not computed yet")  # the heatmap waits for its button
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
    # compare with the second model: the heatmap and its caption appear under the button
    page.locator(".itda-similarity-controls button", has_text="Compare layers").click()
    wait_for_text(page, ".itda-similarity-status", r"Compared in [0-9.]+ s", timeout=120)
    page.wait_for_selector(".itda-similarity canvas", state="visible", timeout=60_000)
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
