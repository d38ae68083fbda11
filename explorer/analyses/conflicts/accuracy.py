"""Greedy-answer accuracy over a split for the baseline, the single run and JuICE."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xarray as xr

from explorer._checks import InputError, check_choice, check_int
from explorer.analyses.conflicts.facts import (CITATION, Fact, Heads, METHODS, PROMPT_KINDS,
                                               Progress, answer_in, conflict_prompt)
from explorer.analyses.conflicts.runs import (_check_heads, _last_logits, greedy_answers,
                                              juice_logits, single_run_logits)
from explorer.models import Model
from explorer.trace import provenance

__all__ = ['conflict_accuracy']


def conflict_accuracy(model: Model, facts: Sequence[Fact], heads_plus: Heads = (),
                      heads_minus: Heads = (), *, alpha_l: float = 1.0, alpha_s: float = 1.0,
                      kinds: Sequence[str] = ("substitution", "coherent"),
                      methods: Sequence[str] = METHODS, n_new: int = 5, batch_size: int = 8,
                      progress: Progress = None) -> xr.Dataset:
    """Greedy answers for baseline / single-run scaling / JuICE dual run over a split.

    Returns
    -------
    xr.Dataset
        ``to_memory``, ``to_context`` (intervention, kind, fact) bool: the normalised
        memory / context answer is in the first five generated words; ``memory_accuracy``,
        ``context_accuracy`` (intervention, kind) their means; ``answer`` (intervention,
        kind, fact) the generated text. ``intervention`` holds the ``methods`` asked for.
    """
    facts = list(facts)
    if not facts:
        raise InputError("`facts` must hold at least one fact; got an empty list.")
    kinds = [check_choice("kind", x, PROMPT_KINDS) for x in kinds]
    methods = [check_choice("method", x, METHODS) for x in methods]
    batch_size = check_int("batch_size", batch_size, low=1)
    plus = _check_heads(model, heads_plus, "heads_plus")
    minus = _check_heads(model, heads_minus, "heads_minus")
    steps = {
        "baseline": lambda ps: _last_logits(model, ps),
        "single": lambda ps: single_run_logits(model, ps, plus, minus, alpha_l=alpha_l, alpha_s=alpha_s),
        "juice": lambda ps: juice_logits(model, ps, plus, minus, alpha_l=alpha_l, alpha_s=alpha_s),
    }
    shape = (len(methods), len(kinds), len(facts))
    answers = np.empty(shape, dtype=object)
    total = int(np.prod(shape))
    done = 0
    for mi, m in enumerate(methods):
        for ki, kind in enumerate(kinds):
            for b0 in range(0, len(facts), batch_size):
                chunk = facts[b0:b0 + batch_size]
                got = greedy_answers(model, [conflict_prompt(f, kind) for f in chunk],
                                     n_new=n_new, step=steps[m])
                answers[mi, ki, b0:b0 + len(chunk)] = got
                done += len(chunk)
                if progress:
                    progress(done, total)
    to_mem = np.vectorize(lambda a, f: answer_in(f.memory, a), otypes=[bool])(
        answers, np.array(facts, dtype=object)[None, None])
    to_ctx = np.vectorize(lambda a, f: answer_in(f.context, a), otypes=[bool])(
        answers, np.array(facts, dtype=object)[None, None])
    dims = ("intervention", "kind", "fact")
    ds = xr.Dataset(
        {"to_memory": (dims, to_mem), "to_context": (dims, to_ctx),
         "memory_accuracy": (dims[:2], to_mem.mean(-1)),
         "context_accuracy": (dims[:2], to_ctx.mean(-1)),
         "answer": (dims, answers.astype(str))},
        coords={"intervention": methods, "kind": kinds, "fact": np.arange(len(facts)),
                "subject": ("fact", [f.subject for f in facts])},
        attrs=provenance(model, method="conflict_accuracy", heads_plus=plus, heads_minus=minus,
                         alpha_l=alpha_l, alpha_s=alpha_s, n_new=n_new),
    )
    ds.attrs["citation"] = CITATION
    return ds
