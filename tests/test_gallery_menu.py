"""The sidebar's component menu and the pasted items in the state, headless on tiny-llama
through the gallery's own objects: each menu button does what it says (the ablation and the
scaling it pushes are checked on the Logit lens against plain torch hooks), only what applies
is offered, and text pasted in a page's "Your own" box comes back after export and import."""
from __future__ import annotations

import functools
import json

import numpy as np
import panel as pn
import pytest
from _browser import wait_until
from _views import small_galleries

from apps.gallery import MENU_ACTIONS, VIEWS, Gallery
from explorer.analyses import user_items
from explorer.interventions import Ablate, Scale
from tests.test_lens_edits import assert_lens_equal, hooked_lens

PROMPT = "When Mary and John went to the store, John gave a drink to"

pytestmark = pytest.mark.usefixtures("one_torch_thread", "empty_cache")


@pytest.fixture
def gallery(tiny_model):
    with small_galleries(circuits_autostart=False) as make:
        yield make


def _menu(g):
    """The menu card's buttons and inputs by their ``menu-*`` css class."""
    return {c: w for w in g.component_menu().select(pn.widgets.Widget)
            for c in w.css_classes if c.startswith("menu-")}


def _click(widget):
    widget.clicks += 1


def _chips(g):
    """The sidebar's selected-components widget (the chips)."""
    return next(w for w in g.workspace_widgets() if isinstance(w, pn.widgets.MultiChoice))


def test_the_menu_offers_what_applies_to_the_newest_selection(gallery):
    from apps.conflicts import ConflictsView

    g = gallery()
    assert _menu(g) == {}                                  # nothing selected: no card content
    _chips(g).value = ["L1.H2"]                            # a chip typed in the sidebar
    head = _menu(g)
    juice = ({"menu-juice-enhance", "menu-juice-suppress"}
             if hasattr(ConflictsView, "add_to_juice") else set())
    assert set(head) == {"menu-attention", "menu-ablate", "menu-scale", "menu-scale-factor",
                         "menu-circuit"} | juice
    names = g.component_menu().select(pn.pane.Markdown)
    assert names[0].object == "**L1.H2**"
    if not juice:   # the conflicts page cannot take heads: a note says so, no dead buttons
        assert any("cannot take heads" in str(m.object) for m in names)
    for label, css, tip in MENU_ACTIONS.values():        # labelled buttons with tooltips
        if css in head:
            assert head[css].label == label and head[css].description == tip and tip
    g.workspace.select("L0.MLP")                           # the newest selection's menu
    assert set(_menu(g)) == {"menu-circuit"}
    g.workspace.select("L2")
    card = g.component_menu()
    assert _menu(g) == {}
    assert card.select(pn.pane.Markdown)[0].object == "**L2** (the newest selected)"
    assert "menu-none" in card.objects[-1].css_classes
    # pages not offered: their actions are not either
    lens_only = gallery(views=[v for v in VIEWS if v[1] == "lens"])
    lens_only.workspace.select("L1.H2")
    assert set(_menu(lens_only)) == {"menu-ablate", "menu-scale", "menu-scale-factor"}
    assert lens_only.menu_actions("L0.MLP") == []


def test_menu_ablate_pushes_the_head_ablation_the_lens_shows(gallery, tiny_model, notes):
    g = gallery()
    g.prompt = PROMPT
    lens = g.page("lens")
    g.workspace.select("L1.H2")
    _click(_menu(g)["menu-ablate"])
    assert g.workspace.edits == [Ablate(1, 2)]             # exactly the head's zero-ablation
    lens.wait()
    assert lens.edits == [Ablate(1, 2)]
    clean_ids, clean_p = hooked_lens(tiny_model, PROMPT)
    ab_ids, ab_p = hooked_lens(tiny_model, PROMPT, ablate=[(1, 2)])
    assert_lens_equal(lens.result, clean_ids, clean_p)
    assert_lens_equal(lens.edited_result, ab_ids, ab_p)
    assert not np.allclose(clean_p, ab_p)
    _click(_menu(g)["menu-ablate"])                        # a second click: not twice
    assert g.workspace.edits == [Ablate(1, 2)]
    assert notes[-1] == ("info", "ablate L1.H2 (zero) is on the edit stack already.")


def test_menu_scale_pushes_the_typed_factor(gallery, tiny_model, notes):
    g = gallery()
    g.prompt = PROMPT
    lens = g.page("lens")
    g.workspace.select("L1.H2")
    menu = _menu(g)
    menu["menu-scale-factor"].value = 0.25
    _click(menu["menu-scale"])
    assert g.workspace.edits == [Scale(1, 2, 0.25)]
    menu["menu-scale-factor"].value = None                 # an emptied box: a note, no edit
    _click(menu["menu-scale"])
    assert g.workspace.edits == [Scale(1, 2, 0.25)]
    assert notes[-1][0] == "warning" and "type a scale factor" in notes[-1][1]
    menu["menu-scale-factor"].value = 0.0                  # x 0.25 then x 0: the head's output is 0
    _click(menu["menu-scale"])
    assert g.workspace.edits == [Scale(1, 2, 0.25), Scale(1, 2, 0.0)]
    lens.wait()
    assert_lens_equal(lens.edited_result, *hooked_lens(tiny_model, PROMPT, ablate=[(1, 2)]))


def test_menu_show_attention_opens_the_page_with_the_head_enlarged(gallery):
    g = gallery()
    g.workspace.select("L1.H2")
    _click(_menu(g)["menu-attention"])
    attention = g.pages["attention"]
    assert g.view == "attention"
    assert g._main.select(lambda o: "attention-head" in (getattr(o, "css_classes", None) or []))
    assert attention.selected == "L1.H2" and (attention.layer, attention.head) == (1, 2)
    assert g.workspace.selected == ["L1.H2"]


def test_menu_show_circuit_edges_selects_an_mlp_on_the_circuits_page(gallery):
    g = gallery()
    circuits = g.page("circuits")
    g.workspace.select("L1.H2", "L0.MLP")
    g.view = "circuits"                                    # a page follows when in view
    assert circuits.selected == "L1.H2"                    # pages follow the newest *head*
    _click(_menu(g)["menu-circuit"])
    assert g.view == "circuits" and circuits.selected == "L0.MLP"
    assert g.workspace.selected == ["L1.H2", "L0.MLP"]     # the menu does not re-select


class _Blank(pn.viewable.Viewer):
    def __init__(self, model=None, **params):
        super().__init__(**params)

    def __panel__(self):
        return pn.pane.Markdown("blank")


class _JuiceConflicts(_Blank):
    """A conflicts page that records what the menu adds to its JuICE sets."""
    built = 0

    def __init__(self, model=None, **params):
        super().__init__(**params)
        type(self).built += 1
        self.calls = []

    def add_to_juice(self, component, which):
        self.calls.append((component, which))


def test_menu_juice_buttons_call_the_conflicts_page(tiny_model, notes):
    views = [("Blank", "blank", _Blank), ("Knowledge conflicts", "conflicts", _JuiceConflicts)]
    g = Gallery("tiny-llama", views=views)
    try:
        _JuiceConflicts.built = 0
        g.workspace.select("L2.H3")
        menu = _menu(g)
        assert set(menu) == {"menu-ablate", "menu-scale", "menu-scale-factor",
                             "menu-juice-enhance", "menu-juice-suppress"}
        assert _JuiceConflicts.built == 0                  # offered without building the page
        _click(menu["menu-juice-enhance"])
        _click(menu["menu-juice-suppress"])
        assert g.pages["conflicts"].calls == [("L2.H3", "enhance"), ("L2.H3", "suppress")]
        assert g.view == "blank"                           # the user stays where they are
        assert notes[-1] == ("success", "Added L2.H3 to the JuICE set S- (suppress) on the "
                                        "Knowledge conflicts page.")
    finally:
        g.close()


def test_menu_juice_without_the_page_method_shows_a_note(tiny_model, notes):
    views = [("Blank", "blank", _Blank), ("Knowledge conflicts", "conflicts", _Blank)]
    g = Gallery("tiny-llama", views=views)
    try:
        g.workspace.select("L2.H3")
        card = g.component_menu()
        assert "menu-juice-enhance" not in _menu(g)
        assert [m for m in card.select(pn.pane.Markdown) if "menu-juice-note" in m.css_classes]
        assert g.add_to_juice("L2.H3", "enhance") is False
        assert notes[-1][0] == "warning" and "cannot take heads" in notes[-1][1]
    finally:
        g.close()


def test_menu_juice_on_the_real_conflicts_page(gallery):
    from apps.conflicts import ConflictsView

    if not hasattr(ConflictsView, "add_to_juice"):
        pytest.skip("the Knowledge conflicts page has no add_to_juice yet")
    g = gallery()
    g.workspace.select("L1.H2")
    _click(_menu(g)["menu-juice-enhance"])
    g.workspace.select("L0.H3")
    _click(_menu(g)["menu-juice-suppress"])
    conflicts = g.pages["conflicts"]
    assert list(conflicts.heads_plus) == ["L1.H2"] and list(conflicts.heads_minus) == ["L0.H3"]
    _click(_menu(g)["menu-juice-enhance"])                 # the page moves it to S+
    assert list(conflicts.heads_plus) == ["L1.H2", "L0.H3"] and list(conflicts.heads_minus) == []


def test_pasted_items_travel_in_the_exported_state(gallery):
    g = gallery()
    conflicts, icl = g.page("conflicts"), g.page("icl-heads")
    conflicts._own.area.value = user_items.CONFLICT_FORMAT   # pasted in the "Your own" boxes
    icl._own.area.value = user_items.ICL_FORMAT
    _click(icl._own.button)                                  # and used there
    assert icl.task == "your pairs"
    state = g.export_state()
    assert json.loads(state)["items"] == {"conflicts": user_items.CONFLICT_FORMAT,
                                          "icl-heads": user_items.ICL_FORMAT}

    fresh = gallery()
    conflicts2 = fresh.page("conflicts")                   # open before the import
    fresh.import_state(state)
    assert fresh.state_message.endswith("0 edit(s), 2 pasted item(s).")
    assert conflicts2._own.area.value == ""                # not in view: nothing runs yet
    fresh.view = "conflicts"                               # opened: it takes the item
    assert conflicts2._own.area.value == user_items.CONFLICT_FORMAT
    assert conflicts2.example.endswith("France (memory Paris, context Berlin)")  # applied
    assert conflicts2.example.count("yours") == 1            # one "yours:" on its label
    icl2 = fresh.page("icl-heads")                         # opened after the import
    assert icl2._own.area.value == user_items.ICL_FORMAT
    assert icl2.task == "your pairs" and icl2.error == ""
    assert icl2._own_task.pairs[:2] == (("hot", "cold"), ("big", "small"))
    fresh.page("conflicts")._own.area.value = ""           # emptied: gone from the state
    assert json.loads(fresh.export_state())["items"] == {"icl-heads": user_items.ICL_FORMAT}


def test_a_bad_pasted_item_comes_back_with_the_page_message(gallery):
    g = gallery()
    g.page("conflicts")._own.area.value = "prompt: only a prompt"
    fresh = gallery()
    fresh.import_state(g.export_state())
    conflicts = fresh.page("conflicts")
    assert conflicts._own.area.value == "prompt: only a prompt"
    assert conflicts.error and "\n" not in conflicts.error    # the parser's one line, kept
    assert not conflicts.example.startswith("yours")


def test_a_state_with_malformed_items_changes_nothing(gallery):
    g = gallery()
    g.page("conflicts")._own.area.value = "kept"
    state = json.loads(g.export_state())
    state["items"] = {"conflicts": 42}
    g.import_state(json.dumps(state))
    assert g.state_message == ("Could not import the state: the state's 'items': the item "
                               "pasted on 'conflicts' must be text; got a JSON number.")
    assert g.workspace.items == {"conflicts": "kept"}
    assert g.pages["conflicts"]._own.area.value == "kept"



_wait_until = functools.partial(wait_until, timeout=10.0, interval=0.01)


def test_the_stop_button_is_live_only_while_the_session_has_background_jobs(gallery):
    """The sidebar's "Stop running work" is disabled and plain while nothing runs, orange
    and enabled while a background job is submitted and not finished, plain again once the
    job has ended; the gallery's stop (the button's click) cancels a running job."""
    import threading

    from apps._session import Runner

    g = gallery()
    stop = next(w for w in g.sidebar() if "stop-work" in (getattr(w, "css_classes", None) or []))
    assert stop.disabled and stop.button_type == "light"
    started, release = threading.Event(), threading.Event()
    results = []

    def job(token):
        started.set()
        while not release.wait(0.01):
            token.check()
        return "done"

    runner = Runner(on_result=results.append, on_error=results.append,
                    on_busy=lambda _busy: None, background=True)
    runner.submit(job)
    assert started.wait(10)
    assert not stop.disabled and stop.button_type == "warning"
    release.set()
    runner.wait(10)
    assert _wait_until(lambda: stop.disabled)
    assert stop.button_type == "light" and results == ["done"]

    started.clear()
    release.clear()
    runner.submit(job)
    assert started.wait(10) and not stop.disabled
    g.stop()
    runner.wait(10)
    assert _wait_until(lambda: stop.disabled)
    assert results == ["done"]          # the cancelled job delivered nothing
    runner.close()
