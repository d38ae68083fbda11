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
                      wait_for, wait_until)

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


# The drawn answer bars' probabilities and title, read from the plot's Bokeh models.
_DRAWN_BARS = """() => {
  const v = [...Bokeh.index.all_views()].find(v => (v.model.type === 'Figure')
      && v.el.isConnected && v.el.offsetParent != null
      && String(v.model.title?.text ?? '').startsWith('P(answer)'))
  if (v == null) return null
  const r = v.model.renderers.find(r => r.data_source?.data?.probability != null)
  const d = r.data_source.data
  return {title: String(v.model.title.text), answer: [...d.answer], run: [...d.run],
          probability: [...d.probability]}
}"""


def _drawn_after(page) -> list[float]:
    drawn = page.evaluate(_DRAWN_BARS)
    value = dict(zip(zip(drawn["answer"], drawn["run"]), drawn["probability"]))
    return [value["memory", "after"], value["context", "after"]]


def test_dragging_alpha_previews_the_bars_and_the_release_draws_the_exact_ones(page_url,
                                                                               browser):
    """Pick the top heads, drag the α_l slider with the mouse: the bars' plot shows previews
    while the mouse is down (its title says so, its drawn data follow the hand); released, the
    page shows the exact bars, equal to the dual run computed here on the same model."""
    import numpy as np

    from explorer import load_model
    from explorer.analyses import conflicts as C

    page, errors = open_page(browser, page_url, viewport={"width": 1500, "height": 1300},
                             ready=".cf-state", timeout=240)
    wait_for(page, "data-cf-after", lambda v: v != "none")
    page.get_by_role("button", name="Pick top heads for the direction").click()
    plus = wait_for(page, "data-cf-plus", lambda v: v != "", timeout=60)
    wait_for(page, "data-cf-busy", lambda v: v == "0", timeout=60)
    before = wait_for(page, "data-cf-alphas", lambda v: v == "1,1", timeout=60)
    assert before == "1,1"
    bars = page.locator(".cf-bars .bk-Canvas").first
    bars.scroll_into_view_if_needed()
    still = painted(bars)
    handle = slider_handle(page, 0, 5)
    box = handle.bounding_box()
    track = handle.locator("xpath=ancestor::div[contains(@class,'noUi-base')]").first \
        .bounding_box()
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    page.mouse.move(x, y)
    page.mouse.down()
    seen = []
    for i in range(1, 4):                # three moves to the right, each waited for
        page.mouse.move(x + i * 0.15 * track["width"], y)
        alphas = wait_for(page, "data-cf-alphas", lambda v: v not in seen + ["1,1"], timeout=60)
        seen.append(alphas)
        # the page's state attributes and the plot reach the browser in separate messages:
        # wait until they describe the same preview, then check each
        wait_until(lambda: attribute(page, "data-cf-preview") == "1"
                   and page.evaluate(_DRAWN_BARS)["title"] == "P(answer) · preview"
                   and np.allclose(_drawn_after(page), [float(v) for v in attribute(
                       page, "data-cf-after").split(",")], rtol=0, atol=5e-7),
                   30, "the drawn bars are the preview the page's state names")
        assert attribute(page, "data-cf-preview") == "1"
        drawn = page.evaluate(_DRAWN_BARS)
        assert drawn["title"] == "P(answer) · preview"
        # the drawn bars are the preview the page's state names
        shown = [float(v) for v in attribute(page, "data-cf-after").split(",")]
        np.testing.assert_allclose(_drawn_after(page), shown, atol=5e-7)
    assert painted(bars) != still                        # the plot changed under the hand
    page.mouse.up()
    wait_for(page, "data-cf-preview", lambda v: v == "0", timeout=60)
    final = attribute(page, "data-cf-alphas")
    assert final == seen[-1]
    alpha_l, alpha_s = (float(a) for a in final.split(","))
    assert alpha_l > 1.0 and page.evaluate(_DRAWN_BARS)["title"] == "P(answer)"
    # the exact bars, computed here: the page's model is a fresh copy of the same weights
    model = load_model("tiny-llama")
    fact = C.load_facts(["country_capital"])[0]
    heads = [(int(n[1:].split(".H")[0]), int(n.split(".H")[1])) for n in plus.split(",")]
    minus_attr = attribute(page, "data-cf-minus")
    minus = [(int(n[1:].split(".H")[0]), int(n.split(".H")[1]))
             for n in minus_attr.split(",") if n]
    logits = C.juice_logits(model, [C.conflict_prompt(fact, "substitution")], heads, minus,
                            alpha_l=alpha_l, alpha_s=alpha_s)
    want = C.answer_probabilities(model, logits, [fact])[0]
    shown = [float(v) for v in attribute(page, "data-cf-after").split(",")]
    np.testing.assert_allclose(shown, want, atol=2e-6)
    np.testing.assert_allclose(_drawn_after(page), want, atol=2e-6)
    ARTIFACTS.mkdir(exist_ok=True)
    painted(page, path=str(ARTIFACTS / "conflicts_alpha_drag.png"), full_page=True)
    assert not errors, errors
    page.close()
