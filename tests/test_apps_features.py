"""Feature dashboards page, headless, on the tiny model with a reduced corpus: the dictionary is
trained once and read back from the store, the dashboards equal the library's functions on the
stored index and hand computations, search selects a feature, the steering edit reaches the
workspace, the snippet recomputes what is shown."""
from __future__ import annotations

import contextlib

import numpy as np
import param
import pytest
import torch

from apps.features import (FeaturesView, contexts_html, index_caption, plot_histogram,
                           plot_logit_effects, prompt_html)
from explorer.interventions import Steer
from explorer.store import ActivationStore

PROMPT = "The baker sold bread to the fox"
SMALL = dict(corpus_tokens=128, layer=1, tau=0.3, n_latents=32)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path / "cache"))
    return ActivationStore(tmp_path / "cache")


def test_first_visit_trains_then_the_store_serves_and_dashboards_match(tiny_model, store):
    view = FeaturesView(tiny_model, background=False, store=store, prompt=PROMPT, **SMALL)
    assert view.error == "" and view.index is not None and view.cached is False
    index = view.index
    assert "trained on this visit" in index_caption(index, view.cached, view.seconds)
    again = FeaturesView(tiny_model, background=False, store=store, prompt=PROMPT, **SMALL)
    assert again.cached is True
    np.testing.assert_array_equal(again.index.decoder.values, index.decoder.values)
    assert "read from the activation cache" in index_caption(again.index, True, 0.1)
    again.close()
    # the shown feature's dashboards: logit effects are W_U @ d by hand
    f = int(np.argmax(index.frequency.values))
    view.feature = f
    d = torch.as_tensor(index.decoder.values[f], dtype=torch.float64)
    by_hand = tiny_model.unembed_module.weight.detach().double() @ d
    assert view.effects.promoted_id.values.tolist() == by_hand.topk(10).indices.tolist()
    bars = plot_logit_effects(view.effects)
    np.testing.assert_allclose(sorted(bars.dimension_values("logit")),
                               sorted(np.r_[by_hand.topk(10).values.numpy(),
                                            -(-by_hand).topk(10).values.numpy()]), rtol=1e-5)
    # the contexts and histogram count the feature's nonzero corpus entries
    n_active = int((index.entry_feature.values == f).sum())
    assert view.histogram.attrs["n_active"] == n_active
    assert int(plot_histogram(view.histogram).dimension_values("tokens").sum()) == n_active
    top = view.contexts
    assert top.activation.values[0] == pytest.approx(float(index.max_activation.values[f]))
    assert "outline" in contexts_html(top) and f"atom {f}" in contexts_html(top)
    # the prompt's activations; a new prompt recomputes them
    assert view.on_prompt.attrs["prompt"] == PROMPT
    view.prompt = "Bread and honey"
    assert view.on_prompt.attrs["prompt"] == "Bread and honey"
    assert "Outdated" in prompt_html(view.on_prompt, "another prompt")
    view.close()


@contextlib.contextmanager
def _gallery_page():
    """A gallery holding only Feature dashboards, its page's small dictionary trained in the
    foreground: (gallery, page)."""
    from apps.gallery import VIEWS, Gallery

    g = Gallery("tiny-llama", views=[v for v in VIEWS if v[1] == "features"], view="features")
    try:
        view = g.page("features")
        view._background = False
        view.param.update(**SMALL)
        view._request_index()
        view.wait()
        yield g, view
    finally:
        g.close()


@pytest.mark.slow
def test_search_selects_a_feature_and_steering_reaches_the_workspace(tiny_model, store):
    with _gallery_page() as (g, view):
        index = view.index
        assert index is not None
        view.query = "the"
        found = view.found
        fires = [int(x) for x in found.feature.sel(how="fires on").values if x >= 0]
        promotes = [int(x) for x in found.feature.sel(how="promotes").values if x >= 0]
        assert view.feature == (fires or promotes)[0]
        edit = view.steer()
        assert isinstance(edit, Steer) and g.workspace.edits[-1] == edit
        np.testing.assert_allclose(edit.vector, index.decoder.values[view.feature], rtol=1e-6)
        assert edit.layer == SMALL["layer"]
        # the widget moved on while the new dashboards compute: the shown feature is steered
        shown = view.feature
        with param.parameterized.discard_events(view):
            view.feature = shown + 1
        again = view.steer()
        np.testing.assert_allclose(again.vector, index.decoder.values[shown], rtol=1e-6)
        assert not np.allclose(again.vector, index.decoder.values[shown + 1])


def test_a_feature_selected_in_the_workspace_is_shown_and_the_shown_one_is_selected(
        tiny_model, store, notes):
    """*Select this feature* puts the shown feature in the workspace as L<layer>.F<index>; a
    feature selected in the workspace (as typed in the sidebar) moves the page to it, at its
    layer: the dashboards then equal those computed on that layer's dictionary directly."""
    from explorer.analyses import feature_dashboards as F

    with _gallery_page() as (g, view):
        view.feature = 2
        assert view.select_shown() == "L1.F2"
        assert g.workspace.selected_features == ["L1.F2"] and "L1.F2" in g.workspace.selection
        g.workspace.select("L0.F3")                         # typed in the sidebar
        view.wait()
        assert view.selected_features == ["L1.F2", "L0.F3"]
        assert (view.layer, view.feature, view.shown_feature()) == (0, 3, "L0.F3")
        direct, _ = F.cached_feature_index(tiny_model, view.texts(), store=store,
                                           **view.settings())
        assert int(view.index.attrs["layer"]) == 0 and int(direct.attrs["layer"]) == 0
        np.testing.assert_array_equal(view.index.decoder.values, direct.decoder.values)
        top = F.top_activating_contexts(direct, 3, k=12)
        np.testing.assert_allclose(view.contexts.activation.values, top.activation.values)
        n = int(view.index.sizes["feature"])
        g.workspace.select(f"L0.F{n + 5}")                  # past the dictionary's last
        assert view.feature == 3 and f"has {n} features" in view.error
        g.workspace.deselect("L0.F3")
        assert view.selected_features == ["L1.F2", f"L0.F{n + 5}"] and view.feature == 3


def test_snippet_recomputes_the_dashboards(tiny_model, store):
    view = FeaturesView(tiny_model, background=False, store=store, prompt=PROMPT,
                        kind="sae", **SMALL)
    view.feature = 3
    ns: dict = {}
    exec(compile(view.code_snippet(), "<snippet>", "exec"), ns)  # noqa: S102 - the page's own
    assert ns["cached"] is True                      # the page's dictionary, from the store
    np.testing.assert_allclose(ns["contexts"].activation.values, view.contexts.activation.values)
    np.testing.assert_allclose(ns["on_prompt"].activation.values,
                               view.on_prompt.activation.values, rtol=1e-5, atol=1e-7)
    assert ns["effects"].promoted_id.values.tolist() == view.effects.promoted_id.values.tolist()
    view.close()
