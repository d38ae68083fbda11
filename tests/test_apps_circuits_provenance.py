"""The Circuits page writes its words from the shown result's provenance (headless, tiny-llama):
the second John clicked and replaced, EAP then EAP-IG; the title and the caption name the
same method and edge count (counted here with `select_circuit`), the scope line says the
replaced position, and a prompt changed without a compute leaves the old result labelled with
its own inputs and marked outdated, its code recomputing it."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from apps.circuits import PROMPT_TASK, CircuitsView
from explorer.analyses import circuits as ca
from explorer.analyses.circuit_tasks import CircuitTask

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "When Mary and John went to the store, John gave a drink to"
# tiny-llama spells names letter by letter: the second John's J is token 24 (character 38)
SECOND_J = 24
CORRUPT = "When Mary and John went to the store, Mohn gave a drink to"


def title_and_caption(view):
    return view.redraw()["title"], view._caption()


@pytest.fixture(scope="module")
def walked(tiny_model):
    """The page after: second J clicked, 'M' typed, EAP computed, then EAP-IG."""
    view = CircuitsView(tiny_model, background=False, autostart=False, task=PROMPT_TASK,
                        prompt=PROMPT)
    view.__panel__()
    view._strip.selected = [SECOND_J]
    view.replacement = "M"
    with torch.enable_grad():
        view._request_scores()
        eap = title_and_caption(view)
        view.method = "eap-ig"
    return view, eap


def test_the_clicked_position_is_the_one_replaced(walked, tiny_model):
    view, _ = walked
    ids = tiny_model.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    assert tiny_model.tokenizer.decode([ids[SECOND_J]]) == "J" and PROMPT[38] == "J"
    assert view.counterfactual == f"J@{SECOND_J}=M"
    assert view._task.corrupt == [CORRUPT]
    assert view.shown.counterfactual.position == SECOND_J
    assert f"(position {SECOND_J}: 'J' -> 'M')" in view.scope().on
    assert CORRUPT in view.scope().on


def test_title_and_caption_agree_after_eap_then_eap_ig(walked, tiny_model):
    view, (eap_title, eap_caption) = walked
    for title, caption, method in ((eap_title, eap_caption, "EAP"),
                                   (*title_and_caption(view), "EAP-IG")):
        assert title.startswith("Circuit: ") and title.endswith(f", {method}, base model")
        assert caption.startswith(f"{method} scores of 1 pair.")
        # the circuit's own sentences name no other method (the layout sentence names the
        # scores the node order comes from)
        own = caption.split("Layout:")[0]
        other = "EAP-IG" if method == "EAP" else "EAP scores"
        assert other not in own
    # the shown count: the pruned top-n of the EAP-IG scores, recomputed here
    task = CircuitTask(clean=[PROMPT], corrupt=[CORRUPT], answer=view._task.answer,
                       wrong=view._task.wrong, name=PROMPT_TASK)
    with torch.enable_grad():
        ig = ca.edge_scores(tiny_model, task, method="eap-ig", batch_size=1)
    np.testing.assert_allclose(view.scores["score"].values, ig["score"].values, atol=1e-6)
    n = int(ca.select_circuit(ig, top_n=view.n_edges).sum())
    title, caption = title_and_caption(view)
    assert re.match(rf"Circuit: {n:,} edges", title)
    assert f"Shown: {n:,} edges" in caption or f": {n:,} edges (top {view.n_edges:,}" in caption
    assert "One pair: the recovery has no interval" in caption
    gap = ig.attrs["clean_metric"] - ig.attrs["corrupt_metric"]
    assert f"gap {gap:.2f} logits" in caption
    assert "method='eap-ig'" in view.code_snippet() and "position=24" in view.code_snippet()


def test_a_new_prompt_marks_the_old_result_outdated_and_never_relabels_it(tiny_model):
    view = CircuitsView(tiny_model, background=False, autostart=False, task=PROMPT_TASK,
                        prompt=PROMPT, counterfactual=f"J@{SECOND_J}=M")
    view.__panel__()
    with torch.enable_grad():
        view._request_scores()
    assert view.redraw()["title"].endswith("base model") and "Outdated" not in view._caption()
    long = "A long prompt that fills the screen. " * 160     # about 6,000 characters
    view.prompt = long
    title, caption = title_and_caption(view)
    assert title.endswith("(outdated)")
    assert caption.startswith("**Outdated.** Shown: computed on 'When Mary and John went to "
                              "the store, John gave a drink to' vs position 24: 'J' -> 'M', "
                              "EAP at ")
    assert "the prompt changed since: press Compute circuit to update." in caption
    scope = view.scope().on
    assert PROMPT in scope and long[:200] not in scope and len(scope) < 600
    assert "Outdated: the prompt changed since" in scope
    assert repr(PROMPT) in view.code_snippet() and long[:50] not in view.code_snippet()
    view.prompt = PROMPT     # back to the computed inputs: not outdated
    assert "Outdated" not in view._caption() and not view.redraw()["title"].endswith("(outdated)")


def test_the_rendered_caption_is_the_shown_results_after_a_method_switch(walked):
    """The caption pane (what a browser shows, re-rendered when the scores change) says what
    `_caption` says now: the EAP-IG default, not the EAP one it had before the switch."""
    import panel as pn

    view, _ = walked
    root = view.__panel__()
    pane = next(p for p in root.select(pn.pane.Markdown) if "circuit-caption" in p.css_classes)
    with torch.enable_grad():
        view.method = "eap"
        view.method = "eap-ig"    # shown at once from the results kept
    rendered = pane.object() if callable(pane.object) else pane.object
    assert rendered == view._caption()
    assert rendered.startswith("EAP-IG scores of 1 pair.")
