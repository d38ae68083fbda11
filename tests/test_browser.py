"""Browser tests of the gallery and the logit-lens page, served by `apps.gallery.serve`.

The server runs as a subprocess on a free port bound to 127.0.0.1; Playwright drives
Debian's chromium. Screenshots go to ``test-artifacts/`` (gitignored).
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest
try:
    from playwright.sync_api import Error as PlaywrightError
except ImportError:        # the browser fixture skips (or fails) these tests with its own message
    PlaywrightError = RuntimeError

from _browser import free_port, painted, served_in_process, served_in_subprocess

pytestmark = pytest.mark.browser

ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
PROMPT_BOX = "input[placeholder='Enter a prompt and press Enter']"


@contextlib.contextmanager
def gallery_server(model: str, folder: Path):
    """`apps.gallery.serve(model=..., port=...)` in a child process, as a user starts it."""
    port = free_port()
    argv = ["-c", f"from apps.gallery import serve; serve(model={model!r}, port={port})"]
    with served_in_subprocess(argv, port, folder / "server.log") as url:
        yield url + "/?view=lens"    # the home page opens first; the lens by its link


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    with gallery_server("tiny-llama", tmp_path_factory.mktemp("tiny-server")) as url:
        yield url


VIEWPORT = {"width": 1500, "height": 1100}


def open_lens(browser, url, *, context=None):
    """A page on the gallery, its console errors collected, once the lens plot has drawn."""
    page = context.new_page() if context is not None else browser.new_page(viewport=VIEWPORT)
    errors: list[str] = []
    page.on("console", lambda msg: errors.append(f"console: {msg.text}") if msg.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(f"pageerror: {exc}"))
    page.on("requestfailed", lambda req: errors.append(f"request failed: {req.url}"))
    page.goto(url, timeout=60_000)
    page.locator(".lens-plot canvas").first.wait_for(state="attached", timeout=120_000)
    deadline = time.time() + 180
    while page.locator("[data-lens-digest]").count() == 0:
        failed = page.get_by_text("Last run failed")
        if failed.count():
            raise AssertionError(f"the lens run failed in the page: {failed.first.inner_text()}")
        if time.time() > deadline:
            shot(page, f"failure-no-result-{int(time.time())}.png")
            raise AssertionError("no lens result after 180 s")
        time.sleep(0.25)
    return page, errors


def digest(page) -> str:
    return page.locator("[data-lens-digest]").get_attribute("data-lens-digest")


def wait_for_change(page, attribute: str, old: str, timeout: float = 120) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = page.locator(f"[{attribute}]").get_attribute(attribute)
        if value != old:
            return value
        time.sleep(0.25)
    raise AssertionError(f"{attribute} stayed {old!r} for {timeout} s")


def shot(page, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    painted(page, path=str(path), full_page=True)   # once the page has stopped moving
    return path


def test_gallery_loads_with_lens_page(browser, tiny_server):
    page, errors = open_lens(browser, tiny_server)
    nav = page.locator(".bk-btn-group button", has_text="Logit lens")
    assert nav.count() == 1
    assert "Explorer" in page.title()
    assert page.get_by_text("Activation cache").count() == 1
    details = page.locator(".lens-details").inner_text()
    assert "Next-token prediction" in details and "·capital" in details
    shot(page, "gallery-lens-tiny.png")
    page.close()
    assert errors == []


def _plot_pixels(page, timeout: float = 30) -> bytes:
    """The lens plot's settled pixels; a plot swapped or hidden mid-screenshot is taken again."""
    deadline = time.time() + timeout
    while True:
        try:
            return painted(page.locator(".lens-plot").first)
        except PlaywrightError:
            if time.time() > deadline:
                raise
            page.wait_for_timeout(200)


def test_steering_slider_changes_the_plot(browser, tiny_server):
    page, errors = open_lens(browser, tiny_server)
    before = digest(page)
    pixels_before = _plot_pixels(page)
    handle = page.locator(".bk-input-group", has_text="Steering strength").locator(".noUi-handle")
    handle.focus()
    for _ in range(4):  # 4 steps of 0.5: α = 2, applied on release (value_throttled)
        page.keyboard.press("ArrowRight")
    after = wait_for_change(page, "data-lens-digest", before)
    assert after != before
    deadline = time.time() + 120          # previews of the steps between may show first
    while "α = 2" not in page.locator(".lens-details").inner_text() and time.time() < deadline:
        time.sleep(0.25)
    details = page.locator(".lens-details").inner_text()
    assert "α = 2" in details
    deadline = time.time() + 30                     # until the new plot has been painted
    pixels_after = pixels_before
    while pixels_after == pixels_before and time.time() < deadline:
        pixels_after = _plot_pixels(page)
        page.wait_for_timeout(150)
    assert pixels_after != pixels_before
    shot(page, "lens-steered-tiny.png")
    page.close()
    assert errors == []


def test_bad_prompt_shows_a_notification_and_keeps_the_plot(browser, tiny_server):
    page, errors = open_lens(browser, tiny_server)
    before = digest(page)
    box = page.locator(PROMPT_BOX)
    box.fill("   ")
    box.press("Enter")
    toast = page.locator(".notyf__message", has_text="empty")
    toast.wait_for(timeout=60_000)
    assert "Prompt not run" in toast.inner_text()   # refused by the sidebar, once
    assert digest(page) == before                   # the last good result stays
    assert page.locator(".lens-plot canvas").count() > 0
    shot(page, "lens-error-tiny.png")               # once the toast has slid in
    page.close()
    assert errors == []


def test_two_sessions_do_not_share_results(browser, tiny_server):
    one_ctx, two_ctx = browser.new_context(viewport=VIEWPORT), browser.new_context(viewport=VIEWPORT)
    one, errors_one = open_lens(browser, tiny_server, context=one_ctx)
    two, errors_two = open_lens(browser, tiny_server, context=two_ctx)
    prompts = {id(one): "The quick brown fox", id(two): "One two three four"}
    for page in (one, two):
        old = digest(page)
        box = page.locator(PROMPT_BOX)
        box.fill(prompts[id(page)])
        box.press("Enter")
        wait_for_change(page, "data-lens-digest", old)
    for page, other in ((one, two), (two, one)):
        own = page.locator("[data-prompt]").get_attribute("data-prompt")
        assert own == prompts[id(page)]
        tokens = page.locator(".lens-tokens").inner_text()
        assert prompts[id(other)].split()[1] not in tokens
    assert one.locator(PROMPT_BOX).input_value() == "The quick brown fox"
    for ctx in (one_ctx, two_ctx):
        ctx.close()
    assert errors_one == [] and errors_two == []


def test_closed_session_cancels_its_work(browser):
    """A tab closed mid-run: the server destroys the session and its views stop computing."""
    from apps.gallery import Gallery

    galleries = []

    def app():
        gallery = Gallery("tiny-llama")
        galleries.append(gallery)
        return gallery.template()

    with served_in_process({"/": app}, timeout=60, check_unused_sessions_milliseconds=500,
                           unused_session_lifetime_milliseconds=5000) as url:
        page, errors = open_lens(browser, f"{url}/")
        (gallery,) = galleries
        view = gallery.pages["lens"]
        page.locator(".bk-input-group", has_text="Steering strength").locator(".noUi-handle").focus()
        page.keyboard.press("ArrowRight")            # a run starts ...
        page.close()                                 # ... and the tab goes away
        deadline = time.time() + 30
        while not (view._runner._closed and gallery._loader._closed and not gallery.pages) \
                and time.time() < deadline:  # session-destroyed callbacks run one by one
            time.sleep(0.2)
        assert view._runner._closed and gallery._loader._closed
        assert not gallery.pages                     # views (and their cached runs) dropped
        assert not view._page_caches                 # its clean run and steering vectors too
        assert errors == []


@pytest.mark.integration
def test_smollm2_lens_page_renders(browser, tmp_path):
    with gallery_server("smollm2-135m", tmp_path) as url:
        page, errors = open_lens(browser, url)
        details = page.locator(".lens-details").inner_text()
        assert "·Paris" in details  # SmolLM2 completes "The capital of France is"
        ticks = page.locator(".lens-tokens").inner_text()
        assert "·France" in ticks
        shot(page, "lens-smollm2.png")
        page.close()
        assert errors == []
