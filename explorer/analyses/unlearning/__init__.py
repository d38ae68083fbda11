"""Mechanistic unlearning: localize where a fact is looked up, then unlearn only there.

Guo, Syed, Sheshadri, Ewart & Dziugaite, "Mechanistic Unlearning: Robust Knowledge
Unlearning and Editing via Mechanistic Localization" (ICML 2025).
Facts are athlete -> sport (``datasets/unlearning/athlete_sport.json``), asked in the
trained format ("Fact: ... plays the sport of") and an unseen multiple-choice format.

- `attribute_probe_curve`: a logistic-regression probe for the sport on the last subject
  token after each layer (cross-validated); `fact_lookup_layers` takes the window of MLP
  layers where the probe accuracy rises most (fact lookup, FLU).
- `causal_trace`: noise the subject embeddings, restore one component's clean output (a
  layer's residual at one position, an MLP or an attention head at every position) and
  read p(answer).
- `attribution_patching`: the gradient of p(answer) in the corrupted run times the clean
  minus corrupted output of each MLP and head, a linear estimate of the restore effect.
- `localized_components`: the heads (``L17.H3``) and MLPs (``L17.MLP``) a localization
  trains for a parameter budget: fact lookup takes MLPs, output tracing the top-scoring
  heads and MLPs (Guo et al.'s selection).
- `localized_finetune`: gradient steps on a copy of the model restricted to the chosen
  parameters (a head: its slice of q_proj and o_proj), with a forget loss and retain terms
  on facts and on general text (`text_windows`); `unlearning_comparison` runs it for each
  localization with the same parameter budget and evaluates forget / multiple-choice /
  retain accuracy, perplexity on held-out text and a relearning attack.

Modules
-------
- `facts`: the facts, their prompts and accuracy (`load_attribute_facts`, `fact_prompt`,
  `format_accuracy`, `known_facts`, `split_facts`).
- `probe`: the fact-lookup probe (`attribute_probe_curve`, `fact_lookup_layers`).
- `localization`: causal tracing, attribution patching and the layers each method picks
  (`causal_trace`, `attribution_patching`, `localized_layers`).
- `components`: component names, the parameter entries each owns, budgets and the
  selection (`component_masks`, `localized_components`).
- `text`: general text windows, their loss and perplexity (`text_windows`, `text_perplexity`).
- `finetune`: training restricted to the chosen parameters (`component_parameters`,
  `localized_finetune`).
- `comparison`: the relearning attack and the comparison (`relearn`, `unlearning_comparison`).

Every public name (and `CITATION`, and the private `_finetune_by_deltas` the tests use) is
re-exported here. To replace a function in a test, patch it in the submodule that calls it.
"""
from __future__ import annotations

from explorer.analyses.unlearning.comparison import (
    METRICS,
    mean_interval,
    relearn,
    relearn_halves,
    trained_parameters,
    unlearning_comparison,
)
from explorer.analyses.unlearning.components import (
    component_label,
    component_masks,
    component_names,
    component_parameter_count,
    component_scores,
    localized_components,
    mlp_budget,
    parse_component,
    top_components,
)
from explorer.analyses.unlearning import facts
from explorer.analyses.unlearning.facts import (
    CITATION,
    FORMATS,
    METHODS,
    OBJECTIVES,
    AttributeFact,
    UnlearningCancelled,
    attribute_token_ids,
    candidate_predictions,
    fact_prompt,
    facts_path,
    format_accuracy,
    known_facts,
    load_attribute_facts,
    split_facts,
    subject_positions,
)
from explorer.analyses.unlearning.finetune import (
    _finetune_by_deltas,
    component_parameters,
    localized_finetune,
)
from explorer.analyses.unlearning.localization import (
    attribution_patching,
    causal_trace,
    localized_layers,
    top_layers,
)
from explorer.analyses.unlearning.probe import attribute_probe_curve, fact_lookup_layers, probe_accuracy
from explorer.analyses.unlearning.text import TEXT_SPLITS, text_loss, text_perplexity, text_windows

__all__ = [
    *facts.__all__,
    "METRICS",
    "probe_accuracy",
    "attribute_probe_curve",
    "fact_lookup_layers",
    "causal_trace",
    "attribution_patching",
    "top_layers",
    "localized_layers",
    "component_parameters",
    "component_names",
    "parse_component",
    "component_masks",
    "component_parameter_count",
    "component_scores",
    "component_label",
    "mlp_budget",
    "top_components",
    "localized_components",
    "trained_parameters",
    "TEXT_SPLITS",
    "text_windows",
    "text_loss",
    "text_perplexity",
    "localized_finetune",
    "mean_interval",
    "relearn_halves",
    "relearn",
    "unlearning_comparison",
]

# Not in __all__ but importable from here: `CITATION` and `_finetune_by_deltas` (tests), imported
# above.
