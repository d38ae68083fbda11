"""Tests for explorer.analyses.feature_dashboards against independent computations: the
corpus activations from Hugging Face's own hidden states, encoded by hand (matching pursuit
written out in torch for ITDA, the TopK ReLU formula for the SAE); top-activating contexts
equal to a brute-force argsort of those; the histogram to numpy's; the logit effects to
W_U @ decoder_row; the steering edit to a forward hook adding the direction."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from explorer._checks import InputError
from explorer.analyses import feature_dashboards as F
from explorer.trace import run_with
from tests._hooks import removed_after

TEXTS = ["The quick brown fox jumps over the lazy dog.",
         "One two three four five six seven eight nine ten.",
         "Water boils at one hundred degrees; the fox sleeps.",
         "She counted the apples, then the pears, then the fox."]
LAYER = 1

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["itda", "sae"])
def index(request, tiny_model):
    return F.feature_index(tiny_model, TEXTS, kind=request.param, layer=LAYER, tau=0.3, l0=4,
                           n_latents=48, k=4, max_epochs=3)


def _hidden(model, text):
    """resid_post of LAYER for ``text`` alone, [pos, d_model], from HF's hidden states."""
    ids = model.tokenize([text]).input_ids
    return model.hf(input_ids=ids, output_hidden_states=True).hidden_states[LAYER + 1][0]


def _encode_by_hand(index, x):
    """Dense activations [n, feature]: matching pursuit over the atoms (ITDA), or
    relu(topk((x - b_dec) W_enc^T + b_enc)) (SAE)."""
    x = torch.as_tensor(np.asarray(x), dtype=torch.float64)
    dec = torch.as_tensor(index.decoder.values, dtype=torch.float64)
    if index.attrs["kind"] == "itda":
        out = torch.zeros(x.shape[0], dec.shape[0], dtype=torch.float64)
        r = x.clone()
        for _ in range(int(index.attrs["settings"]["l0"])):
            dots = r @ dec.T                                        # [n, atoms]
            j = dots.abs().argmax(1)
            c = dots.gather(1, j[:, None])[:, 0]
            out[torch.arange(x.shape[0]), j] += c
            r = r - c[:, None] * dec[j]
        return out.numpy()
    w_enc = torch.as_tensor(index.W_enc.values, dtype=torch.float64)
    pre = (x - torch.as_tensor(index.b_dec.values, dtype=torch.float64)) @ w_enc.T \
        + torch.as_tensor(index.b_enc.values, dtype=torch.float64)
    top = pre.topk(int(index.attrs["settings"]["k"]), dim=1)
    return torch.zeros_like(pre).scatter(1, top.indices, torch.relu(top.values)).numpy()


def _corpus_by_hand(model, index):
    """(dense activations [token, feature] of every token from position 1, their (text,
    position) labels, the token strings per text)."""
    rows, labels, strings = [], [], []
    for i, text in enumerate(TEXTS):
        h = _hidden(model, text).detach()
        strings.append(model.tokenize([text]).tokens[0])
        rows.append(_encode_by_hand(index, h[1:]))
        labels += [(i, p) for p in range(1, h.shape[0])]
    return np.concatenate(rows), labels, strings


def test_top_contexts_histogram_and_search_equal_brute_force(tiny_model, index):
    dense, labels, strings = _corpus_by_hand(tiny_model, index)
    assert dense.shape == (int(index.token_encoded.sum()), index.sizes["feature"])
    busiest = int(np.argmax((dense != 0).sum(0)))
    for f in {0, busiest, index.sizes["feature"] - 1}:
        col = dense[:, f]
        nz = np.nonzero(np.abs(col) > 1e-7)[0]
        order = nz[np.argsort(-col[nz], kind="stable")][:5]
        top = F.top_activating_contexts(index, f, k=5, before=3, after=1)
        np.testing.assert_allclose(top.activation.values, col[order], rtol=1e-3, atol=1e-5)
        got = list(zip(top.token_prompt.values.tolist(), top.token_pos.values.tolist()))
        assert got == [labels[i] for i in order]
        for r, (t, p) in enumerate(got):
            window = [strings[t][q] if 0 <= q < len(strings[t]) else ""
                      for q in range(p - 3, p + 2)]
            assert top.context_token.values[r].tolist() == window
            assert top.context_token.sel(offset=0).values[r] == strings[t][p]
        hist = F.feature_histogram(index, f, bins=5)
        counts, edges = np.histogram(col[nz], bins=5)
        assert hist.token_count.values.tolist() == counts.tolist()
        np.testing.assert_allclose(hist.left.values, edges[:-1], rtol=1e-4, atol=1e-6)
        assert hist.attrs["n_active"] == nz.size
    # search: "fox" is fired on by the features largest on a ' fox' token; promoted by the
    # features whose decoder is most aligned with W_U[' fox']
    found = F.search_features(tiny_model, index, "fox", k=3)
    fox_rows = [i for i, (t, p) in enumerate(labels) if strings[t][p].strip() == "fox"]
    best = dense[fox_rows].max(0)
    best[(dense[fox_rows] == 0).all(0)] = -np.inf
    want = [f for f in np.argsort(-best, kind="stable")[:3] if np.isfinite(best[f])]
    assert found.feature.sel(how="fires on").values[:len(want)].tolist() == want
    ids = sorted({t[0] for t in (tiny_model.tokenizer(s, add_special_tokens=False)["input_ids"]
                                 for s in ("fox", " fox")) if len(t) == 1})
    w_u = tiny_model.unembed_module.weight.detach().double()[ids]
    effect = (torch.as_tensor(index.decoder.values, dtype=torch.float64) @ w_u.T).max(1).values
    assert found.feature.sel(how="promotes").values.tolist() == effect.topk(3).indices.tolist()


def test_prompt_activations_and_logit_effects_by_hand(tiny_model, index):
    prompt = "The lazy fox counted seven apples"
    ds = F.feature_on_prompt(tiny_model, index, prompt, [0, 2])
    want = _encode_by_hand(index, _hidden(tiny_model, prompt).detach())[:, [0, 2]].T
    np.testing.assert_allclose(ds.activation.values, want, rtol=1e-3, atol=1e-5)
    assert ds.token.values.tolist() == tiny_model.tokenize([prompt]).tokens[0]
    f = 3
    eff = F.feature_logit_effects(tiny_model, index, f, k=4)
    by_hand = tiny_model.unembed_module.weight.detach().double() @ torch.as_tensor(
        index.decoder.values[f], dtype=torch.float64)                      # W_U @ d
    assert eff.promoted_id.values.tolist() == by_hand.topk(4).indices.tolist()
    np.testing.assert_allclose(eff.promoted_logit.values, by_hand.topk(4).values.numpy(),
                               rtol=1e-5)
    assert eff.suppressed_id.values.tolist() == (-by_hand).topk(4).indices.tolist()
    assert eff.promoted_token.values.tolist() == tiny_model.token_strings(
        by_hand.topk(4).indices.tolist())


def test_steering_edit_adds_the_decoder_direction(tiny_model, index):
    f = 1
    edit = F.feature_steering_edit(index, f, alpha=3.0)
    d = torch.as_tensor(index.decoder.values[f], dtype=torch.float32)
    assert edit.layer == LAYER and edit.alpha == 3.0
    np.testing.assert_allclose(np.array(edit.vector), d.numpy(), rtol=1e-6)
    text = TEXTS[0]
    layer = tiny_model.hf_layer(LAYER)

    def add(mod, args, out):
        return (out[0] + 3.0 * d,) + tuple(out[1:]) if isinstance(out, tuple) else out + 3.0 * d

    ids = tiny_model.tokenize([text]).input_ids
    with removed_after([layer.register_forward_hook(add)]):
        want = tiny_model.hf(input_ids=ids).logits[0].detach().numpy()
    got = run_with(tiny_model, [text], [edit]).logits.values[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    default = F.feature_steering_edit(index, f)
    assert default.alpha == pytest.approx(float(index.max_activation.values[f]))


def test_errors_name_the_bad_value(tiny_model, index):
    with pytest.raises(InputError, match=r"`feature` must be an int in \[0, "):
        F.top_activating_contexts(index, index.sizes["feature"])
    with pytest.raises(InputError, match="`query` must be a token's text"):
        F.search_features(tiny_model, index, "  ")
    with pytest.raises(InputError, match="`kind` must be one of"):
        F.feature_index(tiny_model, TEXTS, kind="pca", layer=0)


@pytest.mark.slow
def test_command_shows_a_feature_and_finds_features(tmp_path, monkeypatch, capsys, tiny_model):
    from tests._cli import OneCommand

    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path / "cache"))
    run = OneCommand("features", monkeypatch, capsys)
    argv = ["features", "--model", "tiny-llama", "--layer", "1", "--corpus-tokens", "96"]
    out = run.json([*argv, "--feature", "2", "--json"])
    assert out["cached"] is False and out["feature"] == 2
    again = run.json([*argv, "--query", "the", "--json"])
    assert again["cached"] is True                    # the same dictionary, from the store
    from explorer.store import ActivationStore
    from explorer.analyses.saturation.corpus import corpus_chunks, load_corpus

    texts = corpus_chunks(tiny_model, load_corpus(), chunk_tokens=128, max_tokens=96)
    index, cached = F.cached_feature_index(tiny_model, texts, store=ActivationStore(),
                                           kind="itda", layer=1, tau=0.3, l0=8)
    assert cached
    d = torch.as_tensor(index.decoder.values[2], dtype=torch.float64)
    by_hand = tiny_model.unembed_module.weight.detach().double() @ d
    assert out["promoted"] == tiny_model.token_strings(by_hand.topk(10).indices.tolist())
    assert out["n_active"] == int((index.entry_feature.values == 2).sum())
