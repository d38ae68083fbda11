"""Fine-tuning circuits and CircuitLoRA (explorer/analyses/circuit_lora.py) on tiny-llama.

Rank allocation is checked against peft's own count of trainable parameters; Jaccard and
the per-layer edge change against hand-worked sets and score arrays; a short LoRA
fine-tune against the base weights (unchanged) and a reload of its checkpoints (same
logits as the trained adapter).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import xarray as xr

from explorer._checks import InputError
from explorer.analyses import circuit_lora as cl

PROMPTS = [f"{a} + {b} =" for a in range(4) for b in range(4)]
ANSWERS = [f" {a + b}" for a in range(4) for b in range(4)]


def peft_trainable(model, ranks) -> int:
    peft_model = cl.lora_model(model, ranks)
    return sum(p.numel() for p in peft_model.parameters() if p.requires_grad)


def test_parameter_count_matches_peft(tiny_model):
    ranks = {0: 3, 1: 0, 2: 5}
    # tiny-llama: d_model 64, KV 32, MLP 128 -> q 128 + k 96 + v 96 + o 128 + 3 x 192
    assert cl.lora_parameter_count(tiny_model, ranks) == (3 + 5) * (128 + 96 + 96 + 128 + 3 * 192)
    assert cl.lora_parameter_count(tiny_model, ranks) == peft_trainable(tiny_model, ranks)


def test_parameter_count_matches_peft_gpt2(tiny_gpt2):
    """GPT-2's Conv1D modules (weight [d_in, d_out]): c_attn, attn c_proj, c_fc, mlp c_proj."""
    ranks = {0: 2, 1: 3, 2: 1}
    per_rank = (64 + 192) + (64 + 64) + (64 + 256) + (256 + 64)
    assert cl.lora_parameter_count(tiny_gpt2, ranks) == 6 * per_rank
    assert cl.lora_parameter_count(tiny_gpt2, ranks) == peft_trainable(tiny_gpt2, ranks)


@pytest.mark.parametrize("rank,critical,r_other", [(4, [1], 2), (4, [0, 2], 1), (3, [2], 1),
                                                   (5, [0, 1], 3)])
def test_allocation_hits_uniform_count(tiny_model, rank, critical, r_other):
    target = peft_trainable(tiny_model, cl.uniform_lora_ranks(tiny_model, rank))
    alloc = cl.allocate_lora_ranks(tiny_model, target, critical, r_other=r_other)
    ranks = dict(zip(alloc.layer.values.tolist(), alloc["rank"].values.tolist()))
    assert peft_trainable(tiny_model, ranks) == target == alloc.attrs["n_params"]
    assert alloc.attrs["n_params_gap"] == 0
    assert all(ranks[l] == r_other for l in range(3) if l not in critical)
    assert all(ranks[c] > rank for c in critical)
    assert alloc["critical"].values.tolist() == [l in critical for l in range(3)]


def test_allocation_closest_when_not_exact(tiny_model):
    unit = 128 + 96 + 96 + 128 + 3 * 192  # parameters per rank per layer
    alloc = cl.allocate_lora_ranks(tiny_model, 10 * unit + 17, [0, 1], r_other=2)
    # 2 (layer 2) + 8 over the critical layers -> 4 and 4; 17 left over
    assert alloc["rank"].values.tolist() == [4, 4, 2]
    assert alloc.attrs["n_params"] == 10 * unit and alloc.attrs["n_params_gap"] == 17
    alloc = cl.allocate_lora_ranks(tiny_model, 11 * unit, [0, 1], r_other=2)
    assert alloc["rank"].values.tolist() == [5, 4, 2]


def test_allocation_errors(tiny_model):
    with pytest.raises(InputError, match="`n_params` must be at least"):
        cl.allocate_lora_ranks(tiny_model, 100, [0], r_other=2)
    with pytest.raises(InputError, match="`critical` must name at least one layer"):
        cl.allocate_lora_ranks(tiny_model, 10**6, [])
    with pytest.raises(InputError, match="must not repeat"):
        cl.allocate_lora_ranks(tiny_model, 10**6, [1, 1])
    with pytest.raises(InputError, match=r"`critical layer` must be an int in \[0, 2\]; got 7"):
        cl.allocate_lora_ranks(tiny_model, 10**6, [7])
    with pytest.raises(InputError, match="at least one layer a rank"):
        cl.lora_parameter_count(tiny_model, {0: 0, 1: 0})


def test_jaccard_hand_made():
    assert cl.jaccard({1, 2, 3}, {2, 3, 4}) == pytest.approx(2 / 4)
    assert cl.jaccard(set(), set()) == 1.0
    assert cl.jaccard({("a0.h1", "m1")}, {("a0.h1", "m2")}) == 0.0


def circuits_dataset(masks, src, dst):
    return xr.Dataset({"in_circuit": (("checkpoint", "edge"), np.array(masks, bool))},
                      coords={"checkpoint": np.arange(len(masks)), "src": ("edge", src),
                              "dst": ("edge", dst)})


def test_circuit_similarity_hand_made():
    src = ["input", "input", "a0.h0", "a0.h1", "m0"]
    dst = ["a0.h0", "a0.h1", "m0", "m0", "logits"]
    ds = circuits_dataset([[1, 0, 1, 0, 1],     # input a0.h0 m0 logits
                           [0, 1, 0, 1, 1],     # input a0.h1 m0 logits
                           [1, 0, 1, 0, 1]], src, dst)
    sim = cl.circuit_similarity(ds)
    assert sim.edge_jaccard.values[0, 1] == pytest.approx(1 / 5)
    assert sim.node_jaccard.values[0, 1] == pytest.approx(3 / 5)
    assert sim.edge_jaccard.values[0, 2] == 1.0
    assert sim.n_nodes.values.tolist() == [4, 4, 4]
    with pytest.raises(InputError, match="must hold `in_circuit` over"):
        cl.circuit_similarity(xr.Dataset({"score": ("edge", np.zeros(5))}))


def test_layer_edge_change_hand_made():
    src = ["input", "a0.h0", "a1.h2", "m1", "m2", "a2.h0"]
    dst = ["a0.h0", "m1", "m1", "logits", "logits", "logits"]
    before = xr.Dataset({"score": ("edge", [1.0, -2.0, 0.5, 3.0, 0.1, 9.0]),
                         "in_circuit": ("edge", [1, 1, 1, 0, 0, 0])},
                        coords={"src": ("edge", src), "dst": ("edge", dst)})
    after = xr.Dataset({"score": ("edge", [1.5, 1.0, 0.5, -4.0, 0.2, 8.0]),
                        "in_circuit": ("edge", [1, 1, 0, 1, 0, 0])},
                       coords={"src": ("edge", src), "dst": ("edge", dst)})
    out = cl.layer_edge_change(before, after, n_layers=3)
    # both: |1.5-1| = 0.5, |1-(-2)| = 3; before only: 0.5; after only: 4; neither: 0, 0
    assert out.edge_delta.values.tolist() == [0.5, 3.0, 0.5, 4.0, 0.0, 0.0]
    # layer 0: input (0.5) + a0.h0 (3); layer 1: a1.h2 (0.5) + m1 (4); layer 2: 0
    assert out.edge_change.values.tolist() == [3.5, 4.5, 0.0]
    assert cl.critical_layers(out.edge_change, k=1) == [1]
    assert cl.critical_layers(out.edge_change, k=2) == [0, 1]
    assert cl.critical_layers([0.0, 0.0, 10.0, 0.0], rule="mean+std") == [2]
    with pytest.raises(InputError, match="same edges"):
        cl.layer_edge_change(before, after.isel(edge=slice(0, 5)), n_layers=3)
    with pytest.raises(InputError, match="must be one of 'top-k', 'mean\\+std'"):
        cl.critical_layers([1.0], rule="top")


def test_node_layer():
    assert [cl.node_layer(n, 30) for n in ("input", "a3.h7", "m12", "logits")] == [0, 3, 12, 29]
    with pytest.raises(InputError, match="`node` must be"):
        cl.node_layer("mlp3", 30)


def test_finetune_changes_only_lora_and_checkpoints_reload(tiny_model, tmp_path):
    before = {k: v.clone() for k, v in tiny_model.hf.state_dict().items()}
    ds, peft_model = cl.finetune_lora(tiny_model, PROMPTS, ANSWERS, ranks={0: 2, 1: 2, 2: 4},
                                      steps=5, batch_size=4, lr=1e-2, checkpoints=[0, 2, 5],
                                      folder=tmp_path)
    # the shared model is untouched
    for k, v in tiny_model.hf.state_dict().items():
        assert torch.equal(v, before[k]), k
    # inside the LoRA model, only lora_A / lora_B moved
    trained = dict(peft_model.named_parameters())
    changed = set()
    for name, p in trained.items():
        base_name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        if "lora_" in name:
            if "lora_B" in name and p.abs().sum() > 0:
                changed.add(name)
            continue
        assert not p.requires_grad, name
        assert torch.equal(p, before[base_name]), name
    assert changed, "no LoRA B matrix was trained"
    assert cl.checkpoint_steps(tmp_path) == [0, 2, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "run.json", "step-0.safetensors", "step-2.safetensors", "step-5.safetensors"]
    assert ds.loss.shape == (5,) and ds.attrs["trainable_params"] == (2 + 2 + 4) * (128 + 96 + 96 + 128 + 3 * 192)
    batch = tiny_model.tokenize(PROMPTS[:5])
    with torch.no_grad():
        expected = peft_model(**batch.model_inputs()).logits
        base = tiny_model.hf(**batch.model_inputs()).logits
        reloaded = cl.load_checkpoint(tiny_model, tmp_path, 5)
        got = reloaded.hf(**batch.model_inputs()).logits
        start = cl.load_checkpoint(tiny_model, tmp_path, 0).hf(**batch.model_inputs()).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(start, base, atol=1e-6, rtol=1e-6)   # B = 0 at step 0
    assert (got - base).abs().max() > 1e-3
    # a reloaded checkpoint scores like the trained adapter (loss on the answers)
    a = cl.answer_accuracy(tiny_model, PROMPTS, ANSWERS, hf=peft_model)
    b = cl.answer_accuracy(reloaded, PROMPTS, ANSWERS)
    assert a.attrs["loss"] == pytest.approx(b.attrs["loss"], abs=1e-5)
    with pytest.raises(InputError, match="`step` must be one of 0, 2, 5; got 3"):
        cl.load_checkpoint(tiny_model, tmp_path, 3)
    with pytest.raises(InputError, match="not a fine-tuning run folder"):
        cl.load_checkpoint(tiny_model, tmp_path / "nowhere", 0)


def test_answer_accuracy_independent(tiny_model):
    """Exact match vs a plain greedy generate, loss vs a plain cross-entropy."""
    ev = cl.answer_accuracy(tiny_model, PROMPTS[:6], ANSWERS[:6])
    tok = tiny_model.tokenizer
    for i, (p, a) in enumerate(zip(PROMPTS[:6], ANSWERS[:6])):
        p_ids = tok(p, add_special_tokens=False)["input_ids"]
        a_ids = tok(a, add_special_tokens=False)["input_ids"]
        x = torch.tensor([p_ids + a_ids])
        with torch.no_grad():
            logits = tiny_model.hf(input_ids=x).logits[0, len(p_ids) - 1:-1]
            gen = tiny_model.hf.generate(torch.tensor([p_ids]), max_new_tokens=len(a_ids),
                                         do_sample=False, pad_token_id=0)
        assert bool(ev.correct[i]) == (gen[0, len(p_ids):].tolist() == a_ids)
        nll = torch.nn.functional.cross_entropy(logits, torch.tensor(a_ids))
        assert float(ev.answer_loss[i]) == pytest.approx(float(nll), abs=1e-4)


def test_finetune_errors(tiny_model):
    with pytest.raises(InputError, match="same length"):
        cl.finetune_lora(tiny_model, PROMPTS, ANSWERS[:3], ranks=[1, 1, 1], steps=1)
    with pytest.raises(InputError, match="`folder` is required"):
        cl.finetune_lora(tiny_model, PROMPTS, ANSWERS, ranks=[1, 1, 1], steps=1, checkpoints=[1])
    with pytest.raises(InputError, match=r"`checkpoint` must be an int in \[0, 2\]; got 5"):
        cl.finetune_lora(tiny_model, PROMPTS, ANSWERS, ranks=[1, 1, 1], steps=2,
                         checkpoints=[5], folder="x")


@pytest.mark.integration
def test_smollm2_allocation_matches_peft(smollm2):
    """SmolLM2 (30 layers): CircuitLoRA on 5 layers hits uniform rank-4 LoRA's count exactly."""
    uniform = cl.uniform_lora_ranks(smollm2, 4)
    target = cl.lora_parameter_count(smollm2, uniform)
    # per layer and rank: q 1152 + k 768 + v 768 + o 1152 + gate/up/down 3 x 2112
    assert target == 30 * 4 * (1152 + 768 + 768 + 1152 + 3 * 2112)
    alloc = cl.allocate_lora_ranks(smollm2, target, [3, 10, 20, 25, 29], r_other=2)
    ranks = dict(zip(alloc.layer.values.tolist(), alloc["rank"].values.tolist()))
    assert [ranks[c] for c in (3, 10, 20, 25, 29)] == [14] * 5   # 5 r_c + 25 x 2 = 30 x 4
    assert peft_trainable(smollm2, ranks) == target


def test_comparison_equal_params_and_summary_per_variant(tiny_model):
    train = (PROMPTS, ANSWERS)
    test = (PROMPTS[:6], ANSWERS[:6])
    comp = cl.circuit_lora_comparison(tiny_model, train, test, [1], rank=3, r_other=1,
                                      seeds=[0, 1], steps=2, batch_size=4, lr=1e-2)
    unit = 128 + 96 + 96 + 128 + 3 * 192
    assert comp.trainable_params.values.tolist() == [9 * unit, 9 * unit]
    assert comp["rank"].values.tolist() == [[3, 3, 3], [1, 7, 1]]
    # each run's held-out accuracy against a plain recomputation with a fresh fine-tune
    ds, peft_model = cl.finetune_lora(tiny_model, *train, ranks={0: 1, 1: 7, 2: 1}, steps=2,
                                      batch_size=4, lr=1e-2, seed=1)
    again = cl.answer_accuracy(tiny_model, *test, hf=peft_model)
    assert float(comp.loss.sel({"variant": "circuit-lora", "seed": 1})) == pytest.approx(
        again.attrs["loss"], abs=1e-5)
    summary = cl.comparison_summary(comp)
    assert summary["accuracy"]["lora"] == comp.accuracy.values[0].tolist()
    assert summary["accuracy"]["circuit-lora"] == comp.accuracy.values[1].tolist()
    assert summary["loss_std"]["lora"] == pytest.approx(float(np.std(comp.loss.values[0], ddof=1)))
    assert summary["critical"] == [1]


def test_cli_ranks_json_and_error(capsys):
    import json

    from explorer import cli

    assert cli.main(["circuit-lora-ranks", "--model", "tiny-llama", "--critical", "1",
                     "--rank", "4", "--r-other", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    unit = 128 + 96 + 96 + 128 + 3 * 192
    assert out["uniform_params"] == out["n_params"] == 12 * unit
    assert out["ranks"] == [2, 8, 2] and out["n_params_gap"] == 0
    assert cli.main(["circuit-lora-ranks", "--model", "tiny-llama", "--critical", "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "explorer: error: `critical layer` must be an int in [0, 2]; got 5."


def test_lr_schedule_hand_worked():
    # warm-up 2 of 5 steps, then linear decay: lr/2, lr, then lr * 3/3, 2/3, 1/3
    got = [cl.lr_at(k, lr=0.03, steps=5, warmup=2, schedule="linear") for k in range(1, 6)]
    assert got == pytest.approx([0.015, 0.03, 0.03, 0.02, 0.01])
    got = [cl.lr_at(k, lr=0.03, steps=5, warmup=2) for k in range(1, 6)]
    assert got == pytest.approx([0.015, 0.03, 0.03, 0.03, 0.03])
    assert [cl.lr_at(k, lr=0.03, steps=3) for k in (1, 3)] == [0.03, 0.03]
    with pytest.raises(InputError, match="`schedule` must be one of"):
        cl.lr_at(1, lr=0.1, steps=2, schedule="cosine")


def test_finetune_uses_the_scheduled_lr(tiny_model):
    """Step 1 of a 2-step warm-up at lr 0.02 trains exactly like one constant step at 0.01."""
    def lora_weights(**kw):
        ds, peft_model = cl.finetune_lora(tiny_model, PROMPTS, ANSWERS, ranks=[2, 2, 2], steps=1,
                                          batch_size=4, seed=3, **kw)
        return ds, {n: p.detach().clone() for n, p in peft_model.named_parameters() if "lora_" in n}

    ds, warm = lora_weights(lr=0.02, warmup=2, schedule="linear")
    _, half = lora_weights(lr=0.01)
    _, full = lora_weights(lr=0.02)
    assert ds["lr"].values.tolist() == [0.01]
    for name in warm:
        torch.testing.assert_close(warm[name], half[name], atol=0, rtol=0)
    assert any(not torch.equal(warm[n], full[n]) for n in warm if "lora_B" in n)


def test_select_lr_hand_made():
    lrs = [1e-3, 3e-3, 1e-2]
    assert cl.select_lr(lrs, [0.5, 0.7, 0.6], [1.0, 0.9, 0.8]) == 3e-3
    assert cl.select_lr(lrs, [0.5, 0.7, 0.7], [1.0, 0.9, 0.8]) == 1e-2   # tie -> lower loss
    assert cl.select_lr(lrs, [0.7, 0.7, 0.7], [0.8, 0.9, 0.8]) == 1e-3   # then smaller lr
    with pytest.raises(InputError, match="one length"):
        cl.select_lr(lrs, [0.5, 0.7], [1.0, 0.9, 0.8])


def test_cli_run_scores_checkpoints_with_eap_ig_by_default():
    """`explorer circuit-lora` scores checkpoint circuits the paper's way unless told."""
    from explorer import cli

    parser = cli.build_parser()
    assert parser.parse_args(["circuit-lora", "--model", "tiny-llama"]).method == "eap-ig"
    assert parser.parse_args(["circuit-lora", "--model", "tiny-llama",
                              "--method", "eap"]).method == "eap"
    with pytest.raises(Exception, match=r"argument --method: invalid choice: 'acdc'"):
        parser.parse_args(["circuit-lora", "--method", "acdc"])
