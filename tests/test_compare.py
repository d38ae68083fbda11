"""Two prompts side by side: the workspace's second prompt (state file, link, sidebar) and the
Two prompts page's results, checked against each prompt run alone (tiny-llama, in-process)."""
from __future__ import annotations

import base64
import json
import zlib

import pytest

from explorer._checks import InputError
from explorer.workspace import MAX_PROMPT_CHARS, Workspace, read_link, workspace_link

pytestmark = pytest.mark.usefixtures("one_torch_thread")

A = "When Mary and John went to the store, John gave a drink to"
B = "When Mary and John went to the store, Mary gave a drink to"


def _ws(**kw):
    return Workspace(model_name="tiny-llama", n_layers=3, n_heads=4, **kw)


def _link_data(text: str) -> dict:
    body = text.split(".", 1)[1]
    return json.loads(zlib.decompress(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))))


# -- the workspace's second prompt -----------------------------------------------------------

def test_second_prompt_is_empty_by_default_and_travels_in_the_state_file():
    ws = _ws(prompts=[A])
    assert ws.second_prompt == ""
    assert json.loads(ws.to_json())["second_prompt"] == ""
    ws.second_prompt = B
    state = json.loads(ws.to_json())
    assert state["prompts"] == [A] and state["second_prompt"] == B
    back = Workspace.from_json(ws.to_json())
    assert back.prompt == A and back.second_prompt == B
    assert "second_prompt = " in ws.copy_as_code() and repr(B) in ws.copy_as_code()
    other = _ws()
    other.update_from(back)
    assert other.second_prompt == B


def test_a_state_without_the_second_prompt_loads_and_a_bad_one_is_refused():
    state = json.loads(_ws(prompts=[A]).to_json())
    del state["second_prompt"]  # a state written before the field existed
    assert Workspace.from_state(state).second_prompt == ""
    state["second_prompt"] = ["not", "text"]
    with pytest.raises(InputError, match="'second_prompt': the second prompt must be text; "
                                         "got a JSON array"):
        Workspace.from_state(state)
    state["second_prompt"] = "x" * (MAX_PROMPT_CHARS + 1)
    with pytest.raises(InputError, match="at most 100,000 are kept"):
        Workspace.from_state(state)


def test_a_link_carries_the_second_prompt_and_old_links_still_load():
    ws = _ws(prompts=[A], second_prompt=B)
    ws.select("L1.H2")
    text, _ = workspace_link(ws, view="compare")
    data = _link_data(text)
    assert data["p"] == [A] and data["q"] == B  # read back by hand
    link = read_link(text)
    assert link.view == "compare" and link.workspace.prompt == A
    assert link.workspace.second_prompt == B and link.workspace.selected == ["L1.H2"]
    # a link without a second prompt holds no "q", and reads back with none
    plain, _ = workspace_link(_ws(prompts=[A]), view="lens")
    assert "q" not in _link_data(plain) and read_link(plain).workspace.second_prompt == ""


def test_gallery_link_and_export_round_trip_the_second_prompt(tiny_model, notes):
    from apps.gallery import Gallery

    g = Gallery("tiny-llama", view="lens")
    assert g.submit_second_prompt("Water boils at")
    assert g.workspace.second_prompt == "Water boils at"
    query, _ = g.link()
    assert "&s=1." in query
    h = Gallery("tiny-llama")
    assert h.open_link("lens", query.split("&s=")[1])
    assert h.workspace.second_prompt == "Water boils at" and h.link_message == ""
    fresh = Gallery("tiny-llama")
    fresh.import_state(g.export_state())
    assert fresh.workspace.second_prompt == "Water boils at"
    # blank clears it; a prompt over the limit is refused with one notification
    assert g.submit_second_prompt("   ") and g.workspace.second_prompt == ""
    assert not g.submit_second_prompt("word " * 3000)
    assert notes[-1][0] == "warning" and "Second prompt not set" in notes[-1][1]
    assert g.workspace.second_prompt == ""
    assert "Empty" in g._second_prompt_line("")
