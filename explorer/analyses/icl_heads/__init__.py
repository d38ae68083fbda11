"""In-context learning heads: induction heads vs function-vector (FV) heads.

Yin & Steinhardt, "Which Attention Heads Matter for In-Context Learning?" (ICML 2025), with
the FV score of Todd et al., "Function Vectors in Large Language Models" (ICLR 2024):

- `induction_scores`: attention to the token after the previous occurrence on repeated
  random-token sequences.
- `fv_scores`: causal indirect effect of writing a head's task-mean output at the last token
  into shuffled-label few-shot prompts, averaged over tasks.
- `ablation_curves`: few-shot accuracy and token-loss difference when the top p% heads by
  each score (optionally excluding the other score's top heads, or random heads) are
  mean-ablated.

The scoring and ablation functions return an ``xr.Dataset`` whose attrs come from
`explorer.trace.provenance`; helpers return what they name (a list of heads, token ids, an
Edit list), with the reason in their docstrings.

Modules
-------
* `tasks`: the ICL tasks and their prompts.
* `induction`: induction scores.
* `last_token`: the key/value-prefix path for FV scores and ablations.
* `fv`: function-vector scores.
* `screen`: which tasks the model does (`task_screen`).
* `token_loss`: per-token loss and the token-loss difference.
* `ablation`: head rankings, ablation edits and curves.
* `generation_score`: the paper's ICL score (F1 of a parsed 5-token generation) under ablation.

Every public name is re-exported here; patch a function in the submodule that calls it
(e.g. ``explorer.analyses.icl_heads.last_token.LAST_TOKEN_FAMILIES``).
"""
from __future__ import annotations

from explorer.heads import ENGINE_FAMILIES
from explorer.analyses.icl_heads.tasks import (ICL_DIR, ICLTask, icl_task_names, load_icl_task,
                                               icl_prompts, answer_token_ids, CITATION,
                                               as_icl_task, last_token_probs)
from explorer.analyses.icl_heads.induction import (induction_pattern,
                                                   induction_score_from_patterns, induction_scores,
                                                   head_attention)
from explorer.analyses.icl_heads.last_token import (LAST_TOKEN_FAMILIES, last_token_problem,
                                                    last_token_cache, fv_last_token_probs,
                                                    ablated_last_token)
from explorer.analyses.icl_heads.fv import (task_mean_z, fv_patched_probs, fv_scores, FV_METHODS,
                                            heads_of_layers, head_chunks)
from explorer.analyses.icl_heads.screen import chance_accuracy, task_screen, wilson_interval
from explorer.analyses.icl_heads.token_loss import (corpus_token_ids, token_losses,
                                                    token_loss_difference)
from explorer.analyses.icl_heads.ablation import (top_heads, ranked_head_sets, check_head_scores,
                                                  check_rankings, ablation_edits,
                                                  few_shot_accuracy, ablation_curves, MEAN_SOURCES,
                                                  ABLATION_METHODS, cross_task_mean_z, RANKINGS,
                                                  bootstrap_mean_accuracy, ICL_SCORES)
from explorer.analyses.icl_heads.generation_score import (ANSWER_TOKENS, normalize_answer,
                                                          f1_score, parse_generation, parsed_f1,
                                                          ablated_generations)

__all__ = [
    'ICL_SCORES',
    'ANSWER_TOKENS',
    'normalize_answer',
    'f1_score',
    'parse_generation',
    'parsed_f1',
    'ablated_generations',
    'ICL_DIR',
    'ICLTask',
    'icl_task_names',
    'load_icl_task',
    'icl_prompts',
    'answer_token_ids',
    'induction_pattern',
    'induction_score_from_patterns',
    'induction_scores',
    'head_attention',
    'task_mean_z',
    'fv_patched_probs',
    'last_token_problem',
    'LAST_TOKEN_FAMILIES',
    'last_token_cache',
    'fv_last_token_probs',
    'fv_scores',
    'top_heads',
    'ranked_head_sets',
    'check_head_scores',
    'check_rankings',
    'ablation_edits',
    'corpus_token_ids',
    'few_shot_accuracy',
    'token_losses',
    'token_loss_difference',
    'ablation_curves',
    'MEAN_SOURCES',
    'ABLATION_METHODS',
    'cross_task_mean_z',
    'ablated_last_token',
    'chance_accuracy',
    'task_screen',
    'CITATION',
    'RANKINGS',
    'FV_METHODS',
    'as_icl_task',
    'last_token_probs',
    'heads_of_layers',
    'head_chunks',
    'wilson_interval',
    'bootstrap_mean_accuracy',
]
