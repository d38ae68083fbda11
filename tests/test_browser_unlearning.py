"""Browser test of the unlearning page (apps/unlearning.py) on the tiny model.

The page is served by the test process's shared server (`_browser.shared_page`) with a small
hand-made fact file; Playwright drives Debian's chromium: the page opens with nothing
computed, Localize
fills the probe curve and the tracing heatmap, a method is picked, Run trains it, and the
accuracy bars appear. A screenshot goes to ``test-artifacts/`` (gitignored).
"""
from __future__ import annotations


import pytest
from _browser import ARTIFACTS, attribute, open_page, painted, shared_page, wait_for
from _views import tiny_facts_file

pytestmark = pytest.mark.browser


def _page_on_a_fact_file(request):
    """The page on its own copy of tiny-llama, on a small fact file in a temp folder."""
    from apps import theme
    from apps.unlearning import UnlearningView
    from explorer import load_model

    model = load_model("tiny-llama")
    facts_file = tiny_facts_file(request.getfixturevalue("tmp_path_factory").mktemp("unlearning"))
    return lambda: theme.page([UnlearningView(
        model, facts_file=facts_file, known_only=False, n_forget=4, n_retain=2, n_layers=1,
        steps=2, relearn_steps=1)], title="Unlearning")


page_url = shared_page("unlearning", _page_on_a_fact_file)


def test_localize_pick_method_run_and_bars(page_url, browser):
    page, errors = open_page(browser, page_url, viewport={"width": 1500, "height": 1300},
                             ready=".unlearning-state", timeout=240)
    # the page opens without computing anything
    assert attribute(page, "data-unlearning-localized") == "False"
    assert attribute(page, "data-unlearning-result") == "none"
    page.get_by_role("button", name="Localize").click()
    wait_for(page, "data-unlearning-localized", lambda v: v == "True", timeout=180)
    page.locator("select").first.select_option("attribution_patching")
    wait_for(page, "data-unlearning-method", lambda v: v == "attribution_patching")
    page.get_by_role("button", name="Run unlearning").click()
    assert wait_for(page, "data-unlearning-result", lambda v: v != "none",
                    timeout=300) == "original,fact_lookup,attribution_patching"
    assert page.locator(".bk-Canvas, canvas").count() >= 3   # probe curve, heatmap, bars
    ARTIFACTS.mkdir(exist_ok=True)     # the screenshot once the bars have rendered
    painted(page, path=str(ARTIFACTS / "unlearning_page.png"), full_page=True)
    assert not errors, errors
    page.close()
