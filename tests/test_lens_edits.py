"""The Logit lens page with the workspace's edits: clean vs edited, checked against plain torch
hooks (a head's output zeroed before o_proj) and the library's unedited lens."""
from __future__ import annotations

import numpy as np
import panel as pn
import pytest
import torch

from apps.lens import LensView, edited_caption, moved_cells
from explorer.interventions import Ablate
from explorer.lens import logit_lens
from tests._views import ablate_then_remove_l0h1

PROMPT = "The quick brown fox jumps over"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def zero_heads(model, ablate):
    """Torch pre-hooks zeroing each (layer, head) of ``ablate`` at the input of its layer's
    o_proj; returns their handles (remove them when done)."""
    d_head = model.spec.d_head
    handles = []
    for layer, head in ablate:
        def zero(mod, args, _h=head):
            z = args[0].clone()
            z[..., _h * d_head:(_h + 1) * d_head] = 0
            return (z, *args[1:])
        handles.append(model.o_proj(layer).register_forward_pre_hook(zero))
    return handles


def hooked_lens_logits(model, prompt, ablate=()):
    """[layer, pos, vocab] float32 logits of unembed(final_norm(resid_post)) at every layer,
    the heads of ``ablate`` zeroed by `zero_heads` (torch hooks, no library code)."""
    ids = torch.tensor([model.tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    resid, handles = {}, zero_heads(model, ablate)
    for layer in range(model.spec.n_layers):
        def keep(mod, args, out, _l=layer):
            resid[_l] = (out[0] if isinstance(out, tuple) else out)[0]
        handles.append(model.hf_layer(layer).register_forward_hook(keep))
    try:
        with torch.no_grad():
            model.hf(input_ids=ids)
            stack = torch.stack([resid[l] for l in range(model.spec.n_layers)], 0)
            return model.unembed_module(model.final_norm_module(stack.float()))
    finally:
        for h in handles:
            h.remove()


def hooked_lens(model, prompt, ablate=(), k=5):
    """Top-k (ids, probs) [pos, layer, k] of `hooked_lens_logits`."""
    logits = hooked_lens_logits(model, prompt, ablate).transpose(0, 1)
    top = torch.softmax(logits.float(), -1).topk(k, -1)
    return top.indices.numpy(), top.values.numpy()


def assert_lens_equal(ds, ids, probs):
    one = ds.isel(prompt=0)
    real = one.mask.values
    # tiny-llama is random-init: its probabilities are near uniform (~3e-3), hence rtol
    np.testing.assert_allclose(one.top_prob.values[real], probs, rtol=2e-3, atol=1e-7)
    # top-1 ids agree wherever the top two probabilities are not (near) tied
    agree = one.top_token_id.values[real][..., 0] == ids[..., 0]
    gap = (probs[..., 0] - probs[..., 1]) / probs[..., 0]
    assert np.all(agree | (gap < 1e-3))
    assert agree.mean() > 0.9


def test_edited_heatmap_is_the_hooked_ablation(tiny_model):
    model = tiny_model
    view = LensView(model, prompt=PROMPT, alpha=0.0, background=False)
    view.wait()
    assert view.edited_result is None  # no workspace edits: one heatmap, as before
    clean_ids, clean_p = hooked_lens(model, PROMPT)
    assert_lens_equal(view.result, clean_ids, clean_p)

    layer, head = 0, 1
    view.edits = [Ablate(layer, head)]
    view.wait()
    ab_ids, ab_p = hooked_lens(model, PROMPT, ablate=[(layer, head)])
    assert view.edited_result is not None
    assert_lens_equal(view.edited_result, ab_ids, ab_p)
    # the clean one is the library's unedited lens, and the ablation changed something
    ref = logit_lens(model, PROMPT, k=view.k)
    np.testing.assert_allclose(view.result.top_prob.values, ref.top_prob.values, atol=1e-5)
    assert np.abs(ab_p / clean_p - 1).max() > 0.02  # the ablation moves the lens
    assert (ab_ids[..., 0] != clean_ids[..., 0]).any()
    with pytest.raises(AssertionError):  # the comparison tells the clean lens from the edited
        assert_lens_equal(view.result, ab_ids, ab_p)
    assert "ablate L0.H1" in edited_caption(view.result, view.edited_result)
    # the outlined cells are those whose hooked top-1 token moved (up to near ties)
    moved = set(moved_cells(view.result, view.edited_result))
    hooked = {(p, l) for p, l in zip(*np.nonzero(ab_ids[..., 0] != clean_ids[..., 0]))}
    tied = {(p, l) for p, l in zip(*np.nonzero(
        np.minimum((clean_p[..., 0] - clean_p[..., 1]) / clean_p[..., 0],
                   (ab_p[..., 0] - ab_p[..., 1]) / ab_p[..., 0]) < 1e-3))}
    assert moved and moved - tied == hooked - tied
    assert f"in {len(moved)} of " in edited_caption(view.result, view.edited_result)
    assert view.edited_result.attrs["workspace_edits"] == ["ablate L0.H1 (zero)"]
    layout = view.__panel__()
    plots = layout.select(pn.pane.HoloViews)
    assert len(plots) == 2
    titles = [p.object.get(0).opts.get().kwargs["title"] for p in plots]
    assert titles[0].startswith("clean") and titles[1] == "edited: ablate L0.H1 (zero)"

    view.edits = []
    view.wait()
    assert view.edited_result is None
    assert edited_caption(view.result, view.edited_result) == ""
    assert len(layout.select(pn.pane.HoloViews)) == 1  # back to one heatmap
    assert view.__panel__().select(pn.pane.HoloViews)[0].object.get(0).opts.get().kwargs[
        "title"].startswith("Logit lens")
    view.close()


def test_edits_stack_with_the_steering(tiny_model):
    model = tiny_model
    view = LensView(model, prompt=PROMPT, steer_layer=1, alpha=3.0, background=False)
    view.wait()
    view.edits = [Ablate(1, 0)]
    view.wait()
    steer = view.edits_for()
    both = logit_lens(model, PROMPT, k=view.k, edits=[*steer, Ablate(1, 0)])
    only_steer = logit_lens(model, PROMPT, k=view.k, edits=steer)
    np.testing.assert_allclose(view.edited_result.top_prob.values, both.top_prob.values, atol=1e-5)
    np.testing.assert_allclose(view.result.top_prob.values, only_steer.top_prob.values, atol=1e-5)
    assert not np.allclose(both.top_prob.values, only_steer.top_prob.values, atol=1e-4)
    view.close()


def test_gallery_lens_follows_the_workspace_edits(tiny_model):
    from apps.gallery import Gallery

    g = Gallery("tiny-llama", view="lens")
    try:
        lens = g.page("lens")
        lens.wait()
        assert lens.edited_result is None

        def check():
            ab_ids, ab_p = hooked_lens(tiny_model, g.prompt, ablate=[(0, 1)])
            assert_lens_equal(lens.edited_result, ab_ids, ab_p)
            clean_ids, clean_p = hooked_lens(tiny_model, g.prompt)
            assert_lens_equal(lens.result, clean_ids, clean_p)
        ablate_then_remove_l0h1(g, lens, "edited_result", check)
    finally:
        g.close()


def test_a_mean_ablation_over_batches_averages_over_every_prompt(tiny_model):
    """Split into batches of one, a value-less mean ablation uses the mean over every
    prompt's real tokens: the lens equals the one-batch lens, and the lens with that mean
    given explicitly."""
    from explorer.trace import trace

    prompts = [PROMPT, "One two", "Water boils at one hundred"]
    edit = Ablate(layer=1, head=0, mode="mean")
    one = logit_lens(tiny_model, prompts, k=3, edits=[edit], batch_size=8)
    split = logit_lens(tiny_model, prompts, k=3, edits=[edit], batch_size=1)
    z = trace(tiny_model, prompts, sites="attn_z", layers=1)
    mean = z.attn_z.sel(layer=1, head=0).values[z.mask.values].mean(0)   # [d_head]
    given = logit_lens(tiny_model, prompts, k=3, batch_size=1,
                       edits=[Ablate(layer=1, head=0, mode="mean", value=mean)])
    for other in (split, given):
        assert np.array_equal(other.top_token_id.values, one.top_token_id.values)
        np.testing.assert_allclose(other.top_prob.values, one.top_prob.values, atol=1e-5)
