"""The Circuits page's state in links and state files (tiny-llama, no browser): the task,
the attribution method, the circuit's size and the pinned node travel in the gallery's link
and export, and a fresh gallery opening them draws the same circuit; a size asked for before
the scores arrive is kept; another task is computed once the page has scored; a bad value
in a link is refused with a message naming it and the allowed values."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from apps.circuits import CircuitsView
from explorer._checks import InputError
from explorer.workspace import Workspace, workspace_link


pytestmark = pytest.mark.slow      # each test scores the tiny model's edges (seconds of CPU)


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path))


def drawn_edges(view):
    """The drawn circuit's edges (source, target) and the pinned node, read from the page."""
    out = view.redraw()
    return sorted(zip(out["edges"]["src"], out["edges"]["dst"])), view.selected


def test_link_and_state_file_reopen_the_same_circuit(tiny_model, notes):
    from apps.gallery import Gallery

    g = Gallery("tiny-llama", view="circuits")
    with torch.enable_grad():
        view = g.page("circuits")
        view.method = "eap-ig"
    assert view.scores is not None and view._shown_method == "eap-ig"
    sizes = [int(n) for n in view._slider.options.values()]
    size = sizes[len(sizes) // 3]
    assert size != view.n_edges            # not the default circuit
    view.n_edges = size
    view.selected = "L1.H2"
    want = drawn_edges(view)
    assert want[0] and want[1] == "L1.H2"

    query, _ = g.link()
    assert query.startswith("?view=circuits&s=1.")
    h = Gallery("tiny-llama")
    with torch.enable_grad():
        assert h.open_link("circuits", query.split("&s=")[1]), h.link_message
        other = h.page("circuits")
    assert (other.task, other.method, other.n_edges, other.selected) == (
        view.task, "eap-ig", size, "L1.H2")
    assert other._shown_method == "eap-ig" and drawn_edges(other) == want
    assert h.workspace.selected == ["L1.H2"]

    state = json.loads(g.export_state())
    saved = state["settings"]["circuits"]
    assert (saved["task"], saved["method"], saved["n_edges"], saved["selected"]) == (
        view.task, "eap-ig", size, "L1.H2")
    fresh = Gallery("tiny-llama", view="lens")
    fresh.import_state(json.dumps(state))
    with torch.enable_grad():
        again = fresh.page("circuits")
    assert drawn_edges(again) == want and again._shown_method == "eap-ig"


def test_a_size_set_before_the_scores_arrive_is_kept(tiny_model):
    """As a served page receives a link's settings: after the constructor, before scoring."""
    view = CircuitsView(tiny_model, background=False, autostart=False, n_prompts=4)
    view.param.update(method="eap", n_edges=7)
    view.selected = "L0.MLP"
    with torch.enable_grad():
        view._request_scores()
    assert view.scores is not None and view.n_edges == 7 and view.selected == "L0.MLP"
    assert view._shown["chosen"] == 7
    # a page without a size asked for opens on the default circuit instead
    plain = CircuitsView(tiny_model, background=False, autostart=False, n_prompts=4)
    with torch.enable_grad():
        plain._request_scores()
    assert plain.n_edges == plain._default.n_edges


def test_another_task_is_computed_once_the_page_has_scored(tiny_model):
    view = CircuitsView(tiny_model, background=False, n_prompts=4, task="add")
    assert view.scores is not None and view._task.name == "add"
    add_scores = view.scores
    with torch.enable_grad():
        view.task = "sub"
    assert view._task.name == "sub" and view.scores is not add_scores
    clean = list(view._task.clean)
    from explorer.analyses import circuits as ca
    assert clean == ca.make_task("sub", 4, seed=0).clean
    view.task = "add"                       # computed before: shown again at once
    assert view.scores is add_scores
    # before any scoring, a task change waits for the button
    idle = CircuitsView(tiny_model, background=False, autostart=False, n_prompts=4)
    idle.task = "sub"
    assert idle.scores is None


def test_the_pinned_node_is_checked_and_spelled_canonically(tiny_model):
    view = CircuitsView(tiny_model, background=False, autostart=False, n_prompts=4)
    view.selected = "a1.h2"
    assert view.selected == "L1.H2"
    for bad in ("L9.H9", "L1.H2->L2.MLP", "drop table"):
        with pytest.raises(InputError, match=r"`selected` must be a node of this model's "
                                             r"graph: L0.H0 to L2.H3, L0.MLP to L2.MLP, input "
                                             r"or logits \(or empty\); got"):
            view.selected = bad
        assert view.selected == "L1.H2"


@pytest.mark.parametrize("settings, message", [
    ({"method": "eap-x"}, r"method = 'eap-x' refused: .*eap-x"),
    ({"selected": "L9.H9"}, r"selected = 'L9.H9' refused: `selected` must be a node of this "
                            r"model's graph"),
    ({"n_edges": -3}, r"n_edges = -3 refused"),
    ({"task": "nope"}, r"task = 'nope' refused"),
    ({"weights": 1}, r"has no setting 'weights' that links carry"),
])
def test_a_tampered_link_value_is_refused_with_a_message(tiny_model, notes, settings, message):
    from apps.gallery import Gallery

    ws = Workspace(model_name="tiny-llama", n_layers=3, n_heads=4)
    text, _ = workspace_link(ws, view="circuits", settings={"n_prompts": 4, **settings})
    g = Gallery("tiny-llama")
    with torch.enable_grad():
        g.open_link("circuits", text)    # the page's settings apply as the page is built
        view = g.page("circuits")
    assert "could not be opened as it was" in g.link_message
    assert any(kind == "error" and re.search(message, text_)
               for kind, text_ in notes), notes
    # the refused value is left as it was; the good one is applied
    assert view.n_prompts == 4 and view.method in ("eap", "eap-ig") and view.selected == ""
    assert view.n_edges >= 0 and view.task in ("add", "sub", "ioi", "greater-than")
    assert np.isfinite(view.fraction)
