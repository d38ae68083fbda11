"""*Copy as code* and *Copy page as code* in Chromium: a click writes the clipboard with the
snippet the server computes (`Workspace.copy_as_code`, `Gallery.page_code`) and opens it in a
dialog wide enough to read; where the browser refuses the clipboard the text is selected."""
from __future__ import annotations


import pytest
from _browser import ARTIFACTS, shared_page, wait_until

pytestmark = pytest.mark.browser

_SESSIONS: list = []


def _gallery(request):
    from apps.gallery import Gallery
    from apps.lens import LensView

    request.getfixturevalue("tiny_model")

    def app():
        g = Gallery("tiny-llama", views=[("Logit lens", "lens", LensView)])
        _SESSIONS.append(g)
        return g.template()
    return app


gallery_url = shared_page("copy-code", _gallery)




def _open(browser, url, *, permissions=("clipboard-read", "clipboard-write"), script=None):
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    if permissions:
        context.grant_permissions(list(permissions), origin=url.rsplit("/", 1)[0])
    if script:
        context.add_init_script(script)
    tab = context.new_page()
    before = len(_SESSIONS)
    tab.goto(url, timeout=120_000)
    tab.wait_for_selector(".workspace-code button.copy-code-open", state="attached",
                          timeout=120_000)
    wait_until(lambda: len(_SESSIONS) > before, what="the session's gallery")
    return tab, _SESSIONS[-1]


def _copy(tab, css):
    button = tab.locator(f".{css} button.copy-code-open").first
    button.scroll_into_view_if_needed()
    button.click()
    box = tab.locator(f".{css} .copy-code").first
    wait_until(lambda: box.get_attribute("data-copied"), 20, f"{css} copied")
    return box.get_attribute("data-copied"), tab.locator(f".{css} dialog.copy-code-dialog").first


def _dialog_is_readable(tab, dialog, name):
    assert dialog.is_visible()
    box = dialog.bounding_box()
    assert box["width"] >= 800, box                    # not the sidebar's 230 px
    assert box["x"] >= 0 and box["x"] + box["width"] <= 1280, box
    pre = dialog.locator("pre.copy-code-text")
    font, sideways = pre.evaluate("el => [getComputedStyle(el).fontFamily, "
                                  "el.scrollWidth - el.clientWidth]")
    assert "mono" in font.lower(), font
    assert sideways <= 0, f"the code scrolls sideways by {sideways} px"
    dialog.screenshot(path=str(ARTIFACTS / f"copy-code-{name}.png"))
    dialog.locator("button.copy-code-close").click()
    wait_until(lambda: not dialog.is_visible(), 10, "the dialog closed")


def test_copy_as_code_writes_the_clipboard_and_shows_the_snippet(browser, gallery_url):
    ARTIFACTS.mkdir(exist_ok=True)
    tab, g = _open(browser, gallery_url)
    add = tab.locator(".workspace-add input").first
    add.fill("L1.H2, P1")
    add.press("Enter")
    wait_until(lambda: g.workspace.selection == ["L1.H2", "P1"], 30, "the selection")
    tab.locator(".ablate-selected button").first.click()
    wait_until(lambda: len(g.workspace.edits) == 1, 30, "the ablation")
    expected = g.workspace.copy_as_code()
    assert "L1.H2" in expected and "edits" in expected
    # the snippet reaches the browser as the workspace changes; the click copies that one
    wait_until(lambda: tab.locator(".workspace-code pre.copy-code-text").first.evaluate(
        "el => el.textContent") == expected, 30, "the snippet in the browser")
    how, dialog = _copy(tab, "workspace-code")
    assert how == "clipboard"
    assert tab.evaluate("navigator.clipboard.readText()") == expected
    _dialog_is_readable(tab, dialog, "workspace")

    g.page("lens").wait(300)
    page_code = g.page_code()
    wait_until(lambda: tab.locator(".page-code pre.copy-code-text").first.evaluate(
        "el => el.textContent") == page_code, 60, "the page's snippet in the browser")
    how, dialog = _copy(tab, "page-code")
    assert how == "clipboard"
    assert tab.evaluate("navigator.clipboard.readText()") == page_code
    assert "explorer.logit_lens" in page_code
    _dialog_is_readable(tab, dialog, "page")
    tab.context.close()


def test_a_refused_clipboard_selects_the_code_instead(browser, gallery_url):
    refuse = ("Object.defineProperty(navigator, 'clipboard', {value: {writeText: () => "
              "Promise.reject(new DOMException('refused', 'NotAllowedError'))}})")
    tab, g = _open(browser, gallery_url, permissions=(), script=refuse)
    expected = g.workspace.copy_as_code()
    how, dialog = _copy(tab, "workspace-code")
    assert how in ("selected", "clipboard")             # execCommand may still copy it
    # the selection of a <pre> leaves out its last line's newline
    assert tab.evaluate("window.getSelection().toString()").rstrip("\n") == expected.rstrip("\n")
    note = dialog.locator(".copy-code-note").inner_text()
    assert ("Ctrl+C" in note) if how == "selected" else ("Copied" in note)
    tab.context.close()
