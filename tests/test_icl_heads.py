"""ICL heads: tasks, induction score, FV score, position-restricted Ablate, ablation curves.

References are computed independently with plain torch hooks on ``model.hf`` (one prompt
at a time, no padding) or by hand.
"""
from __future__ import annotations

import argparse
import contextlib
import json

import numpy as np
import pytest
import torch

from explorer._checks import InputError
from explorer.analyses import icl_heads as ih
from explorer.analyses.icl_heads import last_token as ih_last_token
from explorer.interventions import Ablate, edits_from_json, edits_to_json
from explorer.trace import run_with

# -- helpers: plain torch references ---------------------------------------------------------


def _ids(model, prompt):
    return torch.tensor([model.tokenizer(prompt, add_special_tokens=False)["input_ids"]])


def _last_z(model, prompt, layer):
    """o_proj input at the last token of one prompt: [n_heads * d_head]."""
    got = {}

    def hook(mod, args):
        got["z"] = args[0][0, -1].clone()

    h = model.o_proj(layer).register_forward_pre_hook(hook)
    try:
        model.hf(_ids(model, prompt))
    finally:
        h.remove()
    return got["z"]


def _logits_with_heads_set(model, ids, writes, positions=(-1,)):
    """Run ``ids`` [1, n] with head slices of the o_proj input overwritten.

    ``writes`` maps (layer, head) -> d_head tensor, or -> "batchmean" for the mean over
    all tokens of ``ids`` (which then must be a batch without padding).
    """
    d = model.spec.d_head
    handles = []
    for (layer, head), value in writes.items():
        def hook(mod, args, head=head, value=value):
            z = args[0].clone()
            sl = slice(head * d, (head + 1) * d)
            if isinstance(value, str):
                z[..., sl] = args[0][..., sl].mean((0, 1))
            else:
                for p in positions:
                    z[:, p, sl] = value
            return (z,)
        handles.append(model.o_proj(layer).register_forward_pre_hook(hook))
    try:
        return model.hf(ids).logits
    finally:
        for h in handles:
            h.remove()


# -- tasks --------------------------------------------------------------------------------


def test_shipped_icl_tasks_have_one_format():
    names = ih.icl_task_names()
    assert len(names) >= 12
    for name in names:
        task = ih.load_icl_task(name)
        assert len(task.pairs) >= 20, name
        assert all(x.strip() and y.strip() for x, y in task.pairs), name
    with pytest.raises(InputError, match="Did you mean 'antonym'"):
        ih.load_icl_task("antonyms")


def test_shuffled_prompts_keep_demos_and_queries_and_permute_labels():
    clean, a1 = ih.icl_prompts("country-capital", n_prompts=4, n_shots=5, seed=3)
    corr, a2 = ih.icl_prompts("country-capital", n_prompts=4, n_shots=5, seed=3,
                              shuffle_labels=True)
    assert a1 == a2
    for c, s in zip(clean, corr):
        cq, sq = c.split("\n\n"), s.split("\n\n")
        assert cq[-1] == sq[-1] and c.endswith("\nA:")
        assert [q.split("\n")[0] for q in cq[:-1]] == [q.split("\n")[0] for q in sq[:-1]]
        assert sorted(q.split("\n")[1] for q in cq[:-1]) == sorted(q.split("\n")[1] for q in sq[:-1])
        assert c != s
    zero, _ = ih.icl_prompts("antonym", n_prompts=2, n_shots=0)
    assert all(p.startswith("Q: ") and p.count("Q:") == 1 for p in zero)


# -- induction score -------------------------------------------------------------------------


def test_induction_score_finds_a_planted_induction_pattern():
    ids = np.array([[7, 1, 2, 3, 1, 2, 3]])
    n = ids.shape[1]
    planted = np.zeros((n, n))
    for i in range(n):
        prev = [j for j in range(1, i + 1) if ids[0, j - 1] == ids[0, i]]
        if prev:
            planted[i, prev] = 1.0 / len(prev)
        else:
            planted[i, 0] = 1.0  # attention sink
    prev_token = np.zeros((n, n))
    prev_token[0, 0] = 1.0
    for i in range(1, n):
        prev_token[i, i - 1] = 1.0
    pats = np.stack([planted, prev_token])[None, None]  # [seq, layer, head, dst, src]
    mul = ih.induction_score_from_patterns(pats, ids, "mul")
    # by hand: rows 4..6 put all their mass on targets, rows 0..3 none -> 3 / 7
    assert mul[0, 0] == pytest.approx(3 / 7)
    assert mul[0, 1] == pytest.approx(0.0)
    ab = ih.induction_score_from_patterns(pats, ids, "abs")
    # rows 0..3 have an all-zero target: |A - P|_1 = 1 each; rows 4..6 match exactly
    assert ab[0, 0] == pytest.approx(1 - 4 / 7)
    with pytest.raises(InputError, match="`measure` must be one of"):
        ih.induction_score_from_patterns(pats, ids, "sq")


def _planted_induction_model(tokenizer):
    """A 2-layer GPT-2 with hand-set weights: L0H0 a previous-token head, L1H0 an induction head.

    The residual (d_model 256) is split into orthonormal subspaces orthogonal to the all-ones
    vector (so LayerNorm is a constant rescaling): P (64 dims) holds one-hot position
    embeddings, T (95 dims) random unit token embeddings, and C (95 dims) is where L0H0
    writes a copy of the previous token. L0H0: query P, key P shifted by one position, value
    T, output into C. L1H0: query T, key C, so position i attends to j with
    token[j-1] == token[i]. Every MLP and every other head writes nothing.
    """
    import copy

    from transformers import GPT2Config, GPT2LMHeadModel

    from explorer.models import wrap_model

    d, n_pos = 256, 64                          # 2 heads of d_head 128
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=n_pos, n_embd=d, n_layer=2,
                        n_head=2, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(config)
    gen = torch.Generator().manual_seed(0)
    first_ones = torch.cat([torch.ones(d, 1), torch.randn(d, d - 1, generator=gen)], 1)
    basis, _ = torch.linalg.qr(first_ones)     # column 0: the all-ones direction
    P, T, C = basis[:, 1:65], basis[:, 65:160], basis[:, 160:255]     # [d, dims]
    tok = torch.randn(config.vocab_size, 95, generator=gen)
    tok = tok / tok.norm(dim=1, keepdim=True)
    shift = torch.zeros(n_pos, n_pos)
    shift[torch.arange(1, n_pos), torch.arange(n_pos - 1)] = 1.0       # e_j -> e_{j+1}
    c0 = (d / 2) ** 0.5        # LayerNorm gain in layer 0, where |x| = |token + position| = sqrt(2)
    with torch.no_grad():
        hf.transformer.wte.weight.copy_(tok @ T.T)
        hf.transformer.wpe.weight.copy_(P.T)
        for block in hf.transformer.h:
            for ln in (block.ln_1, block.ln_2):
                ln.weight.fill_(1.0)
                ln.bias.zero_()
            block.attn.c_attn.weight.zero_()     # [d, 3d]: q | k | v, heads of d_head
            block.attn.c_attn.bias.zero_()
            block.attn.c_proj.weight.zero_()
            block.attn.c_proj.bias.zero_()
            block.mlp.c_proj.weight.zero_()
            block.mlp.c_proj.bias.zero_()
        w0 = hf.transformer.h[0].attn.c_attn.weight
        w0[:, 0:64] = 3.0 * P                    # q_i = c0 * 3 e_i
        w0[:, d:d + 64] = P @ shift.T            # k_j = c0 * e_{j+1}
        w0[:, 2 * d:2 * d + 95] = T              # v_j = c0 * token coordinates
        hf.transformer.h[0].attn.c_proj.weight[0:95] = C.T / c0    # write the copy into C
        w1 = hf.transformer.h[1].attn.c_attn.weight
        w1[:, 0:95] = 4.0 * T                    # q_i = token_i
        w1[:, d:d + 95] = C                      # k_j = token_{j-1} (the copy)
    return wrap_model(hf, copy.deepcopy(tokenizer), name="planted-induction", weights="hand-set")


def test_induction_score_ranks_a_hand_built_induction_head_first(tiny_gpt2):
    m = _planted_induction_model(tiny_gpt2.tokenizer)
    ds = ih.induction_scores(m, n_sequences=4, half_len=20, seed=3, measure="mul")
    score = ds.induction_score.values
    order = np.argsort(-score, axis=None)
    assert np.unravel_index(order[0], score.shape) == (1, 0)
    # the planted head puts its mass on the target in the repeated half: about 20/41
    assert score[1, 0] > 0.4
    assert score[1, 0] - score.ravel()[order[1]] > 0.3
    # and L0H0 is the previous-token head it relies on (read through head_attention)
    rep = ih.head_attention(m, 0, 0, half_len=10)["repeat"].attention.values
    assert (rep[1:].argmax(-1) == np.arange(rep.shape[0] - 1)).all()


@pytest.mark.parametrize("measure", ["abs", "mul"])
def test_induction_scores_match_eager_attention_from_plain_hf(tiny_model, measure):
    m = tiny_model
    ds = ih.induction_scores(m, n_sequences=3, half_len=6, seed=1, measure=measure,
                             batch_size=2)           # two batches: the average spans both
    ids = ds.sequence_ids.values
    assert ids.shape == (3, 13) and np.array_equal(ids[:, 1:7], ids[:, 7:])
    np.testing.assert_allclose(ds.induction_score.values,
                               induction_by_eager_attention(m, ids, measure=measure), atol=1e-5)
    assert ds.attrs["method"] == "induction_scores"


def test_induction_scores_default_to_the_paper_code_setting(tiny_model):
    """Yin & Steinhardt's find_induction_heads.py: detect_head(..., error_measure="abs") on
    [BOS, r_1..r_50, r_1..r_50], seed 42."""
    ds = ih.induction_scores(tiny_model, n_sequences=1)
    params = ds.attrs["params"]
    assert (params["measure"], params["half_len"], params["seed"]) == ("abs", 50, 42)
    assert ds.sequence_ids.shape[1] == 1 + 2 * 50


def induction_by_eager_attention(m, ids, edited=contextlib.nullcontext,
                                 measure: str = "mul") -> np.ndarray:
    """[layer, head] induction scores from plain transformers' eager attention weights (run
    inside ``edited(m)``). ``mul``: per sequence, the mean over destinations i of the
    attention to every source j whose previous token repeats token i. ``abs``: 1 minus the
    mean over i of sum_j |A[i, j] - P[i, j]| (TransformerLens detect_head's abs error)."""
    current = m.hf.config._attn_implementation
    m.hf.set_attn_implementation("eager")
    try:
        with edited(m):
            att = [m.hf(torch.tensor(row[None]), output_attentions=True).attentions
                   for row in ids]
    finally:
        m.hf.set_attn_implementation(current)
    expect = np.zeros((m.spec.n_layers, m.spec.n_heads))
    for row, layers in zip(ids, att):
        for layer, a in enumerate(layers):
            a = a[0].double().numpy()  # [head, dst, src]
            if measure == "abs":
                for i in range(len(row)):
                    target = np.array([1.0 if 1 <= j <= i and row[j - 1] == row[i] else 0.0
                                       for j in range(len(row))])
                    expect[layer] += (1.0 - np.abs(a[:, i, :] - target).sum(-1)) / len(row)
                continue
            for i in range(len(row)):
                for j in range(1, i + 1):
                    if row[j - 1] == row[i]:
                        expect[layer] += a[:, i, j] / len(row)
    return expect / len(ids)


# -- position-restricted Ablate ------------------------------------------------------------


def test_ablate_positions_round_trip_and_checks():
    e = Ablate(1, 2, mode="mean", value=[0.5] * 16, positions=[-1, 0])
    assert e.positions == (-1, 0)
    assert edits_from_json(edits_to_json([e])) == [e]
    with pytest.raises(InputError, match="needs an explicit `value`"):
        Ablate(1, 2, mode="mean", positions=[-1])
    assert Ablate(0, 0, positions=[-1]).positions == (-1,)


def test_ablate_at_last_position_matches_a_torch_hook(tiny_model):
    m = tiny_model
    prompts = ["Q: hot\nA: cold\n\nQ: up\nA:", "Q: big\nA:"]  # different lengths: padding
    value = torch.linspace(-1, 1, m.spec.d_head)
    got = run_with(m, prompts, [Ablate(1, 2, mode="mean", value=value, positions=(-1,))],
                   positions=[-1]).logits.values[:, 0]
    zeroed = run_with(m, prompts, [Ablate(2, 0, positions=(-1,))], positions=[-1])
    for i, p in enumerate(prompts):
        ref = _logits_with_heads_set(m, _ids(m, p), {(1, 2): value})[0, -1]
        np.testing.assert_allclose(got[i], ref.numpy(), atol=1e-4)
        ref0 = _logits_with_heads_set(m, _ids(m, p), {(2, 0): torch.zeros(m.spec.d_head)})[0, -1]
        np.testing.assert_allclose(zeroed.logits.values[i, 0], ref0.numpy(), atol=1e-4)
        plain = m.hf(_ids(m, p)).logits[0, -1]
        assert not np.allclose(got[i], plain.numpy(), atol=1e-4)


# -- FV score ------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["last_token", "resume"])
def test_fv_indirect_effect_equals_hand_built_patch_and_compare(tiny_model, method):
    m = tiny_model
    ds = ih.fv_scores(m, ["antonym"], n_prompts=3, n_shots=2, seed=5, layers=[1], method=method)
    assert ds.attrs["params"]["fv_method"] == method
    clean, answers = ih.icl_prompts("antonym", n_prompts=3, n_shots=2, seed=5)
    corr, _ = ih.icl_prompts("antonym", n_prompts=3, n_shots=2, seed=5, shuffle_labels=True)
    target = [m.tokenizer(" " + a, add_special_tokens=False)["input_ids"][0] for a in answers]
    d = m.spec.d_head
    mean = torch.stack([_last_z(m, p, 1) for p in clean]).mean(0)  # [n_heads * d_head]
    for head in range(m.spec.n_heads):
        effects = []
        for p, t in zip(corr, target):
            base = torch.softmax(m.hf(_ids(m, p)).logits[0, -1], -1)[t]
            patched = _logits_with_heads_set(m, _ids(m, p),
                                             {(1, head): mean[head * d:(head + 1) * d]})
            effects.append(float(torch.softmax(patched[0, -1], -1)[t] - base))
        assert ds.indirect_effect.values[0, 1, head] == pytest.approx(np.mean(effects), abs=1e-6)
    assert np.isnan(ds.indirect_effect.values[0, 0]).all()
    np.testing.assert_allclose(ds.mean_z.values[0, 1].reshape(-1), mean.numpy(), atol=1e-5)
    np.testing.assert_allclose(ds.fv_score.values, ds.indirect_effect.values[0])
    with pytest.raises(InputError, match="at least one task"):
        ih.fv_scores(m, [])


def test_batched_fv_scores_equal_one_trace_per_head(tiny_model):
    """Every chunking (heads split inside a layer, across layers, all in one trace) gives the
    indirect effect of patching each head alone: one plain run_batch per head, no resume."""
    m = tiny_model
    kw = dict(n_prompts=3, n_shots=2, seed=3)
    corr, answers = ih.icl_prompts("uppercase", shuffle_labels=True, **kw)
    clean, _ = ih.icl_prompts("uppercase", **kw)
    target = torch.tensor(ih.answer_token_ids(m, answers))
    rows = torch.arange(len(target))
    mz = ih.task_mean_z(m, clean)
    batch = m.tokenize(corr)
    base = ih.last_token_probs(m, batch)[rows, target]
    expect = np.zeros((m.spec.n_layers, m.spec.n_heads))
    for layer in range(m.spec.n_layers):
        for head in range(m.spec.n_heads):
            edit = Ablate(layer, head, mode="mean", value=mz[layer, head], positions=(-1,))
            p = ih.last_token_probs(m, batch, [edit])[rows, target]
            expect[layer, head] = float((p - base).mean())
    # the random-init model's answer probabilities are ~2e-3 and the effects ~1e-6, so the
    # comparison is relative: float32 resolves them to ~1e-10, and heads differ by ~1e-6
    assert np.abs(expect).min() > 1e-8 and len(np.unique(expect.round(9))) == expect.size
    assert len(set(batch.lengths)) > 1  # left padding: the last-token path's position ids
    for method in ("resume", "last_token"):
        for max_rows in (3, 6, 24, 256):  # 1 head a trace, 2 (layers split), 8 (2 layers), all
            ds = ih.fv_scores(m, ["uppercase"], max_rows=max_rows, method=method, **kw)
            np.testing.assert_allclose(ds.indirect_effect.values[0], expect, rtol=1e-3,
                                       atol=2e-9)
    calls = []
    ih.fv_scores(m, ["uppercase"], max_rows=24, progress=lambda d, t: calls.append((d, t)), **kw)
    assert calls == [(8, 12), (12, 12)]
    with pytest.raises(InputError, match=r"`max_rows` must be an int in \[1, inf\]"):
        ih.fv_scores(m, ["uppercase"], max_rows=0, **kw)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2", "tiny-neox", "tiny-qwen2",
                                  "tiny-gemma2"])
def test_last_token_cache_reproduces_the_full_forward(name):
    """The cached last-token run gives the full forward's last-token probabilities on a
    left-padded batch (prompts of different lengths), unpatched and with heads patched,
    and leaves the per-task cache unchanged between runs, in every family it serves."""
    from explorer import load_model

    m = load_model(name)
    assert ih.last_token_problem(m) is None
    corr, answers = ih.icl_prompts("antonym", n_prompts=3, n_shots=2, seed=1, shuffle_labels=True)
    corr = corr + ["Q: big\nA:"]
    target = torch.tensor(ih.answer_token_ids(m, answers + ["small"]))
    batch = m.tokenize(corr)
    assert len(set(batch.lengths)) >= 3
    rows = torch.arange(len(corr))
    full = ih.last_token_probs(m, batch)[rows, target]
    prefix = ih.last_token_cache(m, batch)
    keys = [layer.keys.clone() for layer in prefix.cache.layers]
    np.testing.assert_allclose(ih.fv_last_token_probs(m, prefix, [], None, target)[0], full,
                               rtol=1e-5)
    mz = np.random.default_rng(0).normal(size=(m.spec.n_layers, m.spec.n_heads, m.spec.d_head))
    heads = [(2, 1), (0, 3), (1, 0)]
    got = ih.fv_last_token_probs(m, prefix, heads, mz, target)            # [head, prompt]
    for j, (layer, head) in enumerate(heads):
        edit = Ablate(layer, head, mode="mean", value=mz[layer, head], positions=(-1,))
        ref = ih.last_token_probs(m, batch, [edit])[rows, target]
        assert not np.allclose(ref, full, rtol=1e-3)
        np.testing.assert_allclose(got[j], ref, rtol=1e-5)
        one = ih.fv_last_token_probs(m, prefix, [(layer, head)], mz, target)[0]
        np.testing.assert_allclose(one, ref, rtol=1e-5)
    assert all(torch.equal(a, b.keys) for a, b in zip(keys, prefix.cache.layers))


def test_last_token_path_only_where_it_applies(tiny_model, tiny_gpt2, monkeypatch):
    """Every family of the architecture table takes the last-token path; a family outside
    LAST_TOKEN_FAMILIES (here Gemma 2 taken out of it) falls back to resuming under "auto"
    and is refused under "last_token"."""
    from explorer import load_model
    from explorer.models import ARCHITECTURES

    gemma = load_model("tiny-gemma2")
    assert set(ARCHITECTURES) <= set(ih.LAST_TOKEN_FAMILIES)
    assert all(ih.last_token_problem(m) is None for m in (tiny_model, tiny_gpt2, gemma))
    kw = dict(n_prompts=2, n_shots=2, seed=0, layers=[0])
    assert ih.fv_scores(tiny_gpt2, ["antonym"], **kw).attrs["params"]["fv_method"] == "last_token"
    assert ih.fv_scores(gemma, ["antonym"], **kw).attrs["params"]["fv_method"] == "last_token"
    monkeypatch.setattr(ih_last_token, "LAST_TOKEN_FAMILIES", ("llama", "gpt2", "gpt_neox"))
    assert "gemma2" in ih.last_token_problem(gemma)
    ds = ih.fv_scores(gemma, ["antonym"], **kw)
    assert ds.attrs["params"]["fv_method"] == "resume"
    with pytest.raises(InputError, match="handles the llama, gpt2, gpt_neox families"):
        ih.fv_scores(gemma, ["antonym"], method="last_token", **kw)
    with pytest.raises(InputError, match="`method` must be one of"):
        ih.fv_scores(tiny_model, ["antonym"], method="fast", **kw)


def test_head_chunks_keep_layers_together():
    heads = [(layer, h) for layer in range(3) for h in range(4)]
    assert ih.head_chunks(heads, 8) == [heads[:8], heads[8:]]
    assert ih.head_chunks(heads, 5) == [heads[:4], heads[4:8], heads[8:]]
    assert ih.head_chunks(heads, 3) == [heads[0:3], heads[3:4], heads[4:7], heads[7:8],
                                         heads[8:11], heads[11:]]
    assert ih.head_chunks(heads[2:], 100) == [heads[2:]]
    assert [len(c) for c in ih.head_chunks(heads, 1)] == [1] * 12


# -- ablations -----------------------------------------------------------------------------


def test_top_heads_counts_all_heads_and_excludes():
    score = np.array([[0.9, 0.1, 0.5], [0.8, 0.7, 0.0]])
    assert ih.top_heads(score, 0.0) == []
    assert ih.top_heads(score, 0.34) == [(0, 0), (1, 0)]          # round(0.34 * 6) = 2
    assert ih.top_heads(score, 0.34, exclude=[(1, 0)]) == [(0, 0), (1, 1)]
    assert ih.top_heads(score, 0.01) == [(0, 0)]                  # at least one
    with pytest.raises(InputError, match="`fraction` must be a number in"):
        ih.top_heads(score, 1.5)


def test_ablation_masks_the_right_heads(tiny_model):
    m = tiny_model
    heads = [(0, 1), (2, 3)]
    mz = np.random.default_rng(0).normal(size=(m.spec.n_layers, m.spec.n_heads, m.spec.d_head))
    edits = ih.ablation_edits(heads, mz)
    assert {(e.layer, e.head, e.positions) for e in edits} == {(0, 1, (-1,)), (2, 3, (-1,))}
    prompts, answers = ih.icl_prompts("capitalize", n_prompts=3, n_shots=2, seed=0)
    got = run_with(m, prompts, edits, positions=[-1]).logits.values[:, 0]
    writes = {h: torch.tensor(mz[h], dtype=torch.float32) for h in heads}
    ref = [_logits_with_heads_set(m, _ids(m, p), writes)[0, -1].numpy() for p in prompts]
    np.testing.assert_allclose(got, np.stack(ref), atol=1e-4)
    target = np.array([m.tokenizer(" " + a, add_special_tokens=False)["input_ids"][0]
                       for a in answers])
    acc = ih.few_shot_accuracy(m, prompts, answers, edits)
    assert acc == pytest.approx(np.mean(np.stack(ref).argmax(-1) == target))
    # whole-sequence mean ablation (token-loss difference): the head's mean over all tokens
    seqs = [list(range(10, 40)), list(range(50, 80))]
    full = ih.ablation_edits(heads, None, positions=None)
    tld = ih.token_loss_difference(m, seqs, full, early=5, window=4)
    logits = _logits_with_heads_set(m, torch.tensor(seqs), {h: "batchmean" for h in heads})
    ids = torch.tensor(seqs)
    loss = -torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    assert tld == pytest.approx(float(loss[:, 4:8].mean() - loss[:, -4:].mean()), abs=1e-4)
    with pytest.raises(InputError, match="too short"):
        ih.token_loss_difference(m, seqs, early=20, window=8)


def test_ablation_curves_shapes_and_zero_percent_baseline(tiny_model):
    m = tiny_model
    rng = np.random.default_rng(1)
    shape = (m.spec.n_layers, m.spec.n_heads)
    induction, fv = rng.random(shape), rng.random(shape)
    ds = ih.ablation_curves(m, ["antonym", "uppercase"], induction, fv,
                            percents=(0, 10, 50), n_prompts=3, n_shots=2, loss_sequences=2,
                            loss_tokens=40, exclude_fraction=0.1)
    assert ds.accuracy.dims == ("ranking", "percent", "task")
    assert list(ds.ranking.values) == list(ih.RANKINGS)
    tld0 = ds.token_loss_difference.sel(percent=0.0).values
    assert np.allclose(tld0, tld0[0])                 # nothing ablated at 0 %
    assert json.loads(str(ds.ablated.sel(ranking="fv", percent=0.0).values)) == []
    # 50 % of 12 heads = 6 heads; the exclusion variant skips the other score's top head
    fv_ex = [tuple(h) for h in
             json.loads(str(ds.ablated.sel(ranking="fv_excl_induction", percent=50.0).values))]
    top_ind = np.unravel_index(np.argmax(induction), shape)
    order = [np.unravel_index(i, shape) for i in np.argsort(-fv, axis=None)]
    expect = [tuple(int(v) for v in lh) for lh in order if lh != top_ind][:6]
    assert fv_ex == expect
    with pytest.raises(InputError, match="scores must be"):
        ih.ablation_curves(m, ["antonym"], np.zeros((2, 2)), np.zeros((2, 2)))
    # the 0% point: answer probability from a plain forward of each (unpadded) eval prompt
    prompts, answers = ih.icl_prompts("antonym", n_prompts=3, n_shots=2, seed=1)
    target = [m.tokenizer(" " + a, add_special_tokens=False)["input_ids"][0] for a in answers]
    probs = [float(torch.softmax(m.hf(_ids(m, q)).logits[0, -1], -1)[t])
             for q, t in zip(prompts, target)]
    got = ds.answer_prob.sel(percent=0.0, task="antonym").values
    np.testing.assert_allclose(got, np.mean(probs), atol=1e-5)


def test_ablation_curves_ranking_subset(tiny_model):
    m = tiny_model
    rng = np.random.default_rng(2)
    shape = (m.spec.n_layers, m.spec.n_heads)
    induction, fv = rng.random(shape), rng.random(shape)
    kw = dict(percents=(0, 25), n_prompts=2, n_shots=2, loss_sequences=2, loss_tokens=40)
    ds = ih.ablation_curves(m, ["uppercase"], induction, fv,
                            rankings=["fv_excl_induction", "random"], **kw)
    assert list(ds.ranking.values) == ["fv_excl_induction", "random"]
    assert ds.attrs["params"]["rankings"] == ["fv_excl_induction", "random"]
    with pytest.raises(InputError, match="Did you mean 'induction'"):
        ih.ablation_curves(m, ["uppercase"], induction, fv, rankings=["inductoin"], **kw)
    with pytest.raises(InputError, match="`rankings` must be a non-empty list"):
        ih.ablation_curves(m, ["uppercase"], induction, fv, rankings=[], **kw)


# -- CLI and bench -------------------------------------------------------------------------


def test_cli_icl_heads_json(tiny_model, capsys):
    """The command's numbers are the library's on the same model and arguments."""
    from explorer.commands.icl_heads import register_cli

    parser = argparse.ArgumentParser()
    register_cli(parser.add_subparsers())
    args = parser.parse_args(["icl-heads", "--model", "tiny-llama", "--tasks", "antonym",
                              "--eval-tasks", "capitalize", "--percents", "0,25",
                              "--n-prompts", "2", "--n-shots", "2", "--top-fraction", "0.25",
                              "--json"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    ind = ih.induction_scores(tiny_model, seed=0)["induction_score"].values
    fv = ih.fv_scores(tiny_model, ["antonym"], n_prompts=2, n_shots=2, seed=0)
    np.testing.assert_allclose(out["induction_score"], ind, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(out["fv_score"], fv["fv_score"].values, rtol=1e-6, atol=1e-9)
    assert out["clean_prob"]["antonym"] == pytest.approx(float(fv.clean_prob.sel(task="antonym")))
    assert out["corrupted_prob"]["antonym"] == \
        pytest.approx(float(fv.corrupted_prob.sel(task="antonym")))
    top_i = ih.top_heads(ind, 0.25)
    top_f = ih.top_heads(fv["fv_score"].values, 0.25)
    assert len(top_i) == 3 == len(top_f)                    # 25 % of 3 x 4 heads
    assert [tuple(h) for h in out["overlap"]["top_induction"]] == [tuple(h) for h in top_i]
    assert [tuple(h) for h in out["overlap"]["top_fv"]] == [tuple(h) for h in top_f]
    assert {tuple(h) for h in out["overlap"]["shared"]} == set(map(tuple, top_i)) & \
        set(map(tuple, top_f))
    curves = ih.ablation_curves(tiny_model, ["capitalize"], ind, fv["fv_score"].values,
                                percents=[0.0, 25.0], exclude_fraction=0.25, n_prompts=2,
                                n_shots=2, seed=0, mean_tasks=["antonym"])
    assert out["percents"] == [0.0, 25.0]
    assert out["mean_source"] == "cross-task" and out["mean_tasks"] == ["antonym"]
    for var in ("mean_accuracy_low", "mean_accuracy_high"):
        for r in ih.RANKINGS:
            np.testing.assert_allclose(out[var][r], curves[var].sel(ranking=r).values)
    assert set(out["mean_accuracy"]) == set(ih.RANKINGS)
    for r in ih.RANKINGS:
        np.testing.assert_allclose(out["mean_accuracy"][r],
                                   curves.mean_accuracy.sel(ranking=r).values, atol=1e-12)
        np.testing.assert_allclose(out["token_loss_difference"][r],
                                   curves.token_loss_difference.sel(ranking=r).values,
                                   rtol=1e-6, atol=1e-9)


def test_bench_icl_heads_reports_ratio(tiny_model):
    from explorer.benches.icl_heads import bench_icl_heads

    out = bench_icl_heads(tiny_model, n_prompts=2, n_shots=2, n_heads=2)
    assert out["figures"]["fv_head_task_pair_vs_forward_ratio"] > 0
    assert out["figures"]["fv_head_task_pair_ms"] > 0
    assert out["figures"]["per_head_trace_vs_forward_ratio"] > 0
    assert out["params"]["n_heads_timed_per_head"] == 2
    assert out["params"]["n_heads_scored"] == tiny_model.spec.n_layers * tiny_model.spec.n_heads
    assert out["accuracy"]["max_abs_prob_diff_batched_vs_per_head"] < 1e-5
    assert out["figures"]["fv_last_token_pair_vs_forward_ratio"] > 0
    assert out["accuracy"]["max_abs_prob_diff_last_token_vs_per_head"] < 1e-5


@pytest.mark.integration
def test_smollm2_has_induction_heads(smollm2):
    ds = ih.induction_scores(smollm2, n_sequences=4, half_len=20, seed=42, measure="mul")
    # a pretrained model has heads with much of their attention on the induction target
    # (about 0.4 for the best SmolLM2 head; mass over all rows, half of which have no target)
    assert float(ds.induction_score.max()) > 0.25
    assert float(ds.induction_score.median()) < 0.1


def test_bench_icl_heads_is_registered_from_the_bench_layer():
    import importlib

    from explorer.bench import ANALYSIS_BENCHES
    from explorer.benches.icl_heads import bench_icl_heads

    module, attr = ANALYSIS_BENCHES["icl-heads"]
    assert getattr(importlib.import_module(module), attr) is bench_icl_heads
