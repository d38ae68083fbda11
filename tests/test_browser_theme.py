"""The theme's tick-label policy, run by BokehJS in chromium on hand-made label boxes."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.browser


def _policy_page(tmp_path):
    """A standalone page (inline BokehJS) with one plot whose axes carry the theme's policy."""
    from pathlib import Path

    import bokeh
    from bokeh.embed import components
    from bokeh.plotting import figure

    from apps import theme

    fig = figure(width=200, height=200)
    fig.line([0, 1], [0, 1])
    policy = theme.no_overlap_policy()
    fig.xaxis.major_label_policy = policy
    path = tmp_path / "policy.html"
    # BokehJS alone, inline (Bokeh's INLINE resources would add Panel's extensions, by path)
    bokeh_js = (Path(bokeh.__file__).parent / "server" / "static" / "js" / "bokeh.min.js").read_text()
    script, div = components(fig)
    path.write_text(f"<html><head><script>{bokeh_js}</script>{script}</head><body>{div}</body></html>",
                    encoding="utf-8")
    return path, policy.id


_RUN = """([id, bboxes]) => {
  const doc = Bokeh.documents[0]
  const policy = doc.get_model_by_id(id)
  const ids = bboxes.map((_, i) => i)
  const result = policy.func.call(Object.create(null), ids, bboxes, null, ...policy.values).next()
  return [...result.value].sort((a, b) => a - b)
}"""


def _box(left, top, width, height):
    return {"left": left, "right": left + width, "top": top, "bottom": top + height}


def test_policy_keeps_spaced_labels_in_any_order_and_thins_crowded_ones(browser, tmp_path):
    path, policy_id = _policy_page(tmp_path)
    page = browser.new_page()
    page.goto(path.as_uri())
    page.wait_for_function("() => window.Bokeh != null && Bokeh.documents.length > 0")
    # a y axis listed top-down (a heatmap's layers L0, L2, ... from the top): boxes 12 px
    # high, 38 px apart, in descending data order; Bokeh's NoOverlap kept only the first
    layers = [_box(0, 10 + 38 * i, 20, 12) for i in range(15)][::-1]
    assert page.evaluate(_RUN, [policy_id, layers]) == list(range(15))
    # an x axis of 40-px labels every 20 px: each label overlaps its neighbours, so every
    # other one stays (the gap to the last kept is 0 px, under the 5-px minimum, for the next)
    crowded = [_box(20 * i, 0, 40, 10) for i in range(10)]
    assert page.evaluate(_RUN, [policy_id, crowded]) == [0, 3, 6, 9]
    # labels 50 px apart with 10-px gaps: all stay
    spaced = [_box(50 * i, 0, 40, 10) for i in range(6)]
    assert page.evaluate(_RUN, [policy_id, spaced]) == list(range(6))
    page.close()


# Ranges of a log axis and the ticks worked out by hand: 1, 2 and 5 times each power of
# ten inside the range; the 1s alone when that gives more than 8; every other power of ten
# when even the 1s are more than 8; 1..9 times the power inside a single decade.
_LOG_RANGES = [
    ((0.09, 1.3), [0.1, 0.2, 0.5, 1.0]),
    ((0.05, 3.0), [0.05, 0.1, 0.2, 0.5, 1.0, 2.0]),            # 1 and 0.1 alone before
    ((1e-6, 1.0), [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0]),  # 19 at 1-2-5: the 1s
    ((1e-12, 1.0), [1e-12, 1e-10, 1e-8, 1e-6, 1e-4, 1e-2, 1.0]),
    ((0.25, 0.45), [0.3, 0.4]),                                # 1-2-5 has none inside
]


def _log_axes_page(tmp_path):
    """A standalone page of HoloViews log plots, one per range, under the pages' Bokeh theme."""
    from pathlib import Path

    import bokeh
    import holoviews as hv
    from bokeh.embed import components
    from bokeh.layouts import column

    from apps import theme

    theme.enable_extension()
    figs = []
    for (low, high), _ in _LOG_RANGES:
        curve = hv.Curve(([0, 1], [low, high])).opts(logy=True, ylim=(low, high), height=260,
                                                     width=300, title=f"{low:g}..{high:g}")
        figs.append(hv.render(curve, backend="bokeh"))
    figs.append(hv.render(hv.Curve(([1, 1000], [1, 2])).opts(logx=True, xticks=[1, 1000], xlim=(0.5, 2000), width=300,
                                                             height=200, title="own ticks")))
    bokeh_js = (Path(bokeh.__file__).parent / "server" / "static" / "js" / "bokeh.min.js").read_text()
    script, div = components(column(*figs), theme=theme.bokeh_theme())
    path = tmp_path / "log_axes.html"
    path.write_text(f"<html><head><script>{bokeh_js}</script>{script}</head><body>{div}</body></html>",
                    encoding="utf-8")
    return path


def test_every_log_axis_gets_1_2_5_ticks_and_a_page_keeps_its_own(browser, tmp_path):
    import numpy as np
    from _ticks import axis_ticks

    page = browser.new_page(viewport={"width": 400, "height": 2000})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(_log_axes_page(tmp_path).as_uri())
    page.wait_for_function("() => window.Bokeh != null && Bokeh.index != null"
                           " && [...Bokeh.index.all_views()].some(v => (v.model.type || '') === 'LogAxis')")
    page.wait_for_timeout(500)
    axes = axis_ticks(page)
    for (low, high), expected in _LOG_RANGES:
        [axis] = [a for a in axes if a["title"] == f"{low:g}..{high:g}" and a["axis"] == "y"]
        assert axis["type"] == "LogAxis"
        np.testing.assert_allclose(axis["ticks"], expected, rtol=1e-9)
        assert all(axis["labels"]) and len(set(axis["labels"])) == len(expected), axis
    # 0.05..3 reads as plain numbers, one label per tick
    [mixed] = [a for a in axes if a["title"] == "0.05..3" and a["axis"] == "y"]
    assert mixed["labels"] == ["0.05", "0.1", "0.2", "0.5", "1", "2"]
    # explicit ticks stay the page's own
    [own] = [a for a in axes if a["title"] == "own ticks" and a["axis"] == "x"]
    assert own["ticks"] == [1, 1000]
    assert not errors, errors
    page.close()


def test_a_long_status_line_wraps_inside_its_column(browser):
    """A page's status line is a <pre>: unwrapped, "... (shares the model with 1 other job
    running)" ran past the right edge of the page at 1280 px (ITDA, Linear ICL)."""
    import panel as pn
    from _browser import SHADOW_TEXT, served_in_process

    from apps import theme

    text = ("3 runs (H = 1, 2, 4), 81 checkpoints, shipped (float16). "
            "(shares the model with 1 other job running)")

    def page():
        return pn.Row(pn.Column(theme.status_line(text), width=300, sizing_mode="fixed"))

    with served_in_process({"status": page}) as url:
        tab = browser.new_page(viewport={"width": 800, "height": 400})
        tab.goto(f"{url}/status")
        tab.wait_for_selector(".status-line", state="attached", timeout=60_000)
        tab.wait_for_timeout(500)
        host = tab.locator(".status-line").first
        assert "shares the model" in host.evaluate(SHADOW_TEXT)
        size = host.evaluate("""el => { const pre = el.shadowRoot.querySelector('pre')
            const r = pre.getBoundingClientRect(), box = el.getBoundingClientRect()
            return {left: box.left, right: r.right, host_right: box.right, height: r.height,
                    scroll: pre.scrollWidth, client: pre.clientWidth} }""")
        assert size["host_right"] - size["left"] <= 300, size   # the pane keeps to its column
        assert size["right"] <= size["host_right"] + 1, size    # and the text to the pane
        assert size["scroll"] <= size["client"] + 1, size       # nothing hidden past the edge
        assert size["height"] > 30, size                         # on more than one line
        tab.close()
