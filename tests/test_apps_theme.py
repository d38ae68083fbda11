"""The theme's tick-label policy reaches every axis of every plot a page draws."""
from __future__ import annotations

import holoviews as hv
import numpy as np
import panel as pn
import pytest
from bokeh.document import Document
from bokeh.models import Axis, CustomLabelingPolicy

from apps import theme


@pytest.fixture(autouse=True)
def _extension():
    theme.enable_extension()


def _axes(obj) -> tuple[Document, list[Axis]]:
    """Render ``obj`` as a page renders it (a Panel pane into a Bokeh document)."""
    doc = Document()
    root = pn.panel(obj).get_root(doc)
    doc.add_root(root)
    return doc, list(root.select({"type": Axis}))


def _ours(policy) -> bool:
    return isinstance(policy, CustomLabelingPolicy) and "explorer-no-overlap" in policy.tags


def _crowded_curve() -> hv.Curve:
    # 40 ticks of 7-digit numbers on a 160-px axis: every label would collide with its neighbour.
    return hv.Curve((np.arange(40) * 1.0e6, np.arange(40.0))).opts(width=160, xticks=40)


def test_crowded_numeric_axis_gets_no_overlap_policy():
    doc, axes = _axes(_crowded_curve())
    assert len(axes) == 2
    assert all(_ours(axis.major_label_policy) for axis in axes)
    # The policy is sent to the browser with the document, one model per axis.
    assert sum(_ours(model) for model in doc.models) == 2
    assert str(doc.to_json()).count("explorer-no-overlap") == 2


def test_page_hooks_keep_the_policy():
    seen = []
    plot = _crowded_curve().opts(hooks=[lambda p, e: seen.append(p.state)])
    _, axes = _axes(plot)
    assert seen, "the page's own hook ran"
    assert all(_ours(axis.major_label_policy) for axis in axes)


def test_categorical_log_and_layout_axes_get_the_policy():
    heat = hv.HeatMap([(f"tok{i}", f"L{j}", i * j) for i in range(30) for j in range(4)])
    log = hv.Curve(([1, 10, 100, 1000, 10000], [1, 2, 3, 4, 5])).opts(logx=True)
    overlay = hv.Curve([(0, 1), (1, 2)]) * hv.Scatter([(0, 1)])
    _, axes = _axes(heat + log + overlay)
    assert len(axes) == 6
    assert {type(axis).__name__ for axis in axes} >= {"CategoricalAxis", "LogAxis", "LinearAxis"}
    assert all(_ours(axis.major_label_policy) for axis in axes)


def test_each_axis_and_document_has_its_own_policy_model():
    # A model belongs to one document: a policy shared between two served sessions would fail.
    _, axes_a = _axes(_crowded_curve())
    _, axes_b = _axes(_crowded_curve())
    policies = [axis.major_label_policy for axis in axes_a + axes_b]
    assert len({id(policy) for policy in policies}) == 4


def test_a_page_can_still_choose_its_own_policy():
    from bokeh.models import AllLabels

    def show_all(plot, element):
        plot.state.xaxis.major_label_policy = AllLabels()

    _, axes = _axes(_crowded_curve().opts(hooks=[show_all]))
    policies = sorted(type(axis.major_label_policy).__name__ for axis in axes)
    assert policies == ["AllLabels", "CustomLabelingPolicy"]


def test_log_axes_get_the_1_2_5_ticker_unless_the_plot_sets_ticks():
    from bokeh.models import CustomJSTicker, FixedTicker, LogAxis

    auto = hv.Curve(([0, 1], [0.05, 3.0])).opts(logy=True)
    own = hv.Curve(([0, 1], [0.05, 3.0])).opts(logy=True, yticks=[0.1, 1])
    for plot, kind in ((auto, CustomJSTicker), (own, FixedTicker)):
        _, axes = _axes(plot)
        [log_axis] = [axis for axis in axes if isinstance(axis, LogAxis)]
        assert isinstance(log_axis.ticker, kind)
    _, axes = _axes(auto + auto)
    tickers = [axis.ticker for axis in axes if isinstance(axis, LogAxis)]
    assert len(tickers) == 2 and tickers[0] is not tickers[1]   # one model per axis
    assert all("explorer-log-ticks" in t.tags for t in tickers)


def test_a_bokeh_pane_takes_a_new_figure_under_the_page_design():
    """A function bound into a page (``pn.bind``) that returns a Bokeh figure gets a pane
    made with the page's layout parameters, ``design`` among them. Panel's own Bokeh pane
    then passes that ``design`` to the next figure and fails; `theme.BokehPane` shows it."""
    from bokeh.plotting import figure

    plain = pn.pane.Bokeh(figure(height=100), design=theme.Design)
    with pytest.raises(AttributeError, match="design"):
        plain.object = figure(height=100)
    ours = theme.BokehPane(figure(height=100), design=theme.Design, sizing_mode="stretch_width")
    new = figure(height=120, title="new")
    ours.object = new
    root = ours.get_root(Document())
    assert ours.object is new and root.select_one({"id": new.id}) is new
    assert new.sizing_mode == "stretch_width"



def test_a_long_placeholder_is_drawn_in_lines_that_fit_a_half_width_plot():
    """Bokeh draws a text glyph's string as given; a sentence of 90 characters must reach the
    document broken at word boundaries into lines of at most 56 characters, all words kept."""
    from bokeh.models import GlyphRenderer
    from bokeh.models import Text as TextGlyph

    sentence = ("Press Run unlearning: accuracy before and after unlearning, per metric, "
                "appears here.")
    doc = Document()
    root = pn.panel(theme.placeholder(sentence)).get_root(doc)
    renderers = [r for r in root.select({"type": GlyphRenderer})
                 if isinstance(r.glyph, TextGlyph)]
    assert len(renderers) == 1
    drawn = renderers[0].data_source.data[renderers[0].glyph.text]
    lines = str(drawn[0]).split("\n")
    assert len(lines) >= 2 and max(map(len, lines)) <= 56
    assert " ".join(lines).split() == sentence.split()
