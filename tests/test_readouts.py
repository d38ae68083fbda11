"""Tests for explorer.readouts and `explorer.trace.read`: readout records against plain
Hugging Face forwards of each prompt alone (hidden states, logits, the lens through the
final norm and unembedding counted over the whole vocabulary), across batch splits and
padding, plus the records' JSON form and their errors."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from explorer._checks import InputError
from explorer.interventions import Ablate
from explorer.models import TINY_MODELS, load_model
from explorer.readouts import (
    DLA,
    FinalNorm,
    Lens,
    Logits,
    Save,
    readout_from_dict,
    readouts_from_json,
    readouts_to_json,
)
from explorer.trace import logit_attribution, read, trace

PROMPTS = ["The quick brown fox jumps over the lazy dog", "One two", "Water boils at one hundred"]
ATOL = 1e-5

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _alone(model, text):
    """A plain HF forward of ``text`` alone: (hidden states, logits [pos, vocab])."""
    ids = model.tokenize([text]).input_ids
    out = model.hf(input_ids=ids, output_hidden_states=True)
    return out.hidden_states, out.logits[0].float()


@pytest.mark.parametrize("batch_size", [1, 2, 8])
def test_save_logits_and_final_norm_match_each_prompt_run_alone(tiny_model, batch_size):
    m = tiny_model
    ds = read(m, PROMPTS, [Save("resid_post", [0, 1]), Logits(), FinalNorm()],
              batch_size=batch_size)
    assert ds.resid_post.dims == ("prompt", "pos", "layer", "d_model")
    assert ds.layer.values.tolist() == [0, 1]
    finals = []
    hooked = m.final_norm_module.register_forward_hook(lambda _m, _i, o: finals.append(o))
    try:
        for i, text in enumerate(PROMPTS):
            hs, logits = _alone(m, text)
            n = len(hs[0][0])
            assert int(ds.mask[i].sum()) == n
            for li, layer in enumerate([0, 1]):
                np.testing.assert_allclose(ds.resid_post.values[i, :n, li],
                                           hs[layer + 1][0].numpy(), atol=ATOL)
            np.testing.assert_allclose(ds.logits.values[i, :n], logits.numpy(), atol=1e-4)
            np.testing.assert_allclose(ds.final_norm.values[i, :n], finals[-1][0].numpy(),
                                       atol=ATOL)
            assert np.isnan(ds.logits.values[i, n:]).all()
    finally:
        hooked.remove()
    assert json.loads(ds.attrs["readouts_json"])[0] == {"kind": "save", "site": "resid_post",
                                                        "layers": [0, 1], "points": None}


def test_saved_points_keep_their_order_across_batches(tiny_model):
    """Points named in any order, over prompts split into batches of one, come back in the
    order given, equal to the full-position trace at those tokens."""
    m = tiny_model
    points = [(2, -1), (0, 3), (1, 0), (0, -1)]
    got = read(m, PROMPTS, [Save("attn_z", points=points), Save("resid_pre", points=points)],
               batch_size=1)
    full = trace(m, PROMPTS, sites=("attn_z", "resid_pre"))
    assert got.attn_z.dims == ("point", "layer", "head", "d_head")
    assert got.point_prompt.values.tolist() == [2, 0, 1, 0]
    for j, (p, q) in enumerate(points):
        pos = q % int(full.mask[p].sum())
        for site in ("attn_z", "resid_pre"):
            np.testing.assert_allclose(got[site].values[j], full[site].values[p, pos], atol=ATOL)


@pytest.mark.parametrize("family", sorted(TINY_MODELS))
def test_lens_record_matches_a_full_vocabulary_count_on_every_family(family):
    """The lens reduced inside the trace against each prompt's hidden states through the
    model's own final norm and unembedding: top ids, log-probs, the output's top tokens'
    strict ranks and log-probs, and adjacent-layer cosines."""
    m = load_model(family)
    L, k = m.n_layers, 4
    ds = read(m, PROMPTS, [Lens(k, ranked=2, cosine=True)], batch_size=2)
    assert ds.lens_rank.dims == ("prompt", "pos", "lens_layer", "ranked")
    for i, text in enumerate(PROMPTS):
        hs, logits = _alone(m, text)
        n = len(hs[0][0])
        final = logits.topk(k, dim=-1).indices                           # [pos, k]
        assert ds.lens_final_id.values[i, :n].tolist() == final.tolist()
        for layer in range(L):
            if layer == L - 1:
                lens = logits           # HF returns the last hidden state normed already
            else:
                lens = m.lens_logits(hs[layer + 1][0]).float()          # [pos, vocab]
            logp = lens.log_softmax(-1)
            top = lens.topk(k, dim=-1)
            assert ds.lens_top_id.values[i, :n, layer].tolist() == top.indices.tolist()
            np.testing.assert_allclose(ds.lens_top_logprob.values[i, :n, layer],
                                       logp.gather(-1, top.indices).numpy(), atol=1e-4)
            target = lens.gather(-1, final[:, :2])
            rank = (lens[:, None, :] > target[:, :, None]).sum(-1)
            assert ds.lens_rank.values[i, :n, layer].tolist() == rank.tolist()
            np.testing.assert_allclose(ds.lens_logprob.values[i, :n, layer],
                                       logp.gather(-1, final[:, :2]).numpy(), atol=1e-4)
            if 0 < layer < L - 1:
                cos = torch.nn.functional.cosine_similarity(hs[layer + 1][0], hs[layer][0], -1)
                np.testing.assert_allclose(ds.lens_cos.values[i, :n, layer], cos.numpy(),
                                           atol=1e-5)
        assert (ds.lens_top_id.values[i, n:] == -1).all()
    assert np.isnan(ds.lens_cos.values[:, :, 0]).all()


def test_dla_record_over_batches_equals_one_batch_and_sums_to_the_logit(tiny_model):
    m = tiny_model
    ids = [[5, 7], [1, 2], [9, 3]]
    one = logit_attribution(m, PROMPTS, ids, positions=[-1, -2])
    split = read(m, PROMPTS, [DLA(ids)], positions=[-1, -2], batch_size=1)
    for name in ("embed", "heads", "attn_bias", "mlp", "norm_bias", "logit"):
        # float32 runs of different padding
        np.testing.assert_allclose(split[name].values, one[name].values, atol=1e-6, err_msg=name)
    total = (split.embed + split.heads.sum(("layer", "head")) + split.attn_bias.sum("layer")
             + split.mlp.sum("layer") + split.norm_bias)
    np.testing.assert_allclose(total.values, split.logit.values, atol=1e-4)


def test_read_under_edits_matches_run_with_and_a_mean_over_every_prompt(tiny_model):
    """A mean ablation split into batches averages over every prompt: equal to one batch."""
    m = tiny_model
    edits = [Ablate(layer=1, head=0, mode="mean")]
    whole = read(m, PROMPTS, [Logits(), Save("attn_z", [1])], edits=edits, batch_size=8)
    split = read(m, PROMPTS, [Logits(), Save("attn_z", [1])], edits=edits, batch_size=1)
    np.testing.assert_allclose(split.logits.values, whole.logits.values, atol=1e-4)
    z = whole.attn_z.sel(layer=1, head=0).values                       # [prompt, pos, d_head]
    real = whole.mask.values
    assert np.allclose(z[real], z[real][0], atol=1e-6)                 # one mean everywhere
    clean = trace(m, PROMPTS, sites="attn_z", layers=1).attn_z.sel(layer=1, head=0).values
    np.testing.assert_allclose(z[real][0], clean[real].mean(0), atol=1e-5)
    assert json.loads(whole.attrs["edits_json"])[0]["kind"] == "ablate"


def test_records_round_trip_through_json():
    records = [Save("attn_z", [0, 2], points=[(0, -1)]), Logits(), FinalNorm(),
               Lens(5, [0, 1], ranked=2, cosine=True), DLA([[1, 2]])]
    back = readouts_from_json(readouts_to_json(records))
    assert back == records
    assert readout_from_dict({"kind": "lens", "k": 3}) == Lens(3)


@pytest.mark.parametrize("records, kwargs, message", [
    ([], {}, "`readouts` is empty"),
    ([Save("resid_post"), Save("resid_post", [1])], {}, "both write 'resid_post'"),
    ([Lens(2), Lens(3, [0])], {}, "both write 'lens_top_id'"),
    ([Save("resid_post", [0]), Save("mlp_out", [1])], {}, "share the `layer` axis"),
    ([Save("resid_post", points=[(0, 0)]), Save("mlp_out")], {}, "same `points`"),
    ([Save("resid_post", points=[(5, 0)])], {}, "name prompt 5; the run has 3"),
    ([Save("resid_post", points=[(1, 9)])], {}, r"\(1, 9\) is outside prompt 1's"),
    ([Save("resid_post", points=[(0, 0)])], {"positions": [-1]}, "cannot both be given"),
    ([DLA([[1]])], {"positions": [-1]}, "one row per prompt"),
    ([DLA([[1], [1], [1]])], {}, "needs the run's `positions`"),
    ([Lens(2, [9])], {}, "layer"),
    ([Save("resid_post")], {"resume": "x", "batch_size": 1}, "`resume` holds one batch"),
])
def test_bad_records_are_clear_errors(tiny_model, records, kwargs, message):
    with pytest.raises(InputError, match=message):
        read(tiny_model, PROMPTS, records, **kwargs)


def test_bad_record_values_are_clear_errors(tiny_model):
    with pytest.raises(InputError, match="site"):
        Save("logits")
    with pytest.raises(InputError, match="`points` apply to sites other than"):
        Save("attn_pattern", points=[(0, 0)])
    with pytest.raises(InputError, match=r"\[prompt, target\] ints"):
        DLA([1, 2])
    big = tiny_model.vocab_size
    with pytest.raises(InputError, match=rf"`DLA.target_ids` must be token ids in \[0, {big - 1}\]; "
                                         rf"got {big}\."):
        read(tiny_model, PROMPTS[:1], [DLA([[big]])], positions=[-1])
    with pytest.raises(TypeError, match="must be a readout record"):
        read(tiny_model, PROMPTS, ["resid_post"])
    with pytest.raises(InputError, match="kind"):
        readout_from_dict({"kind": "probe"})
    with pytest.raises(InputError, match="readouts JSON does not parse"):
        readouts_from_json("[{")
    with pytest.raises(InputError, match="readouts JSON must be a list of readout objects"):
        readouts_from_json('{"kind": "logits"}')
    with pytest.raises(InputError, match="bad fields for a 'save' readout"):
        readout_from_dict({"kind": "save", "site": "resid_post", "depth": 2})


def test_clean_run_keeps_sites_under_edits_like_hooked_forward(tiny_model):
    """`clean_run(..., edits=, keep=("attn_z",))` (run 1 of the JuICE dual run) against a
    plain padded forward with torch hooks: o_proj's input per layer, a head zeroed by a
    pre-hook where the run ablates it, and the edited logits."""
    from explorer.trace import clean_run
    from tests._hooks import removed_after

    m = tiny_model
    d = m.spec.d_head
    run = clean_run(m, PROMPTS, edits=[Ablate(layer=1, head=2)], keep=("attn_z",))
    batch = m.tokenize(PROMPTS)
    seen = {}

    def zero(_mod, args):
        z = args[0].clone()
        z[..., 2 * d:3 * d] = 0
        return (z, *args[1:])

    def keep(layer):
        return lambda _mod, args: seen.__setitem__(layer, args[0].clone())

    handles = [m.o_proj(1).register_forward_pre_hook(zero)]
    handles += [m.o_proj(x).register_forward_pre_hook(keep(x)) for x in range(m.n_layers)]
    with removed_after(handles):
        logits = m.hf(**batch.model_inputs()).logits
    real = batch.attention_mask.bool()
    for layer in range(m.n_layers):
        np.testing.assert_allclose(run.kept["attn_z"][layer][real].numpy(),
                                   seen[layer][real].numpy(), atol=ATOL)
    assert not run.kept["attn_z"][1][..., 2 * d:3 * d].any()
    np.testing.assert_allclose(run.logits[real].numpy(), logits[real].numpy(), atol=1e-4)
    with pytest.raises(InputError, match="`keep` names layer sites"):
        clean_run(m, PROMPTS, keep=("attn_pattern",))


# -- TransformerLens hook names get the site they mean ----------------------------------------

@pytest.mark.parametrize(("hook", "expected"), [
    ("blocks.10.hook_resid_post", r"did you mean `resid_post` at layer 10 \(site='resid_post', "
                                  r"layer=10\)\?"),
    ("blocks.3.attn.hook_z", r"did you mean `attn_z` at layer 3"),
    ("hook_embed", r"did you mean `resid_pre` at layer 0"),
    ("blocks.5.hook_mlp_out", r"did you mean `mlp_out` at layer 5"),
    ("blocks.2.attn.hook_pattern", r"did you mean `attn_pattern` at layer 2"),
    ("blocks.2.hook_resid_mid", r"no site holds the residual between attention and MLP"),
])
def test_transformer_lens_hook_names_are_mapped_in_errors(hook, expected):
    from explorer import Patch, Save, Set, Steer

    with pytest.raises(InputError, match=r"That is a TransformerLens hook name.*" + expected):
        Save(hook, (0,))
    for make in (lambda: Patch(hook, 0, "x"), lambda: Set(hook, 0, (1.0,)),
                 lambda: Steer(0, (1.0,), site=hook)):
        with pytest.raises(InputError, match=r"That is a TransformerLens hook name"):
            make()


def test_a_mapped_site_the_argument_does_not_take_is_said_so():
    from explorer import Steer

    with pytest.raises(InputError, match=r"did you mean `attn_z` at layer 1.*is not among the "
                                         r"sites this argument takes"):
        Steer(0, (1.0,), site="blocks.1.attn.hook_z")
