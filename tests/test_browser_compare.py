"""The Two prompts page in Chromium, in the gallery: opened with a second prompt, each view
draws its three grids (A, B, B − A) at a real size with ink in their frames, prompts of
different lengths draw A and B only and say why there is no difference, the sidebar's second
prompt card is there with its expand arrow and folds, the attribution view's three grids sit in
one row with titles that fit and no sideways scroll, and no console error is logged."""
from __future__ import annotations


import pytest
from _browser import (ARTIFACTS, clipped_titles, gallery_page_state, plot_ids, settle_gallery_page,
                      shared_page, wait_until)

pytestmark = pytest.mark.browser

A = "Mary gave a drink to John"        # the same length in tokens on tiny-llama
B = "John gave a drink to Mary"
LONGER = "Mary gave a drink to John at the store"
MIN_FRAME = 60                        # px: a data area smaller than this reads as collapsed
MIN_INK = 0.05                        # a frame whose commonest colour covers 95 % is blank

_SESSIONS: list = []


def _gallery(request):
    from apps.compare import CompareView
    from apps.gallery import Gallery

    request.getfixturevalue("tiny_model")

    def app():
        g = Gallery("tiny-llama", views=[("Two prompts", "compare", CompareView)])
        g.workspace.prompt = A
        g.workspace.second_prompt = B
        _SESSIONS.append(g)
        return g.template()
    return app


page_url = shared_page("compare", _gallery)




def _plots(tab) -> list[dict]:
    return gallery_page_state(tab)["plots"]


def _check_grids(tab, name: str, n: int) -> None:
    plots = _plots(tab)
    assert len(plots) == n, (name, [p["title"] for p in plots])
    small = [(p["title"], p["frame"]) for p in plots if min(p["frame"]) < MIN_FRAME]
    assert not small, f"{name}: plots without a real frame: {small}"
    blank = [(p["title"], p["ink"]) for p in plots if p["ink"] < MIN_INK]
    assert not blank, f"{name}: plots whose frame is blank: {blank}"
    tab.screenshot(path=str(ARTIFACTS / f"compare-{name}.png"))


@pytest.mark.parametrize("width", [1280, 1920])
def test_each_view_draws_a_b_and_the_difference(browser, page_url, width):
    tab = browser.new_page(viewport={"width": width, "height": 1000})
    tab.goto(page_url, timeout=120_000)
    tab.wait_for_selector(".compare-view", state="attached", timeout=120_000)
    assert settle_gallery_page(tab, timeout=120)
    assert tab.locator(".second-prompt").first.is_visible()
    # the card's header carries an expand arrow (drawn: a stroke colour) and folds the card
    arrow = tab.locator(".second-prompt .card-button svg").first
    assert arrow.evaluate("e => getComputedStyle(e).stroke") not in ("", "none")
    assert min(arrow.bounding_box()["width"], arrow.bounding_box()["height"]) >= 8
    box = tab.locator(".second-prompt-box input").first
    tab.locator(".second-prompt .card-header").first.click()
    box.wait_for(state="hidden", timeout=10_000)
    tab.locator(".second-prompt .card-header").first.click()
    box.wait_for(state="visible", timeout=10_000)
    wait_until(lambda: _SESSIONS, what="the session's gallery")
    gallery = _SESSIONS[-1]
    ARTIFACTS.mkdir(exist_ok=True)
    titles = {"lens": "Logit lens", "attention": "Attention (selected head)",
              "saturation": "Saturation layers", "dla": "Logit attribution"}
    for view, label in titles.items():
        before = plot_ids(tab)
        if view != "lens":
            tab.locator(".compare-view button", has_text=label).first.click()
            assert settle_gallery_page(tab, before=before, timeout=120), view
        _check_grids(tab, f"{view}-{width}", 3)
        shown = [p["title"] for p in _plots(tab)]
        assert shown[0].startswith("A: ") and shown[1].startswith("B: "), shown
        assert shown[2].startswith("B − A: "), shown
        if view == "dla":  # the three grids in one row, titles that fit, no sideways scroll
            tops = [tab.locator(f".compare-{p}").first.bounding_box()["y"]
                    for p in ("A", "B", "difference")]
            assert max(tops) - min(tops) < 2, tops
            assert not clipped_titles(_plots(tab))
            assert tab.evaluate("document.scrollingElement.scrollWidth"
                                " <= document.scrollingElement.clientWidth")
    # prompts of different lengths: A and B drawn, the difference a note
    box = tab.locator(".second-prompt-box input").first
    box.fill(LONGER)
    box.press("Enter")
    wait_until(lambda: gallery.workspace.second_prompt == LONGER, what="prompt B")
    assert settle_gallery_page(tab, timeout=120)
    tab.locator(".compare-view button", has_text="Logit lens").first.click()
    assert settle_gallery_page(tab, timeout=120)
    assert tab.get_by_text("No difference drawn: prompt A has").first.is_visible()
    _check_grids(tab, f"lens-lengths-{width}", 2)          # A and B; no B − A grid
    tab.close()
