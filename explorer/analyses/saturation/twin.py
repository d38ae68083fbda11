"""The random-init control of the saturation analysis: `random_init_twin` builds the same
architecture with freshly initialised, seeded weights (the paper finds ordered saturation even
in untrained transformers).
"""
from __future__ import annotations

import copy
from typing import Any

import torch

from explorer._checks import check_int

__all__ = ["random_init_twin"]

def random_init_twin(model: Any, *, seed: int = 0) -> Any:
    """The same architecture with freshly initialised weights (Hugging Face's own init).

    The paper reports ordered saturation even in untrained transformers; this builds the
    control from ``model.hf.config``, seeded, and wraps it like any loaded model.
    """
    from transformers import AutoModelForCausalLM

    from explorer.models import wrap_model

    seed = check_int("seed", seed, low=0)
    config = copy.deepcopy(model.hf.config)
    dtype = next(model.hf.parameters()).dtype
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hf = AutoModelForCausalLM.from_config(config)
    hf.to(dtype)
    return wrap_model(hf, model.tokenizer, name=f"{model.spec.name}-random-init",
                      weights=f"random-init:seed={seed}")
