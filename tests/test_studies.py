"""Tests for explorer.studies: study files, randomisation, placebos, items, the response
store (including a process killed while writing), the analysis, the report, export, CLI."""
from __future__ import annotations

import copy
import csv
import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from scipy import stats

from explorer import cli
from explorer._checks import InputError, StoreError
from explorer.studies.analysis import (
    analyse,
    analyse_responses,
    cohens_h,
    holm,
    simulate_participants,
    simulated_responses,
)
from explorer.models import token_text
from explorer.studies.items import build_items
from explorer.studies.placebo import (
    mismatched_example,
    placebo_explanations,
    random_heads,
    shuffled_attributions,
)
from explorer.studies.randomise import (
    ATTENTION_CONDITION,
    participant_schedule,
    study_schedule,
)
from explorer.studies.report import CSV_COLUMNS, export_responses_csv, study_report
from explorer.studies.responses import ResponseStore
from explorer.studies.run import StudyRun
from explorer.studies.schema import StudyFileError, load_study, study_from_dict

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = REPO_ROOT / "studies" / "example_study.yaml"
PROMPTS = ["The capital of France is", "One two three four", "Water boils at one hundred",
           "She said that he would", "In 1905 the physicist wrote", "The quick brown fox jumps"]


def study_dict(**changes):
    """A valid small study (6 prompts, 3 conditions, within design) with ``changes`` applied."""
    d = {
        "name": "tiny-study", "title": "A tiny study", "model": "tiny-llama", "seed": 7,
        "design": "within", "participants": 6,
        "task": {"kind": "predict_next_token", "n_choices": 3, "attention_checks": 1},
        "items": {"prompts": list(PROMPTS)},
        "explanation": {"kind": "logit_lens", "k": 2},
        "conditions": [{"name": "real", "kind": "real"}, {"name": "none", "kind": "baseline"},
                       {"name": "fake", "kind": "placebo", "placebo": "mismatched_example"}],
        "hypotheses": [{"id": "H1", "statement": "real beats none", "compare": ["real", "none"]},
                       {"id": "H2", "statement": "real beats fake", "compare": ["real", "fake"]}],
        "analysis": {"bootstrap": 400, "permutations": 400},
        "consent": "Agree?", "instructions": "Pick one.",
    }
    for key, value in changes.items():
        d[key] = value
    return d


def write_study(folder: Path, d: dict, name: str = "study.yaml") -> Path:
    path = folder / name
    path.write_text(yaml.safe_dump(d, sort_keys=False) if name.endswith((".yaml", ".yml"))
                    else json.dumps(d), encoding="utf-8")
    return path


# -- study files ------------------------------------------------------------------------------

def test_example_study_is_valid():
    study = load_study(EXAMPLE)
    assert study.task.kind == "predict_next_token"
    assert len(study.prompts) % len(study.conditions) == 0
    assert {c.kind for c in study.conditions} == {"real", "baseline", "placebo"}
    assert study.participants % len(study.conditions) == 0
    assert len(study.sha256) == 64


def test_yaml_and_json_give_the_same_study(tmp_path):
    a = load_study(write_study(tmp_path, study_dict(), "a.yaml"))
    b = load_study(write_study(tmp_path, study_dict(), "b.json"))
    assert a.to_dict() == b.to_dict()
    assert a.analysis.seed == 7  # defaults to the study seed


def test_items_from_a_file_relative_to_the_study(tmp_path):
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n\n", encoding="utf-8")
    study = load_study(write_study(tmp_path, study_dict(items={"file": "prompts.txt"})))
    assert study.prompts == tuple(PROMPTS)


@pytest.mark.parametrize("change, match", [
    ({"tsak": {}}, r"`tsak` is not a known field.*Did you mean 'task'"),
    ({"task": {"kind": "predict_next_tokens"}}, r"`task.kind` must be one of .*Did you mean 'predict_next_token'"),
    ({"task": {"kind": "predict_next_token", "n_choices": 1}}, r"`task.n_choices` must be an int in \[2, 10\]; got 1"),
    ({"task": {"kind": "predict_next_token", "n_choices": "four"}}, r"`task.n_choices` must be an int.*got str 'four'"),
    ({"seed": -1}, r"`seed` must be an int in \[0, "),
    ({"participants": 7}, r"`participants` must be a multiple of the number of conditions \(3\)"),
    ({"items": {"prompts": PROMPTS[:4]}}, r"`items` must hold a multiple of the number of conditions"),
    ({"items": {"prompts": PROMPTS[:5] + [PROMPTS[0]]}}, r"`items` lists the prompt 'The capital of France is' twice"),
    ({"items": {}}, r"`items` must give exactly one of `prompts`"),
    ({"items": {"prompts": ["ok"] * 0}}, r"`items.prompts` must hold at least 1"),
    ({"explanation": {"kind": "head_attribution"}}, r"`explanation.kind` must be 'logit_lens' for task 'predict_next_token'"),
    ({"explanation": {"kind": "logit_lens", "layers": [1, 1]}}, r"`explanation.layers` lists a layer twice"),
    ({"explanation": {"kind": "logit_lens", "layers": [0, -2]}}, r"`explanation.layers\[1\]` must be a layer index"),
    ({"conditions": [{"name": "real", "kind": "real"}]}, r"`conditions` must hold at least 2"),
    ({"conditions": [{"name": "real", "kind": "real"}, {"name": "p", "kind": "placebo"},
                     {"name": "b", "kind": "baseline"}]}, r"`conditions\[1\].placebo` is required"),
    ({"conditions": [{"name": "real", "kind": "real"}, {"name": "p", "kind": "placebo", "placebo": "random_heads"},
                     {"name": "b", "kind": "baseline"}]},
     r"`conditions\[1\].placebo` 'random_heads' does not apply to explanation kind 'logit_lens'; use one of 'mismatched_example'"),
    ({"conditions": [{"name": "real", "kind": "real"}, {"name": "real", "kind": "baseline"},
                     {"name": "b", "kind": "baseline"}]}, r"`conditions\[1\].name` repeats"),
    ({"conditions": [{"name": "real", "kind": "real"}, {"name": "x", "kind": "placbo"},
                     {"name": "b", "kind": "baseline"}]}, r"`conditions\[1\].kind` must be one of.*Did you mean 'placebo'"),
    ({"hypotheses": [{"id": "H1", "statement": "s", "compare": ["real", "nothing"]}]},
     r"`hypotheses\[0\].compare\[1\]` must name a condition .*got 'nothing'"),
    ({"hypotheses": [{"id": "H1", "statement": "s", "compare": ["real", "none"], "direction": "up"}]},
     r"`hypotheses\[0\].direction` must be one of 'greater', 'less', 'two-sided'"),
    ({"analysis": {"alpha": 0}}, r"`analysis.alpha` must be a number in \(0.0, 0.5\]; got 0"),
    ({"name": "has space"}, r"`name` must be a name of letters"),
])
def test_bad_fields_are_named(change, match):
    d = study_dict(**change)
    with pytest.raises(StudyFileError, match=match):
        study_from_dict(d)


def test_missing_field_is_named():
    d = study_dict()
    del d["consent"]
    with pytest.raises(StudyFileError, match=r"`consent` is required but missing"):
        study_from_dict(d)


def test_unreadable_files_are_named(tmp_path):
    with pytest.raises(StudyFileError, match=r"does not exist"):
        load_study(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n", encoding="utf-8")
    with pytest.raises(StudyFileError, match=r"is not valid YAML .*line"):
        load_study(bad)
    txt = tmp_path / "study.txt"
    txt.write_text("{}", encoding="utf-8")
    with pytest.raises(StudyFileError, match=r"must end in .yaml, .yml or .json"):
        load_study(txt)
    with pytest.raises(StudyFileError, match=r"`\(top level\)` must be a mapping"):
        load_study(write_study(tmp_path, [1, 2], "list.json"))


# -- randomisation ------------------------------------------------------------------------------

def test_between_assignment_is_balanced_at_every_point():
    study = study_from_dict(study_dict(design="between", participants=60))
    groups = [participant_schedule(study, s)[0].condition for s in range(60)]
    for s in range(60):
        trials = participant_schedule(study, s)
        assert {t.condition for t in trials if t.condition != ATTENTION_CONDITION} == {groups[s]}
    for n in range(1, 61):
        counts = [groups[:n].count(c) for c in study.condition_names]
        assert max(counts) - min(counts) <= 1
    assert [groups.count(c) for c in study.condition_names] == [20, 20, 20]


def test_within_assignment_is_a_latin_square():
    study = study_from_dict(study_dict(participants=12))
    schedule = study_schedule(study)
    n_items, n_cond = len(PROMPTS), 3
    for trials in schedule:
        task = [t for t in trials if t.condition != ATTENTION_CONDITION]
        assert sorted(t.item_id for t in task) == [f"item-{j:03d}" for j in range(1, n_items + 1)]
        for c in study.condition_names:   # each condition equally often per participant
            assert sum(t.condition == c for t in task) == n_items // n_cond
        assert sum(t.condition == ATTENTION_CONDITION for t in trials) == 1
        assert trials[0].condition != ATTENTION_CONDITION
        assert [t.index for t in trials] == list(range(len(trials)))
    for block in range(0, 12, n_cond):  # every item under every condition once per block
        for j in range(1, n_items + 1):
            seen = sorted(t.condition for trials in schedule[block:block + n_cond] for t in trials
                          if t.item_id == f"item-{j:03d}")
            assert seen == sorted(study.condition_names)


def test_schedule_is_reproducible_from_the_seed():
    a = study_schedule(study_from_dict(study_dict(participants=12)))
    b = study_schedule(study_from_dict(study_dict(participants=12)))
    c = study_schedule(study_from_dict(study_dict(participants=12, seed=8)))
    assert a == b
    assert a != c


def test_item_order_is_uniformly_random():
    study = study_from_dict(study_dict(participants=900, task={"kind": "predict_next_token"}))
    first = [participant_schedule(study, s)[0].item_id for s in range(900)]
    counts = [first.count(f"item-{j:03d}") for j in range(1, 7)]
    assert stats.chisquare(counts).pvalue > 1e-3       # 150 expected each
    positions = [next(t.index for t in participant_schedule(study, s) if t.item_id == "item-001")
                 for s in range(900)]
    assert stats.chisquare(np.bincount(positions, minlength=6)).pvalue > 1e-3


# -- placebos ----------------------------------------------------------------------------------

def test_shuffled_attributions_keep_form_but_not_information():
    rng = np.random.default_rng(0)
    n_cases, n_cells = 2000, 20
    hits_real = hits_placebo = 0
    correlations = []
    for _ in range(n_cases):
        answer = rng.integers(n_cells)
        real = rng.normal(0, 1, n_cells)
        real[answer] = np.abs(real).max() + 1.0 + rng.exponential()   # the real one points at the answer
        fake = shuffled_attributions(real, rng=rng)
        assert fake.shape == real.shape
        np.testing.assert_array_equal(np.sort(fake), np.sort(real))
        hits_real += int(np.argmax(real) == answer)
        hits_placebo += int(np.argmax(fake) == answer)
        correlations.append(np.corrcoef(real, fake)[0, 1])
    assert hits_real == n_cases   # the test would fail for an informative placebo
    assert stats.binomtest(hits_placebo, n_cases, 1 / n_cells).pvalue > 1e-3
    assert stats.ttest_1samp(correlations, 0.0).pvalue > 1e-3


def test_random_heads_keep_form_but_not_information():
    rng = np.random.default_rng(1)
    n_cases, shape, top = 3000, (6, 8), 3
    hits = 0
    for _ in range(n_cases):
        real = rng.normal(0, 0.1, shape)
        cell = np.unravel_index(rng.integers(real.size), shape)
        real[cell] = 5.0 * rng.choice([-1, 1])   # the head that matters, by far the largest
        fake = random_heads(real, top=top, rng=rng)
        np.testing.assert_array_equal(np.sort(fake, axis=None), np.sort(real, axis=None))
        # the highlighted (top-|score|) values are the same values, on other heads
        np.testing.assert_array_equal(np.sort(np.abs(fake), axis=None)[-top:],
                                      np.sort(np.abs(real), axis=None)[-top:])
        # cells neither highlighted before nor after keep their score
        top_real = set(np.argsort(-np.abs(real), axis=None)[:top].tolist())
        top_fake = set(np.argsort(-np.abs(fake), axis=None)[:top].tolist())
        untouched = [i for i in range(real.size) if i not in top_real | top_fake]
        np.testing.assert_array_equal(fake.reshape(-1)[untouched], real.reshape(-1)[untouched])
        hits += int(np.unravel_index(np.argmax(np.abs(fake)), shape) == cell)
    assert stats.binomtest(hits, n_cases, 1 / real.size).pvalue > 1e-3


def test_random_heads_rejects_bad_input():
    with pytest.raises(InputError, match=r"`scores` must be a 2-d array \[layer, head\]"):
        random_heads(np.zeros(5), top=1, rng=np.random.default_rng(0))
    with pytest.raises(InputError, match=r"`top` must be an int in \[1, 4\]; got 5"):
        random_heads(np.zeros((2, 2)), top=5, rng=np.random.default_rng(0))


def test_mismatched_example_is_a_uniform_derangement():
    rng = np.random.default_rng(2)
    n, reps = 5, 4000
    donors_of_0 = []
    for _ in range(reps):
        perm = mismatched_example(n, rng=rng)
        assert sorted(perm.tolist()) == list(range(n))
        assert not np.any(perm == np.arange(n))
        donors_of_0.append(int(perm[0]))
    counts = np.bincount(donors_of_0, minlength=n)
    assert counts[0] == 0
    assert stats.chisquare(counts[1:]).pvalue > 1e-3
    with pytest.raises(InputError, match=r"`n_items` must be an int in \[2, inf\]; got 1"):
        mismatched_example(1, rng=rng)


def test_mismatched_lens_keeps_form_but_not_information():
    """Synthetic lens explanations whose last row names the answer 90% of the time."""
    rng = np.random.default_rng(3)
    vocab = [f"tok{i}" for i in range(40)]
    n_items, hits_real, hits_fake, total = 12, 0, 0, 0
    for _ in range(300):
        answers = rng.choice(vocab, size=n_items)
        real = []
        for a in answers:
            tokens = [list(rng.choice(vocab, size=2, replace=False)) for _ in range(4)]
            if rng.random() < 0.9:
                tokens[-1][0] = a
            probs = [sorted(rng.random(2).round(3).tolist(), reverse=True) for _ in range(4)]
            real.append({"kind": "logit_lens", "layers": [0, 1, 2, 3], "tokens": tokens, "probs": probs})
        fake = placebo_explanations("mismatched_example", real, rng=rng)
        for i, (a, f) in enumerate(zip(answers, fake)):
            donor = f["source_item"]
            assert donor != i
            assert {k: v for k, v in f.items() if k not in ("placebo", "source_item")} == real[donor]
            hits_real += int(real[i]["tokens"][-1][0] == a)
            hits_fake += int(f["tokens"][-1][0] == a)
            total += 1
    assert hits_real / total > 0.85
    # a donor's answer equals this item's answer by chance only (1/40), plus the 10% noise
    assert stats.binomtest(hits_fake, total, 1 / len(vocab)).pvalue > 1e-3


def test_placebo_explanations_need_matching_form():
    lens = [{"kind": "logit_lens", "layers": [0], "tokens": [["a"]], "probs": [[1.0]]}] * 2
    with pytest.raises(InputError, match=r"placebo 'shuffled_attributions' needs 'head_attribution'"):
        placebo_explanations("shuffled_attributions", lens, rng=np.random.default_rng(0))
    with pytest.raises(InputError, match=r"`placebo` must be one of .*Did you mean 'random_heads'"):
        placebo_explanations("random_head", lens, rng=np.random.default_rng(0))


# -- items (tiny model) -----------------------------------------------------------------------

def _layer_outputs(model, prompt):
    """Residual stream after every layer at the last position, from plain forward hooks."""
    ids = torch.tensor([model.tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    saved = {}
    hooks = [layer.register_forward_hook(
        lambda _m, _i, out, i=i: saved.__setitem__(i, (out[0] if isinstance(out, tuple) else out)[0, -1]))
        for i, layer in enumerate(model.hf.model.layers)]
    try:
        logits = model.hf(ids).logits[0, -1]
    finally:
        for h in hooks:
            h.remove()
    return ids, saved, logits


def test_next_token_items_match_a_plain_forward(tmp_path, tiny_model):
    study = load_study(write_study(tmp_path, study_dict()))
    items = build_items(study, tiny_model)
    assert len(items) == len(PROMPTS) + 1
    lm_head, norm = tiny_model.hf.lm_head, tiny_model.hf.model.norm
    for item, prompt in zip(items, PROMPTS):
        _, resid, logits = _layer_outputs(tiny_model, prompt)
        ranked = [token_text(tiny_model.tokenizer, t) for t in torch.topk(logits, 20).indices.tolist()]
        distinct = list(dict.fromkeys(ranked))[:3]   # ids that decode alike count once
        assert item["choices"][item["answer"]] == ranked[0]
        assert sorted(item["choices"]) == sorted(distinct)
        real = item["explanations"]["real"]
        assert real["layers"] == [0, 1]           # the last layer is hidden by default
        for row, layer in enumerate(real["layers"]):
            probs = torch.softmax(lm_head(norm(resid[layer])), -1)
            p, ids = torch.topk(probs, 2)
            assert real["tokens"][row] == [token_text(tiny_model.tokenizer, i) for i in ids.tolist()]
            np.testing.assert_allclose(real["probs"][row], p.tolist(), atol=1e-4)
        assert item["explanations"]["none"] is None
        fake = item["explanations"]["fake"]
        assert fake["placebo"] == "mismatched_example"
        donor = items[fake["source_item"]]
        assert donor["id"] != item["id"]
        assert fake["tokens"] == donor["explanations"]["real"]["tokens"]
    check = items[-1]
    assert check["attention_check"] and check["choices"][check["answer"]] in check["question"]


def test_pick_head_items_match_plain_hooks(tmp_path, tiny_model):
    d = study_dict(task={"kind": "pick_head", "n_choices": 4},
                   explanation={"kind": "head_attribution", "top": 2},
                   conditions=[{"name": "real", "kind": "real"},
                               {"name": "none", "kind": "baseline"},
                               {"name": "fake", "kind": "placebo", "placebo": "random_heads"}])
    study = load_study(write_study(tmp_path, d))
    items = build_items(study, tiny_model)[:2]
    spec = tiny_model.spec
    for item, prompt in zip(items, PROMPTS):
        ids, resid, logits = _layer_outputs(tiny_model, prompt)
        answer = int(logits.argmax())
        clean_logp = torch.log_softmax(logits, -1)[answer]
        effects = []
        for layer, head in item["details"]["candidates"]:
            o_proj = tiny_model.hf.model.layers[layer].self_attn.o_proj

            def zero_head(_m, args, head=head):
                z = args[0].clone()                                      # [1, pos, head*d_head]
                z[..., head * spec.d_head:(head + 1) * spec.d_head] = 0
                return (z,)
            handle = o_proj.register_forward_pre_hook(zero_head)
            try:
                logp = torch.log_softmax(tiny_model.hf(ids).logits[0, -1], -1)[answer]
            finally:
                handle.remove()
            effects.append(float(clean_logp - logp))
        np.testing.assert_allclose(item["details"]["ablation_effects"], effects, atol=1e-4)
        shown = item["choices"][item["answer"]]
        best = item["details"]["candidates"][int(np.argmax(effects))]
        assert shown == f"L{best[0]} H{best[1]}"
        # direct effect of head (L, h): the answer logit minus the logit without its write
        layer, head = 1, 2
        captured = {}
        o_proj = tiny_model.hf.model.layers[layer].self_attn.o_proj
        handle = o_proj.register_forward_pre_hook(
            lambda _m, args, captured=captured: captured.__setitem__("z", args[0][0, -1]))
        try:
            tiny_model.hf(ids)
        finally:
            handle.remove()
        sl = slice(head * spec.d_head, (head + 1) * spec.d_head)
        write = captured["z"][sl] @ o_proj.weight[:, sl].T                   # [d_model]
        final = resid[spec.n_layers - 1]
        def answer_logit(x, answer=answer):
            return tiny_model.hf.lm_head(tiny_model.hf.model.norm(x))[answer]
        expected = float(answer_logit(final) - answer_logit(final - write))
        real = item["explanations"]["real"]
        assert real["scores"][layer][head] == pytest.approx(expected, abs=2e-4)
        fake = np.array(item["explanations"]["fake"]["scores"])
        np.testing.assert_array_equal(np.sort(fake, axis=None), np.sort(np.array(real["scores"]), axis=None))


def test_explicit_layers_must_exist(tmp_path, tiny_model):
    d = study_dict(explanation={"kind": "logit_lens", "layers": [1, 5]})
    study = load_study(write_study(tmp_path, d))
    with pytest.raises(InputError,
                       match=r"`explanation.layers` must be layers of tiny-llama \(0 to 2\); got 5"):
        build_items(study, tiny_model)


# -- response store -----------------------------------------------------------------------------

def make_store(tmp_path: Path, participants: int = 3):
    """A response store on the tiny study with a synthetic answer key (no model)."""
    study = study_from_dict(study_dict(participants=participants))
    items = [{"id": f"item-{j:03d}", "answer": j % 3, "choices": ["a", "b", "c"], "attention_check": False}
             for j in range(1, 7)] + [{"id": "check-1", "answer": 1, "choices": ["x", "y", "z"],
                                      "attention_check": True}]
    store = ResponseStore.create(tmp_path / "responses.sqlite", schedule=study_schedule(study),
                                 items=items, meta={"study_sha256": study.sha256})
    return study, items, store


def test_store_is_wal_and_scores_from_the_answer_key(tmp_path):
    study, items, store = make_store(tmp_path)
    with sqlite3.connect(tmp_path / "responses.sqlite") as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    key = {it["id"]: it["answer"] for it in items}
    p = store.enrol()
    assert p.slot == 0
    trials = store.trials(p.code)
    assert trials == participant_schedule(study, 0)
    for t in trials[:3]:
        r = store.record_response(p.code, t.index, choice=1, confidence=4, shown_at=100.0,
                                  answered_at=102.5)
        assert r.created and not r.finished
        assert r.row["correct"] == int(key[t.item_id] == 1)
        assert r.row["condition"] == t.condition and r.row["item_id"] == t.item_id
        assert r.row["rt_ms"] == pytest.approx(2500.0)
    assert store.next_trial(p.code) == trials[3]


def test_store_retry_is_idempotent_and_first_answer_counts(tmp_path):
    _, _, store = make_store(tmp_path)
    p = store.enrol()
    first = store.record_response(p.code, 0, choice=2, confidence=3, shown_at=1.0)
    again = store.record_response(p.code, 0, choice=2, confidence=3, shown_at=1.0)
    other = store.record_response(p.code, 0, choice=0, confidence=1, shown_at=1.0)
    assert first.created and not again.created and not other.created
    assert other.row["choice"] == 2 and other.row["confidence"] == 3
    assert len(store.responses()) == 1


def test_store_enrolment_fills_slots_then_refuses(tmp_path):
    _, _, store = make_store(tmp_path, participants=3)
    codes = [store.enrol().code for _ in range(3)]
    assert [store.participant(c).slot for c in codes] == [0, 1, 2]
    with pytest.raises(InputError, match=r"the study is full: all 3 participant places are taken"):
        store.enrol()
    with pytest.raises(InputError, match=r"participant code .* is taken"):
        store.enrol(codes[0])


def test_store_rejects_bad_responses(tmp_path):
    _, _, store = make_store(tmp_path)
    p = store.enrol("PARTICIPANT-1")
    with pytest.raises(InputError, match=r"no participant with code 'NOBODY-00'"):
        store.record_response("NOBODY-00", 0, choice=0, confidence=1, shown_at=0.0)
    with pytest.raises(InputError, match=r"`trial_index` must be an int in \[0, 6\]; got 7"):
        store.record_response(p.code, 7, choice=0, confidence=1, shown_at=0.0)
    with pytest.raises(InputError, match=r"`choice` must be an int in \[0, 2\]; got 3"):
        store.record_response(p.code, 0, choice=3, confidence=1, shown_at=0.0)
    with pytest.raises(InputError, match=r"`confidence` must be an int in \[1, 5\]; got 6"):
        store.record_response(p.code, 0, choice=0, confidence=6, shown_at=0.0, confidence_levels=5)
    with pytest.raises(InputError, match=r"`code` must be 4 to 64 letters"):
        store.participant("a b")
    with pytest.raises(StoreError, match=r"exists already"):
        ResponseStore.create(tmp_path / "responses.sqlite", schedule=[], items=[], meta={})
    assert store.responses() == []


def test_store_marks_a_participant_finished(tmp_path):
    _, _, store = make_store(tmp_path)
    p = store.enrol()
    n = len(store.trials(p.code))
    results = [store.record_response(p.code, i, choice=0, confidence=2, shown_at=0.0) for i in range(n)]
    assert [r.finished for r in results] == [False] * (n - 1) + [True]
    assert store.participant(p.code).finished_at is not None
    assert store.next_trial(p.code) is None


def test_store_reports_a_busy_database(tmp_path):
    _, _, store = make_store(tmp_path)
    p = store.enrol()
    store.close()
    impatient = ResponseStore(tmp_path / "responses.sqlite", timeout=0.1)
    holder = sqlite3.connect(tmp_path / "responses.sqlite", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")               # another writer keeps the lock
    try:
        with pytest.raises(StoreError, match=r"the response database is busy .*try again"):
            impatient.record_response(p.code, 0, choice=0, confidence=1, shown_at=0.0)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert impatient.record_response(p.code, 0, choice=0, confidence=1, shown_at=0.0).created
    impatient.close()


_WRITER = textwrap.dedent("""
    import sys
    from explorer.studies.responses import ResponseStore
    store = ResponseStore(sys.argv[1])
    shift = int(sys.argv[2])
    paced = len(sys.argv) > 3             # wait for a line on stdin before each answer
    for p in store.participants():
        for t in store.trials(p.code):
            if paced and not sys.stdin.readline():
                sys.exit(0)
            choice = (t.index + shift) % 3
            r = store.record_response(p.code, t.index, choice=choice, confidence=1 + t.index % 5,
                                      shown_at=0.0, answered_at=1.0, confidence_levels=5)
            if r.created:
                print(p.code, t.index, choice, flush=True)
""")


@pytest.mark.slow
@pytest.mark.parametrize("kill_after", [5, 30, 60])
def test_store_survives_sigkill_mid_session(tmp_path, kill_after):
    """A writer process is SIGKILLed while it commits responses: every acknowledged answer is
    there, none twice, and a retry of everything adds only the missing ones."""
    n_participants = 12
    _, _, store = make_store(tmp_path, participants=n_participants)
    codes = [store.enrol().code for _ in range(n_participants)]
    n_trials = len(store.trials(codes[0]))
    store.close()
    db = tmp_path / "responses.sqlite"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    # the writer answers only when told to, so however loaded the machine, the kill comes a few
    # answers after the last one read: while it writes them, and before the session's end
    child = subprocess.Popen([sys.executable, "-c", _WRITER, str(db), "0", "paced"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    child.stdin.write("go\n")
    child.stdin.flush()
    acknowledged = []
    for line in child.stdout:
        acknowledged.append(line.split())
        if len(acknowledged) >= kill_after:
            child.stdin.write("go\n" * 3)       # three more answers under way...
            child.stdin.flush()
            child.send_signal(signal.SIGKILL)   # ...when it is killed
            break
        child.stdin.write("go\n")
        child.stdin.flush()
    child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL
    child.stdout.close()
    child.stdin.close()

    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        rows = conn.execute("SELECT code, trial_index, choice FROM responses").fetchall()
        dupes = conn.execute("SELECT code, trial_index FROM responses GROUP BY code, trial_index "
                             "HAVING COUNT(*) > 1").fetchall()
    assert dupes == []
    stored = {(c, i): ch for c, i, ch in rows}
    for code, index, choice in acknowledged:      # nothing acknowledged is lost
        assert stored[(code, int(index))] == int(choice)
    assert len(stored) < n_participants * n_trials   # the kill came before the end

    # a retry of every answer, with different choices: only the missing ones are added
    subprocess.run([sys.executable, "-c", _WRITER, str(db), "1"], check=True, env=env,
                   capture_output=True, text=True, timeout=120)
    with ResponseStore(db) as reopened:
        after = {(r["code"], r["trial_index"]): r["choice"] for r in reopened.responses()}
        assert len(reopened.responses()) == n_participants * n_trials
        assert all(p.finished_at is not None for p in reopened.participants())
    for key, choice in stored.items():
        assert after[key] == choice               # the first answer counts


# -- analysis ---------------------------------------------------------------------------------

def test_cohens_h_and_holm_by_hand():
    assert cohens_h(0.8, 0.5) == pytest.approx(2 * np.arcsin(np.sqrt(0.8)) - 2 * np.arcsin(np.sqrt(0.5)))
    assert cohens_h(0.5, 0.5) == 0.0
    # p = (0.01, 0.04, 0.03): sorted 0.01*3=0.03, 0.03*2=0.06, 0.04*1 -> max(0.06, 0.04)=0.06
    np.testing.assert_allclose(holm([0.01, 0.04, 0.03]), [0.03, 0.06, 0.06])
    np.testing.assert_allclose(holm([0.5, 0.9]), [1.0, 1.0])


def _accuracy_by_hand(rows):
    out = {}
    for r in rows:
        if not r["attention_check"]:
            out.setdefault(r["condition"], []).append(r["correct"])
    return {c: float(np.mean(v)) for c, v in out.items()}


@pytest.mark.parametrize("design", ["within", "between"])
def test_analysis_recovers_a_known_effect(design):
    truth = {"real": 0.8, "none": 0.5, "fake": 0.5}
    # 99% intervals: seven interval checks per design at 95% would miss the truth by chance
    # a third of the time; coverage itself is checked in the next test.
    study = study_from_dict(study_dict(design=design, participants=90,
                                       analysis={"bootstrap": 2000, "permutations": 2000,
                                                 "confidence_level": 0.99}))
    rows = simulated_responses(study, truth, seed=0, spread=0.1)
    ds = analyse_responses(rows, study)
    by_hand = _accuracy_by_hand(rows)
    for c in study.condition_names:
        assert float(ds.accuracy.sel(condition=c)) == pytest.approx(by_hand[c])
        assert ds.accuracy_low.sel(condition=c) <= truth[c] <= ds.accuracy_high.sel(condition=c)
    for h in ("H1", "H2"):
        s = ds.sel(hypothesis=h)
        assert float(s.effect_low) <= 0.3 <= float(s.effect_high)
        assert float(s.effect_low) > 0                       # the effect is detected
        assert float(s.cohens_h_low) <= cohens_h(0.8, 0.5) <= float(s.cohens_h_high)
        assert bool(s.supported) and float(s.p_adjusted) < 0.05


def test_analysis_intervals_cover_the_truth():
    """Over repeated simulated studies the 95% interval of the effect covers it ~95% of the time."""
    truth = {"real": 0.7, "none": 0.5, "fake": 0.45}
    study = study_from_dict(study_dict(participants=30, analysis={"bootstrap": 300, "permutations": 100}))
    covered, estimates = [], []
    for rep in range(120):
        ds = analyse_responses(simulated_responses(study, truth, seed=rep, spread=0.15), study)
        s = ds.sel(hypothesis="H1")
        covered.append(float(s.effect_low) <= 0.2 <= float(s.effect_high))
        estimates.append(float(s.effect))
    assert 0.85 <= np.mean(covered) <= 1.0
    assert abs(np.mean(estimates) - 0.2) < 0.02


def test_analysis_under_the_null_rarely_claims_support():
    truth = {"real": 0.5, "none": 0.5, "fake": 0.5}
    study = study_from_dict(study_dict(participants=30, analysis={"bootstrap": 100, "permutations": 400}))
    p = [float(analyse_responses(simulated_responses(study, truth, seed=rep), study)
               .p_value.sel(hypothesis="H1")) for rep in range(100)]
    assert np.mean(np.array(p) < 0.05) <= 0.12
    assert stats.kstest(p, "uniform").pvalue > 1e-3


def test_analysis_excludes_failed_attention_checks():
    study = study_from_dict(study_dict(participants=30))
    rows = simulated_responses(study, {"real": 0.9, "none": 0.3, "fake": 0.3}, seed=5,
                               attention_pass=0.7)
    failed = {r["code"] for r in rows if r["attention_check"] and not r["correct"]}
    assert 0 < len(failed) < 30
    ds = analyse_responses(rows, study)
    assert ds.attrs["n_excluded"] == len(failed) and ds.attrs["n_analysed"] == 30 - len(failed)
    kept = [r for r in rows if r["code"] not in failed]
    assert float(ds.accuracy.sel(condition="real")) == pytest.approx(_accuracy_by_hand(kept)["real"])
    keep_all = study_from_dict(study_dict(participants=30, analysis={"exclude_failed_attention": False}))
    assert analyse_responses(rows, keep_all).attrs["n_analysed"] == 30


def test_simulated_responses_reject_bad_accuracies():
    study = study_from_dict(study_dict())
    with pytest.raises(InputError, match=r"`accuracy` must give one value per condition .*missing fake"):
        simulated_responses(study, {"real": 0.5, "none": 0.5}, seed=0)
    with pytest.raises(InputError, match=r"`accuracy\['real'\]` must be a number in \[0.0, 1.0\]; got 1.5"):
        simulated_responses(study, {"real": 1.5, "none": 0.5, "fake": 0.5}, seed=0)


# -- run folder, report, export, CLI ----------------------------------------------------------

@pytest.fixture
def prepared(tmp_path, tiny_model):
    path = write_study(tmp_path, study_dict())
    run = StudyRun.prepare(path, tmp_path / "run", model=tiny_model)
    yield path, run
    run.close()


def test_run_folder_is_reopened_only_for_the_same_study(tmp_path, prepared, tiny_model):
    path, run = prepared
    assert (run.folder / "items.json").exists()
    assert (run.folder / "study.yaml").read_bytes() == path.read_bytes()
    again = StudyRun.prepare(path, run.folder, model=tiny_model)
    assert again.items == run.items
    again.close()
    other = write_study(tmp_path, study_dict(seed=99), "other.yaml")
    with pytest.raises(InputError, match=r"holds a run of another version of the study"):
        StudyRun.prepare(other, run.folder, model=tiny_model)
    (run.folder / "study.yaml").write_text(yaml.safe_dump(study_dict(seed=5)), encoding="utf-8")
    with pytest.raises(InputError, match=r"was edited after the run was prepared"):
        StudyRun.open(run.folder)
    with pytest.raises(InputError, match=r"is not a prepared study run"):
        StudyRun.open(tmp_path / "nowhere")


def test_trial_display_is_blind(prepared):
    _, run = prepared
    p = run.store.enrol()
    seen_conditions = set()
    for t in run.store.trials(p.code):
        shown = run.trial_display(t)
        text = json.dumps(shown)
        item = run.items[t.item_id]
        assert "answer" not in shown and "details" not in shown
        assert "placebo" not in text and "source_item" not in text
        assert t.condition not in shown.values()
        assert not set(run.study.condition_names) & set(shown)
        if t.condition == "none" or t.condition == ATTENTION_CONDITION:
            assert shown["explanation"] is None
        else:
            expected = {k: v for k, v in item["explanations"][t.condition].items()
                        if k not in ("placebo", "source_item")}
            assert shown["explanation"] == expected
        seen_conditions.add(t.condition)
    assert seen_conditions == {"real", "none", "fake", ATTENTION_CONDITION}


def test_report_and_export(prepared, tmp_path):
    _, run = prepared
    codes = simulate_participants(run, {"real": 0.9, "none": 0.4, "fake": 0.4}, seed=1, n_participants=6)
    assert len(codes) == 6
    ds = analyse(run)
    md = study_report(run, ds)
    for text in ("real beats none", "real beats fake", "## Limitations", "Randomisation seed 7",
                 "analysis seed 7", f"torch {torch.__version__}", run.study.sha256,
                 "6 of the participants are simulated", "Placebo explanation | yes"):
        assert text in md
    html_text = study_report(run, ds, format="html")
    assert html_text.startswith("<!DOCTYPE html>") and "<table>" in html_text and "**" not in html_text
    with pytest.raises(InputError, match=r"`format` must be one of 'markdown', 'html'"):
        study_report(run, ds, format="pdf")

    text = export_responses_csv(run, tmp_path / "out.csv")
    rows = list(csv.DictReader(io.StringIO(text)))
    assert tuple(rows[0]) == CSV_COLUMNS
    assert len(rows) == 6 * len(run.store.trials(codes[0]))
    assert {r["participant"] for r in rows} == set(codes)
    stored = {(r["code"], r["trial_index"]): r for r in run.store.responses()}
    for r in rows:
        s = stored[(r["participant"], int(r["trial_index"]))]
        assert int(r["correct"]) == s["correct"] == int(s["choice"] == run.items[s["item_id"]]["answer"])
        assert r["choice_text"] == run.items[s["item_id"]]["choices"][s["choice"]]


def _main(argv, monkeypatch):
    monkeypatch.setattr(cli, "COMMAND_MODULES", ("explorer.commands.studies",))
    return cli.main(argv)


def test_cli_validate(monkeypatch, capsys, tmp_path):
    assert _main(["study", "validate", str(EXAMPLE), "--json"], monkeypatch) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["valid"] and out["study"]["name"] == "next-token-lens"
    bad = write_study(tmp_path, study_dict(participants=4))
    assert _main(["study", "validate", str(bad)], monkeypatch) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "`participants` must be a multiple" in err[0]
    assert _main(["study"], monkeypatch) == 2
    assert "needs an action" in capsys.readouterr().err


def test_cli_prepare_simulate_analyse_export(monkeypatch, capsys, tmp_path):
    path = write_study(tmp_path, study_dict())
    folder = tmp_path / "run"
    assert _main(["study", "run", str(path), "--dir", str(folder), "--model", "tiny-llama",
                  "--prepare-only", "--json"], monkeypatch) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["n_items"] == 6 and summary["n_slots"] == 6 and summary["model"] == "tiny-llama"
    assert _main(["study", "simulate", str(folder), "--accuracy", "real=1,none=0,fake=0",
                  "--n", "3", "--json"], monkeypatch) == 0
    assert len(json.loads(capsys.readouterr().out)["simulated"]) == 3
    assert _main(["study", "analyse", str(folder), "--json", "--report", str(tmp_path / "r.html")],
                 monkeypatch) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["conditions"]["real"]["accuracy"] == 1.0
    assert result["conditions"]["none"]["accuracy"] == 0.0
    assert (tmp_path / "r.html").read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    out_csv = tmp_path / "responses.csv"
    assert _main(["study", "export", str(folder), "--out", str(out_csv)], monkeypatch) == 0
    capsys.readouterr()
    assert _main(["study", "export", str(folder), "--out", str(out_csv)], monkeypatch) == 2
    assert "already exists" in capsys.readouterr().err
    assert _main(["study", "simulate", str(folder), "--accuracy", "real=high"], monkeypatch) == 2
    assert "`--accuracy` must be COND=P pairs" in capsys.readouterr().err


@pytest.mark.slow
def test_no_panel_in_the_core_package():
    code = ("import sys, explorer.studies as s\n"
            "for name in s.__all__: getattr(s, name)\n"
            "bad = [m for m in ('panel', 'holoviews', 'bokeh') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT, timeout=120)


def test_deepcopy_of_items_is_not_shared(tmp_path, tiny_model):
    """Placebo explanations are copies: editing one never changes the real one."""
    study = load_study(write_study(tmp_path, study_dict()))
    items = build_items(study, tiny_model)
    before = copy.deepcopy(items)
    items[0]["explanations"]["fake"]["tokens"][0][0] = "changed"
    def reals(xs):
        return [it["explanations"]["real"] for it in xs if not it["attention_check"]]
    assert reals(items) == reals(before)


@pytest.mark.slow
@pytest.mark.integration
def test_example_study_items_on_smollm2(tmp_path, smollm2):
    """The worked example on the packaged model: the correct choice is the model's top-1 from
    a plain forward, and the lens hides the last layers as the study file says."""
    run = StudyRun.prepare(EXAMPLE, tmp_path / "run", model=smollm2)
    try:
        task_items = [it for it in run.items.values() if not it["attention_check"]]
        assert len(task_items) == 12
        for item in task_items:
            ids = torch.tensor([smollm2.tokenizer(item["prompt"], add_special_tokens=False)["input_ids"]])
            top = int(smollm2.hf(ids).logits[0, -1].argmax())
            assert item["choices"][item["answer"]] == smollm2.tokenizer.decode([top])
            assert item["explanations"]["lens"]["layers"] == [20, 22, 24, 25, 26, 27]
            assert item["explanations"]["none"] is None
        assert "last layer" not in study_report(run)   # the final layer is not shown
    finally:
        run.close()
