"""ICL scores under the workspace's edits: the induction score, a head's attention and the
ablation curves of the edited model, each against plain torch hooks on the HF model (the
edit as a pre-hook zeroing the head's slice of the ``o_proj`` input at every position)."""
from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
import torch

from explorer._checks import InputError
from explorer.analyses import icl_heads as ih
from explorer.interventions import Ablate
from tests.test_icl_heads import induction_by_eager_attention

EDIT = Ablate(0, 1, mode="zero")            # the workspace's edit: L0.H1 zeroed everywhere


def _o_proj(model, layer):
    return model.hf.model.layers[layer].self_attn.o_proj


@contextlib.contextmanager
def _edited(model, last_writes=None):
    """L0.H1's output zeroed at every position (the edit), and optionally heads' last-token
    output set to values: ``last_writes`` {(layer, head): vector}."""
    d = model.spec.d_head
    writes = {}
    for (l, h), v in (last_writes or {}).items():
        writes.setdefault(l, []).append((h, torch.as_tensor(v, dtype=torch.float32)))

    def make(layer):
        def pre(_mod, args):
            x = args[0].clone()
            if layer == EDIT.layer:
                x[..., EDIT.head * d:(EDIT.head + 1) * d] = 0
            for h, v in writes.get(layer, []):
                x[:, -1, h * d:(h + 1) * d] = v
            return (x, *args[1:])
        return pre

    handles = [_o_proj(model, l).register_forward_pre_hook(make(l))
               for l in {EDIT.layer, *writes}]
    try:
        yield
    finally:
        for hd in handles:
            hd.remove()


def _ids(model, prompt):
    return torch.tensor([model.tokenizer(prompt, add_special_tokens=False)["input_ids"]])


def test_induction_score_and_attention_under_an_edit(tiny_model):
    m = tiny_model
    ds = ih.induction_scores(m, n_sequences=2, half_len=6, seed=1, edits=[EDIT], measure="mul")
    plain = ih.induction_scores(m, n_sequences=2, half_len=6, seed=1, measure="mul")
    ids = ds.sequence_ids.values
    np.testing.assert_allclose(ds.induction_score.values,
                               induction_by_eager_attention(m, ids, _edited), atol=1e-5)
    # the edit reaches the later layers' scores (so the test can tell it was applied)
    assert np.abs(ds.induction_score.values[1:] - plain.induction_score.values[1:]).max() > 1e-4
    np.testing.assert_allclose(ds.induction_score.values[0], plain.induction_score.values[0],
                               atol=1e-6)
    assert ds.attrs["edits"] == [EDIT.to_dict()]
    # one head's attention on the ICL prompt, edited
    got = ih.head_attention(m, 2, 0, task="antonym", n_shots=2, edits=[EDIT])["icl"]
    prompt, _ = ih.icl_prompts("antonym", n_prompts=1, n_shots=2, seed=42)
    current = m.hf.config._attn_implementation
    m.hf.set_attn_implementation("eager")
    try:
        with _edited(m):
            ref = m.hf(_ids(m, prompt[0]), output_attentions=True).attentions[2][0, 0]
    finally:
        m.hf.set_attn_implementation(current)
    np.testing.assert_allclose(got.attention.values, ref.double().numpy(), atol=1e-5)


def test_ablation_curves_under_an_edit_match_hooks(tiny_model):
    m = tiny_model
    spec = m.spec
    rng = np.random.default_rng(3)
    shape = (spec.n_layers, spec.n_heads)
    kw = dict(percents=(0, 25), rankings=["fv"], n_prompts=3, n_shots=2, loss_sequences=2,
              loss_tokens=40, seed=0, mean_source="per-task", n_boot=50)
    ds = ih.ablation_curves(m, ["antonym"], rng.random(shape), rng.random(shape),
                            edits=[EDIT], **kw)
    assert ds.attrs["params"]["ablation_method"] == "full"
    assert ds.attrs["edits"] == [EDIT.to_dict()]
    heads = [tuple(h) for h in json.loads(str(ds.ablated.sel(ranking="fv", percent=25.0).values))]
    # the per-task mean, of the edited model
    src, _ = ih.icl_prompts("antonym", n_prompts=3, n_shots=2, seed=2)
    zs = []
    for p in src:
        got = {}
        hooks = [_o_proj(m, l).register_forward_pre_hook(
            lambda mod, args, l=l: got.__setitem__(l, args[0][0, -1].clone()))
            for l in range(spec.n_layers)]
        try:
            with _edited(m):
                m.hf(_ids(m, p))
        finally:
            for h in hooks:
                h.remove()
        zs.append(torch.stack([got[l] for l in range(spec.n_layers)]).reshape(
            spec.n_layers, spec.n_heads, spec.d_head).numpy())
    mean = np.mean(zs, 0)
    prompts, answers = ih.icl_prompts("antonym", n_prompts=3, n_shots=2, seed=1)
    probs = []
    for p, a in zip(prompts, answers):
        with _edited(m, {h: mean[h] for h in heads}):
            logits = m.hf(_ids(m, p)).logits[0, -1]
        t = m.tokenizer(" " + a, add_special_tokens=False)["input_ids"][0]
        probs.append(float(torch.softmax(logits.float(), -1)[t]))
    assert float(ds.answer_prob.sel(ranking="fv", percent=25.0, task="antonym")) == \
        pytest.approx(np.mean(probs), abs=1e-5)
    base = []
    for p, a in zip(prompts, answers):
        with _edited(m):
            logits = m.hf(_ids(m, p)).logits[0, -1]
        t = m.tokenizer(" " + a, add_special_tokens=False)["input_ids"][0]
        base.append(float(torch.softmax(logits.float(), -1)[t]))
    assert float(ds.answer_prob.sel(ranking="fv", percent=0.0, task="antonym")) == \
        pytest.approx(np.mean(base), abs=1e-5)
    with pytest.raises(InputError, match="runs the unedited model"):
        ih.ablation_curves(m, ["antonym"], rng.random(shape), rng.random(shape),
                           edits=[EDIT], method="last_token", **kw)
