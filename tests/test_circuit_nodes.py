"""Node-level circuits (explorer/analyses/circuit_select.py: `node_circuit`,
`node_faithfulness_curve`, `measured_node_curve`) against node patching done with plain torch
hooks on tiny-llama's Hugging Face modules: every node outside the kept set (the input
embedding, a head's slice of o_proj's input, an MLP's output) replaced by its value on the
corrupted prompt, the kept nodes computed as usual on what they read."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import xarray as xr

from explorer._checks import InputError
from explorer.analyses import circuit_select as cs
from explorer.analyses import circuits as ca
from explorer.analyses.circuit_tasks import CircuitTask, _target_ids
from explorer.models import _get_path

# equal lengths, no padding: hooks on model.hf see the same positions as the engine
PAIRS = CircuitTask(
    clean=["The quick brown fox jumps over", "One two three four five six"],
    corrupt=["The quick brown dog jumps over", "One two three four nine six"],
    answer=[" the", " seven"], wrong=[" a", " ten"], name="toy")


@pytest.fixture(scope="module")
def scores(tiny_model):
    return ca.edge_scores(tiny_model, PAIRS)


def hook_node_patched_metric(model, task, kept: set[str]) -> tuple[float, float, float]:
    """Mean over the pairs of the logit difference (answer - wrong, last position) of the
    clean prompt with every node not in ``kept`` patched to its corrupted output, by forward
    hooks on model.hf (one pair at a time: no padding); also the clean and corrupted
    metrics. Returns (patched, clean, corrupt)."""
    out = np.array([_pair_metrics(model, task.subset([i]), kept) for i in range(len(task))])
    return tuple(float(v) for v in out.mean(0))


def _pair_metrics(model, task, kept):
    arch = model.arch
    ids = {w: torch.tensor([model.tokenize([p]).token_ids[0] for p in getattr(task, w)])
           for w in ("clean", "corrupt")}
    ans = torch.tensor([_target_ids(model, [c], [a])[0]
                        for c, a in zip(task.clean, task.answer)])
    wrong = torch.tensor([_target_ids(model, [c], [w])[0]
                          for c, w in zip(task.clean, task.wrong)])
    L, H, dh = model.n_layers, model.spec.n_heads, model.spec.d_head
    embed = _get_path(model.hf, arch.embed_path)
    saved: dict = {}

    def run(which, patch):
        handles = []
        if patch:
            if "input" not in kept:
                handles.append(embed.register_forward_hook(lambda m, a, o: saved["emb"]))
        else:
            handles.append(embed.register_forward_hook(
                lambda m, a, o: saved.__setitem__("emb", o)))
        for lay in range(L):
            o_proj = model.o_proj(lay)
            mlp = _get_path(model.hf_layer(lay), arch.mlp_path)
            if patch:
                heads = [h for h in range(H) if f"a{lay}.h{h}" not in kept]

                def pre(m, args, _l=lay, _h=heads):
                    z = args[0].clone()              # [prompt, pos, head * d_head]
                    for h in _h:
                        z[..., h * dh:(h + 1) * dh] = saved[("z", _l)][..., h * dh:(h + 1) * dh]
                    return (z, *args[1:])
                handles.append(o_proj.register_forward_pre_hook(pre))
                if f"m{lay}" not in kept:
                    handles.append(mlp.register_forward_hook(
                        lambda m, a, o, _l=lay: saved[("m", _l)]))
            else:
                handles.append(o_proj.register_forward_pre_hook(
                    lambda m, args, _l=lay: saved.__setitem__(("z", _l), args[0])))
                handles.append(mlp.register_forward_hook(
                    lambda m, a, o, _l=lay: saved.__setitem__(("m", _l), o)))
        try:
            with torch.no_grad():
                logits = model.hf(input_ids=ids[which]).logits[:, -1].double()
        finally:
            for h in handles:
                h.remove()
        rows = torch.arange(len(ids[which]))
        return float((logits[rows, ans] - logits[rows, wrong]).mean())

    clean = run("clean", patch=False)
    corrupt = run("corrupt", patch=False)      # fills `saved` with the corrupted outputs
    return run("clean", patch=True), clean, corrupt


def test_node_ranking_is_by_absolute_out_edge_sum(scores):
    """The ranking, by a loop over the edges here: |sum of a node's out-edge scores|."""
    total: dict[str, float] = {}
    for s, v in zip(scores["src"].values.astype(str), scores["score"].values):
        total[s] = total.get(s, 0.0) + float(v)
    order = cs.node_ranking(scores)
    assert sorted(order) == sorted(total)
    mags = [abs(total[n]) for n in order]
    assert mags == sorted(mags, reverse=True)


@pytest.mark.parametrize("k", [0, 1, 3, 6, 10])
def test_node_curve_equals_hook_node_patching(tiny_model, scores, k):
    """Each point of the node curve is node patching done with hooks: the kept nodes are
    the curve's top k, every other node's output is its corrupted one."""
    curve = cs.node_faithfulness_curve(tiny_model, PAIRS, scores, sizes=[k])
    kept = set(curve.attrs["order"][:k])
    patched, clean, corrupt = hook_node_patched_metric(tiny_model, PAIRS, kept)
    assert curve.attrs["clean_metric"] == pytest.approx(clean, abs=1e-4)
    assert curve.attrs["corrupt_metric"] == pytest.approx(corrupt, abs=1e-4)
    assert float(curve["metric"].sel(n_nodes=k)) == pytest.approx(patched, abs=1e-4)
    assert float(curve["recovered"].sel(n_nodes=k)) == pytest.approx(
        (patched - corrupt) / (clean - corrupt), abs=1e-4)


def test_a_hand_picked_node_set_by_hooks(tiny_model, scores):
    """A node set that is no prefix of the ranking (the input, one head, one MLP): the edge
    mask of `node_circuit`'s kind, patched, equals hook patching; so do all out-edges of the
    nodes (`node_circuit_edges`): edges into a left-out node do not matter."""
    kept = {"input", "a1.h2", "m0"}
    patched, clean, corrupt = hook_node_patched_metric(tiny_model, PAIRS, kept)
    src = scores["src"].values.astype(str)
    dst = np.array([ca.node_of(str(d)) for d in scores["dst"].values])
    between = np.isin(src, list(kept)) & (np.isin(dst, list(kept)) | (dst == "logits"))
    for mask in (between, cs.node_circuit_edges(scores, kept)):
        out = ca.patch_edges_metric(tiny_model, PAIRS, scores, mask)
        assert out["metric"] == pytest.approx(patched, abs=1e-4)


def test_node_circuit_mask_by_hand(scores):
    """The mask of the top-3 nodes: exactly the edges from one of them into another or the
    logits (listed by a loop here)."""
    order = cs.node_ranking(scores)
    kept = set(order[:3])
    mask = cs.node_circuit(scores, 3)
    want = [s in kept and (ca.node_of(d) in kept or d == "logits")
            for s, d in zip(scores["src"].values.astype(str), scores["dst"].values.astype(str))]
    assert mask.values.tolist() == want
    assert mask.attrs["nodes"] == order[:3]
    assert not cs.node_circuit(scores, 0).values.any()
    with pytest.raises(ValueError, match=r"`n_nodes` must be an int in \[0, "):
        cs.node_circuit(scores, len(order) + 1)


def test_measured_node_curve_and_its_default(tiny_model, scores):
    """The measured node curve holds the log-spaced counts and at most two bisection points
    between the first count reaching the target and the one below; its default is the
    smallest measured count reaching the target (found here from the values)."""
    n = len(cs.node_ranking(scores))
    sizes = cs.default_node_sizes(n, points=4)
    assert sizes[0] == 0 and sizes[-1] == n and sizes == sorted(set(sizes))
    curve = cs.measured_node_curve(tiny_model, PAIRS, scores, fraction=0.8, sizes=sizes)
    got = curve["n_nodes"].values.tolist()
    assert set(sizes) <= set(got) and len(got) <= len(sizes) + 2 and got == sorted(got)
    rec = dict(zip(got, curve["recovered"].values.tolist()))
    choice = cs.smallest_faithful_nodes(curve, 0.8)
    reaching = [k for k in got if rec[k] >= 0.8]
    assert choice.reached == bool(reaching)
    if reaching:
        assert choice.n_edges == reaching[0]
    boot = cs.bootstrap_recovered(curve)
    assert {"recovered_low", "recovered_high"} <= set(boot.data_vars)
    assert boot["recovered_low"].dims == ("n_nodes",)
    with pytest.raises(TypeError, match="node_faithfulness_curve"):
        cs.smallest_faithful_nodes(xr.Dataset(), 0.8)
    with pytest.raises(InputError, match="`fraction` must be a number in"):
        cs.smallest_faithful_nodes(curve, 1.5)
