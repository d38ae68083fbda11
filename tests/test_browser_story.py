"""One researcher's story through the gallery in a real browser, on the packaged SmolLM2: the
prompt, the head, the ablation, the lens, and the state carried to a fresh session.

The gallery (`apps.gallery.Gallery`, what `make app` serves) is served on SmolLM2-135M by the
test process's shared server. One tab: a prompt typed in the sidebar; the Attention page's
tile of a head is clicked (a real mouse click at the tile's place, read from Bokeh's frame
scales); the head is then selected in the sidebar and highlighted in the Head atlas; the
sidebar's menu ablates it; the Logit lens shows the clean and the ablated heatmap, and both
are read from the page's Bokeh data sources and checked against a lens computed here with
plain torch hooks; the state is exported, imported into a second tab (a fresh session), and
the second tab's lens shows the same two heatmaps. The story goes on to the Circuits page in
test_browser_story_circuit.py (the same head, ablated; a second test worker runs it
meanwhile); what both share is in tests/_story.py.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
from _browser import shared_page, wait_for_text
from _story import (HEAD, LAYER, NAME, PROMPT, TILE, assert_heat_is, cells, exported_state,
                    heatmaps, open_gallery, open_page, plots, shown, sidebar_prompt,
                    smollm2_gallery)

from tests.test_lens_edits import hooked_lens

pytestmark = [pytest.mark.browser, pytest.mark.integration]

gallery_url = shared_page("story", smollm2_gallery)


def test_a_prompt_a_head_an_ablation_and_the_state_travel_together(browser, gallery_url,
                                                                   smollm2, tmp_path):
    model = smollm2
    n_layers = model.spec.n_layers
    tab = open_gallery(browser, gallery_url)

    # 1. the prompt, typed in the sidebar
    box = sidebar_prompt(tab)
    box.fill(PROMPT)
    box.press("Enter")

    # 2. the Attention page: click the head's tile in the grid of every head
    open_page(tab, "Attention")
    grid = next(p for p in plots(tab) if "attention-grid" in p["classes"])
    x, y = tab.evaluate(TILE, [grid["id"], HEAD, n_layers - 1 - LAYER])
    tab.mouse.click(x, y)
    wait_for_text(tab, ".workspace-selection", re.escape(NAME), timeout=60)

    # 3. the Head atlas outlines it (its heatmap's one box is the head's cell)
    open_page(tab, "Head atlas")
    heat = next(p for p in plots(tab) if "atlas-heatmap" in p["classes"])
    np.testing.assert_allclose(heat["quads"], [[HEAD - 0.5, HEAD + 0.5, LAYER - 0.5, LAYER + 0.5]])

    # 4. the sidebar's menu ablates it; the edit stack lists it
    tab.locator(".menu-ablate button").first.click()
    shown(tab, ".edit-stack", NAME)

    # 5. the Logit lens: clean and ablated heatmaps, each equal to a hooked lens
    open_page(tab, "Logit lens")
    heats = heatmaps(tab)
    assert len(heats) == 2, [h["title"] for h in heats]
    clean, edited = heats
    assert NAME in edited["title"]
    with model.lock:  # nothing else runs the model while the hooks are on
        clean_ids, clean_p = hooked_lens(model, PROMPT)
        ab_ids, ab_p = hooked_lens(model, PROMPT, ablate=[(LAYER, HEAD)])
    assert_heat_is(clean["heat"], clean_ids, clean_p)
    assert_heat_is(edited["heat"], ab_ids, ab_p)
    assert np.abs(ab_p[..., 0] / clean_p[..., 0] - 1).max() > 1e-3  # the ablation shows

    # 6. export the state; import it in a fresh session; the same views
    path = tmp_path / "state.json"
    state = exported_state(tab, path)
    assert state["prompts"] == [PROMPT] and state["selected"] == [NAME]
    assert [e.get("head") for e in state["edits"]] == [HEAD]

    fresh = open_gallery(browser, gallery_url)
    fresh.locator(".import-state input[type=file]").set_input_files(str(path))
    wait_for_text(fresh, ".state-message", "Imported", timeout=60)
    assert sidebar_prompt(fresh).input_value() == PROMPT
    wait_for_text(fresh, ".workspace-selection", re.escape(NAME), timeout=60)
    again = heatmaps(fresh)
    assert len(again) == 2
    assert cells(again[0]["heat"]) == cells(clean["heat"])
    assert cells(again[1]["heat"]) == cells(edited["heat"])
    fresh.close()
    tab.close()
