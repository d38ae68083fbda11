"""The gallery's selection beyond components, headless on tiny-llama: the sidebar's chips show
edges and positions (each removable), the *Add to selection* box reads the one spelling, and
a page's ``selected_edges`` / ``selected_positions`` follow the workspace both ways."""
from __future__ import annotations

import panel as pn
import param
import pytest

from apps.gallery import Gallery
from explorer._checks import InputError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class _Page(pn.viewable.Viewer):
    """A page sharing edges and positions (as the Circuits, Saturation and Attention pages do)."""

    selected_edges = param.List(default=[], item_type=str)
    selected_positions = param.List(default=[], item_type=int)

    def __panel__(self):
        return pn.pane.Markdown("page")


@pytest.fixture
def gallery(tiny_model):
    g = Gallery("tiny-llama", views=[("A", "a", lambda m: _Page()), ("B", "b", lambda m: _Page())])
    yield g
    g.close()


def _widgets(g):
    parts = g.workspace_widgets()
    chips = next(w for w in parts if isinstance(w, pn.widgets.MultiChoice))
    add = next(w for w in parts if isinstance(w, pn.widgets.TextInput))
    message = next(w for w in parts if isinstance(w, pn.pane.Markdown)
                   and "workspace-add-message" in w.css_classes)
    return chips, add, message


def test_typed_names_are_read_with_the_one_spelling(gallery):
    chips, add, message = _widgets(gallery)
    ws = gallery.workspace
    add.value = "a1.h2, a0.h1->m2; pos 1"                    # as typed, then Enter
    assert ws.selected == ["L1.H2"] and ws.selected_edges == ["L0.H1->L2.MLP"]
    assert ws.selected_positions == [1] and add.value == ""
    assert chips.value == ["L1.H2", "L0.H1->L2.MLP", "P1"]
    assert "L0.H1->L2.MLP" in chips.options and "P1" in chips.options
    add.value = "L1.H2"                                       # again: nothing new, no other head
    assert ws.selection == ["L1.H2", "L0.H1->L2.MLP", "P1"]
    add.value = "L2.H0, L2.MLP->L1.H0"                        # one bad name: nothing added
    assert ws.selection == ["L1.H2", "L0.H1->L2.MLP", "P1"]
    assert message.visible and "goes backwards" in message.object
    assert add.value == "L2.H0, L2.MLP->L1.H0"                # kept for the user to fix
    add.value = "L2.H0"
    assert not message.visible and ws.selected == ["L1.H2", "L2.H0"]
    with pytest.raises(InputError, match="out of range"):
        gallery.add_to_selection("P999")


def test_a_removed_chip_drops_it_and_keeps_the_selection_order(gallery):
    chips, _, _ = _widgets(gallery)
    ws = gallery.workspace
    ws.select("L2.H1", "L0.H0", "input->L1.MLP", "P2", "P0")
    chips.value = ["L0.H0", "L2.H1", "P0", "P2"]               # the edge's ✕; option order
    assert ws.selected == ["L2.H1", "L0.H0"] and ws.selected_edges == []
    assert ws.selected_positions == [2, 0]                    # not reordered by the widget
    chips.value = ["L0.H0", "L2.H1", "P0", "P2", "L1.MLP"]      # a pick from the list
    assert ws.selected[-1] == "L1.MLP"


def test_pages_share_edges_and_positions_both_ways(gallery, notes):
    ws = gallery.workspace
    ws.select("L0.H1->L1.MLP", "P1")
    a = gallery.page("a")
    assert a.selected_edges == ["L0.H1->L1.MLP"] and a.selected_positions == [1]
    a.selected_positions = [1, 2]                              # a click on token 2
    a.selected_edges = []                                      # a click on the selected edge
    assert ws.selected_positions == [1, 2] and ws.selected_edges == []
    b = gallery.page("b")
    assert b.selected_positions == [1, 2]
    ws.deselect("P1")                                          # the page in view follows
    assert a.selected_positions == [2] and b.selected_positions == [1, 2]
    gallery.view = "b"                                         # the other when opened
    assert b.selected_positions == [2]
    gallery.view = "a"
    a.selected_positions = [2, 999]                            # past the prompt: refused
    assert ws.selected_positions == [2] and a.selected_positions == [2]
    assert "out of range" in notes[-1][1]
    gallery.prompt = "Hi"                                      # shorter prompt
    n = ws.n_tokens
    assert a.selected_positions == [p for p in [2] if p < n] == ws.selected_positions
