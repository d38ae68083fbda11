"""Browser test of the saturation page (apps/saturation.py) on the tiny model.

The page is served by the test process's shared server (`_browser.shared_page`); Playwright
drives Debian's chromium: wait for the Bokeh canvases, click a token (the detail header and the rank
table's data in the browser follow), move the k slider with the keyboard (the Kendall-tau
histogram changes), move the softmax-margin θ slider (the Pareto marker moves to the
speed-up a zero threshold must give) and the injection-layer slider (the intervention's
s_1 and prediction update, equal to `inject_residual` run here). Screenshots go to
``test-artifacts/`` (gitignored).
"""
from __future__ import annotations

import time

import pytest
from _browser import ARTIFACTS, attribute, shared_page, slider_handle, wait_for

from explorer.analyses.saturation import corpus_chunks, inject_residual, load_corpus

pytestmark = pytest.mark.browser


def _page(request):
    """The Saturation page on its own copy of tiny-llama, small settings."""
    from apps.saturation import SaturationView
    from explorer import load_model

    model = load_model("tiny-llama")
    return lambda: SaturationView(model, store=None, n_tokens=400, analysis_options=dict(
        n_permutations=100, n_pairs=1, sample_positions=200,
        min_sat_layer=0)).page()  # 3 layers: no pair has both s_1 >= 1


page_url = shared_page("saturation", _page)


def wait_for_change(page, name: str, old: str, timeout: float = 60) -> str:
    return wait_for(page, name, lambda value: value != old, timeout)


def wait_for_value(page, name: str, expected: str, timeout: float = 60) -> None:
    wait_for(page, name, lambda value: value == expected, timeout)


def k_slider_handle(page):
    """The noUiSlider handle of the k slider: the one whose range is 1..10."""
    return slider_handle(page, 1, 10)


def cell_counts(page) -> list[int]:
    """Rows of the rank table's cell data in the browser's Bokeh documents (one per view)."""
    return page.evaluate("""() => {
        const out = [];
        for (const doc of Bokeh.documents) {
            for (const m of doc.all_models) {
                if (m.type !== 'ColumnDataSource') continue;
                const keys = m.data instanceof Map ? [...m.data.keys()] : Object.keys(m.data);
                if (keys.includes('probability') && keys.includes('color')) out.push(m.get_length());
            }
        }
        return out;
    }""")


def wait_for_cells(page, n: int, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while cell_counts(page) != [n] and time.time() < deadline:
        page.wait_for_timeout(200)
    assert cell_counts(page) == [n]


def press_until_attr(page, handle_css: str, key: str, name: str, predicate, *,
                     tries: int = 4, timeout: float = 60) -> str:
    """Press Home or End on a slider handle until the data attribute ``name`` satisfies
    ``predicate`` (a press while the page settles can move the handle without the value
    reaching the server: then move it to the other end and back)."""
    away = {"Home": "End", "End": "Home"}[key]
    for attempt in range(tries):
        handle = page.locator(handle_css).first
        handle.focus()
        if attempt:
            handle.press(away)
            page.wait_for_timeout(1000)
        handle.press(key)
        try:
            return wait_for(page, name, lambda v: v is not None and predicate(v), timeout)
        except AssertionError:
            if attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


def pareto_titles(page) -> str:
    """Every early-exit plot title the browser holds, joined: a θ move replaces the plot, and
    the replaced plot's models may linger in the document for a while."""
    return page.evaluate("""() => {
        const found = [];
        for (const doc of Bokeh.documents)
            for (const m of doc.all_models)
                if (m.type === 'Title' && m.text.startsWith('Early exit')) found.push(m.text);
        return found.join(' | ');
    }""")


def test_click_token_and_move_k(page_url, browser, tiny_model):
    page = browser.new_page(viewport={"width": 1500, "height": 1400})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(page_url, timeout=60_000)
    page.locator(".sat-token").first.wait_for(state="attached", timeout=240_000)
    page.locator(".sat-tau-hist canvas").first.wait_for(state="attached", timeout=60_000)
    page.locator(".sat-rank-table canvas").first.wait_for(state="attached", timeout=60_000)
    assert attribute(page, "data-sat-detail") == "none"
    assert cell_counts(page) == [0]

    # click a token: the detail header and the table/staircase follow the clicked position
    page.locator(".sat-token[data-pos='7']").click()
    assert wait_for_change(page, "data-sat-detail", "none") == "0:7:5"
    wait_for_cells(page, 3 * 5)                     # 3 layers x 5 ranks, updated in place
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
    wait_for_cells(page, 3 * 3)

    # softmax-margin θ to 0: every position exits after the first layer, so the marker
    # moves to a speed-up of L N / N = 3 (tiny-llama has 3 layers)
    margin = wait_for(page, "data-sat-pareto", lambda v: v is not None).split("|")[0].split(":")
    assert margin[0] == "margin" and float(margin[1]) == 0.5
    moved = press_until_attr(page, ".sat-theta-margin .noUi-handle", "Home", "data-sat-pareto",
                             lambda v: v.split("|")[0].split(":")[1] == "0.0000")
    assert float(moved.split("|")[0].split(":")[2]) == pytest.approx(3.0)
    deadline = time.time() + 30
    while "margin θ=0.00" not in pareto_titles(page) and time.time() < deadline:
        page.wait_for_timeout(250)
    assert "margin θ=0.00" in pareto_titles(page)

    # injection layer to the other end: the new s_1 and prediction, as run here
    shown = wait_for(page, "data-sat-injection", lambda v: v is not None, timeout=120)
    p, early, late, layer = map(int, shown.split(":")[:4])
    inj = page.locator(".sat-inj-layer .noUi-handle").first
    assert int(float(inj.get_attribute("aria-valuenow"))) == layer
    target = 1 if layer == 0 else 0                 # bounds 0..L-2 = 0..1
    shown = press_until_attr(page, ".sat-inj-layer .noUi-handle", "End" if target else "Home",
                             "data-sat-injection", lambda v: int(v.split(":")[3]) == target,
                             timeout=120)
    text = corpus_chunks(tiny_model, load_corpus(), max_tokens=400)[p]
    direct = inject_residual(tiny_model, text, source_pos=early, target_pos=late, layer=target)
    assert shown == (f"{p}:{early}:{late}:{target}:{direct['s1_before']}:{direct['s1_after']}:"
                     f"{direct['top1_before']}:{direct['top1_after']}")
    line = page.locator(".sat-injection").first.evaluate("el => el.shadowRoot ? "
                                                         "el.shadowRoot.textContent : el.textContent")
    assert f"Injected at layer {target}: s_1 {direct['s1_before']} → {direct['s1_after']}" in line
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "saturation_page.png"), full_page=True)
    assert not errors, errors
    page.close()
