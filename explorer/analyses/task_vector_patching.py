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
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import xarray as xr

from explorer._checks import InputError, check_choice, check_float, check_int
from explorer.analyses.icl_heads import ICLTask, _task, few_shot_accuracy, icl_prompts
from explorer.analyses.task_vectors import CITATION, last_token_residuals, null_task
from explorer.interventions import Steer
from explorer.trace import check_layers, provenance

__all__ = ["task_vector_patching", "task_vectors_by_layer", "PATCH_MODES", "VECTORS"]

PATCH_MODES = ("replace", "add")
VECTORS = ("task", "null", "none")
"""What is patched: the task's own mean vector, the Null task's, or nothing (baseline)."""


def task_vectors_by_layer(model: Any, task: ICLTask | str, *, n_prompts: int = 20,
                          n_shots: int = 4, seed: int = 0) -> np.ndarray:
    """The task vector of every layer: the mean last-token ``resid_post`` over ``n_prompts``
    ``n_shots``-shot prompts of ``task``, [layer, d_model] (float64)."""
    prompts, _ = icl_prompts(_task(task), n_prompts=n_prompts, n_shots=n_shots, seed=seed)
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
        unpatched accuracy, the same at every layer); ``few_shot_accuracy`` (task): the
        ``n_shots``-shot accuracy for reference.
    """
    tasks = [_task(t) for t in tasks]
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
    ds = xr.Dataset(
        {"accuracy": (("task", "vector", "layer"), acc),
         "few_shot_accuracy": (("task",), few)},
        coords={"task": [t.name for t in tasks], "vector": list(VECTORS), "layer": layers},
        attrs=provenance(model, method="task_vector_patching", n_prompts=n_prompts,
                         n_shots=n_shots, target_shots=target_shots, mode=mode, alpha=alpha,
                         seed=seed))
    ds.attrs["citation"] = CITATION
    return ds
