"""Browser test of the saturation page (apps/saturation.py) on the tiny model.

The page is served in a subprocess on a free 127.0.0.1 port; Playwright drives Debian's
chromium: wait for the Bokeh canvases, click a token (the detail updates), move the k
slider with the keyboard (the Kendall-tau histogram changes). Screenshots go to
``test-artifacts/`` (gitignored).
"""
from __future__ import annotations

import textwrap

import pytest
from _browser import ARTIFACTS, attribute, free_port, served_in_subprocess, slider_handle, wait_for

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def page_url(tmp_path_factory):
    port = free_port()
    code = textwrap.dedent(f"""
        import panel as pn
        from apps import theme
        from apps.saturation import SaturationView
        from explorer import load_model

        model = load_model("tiny-llama")
        theme.enable_extension()

        def app():
            view = SaturationView(model, store=None, n_tokens=400, analysis_options=dict(
                n_permutations=100, n_pairs=1, sample_positions=200))
            return view.page()

        pn.serve(app, port={port}, address="127.0.0.1", show=False)
    """)
    log_path = tmp_path_factory.mktemp("saturation-server") / "server.log"
    with served_in_subprocess(["-c", code], port, log_path, timeout=240) as url:
        yield f"{url}/"


def wait_for_change(page, name: str, old: str, timeout: float = 60) -> str:
    return wait_for(page, name, lambda value: value != old, timeout)


def wait_for_value(page, name: str, expected: str, timeout: float = 60) -> None:
    wait_for(page, name, lambda value: value == expected, timeout)


def k_slider_handle(page):
    """The noUiSlider handle of the k slider: the one whose range is 1..10."""
    return slider_handle(page, 1, 10)


def test_click_token_and_move_k(page_url, browser):
    page = browser.new_page(viewport={"width": 1500, "height": 1400})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(page_url, timeout=60_000)
    page.locator(".sat-token").first.wait_for(state="attached", timeout=240_000)
    page.locator(".sat-tau-hist canvas").first.wait_for(state="attached", timeout=60_000)
    page.locator(".sat-rank-table canvas").first.wait_for(state="attached", timeout=60_000)
    assert attribute(page, "data-sat-detail") == "none"

    # click a token: the detail header and the table/staircase follow the clicked position
    page.locator(".sat-token[data-pos='7']").click()
    assert wait_for_change(page, "data-sat-detail", "none") == "0:7:5"
    assert "sat-selected" in page.locator(".sat-token[data-pos='7']").get_attribute("class")
    page.locator(".sat-token[data-pos='12']").click()
    assert wait_for_change(page, "data-sat-detail", "0:7:5") == "0:12:5"

    # move k from 5 to 3 with the keyboard: the histogram changes, the detail shows 3 ranks
    before = attribute(page, "data-sat-hist")
    handle = k_slider_handle(page)
    assert float(handle.get_attribute("aria-valuenow")) == 5
    handle.focus()
    handle.press("ArrowLeft")
    handle.press("ArrowLeft")
    wait_for_value(page, "data-sat-detail", "0:12:3")
    assert float(handle.get_attribute("aria-valuenow")) == 3
    assert wait_for_change(page, "data-sat-hist", before) != before
    page.locator(".sat-tau-hist canvas").first.wait_for(state="attached", timeout=30_000)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "saturation_page.png"), full_page=True)
    assert not errors, errors
    page.close()
