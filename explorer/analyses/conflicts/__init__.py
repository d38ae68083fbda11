"""Knowledge conflicts: per-head context-vs-memory scores and the JuICE dual run.

Li, Chen & Tong, "Taming Knowledge Conflicts in Language Models" (JuICE, ICML 2025).
A fact is asked three ways: closed book (``clean``), after one sentence stating a false
value (``substitution``) and after a short passage supporting the false value
(``coherent``). The true value is the *memory* answer, the false one the *context* answer.

- `head_context_memory_scores`: each head's direct contribution to the memory and the
  context answer logit (its output through the linearised final norm and the unembedding)
  and its causal effect on their difference by zero ablation.
- `juice_head_selection`: score heads by additive scaling (``o_proj.out += alpha * h``)
  and keep the top K consistently helpful across the three prompt types.
- `juice_logits`: the dual run (run 1 caches the chosen heads' outputs; run 2 adds
  ``+alpha_l`` / ``-alpha_s`` times them); `single_run_logits` is the single-run baseline.
- `conflict_accuracy`: greedy answers over a split for baseline / single-run / JuICE.

Modules
-------
* `facts`: the facts, their prompts and answer matching.
* `runs`: logits under head edits, the dual and single runs, greedy answers, closed-book facts.
* `scores`: per-head context-vs-memory scores.
* `selection`: JuICE head selection and the alpha search.
* `accuracy`: accuracy over a split.

Every public name is re-exported here; patch a function in the submodule that calls it
(e.g. ``explorer.analyses.conflicts.runs.greedy_answers``).
"""
from __future__ import annotations

from explorer.analyses.conflicts.facts import (PROMPT_KINDS, DIRECTIONS, METHODS, ENHANCE_ALPHAS,
                                               SUPPRESS_ALPHAS, Fact, facts_path, load_facts,
                                               conflict_prompt, normalise_answer, answer_in,
                                               CITATION, Heads, Progress)
from explorer.analyses.conflicts.runs import (greedy_answers, closed_book_facts, JuiceFirstRun,
                                              juice_first_run, juice_logits, single_run_logits,
                                              answer_probabilities)
from explorer.analyses.conflicts.scores import head_context_memory_scores
from explorer.analyses.conflicts.selection import (juice_head_selection, selected_heads,
                                                   juice_alpha_search)
from explorer.analyses.conflicts.accuracy import conflict_accuracy

__all__ = [
    'PROMPT_KINDS',
    'DIRECTIONS',
    'METHODS',
    'ENHANCE_ALPHAS',
    'SUPPRESS_ALPHAS',
    'Fact',
    'facts_path',
    'load_facts',
    'conflict_prompt',
    'normalise_answer',
    'answer_in',
    'greedy_answers',
    'closed_book_facts',
    'head_context_memory_scores',
    'juice_head_selection',
    'selected_heads',
    'JuiceFirstRun',
    'juice_first_run',
    'juice_logits',
    'single_run_logits',
    'juice_alpha_search',
    'answer_probabilities',
    'conflict_accuracy',
    'CITATION',
    'Heads',
    'Progress',
]
