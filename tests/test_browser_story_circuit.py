"""The researcher's story in the browser, on the packaged SmolLM2, at the Circuits page: the
sidebar's menu opens it on the selected, ablated head; a circuit computed on two prompt pairs
typed into the page draws the head's edges; the exported state keeps the pairs.

The gallery is served on SmolLM2-135M by the test process's shared server. One tab: the
prompt typed in the sidebar, the head typed into *Add to selection* (test_browser_story.py
clicks it on the Attention page), the sidebar's menu ablates it and its "Show circuit edges"
opens the Circuits page, which computes a circuit on the two prompt pairs typed into it and
draws the head's edges (in the circuit, or its strongest edges outside it, as its caption
then says); the exported state holds the prompt, the head, the ablation and the pairs.
"""
from __future__ import annotations

import re

import pytest
from _browser import gallery_page_state, settle_gallery_page, shared_page, wait_for_text
from _story import (EDGES, HEAD, NAME, PAIRS, PROMPT, exported_state, open_gallery, shown,
                    sidebar_prompt, smollm2_gallery)

pytestmark = [pytest.mark.browser, pytest.mark.integration]

gallery_url = shared_page("story-circuit", smollm2_gallery)


def test_the_menu_opens_the_circuit_of_typed_pairs_on_the_ablated_head(browser, gallery_url,
                                                                        tmp_path):
    tab = open_gallery(browser, gallery_url)

    # the prompt, typed in the sidebar; the head, typed into the selection; the menu ablates it
    box = sidebar_prompt(tab)
    box.fill(PROMPT)
    box.press("Enter")
    add = tab.locator(".workspace-add input").first
    add.fill(NAME)
    add.press("Enter")
    wait_for_text(tab, ".workspace-selection", re.escape(NAME), timeout=60)
    tab.locator(".menu-ablate button").first.click()
    shown(tab, ".edit-stack", NAME)

    # the Circuits page: a circuit on two prompt pairs typed into it, with the head shown
    tab.locator(".menu-circuit button").first.click()     # the menu opens the page on it
    settle_gallery_page(tab, timeout=240)
    tab.locator(".own-items textarea").first.fill(PAIRS)
    tab.locator(".own-items button").first.click()
    tab.wait_for_selector(".circuit-state[data-circuit-scores='ready']", state="attached",
                          timeout=600_000)
    state_el = tab.locator(".circuit-state").first
    assert state_el.get_attribute("data-circuit-selected") == NAME
    task = [sel for sel in gallery_page_state(tab)["selects"] if sel["label"].startswith("Task")]
    assert [sel["shown"] for sel in task] == ["your pairs"]  # the circuit of the typed pairs
    settle_gallery_page(tab, timeout=300)
    edges = tab.evaluate(EDGES)
    assert edges and any(NAME in pair for pair in edges), "the head has no edge drawn"
    in_circuit = int(state_el.get_attribute("data-circuit-outside")) == 0
    if not in_circuit:  # drawn as its strongest edges outside the circuit, and said so
        shown(tab, ".circuit-caption", f"{NAME} has no edge in this circuit")

    # the exported state carries the pairs with the prompt, the head and the ablation
    state = exported_state(tab, tmp_path / "state.json")
    assert state["prompts"] == [PROMPT] and state["selected"] == [NAME]
    assert [e.get("head") for e in state["edits"]] == [HEAD]
    assert state["items"]["circuits"] == PAIRS
    tab.close()
