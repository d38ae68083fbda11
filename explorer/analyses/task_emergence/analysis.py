"""Task decodability per layer and the in-context loss per task at every checkpoint, the steps
at which each rises, and their correlation over training."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import xarray as xr

from explorer._checks import InputError, check_float, check_int
from explorer.analyses._training import check_checkpoint_step, training_attrs
from explorer.analyses.task_emergence.model import TaskICLTransformer
from explorer.analyses.task_emergence.tasks import CITATION, ProgressCallback, sample_task_prompts
from explorer.analyses.task_emergence.training import _check_run, task_emergence_model

__all__ = ['query_residuals', 'task_emergence_analysis', 'rise_step', 'emergence_summary']


def query_residuals(model: TaskICLTransformer, x: torch.Tensor,
                    y: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Query predictions [prompt] and the query token's residual after every block
    [prompt, layer, d_model].

    A pair of arrays: the predictions and the residuals of one forward, which the analysis
    loop reads at once for every checkpoint.
    """
    with torch.no_grad():
        pred, kept = model(x, y, residuals=True)
    return pred.numpy(), torch.stack(kept, 1).numpy()


def _posterior_mean_loss(x: np.ndarray, y: np.ndarray, mean: np.ndarray, cov: np.ndarray,
                         noise_var: float) -> np.ndarray:
    """Squared error at the query of the posterior-mean weights under the prior N(mean, cov):
    w = mean + cov X^T (X cov X^T + noise_var I)^-1 (y - X mean), per prompt."""
    X, Y = x[:, :-1].astype(np.float64), y[:, :-1].astype(np.float64)   # [prompt, n, d], [prompt, n]
    gram = np.einsum("pnd,de,pme->pnm", X, cov, X) + noise_var * np.eye(X.shape[1])
    alpha = np.linalg.solve(gram, (Y - X @ mean)[..., None])[..., 0]    # [prompt, n]
    w = mean + np.einsum("de,pne,pn->pd", cov, X, alpha)
    return (np.einsum("pd,pd->p", x[:, -1].astype(np.float64), w) - y[:, -1]) ** 2


def _pca2(h: np.ndarray) -> np.ndarray:
    """First two principal components, each signed so its largest loading is positive."""
    h = np.where(np.isfinite(h), h, 0.0).astype(np.float64)
    centred = h - h.mean(0)
    # Eigenvectors of the d_model x d_model scatter matrix, in torch (one thread, as set by
    # the caller): numpy's SVD spawns BLAS threads that crawl on a busy machine.
    _, vecs = torch.linalg.eigh(torch.as_tensor(centred.T @ centred))
    comps = vecs.numpy()[:, ::-1][:, :2].T                              # [component, d_model]
    signs = np.sign(comps[np.arange(len(comps)), np.abs(comps).argmax(1)])
    comps = comps * np.where(signs == 0, 1, signs)[:, None]
    out = centred @ comps.T
    return np.pad(out, ((0, 0), (0, 2 - out.shape[1])))


def task_emergence_analysis(run: xr.Dataset, *, n_per_task: int = 100, k: int = 10, seed: int = 1,
                            steps: Sequence[int] | None = None,
                            progress: ProgressCallback | None = None) -> xr.Dataset:
    """Task decodability per layer and ICL loss per task at every checkpoint.

    A fixed evaluation set of ``n_per_task`` prompts per task (seeded by ``seed``, not the
    training seed) is run through every checkpoint. TD at a layer is the leave-one-out
    k-NN (k=10) accuracy of the task label from the residual after that block at the
    query token (the token before the answer), as in Han et al. The ICL loss is the
    squared error of the query prediction, per task; the same prompts give two reference
    losses: the posterior mean knowing the prompt's basis (``oracle_loss``) and not knowing
    it (ridge under the task-averaged prior, ``agnostic_loss``), and the loss of predicting
    0 (``zero_loss``, the variance of y); and the loss of knowing the task without reading
    the examples, i.e. predicting with the task's mean weights (``task_mean_loss``).

    Returns
    -------
    xarray.Dataset
        ``td`` (step, layer), ``td_per_task`` (step, layer, task), ``icl_loss`` (step,
        task) and ``icl_loss_mean`` (step), ``projection`` (step, layer, prompt,
        component: 2-D PCA of the query residuals), ``prompt_task`` (prompt); reference
        losses ``oracle_loss``, ``agnostic_loss``, ``zero_loss``, ``task_mean_loss`` (task); attrs: the
        `emergence_summary` numbers.
    """
    from explorer.analyses.task_vectors import knn_loo_predictions

    run = _check_run(run)
    n_per_task = check_int("n_per_task", n_per_task, low=2)
    p = run.attrs["params"]
    n_tasks = int(run.sizes["task"])
    k = check_int("k", k, low=1, high=n_per_task * n_tasks - 1)
    seed = check_int("seed", seed)
    steps = run["step"].values if steps is None else np.asarray([check_checkpoint_step(run, s) for s in steps])
    bases = run["bases"].values
    labels = np.repeat(np.arange(n_tasks), n_per_task)
    coef_mean, coef_std = p.get("coef_mean", 0.0), p.get("coef_std", 1.0)
    evalset = sample_task_prompts(bases, len(labels), p["n_examples"], tasks=labels,
                                  noise_std=p["noise_std"], coef_mean=coef_mean, coef_std=coef_std,
                                  seed=seed)
    x, y = evalset["x"].values, evalset["y"].values
    xt, yt = torch.as_tensor(x), torch.as_tensor(y)
    noise_var = max(p["noise_std"] ** 2, 1e-8)
    # Each task's prior on w: mean B_z 1 coef_mean, covariance coef_std^2 B_z B_z^T. The
    # task-agnostic reference uses one Gaussian with the mixture's mean and covariance.
    means = [b.sum(1) * coef_mean for b in bases.astype(np.float64)]
    covs = [coef_std**2 * b @ b.T for b in bases.astype(np.float64)]
    oracle = np.empty(len(labels))
    for t in range(n_tasks):
        rows = labels == t
        oracle[rows] = _posterior_mean_loss(x[rows], y[rows], means[t], covs[t], noise_var)
    mix_mean = np.mean(means, axis=0)
    mix_cov = (np.mean([c + np.outer(m, m) for m, c in zip(means, covs)], axis=0)
               - np.outer(mix_mean, mix_mean))
    agnostic = _posterior_mean_loss(x, y, mix_mean, mix_cov, noise_var)
    zero = y[:, -1].astype(np.float64) ** 2
    # Knowing the task but not reading the examples: predict with the task's mean weights.
    task_mean = (np.einsum("pd,pd->p", x[:, -1].astype(np.float64), np.asarray(means)[labels]) - y[:, -1]) ** 2

    def per_task(v: np.ndarray) -> np.ndarray:
        return np.array([v[labels == t].mean() for t in range(n_tasks)])

    n_layers = int(p["n_layers"])
    td = np.zeros((len(steps), n_layers))
    td_task = np.zeros((len(steps), n_layers, n_tasks))
    loss = np.zeros((len(steps), n_tasks))
    proj = np.zeros((len(steps), n_layers, len(labels), 2), dtype=np.float32)
    for i, step in enumerate(steps):
        model = task_emergence_model(run, int(step))
        pred, resid = query_residuals(model, xt, yt)        # [prompt], [prompt, layer, d_model]
        loss[i] = per_task((pred.astype(np.float64) - y[:, -1]) ** 2)
        for layer in range(n_layers):
            correct = knn_loo_predictions(resid[:, layer], labels, k) == labels
            td[i, layer] = correct.mean()
            td_task[i, layer] = per_task(correct.astype(np.float64))
            proj[i, layer] = _pca2(resid[:, layer])
        if progress is not None and progress(i + 1, len(steps)) is False:
            steps = steps[:i + 1]
            td, td_task, loss, proj = (a[:i + 1] for a in (td, td_task, loss, proj))
            break
    ds = xr.Dataset(
        {"td": (("step", "layer"), td),
         "td_per_task": (("step", "layer", "task"), td_task),
         "icl_loss": (("step", "task"), loss),
         "icl_loss_mean": (("step",), loss.mean(1)),
         "projection": (("step", "layer", "prompt", "component"), proj),
         "prompt_task": (("prompt",), labels),
         "oracle_loss": (("task",), per_task(oracle)),
         "agnostic_loss": (("task",), per_task(agnostic)),
         "zero_loss": (("task",), per_task(zero)),
         "task_mean_loss": (("task",), per_task(task_mean))},
        coords={"step": np.asarray(steps, dtype=np.int64),
                "wall_seconds": ("step", run["wall_seconds"].sel(step=np.asarray(steps)).values),
                **({"cpu_seconds": ("step", run["cpu_seconds"].sel(step=np.asarray(steps)).values)}
                   if "cpu_seconds" in run.coords else {}),
                "layer": np.arange(n_layers), "task": np.arange(n_tasks),
                "prompt": np.arange(len(labels)),
                "component": ["pc1", "pc2"]},
        attrs=training_attrs("task_emergence_analysis", {"n_per_task": n_per_task, "k": k,
                                                         "run_params": p,
                                                         "run_seed": run.attrs.get("seed")},
                             seed, CITATION,
                             train_seconds=run.attrs.get("train_seconds")),
    )
    ds["td"].attrs["long_name"] = "task decodability (leave-one-out 10-NN accuracy)"
    ds["icl_loss"].attrs["long_name"] = "squared error of the query prediction"
    ds.attrs.update(emergence_summary(ds))
    return ds


def rise_step(values: Sequence[float], steps: Sequence[int], *, fraction: float = 0.5) -> int | None:
    """First step at which ``values`` has covered ``fraction`` of its change from the first
    value to the final one (the mean of the last three), in the direction of that change.

    None when the curve does not change (final equals first).
    """
    v = np.asarray(values, dtype=np.float64)
    s = np.asarray(steps)
    fraction = check_float("fraction", fraction, low=0.0, high=1.0)
    if len(v) < 2 or len(v) != len(s):
        raise InputError(f"`values` and `steps` must have the same length, at least 2; "
                         f"got {len(v)} and {len(s)}.")
    final = float(np.mean(v[-3:]))
    change = final - v[0]
    if change == 0 or not np.isfinite(change):
        return None
    level = v[0] + fraction * change
    hit = np.flatnonzero((v - level) * np.sign(change) >= 0)
    return int(s[hit[0]]) if len(hit) else None


def emergence_summary(analysis: xr.Dataset) -> dict[str, Any]:
    """When task encoding and ICL performance rise, and how closely they move together.

    TD is read at the layer with the highest TD at the last checkpoint (``best_layer``);
    ICL performance as ``icl_r2 = 1 - icl_loss_mean / zero_loss_mean`` (fraction of the
    target variance explained at the query). Reported: the first step each covers 10%,
    50% and 90% of its rise, and the Pearson correlation of TD and ``icl_r2`` over the
    checkpoints, overall and per task (TD per task at the best layer against that task's
    r2).

    A dict, not a Dataset: it is the Dataset's headline numbers as nested JSON scalars and
    lists, what the command's ``--json`` prints and a benchmark writes to docs/figures.
    """
    steps = analysis["step"].values
    td_all = analysis["td"].values
    best = int(np.argmax(td_all[-1]))
    td = td_all[:, best]
    zero = analysis["zero_loss"].values
    r2 = 1 - analysis["icl_loss"].values / zero[None, :]                # [step, task]
    r2_mean = 1 - analysis["icl_loss_mean"].values / zero.mean()

    def corr(a: np.ndarray, b: np.ndarray) -> float | None:
        if len(a) < 3 or np.std(a) == 0 or np.std(b) == 0:
            return None
        return round(float(np.corrcoef(a, b)[0, 1]), 4)

    td_task = analysis["td_per_task"].values[:, best]                   # [step, task]
    out: dict[str, Any] = {
        "best_layer": best,
        "final_td": [round(float(t), 4) for t in td_all[-1]],
        "initial_td": round(float(td[0]), 4),
        "final_icl_loss": [round(float(v), 4) for v in analysis["icl_loss"].values[-1]],
        "oracle_loss": [round(float(v), 4) for v in analysis["oracle_loss"].values],
        "agnostic_loss": [round(float(v), 4) for v in analysis["agnostic_loss"].values],
        "zero_loss": [round(float(v), 4) for v in zero],
        **({"task_mean_loss": [round(float(v), 4) for v in analysis["task_mean_loss"].values]}
           if "task_mean_loss" in analysis else {}),
        "td_icl_correlation": corr(td, r2_mean),
        "td_icl_correlation_per_task": [corr(td_task[:, t], r2[:, t]) for t in range(r2.shape[1])],
    }
    def rise(values: np.ndarray, fraction: float = 0.5) -> int | None:
        return rise_step(values, steps, fraction=fraction) if len(steps) > 1 else None  # one checkpoint

    for frac in (0.1, 0.5, 0.9):
        tag = int(frac * 100)
        out[f"td_rise_step_{tag}"] = rise(td, frac)
        out[f"icl_rise_step_{tag}"] = rise(r2_mean, frac)
    out["icl_rise_step_50_per_task"] = [rise(r2[:, t]) for t in range(r2.shape[1])]
    return out
