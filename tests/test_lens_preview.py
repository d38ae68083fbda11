"""The logit-lens page's preview while the steering slider moves, and the lens's preview mode.

Checked against a plain-torch lens (forward hooks on the Hugging Face layers, final norm and
unembedding by hand), against a fresh HoloViews render for the in-place redraw, and with a
slow fake job for the dropping of stale requests.
"""
from __future__ import annotations

import functools
import threading

import numpy as np
import panel as pn
import param
import pytest
import torch
from _browser import wait_until

import explorer
from apps.lens import LensView, heatmap_columns, is_preview, plot_lens_heatmap
import explorer.lens_preview
from explorer.lens import logit_lens, preview_vocabulary
from explorer.models import TINY_MODELS
from tests.test_apps import _layer_outputs

PROMPT = "The capital of France is"


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path / "cache"))


def _lens_logits(model, prompt, *, steer=None):
    """Plain lens logits [layer, pos, vocab]: each decoder layer's output (hooks; ``steer`` =
    (layer, vector, alpha) adds alpha * vector there) through the final norm and lm_head."""
    h = _layer_outputs(model, prompt, steer=steer)                      # [layer, pos, d]
    with torch.no_grad():
        return model.hf.lm_head(model.hf.model.norm(h)).float()


def _vector(view):
    return view._steering_vector(view._run_params())


def _release(slider, value):
    with param.parameterized.edit_constant(slider):
        slider.param.update(value=value, value_throttled=value)


# -- explorer.logit_lens(preview_vocab=...) ------------------------------------------------

def test_preview_over_every_token_is_the_exact_lens(tiny_model):
    vocab = np.arange(tiny_model.vocab_size)       # nothing left to sample: exact normaliser
    exact = logit_lens(tiny_model, PROMPT, k=3)
    preview = logit_lens(tiny_model, PROMPT, k=3, preview_vocab=vocab)
    assert preview.attrs["params"]["readout"] == "preview"
    np.testing.assert_array_equal(preview.top_token_id.values, exact.top_token_id.values)
    np.testing.assert_allclose(preview.top_prob.values, exact.top_prob.values, rtol=1e-5)
    np.testing.assert_array_equal(preview.final_rank.values, exact.final_rank.values)


def test_preview_reads_the_candidates_exactly(tiny_model, monkeypatch):
    monkeypatch.setattr(explorer.lens, "PREVIEW_SAMPLE", 0)  # the candidates alone
    v = np.random.default_rng(0).normal(size=tiny_model.spec.d_model).astype(np.float32)
    edits = [explorer.Steer(1, v, 3.0)]
    logits = _lens_logits(tiny_model, PROMPT, steer=(1, v, 3.0))     # [layer, pos, vocab]
    cand = np.arange(0, tiny_model.vocab_size, 7)                     # every 7th token
    ds = logit_lens(tiny_model, PROMPT, k=2, edits=edits, preview_vocab=cand)
    read = np.zeros(tiny_model.vocab_size, dtype=bool)
    n_layers = logits.shape[0]
    top = ds.top_token_id.values[0]                                   # [pos, layer, rank]
    for layer in range(n_layers - 1):
        cols = np.concatenate([cand, ds.final_token_id.values[0].reshape(-1)])
        read[:] = False
        read[cols] = True
        for pos in range(logits.shape[1]):
            got = top[pos, layer, 0]
            row = logits[layer, pos].numpy()
            # the best of the tokens read, its probability normalised over them
            assert read[got] and row[got] >= row[read].max() - 1e-5
            p = np.exp(row[got] - row[read].max()) / np.exp(row[read] - row[read].max()).sum()
            np.testing.assert_allclose(ds.top_prob.values[0, pos, layer, 0], p, rtol=1e-4)
    # the final layer is the model's output, exact
    final = torch.softmax(logits[-1], -1)
    np.testing.assert_array_equal(top[:, -1, 0], final.argmax(-1).numpy())
    np.testing.assert_allclose(ds.top_prob.values[0, :, -1, 0], final.max(-1).values.numpy(),
                               rtol=1e-4)


def test_preview_vocabulary_takes_results_and_direction(tiny_model):
    ds = logit_lens(tiny_model, PROMPT, k=2)
    v = np.random.default_rng(1).normal(size=tiny_model.spec.d_model).astype(np.float32)
    ids = preview_vocabulary(tiny_model, results=[ds], directions=[v], per_direction=5)
    assert len(set(ids.tolist())) == len(ids)
    assert set(ds.top_token_id.values.reshape(-1).tolist()) <= set(ids.tolist())
    w = tiny_model.hf.lm_head.weight.detach()
    gain = tiny_model.hf.model.norm.weight.detach()
    raised = (w @ (torch.as_tensor(v) * gain)).topk(5).indices.tolist()
    assert set(raised) <= set(ids.tolist())


# -- the page -------------------------------------------------------------------------------

def test_dragging_shows_a_marked_preview_and_release_the_exact_lens(tiny_model):
    view = LensView(tiny_model, prompt=PROMPT, k=3, steer_layer=1, background=False)
    slider = view.alpha_slider()
    unedited = view.result
    slider.value = 2.5                                   # dragging: value, not value_throttled
    assert is_preview(view.preview) and view.preview.attrs["edits"][0]["alpha"] == 2.5
    assert view.result is unedited and view.alpha == 0.0  # no exact run while dragging
    assert view.shown is view.preview
    title = plot_lens_heatmap(view.shown).get(0).opts.get().kwargs["title"]
    assert title.startswith("PREVIEW") and "Preview" in view.status
    _release(slider, 2.5)                                # released: the exact lens
    assert view.preview is None and view.alpha == 2.5 and not is_preview(view.result)
    # the exact result equals a plain full computation (hooks, no resume, no preview)
    logits = _lens_logits(tiny_model, PROMPT, steer=(1, _vector(view), 2.5))
    probs = torch.softmax(logits, -1)                    # [layer, pos, vocab]
    top_p, top_i = probs.topk(3, dim=-1)
    np.testing.assert_array_equal(view.result.top_token_id.values[0],
                                  top_i.transpose(0, 1).numpy())
    np.testing.assert_allclose(view.result.top_prob.values[0], top_p.transpose(0, 1).numpy(),
                               rtol=1e-4, atol=1e-6)
    title = plot_lens_heatmap(view.shown).get(0).opts.get().kwargs["title"]
    assert not title.startswith("PREVIEW")


def test_stale_previews_are_dropped_not_queued(tiny_model):
    view = LensView(tiny_model, prompt=PROMPT, k=2, steer_layer=1, background=True).wait()
    gate, started = threading.Event(), threading.Event()
    computed = []

    def slow(p, token):                                  # a slow fake preview job
        computed.append(p["alpha"])
        started.set()
        gate.wait(10)
        return view.result.assign_attrs(params={**view.result.attrs["params"],
                                                "readout": "preview"},
                                        edits=[{"kind": "steer", "layer": 1,
                                               "alpha": p["alpha"]}])

    view._compute_preview = slow
    try:
        view.request_preview(1.0)
        assert started.wait(10)
        for a in (2.0, 3.0, 4.0, 5.0):                   # while 1.0 computes
            view.request_preview(a)
        gate.set()
        deadline = threading.Event()
        for _ in range(200):
            if not view._slot.busy:
                break
            deadline.wait(0.05)
        view.wait()
        assert computed == [1.0, 5.0]                    # 2, 3 and 4 were dropped
        # a preview asked for before a release is not drawn over the exact result
        gate.clear()
        started.clear()
        view.request_preview(6.0)
        assert started.wait(10)
        view.alpha = 1.5                                 # the release's exact run
        view._runners["run"].wait(60)                    # lands while the preview still computes
        assert view.result.attrs["edits"][0]["alpha"] == 1.5
        gate.set()
        for _ in range(200):
            if not view._slot.busy:
                break
            deadline.wait(0.05)
        assert view.preview is None and view.shown is view.result
    finally:
        gate.set()
        view.close()


def test_drag_redraws_in_place_like_a_fresh_render(tiny_model):
    from bokeh.document import Document
    from bokeh.models import ColumnDataSource
    from panel.io.state import set_curdoc

    view = LensView(tiny_model, prompt=PROMPT, k=3, steer_layer=1, background=False)
    slider = view.alpha_slider()
    doc = Document()
    with set_curdoc(doc):
        doc.add_root(pn.panel(view).get_root(doc))
        _release(slider, 1.0)                           # steered: the plot gains its line
        version = view.plot_version
        slider.value = 3.0
        assert view.plot_version == version             # same shape: no new plot
        drawn = view.drawn_sources()
        assert drawn["heat"] and drawn["labels"]
    fresh = Document()
    with set_curdoc(fresh):
        pane = pn.pane.HoloViews(plot_lens_heatmap(view.preview))
        fresh.add_root(pane.get_root(fresh))
    rendered = [s.data for s in fresh.select({"type": ColumnDataSource})]
    want = heatmap_columns(view.preview)
    for glyph, sources in drawn.items():
        for src in sources:
            match = [d for d in rendered if set(d) == set(src.data)]
            assert match, f"no fresh {glyph} source with columns {sorted(src.data)}"
            for name in src.data:
                got = list(src.data[name])
                assert got == list(match[0][name]) == list(want[glyph][name]), name
    view.close()


def test_an_in_place_redraw_retitles_the_shown_figure_only(tiny_model):
    """A drag retitles the figure the page shows; a figure of an earlier render that is still
    alive (kept by the hooks, no longer in the page) is left alone: a change to it would name
    a model the browser does not hold."""
    import gc

    from bokeh.document import Document
    from bokeh.models import Plot
    from panel.io.state import set_curdoc

    from apps._lens_heatmap import lens_title

    view = LensView(tiny_model, prompt=PROMPT, k=3, steer_layer=1, background=False)
    slider = view.alpha_slider()
    doc = Document()
    with set_curdoc(doc):
        doc.add_root(pn.panel(view).get_root(doc))
        _release(slider, 1.0)
        old = [f for f in doc.select({"type": Plot}) if f.title is not None and f.title.text]
        assert len(old) == 1
        stale = old[0]
        stale_title = stale.title.text
        view.plot_version += 1                          # drawn anew: a new figure
        gc.collect()
        shown = [f for f in doc.select({"type": Plot}) if f.title is not None and f.title.text]
        assert len(shown) == 1 and shown[0] is not stale
        view._figures.append(__import__("weakref").ref(stale))   # as if a hook still held it
        version = view.plot_version
        slider.value = 3.0                              # a drag: in place
        assert view.plot_version == version
        assert shown[0].title.text == lens_title(view.preview, clean=False)
        assert shown[0].title.text != stale_title
        assert stale.title.text == stale_title          # the gone figure is not touched
    view.close()


def test_a_drag_from_zero_shows_the_steering_line_in_place(tiny_model):
    """The unsteered lens and the first preview share one figure: the steering line is drawn
    hidden at first, the move shows it at the steered layer's lower edge (no new plot)."""
    from bokeh.document import Document
    from bokeh.models import Span
    from panel.io.state import set_curdoc

    view = LensView(tiny_model, prompt=PROMPT, k=3, steer_layer=1, background=False)
    slider = view.alpha_slider()
    doc = Document()
    with set_curdoc(doc):
        doc.add_root(pn.panel(view).get_root(doc))
        spans = list(doc.select({"type": Span}))
        assert [(s.location, s.visible) for s in spans] == [(0.5, False)]
        version = view.plot_version
        slider.value = 2.0                              # a drag from 0: the first preview
        assert is_preview(view.preview) and view.plot_version == version
        assert [(s.location, s.visible) for s in doc.select({"type": Span})] == [(0.5, True)]
        view.steer_layer = 0
        slider.value = 2.5
        assert view.plot_version == version
        assert [(s.location, s.visible) for s in doc.select({"type": Span})] == [(-0.5, True)]
    view.close()


def test_a_redraw_sends_only_the_changed_cells():
    from bokeh.document import Document
    from bokeh.models import ColumnDataSource

    from apps.lens import _update_source

    src = ColumnDataSource({"z": np.array([0.1, 0.2, 0.3, 0.4]), "tok": ["a", "b", "c", "d"],
                            "same": ["x", "y", "z", "w"]})
    doc = Document()
    doc.add_root(src)
    events = []
    doc.on_change(lambda event: events.append(event))
    _update_source(src, {"z": np.array([0.1, 0.25, 0.35, 0.45]), "tok": ["a", "b", "q", "d"],
                         "same": ["x", "y", "z", "w"]})
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["ColumnDataChangedEvent", "ColumnsPatchedEvent"], kinds
    assert events[0].cols == ["z"]                          # 3 of 4 changed: sent whole
    assert events[1].patches == {"tok": [(2, "q")]}         # 1 of 4: that cell only
    assert list(src.data["z"]) == [0.1, 0.25, 0.35, 0.45]
    assert src.data["tok"] == ["a", "b", "q", "d"] and src.data["same"] == ["x", "y", "z", "w"]


def test_the_slider_updates_are_the_full_columns(tiny_model):
    """`heatmap_updates` (built from the arrays, for speed) gives every column it sends equal
    to `heatmap_columns` (built from the lens table), steered and not."""
    from apps.lens import heatmap_updates

    vector = np.random.default_rng(0).standard_normal(tiny_model.spec.d_model).astype("float32")
    for edits in ([], [explorer.Steer(1, vector, 3.0)]):
        ds = logit_lens(tiny_model, [PROMPT], k=3, edits=edits)
        full, fast = heatmap_columns(ds), heatmap_updates(ds)
        assert set(fast) == set(full)
        for glyph, cols in fast.items():
            assert cols and set(cols) <= set(full[glyph])
            for name, values in cols.items():
                np.testing.assert_array_equal(np.asarray(values), np.asarray(full[glyph][name]))


# -- every family of the architecture table -------------------------------------------------

@pytest.fixture(scope="module", params=TINY_MODELS)
def family_model(request):
    return explorer.load_model(request.param)


def test_a_steered_preview_over_every_token_is_the_exact_lens_in_every_family(family_model):
    m = family_model
    v = np.random.default_rng(2).normal(size=m.spec.d_model).astype(np.float32)
    edits = [explorer.Steer(1, v, 2.0)]
    exact = logit_lens(m, PROMPT, k=3, edits=edits)
    preview = logit_lens(m, PROMPT, k=3, edits=edits, preview_vocab=np.arange(m.vocab_size))
    assert preview.attrs["params"]["readout"] == "preview"
    np.testing.assert_array_equal(preview.top_token_id.values, exact.top_token_id.values)
    np.testing.assert_allclose(preview.top_prob.values, exact.top_prob.values, rtol=1e-5)


def test_the_page_previews_a_drag_in_every_family(family_model):
    """A drag on the lens page draws a marked preview on every family: through the preview
    forward where it covers the blocks (`preview_forward_reason`), through the trace's lens
    elsewhere, whose final layer is the model's exact output. Layers before the steered one
    are the exact lens's, and the release gives the exact lens."""
    m = family_model
    view = LensView(m, prompt=PROMPT, k=3, steer_layer=1, background=False)
    try:
        slider = view.alpha_slider()
        slider.value = 2.5
        assert is_preview(view.preview)
        edits = [explorer.Steer(1, _vector(view), 2.5)]
        exact = logit_lens(m, PROMPT, k=3, edits=edits)
        got, want = view.preview.top_token_id.values[0], exact.top_token_id.values[0]
        np.testing.assert_array_equal(got[:, :1], want[:, :1])     # layer 0, before the steer
        if explorer.lens_preview.preview_forward_reason(m, edits) is not None:
            np.testing.assert_array_equal(got[:, -1, 0], want[:, -1, 0])
        _release(slider, 2.5)
        assert view.preview is None and not is_preview(view.result)
        np.testing.assert_array_equal(view.result.top_token_id.values, exact.top_token_id.values)
    finally:
        view.close()


_until = functools.partial(wait_until, timeout=30.0, interval=0.02)


def test_preview_moves_leave_the_stop_button_alone_and_the_release_lights_it(tiny_model):
    """The stop button follows the session's counted jobs (`SessionHooks.on_active`): a
    drag's previews are not counted; the release's exact run and the preview warm-up after
    it are (each on, then off)."""
    from apps._session import session_hooks

    view = LensView(tiny_model, prompt=PROMPT, k=2, steer_layer=1, background=True).wait()
    hooks = session_hooks(None)
    heard, before = [], hooks.on_active
    hooks.on_active = heard.append
    try:
        start = hooks.active
        for a in (1.0, 1.5, 2.0):
            view.request_preview(a)
            assert _until(lambda: not view._slot.busy)
        assert is_preview(view.preview) and heard == []
        view.alpha = 2.0
        view._runners["run"].wait(60)
        assert _until(lambda: len(heard) == 4 and heard[-1] == start)
        assert heard[0] == start + 1 and not is_preview(view.shown)
    finally:
        hooks.on_active = before
        view.close()


def test_the_gallery_rewrites_the_page_snippet_on_release_not_per_preview():
    from apps.gallery import Gallery

    g = Gallery("tiny-llama", views=[("Logit lens", "lens", lambda m: LensView(
        m, prompt=PROMPT, k=2, steer_layer=1, background=False))])
    view = g.page("lens")
    g.view = "lens"
    revision = g.page_revision
    slider = view.alpha_slider()
    for a in (1.0, 1.5, 2.0):
        slider.value = a
        assert view.previewing and is_preview(view.shown)
    assert g.page_revision == revision           # the snippet and link were left as they were
    _release(slider, 2.0)
    assert not view.previewing and g.page_revision > revision
    assert "'alpha': 2.0" in g.page_code() or "alpha=2.0" in g.page_code()


def test_the_exact_run_computes_at_the_preview_thread_count(tiny_model, monkeypatch):
    """The release's exact lens runs at `PREVIEW_THREADS` torch threads (two threads' barriers
    spin on a busy 2-core machine), and the process's count is restored after it."""
    seen, lens = [], explorer.logit_lens

    def counting(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return lens(*args, **kwargs)

    view = LensView(tiny_model, prompt=PROMPT, k=2, steer_layer=1, background=False)
    before = torch.get_num_threads()
    monkeypatch.setattr(explorer, "logit_lens", counting)
    torch.set_num_threads(2)
    try:
        _release(view.alpha_slider(), 1.5)
        assert seen == [explorer.lens_preview.PREVIEW_THREADS]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
        view.close()


def test_the_stop_button_mid_preview_frees_the_preview_path(tiny_model):
    """The sidebar's stop button cancels the session's runners (`SessionHooks.stop_all`),
    not through the page: a preview cancelled so must not leave the path busy, or every
    later move would wait in the slot for a preview that never lands."""
    from apps._session import session_hooks

    view = LensView(tiny_model, prompt=PROMPT, k=2, steer_layer=1, background=True).wait()
    gate, started = threading.Event(), threading.Event()
    computed = []
    exact = view._compute_preview

    def slow(p, token):
        computed.append(p["alpha"])
        started.set()
        gate.wait(10)
        return exact(p, token)

    view._compute_preview = slow
    try:
        view.request_preview(1.0)
        assert started.wait(10)
        view.request_preview(2.0)                        # waits in the slot
        assert session_hooks(None).stop_all() >= 1       # the stop button
        assert not view._slot.busy and view._slot.pending is None
        gate.set()
        started.clear()
        view.request_preview(3.0)                        # the next move computes at once
        assert started.wait(10)
        assert _until(lambda: not view._slot.busy)
        assert computed == [1.0, 3.0]                    # 2.0 was dropped with the stop
        assert is_preview(view.preview)
        assert view.preview.attrs["edits"][0]["alpha"] == 3.0
    finally:
        gate.set()
        view.close()
