"""Issue 21's story, headless on tiny-llama through the gallery's own objects: a prompt typed
in the sidebar reaches every page; a head clicked on the Attention page is selected in the
workspace, highlighted in the head atlas and on the Circuits page; ablating it from the sidebar
makes the Logit lens show clean vs ablated (checked against plain torch hooks); the exported
state, imported into a fresh session, gives the same prompt, selection, edits and lens."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from explorer.interventions import Ablate

PROMPT = "When Mary and John went to the store, John gave a drink to"


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path / "cache"))


def _lens_by_hooks(model, prompt, ablate=()):
    """Top-1 ids and probabilities of a logit lens on plain torch hooks: the ablated heads'
    slices zeroed at the input of o_proj, each layer's output read, final norm, unembedding."""
    hf = model.hf
    layers = hf.model.layers
    d_head = hf.config.hidden_size // hf.config.num_attention_heads
    handles, resid = [], {}
    for layer, head in ablate:
        def zero(module, args, head=head):
            x = args[0].clone()
            x[..., head * d_head:(head + 1) * d_head] = 0
            return (x,)
        handles.append(layers[layer].self_attn.o_proj.register_forward_pre_hook(zero))
    for i, block in enumerate(layers):
        handles.append(block.register_forward_hook(
            lambda m, a, out, i=i: resid.__setitem__(i, (out[0] if isinstance(out, tuple) else out))))
    ids = model.tokenizer(prompt, return_tensors="pt").input_ids
    try:
        with torch.no_grad():
            hf(ids)
            probs = [torch.softmax(hf.lm_head(hf.model.norm(resid[i][0])).float(), -1)
                     for i in range(len(layers))]
    finally:
        for h in handles:
            h.remove()
    p = torch.stack(probs)                                   # [layer, pos, vocab]
    return p.argmax(-1).numpy(), p.max(-1).values.numpy()


def _top1(ds):
    """[layer, pos] top-1 token ids and probabilities of a lens Dataset's first prompt."""
    one = ds.isel(prompt=0, rank=0)
    return (one.top_token_id.transpose("layer", "pos").values,
            one.top_prob.transpose("layer", "pos").values)


def test_prompt_head_atlas_ablation_lens_and_state_travel_together(tiny_model):
    from apps.gallery import Gallery

    g = Gallery("tiny-llama", view="lens")
    fresh = None
    try:
        g.prompt = PROMPT                                     # typed in the sidebar
        assert g.workspace.prompt == PROMPT
        lens = g.page("lens")
        attention = g.page("attention")
        attention.wait()
        assert lens.prompt == PROMPT and attention.prompt == PROMPT

        L = tiny_model.spec.n_layers
        attention._grid_tapped(x=2.0, y=L - 1 - 1.0)        # the tile of L1.H2
        assert g.workspace.selected == ["L1.H2"]
        atlas = g.page("atlas")
        circuits = g.page("circuits")
        assert atlas.highlighted == ["L1.H2"] and circuits.selected == "L1.H2"
        table = atlas._table_frame(highlighted=atlas.highlighted)
        assert table.loc[table["selected"], "component"].tolist() == ["L1.H2"]

        g.ablate_selected()                                   # the sidebar's button
        lens.wait()
        assert g.workspace.edits == [Ablate(1, 2)] and lens.edits == [Ablate(1, 2)]
        clean_ids, clean_p = _lens_by_hooks(tiny_model, PROMPT)
        ab_ids, ab_p = _lens_by_hooks(tiny_model, PROMPT, ablate=[(1, 2)])
        got_ids, got_p = _top1(lens.result)
        np.testing.assert_allclose(got_p, clean_p, rtol=2e-3, atol=1e-6)
        e_ids, e_p = _top1(lens.edited_result)
        np.testing.assert_allclose(e_p, ab_p, rtol=2e-3, atol=1e-6)
        assert not np.allclose(clean_p, ab_p)                 # the ablation changes the lens

        state = g.export_state()
        assert json.loads(state)["selected"] == ["L1.H2"]
        fresh = Gallery("tiny-llama", view="lens")
        fresh.import_state(state)
        assert fresh.prompt == PROMPT
        assert fresh.workspace.selected == ["L1.H2"] and fresh.workspace.edits == [Ablate(1, 2)]
        lens2 = fresh.page("lens")
        lens2.wait()
        np.testing.assert_array_equal(_top1(lens2.edited_result)[0], e_ids)
        np.testing.assert_allclose(_top1(lens2.edited_result)[1], e_p, rtol=1e-6)
        np.testing.assert_allclose(_top1(lens2.result)[1], got_p, rtol=1e-6)
    finally:
        g.close()
        if fresh is not None:
            fresh.close()
