"""The workspace's pasted items (page slug -> the user's own text): kept as typed, written to and
read from the exported state, refused with one line when malformed; old states load."""
from __future__ import annotations

import json

import pytest

from explorer._checks import InputError
from explorer.workspace import MAX_ITEM_CHARS, MAX_ITEMS, Workspace

PAIRS = "hot -> cold\nbig -> small\n  up -> down  \nfast -> slow\n\u00e9t\u00e9 -> hiver"


@pytest.fixture
def ws(tiny_model):
    return Workspace.from_model(tiny_model, prompts=["The cat sat"])


def test_items_are_kept_as_typed_and_travel_in_the_state(ws, tiny_model):
    seen = []
    ws.param.watch(lambda e: seen.append(dict(e.new)), "items")
    ws.set_item("icl-heads", PAIRS)
    ws.set_item("conflicts", "subject: France\nmemory: Paris")
    assert ws.item("icl-heads") == PAIRS and ws.item("unlearning") == ""
    assert seen == [{"icl-heads": PAIRS},
                    {"icl-heads": PAIRS, "conflicts": "subject: France\nmemory: Paris"}]
    state = json.loads(ws.to_json())
    assert state["items"] == {"icl-heads": PAIRS, "conflicts": "subject: France\nmemory: Paris"}
    back = Workspace.from_json(ws.to_json(), model=tiny_model)
    assert back.items == ws.items            # whitespace, newlines and accents as typed
    ws.set_item("conflicts", "")              # an emptied box is forgotten
    assert ws.items == {"icl-heads": PAIRS} and len(seen) == 3


def test_a_state_without_items_still_loads(ws, tiny_model):
    state = json.loads(ws.to_json())
    del state["items"]                        # written before items travelled
    back = Workspace.from_json(json.dumps(state), model=tiny_model)
    assert back.items == {} and back.prompts == ["The cat sat"]


def test_update_from_takes_the_items(ws, tiny_model):
    other = Workspace.from_model(tiny_model, items={"unlearning": "subject: X"})
    ws.set_item("conflicts", "old")
    ws.update_from(other)
    assert ws.items == {"unlearning": "subject: X"}


def _with_items(ws, items):
    state = json.loads(ws.to_json())
    state["items"] = items
    return json.dumps(state)


@pytest.mark.parametrize(("items", "match"), [
    (["a", "b"], r"the state's 'items': pasted items must be an object .* got a JSON array"),
    ("text", "got a JSON string"),
    ({"conflicts": 3}, r"the item pasted on 'conflicts' must be text; got a JSON number"),
    ({"conflicts": ["a"]}, "got a JSON array"),
    ({"conflicts": {"a": "b"}}, "got a JSON object"),
    ({"conflicts": None}, "got a JSON null"),
    ({"Bad Page!": "x"}, r"page must be a page name .* got 'Bad Page!'"),
    ({"": "x"}, "page must be a page name"),
    ({"conflicts": "x" * (MAX_ITEM_CHARS + 1)},
     rf"has {MAX_ITEM_CHARS + 1} characters; at most {MAX_ITEM_CHARS}"),
    ({f"p{i}": "x" for i in range(MAX_ITEMS + 1)}, f"at most {MAX_ITEMS} pages"),
])
def test_bad_items_in_a_state_are_refused_in_one_line(ws, tiny_model, items, match):
    with pytest.raises(InputError, match=match) as info:
        Workspace.from_json(_with_items(ws, items), model=tiny_model)
    assert "\n" not in str(info.value)


def test_bad_items_from_code_are_refused_and_nothing_changes(ws):
    ws.set_item("conflicts", "kept")
    with pytest.raises(InputError, match="must be text; got int"):
        ws.set_item("conflicts", 3)
    with pytest.raises(InputError, match="page must be a page name"):
        ws.set_item("Not a slug", "x")
    with pytest.raises(InputError, match="at most"):
        ws.set_item("conflicts", "x" * (MAX_ITEM_CHARS + 1))
    with pytest.raises(InputError, match="got a JSON number"):
        Workspace(items={"conflicts": 1.5})
    assert ws.items == {"conflicts": "kept"}
