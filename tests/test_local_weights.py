"""Methods that copy the weights refuse a remote (NDIF) model, before any work.

A remote model is a meta-device copy with no weights on this machine: copying or training
it here would fail deep inside torch, or train meta tensors. (Its training runs on the
server with the updates held apart: tests/test_remote.py.) The model here is a tiny local
one marked remote, which is all these checks look at.
"""
from __future__ import annotations

import pytest

from explorer import load_model
from explorer._checks import InputError

MESSAGE = r"trains or reads a copy of the weights on this machine, and a remote \(NDIF\) model"


@pytest.fixture()
def remote_like():
    model = load_model("tiny-llama")   # its own object: the shared fixture stays local
    model.remote = True
    return model


def test_lora_fine_tuning_refuses_a_remote_model(remote_like):
    from explorer.analyses import circuit_lora, icl_finetune

    with pytest.raises(InputError, match="LoRA fine-tuning " + MESSAGE):
        circuit_lora.lora_model(remote_like, {0: 2})
    with pytest.raises(InputError, match="LoRA fine-tuning " + MESSAGE):
        icl_finetune._copy_hf(remote_like)


def test_unlearning_on_a_remote_model_refuses_what_needs_a_second_copy(remote_like):
    """A remote model's unlearning holds the updates of linear maps apart (trained on the
    server, tests/test_remote.py); what would need every parameter copied there is refused
    before any work: a norm or embedding weight, method 'all', the relearning attack."""
    from explorer.analyses import unlearning

    facts = unlearning.load_attribute_facts()[:4]
    with pytest.raises(InputError, match="'model.norm.weight' is not the weight or bias of a "
                                         "linear map inside a layer"):
        unlearning.localized_finetune(remote_like, facts[:2], facts[2:], ["model.norm.weight"])
    with pytest.raises(InputError, match="relearning attack fine-tunes every parameter"):
        unlearning.unlearning_comparison(remote_like, facts[:2], facts[2:])
    with pytest.raises(InputError, match="method 'all' trains every parameter"):
        unlearning.unlearning_comparison(remote_like, facts[:2], facts[2:], relearn_steps=0)


def test_perturbed_copy_refuses_a_remote_model(remote_like):
    from explorer.analyses.similarity import perturbed_copy

    with pytest.raises(InputError, match="a perturbed copy " + MESSAGE):
        perturbed_copy(remote_like, scale=0.02)
