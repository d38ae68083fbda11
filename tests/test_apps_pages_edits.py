"""Attention and Head atlas under the workspace's edits, against plain torch hooks on tiny-llama.

Each edit record (ablate, scale, patch, steer) is re-done by hand with forward hooks on the
Hugging Face modules (o_proj inputs sliced by head, decoder-layer inputs and outputs) and the
patterns read from Hugging Face's own eager forward with ``output_attentions``.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from apps.atlas import AtlasView, edited_induction_scores
from apps.attention import AttentionView, edits_caption, patterns, plot_grid
from explorer import Ablate, Patch, Scale, Steer
from explorer.analyses.icl_heads import induction_score_from_patterns, induction_scores

PROMPT = "The cat sat on the mat because the cat was tired"
SOURCE = "A dog ran in the park since the dog was happy"       # patched at positions 2, 3


def _edits(model):
    rng = np.random.default_rng(0)
    vector = rng.normal(size=model.spec.d_model).astype(np.float32) * 2.0
    return [Ablate(layer=0, head=1), Scale(layer=1, head=2, alpha=3.0),
            Patch(site="resid_pre", layer=1, source=SOURCE, positions=(2, 3)),
            Steer(layer=1, vector=tuple(float(v) for v in vector), alpha=1.5)]


def _ids(model, prompt):
    return torch.tensor([model.tokenizer(prompt, add_special_tokens=False)["input_ids"]])


def _eager(model, fn):
    hf = model.hf
    current = hf.config._attn_implementation
    hf.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            return fn(hf)
    finally:
        hf.set_attn_implementation(current)


def _hooked_patterns(model, ids, edits):
    """[prompt, layer, head, q, k] of Hugging Face's eager forward with the edits done by
    torch hooks: ablate / scale on the o_proj input's head slice, patch on a decoder layer's
    input (the source's, captured by a first hooked run), steer on a decoder layer's output."""
    dh = model.spec.d_head
    layers = [model.hf_layer(i) for i in range(model.spec.n_layers)]
    handles = []
    source_resid = {}
    for e in edits:
        if isinstance(e, Patch):
            def capture(mod, args, kwargs, layer=e.layer):
                x = args[0] if args else kwargs["hidden_states"]
                source_resid[layer] = x.detach().clone()
            h = layers[e.layer].register_forward_pre_hook(capture, with_kwargs=True)
            _eager(model, lambda hf: hf(input_ids=_ids(model, e.source)))
            h.remove()
    try:
        for e in edits:
            if isinstance(e, (Ablate, Scale)):
                factor = 0.0 if isinstance(e, Ablate) else e.alpha

                def head_slice(mod, args, head=e.head, factor=factor):
                    z = args[0].clone()
                    z[..., head * dh:(head + 1) * dh] *= factor
                    return (z,) + tuple(args[1:])
                handles.append(model.o_proj(e.layer).register_forward_pre_hook(head_slice))
            elif isinstance(e, Patch):
                def patch(mod, args, kwargs, layer=e.layer, pos=list(e.positions)):
                    x = (args[0] if args else kwargs["hidden_states"]).clone()
                    x[:, pos] = source_resid[layer][:, pos]
                    if args:
                        return (x,) + tuple(args[1:]), kwargs
                    return args, {**kwargs, "hidden_states": x}
                handles.append(layers[e.layer].register_forward_pre_hook(patch, with_kwargs=True))
            elif isinstance(e, Steer):
                vec = torch.tensor(e.vector) * e.alpha

                def steer(mod, args, out, vec=vec):
                    if isinstance(out, tuple):
                        return (out[0] + vec,) + tuple(out[1:])
                    return out + vec
                handles.append(layers[e.layer].register_forward_hook(steer))
        out = _eager(model, lambda hf: hf(input_ids=ids, output_attentions=True))
    finally:
        for h in handles:
            h.remove()
    return torch.stack(out.attentions, 1).double().numpy()


def test_attention_page_patterns_under_edits_equal_hooked_forward(tiny_model):
    edits = _edits(tiny_model)
    view = AttentionView(tiny_model, background=False, prompt=PROMPT)
    clean = patterns(view.result).values
    view.edits = edits
    assert view.error == ""
    got = patterns(view.result).values                                      # [layer, head, q, k]
    want = _hooked_patterns(tiny_model, _ids(tiny_model, PROMPT), edits)[0]
    np.testing.assert_allclose(got, want, atol=2e-5)
    # the edits move the later layers (the test would pass on an unedited page otherwise)
    assert np.abs(got[2] - clean[2]).max() > 1e-3
    np.testing.assert_allclose(got[0], clean[0], atol=1e-6)  # layer 0 reads no edit
    assert view.result.attrs["workspace_edits"] and "edit" in view.status
    assert plot_grid(view.result).opts.get().kwargs["title"] == "All heads · 4 edits"
    assert view.scope().edits == "applied"
    assert "`ablate L0.H1 (zero)`; then `scale L1.H2" in edits_caption(view.result)
    assert "edits=edits" in view.code_snippet()
    view.edits = []
    np.testing.assert_allclose(patterns(view.result).values, clean, atol=1e-6)
    assert plot_grid(view.result).opts.get().kwargs["title"] == "All heads"


def test_atlas_attention_statistics_under_edits_equal_hooked_forward(tiny_model):
    edits = _edits(tiny_model)
    view = AtlasView(tiny_model, background=False, prompt=PROMPT)
    clean_first = view.atlas["first_token_attention"].values.copy()
    view.edits = edits
    a = _hooked_patterns(tiny_model, _ids(tiny_model, PROMPT), edits)[0]   # [layer, head, q, k]
    n = a.shape[-1]
    first = np.mean([a[:, :, q, 0] for q in range(1, n)], axis=0)
    prev = np.mean([a[:, :, q, q - 1] for q in range(1, n)], axis=0)
    np.testing.assert_allclose(view.atlas["first_token_attention"].values, first, atol=2e-5)
    np.testing.assert_allclose(view.atlas["previous_token_attention"].values, prev, atol=2e-5)
    assert np.abs(view.atlas["first_token_attention"].values - clean_first).max() > 1e-3
    assert view.atlas["first_token_attention"].attrs["edits"]
    assert "edited model" in str(
        __import__("apps.atlas", fromlist=["plot_score"]).plot_score(
            view.atlas, "first_token_attention").opts.get().kwargs["title"])
    assert "workspace edit" in view.status and view.scope().edits.startswith("applied")


def test_atlas_induction_scores_under_edits_equal_hooked_forward(tiny_model):
    edits = _edits(tiny_model)[:2] + _edits(tiny_model)[3:]     # no patch: the sequences differ
    got = edited_induction_scores(tiny_model, edits, n_sequences=3, half_len=6)
    ids = induction_scores(tiny_model, n_sequences=3, half_len=6)["sequence_ids"].values
    pats = _hooked_patterns(tiny_model, torch.tensor(ids), edits)          # [seq, layer, head, q, k]
    want = induction_score_from_patterns(pats, ids)
    np.testing.assert_allclose(got["induction_score"].values, want, atol=2e-5)
    clean = induction_scores(tiny_model, n_sequences=3, half_len=6)["induction_score"].values
    assert np.abs(got["induction_score"].values - clean).max() > 1e-4
    view = AtlasView(tiny_model, background=False, prompt=PROMPT, edits=edits)
    view.add_induction()
    score = [n for n in view.atlas.data_vars if n.startswith("induction_score")][0]
    assert view.atlas[score].attrs.get("edits")
    view.edits = []                                      # the induction column follows the edits
    assert not view.atlas[score].attrs.get("edits")


def test_attention_page_refuses_a_long_prompt_naming_its_limit(tiny_model):
    from apps.attention import MAX_TOKENS
    view = AttentionView(tiny_model, background=False, prompt=PROMPT)
    words = ["the"]
    while len(tiny_model.tokenize(" ".join(words)).token_ids[0]) <= MAX_TOKENS:
        words.append("the")                        # just past the page's limit
    view.prompt = " ".join(words)
    n = len(tiny_model.tokenize(view.prompt).token_ids[0])
    assert view.error == f"The prompt is {n} tokens; this page draws at most {MAX_TOKENS} " \
                         "(every head's pattern grows with its square). Shorten it."
    assert view.result is not None            # the last good patterns stay


@pytest.mark.parametrize("bad", ["L0.H99"])
def test_attention_page_names_a_head_outside_the_model(tiny_model, bad):
    from apps.attention import parse_head
    from explorer._checks import InputError
    with pytest.raises(InputError, match=r"L0\.H99 is not in this model: layers 0-2, heads 0-3"):
        parse_head(bad, tiny_model.spec.n_layers, tiny_model.spec.n_heads)
