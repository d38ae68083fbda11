"""Attention page, headless: the grid and the enlarged head against a plain HF eager forward."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from apps.attention import (LEVELS, MAX_TOKENS, AttentionView, grid_cell, head_pattern, mosaic,
                            parse_head, patterns, plot_grid, plot_head, quantize)
from tests._hooks import hf_attentions

PROMPT = "The cat sat on the mat because the cat was tired"


@pytest.mark.parametrize("name", ["tiny_model", "tiny_gpt2"])
def test_grid_and_enlarged_head_equalhf_attentions(name, request):
    model = request.getfixturevalue(name)
    view = AttentionView(model, background=False, prompt=PROMPT)
    assert view.error == "" and view.result is not None
    want = hf_attentions(model, PROMPT)                      # [L, H, n, n]
    got = patterns(view.result).values
    np.testing.assert_allclose(got, want, atol=1e-5)
    L, H, n, _ = want.shape
    img = mosaic(got)
    tile = n + 1
    for layer in range(L):
        for head in range(H):
            np.testing.assert_allclose(img[layer * tile:layer * tile + n, head * tile:head * tile + n],
                                       want[layer, head], atol=1e-5)
    assert np.isnan(img[n, :]).all() and np.isnan(img[:, n]).all()   # the gaps
    shown = plot_grid(view.result).dimension_values(2, flat=False)  # what the page draws
    q = quantize(img)
    assert q.dtype == np.uint8 and (q[np.isnan(img)] == LEVELS + 1).all()
    np.testing.assert_allclose(q[~np.isnan(img)] / LEVELS, img[~np.isnan(img)], atol=0.5 / LEVELS)
    assert sorted(np.unique(shown).tolist()) == sorted(np.unique(q).tolist())
    view.select(L - 1, H - 1)
    assert view.selected == f"L{L - 1}.H{H - 1}"
    np.testing.assert_allclose(head_pattern(view.result, L - 1, H - 1).values, want[-1, -1],
                               atol=1e-5)
    heat = plot_head(view.result, view.layer, view.head)
    assert heat.opts.get().kwargs["title"] == f"L{L - 1}.H{H - 1}"
    cells = {(int(k), int(qq)): w for k, qq, w in zip(heat.dimension_values("key"),
                                                       heat.dimension_values("query"),
                                                       heat.dimension_values("weight"))}
    assert len(cells) == n * (n + 1) // 2
    for (k, qq), w in cells.items():
        assert w == pytest.approx(want[-1, -1, qq, k], abs=1e-5)
    view.close()


def test_click_and_typed_head_pick_the_head(tiny_model):
    view = AttentionView(tiny_model, background=False)
    L, H = tiny_model.spec.n_layers, tiny_model.spec.n_heads
    assert grid_cell(2.2, L - 1 - 1 + 0.3, L, H) == (1, 2)     # layer 0's row is on top
    assert grid_cell(H + 1, 0, L, H) is None
    view._grid_tapped(x=3.1, y=L - 1.0)
    assert (view.layer, view.head, view.selected) == (0, 3, "L0.H3")
    view.selected = "l2.h1"
    assert (view.layer, view.head, view.selected) == (2, 1, "L2.H1")
    view.selected = "L9.H0"                                     # not in the model: unchanged
    assert (view.layer, view.head, view.selected) == (2, 1, "L2.H1")
    with pytest.raises(Exception, match="L2.H3"):
        parse_head("2/1", L, H)
    view.close()


def test_prompt_change_recomputes_and_bad_prompts_show_a_message(tiny_model):
    view = AttentionView(tiny_model, background=False, prompt="a b")
    first = view.result
    view.prompt = PROMPT
    n = len(tiny_model.tokenize(PROMPT).token_ids[0])
    assert view.result is not first and patterns(view.result).sizes["dst_pos"] == n
    np.testing.assert_allclose(patterns(view.result).values, hf_attentions(tiny_model, PROMPT),
                               atol=1e-5)
    good = view.result
    view.prompt = "   "
    assert "empty" in view.error and "Traceback" not in view.error and view.result is good
    long = "x " * (MAX_TOKENS // 2 + 10)
    assert MAX_TOKENS < len(tiny_model.tokenize(long).token_ids[0]) <= 256  # the model takes it
    view.prompt = long
    assert f"at most {MAX_TOKENS}" in view.error and view.status.startswith("Last run failed")
    view.prompt = "a b c"
    assert view.error == ""
    view.close()
    view.prompt = PROMPT                                        # closed: nothing runs
    assert view.result is None and view._runners["trace"].submit(lambda t: 1) is None


@pytest.mark.integration
def test_bench_smollm2_64_tokens(smollm2, capsys):
    """Not a timed assertion: measures prompt change -> data ready and the render payload."""
    import panel as pn
    from bokeh.document import Document
    from bokeh.document.events import DocumentPatchedEvent
    from bokeh.protocol import Protocol

    ids = smollm2.tokenize(" ".join([PROMPT] * 8)).token_ids[0][:64]
    prompt = smollm2.tokenizer.decode(ids)
    n = len(smollm2.tokenize(prompt).token_ids[0])
    view = AttentionView(smollm2, background=False)
    doc = Document()
    doc.add_root(pn.panel(view).get_root(doc))
    events = []
    doc.on_change(events.append)
    started = time.perf_counter()
    view.prompt = prompt
    rendered = time.perf_counter() - started
    msg = Protocol().create("PATCH-DOC", [e for e in events if isinstance(e, DocumentPatchedEvent)])
    buffers = sum(memoryview(b.data).nbytes for b in msg.buffers)
    events.clear()
    t = time.perf_counter()
    view.select(17, 3)
    select_s = time.perf_counter() - t
    sel = Protocol().create("PATCH-DOC", [e for e in events if isinstance(e, DocumentPatchedEvent)])
    figures = {"tokens": n, "data_ready_s": round(view.seconds, 3),
               "prompt_to_models_s": round(rendered, 3),
               "prompt_payload_bytes": len(msg.content_json) + buffers,
               "select_s": round(select_s, 3),
               "select_payload_bytes": len(sel.content_json) + sum(
                   memoryview(b.data).nbytes for b in sel.buffers)}
    with capsys.disabled():
        print("\nattention bench:", json.dumps(figures))
    assert view.error == "" and patterns(view.result).shape == (30, 9, n, n)
    view.close()


def test_grid_has_its_real_size_before_the_trace_arrives(tiny_model):
    """The grid is a DynamicMap, which keeps the size of its first frame: without a trace it
    must already be the image it will be (it was a responsive text placeholder, so the plot
    stayed 0 px wide in the gallery)."""
    from apps.attention import AttentionView, plot_grid

    L, H = tiny_model.spec.n_layers, tiny_model.spec.n_heads
    view = AttentionView(tiny_model, background=False, prompt=PROMPT)
    empty, full = plot_grid(None, L, H), plot_grid(view.result, L, H)
    assert type(empty) is type(full)
    keys = ("frame_width", "frame_height", "xticks", "yticks", "clim")
    assert ({k: empty.opts.get().kwargs[k] for k in keys}
            == {k: full.opts.get().kwargs[k] for k in keys})
    assert empty.bounds.lbrt() == full.bounds.lbrt()
    assert (empty.dimension_values(2) == LEVELS + 1).all()   # all gaps: nothing drawn yet
    view.close()


def test_workspace_selection_is_outlined_and_labels_use_the_one_spelling(tiny_model):
    from apps.attention import head_label, highlighted_heads, plot_highlight

    L, H = tiny_model.spec.n_layers, tiny_model.spec.n_heads
    names = ["L1.H2", "L0.MLP", "a2.h3", "L9.H0", "nonsense", "L1.H2"]
    assert highlighted_heads(names, L, H) == [(1, 2), (2, 3)]
    boxes = plot_highlight(L, H, names).data
    # layer l's row of tiles is at y = L - 1 - l, head h's column at x = h
    np.testing.assert_allclose(boxes[["x0", "y0", "x1", "y1"]].values,
                               [[1.5, L - 2 - 0.5, 2.5, L - 2 + 0.5], [2.5, -0.5, 3.5, 0.5]])
    assert len(plot_highlight(L, H, []).data) == 0
    assert head_label(17, 3) == "L17.H3" and parse_head("a2.h1", L, H) == (2, 1)
    view = AttentionView(tiny_model, background=False, highlighted=["L0.H1"])
    view._grid_tapped(x=1.0, y=L - 1.0)                     # the highlighted tile
    assert view.selected == "L0.H1"
    view.close()


def test_short_prompt_key_tokens_stand_upright_and_grid_axes_say_head_and_layer(tiny_model):
    """'0 The 1 ·capital 2 ·of' side by side touched on a 5-token prompt: upright labels
    take one line-height each, so they fit where the flat ones (5 x ~9 characters) did not."""
    import holoviews as hv

    view = AttentionView(tiny_model, background=False, prompt="The capital of France is")
    fig = hv.render(plot_head(view.result, 0, 0))
    assert fig.xaxis[0].major_label_orientation == pytest.approx(np.pi / 2)
    assert len(fig.xaxis[0].major_label_overrides) == view.result.sizes["pos"]
    grid = hv.render(plot_grid(view.result))
    assert (grid.xaxis[0].axis_label, grid.yaxis[0].axis_label) == ("head", "layer")
    view.close()


def test_a_head_change_redraws_the_enlarged_head_in_its_figure(tiny_model):
    """A layer or head change replaces the enlarged plot's cells and title in the figure the
    browser has (no new figure to lay out); the cells are the new head's weights of a plain HF
    forward. A new prompt draws a new figure, sized to its tokens."""
    import panel as pn
    from bokeh.document import Document
    from bokeh.models import GlyphRenderer, Plot

    def enlarged(doc):
        (fig,) = [f for f in doc.select({"type": Plot}) if f.title and f.title.text.startswith("L")]
        (source,) = [r.data_source for r in fig.renderers if isinstance(r, GlyphRenderer)
                     and "weight" in r.data_source.data]
        return fig, source

    L, H = tiny_model.spec.n_layers, tiny_model.spec.n_heads
    view = AttentionView(tiny_model, background=False, prompt=PROMPT)
    doc = Document()
    doc.add_root(pn.panel(view).get_root(doc))
    first, _ = enlarged(doc)
    assert first.title.text == "L0.H0"
    want = hf_attentions(tiny_model, PROMPT)
    for layer, head in [(L - 1, H - 1), (1, 2), (0, 1)]:
        view.select(layer, head)
        fig, source = enlarged(doc)
        assert fig is first and fig.title.text == f"L{layer}.H{head}"
        cells = {qk: w for qk, w in zip(zip(source.data["query"], source.data["key"]),
                                        source.data["zvalues"]) if np.isfinite(w)}  # drawn
        n = want.shape[-1]
        assert len(cells) == n * (n + 1) // 2
        for (q, k), w in cells.items():
            assert w == pytest.approx(want[layer, head, int(q), int(k)], abs=1e-5)
    view.prompt = "a b c"
    fig, source = enlarged(doc)
    n = len(tiny_model.tokenize("a b c").token_ids[0])
    assert fig is not first and fig.title.text == "L0.H1"
    assert np.isfinite(np.asarray(source.data["zvalues"], float)).sum() == n * (n + 1) // 2
    # the plots of earlier prompts stop watching layer and head (they would keep their traces)
    watching = len(view.param.watchers["layer"]["value"])
    for prompt in ("a b", "a b c d", PROMPT, "a b c"):
        view.prompt = prompt
    assert len(view.param.watchers["layer"]["value"]) == watching
    view.select(1, 1)
    assert enlarged(doc)[0].title.text == "L1.H1"
    view.close()
