"""Head atlas page and the gallery's workspace, headless on tiny-llama: the selection shared
between the Attention and Head atlas pages, the sidebar's selection and edit stack, state
export / import, and the atlas against independent computations."""
from __future__ import annotations

import io

import numpy as np
import pandas as pd
import panel as pn
import pytest
import torch
import xarray as xr

import explorer
from apps.atlas import AtlasView, collect_results, plot_score, provenance_markdown
from apps.attention import AttentionView
from apps.gallery import VIEWS, Gallery
from explorer import Ablate, Scale
from explorer.analyses import icl_heads as ih

PROMPT = "The cat sat on the mat because the cat was tired"



@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def gallery(tiny_model):
    views = [(t, s, f) for t, s, f in VIEWS if s in ("attention", "atlas")]
    g = Gallery("tiny-llama", views=views, view="attention")
    g.prompt = PROMPT
    yield g
    g.close()


def _hf_first_and_previous(model, prompt):
    """[layer, head] mean weight on token 0 and on the previous token (queries 1..n-1), from
    Hugging Face's own eager forward."""
    ids = torch.tensor([model.tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    hf = model.hf
    current = hf.config._attn_implementation
    hf.set_attn_implementation("eager")
    try:
        a = torch.stack([x[0] for x in hf(input_ids=ids, output_attentions=True).attentions])
    finally:
        hf.set_attn_implementation(current)
    a = a.double().numpy()                                  # [layer, head, q, k]
    n = a.shape[-1]
    first = np.mean([a[:, :, q, 0] for q in range(1, n)], axis=0)
    prev = np.mean([a[:, :, q, q - 1] for q in range(1, n)], axis=0)
    return first, prev


def test_atlas_page_scores_the_prompt_like_hugging_face(tiny_model):
    view = AtlasView(tiny_model, background=False, prompt=PROMPT)
    first, prev = _hf_first_and_previous(tiny_model, PROMPT)
    np.testing.assert_allclose(view.atlas["first_token_attention"].values, first, atol=1e-5)
    np.testing.assert_allclose(view.atlas["previous_token_attention"].values, prev, atol=1e-5)
    assert view.score == "first_token_attention"
    shown = plot_score(view.atlas, "previous_token_attention").dimension_values(2, flat=False)
    np.testing.assert_allclose(shown, prev, atol=1e-5)        # what the heatmap draws
    csv = pd.read_csv(io.StringIO(view._csv().getvalue()))
    row = csv.set_index("component").loc["L2.H1"]
    assert row["previous_token_attention"] == pytest.approx(prev[2, 1], rel=1e-5)
    assert "attention_pattern" in provenance_markdown(view.atlas)
    view.prompt = "   "
    assert "empty" in view.error and "first_token_attention" in view.atlas  # last good kept
    view.close()


def test_atlas_click_selects_and_bad_names_are_refused(tiny_model, notes):
    view = AtlasView(tiny_model, background=False)
    view._heat_tapped(x=3.2, y=1.9)                           # head 3, layer 2
    assert view.selected == "L2.H3"
    view._heat_tapped(x=9, y=0)                               # off the grid: unchanged
    assert view.selected == "L2.H3"
    view.selected = "a1.h0"                                   # an older spelling is rewritten
    assert view.selected == "L1.H0"
    view.selected = "L7.H0"
    assert view.selected == "L1.H0" and "out of range" in notes[-1][1]
    view._row_clicked(type("Click", (), {"row": 5})())        # table rows: L0.H0, L0.H1, ...
    assert view.selected == "L1.H1"
    view.close()


def test_collect_results_keeps_per_head_results_once(tiny_model):
    ind = ih.induction_scores(tiny_model, n_sequences=2, half_len=4)
    trace = explorer.trace(tiny_model, [PROMPT], sites=("attn_pattern",))
    other = xr.Dataset({"x": ("prompt", [1.0])})
    assert collect_results([ind, ind, trace, other, None, 3]) == [ind]


def test_gallery_shares_the_selection_between_attention_and_atlas(gallery, tiny_model):
    ws = gallery.workspace
    attention = gallery.page("attention")
    assert isinstance(attention, AttentionView) and ws.selected == []
    L = tiny_model.spec.n_layers
    attention._grid_tapped(x=2.0, y=L - 1 - 1.0)            # the tile of L1.H2
    assert ws.selected == ["L1.H2"] and attention.highlighted == ["L1.H2"]
    gallery.view = "atlas"
    atlas = gallery.page("atlas")
    assert atlas.highlighted == ["L1.H2"] and atlas.selected == "L1.H2"
    table = atlas._table_frame(highlighted=atlas.highlighted)
    assert table.loc[table["selected"], "component"].tolist() == ["L1.H2"]
    atlas._heat_tapped(x=0.0, y=2.0)                         # L2.H0 on the atlas
    assert ws.selected == ["L1.H2", "L2.H0"]
    gallery.view = "attention"                              # it follows when opened
    assert attention.highlighted == ["L1.H2", "L2.H0"] and attention.selected == "L2.H0"
    assert (attention.layer, attention.head) == (2, 0)     # the enlarged head follows
    outlined = attention._grid().object  # image * highlight * marker
    assert outlined is not None
    ws.deselect("L2.H0")
    assert attention.highlighted == ["L1.H2"]
    gallery.view = "atlas"
    assert atlas.highlighted == ["L1.H2"]
    # the atlas reads what the other pages hold, in the one spelling
    assert gallery.page_results() == [v for v in attention.param.values().values()
                                      if isinstance(v, xr.Dataset)]


def test_gallery_prompt_is_the_workspace_prompt(gallery):
    ws = gallery.workspace
    assert ws.prompt == PROMPT
    ws.prompt = "Water boils at"                             # a loaded state sets it
    assert gallery.prompt == "Water boils at" and gallery.page("attention").prompt == "Water boils at"
    gallery.prompt = "Ice melts at"
    assert ws.prompts == ["Ice melts at"]


def _sidebar_widget(gallery, cls, css=None):
    found = [o for part in gallery.sidebar() for o in
             (part.select(cls) if hasattr(part, "select") else [])
             if css is None or css in getattr(o, "css_classes", [])]
    assert found, (cls, css)
    return found[0]


def test_sidebar_selection_and_edit_stack(gallery):
    ws = gallery.workspace
    choice = _sidebar_widget(gallery, pn.widgets.MultiChoice)
    assert "L2.H3" in choice.options and "L0.MLP" in choice.options and "L3.H0" not in choice.options
    choice.value = ["L0.H1", "L1.MLP"]
    assert ws.selected == ["L0.H1", "L1.MLP"]
    assert gallery.page("attention").highlighted == ["L0.H1", "L1.MLP"]
    ws.select("L2.H2")
    assert choice.value == ["L0.H1", "L1.MLP", "L2.H2"]
    gallery.ablate_selected()
    gallery.ablate_selected()                                # already ablated: not twice
    assert ws.edits == [Ablate(0, 1), Ablate(2, 2)]
    ws.push_edit(Scale(1, 0, 0.5))
    rows = gallery._edit_rows(ws.edits)
    labels = [r[0].object for r in rows]
    assert labels == ["ablate L0.H1 (zero)", "ablate L2.H2 (zero)", "scale L1.H0 × 0.5"]
    rows[1][1].clicks += 1                                   # its ✕ button
    assert ws.edits == [Ablate(0, 1), Scale(1, 0, 0.5)]


def test_state_export_import_round_trip_and_bad_files(gallery, tiny_model, notes):
    ws = gallery.workspace
    ws.select("L1.H2", "logits")
    ws.push_edit(Ablate(1, 2))
    download = _sidebar_widget(gallery, pn.widgets.FileDownload)
    text = download.callback().getvalue()
    assert text == gallery.export_state()
    fresh = Gallery("tiny-llama", views=[v for v in VIEWS if v[1] == "attention"])
    try:
        upload = _sidebar_widget(fresh, pn.widgets.FileInput)
        upload.value = text.encode()
        assert fresh.workspace.selected == ["L1.H2", "logits"]
        assert fresh.workspace.edits == [Ablate(1, 2)] and fresh.prompt == PROMPT
        assert fresh.page("attention").prompt == PROMPT
        assert fresh.page("attention").highlighted == ["L1.H2", "logits"]
        assert fresh.state_message.startswith("Imported")
        before = fresh.workspace.state()
        for bad, match in [(b"not json", "not valid JSON"),
                           (text.replace('"L1.H2"', '"L1.H9"').encode(), "out of range"),
                           (text.replace('"tiny-llama"', '"no-such-model"').encode(),
                            "does not offer")]:
            upload.value = bad
            assert match in fresh.state_message and match in notes[-1][1]
            assert fresh.workspace.state() == before             # nothing changed
    finally:
        fresh.close()


def test_atlas_in_the_gallery_reads_what_other_pages_hold(tiny_model):
    """A page holding per-head results in its parameters (as ICL heads holds its scores):
    the atlas shows them, values unchanged, when it is opened or refreshed."""
    from apps._view import View
    import param as _param

    ind = ih.induction_scores(tiny_model, n_sequences=2, half_len=4)

    class Holder(View):
        scores = _param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True,
                                      precedence=-1)

        def __panel__(self):
            return pn.pane.Markdown("a page")

    holder = Holder(background=False)
    views = [("Holder", "holder", lambda m: holder),
             *[(t, s, f) for t, s, f in VIEWS if s == "atlas"]]
    g = Gallery("tiny-llama", views=views)
    try:
        g.view = "atlas"
        atlas = g.page("atlas")
        assert "induction_score" not in atlas.atlas
        holder.scores = ind
        g.view = "holder"
        g.view = "atlas"                                      # shown again: rebuilt
        np.testing.assert_array_equal(atlas.atlas["induction_score"].values,
                                      ind["induction_score"].values)
        assert "induction_score" in atlas.param.score.objects
    finally:
        g.close()


def test_a_state_of_another_model_switches_the_model_first(gallery, tiny_gpt2, notes):
    state = explorer.Workspace.from_model(tiny_gpt2, prompts=["Hello there"],
                                          selected=["L1.H1"], edits=[Ablate(0, 1)])
    choice = _sidebar_widget(gallery, pn.widgets.MultiChoice)
    gallery.import_state(state.to_json())
    assert gallery.model.spec.name == "tiny-gpt2" and gallery.workspace.model_name == "tiny-gpt2"
    assert gallery.workspace.selected == ["L1.H1"] and gallery.workspace.edits == [Ablate(0, 1)]
    assert gallery.prompt == "Hello there" and gallery.state_message.startswith("Imported")
    spec = tiny_gpt2.spec
    assert len(choice.options) == spec.n_layers * (spec.n_heads + 2) + 2


def test_own_induction_scores_are_named_by_their_provenance_and_the_table_fits(tiny_model):
    """Another page's induction scores keep 'induction_score'; the page's own (pressed twice:
    replaced, not added again) is 'induction_score_random_8x20' (its repeated random
    sequences), not 'induction_score_3'. The table's columns fit the width (wrapped titles)."""
    page = ih.induction_scores(tiny_model, n_sequences=2, half_len=4)
    view = AtlasView(tiny_model, background=False)
    view.set_sources(lambda: [page])
    view.add_induction()
    view.add_induction()
    names = [n for n in view.atlas.data_vars if n.startswith("induction_score")]
    assert names == ["induction_score", "induction_score_random_8x20"]
    own = ih.induction_scores(tiny_model, n_sequences=8, half_len=20)
    np.testing.assert_allclose(view.atlas["induction_score_random_8x20"].values,
                               own["induction_score"].values)
    np.testing.assert_allclose(view.atlas["induction_score"].values, page["induction_score"].values)
    assert "induction_score_random_8x20: this page's" in view.status
    table = [t for t in view.__panel__().select(pn.widgets.Tabulator)][0]
    assert table.layout == "fit_columns"
    assert table.titles["induction_score_random_8x20"] == "induction score random 8x20"
    view.close()


def test_own_induction_off_removes_the_column_and_on_brings_it_back(tiny_model, monkeypatch):
    """Turning `own_induction` off takes the page's induction column out of the atlas, the
    table and the record; on again it comes back (rescored only when the edits moved on)."""
    import apps.atlas as atlas_page

    scored = []
    real = atlas_page.edited_induction_scores

    def counted(model, edits, **kw):
        scored.append(list(edits))
        return real(model, edits, **kw)

    monkeypatch.setattr(atlas_page, "edited_induction_scores", counted)
    view = AtlasView(tiny_model, background=False, prompt=PROMPT)
    try:
        before = set(view.atlas.data_vars)
        view.add_induction()
        assert "induction_score" in view.atlas and "induction_score" not in before
        assert dict(view.shown_record.request)["induction"] == (8, 20, ())
        want = ih.induction_scores(tiny_model, n_sequences=8, half_len=20)["induction_score"]
        view.score = "induction_score"

        view.own_induction = False
        assert set(view.atlas.data_vars) == before and view.score != "induction_score"
        assert "induction_score" not in view._table_frame().columns
        assert "induction" not in dict(view.shown_record.request)
        assert view.stale_note() == ""
        assert "edited_induction_scores" not in view.code_snippet()

        view.own_induction = True                      # the same edits: no new scoring
        assert len(scored) == 1
        np.testing.assert_allclose(view.atlas["induction_score"].values, want.values)
        assert "induction_score" in view._table_frame().columns

        view.own_induction = False
        view.edits = [Ablate(0, 1)]                    # off: the column does not follow
        assert len(scored) == 1 and "induction_score" not in view.atlas
        view.own_induction = True                      # scored under the new edits
        assert scored[-1] == [Ablate(0, 1)] and len(scored) == 2
        assert dict(view.shown_record.request)["induction"] == (8, 20, ("ablate L0.H1 (zero)",))
        assert view.stale_note() == ""
    finally:
        view.close()
