"""Saturation layers with edits: the library's ``saturation_layers(edits=...)`` and the
Saturation page's prompt token view (clean vs edited), checked against plain torch hooks
(a head's output zeroed at the input of its o_proj, the lens and the strict ranks
recomputed over the whole vocabulary), and the page's "copy as code" snippet run."""
from __future__ import annotations

import numpy as np
import panel as pn
import pytest
import xarray as xr

from explorer._checks import InputError
from explorer.analyses.saturation import saturation_layers
from explorer.interventions import Ablate, Scale
from tests._views import ablate_then_remove_l0h1
from tests.test_lens_edits import hooked_lens_logits as _hooked_logits

PROMPT = "The quick brown fox jumps over the lazy dog"
TEXTS = ["one two three one two three", "The cat sat on the mat and", "Hello world, hello"]
OPTIONS = dict(n_permutations=50, n_pairs=1, sample_positions=100, min_sat_layer=0)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def hooked_lens_logits(model, prompt, ablate=()):
    """[layer, pos, vocab] float64 logits of the plain-hook lens (`tests.test_lens_edits`)."""
    return _hooked_logits(model, prompt, ablate).double().numpy()


def hooked_saturation(logits, k):
    """Saturation layers [pos, k] from [layer, pos, vocab] logits, by the definition: the
    final rank-j token's strict rank (tokens with a larger logit) is j at every layer from
    s_j on; -1 if not even at the last layer. Also the smallest logit gap [pos, k] between
    that token and any other at any layer (near ties may order differently in float32)."""
    n_layers, n_pos, _ = logits.shape
    sat = np.full((n_pos, k), -1)
    gap = np.full((n_pos, k), np.inf)
    for p in range(n_pos):
        final = np.argsort(-logits[-1, p], kind="stable")[:k]
        for j, t in enumerate(final):
            ranks = (logits[:, p] > logits[:, p, t:t + 1]).sum(-1)          # [layer]
            for layer in range(n_layers - 1, -1, -1):
                if ranks[layer] != j:
                    break
                sat[p, j] = layer
            others = np.delete(logits[:, p], t, axis=1)
            gap[p, j] = np.abs(others - logits[:, p, t:t + 1]).min()
    return sat, gap


def assert_saturation_equal(ds, sat, gap, *, prompt=0):
    one = ds.isel(prompt=prompt)
    got = one.sat_layer.values[one.mask.values][:, :sat.shape[1]]
    clear = gap > 1e-5                      # cells with no float32 near tie
    assert clear.mean() > 0.9
    np.testing.assert_array_equal(got[clear], sat[clear])


def test_saturation_layers_with_an_ablation_is_the_hooked_one(tiny_model):
    k = 5
    clean_ref, clean_gap = hooked_saturation(hooked_lens_logits(tiny_model, PROMPT), k)
    for ablate in ([(0, 1)], [(1, 2)], [(0, 1), (2, 3)]):
        ds = saturation_layers(tiny_model, [PROMPT], k=k, sample_positions=0,
                               edits=[Ablate(l, h) for l, h in ablate])
        ref, gap = hooked_saturation(hooked_lens_logits(tiny_model, PROMPT, ablate), k)
        assert_saturation_equal(ds, ref, gap)
        assert (ref != clean_ref).any()      # the ablation moves some saturation layer
        with pytest.raises(AssertionError):  # the check tells the edited run from the clean one
            assert_saturation_equal(ds, clean_ref, np.minimum(gap, clean_gap))
        assert ds.attrs["edits"] == [Ablate(l, h).to_dict() for l, h in ablate]
    plain = saturation_layers(tiny_model, [PROMPT], k=k, sample_positions=0)
    assert_saturation_equal(plain, clean_ref, clean_gap)
    assert plain.attrs["edits"] == []


def test_edits_over_batches(tiny_model):
    """A prompt-targeted edit hits its own text in any batch; a mean ablation averages over
    every text whatever the batch size."""
    kw = dict(k=4, sample_positions=0)
    one = saturation_layers(tiny_model, TEXTS, batch_size=2, edits=[Ablate(1, 0, prompts=(2,))], **kw)
    alone = saturation_layers(tiny_model, TEXTS[2:], edits=[Ablate(1, 0)], **kw)
    clean = saturation_layers(tiny_model, TEXTS[:2], **kw)
    n = alone.sizes["pos"]
    np.testing.assert_array_equal(one.sat_layer.values[2, :n], alone.sat_layer.values[0])
    np.testing.assert_array_equal(one.sat_layer.values[:2, :clean.sizes["pos"]],
                                  clean.sat_layer.values)
    mean = [Ablate(0, 2, mode="mean")]
    split = saturation_layers(tiny_model, TEXTS, batch_size=1, edits=mean, **kw)
    whole = saturation_layers(tiny_model, TEXTS, batch_size=8, edits=mean, **kw)
    np.testing.assert_allclose(split.top_prob.values, whole.top_prob.values, rtol=1e-4, atol=1e-7)


def test_bad_edits_are_refused_by_name(tiny_model, tmp_path):
    from explorer.store import ActivationStore

    with pytest.raises(InputError, match="part_texts"):
        saturation_layers(tiny_model, TEXTS, part_texts=4, store=ActivationStore(tmp_path),
                          edits=[Ablate(0, 0)])
    with pytest.raises(InputError, match="layer"):
        saturation_layers(tiny_model, TEXTS, edits=[Ablate(9, 0)])
    with pytest.raises(InputError, match="row 5"):
        saturation_layers(tiny_model, TEXTS, edits=[Ablate(0, 0, prompts=(5,))])
    with pytest.raises(TypeError, match="edit record"):
        saturation_layers(tiny_model, TEXTS, edits=["ablate L0.H0"])


def test_edits_are_part_of_the_cache_key(tiny_model, tmp_path):
    from explorer.store import ActivationStore

    store = ActivationStore(tmp_path)
    kw = dict(k=4, sample_positions=0, store=store)
    clean = saturation_layers(tiny_model, TEXTS[:1], **kw)
    edited = saturation_layers(tiny_model, TEXTS[:1], edits=[Scale(0, 1, 0.0)], **kw)
    direct = saturation_layers(tiny_model, TEXTS[:1], k=4, sample_positions=0,
                               edits=[Scale(0, 1, 0.0)])
    xr.testing.assert_allclose(edited.top_prob, direct.top_prob)
    assert not np.allclose(clean.top_prob.values, edited.top_prob.values)
    again = saturation_layers(tiny_model, TEXTS[:1], **kw)
    xr.testing.assert_allclose(again.top_prob, clean.top_prob)


# -- the page ------------------------------------------------------------------------------------

def _view(model, **params):
    from apps.saturation import SaturationView

    return SaturationView(model, store=None, n_tokens=200, background=False,
                          analysis_options=OPTIONS, **params)


def _titles(layout):
    panes = [p for p in layout.select(pn.pane.HoloViews)
             if any(c.startswith("sat-prompt") for c in p.css_classes)]
    return [p.object.get(0).opts.get().kwargs["title"] for p in panes]


@pytest.mark.slow
def test_prompt_view_clean_vs_edited_is_the_hooked_ablation(tiny_model):
    from apps.saturation import changed_cells, prompt_caption

    view = _view(tiny_model, prompt=PROMPT)
    view.wait()
    assert view.prompt_edited is None            # no workspace edits: one heatmap
    k = view.k
    clean_ref, clean_gap = hooked_saturation(hooked_lens_logits(tiny_model, PROMPT), k)
    assert_saturation_equal(view.prompt_result, clean_ref, clean_gap)
    layout = view.__panel__()
    assert _titles(layout) == [f"Saturation layers of the prompt's tokens, top-{k}"]

    view.edits = [Ablate(0, 1)]
    view.wait()
    ref, gap = hooked_saturation(hooked_lens_logits(tiny_model, PROMPT, [(0, 1)]), k)
    assert_saturation_equal(view.prompt_edited, ref, gap)
    assert view.prompt_edited.attrs["workspace_edits"] == ["ablate L0.H1 (zero)"]
    # the outlined cells are those whose hooked saturation layer moved (near ties aside)
    clear = (gap > 1e-5) & (clean_gap > 1e-5)
    moved = set(changed_cells(view.prompt_result, view.prompt_edited, k))
    hooked = {(int(p), int(j) + 1) for p, j in zip(*np.nonzero((ref != clean_ref) & clear))}
    unclear = {(int(p), int(j) + 1) for p, j in zip(*np.nonzero(~clear))}
    assert hooked and moved - unclear == hooked
    caption = prompt_caption(view.prompt_result, view.prompt_edited, k)
    assert "ablate L0.H1 (zero)" in caption and f"in {len(moved)} of {ref.size} cells" in caption
    assert _titles(layout) == [f"clean: no workspace edits · top-{k}", "edited: ablate L0.H1 (zero)"]

    view.k = 3                                   # the slider shows fewer ranks, no new run
    assert len(changed_cells(view.prompt_result, view.prompt_edited, 3)) == len(
        [c for c in moved if c[1] <= 3])
    view.edits = []
    view.wait()
    assert view.prompt_edited is None
    assert _titles(layout) == ["Saturation layers of the prompt's tokens, top-3"]
    view.close()


def test_prompt_view_bad_prompt_keeps_the_result(tiny_model, notes):
    view = _view(tiny_model, prompt=PROMPT)
    view.wait()
    shown = view.prompt_result
    view.prompt = ""
    view.wait()
    assert view.prompt_result is shown
    assert view.error and "\n" not in view.error and "Traceback" not in view.error
    assert notes and notes[-1][0] == "error"
    view.close()


@pytest.mark.slow
def test_snippet_recomputes_what_the_page_shows(tiny_model):
    from apps.saturation import strip_tokens

    view = _view(tiny_model, prompt=PROMPT)
    view.wait()
    view.edits = [Ablate(1, 2), Scale(2, 0, 0.5)]
    view.selected = 3
    view.wait()
    code = view.code_snippet()
    ns: dict = {}
    exec(compile(code, "<snippet>", "exec"), ns)  # noqa: S102 - the page's own snippet
    assert ns["model"].spec.name == "tiny-llama"
    for name in ("sat_layer", "top_prob", "kept"):
        xr.testing.assert_allclose(ns["result"][name], view.result[name])
    titles = [t["title"] for t in strip_tokens(view.result, view.text)]
    assert [f"s_1 = {'never' if s < 0 else s}" in t for s, t in
            zip(ns["strip"].values.tolist(), titles)] == [True] * len(titles)
    assert int(ns["clicked"].pos) == 3
    k = view.k
    np.testing.assert_array_equal(ns["shown"].values, view.prompt_result.sat_layer.values[0, :, :k])
    np.testing.assert_array_equal(ns["edited_shown"].values,
                                  view.prompt_edited.sat_layer.values[0, :, :k])
    from apps.saturation import changed_cells

    assert {(int(p), int(r) + 1) for p, r in zip(*np.nonzero(ns["changed"].values))} == set(
        changed_cells(view.prompt_result, view.prompt_edited, k))
    if view.intervention is not None:
        assert ns["injection"]["s1_after"] == view.intervention["s1_after"]
        assert ns["injection"]["top1_after"] == view.intervention["top1_after"]
    view.close()


@pytest.mark.slow
def test_gallery_saturation_follows_the_prompt_and_the_edits(tiny_model):
    from apps.gallery import Gallery
    from apps.saturation import SaturationView

    views = [("Saturation events", "saturation",
              lambda m: SaturationView(m, store=None, n_tokens=200, analysis_options=OPTIONS))]
    g = Gallery("tiny-llama", views=views, view="saturation")
    try:
        page = g.page("saturation")
        g.prompt = PROMPT
        page.wait()
        assert page.prompt == PROMPT and page.param.prompt.precedence == -1
        assert not any(isinstance(w, pn.widgets.TextInput) for w in page.controls().select(
            pn.widgets.TextInput))                # the sidebar's prompt drives it

        def check():
            ref, gap = hooked_saturation(hooked_lens_logits(tiny_model, PROMPT, [(0, 1)]), page.k)
            assert_saturation_equal(page.prompt_edited, ref, gap)
        ablate_then_remove_l0h1(g, page, "prompt_edited", check)
    finally:
        g.close()


@pytest.mark.parametrize("words", [5, 60])
def test_prompt_heatmap_writes_layers_in_cells_only_where_they_fit(tiny_model, words):
    """Each cell's layer is written in it up to LABELLED_POSITIONS tokens (the hand count
    from the tokenizer decides which case a prompt is); past it, only the colour and hover."""
    import holoviews as hv

    from apps.saturation import LABELLED_POSITIONS, plot_prompt_saturation

    text = " ".join(["fox"] * words)
    n = len(tiny_model.tokenizer(text, add_special_tokens=False)["input_ids"])
    ds = saturation_layers(tiny_model, [text], k=3, sample_positions=0)
    plot = plot_prompt_saturation(ds, 3, lambda ids: {int(i): str(i) for i in np.ravel(ids)},
                                  title="t")
    labels = [el for el in (plot.values() if isinstance(plot, hv.Overlay) else [plot])
              if isinstance(el, hv.Labels)]
    if n <= LABELLED_POSITIONS:
        assert len(labels) == 1 and len(labels[0]) == n * 3
    else:
        assert labels == []
