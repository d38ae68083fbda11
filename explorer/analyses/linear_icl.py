"""In-context linear regression with one layer of multi-head softmax attention.

He, Pan, Chen & Yang (ICML 2025) train ``TF(Z, z_q) = sum_h O_h V_h Z softmax(Z^T K_h^T Q_h z_q
/ sqrt(d+1))`` on prompts ``z_i = (x_i, y_i)``, ``y_i = beta^T x_i + noise``, and find that
training settles on a simple pattern: each head's key-query matrix has an x-block close to a
scaled identity ``omega_h I`` (and zero y-row/column), each head's output-value vector is
non-zero only at the y entry (``mu_h``), and the heads pair up with opposite signs so that
``sum_h mu_h ~ 0``. With such a pair the model computes (to first order in omega) one step of
*debiased* gradient descent, ``y_hat = (2 omega mu / L) sum_i y_i (x_i - x_bar)^T x_q``; a
single head cannot cancel the ``y_bar`` term and is measurably worse.

This module trains the model and keeps checkpoints (`train_linear_icl`), measures the
patterns over training (`attention_patterns`), computes the predictors the patterns imply
and the baselines (`debiased_gd_predict`, `gd_predict`, `ridge_predict`, `bayes_risk`,
`bayes_risk_asymptotic`, in `explorer.analyses.linear_icl_theory` and re-exported here), and
puts it together (`linear_icl_analysis`).

References
----------
J. He, X. Pan, S. Chen and Z. Yang, "In-Context Linear Regression Demystified: Training
Dynamics and Mechanistic Interpretability of Multi-Head Softmax Attention", ICML 2025.
"""
from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xarray as xr
from torch import nn

from explorer.defaults import DATASETS_DIR
from explorer._checks import InputError, check_float, check_int
from explorer.analyses._training import (
    datasets_from_safetensors,
    datasets_to_safetensors,
    run_training_steps,
    stored_training_run,
    training_versions,
)
from explorer.analyses.linear_icl_theory import (  # re-exported: the predictors the model is compared with
    approximate_loss,
    bayes_risk,
    bayes_risk_asymptotic,
    debiased_gd_predict,
    fit_step_size,
    gd_predict,
    optimal_mu,
    pattern_predict,
    ridge_predict,
)

__all__ = [
    "CITATION",
    "DEFAULTS",
    "ICLAttention",
    "sample_regression_prompts",
    "train_linear_icl",
    "icl_model",
    "attention_patterns",
    "pattern_reached",
    "PATTERN_THRESHOLDS",
    "pattern_predict",
    "gd_predict",
    "debiased_gd_predict",
    "ridge_predict",
    "fit_step_size",
    "bayes_risk",
    "bayes_risk_asymptotic",
    "optimal_mu",
    "approximate_loss",
    "icl_losses_by_length",
    "linear_icl_analysis",
    "linear_icl_run",
    "stored_linear_icl_analysis",
    "SHIPPED_RUNS",
    "SHIPPED_HEADS",
    "save_linear_icl_runs_safetensors",
    "load_linear_icl_runs_safetensors",
    "analysis_summary",
    "icl_run_from_models",
]

CITATION = ("J. He, X. Pan, S. Chen and Z. Yang, \"In-Context Linear Regression Demystified: "
            "Training Dynamics and Mechanistic Interpretability of Multi-Head Softmax "
            "Attention\", ICML 2025.")

#: The paper's setting (METHODS.md section 10): d = 5, L = 8d = 40, noise variance 0.1,
#: Adam lr 1e-3, batch 256; fresh prompts every step.
DEFAULTS: dict[str, Any] = {
    "n_heads": 2,
    "d": 5,
    "context_length": 40,
    "noise_var": 0.1,
    "lr": 1e-3,
    "batch_size": 256,
    "steps": 20000,
    "checkpoint_every": 250,
    "init_scale": 1.0,
    "seed": 0,
}

#: Context lengths of the length-generalisation test.
TEST_LENGTHS: tuple[int, ...] = (5, 10, 20, 40, 80, 160)

ProgressCallback = Callable[[int, int], Any]


# -- model ----------------------------------------------------------------------------

class ICLAttention(nn.Module):
    """One layer of multi-head softmax attention from the query to the context tokens.

    Tokens are ``z_i = (x_i, y_i)`` and the query ``z_q = (x_q, 0)``, all in R^(d+1); there is
    no positional encoding. Head ``h`` scores context token ``i`` by
    ``(z_q W_Q^h) . (z_i W_K^h) / sqrt(d+1)``, softmaxes over ``i``, and adds
    ``sum_i a_i (z_i W_V^h) . W_O^h`` to the prediction.

    Parameters
    ----------
    d : int, default=5
    n_heads : int, default=2
    init_scale : float, default=1.0
        Weights start uniform in ``+-init_scale / sqrt(fan_in)`` (PyTorch's ``nn.Linear``
        default at 1.0, as in the paper's code).
    seed : int, default=0

    Attributes
    ----------
    W_Q, W_K, W_V : torch.nn.Parameter, shape (n_heads, d+1, d+1)
        Row-vector convention: ``q = z @ W_Q[h]``.
    W_O : torch.nn.Parameter, shape (n_heads, d+1)
    """

    def __init__(self, d: int = 5, n_heads: int = 2, *, init_scale: float = 1.0,
                 seed: int = 0) -> None:
        super().__init__()
        d = check_int("d", d, low=1, high=256)
        n_heads = check_int("n_heads", n_heads, low=1, high=64)
        init_scale = check_float("init_scale", init_scale, low=0.0)
        D = d + 1
        gen = torch.Generator().manual_seed(int(seed))

        def uniform(shape, fan_in):
            bound = init_scale / math.sqrt(fan_in)
            return nn.Parameter((torch.rand(shape, generator=gen) * 2 - 1) * bound)

        self.W_Q = uniform((n_heads, D, D), D)
        self.W_K = uniform((n_heads, D, D), D)
        self.W_V = uniform((n_heads, D, D), D)
        self.W_O = uniform((n_heads, D), D * n_heads)

    @property
    def d(self) -> int:
        return int(self.W_Q.shape[1]) - 1

    @property
    def n_heads(self) -> int:
        return int(self.W_Q.shape[0])

    def forward(self, X: torch.Tensor, y: torch.Tensor, x_q: torch.Tensor) -> torch.Tensor:
        """Prediction for the query.

        Parameters
        ----------
        X : torch.Tensor, shape (batch, L, d)
        y : torch.Tensor, shape (batch, L)
        x_q : torch.Tensor, shape (batch, d)

        Returns
        -------
        torch.Tensor, shape (batch,)
        """
        Z = torch.cat([X, y[..., None]], dim=-1)                              # [batch, L, D]
        kq = self.W_Q @ self.W_K.transpose(1, 2)                             # [head, D, D]
        ov = (self.W_V @ self.W_O[..., None])[..., 0]                        # [head, D]
        # The query's y entry is 0, so only the x rows of W_KQ act.
        q = torch.einsum("bd,hde->bhe", x_q, kq[:, :-1]) / math.sqrt(self.d + 1)  # [batch, head, D]
        scores = q @ Z.transpose(1, 2)                                       # [batch, head, L]
        attn = torch.softmax(scores, dim=-1)
        values = (Z @ ov.T).transpose(1, 2)                                  # [batch, head, L]
        return (attn * values).sum(dim=(1, 2))

    def weights(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name).detach().numpy().copy()
                for name in ("W_Q", "W_K", "W_V", "W_O")}

    @classmethod
    def from_weights(cls, W_Q, W_K, W_V, W_O) -> "ICLAttention":
        """A model with the given weights (shapes as the attributes)."""
        W_Q = np.asarray(W_Q, dtype=np.float32)
        if W_Q.ndim != 3 or W_Q.shape[1] != W_Q.shape[2]:
            raise InputError(f"`W_Q` must have shape (n_heads, d+1, d+1); got {W_Q.shape}.")
        H, D = W_Q.shape[0], W_Q.shape[1]
        shapes = {"W_K": (H, D, D), "W_V": (H, D, D), "W_O": (H, D)}
        given = {"W_K": W_K, "W_V": W_V, "W_O": W_O}
        for name, value in given.items():
            if tuple(np.shape(value)) != shapes[name]:
                raise InputError(f"`{name}` must have shape {shapes[name]}; got {tuple(np.shape(value))}.")
        model = cls(D - 1, H, init_scale=0.0)
        with torch.no_grad():
            for name, value in {"W_Q": W_Q, **given}.items():
                getattr(model, name).copy_(torch.as_tensor(np.asarray(value, dtype=np.float32)))
        return model


# -- data -----------------------------------------------------------------------------

def sample_regression_prompts(n_prompts: int, context_length: int, d: int, *, noise_var: float = 0.1,
                              generator: torch.Generator | None = None,
                              seed: int | None = None) -> dict[str, torch.Tensor]:
    """Prompts of in-context linear regression: x ~ N(0, I_d), beta ~ N(0, I_d / d),
    y = beta^T x + eps with eps ~ N(0, noise_var), for context and query alike.

    Returns
    -------
    dict of torch.Tensor
        ``X`` (prompt, L, d), ``y`` (prompt, L), ``x_q`` (prompt, d), ``y_q`` (prompt,),
        ``beta`` (prompt, d).
    """
    n_prompts = check_int("n_prompts", n_prompts, low=1)
    context_length = check_int("context_length", context_length, low=1)
    d = check_int("d", d, low=1)
    noise_var = check_float("noise_var", noise_var, low=0.0)
    if generator is None:
        generator = torch.Generator().manual_seed(0 if seed is None else int(seed))
    g = generator
    beta = torch.randn(n_prompts, d, generator=g) / math.sqrt(d)
    X = torch.randn(n_prompts, context_length, d, generator=g)
    x_q = torch.randn(n_prompts, d, generator=g)
    noise = math.sqrt(noise_var)
    y = torch.einsum("pld,pd->pl", X, beta) + noise * torch.randn(n_prompts, context_length, generator=g)
    y_q = (x_q * beta).sum(-1) + noise * torch.randn(n_prompts, generator=g)
    return {"X": X, "y": y, "x_q": x_q, "y_q": y_q, "beta": beta}


# -- training -------------------------------------------------------------------------

def train_linear_icl(
    *,
    n_heads: int = DEFAULTS["n_heads"],
    d: int = DEFAULTS["d"],
    context_length: int = DEFAULTS["context_length"],
    noise_var: float = DEFAULTS["noise_var"],
    lr: float = DEFAULTS["lr"],
    batch_size: int = DEFAULTS["batch_size"],
    steps: int = DEFAULTS["steps"],
    checkpoint_every: int = DEFAULTS["checkpoint_every"],
    init_scale: float = DEFAULTS["init_scale"],
    seed: int = DEFAULTS["seed"],
    test_lengths: Sequence[int] = TEST_LENGTHS,
    n_test: int = 2048,
    progress: ProgressCallback | None = None,
) -> xr.Dataset:
    """Train one layer of multi-head softmax attention on in-context linear regression.

    Every step draws a fresh batch of prompts; the loss is the squared error of the query
    prediction; Adam. At every checkpoint the weights are stored and the test loss is
    measured on a fixed set of prompts at each context length in ``test_lengths``.

    Parameters
    ----------
    n_heads : int, default=2
    d : int, default=5
    context_length : int, default=40
        L of the training prompts.
    noise_var : float, default=0.1
    lr : float, default=1e-3
    batch_size : int, default=256
    steps : int, default=20000
    checkpoint_every : int, default=250
    init_scale : float, default=1.0
    seed : int, default=0
        Seeds the initialisation, the training prompts and the test prompts.
    test_lengths : sequence of int, default=(5, 10, 20, 40, 80, 160)
    n_test : int, default=2048
        Test prompts per context length.
    progress : callable, optional
        ``progress(steps_done, steps)`` at every checkpoint; returning ``False`` stops.

    Returns
    -------
    xarray.Dataset
        Dims ``step``, ``head``, ``feature`` (token entries x1..xd, y), ``d_head``,
        ``context_length``. Variables ``W_Q``, ``W_K``, ``W_V`` (step, head, feature,
        d_head), ``W_O`` (step, head, d_head), ``train_loss`` (step; mean over the steps
        since the previous checkpoint), ``test_loss`` (step, context_length); coordinate
        ``wall_seconds`` (step): training time until the checkpoint. Attrs: method, params,
        seed, versions, citation, train_seconds (wall), train_cpu_seconds (this process), cancelled.

    References
    ----------
    J. He, X. Pan, S. Chen and Z. Yang, ICML 2025.
    """
    n_heads = check_int("n_heads", n_heads, low=1, high=64)
    d = check_int("d", d, low=1, high=256)
    context_length = check_int("context_length", context_length, low=1)
    noise_var = check_float("noise_var", noise_var, low=0.0)
    lr = check_float("lr", lr, low=0.0)
    batch_size = check_int("batch_size", batch_size, low=1)
    steps = check_int("steps", steps, low=0)
    checkpoint_every = check_int("checkpoint_every", checkpoint_every, low=1)
    init_scale = check_float("init_scale", init_scale, low=0.0)
    seed = check_int("seed", seed)
    test_lengths = sorted({check_int("test_lengths[i]", int(n), low=1) for n in test_lengths})
    n_test = check_int("n_test", n_test, low=1)
    params = {"n_heads": n_heads, "d": d, "context_length": context_length, "noise_var": noise_var,
              "lr": lr, "batch_size": batch_size, "steps": steps,
              "checkpoint_every": checkpoint_every, "init_scale": init_scale,
              "test_lengths": test_lengths, "n_test": n_test}

    model = ICLAttention(d, n_heads, init_scale=init_scale, seed=seed)
    optimiser = torch.optim.Adam(model.parameters(), lr=lr)
    data_gen = torch.Generator().manual_seed(int(seed) + 1)
    tests = {L: sample_regression_prompts(n_test, L, d, noise_var=noise_var, seed=int(seed) + 10_000 + L)
             for L in test_lengths}

    snapshots, at_steps, train_losses, test_losses, walls = [], [], [], [], []
    running = []
    start, cpu_start = time.perf_counter(), time.process_time()

    def checkpoint(step: int) -> None:
        with torch.no_grad():
            test_losses.append([float(((model(t["X"], t["y"], t["x_q"]) - t["y_q"]) ** 2).mean())
                                for t in tests.values()])
        snapshots.append(model.weights())
        at_steps.append(step)
        train_losses.append(float(np.mean(running)) if running else float("nan"))
        walls.append(time.perf_counter() - start)
        running.clear()

    def step_loss(_step: int) -> torch.Tensor:
        batch = sample_regression_prompts(batch_size, context_length, d, noise_var=noise_var,
                                          generator=data_gen)
        return ((model(batch["X"], batch["y"], batch["x_q"]) - batch["y_q"]) ** 2).mean()

    with torch.enable_grad():
        checkpoint(0)
    cancelled = run_training_steps(steps, step_loss, optimiser, losses=running,
                                   checkpoint=checkpoint, checkpoint_every=checkpoint_every,
                                   progress=progress)
    seconds = time.perf_counter() - start
    return _run_dataset(snapshots, at_steps, train_losses, test_losses, test_lengths,
                        _attrs("linear_icl", params, seed, train_seconds=round(seconds, 3),
                               train_cpu_seconds=round(time.process_time() - cpu_start, 3),
                               cancelled=cancelled), wall_seconds=walls)


def _run_dataset(snapshots, steps, train_losses, test_losses, test_lengths, attrs,
                 wall_seconds=None) -> xr.Dataset:
    H, D = snapshots[0]["W_Q"].shape[:2]
    features = [f"x{i + 1}" for i in range(D - 1)] + ["y"]

    def stack(name):
        return np.stack([s[name] for s in snapshots]).astype(np.float32)

    dims = ("step", "head", "feature", "d_head")
    return xr.Dataset(
        {"W_Q": (dims, stack("W_Q")), "W_K": (dims, stack("W_K")), "W_V": (dims, stack("W_V")),
         "W_O": (("step", "head", "d_head"), stack("W_O")),
         "train_loss": (("step",), np.asarray(train_losses, dtype=np.float64)),
         "test_loss": (("step", "context_length"), np.asarray(test_losses, dtype=np.float64))},
        coords={"step": np.asarray(steps, dtype=np.int64), "head": np.arange(H),
                "feature": features, "d_head": np.arange(D),
                "context_length": np.asarray(test_lengths, dtype=np.int64),
                "wall_seconds": ("step", np.asarray(wall_seconds if wall_seconds is not None
                                                    else [np.nan] * len(steps), dtype=np.float64))},
        attrs=attrs,
    )


def icl_run_from_models(models: Sequence[ICLAttention], *, steps: Sequence[int] | None = None,
                        noise_var: float = DEFAULTS["noise_var"],
                        test_lengths: Sequence[int] = TEST_LENGTHS, n_test: int = 2048,
                        seed: int = 0) -> xr.Dataset:
    """A run Dataset (the layout of `train_linear_icl`) holding the given models, e.g.
    hand-set weights, one checkpoint each, with their test losses."""
    models = list(models)
    if not models or not all(isinstance(m, ICLAttention) for m in models):
        raise InputError("`models` must be a non-empty list of ICLAttention models.")
    steps = list(range(len(models))) if steps is None else [int(s) for s in steps]
    test_lengths = sorted({check_int("test_lengths[i]", int(n), low=1) for n in test_lengths})
    d = models[0].d
    tests = [sample_regression_prompts(n_test, L, d, noise_var=noise_var, seed=seed + 10_000 + L)
             for L in test_lengths]
    losses = []
    with torch.no_grad():
        for m in models:
            losses.append([float(((m(t["X"], t["y"], t["x_q"]) - t["y_q"]) ** 2).mean()) for t in tests])
    params = {"d": d, "n_heads": models[0].n_heads, "noise_var": noise_var,
              "test_lengths": test_lengths, "n_test": n_test, "from_models": True}
    return _run_dataset([m.weights() for m in models], steps, [float("nan")] * len(models), losses,
                        test_lengths, _attrs("linear_icl", params, seed))


def _attrs(method: str, params: dict, seed: int, **extra: Any) -> dict:
    return {"method": method, "params": params, "seed": int(seed),
            "versions": training_versions(), "citation": CITATION, **extra}


def _check_run(run: Any) -> xr.Dataset:
    if not isinstance(run, xr.Dataset):
        raise TypeError(f"`run` must be an xarray.Dataset from train_linear_icl; got {type(run).__name__}.")
    missing = [v for v in ("W_Q", "W_K", "W_V", "W_O") if v not in run]
    if missing:
        raise InputError(f"`run` is not a linear-ICL training run (missing {', '.join(missing)}); "
                         "make one with train_linear_icl.")
    return run


def icl_model(run: xr.Dataset, step: int) -> ICLAttention:
    """The model of ``run`` at checkpoint ``step``."""
    run = _check_run(run)
    steps = run["step"].values
    step = check_int("step", step)
    if step not in steps:
        raise InputError(f"`step` must be a checkpoint step of the run ({steps[0]}..{steps[-1]}); got {step}.")
    at = run.sel(step=step)
    return ICLAttention.from_weights(at["W_Q"].values, at["W_K"].values, at["W_V"].values,
                                     at["W_O"].values)


# -- patterns -------------------------------------------------------------------------

def attention_patterns(run: xr.Dataset) -> xr.Dataset:
    """Key-query and output-value patterns of every head (at every checkpoint).

    ``W_KQ^h = W_Q^h (W_K^h)^T`` (query feature x key feature) and ``W_OV^h = W_V^h W_O^h``
    (one weight per feature). With D = d + 1 and the x-block ``B = W_KQ[:d, :d]``:

    - ``omega`` = mean(diag B) / sqrt(D): the effective softmax coefficient, so that the
      ideal pattern computes `pattern_predict` with this omega;
    - ``kq_identity_error`` = ||B - (tr B / d) I||_F / ||B||_F: distance of the x-block from
      its best scaled identity (0 = diagonal and homogeneous);
    - ``kq_offdiag_ratio``: energy of the active rows of W_KQ outside the x-block diagonal
      over their total energy (covers the off-diagonal x entries and the y column). The
      row of the query's y entry is left out: that entry is always 0, so the row never acts
      and never receives a gradient;
    - ``kq_diag_cv``: coefficient of variation of diag B (0 = homogeneous);
    - ``mu`` = W_OV[y]: the weight given to y_i;
    - ``ov_offy_ratio`` = ||W_OV[:d]||^2 / ||W_OV||^2: OV energy off the y entry (0 = ideal);
    - ``mu_sum_ratio`` = |sum_h mu_h| / sum_h |mu_h| (0 = the heads cancel: zero-sum);
    - ``active``: the head's |mu| is at least 5% of the largest |mu| (a head that carries
      nothing has no meaningful pattern; with H > 2 some heads die out);
    - ``kq_identity_error_max``, ``ov_offy_ratio_max``: worst active head.

    Parameters
    ----------
    run : xarray.Dataset
        A run from `train_linear_icl` (or any Dataset with ``W_Q``, ``W_K``, ``W_V``, ``W_O``
        with dims (..., head, feature, d_head)).

    Returns
    -------
    xarray.Dataset
        ``W_KQ`` (..., head, query_feature, key_feature), ``W_OV`` (..., head, feature), and
        the metrics above over (..., head) or (...).

    References
    ----------
    J. He, X. Pan, S. Chen and Z. Yang, ICML 2025 (Section 3, "diagonal & homogeneous"
    KQ and "last-entry-only, zero-sum" OV patterns).
    """
    run = _check_run(run)
    Wq, Wk, Wv = (run[n].transpose(..., "head", "feature", "d_head").values.astype(np.float64)
                  for n in ("W_Q", "W_K", "W_V"))
    Wo = run["W_O"].transpose(..., "head", "d_head").values.astype(np.float64)
    kq = np.einsum("...ik,...jk->...ij", Wq, Wk)                          # [..., head, q_feat, k_feat]
    ov = np.einsum("...ik,...k->...i", Wv, Wo)                            # [..., head, feature]
    D = kq.shape[-1]
    d = D - 1
    block = kq[..., :d, :d]
    diag = np.diagonal(block, axis1=-2, axis2=-1)                         # [..., head, d]
    diag_mean = diag.mean(-1)
    omega = diag_mean / math.sqrt(D)
    block_norm = np.sqrt((block**2).sum((-2, -1)))
    resid = block - diag_mean[..., None, None] * np.eye(d)
    identity_error = np.sqrt((resid**2).sum((-2, -1))) / np.where(block_norm > 0, block_norm, np.nan)
    total = (kq[..., :d, :] ** 2).sum((-2, -1))                          # rows the query uses
    offdiag = total - (diag**2).sum(-1)
    offdiag_ratio = offdiag / np.where(total > 0, total, np.nan)
    diag_cv = diag.std(-1) / np.where(np.abs(diag_mean) > 0, np.abs(diag_mean), np.nan)
    mu = ov[..., -1]
    ov_total = (ov**2).sum(-1)
    offy = (ov[..., :-1] ** 2).sum(-1) / np.where(ov_total > 0, ov_total, np.nan)
    active = np.abs(mu) >= 0.05 * np.abs(mu).max(-1, keepdims=True)
    mu_abs = np.abs(mu).sum(-1)
    mu_sum_ratio = np.abs(mu.sum(-1)) / np.where(mu_abs > 0, mu_abs, np.nan)

    lead = tuple(d_ for d_ in run["W_Q"].dims if d_ not in ("head", "feature", "d_head"))
    features = list(run["feature"].values) if "feature" in run.coords else [f"x{i + 1}" for i in range(d)] + ["y"]
    coords = {c: run.coords[c] for c in lead if c in run.coords}
    coords.update({"head": run["head"].values if "head" in run.coords else np.arange(kq.shape[-3]),
                   "query_feature": features, "key_feature": features, "feature": features})
    H = (*lead, "head")
    return xr.Dataset(
        {"W_KQ": ((*H, "query_feature", "key_feature"), kq.astype(np.float32)),
         "W_OV": ((*H, "feature"), ov.astype(np.float32)),
         "omega": (H, omega), "mu": (H, mu),
         "kq_identity_error": (H, identity_error), "kq_offdiag_ratio": (H, offdiag_ratio),
         "kq_diag_cv": (H, diag_cv), "ov_offy_ratio": (H, offy),
         "mu_sum_ratio": (lead, mu_sum_ratio),
         "active": (H, active),
         "kq_identity_error_max": (lead, _nanmax(np.where(active, identity_error, np.nan))),
         "ov_offy_ratio_max": (lead, _nanmax(np.where(active, offy, np.nan)))},
        coords=coords,
        attrs=_attrs("attention_patterns", {}, run.attrs.get("seed", 0)),
    )


def _nanmax(x: np.ndarray) -> np.ndarray:
    """Max over the last axis ignoring NaN; NaN (without a warning) where all are NaN."""
    filled = np.where(np.isnan(x), -np.inf, x).max(axis=-1)
    return np.where(np.isneginf(filled), np.nan, filled)


#: Thresholds of `pattern_reached`: the paper's patterns, numerically.
PATTERN_THRESHOLDS: dict[str, float] = {
    "kq_identity_error_max": 0.1,   # x-block within 10% (Frobenius) of a scaled identity
    "ov_offy_ratio_max": 0.01,      # <1% of OV energy off the y entry
    "mu_sum_ratio": 0.05,           # heads cancel to 5% (only asked of H >= 2)
}


def pattern_reached(patterns: xr.Dataset, thresholds: dict[str, float] | None = None) -> xr.DataArray:
    """Whether every active head shows the paper's pattern, per checkpoint.

    KQ x-block close to a scaled identity, OV on the y entry only, and (with two or more
    heads) the heads' mu summing to about zero; thresholds in `PATTERN_THRESHOLDS`.
    """
    limits = {**PATTERN_THRESHOLDS, **(thresholds or {})}
    ok = (patterns["kq_identity_error_max"] < limits["kq_identity_error_max"]) & \
         (patterns["ov_offy_ratio_max"] < limits["ov_offy_ratio_max"])
    if patterns.sizes["head"] >= 2:
        ok = ok & (patterns["mu_sum_ratio"] < limits["mu_sum_ratio"])
    return ok.rename("pattern_reached")


def _first_settled(flags: np.ndarray) -> int | None:
    """Index from which ``flags`` stays True to the end, or None."""
    for i in range(len(flags)):
        if flags[i:].all():
            return i
    return None


# -- losses of the model and the baselines --------------------------------------------

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
        attrs=_attrs("icl_losses_by_length", {"step": step, "n_prompts": n_prompts,
                                              "context_lengths": context_lengths}, seed,
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
    ds.attrs = _attrs("linear_icl_analysis", {"n_prompts": n_prompts,
                                              "run_params": p}, seed,
                      pattern_step=pattern_step, pattern_seconds=pattern_seconds,
                      train_seconds=run.attrs.get("train_seconds"),
                      n_heads=int(run.sizes["head"]),
                      final_test_loss=float(run["test_loss"].sel(context_length=train_L).isel(step=-1))
                      if train_L in run["context_length"].values else None,
                      final_dgd_r2=float(last["dgd_r2"]),
                      dgd_step_size_fitted=base.attrs["dgd_step_size"])
    return ds


# -- cached runs ----------------------------------------------------------------------

def run_key_parts(params: dict[str, Any]) -> dict[str, Any]:
    """The parts of the store key of the training run with ``params`` (`Store.key` hashes them)."""
    return {"method": "linear_icl", "format": 1, **params}


#: The seed-0 runs with `DEFAULTS` for these head counts ship with the project, so the page
#: opens on them instead of training them (about 3 minutes of one CPU core).
SHIPPED_HEADS: tuple[int, ...] = (1, 2, 4)

#: The shipped runs: weights at every checkpoint in float16, losses at full precision, and the
#: `linear_icl_analysis` of those float16 weights; ``scripts/ship_linear_icl_runs.py`` writes it
#: and `tests/test_linear_icl.py` checks that re-training reproduces its first checkpoints.
SHIPPED_RUNS = DATASETS_DIR / "dynamics" / "linear_icl_seed0.safetensors"

_WEIGHTS = ("W_Q", "W_K", "W_V", "W_O")


def save_linear_icl_runs_safetensors(runs: Mapping[int, xr.Dataset], path: str | Path, *,
                                     analyses: Mapping[int, xr.Dataset] | None = None) -> Path:
    """Write runs (by head count; weights as float16) and optionally their analyses as one
    safetensors file.

    Tensors are named ``run_H<n>/<variable>`` and ``analysis_H<n>/<variable>``; dims and attrs
    are JSON in the metadata; no pickle. float16 keeps about 3 significant digits of a weight.
    """
    if not runs:
        raise InputError("`runs` must hold at least one run.")
    parts: dict[str, xr.Dataset] = {}
    for H, run in sorted(runs.items()):
        parts[f"run_H{int(H)}"] = _check_run(run)
        if analyses is not None:
            if H not in analyses:
                raise InputError(f"`analyses` has no analysis for the run with H = {H}.")
            parts[f"analysis_H{int(H)}"] = analyses[H]
    return datasets_to_safetensors(parts, path, half=_WEIGHTS,
                                   metadata={"weights_dtype": "float16", "heads": sorted(map(int, runs))})


def load_linear_icl_runs_safetensors(path: str | Path) -> tuple[dict[int, xr.Dataset], dict[int, xr.Dataset]]:
    """Read a file of `save_linear_icl_runs_safetensors`: the runs by head count (weights back
    in float32, the stored float16 values exactly) and the analyses it holds, by head count."""
    parts, _ = datasets_from_safetensors(path, as_float32=_WEIGHTS)
    runs = {int(k[len("run_H"):]): _check_run(v) for k, v in parts.items() if k.startswith("run_H")}
    if not runs:
        raise InputError(f"{str(path)!r} holds no linear-ICL run.")
    analyses = {int(k[len("analysis_H"):]): v for k, v in parts.items() if k.startswith("analysis_H")}
    return runs, analyses


def _shipped_run(full: dict[str, Any], store) -> xr.Dataset | None:
    """The shipped run if ``full`` is a default seed-0 setting with a shipped head count (and
    the file is there); its analysis goes into the store under the key
    `stored_linear_icl_analysis` reads."""
    H = full.get("n_heads")
    if {**full, "n_heads": DEFAULTS["n_heads"]} != DEFAULTS or H not in SHIPPED_HEADS \
            or not SHIPPED_RUNS.is_file():
        return None
    runs, analyses = load_linear_icl_runs_safetensors(SHIPPED_RUNS)
    if H not in runs:
        return None
    run = runs[H]
    run.attrs["source"] = (f"shipped with the project ({SHIPPED_RUNS.name}, weights in float16); "
                           "`explorer linear-icl train` re-trains it in full precision")
    if H in analyses:
        a = analyses[H]
        parts = _analysis_parts(run, a.attrs["params"]["n_prompts"], a.attrs["seed"])
        store.put(store.key(parts), a, parts=parts)
    return run


def linear_icl_run(*, store=None, retrain: bool = False, progress: ProgressCallback | None = None,
                   **params: Any) -> xr.Dataset:
    """The training run for ``params`` (see `train_linear_icl`), from the store or trained.

    A default seed-0 run with a head count in `SHIPPED_HEADS`, when the store lacks it, is
    read from `SHIPPED_RUNS` (float16 weights, with its analysis) instead of being trained.
    ``retrain=True`` trains again and replaces the stored run.
    """
    return stored_training_run(run_key_parts, train_linear_icl, DEFAULTS, params, what="linear-ICL",
                               store=store, retrain=retrain, progress=progress, shipped=_shipped_run)


def _analysis_parts(run: xr.Dataset, n_prompts: int, seed: int) -> dict[str, Any]:
    # The run is named by its parameters and a hash of its weights, so a changed run never
    # reads an analysis of another.
    digest = hashlib.sha256()
    for name in _WEIGHTS:
        digest.update(np.ascontiguousarray(run[name].values).tobytes())
    return {"method": "linear_icl_analysis", "format": 1,
            "run": {**run.attrs.get("params", {}), "seed": run.attrs.get("seed", 0)},
            "weights_sha256": digest.hexdigest()[:32], "n_prompts": n_prompts, "seed": seed}


def stored_linear_icl_analysis(run: xr.Dataset, *, store=None, n_prompts: int = 2048,
                               seed: int = 1) -> xr.Dataset:
    """`linear_icl_analysis` of a run, from the store or computed and stored.

    The key holds the run's parameters, seed and a hash of its weights, so the command
    line and the app share one stored analysis per run.
    """
    from explorer.store import ActivationStore

    run = _check_run(run)
    store = ActivationStore() if store is None else store
    parts = _analysis_parts(run, n_prompts, seed)
    return store.get_or_compute(parts, lambda: linear_icl_analysis(
        run, n_prompts=n_prompts, seed=seed)).load()


def analysis_summary(analyses: dict[int, xr.Dataset]) -> dict[str, Any]:
    """Headline numbers of `linear_icl_analysis` for runs with different head counts."""
    out: dict[str, Any] = {"runs": {}}
    for H, ds in sorted(analyses.items()):
        last = ds.isel(step=-1)
        train_L = int(ds.attrs["params"]["run_params"].get("context_length", DEFAULTS["context_length"]))
        out["runs"][str(H)] = {
            "n_heads": H,
            "train_seconds": ds.attrs.get("train_seconds"),
            "final_test_loss": ds.attrs.get("final_test_loss"),
            "omega": last["omega"].values.tolist(),
            "mu": last["mu"].values.tolist(),
            "kq_identity_error_max": float(last["kq_identity_error_max"]),
            "kq_offdiag_ratio": last["kq_offdiag_ratio"].values.tolist(),
            "ov_offy_ratio_max": float(last["ov_offy_ratio_max"]),
            "mu_sum_ratio": float(last["mu_sum_ratio"]),
            "dgd_r2": float(last["dgd_r2"]),
            "active_heads": int(last["active"].sum()),
            "pattern_step": ds.attrs.get("pattern_step"),
            "pattern_seconds": ds.attrs.get("pattern_seconds"),
            "pattern_r2": float(last["pattern_r2"]),
            "loss_by_context_length": {
                str(int(L)): {"model": float(last["baseline_model"].sel(context_length=L)),
                              "debiased_gd": float(last["baseline_debiased_gd"].sel(context_length=L)),
                              "bayes": float(last["baseline_bayes_expected"].sel(context_length=L))}
                for L in ds["context_length"].values},
            "train_context_length": train_L,
        }
    if "1" in out["runs"] and "2" in out["runs"]:
        a, b = out["runs"]["1"]["final_test_loss"], out["runs"]["2"]["final_test_loss"]
        if a is not None and b is not None:
            out["loss_gap_h1_minus_h2"] = a - b
    return out
