"""The head atlas: each conversion to [layer, head] against an independent computation."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
import xarray as xr

import explorer
from explorer._checks import InputError
from explorer.analyses import circuits as ca
from explorer.analyses import conflicts as C
from explorer.analyses import icl_heads as ih
from explorer.head_atlas import atlas_table, head_atlas

PROMPTS = ["The cat sat on the mat because the cat was tired", "Hi", "One two three"]


@pytest.fixture(scope="module")
def induction(tiny_model):
    return ih.induction_scores(tiny_model, n_sequences=4, half_len=8)


@pytest.fixture(scope="module")
def edges(tiny_model):
    with torch.enable_grad():
        return ca.edge_scores(tiny_model, ca.make_task("add", 4, seed=0), batch_size=4)


def test_layer_head_scores_pass_through_with_their_provenance(tiny_model, induction):
    atlas = head_atlas(induction)
    assert atlas.attrs["model"] == "tiny-llama" and atlas.attrs["scores"] == ["induction_score"]
    np.testing.assert_array_equal(atlas["induction_score"].values,
                                  induction["induction_score"].transpose("layer", "head").values)
    attrs = atlas["induction_score"].attrs
    assert attrs["method"] == "induction_scores" and attrs["model"] == "tiny-llama"
    assert json.loads(attrs["params"])["n_sequences"] == 4
    assert atlas["component"].values[2, 3] == "L2.H3"
    assert "sequence_ids" not in atlas  # not a per-head score


def test_a_merged_result_that_lost_its_method_is_named_from_the_variable(induction):
    fv = xr.Dataset({"fv_score": (("head", "layer"), np.arange(12.0).reshape(4, 3))},
                    coords={"layer": range(3), "head": range(4)})
    merged = xr.merge([induction[["induction_score"]], fv], combine_attrs="drop")
    atlas = head_atlas(merged, n_layers=3, n_heads=4)
    assert atlas["induction_score"].attrs["method"] == "induction_scores"
    assert atlas["fv_score"].attrs["method"] == "fv_scores"
    assert atlas["fv_score"].values[1, 2] == fv["fv_score"].values[2, 1]  # transposed, not copied


def test_edge_mass_equals_a_plain_loop_over_edges(tiny_model, edges):
    atlas = head_atlas(edges, model=tiny_model)
    L, H = tiny_model.spec.n_layers, tiny_model.spec.n_heads
    want_in, want_out = np.zeros((L, H)), np.zeros((L, H))
    name = re.compile(r"^a(\d+)\.h(\d+)$")
    for src, dst, s in zip(edges["src"].values, edges["dst"].values, edges["score"].values):
        if m := name.match(str(src)):
            want_out[int(m[1]), int(m[2])] += abs(float(s))
        if m := name.match(str(dst)):
            want_in[int(m[1]), int(m[2])] += abs(float(s))
    np.testing.assert_allclose(atlas["eap_in_mass"].values, want_in, rtol=1e-6)
    np.testing.assert_allclose(atlas["eap_out_mass"].values, want_out, rtol=1e-6)
    assert want_in.sum() > 0 and want_out.sum() > 0
    assert atlas["eap_in_mass"].attrs["method"] == "circuit_eap"


def test_attention_statistics_equal_hugging_face_attentions(tiny_model):
    trace = explorer.trace(tiny_model, PROMPTS, sites=("attn_pattern",))
    atlas = head_atlas(trace)
    L, H = tiny_model.spec.n_layers, tiny_model.spec.n_heads
    first, prev, ent, count = np.zeros((L, H)), np.zeros((L, H)), np.zeros((L, H)), 0
    hf = tiny_model.hf
    current = hf.config._attn_implementation
    hf.set_attn_implementation("eager")
    try:
        for prompt in PROMPTS:
            ids = tiny_model.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            if len(ids) < 2:
                continue
            out = hf(input_ids=torch.tensor([ids]), output_attentions=True)
            a = torch.stack([x[0] for x in out.attentions]).double().numpy()   # [L, H, q, k]
            for q in range(1, len(ids)):
                first += a[:, :, q, 0]
                prev += a[:, :, q, q - 1]
                row = a[:, :, q, :q + 1]
                ent += -(row * np.log(np.clip(row, 1e-300, None))).sum(-1)
                count += 1
    finally:
        hf.set_attn_implementation(current)
    np.testing.assert_allclose(atlas["first_token_attention"].values, first / count, atol=1e-5)
    np.testing.assert_allclose(atlas["previous_token_attention"].values, prev / count, atol=1e-5)
    np.testing.assert_allclose(atlas["attention_entropy"].values, ent / count, atol=1e-4)
    assert atlas["attention_entropy"].attrs["method"] == "attention_pattern"


def test_conflict_scores_and_mean_ablation_effect(tiny_model):
    facts = [C.load_facts(["country_capital"])[i] for i in (0, 2)]
    ds = C.head_context_memory_scores(tiny_model, facts, kinds=["substitution"])
    atlas = head_atlas(ds)
    np.testing.assert_array_equal(atlas["memory_score"].values, ds["memory_score"].values)
    np.testing.assert_array_equal(atlas["context_score"].values, ds["context_score"].values)
    eff = ds["ablation_effect"].values                            # [kind, fact, layer, head]
    want = np.zeros(eff.shape[2:])
    for k in range(eff.shape[0]):
        for f in range(eff.shape[1]):
            want += eff[k, f]
    np.testing.assert_allclose(atlas["ablation_effect"].values, want / (eff.shape[0] * eff.shape[1]))
    no_ablation = C.head_context_memory_scores(tiny_model, facts, kinds=["substitution"],
                                               ablation=False)
    assert "ablation_effect" not in head_atlas(no_ablation)   # zeros that were never computed


def test_several_results_one_dataset_and_clashing_names_get_suffixes(tiny_model, induction, edges):
    trace = explorer.trace(tiny_model, PROMPTS[:1], sites=("attn_pattern",))
    atlas = head_atlas([induction, edges], trace, edges)
    assert list(atlas.data_vars) == ["induction_score", "eap_in_mass", "eap_out_mass",
                                     "first_token_attention", "previous_token_attention",
                                     "attention_entropy", "eap_in_mass_add", "eap_out_mass_add"]
    np.testing.assert_array_equal(atlas["eap_in_mass_add"].values, atlas["eap_in_mass"].values)
    table = atlas_table(atlas)
    assert len(table) == 12 and list(table.columns[:3]) == ["component", "layer", "head"]
    row = table.set_index("component").loc["L1.H2"]
    assert row["induction_score"] == atlas["induction_score"].values[1, 2]
    assert row["eap_out_mass"] == atlas["eap_out_mass"].values[1, 2]


def test_an_atlas_saves_to_zarr_and_reads_back(tmp_path, induction, edges):
    atlas = head_atlas(induction, edges)
    atlas.to_zarr(tmp_path / "atlas.zarr")
    back = xr.open_zarr(tmp_path / "atlas.zarr").load()
    np.testing.assert_array_equal(back["eap_in_mass"].values, atlas["eap_in_mass"].values)
    assert back["eap_in_mass"].attrs["method"] == "circuit_eap"


def test_bad_input_is_refused(tiny_model, induction):
    other = induction.copy()
    other.attrs = {**induction.attrs, "model": "smollm2-135m"}
    with pytest.raises(InputError, match="different models: 'tiny-llama' and 'smollm2-135m'"):
        head_atlas(induction, other)
    with pytest.raises(TypeError, match="xarray.Datasets; got ndarray"):
        head_atlas(np.zeros((3, 4)))
    with pytest.raises(InputError, match="needs n_layers and n_heads"):
        head_atlas()
    empty = head_atlas(model=tiny_model)
    assert dict(empty.sizes) == {"layer": 3, "head": 4} and not empty.data_vars
