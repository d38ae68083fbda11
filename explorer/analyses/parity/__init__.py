"""Streaming parity: a ReLU RNN trained from scratch, and the automaton it develops.

van Rossem & Saxe (ICML 2025) train a small-init recurrent network on the parity of
every binary string of length 1-10. Early in training the hidden states of different
strings spread apart (a tree that memorises the training set); later, states whose
continuations agree merge, and the network collapses onto a 2-state automaton. From then
on it computes parity for strings of any length ("infinite generalisation").

This module trains the network and stores its weights at checkpoints as one
``xarray.Dataset`` with a ``step`` dimension (`train_parity_rnn`), and reads it back at
any checkpoint: hidden states and their PCA (`parity_hidden_states`, `parity_hidden_pca`),
the automaton of merged states and its Hopcroft minimisation (`parity_automaton`), the
automaton size over training (`parity_automaton_sizes`), and accuracy on long strings
(`parity_long_accuracy`). `parity_run` caches a run in the `ActivationStore`; the seed-0
run with the default settings comes with the project (`SHIPPED_RUN`, float16 weights and
their analysis in one safetensors file), so it is read, not trained, on first use.

Modules
-------
* `network`: the RNN and its data (`ParityRNN`, `parity_strings`, `DEFAULTS`, `CITATION`).
* `training`: training and the run Dataset (`train_parity_rnn`, `parity_run_from_models`,
  `parity_model`).
* `states`: hidden states and their PCA (`parity_hidden_states`, `parity_hidden_pca`).
* `automaton`: the extracted automaton and its size over training (`parity_automaton`,
  `parity_automaton_sizes`).
* `generalisation`: accuracy on long strings (`parity_long_accuracy`).
* `runs`: cached and shipped runs and their analysis (`parity_run`, `SHIPPED_RUN`,
  `save_parity_run_safetensors`, `load_parity_run_safetensors`, `parity_analysis`,
  `stored_parity_analysis`, `analysis_summary`).
* `phase`: the phase diagram (`parity_phase_diagram`, `stored_parity_phase_diagram`,
  `phase_summary`).

Every public name (and the helpers `OPTIMIZERS`, `run_key_parts` and the private `_WEIGHTS` that
the command layer and benchmarks use) is re-exported here. To replace a function in a test,
patch it in the submodule that calls it (e.g. ``explorer.analyses.parity.runs.train_parity_rnn``
for `parity_run`): patching it here changes only this package's attribute.

References
----------
L. van Rossem and A. M. Saxe, "Algorithm Development in Neural Networks: Insights from
the Streaming Parity Task", ICML 2025.
"""
from __future__ import annotations

# the submodules' __all__ make up this package's
from explorer.analyses.parity import (  # noqa: I001
    network, training, states, automaton, generalisation, runs, phase,
)
from explorer.analyses.parity.automaton import parity_automaton, parity_automaton_sizes
from explorer.analyses.parity.generalisation import parity_long_accuracy
from explorer.analyses.parity.network import CITATION, DEFAULTS, LONG_LENGTHS, ParityRNN, parity_strings
from explorer.analyses.parity.phase import (
    PHASE_GAINS,
    PHASE_MAX_LENGTHS,
    parity_phase_diagram,
    phase_summary,
    stored_parity_phase_diagram,
)
from explorer.analyses.parity.runs import (
    _WEIGHTS,
    SHIPPED_RUN,
    run_key_parts,
    analysis_summary,
    load_parity_run_safetensors,
    parity_analysis,
    parity_run,
    save_parity_run_safetensors,
    stored_parity_analysis,
)
from explorer.analyses.parity.states import parity_hidden_pca, parity_hidden_states
from explorer.analyses.parity.training import (
    OPTIMIZERS,
    BATCHINGS,
    parity_model,
    parity_run_from_models,
    train_parity_rnn,
)

__all__ = [
    *network.__all__,
    *training.__all__,
    *states.__all__,
    *automaton.__all__,
    *generalisation.__all__,
    *runs.__all__,
    *phase.__all__,
]

# Not in __all__ but importable from here: `LONG_LENGTHS`, `PHASE_GAINS`, `PHASE_MAX_LENGTHS`,
# the helpers `OPTIMIZERS`, `run_key_parts` (explorer.commands.parity) and the private `_WEIGHTS`
# (benchmarks/dynamics_evidence.py), imported above.
