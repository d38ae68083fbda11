"""In-context linear regression with one layer of multi-head softmax attention.

He, Pan, Chen & Yang (ICML 2025) train ``TF(Z, z_q) = sum_h O_h V_h Z softmax(Z^T K_h^T Q_h z_q
/ sqrt(d+1))`` on prompts ``z_i = (x_i, y_i)``, ``y_i = beta^T x_i + noise``, and find that
training settles on a simple pattern: each head's key-query matrix has an x-block close to a
scaled identity ``omega_h I`` (and zero y-row/column), each head's output-value vector is
non-zero only at the y entry (``mu_h``), and the heads pair up with opposite signs so that
``sum_h mu_h ~ 0``. With such a pair the model computes (to first order in omega) one step of
*debiased* gradient descent, ``y_hat = (2 omega mu / L) sum_i y_i (x_i - x_bar)^T x_q``; a
single head cannot cancel the ``y_bar`` term and is measurably worse.

This package trains the model and keeps checkpoints (`train_linear_icl`), measures the
patterns over training (`attention_patterns`), computes the predictors the patterns imply
and the baselines (`debiased_gd_predict`, `gd_predict`, `ridge_predict`, `bayes_risk`,
`bayes_risk_asymptotic`, in `explorer.analyses.linear_icl_theory` and re-exported here), and
puts it together (`linear_icl_analysis`).

References
----------
J. He, X. Pan, S. Chen and Z. Yang, "In-Context Linear Regression Demystified: Training
Dynamics and Mechanistic Interpretability of Multi-Head Softmax Attention", ICML 2025.

Modules
-------
* `model`: the attention model, its setting and its prompts.
* `training`: training with checkpoints, the run Dataset, a checkpoint's model.
* `patterns`: the head patterns over training.
* `analysis`: losses by context length against the predictors; the whole analysis.
* `runs`: shipped and stored runs and analyses, the summary over head counts.

Every public name is re-exported here; patch a function in the submodule that calls it.
"""
from __future__ import annotations

from explorer.analyses.linear_icl_theory import (approximate_loss, bayes_risk,
                                                 bayes_risk_asymptotic, debiased_gd_predict,
                                                 fit_step_size, gd_predict, optimal_mu,
                                                 pattern_predict, ridge_predict)
from explorer.analyses.linear_icl.model import (CITATION, DEFAULTS, ICLAttention,
                                                sample_regression_prompts, TEST_LENGTHS,
                                                ProgressCallback)
from explorer.analyses.linear_icl.training import train_linear_icl, icl_model, icl_run_from_models
from explorer.analyses.linear_icl.patterns import (attention_patterns, pattern_reached,
                                                   PATTERN_THRESHOLDS)
from explorer.analyses.linear_icl.analysis import icl_losses_by_length, linear_icl_analysis
from explorer.analyses.linear_icl.runs import (linear_icl_run, stored_linear_icl_analysis,
                                               SHIPPED_RUNS, SHIPPED_HEADS,
                                               save_linear_icl_runs_safetensors,
                                               load_linear_icl_runs_safetensors, analysis_summary,
                                               run_key_parts)

__all__ = [
    'CITATION',
    'DEFAULTS',
    'ICLAttention',
    'sample_regression_prompts',
    'train_linear_icl',
    'icl_model',
    'attention_patterns',
    'pattern_reached',
    'PATTERN_THRESHOLDS',
    'pattern_predict',
    'gd_predict',
    'debiased_gd_predict',
    'ridge_predict',
    'fit_step_size',
    'bayes_risk',
    'bayes_risk_asymptotic',
    'optimal_mu',
    'approximate_loss',
    'icl_losses_by_length',
    'linear_icl_analysis',
    'linear_icl_run',
    'stored_linear_icl_analysis',
    'SHIPPED_RUNS',
    'SHIPPED_HEADS',
    'save_linear_icl_runs_safetensors',
    'load_linear_icl_runs_safetensors',
    'analysis_summary',
    'icl_run_from_models',
    'TEST_LENGTHS',
    'ProgressCallback',
    'run_key_parts',
]
