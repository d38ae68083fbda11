"""The Logit attribution and Feature dashboards pages in a real browser (tiny-llama gallery):
both open from the sidebar, their plots are drawn at real sizes with ink in them, a click on
a DLA heatmap cell selects that component in the workspace, and the features page shows its
contexts and steers the workspace."""
from __future__ import annotations

import pytest
from _browser import (ARTIFACTS, FRAME_IN_PANE, gallery_page_state, open_gallery, plot_ids,
                      served_galleries, settle_gallery_page, wait_for_text)

from explorer.interventions import Ablate

pytestmark = pytest.mark.browser

MIN_FRAME = 60


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    from apps.dla import DLAView
    from apps.features import FeaturesView

    views = [("Logit attribution", "dla", DLAView),
             ("Feature dashboards", "features",
              lambda m: FeaturesView(m, corpus_tokens=128, layer=1))]
    with served_galleries("tiny-llama", views=views, view="dla") as served:
        yield served


def _open(tab, title):
    before = plot_ids(tab)
    tab.locator(".bk-btn-group button", has_text=title).first.click()
    tab.mouse.move(640, 10)
    assert settle_gallery_page(tab, before=before, timeout=240)


def _sizes_and_ink(tab):
    plots = gallery_page_state(tab)["plots"]
    assert plots, "no plot drawn"
    for p in plots:
        assert min(p["frame"]) >= MIN_FRAME, p
        assert p["ink"] > 0.002, p
    return plots


def test_both_pages_open_draw_and_a_cell_click_selects(browser, served):
    tab, g = open_gallery(browser, served, ready=".dla-clean")
    ws = g.workspace
    _sizes_and_ink(tab)
    wait_for_text(tab, ".dla-caption", r"Clean logit difference", timeout=60)
    n_layers, n_cols = 3, 5                           # tiny-llama: 4 heads + the MLP column
    for col, layer, name in [(4, 1, "L1.MLP"), (2, 0, "L0.H2")]:
        assert settle_gallery_page(tab, timeout=120)   # the outline of the last click drawn
        frame = tab.evaluate(FRAME_IN_PANE, "dla-clean")
        assert frame is not None
        tab.mouse.click(frame["left"] + (col + 0.5) * frame["width"] / n_cols,
                        frame["top"] + (layer + 0.5) * frame["height"] / n_layers)
        for _ in range(100):
            if name in ws.selected:
                break
            tab.wait_for_timeout(100)
        assert name in ws.selected, (name, ws.selected)
    # an edit from the workspace: the edited and difference panels appear
    ws.push_edit(Ablate(layer=1, head=0))
    tab.wait_for_selector(".dla-difference", state="visible", timeout=120_000)
    assert settle_gallery_page(tab, timeout=240)
    plots = _sizes_and_ink(tab)
    assert len(plots) >= 3
    ARTIFACTS.mkdir(exist_ok=True)
    tab.screenshot(path=str(ARTIFACTS / "dla-tiny-1280.png"), full_page=True)

    _open(tab, "Feature dashboards")
    wait_for_text(tab, ".features-contexts", r"Top activations of", timeout=240)
    _sizes_and_ink(tab)
    tab.locator(".features-search input").first.fill("the")
    tab.locator(".features-search input").first.press("Enter")
    wait_for_text(tab, ".features-search-results", r"fires on", timeout=60)
    n_edits = len(ws.edits)
    tab.locator(".features-steer button").first.click()
    for _ in range(100):
        if len(ws.edits) > n_edits:
            break
        tab.wait_for_timeout(100)
    assert len(ws.edits) == n_edits + 1 and ws.edits[-1].kind == "steer"
    assert g.page("features").index is not None
    tab.screenshot(path=str(ARTIFACTS / "features-tiny-1280.png"), full_page=True)
    tab.close()
