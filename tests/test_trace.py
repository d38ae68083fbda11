"""Tests for explorer.trace: every site on every architecture family against plain torch hooks.

The reference for each prompt is a plain Hugging Face forward of that prompt alone (no
padding, eager attention) with ``output_hidden_states``/``output_attentions`` and torch
hooks on the output projection, the MLP and the final norm. `trace` runs the prompts as
one left-padded batch, so agreement also checks the padding bookkeeping.
"""
from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from explorer._checks import InputError
from explorer.models import SITES, TINY_MODELS, load_model
from explorer.trace import trace
from tests._hooks import eager_attention, removed_after

# lengths 17, 2 and 7 tokens: different enough to pad, and longer than Gemma 2's window of 8
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins",
    "One two",
    "Water boils at one hundred degrees",
]
ATOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def hf_reference(model, prompt: str) -> dict[str, torch.Tensor]:
    """Plain HF forward of one unpadded prompt, with torch hooks on o_proj, MLP, final norm."""
    ids = torch.tensor([model.tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    captured: dict[str, list] = {"o_in": [], "o_out": [], "mlp": [], "norm": []}
    handles = []
    for layer in range(model.n_layers):
        o_proj = model.o_proj(layer)
        handles.append(o_proj.register_forward_pre_hook(
            lambda mod, args: captured["o_in"].append(args[0][0].clone())))
        handles.append(o_proj.register_forward_hook(
            lambda mod, args, out: captured["o_out"].append(out[0].clone())))
        handles.append(model.hf_layer(layer).mlp.register_forward_hook(
            lambda mod, args, out: captured["mlp"].append(out[0].clone())))
    handles.append(model.final_norm_module.register_forward_hook(
        lambda mod, args, out: captured["norm"].append(out[0].clone())))
    with removed_after(handles), eager_attention(model):
        out = model.hf(input_ids=ids, output_hidden_states=True, output_attentions=True)
    return {
        "ids": ids[0],
        "hidden": [h[0] for h in out.hidden_states],            # L+1 x [pos, d_model]
        "attentions": [a[0] for a in out.attentions],           # L x [head, dst, src]
        "o_in": captured["o_in"],                                # L x [pos, head*d_head]
        "o_out": captured["o_out"],                              # L x [pos, d_model]
        "mlp": captured["mlp"],                                  # L x [pos, d_model]
        "final_norm": captured["norm"][0],                       # [pos, d_model]
        "logits": out.logits[0],                                 # [pos, vocab]
    }


@pytest.fixture(scope="module", params=TINY_MODELS)
def family_run(request):
    """One family: the model, a trace of every site over PROMPTS, and per-prompt references."""
    model = load_model(request.param)
    ds = trace(model, PROMPTS, sites=SITES)
    refs = [hf_reference(model, p) for p in PROMPTS]
    return model, ds, refs


def real(ds_var, i: int, n: int) -> torch.Tensor:
    """The first n (real) positions of prompt i as a tensor."""
    return torch.from_numpy(np.asarray(ds_var.isel(prompt=i, pos=slice(0, n)).values))


def assert_close(actual, expected, atol=ATOL, rtol=1e-4):
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def each_prompt(refs: list[dict]) -> Iterator[tuple[int, dict, int]]:
    """Every prompt: its index, its reference and its number of real tokens."""
    for i, ref in enumerate(refs):
        yield i, ref, len(ref["ids"])


def each_prompt_and_layer(model, refs: list[dict]) -> Iterator[tuple[int, dict, int, int]]:
    """Every prompt at every layer: its index, its reference, its number of real tokens and
    the layer."""
    for i, ref, n in each_prompt(refs):
        for layer in range(model.n_layers):
            yield i, ref, n, layer


def assert_site_is_reference(family_run, site: str, key: str) -> None:
    """The real positions of ``site`` equal the reference's ``key`` at every layer of every
    prompt."""
    model, ds, refs = family_run
    for i, ref, n, layer in each_prompt_and_layer(model, refs):
        assert_close(real(ds[site].sel(layer=layer), i, n), ref[key][layer])


# -- every site against plain torch ----------------------------------------------------------

def test_resid_post_matches_hidden_states(family_run):
    model, ds, refs = family_run
    L = model.n_layers
    for i, ref, n, layer in each_prompt_and_layer(model, refs):
        resid = real(ds.resid_post.sel(layer=layer), i, n)
        if layer < L - 1:
            assert_close(resid, ref["hidden"][layer + 1])
        else:  # HF applies the final norm to its last hidden state
            assert_close(model.final_norm_module(resid), ref["hidden"][L])


def test_resid_pre_matches_hidden_states(family_run):
    assert_site_is_reference(family_run, "resid_pre", "hidden")


def test_head_out_sums_to_o_proj_output(family_run):
    model, ds, refs = family_run
    for i, ref, n, layer in each_prompt_and_layer(model, refs):
        summed = real(ds.head_out.sel(layer=layer), i, n).sum(dim=1)  # [pos, d_model]
        bias = model.b_O(layer)
        if bias is not None:
            summed = summed + bias
        assert_close(summed, ref["o_out"][layer])


def test_attn_z_is_o_proj_input_by_head(family_run):
    model, ds, refs = family_run
    H, D = model.spec.n_heads, model.spec.d_head
    for i, ref, n, layer in each_prompt_and_layer(model, refs):
        z = real(ds.attn_z.sel(layer=layer), i, n)           # [pos, head, d_head]
        assert z.shape == (n, H, D)
        assert_close(z, ref["o_in"][layer].reshape(n, H, D))


def test_attn_pattern_matches_eager_attentions(family_run):
    model, ds, refs = family_run
    for i, ref, n, layer in each_prompt_and_layer(model, refs):
        pat = torch.from_numpy(ds.attn_pattern.isel(prompt=i).sel(layer=layer).values)
        assert_close(pat[:, :n, :n], ref["attentions"][layer])
        # rows sum to 1 over the real source tokens; nothing is attributed to padding
        torch.testing.assert_close(pat[:, :n, :n].sum(-1), torch.ones(pat.shape[0], n))
        assert torch.isnan(pat[:, n:, :]).all() and torch.isnan(pat[:, :, n:]).all()


def test_mlp_out_matches_mlp_hook(family_run):
    assert_site_is_reference(family_run, "mlp_out", "mlp")


def test_final_norm_and_unembed_match_hf(family_run):
    model, ds, refs = family_run
    for i, ref, n in each_prompt(refs):
        assert_close(real(ds.final_norm, i, n), ref["final_norm"])
        assert_close(real(ds.unembed, i, n), ref["logits"], atol=1e-4)


def test_padding_is_nan_and_mask_marks_real_tokens(family_run):
    model, ds, refs = family_run
    lengths = [len(r["ids"]) for r in refs]
    assert ds.sizes["pos"] == max(lengths)
    expected_mask = np.arange(max(lengths))[None, :] < np.array(lengths)[:, None]
    np.testing.assert_array_equal(ds["mask"].values, expected_mask)
    for i, ref, n in each_prompt(refs):
        np.testing.assert_array_equal(ds.token_id.values[i, :n], ref["ids"].numpy())
        assert list(ds.token.values[i, :n]) == [model.tokenizer.decode([t]) for t in ref["ids"]]
        assert (ds.token_id.values[i, n:] == -1).all()
        for site in ("resid_pre", "resid_post", "attn_z", "head_out", "mlp_out", "final_norm",
                     "unembed"):
            values = ds[site].isel(prompt=i).values
            assert np.isnan(values[n:]).all(), site
            assert not np.isnan(values[:n]).any(), site


def test_batch_gives_each_prompt_alone(family_run):
    model, ds, refs = family_run
    sites = ("resid_post", "attn_z", "attn_pattern", "mlp_out", "unembed")
    for i, prompt in enumerate(PROMPTS):
        alone = trace(model, [prompt], sites=sites)
        n = alone.sizes["pos"]
        for site in sites:
            batched = ds[site].isel(prompt=i).values
            single = alone[site].isel(prompt=0).values
            if site == "attn_pattern":
                batched = batched[..., :n, :n]
            else:
                batched = batched[:n]
            np.testing.assert_allclose(batched, single, atol=ATOL, rtol=1e-4, err_msg=site)


# -- options ---------------------------------------------------------------------------------

def test_positions_layers_and_batch_size_select_the_same_values(tiny_model):
    full = trace(tiny_model, PROMPTS, sites=["resid_post", "head_out"])
    part = trace(tiny_model, PROMPTS, sites=["resid_post", "head_out"], layers=[2, 0],
                 positions=[0, -1], batch_size=1)
    assert list(part.layer.values) == [0, 2]
    assert list(part.pos.values) == [0, -1]
    for i, prompt in enumerate(PROMPTS):
        ids = tiny_model.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        n = len(ids)
        for j, q in enumerate((0, n - 1)):
            assert part.token_id.values[i, j] == ids[q]
            for site in ("resid_post", "head_out"):
                np.testing.assert_allclose(part[site].values[i, j],
                                           full[site].sel(layer=[0, 2]).values[i, q],
                                           atol=ATOL, rtol=1e-4)
    assert part["mask"].values.all()


def test_attn_pattern_at_positions_keeps_every_source(tiny_model):
    full = trace(tiny_model, PROMPTS, sites=["attn_pattern"], layers=[1])
    part = trace(tiny_model, PROMPTS, sites=["attn_pattern"], layers=[1], positions=[0, -1])
    assert list(part.dst_pos.values) == [0, -1]
    assert part.sizes["src_pos"] == full.sizes["src_pos"] == 17
    for i, n in enumerate(full["mask"].values.sum(1)):
        for j, q in enumerate((0, n - 1)):
            np.testing.assert_allclose(part.attn_pattern.values[i, :, :, j],
                                       full.attn_pattern.values[i, :, :, q], atol=ATOL)
        # the last token's row sums to 1 over its prompt's real tokens
        np.testing.assert_allclose(part.attn_pattern.values[i, 0, :, 1, :n].sum(-1), 1.0,
                                   atol=1e-6)


def test_single_string_prompt_and_progress_callback(tiny_model):
    calls = []
    ds = trace(tiny_model, "One two", sites="resid_post", progress=lambda done, total:
               calls.append((done, total)))
    assert ds.sizes["prompt"] == 1 and calls == [(1, 1)]
    calls.clear()
    trace(tiny_model, PROMPTS, sites="resid_post", batch_size=2,
          progress=lambda done, total: calls.append((done, total)))
    assert calls == [(2, 3), (3, 3)]


def test_attrs_are_json_and_name_the_run(tiny_model):
    ds = trace(tiny_model, PROMPTS[:2], sites=["resid_post"], layers=[1])
    attrs = json.loads(json.dumps(ds.attrs))
    assert attrs["model"] == "tiny-llama"
    assert attrs["method"] == "trace"
    assert attrs["params"]["prompts"] == PROMPTS[:2]
    assert attrs["params"]["layers"] == [1]
    assert attrs["edits"] == []


def test_trace_is_importable_as_a_function_from_the_package():
    import explorer

    from explorer import trace as top_level_trace

    import importlib

    # the package attribute is the function (not the submodule it lives in), and calling it
    # reads what a plain forward computes
    assert top_level_trace is explorer.trace is importlib.import_module("explorer.trace").trace
    model = explorer.load_model("tiny-llama")
    ds = explorer.trace(model, ["the cat sat"], layers=[1])
    ref = hf_reference(model, "the cat sat")
    assert_close(real(ds.resid_post.sel(layer=1), 0, len(ref["ids"])), ref["hidden"][2])


# -- bad input -------------------------------------------------------------------------------

def test_unknown_site_suggests_the_close_name(tiny_model):
    with pytest.raises(InputError, match=r"`site` must be one of .*got 'resid_psot'.*"
                                         r"Did you mean 'resid_post'\?"):
        trace(tiny_model, "One two", sites=["resid_psot"])
    with pytest.raises(InputError, match="`sites` must name at least one"):
        trace(tiny_model, "One two", sites=[])


def test_layer_out_of_range_names_the_range(tiny_model):
    with pytest.raises(InputError, match=r"`layer` must be an int in \[0, 2\]; got 3\."):
        trace(tiny_model, "One two", layers=[0, 3])
    with pytest.raises(InputError, match=r"`layer` must be an int in \[0, 2\]; got -1\."):
        trace(tiny_model, "One two", layers=-1)
    with pytest.raises(TypeError, match="`layer` must be an int; got float"):
        trace(tiny_model, "One two", layers=[1.5])


def test_empty_prompts_are_rejected(tiny_model):
    with pytest.raises(InputError, match="`prompts` must hold at least one prompt"):
        trace(tiny_model, [], sites="resid_post")
    with pytest.raises(InputError, match=r"`prompts\[1\]` is empty"):
        trace(tiny_model, ["One two", "  "], sites="resid_post")


def test_prompt_over_context_length_is_rejected(tiny_model):
    long_prompt = " fox" * 300  # 300 tokens; the tiny models take 256
    with pytest.raises(InputError, match=r"`prompts\[1\]` is 300 tokens; tiny-llama takes at "
                                         r"most 256"):
        trace(tiny_model, ["One two", long_prompt], sites="resid_post")


def test_out_of_range_position_is_rejected(tiny_model):
    # "One two" has 2 tokens: positions -2..1
    with pytest.raises(InputError, match=r"position 2 is out of range for prompt 1 with 2 "
                                         r"tokens \(allowed: -2 to 1\)"):
        trace(tiny_model, PROMPTS[:2], positions=[2])
    with pytest.raises(InputError, match=r"position -3 is out of range"):
        trace(tiny_model, PROMPTS[:2], positions=[-3])


def test_bad_positions_and_layers_are_rejected(tiny_model):
    with pytest.raises(InputError, match=r"`positions` is empty; pass None"):
        trace(tiny_model, PROMPTS, positions=[])
    with pytest.raises(TypeError, match=r"`positions\[1\]` must be an int; got float"):
        trace(tiny_model, PROMPTS, positions=[0, 1.0])
    with pytest.raises(InputError, match=r"`layers` is empty; pass None for every layer"):
        trace(tiny_model, PROMPTS, layers=[])
    one = trace(tiny_model, PROMPTS, positions=-1, layers=1)
    assert list(one.pos.values) == [-1] and list(one.layer.values) == [1]


def test_bad_batch_size_is_rejected(tiny_model):
    with pytest.raises(InputError, match=r"`batch_size` must be an int in \[1, inf\]; got 0"):
        trace(tiny_model, "One two", batch_size=0)


# -- the packaged SmolLM2 -------------------------------------------------------------------

@pytest.mark.integration
def test_smollm2_residuals_match_hidden_states(smollm2):
    prompts = ["The capital of France is", "One two three"]
    layers = [0, 14, 29]
    ds = trace(smollm2, prompts, sites=["resid_pre", "resid_post"], layers=layers)
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([smollm2.tokenizer(prompt, add_special_tokens=False)["input_ids"]])
        hidden = smollm2.hf(input_ids=ids, output_hidden_states=True).hidden_states
        n = ids.shape[1]
        for layer in layers:
            assert_close(real(ds.resid_pre.sel(layer=layer), i, n), hidden[layer][0], atol=1e-4)
            post = real(ds.resid_post.sel(layer=layer), i, n)
            if layer == smollm2.n_layers - 1:
                post = smollm2.final_norm_module(post)
            assert_close(post, hidden[layer + 1][0], atol=1e-4)


def test_last_position_logits_equal_the_full_forward(tiny_model):
    """save_positions=[-1] unembeds the last position only; it equals HF's last real logits."""
    from explorer import Steer
    from explorer.trace import run_batch

    prompts = ["one two three four five", "a b", "the cat sat"]   # different lengths: padding
    batch = tiny_model.tokenize(prompts)
    out = run_batch(tiny_model, batch, save={(1, "resid_post")}, save_positions=[-1])
    assert out["logits"].shape == (3, 1, tiny_model.vocab_size)
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([tiny_model.tokenizer(prompt, add_special_tokens=False)["input_ids"]])
        hf = tiny_model.hf(input_ids=ids, output_hidden_states=True)
        torch.testing.assert_close(out["logits"][i, 0], hf.logits[0, -1], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(out[(1, "resid_post")][i, 0], hf.hidden_states[2][0, -1],
                                   rtol=1e-4, atol=1e-5)
    steer = [Steer(layer=0, vector=np.ones(tiny_model.spec.d_model), alpha=2.0)]
    edited = run_batch(tiny_model, batch, edits=steer, save_positions=[-1])["logits"]
    full = run_batch(tiny_model, batch, edits=steer)["logits"]
    torch.testing.assert_close(edited[:, 0], full[:, -1], rtol=1e-4, atol=1e-5)


# -- direct logit attribution inside the trace ----------------------------------------------

def _hand_dla(model, prompt: str, token_ids: list[int]) -> dict[str, torch.Tensor]:
    """The last position's logit split by hand: plain torch hooks, the final norm linearised
    by its formula (RMSNorm: gain / rms; LayerNorm: centred, gain / std), float64."""
    ids = torch.tensor([model.tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    got: dict[str, list] = {"z": [], "mlp": [], "x0": [], "x": []}
    hooks = [model.hf_layer(0).register_forward_pre_hook(
        lambda mod, args, kwargs: got["x0"].append(
            (args[0] if args else kwargs["hidden_states"])[0, -1].double()), with_kwargs=True),
        model.final_norm_module.register_forward_pre_hook(
            lambda mod, args: got["x"].append(args[0][0, -1].double()))]
    for layer in range(model.n_layers):
        hooks.append(model.o_proj(layer).register_forward_pre_hook(
            lambda mod, args: got["z"].append(args[0][0, -1].double())))
        hooks.append(model.hf_layer(layer).mlp.register_forward_hook(
            lambda mod, args, out: got["mlp"].append(out[0, -1].double())))
    with removed_after(hooks), torch.no_grad():
        logits = model.hf(input_ids=ids).logits[0, -1].double()
    fn = model.final_norm_module
    centred = isinstance(fn, torch.nn.LayerNorm)
    x = got["x"][0]
    if centred:
        eps, gain = fn.eps, fn.weight.double()
        x = x - x.mean()
    else:
        eps = getattr(fn, "variance_epsilon", getattr(fn, "eps", 1e-6))
        gain = fn.weight.double() + (1.0 if "Gemma" in type(fn).__name__ else 0.0)
    r = model.unembed_module.weight.detach().double()[token_ids] * gain / torch.sqrt(
        x.pow(2).mean() + eps)                                     # [t, d_model]

    def read(c):
        return r @ (c - c.mean() if centred else c)

    n_heads, d_head = model.spec.n_heads, model.spec.d_head
    heads = []
    for layer in range(model.n_layers):
        w = model.o_proj(layer).weight.detach().double()
        w = w if model.arch.o_proj_transposed else w.T                # [head*d_head, d_model]
        z = got["z"][layer].reshape(n_heads, d_head)
        heads.append(torch.stack([read(z[h] @ w[h * d_head:(h + 1) * d_head])
                                  for h in range(n_heads)]))          # [head, t]
    bias = []
    for layer in range(model.n_layers):
        b = model.b_O(layer)
        bias.append(read(b.detach().double()) if b is not None
                    else torch.zeros(len(token_ids), dtype=torch.float64))
    norm_bias = torch.zeros(len(token_ids), dtype=torch.float64)
    if centred and fn.bias is not None:
        norm_bias = model.unembed_module.weight.detach().double()[token_ids] @ fn.bias.double()
    if getattr(model.unembed_module, "bias", None) is not None:
        norm_bias = norm_bias + model.unembed_module.bias.detach().double()[token_ids]
    return {"embed": read(got["x0"][0]), "head": torch.stack(heads),
            "attn_bias": torch.stack(bias), "mlp": torch.stack([read(m) for m in got["mlp"]]),
            "norm_bias": norm_bias, "logits": logits[token_ids]}


@pytest.mark.parametrize("name", TINY_MODELS)
def test_direct_logit_attribution_matches_a_hand_split(name):
    """run_batch(dla_ids=...) equals the split computed by hand, per prompt of a padded batch;
    where the residual stream is a plain sum (all but Gemma 2's post-norms), the parts add up
    to the model's own logit."""
    from explorer.trace import run_batch

    model = load_model(name)
    batch = model.tokenize(PROMPTS)
    ids = torch.tensor([[5, 17, 40], [3, 3, 99], [60, 1, 2]])
    out = run_batch(model, batch, save_positions=[-1], dla_ids=ids)
    parts = ("embed", "head", "attn_bias", "mlp", "norm_bias")
    for i, prompt in enumerate(PROMPTS):
        hand = _hand_dla(model, prompt, ids[i].tolist())
        got = {p: out[("dla", p)][i, 0] for p in parts}                # drop the pos dim
        for p in parts:
            torch.testing.assert_close(got[p], hand[p], atol=2e-5, rtol=1e-4,
                                       msg=lambda m, p=p: f"{name} {p}: {m}")
        if name != "tiny-gemma2":
            total = (got["embed"] + got["head"].sum((0, 1)) + got["attn_bias"].sum(0)
                     + got["mlp"].sum(0) + got["norm_bias"])
            torch.testing.assert_close(total, hand["logits"], atol=1e-4, rtol=1e-4)


def test_dla_ids_must_match_the_batch(tiny_model):
    from explorer.trace import run_batch

    batch = tiny_model.tokenize(PROMPTS[:2])
    with pytest.raises(InputError, match="dla_ids"):
        run_batch(tiny_model, batch, dla_ids=torch.zeros(3, 1, dtype=torch.long))
    with pytest.raises(InputError, match="token ids"):
        run_batch(tiny_model, batch, dla_ids=torch.full((2, 1), tiny_model.vocab_size))


def test_in_trace_lens_cosine_ranks_and_points_match_hidden_states(tiny_model):
    """run_batch's in-trace reductions for remote runs (cosines of consecutive layers,
    ranks of only the top `lens_ranked` output tokens, residuals gathered at points)
    against a plain forward's hidden states and a full-vocabulary count."""
    from explorer.trace import run_batch

    m = tiny_model
    batch = m.tokenize(PROMPTS)
    L = m.n_layers
    rows, cols = torch.tensor([0, 2, 1]), torch.tensor([batch.width - 1, batch.width - 3,
                                                        batch.width - 2])
    got = run_batch(m, batch, save={(layer, "resid_post") for layer in range(L)},
                    logits=False, lens_k=4, lens_layers=range(L), lens_ranked=2,
                    lens_cosine=True, save_points=(rows, cols))
    with eager_attention(m):
        hs = m.hf(**batch.model_inputs(), output_hidden_states=True).hidden_states
    # hidden_states[l + 1] is resid_post[l] except the last, which HF returns normed
    for layer in range(L - 1):
        assert got[(layer, "resid_post")].shape == (3, m.spec.d_model)
        np.testing.assert_allclose(got[(layer, "resid_post")].numpy(),
                                   hs[layer + 1][rows, cols].numpy(), atol=ATOL)
    real = batch.attention_mask.bool()
    for layer in range(1, L - 1):
        expect = torch.nn.functional.cosine_similarity(hs[layer + 1], hs[layer], dim=-1)
        np.testing.assert_allclose(got[("lens_cos", layer)][real].numpy(),
                                   expect[real].numpy(), atol=1e-5)
    out = m.hf(**batch.model_inputs()).logits.float()                 # [prompt, pos, vocab]
    final = out.topk(4, dim=-1).indices
    lens = m.lens_logits(hs[2]).float()                              # layer 1's lens
    ids, _, rank, _ = got[("lens", 1)]
    assert rank.shape[-1] == 2
    target = lens.gather(-1, final[..., :2])
    expect_rank = (lens.unsqueeze(-2) > target.unsqueeze(-1)).sum(-1)  # [prompt, pos, 2]
    assert torch.equal(rank[real], expect_rank[real])
    assert torch.equal(ids[real], lens.topk(4, dim=-1).indices[real])


def test_bad_in_trace_lens_options_are_clear_errors(tiny_model):
    from explorer.trace import run_batch

    batch = tiny_model.tokenize(PROMPTS[:2])
    with pytest.raises(InputError, match=r"`lens_ranked` must be an int in \[1, 3\]; got 4"):
        run_batch(tiny_model, batch, lens_k=3, lens_layers=[0], lens_ranked=4)
    with pytest.raises(InputError, match="`lens_cosine` needs every lens layer's predecessor"):
        run_batch(tiny_model, batch, lens_k=3, lens_layers=[2], lens_cosine=True)
    with pytest.raises(InputError, match="cannot both be given"):
        run_batch(tiny_model, batch, save_positions=[-1],
                  save_points=(torch.tensor([0]), torch.tensor([0])))
    with pytest.raises(InputError, match=r"must lie in \[0, 2\) x \[0, "):
        run_batch(tiny_model, batch, save={(0, "resid_post")},
                  save_points=(torch.tensor([2]), torch.tensor([0])))
    with pytest.raises(InputError, match="two 1-d tensors"):
        run_batch(tiny_model, batch, save_points=(torch.tensor([0, 1]), torch.tensor([0])))


def test_readouts_record_equals_the_keywords_and_plain_hidden_states(tiny_model):
    """A `TraceRequest` record and the same fields as keywords run the same trace; both agree
    with a plain forward's hidden states and logits at the kept positions."""
    from explorer.trace import TraceRequest, run_batch

    m = tiny_model
    batch = m.tokenize(PROMPTS)
    record = TraceRequest(save={(1, "resid_post")}, save_positions=[-2, -1], lens_k=3,
                      lens_layers=[0, 1])
    by_record = run_batch(m, batch, readouts=record)
    by_keywords = run_batch(m, batch, save={(1, "resid_post")}, save_positions=[-2, -1],
                            lens_k=3, lens_layers=[0, 1])
    assert by_record.keys() == by_keywords.keys()
    for key in by_record:
        a, b = by_record[key], by_keywords[key]
        for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            assert torch.equal(x, y), key
    with eager_attention(m):
        hf = m.hf(**batch.model_inputs(), output_hidden_states=True)
    cols = [batch.width - 2, batch.width - 1]
    np.testing.assert_allclose(by_record[(1, "resid_post")].numpy(),
                               hf.hidden_states[2][:, cols].numpy(), atol=ATOL)
    np.testing.assert_allclose(by_record["logits"].numpy(), hf.logits[:, cols].numpy(),
                               atol=1e-4)


def test_readouts_given_twice_or_unknown_are_errors(tiny_model):
    from explorer.trace import TraceRequest, run_batch

    batch = tiny_model.tokenize(PROMPTS[:2])
    with pytest.raises(TypeError, match=r"not both; got `readouts` and \['lens_k'\]"):
        run_batch(tiny_model, batch, readouts=TraceRequest(), lens_k=3)
    with pytest.raises(TypeError, match="save_sites"):
        run_batch(tiny_model, batch, save_sites={(0, "resid_post")})


def test_trace_module_functions_fit_on_one_screen():
    """Every function in explorer/trace.py has at most 80 lines and 8 parameters."""
    import ast
    import sys
    from pathlib import Path

    tree = ast.parse(Path(sys.modules["explorer.trace"].__file__).read_text())
    too_big = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            n_params = (len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
                        + (a.vararg is not None) + (a.kwarg is not None))
            n_lines = node.end_lineno - node.lineno + 1
            if n_lines > 80 or n_params > 8:
                too_big.append((node.name, n_lines, n_params))
    assert too_big == []


def test_token_id_lists_and_batches_read_like_text(family_run):
    """`trace` and `run_with` take token id lists or a `Batch` as well as text: the same
    values as the text's hooked reference, the same token coords, and no prompt texts."""
    from explorer.trace import run_with

    model, _, refs = family_run
    ids = [r["ids"].tolist() for r in refs]
    by_ids = trace(model, ids, sites=("resid_post", "unembed"), batch_size=2, progress=False)
    for i, ref, n in each_prompt(refs):
        assert_close(real(by_ids.unembed, i, n), ref["logits"], atol=1e-4)
        assert_close(real(by_ids.resid_post.sel(layer=0), i, n), ref["hidden"][1])
        np.testing.assert_array_equal(by_ids.token_id.values[i, :n], ref["ids"].numpy())
    assert by_ids.attrs["params"]["prompts"] is None
    batch = model.batch_from_ids(ids)
    last = run_with(model, batch, positions=[-1])
    np.testing.assert_allclose(last.logits.values[:, 0],
                               np.stack([r["logits"][-1].numpy() for r in refs]), atol=1e-4)
    with pytest.raises(InputError, match="no tokens"):
        trace(model, [ids[0], []])
    with pytest.raises(InputError, match="token id outside"):
        run_with(model, [[0, model.vocab_size]])
    with pytest.raises(TypeError, match="token id list"):
        trace(model, [ids[0], "text"])


def test_logit_attribution_is_the_hand_split_as_a_dataset(family_run):
    """`logit_attribution`: each term equals the split computed by hand with hooks, the
    targets' logits are the plain forward's at each prompt's last token, and where the
    residual stream is a plain sum (all but Gemma 2's post-norms) the terms add up to them."""
    from explorer.trace import logit_attribution

    model, _, refs = family_run
    targets = np.array([[3, 17], [5, 5], [0, 40]])
    got = logit_attribution(model, PROMPTS, targets)
    assert got.heads.dims == ("prompt", "pos", "layer", "head", "target")
    total = (got.embed + got.heads.sum(("layer", "head")) + got.attn_bias.sum("layer")
             + got.mlp.sum("layer") + got.norm_bias)
    for i, (prompt, ref) in enumerate(zip(PROMPTS, refs)):
        hand = _hand_dla(model, prompt, targets[i].tolist())
        for var, part in (("embed", "embed"), ("heads", "head"), ("attn_bias", "attn_bias"),
                          ("mlp", "mlp"), ("norm_bias", "norm_bias")):
            np.testing.assert_allclose(got[var].values[i, 0], hand[part].numpy(), atol=2e-5,
                                       rtol=1e-4, err_msg=var)
        want = ref["logits"][-1].double().numpy()[targets[i]]
        np.testing.assert_allclose(got.logit.values[i, 0], want, atol=1e-4)
        if model.spec.family != "gemma2":
            np.testing.assert_allclose(total.values[i, 0], want, atol=1e-3)
    np.testing.assert_array_equal(got.target_id.values, targets)
    with pytest.raises(InputError, match="target_ids"):
        logit_attribution(model, PROMPTS, targets[:2])


# -- runs over a key/value prefix: the last token only ---------------------------------------

def _hooked_last_token(model, prompt: str, layer: int, head: int, z: np.ndarray,
                       steer: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """One unpadded prompt's full forward with plain torch hooks: head ``head`` of ``layer``
    writes ``z`` at the last position, and ``steer`` is added to the last layer's output
    there. (last logits [vocab], layer-1 resid_post at the last position [d_model])."""
    ids = torch.tensor([model.tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    dh = model.spec.d_head

    def set_head(_m, args):
        x = args[0].clone()
        x[0, -1, head * dh:(head + 1) * dh] = torch.as_tensor(z, dtype=x.dtype)
        return (x, *args[1:])

    def add(_m, _args, out):
        h = (out[0] if isinstance(out, tuple) else out).clone()
        h[0, -1] += torch.as_tensor(steer, dtype=h.dtype)
        return (h, *out[1:]) if isinstance(out, tuple) else h

    last = model.hf_layer(model.n_layers - 1)
    handles = [model.o_proj(layer).register_forward_pre_hook(set_head),
               last.register_forward_hook(add)]
    with removed_after(handles), torch.no_grad():
        out = model.hf(input_ids=ids, output_hidden_states=True)
    return out.logits[0, -1], out.hidden_states[2][0, -1]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2", "tiny-neox", "tiny-qwen2"])
def test_run_over_a_key_value_prefix_equals_a_hooked_full_forward(name):
    """`run_batch(prefix=...)` runs only the last column of a left-padded batch over the
    cached keys and values, with edits at the last token in per-copy rows; its logits and
    readouts equal each prompt's own full forward with the same edits as torch hooks, and
    the prefix's cache is the same after the runs."""
    from explorer import Ablate, Steer
    from explorer.trace import TraceRequest, key_value_prefix, run_batch

    m = load_model(name)
    prompts = PROMPTS[1:] + ["The capital of France is the city of"]
    batch = m.tokenize(prompts)
    n, L = len(prompts), m.n_layers
    prefix = key_value_prefix(m, batch)
    keys = [layer.keys.clone() for layer in prefix.cache.layers]
    rng = np.random.default_rng(3)
    heads = [(1, 2), (0, 1)]                                  # copy j ablates heads[j]
    zs = rng.normal(size=(len(heads), m.spec.d_head))
    steer = rng.normal(size=m.spec.d_model)
    big = prefix.repeat(len(heads))
    edits = [Ablate(layer, head, mode="mean", value=zs[j], positions=(-1,),
                    prompts=tuple(range(j * n, (j + 1) * n)))
             for j, (layer, head) in enumerate(heads)]
    edits.append(Steer(L - 1, steer, positions=(-1,)))
    out = run_batch(m, big.batch, edits=edits, prefix=big,
                    readouts=TraceRequest(save={(1, "resid_post")}, save_positions=[-1]))
    assert out["logits"].shape == (len(heads) * n, 1, m.vocab_size)
    for j, (layer, head) in enumerate(heads):
        for i, prompt in enumerate(prompts):
            logits, resid = _hooked_last_token(m, prompt, layer, head, zs[j], steer)
            torch.testing.assert_close(out["logits"][j * n + i, 0], logits, rtol=1e-4,
                                       atol=1e-5)
            torch.testing.assert_close(out[(1, "resid_post")][j * n + i, 0], resid,
                                       rtol=1e-4, atol=1e-5)
    assert all(torch.equal(a, b.keys) for a, b in zip(keys, prefix.cache.layers))
    plain = run_batch(m, batch, prefix=prefix)["logits"][:, 0]
    full = run_batch(m, batch, save_positions=[-1])["logits"][:, 0]
    torch.testing.assert_close(plain, full, rtol=1e-4, atol=1e-5)


def test_run_over_a_key_value_prefix_refuses_what_it_cannot_compute(tiny_model):
    """Edits or readouts before the last token, another batch's prefix, a prefix with a
    resumed run, and a one-token batch are clear errors."""
    from explorer import Ablate, Scale, Steer
    from explorer.trace import clean_run, key_value_prefix, run_batch

    batch = tiny_model.tokenize(["one two three", "a b"])
    prefix = key_value_prefix(tiny_model, batch)
    vec = np.ones(tiny_model.spec.d_model)
    for edit in (Steer(0, vec), Steer(0, vec, positions=(0,)), Scale(0, 1, 2.0),
                 Ablate(0, 1, positions=(-2,))):
        with pytest.raises(InputError, match=r"computes only the last token, so every edit "
                                             r"must act at positions=\(-1,\)"):
            run_batch(tiny_model, batch, edits=[edit], prefix=prefix)
    with pytest.raises(InputError, match=r"read it with save_positions=\[-1\]"):
        run_batch(tiny_model, batch, prefix=prefix, save_positions=[0])
    with pytest.raises(InputError, match="computed for different prompts"):
        run_batch(tiny_model, tiny_model.tokenize(["one two four", "a b"]), prefix=prefix)
    with pytest.raises(InputError, match="give `resume` or `prefix`, not both"):
        run_batch(tiny_model, batch, prefix=prefix, resume=clean_run(tiny_model, batch),
                  edits=[Ablate(0, 1, positions=(-1,))])
    with pytest.raises(InputError, match="at least 2 tokens"):
        key_value_prefix(tiny_model, [[5], [7]])


# -- gradients in the trace ------------------------------------------------------------------

@pytest.mark.parametrize("name", TINY_MODELS)
def test_gradient_readouts_equal_torch_autograd(name):
    """``grad`` / ``grad_ids`` readouts: the gradient of the summed answer probabilities at
    the last position with respect to attn_z, mlp_out and resid_post of every layer, in a
    run with a steering edit, equal torch.autograd on each prompt's own hooked forward (the
    steering added by a hook, the values kept by hooks); the weights get no gradient."""
    from explorer import Steer
    from explorer.trace import TraceRequest, run_batch

    m = load_model(name)
    prompts = PROMPTS[1:]
    batch = m.tokenize(prompts)
    L = m.n_layers
    target = torch.tensor([3, 11])
    steer = np.random.default_rng(5).normal(size=m.spec.d_model)
    sites = {(x, s) for x in range(L) for s in ("attn_z", "mlp_out", "resid_post")}
    out = run_batch(m, batch, edits=[Steer(0, steer, positions=(0,))],
                    readouts=TraceRequest(logits=False, grad=sites, grad_ids=target))
    assert all(p.grad is None for p in m.hf.parameters())
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([m.tokenizer(prompt, add_special_tokens=False)["input_ids"]])
        n = ids.shape[1]
        got: dict[tuple[int, str], torch.Tensor] = {}

        def keep(key, pre=False):
            def hook(_m, args, out=None):
                value = args[0] if pre else (out[0] if isinstance(out, tuple) else out)
                got[key] = value
            return hook

        def steer_first(_m, _args, out):
            h = (out[0] if isinstance(out, tuple) else out).clone()
            h[0, 0] += torch.as_tensor(steer, dtype=h.dtype)
            got[(0, "resid_post")] = h
            return (h, *out[1:]) if isinstance(out, tuple) else h

        def track(_m, _args, out):
            return out.detach().requires_grad_(True).clone()

        handles = [m.hf.get_input_embeddings().register_forward_hook(track)]
        if m.arch.family == "gpt2":   # resid_pre 0 is wte + wpe: track the position part too
            handles.append(m.hf.transformer.wpe.register_forward_hook(track))
        for x in range(L):
            handles.append(m.o_proj(x).register_forward_pre_hook(
                lambda mod, args, k=(x, "attn_z"): keep(k, pre=True)(mod, args)))
            handles.append(m.hf_layer(x).mlp.register_forward_hook(keep((x, "mlp_out"))))
            handles.append(m.hf_layer(x).register_forward_hook(
                steer_first if x == 0 else keep((x, "resid_post"))))
        with removed_after(handles), torch.enable_grad():
            logits = m.hf(input_ids=ids).logits[0, -1].float()
            p = torch.softmax(logits, -1)[target[i]]
            keys = sorted(got)
            grads = dict(zip(keys, torch.autograd.grad(p, [got[k] for k in keys],
                                                       allow_unused=True)))
        assert set(keys) == sites
        for key in keys:
            ref = torch.zeros_like(got[key][0]) if grads[key] is None else grads[key][0]
            mine = out[("grad", *key)][i, batch.width - n:]
            torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-7, msg=str(key))
            assert float(out[("grad", *key)][i, :batch.width - n].abs().sum()) == 0.0
        assert float(grads[(0, "mlp_out")][0].abs().max()) > 0


def test_gradient_readouts_refuse_what_they_cannot_compute(tiny_model):
    """Gradients need both sites and token ids, one id per prompt inside the vocabulary,
    and known sites."""
    from explorer.trace import run_batch

    batch = tiny_model.tokenize(["one two three", "a b"])
    ids = torch.tensor([1, 2])
    with pytest.raises(InputError, match="need both `grad`"):
        run_batch(tiny_model, batch, grad={(0, "mlp_out")})
    with pytest.raises(InputError, match="need both `grad`"):
        run_batch(tiny_model, batch, grad_ids=ids)
    with pytest.raises(InputError, match="one token id per prompt"):
        run_batch(tiny_model, batch, grad={(0, "mlp_out")}, grad_ids=torch.tensor([1]))
    top = tiny_model.vocab_size - 1
    with pytest.raises(InputError, match=rf"`grad_ids` must be token ids in \[0, {top}\]; got 1000000\."):
        run_batch(tiny_model, batch, grad={(0, "mlp_out")}, grad_ids=torch.tensor([1, 10**6]))
    with pytest.raises(InputError, match="gradient site"):
        run_batch(tiny_model, batch, grad={(0, "attn_pattern")}, grad_ids=ids)
    with pytest.raises(InputError, match="layer"):
        run_batch(tiny_model, batch, grad={(9, "mlp_out")}, grad_ids=ids)


def _sliding_window_model(kind: str):
    """A random-init Mistral (window 4 on every layer) or Qwen2 (window 4 above layer 0)
    over the tiny tokenizer; tiny-gemma2 alternates a window of 8 with full layers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from explorer.models import _tiny_tokenizer, wrap_model

    if kind == "gemma2":
        return load_model("tiny-gemma2")
    extra = {"mistral": dict(sliding_window=4),
             "qwen2": dict(sliding_window=4, use_sliding_window=True, max_window_layers=1)}[kind]
    config = AutoConfig.for_model(kind, num_hidden_layers=3, num_attention_heads=4,
                                  num_key_value_heads=2, hidden_size=64, intermediate_size=128,
                                  max_position_embeddings=256, vocab_size=512, bos_token_id=0,
                                  eos_token_id=0, pad_token_id=0, **extra)
    torch.manual_seed(0)
    return wrap_model(AutoModelForCausalLM.from_config(config), _tiny_tokenizer(),
                      name=f"tiny-{kind}-window", weights="random-init seed=0")


@pytest.mark.parametrize("kind", ["gemma2", "mistral", "qwen2"])
def test_run_over_a_key_value_prefix_with_sliding_windows(kind):
    """Sliding attention windows narrower than the prompts: the prefix keeps the model's own
    sliding-window cache layers (truncated to the window), and a run over them equals the
    full forward's last-token logits and a hooked full forward's edited ones."""
    from explorer import Ablate
    from explorer.trace import key_value_prefix, run_batch

    m = _sliding_window_model(kind)
    window = m.hf.config.sliding_window
    batch = m.tokenize(PROMPTS)
    assert batch.width > 2 * window
    prefix = key_value_prefix(m, batch)
    sliding = [layer for layer in prefix.cache.layers if layer.keys.shape[-2] == window - 1]
    assert len(sliding) == {"gemma2": 2, "mistral": 3, "qwen2": 2}[kind]
    full = run_batch(m, batch, save_positions=[-1])["logits"][:, 0]
    big = prefix.repeat(2)
    plain = run_batch(m, big.batch, prefix=big)["logits"][:, 0]
    torch.testing.assert_close(plain, full.repeat(2, 1), rtol=1e-4, atol=1e-5)
    z = np.random.default_rng(1).normal(size=m.spec.d_head)
    edited = run_batch(m, batch, prefix=prefix,
                       edits=[Ablate(2, 1, mode="mean", value=z, positions=(-1,))])["logits"]
    for i, prompt in enumerate(PROMPTS):
        ids = torch.tensor([m.tokenizer(prompt, add_special_tokens=False)["input_ids"]])
        dh = m.spec.d_head

        def set_head(_m, args):
            x = args[0].clone()
            x[0, -1, dh:2 * dh] = torch.as_tensor(z, dtype=x.dtype)
            return (x, *args[1:])

        with removed_after([m.o_proj(2).register_forward_pre_hook(set_head)]), torch.no_grad():
            ref = m.hf(input_ids=ids).logits[0, -1]
        torch.testing.assert_close(edited[i, 0], ref, rtol=1e-4, atol=1e-5)


def test_token_probability_readout_equals_the_softmax_of_hf_logits(tiny_model):
    """``prob_ids``: each prompt's token probability at its last position, computed in the
    trace (with an edit), equals the softmax of each prompt's own hooked HF forward; bad
    ids are clear errors."""
    from explorer import Steer
    from explorer.trace import run_batch

    prompts = ["one two three four five", "a b", "the cat sat"]
    batch = tiny_model.tokenize(prompts)
    ids = torch.tensor([7, 100, 3])
    vec = np.linspace(-2, 2, tiny_model.spec.d_model)
    out = run_batch(tiny_model, batch, edits=[Steer(1, vec, positions=(-1,))], logits=False,
                    prob_ids=ids)
    assert set(out) == {"prob"} and out["prob"].shape == (3,)

    def steer(_m, _args, o):
        h = (o[0] if isinstance(o, tuple) else o).clone()
        h[0, -1] += torch.as_tensor(vec, dtype=h.dtype)
        return (h, *o[1:]) if isinstance(o, tuple) else h

    for i, prompt in enumerate(prompts):
        x = torch.tensor([tiny_model.tokenizer(prompt, add_special_tokens=False)["input_ids"]])
        with removed_after([tiny_model.hf_layer(1).register_forward_hook(steer)]), \
                torch.no_grad():
            p = torch.softmax(tiny_model.hf(input_ids=x).logits[0, -1].float(), -1)[ids[i]]
        torch.testing.assert_close(out["prob"][i], p, rtol=1e-4, atol=1e-7)
    with pytest.raises(InputError, match="`prob_ids` must hold one token id per prompt"):
        run_batch(tiny_model, batch, prob_ids=torch.tensor([1, 2]))
    with pytest.raises(InputError, match="`prob_ids` must be token ids"):
        run_batch(tiny_model, batch, prob_ids=torch.tensor([1, 2, -1]))


def test_grad_record_reads_the_trace_gradients_as_labelled_arrays(tiny_model):
    """`read` with a `Grad` record: ``grad_<site>`` over (prompt, pos, layer, ...) equals the
    trace's gradient tensors unpadded (NaN past a prompt's end), batches split or not; the
    record round-trips through JSON; bad records are clear errors."""
    from explorer import Grad, Save, read
    from explorer.readouts import readouts_from_json, readouts_to_json
    from explorer.trace import TraceRequest, run_batch

    prompts = ["one two three four five", "a b", "the cat sat"]
    ids = [5, 9, 2]
    record = Grad(("attn_z", "mlp_out"), ids, layers=[0, 2])
    assert readouts_from_json(readouts_to_json([record])) == [record]
    ds = read(tiny_model, prompts, [record, Save("mlp_out", layers=[0, 2])], batch_size=2)
    assert ds.grad_attn_z.dims == ("prompt", "pos", "layer", "head", "d_head")
    assert list(ds.layer.values) == [0, 2]
    batch = tiny_model.tokenize(prompts)
    sites = {(x, s) for x in (0, 2) for s in ("attn_z", "mlp_out")}
    ref = run_batch(tiny_model, batch, readouts=TraceRequest(logits=False, grad=sites,
                                                        grad_ids=torch.tensor(ids)))
    H, dh = tiny_model.spec.n_heads, tiny_model.spec.d_head
    for i, n in enumerate(batch.lengths):
        for j, layer in enumerate((0, 2)):
            z = ref[("grad", layer, "attn_z")][i, batch.width - n:].reshape(n, H, dh)
            np.testing.assert_allclose(ds.grad_attn_z.values[i, :n, j], z.numpy(), rtol=1e-5,
                                       atol=1e-9)
            np.testing.assert_allclose(ds.grad_mlp_out.values[i, :n, j],
                                       ref[("grad", layer, "mlp_out")][i, batch.width - n:],
                                       rtol=1e-5, atol=1e-9)
        assert np.isnan(ds.grad_mlp_out.values[i, n:]).all()
    assert float(np.abs(ds.grad_mlp_out.values[~np.isnan(ds.grad_mlp_out.values)]).max()) > 0
    with pytest.raises(InputError, match="one token per prompt"):
        read(tiny_model, prompts, [Grad("mlp_out", [1, 2])])
    with pytest.raises(InputError, match="one run computes one `Grad`"):
        read(tiny_model, prompts, [Grad("mlp_out", ids), Grad("attn_z", ids)])
    with pytest.raises(InputError, match="`site` must be one of"):
        Grad("attn_pattern", ids)
    with pytest.raises(InputError, match=r"`Grad.token_ids` must be token ids in .*; got 1000000\."):
        read(tiny_model, prompts, [Grad("mlp_out", [1, 2, 10**6])])


# -- positions a person means: negative positions per prompt on a padded batch ---------------

def test_negative_positions_are_each_prompts_own_tokens(tiny_model):
    ds = trace(tiny_model, PROMPTS, sites=["resid_post", "resid_pre"])
    refs = [hf_reference(tiny_model, p) for p in PROMPTS]
    layer = 1
    # the padded batch ends in padding for the shorter prompts: the raw last column is NaN
    assert np.isnan(ds.resid_post.sel(layer=layer).isel(prompt=1, pos=-1).values).all()
    for i, ref in enumerate(refs):
        n = len(ref["ids"])
        alone = ref["hidden"][layer + 1]                                   # [pos, d_model]
        got = ds.resid_post.sel(layer=layer).explorer.isel(prompt=i, pos=-1)
        assert_close(torch.from_numpy(got.values), alone[-1])
        assert int(got.pos) == n - 1 and int(got.token_id) == int(ref["ids"][-1])
        two = ds.resid_pre.sel(layer=layer).explorer.isel(prompt=i, pos=[0, -2])
        assert two.pos.values.tolist() == [0, -2]
        assert_close(torch.from_numpy(two.values), ref["hidden"][layer][[0, n - 2]])
    last = ds.explorer.last                                 # every prompt at once, a Dataset
    assert last.resid_post.dims == ("prompt", "layer", "d_model")
    assert last.pos.values.tolist() == [len(r["ids"]) - 1 for r in refs]
    for i, ref in enumerate(refs):
        assert_close(torch.from_numpy(last.resid_post.sel(layer=0).values[i]), ref["hidden"][1][-1])
    assert ds.explorer.lengths.values.tolist() == [len(r["ids"]) for r in refs]


def test_positions_accessor_on_kept_positions_and_errors(tiny_model):
    kept = trace(tiny_model, PROMPTS, positions=[0, -1])
    whole = trace(tiny_model, PROMPTS)
    np.testing.assert_array_equal(kept.resid_post.explorer.isel(pos=-1).values,
                                  whole.resid_post.explorer.last.values)
    with pytest.raises(InputError, match=r"position 3 was not kept by this run; it kept "
                                         r"positions \[0, -1\]"):
        kept.explorer.isel(pos=3)
    with pytest.raises(InputError, match=r"position -3 is out of range for prompt 1 with 2 "
                                         r"tokens \(allowed: -2 to 1\)"):
        whole.resid_post.explorer.isel(pos=-3)


@pytest.mark.slow
def test_readme_quickstart_runs_as_written(smollm2, monkeypatch, tmp_path):
    """The README's first Python block, as written, on SmolLM2 (a padded batch of two
    prompts): the per-prompt last token is a number where the batch's last column is
    padding, and generation returns the tokens it chose."""
    import re
    from pathlib import Path

    import explorer

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```python\n(import explorer\n.*?)```", readme, re.S).group(1)
    monkeypatch.setattr(explorer, "load_model", lambda *a, **k: smollm2)   # loaded once
    script = tmp_path / "readme_quickstart.py"   # a file: nnsight reads a trace's source
    script.write_text(block, encoding="utf-8")
    scope: dict = {}
    exec(compile(block, str(script), "exec"), scope)  # noqa: S102 - the project's own README
    ds, gen = scope["ds"], scope["gen"]
    assert np.isnan(ds.resid_post.sel(layer=10).isel(prompt=1, pos=-1).values).all()
    last = ds.resid_post.sel(layer=10).explorer.isel(prompt=1, pos=-1)
    assert np.isfinite(last.values).all() and str(last.token.values) == " is"
    assert len(gen.token_ids) >= 1 and gen.full_text.startswith("The capital of France is")
