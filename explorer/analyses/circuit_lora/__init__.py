"""Fine-tuning circuits and CircuitLoRA: how circuits change under LoRA, and ranks by that change.

Wang, Hu, Du, Cheng, Wang & Zou, "Towards Understanding Fine-Tuning Mechanisms of LLMs via
Circuit Analysis" (CircuitLoRA, ICML 2025). A model is fine-tuned with LoRA on an arithmetic
task and the adapter is saved at checkpoints (safetensors); the circuit of each checkpoint
comes from `explorer.analyses.circuits` (EAP / EAP-IG edge scores, top-n edges). Node sets
stay similar across fine-tuning while edge sets change more (`circuit_similarity`). The
per-layer edge change (`layer_edge_change`) picks critical layers, which CircuitLoRA gives a
higher LoRA rank than the rest at the same trainable-parameter count as uniform LoRA
(`allocate_lora_ranks`, `circuit_lora_comparison`).

- `lora_modules`, `lora_parameter_count`, `allocate_lora_ranks`: which linear modules get
  LoRA and how many trainable parameters a per-layer rank assignment costs.
- `finetune_lora`: LoRA training on (prompt, answer) pairs, loss on the answer tokens only,
  optional warm-up and linear decay (`lr_at`), adapter checkpoints as safetensors;
  `load_checkpoint` merges one into a copy of the model. `select_lr` picks a learning rate
  from a sweep by validation accuracy.
- `answer_accuracy`: exact-match accuracy of the greedy answer, answer-token accuracy, loss.
- `checkpoint_circuits`, `jaccard`, `circuit_similarity`: circuits per checkpoint and their
  node / edge Jaccard similarity.
- `layer_edge_change`, `critical_layers`, `circuit_lora_comparison`.

Modules
-------
- `adapters`: LoRA modules, ranks, parameter counts and the adapted model (`lora_modules`,
  `lora_parameter_count`, `uniform_lora_ranks`, `allocate_lora_ranks`, `lora_model`,
  `lora_weights_init`).
- `answers`: answer scoring (`answer_accuracy`).
- `training`: LoRA fine-tuning and learning-rate selection (`finetune_lora`, `lr_at`,
  `select_lr`).
- `checkpoints`: the adapter checkpoints of a run (`checkpoint_steps`, `read_checkpoint`,
  `load_checkpoint`).
- `circuit_change`: circuits per checkpoint, their similarity and per-layer change
  (`checkpoint_circuits`, `layer_change_noise_floor`, `circuit_similarity`,
  `layer_edge_change`, `critical_layers`).
- `comparison`: CircuitLoRA vs LoRA (`circuit_lora_comparison`).
- `study`: the whole study (`run_summary`, `comparison_summary`, `save_netcdf`).

Every public name (and the helpers `encode_answers`, `batch_draws`, `train_by_hooks` that
the benchmarks and tests use) is re-exported here. To replace a function in a test, patch it
in the submodule that calls it.
"""
from __future__ import annotations

# the submodules' __all__ make up this package's
from explorer.analyses.circuit_lora import (  # noqa: I001
    adapters, training, answers, checkpoints, circuit_change, study,
)
from explorer.analyses.circuit_lora.adapters import (
    CITATION,
    METHODS,
    allocate_lora_ranks,
    lora_model,
    lora_modules,
    lora_parameter_count,
    lora_weights_init,
    uniform_lora_ranks,
)
from explorer.analyses.circuit_lora.answers import encode_answers, answer_accuracy
from explorer.analyses.circuit_lora.checkpoints import checkpoint_steps, load_checkpoint, read_checkpoint
from explorer.analyses.circuit_lora.circuit_change import (
    CHECKPOINT_METHOD,
    CHECKPOINT_METRIC,
    checkpoint_circuits,
    circuit_similarity,
    critical_layers,
    jaccard,
    layer_change_noise_floor,
    layer_edge_change,
    node_layer,
)
from explorer.analyses.circuit_lora.comparison import circuit_lora_comparison
from explorer.analyses.circuit_lora.study import comparison_summary, run_summary, save_netcdf
from explorer.analyses.circuit_lora.training import (
    batch_draws,
    train_by_hooks,
    finetune_lora,
    lr_at,
    select_lr,
)

__all__ = [
    *adapters.__all__,
    *training.__all__,
    *answers.__all__,
    *checkpoints.__all__,
    *circuit_change.__all__,
    *study.__all__,
    "circuit_lora_comparison",
]

# Not in __all__ but importable from here: `encode_answers`, `batch_draws` and `train_by_hooks`
# (explorer.bench, tests/test_lora.py), imported above.
