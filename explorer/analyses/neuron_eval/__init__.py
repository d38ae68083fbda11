"""Evaluating neuron explanations: the unified metrics and the two sanity checks.

A unit (a neuron, an ITDA atom, a probe) has activations a over a probing set D; an
explanation is a concept with presence c in [0, 1] per input. Every metric scores the
pair (a, c); they differ in how they binarise a (the top ceil(alpha |D|) inputs, or a
threshold) and what they compare. The metrics keep the orientation of the paper's code
(Oikarinen et al., 2025): **recall** = |B(a) ∩ c| / |B(a)| and **precision** =
|B(a) ∩ c| / |c|, with B(a) the binarised activations and c the binarised concept
(c >= 0.5).

The sanity checks perturb a correct explanation and ask whether the score drops:
*missing labels* keeps each positive with probability 0.5 (an over-specific
explanation); *extra labels* adds positives with probability |c| / (|D| - |c|), doubling
|c| in expectation (an over-general one). The score change is normalised by the metric's
range; "decrease accuracy" is the fraction of (unit, seed) cases where it fell by more than
epsilon; a metric passes when its decrease accuracy exceeds 90% on both tests.

References
----------
T. Oikarinen, G. Yan, T.-W. Weng, "Evaluating Neuron Explanations: A Unified Framework with
Sanity Checks", ICML 2025.

S. Bills et al., "Language models can explain neurons in language models", 2023
(the top-and-random correlation).

Modules
-------
* `metrics`: binarisation and the paired metrics (`paired_metrics`, `neuron_metrics`).
* `sanity`: the missing- and extra-labels checks (`sanity_checks`, `synthetic_sanity_checks`).
* `concepts`: token-level concepts (`token_concepts`, `token_identity_concepts`).
* `atoms`: ITDA atoms as units (`atom_probe_set`, `itda_atom_sanity_checks`).

Every public name is re-exported here; patch a function in the submodule that calls it.
"""
from __future__ import annotations

from explorer.analyses.neuron_eval.metrics import (METRICS, METRIC_RANGES, BINARIZATIONS,
                                                   binarize_activations, neuron_metrics,
                                                   paired_metrics, CITATION)
from explorer.analyses.neuron_eval.sanity import (missing_labels, extra_labels, sanity_checks,
                                                  synthetic_sanity_checks, SANITY_TESTS)
from explorer.analyses.neuron_eval.concepts import (token_concepts, token_identity_concepts,
                                                    NUMBER_WORDS)
from explorer.analyses.neuron_eval.atoms import (atom_probe_set, itda_atom_sanity_checks,
                                                 ATOM_EXPLANATIONS)

__all__ = [
    'METRICS',
    'METRIC_RANGES',
    'BINARIZATIONS',
    'binarize_activations',
    'neuron_metrics',
    'paired_metrics',
    'missing_labels',
    'extra_labels',
    'sanity_checks',
    'synthetic_sanity_checks',
    'token_concepts',
    'token_identity_concepts',
    'atom_probe_set',
    'itda_atom_sanity_checks',
    'ATOM_EXPLANATIONS',
    'NUMBER_WORDS',
    'CITATION',
    'SANITY_TESTS',
]
