"""Browser test of the knowledge-conflicts page (apps/conflicts.py) on the tiny model.

The page is served by the test process's shared server (`_browser.shared_page`); Playwright
drives Debian's chromium: wait for the head scores and the bars, click a cell of the layer x head heatmap
(the head joins S+), move the alpha_l slider with the keyboard (the "after" bars change),
press "Score the whole split" (a results table appears). A screenshot goes to
``test-artifacts/`` (gitignored).
"""
from __future__ import annotations


import pytest
from _browser import (ARTIFACTS, attribute, open_page, painted, shared_page, slider_handle,
                      wait_for)

pytestmark = pytest.mark.browser


def _page(request):
    """The Knowledge-conflicts page on its own copy of tiny-llama, three facts."""
    from apps import theme
    from apps.conflicts import ConflictsView
    from explorer import load_model
    from explorer.analyses.conflicts import load_facts

    model = load_model("tiny-llama")
    facts = load_facts(["country_capital"])[:3]
    return lambda: theme.page([ConflictsView(model, facts=facts, closed_book=False, n_new=2)],
                              title="Knowledge conflicts")


page_url = shared_page("conflicts", _page)


def test_click_a_head_move_alpha_and_score_the_split(page_url, browser):
    page, errors = open_page(browser, page_url, viewport={"width": 1500, "height": 1300},
                             ready=".cf-state", timeout=240)
    wait_for(page, "data-cf-scores", lambda v: v == "ready")
    before = wait_for(page, "data-cf-after", lambda v: v != "none")
    assert attribute(page, "data-cf-plus") == ""
    # wait for the heatmap to render, then click inside its frame
    canvas = page.locator(".cf-heatmap .bk-Canvas").first
    canvas.wait_for(state="visible", timeout=60_000)
    painted(canvas)
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
    ARTIFACTS.mkdir(exist_ok=True)
    painted(page, path=str(ARTIFACTS / "conflicts_page.png"), full_page=True)
    assert not errors, errors
    page.close()
