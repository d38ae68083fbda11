"""Hook-applied LoRA (explorer/lora.py) against peft on the same weights.

peft's LoRA layers are the independent computation: the starting draws, the forward with
trained matrices, the merged weight update, a training run and the circuits of a
checkpoint must all match what `LoRAWeights` gives without copying the model.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict

from explorer import lora as lora_module
from explorer._checks import InputError
from explorer.analyses import circuit_lora as cl
from explorer.analyses import circuits as ca
from explorer.lora import PEFT_PREFIX, LoRAWeights

PROMPTS = [f"{a} + {b} =" for a in range(4) for b in range(4)]
ANSWERS = [f" {a + b}" for a in range(4) for b in range(4)]
RANKS = {2: 4, 0: 2, 1: 3}  # not in layer order: the draws must still follow module order


def _peft_with_random_adapters(model, seed: int):
    """(random LoRAWeights on RANKS, a peft model on a copy holding the same adapters)."""
    lora = _random_state(cl.lora_weights_init(model, RANKS), seed=seed)
    peft_model = cl.lora_model(model, RANKS)
    set_peft_model_state_dict(peft_model, lora.state_dict())
    return lora, peft_model


def _hooked_logits(model, hooked, ids):
    """(logits of model.hf with ``hooked``'s hooks on, logits after they are removed)."""
    handles = hooked.hooks(model)
    try:
        on = model.hf(input_ids=ids).logits
    finally:
        lora_module.remove_hooks(handles)
    return on, model.hf(input_ids=ids).logits


def _random_state(weights: LoRAWeights, seed: int) -> LoRAWeights:
    g = torch.Generator().manual_seed(seed)
    return LoRAWeights({k: torch.randn(v.shape, generator=g) * 0.1 for k, v in weights.A.items()},
                       {k: torch.randn(v.shape, generator=g) * 0.1 for k, v in weights.B.items()},
                       weights.scaling, transposed=weights.transposed)


@pytest.mark.parametrize("family", ["tiny_model", "tiny_gpt2"])
def test_init_draws_what_peft_draws(family, request):
    model = request.getfixturevalue(family)
    peft_model = cl.lora_model(model, RANKS, seed=7)
    theirs = get_peft_model_state_dict(peft_model)
    mine = cl.lora_weights_init(model, RANKS, seed=7).state_dict()
    assert list(mine) == list(theirs)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert not torch.equal(mine[next(iter(mine))],
                           cl.lora_weights_init(model, RANKS, seed=8).state_dict()[next(iter(mine))])


@pytest.mark.parametrize("family", ["tiny_model", "tiny_gpt2"])
def test_hooks_add_what_peft_layers_add_and_are_removed(family, request):
    model = request.getfixturevalue(family)
    lora, peft_model = _peft_with_random_adapters(model, seed=1)
    ids = torch.randint(0, model.vocab_size, (2, 9))
    with torch.no_grad():
        base = model.hf(input_ids=ids).logits
        theirs = peft_model(input_ids=ids).logits
        mine, after = _hooked_logits(model, lora, ids)
    assert (theirs - base).abs().max() > 1e-3  # the adapters change the output
    torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)
    assert torch.equal(after, base)


@pytest.mark.parametrize("family", ["tiny_model", "tiny_gpt2"])
def test_delta_is_peft_merged_update(family, request):
    model = request.getfixturevalue(family)
    lora, peft_model = _peft_with_random_adapters(model, seed=2)
    merged = dict(peft_model.merge_and_unload().named_parameters())
    base = dict(model.hf.named_parameters())
    for name in lora.names():
        key = f"{name}.weight"
        torch.testing.assert_close(lora.delta(name), merged[key] - base[key], rtol=0, atol=1e-6)
    assert lora.delta("model.layers.0.nothing") is None


def test_state_dict_round_trip_and_bad_checkpoints(tiny_model):
    lora = _random_state(cl.lora_weights_init(tiny_model, RANKS), seed=3)
    back = LoRAWeights.from_state_dict(lora.state_dict(), lora.scaling)
    assert all(torch.equal(back.A[k], lora.A[k]) and torch.equal(back.B[k], lora.B[k])
               for k in lora.names())
    assert lora.n_params() == cl.lora_parameter_count(tiny_model, RANKS)
    state = lora.state_dict()
    with pytest.raises(InputError, match="is not a LoRA A or B matrix"):
        LoRAWeights.from_state_dict({**state, f"{PEFT_PREFIX}x.weight": torch.zeros(1)},
                                    lora.scaling)
    first = next(iter(state))
    with pytest.raises(InputError, match="does not match the run's layout"):
        LoRAWeights.from_state_dict({k: v for k, v in state.items() if k != first}, lora.scaling)


def test_training_by_hooks_is_peft_training(tiny_model, monkeypatch):
    """`finetune_lora`'s hook path (what a remote model runs, in jobs of STEPS_PER_JOB steps
    with the optimiser state carried across) gives peft's losses and adapters exactly, and
    leaves the model's weights and gradients untouched."""
    monkeypatch.setattr(lora_module, "STEPS_PER_JOB", 3)
    before = {k: v.clone() for k, v in tiny_model.hf.state_dict().items()}
    ds, peft_model = cl.finetune_lora(tiny_model, PROMPTS, ANSWERS, ranks=RANKS, steps=7,
                                      batch_size=4, lr=1e-2, seed=4, warmup=2, schedule="linear")
    pairs = cl.encode_answers(tiny_model, PROMPTS, ANSWERS)
    seen = []
    with torch.enable_grad():
        lora, losses, _, _ = cl.train_by_hooks(
            tiny_model, cl.lora_weights_init(tiny_model, RANKS, seed=4), pairs,
            cl.batch_draws(len(pairs), 4, 7, 4), ds["lr"].values.tolist(), [],
            lambda step, w: None, lambda done, total: seen.append(done))
    assert seen == [3, 6, 7]  # three jobs
    assert np.array_equal(np.array(losses), ds["loss"].values)
    theirs = get_peft_model_state_dict(peft_model)
    assert all(torch.equal(lora.state_dict()[k], theirs[k]) for k in theirs)
    for k, v in tiny_model.hf.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in tiny_model.hf.parameters())


@pytest.mark.parametrize("family", ["tiny_model", "tiny_gpt2"])
def test_circuits_and_accuracy_with_lora_match_the_merged_copy(family, request, tmp_path):
    """edge_scores(lora=...) on the shared model equals edge_scores on the merged copy
    (`load_checkpoint`) to float rounding; answer_accuracy with the adapters equals the peft
    model's."""
    model = request.getfixturevalue(family)
    task = ca.make_task("add", 6, seed=0)
    with torch.enable_grad():
        _, peft_model = cl.finetune_lora(model, task.clean, task.answer, ranks={0: 2, 1: 2},
                                         steps=4, batch_size=3, lr=5e-2, checkpoints=[4],
                                         folder=tmp_path)
        lora = cl.read_checkpoint(model, tmp_path, 4)
        merged = cl.load_checkpoint(model, tmp_path, 4)
        for method in ("eap", "eap-ig"):
            want = ca.edge_scores(merged, task, method=method, steps=3).score.values
            got = ca.edge_scores(model, task, method=method, steps=3, lora=lora).score.values
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3 * np.abs(want).max())
        base = ca.edge_scores(model, task).score.values
    assert np.abs(base - ca.edge_scores(merged, task).score.values).max() > 1e-3 * np.abs(base).max()
    mine = cl.answer_accuracy(model, task.clean, task.answer, hf=lora)
    theirs = cl.answer_accuracy(model, task.clean, task.answer, hf=peft_model)
    np.testing.assert_allclose(mine.answer_loss.values, theirs.answer_loss.values, rtol=1e-5)
    assert mine.correct.values.tolist() == theirs.correct.values.tolist()
    with pytest.raises(TypeError, match="`lora` must be explorer.lora.LoRAWeights"):
        ca.edge_scores(model, task, lora=peft_model)


@pytest.mark.parametrize("family", ["tiny_model", "tiny_gpt2"])
def test_weight_deltas_compute_as_the_updated_weights(family, request):
    """WeightDeltas' hooks give the forward of a copy whose chosen weights and biases are
    W + dW (GPT-2's Conv1D [d_in, d_out] included), and are removed afterwards."""
    import copy

    from explorer.analyses import unlearning as U
    from explorer.lora import WeightDeltas

    model = request.getfixturevalue(family)
    names = U.component_parameters(model, "fact_lookup", [0, 2])
    deltas = WeightDeltas.zeros(model, names)
    params = dict(model.hf.named_parameters())
    assert deltas.n_params() == sum(params[n].numel() for n in names)
    g = torch.Generator().manual_seed(0)
    deltas = WeightDeltas({n: torch.randn(d.shape, generator=g) * 0.05
                           for n, d in deltas.deltas.items()}, deltas.transposed)
    updated = copy.deepcopy(model.hf)
    with torch.no_grad():
        for n, p in updated.named_parameters():
            if n in deltas.deltas:
                p += deltas.deltas[n]
    ids = torch.randint(0, model.vocab_size, (2, 8))
    with torch.no_grad():
        want = updated(input_ids=ids).logits
        base = model.hf(input_ids=ids).logits
        got, after = _hooked_logits(model, deltas, ids)
        assert torch.equal(after, base)
    assert (want - base).abs().max() > 1e-3
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    embed = next(n for n, _ in model.hf.named_parameters() if "emb" in n or "wte" in n)
    with pytest.raises(InputError, match="not the weight or bias of a linear map inside a layer"):
        WeightDeltas.zeros(model, [embed])
