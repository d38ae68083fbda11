"""Toggle groups show their state in Chromium: the chosen button of every kind of toggle the
pages use (the default button group of eap / eap-ig, the primary outline one of the gallery's
navigation, a check group) is told apart from the others by its colour, under the theme."""
from __future__ import annotations

import pytest
from _browser import ARTIFACTS, served_in_process

pytestmark = pytest.mark.browser


def _toggles():
    import panel as pn

    from apps import theme

    theme.enable_extension()
    groups = [
        pn.widgets.RadioButtonGroup(options=["eap", "eap-ig"], value="eap-ig",
                                    css_classes=["t-default"]),
        pn.widgets.RadioButtonGroup(options=["top-n", "threshold"], value="top-n",
                                    color="primary", variant="outline", css_classes=["t-outline"]),
        pn.widgets.RadioButtonGroup(options=["edges", "nodes"], value="nodes",
                                    orientation="vertical", color="primary", variant="outline",
                                    css_classes=["t-vertical"]),
        pn.widgets.CheckButtonGroup(options=["a", "b", "c"], value=["b"], css_classes=["t-check"]),
    ]
    return theme.page([pn.Column(*groups, width=400)])


def _luminance(rgb: str) -> float:
    """WCAG relative luminance of a computed ``rgb(r, g, b)`` / ``rgba(...)`` colour."""
    parts = [float(x) for x in rgb[rgb.index("(") + 1:rgb.index(")")].split(",")]
    if len(parts) == 4 and parts[3] == 0:
        parts = [255.0, 255.0, 255.0]        # transparent: the white page under it
    channels = [c / 255 for c in parts[:3]]
    lin = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def _contrast(a: str, b: str) -> float:
    la, lb = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


_STYLE = "el => [getComputedStyle(el).backgroundColor, getComputedStyle(el).color]"


def test_the_chosen_button_of_every_toggle_stands_out(browser):
    with served_in_process({"toggles": _toggles}) as url:
        tab = browser.new_page(viewport={"width": 1280, "height": 800})
        tab.goto(f"{url}/toggles", timeout=120_000)
        chosen = {"t-default": "eap-ig", "t-outline": "top-n", "t-vertical": "nodes",
                  "t-check": "b"}
        for css, label in chosen.items():
            buttons = tab.locator(f".{css} button.bk-btn")
            buttons.first.wait_for(state="attached", timeout=60_000)
            styles = {b.inner_text().strip(): (b.evaluate(_STYLE),
                                               "bk-active" in (b.get_attribute("class") or ""))
                      for b in buttons.all()}
            (active_bg, active_fg), on = styles[label]
            assert on, (css, styles)
            for name, ((bg, _), other_on) in styles.items():
                if name == label:
                    continue
                assert not other_on, (css, styles)
                # the chosen one's background against the others': a clear step (WCAG's 3:1
                # for user-interface parts), not Fast's 242 against 237
                assert _contrast(active_bg, bg) >= 3, (css, active_bg, bg)
            assert _contrast(active_bg, active_fg) >= 4.5, (css, active_bg, active_fg)
        ARTIFACTS.mkdir(exist_ok=True)
        tab.screenshot(path=str(ARTIFACTS / "toggles.png"))
        tab.close()
