"""The session workspace: selection, edit stack, JSON state round trip, bad input, code snippet."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import explorer
from explorer import Ablate, AddHead, Patch, Scale, Steer
from explorer._checks import ExplorerError, InputError
from explorer.workspace import MAX_STATE_BYTES, Workspace, edit_label


@pytest.fixture
def ws(tiny_model):
    return Workspace.from_model(tiny_model, prompts=["The cat sat on the mat"])


def test_from_model_takes_the_name_and_shape(ws, tiny_model):
    spec = tiny_model.spec
    assert (ws.model_name, ws.n_layers, ws.n_heads) == (spec.name, spec.n_layers, spec.n_heads)
    assert ws.prompt == "The cat sat on the mat" and ws.selected == [] and ws.edits == []


def test_select_spells_components_once_in_selection_order(ws):
    assert ws.select("a1.h2", "l0.mlp", "L2H3", "input") == ["L1.H2", "L0.MLP", "L2.H3", "input"]
    assert ws.selected == ["L1.H2", "L0.MLP", "L2.H3", "input"]
    ws.select("L0.MLP")                       # selected again: moves to the end, not twice
    assert ws.selected == ["L1.H2", "L2.H3", "input", "L0.MLP"]
    ws.deselect("a2.h3", "L1")                # L1 is not selected: ignored
    assert ws.selected == ["L1.H2", "input", "L0.MLP"]
    assert ws.toggle("L1.H2") is False and "L1.H2" not in ws.selected
    assert ws.toggle("L1.H2") is True and ws.selected[-1] == "L1.H2"
    ws.select("L0.H3")
    assert ws.selected_heads == [(1, 2), (0, 3)]
    ws.set_selection(["m2", "logits"])
    assert ws.selected == ["L2.MLP", "logits"]
    ws.clear_selection()
    assert ws.selected == []


def test_every_selection_change_is_seen_by_a_watcher(ws):
    seen = []
    ws.param.watch(lambda e: seen.append(list(e.new)), "selected")
    ws.select("L0.H1")
    ws.select("L1.H1")
    ws.deselect("L0.H1")
    assert seen == [["L0.H1"], ["L0.H1", "L1.H1"], ["L1.H1"]]


@pytest.mark.parametrize(("name", "match"), [
    ("L3.H0", r"L3.H0 is out of range: the model has layers 0..2"),
    ("L0.H4", r"heads 0..3"),
    ("L9.MLP", r"layers 0..2"),
    ("attention 3", r"cannot read 'attention 3': write a head as L17.H3"),
    ("", r"cannot read '': write a head as L17.H3"),
])
def test_bad_components_are_refused_with_the_allowed_spelling(ws, name, match):
    with pytest.raises(InputError, match=match):
        ws.select(name)
    assert ws.selected == []


def test_a_workspace_without_a_shape_still_spells_but_does_not_range_check():
    ws = Workspace(model_name="some-model")
    assert ws.select("a40.h30") == ["L40.H30"]
    with pytest.raises(InputError, match="cannot read"):
        ws.select("head seven")


def test_edit_stack_push_remove_and_validation(ws, tiny_model):
    a, s = Ablate(1, 2), Scale(0, 3, 0.5)
    ws.push_edit(a)
    ws.push_edit(s)
    ws.push_edit({"kind": "ablate", "layer": 2, "head": 0})
    assert ws.edit_labels == ["ablate L1.H2 (zero)", "scale L0.H3 × 0.5", "ablate L2.H0 (zero)"]
    assert ws.remove_edit(s) == s
    assert ws.remove_edit(-1) == Ablate(2, 0)
    assert ws.edits == [a]
    with pytest.raises(InputError, match=r"index in \[0, 0\]"):
        ws.remove_edit(3)
    with pytest.raises(InputError, match="not on the edit stack"):
        ws.remove_edit(Scale(0, 0, 2.0))
    with pytest.raises(InputError, match=r"`head` must be an int in \[0, 3\]; got 4"):
        ws.push_edit(Ablate(0, 4))
    with pytest.raises(InputError, match="d_model=64"):
        ws.push_edit(Steer(1, vector=[0.0] * 3))
    with pytest.raises(TypeError, match="intervention record"):
        ws.push_edit("ablate L0.H0")
    assert ws.edits == [a]
    ws.clear_edits()
    assert ws.edits == []


def test_json_round_trip_keeps_every_field(ws, tiny_model):
    rng = np.random.default_rng(0)
    ws.prompts = ["The cat sat on the mat", "Second prompt\nwith a newline \u00e9"]
    ws.select("L1.H2", "L0.MLP", "logits")
    edits = [Ablate(1, 2), Ablate(0, 1, mode="mean", value=rng.normal(size=16).tolist()),
             Scale(2, 3, -0.25, prompts=(1,)), Steer(1, vector=rng.normal(size=64).tolist(),
                                                     alpha=2.0, positions=(-1,)),
             Patch("resid_post", 1, "The dog sat on the mat"),
             AddHead(2, 1, value=rng.normal(size=32).tolist(), positions=(0, 1))]
    for e in edits:
        ws.push_edit(e)
    text = ws.to_json()
    state = json.loads(text)
    assert state["format"] == "explorer-workspace" and state["version"] == 1
    assert state["versions"]["explorer"] == explorer.__version__
    assert state["versions"]["torch"] == torch.__version__
    assert state["model"] == "tiny-llama" and state["selected"] == ["L1.H2", "L0.MLP", "logits"]
    back = Workspace.from_json(text, model=tiny_model)
    assert back.prompts == ws.prompts and back.selected == ws.selected
    assert back.edits == edits                      # floats survive JSON exactly
    assert Workspace.from_json(text.encode()).edits == edits   # bytes (an uploaded file)


def _state(ws, **changes):
    state = json.loads(ws.to_json())
    state.update(changes)
    return json.dumps(state)


@pytest.mark.parametrize(("text", "match"), [
    ("{", r"not valid JSON: Expecting property name .* line 1, column 2"),
    ("[1, 2]", "a state is a JSON object; got a JSON array"),
    ('"hello"', "got a JSON string"),
    ('{"format": "something-else"}', "not an explorer state"),
    ("__import__('os').system('echo hi')", "not valid JSON"),
])
def test_malformed_json_is_refused(tiny_model, text, match):
    with pytest.raises(ExplorerError, match=match):
        Workspace.from_json(text, model=tiny_model)


def test_bad_fields_are_refused_naming_the_field(ws, tiny_model):
    cases = [
        (_state(ws, version=7), "reads state version 1; the file has version 7"),
        (_state(ws, extra=1), r"unknown field\(s\) in the state: 'extra'"),
        (_state(ws, model=3), "'model' must be a model name"),
        (_state(ws, model="smollm2-135m"), "the state is for model 'smollm2-135m'"),
        (_state(ws, n_layers=30), "n_layers=30; tiny-llama has 3"),
        (_state(ws, n_heads=-1), "'n_heads' must be a positive int"),
        (_state(ws, prompts="one prompt"), "'prompts' must be a list of strings"),
        (_state(ws, selected=["L1.H2", 5]), "'selected' must be a list of component names"),
        (_state(ws, selected=["L7.H0"]), "the state's selection: L7.H0 is out of range"),
        (_state(ws, edits={"kind": "ablate"}), "'edits' must be a list"),
        (_state(ws, edits=[{"kind": "eval", "layer": 0}]), r"edit 0 of the state: `kind` must be"),
        (_state(ws, edits=[{"kind": "ablate", "layer": 0, "head": 9}]), r"edit 0 .*`head`"),
        (_state(ws, edits=[{"kind": "scale", "layer": 0, "head": 0, "alpha": 1, "x": 2}]),
         r"edit 0 .*bad fields for a 'scale' edit"),
        (b"\xff\xfe{}", "not UTF-8"),
    ]
    for text, match in cases:
        with pytest.raises(InputError, match=match):
            Workspace.from_json(text, model=tiny_model)


def test_an_oversized_state_is_refused_before_parsing(tiny_model):
    with pytest.raises(InputError, match="at most"):
        Workspace.from_json(b" " * (MAX_STATE_BYTES + 1), model=tiny_model)


def test_update_from_takes_another_state_in_one_update(ws, tiny_model):
    other = Workspace.from_model(tiny_model, prompts=["Other"], selected=["L2.H1"],
                                 edits=[Scale(0, 0, 2.0)])
    seen = []
    ws.param.watch(lambda *events: seen.append(sorted(e.name for e in events)),
                   ["prompts", "selected", "edits"])
    ws.update_from(other)
    assert (ws.prompts, ws.selected, ws.edits) == (["Other"], ["L2.H1"], [Scale(0, 0, 2.0)])
    assert seen == [["edits", "prompts", "selected"]]  # one batched event
    with pytest.raises(InputError, match="for model 'x'"):
        ws.update_from(Workspace(model_name="x"))


def test_copy_as_code_runs_and_reproduces_the_edited_logits(ws, tiny_model, tmp_path,
                                                            monkeypatch):
    ws.select("L1.H2")
    ws.push_edit(Ablate(1, 2))
    ws.push_edit(Scale(0, 3, 0.5))
    code = ws.copy_as_code()
    assert "explorer.load_model('tiny-llama')" in code and "Ablate(layer=1, head=2" in code
    names: dict = {}
    exec(compile(code, "<snippet>", "exec"), names)
    want = explorer.run_with(tiny_model, ws.prompts, ws.edits).logits.values
    np.testing.assert_allclose(names["edited"].logits.values, want, atol=1e-6)
    assert names["selected"] == ["L1.H2"]
    # edits with long vectors are read back from the exported state file
    ws.push_edit(Steer(1, vector=np.linspace(-1, 1, 64).tolist()))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "explorer-state.json").write_text(ws.to_json())
    code = ws.copy_as_code()
    assert "Workspace.from_json" in code and "linspace" not in code
    names = {}
    exec(compile(code, "<snippet>", "exec"), names)
    want = explorer.run_with(tiny_model, ws.prompts, ws.edits).logits.values
    np.testing.assert_allclose(names["edited"].logits.values, want, atol=1e-6)


def test_edit_labels_use_the_component_spelling():
    assert edit_label(Ablate(3, 1)) == "ablate L3.H1 (zero)"
    assert edit_label(Ablate(3, 1, positions=(-1,))) == "ablate L3.H1 (zero) at pos -1"
    assert edit_label(Scale(0, 2, 0.5, prompts=(1,))) == "scale L0.H2 × 0.5 in prompt 1"
    assert edit_label(Patch("attn_z", 2, "abc", head=1)) == "patch L2.H1 from 'abc'"
    assert edit_label(Patch("resid_post", 2, "abc")) == "patch resid_post L2 from 'abc'"
    assert edit_label(Steer(4, vector=[1.0], alpha=3)) == "steer L4 × 3"


def test_set_model_keeps_what_fits_and_drops_the_rest(tiny_model):
    big = Workspace(model_name="big", n_layers=8, n_heads=8, selected=["L7.H0", "L1.H1", "L2.MLP"],
                    edits=[Ablate(6, 6), Scale(1, 1, 0.5)])
    dropped, gone, second = big.set_model(tiny_model)       # 3 layers x 4 heads
    assert (big.model_name, big.n_layers, big.n_heads) == ("tiny-llama", 3, 4)
    assert big.selected == ["L1.H1", "L2.MLP"] and dropped == ["L7.H0"]
    assert big.edits == [Scale(1, 1, 0.5)] and gone == [Ablate(6, 6)] and second == ""


def test_set_model_drops_a_second_prompt_over_the_new_models_limit(tiny_model):
    """A second prompt kept on a model with a longer context is removed (and returned) when
    the workspace moves to a model it does not fit; one that fits stays."""
    n_ctx = tiny_model.spec.context_length
    long_text = " word" * (n_ctx + 10)
    count = len(tiny_model.tokenizer(long_text)["input_ids"])      # the tokenizer, by hand
    assert count > n_ctx
    big = Workspace(model_name="big", n_layers=8, n_heads=8, second_prompt=long_text)
    assert big.second_prompt == long_text           # no tokenizer yet: nothing to check against
    dropped, gone, second = big.set_model(tiny_model)
    assert (dropped, gone, second) == ([], [], long_text) and big.second_prompt == ""
    with pytest.raises(InputError, match=f"at most {n_ctx:,} tokens"):
        big.second_prompt = long_text               # and the workspace refuses it from now on
    fits = Workspace(model_name="big", n_layers=8, n_heads=8, second_prompt="The cat sat")
    assert fits.set_model(tiny_model)[2] == "" and fits.second_prompt == "The cat sat"
