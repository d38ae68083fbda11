"""Browser test of the representation-shattering page: served on a free local port with a tiny
model trained here, driven in headless chromium. Moving the edit-strength slider to 0 must
update the summary (R = 0) and redraw the embedding plot."""
from __future__ import annotations

import re

import pytest
from _browser import (gallery_page_state, open_page, painted, press_until, served_in_process,
                      wait_for_canvas, wait_for_text, wait_until)
from _views import KM_PARAMS

from explorer.commands._common import torch_threads

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def trained():
    """A tiny model (seconds of training, one thread) and a short edit sweep."""
    from explorer.analyses import shattering as sh

    with torch_threads(1):
        km = sh.train_knowledge_model(**KM_PARAMS)
        sweep = sh.edit_sweep(km, n_edits=6, distances=[1, 2, 3], method="finetune")
    return km, sweep


@pytest.fixture(scope="module")
def server(trained):
    pytest.importorskip("panel")
    from apps import theme
    from apps.shattering import ShatteringView

    km, sweep = trained

    def page():
        return theme.page([ShatteringView(km=km, sweep=sweep, method="finetune", entity="e3",
                                          relation="A+1", distance=2)], title="Shattering")

    with served_in_process({"shattering": page}) as url:
        yield url


def test_strength_slider_redraws_the_embedding(server, browser):
    page, errors = open_page(browser, f"{server}/shattering", viewport={"width": 1500, "height": 1300},
                             ready=".shattering-summary", timeout=240)
    text = wait_for_text(page, ".shattering-summary", r"e3 A\+1.*distance 2.*strength 1\.00: R = ([0-9.]+)")
    assert float(re.search(r"R = ([0-9.]+)", text).group(1)) > 0
    for css in (".shattering-embedding", ".shattering-scatter"):
        wait_for_canvas(page, css)
    embedding = page.locator(".shattering-embedding")
    wait_until(lambda: (plots := gallery_page_state(page)["plots"])
               and all(p["ink"] >= 0.002 for p in plots), 60, "every plot drawn")
    before = painted(embedding)   # and still
    # Sliders in order: distance, strength, layer. Home moves strength to 0.
    press_until(page, ".shattering-controls .noUi-handle", "Home", ".shattering-summary",
                r"strength 0\.00: R = 0\.000", nth=1)
    from playwright.sync_api import Error as PlaywrightError

    # the new embedding arrives after the summary; while its pane re-renders the element is
    # replaced, so a screenshot taken at that moment finds it detached: look again
    def redrawn() -> bool:
        try:
            return embedding.screenshot(timeout=5000) != before
        except PlaywrightError:
            return False
    wait_until(redrawn, 30, "the embedding redrawn")
    after = painted(embedding)
    assert after != before
    assert not errors, errors
    page.close()
