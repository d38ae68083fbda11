"""Mechanistic unlearning (Guo et al., ICML 2025): data, probe, tracing, localized training.

Values are checked against plain torch hooks on ``model.hf``, hand-worked cases and
formulas, never against the analysis's own earlier output.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import xarray as xr

from explorer._checks import InputError
from explorer.analyses import unlearning as U
from explorer.commands._common import torch_threads
from tests._threads import record_threads

ATTRS = ["blue", "dog", "moon"]  # distinct first tokens for the tiny byte-level tokenizer


@pytest.fixture(scope="module")
def facts_file(tmp_path_factory):
    names = [f"Person {a}{b}" for a in "ABCD" for b in "xyz"]
    data = {
        "attributes": ATTRS,
        "templates": {"trained": "Fact: {subject} likes the",
                      "mc": "Q: What does {subject} like? Options: {options}\nA: {subject} likes the"},
        "facts": [[n, ATTRS[i % 3]] for i, n in enumerate(names)],
    }
    path = tmp_path_factory.mktemp("unlearning") / "facts.json"
    path.write_text(json.dumps(data))
    return path


@pytest.fixture(scope="module")
def facts(facts_file):
    return U.load_attribute_facts(facts_file)


def _noise(model, fact, scale=3.0, seed=0):
    """The documented noise recipe for the first fact of a run."""
    g = torch.Generator().manual_seed(seed)
    std = float(model.hf.get_input_embeddings().weight.float().std())
    n = len(U.subject_positions(model, fact))
    return torch.randn(n, model.spec.d_model, generator=g) * scale * std


def _hand_run(model, fact, noise=None, hooks=()):
    """Last-position softmax of a plain forward with optional subject noise and extra hooks."""
    ids = torch.tensor([model.tokenizer(U.fact_prompt(fact), add_special_tokens=False)["input_ids"]])
    subj = U.subject_positions(model, fact)
    handles = []
    if noise is not None:
        def add(_m, _i, out):
            out = out.clone()
            out[0, subj] += noise
            return out
        handles.append(model.hf.get_input_embeddings().register_forward_hook(add))
    handles += [mod.register_forward_hook(fn) for mod, fn in hooks]
    try:
        return torch.softmax(model.hf(input_ids=ids).logits[0, -1].float(), -1)
    finally:
        for h in handles:
            h.remove()


def _target(model, fact):
    return model.tokenizer(" " + fact.attribute, add_special_tokens=False)["input_ids"][0]


# -- data ------------------------------------------------------------------------------------

def test_shipped_facts_load_and_prompt():
    facts = U.load_attribute_facts()
    assert len(facts) >= 60
    assert {f.attribute for f in facts} == set(facts[0].attributes)
    f = facts[0]
    assert U.fact_prompt(f).endswith(f"Fact: {f.subject} plays the sport of")
    mc = U.fact_prompt(f, "mc")
    assert all(a in mc for a in f.attributes) and mc.endswith(f"{f.subject} plays")


def test_fact_file_errors(tmp_path, facts):
    with pytest.raises(InputError, match="does not exist"):
        U.load_attribute_facts(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"attributes": ["a"], "templates": {"trained": "{subject}", "mc": "{subject}"},
                               "facts": [["x", "b"]]}))
    with pytest.raises(InputError, match="has attribute 'b'"):
        U.load_attribute_facts(bad)
    bad.write_text(json.dumps({"attributes": ["a"], "templates": {"trained": "{subject}"},
                               "facts": [["x", "a"]]}))
    with pytest.raises(InputError, match="lacks templates.mc"):
        U.load_attribute_facts(bad)
    bad.write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        U.load_attribute_facts(bad)
    with pytest.raises(InputError, match="`format` must be one of"):
        U.fact_prompt(facts[0], "cloze")
    with pytest.raises(InputError, match="at most the 12 facts"):
        U.split_facts(facts, 8, 8)


def test_split_is_disjoint_and_seeded(facts):
    fo, re_ = U.split_facts(facts, 4, 5, seed=3)
    assert len(fo) == 4 and len(re_) == 5
    assert not {f.subject for f in fo} & {f.subject for f in re_}
    assert U.split_facts(facts, 4, 5, seed=3) == (fo, re_)


def test_subject_positions_decode_to_subject(tiny_model, facts):
    f = facts[5]
    ids = tiny_model.tokenizer(U.fact_prompt(f), add_special_tokens=False)["input_ids"]
    pos = U.subject_positions(tiny_model, f)
    assert tiny_model.tokenizer.decode([ids[p] for p in pos]).strip() == f.subject


def test_multiple_choice_scoring_hand_made():
    logits = torch.zeros(3, 10)
    logits[0, 7] = 5.0                  # the largest logit overall is not a candidate
    logits[0, 4] = 2.0
    logits[1, 2] = 1.0
    logits[1, 4] = 0.5
    logits[2, 9] = 3.0
    # candidates in option order: ids 2, 4, 9
    assert U.candidate_predictions(logits, [2, 4, 9]).tolist() == [1, 0, 2]
    with pytest.raises(InputError, match=r"must be \[prompt, vocab\]"):
        U.candidate_predictions(logits[0], [2, 4])


def test_fact_filter_matches_plain_forward(tiny_model, facts, tmp_path, monkeypatch):
    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path))
    ids = [tiny_model.tokenizer(" " + a, add_special_tokens=False)["input_ids"][0] for a in ATTRS]
    expect = []
    for f in facts:
        p = _hand_run(tiny_model, f)
        expect.append(ATTRS[int(p[ids].argmax())] == f.attribute)
    kept = U.known_facts(tiny_model, facts)
    assert [f.subject for f in kept] == [f.subject for f, ok in zip(facts, expect) if ok]
    assert list((tmp_path / "unlearning").glob("known-*.json"))  # cached
    assert U.known_facts(tiny_model, facts) == kept
    with pytest.raises(InputError, match="at least one fact"):
        U.known_facts(tiny_model, [])
    # both formats: the trained-format answers and the multiple-choice answers, by hand
    both = []
    with torch.no_grad():
        for f, ok in zip(facts, expect):
            x = torch.tensor([tiny_model.tokenizer(U.fact_prompt(f, "mc"), add_special_tokens=False)["input_ids"]])
            p = torch.softmax(tiny_model.hf(input_ids=x).logits[0, -1].float(), -1)
            both.append(ok and ATTRS[int(p[ids].argmax())] == f.attribute)
    kept2 = U.known_facts(tiny_model, facts, formats=("trained", "mc"))
    assert [f.subject for f in kept2] == [f.subject for f, ok in zip(facts, both) if ok]


# -- probe and fact-lookup layers -----------------------------------------------------------

def test_probe_separable_and_random_labels():
    rng = np.random.default_rng(0)
    y = np.repeat([0, 1, 2], 20)
    centres = rng.normal(size=(3, 8)) * 10
    x = centres[y] + rng.normal(size=(60, 8))
    assert U.probe_accuracy(x, y, n_folds=4) == 1.0
    noise = rng.normal(size=(60, 8))
    assert U.probe_accuracy(noise, rng.permutation(y), n_folds=4) < 0.7
    with pytest.raises(InputError, match="at least `n_folds`=4"):
        U.probe_accuracy(x[:9], np.repeat([0, 1, 2], 3), n_folds=4)
    with pytest.raises(InputError, match="at least 2 classes"):
        U.probe_accuracy(x[:8], np.zeros(8), n_folds=4)


def test_fact_lookup_window_is_the_steepest_rise():
    probe = xr.Dataset({"probe_accuracy": ("layer", [0.2, 0.2, 0.3, 0.8, 0.9, 0.9, 0.7]),
                        "embed_accuracy": 0.2})
    assert U.fact_lookup_layers(probe, 1) == [3]
    assert U.fact_lookup_layers(probe, 2) == [2, 3]  # ties with [3, 4]: the earliest window
    assert U.fact_lookup_layers(probe, 3) == [2, 3, 4]  # 0.9 - 0.2 beats 0.8 - 0.2
    with pytest.raises(InputError, match=r"`n_layers` must be an int in \[1, 7\]"):
        U.fact_lookup_layers(probe, 8)


def test_probe_curve_reads_the_subject_token(tiny_model, facts, monkeypatch):
    from explorer.analyses.unlearning import probe as probe_module

    seen = []                                   # the features each probe is fitted on
    real_probe = probe_module.probe_accuracy
    monkeypatch.setattr(probe_module, "probe_accuracy",
                        lambda x, y, **kw: seen.append(np.array(x)) or real_probe(x, y, **kw))
    ds = U.attribute_probe_curve(tiny_model, facts, n_folds=2)
    assert ds.probe_accuracy.dims == ("layer",) and ds.sizes["layer"] == tiny_model.n_layers
    assert ds.attrs["method"] == "attribute_probe_curve"
    assert float(ds.chance) == pytest.approx(1 / 3)
    # the features by hand: each unpadded prompt's embedding and decoder-layer outputs (torch
    # hooks) at the last token of the subject, found by decoding, not by subject_positions
    assert len(seen) == tiny_model.n_layers + 1                 # embedding, then each layer
    for row, f in enumerate(facts):
        ids = tiny_model.tokenizer(U.fact_prompt(f, "trained"), add_special_tokens=False)["input_ids"]
        last = next(i for i in range(len(ids))
                    if tiny_model.tokenizer.decode(ids[:i + 1]).rstrip().endswith(f.subject))
        assert last < len(ids) - 1                              # not the prompt's last token
        outs = []
        hooks = [tiny_model.hf_layer(x).register_forward_hook(
            lambda _m, _i, out: outs.append(out[0] if isinstance(out, tuple) else out))
            for x in range(tiny_model.n_layers)]
        try:
            embed = tiny_model.hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[0]
        finally:
            for h in hooks:
                h.remove()
        for j, h in enumerate([embed, *outs]):
            np.testing.assert_allclose(seen[j][row], h[0, last].float().numpy(), rtol=1e-4,
                                       atol=1e-5, err_msg=f"fact {row}, feature set {j}")
    labels = np.array([f.attribute for f in facts])
    assert float(ds.embed_accuracy) == real_probe(seen[0], labels, n_folds=2, seed=0)


# -- causal tracing and attribution patching ------------------------------------------------

def test_causal_trace_restore_equals_hand_hooks(tiny_model, facts):
    f = facts[1]
    ds = U.causal_trace(tiny_model, [f], noise_scale=3.0, seed=0)
    noise = _noise(tiny_model, f)
    tgt = _target(tiny_model, f)
    clean_resid, clean_mlp = {}, {}

    def save(store, layer):
        def hook(_m, _i, out):
            store[layer] = (out[0] if isinstance(out, tuple) else out)[0].clone()
        return hook

    L = tiny_model.n_layers
    p_clean = _hand_run(tiny_model, f, hooks=[(tiny_model.hf_layer(x), save(clean_resid, x)) for x in range(L)]
                        + [(tiny_model.hf_layer(x).mlp, save(clean_mlp, x)) for x in range(L)])[tgt]
    assert float(ds.p_clean[0]) == pytest.approx(float(p_clean), rel=1e-4)
    assert float(ds.p_corrupt[0]) == pytest.approx(float(_hand_run(tiny_model, f, noise)[tgt]), rel=1e-4)
    layer, pos = 1, U.subject_positions(tiny_model, f)[-1]

    def put_resid(_m, _i, out):
        h = (out[0] if isinstance(out, tuple) else out).clone()
        h[0, pos] = clean_resid[layer][pos]
        return (h, *out[1:]) if isinstance(out, tuple) else h

    def put_mlp(_m, _i, out):
        return clean_mlp[layer][None].clone()

    p_r = _hand_run(tiny_model, f, noise, hooks=[(tiny_model.hf_layer(layer), put_resid)])[tgt]
    p_m = _hand_run(tiny_model, f, noise, hooks=[(tiny_model.hf_layer(layer).mlp, put_mlp)])[tgt]
    assert float(ds.restore_resid.sel(fact=0, layer=layer, pos=pos)) == pytest.approx(float(p_r), rel=1e-4)
    assert float(ds.restore_mlp.sel(fact=0, layer=layer)) == pytest.approx(float(p_m), rel=1e-4)
    # restoring the last layer's whole output at the last position gives the clean answer
    n = len(tiny_model.tokenizer(U.fact_prompt(f), add_special_tokens=False)["input_ids"])
    assert float(ds.restore_resid.sel(fact=0, layer=L - 1, pos=n - 1)) == pytest.approx(float(p_clean), rel=1e-4)


def test_attribution_patching_is_grad_times_delta(tiny_model, facts):
    f = facts[2]
    ds = U.attribution_patching(tiny_model, [f], noise_scale=3.0, seed=0)
    noise = _noise(tiny_model, f)
    tgt = _target(tiny_model, f)
    L = tiny_model.n_layers
    clean = {}

    def save(layer):
        def hook(_m, _i, out):
            clean[layer] = out[0].clone()
        return hook

    _hand_run(tiny_model, f, hooks=[(tiny_model.hf_layer(x).mlp, save(x)) for x in range(L)])
    acts = {}

    def grab(layer):
        def hook(_m, _i, out):
            acts[layer] = out
        return hook

    ids = torch.tensor([tiny_model.tokenizer(U.fact_prompt(f), add_special_tokens=False)["input_ids"]])
    subj = U.subject_positions(tiny_model, f)
    with torch.enable_grad():
        emb = tiny_model.hf.get_input_embeddings()(ids).detach()
        emb[0, subj] += noise
        emb.requires_grad_(True)
        handles = [tiny_model.hf_layer(x).mlp.register_forward_hook(grab(x)) for x in range(L)]
        try:
            p = torch.softmax(tiny_model.hf(inputs_embeds=emb).logits[0, -1].float(), -1)[tgt]
            grads = torch.autograd.grad(p, [acts[x] for x in range(L)])
        finally:
            for h in handles:
                h.remove()
    for x in range(L):
        expect = float((grads[x][0] * (clean[x] - acts[x][0].detach())).sum())
        assert float(ds.ap_mlp.sel(fact=0, layer=x)) == pytest.approx(expect, rel=1e-3, abs=1e-9)


def test_localization_choices_and_errors(tiny_model):
    ap = xr.Dataset({"ap_mlp": (("fact", "layer"), [[0.1, 0.5, 0.2], [0.1, 0.3, 0.4]])})
    assert U.localized_layers(tiny_model, "attribution_patching_mlp", 2, attribution=ap) == [1, 2]
    with pytest.raises(InputError, match="need a causal trace with `restore_head` or an "
                                         "attribution with `ap_head`"):
        U.localized_layers(tiny_model, "attribution_patching", 2, attribution=ap)
    assert U.localized_layers(tiny_model, "all", 1) == [0, 1, 2]
    assert U.localized_layers(tiny_model, "random", 2, seed=1) == U.localized_layers(
        tiny_model, "random", 2, seed=1)
    with pytest.raises(InputError, match="needs the `trace` dataset"):
        U.localized_layers(tiny_model, "causal_tracing", 1)
    with pytest.raises(InputError, match="needs the `trace` dataset"):
        U.localized_layers(tiny_model, "causal_tracing_mlp", 1)
    with pytest.raises(InputError, match="`method` must be one of .*Did you mean 'fact_lookup'"):
        U.localized_layers(tiny_model, "fact_lookp", 1)


# -- budgets and localized training ---------------------------------------------------------

def test_equal_budgets_are_equal(tiny_model):
    cfg = tiny_model.hf.config
    per_layer = 3 * cfg.hidden_size * cfg.intermediate_size  # gate, up, down; no biases
    counts = []
    for method, layers in (("fact_lookup", [0, 1]), ("causal_tracing", [1, 2]),
                           ("attribution_patching", [0, 2]), ("random", [2, 0])):
        names = set(U.component_parameters(tiny_model, method, layers))
        counts.append(sum(p.numel() for n, p in tiny_model.hf.named_parameters() if n in names))
    assert counts == [2 * per_layer] * 4
    n_all = len(U.component_parameters(tiny_model, "all", []))
    assert n_all == len(list(tiny_model.hf.named_parameters()))


def test_localized_training_changes_only_chosen_parameters(tiny_model, facts):
    before = {n: p.detach().clone() for n, p in tiny_model.hf.named_parameters()}
    names = set(U.component_parameters(tiny_model, "fact_lookup", [1]))
    hf, losses = U.localized_finetune(tiny_model, facts[:4], facts[4:8], sorted(names),
                                      steps=2, lr=1e-2)
    assert len(losses) == 2 and hf is not tiny_model.hf
    for n, p in hf.named_parameters():
        changed = not torch.equal(p, before[n])
        assert changed == (n in names), n
    for n, p in tiny_model.hf.named_parameters():  # the shared model is untouched
        assert torch.equal(p, before[n]), n
    with pytest.raises(InputError, match="unknown parameter name 'nope'"):
        U.localized_finetune(tiny_model, facts[:2], [], ["nope"], steps=1)
    with pytest.raises(InputError, match="`objective` must be one of"):
        U.localized_finetune(tiny_model, facts[:2], [], sorted(names), objective="forget")


def test_unlearning_loss_lowers_answer_probability(tiny_model, facts):
    fo = facts[:3]
    ids = [tiny_model.tokenizer(" " + a, add_special_tokens=False)["input_ids"][0] for a in ATTRS]
    names = U.component_parameters(tiny_model, "all", [])
    hf, losses = U.localized_finetune(tiny_model, fo, [], names, steps=3, lr=1e-3)
    # the loss is -log(1 - p) with p the answer's share among the attributes
    prompt_ids = [torch.tensor([tiny_model.tokenizer(U.fact_prompt(f), add_special_tokens=False)["input_ids"]])
                  for f in fo]
    with torch.no_grad():
        p0 = [float(torch.softmax(tiny_model.hf(input_ids=x).logits[0, -1, ids], -1)[ATTRS.index(f.attribute)])
              for x, f in zip(prompt_ids, fo)]
        p1 = [float(torch.softmax(hf(input_ids=x).logits[0, -1, ids], -1)[ATTRS.index(f.attribute)])
              for x, f in zip(prompt_ids, fo)]
    assert losses[0] == pytest.approx(float(np.mean([-np.log1p(-p) for p in p0])), rel=1e-4)
    assert np.mean([-np.log1p(-p) for p in p1]) < losses[0]


def test_training_can_be_stopped(tiny_model, facts):
    names = U.component_parameters(tiny_model, "fact_lookup", [0])
    with pytest.raises(U.UnlearningCancelled, match="stopped after 0 of 3 steps"):
        U.localized_finetune(tiny_model, facts[:2], [], names, steps=3, should_stop=lambda: True)


def test_comparison_on_tiny_model(tiny_model, facts):
    fo, re_ = U.split_facts(facts, 4, 4)
    probe = xr.Dataset({"probe_accuracy": ("layer", [0.3, 0.9, 0.9]), "embed_accuracy": 0.3})
    ds = U.unlearning_comparison(tiny_model, fo, re_, methods=["fact_lookup"], n_layers=1,
                                 steps=1, lr=1e-2, relearn_steps=1, probe=probe)
    assert ds["localization"].values.tolist() == ["original", "fact_lookup"]
    assert ds["trained_layers"].sel(localization="fact_lookup").item() == "1"
    assert int(ds.n_params.sel(localization="fact_lookup")) == sum(
        p.numel() for p in tiny_model.hf_layer(1).mlp.parameters())
    # the original row: accuracies by an independent plain forward
    ids = [tiny_model.tokenizer(" " + a, add_special_tokens=False)["input_ids"][0] for a in ATTRS]
    ok = [ATTRS[int(_hand_run(tiny_model, f)[ids].argmax())] == f.attribute for f in fo]
    assert float(ds.accuracy.sel(localization="original", metric="forget")) == pytest.approx(np.mean(ok))
    with pytest.raises(InputError, match="at least 2 facts"):
        U.unlearning_comparison(tiny_model, fo[:1], re_, methods=["all"])


def test_relearn_halves_are_stratified_by_hand(facts):
    # facts cycle blue, dog, moon; take 3 blue, 2 dog, 1 moon in a scrambled order
    b0, d0, m0, b1, d1, _, b2 = facts[0], facts[1], facts[2], facts[3], facts[4], facts[5], facts[6]
    learn, held = U.relearn_halves([d0, b0, m0, b1, d1, b2])
    # attributes in order of first appearance: dog, blue, moon; one alternation across them
    assert learn == [d0, b0, b2] and held == [d1, b1, m0]


def _by_hand_accuracy(model, hf, facts, fmt):
    """Top candidate among ATTRS from one unpadded forward per prompt of ``hf``."""
    ids = [model.tokenizer(" " + a, add_special_tokens=False)["input_ids"][0] for a in ATTRS]
    ok = []
    with torch.no_grad():
        for f in facts:
            x = torch.tensor([model.tokenizer(U.fact_prompt(f, fmt), add_special_tokens=False)["input_ids"]])
            ok.append(ATTRS[int(hf(input_ids=x).logits[0, -1, ids].argmax())] == f.attribute)
    return np.array(ok)


def _by_hand_step_loop(model, hf, steps, lr, loss_fn):
    """AdamW (no weight decay) on every parameter of ``hf``, clipping at 1."""
    params = list(hf.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    with torch.enable_grad():
        for _ in range(steps):
            loss = loss_fn(hf)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
    for p in params:
        p.requires_grad_(False)


def test_comparison_rows_match_an_independent_run(tiny_model, facts):
    """Every accuracy row of `unlearning_comparison` (original model and an all-parameter
    unlearning) against a separate implementation: unpadded forwards, a hand-written
    unlearning loss and relearning loop, and the halves written out by hand."""
    import copy

    forget = [facts[0], facts[1], facts[3], facts[4]]     # blue, dog, blue, dog
    retain = [facts[2], facts[5], facts[7]]
    learn, held = [facts[0], facts[1]], [facts[3], facts[4]]
    steps, lr, r_steps, r_lr = 2, 3e-3, 3, 1e-2
    torch.manual_seed(0)
    ds = U.unlearning_comparison(tiny_model, forget, retain, methods=["all"], n_layers=1,
                                 steps=steps, lr=lr,
                                 relearn_steps=r_steps, relearn_lr=r_lr)
    assert ds.attrs["params"]["relearn_on"] == [f.subject for f in learn]
    tok = tiny_model.tokenizer
    cand = [tok(" " + a, add_special_tokens=False)["input_ids"][0] for a in ATTRS]

    def last_logits(hf, fs):  # one unpadded forward per prompt
        return torch.cat([hf(input_ids=torch.tensor([tok(U.fact_prompt(f), add_special_tokens=False)[
            "input_ids"]])).logits[:, -1].float() for f in fs])

    def unlearn_loss(hf):
        lg = last_logits(hf, forget)
        pc = torch.softmax(lg[:, cand], -1)[torch.arange(len(forget)),
                                            torch.tensor([ATTRS.index(f.attribute) for f in forget])]
        lr_ = torch.log_softmax(last_logits(hf, retain), -1)[
            torch.arange(len(retain)), torch.tensor([cand[ATTRS.index(f.attribute)] for f in retain])]
        return -torch.log(1 - pc).mean() - lr_.mean()

    def relearn_loss(hf):
        lp = torch.log_softmax(last_logits(hf, learn), -1)
        return -lp[torch.arange(len(learn)), torch.tensor([cand[ATTRS.index(f.attribute)] for f in learn])].mean()

    mc_start = _by_hand_accuracy(tiny_model, tiny_model.hf, forget, "mc")
    for row in ("original", "all"):
        hf = copy.deepcopy(tiny_model.hf)
        if row == "all":
            _by_hand_step_loop(tiny_model, hf, steps, lr, unlearn_loss)
        mc = _by_hand_accuracy(tiny_model, hf, forget, "mc")
        expect = {
            "forget": _by_hand_accuracy(tiny_model, hf, forget, "trained").mean(),
            "forget_mc": mc.mean(),
            "forget_mc_known": mc[mc_start].mean() if mc_start.any() else np.nan,
            "retain": _by_hand_accuracy(tiny_model, hf, retain, "trained").mean(),
            "retain_mc": _by_hand_accuracy(tiny_model, hf, retain, "mc").mean(),
            "relearn_heldout_before": _by_hand_accuracy(tiny_model, hf, held, "trained").mean(),
        }
        _by_hand_step_loop(tiny_model, hf, r_steps, r_lr, relearn_loss)
        expect["relearn_heldout"] = _by_hand_accuracy(tiny_model, hf, held, "trained").mean()
        expect["relearn_learned"] = _by_hand_accuracy(tiny_model, hf, learn, "trained").mean()
        got = {k: float(ds.accuracy.sel(localization=row, metric=k)) for k in U.METRICS}
        assert got == pytest.approx(expect, nan_ok=True), row
    # the run moved something, so the rows compared are not all the original's
    assert not ds.accuracy.sel(localization="all").equals(ds.accuracy.sel(localization="original"))


def test_cli_unlearn_json(tiny_model, facts_file, capsys):
    from explorer.cli import main

    rc = main(["unlearn", "--model", "tiny-llama", "--facts", str(facts_file), "--all-facts",
               "--methods", "attribution_patching,all", "--n-layers", "1", "--n-forget", "4",
               "--n-retain", "2", "--steps", "1", "--relearn-steps", "1", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["methods"]) == {"original", "attribution_patching", "all"}
    assert out["methods"]["all"]["n_params"] == sum(p.numel() for p in tiny_model.hf.parameters())
    # perplexity before unlearning: held-out corpus windows of 64 tokens, by the library's
    # documented split (tested by hand in test_unlearning_components.py)
    held = U.text_windows(tiny_model, "heldout", window=64, max_windows=16)
    assert out["methods"]["original"]["perplexity"] == pytest.approx(
        U.text_perplexity(tiny_model, held), rel=1e-3)
    ap = out["methods"]["attribution_patching"]
    assert ap["n_params"] >= U.mlp_budget(tiny_model, 1) and ap["n_heads"] >= 0
    assert ap["components"] != "-"


def test_cli_unlearn_runs_on_one_thread_and_restores_the_thread_count(tiny_model, facts_file,
                                                                      capsys, monkeypatch):
    """The command trains on one thread unless --threads says otherwise, and leaves torch's
    thread count as it found it (it used to leave it at 1)."""
    from explorer.cli import main

    seen = record_threads(monkeypatch, U, "unlearning_comparison")
    with torch_threads(2):
        argv = ["unlearn", "--model", "tiny-llama", "--facts", str(facts_file), "--all-facts",
                "--methods", "random", "--n-layers", "1", "--n-forget", "2", "--n-retain", "1",
                "--steps", "1", "--relearn-steps", "0", "--json"]
        assert main(argv) == 0
        assert torch.get_num_threads() == 2 and seen == [1]
        assert set(json.loads(capsys.readouterr().out)["methods"]) == {"original", "random"}
        assert main(argv + ["--threads", "3"]) == 0
        assert torch.get_num_threads() == 2 and seen == [1, 3]


@pytest.mark.integration
def test_smollm2_subject_positions_and_known_facts(smollm2):
    facts = U.load_attribute_facts()
    f = next(x for x in facts if x.subject == "Michael Jordan")
    ids = smollm2.tokenizer(U.fact_prompt(f), add_special_tokens=False)["input_ids"]
    assert smollm2.tokenizer.decode([ids[p] for p in U.subject_positions(smollm2, f)]) == " Michael Jordan"
    assert U.attribute_token_ids(smollm2, f.attributes)  # distinct first tokens


# -- the page's plots (headless) ------------------------------------------------------------

def test_view_plots_and_rows_headless(tiny_model):
    import holoviews as hv
    import panel as pn

    from apps.unlearning import UnlearningView, accuracy_rows, plot_probe_curve

    probe = xr.Dataset({"probe_accuracy": ("layer", [0.2, 0.6, 0.9, 0.9]), "embed_accuracy": 0.2,
                        "chance": 0.25}, coords={"layer": np.arange(4)})
    spans = [el for el in plot_probe_curve(probe, [1, 2]) if isinstance(el, hv.VSpan)]
    assert [(s.data[0], s.data[1]) for s in spans] == [(0.5, 2.5)]  # one band over layers 1-2
    spans = [el for el in plot_probe_curve(probe, [0, 3]) if isinstance(el, hv.VSpan)]
    assert sorted((s.data[0], s.data[1]) for s in spans) == [(-0.5, 0.5), (2.5, 3.5)]
    res = xr.Dataset({"accuracy": (("localization", "metric"), [[1.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
                                                                [0.0, 0.25, 0.5, 0.75, 1.0, 0.0, 0.5, 1.0]])},
                     coords={"localization": ["original", "fact_lookup"], "metric": list(U.METRICS)})
    rows = accuracy_rows(res)
    assert ("forget", "FLU", 0.0) in rows
    assert ("held out", "before", 1.0) in rows and len(rows) == 10
    assert ("forget MC", "FLU", 0.5) in rows
    # the caption under the probe plot carries its numbers (the title stays short)
    from apps.unlearning import probe_caption

    text = probe_caption(probe, [1, 2])
    assert "best at layer 2 (0.90; chance 0.25" in text and "fact lookup trains (1, 2)" in text
    view = UnlearningView(tiny_model)  # opens without computing anything
    assert view.probe is None and view.chosen_layers() == [] and view.param.n_layers.bounds == (1, 3)
    root = view.__panel__()
    pn.panel(view).get_root()  # the page renders before anything is computed
    # every control has a label (not the parameter's name) and a tooltip saying what it does
    names = ["method", "n_layers", "steps", "lr", "n_forget", "n_retain", "relearn_steps"]
    shown = {w.name: w for w in root.select(pn.widgets.Widget) if w.name}
    tips = {w.value for w in root.select(pn.widgets.TooltipIcon)}
    for n in names:
        label = view.param[n].label
        assert label in shown and label != n.replace("_", " ").capitalize()
        assert view.param[n].doc in tips or shown[label].description == view.param[n].doc


def test_cli_unknown_method_is_one_line(capsys):
    from explorer.cli import main

    rc = main(["unlearn", "--model", "tiny-llama", "--methods", "fact_lookp", "--json"])
    err = capsys.readouterr().err
    assert rc != 0 and "`method` must be one of" in err and "Did you mean 'fact_lookup'" in err


def test_edit_objective_is_cross_entropy_to_the_next_attribute(tiny_model, facts):
    fo = facts[:3]
    names = U.component_parameters(tiny_model, "fact_lookup", [2])
    _, losses = U.localized_finetune(tiny_model, fo, [], names, objective="edit", steps=1, lr=1e-3)
    ce = []
    with torch.no_grad():
        for f in fo:
            new = ATTRS[(ATTRS.index(f.attribute) + 1) % 3]   # the documented rotation
            t = tiny_model.tokenizer(" " + new, add_special_tokens=False)["input_ids"][0]
            ce.append(-float(torch.log(_hand_run(tiny_model, f)[t])))
    assert losses[0] == pytest.approx(float(np.mean(ce)), rel=1e-4)


def test_training_with_updates_held_apart_matches_the_copy(tiny_model, facts, monkeypatch):
    """The remote model's training path (updates dW held apart and hooked, in jobs of
    STEPS_PER_JOB steps) run here: its losses and W + dW match the trained copy's to float
    rounding, the shared model is untouched, and format_accuracy reads the same answers."""
    from explorer import lora as lora_jobs
    from explorer.lora import WeightDeltas

    monkeypatch.setattr(lora_jobs, "STEPS_PER_JOB", 2)
    before = {n: p.detach().clone() for n, p in tiny_model.hf.named_parameters()}
    names = U.component_parameters(tiny_model, "fact_lookup", [1, 2])
    fo, re_ = facts[:4], facts[4:8]
    for objective in ("unlearn", "edit"):
        hf, want = U.localized_finetune(tiny_model, fo, re_, names, objective=objective,
                                        steps=5, lr=1e-2)
        seen: list[int] = []
        deltas, got = U._finetune_by_deltas(tiny_model, fo, re_, sorted(names),
                                            objective=objective, steps=5, lr=1e-2,
                                            retain_weight=1.0, clip=1.0,
                                            progress=lambda d, t, seen=seen: seen.append(d),
                                            should_stop=None)
        assert isinstance(deltas, WeightDeltas) and seen == [1, 2, 3, 4, 5]
        np.testing.assert_allclose(got, want, rtol=1e-4)
        trained = dict(hf.named_parameters())
        for n in names:
            torch.testing.assert_close(before[n] + deltas.deltas[n], trained[n], rtol=1e-4,
                                       atol=1e-6)
            assert float(deltas.deltas[n].abs().max()) > 0
        for fmt in ("trained", "mc"):
            ok_d, p_d = U.format_accuracy(tiny_model, fo + re_, fmt, hf=deltas)
            ok_c, p_c = U.format_accuracy(tiny_model, fo + re_, fmt, hf=hf)
            assert ok_d.tolist() == ok_c.tolist()
            np.testing.assert_allclose(p_d, p_c, rtol=1e-4, atol=1e-6)
    for n, p in tiny_model.hf.named_parameters():
        assert torch.equal(p, before[n]), n
        assert p.grad is None
    with pytest.raises(U.UnlearningCancelled, match="stopped after 0 of 3 steps"):
        U._finetune_by_deltas(tiny_model, fo, [], sorted(names), objective="unlearn", steps=3,
                              lr=1e-2, retain_weight=1.0, clip=1.0, progress=None,
                              should_stop=lambda: True)


def test_view_placeholders_are_text_and_trace_labels_are_short_tokens():
    import holoviews as hv

    from apps.unlearning import (plot_accuracy_bars, plot_probe_curve, plot_trace_heatmap,
                                 trace_token_labels)

    # Before Localize / Run unlearning: a line of text saying what to press, no axes.
    for element, press in ((plot_probe_curve(None), "Localize"), (plot_trace_heatmap(None), "Localize"),
                           (plot_accuracy_bars([]), "Run unlearning")):
        assert isinstance(element, hv.Text) and element.text.startswith(f"Press {press}")
        assert element.opts.get().kwargs["xaxis"] is None
    # The token labels: as the model sees them, 8 characters at most, the position only
    # where a token repeats (worked by hand).
    assert trace_token_labels([" Derek", " Jeter", " plays", " the", " sport", " of", " the"],
                              [12, 13, 14, 15, 16, 17, 18]) == \
        ["·Derek", "·Jeter", "·plays", "·the (15)", "·sport", "·of", "·the (18)"]
    assert trace_token_labels([" professional"], [3]) == ["·profes…"]
    tokens = np.array([[" Derek", " Jeter", " plays"]])
    trace = xr.Dataset({"restore_resid": (("fact", "layer", "pos"), np.arange(6.0).reshape(1, 2, 3))},
                       coords={"token": (("fact", "pos"), tokens), "subject": ("fact", ["Derek Jeter"])})
    heat = plot_trace_heatmap(trace)
    assert sorted(set(heat.dimension_values("token"))) == ["·Derek", "·Jeter", "·plays"]
    assert heat.opts.get().kwargs["xrotation"] == 0
    # cell (token ·Jeter, layer 1) holds restore_resid[layer 1, pos 1] = 4, its position in the hover
    cell = [r for r in zip(*(heat.dimension_values(d) for d in ("token", "layer", "p_answer", "position")))
            if r[0] == "·Jeter" and r[1] == 1]
    assert cell == [("·Jeter", 1, 4.0, 1)]


def test_view_shows_the_component_contrast_and_runs_both(tiny_model, facts_file):
    """Localize fills the component map (the selected method's components as dots, the
    fact-lookup MLPs as rings); Run trains fact lookup beside the selected method and reads
    the held-out perplexity; the page states its scope and the settings a link carries."""
    import holoviews as hv

    from apps.unlearning import UnlearningView, component_map_rows, perplexity_caption

    view = UnlearningView(tiny_model, facts_file=facts_file, known_only=False, background=False,
                          n_forget=4, n_retain=2, n_layers=1, steps=1, relearn_steps=0)
    assert view.scope().edits.startswith("not applicable")
    assert "4 to forget, 2 to retain" in view.scope().on
    assert set(view.link_params) <= set(view.param) and "method" in view.link_params
    view.localize()
    assert view.probe is not None and "restore_head" in view.trace
    view.method = "causal_tracing"
    overlay = view._component_map()
    heat, ring, dots = [el for el in overlay]
    assert isinstance(heat, hv.HeatMap)
    expect = U.localized_components(tiny_model, "causal_tracing", 1, probe=view.probe,
                                    trace=view.trace, attribution=view.attribution)
    assert sorted(map(tuple, dots.data[["component", "layer"]].values.tolist())) == sorted(
        (c.split(".")[1], int(c[1:].split(".")[0])) for c in expect)
    flu = U.localized_components(tiny_model, "fact_lookup", 1, probe=view.probe)
    assert ring.data[["component", "layer"]].values.tolist() == [["MLP", int(flu[0][1:].split(".")[0])]]
    # the map's cells are the restore effects of every head and MLP
    rows = component_map_rows(U.component_scores(view.trace))
    assert len(rows) == tiny_model.n_layers * (tiny_model.spec.n_heads + 1)
    eff = float((view.trace.restore_head.sel(layer=2, head=1) - view.trace.p_corrupt).mean())
    assert ("H1", 2, pytest.approx(eff), "L2.H1") in rows
    assert "fact lookup" in view._contrast_caption() and "causal tracing" in view._contrast_caption()
    view.run()
    res = view.result
    assert res["localization"].values.tolist() == ["original", "fact_lookup", "causal_tracing"]
    held = U.text_windows(tiny_model, "heldout", window=64, max_windows=16)
    assert float(res.perplexity.sel(localization="original")) == pytest.approx(
        U.text_perplexity(tiny_model, held), rel=1e-5)
    assert "FLU" in perplexity_caption(res) and "CT" in perplexity_caption(res)
    assert "text_windows(model, 'train'" in view.code_snippet()


def test_a_stop_ends_localize_at_its_next_progress_step(tiny_model, facts_file, monkeypatch):
    """The gallery's stop button cancels the page's runner: Localize's stages (a probe over
    every fact, causal tracing per fact) stop at their next progress step, not at the end of
    the stage, and nothing after it runs; the status says it stopped."""
    from apps.unlearning import UnlearningView

    view = UnlearningView(tiny_model, facts_file=facts_file, known_only=False, background=False,
                          n_forget=4, n_retain=2)
    ran_on, traced = [], []

    def probe_stopped_midway(model, facts, n_folds, progress):
        view._runners["work"].cancel()          # what the stop button does (`stop_all`)
        progress(1, len(facts))
        ran_on.append("after the first progress step")

    monkeypatch.setattr(U, "attribute_probe_curve", probe_stopped_midway)
    monkeypatch.setattr(U, "causal_trace", lambda *a, **k: traced.append(True))
    view.localize()
    assert ran_on == [] and traced == [] and view.probe is None
    assert view.status == "Stopped: nothing was computed." and not view.busy


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma2", "tiny-gpt2"])
def test_noise_unit_is_the_std_of_the_embedding_outputs(name):
    """Causal tracing's noise unit (ROME's: the std of the subject embeddings as the model
    feeds them on) is the std of the token embedding module's outputs over the whole
    vocabulary, Gemma's sqrt(d_model) scale included."""
    from explorer.analyses.unlearning.localization import _noise_std
    from explorer.models import load_model

    m = load_model(name)
    emb = m.hf.get_input_embeddings()
    with torch.no_grad():
        every = emb(torch.arange(m.vocab_size)).float()
    assert _noise_std(m) == pytest.approx(float(every.std()), rel=1e-5)
