"""Browser test of the ICL heads page (apps/icl_heads.py) on the tiny model.

The page is served by the test process's shared server (`_browser.shared_page`); Playwright
drives Debian's chromium: wait for the head scores, move the head slider with the keyboard (the selected
head and its attention plots follow), press the ablation button (curves appear), tick the
exclusion toggle (the curves are recomputed for the exclusion rankings). A screenshot goes
to ``test-artifacts/`` (gitignored).
"""
from __future__ import annotations


import pytest
from _browser import (ARTIFACTS, attribute, open_page, painted, shared_page, slider_handle,
                      wait_for)

pytestmark = pytest.mark.browser


def _page(request):
    """The ICL-heads page on its own copy of tiny-llama, 3 prompts of 2 shots."""
    from apps import theme
    from apps.icl_heads import ICLHeadsView
    from explorer import load_model

    model = load_model("tiny-llama")
    return lambda: theme.page([ICLHeadsView(model, n_prompts=3, n_shots=2)], title="ICL heads")


page_url = shared_page("icl", _page)


def test_scores_head_slider_and_ablation_curves(page_url, browser):
    page, errors = open_page(browser, page_url, viewport={"width": 1500, "height": 1600},
                             ready=".icl-state", timeout=240)
    wait_for(page, "data-icl-scores", lambda v: v == "ready")
    wait_for(page, "data-icl-td", lambda v: v == "ready")
    assert wait_for(page, "data-icl-fv", lambda v: v != "none") == "1"   # n_layers // 3
    head = attribute(page, "data-icl-head")
    layer, h = map(int, head.split(":"))
    # the head slider (range 0..3 on the tiny model; the first such slider is the layer's
    # 0..2, so pick by range): one step changes the selected head
    handle = slider_handle(page, 0, 3)
    handle.focus()
    handle.press("ArrowLeft" if h > 0 else "ArrowRight")
    new = wait_for(page, "data-icl-head", lambda v: v != head)
    assert new == f"{layer}:{h - 1 if h > 0 else h + 1}"
    assert page.locator(".bk-Canvas, canvas").count() >= 5   # scatter, 2 heatmaps, 2 patterns
    assert attribute(page, "data-icl-curves") == "none"
    page.get_by_role("button", name="Recompute ablation curves").click()
    assert wait_for(page, "data-icl-curves", lambda v: v != "none") == "0,1,3,5,10,20"
    # the exclusion of the other score's top heads is on by default (the paper's 2 %)
    assert attribute(page, "data-icl-rankings") == "fv_excl_induction,induction_excl_fv,random"
    page.locator("input[type=checkbox]").first.uncheck()   # the exclusion toggle: the only one
    assert wait_for(page, "data-icl-rankings", lambda v: "excl" not in v) == (
        "fv,induction,random")
    ARTIFACTS.mkdir(exist_ok=True)     # the screenshot once the curves have rendered
    painted(page, path=str(ARTIFACTS / "icl_heads_page.png"), full_page=True)
    assert not errors, errors
    page.close()
