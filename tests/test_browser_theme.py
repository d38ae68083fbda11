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
