"""The one component spelling: every accepted older spelling reads to the same component, the
canonical form round-trips, and bad names get a clear error."""
import pytest

from explorer import components as comp
from explorer.analyses.circuits.graph import _graph


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
    assert [comp.canonical(n) for n in _graph(2, 3).nodes] == expected


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


# -- edges ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, canonical", [
    ("L3.H1->L5.MLP", "L3.H1->L5.MLP"), ("a3.h1->m5", "L3.H1->L5.MLP"),
    (" input -> L0.H2 ", "input->L0.H2"), ("L29.MLP->logits", "L29.MLP->logits"),
    ("m29->logits", "L29.MLP->logits"), ("L3H1 → L3mlp", "L3.H1->L3.MLP"),
    ("embed->unembed", "input->logits"), ("L0.MLP->L1.H0", "L0.MLP->L1.H0"),
])
def test_edge_spellings_read_to_one_edge(text, canonical):
    e = comp.parse_edge(text)
    assert str(e) == canonical and comp.canonical_any(text) == canonical
    assert comp.parse_edge(canonical) == e and comp.parse_any(canonical) == e


def test_every_circuit_graph_edge_round_trips_and_no_other_pair_is_an_edge():
    # the circuit analysis's own [src, dst] mask decides which pairs are edges; the spelling's
    # forward-in-depth rule must accept exactly those (sequential and parallel attn/MLP)
    for parallel in (False, True):
        g = _graph(3, 2, parallel)
        graph_edges = {(comp.canonical(s), comp.canonical(t)) for s, t in g.edges}
        accepted = set()
        for s in g.nodes:
            for t in g.nodes:
                try:
                    e = comp.check_edge_in_model(f"{s}->{t}", 3, 2, parallel=parallel)
                except comp.ComponentError:
                    continue
                accepted.add((str(e.src), str(e.dst)))
                assert str(comp.parse_edge(str(e))) == str(e)
        assert accepted == graph_edges and len(graph_edges) == len(g.edges)


@pytest.mark.parametrize("bad, match", [
    ("L5.MLP->L3.H1", "backwards"), ("L3.MLP->L3.H0", "backwards"),
    ("L3.H1->L3.H2", "heads of one layer"), ("L3.H1->L3.H1", "self edge"),
    ("input->input", "self edge|target"), ("L3->L4.H1", "whole layer"),
    ("L2.H0->L4", "whole layer"), ("logits->L3.H1", "source"), ("L3.H1->input", "target"),
    ("L3.H1->", "SRC->DST"), ("->L3.H1", "SRC->DST"), ("L3.H1 L5.MLP", "L17.H3"),
    ("L3.H1->L4.H1->L5.MLP", "SRC->DST"), ("x->L3.H1", "cannot read component 'x'"),
    ("L3.H1-L5.MLP", "L17.H3"),
])
def test_bad_edges_get_a_clear_error(bad, match):
    with pytest.raises(comp.ComponentError, match=match):
        comp.parse_any(bad)


def test_edge_range_check_against_the_model_shape():
    assert comp.check_edge_in_model("a29.h8->logits", 30, 9) == comp.edge("L29.H8", "logits")
    with pytest.raises(comp.ComponentError, match="layers 0..29"):
        comp.check_edge_in_model("L3.H1->L30.MLP", 30, 9)
    with pytest.raises(comp.ComponentError, match="heads 0..8"):
        comp.check_edge_in_model("L3.H9->L4.MLP", 30, 9)
    with pytest.raises(comp.ComponentError, match="reads what its layer's heads read"):
        comp.check_edge_in_model("L3.H1->L3.MLP", 30, 9, parallel=True)
    with pytest.raises(comp.ComponentError, match="Component"):
        comp.Edge("L3.H1", comp.LOGITS)


# -- token positions --------------------------------------------------------------------------------

@pytest.mark.parametrize("text, index", [
    ("P5", 5), ("p5", 5), ("pos 5", 5), ("pos5", 5), ("POS=12", 12), (" P0 ", 0), (3, 3),
])
def test_position_spellings(text, index):
    p = comp.parse_any(text)
    assert p == comp.Position(index) and str(p) == f"P{index}"
    assert comp.parse_any(str(p)) == p


def test_position_round_trip_and_order():
    names = [f"P{i}" for i in range(64)]
    assert [str(comp.parse_position(n)) for n in names] == names
    assert sorted(comp.parse_position(n) for n in reversed(names)) == [comp.Position(i) for i in range(64)]
    assert comp.parse_position("7") == comp.Position(7)  # alone, a bare number is a position


@pytest.mark.parametrize("bad", ["P", "pos", "P-1", "pos -1", "P5.2", "P 5x", "Q5", True, 2.0])
def test_bad_positions_get_a_clear_error(bad):
    with pytest.raises(comp.ComponentError, match="P5"):
        comp.parse_position(bad)


def test_bare_number_is_not_read_as_anything_by_parse_any():
    with pytest.raises(comp.ComponentError, match="P5"):  # "5": a layer? a position? neither
        comp.parse_any("5")


def test_position_checked_against_the_prompt_length():
    assert comp.check_position("P5", 6) == comp.Position(5)
    assert comp.check_position("P5", None) == comp.Position(5)       # length unknown: not checked
    with pytest.raises(comp.ComponentError, match=r"6 tokens \(positions P0..P5\)"):
        comp.check_position("P6", 6)
    with pytest.raises(comp.ComponentError, match="0 tokens"):
        comp.check_position(0, 0)
    with pytest.raises(comp.ComponentError, match=">= 0"):
        comp.Position(-1)


def test_check_any_dispatches_on_the_kind():
    assert comp.check_any("a1.h0->m1", 2, 3) == comp.edge("L1.H0", "L1.MLP")
    assert comp.check_any("pos 1", 2, 3, n_tokens=2) == comp.Position(1)
    assert comp.check_any("L1.MLP", None, None) == comp.mlp(1)           # shape unknown
    with pytest.raises(comp.ComponentError, match="out of range"):
        comp.check_any("L2.H0", 2, 3)
    with pytest.raises(comp.ComponentError, match="out of range"):
        comp.check_any("P2", 2, 3, n_tokens=2)
    with pytest.raises(comp.ComponentError, match="layers 0..1"):
        comp.check_any("L1.H0->L2.MLP", 2, 3)


@pytest.mark.parametrize("text", ["L5.F123", "l5.f123", "L5 F123", " L5 . F123 "])
def test_a_feature_has_one_spelling(text):
    f = comp.parse_any(text)
    assert isinstance(f, comp.Feature) and (f.layer, f.index) == (5, 123)
    assert str(f) == comp.canonical_any(text) == "L5.F123"


def test_a_feature_is_checked_against_the_models_depth():
    assert comp.check_any("L2.F9", 3, 4) == comp.Feature(2, 9)
    with pytest.raises(comp.ComponentError, match=r"L3.F0 is out of range: the model has 3 "
                                                  r"layers \(L0..L2\)"):
        comp.check_any("L3.F0", 3, 4)
    for bad in ("L5.F", "F12", "L5.Fx"):
        with pytest.raises(comp.ComponentError):
            comp.parse_feature(bad)
    with pytest.raises(comp.ComponentError, match="dictionary feature as L5.F123"):
        comp.parse_any("L5.Q1")
