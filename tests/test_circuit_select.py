"""Circuit selection rules (explorer/analyses/circuit_select.py): the greedy construction of
Hanna et al. 2024 and its dead-node pruning against a hand-worked graph and a plain-Python
transcription of hannamw/EAP-IG's ``apply_greedy`` / ``prune_dead_nodes``; the curve of a
rule by patching, the bootstrap interval, and the default-circuit entry on tiny-llama."""
from __future__ import annotations

import heapq

import numpy as np
import pytest
import xarray as xr

from explorer._checks import InputError
from explorer.analyses import circuit_select as cs
from explorer.analyses import circuits as ca
from explorer.analyses.circuit_tasks import CircuitTask

PAIRS = CircuitTask(
    clean=["The quick brown fox jumps over", "One two three four five six"],
    corrupt=["The quick brown dog jumps over", "One two three four nine six"],
    answer=[" the", " seven"], wrong=[" a", " ten"], name="toy")


def table(edges: dict[tuple[str, str], float]) -> xr.Dataset:
    """A score table over the given (src, dst) edges, as edge_scores lays it out."""
    src = [s for s, _ in edges]
    dst = [d for _, d in edges]
    return xr.Dataset({"score": ("edge", np.array(list(edges.values()), dtype=np.float32))},
                      coords={"src": ("edge", src), "dst": ("edge", dst)})


def names(scores: xr.Dataset, mask) -> set[tuple[str, str]]:
    return {(str(s), str(d)) for s, d, m in zip(scores["src"].values, scores["dst"].values,
                                                np.asarray(mask)) if m}


# One layer, two heads: every edge of the head/MLP graph, scores chosen so that top-n and
# greedy differ (input -> a0.h1 is strong, but a0.h1 only joins through a0.h1 -> logits).
HAND = {("input", "a0.h0"): 4.0, ("input", "a0.h1"): 4.5, ("input", "m0"): 0.5,
        ("a0.h0", "m0"): 2.0, ("a0.h1", "m0"): 0.1, ("input", "logits"): 0.05,
        ("a0.h0", "logits"): 0.3, ("a0.h1", "logits"): -3.0, ("m0", "logits"): 5.0}


def test_greedy_on_a_hand_worked_graph():
    s = table(HAND)
    # steps: m0->logits (5; m0 joins), a0.h1->logits (|-3|; a0.h1 joins), input->a0.h1 (4.5),
    # a0.h0->m0 (2; a0.h0 joins), input->a0.h0 (4), input->m0 (0.5), a0.h0->logits (0.3)
    g3 = cs.greedy_circuit(s, 3)
    # m0 has no in-edge after 3 steps: m0 -> logits is a dead end and goes
    assert names(s, g3) == {("a0.h1", "logits"), ("input", "a0.h1")}
    assert g3.attrs["n_chosen"] == 3 and g3.attrs["rule"] == "greedy"
    assert names(s, cs.greedy_circuit(s, 4)) == {("a0.h1", "logits"), ("input", "a0.h1")}
    assert names(s, cs.greedy_circuit(s, 5)) == {
        ("m0", "logits"), ("a0.h1", "logits"), ("input", "a0.h1"), ("a0.h0", "m0"),
        ("input", "a0.h0")}
    assert names(s, cs.greedy_circuit(s, 6)) == names(s, cs.greedy_circuit(s, 5)) | {
        ("input", "m0")}
    assert not cs.greedy_circuit(s, 0).any()
    assert int(cs.greedy_circuit(s, 9).sum()) == 9
    # top-n of the same size: the three strongest edges hold no input -> logits path
    assert not ca.select_circuit(s, top_n=3).any()
    assert names(s, cs.circuit_by_rule(s, 3, "top-n")) == set()
    # signed: a0.h1 -> logits (-3) ranks last, so a0.h0 -> m0 (2) is step 2
    assert names(s, cs.greedy_circuit(s, 3, absolute=False)) == {
        ("m0", "logits"), ("a0.h0", "m0"), ("input", "a0.h0")}


def test_prune_dead_nodes_on_a_hand_worked_graph():
    s = table(HAND)
    keys = list(HAND)
    # a0.h0 -> m0 without an edge into a0.h0 (parentless), input -> a0.h1 without an edge out
    # of a0.h1 (childless), m0 -> logits fed only by the parentless a0.h0
    chosen = np.array([k in {("a0.h0", "m0"), ("input", "a0.h1"), ("m0", "logits"),
                             ("input", "logits")} for k in keys])
    assert names(s, cs.prune_dead_nodes(s, chosen)) == {("input", "logits")}


# -- a plain-Python transcription of hannamw/EAP-IG (commit 0edbdd7, the paper's) ------------

class _Node:
    def __init__(self, name):
        self.name, self.in_graph = name, False
        self.parent_edges, self.child_edges = [], []


class _Edge:
    def __init__(self, parent, child, score):
        self.parent, self.child, self.score, self.in_graph = parent, child, score, False


def paper_greedy(scores: xr.Dataset, n_edges: int, order: list[str],
                 absolute: bool = True) -> set[tuple[str, str]]:
    """Graph.apply_greedy then Graph.prune_dead_nodes, line by line, on node/edge objects."""
    nodes = {n: _Node(n) for n in order}
    edges = []
    for s, d, v in zip(scores["src"].values, scores["dst"].values, scores["score"].values):
        e = _Edge(nodes[str(s)], nodes[str(d)], float(v))
        e.parent.child_edges.append(e)
        e.child.parent_edges.append(e)
        edges.append(e)
    nodes["logits"].in_graph = True
    key = (lambda e: abs(e.score)) if absolute else (lambda e: e.score)
    stream = heapq.merge(sorted([e for e in edges if e.child.in_graph], key=key, reverse=True),
                         key=key, reverse=True)
    while n_edges > 0:
        n_edges -= 1
        top = next(stream)
        top.in_graph = True
        if not top.parent.in_graph:
            top.parent.in_graph = True
            stream = heapq.merge(stream, sorted(top.parent.parent_edges, key=key, reverse=True),
                                 key=key, reverse=True)
    # prune_dead_nodes(prune_childless=True, prune_parentless=True)
    nodes["logits"].in_graph = any(e.in_graph for e in nodes["logits"].parent_edges)
    for node in reversed([nodes[n] for n in order]):
        if node.name == "logits":
            continue
        if any(e.in_graph for e in node.child_edges):
            node.in_graph = True
        else:
            node.in_graph = False
            for e in node.parent_edges:
                e.in_graph = False
    for node in (nodes[n] for n in order):
        if node.name != "input" and node.in_graph and not any(e.in_graph for e in node.parent_edges):
            node.in_graph = False
            for e in node.child_edges:
                e.in_graph = False
    return {(e.parent.name, e.child.name) for e in edges if e.in_graph}


def random_table(graph: ca.CircuitGraph, seed: int) -> xr.Dataset:
    rng = np.random.default_rng(seed)
    # heavy tails, like real scores; distinct values, so no ties to break
    vals = rng.standard_t(2, size=len(graph.edges))
    return table({e: float(v) for e, v in zip(graph.edges, vals)})


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_matches_the_papers_code_on_random_scores(tiny_model, seed):
    graph = ca.circuit_graph(tiny_model)
    s = random_table(graph, seed)
    for n in [1, 3, 8, 20, 40, len(graph.edges) // 2, len(graph.edges)]:
        for absolute in (True, False):
            ours = names(s, cs.greedy_circuit(s, n, absolute=absolute))
            assert ours == paper_greedy(s, n, list(graph.nodes), absolute), (n, absolute)


@pytest.mark.parametrize("seed", [0, 1])
def test_prune_dead_nodes_keeps_what_select_circuit_keeps(tiny_model, seed):
    """The paper's two-pass pruning and the graph search of select_circuit give one set."""
    s = random_table(ca.circuit_graph(tiny_model), seed)
    order = np.argsort(-np.abs(s["score"].values), kind="stable")
    for n in [2, 5, 10, 25, 60, 100]:
        chosen = np.zeros(s.sizes["edge"], dtype=bool)
        chosen[order[:n]] = True
        assert names(s, cs.prune_dead_nodes(s, chosen)) == names(s, ca.select_circuit(s, top_n=n))


def test_greedy_edges_all_lead_to_the_logits(tiny_model):
    """Before pruning every greedy edge ends in a node already joined to the logits, so
    pruning only removes chains that never reach the input."""
    s = random_table(ca.circuit_graph(tiny_model), 5)
    for n in [5, 30]:
        g = cs.greedy_circuit(s, n)
        assert g.attrs["n_chosen"] == n
        kept = names(s, g)
        into = {d for _, d in kept}
        outof = {a for a, _ in kept}
        assert all(d == "logits" or d in outof for d in into)
        assert all(a == "input" or a in into for a in outof)


def test_rules_reject_bad_arguments():
    s = table(HAND)
    with pytest.raises(InputError, match="rule"):
        cs.circuit_by_rule(s, 3, "greediest")
    with pytest.raises(InputError, match="n_edges"):
        cs.greedy_circuit(s, 10)
    with pytest.raises(TypeError, match="absolute"):
        cs.greedy_circuit(s, 3, absolute="yes")
    with pytest.raises(TypeError, match="scores"):
        cs.greedy_circuit(s["score"], 3)
    with pytest.raises(InputError, match="in_circuit"):
        cs.prune_dead_nodes(s, np.ones(3, dtype=bool))


def test_default_sizes_are_log_spaced_and_capped():
    assert cs.default_sizes(44371, 1000, n_points=4) == [10, 46, 215, 1000]
    assert cs.default_sizes(50, 300, n_points=3) == [10, 22, 50]
    assert cs.default_sizes(5, 300) == [5]


# -- curves on tiny-llama ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def scores(tiny_model):
    return ca.edge_scores(tiny_model, PAIRS)


def test_top_n_curve_matches_faithfulness_curve(tiny_model, scores):
    sizes = [0, 5, 20, 80, scores.sizes["edge"]]
    ours = cs.rule_faithfulness_curve(tiny_model, PAIRS, scores, sizes=sizes, rule="top-n",
                                      per_pair=True)
    ref = ca.faithfulness_curve(tiny_model, PAIRS, scores, sizes=sizes)
    np.testing.assert_allclose(ours["metric"].values, ref["metric"].values, atol=1e-4)
    np.testing.assert_allclose(ours["recovered"].values, ref["recovered"].values, atol=1e-4)
    np.testing.assert_array_equal(ours["n_kept"].values, ref["n_kept"].values)
    assert ours.attrs["clean_metric"] == pytest.approx(ref.attrs["clean_metric"], abs=1e-4)
    # per-pair values: each pair's own patched run
    one = ca.patch_edges_metric(tiny_model, PAIRS.subset([1]), scores,
                                ca.select_circuit(scores, top_n=20))
    assert float(ours["pair_metric"].sel(n_edges=20, prompt=1)) == pytest.approx(one["metric"],
                                                                                 abs=1e-5)
    assert float(ours["pair_clean_metric"][1]) == pytest.approx(one["clean_metric"], abs=1e-5)


def test_greedy_curve_patches_the_greedy_circuits(tiny_model, scores):
    curve = cs.rule_faithfulness_curve(tiny_model, PAIRS, scores, sizes=[0, 10, 40],
                                       rule="greedy")
    assert curve["recovered"].sel(n_edges=0) == pytest.approx(0.0, abs=1e-4)
    g = cs.greedy_circuit(scores, 10)
    direct = ca.patch_edges_metric(tiny_model, PAIRS, scores, g)
    assert float(curve["recovered"].sel(n_edges=10)) == pytest.approx(direct["recovered"], abs=1e-5)
    assert int(curve["n_kept"].sel(n_edges=10)) == int(g.sum())
    assert curve.attrs["rule"] == "greedy"


def test_bootstrap_interval_over_two_pairs_by_enumeration():
    """With two pairs a resample is (0, 0), (1, 1) or one of each: with 4000 resamples the
    2.5 % and 97.5 % points are the smallest and largest of those three ratios."""
    m = np.array([[1.0, 3.0], [2.0, 2.5]])          # [n_edges, prompt]
    clean, corrupt = np.array([2.0, 4.0]), np.array([0.0, 1.0])
    curve = xr.Dataset({"pair_metric": (("n_edges", "prompt"), m),
                        "pair_clean_metric": ("prompt", clean),
                        "pair_corrupt_metric": ("prompt", corrupt)},
                       coords={"n_edges": [10, 20], "prompt": [0, 1]})
    out = cs.bootstrap_recovered(curve, n_boot=4000)
    for j in range(2):
        ratios = [(m[j, 0] - corrupt[0]) / (clean[0] - corrupt[0]),
                  (m[j, 1] - corrupt[1]) / (clean[1] - corrupt[1]),
                  (m[j].mean() - corrupt.mean()) / (clean.mean() - corrupt.mean())]
        assert float(out["recovered_low"][j]) == pytest.approx(min(ratios))
        assert float(out["recovered_high"][j]) == pytest.approx(max(ratios))
    with pytest.raises(InputError, match="per_pair"):
        cs.bootstrap_recovered(curve.drop_vars("pair_metric"))


def test_choose_default_circuit(tiny_model, scores):
    for rule in cs.SELECTION_RULES:
        d = cs.choose_default_circuit(tiny_model, PAIRS, scores, fraction=0.5, max_edges=60,
                                      rule=rule)
        assert d.rule == rule
        assert d.choice == cs.smallest_faithful_circuit(d.curve, 0.5, max_edges=60)
        assert np.array_equal(d.in_circuit.values,
                              cs.circuit_by_rule(scores, d.choice.n_edges, rule).values)
        measured = ca.patch_edges_metric(tiny_model, PAIRS, scores, d.in_circuit)
        assert measured["recovered"] == pytest.approx(d.choice.recovered, abs=1e-5)
        assert int(d.in_circuit.sum()) == d.choice.n_kept
        if d.choice.reached:
            assert d.choice.n_kept <= 60 and measured["recovered"] >= 0.5
    with pytest.raises(InputError, match="rule"):
        cs.choose_default_circuit(tiny_model, PAIRS, scores, rule="best")


def test_batched_curve_keeps_each_pairs_value(tiny_model, scores):
    """faithfulness_curve's per-pair values (one batch) are each pair's own patched run."""
    sizes = [0, 20, scores.sizes["edge"]]
    curve = ca.faithfulness_curve(tiny_model, PAIRS, scores, sizes=sizes, batch_size=2)
    for pair in (0, 1):
        one = ca.patch_edges_metric(tiny_model, PAIRS.subset([pair]), scores,
                                    ca.select_circuit(scores, top_n=20))
        assert float(curve["pair_metric"].sel(n_edges=20, prompt=pair)) == pytest.approx(
            one["metric"], abs=1e-5)
        assert float(curve["pair_clean_metric"][pair]) == pytest.approx(one["clean_metric"],
                                                                        abs=1e-5)
        assert float(curve["pair_corrupt_metric"][pair]) == pytest.approx(
            one["corrupt_metric"], abs=1e-5)
    np.testing.assert_allclose(curve["pair_metric"].mean("prompt"), curve["metric"], atol=1e-6)
    boot = cs.bootstrap_recovered(curve, n_boot=200)
    assert (boot["recovered_low"] <= boot["recovered_high"]).all()


def test_bisection_size_and_merged_curve():
    curve = xr.Dataset({"recovered": ("n_edges", [0.0, 0.3, 0.7, 0.9, 1.0]),
                        "n_kept": ("n_edges", [0, 5, 50, 400, 900])},
                       coords={"n_edges": [0, 10, 100, 1000, 10000]})
    # first reaching 0.8 at 1000, the point below is 100: geometric midpoint 316
    assert cs.next_bisection_size(curve, 0.8) == 316
    assert cs.next_bisection_size(curve, 0.95) == 3162
    assert cs.next_bisection_size(curve, 1.5) is None        # none reaches it
    assert cs.next_bisection_size(curve, 0.0) is None        # the smallest does
    more = xr.Dataset({"recovered": ("n_edges", [0.85]), "n_kept": ("n_edges", [150])},
                      coords={"n_edges": [316]})
    merged = cs.merge_curves(curve, more)
    assert merged["n_edges"].values.tolist() == [0, 10, 100, 316, 1000, 10000]
    assert merged["recovered"].sel(n_edges=316) == 0.85
    assert cs.next_bisection_size(merged, 0.8) == 178
    neighbours = curve.assign_coords(n_edges=[0, 1, 2, 3, 4])
    assert cs.next_bisection_size(neighbours, 0.8) is None


def test_node_circuits_patch_each_left_out_nodes_output(tiny_model, scores):
    """Node scores are out-edge sums (by a loop here); the curve's ends are the corrupted and
    the clean run (0 and 1); the top-3 node circuit is the edge patcher's run with every
    out-edge of the 3 nodes (ranked here) kept."""
    ns = cs.node_scores(scores)
    by_loop = {}
    for s, v in zip(scores["src"].values.astype(str), scores["score"].values):
        by_loop[s] = by_loop.get(s, 0.0) + float(v)
    assert dict(zip(ns["node"].values.tolist(), ns.values.tolist())) == pytest.approx(by_loop)
    n = ns.sizes["node"]
    curve = cs.node_faithfulness_curve(tiny_model, PAIRS, scores, sizes=[0, 3, n])
    assert float(curve["recovered"].sel(n_nodes=0)) == pytest.approx(0.0, abs=1e-5)
    assert float(curve["recovered"].sel(n_nodes=n)) == pytest.approx(1.0, abs=1e-5)
    top3 = curve.attrs["order"][:3]
    assert sorted(top3, key=lambda x: -abs(by_loop[x])) == top3
    keep = np.isin(scores["src"].values.astype(str), top3)
    direct = ca.patch_edges_metric(tiny_model, PAIRS, scores, keep)
    assert float(curve["recovered"].sel(n_nodes=3)) == pytest.approx(direct["recovered"],
                                                                      abs=1e-5)
    with pytest.raises(ValueError, match=r"`sizes\[i\]` must be an int in"):
        cs.node_faithfulness_curve(tiny_model, PAIRS, scores, sizes=[n + 1])


def test_edge_nodes_name_each_edges_ends_as_node_of_does(tiny_model):
    """`edge_nodes` (each distinct name resolved once) against the per-edge spelling: the
    source's name, the destination's node (`node_of`: a head's q/k/v input is the head), in
    forward order, on the plain and the q/k/v-split graph."""
    from explorer.analyses import circuits
    from explorer.analyses.circuit_select.rules import _node_rank, edge_nodes, node_of

    task = circuits.filter_task(tiny_model, circuits.make_task("add", 4), correct_only=False)
    for split in (False, True):
        scores = circuits.edge_scores(tiny_model, task, method="eap", split_qkv=split)
        src = [str(s) for s in scores["src"].values]
        dst = [node_of(str(d)) for d in scores["dst"].values]
        names, s, d = edge_nodes(scores)
        assert names == sorted(set(src) | set(dst), key=_node_rank)
        assert [names[i] for i in s] == src and [names[i] for i in d] == dst
        assert s.dtype.kind == d.dtype.kind == "i" and len(s) == scores.sizes["edge"]
        assert split == any(n != str(x) for n, x in zip(dst, scores["dst"].values))
