"""The causal test of task vectors: does the encoded task *drive* the answer?

Han, Song, Gore & Agrawal (ICML 2025) read the task from the residual at the token before
the answer (task decodability, `explorer.analyses.task_vectors.task_decodability`) and then
test it by intervention: the mean activation of the correct task (a positive intervention)
or of the Null task (random outputs; the negative control) is written into prompts at one
layer, and exact-match accuracy is compared. `task_vector_patching` does this at every
layer: for each task, the task vector at layer ``l`` is the mean ``resid_post`` of layer
``l`` at the last token of ``n_shots``-shot prompts; it is patched into the last token of
``target_shots``-shot prompts of the same task (zero-shot by default, where the model has
no demonstration to read the task from), and the first answer token's argmax accuracy is
measured with the task's own vector, with the Null task's vector, and with no patch.

``mode="replace"`` sets the last token's residual to the vector (each prompt's own residual
is subtracted and the vector added, with `explorer.interventions.Steer` records restricted
to that prompt's row); ``mode="add"`` adds it (``alpha`` times).

`conflicting_task_patching` is the conflicting-task form of the test: task A's vector is
written into few-shot prompts of a *different* task B, whose demonstrations say B, and the
answer is scored against both A's and B's answer to B's query (a source x target matrix per
layer, with the Null task's vector and no patch as controls, and percentile bootstrap
intervals over prompts). A's answer to B's query comes from A's rule where the task is a
rule of its input (`ANSWER_RULES`: capitalize, uppercase, lowercase-first-letter, choose-*-of-3),
else from A's pairs when the query is among A's inputs; prompts where A's answer is
undefined or starts with the same token as B's are not scored for A.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import xarray as xr

from explorer._checks import InputError, check_choice, check_float, check_int
from explorer.analyses.icl_heads import (ICLTask, answer_token_ids, as_icl_task, few_shot_accuracy,
                                         icl_prompts, last_token_probs, wilson_interval)
from explorer.analyses.task_vectors import CITATION, last_token_residuals, null_task
from explorer.interventions import Steer
from explorer.trace import check_layers, provenance

__all__ = ["task_vector_patching", "task_vectors_by_layer", "conflicting_task_patching",
           "task_answer", "ANSWER_RULES", "PATCH_MODES", "VECTORS"]

PATCH_MODES = ("replace", "add")
VECTORS = ("task", "null", "none")
"""What is patched: the task's own mean vector, the Null task's, or nothing (baseline)."""


def task_vectors_by_layer(model: Any, task: ICLTask | str, *, n_prompts: int = 20,
                          n_shots: int = 4, seed: int = 0) -> np.ndarray:
    """The task vector of every layer: the mean last-token ``resid_post`` over ``n_prompts``
    ``n_shots``-shot prompts of ``task``, [layer, d_model] (float64)."""
    prompts, _ = icl_prompts(as_icl_task(task), n_prompts=n_prompts, n_shots=n_shots, seed=seed)
    return last_token_residuals(model, prompts).astype(np.float64).mean(0)


def _patch_edits(layer: int, vector: np.ndarray, own: np.ndarray | None,
                 alpha: float) -> list[Steer]:
    """Edits writing ``vector`` at the last token of every row: with ``own`` ([row, d], each
    row's residual there) the residual is replaced, else ``alpha * vector`` is added."""
    if own is None:
        return [Steer(layer, vector.astype(np.float32), alpha=alpha, positions=(-1,))]
    return [Steer(layer, (vector - h).astype(np.float32), positions=(-1,), prompts=(i,))
            for i, h in enumerate(own)]


def task_vector_patching(model: Any, tasks: Sequence[ICLTask | str], *,
                         layers: Sequence[int] | None = None, n_prompts: int = 20,
                         n_shots: int = 4, target_shots: int = 0, mode: str = "replace",
                         alpha: float = 1.0, seed: int = 0,
                         progress: Any = None) -> xr.Dataset:
    """Accuracy of ``target_shots``-shot prompts with each task's vector, the Null task's
    vector, or nothing patched at the last token, per layer (Han et al.'s causal test).

    Parameters
    ----------
    tasks : tasks or names of `explorer.analyses.icl_heads` tasks (at least one).
    layers : layers to patch (default all).
    n_prompts : prompts per task, for the vectors and for the evaluation (different seeds).
    n_shots : demonstrations in the prompts the vectors are averaged over.
    target_shots : demonstrations in the evaluated prompts (0: zero-shot).
    mode : ``"replace"`` (default) or ``"add"`` (``alpha`` times the vector).
    progress : optional ``progress(done, total)`` after each patched run.

    Returns
    -------
    xr.Dataset
        ``accuracy`` (task, vector, layer) with vector in ``task`` / ``null`` / ``none`` (the
        unpatched accuracy, the same at every layer); ``accuracy_low`` / ``accuracy_high``
        (task, vector, layer): its 95 % Wilson interval over the ``n_prompts`` prompts;
        ``few_shot_accuracy`` (task): the ``n_shots``-shot accuracy for reference.
    """
    tasks = [as_icl_task(t) for t in tasks]
    if not tasks:
        raise InputError("`tasks` must hold at least one task; got none.")
    mode = check_choice("mode", mode, PATCH_MODES)
    alpha = check_float("alpha", alpha)
    n_prompts = check_int("n_prompts", n_prompts, low=1)
    layers = check_layers(model, layers)
    null = task_vectors_by_layer(model, null_task(tasks, seed), n_prompts=n_prompts,
                                 n_shots=n_shots, seed=seed)
    acc = np.full((len(tasks), len(VECTORS), len(layers)), np.nan)
    few = np.full(len(tasks), np.nan)
    total, done = len(tasks) * len(layers) * 2, 0
    for ti, task in enumerate(tasks):
        vectors = task_vectors_by_layer(model, task, n_prompts=n_prompts, n_shots=n_shots,
                                        seed=seed)
        ref_prompts, ref_answers = icl_prompts(task, n_prompts=n_prompts, n_shots=n_shots,
                                               seed=seed)
        few[ti] = few_shot_accuracy(model, ref_prompts, ref_answers)
        prompts, answers = icl_prompts(task, n_prompts=n_prompts, n_shots=target_shots,
                                       seed=seed + 1)
        own = last_token_residuals(model, prompts).astype(np.float64) if mode == "replace" \
            else None
        acc[ti, VECTORS.index("none"), :] = few_shot_accuracy(model, prompts, answers)
        for li, layer in enumerate(layers):
            for name, vec in (("task", vectors[layer]), ("null", null[layer])):
                edits = _patch_edits(layer, vec, None if own is None else own[:, layer], alpha)
                acc[ti, VECTORS.index(name), li] = few_shot_accuracy(model, prompts, answers,
                                                                     edits)
                done += 1
                if progress is not None:
                    progress(done, total)
    interval = np.array([wilson_interval(float(round(a * n_prompts)), n_prompts, 0.95)
                         for a in acc.ravel()]).reshape(*acc.shape, 2)
    ds = xr.Dataset(
        {"accuracy": (("task", "vector", "layer"), acc),
         "accuracy_low": (("task", "vector", "layer"), interval[..., 0]),
         "accuracy_high": (("task", "vector", "layer"), interval[..., 1]),
         "few_shot_accuracy": (("task",), few)},
        coords={"task": [t.name for t in tasks], "vector": list(VECTORS), "layer": layers},
        attrs=provenance(model, method="task_vector_patching", n_prompts=n_prompts,
                         n_shots=n_shots, target_shots=target_shots, mode=mode, alpha=alpha,
                         seed=seed))
    ds.attrs["citation"] = CITATION
    return ds


# -- conflicting tasks ---------------------------------------------------------------------

def _choose(i: int):
    return lambda x: [w.strip() for w in x.split(",")][i]


#: Tasks whose output is a rule of the input, so that their answer to another task's query
#: is defined (the shipped pairs follow these rules; tests check it).
ANSWER_RULES = {
    "capitalize": lambda x: x[:1].upper() + x[1:],
    "uppercase": str.upper,
    "lowercase-first-letter": lambda x: x[:1].lower(),
    "choose-first-of-3": _choose(0),
    "choose-middle-of-3": _choose(1),
    "choose-last-of-3": _choose(2),
}


def task_answer(task: ICLTask | str, query: str) -> str | None:
    """``task``'s answer to ``query``: its rule (`ANSWER_RULES`) where it has one, else its
    output for ``query`` among its pairs, else None (undefined)."""
    task = as_icl_task(task)
    if task.name in ANSWER_RULES:
        if task.name.startswith("choose-") and len(query.split(",")) != 3:
            return None
        return ANSWER_RULES[task.name](query)
    return dict(task.pairs).get(query)


def _bootstrap_rate(hits: np.ndarray, mask: np.ndarray, n_boot: int, level: float,
                    rng: np.random.Generator) -> tuple[float, float, float]:
    """Mean of ``hits`` over the prompts in ``mask`` and its percentile bootstrap interval."""
    x = hits[mask].astype(float)
    if x.size == 0:
        return np.nan, np.nan, np.nan
    boot = x[rng.integers(0, x.size, size=(n_boot, x.size))].mean(1)
    tail = (1.0 - level) / 2.0
    return float(x.mean()), float(np.quantile(boot, tail)), float(np.quantile(boot, 1 - tail))


def conflicting_task_patching(model: Any, tasks: Sequence[ICLTask | str], *,
                              layers: Sequence[int] | None = None, n_prompts: int = 16,
                              n_shots: int = 4, mode: str = "replace", alpha: float = 1.0,
                              n_boot: int = 1000, level: float = 0.95, seed: int = 0,
                              progress: Any = None) -> xr.Dataset:
    """How often the answer follows the patched task A rather than the prompt's task B.

    For every target task B, ``n_prompts`` ``n_shots``-shot prompts of B are run with the
    last token's residual at layer l replaced by (``mode="replace"``) or increased by
    (``"add"``) the task vector of each source A (`task_vectors_by_layer`, other prompts:
    ``seed``), of the Null task, or of nothing; the argmax next token is compared with the
    first token of A's answer (`task_answer`) and of B's answer to B's query.

    Parameters
    ----------
    tasks : at least two tasks or task names; a source A is run on target B only where A's
        answer to some of B's queries is defined.
    layers : layers to patch (default all).
    n_prompts : prompts per task, for the vectors and for the evaluated prompts (seed + 1).
    n_shots : demonstrations in both.
    n_boot, level : the percentile bootstrap over prompts.
    progress : optional ``progress(done, total)`` after each patched run.

    Returns
    -------
    xr.Dataset
        ``follows_source`` (source, target, layer): the fraction of scored prompts (those
        where A's answer is defined and its first token differs from B's) whose answer is
        A's; ``follows_target``: the fraction of the same prompts answered with B's answer
        (for the ``null`` and ``none`` sources, of all B's prompts); ``*_low`` / ``*_high``
        their intervals; ``n_scored`` (source, target); ``prediction`` (source, target,
        layer, prompt) the argmax token (-1 where not run); ``source_answer`` (source,
        target, prompt) A's first answer token (-1 where not scored) and ``target_answer``
        (target, prompt). Sources are the tasks, then ``null`` and ``none``; the source
        equal to the target is the same task's own vector. attrs ``best_layer``: the layer
        with the highest mean ``follows_source`` over the scored source != target cells.
    """
    tasks = [as_icl_task(t) for t in tasks]
    if len(tasks) < 2:
        raise InputError(f"`tasks` must hold at least two tasks; got {len(tasks)}.")
    names = [t.name for t in tasks]
    if len(set(names)) != len(names):
        raise InputError(f"`tasks` must be distinct; got {names}.")
    mode = check_choice("mode", mode, PATCH_MODES)
    alpha = check_float("alpha", alpha)
    n_prompts = check_int("n_prompts", n_prompts, low=1)
    n_boot = check_int("n_boot", n_boot, low=1)
    level = check_float("level", level, low=0.0, high=1.0)
    layers = check_layers(model, layers)
    sources = names + ["null", "none"]
    vectors = {t.name: task_vectors_by_layer(model, t, n_prompts=n_prompts, n_shots=n_shots,
                                             seed=seed) for t in tasks}
    vectors["null"] = task_vectors_by_layer(model, null_task(tasks, seed), n_prompts=n_prompts,
                                            n_shots=n_shots, seed=seed)
    S, T, L = len(sources), len(tasks), len(layers)
    pred = np.full((S, T, L, n_prompts), -1, dtype=np.int64)
    src_ans = np.full((S, T, n_prompts), -1, dtype=np.int64)
    tgt_ans = np.zeros((T, n_prompts), dtype=np.int64)
    plan = []                                       # (target index, its prompts, sources run)
    for bi, target in enumerate(tasks):
        prompts, answers = icl_prompts(target, n_prompts=n_prompts, n_shots=n_shots,
                                       seed=seed + 1)
        queries = [p.rsplit("Q: ", 1)[1][:-len("\nA:")] for p in prompts]
        tgt_ans[bi] = answer_token_ids(model, answers)
        run = []
        for ai, source in enumerate(tasks):
            for j, q in enumerate(queries):
                a = task_answer(source, q)
                if a is not None:
                    tok = answer_token_ids(model, [a])[0]
                    if ai == bi or tok != tgt_ans[bi, j]:
                        src_ans[ai, bi, j] = tok
            if (src_ans[ai, bi] >= 0).any():
                run.append(ai)
        plan.append((bi, prompts, run + [sources.index("null")]))
    total = sum(len(r) for *_, r in plan) * L + T
    done = 0
    for bi, prompts, run in plan:
        batch = model.tokenize(list(prompts))
        pred[sources.index("none"), bi, :] = last_token_probs(model, batch).argmax(-1).numpy()
        done += 1
        own = last_token_residuals(model, prompts).astype(np.float64) if mode == "replace" \
            else None
        for ai in run:
            vec = vectors[sources[ai]]
            for li, layer in enumerate(layers):
                edits = _patch_edits(layer, vec[layer], None if own is None else own[:, layer],
                                     alpha)
                pred[ai, bi, li] = last_token_probs(model, batch, edits).argmax(-1).numpy()
                done += 1
                if progress is not None:
                    progress(done, total)
    rng = np.random.default_rng(seed)
    stats = {k: np.full((S, T, L), np.nan) for k in
             ("follows_source", "follows_source_low", "follows_source_high",
              "follows_target", "follows_target_low", "follows_target_high")}
    n_scored = np.zeros((S, T), dtype=np.int64)
    for ai in range(S):
        for bi in range(T):
            if (pred[ai, bi] < 0).all():
                continue
            mask = src_ans[ai, bi] >= 0 if ai < T else np.ones(n_prompts, bool)
            n_scored[ai, bi] = int(mask.sum())
            for li in range(L):
                p = pred[ai, bi, li]
                if ai < T:
                    (stats["follows_source"][ai, bi, li], stats["follows_source_low"][ai, bi, li],
                     stats["follows_source_high"][ai, bi, li]) = _bootstrap_rate(
                        p == src_ans[ai, bi], mask, n_boot, level, rng)
                (stats["follows_target"][ai, bi, li], stats["follows_target_low"][ai, bi, li],
                 stats["follows_target_high"][ai, bi, li]) = _bootstrap_rate(
                    p == tgt_ans[bi], mask, n_boot, level, rng)
    cross = stats["follows_source"][:T].copy()       # [source, target, layer]
    cross[np.arange(T), np.arange(T)] = np.nan
    cross = cross.reshape(T * T, L)
    counts = np.isfinite(cross).sum(0)
    mean_cross = np.where(counts > 0, np.nansum(cross, 0) / np.maximum(counts, 1), -np.inf)
    best = int(layers[int(np.argmax(mean_cross))]) if (counts > 0).any() else None
    dims = ("source", "target", "layer")
    ds = xr.Dataset(
        {**{k: (dims, v) for k, v in stats.items()},
         "n_scored": (("source", "target"), n_scored),
         "prediction": (("source", "target", "layer", "prompt"), pred),
         "source_answer": (("source", "target", "prompt"), src_ans),
         "target_answer": (("target", "prompt"), tgt_ans)},
        coords={"source": sources, "target": names, "layer": layers,
                "prompt": np.arange(n_prompts)},
        attrs=provenance(model, method="conflicting_task_patching", n_prompts=n_prompts,
                         n_shots=n_shots, mode=mode, alpha=alpha, n_boot=n_boot, level=level,
                         seed=seed))
    ds.attrs["best_layer"] = best
    ds.attrs["citation"] = CITATION
    return ds
