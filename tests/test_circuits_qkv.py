"""The q/k/v-split graph of Hanna et al. 2024's code (`edge_scores(split_qkv=True)`).

Each head's query, key and value inputs are separate destinations, as in hannamw/EAP-IG
(TransformerLens ``use_split_qkv_input``, grouped key/value heads ungrouped). Checked here:
the graph's edges by count, the scores against plain torch hooks on ``model.hf`` (each query
head's q columns, each key/value group's k or v columns recomputed from a perturbed stream;
EAP and EAP-IG), the q + k + v = combined identity, patching, and circuit selection.
"""
from __future__ import annotations

import numpy as np
import pytest
import xarray as xr

from explorer import load_model
from explorer.analyses import circuit_select as cs
from explorer.analyses import circuits as C
from explorer.analyses.circuit_tasks import CircuitTask, _target_ids
from explorer.analyses.circuits.graph import _graph
from tests.test_circuits import (LONG_PAIRS, PAIRS, _arch_hook_scores, _equal_lengths, _score_of,
                                 checked_against_hooks)

FAMILIES = ["tiny-llama", "tiny-gpt2", "tiny-qwen2", "tiny-neox", "tiny-gemma2"]


def test_split_graph_edges_and_names():
    """Every edge into a head becomes three (q, k, v); MLP and logits edges stay. SmolLM2's
    shape (30 layers, 9 heads) gives the 123,211 edges of the EAP-IG library against 44,371
    (the library's count: n_forward x n_backward over its real edges)."""
    assert len(_graph(30, 9).edges) == 44_371
    assert len(_graph(30, 9, split_qkv=True).edges) == 123_211
    g, s = _graph(3, 4), _graph(3, 4, split_qkv=True)
    into_heads = [(a, b) for a, b in g.edges if b.startswith("a")]
    others = [(a, b) for a, b in g.edges if not b.startswith("a")]
    assert len(s.edges) == 3 * len(into_heads) + len(others)
    want = {(a, f"{b}<{p}>") for a, b in into_heads for p in "qkv"} | set(others)
    assert set(s.edges) == want
    # the library's destination order: per layer all q inputs, all k, all v, then the MLP
    assert s.destinations[:13] == tuple([f"a0.h{h}<{p}>" for p in "qkv" for h in range(4)]
                                        + ["m0"])
    assert s.layer_of("a2.h1<v>") == 2
    assert C.node_of("a2.h1<v>") == "a2.h1" and C.input_of("a2.h1<v>") == "v"
    assert C.node_of("m1") == "m1" and C.input_of("m1") == ""
    with pytest.raises(TypeError, match="split_qkv"):
        C.circuit_graph(load_model("tiny-llama"), split_qkv="yes")


def _check_against_hooks(m, task, ds, layer, ref, members):
    """Compare split scores into layer ``layer`` with the hook reference; a group's k / v
    reference is the sum over its query heads' own k / v scores."""
    edges = set(zip(ds["src"].values.tolist(), ds["dst"].values.tolist()))
    big = max(abs(v) for v in ref.values())
    n_checked = checked_against_hooks(ds, ref, members, layer, m.n_layers,
                                      head=lambda h, dst: f"a{layer}.h{h}<{dst[-2]}>",
                                      other=lambda src, dst: (src, dst) in edges, tol=1e-5 * big)
    parts = {dst[-2] for _, dst in ref if dst in members}       # every group's q, k and v
    assert parts == {"q", "k", "v"} and n_checked > 60 and big > 1e-4


@pytest.mark.parametrize("name", FAMILIES)
def test_split_eap_matches_hook_gradients_every_family(name):
    """EAP, split graph, each family's tiny model (random norm gains): every edge into layer
    1's query inputs (per query head), key and value inputs (per KV group), its MLP and the
    logits against `_arch_hook_scores(split=True)`."""
    from tests.test_engine import noisy_norms

    m = noisy_norms(name)
    lens, lens_c = _equal_lengths(m, LONG_PAIRS)
    assert lens == lens_c and len(set(lens)) == 1
    ref, members = _arch_hook_scores(m, LONG_PAIRS, 1, split=True)
    ds = C.edge_scores(m, LONG_PAIRS, method="eap", split_qkv=True)
    assert ds.sizes["edge"] == len(C.circuit_graph(m, split_qkv=True).edges)
    assert ds.attrs["split_qkv"] is True and set(ds["dst_input"].values) == {"q", "k", "v", ""}
    _check_against_hooks(m, LONG_PAIRS, ds, 1, ref, members)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_split_eap_ig_matches_hook_integrated_gradients(name):
    """EAP-IG (3 steps), split graph, against hook gradients averaged over runs whose input
    embeddings are interpolated corrupted -> clean (alpha = 1/3, 2/3, 1)."""
    from tests.test_engine import noisy_norms

    m = noisy_norms(name)
    steps = 3
    ref, members = _arch_hook_scores(m, LONG_PAIRS, 1, split=True,
                                     alphas=[k / steps for k in range(1, steps + 1)])
    ds = C.edge_scores(m, LONG_PAIRS, method="eap-ig", steps=steps, split_qkv=True)
    _check_against_hooks(m, LONG_PAIRS, ds, 1, ref, members)
    eap, _ = _arch_hook_scores(m, LONG_PAIRS, 1, split=True)
    big = max(abs(v) for v in ref.values())
    assert max(abs(ref[e] - eap[e]) for e in ref) > 0.02 * big   # the interpolation matters


def _split_sums(combined, split):
    """Per combined edge: (combined score, q, k, v scores or None)."""
    score = dict(zip(zip(split["src"].values.tolist(), split["dst"].values.tolist()),
                     split["score"].values.tolist()))
    for src, dst, value in zip(combined["src"].values.tolist(), combined["dst"].values.tolist(),
                               combined["score"].values.tolist()):
        if dst.startswith("a"):
            yield value, [score[(src, f"{dst}<{p}>")] for p in "qkv"]
        else:
            yield value, [score[(src, dst)]]


@pytest.mark.parametrize("name,method", [("tiny-llama", "eap"), ("tiny-llama", "eap-ig"),
                                         ("tiny-neox", "eap"), ("tiny-gemma2", "eap-ig")])
def test_split_scores_sum_to_the_combined_score(name, method):
    """At an unpatched run a head's q, k and v inputs are one tensor, so dM/d(combined input)
    = dM/dq_in + dM/dk_in + dM/dv_in and the three split scores of an edge sum to its
    combined score (EAP; EAP-IG too, whose runs interpolate only the input embeddings). MLP
    and logits edges are the same in both graphs. The parts themselves differ."""
    from tests.test_engine import noisy_norms

    m = noisy_norms(name)
    combined = C.edge_scores(m, LONG_PAIRS, method=method, steps=3)
    split = C.edge_scores(m, LONG_PAIRS, method=method, steps=3, split_qkv=True)
    big = float(np.abs(combined["score"].values).max())
    n_heads_edges, spread = 0, 0.0
    for value, parts in _split_sums(combined, split):
        assert sum(parts) == pytest.approx(value, abs=2e-5 * big)
        if len(parts) == 3:
            n_heads_edges += 1
            spread = max(spread, max(parts) - min(parts))
    assert n_heads_edges > 50 and spread > 0.01 * big


def test_split_patching_endpoints_and_one_input_edge():
    """Patching on the split graph: all edges give the clean run, none the corrupted run;
    dropping the edge input -> (head, q input) equals a hooked ``model.hf`` run where that
    head's query columns alone are recomputed from the stream plus the corrupted minus clean
    embedding; dropping its q, k and v edges equals dropping the combined graph's one edge."""
    import torch

    from explorer.models import _get_path
    from tests.test_circuits import _guard, _qkv_columns

    m = load_model("tiny-llama")
    split = C.edge_scores(m, PAIRS, split_qkv=True)
    combined = C.edge_scores(m, PAIRS)
    n = split.sizes["edge"]
    every = C.patch_edges_metric(m, PAIRS, split, np.ones(n, bool))
    none = C.patch_edges_metric(m, PAIRS, split, np.zeros(n, bool))
    assert every["recovered"] == pytest.approx(1.0, abs=1e-4)
    assert none["recovered"] == pytest.approx(0.0, abs=1e-4)

    def drop(pairs, ds):
        s, d = ds["src"].values, ds["dst"].values
        keep = np.ones(ds.sizes["edge"], bool)
        for a, b in pairs:
            keep[(s == a) & (d == b)] = False
        return C.patch_edges_metric(m, PAIRS, ds, keep)["metric"]

    layer, H, G = 1, m.spec.n_heads, m.spec.n_kv_heads
    q_in = [f"a{layer}.h{h}<q>" for h in range(H)]
    head = max(range(H), key=lambda h: abs(_score_of(split, "input", q_in[h])))
    got = drop([("input", q_in[head])], split)

    block = m.hf_layer(layer)
    norm = _get_path(block, m.arch.attn_norm_path)
    emb = m.hf.get_input_embeddings()
    vals = []
    for c, k, a, w in zip(PAIRS.clean, PAIRS.corrupt, PAIRS.answer, PAIRS.wrong):
        ids_c = torch.tensor([m.tokenize([c]).token_ids[0]])
        delta = emb(torch.tensor([m.tokenize([k]).token_ids[0]])) - emb(ids_c)
        cache = {}
        handles = [norm.register_forward_pre_hook(
            lambda mod, args: [cache.setdefault("x", args[0]), None][1])]
        (proj, cols), = _qkv_columns(m.arch, block, [head], head * G // H, m.spec.d_head,
                                     m.spec.d_model, "q").items()

        def hook(mod, args, out, _cols=cols, _delta=delta):
            out = out.clone()
            out[..., _cols] = mod(norm(cache["x"] + _delta))[..., _cols]
            return out
        handles.append(proj.register_forward_hook(_guard(hook)))
        try:
            with torch.no_grad():
                lg = m.hf(input_ids=ids_c).logits[0, -1]
        finally:
            for h in handles:
                h.remove()
        ai, wi = _target_ids(m, [c], [a])[0], _target_ids(m, [c], [w])[0]
        vals.append(float(lg[ai] - lg[wi]))
    assert abs(got - every["metric"]) > 1e-4          # the edge matters
    assert got == pytest.approx(np.mean(vals), abs=1e-5)
    k_only = drop([("input", f"a{layer}.h{head}<k>")], split)
    assert abs(k_only - got) > 1e-6
    all3 = drop([("input", f"a{layer}.h{head}<{p}>") for p in "qkv"], split)
    assert all3 == pytest.approx(drop([("input", f"a{layer}.h{head}")], combined), abs=1e-5)


def _split_table(seed):
    g = _graph(3, 2, split_qkv=True)
    rng = np.random.default_rng(seed)
    src, dst = zip(*g.edges)
    return xr.Dataset({"score": ("edge", rng.standard_normal(len(src)))},
                      coords={"src": ("edge", list(src)), "dst": ("edge", list(dst))},
                      attrs={"split_qkv": True})


def _reference_paths(ds, chosen):
    """Edges on an input -> logits path by brute force: a node is alive when it reaches
    the logits and is reached from the input through chosen edges, a head through any of its
    q / k / v inputs."""
    edges = [(s, C.node_of(d)) for s, d, c in zip(ds["src"].values, ds["dst"].values, chosen)
             if c]
    fwd, bwd = {"input"}, {"logits"}
    for _ in range(20):
        fwd |= {b for a, b in edges if a in fwd}
        bwd |= {a for a, b in edges if b in bwd}
    return np.array([bool(c) and s in fwd and C.node_of(d) in bwd
                     for s, d, c in zip(ds["src"].values, ds["dst"].values, chosen)])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_split_selection_prunes_through_any_head_input(seed):
    """Top-n and greedy circuits on a random split table: top-n's pruning and the greedy's
    dead-node pruning both keep exactly the brute-force path set, a head reached through
    any one of its inputs."""
    ds = _split_table(seed)
    for n in (5, 20, 60):
        top = C.select_circuit(ds, top_n=n)
        order = np.argsort(-np.abs(ds["score"].values), kind="stable")
        chosen = np.zeros(ds.sizes["edge"], bool)
        chosen[order[:n]] = True
        assert (top.values == _reference_paths(ds, chosen)).all()
        greedy = cs.greedy_circuit(ds, n)
        assert (cs.prune_dead_nodes(ds, greedy.values).values == greedy.values).all()
        assert (greedy.values == _reference_paths(ds, greedy.values)).all()
    # a head whose only in-edge is into its key input is still on the path
    names = [("input", "a0.h1<k>"), ("a0.h1", "logits")]
    t = xr.Dataset({"score": ("edge", np.array([1.0, 2.0]))},
                   coords={"src": ("edge", [a for a, _ in names]),
                           "dst": ("edge", [b for _, b in names])})
    assert C.select_circuit(t, top_n=2).values.all()
    assert cs.greedy_circuit(t, 2).values.all()


def test_split_greedy_matches_a_port_of_the_library_on_split_edges():
    """Greedy on a split table equals a plain port of ``Graph.apply_greedy`` where an edge's
    child is the head (its q / k / v edges all candidates once the head is in)."""
    ds = _split_table(7)
    src = [str(s) for s in ds["src"].values]
    child = [C.node_of(str(d)) for d in ds["dst"].values]
    score = np.abs(ds["score"].values)
    n = 25
    in_graph, chosen = {"logits"}, np.zeros(len(src), bool)
    for _ in range(n):
        cand = [e for e in range(len(src)) if not chosen[e] and child[e] in in_graph]
        e = max(cand, key=lambda i: (score[i], -i))
        chosen[e] = True
        in_graph.add(src[e])
    want = cs.prune_dead_nodes(ds, chosen).values
    assert (cs.greedy_circuit(ds, n).values == want).all() and want.any()


def test_split_faithfulness_curve_on_tiny_model():
    """The rule curve on split scores: the empty circuit recovers 0, the whole graph 1."""
    m = load_model("tiny-llama")
    task = CircuitTask(PAIRS.clean, PAIRS.corrupt, PAIRS.answer, PAIRS.wrong, name="toy")
    split = C.edge_scores(m, task, split_qkv=True)
    n = split.sizes["edge"]
    curve = cs.rule_faithfulness_curve(m, task, split, sizes=[0, 30, n], rule="greedy",
                                       per_pair=True)
    assert curve["recovered"].values[0] == pytest.approx(0.0, abs=1e-4)
    assert curve["recovered"].values[-1] == pytest.approx(1.0, abs=1e-4)
    assert curve.attrs["n_edges_total"] == n
