"""Ablation curves: few-shot accuracy and token-loss difference with the top p% heads of each
ranking (FV, induction, each without the other's top heads, random) mean-ablated."""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import xarray as xr

from explorer._checks import InputError, check_choice, check_float, check_int
from explorer.analyses.icl_heads.fv import task_mean_z
from explorer.analyses.icl_heads.generation_score import (ANSWER_TOKENS, ablated_generations,
                                                          parsed_f1)
from explorer.analyses.icl_heads.last_token import (ablated_last_token, last_token_cache,
                                                    last_token_problem)
from explorer.analyses.icl_heads.tasks import (CITATION, ICLTask, answer_token_ids, as_icl_task,
                                               icl_prompts, icl_task_names, last_token_probs)
from explorer.analyses.icl_heads.token_loss import corpus_token_ids, token_loss_difference
from explorer.interventions import Ablate
from explorer.models import Model
from explorer.trace import provenance

__all__ = [
    'RANKINGS', 'top_heads', 'check_head_scores', 'check_rankings', 'ranked_head_sets',
    'ablation_edits', 'few_shot_accuracy', 'MEAN_SOURCES', 'ABLATION_METHODS', 'ICL_SCORES',
    'cross_task_mean_z',
    'bootstrap_mean_accuracy', 'ablation_curves',
]


RANKINGS = ("fv", "induction", "fv_excl_induction", "induction_excl_fv", "random")


def top_heads(score: np.ndarray, fraction: float, *,
              exclude: Sequence[tuple[int, int]] = ()) -> list[tuple[int, int]]:
    """The top ``fraction`` of all heads by ``score`` [layer, head], skipping ``exclude``.

    The count is ``round(fraction * n_heads)`` (at least one when ``fraction > 0``), as a
    fraction of *all* heads; ties are broken by (layer, head) order.
    """
    fraction = check_float("fraction", fraction, low=0.0, high=1.0)
    score = np.asarray(score, dtype=float)
    n = score.size
    k = 0 if fraction == 0 else max(1, int(round(fraction * n)))
    if k == 0:
        return []
    excluded = set(map(tuple, exclude))
    order = np.argsort(-np.nan_to_num(score, nan=-np.inf).ravel(), kind="stable")
    picked = []
    for flat in order:
        lh = tuple(int(v) for v in np.unravel_index(flat, score.shape))
        if lh not in excluded:
            picked.append(lh)
        if len(picked) == k:
            break
    return picked


def check_head_scores(model: Model, induction: Any, fv: Any) -> tuple[np.ndarray, np.ndarray]:
    """The induction and FV scores as float arrays, both [layer, head] of ``model``.

    A pair: the two checked arrays, returned in the order they were given.
    """
    induction, fv = np.asarray(induction, float), np.asarray(fv, float)
    shape = (model.spec.n_layers, model.spec.n_heads)
    if induction.shape != shape or fv.shape != induction.shape:
        raise InputError(f"scores must be [layer, head] = {shape}; "
                         f"got {induction.shape} and {fv.shape}.")
    return induction, fv


def check_rankings(rankings: Any) -> list[str]:
    """A non-empty list of `RANKINGS` names (a bare string is refused)."""
    if isinstance(rankings, str) or not rankings:
        raise InputError(f"`rankings` must be a non-empty list of {list(RANKINGS)}; "
                         f"got {rankings!r}.")
    return [check_choice("ranking", r, RANKINGS) for r in rankings]


def ranked_head_sets(induction: np.ndarray, fv: np.ndarray, percents: Sequence[float], *,
                     rankings: Sequence[str] = RANKINGS, exclude_fraction: float = 0.02,
                     seed: int = 0) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """The heads ablated at each (ranking, percent) of Yin & Steinhardt's curves.

    Rankings: by FV score, by induction score, each after removing the other score's top
    ``exclude_fraction`` heads, and a random ranking (uniform scores from ``seed``). Keys
    are (index in ``rankings``, index in ``percents``); values `top_heads` lists.

    A dict keyed by (ranking index, percent index): the head lists the ablation runs loop
    over.
    """
    induction, fv = np.asarray(induction, float), np.asarray(fv, float)
    random_score = np.random.default_rng(seed).random(induction.shape)
    excl_ind = top_heads(induction, exclude_fraction)
    excl_fv = top_heads(fv, exclude_fraction)
    every = {"fv": (fv, ()), "induction": (induction, ()),
             "fv_excl_induction": (fv, excl_ind), "induction_excl_fv": (induction, excl_fv),
             "random": (random_score, ())}
    chosen = [every[check_choice("ranking", r, RANKINGS)] for r in rankings]
    return {(r, j): top_heads(score, p / 100.0, exclude=exclude)
            for r, (score, exclude) in enumerate(chosen) for j, p in enumerate(percents)}


def ablation_edits(heads: Sequence[tuple[int, int]], mean_z: np.ndarray | None, *,
                   positions: Sequence[int] | None = (-1,)) -> list[Ablate]:
    """Mean-ablation records: each head's output := ``mean_z[layer, head]`` at ``positions``.

    With ``mean_z`` None the heads are mean-ablated over the run's own real tokens at
    every position (``positions`` must then be None).
    """
    if mean_z is None:
        if positions is not None:
            raise InputError("`positions` needs `mean_z`; pass positions=None for a run mean.")
        return [Ablate(l, h, mode="mean") for l, h in heads]
    pos = None if positions is None else tuple(positions)
    return [Ablate(l, h, mode="mean", value=mean_z[l, h], positions=pos) for l, h in heads]


def few_shot_accuracy(model: Model, prompts: Sequence[str], answers: Sequence[str],
                      edits=()) -> float:
    """Fraction of prompts whose argmax next token is the answer's first token."""
    return _accuracy_and_answer_prob(model, prompts, answers, edits)[0]


def _accuracy_and_answer_prob(model: Model, prompts: Sequence[str], answers: Sequence[str],
                              edits=()) -> tuple[float, float]:
    """Argmax accuracy and mean probability of the answer's first token, one batched run."""
    correct, prob = _correct_and_answer_prob(model, prompts, answers, edits)
    return float(correct.mean()), float(prob.mean())


def _correct_and_answer_prob(model: Model, prompts: Sequence[str], answers: Sequence[str],
                             edits=()) -> tuple[np.ndarray, np.ndarray]:
    """Per prompt: whether the argmax next token is the answer's first token, and its probability."""
    batch = model.tokenize(list(prompts))
    probs = last_token_probs(model, batch, edits)                     # [prompt, vocab]
    target = torch.tensor(answer_token_ids(model, answers))
    rows = torch.arange(len(target))
    return ((probs.argmax(-1) == target).numpy().astype(float),
            probs[rows, target].float().numpy())


#: Where a mean-ablated head's replacement comes from (`ablation_curves`' ``mean_source``).
MEAN_SOURCES = ("cross-task", "per-task", "zero")


#: How `ablation_curves` scores an ablated prompt: ``first_token`` 1 when the argmax next token
#: is the answer's first token; ``f1`` the paper's score, the F1 of the answer parsed from 5
#: greedily generated tokens (`explorer.analyses.icl_heads.generation_score`).
ICL_SCORES = ("first_token", "f1")


#: How `ablation_curves` runs the ablated prompts: ``last_token`` only the last token over a
#: cache of the earlier positions (`ablated_last_token`), ``full`` every position.
ABLATION_METHODS = ("auto", "last_token", "full")


def cross_task_mean_z(model: Model, tasks: Sequence[ICLTask | str], *, n_prompts: int = 8,
                      n_shots: int = 5, seed: int = 0, edits=()) -> np.ndarray:
    """Every head's last-token output averaged over the per-task means of ``tasks``.

    This is the ablation value of Yin & Steinhardt (2025): one mean per head, the average
    of the task means ā^t over the tasks the FV scores come from (their
    ``mean_head_activations.pt``), so that ablating a head removes what it carries for
    the evaluated task instead of replaying that task's own mean. Returns [layer, head, d_head].
    """
    tasks = [as_icl_task(t) for t in tasks]
    if not tasks:
        raise InputError("`mean_tasks` must name at least one task.")
    means = [task_mean_z(model, icl_prompts(t, n_prompts=n_prompts, n_shots=n_shots,
                                            seed=seed)[0], edits) for t in tasks]
    return np.mean(means, axis=0)


def bootstrap_mean_accuracy(correct: np.ndarray, *, n_boot: int, level: float,
                             seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Percentile interval of the task-averaged accuracy, resampling prompts within each task
    (the (low, high) pair of arrays that `ablation_curves` stores as two variables).

    ``correct`` is [ranking, percent, task, prompt]; the same resampled prompts are used for
    every (ranking, percent), so differences between curves are paired.
    """
    rng = np.random.default_rng(seed)
    n_prompt = correct.shape[-1]
    idx = rng.integers(0, n_prompt, size=(n_boot, correct.shape[2], n_prompt))  # [boot, task, prompt]
    tasks = np.arange(correct.shape[2])[None, :, None]
    # [ranking, percent, boot, task, prompt] -> mean over prompts, then tasks
    resampled = correct[:, :, tasks, idx].mean(-1).mean(-1)
    tail = (1.0 - level) / 2.0
    return np.quantile(resampled, tail, axis=-1), np.quantile(resampled, 1.0 - tail, axis=-1)


def ablation_curves(model: Model, tasks: Sequence[ICLTask | str], induction: np.ndarray,
                    fv: np.ndarray, *, percents: Sequence[float] = (0, 1, 3, 5, 10, 20),
                    exclude_fraction: float = 0.02, n_prompts: int = 8, n_shots: int = 5,
                    loss_sequences: int = 4, loss_tokens: int = 96, seed: int = 0,
                    rankings: Sequence[str] = RANKINGS, mean_source: str = "cross-task",
                    mean_tasks: Sequence[ICLTask | str] | None = None, n_boot: int = 1000,
                    confidence_level: float = 0.95, method: str = "auto", max_rows: int = 512,
                    score: str = "first_token", edits=(), progress: Any = None) -> xr.Dataset:
    """Few-shot accuracy and token-loss difference with the top p% heads mean-ablated.

    Rankings (Yin & Steinhardt 2025): by FV score, by induction score, each after removing
    the other score's top ``exclude_fraction`` heads, and a random ranking (seeded). For
    the ICL accuracy a head's output at the last token (the one predicting the answer;
    their ``ablate.py`` replaces it there and at every generated token, and only the first
    answer token is scored here) is replaced according to ``mean_source``:

    - ``"cross-task"`` (the paper's ablation, default): one mean per head, the average of
      the per-task last-token means over ``mean_tasks``, from separate clean prompts
      (`cross_task_mean_z`). The paper averages over its FV-scoring tasks, which are
      disjoint from its evaluation tasks; the default ``mean_tasks`` (None) is likewise
      every shipped task that is not among ``tasks``;
    - ``"per-task"``: the mean over clean prompts of the task being evaluated. A
      function-vector head's task mean is its contribution to the function vector, so this
      ablation keeps much of what the paper removes;
    - ``"zero"``: zero.

    ``score`` (`ICL_SCORES`): ``"first_token"`` scores a prompt 1 when its argmax next token
    is the answer's first token, one forward per prompt; ``"f1"`` is the paper's score: 5
    tokens generated greedily with the heads ablated at the last prompt token and every
    generated token (`ablated_generations`), the first word run parsed and scored by F1
    against the answer (`parsed_f1`), five forwards per prompt (``method`` does not apply).

    ``method``: ``"last_token"`` runs only the last token of each ablated copy over keys and
    values of the earlier positions cached once per task (`ablated_last_token`; every
    (ranking, percent) is one copy, at most ``max_rows`` rows a run), ``"full"`` runs every
    position through `explorer.trace.run_with` with `Ablate` records; ``"auto"`` picks
    ``"last_token"`` where `last_token_problem` finds none. Both give the same numbers.
    ``edits`` (the workspace's intervention records) apply to every run, the means
    included: the curves of the edited model; they need ``method="full"`` (``"auto"``
    picks it).

    For the token-loss difference (on the shipped corpus) a head is replaced by its mean
    over the run's own tokens, at every position. ``rankings`` picks a subset of
    `RANKINGS`; the 0% point (nothing ablated) is run once and shared by every ranking.
    The interval on ``mean_accuracy`` is a percentile bootstrap over prompts (resampled
    within each task, ``n_boot`` draws, paired across rankings and percents).

    Returns
    -------
    xr.Dataset: ``accuracy`` and ``answer_prob`` (ranking, percent, task: the mean ``score``,
    argmax accuracy or F1, and the mean probability of the answer's first token), ``mean_accuracy`` and
    ``mean_answer_prob`` (ranking, percent), ``mean_accuracy_low`` / ``mean_accuracy_high``
    (ranking, percent: the bootstrap interval), ``correct`` (ranking, percent, task,
    prompt: 0/1 per prompt), ``token_loss_difference`` (ranking, percent), ``ablated``
    (ranking, percent): JSON list of the ablated (layer, head).
    """
    tasks = [as_icl_task(t) for t in tasks]
    if not tasks:
        raise InputError("`tasks` must name at least one evaluation task; got an empty list.")
    induction, fv = check_head_scores(model, induction, fv)
    spec = model.spec
    percents = [check_float("percent", p, low=0.0, high=100.0) for p in percents]
    names = check_rankings(rankings)
    mean_source = check_choice("mean_source", mean_source, MEAN_SOURCES)
    method = check_choice("method", method, ABLATION_METHODS)
    score = check_choice("score", score, ICL_SCORES)
    max_rows = check_int("max_rows", max_rows, low=1)
    n_boot = check_int("n_boot", n_boot, low=10)
    confidence_level = check_float("confidence_level", confidence_level, low=0.5, high=0.999)
    n_prompts = check_int("n_prompts", n_prompts, low=1)
    edits = list(edits)
    if score == "f1":
        if method == "last_token":
            raise InputError("ablation_curves(score='f1') generates 5 tokens per prompt, which "
                             "the last-token path cannot; use method='auto' or 'full'.")
        method = "generate"
    elif method == "auto":
        method = ("full" if last_token_problem(model) or model.remote or edits
                  else "last_token")
    elif method == "last_token" and edits:
        raise InputError("ablation_curves(method='last_token') runs the unedited model; "
                         "with `edits` use method='full' or 'auto'.")
    elif method == "last_token" and last_token_problem(model):
        raise InputError(f"ablation_curves(method='last_token') cannot run: "
                         f"{last_token_problem(model)}.")
    heads_at = ranked_head_sets(induction, fv, percents, rankings=names,
                                exclude_fraction=exclude_fraction, seed=seed)
    pool: list[Any] = []
    if mean_source == "cross-task":
        evaluated = {t.name for t in tasks}
        pool = ([n for n in icl_task_names() if n not in evaluated] if mean_tasks is None
                else list(mean_tasks))
        shared = cross_task_mean_z(model, pool, n_prompts=n_prompts, n_shots=n_shots,
                                   seed=seed + 2, edits=edits)
    elif mean_source == "zero":
        shared = np.zeros((spec.n_layers, spec.n_heads, spec.d_head))
    # the empty set (0 %) is run once per task
    sets = sorted({tuple(h) for h in heads_at.values()}, key=lambda h: (len(h), h))
    acc = np.zeros((len(names), len(percents), len(tasks)))
    prob = np.zeros_like(acc)
    correct = np.zeros((len(names), len(percents), len(tasks), n_prompts))
    total, done = len(tasks) * len(sets), 0
    for t, task in enumerate(tasks):
        prompts, answers = icl_prompts(task, n_prompts=n_prompts, n_shots=n_shots, seed=seed + 1)
        if mean_source == "per-task":
            means_from, _ = icl_prompts(task, n_prompts=n_prompts, n_shots=n_shots, seed=seed + 2)
            mz = task_mean_z(model, means_from, edits)
        else:
            mz = shared
        result: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        if method == "generate":
            first_ids = answer_token_ids(model, answers)
            for hs in sets:
                texts, probs = ablated_generations(model, prompts, list(hs), mz,
                                                   answer_ids=first_ids, edits=edits)
                result[hs] = (np.array([parsed_f1(t, a) for t, a in zip(texts, answers)]),
                              probs)
                done += 1
                if callable(progress):
                    progress(done, total)
        elif method == "last_token":
            batch = model.tokenize(list(prompts))
            prefix = last_token_cache(model, batch)
            target = torch.tensor(answer_token_ids(model, answers))
            per_run = max(1, max_rows // n_prompts)
            for start in range(0, len(sets), per_run):
                chunk = sets[start:start + per_run]
                hits, probs = ablated_last_token(model, prefix, chunk, mz, target)
                for i, hs in enumerate(chunk):
                    result[hs] = (hits[i].numpy().astype(float), probs[i].numpy())
                done += len(chunk)
                if callable(progress):
                    progress(done, total)
        else:
            for hs in sets:
                result[hs] = _correct_and_answer_prob(model, prompts, answers,
                                                      [*edits, *ablation_edits(list(hs), mz)])
                done += 1
                if callable(progress):
                    progress(done, total)
        for (r, j), heads in heads_at.items():
            hits, probs = result[tuple(heads)]
            correct[r, j, t] = hits
            acc[r, j, t], prob[r, j, t] = hits.mean(), probs.mean()
    loss_ids = corpus_token_ids(model, loss_sequences, loss_tokens)
    tld = np.zeros((len(names), len(percents)))
    ablated = np.empty((len(names), len(percents)), dtype=object)
    losses: dict[tuple, float] = {}
    for (r, j), heads in heads_at.items():
        ablated[r, j] = json.dumps(heads)
        key = tuple(heads)
        if key not in losses:
            losses[key] = token_loss_difference(
                model, loss_ids, [*edits, *ablation_edits(heads, None, positions=None)])
        tld[r, j] = losses[key]
    low, high = bootstrap_mean_accuracy(correct, n_boot=n_boot, level=confidence_level,
                                         seed=seed)
    return xr.Dataset(
        {"accuracy": (("ranking", "percent", "task"), acc),
         "mean_accuracy": (("ranking", "percent"), acc.mean(-1)),
         "mean_accuracy_low": (("ranking", "percent"), low),
         "mean_accuracy_high": (("ranking", "percent"), high),
         "correct": (("ranking", "percent", "task", "prompt"), correct),
         "answer_prob": (("ranking", "percent", "task"), prob),
         "mean_answer_prob": (("ranking", "percent"), prob.mean(-1)),
         "token_loss_difference": (("ranking", "percent"), tld),
         "ablated": (("ranking", "percent"), ablated.astype(str))},
        coords={"ranking": list(rankings), "percent": percents, "task": [t.name for t in tasks]},
        attrs=provenance(model, method="ablation_curves", percents=percents,
                         exclude_fraction=exclude_fraction, n_prompts=n_prompts,
                         n_shots=n_shots, loss_sequences=loss_sequences,
                         loss_tokens=loss_tokens, seed=seed, rankings=names,
                         mean_source=mean_source,
                         mean_tasks=None if mean_source != "cross-task" else
                         [as_icl_task(t).name for t in pool], n_boot=n_boot, ablation_method=method,
                         score=score, answer_tokens=ANSWER_TOKENS if score == "f1" else 1,
                         confidence_level=confidence_level, edits=edits, citation=CITATION))
