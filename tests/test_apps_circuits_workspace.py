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
