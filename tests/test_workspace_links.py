"""Shareable links and page settings of the workspace, the gallery's prompt limit, its home page
and its one-notification-per-fault rule, without a browser (the tiny random-init model)."""
from __future__ import annotations

import base64
import json
import zlib

import pytest

from explorer._checks import InputError
from explorer.interventions import Ablate, Scale, Steer
from explorer.workspace import (LINK_VERSION, MAX_PROMPT_CHARS, Workspace, check_settings,
                                read_link, workspace_link)


def _ws(**kw):
    return Workspace(model_name="tiny-llama", n_layers=3, n_heads=4, **kw)


def test_a_link_carries_prompt_selection_edits_page_and_settings():
    ws = _ws(prompts=["Hello there"])
    ws.select("L1.H2", "L0.MLP", "L0.H1->L1.MLP")
    ws.push_edit(Ablate(1, 2))
    ws.push_edit(Scale(2, 3, 0.5))
    text, left_out = workspace_link(ws, view="lens", settings={"k": 9, "contrast_a": "A\nB"})
    assert text.startswith(f"{LINK_VERSION}.") and left_out == 0
    assert set(text[2:]) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
    # the text is the JSON, compressed: read it back by hand
    body = text[2:]
    data = json.loads(zlib.decompress(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))))
    assert data["p"] == ["Hello there"] and data["v"] == "lens" and data["o"]["k"] == 9
    link = read_link(text)
    assert link.view == "lens" and link.settings == {"k": 9, "contrast_a": "A\nB"}
    assert link.workspace.prompts == ["Hello there"]
    assert link.workspace.selection == ["L1.H2", "L0.MLP", "L0.H1->L1.MLP"]
    assert link.workspace.edits == [Ablate(1, 2), Scale(2, 3, 0.5)]


def test_features_travel_in_links_states_and_code(tiny_model):
    """Selected dictionary features are one more kind of selection: checked against the
    model's depth, kept in their own list and carried by a link, a state file and the code."""
    ws = Workspace.from_model(tiny_model)
    ws.select("L2.F7", "L0.H1", "l1 f3")
    assert ws.selected_features == ["L2.F7", "L1.F3"] and ws.selected == ["L0.H1"]
    with pytest.raises(InputError, match="out of range"):
        ws.select(f"L{tiny_model.spec.n_layers}.F0")
    text, _ = workspace_link(ws, view="features")
    back = read_link(text, model=tiny_model).workspace
    assert back.selected_features == ["L2.F7", "L1.F3"] and back.selection == ws.selection
    again = Workspace.from_json(ws.to_json(), model=tiny_model)
    assert again.selected_features == ["L2.F7", "L1.F3"]
    assert "selected_features = ['L2.F7', 'L1.F3']" in ws.copy_as_code()
    ws.toggle("L2.F7")
    assert ws.selected_features == ["L1.F3"]
    ws.clear_selection()
    assert ws.selection == []


def test_a_link_leaves_out_edits_holding_a_vector():
    ws = _ws()
    ws.push_edit(Ablate(0, 1))
    ws.edits = [*ws.edits, Steer(layer=1, vector=[0.1] * 64, alpha=2.0)]
    text, left_out = workspace_link(ws)
    assert left_out == 1 and read_link(text).workspace.edits == [Ablate(0, 1)]


def test_a_changed_cut_or_foreign_link_is_refused_with_a_message():
    ws = _ws(prompts=["Hello there"])
    ws.select("L1.H2")
    text, _ = workspace_link(ws, view="lens")
    i = len(text) // 2
    changed = text[:i] + ("B" if text[i] != "B" else "C") + text[i + 1:]
    with pytest.raises(InputError, match="a character was changed or the link was cut"):
        read_link(changed)
    with pytest.raises(InputError, match="a character was changed or the link was cut"):
        read_link(text[:-6])
    with pytest.raises(InputError, match=r"another version of the explorer \(link version 7"):
        read_link("7" + text[1:])
    with pytest.raises(InputError, match="does not start with its version"):
        read_link("garbage")
    with pytest.raises(InputError, match="holds no state"):
        read_link("")
    with pytest.raises(InputError, match="at most 16,000 are read"):
        read_link("1." + "A" * 20_000)


def _raw_link(data) -> str:
    raw = zlib.compress(json.dumps(data).encode())
    return "1." + base64.urlsafe_b64encode(raw).decode().rstrip("=")


def test_a_well_formed_link_is_still_checked_like_a_state(tiny_model):
    good = {"m": "tiny-llama", "p": ["Hi"], "s": ["L1.H2"], "v": "lens", "o": {"k": 3}}
    assert read_link(_raw_link(good), model=tiny_model).workspace.selected == ["L1.H2"]
    with pytest.raises(InputError, match="the link's selection: .*L40"):
        read_link(_raw_link({**good, "s": ["L40.H3"]}), model=tiny_model)
    with pytest.raises(InputError, match="the state is for model 'smollm2-135m'"):
        read_link(_raw_link({**good, "m": "smollm2-135m"}), model=tiny_model)
    with pytest.raises(InputError, match="unknown field"):
        read_link(_raw_link({**good, "x": 1}))
    with pytest.raises(InputError, match="edit 0 of the state"):
        read_link(_raw_link({**good, "e": [{"kind": "ablate", "layer": 9, "head": 0}]}),
                  model=tiny_model)
    with pytest.raises(InputError, match="the setting lens.k must be a string, number"):
        read_link(_raw_link({**good, "o": {"k": {"deep": 1}}}))
    with pytest.raises(InputError, match="page must be a page name"):
        read_link(_raw_link({**good, "v": "../etc"}))


def test_settings_travel_in_the_state_file():
    ws = _ws(settings={"lens": {"k": 7, "alpha": 1.5}})
    back = Workspace.from_json(ws.to_json())
    assert back.settings == {"lens": {"k": 7, "alpha": 1.5}}
    with pytest.raises(InputError, match="the state's 'settings': the setting lens.k"):
        Workspace.from_json(json.dumps({**json.loads(ws.to_json()),
                                        "settings": {"lens": {"k": {"a": 1}}}}))
    with pytest.raises(InputError, match="page name is lower-case"):
        check_settings({"Bad Page": {}})


def test_a_prompt_over_the_limit_is_refused():
    with pytest.raises(InputError, match=f"at most {MAX_PROMPT_CHARS:,} are kept"):
        _ws(prompts=["x" * (MAX_PROMPT_CHARS + 1)])
    ws = _ws()
    with pytest.raises(InputError, match="are kept"):
        ws.prompt = "x" * (MAX_PROMPT_CHARS + 1)
    assert ws.prompt == "The capital of France is"


# -- the gallery ---------------------------------------------------------------------------------

def test_gallery_link_round_trip_and_export_settings(tiny_model):
    from apps.gallery import Gallery

    g = Gallery("tiny-llama", view="lens")
    lens = g.page("lens")
    g.prompt = "Water boils at"
    g.workspace.select("L1.H2")
    g.workspace.push_edit(Ablate(1, 2))
    lens.k = 9
    query, _ = g.link()
    assert query.startswith("?view=lens&s=1.")
    h = Gallery("tiny-llama")
    assert h.open_link("lens", query.split("&s=")[1])
    assert h.view == "lens" and h.prompt == "Water boils at"
    assert h.workspace.selected == ["L1.H2"] and h.workspace.edits == [Ablate(1, 2)]
    assert h.page("lens").k == 9 and h.link_message == ""
    # the export carries the settings of every page opened; an import applies them
    state = json.loads(g.export_state())
    assert state["settings"]["lens"]["k"] == 9
    fresh = Gallery("tiny-llama", view="lens")
    fresh.import_state(json.dumps(state))
    assert fresh.page("lens").k == 9


def test_gallery_refuses_a_bad_link_and_opens_plainly(tiny_model, notes):
    from apps.gallery import Gallery

    g = Gallery("tiny-llama")
    assert not g.open_link("lens", "1.AAAA")
    assert "could not be opened" in g.link_message and g.view == "lens"
    assert g.workspace.selected == [] and notes[-1][0] == "error"
    h = Gallery("tiny-llama")
    assert not h.open_link("nope", None)
    assert "there is no page 'nope'" in h.link_message
    # a setting the page does not carry, or refuses, is said and left as it is
    good, _ = Gallery("tiny-llama").link()
    link = _raw_link({"m": "tiny-llama", "p": ["Hi"], "v": "lens", "o": {"k": 500, "zzz": 1}})
    k = Gallery("tiny-llama")
    assert not k.open_link("lens", link)
    assert "no setting 'zzz'" in k.link_message and "k = 500 refused" in k.link_message
    assert k.page("lens").k == 5 and k.prompt == "Hi"


def test_sidebar_prompt_limit(tiny_model, notes):
    from apps.gallery import Gallery

    g = Gallery("tiny-llama", view="lens")
    assert g.prompt_limit == min(2048, tiny_model.spec.context_length)
    n = len(tiny_model.tokenizer("Hello world", add_special_tokens=False)["input_ids"])
    assert g._prompt_line("Hello world").startswith(f"{n} / {g.prompt_limit} tokens")
    long = "word " * 3000
    assert not g.submit_prompt(long)
    assert g.prompt == "The capital of France is"
    assert notes[-1][0] == "warning" and f"at most {g.prompt_limit} tokens" in notes[-1][1]
    assert "Too long" in g.prompt_info
    assert not g.submit_prompt("   ") and "the prompt is empty" in notes[-1][1]
    assert g.submit_prompt("Hello world") and g.page("lens").prompt == "Hello world"


def test_home_page_links_every_gallery_page_once():
    from apps._page_titles import PAGE_TITLES
    from apps.gallery import VIEWS
    from apps.home import GROUPS, home_html

    titles = {slug: title for title, slug, _ in VIEWS}
    grouped = [s for _, _, slugs in GROUPS for s in slugs]
    assert sorted(grouped) == sorted(titles) and len(grouped) == len(set(grouped))
    assert len(grouped) == len(PAGE_TITLES) >= 18
    text = home_html(titles)
    for slug, title in titles.items():
        assert text.count(f"data-view='{slug}' class='home-link'") == 1
        assert f">{title}</a>" in text
    assert "More pages" not in text and text.count("<li>") == 3


def test_one_fault_one_notification(monkeypatch):
    """The same fault from several pages: one notification, naming the pages."""
    import panel as pn

    from apps import theme

    shown = []

    class Note:
        def __init__(self, text):
            self.text, self.gone = text, False

        def destroy(self):
            self.gone = True

    class Area:
        def error(self, text, duration):
            shown.append(Note(text))
            return shown[-1]

        warning = error

    monkeypatch.setattr(pn.state, "_notifications", {None: Area()}, raising=False)
    monkeypatch.setattr(type(pn.state), "notifications", property(lambda self: Area()))
    for title in ("Logit lens", "Attention", "Logit lens"):
        theme.notify("error", f"{title}: bad prompt", source=title, fault="bad prompt")
    live = [n.text for n in shown if not n.gone]
    assert live == ["Logit lens, Attention: bad prompt"]
    theme.notify("warning", "L40 is out of range")
    theme.notify("warning", "L40 is out of range")
    assert [n.text for n in shown if not n.gone] == ["Logit lens, Attention: bad prompt",
                                                     "L40 is out of range"]


def test_widget_errors_name_the_control_and_its_bounds(monkeypatch):
    import param

    from apps import theme

    sent = []
    monkeypatch.setattr(theme, "notify", lambda kind, message, **kw: sent.append((kind, message)))

    class Pairs(param.Parameterized):
        n_prompts = param.Integer(default=8, bounds=(1, 64), label="Prompt pairs")

    with pytest.raises(ValueError) as err:
        Pairs().n_prompts = 0
    theme.widget_error(err.value)
    assert sent == [("warning", "Prompt pairs must be at least 1, not 0. The value is unchanged.")]
