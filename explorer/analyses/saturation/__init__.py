"""Saturation events: the layer at which each of a model's top-k tokens is fixed.

Lioubashevski et al. (ICML 2025) read every layer through the logit lens and find that a
transformer settles its top-1 token first, then the rank-2 token, then rank 3, and so on:
the *saturation layers* s_1 < s_2 < ... tend to come in rank order. This package measures
that over a text corpus and runs the paper's four follow-ups:

* `saturation_layers`: one trace + a chunked logit lens per batch of texts; per position
  the saturation layer of each of the final top-k tokens (cached in the activation store).
* `order_test`: strict Kendall tau (ties count as discordant) between rank and saturation
  layer per position, averaged, with a seeded permutation test.
* `task_probe`: logistic regression predicting the *task* (how many of the top tokens are
  already decided) from the hidden state, 5-fold CV, balanced accuracy per layer, against
  Gaussian random features and chance.
* `inject_residual`: write the residual of an early-saturating position into a
  late-saturating one at one layer; the new s_1 and whether the prediction changed.
* `early_exit`: exit at the first layer where the probe says "top-1 decided", vs softmax
  margin (p1 - p2 >= theta), vs consecutive-layer cosine (>= theta), vs the oracle s_1.

`saturation_analysis` runs all of it and returns one Dataset.

Modules
-------
* `corpus`: the shipped corpus and its cutting into prompts (`load_corpus`, `corpus_chunks`).
* `stats`: saturation layers from ranks, the position filter, the order test and the task
  probe; pure numpy, no model.
* `lens_pass`: the model pass (`saturation_layers`) and its cache in parts
  (`cache_saturation_parts`).
* `over_store`: the per-position numbers out of core with dask (`saturation_over_store`).
* `exits`: early-exit rules and their speed-ups (`early_exit`, `speedup_at_accuracy`).
* `intervention`: residual injection between positions (`intervention_pairs`, `inject_residual`).
* `analysis`: the whole analysis and its summary (`saturation_analysis`, `saturation_summary`).
* `twin`: the random-init control (`random_init_twin`).

Every public name (and the few private helpers the command layer and benchmarks use) is
re-exported here. To replace a function in a test, patch it in the submodule that calls it
(e.g. ``explorer.analyses.saturation.analysis.saturation_from_lens``): patching it here changes only
this package's attribute.

Conventions
-----------
* Layers are numbered 0..L-1: layer l is the residual stream after block l
  (``resid_post``), read through the final norm and unembedding. The last layer's lens
  *is* the model's output, so the "final" top-k tokens are the lens top-k at layer L-1.
* Ranks count from 0 and are *strict*: the rank of a token is the number of vocabulary
  tokens with a strictly larger logit. Two tied tokens share a rank, so under a tie the
  token that should be one place lower is not "at its rank".
* The saturation layer of rank j, ``s_j``, is the smallest layer l such that the final
  rank-j token t_j has rank exactly j at every layer from l to L-1.
  A token at its final rank at every layer has ``s_j = 0`` (the paper's top-k helper
  returns L there; its top-1 helper returns 0; we use 0 throughout). A token that is not
  at rank j even at the last layer (possible only under a tie) has ``s_j = -1``: never.
* Position filter: keep positions whose top-1 saturates within the first ``max_ratio``
  of the layers, i.e. ``s_1 + 1 <= max_ratio * L`` (the paper's s_1 <= 0.85 L with layers
  counted from 1).
* Order test: per position take (s_1..s_k), cut it before the first rank that saturates
  only at the last layer (s = L-1) or never; keep the position if at least ``min_ranks``
  (3) ranks remain.

References
----------
D. Lioubashevski, T. Schlank, G. Stanovsky, A. Goldstein, "Looking Beyond the Top-1:
Transformers Determine Top Tokens in Order", ICML 2025.
"""
from __future__ import annotations

from explorer.analyses.saturation.analysis import saturation_from_lens, saturation_analysis, saturation_summary
from explorer.analyses.saturation.corpus import CORPUS_DIR, corpus_chunks, load_corpus
from explorer.analyses.saturation.exits import (
    EXIT_ACCURACY_TARGETS,
    early_exit,
    exit_layers,
    exit_metrics,
    speedup_at_accuracy,
)
from explorer.analyses.saturation.intervention import (
    intervention_pair_defaults,
    inject_residual,
    intervention_pairs,
)
from explorer.analyses.saturation.lens_pass import (
    _join_parts,
    _lens_params,
    _part_key_parts,
    _sample_positions,
    cache_saturation_parts,
    saturation_layers,
)
from explorer.analyses.saturation.over_store import saturation_over_store
from explorer.analyses.saturation.stats import (
    CITATION,
    NEVER,
    kept_positions,
    order_test,
    saturation_from_ranks,
    strict_kendall_tau,
    task_labels,
    task_probe,
    tau_per_position,
)
from explorer.analyses.saturation.twin import random_init_twin

__all__ = [
    "CITATION",
    "NEVER",
    "CORPUS_DIR",
    "load_corpus",
    "corpus_chunks",
    "saturation_from_ranks",
    "kept_positions",
    "strict_kendall_tau",
    "order_test",
    "task_labels",
    "task_probe",
    "exit_layers",
    "exit_metrics",
    "early_exit",
    "EXIT_ACCURACY_TARGETS",
    "speedup_at_accuracy",
    "saturation_layers",
    "cache_saturation_parts",
    "intervention_pairs",
    "inject_residual",
    "saturation_analysis",
    "saturation_summary",
    "saturation_over_store",
    "tau_per_position",
    "random_init_twin",
]

# Not in __all__ but importable from here: the helpers `saturation_from_lens`, `intervention_pair_defaults`
# (explorer.commands.saturation) and `_join_parts`, `_lens_params`, `_part_key_parts`,
# `_sample_positions` (benchmarks/saturation_evidence.py), imported above.
