"""Methods that train or copy the weights refuse a remote (NDIF) model, before any work.

A remote model is a meta-device copy with no weights on this machine: training it would
fail deep inside torch, or train meta tensors. The model here is a tiny local one marked
remote, which is all these checks look at.
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


def test_unlearning_refuses_a_remote_model(remote_like):
    from explorer.analyses import unlearning

    facts = unlearning.load_attribute_facts()[:4]
    with pytest.raises(InputError, match="unlearning " + MESSAGE):
        unlearning.localized_finetune(remote_like, facts[:2], facts[2:], ["model.norm.weight"])
    with pytest.raises(InputError, match="unlearning " + MESSAGE):
        unlearning.unlearning_comparison(remote_like, facts[:2], facts[2:])


def test_perturbed_copy_refuses_a_remote_model(remote_like):
    from explorer.analyses.similarity import perturbed_copy

    with pytest.raises(InputError, match="a perturbed copy " + MESSAGE):
        perturbed_copy(remote_like, scale=0.02)
