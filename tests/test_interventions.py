"""Tests for explorer.interventions: every edit against the same edit done with a plain torch hook.

The reference runs the Hugging Face module directly on the same left-padded batch, with a
torch hook that performs the edit by hand at padded columns computed here from the prompt
lengths; patch sources are captured from a plain forward of the source prompt alone.
"""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from explorer._checks import InputError
from explorer.interventions import (
    Ablate,
    AddHead,
    Patch,
    Scale,
    Set,
    Steer,
    edit_from_dict,
    edits_from_json,
    edits_to_json,
)
from explorer.models import TINY_MODELS, load_model
from explorer.trace import clean_run, run_with, trace

# 17, 2 and 7 tokens: a left-padded batch of different lengths
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins",
    "One two",
    "Water boils at one hundred degrees",
]
SOURCE = "Paris is the capital"  # patch source
ATOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=TINY_MODELS)
def family_model(request):
    return load_model(request.param)


# -- the plain-torch reference -------------------------------------------------------------

def columns(lengths, width, positions):
    """Per prompt, the padded columns of its positions (None = every real token)."""
    out = []
    for n in lengths:
        pos = range(n) if positions is None else positions
        out.append([width - n + (p if p >= 0 else n + p) for p in pos])
    return out


def head_slice(model, head):
    d = model.spec.d_head
    return slice(head * d, (head + 1) * d)


def hooked_logits(model, batch, hooks) -> torch.Tensor:
    """HF logits [prompt, padded_pos, vocab] of the padded batch under plain torch hooks.

    ``hooks`` is a list of (module, "pre" | "post", fn); a "pre" fn maps the module's
    first input tensor to its replacement, a "post" fn maps its output tensor.
    """
    handles = []
    for module, when, fn in hooks:
        if when == "pre":
            handles.append(module.register_forward_pre_hook(
                lambda mod, args, fn=fn: (fn(args[0].clone()), *args[1:])))
        else:
            handles.append(module.register_forward_hook(
                lambda mod, args, out, fn=fn: fn(out.clone())))
    try:
        return model.hf(**batch.model_inputs()).logits
    finally:
        for h in handles:
            h.remove()


def site_module(model, site, layer):
    """(module, "pre" | "post") whose first input or output is the site's activation."""
    return {
        "resid_pre": (model.hf_layer(layer), "pre"),
        "resid_post": (model.hf_layer(layer), "post"),
        "attn_z": (model.o_proj(layer), "pre"),
        "mlp_out": (model.hf_layer(layer).mlp, "post"),
    }[site]


def captured(model, prompt, site, layer) -> torch.Tensor:
    """The site's activation [pos, d] from a plain forward of one prompt (or its token ids)
    alone."""
    ids = torch.tensor([model.tokenizer(prompt, add_special_tokens=False)["input_ids"]
                        if isinstance(prompt, str) else list(prompt)])
    module, when = site_module(model, site, layer)
    seen = []
    if when == "pre":
        h = module.register_forward_pre_hook(lambda mod, args: seen.append(args[0][0].clone()))
    else:
        h = module.register_forward_hook(lambda mod, args, out: seen.append(out[0].clone()))
    try:
        model.hf(input_ids=ids)
    finally:
        h.remove()
    return seen[0]


def reference_hook(model, batch, edit):
    """The edit as a (module, when, fn) plain torch hook on the padded batch."""
    lengths, width = batch.lengths, batch.width
    real = batch.attention_mask.bool()  # [prompt, padded_pos]
    if isinstance(edit, (Ablate, Scale)):
        sl = head_slice(model, edit.head)

        def fn(x):  # [prompt, padded_pos, head*d_head]
            if isinstance(edit, Scale):
                x[..., sl] = x[..., sl] * edit.alpha
            elif edit.mode == "zero":
                x[..., sl] = 0.0
            elif edit.value is not None:
                x[..., sl] = torch.tensor(edit.value)
            else:
                x[..., sl] = x[..., sl][real].mean(0)  # mean over the batch's real tokens
            return x
        return (model.o_proj(edit.layer), "pre", fn)
    if isinstance(edit, Steer):
        cols = columns(lengths, width, edit.positions)
        vec = torch.tensor(edit.vector)
        rows = range(len(lengths)) if edit.prompts is None else edit.prompts

        def fn(x):  # [prompt, padded_pos, d_model]
            for i in rows:
                for c in cols[i]:
                    x[i, c] = x[i, c] + edit.alpha * vec
            return x
        module, when = site_module(model, edit.site, edit.layer)
        return (module, when, fn)
    if isinstance(edit, Patch):
        src = captured(model, edit.source, edit.site, edit.layer)  # [n_src, d]
        n_src = src.shape[0]
        cols = columns(lengths, width, edit.positions)
        src_pos = [range(n) if edit.positions is None else
                   [p if p >= 0 else n_src + p for p in edit.positions] for n in lengths]
        sl = slice(None) if edit.head is None else head_slice(model, edit.head)

        def fn(x):
            for i, (cs, qs) in enumerate(zip(cols, src_pos)):
                for c, q in zip(cs, qs):
                    x[i, c, sl] = src[q, sl]
            return x
        module, when = site_module(model, edit.site, edit.layer)
        return (module, when, fn)
    if isinstance(edit, Set):
        cols = columns(lengths, width, edit.positions)
        rows = range(len(lengths)) if edit.prompts is None else edit.prompts
        sl = slice(None) if edit.head is None else head_slice(model, edit.head)

        def fn(x):
            vec = torch.tensor(edit.value).reshape(-1, x[..., sl].shape[-1])
            per_pair = len(vec) == sum(len(cols[i]) for i in rows)
            j = 0
            for i in rows:
                for k, c in enumerate(cols[i]):
                    v = vec[j] if per_pair else vec[k]   # one per pair, or one per position
                    x[i, c, sl] = x[i, c, sl] + v if edit.add else v
                    j += 1
            return x
        module, when = site_module(model, edit.site, edit.layer)
        return (module, when, fn)
    raise TypeError(edit)


def real_logits(model, batch, padded: torch.Tensor) -> list[np.ndarray]:
    return [padded[i, batch.width - n:].numpy() for i, n in enumerate(batch.lengths)]


def ds_logits(ds) -> list[np.ndarray]:
    lengths = ds["mask"].values.sum(1)
    return [ds.logits.values[i, :n] for i, n in enumerate(lengths)]


def assert_edit_matches_hooks(model, prompts, edits, *, min_effect=1e-3):
    """run_with(edits) equals the plain-hook reference on real tokens; the edit does something."""
    batch = model.tokenize(prompts)
    expected = real_logits(model, batch, hooked_logits(
        model, batch, [reference_hook(model, batch, e) for e in edits]))
    clean = real_logits(model, batch, hooked_logits(model, batch, []))
    got = ds_logits(run_with(model, prompts, edits))
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, atol=ATOL, rtol=1e-4)
    effect = max(np.abs(e - c).max() for e, c in zip(expected, clean))
    assert effect > min_effect, "the edit had no effect; the comparison would be vacuous"


def random_vector(n, seed=0, scale=3.0):
    return tuple((torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale).tolist())


# -- each edit equals a plain torch hook ----------------------------------------------------

def test_ablate_zero(family_model):
    assert_edit_matches_hooks(family_model, PROMPTS, [Ablate(1, 2)])


def test_ablate_mean_over_the_batch_real_tokens(family_model):
    assert_edit_matches_hooks(family_model, PROMPTS, [Ablate(0, 1, mode="mean")])


def test_ablate_with_a_given_value(family_model):
    value = random_vector(family_model.spec.d_head, seed=1)
    assert_edit_matches_hooks(family_model, PROMPTS, [Ablate(2, 3, mode="mean", value=value)])


def test_scale(family_model):
    assert_edit_matches_hooks(family_model, PROMPTS, [Scale(1, 0, alpha=4.0)])


@pytest.mark.parametrize("site", ["resid_pre", "resid_post", "mlp_out"])
def test_patch_site_at_chosen_positions(family_model, site):
    edit = Patch(site, 1, SOURCE, positions=(0, -1))
    assert_edit_matches_hooks(family_model, PROMPTS, [edit])


def test_patch_attn_z_one_head(family_model):
    edit = Patch("attn_z", 2, SOURCE, head=1, positions=(1, -2))
    assert_edit_matches_hooks(family_model, PROMPTS, [edit])


def test_patch_from_token_ids(family_model):
    # ids no text need tokenise to: the source runs as given
    ids = [(7 * i + 3) % family_model.vocab_size for i in range(6)]
    edit = Patch("resid_pre", 1, ids, positions=(0, -1))
    assert edit.source == tuple(ids)
    assert_edit_matches_hooks(family_model, PROMPTS, [edit])
    assert edits_from_json(edits_to_json([edit])) == [edit]


def test_patch_token_ids_are_checked(tiny_model):
    with pytest.raises(InputError, match=r"`source` must hold at least one token id"):
        Patch("resid_pre", 0, [])
    with pytest.raises(InputError, match=r"`source` token ids must be ints >= 0; got -1"):
        Patch("resid_pre", 0, [3, -1])
    with pytest.raises(TypeError, match=r"`source` must be a prompt \(str\) or its token ids"):
        Patch("resid_pre", 0, 5)
    big = tiny_model.vocab_size
    with pytest.raises(InputError, match=rf"`source` must be token ids in \[0, {big - 1}\]; "
                                         rf"got {big}"):
        run_with(tiny_model, PROMPTS, [Patch("resid_pre", 0, [1, big], positions=(0,))])


def test_patch_every_position_of_same_length_prompts(tiny_model):
    n_src = len(tiny_model.tokenizer(SOURCE, add_special_tokens=False)["input_ids"])
    prompts = ["One two three four five", "Water boils at one"]
    assert [len(tiny_model.tokenizer(p, add_special_tokens=False)["input_ids"])
            for p in prompts] == [n_src] * 2
    assert_edit_matches_hooks(tiny_model, prompts, [Patch("resid_post", 0, SOURCE)])


def test_steer_at_positions_including_negative(family_model):
    vec = random_vector(family_model.spec.d_model, seed=2)
    assert_edit_matches_hooks(family_model, PROMPTS, [Steer(0, vec, alpha=2.0, positions=(0, -1))])
    assert_edit_matches_hooks(family_model, PROMPTS, [Steer(1, vec, alpha=-1.5)])


def test_several_edits_together(family_model):
    d_model = family_model.spec.d_model
    edits = [
        Scale(0, 1, alpha=0.25),
        Patch("mlp_out", 0, SOURCE, positions=(-1,)),
        Ablate(1, 0, mode="mean"),          # its mean is taken after the layer-0 edits
        Steer(1, random_vector(d_model, seed=3), alpha=1.0, positions=(-2,)),
        Ablate(2, 2),
    ]
    assert_edit_matches_hooks(family_model, PROMPTS, edits)


def test_edits_inside_trace_change_the_read_sites(tiny_model):
    vec = torch.tensor(random_vector(64, seed=4))
    clean = trace(tiny_model, PROMPTS, sites=["resid_post"], layers=[0])
    steered = trace(tiny_model, PROMPTS, sites=["resid_post"], layers=[0],
                    edits=[Steer(0, vec, alpha=0.5, positions=(-1,))])
    diff = (steered.resid_post - clean.resid_post).isel(layer=0).values  # [prompt, pos, d_model]
    for i, n in enumerate(clean["mask"].values.sum(1)):
        np.testing.assert_allclose(diff[i, n - 1], 0.5 * vec.numpy(), atol=1e-5)
        np.testing.assert_array_equal(diff[i, :n - 1], 0.0)
    assert [e["kind"] for e in steered.attrs["edits"]] == ["steer"]


def test_mean_ablation_in_batches_averages_over_every_prompt(tiny_model):
    """trace in batches of one gives what one batch of all prompts gives (and run_with)."""
    edits = [Ablate(2, 0, mode="mean"), Scale(0, 1, alpha=3.0), Ablate(1, 1, mode="mean")]
    whole = trace(tiny_model, PROMPTS, sites=["unembed"], edits=edits, batch_size=8)
    split = trace(tiny_model, PROMPTS, sites=["unembed"], edits=edits, batch_size=1)
    np.testing.assert_allclose(split.unembed.values, whole.unembed.values, atol=ATOL, rtol=1e-4)
    np.testing.assert_allclose(whole.unembed.values, run_with(tiny_model, PROMPTS, edits).logits,
                               atol=ATOL, rtol=1e-4)
    assert split.attrs["edits"] == [e.to_dict() for e in edits]  # as given, not resolved


def test_a_single_edit_need_not_be_in_a_list(tiny_model):
    edit = Scale(1, 0, alpha=4.0)
    np.testing.assert_array_equal(run_with(tiny_model, PROMPTS, edit).logits.values,
                                  run_with(tiny_model, PROMPTS, [edit]).logits.values)


@pytest.mark.parametrize("case", ["resid_post per pair", "attn_z head per position, added",
                                  "mlp_out of one prompt", "resid_pre added per position"])
def test_set_writes_or_adds_given_values_like_a_hook(family_model, case):
    m = family_model
    d, dh = m.spec.d_model, m.spec.d_head
    lengths = m.tokenize(PROMPTS).lengths
    edit = {
        "resid_post per pair": lambda: Set("resid_post", 1, random_vector(3 * 2 * d, 1),
                                           positions=(0, -1)),
        "attn_z head per position, added": lambda: Set("attn_z", 0, random_vector(2 * dh, 2),
                                                       head=1, add=True, positions=(0, -1)),
        "mlp_out of one prompt": lambda: Set("mlp_out", 2, random_vector(lengths[2] * d, 3),
                                             prompts=(2,)),
        "resid_pre added per position": lambda: Set("resid_pre", 0, random_vector(2 * d, 4),
                                                    add=True, positions=(0, 1)),
    }[case]()
    assert_edit_matches_hooks(m, PROMPTS, [edit])


def test_noise_at_resid_pre_of_layer_0_is_noise_on_the_embeddings(family_model):
    """What causal tracing relies on: adding ``noise`` at resid_pre of layer 0 equals adding
    it to the token embedding module's output (GPT-2 adds its position embedding to both;
    Gemma's scale by sqrt(d_model) is inside that module)."""
    m = family_model
    noise = torch.tensor(random_vector(2 * m.spec.d_model, 6)).reshape(2, -1)
    batch = m.tokenize(PROMPTS)
    cols = columns(batch.lengths, batch.width, (0, 1))

    def add(_mod, _args, out):
        out = out.clone()
        for i, cs in enumerate(cols):
            out[i, cs] += noise
        return out
    handle = m.hf.get_input_embeddings().register_forward_hook(add)
    try:
        expected = real_logits(m, batch, m.hf(**batch.model_inputs()).logits)
    finally:
        handle.remove()
    got = ds_logits(run_with(m, PROMPTS, [Set("resid_pre", 0, noise, add=True,
                                              positions=(0, 1))]))
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, atol=1e-4, rtol=1e-4)


def test_set_with_values_that_do_not_fit_is_a_clear_error(tiny_model):
    d = tiny_model.spec.d_model
    with pytest.raises(InputError, match="holds 5 vectors; the run selects 6"):
        run_with(tiny_model, PROMPTS, [Set("resid_post", 0, (0.0,) * (5 * d), positions=(0, 1))])
    with pytest.raises(InputError, match="per pair or per position"):
        run_with(tiny_model, PROMPTS, [Set("resid_post", 0, (0.0,) * (2 * d))])
    with pytest.raises(InputError, match=f"whole number of {d}-wide vectors"):
        run_with(tiny_model, PROMPTS, [Set("mlp_out", 0, (0.0,) * 7)])
    with pytest.raises(InputError, match="`head` applies to the head sites attn_q, attn_k, attn_v, attn_z only"):
        Set("mlp_out", 0, (0.0,) * d, head=1)
    with pytest.raises(InputError, match="finite"):
        Set("resid_post", 0, (float("nan"),) * d)


# -- serialisation --------------------------------------------------------------------------

ALL_EDITS = [
    Ablate(0, 1),
    Ablate(1, 2, mode="mean"),
    Ablate(2, 3, mode="mean", value=(0.5,) * 16),
    Scale(1, 0, alpha=-2.5),
    Patch("resid_pre", 0, "The cat"),
    Patch("attn_z", 2, "A dog", head=3, positions=(0, -1)),
    Patch("mlp_out", 1, "One two", positions=[1]),
    Patch("resid_post", 2, "Paris"),
    Steer(1, torch.randn(64, generator=torch.Generator().manual_seed(5)), alpha=0.3),
    Steer(2, np.linspace(-1, 1, 64, dtype=np.float32), positions=[-1, 0]),
    Set("resid_post", 1, (0.25,) * 128, positions=(0, -1), prompts=(1,)),
    Set("attn_z", 0, (1.5,) * 16, head=2, add=True),
]


@pytest.mark.parametrize("edit", ALL_EDITS, ids=lambda e: e.kind)
def test_json_round_trip_of_every_record(edit):
    text = edits_to_json([edit])
    assert edits_from_json(text) == [edit]
    assert edit_from_dict(json.loads(text)[0]) == edit


def test_json_round_trip_of_a_list():
    assert edits_from_json(edits_to_json(ALL_EDITS)) == ALL_EDITS
    assert edits_from_json(edits_to_json([])) == []


def test_site_is_named_site_on_every_record():
    assert Patch(site="mlp_out", layer=1, source="x").site == "mlp_out"
    assert Set(site="resid_pre", layer=0, value=(1.0,)).site == "resid_pre"
    with pytest.raises(InputError, match=r"use site='resid_pre', not patch_site="):
        Patch(patch_site="resid_pre", layer=1, source="x")
    with pytest.raises(InputError, match=r"use site='mlp_out', not set_site="):
        Set(set_site="mlp_out", layer=1, value=(1.0,))


@pytest.mark.parametrize("site", ["resid_pre", "mlp_out", "resid_post"])
def test_steer_at_each_site_adds_the_vector_there(tiny_model, site):
    d = tiny_model.spec.d_model
    vec = random_vector(d, 7)
    edit = Steer(1, vec, alpha=2.5, positions=(0, -1), prompts=(0, 2), site=site)
    assert edit.edit_site == site and edit_from_dict(edit.to_dict()) == edit
    assert_edit_matches_hooks(tiny_model, PROMPTS, [edit])


def test_steer_site_defaults_to_resid_post_and_names_the_allowed_sites():
    assert Steer(0, (1.0,)).site == "resid_post"
    assert edit_from_dict({"kind": "steer", "layer": 0, "vector": [1.0]}).site == "resid_post"
    with pytest.raises(InputError, match=r"`site` must be one of 'resid_pre', 'mlp_out', "
                                         r"'resid_post'; got 'attn_z'"):
        Steer(0, (1.0,), site="attn_z")


def test_saved_edits_with_older_site_keys_still_read():
    text = json.dumps([
        {"kind": "patch", "patch_site": "resid_pre", "layer": 1, "source": "x", "head": None,
         "positions": [0, -1]},
        {"kind": "set", "set_site": "attn_z", "layer": 0, "value": [1.5] * 16, "head": 2,
         "add": True},
    ])
    assert edits_from_json(text) == [Patch("resid_pre", 1, "x", positions=(0, -1)),
                                     Set("attn_z", 0, (1.5,) * 16, head=2, add=True)]


def test_records_normalise_their_fields():
    steer = Steer(0, torch.ones(4), alpha=2, positions=[np.int64(1), -1])
    assert steer.vector == (1.0, 1.0, 1.0, 1.0) and steer.positions == (1, -1)
    assert isinstance(steer.alpha, float)
    assert hash(steer) == hash(Steer(0, (1.0,) * 4, alpha=2.0, positions=(1, -1)))
    patch = Patch("attn_z", 0, "x", head=1, positions=[0])
    assert patch.to_dict() == {"kind": "patch", "site": "attn_z", "layer": 0, "source": "x",
                               "head": 1, "positions": (0,)}


# -- layer resumption -----------------------------------------------------------------------

def resume_cases(model):
    d_model = model.spec.d_model
    vec = random_vector(d_model, seed=6)
    return {
        "steer-layer-2": [Steer(2, vec, alpha=2.0, positions=(-1,))],
        "steer-layer-1": [Steer(1, vec, alpha=1.0)],
        "ablate-layer-1": [Ablate(1, 3, mode="mean")],
        "patch-resid_pre-at-resume-layer": [Patch("resid_pre", 1, SOURCE, positions=(0, -1))],
        "patch-resid_pre-layer-2+scale": [Patch("resid_pre", 2, SOURCE, positions=(-1,)),
                                          Scale(2, 0, alpha=3.0)],
        "layers-1-and-2": [Scale(2, 1, alpha=0.0), Steer(1, vec, positions=(0,))],
        "layer-0": [Ablate(0, 0)],
    }


@pytest.mark.parametrize("case", ["steer-layer-2", "steer-layer-1", "ablate-layer-1",
                                  "patch-resid_pre-at-resume-layer",
                                  "patch-resid_pre-layer-2+scale", "layers-1-and-2", "layer-0"])
def test_resume_equals_full_rerun(family_model, case):
    model = family_model
    edits = resume_cases(model)[case]
    clean = clean_run(model, PROMPTS)
    cache_before = [t.clone() for t in clean.resid_pre]
    full = run_with(model, PROMPTS, edits, sites=["resid_post"])
    resumed = run_with(model, PROMPTS, edits, sites=["resid_post"], resume=clean)
    np.testing.assert_allclose(resumed.logits.values, full.logits.values, atol=1e-6, rtol=0)
    np.testing.assert_allclose(resumed.resid_post.values, full.resid_post.values, atol=1e-6,
                               rtol=0)
    # the edit worked on a copy: the cached clean residuals are untouched
    for before, after in zip(cache_before, clean.resid_pre):
        assert torch.equal(before, after)
    # and a second resumed run from the same cache gives the same answer
    again = run_with(model, PROMPTS, edits, resume=clean)
    np.testing.assert_array_equal(again.logits.values, resumed.logits.values)


def test_resume_with_sites_before_the_first_edit(tiny_model):
    """Sites the clean cache lacks (mlp_out, attn_z) before the edit still come out right."""
    edits = [Steer(2, random_vector(64, seed=7), positions=(-1,))]
    clean = clean_run(tiny_model, PROMPTS)
    for sites in (["mlp_out"], ["attn_z", "resid_pre"]):
        full = run_with(tiny_model, PROMPTS, edits, sites=sites, positions=[0, -1])
        resumed = run_with(tiny_model, PROMPTS, edits, sites=sites, positions=[0, -1],
                           resume=clean)
        for var in ("logits", *sites):
            np.testing.assert_allclose(resumed[var].values, full[var].values, atol=1e-6, rtol=0)


def test_resume_skips_the_layers_before_the_first_edit(tiny_model):
    clean = clean_run(tiny_model, PROMPTS)
    ran = []
    handles = [tiny_model.hf_layer(layer).mlp.register_forward_hook(
        lambda mod, args, out, layer=layer: ran.append(layer)) for layer in range(3)]
    try:
        run_with(tiny_model, PROMPTS, [Scale(2, 0, alpha=2.0)], resume=clean)
    finally:
        for h in handles:
            h.remove()
    assert ran == [2]


def test_clean_run_holds_the_unedited_residuals(tiny_model):
    clean = clean_run(tiny_model, PROMPTS)
    batch = tiny_model.tokenize(PROMPTS)
    hidden = tiny_model.hf(**batch.model_inputs(), output_hidden_states=True).hidden_states
    for layer in range(tiny_model.n_layers):
        for i, n in enumerate(batch.lengths):
            torch.testing.assert_close(clean.resid_pre[layer][i, -n:], hidden[layer][i, -n:],
                                       atol=ATOL, rtol=1e-4)


def test_resume_from_other_prompts_is_rejected(tiny_model):
    clean = clean_run(tiny_model, PROMPTS[:2])
    with pytest.raises(InputError, match="`resume` was computed for different prompts"):
        run_with(tiny_model, PROMPTS[1:], [Scale(1, 0, alpha=2.0)], resume=clean)


# -- bad input ------------------------------------------------------------------------------

def test_bad_edit_kind_in_json_lists_the_kinds():
    text = json.dumps([{"kind": "ablte", "layer": 0, "head": 1}])
    with pytest.raises(InputError, match=r"`kind` must be one of 'ablate', 'scale', 'patch', "
                                         r"'steer', 'add_head', 'set'; got 'ablte'\. Did you mean "
                                         r"'ablate'\?"):
        edits_from_json(text)
    with pytest.raises(InputError, match="an edit must be a dict with a 'kind' key"):
        edits_from_json(json.dumps([{"layer": 0}]))
    with pytest.raises(InputError, match="edits JSON must be a list"):
        edits_from_json(json.dumps({"kind": "scale"}))
    with pytest.raises(InputError, match="bad fields for a 'scale' edit"):
        edits_from_json(json.dumps([{"kind": "scale", "layer": 0, "head": 1, "alpah": 2}]))
    with pytest.raises(InputError, match=r"`site` must be one of .*; got None"):
        edits_from_json(json.dumps([{"kind": "patch", "layer": 0, "source": "x"}]))
    with pytest.raises(InputError, match=r"`kind` must be one of .*; got \['ablate'\]"):
        edits_from_json(json.dumps([{"kind": ["ablate"], "layer": 0, "head": 1}]))
    with pytest.raises(InputError, match=r"edits JSON does not parse: .* line 1, column 3"):
        edits_from_json("[{kind: 'scale'}]")


def test_bad_record_fields_are_rejected():
    with pytest.raises(InputError, match=r"`mode` must be one of 'zero', 'mean'; got 'avg'"):
        Ablate(0, 0, mode="avg")
    with pytest.raises(InputError, match=r"`value` applies to mode 'mean' only"):
        Ablate(0, 0, mode="zero", value=(0.0,) * 16)
    with pytest.raises(InputError, match=r"`site` must be one of .*got 'resid_psot'.*"
                                         r"Did you mean 'resid_post'"):
        Patch("resid_psot", 0, "x")
    with pytest.raises(InputError, match=r"`head` applies to the head sites attn_q, attn_k, attn_v, attn_z only"):
        Patch("mlp_out", 0, "x", head=1)
    with pytest.raises(InputError, match=r"`alpha` must be a number in \[-inf, inf\]; got nan"):
        Scale(0, 0, alpha=float("nan"))


@pytest.mark.parametrize("make", [
    lambda bad: Steer(0, torch.tensor([0.0, bad, 1.0])),
    lambda bad: Ablate(0, 0, mode="mean", value=np.array([bad, 0.0])),
    lambda bad: AddHead(0, 1, value=[1.0, 2.0, bad]),
])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_edit_tensors_are_refused(make, bad):
    with pytest.raises(InputError, match=rf"must hold finite numbers; 1 of its [23] entries are "
                                         rf"not \({bad} at [012]\)"):
        make(bad)


def test_non_finite_values_are_named_and_alphas_must_be_finite():
    with pytest.raises(InputError, match=r"`vector` must hold finite numbers; 4 of its 5 "
                                         r"entries are not \(nan at 0, inf at 1, -inf at 3, \.\.\.\)"):
        Steer(0, [float("nan"), float("inf"), 0.0, -float("inf"), float("nan")])
    for make in (lambda a: Steer(0, [1.0], alpha=a), lambda a: Scale(0, 0, alpha=a),
                 lambda a: AddHead(0, 0, value=[1.0], alpha=a)):
        with pytest.raises(InputError, match=r"`alpha` must be a finite number; got inf"):
            make(float("inf"))
    with pytest.raises(InputError, match=r"`vector` must hold finite numbers"):
        edits_from_json('[{"kind": "steer", "layer": 0, "vector": [NaN]}]')


def test_layer_and_head_out_of_range(tiny_model):
    with pytest.raises(InputError, match=r"`layer` must be an int in \[0, 2\]; got 3\."):
        run_with(tiny_model, PROMPTS, [Ablate(3, 0)])
    with pytest.raises(InputError, match=r"`head` must be an int in \[0, 3\]; got 4\."):
        run_with(tiny_model, PROMPTS, [Scale(0, 4, alpha=2.0)])
    with pytest.raises(InputError, match=r"`head` must be an int in \[0, 3\]; got -1\."):
        run_with(tiny_model, PROMPTS, [Patch("attn_z", 0, SOURCE, head=-1, positions=(0,))])


def test_vector_and_value_lengths_are_checked(tiny_model):
    with pytest.raises(InputError, match=r"`vector` must have d_model=64 entries; got 3\."):
        run_with(tiny_model, PROMPTS, [Steer(0, (1.0, 2.0, 3.0))])
    with pytest.raises(InputError, match=r"`value` must have d_head=16 entries; got 2\."):
        run_with(tiny_model, PROMPTS, [Ablate(0, 0, mode="mean", value=(1.0, 2.0))])


def test_patch_source_length_mismatch(tiny_model):
    n_src = len(tiny_model.tokenizer(SOURCE, add_special_tokens=False)["input_ids"])
    with pytest.raises(InputError, match=rf"patch source has {n_src} tokens but a prompt has 17; "
                                         r"pass `positions`"):
        run_with(tiny_model, PROMPTS, [Patch("resid_post", 1, SOURCE)])
    with pytest.raises(InputError, match=rf"patch position 9 is out of range for the source with "
                                         rf"{n_src} tokens"):
        run_with(tiny_model, PROMPTS[:1], [Patch("resid_post", 1, SOURCE, positions=(9,))])


def test_edits_must_be_records(tiny_model):
    with pytest.raises(TypeError, match=r"`edits\[1\]` must be an edit record .*got dict.*"
                                        r"edit_from_dict"):
        run_with(tiny_model, PROMPTS, [Scale(0, 0, alpha=1.0), {"kind": "scale"}])
    with pytest.raises(TypeError, match=r"`edits` must be a list of edit records .*got str"):
        trace(tiny_model, PROMPTS, edits=edits_to_json([Ablate(0, 0)]))


def test_out_of_range_edit_position(tiny_model):
    vec = (0.0,) * 64
    with pytest.raises(InputError, match=r"position -3 is out of range for prompt 1 with 2 "
                                         r"tokens \(allowed: -2 to 1\)"):
        run_with(tiny_model, PROMPTS, [Steer(0, vec, positions=(-3,))])
    with pytest.raises(InputError, match=r"position 7 is out of range for prompt 1"):
        run_with(tiny_model, PROMPTS, [Patch("resid_pre", 1, SOURCE, positions=(7,))])


# -- row-targeted edits (`prompts`) ---------------------------------------------------------

def row_target_cases(model):
    d_head, d_model = model.spec.d_head, model.spec.d_model
    return {
        "ablate-zero": Ablate(1, 2),
        "ablate-value-last": Ablate(2, 1, mode="mean", value=random_vector(d_head, seed=8),
                                    positions=(-1,)),
        "scale": Scale(0, 3, alpha=-2.0),
        "steer": Steer(1, random_vector(d_model, seed=9), positions=(0, -1)),
        "patch": Patch("resid_pre", 1, SOURCE, positions=(-1,)),
        # one d_head vector per prompt (position -1 of each of the 3 prompts)
        "add-head": AddHead(1, 0, random_vector(3 * d_head, seed=10), positions=(-1,)),
    }


@pytest.mark.parametrize("case", ["ablate-zero", "ablate-value-last", "scale", "steer", "patch",
                                  "add-head"])
def test_row_targeted_edit_changes_only_its_rows(tiny_model, case):
    """Rows in `prompts` equal the edit on every row; the other rows equal the unedited run."""
    model = tiny_model
    everywhere = row_target_cases(model)[case]
    rows = (2, 0)  # in this order: AddHead's values are prompt-major in this order
    targeted = replace(everywhere, prompts=rows)
    if isinstance(everywhere, AddHead):  # one vector per selected (prompt, position)
        v = np.array(everywhere.value).reshape(len(PROMPTS), model.spec.d_head)
        targeted = replace(everywhere, prompts=rows, value=v[list(rows)].reshape(-1))
    plain = ds_logits(run_with(model, PROMPTS))
    full = ds_logits(run_with(model, PROMPTS, [everywhere]))
    got = ds_logits(run_with(model, PROMPTS, [targeted]))
    for i in range(len(PROMPTS)):
        want = full[i] if i in rows else plain[i]
        np.testing.assert_allclose(got[i], want, atol=ATOL, rtol=1e-4)
    assert max(np.abs(full[i] - plain[i]).max() for i in rows) > 1e-3  # not vacuous
    # resumed and split into batches of one, the same rows change
    resumed = ds_logits(run_with(model, PROMPTS, [targeted], resume=clean_run(model, PROMPTS)))
    for g, r in zip(got, resumed):
        np.testing.assert_allclose(r, g, atol=1e-6, rtol=0)
    if not isinstance(everywhere, AddHead):
        split = trace(model, PROMPTS, sites=["unembed"], edits=[targeted], batch_size=1)
        whole = trace(model, PROMPTS, sites=["unembed"], edits=[targeted], batch_size=8)
        np.testing.assert_allclose(split.unembed.values, whole.unembed.values, atol=ATOL,
                                   rtol=1e-4)


def test_row_targeted_mean_ablation_averages_over_its_rows(tiny_model):
    """A value-less mean over `prompts` rows is the mean over those prompts' real tokens."""
    model = tiny_model
    rows = (0, 2)
    edit = Ablate(1, 3, mode="mean", prompts=rows)
    got = ds_logits(run_with(model, PROMPTS, [edit]))
    sub = ds_logits(run_with(model, [PROMPTS[i] for i in rows], [Ablate(1, 3, mode="mean")]))
    plain = ds_logits(run_with(model, PROMPTS))
    for j, i in enumerate(rows):
        np.testing.assert_allclose(got[i], sub[j], atol=ATOL, rtol=1e-4)
    np.testing.assert_allclose(got[1], plain[1], atol=ATOL, rtol=1e-4)
    split = trace(model, PROMPTS, sites=["unembed"], edits=[edit], batch_size=1)
    for i, n in enumerate(split["mask"].values.sum(1)):
        np.testing.assert_allclose(split.unembed.values[i, :n], got[i], atol=ATOL, rtol=1e-4)


def test_bad_prompt_rows_are_rejected(tiny_model):
    with pytest.raises(InputError, match=r"Ablate at layer 1 targets prompt row 3, but the "
                                         r"batch has 3 prompts \(rows 0 to 2\)"):
        run_with(tiny_model, PROMPTS, [Ablate(1, 0, prompts=(0, 3))])
    with pytest.raises(InputError, match=r"Steer at layer 0 targets prompt row 3"):
        trace(tiny_model, PROMPTS, edits=[Steer(0, (0.0,) * 64, prompts=[3])], batch_size=1)
    with pytest.raises(InputError, match=r"targets prompt row 1, but the batch has 1 prompt "):
        run_with(tiny_model, PROMPTS[:1], [Scale(0, 0, alpha=2.0, prompts=(1,))])
    with pytest.raises(InputError, match=r"`prompts` holds batch row indices from 0; got -1"):
        Ablate(0, 0, prompts=(-1,))
    with pytest.raises(InputError, match=r"`prompts` is empty"):
        Scale(0, 0, alpha=1.0, prompts=())
    with pytest.raises(InputError, match=r"`prompts` names row 2 twice"):
        Patch("resid_pre", 0, SOURCE, prompts=(2, 1, 2))
    with pytest.raises(TypeError, match=r"`prompts\[0\]` must be an int"):
        Ablate(0, 0, prompts=("0",))


def test_prompts_round_trip_and_stay_out_of_old_records():
    e = Ablate(1, 2, mode="mean", value=(0.5,) * 16, positions=[-1], prompts=[np.int64(4), 1])
    assert e.prompts == (4, 1)
    assert edits_from_json(edits_to_json([e])) == [e]
    assert "prompts" not in Ablate(0, 1).to_dict()
    assert Scale(0, 0, alpha=1.0, prompts=3).prompts == (3,)


# -- CleanRun.repeat ------------------------------------------------------------------------

def test_repeated_clean_run_resumes_a_repeated_batch(tiny_model):
    """Resuming k copies from `repeat(k)` equals a full run of the k-times repeated prompts."""
    model = tiny_model
    clean = clean_run(model, PROMPTS)
    big = clean.repeat(2)
    assert big.batch.lengths == clean.batch.lengths * 2
    assert torch.equal(big.batch.input_ids[3:], clean.batch.input_ids)
    assert len(big.resid_pre) == model.n_layers and big.logits.shape[0] == 0
    assert torch.equal(big.resid_pre[1][3:], clean.resid_pre[1])
    assert torch.equal(clean.repeat(2, logits=True).logits[3:], clean.logits)
    # copy 0 edits head 1 of layer 1, copy 1 head 2 of layer 2; resumed at layer 1
    edits = [Ablate(1, 1, prompts=(0, 1, 2)), Scale(2, 2, alpha=3.0, prompts=(3, 4, 5))]
    resumed = ds_logits(run_with(model, PROMPTS * 2, edits, resume=big))
    full = ds_logits(run_with(model, PROMPTS * 2, edits))
    one = ds_logits(run_with(model, PROMPTS, [Ablate(1, 1)]))
    two = ds_logits(run_with(model, PROMPTS, [Scale(2, 2, alpha=3.0)]))
    for i in range(6):
        np.testing.assert_allclose(resumed[i], full[i], atol=1e-6, rtol=0)
        np.testing.assert_allclose(resumed[i], (one + two)[i], atol=ATOL, rtol=1e-4)
    with pytest.raises(InputError, match=r"`k` must be an int in \[1, inf\]; got 0"):
        clean.repeat(0)
