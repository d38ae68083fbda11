"""The Circuits page in the session workspace (apps/circuits.py, headless on tiny-llama): the
user's own prompt pairs, workspace edits (the task metric clean vs edited), a selection made
elsewhere drawn in the graph, "Patch all shown edges", and the page's copy-as-code snippet."""
from __future__ import annotations

import numpy as np
import panel as pn
import pytest
import torch

from apps.circuits import OWN_TASK, CircuitsView
from explorer.analyses import circuits as ca
from explorer.analyses import user_items as ui

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# two pairs whose prompts have as many tokens, and whose answers start with different tokens,
# on tiny-llama's 512-token tokenizer
PAIRS = ('"Tom gave a drink to " | "Kim gave a drink to " | "Mary" | "Bob"\n'
         '"The sum: 12 + 30 = " | "The sum: 12 - 30 = " | "4" | "1"')


@pytest.fixture(scope="module")
def own_view(tiny_model):
    """A page that computed the circuit of PAIRS, pasted in its 'Your own' box."""
    with torch.enable_grad():
        view = CircuitsView(tiny_model, background=False, autostart=False)
        view.__panel__()
        view._own.area.value = PAIRS
        view._own.button.clicks += 1
    return view


def test_own_pairs_are_the_task_and_their_scores_are_edge_scores(own_view, tiny_model):
    view = own_view
    task = ui.parse_circuit_pairs(PAIRS, tiny_model, name=OWN_TASK)
    assert view.task == OWN_TASK and view.error == "" and OWN_TASK in view.param.task.objects
    assert view._task.clean == task.clean and view._task.answer == task.answer
    assert view.scores is not None and view.scores.attrs["n_prompts"] == 2
    with torch.enable_grad():
        want = ca.edge_scores(tiny_model, task, method="eap", batch_size=len(task))
    np.testing.assert_allclose(view.scores["score"].values, want["score"].values, rtol=1e-5,
                               atol=1e-7)
    assert view.scores.attrs["clean_metric"] == pytest.approx(want.attrs["clean_metric"], abs=1e-5)
    assert list(view.scores["src"].values) == list(want["src"].values)


def test_own_pairs_bad_text_shows_one_line_and_keeps_the_result(own_view):
    view = own_view
    scores = view.scores
    root = view.__panel__()
    area = view._own.area
    assert area in root.select(pn.widgets.TextAreaInput) and area.placeholder == ui.CIRCUIT_FORMAT
    area.value = PAIRS + "\n" + '"Tom gave a drink to " | "Kimberly gave a drink to " | "a" | "b"'
    view._own.button.clicks += 1
    assert view.error.startswith("line 3: the clean prompt has 14 tokens and the corrupted "
                                 "prompt 18") and "\n" not in view.error
    assert view.scores is scores and view.task == OWN_TASK
    shown = [m.object for m in root.select(pn.pane.Markdown) if "own-items-error" in m.css_classes]
    assert shown == [view.error]
    area.value = PAIRS


def hooked_logit_diff(model, task, ablate=()):
    """Per pair: the answer's minus the wrong answer's logit at the last token, each prompt run
    alone by the Hugging Face model with each (layer, head) in ``ablate`` zeroed at the input
    of its layer's o_proj by torch hooks; the answers' first tokens read from the tokenizer."""
    tok, d_head = model.tokenizer, model.spec.d_head
    handles = []
    for layer, head in ablate:
        def zero(mod, args, _h=head):
            z = args[0].clone()
            z[..., _h * d_head:(_h + 1) * d_head] = 0
            return (z, *args[1:])
        handles.append(model.o_proj(layer).register_forward_pre_hook(zero))
    out = {"clean": [], "corrupt": []}
    try:
        for i, (a, w) in enumerate(zip(task.answer, task.wrong)):
            n = len(tok(task.clean[i], add_special_tokens=False)["input_ids"])
            first = [tok(task.clean[i] + t, add_special_tokens=False)["input_ids"][n] for t in (a, w)]
            for which in out:
                ids = torch.tensor([tok(getattr(task, which)[i], add_special_tokens=False)["input_ids"]])
                with torch.no_grad():
                    logits = model.hf(input_ids=ids).logits[0, -1].double()
                out[which].append(float(logits[first[0]] - logits[first[1]]))
    finally:
        for h in handles:
            h.remove()
    return {k: np.array(v) for k, v in out.items()}


def test_edits_show_the_task_metric_clean_vs_edited_as_torch_hooks(own_view, tiny_model):
    import explorer

    view = own_view
    task = view._task
    assert view.edited is None and "Workspace edits" not in view._readout()
    view.edits = [explorer.Ablate(layer=1, head=2), explorer.Ablate(layer=0, head=0)]
    e = view.edited
    plain = hooked_logit_diff(tiny_model, task)
    edited = hooked_logit_diff(tiny_model, task, ablate=[(1, 2), (0, 0)])
    assert abs(edited["clean"].mean() - plain["clean"].mean()) > 1e-4   # the edit matters
    assert e["clean_metric"] == pytest.approx(plain["clean"].mean(), abs=1e-4)
    assert e["corrupt_metric"] == pytest.approx(plain["corrupt"].mean(), abs=1e-4)
    assert e["edited_clean_metric"] == pytest.approx(edited["clean"].mean(), abs=1e-4)
    assert e["edited_corrupt_metric"] == pytest.approx(edited["corrupt"].mean(), abs=1e-4)
    # the unedited metric is the one the edge scores report (the circuit's own forward)
    assert e["clean_metric"] == pytest.approx(view.scores.attrs["clean_metric"], abs=1e-4)
    want = (edited["clean"].mean() - plain["corrupt"].mean()) / (plain["clean"].mean() -
                                                                 plain["corrupt"].mean())
    assert e["recovered"] == pytest.approx(want, rel=1e-3)
    text = view._readout()
    assert "ablate L1.H2 (zero), ablate L0.H0 (zero)" in text
    assert f"{e['clean_metric']:.4f} → {e['edited_clean_metric']:.4f}" in text
    assert f"data-circuit-edited='{e['clean_metric']:.9g} " in view._state_html()
    # the faithfulness panel marks the edited model's share
    lines = [el for el in view._marker_plot() if type(el).__name__ == "HLine"]
    assert [round(float(el.data), 6) for el in lines] == [round(view.fraction, 6), round(want, 6)]
    view.edits = []
    assert view.edited is None and "Workspace edits" not in view._readout()
