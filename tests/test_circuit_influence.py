"""Influence pruning of a circuit (circuit-tracer's prune_graph on the head/MLP graph),
checked on a graph worked by hand and against independent computations (a matrix inverse for
the influence, networkx's enumeration of every path for the strongest paths)."""
from __future__ import annotations

from fractions import Fraction as F

import networkx as nx
import numpy as np
import pytest
import xarray as xr

from explorer.analyses import circuit_influence as ci

# one layer, two heads: input -> heads -> MLP -> logits, every edge present
EDGES = [("input", "a0.h0", 3.0), ("input", "a0.h1", 1.0), ("input", "m0", 1.0),
         ("input", "logits", 1.0), ("a0.h0", "m0", 2.0), ("a0.h0", "logits", 1.0),
         ("a0.h1", "m0", -1.0), ("a0.h1", "logits", 0.5), ("m0", "logits", -2.0)]


def scores_of(edges):
    return xr.Dataset({"score": ("edge", np.array([e[2] for e in edges], dtype=np.float32))},
                      coords={"src": ("edge", [e[0] for e in edges]),
                              "dst": ("edge", [e[1] for e in edges])})


def drawn_pairs(ds, edges):
    return {(s, d) for (s, d, _), k in zip(edges, ds["drawn"].values) if k}


def test_influence_on_the_hand_worked_graph():
    scores = scores_of(EDGES)
    ds = ci.influence_pruning(scores, np.ones(len(EDGES), bool), node_threshold=0.8,
                              edge_threshold=0.9)
    # By hand, rows of Â: logits reads input 2/9, h0 2/9, h1 1/9, m0 4/9; m0 reads input
    # 1/4, h0 1/2, h1 1/4; each head reads the input alone. Influence w @ (Â + Â² + ...):
    # m0 4/9, h0 2/9 + 1/2 * 4/9 = 4/9, h1 1/9 + 1/4 * 4/9 = 2/9, input 1.
    want = dict(zip(["input", "a0.h0", "a0.h1", "m0", "logits"],
                    [F(1), F(4, 9), F(2, 9), F(4, 9), F(0)]))
    got = dict(zip(ds["node"].values.tolist(), ds["node_influence"].values.tolist()))
    assert got == pytest.approx({k: float(v) for k, v in want.items()})
    # edge influence Â[t, s] * (influence[t] + w[t]) on the whole circuit; total 19/9
    e_want = [F(4, 9), F(2, 9), F(1, 9), F(2, 9), F(2, 9), F(2, 9), F(1, 9), F(1, 9), F(4, 9)]
    assert ds["influence"].values == pytest.approx([float(v) for v in e_want])
    # nodes: sorted 1, 4/9, 4/9, 2/9, 0 of 19/9 -> 0.47, 0.68, 0.89 >= 0.8 at the third:
    # threshold 4/9 keeps input, h0, m0 (and logits); h1 goes.
    assert dict(zip(ds["node"].values, ds["node_kept"].values)) == {
        "input": True, "a0.h0": True, "a0.h1": False, "m0": True, "logits": True}
    # without h1 the edge influences are 7/12 (input->h0), 1/2 (m0->logits), 1/3 (h0->m0),
    # 1/4, 1/4 (input->logits, h0->logits), 1/6 (input->m0), of 25/12: cumulative 0.28,
    # 0.52, 0.68, 0.80, 0.92 >= 0.9 at the fifth -> threshold 1/4 drops input->m0 only.
    assert drawn_pairs(ds, EDGES) == {("input", "a0.h0"), ("m0", "logits"), ("a0.h0", "m0"),
                                      ("input", "logits"), ("a0.h0", "logits")}
    # the drawn share, in the whole circuit's influence: (4 + 4 + 2 + 2 + 2) / 19
    assert ds.attrs["drawn_share"] == pytest.approx(14 / 19)
    assert ds.attrs["n_drawn"] == 5 and ds.attrs["n_circuit"] == 9


def test_the_last_pass_drops_nodes_left_without_an_in_or_out_edge():
    scores = scores_of(EDGES)
    # edge threshold 0.5: 7/12 and 1/2 (cumulative 0.52) pass: input -> h0 and m0 -> logits;
    # h0 then has no out-edge and m0 no in-edge, so both go, with their edges
    ds = ci.influence_pruning(scores, np.ones(len(EDGES), bool), edge_threshold=0.5)
    assert drawn_pairs(ds, EDGES) == set()
    assert ds.attrs["drawn_share"] == 0.0
    kept = dict(zip(ds["node"].values, ds["node_kept"].values))
    assert kept == {"input": True, "a0.h0": False, "a0.h1": False, "m0": False, "logits": True}
    # 0.6: 7/12, 1/2, 1/3 pass (0.68): input -> h0 -> m0 -> logits, a whole path
    ds = ci.influence_pruning(scores, np.ones(len(EDGES), bool), edge_threshold=0.6)
    assert drawn_pairs(ds, EDGES) == {("input", "a0.h0"), ("a0.h0", "m0"), ("m0", "logits")}
    assert ds.attrs["drawn_share"] == pytest.approx(10 / 19)


def random_graph(rng, n_layers=3, n_heads=3, p=0.6):
    nodes = ["input"] + [n for layer in range(n_layers)
                         for n in [f"a{layer}.h{h}" for h in range(n_heads)] + [f"m{layer}"]]
    nodes.append("logits")
    edges = [(s, d, float(rng.normal())) for i, s in enumerate(nodes) for d in nodes[i + 1:]
             if d != "input" and rng.random() < p]
    return nodes, edges


def test_influence_equals_the_matrix_inverse_and_paths_the_enumerated_best():
    rng = np.random.default_rng(3)
    nodes, edges = random_graph(rng)
    scores = scores_of(edges)
    mask = rng.random(len(edges)) < 0.8
    ds = ci.influence_pruning(scores, mask)
    # independent: B = (I - Â)^-1 - I, influence = w @ B, with Â built here
    index = {n: i for i, n in enumerate(nodes)}
    a = np.zeros((len(nodes), len(nodes)))
    stored = scores["score"].values.astype(np.float64)   # the float32 scores as stored
    for (s, d, _), v, m in zip(edges, stored, mask):
        if m:
            a[index[d], index[s]] += abs(v)
    a_hat = a / np.maximum(a.sum(1, keepdims=True), 1e-10)
    w = np.zeros(len(nodes))
    w[-1] = 1
    infl = w @ (np.linalg.inv(np.eye(len(nodes)) - a_hat) - np.eye(len(nodes)))
    got = dict(zip(ds["node"].values.tolist(), ds["node_influence"].values.tolist()))
    for n in got:
        assert got[n] == pytest.approx(infl[index[n]], abs=1e-12)
    e = [a_hat[index[d], index[s]] * (infl[index[d]] + w[index[d]]) if m else 0.0
         for (s, d, _), m in zip(edges, mask)]
    assert ds["influence"].values == pytest.approx(e, abs=1e-12)
    # drawn share is the drawn edges' sum over the circuit's
    assert ds.attrs["drawn_share"] == pytest.approx(
        sum(v for v, k in zip(e, ds["drawn"].values) if k) / sum(e))
    # strongest paths: networkx enumerates every simple path, product of Â along it
    g = nx.DiGraph()
    for (s, d, _), m in zip(edges, mask):
        if m:
            g.add_edge(s, d, w=a_hat[index[d], index[s]])
    paths = ci.strongest_paths(scores, mask)

    def product(path):
        return float(np.prod([g.edges[u, v]["w"] for u, v in zip(path, path[1:])]))

    def as_nodes(idx):
        return [edges[i][0] for i in idx] + ([edges[idx[-1]][1]] if idx else [])

    checked = 0
    for node, (back, fwd) in paths.items():
        for start, end, got_path in (("input", node, back), (node, "logits", fwd)):
            if start == end:
                assert got_path == []
                continue
            every = list(nx.all_simple_paths(g, start, end)) if start in g and end in g else []
            if not every:
                assert got_path == []
                continue
            best = max(product(p) for p in every)
            assert as_nodes(got_path)[0] == start and as_nodes(got_path)[-1] == end
            assert product(as_nodes(got_path)) == pytest.approx(best, rel=1e-12)
            checked += 1
    assert checked > 10


def test_bad_arguments_are_named():
    scores = scores_of(EDGES)
    with pytest.raises(ValueError, match=r"`node_threshold` must be a number in \[0, 1\]; got 1.5"):
        ci.influence_pruning(scores, np.ones(len(EDGES), bool), node_threshold=1.5)
    with pytest.raises(ValueError, match="`in_circuit` must be a bool array over the 9 edges"):
        ci.influence_pruning(scores, np.ones(3, bool))
