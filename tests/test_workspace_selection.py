"""Circuit edges and token positions in the workspace selection: filed under their own lists,
checked against the model and the prompt's length, carried in the JSON state."""
from __future__ import annotations

import json

import pytest

from explorer._checks import InputError
from explorer.analyses import circuits as ca
from explorer.workspace import Workspace

PROMPT = "The cat sat on the mat"


@pytest.fixture
def ws(tiny_model):
    return Workspace.from_model(tiny_model, prompts=[PROMPT])


def _n_tokens(model, text):
    """The prompt's length, from the tokenizer itself (as the pages count: no special tokens)."""
    return len(model.tokenizer(text, add_special_tokens=False)["input_ids"])


def test_edges_and_positions_go_to_their_own_lists(ws):
    names = ws.select("a1.h2->m2", "L0.H1", "pos 3", "input->L0.H2", "P0")
    assert names == ["L0.H1", "L1.H2->L2.MLP", "input->L0.H2", "P3", "P0"]
    assert ws.selected == ["L0.H1"]                         # components only, as before
    assert ws.selected_edges == ["L1.H2->L2.MLP", "input->L0.H2"]
    assert ws.selected_positions == [3, 0]
    assert ws.edge_pairs == [("L1.H2", "L2.MLP"), ("input", "L0.H2")]
    assert ws.selection == ["L0.H1", "L1.H2->L2.MLP", "input->L0.H2", "P3", "P0"]
    ws.select("L1.H2 -> L2.MLP")                            # again: moves to the end, once
    assert ws.selected_edges == ["input->L0.H2", "L1.H2->L2.MLP"]
    assert ws.toggle("P3") is False and ws.selected_positions == [0]
    assert ws.toggle(3) is True and ws.selected_positions == [0, 3]
    assert ws.toggle("input->L0.H2") is False and ws.selected_edges == ["L1.H2->L2.MLP"]
    ws.deselect("P0", "L2.MLP->logits")                     # the edge is not selected: ignored
    assert ws.selected_positions == [3] and ws.selected_edges == ["L1.H2->L2.MLP"]
    ws.set_selection(["m1", "L0.MLP->logits", "P1"])        # replaces all three lists
    assert (ws.selected, ws.selected_edges, ws.selected_positions) == (
        ["L1.MLP"], ["L0.MLP->logits"], [1])
    ws.clear_selection()
    assert (ws.selected, ws.selected_edges, ws.selected_positions) == ([], [], [])


def test_watchers_see_each_list_change(ws):
    seen = []
    ws.param.watch(lambda e: seen.append((e.name, list(e.new))),
                   ["selected", "selected_edges", "selected_positions"])
    ws.select("L0.H1->L1.H0")
    ws.select("P2")
    ws.select("L0.H0")
    assert seen == [("selected_edges", ["L0.H1->L1.H0"]), ("selected_positions", [2]),
                    ("selected", ["L0.H0"])]


@pytest.mark.parametrize(("name", "match"), [
    ("L2.MLP->L1.H0", "goes backwards"),
    ("L1.H0->L1.H1", "heads of one layer"),
    ("L1.H0->L1.H0", "self edge"),
    ("L1->L2.H0", "whole layer"),
    ("L1.H0->L3.MLP", "L3.MLP is out of range: the model has layers 0..2"),
    ("L1.H4->logits", "heads 0..3"),
    ("P99", "P99 is out of range: the prompt has"),
    ("pos x", "cannot read 'pos x'"),
])
def test_bad_edges_and_positions_are_refused_and_nothing_changes(ws, name, match):
    ws.select("L0.H0", "L0.H0->L0.MLP", "P1")
    before = ws.selection
    with pytest.raises(InputError, match=match):
        ws.select("L1.H1", name)
    assert ws.selection == before


def test_positions_are_checked_against_the_prompt_length_in_tokens(ws, tiny_model):
    n = _n_tokens(tiny_model, PROMPT)
    assert ws.n_tokens == n and n > 2
    ws.select(f"P{n - 1}")
    with pytest.raises(InputError, match=rf"the prompt has {n} tokens \(positions P0..P{n - 1}\)"):
        ws.select(f"P{n}")
    ws.select("P1")
    ws.prompt = "The cat"                                   # shorter: positions past it go
    short = _n_tokens(tiny_model, "The cat")
    assert ws.n_tokens == short and ws.selected_positions == [p for p in (n - 1, 1) if p < short]


def test_a_blank_prompt_is_taken_and_keeps_the_positions(ws, tiny_model):
    """A blank prompt has no tokens to check positions against: the workspace takes it (the
    pages then report it) and keeps the selection, which comes back with a real prompt."""
    ws.select("P3")
    ws.prompt = "   "
    assert ws.prompt == "   " and ws.selected_positions == [3]
    with pytest.raises(InputError, match="empty"):
        ws.select("P1")
    ws.prompt = PROMPT
    assert ws.selected_positions == [3] and ws.n_tokens == _n_tokens(tiny_model, PROMPT)


def test_without_a_tokenizer_positions_are_spelled_but_not_range_checked():
    ws = Workspace(model_name="some-model", n_layers=2, n_heads=3)
    assert ws.n_tokens is None
    assert ws.select("pos 400", "a1.h2->logits") == ["L1.H2->logits", "P400"]
    with pytest.raises(InputError, match="layers 0..1"):
        ws.select("L1.H2->L2.MLP")


def test_every_graph_edge_of_the_model_is_selectable(ws, tiny_model):
    graph = ca.circuit_graph(tiny_model)
    names = [f"{s}->{t}" for s, t in graph.edges]
    ws.select(*names)
    assert len(ws.selected_edges) == len(graph.edges)


def test_edges_and_positions_travel_in_the_state(ws, tiny_model):
    ws.select("L1.H2", "a0.h1->m1", "P4", "input->logits", "P2")
    state = json.loads(ws.to_json())
    assert state["selected"] == ["L1.H2"]
    assert state["selected_edges"] == ["L0.H1->L1.MLP", "input->logits"]
    assert state["selected_positions"] == ["P4", "P2"]      # the one spelling in the export
    back = Workspace.from_json(ws.to_json(), model=tiny_model)
    assert (back.selected, back.selected_edges, back.selected_positions) == (
        ["L1.H2"], ["L0.H1->L1.MLP", "input->logits"], [4, 2])
    fresh = Workspace.from_model(tiny_model)
    fresh.update_from(back)
    assert fresh.selection == ws.selection


def test_an_old_state_without_edges_or_positions_still_loads(ws, tiny_model):
    ws.select("L1.H2")
    state = json.loads(ws.to_json())
    del state["selected_edges"], state["selected_positions"]
    back = Workspace.from_json(json.dumps(state), model=tiny_model)
    assert back.selected == ["L1.H2"] and back.selected_edges == [] and back.selected_positions == []


def _state(ws, **changes):
    state = json.loads(ws.to_json())
    state.update(changes)
    return json.dumps(state)


def test_bad_edges_and_positions_in_a_state_are_refused_naming_the_field(ws, tiny_model):
    n = _n_tokens(tiny_model, PROMPT)
    cases = [
        (_state(ws, selected_edges="L0.H1->L1.MLP"), "'selected_edges' must be a list of edge"),
        (_state(ws, selected_edges=[3]), "'selected_edges' must be a list of edge"),
        (_state(ws, selected_edges=["L1.MLP->L0.H1"]), "selected edges: L1.MLP->L0.H1 goes backwards"),
        (_state(ws, selected_edges=["L0.H1->L7.MLP"]), "selected edges: L7.MLP is out of range"),
        (_state(ws, selected_edges=["L0.H1"]), "selected edges: cannot read edge 'L0.H1'"),
        (_state(ws, selected_positions={"a": 1}), "'selected_positions' must be a list of token"),
        (_state(ws, selected_positions=[True]), "'selected_positions' must be a list of token"),
        (_state(ws, selected_positions=[f"P{n}"]),
         rf"selected positions: P{n} is out of range: the prompt has {n} tokens"),
        (_state(ws, selected_positions=["L1.H2"]), "selected positions: cannot read token position"),
        (_state(ws, selected=["L0.H1->L1.MLP"]), "the state's selection: cannot read component"),
    ]
    for text, match in cases:
        with pytest.raises(InputError, match=match):
            Workspace.from_json(text, model=tiny_model)
    # positions are checked against the state's own prompt, not the session's
    ok = Workspace.from_json(_state(ws, prompts=["The cat sat on the mat and the dog"],
                                    selected_positions=[f"P{n}"]), model=tiny_model)
    assert ok.selected_positions == [n]


def test_set_model_drops_the_edges_that_do_not_fit(tiny_model):
    big = Workspace(model_name="big", n_layers=8, n_heads=8,
                    selected=["L1.H1"], selected_edges=["L6.H0->L7.MLP", "L0.H1->L1.MLP"],
                    selected_positions=[2])
    dropped, _, _ = big.set_model(tiny_model)
    assert big.selected_edges == ["L0.H1->L1.MLP"] and big.selected_positions == [2]
    assert dropped == ["L6.H0->L7.MLP"]


def test_copy_as_code_and_repr_name_the_edges_and_positions(ws):
    ws.select("L0.H1->L1.MLP", "P2")
    code = ws.copy_as_code()
    assert "selected_edges = ['L0.H1->L1.MLP']" in code and "selected_positions = [2]" in code
    names: dict = {}
    exec(compile("\n".join(line for line in code.splitlines() if line.startswith("selected")),
                 "<snippet>", "exec"), names)
    assert names["selected_edges"] == ws.selected_edges
    assert "'P2'" in repr(ws) and "L0.H1->L1.MLP" in repr(ws)
