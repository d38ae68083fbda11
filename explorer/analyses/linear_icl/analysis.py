"""The model's loss against the predictors its patterns imply and the baselines, by context
length, and the whole analysis of a run (`linear_icl_analysis`)."""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import xarray as xr

from explorer._checks import check_int
from explorer.analyses._training import training_attrs
from explorer.analyses.linear_icl.model import (CITATION, DEFAULTS, TEST_LENGTHS,
                                                sample_regression_prompts)
from explorer.analyses.linear_icl.patterns import (_first_settled, attention_patterns,
                                                   pattern_reached)
from explorer.analyses.linear_icl.training import _check_run, icl_model
from explorer.analyses.linear_icl_theory import (bayes_risk, bayes_risk_asymptotic,
                                                 debiased_gd_predict, fit_step_size, gd_predict,
                                                 pattern_predict, ridge_predict)

__all__ = ['icl_losses_by_length', 'linear_icl_analysis']


def icl_losses_by_length(run: xr.Dataset, *, step: int | None = None,
                         context_lengths: Sequence[int] = TEST_LENGTHS, n_prompts: int = 4096,
                         seed: int = 1) -> xr.Dataset:
    """Test loss against context length: the model at one checkpoint and the baselines.

    The debiased-GD and GD step sizes are fitted once by least squares on prompts of the
    training length and then kept at every length, as a trained model keeps its weights;
    the Bayes-optimal ridge uses ``ridge = noise_var * d`` at every length.

    Returns
    -------
    xarray.Dataset
        Over ``context_length``: ``model``, ``debiased_gd``, ``gd``, ``bayes`` (empirical
        loss of the posterior mean on the same prompts), ``bayes_expected`` (Monte Carlo
        expectation, `bayes_risk`), ``bayes_asymptotic`` (`bayes_risk_asymptotic`),
        ``dgd_r2`` (agreement of the model's predictions with debiased GD at its own
        least-squares step size). Attrs: step, the fitted step sizes.
    """
    run = _check_run(run)
    step = int(run["step"].values[-1]) if step is None else step
    model = icl_model(run, step)
    p = run.attrs.get("params", {})
    d = model.d
    noise_var = float(p.get("noise_var", DEFAULTS["noise_var"]))
    train_L = int(p.get("context_length", DEFAULTS["context_length"]))
    context_lengths = sorted({check_int("context_lengths[i]", int(n), low=2) for n in context_lengths})
    n_prompts = check_int("n_prompts", n_prompts, low=2)
    fit = sample_regression_prompts(n_prompts, train_L, d, noise_var=noise_var, seed=seed)
    Xf, yf, xqf, yqf = (fit[k].numpy() for k in ("X", "y", "x_q", "y_q"))
    eta_dgd = fit_step_size(debiased_gd_predict(Xf, yf, xqf, 1.0), yqf)
    eta_gd = fit_step_size(gd_predict(Xf, yf, xqf, 1.0), yqf)
    rows = {k: [] for k in ("model", "debiased_gd", "gd", "bayes", "bayes_expected",
                            "bayes_asymptotic", "dgd_r2")}
    for L in context_lengths:
        t = sample_regression_prompts(n_prompts, L, d, noise_var=noise_var, seed=seed + L)
        with torch.no_grad():
            pred = model(t["X"], t["y"], t["x_q"]).double().numpy()
        X, y, xq, yq = (t[k].double().numpy() for k in ("X", "y", "x_q", "y_q"))
        dgd_unit = debiased_gd_predict(X, y, xq, 1.0)
        rows["model"].append(float(((pred - yq) ** 2).mean()))
        rows["debiased_gd"].append(float(((eta_dgd * dgd_unit - yq) ** 2).mean()))
        rows["gd"].append(float(((gd_predict(X, y, xq, eta_gd) - yq) ** 2).mean()))
        rows["bayes"].append(float(((ridge_predict(X, y, xq, noise_var * d) - yq) ** 2).mean()))
        rows["bayes_expected"].append(bayes_risk(L, d, noise_var, n_samples=4000, seed=seed))
        rows["bayes_asymptotic"].append(bayes_risk_asymptotic(L, d, noise_var))
        rows["dgd_r2"].append(_r2(pred, fit_step_size(dgd_unit, pred) * dgd_unit))
    return xr.Dataset(
        {k: (("context_length",), np.asarray(v)) for k, v in rows.items()},
        coords={"context_length": np.asarray(context_lengths)},
        attrs=training_attrs("icl_losses_by_length", {"step": step, "n_prompts": n_prompts,
                                                      "context_lengths": context_lengths},
                             seed, CITATION,
                             step=step, dgd_step_size=eta_dgd, gd_step_size=eta_gd),
    )


def _r2(y: np.ndarray, fitted: np.ndarray) -> float:
    """Fraction of the variance of ``y`` that ``fitted`` explains."""
    ss_res = float(((y - fitted) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    return 1.0 - ss_res / ss_tot if ss_tot > 0 else float("nan")


def linear_icl_analysis(run: xr.Dataset, *, n_prompts: int = 2048, seed: int = 1,
                        context_lengths: Sequence[int] = TEST_LENGTHS) -> xr.Dataset:
    """Patterns, losses and agreement with debiased GD over training, in one Dataset.

    Returns
    -------
    xarray.Dataset
        The variables of `attention_patterns` (step, head), ``test_loss`` (step,
        context_length) and ``train_loss`` from the run, ``dgd_r2`` (step): R^2 between the
        model's predictions and debiased GD at the best-fitting step size, on prompts of
        the training length; ``pattern_r2`` (step): the same against `pattern_predict`
        with the heads' measured (omega, mu); and the baselines of `icl_losses_by_length`
        at the last checkpoint, prefixed ``baseline_`` (context_length). Attrs
        ``pattern_step`` and ``pattern_seconds``: the first checkpoint from which on the
        pattern holds, and the training time until then.
    """
    run = _check_run(run)
    pats = attention_patterns(run)
    p = run.attrs.get("params", {})
    d = int(run.sizes["feature"]) - 1
    noise_var = float(p.get("noise_var", DEFAULTS["noise_var"]))
    train_L = int(p.get("context_length", DEFAULTS["context_length"]))
    t = sample_regression_prompts(n_prompts, train_L, d, noise_var=noise_var, seed=seed)
    X, y, xq = (t[k].double().numpy() for k in ("X", "y", "x_q"))
    dgd_unit = debiased_gd_predict(X, y, xq, 1.0)
    dgd_r2, pattern_r2, eta_model = [], [], []
    for step in run["step"].values:
        model = icl_model(run, int(step))
        with torch.no_grad():
            pred = model(t["X"], t["y"], t["x_q"]).double().numpy()
        eta = fit_step_size(dgd_unit, pred)
        eta_model.append(eta)
        dgd_r2.append(_r2(pred, eta * dgd_unit))
        at = pats.sel(step=step)
        pattern_r2.append(_r2(pred, pattern_predict(X, y, xq, at["omega"].values, at["mu"].values)))
    base = icl_losses_by_length(run, context_lengths=context_lengths, n_prompts=n_prompts, seed=seed)
    ds = pats.assign(
        test_loss=run["test_loss"].rename(context_length="test_context_length"),
        train_loss=run["train_loss"],
        dgd_r2=("step", np.asarray(dgd_r2)),
        pattern_r2=("step", np.asarray(pattern_r2)),
        dgd_step_size=("step", np.asarray(eta_model)),
        **{f"baseline_{k}": v for k, v in base.data_vars.items()},
    )
    ds["pattern_reached"] = pattern_reached(pats)
    settled = _first_settled(ds["pattern_reached"].values)
    pattern_step = None if settled is None else int(ds["step"].values[settled])
    pattern_seconds = None
    if settled is not None and "wall_seconds" in run.coords:
        wall = float(run["wall_seconds"].values[settled])
        pattern_seconds = None if math.isnan(wall) else round(wall, 3)
    last = ds.isel(step=-1)
    ds.attrs = training_attrs("linear_icl_analysis", {"n_prompts": n_prompts,
                                                      "run_params": p}, seed, CITATION,
                              pattern_step=pattern_step, pattern_seconds=pattern_seconds,
                              train_seconds=run.attrs.get("train_seconds"),
                              n_heads=int(run.sizes["head"]),
                              final_test_loss=float(run["test_loss"].sel(context_length=train_L).isel(step=-1))
                              if train_L in run["context_length"].values else None,
                              final_dgd_r2=float(last["dgd_r2"]),
                              dgd_step_size_fitted=base.attrs["dgd_step_size"])
    return ds
