"""The one component spelling: every accepted older spelling reads to the same component, the
canonical form round-trips, and bad names get a clear error."""
import pytest

from explorer import components as comp
from explorer.analyses import circuits as ca


@pytest.mark.parametrize("text, canonical", [
    ("L17.H3", "L17.H3"), ("l17h3", "L17.H3"), ("L20H5", "L20.H5"), ("a14.h2", "L14.H2"),
    ("L0.MLP", "L0.MLP"), ("m7", "L7.MLP"), ("L7mlp", "L7.MLP"), ("L29", "L29"),
    (" input ", "input"), ("Logits", "logits"), ("embeddings", "input"),
])
def test_spellings_read_to_one_component(text, canonical):
    assert comp.canonical(text) == canonical
    assert str(comp.parse(canonical)) == canonical  # the canonical form is a fixed point


def test_round_trip_over_every_component_of_a_model():
    names = ([str(comp.head(l, h)) for l in range(30) for h in range(9)]
             + [str(comp.mlp(l)) for l in range(30)] + [str(comp.layer(l)) for l in range(30)]
             + ["input", "logits"])
    parsed = [comp.parse(n) for n in names]
    assert [str(c) for c in parsed] == names
    assert len(set(parsed)) == len(names)


def test_circuit_graph_node_names_map_onto_the_spelling():
    expected = ["input", "L0.H0", "L0.H1", "L0.H2", "L0.MLP", "L1.H0", "L1.H1", "L1.H2",
                "L1.MLP", "logits"]
    raw = ["input"] + [n for l in range(2) for n in [f"a{l}.h{h}" for h in range(3)] + [f"m{l}"]]
    raw.append("logits")
    assert [comp.canonical(n) for n in raw] == expected
    assert [comp.canonical(n) for n in ca._graph(2, 3).nodes] == expected


@pytest.mark.parametrize("bad", ["", "L", "H3", "L3.H", "L-1.H2", "layer 3", "a3", "L3.H2.x", "3"])
def test_bad_names_get_a_clear_error(bad):
    with pytest.raises(comp.ComponentError, match="L17.H3"):
        comp.parse(bad)


def test_range_check_against_the_model_shape():
    assert comp.check_in_model("L29.H8", 30, 9) == comp.head(29, 8)
    with pytest.raises(comp.ComponentError, match="layers 0..29"):
        comp.check_in_model("L30.H0", 30, 9)
    with pytest.raises(comp.ComponentError, match="heads 0..8"):
        comp.check_in_model("L3.H9", 30, 9)
    assert comp.check_in_model("logits", 30, 9) is comp.LOGITS


def test_parse_many_keeps_order_and_drops_repeats():
    assert [str(c) for c in comp.parse_many("L3.H1, a3.h1 L2.MLP;logits")] == [
        "L3.H1", "L2.MLP", "logits"]
    with pytest.raises(comp.ComponentError):
        comp.parse_many("L3.H1, nonsense")


def test_constructor_refuses_inconsistent_parts():
    with pytest.raises(comp.ComponentError):
        comp.Component("head", 3)
    with pytest.raises(comp.ComponentError):
        comp.Component("input", 3)
    with pytest.raises(comp.ComponentError):
        comp.Component("mlp", 3, 1)
