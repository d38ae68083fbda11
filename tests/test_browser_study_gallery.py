"""The User study page in the gallery, in Chromium: its panes and plot have a real size, its
select widgets offer options, *Build study* shows the explanation under each condition, and a
participant who opens the page's link on the same server answers a question that the
researcher's analysis then counts; no console errors on either tab."""
from __future__ import annotations


import pytest
from _browser import (ARTIFACTS, gallery_page_state, resize_and_settle, settle_gallery_page, shared_page,
                      wait_until)

pytestmark = pytest.mark.browser

_SESSIONS: list = []


def _gallery(request):
    from apps.dla import DLAView
    from apps.gallery import Gallery
    from apps.lens import LensView
    from apps.study_builder import StudyBuilderView

    request.getfixturevalue("tiny_model")
    folder = request.getfixturevalue("tmp_path_factory").mktemp("studies")

    def app():
        g = Gallery("tiny-llama", view="study", views=[
            ("Logit lens", "lens", LensView), ("Logit attribution", "dla", DLAView),
            ("User study", "study", lambda m: StudyBuilderView(m, folder=folder))])
        _SESSIONS.append(g)
        return g.template()
    return app


def _participants(request):
    from apps.study_builder import participant_page

    return participant_page


gallery_url = shared_page("study-gallery", _gallery)
participant_url = shared_page("study", _participants)




def _box(tab, css):
    box = tab.locator(f".{css}").first.bounding_box()
    assert box is not None, f".{css} is not shown"
    return box


def _errors_of(tab):
    errors: list[str] = []
    tab.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    tab.on("pageerror", lambda exc: errors.append(str(exc)))
    return errors


def _click(tab, css):
    button = tab.locator(f".{css} button").first
    button.scroll_into_view_if_needed()
    button.click()


def test_the_study_page_builds_serves_and_analyses_in_the_browser(browser, gallery_url,
                                                                  participant_url):
    ARTIFACTS.mkdir(exist_ok=True)
    tab = browser.new_page(viewport={"width": 1280, "height": 1000})
    errors = _errors_of(tab)
    before = len(_SESSIONS)
    tab.goto(gallery_url, timeout=120_000)
    tab.wait_for_selector(".study-build button", state="attached", timeout=180_000)
    wait_until(lambda: len(_SESSIONS) > before, what="the session's gallery")
    g = _SESSIONS[-1]
    assert settle_gallery_page(tab, timeout=90)

    state = gallery_page_state(tab)
    labels = {s["label"]: s for s in state["selects"]}
    assert {"Explanation from", "Design"} <= set(labels), labels
    assert all(s["named"] >= 2 for s in state["selects"]), state["selects"]
    plot = [p for p in state["plots"] if p["title"].startswith("Accuracy by condition")]
    assert plot and min(plot[0]["frame"]) >= 60, state["plots"]
    assert _box(tab, "study-controls")["width"] >= 200

    _click(tab, "study-build")
    wait_until(lambda: g.page("study").run is not None, 180, "the study built")
    tab.wait_for_selector(".study-condition", state="visible", timeout=60_000)
    cards = tab.locator(".study-condition")
    assert cards.count() == 3
    for i in range(3):
        box = cards.nth(i).bounding_box()
        assert box["width"] >= 250 and box["height"] >= 40, box

    _click(tab, "study-open")
    link = wait_until(lambda: tab.locator(".study-link input").first.input_value(), 30, "the link")
    assert link.startswith(gallery_url.rsplit("/", 1)[0] + "/study?run=")

    # a participant on the same server: consent, begin, one answer
    part = browser.new_page(viewport={"width": 1280, "height": 1000})
    part_errors = _errors_of(part)
    part.goto(link, timeout=120_000)
    part.get_by_role("checkbox").check()
    part.get_by_role("button", name="Start the study").click()
    part.get_by_role("button", name="Begin").click()
    part.get_by_text("Question 1 of 13", exact=True).wait_for(timeout=60_000)
    from apps.theme import show_token

    run = g.page("study").run
    trial = run.store.next_trial(run.store.participants()[-1].code)
    first = run.trial_display(trial)["choices"][0]
    # a token may read like a confidence label ("3"): choices come first on the page
    part.get_by_role("button", name=show_token(first), exact=True).first.click()
    part.get_by_role("button", name="3", exact=True).last.click()
    part.get_by_role("button", name="Submit answer").click()
    part.get_by_text("Question 2 of 13", exact=True).wait_for(timeout=60_000)
    part.screenshot(path=str(ARTIFACTS / "study-gallery-participant.png"), full_page=True)

    # the researcher's page counts the answer (its poll runs every 3 s)
    tab.wait_for_selector(".study-analysis-pane >> text=n = 1", timeout=60_000)
    assert g.page("study").n_answers == 1
    tab.locator(".study-analysis-pane").first.scroll_into_view_if_needed()
    tab.screenshot(path=str(ARTIFACTS / "study-gallery-1280.png"))
    assert resize_and_settle(tab, 1920, 1080, timeout=60)
    assert _box(tab, "study-accuracy")["width"] >= 600        # the plot follows the window
    tab.screenshot(path=str(ARTIFACTS / "study-gallery-1920.png"))
    assert not errors, errors
    assert not part_errors, part_errors
    part.close()
    tab.close()
