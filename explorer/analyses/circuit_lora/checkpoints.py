"""Reading a fine-tuning run's adapter checkpoints: the steps stored (`checkpoint_steps`), one
checkpoint as `explorer.lora.LoRAWeights` (`read_checkpoint`) or merged into a copy of the
model (`load_checkpoint`).
"""
from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

from explorer._checks import InputError, check_choice
from explorer.analyses.circuit_lora.adapters import _ALPHA_PER_RANK, _check_ranks, _lora_config, lora_modules
from explorer.lora import LoRAWeights
from explorer.models import Model, wrap_model

__all__ = ["checkpoint_steps", "load_checkpoint", "read_checkpoint"]


_RUN_FILE = "run.json"


def _read_run(folder: str | Path) -> tuple[Path, dict]:
    folder = Path(folder)
    run_file = folder / _RUN_FILE
    if not run_file.is_file():
        raise InputError(f"{str(folder)!r} is not a fine-tuning run folder (no {_RUN_FILE}).")
    return folder, json.loads(run_file.read_text())


def checkpoint_steps(folder: str | Path) -> list[int]:
    """The steps saved in a run folder, ascending."""
    folder, _ = _read_run(folder)
    return sorted(int(p.stem.split("-")[1]) for p in folder.glob("step-*.safetensors"))


def _checkpoint_file(model: Model, folder: str | Path, step: int) -> tuple[Path, dict[int, int]]:
    """The checkpoint file of ``step`` in a run of ``model``, and the run's ranks."""
    folder, run = _read_run(folder)
    saved = checkpoint_steps(folder)
    check_choice("step", step, saved)
    if run["model"] != model.spec.name or run.get("weights") != model.spec.weights:
        raise InputError(f"run {str(folder)!r} fine-tuned {run['model']!r} "
                         f"({run.get('weights')}); got {model.spec.name!r} ({model.spec.weights}).")
    return folder / f"step-{step}.safetensors", {int(k): int(v) for k, v in run["ranks"].items()}


def read_checkpoint(model: Model, folder: str | Path, step: int) -> LoRAWeights:
    """The adapters saved at ``step`` as `LoRAWeights`, nothing merged (local or remote model).

    Pass them to `circuits.edge_scores` (``lora=``) or `answer_accuracy` (``hf=``); this is
    how a remote model's checkpoints are analysed, since its weights cannot be copied.
    """
    from safetensors.torch import load_file

    path, ranks = _checkpoint_file(model, folder, step)
    ranks = _check_ranks(model, ranks)
    scaling = {n: _ALPHA_PER_RANK for layer, r in ranks.items() if r > 0
               for n, _, _ in lora_modules(model)[layer]}  # alpha / r = 2 for every rank
    return LoRAWeights.from_state_dict(load_file(str(path)), scaling,
                                       transposed=model.spec.family == "gpt2")


def load_checkpoint(model: Model, folder: str | Path, step: int) -> Model:
    """The model with the adapter of ``step`` merged into a copy of its weights.

    The result is a plain `Model` (same module tree as ``model``) that every analysis can
    trace; its spec name is ``"{name}+lora@{step}"`` and its weights id names the file.
    A remote model cannot be copied: use `read_checkpoint` and pass the adapters on.
    """
    from peft import get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    path, ranks = _checkpoint_file(model, folder, step)
    if model.remote:
        raise InputError("load_checkpoint merges the adapters into a copy of the weights, which "
                         "a remote (NDIF) model does not have here; use read_checkpoint() and "
                         "pass the adapters to edge_scores(lora=...) or answer_accuracy(hf=...).")
    hf = copy.deepcopy(model.hf)
    peft_model = get_peft_model(hf, _lora_config(model, ranks))
    result = set_peft_model_state_dict(peft_model, load_file(str(path)))
    if getattr(result, "unexpected_keys", None):
        raise InputError(f"{str(path)!r} holds weights this run's LoRA layout lacks: "
                         f"{result.unexpected_keys[:3]}.")
    merged = peft_model.merge_and_unload()
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return wrap_model(merged, model.tokenizer, name=f"{model.spec.name}+lora@{step}",
                      weights=f"{model.spec.weights}+lora:{digest}")
