"""Knowledge conflicts (JuICE, Li et al. ICML 2025): data, direct scores, dual run, selection.

Values are checked against plain torch hooks on ``model.hf`` and against the logits of the
actual run, never against the analysis's own earlier output.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from explorer import load_model
from explorer._checks import InputError
from explorer.analyses import conflicts as C
from explorer.analyses.conflicts import runs as conflict_runs
from explorer.interventions import AddHead, edit_from_dict
from explorer.trace import run_with
from tests._cli import parse_and_run

# -- helpers: plain torch hooks -------------------------------------------------------------


def _hf_last_logits(model, prompt, hooks=()):
    ids = torch.tensor([model.tokenize([prompt]).token_ids[0]])
    handles = [mod.register_forward_pre_hook(fn) for mod, fn in hooks]
    try:
        out = model.hf(input_ids=ids).logits[0, -1].float()
    finally:
        for h in handles:
            h.remove()
    return out


def _capture_o_proj_inputs(model, prompt, layers):
    cache = {}

    def make(layer):
        def hook(mod, args):
            cache[layer] = args[0][0].clone()  # [pos, head*d_head]
        return hook

    _hf_last_logits(model, prompt, [(model.o_proj(x), make(x)) for x in layers])
    return cache


def _fact(subject="France", memory="Paris", context="Rome"):
    return C.Fact("country_capital", subject, memory, context,
                  "The capital city of {subject} is", "The capital city of {subject} is {value}.",
                  "People in {subject} say {value} is the capital.",
                  "Question: What is the capital of {subject}? Answer: The capital of {subject} is")


# -- data ------------------------------------------------------------------------------------

def test_shipped_facts_have_four_relations_and_false_contexts():
    facts = C.load_facts()
    rels = {f.relation for f in facts}
    assert len(rels) >= 4
    for rel in rels:
        assert sum(f.relation == rel for f in facts) >= 10
    assert all(f.memory != f.context for f in facts)
    fr = next(f for f in facts if f.relation == "country_capital" and f.subject == "France")
    assert fr.memory == "Paris" and fr.context == "Berlin"  # the next fact's answer


def test_prompt_kinds():
    f = _fact()
    assert C.conflict_prompt(f, "clean") == "The capital city of France is"
    sub = C.conflict_prompt(f, "substitution")
    assert sub == "The capital city of France is Rome. The capital city of France is"
    coh = C.conflict_prompt(f, "coherent")
    assert "Rome" in coh and "Paris" not in coh and coh.endswith("The capital of France is")


def test_bad_inputs_raise():
    with pytest.raises(InputError, match="`relation` must be one of .*Did you mean 'country_capital'"):
        C.load_facts(["country_capitol"])
    with pytest.raises(InputError, match="`kind` must be one of"):
        C.conflict_prompt(_fact(), "closed")
    with pytest.raises(InputError, match="at least one fact"):
        C.head_context_memory_scores(None, [])


def test_answer_normalisation():
    assert C.normalise_answer("  Bogotá, ") == "bogota"
    assert C.answer_in("Paris", " Paris. It is a city")
    assert not C.answer_in("Paris", " a b c d e Paris")       # only the first five words
    assert not C.answer_in("Rome", " Romeo")                  # whole words only
    assert C.answer_in("Statue of Liberty", " the statue of liberty!")


def test_closed_book_filter_keeps_known_facts_and_caches(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path))
    f = _fact()
    # the greedy continuation, by a plain forward loop on token ids
    ids = tiny_model.tokenize([C.conflict_prompt(f, "clean")]).token_ids[0]
    gen = []
    for _ in range(5):
        logits = tiny_model.hf(input_ids=torch.tensor([ids + gen])).logits[0, -1]
        gen.append(int(logits.argmax()))
    words = C.normalise_answer(tiny_model.tokenizer.decode(gen)).split()
    assert words, "the tiny model's continuation has no word to use as the answer"
    known = _fact(subject="France", memory=words[0])
    unknown = _fact(subject="France", memory="zzqqxx")
    kept = C.closed_book_facts(tiny_model, [unknown, known])
    assert kept == [known]
    files = list((tmp_path / "conflicts").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["kept"] == [1]

    def boom(*a, **k):
        raise AssertionError("the cache was not used")

    monkeypatch.setattr(conflict_runs, "greedy_answers", boom)
    assert C.closed_book_facts(tiny_model, [unknown, known]) == [known]


# -- direct contributions ------------------------------------------------------------------------

def test_direct_contributions_sum_to_the_logit_difference(tiny_model):
    # facts whose two answers start with different tokens in the tiny tokenizer
    facts = [C.load_facts(["country_capital"])[i] for i in (0, 2, 7)]
    ds = C.head_context_memory_scores(tiny_model, facts, ablation=False)
    total = (ds.direct_diff.sum(("layer", "head")) + ds.embed_diff + ds.mlp_diff.sum("layer")
             + ds.attn_bias_diff.sum("layer") + ds.norm_bias_diff)
    np.testing.assert_allclose(total.values, ds.logit_diff.values, atol=1e-4)
    assert float(abs(ds.logit_diff).max()) > 1e-3  # not a trivial 0 == 0
    # the logit difference itself against a plain forward
    f = facts[1]
    lg = _hf_last_logits(tiny_model, C.conflict_prompt(f, "coherent"))
    m, c = (tiny_model.tokenizer(" " + a, add_special_tokens=False)["input_ids"][0]
            for a in (f.memory, f.context))
    assert float(ds.logit_diff.sel(kind="coherent", fact=1)) == pytest.approx(
        float(lg[m] - lg[c]), abs=1e-4)
    # scores are the positive parts of the head's mean push toward memory / context
    d = ds.direct_diff.values
    np.testing.assert_allclose(ds.memory_score, np.clip(d, 0, None).mean((0, 1)))
    np.testing.assert_allclose(ds.context_score, np.clip(-d, 0, None).mean((0, 1)))


def test_one_head_direct_contribution_by_hand(tiny_model):
    f = C.load_facts(["country_capital"])[0]  # Paris vs Berlin: distinct first tokens
    prompt = C.conflict_prompt(f, "substitution")
    layer, head = 1, 2
    d = tiny_model.spec.d_head
    z = _capture_o_proj_inputs(tiny_model, prompt, [layer])[layer][-1, head * d:(head + 1) * d]
    h = z.double() @ tiny_model.W_O(layer)[head].double()               # [d_model]
    resid = {}
    norm = tiny_model.final_norm_module

    def grab(mod, args):
        resid["x"] = args[0][0, -1].clone()

    _hf_last_logits(tiny_model, prompt, [(norm, grab)])
    x = resid["x"].double()
    scale = 1 / torch.sqrt(x.pow(2).mean() + norm.variance_epsilon)
    W_U = tiny_model.unembed_module.weight.double()
    m, c = (tiny_model.tokenizer(" " + a, add_special_tokens=False)["input_ids"][0]
            for a in (f.memory, f.context))
    assert m != c
    want = float((norm.weight.double() * h * scale) @ (W_U[m] - W_U[c]))
    ds = C.head_context_memory_scores(tiny_model, [f], kinds=["substitution"])
    got = float(ds.direct_diff.sel(kind="substitution", fact=0, layer=layer, head=head))
    assert got == pytest.approx(want, rel=1e-4, abs=1e-6)
    # ablation effect: zero the head's slice of o_proj's input in a plain forward
    def zero(mod, args):
        a = args[0].clone()
        a[..., head * d:(head + 1) * d] = 0
        return (a,)

    lg0 = _hf_last_logits(tiny_model, prompt)
    lg1 = _hf_last_logits(tiny_model, prompt, [(tiny_model.o_proj(layer), zero)])
    eff = float((lg1[m] - lg1[c]) - (lg0[m] - lg0[c]))
    got = float(ds.ablation_effect.sel(kind="substitution", fact=0, layer=layer, head=head))
    assert got == pytest.approx(eff, abs=1e-4)
    assert abs(eff) > 1e-6


# -- AddHead and the dual run ----------------------------------------------------------------------

def test_add_head_round_trip_and_errors(tiny_model):
    e = AddHead(1, 2, np.arange(32.0), alpha=-2.0)
    assert edit_from_dict(json.loads(json.dumps(e.to_dict()))) == e
    with pytest.raises(InputError, match="whole number of d_head=16 vectors; got 5"):
        AddHead(1, 2, np.ones(5)).validate(tiny_model)
    with pytest.raises(InputError, match="holds 2 vectors but the run selects 1"):
        run_with(tiny_model, ["abc"], [AddHead(1, 2, np.ones(32), positions=(-1,))])
    with pytest.raises(InputError, match=r"`heads_plus\[0\] head` must be an int in \[0, 3\]"):
        C.juice_logits(tiny_model, ["abc"], [(1, 9)])


def test_add_head_equals_a_hook(tiny_model):
    prompt = "The capital city of Spain is"
    d = tiny_model.spec.d_head
    vec = torch.linspace(-1, 1, d)

    def add(mod, args):
        a = args[0].clone()
        a[0, -1, 3 * d:4 * d] += 0.5 * vec
        return (a,)

    want = _hf_last_logits(tiny_model, prompt, [(tiny_model.o_proj(2), add)])
    ds = run_with(tiny_model, [prompt], [AddHead(2, 3, vec, alpha=0.5, positions=(-1,))],
                  positions=[-1])
    np.testing.assert_allclose(ds.logits.values[0, -1], want.numpy(), atol=1e-4)


def _two_pass_by_hand(model, prompt, plus, minus, alpha_l, alpha_s):
    d = model.spec.d_head
    layers = sorted({x for x, _ in plus + minus})
    cache = _capture_o_proj_inputs(model, prompt, layers)   # run 1: [pos, head*d_head]

    def make(layer):
        def hook(mod, args):
            a = args[0].clone()
            for group, alpha in ((plus, alpha_l), (minus, -alpha_s)):
                for x, h in group:
                    if x == layer:
                        a[0, :, h * d:(h + 1) * d] += alpha * cache[layer][:, h * d:(h + 1) * d]
            return (a,)
        return hook

    return _hf_last_logits(model, prompt, [(model.o_proj(x), make(x)) for x in layers])


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_dual_run_equals_two_pass_hooks(name, tiny_model, tiny_gpt2):
    model = tiny_model if name == "tiny-llama" else tiny_gpt2
    prompts = ["The capital city of France is Rome. The capital city of France is",
               "The chemical symbol of gold is"]                 # different lengths: padding
    plus, minus = [(0, 1), (2, 3)], [(1, 0)]
    got = C.juice_logits(model, prompts, plus, minus, alpha_l=3.0, alpha_s=2.0)
    for i, p in enumerate(prompts):
        want = _two_pass_by_hand(model, p, plus, minus, 3.0, 2.0)
        plain = _hf_last_logits(model, p)
        np.testing.assert_allclose(got[i].numpy(), want.numpy(), atol=2e-4)
        assert float(abs(want - plain).max()) > 1e-3            # the intervention did something
    # the single run differs from the dual run once a later head sees an edited residual
    single = C.single_run_logits(model, prompts, plus, minus, alpha_l=3.0, alpha_s=2.0)
    assert float(abs(single - got).max()) > 1e-4


def test_single_run_equals_scaling_hooks(tiny_model):
    prompt = "The official language of Italy is"
    d = tiny_model.spec.d_head

    def scale(h, factor):
        def hook(mod, args):
            a = args[0].clone()
            a[..., h * d:(h + 1) * d] *= factor
            return (a,)
        return hook

    want = _hf_last_logits(tiny_model, prompt, [(tiny_model.o_proj(1), scale(2, 3.0)),
                                                (tiny_model.o_proj(2), scale(0, 0.5))])
    got = C.single_run_logits(tiny_model, [prompt], [(1, 2)], [(2, 0)], alpha_l=2.0, alpha_s=0.5)
    np.testing.assert_allclose(got[0].numpy(), want.numpy(), atol=1e-4)


# -- head selection ------------------------------------------------------------------------------

def test_head_selection_finds_a_head_built_to_write_the_context_answer():
    """Layer 2, head 0 of a tiny Qwen2 is set by hand to write the context answer's
    unembedding vector whatever the prompt (V = a constant bias, O = that vector);
    scaling it up must raise p(context answer) on all three prompt types."""
    model = load_model("tiny-qwen2")  # a fresh copy: the weights are changed below
    facts = [_fact(s, m, "Rome") for s, m in (("France", "Paris"), ("Spain", "Madrid"),
                                               ("Japan", "Tokyo"))]
    t = model.tokenizer(" Rome", add_special_tokens=False)["input_ids"][0]
    d, H = model.spec.d_head, model.spec.n_heads
    attn = model.hf.model.layers[2].self_attn
    gen = torch.Generator().manual_seed(0)
    u = torch.randn(model.spec.d_model, generator=gen)
    with torch.no_grad():
        model.hf.lm_head.weight[t] = 0.1 * u                   # tied: a distinct direction
        attn.v_proj.weight[:d] = 0.0                           # KV group 0 = heads 0 and 1
        attn.v_proj.bias[:d] = 1.0                             # z = ones for heads 0 and 1
        attn.o_proj.weight[:, :d] = (0.01 * u / d)[:, None]    # head 0 writes 0.01 * u
        attn.o_proj.weight[:, d:2 * d] = 0.0                   # head 1 writes nothing
    sel = C.juice_head_selection(model, facts, direction="context", k=2,
                                 enhance_alphas=(1.0, 3.0, 5.0), suppress_alphas=(-1.0,))
    plus, minus = C.selected_heads(sel)
    assert plus[0] == (2, 0)
    assert (2, 1) not in plus + minus
    assert bool(sel.consistent_plus.sel(layer=2, head=0))
    delta = sel.delta_plus.values.copy()                     # [kind, layer, head]
    built = delta[:, 2, 0].copy()
    delta[:, 2, 0] = 0.0
    assert (built > 0.1).all() and (built > 5 * abs(delta).max((1, 2))).all()
    assert not bool(sel.consistent_minus.sel(layer=2, head=0))
    assert sel.delta_plus.shape == (3, model.n_layers, H)


@pytest.mark.slow
def test_head_selection_delta_equals_scaling_runs(tiny_model):
    """Delta+ / Delta- of one head against plain hooks scaling the head by 1 + alpha."""
    facts = [C.load_facts(["country_capital"])[i] for i in (0, 2, 7)]
    layer, head = 1, 2
    d = tiny_model.spec.d_head
    sel = C.juice_head_selection(tiny_model, facts, k=2, layers=[layer],
                                 enhance_alphas=(1.0, 10.0), suppress_alphas=(-2.0,))

    def scale(factor):
        def hook(mod, args):
            a = args[0].clone()
            a[..., head * d:(head + 1) * d] *= factor
            return (a,)
        return hook

    for kind in C.PROMPT_KINDS:
        for name, alphas in (("delta_plus", (1.0, 10.0)), ("delta_minus", (-2.0,))):
            gain = []
            for f in facts:
                prompt = C.conflict_prompt(f, kind)
                t = tiny_model.tokenizer(" " + f.memory, add_special_tokens=False)["input_ids"][0]
                p0 = torch.softmax(_hf_last_logits(tiny_model, prompt), -1)[t]
                for a in alphas:
                    lg = _hf_last_logits(tiny_model, prompt, [(tiny_model.o_proj(layer), scale(1 + a))])
                    gain.append(float(torch.softmax(lg, -1)[t] - p0))
            got = float(sel[name].sel(kind=kind, layer=layer, head=head))
            assert got == pytest.approx(np.mean(gain), abs=1e-6)
    assert np.isnan(sel.delta_plus.sel(layer=0)).all()        # layers not scored
    # pruning skips heads that failed for both sets but chooses the same heads
    small = dict(k=3, enhance_alphas=(1.0, 10.0), suppress_alphas=(-2.0,))
    full = C.juice_head_selection(tiny_model, facts[:2], **small)
    pruned = C.juice_head_selection(tiny_model, facts[:2], prune=True, **small)
    assert np.isnan(pruned.delta_plus.values).any()          # something was pruned
    assert C.selected_heads(full) == C.selected_heads(pruned)


def test_alpha_search_and_first_run_reuse(tiny_model):
    facts = [C.load_facts(["country_capital"])[i] for i in (0, 2)]
    plus, minus = [(1, 2)], [(2, 0)]
    ds = C.juice_alpha_search(tiny_model, facts, plus, minus, alpha_s_grid=(0.0, 2.0),
                              alpha_l_grid=(1.0, 4.0), kinds=("substitution",))
    for a_s in (0.0, 2.0):
        for a_l in (1.0, 4.0):
            probs = []
            for f in facts:
                want = _two_pass_by_hand(tiny_model, C.conflict_prompt(f, "substitution"),
                                         plus, minus, a_l, a_s)
                t = tiny_model.tokenizer(" " + f.memory, add_special_tokens=False)["input_ids"][0]
                probs.append(float(torch.softmax(want, -1)[t]))
            got = float(ds.target_prob.sel(alpha_s=a_s, alpha_l=a_l))
            assert got == pytest.approx(np.mean(probs), abs=1e-5)
    best = ds.target_prob.where(ds.accuracy == ds.accuracy.max())
    i, j = np.unravel_index(int(np.nanargmax(best.values)), best.shape)
    assert (ds.attrs["best_alpha_s"], ds.attrs["best_alpha_l"]) == (
        float(ds.alpha_s[i]), float(ds.alpha_l[j]))
    run1 = C.juice_first_run(tiny_model, ["The capital city of France is"])
    with pytest.raises(InputError, match="`run1` was computed for different prompts"):
        C.juice_logits(tiny_model, ["The capital city of Spain is"], plus, run1=run1)
    with pytest.raises(InputError, match="`method` must be one of 'juice', 'single'"):
        C.juice_alpha_search(tiny_model, facts, plus, method="dual")
    single = C.single_run_logits(tiny_model, None, plus, minus, alpha_l=2.0, alpha_s=1.0, run1=run1)
    np.testing.assert_allclose(single.numpy(), C.single_run_logits(
        tiny_model, ["The capital city of France is"], plus, minus, alpha_l=2.0,
        alpha_s=1.0).numpy(), atol=1e-4)


def _plain_greedy(model, prompt: str, n_new: int) -> str:
    """Greedy continuation by Hugging Face's own generate, one unpadded prompt at a time."""
    ids = torch.tensor([model.tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    out = model.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                            do_sample=False, pad_token_id=model.tokenizer.pad_token_id)
    return model.tokenizer.decode(out[0, ids.shape[1]:])


def test_baseline_answers_are_plain_generation_and_scored_as_worked_by_hand(tiny_model):
    """The baseline's answers equal HF generate's; to_memory / to_context are then read
    off by hand: each fact's memory value is set to a word the model does generate, its
    context value to one it does not, so both must come out as stated."""
    import dataclasses

    base = C.load_facts(["country_capital"])[:2]
    kinds = ("substitution", "coherent")
    plain = {(k, i): _plain_greedy(tiny_model, C.conflict_prompt(f, k), 3)
             for k in kinds for i, f in enumerate(base)}
    facts = []
    for i, f in enumerate(base):
        # the prompts use subject and context value, not the memory value: setting memory to
        # the first word generated on the substitution prompt leaves every prompt unchanged
        word = C.normalise_answer(plain[("substitution", i)]).split()[0]
        facts.append(dataclasses.replace(f, memory=word))
    ds = C.conflict_accuracy(tiny_model, facts, methods=("baseline",), kinds=kinds, n_new=3)
    for k in kinds:
        for i, f in enumerate(facts):
            got = str(ds.answer.sel(intervention="baseline", kind=k, fact=i).values)
            assert got == plain[(k, i)], (k, i)
            words = C.normalise_answer(plain[(k, i)]).split()[:5]
            assert bool(ds.to_memory.sel(intervention="baseline", kind=k, fact=i)) == \
                (f.memory in words)
            assert bool(ds.to_context.sel(intervention="baseline", kind=k, fact=i)) == \
                (C.normalise_answer(f.context) in words)
    assert ds.to_memory.sel(intervention="baseline", kind="substitution").values.all()
    assert not ds.to_context.values.any()        # the capitals are not what it generates
    np.testing.assert_array_equal(ds.memory_accuracy.sel(intervention="baseline").values,
                                  ds.to_memory.sel(intervention="baseline").mean("fact").values)


def test_head_selection_errors(tiny_model):
    facts = C.load_facts()[:2]
    with pytest.raises(InputError, match="`direction` must be one of 'parametric', 'context'"):
        C.juice_head_selection(tiny_model, facts, direction="memory")
    with pytest.raises(InputError, match=r"`k` must be an int in \[1, 12\]; got 13"):
        C.juice_head_selection(tiny_model, facts, k=13)


def test_accuracy_counts_answers(tiny_model):
    facts = C.load_facts(["country_capital"])[:2]
    progress = []
    ds = C.conflict_accuracy(tiny_model, facts, [(1, 1)], [], alpha_l=2.0, n_new=2,
                             progress=lambda a, b: progress.append((a, b)))
    assert progress[-1] == (12, 12)
    for m in ds.intervention.values:
        for k in ds.kind.values:
            for i, f in enumerate(facts):
                a = str(ds.answer.sel(intervention=m, kind=k, fact=i).values)
                assert bool(ds.to_memory.sel(intervention=m, kind=k, fact=i)) == C.answer_in(f.memory, a)
    np.testing.assert_allclose(ds.memory_accuracy, ds.to_memory.mean("fact"))


# -- SmolLM2 -----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.integration
def test_smollm2_knows_capitals_and_the_context_moves_it(smollm2, tmp_path, monkeypatch):
    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path))
    facts = C.load_facts(["country_capital"])[:6]
    kept = C.closed_book_facts(smollm2, facts)
    assert any(f.subject == "France" for f in kept)
    prompts = [C.conflict_prompt(f, "substitution") for f in kept[:3]]
    base = C.answer_probabilities(smollm2, C.juice_logits(smollm2, prompts), kept[:3])
    clean = C.answer_probabilities(
        smollm2, C.juice_logits(smollm2, [C.conflict_prompt(f, "clean") for f in kept[:3]]),
        kept[:3])
    assert (base[:, 1] > clean[:, 1]).all()  # the stated false value gains probability


# -- CLI -----------------------------------------------------------------------------------------

def _cli(argv):
    return parse_and_run("conflicts", argv)


def test_cli_reports_too_few_known_facts(tmp_path, monkeypatch):
    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path))
    monkeypatch.setattr(C, "closed_book_facts", lambda model, facts: facts[:3])
    with pytest.raises(InputError, match="answers only 3 facts closed book; need more than "
                                         "--select-facts=4"):
        _cli(["conflicts", "--model", "tiny-llama", "--relations", "country_capital"])


@pytest.mark.slow
def test_cli_json_summary(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path))
    monkeypatch.setattr(C, "closed_book_facts", lambda model, facts: [facts[i] for i in (0, 2, 7)])
    assert _cli(["conflicts", "--model", "tiny-llama", "--relations", "country_capital",
                 "--select-facts", "2", "--layers", "2", "--k", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["n_closed_book"] == 3 and out["n_eval"] == 1
    assert all(0 <= layer_head[0] <= 2 for layer_head in out["heads_plus"] + out["heads_minus"])
    assert set(out["memory_accuracy"]) == {"baseline", "single", "juice"}
    assert set(out["memory_accuracy"]["juice"]) == {"substitution", "coherent"}
    # the same numbers as the library calls on the same facts (split 2 to select, 1 to score)
    from explorer import load_model

    model = load_model("tiny-llama")
    facts = [C.load_facts(["country_capital"])[i] for i in (0, 2, 7)]
    sel = C.juice_head_selection(model, facts[:2], direction="parametric", k=2, layers=[2])
    plus, minus = C.selected_heads(sel)
    assert out["heads_plus"] == [list(h) for h in plus]
    assert out["heads_minus"] == [list(h) for h in minus]
    acc = C.conflict_accuracy(model, facts[2:], plus, minus, alpha_l=1.0, alpha_s=1.0)
    for name, var in (("memory_accuracy", acc.memory_accuracy),
                      ("context_accuracy", acc.context_accuracy)):
        for m in ("baseline", "single", "juice"):
            for k in ("substitution", "coherent"):
                assert out[name][m][k] == pytest.approx(float(var.sel(intervention=m, kind=k)))


# -- the view (headless) -------------------------------------------------------------------------

def test_view_bars_follow_heads_and_alpha(tiny_model):
    from apps.conflicts import (ConflictsView, accuracy_table, plot_answer_bars,
                                plot_head_heatmap, plot_head_scatter)

    facts = C.load_facts(["country_capital"])[:2]
    view = ConflictsView(tiny_model, facts=facts, closed_book=False, background=False, n_new=2)
    fact = view._fact()
    prompt = C.conflict_prompt(fact, "substitution")
    rows0 = view.bar_rows
    assert [r[2] for r in rows0[:2]] == pytest.approx([r[2] for r in rows0[2:]])  # no heads
    view._scatter_tapped([1 * 4 + 2])           # a click on the scatter point of L1.H2
    assert view.heads_plus == ["L1.H2"]
    view.alpha_l = 3.0
    rows1 = view.bar_rows
    want = _two_pass_by_hand(tiny_model, prompt, [(1, 2)], [], 3.0, 0.0)
    p = torch.softmax(want, -1)
    m, c = (tiny_model.tokenizer(" " + a, add_special_tokens=False)["input_ids"][0]
            for a in (fact.memory, fact.context))
    assert rows1[2] == ("memory", "after", pytest.approx(float(p[m]), abs=1e-5))
    assert rows1[3] == ("context", "after", pytest.approx(float(p[c]), abs=1e-5))
    # a heatmap click (categorical axes give strings) on a chosen head removes it;
    # with the toggle on S-, a new click adds to S-
    view._heatmap_tapped("2", "1")
    assert view.heads_plus == [] and view.heads_minus == []
    view.pick_set = "S- (suppress)"
    view._heatmap_tapped("0", "2")
    assert view.heads_minus == ["L2.H0"]
    scores = view.scores
    assert len(plot_head_heatmap(scores, [], ["L2.H0"]).get(0).dimension_values(2)) == 12
    assert len(plot_head_scatter(scores).get(0)) == 12
    assert len(plot_answer_bars(rows1)) == 4
    # direction: the top heads by direct effect toward the memory (or context) answer
    view.direction = "context"
    view.pick_top_heads(k=2)
    d = -scores.direct_diff.mean(("kind", "fact")).values
    best = np.unravel_index(int(np.argmax(d)), d.shape)
    assert view.heads_plus[0] == f"L{best[0]}.H{best[1]}"
    # the whole split: the table holds the accuracy of every intervention
    view._request("split")
    acc = view.accuracy
    assert acc.sizes["fact"] == 2
    table = accuracy_table(acc)
    assert list(table["intervention"]) == ["baseline (no intervention)", "single run (JuNE)",
                                          "JuICE dual run"]
    assert table["to memory, coherent"].tolist() == acc.memory_accuracy.sel(kind="coherent").values.tolist()
    # what the page shows: the bars' numbers in the caption, labelled button groups
    import panel as pn

    from apps.conflicts import bars_caption

    text = bars_caption(view.bar_rows, fact, "juice")
    after = {(a, r): v for a, r, v in view.bar_rows}
    assert f"**{after['memory', 'after']:.2f}**" in text and fact.memory in text
    root = view.__panel__()
    shown = [o.object for o in root.select(pn.pane.HTML)]
    for label in ("Prompt type", "Answer to strengthen", "Clicks add heads to", "Intervention"):
        assert f"<b>{label}</b>" in shown
    tips = {w.value for w in root.select(pn.widgets.TooltipIcon)}
    assert view.param.kind.doc in tips and view.param.mode.doc in tips
    groups = root.select(pn.widgets.RadioButtonGroup)
    assert {tuple(g.options) for g in groups} == {tuple(C.PROMPT_KINDS), tuple(C.DIRECTIONS),
                                                  ("S+ (enhance)", "S- (suppress)"),
                                                  ("juice", "single")}


@pytest.mark.slow
def test_view_selects_heads_as_juice_does(tiny_model):
    """The page's JuICE button fills S+ / S- with `juice_head_selection` on the example."""
    import panel as pn

    from apps.conflicts import ConflictsView

    facts = C.load_facts(["country_capital"])[:2]
    view = ConflictsView(tiny_model, facts=facts, closed_book=False, background=False, n_new=2)
    view.direction = "context"
    button = next(b for b in view.__panel__().select(pn.widgets.Button)
                  if b.name == "Select heads as JuICE does")
    button.clicks += 1
    sel = C.juice_head_selection(tiny_model, [view._fact()], direction="context", k=3)
    plus, minus = C.selected_heads(sel)
    assert view.heads_plus == [f"L{l}.H{h}" for l, h in plus]
    assert view.heads_minus == [f"L{l}.H{h}" for l, h in minus]
    assert view.progress_active is False and view.error == ""


def test_view_reports_an_empty_split(tiny_model, tmp_path, monkeypatch):
    from apps.conflicts import ConflictsView

    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path))
    facts = [_fact(), _fact("Spain", "zzqqxx")]
    view = ConflictsView(tiny_model, facts=facts, background=False, n_new=1)
    monkeypatch.setattr(C, "closed_book_facts", lambda *a, **k: [])
    view._request("split")
    assert view.accuracy is None
    assert "answers none of the facts closed book" in view.error


def test_bench_conflicts_runs_from_the_bench_registry(tmp_path, monkeypatch):
    from explorer.bench import run_bench

    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path))
    out = run_bench("conflicts", model="tiny-llama", repeats=1)
    fig = out["figures"]
    assert out["params"]["model"] == "tiny-llama" and out["params"]["repeats"] == 1
    assert all(v > 0 for v in fig.values())
    assert fig["dual_vs_two_forwards_ratio"] == pytest.approx(fig["dual_run_ms"] / fig["two_forwards_ms"])
    assert fig["slider_vs_two_forwards_ratio"] == pytest.approx(
        fig["slider_update_ms"] / fig["two_forwards_ms"])
