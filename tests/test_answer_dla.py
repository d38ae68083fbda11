"""Tests for explorer.analyses.answer_dla against a hand computation with plain torch hooks:
each head's output through its slice of W_O and each MLP's output, captured on ``model.hf``,
divided by the clean run's final-norm scale, times the final norm's gain and dotted with
W_U[answer] - W_U[alternative]; the edited run's writers through the same clean scale; and,
on a family with biases (GPT-2), the sum of every term equal to the logit difference."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from explorer._checks import InputError
from explorer.analyses.answer_dla import answer_logit_attribution, answer_token_id
from explorer.interventions import Ablate
from explorer.models import submodule_at
from tests._hooks import removed_after

PROMPT = "The quick brown fox jumps over the lazy"
RTOL = 1e-4

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _hand_terms(model, text, a_id, b_id, *, ablate=None, scale=None):
    """(heads [layer, head], mlp [layer], logit diff, clean-norm scale, embed, biases) at the
    last position from hooks on ``model.hf``; ``ablate`` (layer, head) zeroes that head's z
    (its o_proj input slice); ``scale`` (the clean run's) replaces the run's own."""
    hf, spec = model.hf, model.spec
    L, H, dh = spec.n_layers, spec.n_heads, spec.d_head
    z, mlp_out, final_in = {}, {}, {}
    handles = []
    for layer in range(L):
        o_proj = model.o_proj(layer)

        def pre(mod, args, layer=layer):
            x = args[0]
            if ablate is not None and ablate[0] == layer:
                x = x.clone()
                x[..., ablate[1] * dh:(ablate[1] + 1) * dh] = 0
                z[layer] = x.detach()
                return (x, *args[1:])
            z[layer] = x.detach()

        handles.append(o_proj.register_forward_pre_hook(pre))
        mlp = submodule_at(model.hf_layer(layer), model.arch.mlp_path)
        handles.append(mlp.register_forward_hook(
            lambda mod, args, out, layer=layer: mlp_out.__setitem__(layer, out.detach())))
    norm = model.final_norm_module
    handles.append(norm.register_forward_pre_hook(
        lambda mod, args: final_in.__setitem__("x", args[0].detach())))
    ids = model.tokenize([text]).input_ids
    with removed_after(handles):
        out = hf(input_ids=ids, output_hidden_states=True)
    logits = out.logits[0, -1].double()
    x = final_in["x"][0, -1].double()                                  # [d_model]
    centred = isinstance(norm, torch.nn.LayerNorm)
    xc = x - x.mean() if centred else x
    own = 1.0 / torch.sqrt(xc.pow(2).mean() + (norm.eps if centred else norm.variance_epsilon))
    s = own if scale is None else scale
    w_u = model.unembed_module.weight.double()
    direction = (w_u[a_id] - w_u[b_id]) * norm.weight.double() * s     # [d_model]

    def read(c):
        c = c.double()
        return (c - c.mean(-1, keepdim=True) if centred else c) @ direction

    heads = np.zeros((L, H))
    mlps = np.zeros(L)
    biases = 0.0
    for layer in range(L):
        w_o = model.W_O(layer).double()                                # [head, d_head, d_model]
        zl = z[layer][0, -1].double().reshape(H, dh)
        for h in range(H):
            heads[layer, h] = float(read(zl[h] @ w_o[h]))
        mlps[layer] = float(read(mlp_out[layer][0, -1]))
        b = model.b_O(layer)
        if b is not None:
            biases += float(read(b))
    embed = float(read(out.hidden_states[0][0, -1]))
    if getattr(norm, "bias", None) is not None:
        biases += float((w_u[a_id] - w_u[b_id]) @ norm.bias.double())
    return heads, mlps, float(logits[a_id] - logits[b_id]), own, embed, biases


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_clean_and_edited_terms_equal_hooks_through_the_clean_norm(name, request):
    from explorer import load_model

    model = load_model(name)
    ds = answer_logit_attribution(model, PROMPT, edits=[Ablate(layer=1, head=2)])
    logits = model.hf(input_ids=model.tokenize([PROMPT]).input_ids).logits[0, -1]
    top = logits.topk(2).indices.tolist()
    assert [ds.attrs["answer_id"], ds.attrs["alternative_id"]] == top   # defaults: top-1, top-2
    a, b = top
    heads, mlps, diff, scale, embed, _ = _hand_terms(model, PROMPT, a, b)
    clean = ds.sel(run="clean", pos=-1)
    np.testing.assert_allclose(clean.heads.values, heads, rtol=RTOL, atol=1e-7)
    np.testing.assert_allclose(clean.mlp.values, mlps, rtol=RTOL, atol=1e-7)
    np.testing.assert_allclose(float(clean.embed), embed, rtol=RTOL, atol=1e-7)
    np.testing.assert_allclose(float(clean.logit_diff), diff, rtol=RTOL, atol=1e-6)
    e_heads, e_mlps, e_diff, e_scale, _, _ = _hand_terms(model, PROMPT, a, b, ablate=(1, 2),
                                                         scale=scale)
    assert abs(float(e_scale - scale)) > 0        # the edit moves the norm: the freeze matters
    edited = ds.sel(run="edited", pos=-1)
    np.testing.assert_allclose(edited.heads.values, e_heads, rtol=RTOL, atol=1e-7)
    np.testing.assert_allclose(edited.mlp.values, e_mlps, rtol=RTOL, atol=1e-7)
    np.testing.assert_allclose(float(edited.logit_diff), e_diff, rtol=RTOL, atol=1e-6)
    assert float(edited.heads.sel(layer=1, head=2)) == 0.0
    assert str(ds.head_component.sel(layer=1, head=2).item()) == "L1.H2"
    assert str(ds.mlp_component.sel(layer=2).item()) == "L2.MLP"


def test_terms_add_up_to_the_logit_difference_with_biases():
    """GPT-2 with random biases: embedding + heads + attention-output biases + MLPs + the
    final LayerNorm's bias is the logit difference at the last position (each bias term
    computed by hand too)."""
    from explorer import load_model

    m = load_model("tiny-gpt2")                      # its own copy: the biases are changed
    gen = torch.Generator().manual_seed(0)
    for name, p in m.hf.named_parameters():
        if name.endswith("bias"):
            p.data.copy_(0.1 * torch.randn(p.shape, generator=gen))
    ids = m.tokenize([PROMPT]).input_ids
    logits = m.hf(input_ids=ids).logits[0, -1]
    a, b = logits.topk(5).indices.tolist()[2], 17
    heads, mlps, diff, _, embed, biases = _hand_terms(m, PROMPT, a, b)
    assert biases != 0.0
    np.testing.assert_allclose(heads.sum() + mlps.sum() + embed + biases, diff, rtol=RTOL)
    ds = answer_logit_attribution(m, PROMPT, answer=a, alternative=b).sel(run="clean", pos=-1)
    np.testing.assert_allclose(float(ds.attn_bias.sum() + ds.norm_bias), biases, rtol=RTOL)
    np.testing.assert_allclose(float(ds.total), diff, rtol=RTOL)


def test_answers_by_text_positions_and_errors(tiny_model):
    m = tiny_model
    tok = m.tokenize([" fox"]).token_ids[0]
    assert answer_token_id(m, " fox") == tok[0] if len(tok) == 1 else True
    ds = answer_logit_attribution(m, PROMPT, answer=5, alternative=9, positions=[-1, 2])
    assert ds.sizes["pos"] == 2 and ds.position.values.tolist()[1] == 2
    assert ds.attrs["answer_id"] == 5 and ds.attrs["alternative_id"] == 9
    # no edits: the edited run is the clean one
    np.testing.assert_array_equal(ds.heads.sel(run="edited").values,
                                  ds.heads.sel(run="clean").values)
    with pytest.raises(InputError, match="must differ from `answer`"):
        answer_logit_attribution(m, PROMPT, answer=5, alternative=5)
    with pytest.raises(InputError, match=r"`answer` must be a token id in \[0, 511\]; got 512"):
        answer_logit_attribution(m, PROMPT, answer=512)
    with pytest.raises(InputError, match="must be one token"):
        answer_token_id(m, "The quick brown fox")
    with pytest.raises(InputError, match=r"position 40 is out of range for the prompt with \d+ tokens"):
        answer_logit_attribution(m, PROMPT, positions=[40])


def test_command_prints_the_largest_components_as_hooks_give_them(tiny_model, monkeypatch,
                                                                  capsys):
    from tests._cli import OneCommand

    run = OneCommand("dla", monkeypatch, capsys)
    out = run.json(["dla", "--model", "tiny-llama", "--prompt", PROMPT, "--answer", "#5",
                    "--alt", "#9", "--top", "3", "--json"])
    heads, mlps, diff, *_ = _hand_terms(tiny_model, PROMPT, 5, 9)
    names = [f"L{la}.H{h}" for la in range(3) for h in range(4)] + [f"L{la}.MLP" for la in range(3)]
    values = np.concatenate([heads.ravel(), mlps])
    order = np.argsort(-np.abs(values))[:3]
    clean = out["positions"][0]["clean"]
    assert [c["component"] for c in clean["top"]] == [names[i] for i in order]
    np.testing.assert_allclose([c["contribution"] for c in clean["top"]], values[order],
                               rtol=RTOL)
    np.testing.assert_allclose(clean["logit_diff"], diff, rtol=RTOL)
    assert run(["dla", "--model", "tiny-llama", "--prompt", PROMPT, "--answer", "#5",
                "--alt", "#5"]) != 0
    assert "must differ" in capsys.readouterr().err
