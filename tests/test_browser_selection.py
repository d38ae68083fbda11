"""The sidebar selection in a real browser, on the packaged SmolLM2 (30 layers x 9 heads).

The old sidebar let the user type a head into the chips' own search box (Choices.js, fuzzy):
typed before its search ran (a paste, a fast Enter) Enter added the list's first option
(``L0.H0`` for ``L10.H1``), and typed again when already selected it added the nearest other
head (``L0.H0`` for ``L0.H1``). Now that search box is hidden, names are typed into the *Add
to selection* box, read with the one spelling (edges and positions too), and the chips still
open their list on a click (a mouse pick is exact) and drop one with its ✕. Each typing is
done both ways a user does it: key by key, and all at once (``fill``, as a paste), then Enter.
"""
from __future__ import annotations

import panel as pn
import pytest
from _browser import ARTIFACTS, served_galleries, wait_for_text

pytestmark = [pytest.mark.browser, pytest.mark.integration]


class _Blank(pn.viewable.Viewer):
    def __panel__(self):
        return pn.pane.Markdown("A page that computes nothing.")


@pytest.fixture(scope="module")
def served(smollm2):
    with served_galleries("smollm2-135m", views=[("Blank", "blank", lambda m: _Blank())]) as served:
        yield served


def _wait(tab, predicate, timeout=20_000):
    for _ in range(timeout // 100):
        if predicate():
            return True
        tab.wait_for_timeout(100)
    return predicate()


def _type(tab, text, *, paste):
    box = tab.locator(".workspace-add input").first
    box.click()
    if paste:
        box.fill(text)
    else:
        box.press_sequentially(text, delay=20)
    box.press("Enter")


def test_typed_names_select_exactly_what_was_typed(browser, served):
    url, sessions = served
    tab = browser.new_page(viewport={"width": 1280, "height": 1000})
    tab.goto(url, timeout=180_000)
    tab.wait_for_selector(".workspace-add input", timeout=120_000)
    ws = sessions[-1].workspace

    # the chips' own (fuzzy) search box is not there to type into
    search = tab.locator(".workspace-selection input.choices__input")
    assert search.count() == 0 or not search.first.is_visible()

    expected = []
    for text, name, paste in [("L10.H1", "L10.H1", True), ("L0.H1", "L0.H1", False),
                              ("L0.H1", "L0.H1", True),      # again: nothing else is added
                              ("a3.h1", "L3.H1", False), ("L29.H8", "L29.H8", True),
                              ("a3.h1->m5", "L3.H1->L5.MLP", True), ("pos 2", "P2", False)]:
        _type(tab, text, paste=paste)
        if name not in expected:
            expected.append(name)
        assert _wait(tab, lambda: sorted(ws.selection) == sorted(expected)), (text, ws.selection)
        tab.wait_for_timeout(300)
        assert sorted(ws.selection) == sorted(expected), (text, ws.selection)
        wait_for_text(tab, ".workspace-selection", "P2" if name == "P2" else name, timeout=20)
    assert ws.selected == ["L10.H1", "L0.H1", "L3.H1", "L29.H8"]
    assert ws.selected_edges == ["L3.H1->L5.MLP"] and ws.selected_positions == [2]

    # a name that cannot be read: a message in the sidebar, nothing added
    _type(tab, "L3.H1->L2.MLP", paste=True)
    wait_for_text(tab, ".workspace-add-message", "goes backwards", timeout=20)
    assert ws.selected_edges == ["L3.H1->L5.MLP"]

    # the chips still drop one with its ✕ (the edge's chip) ...
    chip = tab.locator(".workspace-selection .choices__item--selectable",
                       has_text="L3.H1->L5.MLP").first
    chip.locator("button").click()
    assert _wait(tab, lambda: ws.selected_edges == []), ws.selected_edges
    # ... and open their list on a click: a mouse pick adds exactly that component
    tab.locator(".workspace-selection .choices").first.click()
    option = tab.locator(".workspace-selection .choices__list--dropdown .choices__item--choice",
                         has_text="L7.MLP").first
    option.scroll_into_view_if_needed()
    option.click()
    assert _wait(tab, lambda: "L7.MLP" in ws.selected), ws.selected
    assert ws.selected == ["L10.H1", "L0.H1", "L3.H1", "L29.H8", "L7.MLP"]
    ARTIFACTS.mkdir(exist_ok=True)
    tab.screenshot(path=str(ARTIFACTS / "sidebar-selection.png"))
    tab.close()
