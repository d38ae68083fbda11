"""Function vectors and task decodability.

- `function_vector` / `function_vector_accuracy`: the sum of the top FV heads' task-mean
  outputs (Todd et al., "Function Vectors in Large Language Models", ICLR 2024), added to
  the residual stream of zero-shot prompts at one layer (L/3 by default, as in Yin &
  Steinhardt, ICML 2025).
- `task_decodability`: leave-one-out k-NN (k=10) task classification from the residual at
  the token before the answer, per layer, and its relation to ICL accuracy across tasks
  (Han, Song, Gore, Agrawal, "Emergence and Effectiveness of Task Vectors in In-Context
  Learning: An Encoder-Decoder Perspective", ICML 2025).
- `decodability_over_store`: the same k-NN TD per layer from cached last-token residuals,
  out of core with dask, one task per layer (``task_decodability(store=..., scheduler=...)``).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import xarray as xr

from explorer._checks import InputError, check_float, check_int
from explorer.analyses.icl_heads import (
    ICLTask,
    as_icl_task,
    answer_token_ids,
    few_shot_accuracy,
    icl_prompts,
    task_mean_z,
    top_heads,
)
from explorer.interventions import Steer
from explorer.models import Model
from explorer.trace import provenance, run_on_weights, trace

__all__ = [
    "function_vector",
    "function_vector_accuracy",
    "knn_loo_predictions",
    "knn_loo_accuracy",
    "r_squared",
    "null_task",
    "last_token_residuals",
    "task_decodability",
    "decodability_over_store",
]

CITATION = ("E. Todd et al., \"Function Vectors in Large Language Models\", ICLR 2024; "
            "S. Han, J. Song, J. Gore, P. Agrawal, \"Emergence and Effectiveness of Task "
            "Vectors in In-Context Learning: An Encoder-Decoder Perspective\", ICML 2025.")


# -- function vectors ----------------------------------------------------------------------

def function_vector(model: Model, mean_z: np.ndarray, heads: Sequence[tuple[int, int]]) -> np.ndarray:
    """Sum over ``heads`` of each head's task-mean output written through its slice of W_O.

    ``mean_z`` is [layer, head, d_head] (see `explorer.analyses.icl_heads.task_mean_z`);
    the result is a d_model vector (no output-projection bias). On a remote model the heads'
    W_O slices are read on the server (`explorer.trace.run_on_weights`).
    """
    heads = [(int(layer), int(head)) for layer, head in heads]
    vec = np.zeros(model.spec.d_model)
    if not heads:
        return vec
    w_o = run_on_weights(model, _head_w_o, heads).double().numpy()  # [head, d_head, d_model]
    for (layer, head), w in zip(heads, w_o):
        vec += np.asarray(mean_z[layer, head], dtype=np.float64) @ w
    return vec


def _head_w_o(weights: Any, heads: list[tuple[int, int]]) -> Any:
    """[len(heads), d_head, d_model]: each head's slice of its layer's output projection."""
    import torch

    return torch.stack([weights.W_O(layer)[head].detach() for layer, head in heads])


def function_vector_accuracy(model: Model, tasks: Sequence[ICLTask | str], fv_score: np.ndarray,
                             *, layer: int | None = None, top_fraction: float = 0.02,
                             alpha: float = 1.0, n_prompts: int = 16, n_shots: int = 5,
                             seed: int = 0) -> xr.Dataset:
    """Zero-shot accuracy per task with and without the task's function vector.

    The vector sums the top ``top_fraction`` heads by ``fv_score`` [layer, head], each
    head's mean last-token output over ``n_prompts`` clean ``n_shots``-shot prompts; it is
    added (times ``alpha``) to ``resid_post`` of ``layer`` (default n_layers // 3) at the
    last token of zero-shot prompts ``"Q: x\\nA:"``.

    Returns
    -------
    xr.Dataset: ``zero_shot_accuracy``, ``fv_accuracy``, ``few_shot_accuracy`` (task),
    ``function_vector`` (task, d_model); attrs carry ``layer`` and the heads used.
    """
    tasks = [as_icl_task(t) for t in tasks]
    spec = model.spec
    layer = spec.n_layers // 3 if layer is None else model.check_layer(layer)
    alpha = check_float("alpha", alpha)
    heads = top_heads(np.asarray(fv_score, float), top_fraction)
    zs, fa, fs, vecs = [], [], [], []
    for task in tasks:
        clean, answers = icl_prompts(task, n_prompts=n_prompts, n_shots=n_shots, seed=seed)
        vec = function_vector(model, task_mean_z(model, clean), heads)
        queries, q_answers = icl_prompts(task, n_prompts=n_prompts, n_shots=0, seed=seed + 1)
        steer = Steer(layer, vec, alpha=alpha, positions=(-1,))
        zs.append(few_shot_accuracy(model, queries, q_answers))
        fa.append(few_shot_accuracy(model, queries, q_answers, [steer]))
        fs.append(few_shot_accuracy(model, clean, answers))
        vecs.append(vec)
    return xr.Dataset(
        {"zero_shot_accuracy": (("task",), np.array(zs)),
         "fv_accuracy": (("task",), np.array(fa)),
         "few_shot_accuracy": (("task",), np.array(fs)),
         "function_vector": (("task", "d_model"), np.array(vecs))},
        coords={"task": [t.name for t in tasks]},
        attrs={**provenance(model, method="function_vector_accuracy", layer=layer,
                            top_fraction=top_fraction, alpha=alpha, n_prompts=n_prompts,
                            n_shots=n_shots, seed=seed, citation=CITATION),
               "layer": layer, "heads": [list(h) for h in heads]})


# -- task decodability ---------------------------------------------------------------------

def knn_loo_predictions(x: np.ndarray, y: Sequence[Any], k: int = 10) -> np.ndarray:
    """Leave-one-out k-NN majority vote (Euclidean) for every row of ``x`` [n, d].

    Each point is classified by its ``k`` nearest *other* points; a tie in votes goes to
    the tied label whose nearest member is closest.
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y)
    n = len(x)
    k = check_int("k", k, low=1, high=max(1, n - 1))
    if n < 2:
        raise InputError(f"k-NN needs at least 2 points; got {n}.")
    sq = (x * x).sum(1)
    d = sq[:, None] + sq[None, :] - 2 * x @ x.T
    np.fill_diagonal(d, np.inf)
    order = np.argsort(d, axis=1, kind="stable")[:, :k]        # [n, k] nearest first
    pred = np.empty(n, dtype=y.dtype)
    for i in range(n):
        labels = y[order[i]]
        values, counts = np.unique(labels, return_counts=True)
        best = set(values[counts == counts.max()].tolist())
        pred[i] = next(lab for lab in labels if lab in best)   # closest among the tied
    return pred


def knn_loo_accuracy(x: np.ndarray, y: Sequence[Any], k: int = 10) -> float:
    """Fraction of points whose leave-one-out k-NN vote is their own label (the TD)."""
    return float(np.mean(knn_loo_predictions(x, y, k) == np.asarray(y)))


def r_squared(x: Sequence[float], y: Sequence[float]) -> float:
    """R^2 of the least-squares line y ~ a + b x (the squared Pearson correlation)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) < 3 or np.std(x) == 0 or np.std(y) == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1] ** 2)


def null_task(tasks: Sequence[ICLTask], seed: int = 0) -> ICLTask:
    """The Null task of Han et al.: inputs of the tasks paired with random outputs."""
    rng = np.random.default_rng(seed)
    inputs = [x for t in tasks for x, _ in t.pairs]
    outputs = [y for t in tasks for _, y in t.pairs]
    perm = rng.permutation(len(outputs))
    pairs = tuple((inputs[i], outputs[j]) for i, j in enumerate(perm))
    return ICLTask("null", pairs, "inputs paired with random outputs")


def last_token_residuals(model: Model, prompts: Sequence[str], *,
                         batch_size: int = 16) -> np.ndarray:
    """``resid_post`` of every layer at each prompt's last token: [prompt, layer, d_model]."""
    return trace(model, list(prompts), sites="resid_post", positions=[-1],
                 batch_size=batch_size, progress=False).resid_post.values[:, 0]


def _pca2(x: np.ndarray) -> np.ndarray:
    x = x - x.mean(0)
    _, _, vt = np.linalg.svd(x, full_matrices=False)
    return x @ vt[:2].T


def task_decodability(model: Model, tasks: Sequence[ICLTask | str], *, n_prompts: int = 20,
                      n_shots: int = 4, k: int = 10, include_null: bool = True,
                      seed: int = 0, store: Any = None, scheduler: str | None = None,
                      lora: Any = None) -> xr.Dataset:
    """Task decodability (TD) per layer and its relation to ICL accuracy (Han et al. 2025).

    For every task, ``n_prompts`` few-shot prompts are run; the residual (``resid_post``)
    at the last prompt token (the one before the answer) is classified by leave-one-out
    k-NN over all prompts of all tasks. TD is the fraction classified correctly.

    With ``store`` (an `explorer.store.ActivationStore`) the last-token residuals are cached
    there, keyed by the model's provenance and the prompts; with ``scheduler`` ("threads",
    "synchronous", "local" or a scheduler address) TD is computed with dask, one task per
    layer (`decodability_over_store`), over the cached entry opened lazily (or over the
    residuals in memory without ``store``). The numbers are the same on every path. The key
    does not see weights changed in place (a fine-tuned copy with the same spec): pass no
    ``store`` for such a model.

    ``lora`` (`explorer.lora.LoRAWeights`, e.g. `icl_finetune.LayerLoRA`'s ``lora_``) measures
    the model with those adapters applied by hooks, in one job where the weights are
    (`explorer.trace.run_on_weights`: a remote model's on the server). The prompts are
    batched as without adapters, so zero adapters give the plain numbers exactly. It takes
    no ``store``.

    Returns
    -------
    xr.Dataset: ``td`` (layer), ``td_per_task`` (layer, task), ``icl_accuracy`` (task,
    the Null task excluded: NaN), ``projection`` (layer, prompt, component) a 2-D PCA of
    the residuals, ``prompt_task`` (prompt); attrs ``best_layer`` and ``td_accuracy_r2``
    (R^2 of each real task's TD, averaged over layers, against its ICL accuracy).
    """
    tasks = [as_icl_task(t) for t in tasks]
    if len(tasks) < 2:
        raise InputError(f"task decodability needs at least 2 tasks; got {len(tasks)}.")
    if scheduler is not None:
        from explorer.distributed import check_scheduler

        scheduler = check_scheduler(scheduler)
    if lora is not None and store is not None:
        raise InputError("task_decodability with `lora` takes no `store` (the cache key does "
                         "not see adapters); pass one or the other.")
    if include_null:
        tasks = tasks + [null_task(tasks, seed)]
    prompts, labels, acc, per_task = [], [], [], []
    for task in tasks:
        p, a = icl_prompts(task, n_prompts=n_prompts, n_shots=n_shots, seed=seed)
        prompts += p
        labels += [task.name] * len(p)
        per_task.append((p, a))
        if lora is None:
            acc.append(np.nan if task.name == "null" and include_null
                       else few_shot_accuracy(model, p, a))
    k = check_int("k", k, low=1, high=len(prompts) - 1)
    labels_a = np.array(labels)
    names = [t.name for t in tasks]
    n_layers = model.spec.n_layers
    td = np.zeros(n_layers)
    td_task = np.zeros((n_layers, len(tasks)))
    proj = np.zeros((n_layers, len(prompts), 2))
    if lora is not None:                                       # adapters hooked, in one job
        resid, acc = _with_lora(model, lora, prompts, per_task,
                                [include_null and t.name == "null" for t in tasks])
    elif store is None:
        resid = last_token_residuals(model, prompts)           # [prompt, layer, d_model]
    else:                                                      # lazy, dask-backed
        resid = store.get_or_compute(
            _residuals_key_parts(model, prompts),
            lambda: _residuals_dataset(last_token_residuals(model, prompts)))
    if scheduler is not None:                                  # one dask task per layer
        if store is None:
            resid = _residuals_dataset(resid)
        over = decodability_over_store(resid, labels_a, k=k, scheduler=scheduler)
        predicted = list(over.predicted.values)
        proj[:] = over.projection.values
    else:
        if store is not None:
            resid = resid.resid_post.transpose("prompt", "layer", "d_model").values
        predicted = [knn_loo_predictions(resid[:, layer], labels_a, k)
                     for layer in range(n_layers)]
        for layer in range(n_layers):
            proj[layer] = _pca2(resid[:, layer].astype(np.float64))
    for layer in range(n_layers):
        correct = predicted[layer] == labels_a
        td[layer] = correct.mean()
        td_task[layer] = [correct[labels_a == n].mean() for n in names]
    best = int(np.argmax(td))
    real = [i for i, n in enumerate(names) if not (include_null and n == "null")]
    # per-task TD averaged over layers: at the best layer TD often saturates at 1 for
    # every task, which leaves no variance to relate to accuracy
    r2 = r_squared(td_task[:, real].mean(0), np.array(acc)[real])
    return xr.Dataset(
        {"td": (("layer",), td),
         "td_per_task": (("layer", "task"), td_task),
         "icl_accuracy": (("task",), np.array(acc, dtype=float)),
         "projection": (("layer", "prompt", "component"), proj),
         "prompt_task": (("prompt",), labels_a)},
        coords={"layer": list(range(n_layers)), "task": names,
                "prompt": list(range(len(prompts))), "component": ["pc1", "pc2"]},
        attrs={**provenance(model, method="task_decodability", n_prompts=n_prompts,
                            n_shots=n_shots, k=k, include_null=include_null, seed=seed,
                            citation=CITATION),
               "best_layer": best, "td_accuracy_r2": r2})


def _with_lora(model: Model, lora: Any, prompts: list[str], per_task: list[tuple[list, list]],
               skip: list[bool]) -> tuple[np.ndarray, list[float]]:
    """Last-token residuals [prompt, layer, d_model] and few-shot accuracy per task with
    ``lora`` applied, batched as `last_token_residuals` and `few_shot_accuracy` batch."""
    import torch

    from explorer.lora import LoRAWeights, last_token_states

    if not isinstance(lora, LoRAWeights):
        raise TypeError(f"`lora` must be explorer.lora.LoRAWeights; got {type(lora).__name__}.")
    size = 16  # last_token_residuals' batch size
    resid_batches = [model.tokenize(prompts[s:s + size]) for s in range(0, len(prompts), size)]
    acc_batches = [model.tokenize(list(p)) for (p, _), sk in zip(per_task, skip) if not sk]
    states = last_token_states(model, resid_batches + acc_batches, lora)
    resid = np.concatenate([r.numpy() for r, _ in states[:len(resid_batches)]])
    tops = iter(t for _, t in states[len(resid_batches):])
    acc = []
    for (_, a), sk in zip(per_task, skip):
        if sk:
            acc.append(np.nan)
        else:
            target = torch.tensor(answer_token_ids(model, a))
            acc.append(float((next(tops) == target).double().mean()))  # as few_shot_accuracy
    return resid, acc


def _residuals_key_parts(model: Model, prompts: Sequence[str]) -> dict[str, Any]:
    """Cache key parts of `last_token_residuals`: model provenance and the prompts."""
    return {"model": model.spec.provenance(), "method": "last_token_residuals",
            "site": "resid_post", "prompts": list(prompts)}


def _residuals_dataset(resid: np.ndarray) -> xr.Dataset:
    """Last-token residuals [prompt, layer, d_model] as a Dataset the store can hold."""
    return xr.Dataset({"resid_post": (("prompt", "layer", "d_model"), resid)},
                      coords={"prompt": np.arange(resid.shape[0]),
                              "layer": np.arange(resid.shape[1])},
                      attrs={"method": "last_token_residuals", "site": "resid_post"})


def _layer_decodability(x: np.ndarray, labels: np.ndarray, k: int) -> tuple[np.ndarray, ...]:
    """k-NN LOO predictions and the 2-D PCA of one layer's residuals ``x`` [prompt, d_model]."""
    x = np.asarray(x)
    return knn_loo_predictions(x, labels, k), _pca2(x.astype(np.float64))


def decodability_over_store(ds: xr.Dataset, labels: Sequence[Any], *, site: str = "resid_post",
                            k: int = 10, scheduler: str = "threads",
                            scheduler_options: dict[str, Any] | None = None) -> xr.Dataset:
    """Leave-one-out k-NN task decodability per layer, out of core with dask (Han et al. 2025).

    Reads ``site`` of a Dataset of last-token residuals (dims prompt, [pos of size 1,]
    layer, d_model), e.g. a store entry opened lazily (`explorer.store.ActivationStore.get`,
    `explorer.distributed.open_entry`); an in-memory Dataset works too. Each layer is one
    dask task that loads only that layer's [prompt, d_model] slice, so memory holds a few
    layers, never the cache. The numbers are those of `knn_loo_predictions` in memory.

    Parameters
    ----------
    ds : xarray.Dataset
        Last-token residuals, lazy or in memory.
    labels : sequence
        The task of every prompt (length: the ``prompt`` dim).
    site : str, default="resid_post"
    k : int, default=10
        Neighbours (at most the number of prompts - 1).
    scheduler : str, default="threads"
        ``"threads"``, ``"synchronous"``, ``"local"`` (a LocalCluster) or a scheduler
        address; see `explorer.distributed.dask_scheduler`.
    scheduler_options : dict, optional
        Passed to `explorer.distributed.dask_scheduler` (e.g. ``n_workers``, ``processes``).

    Returns
    -------
    xarray.Dataset
        ``td`` (layer), ``td_per_task`` (layer, task; tasks in order of first appearance),
        ``predicted`` (layer, prompt), ``projection`` (layer, prompt, component) a 2-D PCA
        of each layer's residuals, ``prompt_task`` (prompt).
    """
    import dask
    import dask.array as da

    from explorer.distributed import check_scheduler, dask_scheduler

    scheduler = check_scheduler(scheduler)
    if site not in ds.data_vars:
        raise InputError(f"`site` {site!r} is not in the Dataset; it has "
                         f"{', '.join(map(str, ds.data_vars))}.")
    x = ds[site]
    if "pos" in x.dims:
        if x.sizes["pos"] != 1:
            raise InputError(f"`{site}` must hold one position per prompt (the last token); "
                             f"its pos dim has size {x.sizes['pos']}.")
        x = x.isel(pos=0)
    if set(x.dims) != {"prompt", "layer", "d_model"}:
        raise InputError(f"`{site}` must have dims prompt, [pos,] layer, d_model; "
                         f"got {x.dims}.")
    x = x.transpose("prompt", "layer", "d_model")                 # [prompt, layer, d_model]
    labels_a = np.asarray(labels)
    n_prompts, n_layers = x.sizes["prompt"], x.sizes["layer"]
    if labels_a.shape != (n_prompts,):
        raise InputError(f"`labels` must have one label per prompt ({n_prompts}); "
                         f"got shape {labels_a.shape}.")
    if n_prompts < 2:
        raise InputError(f"k-NN needs at least 2 prompts; got {n_prompts}.")
    k = check_int("k", k, low=1, high=n_prompts - 1)
    data = x.data
    if not isinstance(data, da.Array):
        data = da.from_array(np.asarray(data), chunks=(-1, 1, -1))
    tasks = []
    for layer in range(n_layers):
        # slicing fused into the chunk reads: each task reads only this layer's values
        (part,) = dask.optimize(data[:, layer, :])                # [prompt, d_model]
        tasks.append(dask.delayed(_layer_decodability, pure=True)(part, labels_a, k))
    with dask_scheduler(scheduler, **(scheduler_options or {})):
        results = dask.compute(*tasks)
    predicted = np.stack([r[0] for r in results])                 # [layer, prompt]
    projection = np.stack([r[1] for r in results])                # [layer, prompt, 2]
    names = list(dict.fromkeys(labels_a.tolist()))
    correct = predicted == labels_a[None, :]
    td_task = np.array([[correct[layer, labels_a == n].mean() for n in names]
                        for layer in range(n_layers)]).reshape(n_layers, len(names))
    layer_coord = x.coords["layer"].values if "layer" in x.coords else np.arange(n_layers)
    prompt_coord = x.coords["prompt"].values if "prompt" in x.coords else np.arange(n_prompts)
    return xr.Dataset(
        {"td": (("layer",), correct.mean(1)),
         "td_per_task": (("layer", "task"), td_task),
         "predicted": (("layer", "prompt"), predicted),
         "projection": (("layer", "prompt", "component"), projection),
         "prompt_task": (("prompt",), labels_a)},
        coords={"layer": layer_coord, "task": names, "prompt": prompt_coord,
                "component": ["pc1", "pc2"]},
        attrs={"method": "decodability_over_store", "site": site, "k": k,
               "scheduler": scheduler, "citation": CITATION})
