"""Circuit discovery (EAP / EAP-IG, Hanna et al. 2024; CircuitLoRA, Wang et al. 2025).

EAP scores are checked against gradients taken with plain torch hooks on ``model.hf``;
EAP-IG against exact per-edge patching of a hand-built linear network; edge patching
against plain forwards of the clean and corrupted prompts; pruning on a hand-built graph.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import xarray as xr

from explorer import load_model
from explorer._checks import InputError
from explorer.analyses import circuits as C
from explorer.analyses.circuit_tasks import CircuitTask, _target_ids, make_task
from explorer.analyses.circuits import scores as eap_scores
from explorer.analyses.circuits.graph import _graph
from explorer.analyses.circuits.scores import _shared_prefix

# prompt pairs of equal length and no padding, so hooks on model.hf see the same positions
PAIRS = CircuitTask(
    clean=["The quick brown fox jumps over", "One two three four five six"],
    corrupt=["The quick brown dog jumps over", "One two three four nine six"],
    answer=[" the", " seven"], wrong=[" a", " ten"], name="toy")


def _equal_lengths(model, task):
    lens = [len(model.tokenizer(p, add_special_tokens=False)["input_ids"]) for p in task.clean]
    lens_c = [len(model.tokenizer(p, add_special_tokens=False)["input_ids"]) for p in task.corrupt]
    return lens, lens_c


# -- plain-hook reference for EAP -----------------------------------------------------------

# 12 tokens each, no padding: wider than tiny-gemma2's sliding window (8)
LONG_PAIRS = CircuitTask(
    clean=["The capital of France is Paris; the capital of Italy is",
           "Water boils at one hundred degrees at sea level. The"],
    corrupt=["The capital of Italy is Rome; the capital of France is",
             "Water boils at one hundred degrees at sea level. A"],
    answer=[" Rome", " quick"], wrong=[" Paris", " lazy"], name="long")


def _qkv_columns(arch, block, heads, g, dh, d, parts="qkv"):
    """{projection module: output columns} of ``parts`` of the query heads ``heads`` (KV
    group ``g``), in the family's q/k/v layout."""
    from explorer.models import _get_path

    if arch.qkv_layout == "separate":
        q, k, v = (_get_path(block, p) for p in arch.qkv_paths)
        kv = [g * dh + i for i in range(dh)]
        cols = {q: [h * dh + i for h in heads for i in range(dh)], k: kv, v: kv}
        return {mod: c for mod, c, part in zip((q, k, v), cols.values(), "qkv") if part in parts}
    idx = ["qkv".index(p) for p in parts]
    if arch.qkv_layout == "blocks":   # GPT-2 c_attn: q | k | v blocks of d columns
        return {_get_path(block, arch.qkv_paths[0]):
                [part * d + h * dh + i for part in idx for h in heads for i in range(dh)]}
    # GPT-NeoX: [head, q|k|v, d_head] columns
    return {_get_path(block, arch.qkv_paths[0]):
            [h * 3 * dh + part * dh + i for h in heads for part in idx for i in range(dh)]}


def _arch_hook_scores(model, task, layer, *, split=False, alphas=(1.0,)):
    """EAP by hand on any family, from its ArchSpec paths: node outputs from hooks on
    model.hf (embedding (+ positions), o_proj inputs sliced by head -- through the post-
    attention norm where the family has one, as the factor that norm applies -- and MLP
    writes), and gradients w.r.t. zero perturbations added where only one destination reads:
    each KV group of layer ``layer`` (its q/k/v columns recomputed from the perturbed
    stream), that layer's MLP (its norm's input) and the logits (the final norm's input).

    ``split``: the q/k/v-split graph's destinations instead of the groups: each query head's
    query input (``a{layer}.h{h}<q>``, its q columns alone recomputed from its own perturbed
    stream) and each group's key and value inputs (``group{g}<k>``, ``<v>``; a query head's
    own key input cannot be hooked, the sum over its group can). ``alphas``: the gradient is
    the mean over runs whose input embeddings are the corrupted ones plus alpha times the
    clean minus corrupted ones (EAP-IG; (1.0,) is EAP).
    Returns ({(src, dst): score}, group -> heads)."""
    from explorer.models import _get_path

    arch = model.arch
    ids_clean = torch.tensor([model.tokenize([p]).token_ids[0] for p in task.clean])
    ids_corrupt = torch.tensor([model.tokenize([p]).token_ids[0] for p in task.corrupt])
    ans = torch.tensor([_target_ids(model, [c], [a])[0] for c, a in zip(task.clean, task.answer)])
    wrong = torch.tensor([_target_ids(model, [c], [w])[0] for c, w in zip(task.clean, task.wrong)])
    L, H, G, dh = model.n_layers, model.spec.n_heads, model.spec.n_kv_heads, model.spec.d_head
    d = model.spec.d_model
    block = model.hf_layer(layer)
    norm = _get_path(block, arch.attn_norm_path)
    groups, members = {}, {}
    for g in range(G):
        heads = list(range(g * H // G, (g + 1) * H // G))
        if not split:
            members[f"group{g}"] = heads
            groups[f"group{g}"] = (None, "attn", (norm, _qkv_columns(arch, block, heads, g, dh, d)))
            continue
        for h in heads:
            members[f"a{layer}.h{h}<q>"] = [h]
            groups[f"a{layer}.h{h}<q>"] = (None, "attn",
                                           (norm, _qkv_columns(arch, block, [h], g, dh, d, "q")))
        for part in "kv":
            members[f"group{g}<{part}>"] = heads
            groups[f"group{g}<{part}>"] = (None, "attn",
                                           (norm, _qkv_columns(arch, block, heads, g, dh, d, part)))
    groups[f"m{layer}"] = (_get_path(block, arch.mlp_norm_path), "pre", None)
    groups["logits"] = (model.final_norm_module, "pre", None)

    def node_outputs(ids, perturb=None):
        outs, handles = {}, []
        handles.append(_get_path(model.hf, arch.embed_path).register_forward_hook(
            lambda m, a, o: outs.__setitem__("emb", o)))
        if arch.pos_embed_path:
            handles.append(_get_path(model.hf, arch.pos_embed_path).register_forward_hook(
                lambda m, a, o: outs.__setitem__("pos", o)))
        for lay in range(L):
            blk = model.hf_layer(lay)
            handles.append(model.o_proj(lay).register_forward_hook(
                lambda m, a, o, _l=lay: outs.update({("z", _l): a[0], ("o", _l): o})))
            if arch.attn_out_norm_path:
                handles.append(_get_path(blk, arch.attn_out_norm_path).register_forward_hook(
                    lambda m, a, o, _l=lay: outs.__setitem__(("attn", _l), o)))
            handles.append(_get_path(blk, arch.mlp_out_norm_path or arch.mlp_path)
                           .register_forward_hook(
                               lambda m, a, o, _l=lay: outs.__setitem__(f"m{_l}", o)))
        if perturb is not None:
            handles += perturb()
        try:
            logits = model.hf(input_ids=ids).logits[:, -1]
        finally:
            for h in handles:
                h.remove()
        node = {"input": outs["emb"] + outs["pos"] if "pos" in outs else outs["emb"]}
        for lay in range(L):
            z = outs[("z", lay)].reshape(*ids.shape, H, -1)              # [prompt, pos, head, d_head]
            per_head = torch.einsum("bphe,hed->bphd", z, model.W_O(lay))
            if arch.attn_out_norm_path:
                per_head = per_head * (outs[("attn", lay)] / outs[("o", lay)])[:, :, None]
            for h in range(H):
                node[f"a{lay}.h{h}"] = per_head[:, :, h]
            node[f"m{lay}"] = outs[f"m{lay}"]
        return node, logits

    embed = _get_path(model.hf, arch.embed_path)
    with torch.no_grad():
        corrupt_nodes, _ = node_outputs(ids_corrupt)
        clean_nodes, _ = node_outputs(ids_clean)
        corrupt_emb = embed(ids_corrupt)
    leaves = {}

    def perturb(alpha):
        handles, cache = [], {}
        if alpha != 1.0:   # interpolated token embeddings (positions are the same in both)
            handles.append(embed.register_forward_hook(
                lambda m, a, o: corrupt_emb + alpha * (o - corrupt_emb)))
        for dst, (module, kind, info) in groups.items():
            leaf = leaves[dst]
            if kind == "pre":
                handles.append(module.register_forward_pre_hook(
                    lambda m, args, _leaf=leaf: (args[0] + _leaf, *args[1:])))
                continue
            nrm, proj_cols = info
            if not cache:
                handles.append(nrm.register_forward_pre_hook(
                    lambda m, args: [cache.setdefault("x", args[0]), None][1]))
                cache["ready"] = True
            for proj, cols in proj_cols.items():
                def hook(m, args, out, _leaf=leaf, _cols=cols):
                    moved = m(nrm(cache["x"] + _leaf))
                    out = out.clone()
                    out[..., _cols] = moved[..., _cols]
                    return out
                handles.append(proj.register_forward_hook(_guard(hook)))
        return handles

    grads = [0.0] * len(groups)
    for alpha in alphas:
        leaves.update({dst: torch.zeros(*ids_clean.shape, d, requires_grad=True) for dst in groups})
        with torch.enable_grad():
            _, logits = node_outputs(ids_clean, lambda: perturb(alpha))
            rows = torch.arange(len(task))
            metric = (logits[rows, ans] - logits[rows, wrong]).sum()
            step = torch.autograd.grad(metric, [leaves[dst] for dst in groups])
        grads = [a + b / len(alphas) for a, b in zip(grads, step)]
    out = {}
    for dst, g in zip(groups, grads):
        for src in clean_nodes:
            dz = (corrupt_nodes[src] - clean_nodes[src]).detach()
            out[(src, dst)] = float((dz * g).sum()) / len(task)
    return out, members


def _guard(hook):
    """Run a forward hook that calls its own module without re-entering itself."""
    def wrapped(m, args, out):
        if getattr(m, "_busy", False):
            return None
        m._busy = True
        try:
            return hook(m, args, out)
        finally:
            m._busy = False
    return wrapped


def _score_of(ds, src, dst):
    hit = (ds["src"].values == src) & (ds["dst"].values == dst)
    assert hit.sum() == 1, (src, dst)
    return float(ds["score"].values[hit][0])


def test_eap_matches_hook_gradients_per_head_gpt2(tiny_gpt2):
    """GPT-2 (one key/value per head): every edge into each head of layer 1, its MLP and
    the logits against `_arch_hook_scores`."""
    m = tiny_gpt2
    lens, lens_c = _equal_lengths(m, PAIRS)
    assert lens == lens_c and len(set(lens)) == 1
    layer = 1
    ref, members = _arch_hook_scores(m, PAIRS, layer)
    assert all(len(heads) == 1 for heads in members.values())
    ds = C.edge_scores(m, PAIRS, method="eap")
    n_checked = 0
    for (src, dst), want in ref.items():
        if dst in members:
            dst = f"a{layer}.h{members[dst][0]}"
        if src in ("input",) or C.node_layer(src, m.n_layers) < layer or dst == "logits" or (
                dst == "m1" and src.startswith("a1.")):
            got = _score_of(ds, src, dst)
            assert got == pytest.approx(want, rel=1e-3, abs=1e-6), (src, dst)
            n_checked += 1
    assert n_checked > 30


def checked_against_hooks(ds, ref, members, layer, n_layers, *, head, other, tol) -> int:
    """Assert EAP scores ``ds`` equal the hook reference ``ref`` (`_arch_hook_scores`):
    into ``layer``'s heads the sum over each KV group's ``members`` (``head(h, dst)`` names
    a member's destination in ``ds``), from sources before ``layer``; any other edge where
    ``other(src, dst)``. Returns how many edges were compared."""
    n_checked = 0
    for (src, dst), want in ref.items():
        if dst in members:
            if src != "input" and C.node_layer(src, n_layers) >= layer:
                continue
            got = sum(_score_of(ds, src, head(h, dst)) for h in members[dst])
        elif other(src, dst):
            got = _score_of(ds, src, dst)
        else:
            continue
        assert got == pytest.approx(want, rel=1e-3, abs=tol), (src, dst)
        n_checked += 1
    return n_checked


def test_eap_matches_hook_gradients_llama_gqa(tiny_model):
    """Llama with grouped KV heads: MLP and logits per node; heads summed over a KV group
    (the hooks cannot give one query head its own key/value input; the sum over the group can)."""
    m = tiny_model
    lens, lens_c = _equal_lengths(m, PAIRS)
    assert lens == lens_c and len(set(lens)) == 1
    assert m.spec.n_kv_heads < m.spec.n_heads
    layer = 2
    ref, members = _arch_hook_scores(m, PAIRS, layer)
    ds = C.edge_scores(m, PAIRS, method="eap")
    n_checked = checked_against_hooks(
        ds, ref, members, layer, m.n_layers, head=lambda h, dst: f"a{layer}.h{h}", tol=1e-6,
        other=lambda src, dst: dst == "logits" or (
            dst == "m2" and src.startswith(("a0", "a1", "a2", "m0", "m1", "input"))))
    assert n_checked > 30


def test_shared_prefix_is_where_the_pair_tokens_first_differ(tiny_model):
    """EAP runs only the positions from the first one where some clean token differs from
    its corrupted one (left padding counted); identical prompts still run the last one."""
    m = tiny_model
    task = CircuitTask(["The quick brown fox jumps", "One two three"],
                       ["The quick brown dog jumps", "One two four"], [" over", " four"],
                       [" the", " five"], name="toy")   # different lengths: left padding
    tok = [m.tokenizer(p, add_special_tokens=False)["input_ids"] for p in task.clean + task.corrupt]
    width = max(len(t) for t in tok)
    firsts = [width - len(c) + next(i for i, (a, b) in enumerate(zip(c, k)) if a != b)
              for c, k in zip(tok[:2], tok[2:])]
    prep = C.prepare_pairs(m, task, [0, 1])
    assert _shared_prefix(prep) == min(firsts) > 0
    same = CircuitTask(task.clean, task.clean, task.answer, task.wrong, name="same")
    assert _shared_prefix(C.prepare_pairs(m, same, [0, 1])) == width - 1


# -- every family: EAP against hooks on model.hf -----------------------------------------------

@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2", "tiny-qwen2", "tiny-neox",
                                  "tiny-gemma2"])
def test_eap_matches_hook_gradients_every_family(name):
    """EAP on each family's tiny model (random norm gains: Gemma's init is all zeros)
    against `_arch_hook_scores`: every edge into layer 1's heads (summed over a KV group),
    its MLP and the logits. GPT-NeoX's MLP reads its layer's input, not its heads: no such
    edge exists, and the scores into that MLP still match the hooks."""
    from tests.test_engine import noisy_norms

    m = noisy_norms(name)
    lens, lens_c = _equal_lengths(m, LONG_PAIRS)
    assert lens == lens_c and len(set(lens)) == 1 and lens[0] > 8
    layer = 1
    ref, members = _arch_hook_scores(m, LONG_PAIRS, layer)
    ds = C.edge_scores(m, LONG_PAIRS, method="eap")
    edges = set(zip(ds["src"].values.tolist(), ds["dst"].values.tolist()))
    parallel = name == "tiny-neox"
    assert (("a1.h0", "m1") in edges) == (not parallel)
    big = max(abs(v) for v in ref.values())
    n_checked = checked_against_hooks(ds, ref, members, layer, m.n_layers,
                                      head=lambda h, dst: f"a{layer}.h{h}", tol=1e-5 * big,
                                      other=lambda src, dst: (src, dst) in edges)
    assert n_checked > 30 and big > 1e-4


# -- the circuit forward reproduces the model ---------------------------------------------------

@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2", "tiny-qwen2", "tiny-neox",
                                  "tiny-gemma2"])
def test_patching_all_or_no_edges_gives_corrupted_or_clean_run(name):
    m = load_model(name)
    task = CircuitTask(["The quick brown fox jumps", "One two three"],
                       ["The quick brown dog jumps", "One two four"], [" over", " four"],
                       [" the", " five"], name="toy")  # different lengths: left padding
    ids = [m.tokenizer(p, add_special_tokens=False)["input_ids"] for p in task.clean + task.corrupt]
    assert len({len(i) for i in ids}) > 1
    ans = [_target_ids(m, [c], [a])[0] for c, a in zip(task.clean, task.answer)]
    wrong = [_target_ids(m, [c], [w])[0] for c, w in zip(task.clean, task.wrong)]

    def plain_metric(prompts):
        vals = []
        for p, a, w in zip(prompts, ans, wrong):
            lg = m.hf(input_ids=torch.tensor([m.tokenizer(p, add_special_tokens=False)["input_ids"]])
                      ).logits[0, -1]
            vals.append(float(lg[a] - lg[w]))
        return np.mean(vals)

    clean, corrupt = plain_metric(task.clean), plain_metric(task.corrupt)
    scores = C.edge_scores(m, task)
    everything = C.patch_edges_metric(m, task, scores, np.ones(scores.sizes["edge"], bool))
    nothing = C.patch_edges_metric(m, task, scores, np.zeros(scores.sizes["edge"], bool))
    assert everything["metric"] == pytest.approx(clean, abs=1e-4)
    assert nothing["metric"] == pytest.approx(corrupt, abs=1e-4)
    assert everything["clean_metric"] == pytest.approx(clean, abs=1e-4)
    assert everything["corrupt_metric"] == pytest.approx(corrupt, abs=1e-4)
    assert everything["recovered"] == pytest.approx(1.0, abs=1e-3)
    assert nothing["recovered"] == pytest.approx(0.0, abs=1e-3)


def test_patching_one_edge_changes_only_its_destination(tiny_model):
    """Dropping the single edge input -> logits equals replacing the final residual's
    embedding term by the corrupted embedding (a hand computation from a hooked forward)."""
    m = tiny_model
    scores = C.edge_scores(m, PAIRS)
    keep = np.ones(scores.sizes["edge"], bool)
    keep[(scores["src"].values == "input") & (scores["dst"].values == "logits")] = False
    res = C.patch_edges_metric(m, PAIRS, scores, keep)
    vals = []
    for c, k, a, w in zip(PAIRS.clean, PAIRS.corrupt, PAIRS.answer, PAIRS.wrong):
        ids_c = torch.tensor([m.tokenize([c]).token_ids[0]])
        ids_k = torch.tensor([m.tokenize([k]).token_ids[0]])
        emb = m.hf.get_input_embeddings()
        delta = emb(ids_k) - emb(ids_c)
        h = m.hf.model.norm.register_forward_pre_hook(lambda mod, args: (args[0] + delta,))
        try:
            lg = m.hf(input_ids=ids_c).logits[0, -1]
        finally:
            h.remove()
        ai, wi = _target_ids(m, [c], [a])[0], _target_ids(m, [c], [w])[0]
        vals.append(float(lg[ai] - lg[wi]))
    assert res["metric"] == pytest.approx(np.mean(vals), abs=1e-4)


# -- EAP-IG is exact on a linear network -------------------------------------------------------

class _LinearAdapter:
    """A network where every node is linear in its input: heads mix positions with a fixed
    causal matrix and map d_model -> d_model; MLPs are matrices; logits a matrix."""

    def __init__(self, n_layers=2, n_heads=2, d=6, vocab=512, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.n_layers, self.n_heads, self.d = n_layers, n_heads, d
        self.E = torch.randn(vocab, d, generator=g)
        self.A = torch.randn(n_layers, n_heads, d, d, generator=g) / d ** 0.5
        self.M = torch.randn(n_layers, d, d, generator=g) / d ** 0.5
        self.U = torch.randn(d, vocab, generator=g)

    def lora_hooks(self):
        return []

    def embed(self, batch):
        return self.E[batch.input_ids]

    def prepare(self, x0, batch):
        p = x0.shape[1]
        return {"mix": torch.tril(torch.ones(p, p)) / torch.arange(1, p + 1)[:, None]}

    def heads(self, layer, x, mask, ctx):
        mixed = torch.einsum("qk,hbkd->hbqd", ctx["mix"], x)
        return torch.einsum("hbpd,hde->hbpe", mixed, self.A[layer])

    def attn_bias(self, layer):
        return None

    def mlp(self, layer, x):
        return x @ self.M[layer]

    def logits(self, resid):
        return resid @ self.U


def _linear_exact_effects(lin, ids_clean, ids_corrupt, ans, wrong, edges):
    """Metric change when one edge carries its corrupted value, by an explicit per-edge
    evaluation of the linear network (independent of the module's engine)."""
    L, H = lin.n_layers, lin.n_heads
    p = ids_clean.shape[1]
    mix = torch.tril(torch.ones(p, p)) / torch.arange(1, p + 1)[:, None]

    def run(ids, patched=None, corrupt_out=None):
        out = {"input": lin.E[ids]}
        order = []

        def read(dst):
            total = 0
            for src in order:
                val = out[src]
                if patched == (src, dst):
                    val = corrupt_out[src]
                total = total + val
            return total
        order.append("input")
        for layer in range(L):
            for h in range(H):
                x = read(f"a{layer}.h{h}")
                out[f"a{layer}.h{h}"] = torch.einsum("qk,bkd->bqd", mix, x) @ lin.A[layer, h]
            order += [f"a{layer}.h{h}" for h in range(H)]
            out[f"m{layer}"] = read(f"m{layer}") @ lin.M[layer]
            order.append(f"m{layer}")
        lg = read("logits")[:, -1] @ lin.U
        rows = torch.arange(ids.shape[0])
        return out, float((lg[rows, ans] - lg[rows, wrong]).mean())

    corrupt_out, _ = run(ids_corrupt)
    _, base = run(ids_clean)
    return {e: run(ids_clean, e, corrupt_out)[1] - base for e in edges}


def test_eap_ig_equals_exact_patching_on_linear_network(tiny_model, monkeypatch):
    lin = _LinearAdapter()
    monkeypatch.setattr(eap_scores, "circuit_engine", lambda model, lora=None: lin)
    task = PAIRS
    ig = C.edge_scores(tiny_model, task, method="eap-ig", steps=3)
    eap = C.edge_scores(tiny_model, task, method="eap")
    ids_c = torch.tensor([tiny_model.tokenize([p]).token_ids[0] for p in task.clean])
    ids_k = torch.tensor([tiny_model.tokenize([p]).token_ids[0] for p in task.corrupt])
    ans = torch.tensor([_target_ids(tiny_model, [c], [a])[0] for c, a in zip(task.clean, task.answer)])
    wrong = torch.tensor([_target_ids(tiny_model, [c], [w])[0] for c, w in zip(task.clean, task.wrong)])
    edges = list(zip(ig["src"].values.tolist(), ig["dst"].values.tolist()))
    # hand count: layer-0 heads 2 x 1, m0 3, layer-1 heads 2 x 4, m1 6, logits 7
    assert len(edges) == len(_graph(2, 2).edges) == 2 + 3 + 8 + 6 + 7
    exact = _linear_exact_effects(lin, ids_c, ids_k, ans, wrong, edges)
    want = np.array([exact[e] for e in edges])
    assert np.abs(want).max() > 1e-2
    np.testing.assert_allclose(ig["score"].values, want, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(eap["score"].values, want, rtol=1e-3, atol=1e-4)


# -- EAP-IG on a nonlinear model, and the KL metric ---------------------------------------------

def _plain_runs(m, task):
    """Token ids of the pairs, answer / wrong token ids, and a plain `model.hf` forward that
    returns each node's output (hooks on the embedding, o_proj inputs and MLPs)."""
    ids_c = torch.tensor([m.tokenize([p]).token_ids[0] for p in task.clean])
    ids_k = torch.tensor([m.tokenize([p]).token_ids[0] for p in task.corrupt])
    ans = torch.tensor([_target_ids(m, [c], [a])[0] for c, a in zip(task.clean, task.answer)])
    wrong = torch.tensor([_target_ids(m, [c], [w])[0] for c, w in zip(task.clean, task.wrong)])
    L, H = m.n_layers, m.spec.n_heads

    def run(embeds, leaves=None):
        """Logits at the last position and node outputs; ``leaves`` {dst: tensor} are added
        to the input of that destination alone (MLP norm, final norm)."""
        outs, handles = {}, []
        for layer in range(L):
            handles.append(m.o_proj(layer).register_forward_pre_hook(
                lambda mod, args, _l=layer: outs.__setitem__(("z", _l), args[0])))
            handles.append(m.hf_layer(layer).mlp.register_forward_hook(
                lambda mod, args, out, _l=layer: outs.__setitem__(f"m{_l}", out)))
        for dst, leaf in (leaves or {}).items():
            module = (m.hf.model.norm if dst == "logits"
                      else m.hf_layer(int(dst[1:])).post_attention_layernorm)
            handles.append(module.register_forward_pre_hook(
                lambda mod, args, _leaf=leaf: (args[0] + _leaf, *args[1:])))
        try:
            logits = m.hf(inputs_embeds=embeds).logits[:, -1]
        finally:
            for h in handles:
                h.remove()
        node = {"input": embeds}
        for layer in range(L):
            z = outs[("z", layer)].reshape(*embeds.shape[:2], H, -1)
            per_head = torch.einsum("bphe,hed->bphd", z, m.W_O(layer))
            for h in range(H):
                node[f"a{layer}.h{h}"] = per_head[:, :, h]
            node[f"m{layer}"] = outs[f"m{layer}"]
        return logits, node

    return ids_c, ids_k, ans, wrong, run


@pytest.mark.parametrize("metric,steps", [("logit_diff", 1), ("logit_diff", 3), ("kl", 3)])
def test_eap_ig_matches_integrated_gradients_by_hand(tiny_model, metric, steps):
    """EAP-IG on tiny-llama (nonlinear) against integrated gradients taken with plain hooks
    on ``model.hf``: the input embeddings interpolated from the corrupted to the clean prompt
    at alpha = k/steps (k = 1..steps), the gradient of the metric w.r.t. each destination's
    own input (an MLP, the logits) averaged over those points, times the source's corrupted
    minus clean output, summed over positions and averaged over prompts."""
    m = tiny_model
    ids_c, ids_k, ans, wrong, run = _plain_runs(m, PAIRS)
    emb = m.hf.get_input_embeddings()
    with torch.no_grad():
        x_c, x_k = emb(ids_c), emb(ids_k)
        clean_logits, clean_nodes = run(x_c)
        _, corrupt_nodes = run(x_k)
    rows = torch.arange(len(PAIRS))
    dsts = [f"m{layer}" for layer in range(m.n_layers)] + ["logits"]

    def ig(n):
        total = {d: torch.zeros_like(x_c) for d in dsts}
        for k in range(1, n + 1):
            leaves = {d: torch.zeros_like(x_c, requires_grad=True) for d in dsts}
            with torch.enable_grad():
                logits, _ = run(x_k + k / n * (x_c - x_k), leaves)
                if metric == "logit_diff":
                    value = (logits[rows, ans] - logits[rows, wrong]).sum()
                else:
                    p = torch.log_softmax(clean_logits, -1)
                    value = (p.exp() * (p - torch.log_softmax(logits, -1))).sum()
                grads = torch.autograd.grad(value, [leaves[d] for d in dsts])
            for d, g in zip(dsts, grads):
                total[d] += g
        edges = set(_graph(m.n_layers, m.spec.n_heads).edges)  # hand-counted in another test
        out = {}
        for d in dsts:
            for src in clean_nodes:
                if (src, d) in edges:
                    delta = corrupt_nodes[src] - clean_nodes[src]
                    out[(src, d)] = float((delta * total[d] / n).sum()) / len(PAIRS)
        return out

    want = ig(steps)
    got = C.edge_scores(m, PAIRS, method="eap-ig", steps=steps, metric=metric)
    assert len(want) > 40
    big = max(abs(v) for v in want.values())
    assert big > (1e-3 if metric == "logit_diff" else 1e-5)   # KL of a random tiny model is small
    for (src, dst), value in want.items():
        assert _score_of(got, src, dst) == pytest.approx(value, rel=2e-3, abs=1e-3 * big), (src, dst)
    if steps > 1:   # the interpolation matters on this model: one point gives other scores
        one = ig(1)
        assert max(abs(want[e] - one[e]) for e in want) > 0.05 * big


def test_kl_metric_endpoints(tiny_model):
    """metric="kl" with EAP-IG: every edge kept gives KL 0 (the clean run); none gives
    KL(clean || corrupted) of plain `model.hf` forwards, computed here."""
    m = tiny_model
    ids_c, ids_k, *_ = _plain_runs(m, PAIRS)
    with torch.no_grad():
        p = torch.log_softmax(m.hf(input_ids=ids_c).logits[:, -1].float(), -1)
        q = torch.log_softmax(m.hf(input_ids=ids_k).logits[:, -1].float(), -1)
    kl = float((p.exp() * (p - q)).sum(-1).mean())
    assert kl > 1e-3
    scores = C.edge_scores(m, PAIRS, method="eap-ig", steps=3, metric="kl")
    assert scores.attrs["clean_metric"] == pytest.approx(0.0, abs=1e-6)
    assert scores.attrs["corrupt_metric"] == pytest.approx(kl, rel=1e-4, abs=1e-6)
    n = scores.sizes["edge"]
    everything = C.patch_edges_metric(m, PAIRS, scores, np.ones(n, bool), metric="kl")
    nothing = C.patch_edges_metric(m, PAIRS, scores, np.zeros(n, bool), metric="kl")
    assert everything["metric"] == pytest.approx(0.0, abs=1e-6)
    assert nothing["metric"] == pytest.approx(kl, rel=1e-4, abs=1e-6)
    curve = C.faithfulness_curve(m, PAIRS, scores, sizes=[0, n], metric="kl")
    assert curve["metric"].values == pytest.approx([kl, 0.0], rel=1e-4, abs=1e-6)
    # recovered = 1 - metric / kl here, so the metric's float32 tolerance (1e-6, the
    # rounding of re-assembling every input from its edges) becomes 1e-6 / kl
    assert curve["recovered"].values == pytest.approx([0.0, 1.0], abs=max(1e-4, 1e-6 / kl))


# -- graph and circuit selection ------------------------------------------------------------------

def test_graph_nodes_edges_and_layers(tiny_model):
    g = C.circuit_graph(tiny_model)
    L, H = tiny_model.n_layers, tiny_model.spec.n_heads
    assert g.nodes[0] == "input" and g.nodes[-1] == "logits"
    assert len(g.nodes) == 2 + L * (H + 1)
    edges = set(g.edges)
    assert ("a0.h1", "m0") in edges and ("a0.h1", "a0.h2") not in edges
    assert ("m0", "a1.h0") in edges and ("a1.h0", "m0") not in edges
    assert ("input", "logits") in edges and ("m2", "logits") in edges
    # each head: input + all earlier nodes; each MLP additionally its layer's heads
    n = sum(1 + l * (H + 1) for l in range(L)) * H + sum(1 + l * (H + 1) + H for l in range(L))
    assert len(edges) == n + 1 + L * (H + 1)
    assert g.layer_of("a2.h3") == 2 and g.layer_of("m1") == 1
    assert g.layer_of("input") == 0 and g.layer_of("logits") == L - 1
    with pytest.raises(InputError, match="unknown node 'x7'"):
        g.layer_of("x7")


def _hand_scores():
    edges = [("input", "a0.h0", 5.0), ("a0.h0", "logits", 4.0),   # a full path
             ("input", "a0.h1", 3.0),                              # dead end: a0.h1 reaches nothing
             ("m0", "logits", -6.0),                               # m0 not reached from input
             ("a0.h0", "m0", 0.5), ("input", "logits", -0.1)]
    src, dst, sc = zip(*edges)
    return xr.Dataset({"score": ("edge", np.array(sc))},
                      coords={"src": ("edge", list(src)), "dst": ("edge", list(dst))})


def test_select_circuit_prunes_to_input_logits_paths():
    ds = _hand_scores()
    top4 = C.select_circuit(ds, top_n=4)
    assert top4.attrs["n_chosen"] == 4
    assert C.circuit_edges(ds, top4) == {("input", "a0.h0"), ("a0.h0", "logits")}
    assert C.circuit_nodes(ds, top4) == {"input", "a0.h0", "logits"}
    # with a0.h0 -> m0 the MLP joins the path
    thr = C.select_circuit(ds, threshold=0.5)
    assert C.circuit_edges(ds, thr) == {("input", "a0.h0"), ("a0.h0", "logits"),
                                        ("a0.h0", "m0"), ("m0", "logits")}
    assert not C.select_circuit(ds, top_n=0).any()
    everything = C.select_circuit(ds, threshold=0.0)
    assert int(everything.sum()) == 5  # all but the dead end


def test_faithfulness_curve_endpoints_and_size(tiny_model):
    scores = C.edge_scores(tiny_model, PAIRS)
    n = scores.sizes["edge"]
    curve = C.faithfulness_curve(tiny_model, PAIRS, scores, sizes=[0, 10, n])
    assert list(curve["n_edges"].values) == [0, 10, n]
    assert curve["recovered"].sel(n_edges=0) == pytest.approx(0.0, abs=1e-4)
    assert curve["recovered"].sel(n_edges=n) == pytest.approx(1.0, abs=1e-4)
    assert int(curve["n_kept"].sel(n_edges=n)) == n
    assert int(curve["n_kept"].sel(n_edges=10)) <= 10
    one = C.patch_edges_metric(tiny_model, PAIRS, scores, C.select_circuit(scores, top_n=10))
    assert one["metric"] == pytest.approx(float(curve["metric"].sel(n_edges=10)), abs=1e-5)
    json.dumps(curve.attrs)
    json.dumps(scores.attrs)


# -- tasks --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["add", "sub", "ioi", "greater-than"])
def test_task_generators(name):
    t = make_task(name, 20, seed=3)
    assert len(t) == 20 and t.name == name
    assert make_task(name, 20, seed=3).clean == t.clean
    assert all(c != k for c, k in zip(t.clean, t.corrupt))
    assert all(a != w for a, w in zip(t.answer, t.wrong))
    if name in ("add", "sub"):
        for c, a, w in zip(t.clean, t.answer, t.wrong):
            x, op, y = c.rstrip("= ").split()[-3:]
            assert int(a) == (int(x) + int(y) if op == "+" else int(x) - int(y))
            assert int(w) == (int(x) - int(y) if op == "+" else int(x) + int(y))
            assert a[0] != w[0] and len(a) == len(w) == 2


@pytest.mark.parametrize("name", ["add", "sub"])
def test_operand_corruption(name, tiny_model):
    t = make_task(name, 30, seed=4, corruption="operand")
    assert len(t) == 30 and t.name == name
    for c, k, a, w in zip(t.clean, t.corrupt, t.answer, t.wrong):
        x, op, y = c.rstrip("= ").split()[-3:]
        x2, op2, y2 = k.rstrip("= ").split()[-3:]
        assert (x2, op2) == (x, op) and y2 != y and op == ("+" if name == "add" else "-")
        assert c[:-10] == k[:-10]   # the same instruction
        f = (lambda u, v: u + v) if op == "+" else (lambda u, v: u - v)
        assert int(a) == f(int(x), int(y)) and int(w) == f(int(x), int(y2))
        assert len(a) == len(w) == len(y2) == 2 and a[0] != w[0]
        assert len(c) == len(k)
    # a tokenizer that merges digit pairs (tiny-llama's) can split b and b2 differently;
    # filter_task drops those pairs, and every pair it keeps prepares (equal token lengths)
    acc = C.task_accuracy(tiny_model, t)
    kept = C.filter_task(tiny_model, t, correct_only=False)
    assert len(kept) == int((acc["same_length"] & acc["distinct"]).sum()) > 0
    C.prepare_pairs(tiny_model, kept, list(range(len(kept))))
    assert make_task(name, 30, seed=4).corrupt != t.corrupt   # the default flips the operator
    with pytest.raises(InputError, match="applies to the arithmetic tasks"):
        make_task("ioi", 3, corruption="operand")
    with pytest.raises(InputError, match="`corruption` must be one of 'operator', 'operand'"):
        make_task(name, 3, corruption="operands")


# -- errors -------------------------------------------------------------------------------------------

def test_errors(tiny_model):
    with pytest.raises(InputError, match="`method` must be one of 'eap', 'eap-ig'; got 'eapig'"):
        C.edge_scores(tiny_model, PAIRS, method="eapig")
    with pytest.raises(InputError, match="`metric` must be one of 'logit_diff', 'kl'"):
        C.edge_scores(tiny_model, PAIRS, metric="logitdiff")
    with pytest.raises(InputError, match="zero gradient at the clean run"):
        C.edge_scores(tiny_model, PAIRS, metric="kl")
    with pytest.raises(TypeError, match="`task` must be a CircuitTask"):
        C.edge_scores(tiny_model, ["a"])
    with pytest.raises(InputError, match="`steps` must be an int in"):
        C.edge_scores(tiny_model, PAIRS, method="eap-ig", steps=0)
    bad = CircuitTask(["one two three"], ["one"], ["x"], ["y"])
    with pytest.raises(InputError, match=r"tokenise to \d+ and \d+ tokens; each pair must have the same length"):
        C.edge_scores(tiny_model, bad)
    with pytest.raises(InputError, match="`corrupt` has 1 entries but `clean` has 2"):
        CircuitTask(["a", "b"], ["c"], ["x", "y"], ["z", "w"])
    with pytest.raises(InputError, match="`task` must be one of 'add', 'sub', 'ioi', 'greater-than'"):
        make_task("addition", 3)
    with pytest.raises(InputError, match="`n` must be an int in"):
        make_task("add", 0)
    import transformers

    from explorer.models import _tiny_tokenizer, wrap_model

    cfg = transformers.AutoConfig.for_model(  # Qwen3: per-head query/key norms
        "qwen3", num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        hidden_size=32, head_dim=16, intermediate_size=64, vocab_size=512)
    qwen3 = wrap_model(transformers.AutoModelForCausalLM.from_config(cfg), _tiny_tokenizer(),
                       name="tiny-qwen3", weights="random")
    with pytest.raises(C.UnsupportedModelError, match="normalises queries and keys"):
        C.circuit_graph(qwen3)
    with pytest.raises(C.UnsupportedModelError, match="normalises queries and keys"):
        C.edge_scores(qwen3, PAIRS)
    ds = _hand_scores()
    with pytest.raises(InputError, match="exactly one of `top_n`"):
        C.select_circuit(ds)
    with pytest.raises(InputError, match="exactly one of `top_n`"):
        C.select_circuit(ds, top_n=2, threshold=0.1)
    with pytest.raises(InputError, match="`top_n` must be an int in \\[0, 6\\]; got 7"):
        C.select_circuit(ds, top_n=7)
    with pytest.raises(TypeError, match="`scores` must be the Dataset returned by edge_scores"):
        C.select_circuit(ds["score"], top_n=1)
    scores = C.edge_scores(tiny_model, PAIRS)
    with pytest.raises(InputError, match="`in_circuit` must be a bool array over the"):
        C.patch_edges_metric(tiny_model, PAIRS, scores, np.ones(3, bool))
    renamed = ds.assign_coords(src=("edge", ["inputx"] + ds["src"].values.tolist()[1:]))
    with pytest.raises(InputError, match="names node 'inputx', which tiny-llama does not have"):
        C.patch_edges_metric(tiny_model, PAIRS, renamed, np.ones(6, bool))
    with pytest.raises(InputError, match="`sizes` must hold at least one"):
        C.faithfulness_curve(tiny_model, PAIRS, scores, sizes=[])


# -- command line ------------------------------------------------------------------------------------

def test_cli_circuits_json(capsys, monkeypatch):
    from explorer import cli

    monkeypatch.setattr(cli, "COMMAND_MODULES", ("explorer.commands.circuits",))
    code = cli.main(["circuits", "--model", "tiny-llama", "--task", "add", "--n", "3",
                     "--all-prompts", "--method", "eap", "--sizes", "0,5", "--top-n", "5",
                     "--show", "3", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["n_prompts"] == 3 and len(out["top_edges"]) == 3
    assert [row["n_edges"] for row in out["faithfulness"]] == [0, 5]
    assert out["faithfulness"][0]["recovered"] == pytest.approx(0.0, abs=1e-4)
    mags = [abs(e["score"]) for e in out["top_edges"]]
    assert mags == sorted(mags, reverse=True)
    code = cli.main(["circuits", "--model", "tiny-neox", "--task", "add", "--n", "2",
                     "--all-prompts", "--method", "eap", "--sizes", "0", "--json"])
    assert code == 0   # every family of the architecture table has circuits
    assert json.loads(capsys.readouterr().out)["n_prompts"] == 2


def test_cli_circuits_threshold(capsys, monkeypatch, tiny_model):
    from explorer import cli

    monkeypatch.setattr(cli, "COMMAND_MODULES", ("explorer.commands.circuits",))
    task = make_task("add", 3, seed=0)
    scores = C.edge_scores(tiny_model, task, method="eap")
    mag = np.abs(scores["score"].values.astype(np.float64))
    t = float(np.quantile(mag, 0.7))
    code = cli.main(["circuits", "--model", "tiny-llama", "--task", "add", "--n", "3",
                     "--all-prompts", "--method", "eap",
                     "--sizes", "0", "--threshold", repr(t), "--show", "2", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)["circuit"]
    assert out["threshold"] == t and out["top_n"] is None
    assert out["n_chosen"] == int((mag >= t).sum())
    mask = C.select_circuit(scores, threshold=t)
    assert out["n_edges"] == int(mask.sum()) > 0
    want = C.patch_edges_metric(tiny_model, task, scores, mask)
    assert out["recovered"] == pytest.approx(want["recovered"], abs=1e-6)
    # --top-n and --threshold exclude each other
    assert cli.main(["circuits", "--model", "tiny-llama", "--top-n", "3", "--threshold", "0.1"]) != 0
    assert "not allowed with argument" in capsys.readouterr().err


def test_bench_eap_shape(tiny_model):
    from explorer.bench import ANALYSIS_BENCHES

    from explorer.commands.circuits import bench_eap

    assert ANALYSIS_BENCHES["eap"] == ("explorer.commands.circuits", "bench_eap")
    out = bench_eap(tiny_model, n_prompts=2, steps=2, repeats=1)
    figs = out["figures"]
    assert set(figs) >= {"eap_vs_forward_ratio", "eap_ig_vs_forward_ratio",
                         "patch_one_edge_vs_forward_ratio", "eap_peak_mb",
                         "slider_redraw_ms", "slider_redraw_cpu_ms"}
    assert 0 < figs["slider_redraw_cpu_ms"] <= figs["slider_redraw_max_cpu_ms"]
    assert all(k.endswith(("_ratio", "_ms", "_mb")) for k in figs)
    assert all(v > 0 for k, v in figs.items() if k.endswith("_ratio"))
    assert out["params"]["n_edges"] == len(C.circuit_graph(tiny_model).edges)
    json.dumps(out)


# -- SmolLM2 --------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.integration
def test_smollm2_tasks_tokenise_in_pairs_and_forward_matches(smollm2):
    """Every generated pair has equal token lengths and distinct first target tokens on
    SmolLM2 (which splits numbers into digits); the circuit forward matches its logits."""
    for name in ("add", "sub", "ioi", "greater-than"):
        t = make_task(name, 24, seed=1)
        prep = C.prepare_pairs(smollm2, t, list(range(len(t))))   # raises on unequal lengths
        assert (prep.answer != prep.wrong).all(), name
        if name in ("add", "sub"):  # the first digit, as the next token after "= "
            assert smollm2.token_strings(prep.answer.tolist()) == [a[0] for a in t.answer]
    t = make_task("add", 3)
    prep = C.prepare_pairs(smollm2, t, [0, 1, 2])
    run = C.graph_forward(C.circuit_engine(smollm2), prep.clean)
    ref = smollm2.hf(**prep.clean.model_inputs()).logits[:, -1]
    torch.testing.assert_close(run.logits, ref, atol=2e-4, rtol=1e-4)
