"""Pages state their scope and carry their settings; the drawing faults a walk through the
pages found, checked on the Bokeh models the pages build (headless, tiny-llama)."""
from __future__ import annotations

import json
import re
import time

import holoviews as hv
import numpy as np
import pytest
from bokeh.models import HoverTool

from apps._view import Scope, read_export
from explorer import Ablate, components

PROMPT = "The cat sat on the mat"


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path / "cache"))


def _json_able(view) -> None:
    for name in view.link_params:
        assert name in view.param, name
        json.dumps(getattr(view, name))


def _check_scope(scope, edits_applied: bool) -> None:
    assert isinstance(scope, Scope) and scope.on
    if edits_applied:
        assert scope.edits.startswith("applied"), scope.edits
    else:
        assert re.match(r"not applicable: \w", scope.edits), scope.edits


def test_model_pages_state_scope_and_link_params(tiny_model):
    from apps.atlas import AtlasView
    from apps.attention import AttentionView
    from apps.lens import MAX_LENS_TOKENS, LensView

    for cls, limit in ((AttentionView, "at most 128 tokens"), (AtlasView, "at most 256 tokens"),
                       (LensView, f"at most {MAX_LENS_TOKENS} tokens")):
        view = cls(tiny_model, background=False, prompt=PROMPT)
        scope = view.scope()
        _check_scope(scope, True)
        assert scope.on.startswith("your prompt") and limit in scope.on
        assert view.link_params
        _json_able(view)
        view.close()


def test_conflicts_says_which_prompts_it_runs_and_outlines_the_selected_heads(tiny_model):
    from apps import conflicts as cf
    from explorer.analyses import conflicts as C

    view = cf.ConflictsView(tiny_model, background=False, facts=C.load_facts()[:2])
    fact = view._fact()
    scope = view.scope()
    _check_scope(scope, True)
    assert "not your prompt" in scope.on and fact.subject in scope.on and view.kind in scope.on
    note = cf.prompts_note(fact, view.kind)
    assert C.conflict_prompt(fact, view.kind)[:40] in note and "not your prompt" in note
    _json_able(view)
    # the workspace selection: heads outlined on the heatmap, ringed on the scatter
    view.highlighted = ["L1.H2", "L0.MLP", "L9.H0", "nonsense"]
    assert cf.selected_heads_in(view.highlighted, 3, 4) == [(1, 2)]
    boxes = cf.plot_selected_heads(view.scores, view.highlighted)
    assert boxes.data[["x0", "y0", "x1", "y1"]].values.tolist() == [[1.5, 0.5, 2.5, 1.5]]
    heat = cf.plot_head_heatmap(view.scores)
    cells = set(zip(heat.get(0).dimension_values("head"), heat.get(0).dimension_values("layer")))
    assert (2, 1) in cells                                      # the outline sits on a cell
    scatter = cf.plot_head_scatter(view.scores, [], [], view.highlighted)
    ring = scatter.get(2)
    assert ring.dimension_values("head_name").tolist() == ["L1.H2"]
    assert "L1.H2" in view._selection_note(view.highlighted, view.scores)
    view.highlighted = []
    assert cf.plot_selected_heads(view.scores, []) is None
    assert len(cf.plot_head_scatter(view.scores, [], [], []).get(2)) == 0


def test_toy_and_separate_model_pages_say_edits_do_not_apply():
    from apps.linear_icl import LinearICLView
    from apps.parity import ParityView
    from apps.shattering import ShatteringView

    for cls in (LinearICLView, ParityView, ShatteringView):
        scope = cls.scope(_Bare(cls))
        _check_scope(scope, False)
        assert "not your prompt" in scope.on


class _Bare:
    """Stands in for a page whose scope reads none of its state."""

    def __init__(self, cls):
        self.link_params = cls.link_params


def test_linear_icl_toy_heads_are_not_named_like_model_components():
    from apps.linear_icl import toy_head_name

    for h in range(8):
        name = toy_head_name(h)
        assert name == f"toy head {h}"
        with pytest.raises(components.ComponentError):
            c = components.parse(name)
            if c is None:
                raise components.ComponentError("not a component")


# -- drawing faults -------------------------------------------------------------------------

def _fields(template: str) -> list[str]:
    return re.findall(r"@\{([^}]+)\}|@(\w+)", template)


def test_attention_hover_reads_token_columns_that_exist(tiny_model):
    from apps.attention import AttentionView, plot_head, prompt_tokens

    view = AttentionView(tiny_model, background=False, prompt=PROMPT)
    fig = hv.render(plot_head(view.result, 1, 1))
    (hover,) = [t for t in fig.tools if isinstance(t, HoverTool)]
    source = next(r.data_source for r in fig.renderers if hasattr(r, "data_source"))
    for _, template in hover.tooltips:
        for braced, plain in _fields(template):
            assert (braced or plain) in source.data, template
        # no literal text glued after a field (the hover showed "8_token")
        assert not re.search(r"\}[A-Za-z_]", template), template
    tokens = prompt_tokens(view.result)
    drawn = np.isfinite(np.asarray(source.data["zvalues"], dtype=float))  # the lower triangle
    assert drawn.sum() == len(tokens) * (len(tokens) + 1) // 2
    q = np.asarray(source.data["query"])[drawn].astype(int)
    k = np.asarray(source.data["key"])[drawn].astype(int)
    assert list(np.asarray(source.data["dst_token"])[drawn]) == [tokens[i] for i in q]
    assert list(np.asarray(source.data["src_token"])[drawn]) == [tokens[i] for i in k]


def test_lens_title_is_not_under_the_toolbar(tiny_model):
    from apps.lens import LensView, plot_lens_heatmap

    view = LensView(tiny_model, background=False, prompt=PROMPT)
    fig = hv.render(plot_lens_heatmap(view.result))
    assert fig.title.text and fig.title_location == "above"
    assert fig.toolbar_location in ("right", "left", "below")


def test_atlas_titles_wrap_between_words_only(tiny_model):
    from apps import atlas

    assert "anywhere" not in atlas._WRAPPED_TITLES and "break-all" not in atlas._WRAPPED_TITLES
    assert "word-break: normal" in atlas._WRAPPED_TITLES
    view = atlas.AtlasView(tiny_model, background=False, prompt=PROMPT)
    titles = atlas.column_titles(view.atlas)
    longest = max(len(w) for t in titles.values() for w in t.split())
    # a column fits its longest word: ~8 px a character at the table's font, plus padding
    assert atlas._MIN_COLUMN_PX >= 8 * longest + 16


def test_lens_page_export_holds_the_lens_grid(tiny_model):
    from apps.lens import LensView

    view = LensView(tiny_model, background=False, prompt=PROMPT, k=3)
    view.edits = [Ablate(layer=0, head=1)]
    data = read_export(view.export_bytes())
    ds = view.result.isel(prompt=0)
    n = int(ds.mask.sum())
    for name, result in (("lens", view.result), ("lens_edited", view.edited_result)):
        table = data["tables"][name]
        one = result.isel(prompt=0)
        assert list(table.columns) == ["pos", "input_token", "layer", "rank", "token", "token_id",
                                       "probability"]
        assert len(table) == n * one.sizes["layer"] * 3
        real = one.pos.values[one.mask.values]
        for _, row in table.sample(20, random_state=0).iterrows():
            cell = one.sel(pos=row["pos"], layer=row["layer"]).isel(rank=row["rank"] - 1)
            assert row["token_id"] == int(cell.top_token_id)
            assert row["probability"] == pytest.approx(float(cell.top_prob), rel=1e-6)
            assert row["pos"] in real
    # the edited table is the edited lens, not a copy of the clean one
    assert not np.array_equal(data["tables"]["lens"]["probability"].to_numpy(),
                              data["tables"]["lens_edited"]["probability"].to_numpy())


# -- long prompts ---------------------------------------------------------------------------

def test_lens_refuses_a_3000_word_prompt_at_once_naming_its_limit(tiny_model):
    from apps.lens import MAX_LENS_TOKENS, LensView, check_lens_prompt
    from explorer._checks import InputError

    words = ("the model reads a long text about rivers and cities and the people who live "
             "there").split()
    prompt = " ".join(words[i % len(words)] for i in range(3000))
    n = len(tiny_model.tokenizer(prompt, add_special_tokens=False)["input_ids"])
    with pytest.raises(InputError, match=rf"The prompt is {n} tokens; the logit lens draws at "
                                         rf"most {MAX_LENS_TOKENS} \(one column per token\)"):
        check_lens_prompt(tiny_model, prompt)
    view = LensView(tiny_model, background=False, prompt=PROMPT)
    shown = view.result
    started = time.perf_counter()
    view.prompt = prompt
    seconds = time.perf_counter() - started
    assert f"at most {MAX_LENS_TOKENS}" in view.error and view.result is shown
    assert seconds < 5.0, seconds      # the tokenizer alone runs; no forward, no figure


def test_lens_draws_a_prompt_at_its_limit_in_a_scrolling_box(tiny_model):
    from apps.lens import MAX_LENS_TOKENS, LensView, plot_lens_heatmap

    words = ["the"]
    def count(ws):
        return len(tiny_model.tokenizer(" ".join(ws), add_special_tokens=False)["input_ids"])
    while count(words + ["the"]) <= min(MAX_LENS_TOKENS, tiny_model.spec.context_length):
        words.append("the")
    view = LensView(tiny_model, background=False, prompt=" ".join(words))
    assert view.error == "" and int(view.result.mask.sum()) <= MAX_LENS_TOKENS
    fig = hv.render(plot_lens_heatmap(view.result))
    assert fig.min_width == 56 * int(view.result.mask.sum())
    layout = view.__panel__()
    boxes = [o for o in layout.select(lambda o: "lens-scroll" in getattr(o, "css_classes", []))]
    assert len(boxes) == 1 and boxes[0].scroll == "x-auto"
