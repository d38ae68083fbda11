"""The Activation patching page in a real browser (tiny-llama gallery): it opens from the
sidebar, a click on a token and a typed replacement make the counterfactual, the grid is
drawn at a real size with ink in it, and a click on a cell selects that component and
position in the workspace."""
from __future__ import annotations

import pytest
from _browser import (ARTIFACTS, FRAME_IN_PANE, gallery_page_state, open_gallery, plot_ids,
                      served_galleries, settle_gallery_page, wait_for_text)

pytestmark = pytest.mark.browser

MIN_FRAME = 60


@pytest.fixture(scope="module")
def served(tiny_model):
    from apps.dla import DLAView
    from apps.patching import PatchingView

    views = [("Logit attribution", "dla", DLAView),
             ("Activation patching", "patching", PatchingView)]
    with served_galleries("tiny-llama", views=views, view="dla") as served:
        yield served


def test_page_opens_draws_and_a_cell_click_selects(browser, served):
    tab, g = open_gallery(browser, served, ready=".dla-clean")
    ws = g.workspace
    before = plot_ids(tab)
    tab.locator(".bk-btn-group button", has_text="Activation patching").first.click()
    tab.wait_for_selector(".patching-strip .pos-token", timeout=120_000)
    tokens = tab.locator(".patching-strip .pos-token")
    n_tokens = tokens.count()
    assert n_tokens >= 3
    tokens.nth(2).click()                                   # the token to replace
    box = tab.locator(".patching-controls input").first
    box.fill("#5")
    box.press("Enter")
    wait_for_text(tab, ".patching-caption", r"Counterfactual: position 2:", timeout=240)
    assert settle_gallery_page(tab, before=before, timeout=240)
    plots = gallery_page_state(tab)["plots"]
    assert plots, "no plot drawn"
    for p in plots:
        assert min(p["frame"]) >= MIN_FRAME, p
        assert p["ink"] > 0.002, p
    frame = tab.evaluate(FRAME_IN_PANE, "patching-grid")
    assert frame is not None and frame["width"] >= MIN_FRAME
    n_layers = 3
    col, layer = n_tokens - 1, 2               # the last position at layer 2: resid_pre = L1
    tab.mouse.click(frame["left"] + (col + 0.5) * frame["width"] / n_tokens,
                    frame["top"] + (layer + 0.5) * frame["height"] / n_layers)
    for _ in range(100):
        if "L1" in ws.selected and col in ws.selected_positions:
            break
        tab.wait_for_timeout(100)
    assert "L1" in ws.selected and col in ws.selected_positions, (ws.selected,
                                                                  ws.selected_positions)
    ARTIFACTS.mkdir(exist_ok=True)
    tab.screenshot(path=str(ARTIFACTS / "patching-tiny-1280.png"), full_page=True)
    tab.close()
