"""Browser test: the Knowledge conflicts and Unlearning pages in the gallery on tiny-llama, at
1280 x 800 (and the conflicts page again at 1920 px).

Knowledge conflicts: the answer bars' frame (Bokeh's layout, `_browser.FRAME_IN_PANE`) is at
least 320 px wide, and *Select heads as JuICE does* says how long it takes before it is
pressed. Unlearning: after pressing Localize the status line (what runs, then its end) lies
within the first 800 px of the page. Screenshots go to ``test-artifacts/``."""
from __future__ import annotations

import re

import pytest

from _browser import (ARTIFACTS, FRAME_IN_PANE, painted, resize_and_settle, settle_gallery_page,
                      shared_page, show_gallery_page, wait_for)
from _views import tiny_facts_file

pytestmark = pytest.mark.browser

WIDTH, HEIGHT = 1280, 800


def _gallery(request):
    """The gallery on tiny-llama with a three-fact Knowledge conflicts page (its selection
    time measured) and the Unlearning page on a small fact file; it opens on conflicts."""
    from apps.conflicts import ConflictsView
    from apps.gallery import Gallery
    from apps.unlearning import UnlearningView
    from explorer.analyses.conflicts import load_facts

    facts = load_facts(["country_capital"])[:3]
    facts_file = tiny_facts_file(request.getfixturevalue("tmp_path_factory").mktemp("unlearn"))
    views = [("Knowledge conflicts", "conflicts",
              lambda m: ConflictsView(m, facts=facts, closed_book=False, n_new=2,
                                      estimate_time=True)),
             ("Mechanistic unlearning", "unlearning",
              lambda m: UnlearningView(m, facts_file=facts_file, known_only=False, n_forget=4,
                                       n_retain=2, n_layers=1, steps=2, relearn_steps=1))]
    return lambda: Gallery("tiny-llama", views=views, view="conflicts").template()


gallery_url = shared_page("conflicts-unlearning-layout", _gallery)


def _show(tab, title):
    show_gallery_page(tab, title, width=WIDTH)


def test_conflicts_bars_wide_and_selection_time_said(gallery_url, browser):
    tab = browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
    tab.goto(gallery_url, timeout=180_000)
    tab.wait_for_selector(".cf-bars .bk-Canvas", state="attached", timeout=240_000)
    _show(tab, "Knowledge conflicts")
    wait_for(tab, "data-cf-after", lambda v: v != "none", timeout=240)
    assert settle_gallery_page(tab, timeout=240)
    frame = tab.evaluate(FRAME_IN_PANE, "cf-bars")
    assert frame is not None and frame["width"] >= 320, frame
    # the selection's time, measured after the first bars, on the button before any press
    button = tab.get_by_role("button", name=re.compile("^Select heads as JuICE does"))
    for _ in range(2400):
        if "(about" in button.inner_text():
            break
        tab.wait_for_timeout(100)
    assert re.search(r"\(about \d+(–\d+)? (s|min)", button.inner_text()), button.inner_text()
    ARTIFACTS.mkdir(exist_ok=True)
    painted(tab, path=str(ARTIFACTS / "conflicts_gallery_1280.png"))
    assert resize_and_settle(tab, 1920, 1000)
    wide = tab.evaluate(FRAME_IN_PANE, "cf-bars")
    assert wide is not None and 320 <= wide["width"] <= 720, wide
    painted(tab, path=str(ARTIFACTS / "conflicts_gallery_1920.png"))
    print(f"answer bars frame: {frame['width']:.0f} px at 1280, {wide['width']:.0f} px at 1920")
    tab.close()




def test_unlearning_status_in_view_after_localize(gallery_url, browser):
    tab = browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
    tab.goto(gallery_url, timeout=180_000)
    tab.wait_for_selector("canvas", state="attached", timeout=240_000)
    _show(tab, "Mechanistic unlearning")
    ARTIFACTS.mkdir(exist_ok=True)
    tab.get_by_role("button", name="Localize").click()
    seen = []

    def status():
        """The status line's box in the window (what is in view) and its text."""
        line = tab.locator(".unlearning-status").first
        box = line.bounding_box()
        if box is None:
            return None
        top = box["y"]
        text = line.evaluate("e => [...(e.shadowRoot || e).children].filter(c => "
                             "!['STYLE', 'LINK'].includes(c.tagName)).map(c => c.innerText)"
                             ".join(' ')")
        out = {"top": top, "bottom": top + box["height"], "text": text}
        if out["text"].strip():
            seen.append(out)
        return out

    # while it runs: "Localizing …" at the top of the main column ("Localized on …" where
    # the tiny job ended between two looks)
    for _ in range(600):
        box = status()
        if box and re.search(r"Localizing|Localized on", box["text"]):
            break
        tab.wait_for_timeout(100)
    painted(tab, path=str(ARTIFACTS / "unlearning_gallery_1280_running.png"))
    assert seen and re.search(r"Localizing|Localized on", seen[-1]["text"]), (
        seen[-1:], tab.locator(".unlearning-status").count(), status())
    running = seen[-1]
    assert 0 <= running["top"] and running["bottom"] <= HEIGHT, running
    assert settle_gallery_page(tab, timeout=240)
    done = status()
    assert done is not None and 0 <= done["top"] and done["bottom"] <= HEIGHT, done
    assert re.search(r"^Localized on \d+ forget facts", done["text"].strip()), done
    painted(tab, path=str(ARTIFACTS / "unlearning_gallery_1280_done.png"))
    print(f"unlearning status top: {running['top']:.0f} px running "
          f"('{running['text'].strip()[:60]}'), {done['top']:.0f} px done "
          f"('{done['text'].strip()[:60]}')")
    tab.close()
