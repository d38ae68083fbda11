"""Saturation page before any click or analysis: the detail plots and the injection test say
what they wait for, and the staircase's rank axis reads left to right."""
from __future__ import annotations

import panel as pn
from bokeh.document import Document
from bokeh.models import Plot

from apps import theme


def _view(model, **params):
    from apps.saturation import SaturationView

    return SaturationView(model, store=None, n_tokens=200, background=False, **params)


def _render(viewable) -> list[Plot]:
    doc = Document()
    root = viewable.get_root(doc)
    doc.add_root(root)
    return list(root.select({"type": Plot}))


def test_detail_plots_say_click_a_token_until_one_is_clicked(tiny_model):
    theme.enable_extension()
    view = _view(tiny_model)
    plots = _render(view._detail_plots())
    assert sorted(p.title.text for p in plots) == ["Lens top-k per layer", "Saturation staircase"]
    assert view.hints_shown() == [True, True]
    view.selected = 2
    assert view.hints_shown() == [False, False]
    assert len(view.detail_sources()["points"][0].data["rank"]) == view.k   # the token's s_j
    view.selected = -1
    assert view.hints_shown() == [True, True]
    # rank 1 on the left, k_max on the right, on both plots (the staircase ran 10 -> 0)
    k_max = view.param.k.bounds[1]
    for plot in plots:
        assert (plot.x_range.start, plot.x_range.end) == (0.5, k_max + 0.5)
    view.close()


def test_injection_test_waits_for_the_analysis(tiny_model):
    view = _view(tiny_model)
    result = view.result
    view.result = None
    shown = view._intervention()
    assert isinstance(shown, pn.pane.Markdown) and "waits for the corpus analysis" in shown.object
    view.result = result
    assert "waits" not in str(getattr(view._intervention(), "object", ""))
    view.close()
