"""Links, the address bar, the prompt box and notifications of the gallery in a real browser.

One gallery (`apps.gallery.Gallery` with its home page) is served in this process on the tiny
random-init model, with the logit lens, a second lens page, a page whose job runs for a long
time, and a page with a bounded number input ("Prompt pairs", 1..64). The checks read the
browser's own address (``location.search``), the sidebar's widgets and the notifications
drawn (Panel's notyf toasts), and open links in fresh browser contexts (no shared storage).
"""
from __future__ import annotations

import re
import threading
import time

import panel as pn
import param
import pytest
from _browser import ARTIFACTS, served_galleries, wait_for_text

from apps._view import Scope, View
from apps.lens import LensView

pytestmark = pytest.mark.browser

TOAST = ".notyf__toast"


class _Slow(View):
    """A page whose job runs until cancelled (at most ``seconds``): a long job."""

    seconds = param.Number(default=60.0)
    notify_title = "Slow"

    def __init__(self, model, **params):
        super().__init__(**params)
        self.runner("work", lambda _v: None)
        self.started = threading.Event()

    def start(self) -> None:
        def job(token):
            self.started.set()
            until = time.time() + self.seconds
            while time.time() < until and not token.cancelled:
                sum(i * i for i in range(20_000))  # holds the GIL most of the time
            return None
        self.submit("work", job)

    def scope(self) -> Scope:
        return Scope("nothing", "not applicable: it runs no model")

    def __panel__(self):
        return pn.pane.Markdown("A page whose job runs for a long time.", css_classes=["slow"])


class _Pairs(View):
    """A page with a bounded number input built as the circuits page builds its own."""

    n_prompts = param.Integer(default=8, bounds=(1, 64), label="Prompt pairs")
    link_params = ("n_prompts",)

    def __init__(self, model, **params):
        super().__init__(**params)

    def __panel__(self):
        return pn.Column(pn.widgets.IntInput.from_param(self.param.n_prompts,
                                                        css_classes=["pairs-input"]),
                         pn.pane.Markdown(pn.bind(lambda n: f"pairs: {n}", self.param.n_prompts),
                                          css_classes=["pairs-value"]))


VIEWS = [("Logit lens", "lens", LensView), ("Second lens", "lens2", LensView),
         ("Slow job", "slow", _Slow), ("Pairs", "pairs", _Pairs)]


@pytest.fixture(scope="module")
def served(tiny_model):
    with served_galleries("tiny-llama", slug="gallery", views=VIEWS, home=True) as served:
        yield served


def _search(tab) -> str:
    return tab.evaluate("window.location.search")


def _wait(tab, predicate, timeout=60.0, what="") -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        tab.wait_for_timeout(100)
    raise AssertionError(f"not within {timeout} s: {what}")


def _nav(tab, title):
    return tab.locator(".gallery-nav button", has_text=re.compile(f"^{re.escape(title)}$")).first


def _active(tab) -> str:
    return tab.locator(".gallery-nav button.bk-active").first.inner_text().strip()


def _open(context_or_browser, url, ready=".gallery-nav button"):
    tab = context_or_browser.new_page()
    tab.set_viewport_size({"width": 1280, "height": 1000})
    tab.goto(url, timeout=120_000)
    tab.wait_for_selector(ready, state="attached", timeout=120_000)
    return tab


def _lens_drawn(tab, timeout=120):
    tab.locator(".lens-plot canvas").first.wait_for(state="attached", timeout=timeout * 1000)


def _toasts(tab) -> list[str]:
    return [t.strip() for t in tab.locator(TOAST).all_inner_texts()]


def test_home_page_is_first_and_its_links_open_pages(browser, served):
    url, sessions = served
    tab = _open(browser, url, ready=".home-page")
    assert _active(tab) == "Home"
    text = wait_for_text(tab, ".home-page", "A first tour")
    # this gallery's pages: the lens under its question, the others under "More pages"
    assert "What does the model predict?" in text and "More pages" in text
    assert "How does it learn?" not in text
    ARTIFACTS.mkdir(exist_ok=True)
    for width, height in ((1280, 1000), (1920, 1080)):
        tab.set_viewport_size({"width": width, "height": height})
        tab.wait_for_timeout(500)
        tab.screenshot(path=str(ARTIFACTS / f"gallery-home-{width}.png"), full_page=True)
    tab.locator(".home-page a[data-view='lens']").first.click()
    _wait(tab, lambda: "view=lens" in _search(tab), 5, "the address follows the link")
    _lens_drawn(tab)
    _wait(tab, lambda: _active(tab) == "Logit lens", 30, "the lens page is shown")
    assert sessions[-1].view == "lens"
    tab.close()


def test_view_slug_links_still_open_their_page(browser, served):
    url, _ = served
    tab = _open(browser, f"{url}?view=lens2")
    _lens_drawn(tab)
    assert _active(tab) == "Second lens"
    tab.close()


def test_link_round_trip_in_a_fresh_context(browser, served):
    url, sessions = served
    tab = _open(browser, f"{url}?view=lens")
    _lens_drawn(tab)
    g = sessions[-1]
    box = tab.locator(".prompt-box input").first
    box.fill("The Eiffel Tower is in")
    box.press("Enter")
    _wait(tab, lambda: g.prompt == "The Eiffel Tower is in", 30, "the prompt reaches the server")
    add = tab.locator(".workspace-add input").first
    add.fill("L1.H2")
    add.press("Enter")
    _wait(tab, lambda: g.workspace.selected == ["L1.H2"], 30, "the head is selected")
    tab.locator(".ablate-selected button").first.click()
    _wait(tab, lambda: len(g.workspace.edits) == 1, 30, "the ablation is on the stack")
    g.page("lens").k = 9  # a page setting the link carries (set as the slider would)
    _wait(tab, lambda: "&s=1." in _search(tab) and g.link()[0] == _search(tab), 30,
          "the address holds the whole link")
    scope = wait_for_text(tab, ".page-scope", "on: your prompt")
    assert "edits: applied" in scope
    tab.locator(".copy-link button").first.click()
    wait_for_text(tab, ".link-note", r"Link copied \(\d")
    link = tab.evaluate("window.__explorerCopied")
    assert link == tab.evaluate("window.location.href")
    tab.close()

    fresh = browser.new_context()
    other = _open(fresh, link)
    _lens_drawn(other)
    h = sessions[-1]
    assert h is not g
    assert other.locator(".prompt-box input").first.input_value() == "The Eiffel Tower is in"
    assert h.workspace.prompt == "The Eiffel Tower is in"
    assert h.workspace.selected == ["L1.H2"]
    assert [e.to_dict() for e in h.workspace.edits] == [e.to_dict() for e in g.workspace.edits]
    assert h.page("lens").k == 9 and h.view == "lens"
    other.locator(".edit-stack", has_text="ablate L1.H2").first.wait_for(timeout=60_000)
    other.locator(".workspace-selection .choices__item", has_text="L1.H2").first.wait_for(
        state="attached", timeout=60_000)
    assert _active(other) == "Logit lens"
    assert not other.locator(".link-message").first.is_visible()
    other.close()

    # one character changed in the state: refused with a message, the page opens plain
    query = link.split("?", 1)[1]
    state = query.split("&s=", 1)[1]
    i = len(state) // 2
    bad = state[:i] + ("B" if state[i] != "B" else "C") + state[i + 1:]
    tampered = _open(fresh, f"{url}?view=lens&s={bad}")
    _lens_drawn(tampered)
    message = wait_for_text(tampered, ".link-message", "could not be opened")
    assert "a character was changed" in message
    assert sessions[-1].workspace.selected == [] and sessions[-1].workspace.edits == []
    _wait(tampered, lambda: len(_toasts(tampered)) == 1, 10, "one notification")
    tampered.close()
    # a link of another version
    old = _open(fresh, f"{url}?view=lens&s=0.{state[2:]}")
    wait_for_text(old, ".link-message", "another version")
    old.close()
    fresh.close()


def test_back_and_forward_move_between_pages(browser, served):
    url, sessions = served
    tab = _open(browser, f"{url}?view=lens")
    _lens_drawn(tab)
    for title, slug in (("Slow job", "slow"), ("Pairs", "pairs")):
        _nav(tab, title).click()
        _wait(tab, lambda: f"view={slug}" in _search(tab), 5, f"address at {slug}")
        _wait(tab, lambda: sessions[-1].view == slug, 30, f"server at {slug}")
    tab.go_back()
    _wait(tab, lambda: "view=slow" in _search(tab), 5, "back: address")
    _wait(tab, lambda: sessions[-1].view == "slow" and _active(tab) == "Slow job", 30,
          "back: the page")
    tab.go_back()
    _wait(tab, lambda: sessions[-1].view == "lens" and _active(tab) == "Logit lens", 30,
          "back again")
    tab.go_forward()
    _wait(tab, lambda: sessions[-1].view == "slow" and "view=slow" in _search(tab), 30,
          "forward")
    tab.close()


def test_the_address_follows_at_once_while_a_long_job_runs(browser, served):
    url, sessions = served
    tab = _open(browser, f"{url}?view=slow")
    g = sessions[-1]
    _wait(tab, lambda: g.view == "slow", 30, "slow page")
    slow = g.page("slow")
    stop = threading.Event()

    def burn():  # other work on the server's interpreter: a loaded server
        while not stop.is_set():
            sum(i * i for i in range(50_000))

    burners = [threading.Thread(target=burn, daemon=True) for _ in range(2)]
    for b in burners:
        b.start()
    try:
        slow.start()
        assert slow.started.wait(30)
        lags = []
        for title, slug in (("Pairs", "pairs"), ("Second lens", "lens2"), ("Slow job", "slow")):
            t0 = time.perf_counter()
            _nav(tab, title).click()
            _wait(tab, lambda: f"view={slug}" in _search(tab), 5, f"address at {slug}")
            lags.append(time.perf_counter() - t0)
        # the click's own round trip in Playwright included: the address changed in the page
        assert max(lags) < 2.0, lags
        _wait(tab, lambda: g.view == "slow", 60, "the server follows")
        _wait(tab, lambda: "view=slow" in _search(tab), 10, "the address stays on the page")
    finally:
        stop.set()
        slow.cancel()
        for b in burners:
            b.join(5)
    tab.close()


def test_one_notification_per_bad_input(browser, served):
    url, sessions = served
    tab = _open(browser, f"{url}?view=lens")
    _lens_drawn(tab)
    _nav(tab, "Second lens").click()
    _wait(tab, lambda: "lens2" in sessions[-1].pages, 30, "both lenses built")
    tab.wait_for_timeout(1000)
    box = tab.locator(".prompt-box input").first
    box.fill("   ")
    box.press("Enter")
    _wait(tab, lambda: len(_toasts(tab)) >= 1, 30, "a notification")
    tab.wait_for_timeout(3000)  # both pages have failed by now
    toasts = _toasts(tab)
    assert len(toasts) == 1, toasts
    assert "Prompt not run: the prompt is empty" in toasts[0]
    assert sessions[-1].prompt == "The capital of France is"  # the pages keep their prompt

    # a prompt over the limit: refused once, saying the limit; the text stays in the box
    long = "word " * 3000
    box.fill(long)
    wait_for_text(tab, ".prompt-info", r"Too long: the prompt is [\d,]+ tokens; the sidebar "
                                       r"takes at most 256")
    box.press("Enter")
    _wait(tab, lambda: any("at most 256" in t for t in _toasts(tab)), 30, "the limit said")
    tab.wait_for_timeout(1500)
    assert len([t for t in _toasts(tab) if "at most 256" in t]) == 1
    assert box.input_value() == long   # nothing cut in the box
    assert sessions[-1].prompt == "The capital of France is"
    box.fill("Hello")
    wait_for_text(tab, ".prompt-info", r"^\s*\d+ / 256 tokens")

    # an out-of-range head typed in the selection box: one message
    add = tab.locator(".workspace-add input").first
    add.fill("L40.H3")
    add.press("Enter")
    msg = wait_for_text(tab, ".workspace-add-message", "L40")
    assert "layer" in msg.lower()
    tab.wait_for_timeout(1000)
    assert len([t for t in _toasts(tab) if "L40" in t]) <= 1
    tab.close()


@pytest.mark.parametrize("typed", ["0", "-5", "100000"])
def test_a_number_out_of_range_says_so(browser, served, typed):
    url, sessions = served
    tab = _open(browser, f"{url}?view=pairs", ready=".pairs-input input")
    box = tab.locator(".pairs-input input").first
    box.fill(typed)
    box.press("Enter")
    _wait(tab, lambda: len(_toasts(tab)) >= 1, 20, "a notification")
    toasts = _toasts(tab)
    assert len(toasts) == 1, toasts
    assert re.search(r"Prompt pairs must be at (least 1|most 64), not -?\d+", toasts[0]), toasts
    assert sessions[-1].page("pairs").n_prompts == 8
    wait_for_text(tab, ".pairs-value", "pairs: 8")
    tab.close()


def test_sidebar_at_1280_and_1920(browser, served):
    """The copy-as-code buttons inside the sidebar and the nav without a tooltip left over the
    page, screenshot at both widths."""
    url, _ = served
    tab = _open(browser, f"{url}?view=lens")
    _lens_drawn(tab)
    _nav(tab, "Second lens").hover()
    tab.mouse.move(900, 400)
    tab.wait_for_timeout(800)
    assert tab.locator(".bk-tooltip:visible, [role=tooltip]:visible").count() == 0
    for width, height in ((1280, 1000), (1920, 1080)):
        tab.set_viewport_size({"width": width, "height": height})
        tab.wait_for_timeout(800)
        sidebar = tab.locator("#sidebar").first.bounding_box()
        for name in ("page-code", "workspace-code"):
            button = tab.locator(f".{name} button.copy-code-open").first
            button.scroll_into_view_if_needed()
            box = button.bounding_box()
            assert box["x"] + box["width"] <= sidebar["x"] + sidebar["width"] + 1, (box, sidebar)
            button.screenshot(path=str(ARTIFACTS / f"gallery-{name}-button-{width}.png"))
        tab.screenshot(path=str(ARTIFACTS / f"gallery-sidebar-{width}.png"))
    tab.close()
