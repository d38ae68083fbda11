"""Which tasks the model does: few-shot accuracy against chance with Wilson intervals."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xarray as xr

from explorer._checks import InputError, check_float, check_int
from explorer.analyses._intervals import wilson_interval
from explorer.analyses.icl_heads.ablation import _correct_and_answer_prob
from explorer.analyses.icl_heads.tasks import (CITATION, ICLTask, as_icl_task, icl_prompts,
                                               icl_task_names)
from explorer.models import Model
from explorer.trace import provenance

__all__ = ['chance_accuracy', 'wilson_interval', 'task_screen']


def chance_accuracy(task: ICLTask | str) -> float:
    """The first-token accuracy of guessing without reading the demonstrations.

    Where every answer is one of the query's comma-separated items (choose-first-of-3,
    animal-v-object-3), a uniform pick among the items: 1 / items. Otherwise the best
    constant answer: the share of the task's pairs whose answer is its most common one.
    """
    task = as_icl_task(task)
    items = [[w.strip() for w in x.split(",")] for x, _ in task.pairs]
    if all(len(i) > 1 and y.strip() in i for i, (_, y) in zip(items, task.pairs)):
        return float(np.mean([1.0 / len(i) for i in items]))
    outputs = [y for _, y in task.pairs]
    return max(outputs.count(y) for y in set(outputs)) / len(outputs)


def task_screen(model: Model, tasks: Sequence[ICLTask | str] | None = None, *,
                n_prompts: int = 32, n_shots: int = 5, seed: int = 100,
                confidence_level: float = 0.95, edits=()) -> xr.Dataset:
    """Few-shot first-token accuracy of each task against its chance level.

    A task is ``above_chance`` when the lower end of the Wilson interval of its accuracy
    over ``n_prompts`` prompts exceeds `chance_accuracy`. Use a ``seed`` other than the
    evaluation's, so that the tasks are picked on other prompts than they are scored on.

    Returns
    -------
    xr.Dataset over ``task``: ``accuracy``, ``accuracy_low`` / ``accuracy_high`` (Wilson),
    ``chance``, ``above_chance`` (bool).
    """
    tasks = [as_icl_task(t) for t in (icl_task_names() if tasks is None else tasks)]
    if not tasks:
        raise InputError("`tasks` must name at least one task; got an empty list.")
    n_prompts = check_int("n_prompts", n_prompts, low=1)
    level = check_float("confidence_level", confidence_level, low=0.5, high=0.999)
    acc, low, high, chance = [], [], [], []
    for task in tasks:
        prompts, answers = icl_prompts(task, n_prompts=n_prompts, n_shots=n_shots, seed=seed)
        hits, _ = _correct_and_answer_prob(model, prompts, answers, edits)
        lo, hi = wilson_interval(float(hits.sum()), n_prompts, level)
        acc.append(float(hits.mean()))
        low.append(lo)
        high.append(hi)
        chance.append(chance_accuracy(task))
    return xr.Dataset(
        {"accuracy": (("task",), acc), "accuracy_low": (("task",), low),
         "accuracy_high": (("task",), high), "chance": (("task",), chance),
         "above_chance": (("task",), np.array(low) > np.array(chance))},
        coords={"task": [t.name for t in tasks]},
        attrs=provenance(model, method="task_screen", n_prompts=n_prompts, n_shots=n_shots,
                         seed=seed, confidence_level=level, edits=list(edits),
                         citation=CITATION))
