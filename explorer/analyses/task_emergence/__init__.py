"""Task-vector emergence: a small transformer learns a mixture of ICL tasks, checkpoint by checkpoint.

Han, Song, Gore & Agrawal (ICML 2025) train a GPT-2-style transformer from scratch on a
mixture of sparse linear regressions: every prompt's weight vector lies in one of a few
disjoint orthogonal subspaces (the latent task). As training proceeds the model's
representation of the query token comes to encode which subspace the prompt uses (task
decodability, TD: leave-one-out k-NN accuracy of the task label) and its in-context loss
falls towards the loss of regression restricted to the right subspace. This package trains
such a model and stores its weights at checkpoints (`train_task_emergence`: one
``xarray.Dataset`` with a ``step`` dimension; `save_run_safetensors` /
`load_run_safetensors` write and read them as safetensors), and measures TD per layer and
the ICL loss per task at every checkpoint (`task_emergence_analysis`), with the steps at
which each rises and their correlation over training (`emergence_summary`).

References
----------
S. Han, J. Song, J. Gore, P. Agrawal, "Emergence and Effectiveness of Task Vectors in
In-Context Learning: An Encoder-Decoder Perspective", ICML 2025.

Modules
-------
* `tasks`: the task subspaces and prompts.
* `model`: the transformer.
* `training`: training with checkpoints, the run, its safetensors file.
* `analysis`: task decodability and loss per task over training, rise steps.
* `runs`: stored and shipped runs and analyses.

Every public name is re-exported here; patch a function in the submodule that calls it
(e.g. ``explorer.analyses.task_emergence.runs.train_task_emergence``).
"""
from __future__ import annotations

from explorer.analyses.task_emergence.tasks import (CITATION, DEFAULTS, task_bases,
                                                    sample_task_prompts, ProgressCallback)
from explorer.analyses.task_emergence.model import TaskICLTransformer
from explorer.analyses.task_emergence.training import (train_task_emergence, task_emergence_model,
                                                       save_run_safetensors, load_run_safetensors)
from explorer.analyses.task_emergence.analysis import (query_residuals, task_emergence_analysis,
                                                       rise_step, emergence_summary)
from explorer.analyses.task_emergence.runs import (task_emergence_run,
                                                   stored_task_emergence_analysis,
                                                   SHIPPED_ANALYSIS, save_analysis_safetensors,
                                                   load_analysis_safetensors, default_analysis,
                                                   run_key_parts)

__all__ = [
    'CITATION',
    'DEFAULTS',
    'TaskICLTransformer',
    'task_bases',
    'sample_task_prompts',
    'train_task_emergence',
    'task_emergence_model',
    'query_residuals',
    'task_emergence_analysis',
    'rise_step',
    'emergence_summary',
    'save_run_safetensors',
    'load_run_safetensors',
    'task_emergence_run',
    'stored_task_emergence_analysis',
    'SHIPPED_ANALYSIS',
    'save_analysis_safetensors',
    'load_analysis_safetensors',
    'default_analysis',
    'ProgressCallback',
    'run_key_parts',
]
