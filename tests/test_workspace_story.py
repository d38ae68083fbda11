"""The workspace story, headless on tiny-llama through the gallery's own objects: a prompt typed
in the sidebar reaches every page; a head clicked on the Attention page is selected in the
workspace, highlighted in the head atlas and on the Circuits page; ablating it from the sidebar
makes the Logit lens show clean vs ablated (checked against plain torch hooks); the exported
state, imported into a fresh session, gives the same prompt, selection, edits and lens."""
from __future__ import annotations

import json

import numpy as np
import pytest

from explorer.interventions import Ablate
from tests.test_lens_edits import assert_lens_equal, hooked_lens

PROMPT = "When Mary and John went to the store, John gave a drink to"


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path / "cache"))


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
        clean_ids, clean_p = hooked_lens(tiny_model, PROMPT)
        ab_ids, ab_p = hooked_lens(tiny_model, PROMPT, ablate=[(1, 2)])
        assert_lens_equal(lens.result, clean_ids, clean_p)
        assert_lens_equal(lens.edited_result, ab_ids, ab_p)
        assert not np.allclose(clean_p, ab_p)                 # the ablation changes the lens
        got_p = _top1(lens.result)[1]
        e_ids, e_p = _top1(lens.edited_result)

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
