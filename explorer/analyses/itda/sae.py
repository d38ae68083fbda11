"""The SAE baseline of ITDA: a plain TopK sparse autoencoder in torch (`SparseAutoencoder`,
Gao et al., 2024) and `itda_vs_sae`, which trains it on the same activations to the
dictionary's error and compares time, error, FVE, size and L0.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
import xarray as xr

from explorer._checks import InputError, check_float, check_int
from explorer.analyses.itda.activations import _check_data, activation_chunks
from explorer.analyses.itda.dictionary import CITATION, ITDA
from explorer.analyses.itda.measures import itda_reconstruction

__all__ = ["SparseAutoencoder", "itda_vs_sae"]

class SparseAutoencoder:
    """A plain TopK sparse autoencoder in torch, the baseline ITDA is compared with.

    z = TopK(W_enc (x - b_dec) + b_enc), x_hat = W_dec z + b_dec, unit-norm decoder rows,
    trained with Adam on the mean squared error (Gao et al., 2024). Training stops when
    the mean relative error ||x - x_hat||^2 / ||x||^2 over an epoch reaches
    ``target_error`` (the ITDA comparison sets it to the dictionary's error), or after
    ``max_epochs`` / ``max_seconds``.

    Parameters
    ----------
    n_latents : int
    k : int, default=8
        Active latents per input (matches ITDA's l0 in the comparison).
    lr : float, default=1e-3
    batch_size : int, default=256
    max_epochs : int, default=50
    max_seconds : float, optional
    target_error : float, optional
    seed : int, default=0

    Attributes
    ----------
    W_enc_ : numpy.ndarray (n_latents, d), W_dec_ (n_latents, d), b_enc_ (n_latents,), b_dec_ (d,)
    error_ : float
        Mean relative error over the last epoch.
    reached_target_ : bool
    epochs_, steps_ : int
    fit_seconds_ : float
    history_ : numpy.ndarray (epochs,), error after each epoch
    val_history_ : numpy.ndarray (epochs,), validation error after each epoch (with ``x_val``)
    """

    def __init__(self, n_latents: int, *, k: int = 8, lr: float = 1e-3, batch_size: int = 256,
                 max_epochs: int = 50, max_seconds: float | None = None,
                 target_error: float | None = None, seed: int = 0):
        self.n_latents = check_int("n_latents", n_latents, low=1)
        self.k = check_int("k", k, low=1, high=self.n_latents)
        self.lr = check_float("lr", lr, low=0.0)
        self.batch_size = check_int("batch_size", batch_size, low=1)
        self.max_epochs = check_int("max_epochs", max_epochs, low=1)
        self.max_seconds = None if max_seconds is None else check_float("max_seconds", max_seconds, low=0.0)
        self.target_error = None if target_error is None else check_float("target_error", target_error, low=0.0)
        self.seed = check_int("seed", seed)

    def _forward(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        pre = (x - params["b_dec"]) @ params["W_enc"].T + params["b_enc"]        # [b, latents]
        top = pre.topk(self.k, dim=1)
        z = torch.zeros_like(pre).scatter(1, top.indices, torch.relu(top.values))
        return z @ params["W_dec"] + params["b_dec"]

    def fit(self, x: Any, *, x_val: Any = None) -> SparseAutoencoder:
        """Train on the rows of ``x`` [n, d] (an array; stream big data through ITDA instead).

        With ``x_val``, ``target_error`` is checked on the validation rows after each epoch
        (``val_history_``) instead of on the training epoch.
        """
        xt = torch.as_tensor(np.asarray(x, dtype=np.float32))
        if xt.ndim != 2 or xt.shape[0] < 2:
            raise InputError(f"`x` must be a 2-d array with at least 2 rows; got shape {tuple(xt.shape)}.")
        n, d = xt.shape
        xv = None if x_val is None else torch.as_tensor(np.asarray(x_val, dtype=np.float32))
        if xv is not None and (xv.ndim != 2 or xv.shape[1] != d):
            raise InputError(f"`x_val` must be [n, {d}]; got shape {tuple(xv.shape)}.")
        gen = torch.Generator().manual_seed(self.seed)
        t0 = time.perf_counter()
        with torch.enable_grad():
            w_dec = torch.randn(self.n_latents, d, generator=gen)
            w_dec = w_dec / w_dec.norm(dim=1, keepdim=True)
            params = {"W_enc": w_dec.clone().requires_grad_(True),
                      "W_dec": w_dec.clone().requires_grad_(True),
                      "b_enc": torch.zeros(self.n_latents, requires_grad=True),
                      "b_dec": xt.median(0).values.clone().requires_grad_(True)}
            opt = torch.optim.Adam(params.values(), lr=self.lr)
            norm2 = (xt ** 2).sum(1).clamp_min(1e-30)
            scale = float(norm2.mean())
            history: list[float] = []
            val_history: list[float] = []
            steps = 0
            self.reached_target_ = False
            for _epoch in range(self.max_epochs):
                perm = torch.randperm(n, generator=gen)
                rel_sum = 0.0
                for s in range(0, n, self.batch_size):
                    b = perm[s:s + self.batch_size]
                    xb = xt[b]
                    xhat = self._forward(params, xb)
                    sq = ((xb - xhat) ** 2).sum(1)
                    loss = sq.mean() / scale
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    with torch.no_grad():
                        params["W_dec"] /= params["W_dec"].norm(dim=1, keepdim=True).clamp_min(1e-12)
                    rel_sum += float((sq.detach() / norm2[b]).sum())
                    steps += 1
                history.append(rel_sum / n)
                watched = history[-1]
                if xv is not None:
                    with torch.no_grad():
                        res = ((xv - self._forward(params, xv)) ** 2).sum(1)
                        val_history.append(float((res / (xv ** 2).sum(1).clamp_min(1e-30)).mean()))
                    watched = val_history[-1]
                if self.target_error is not None and watched <= self.target_error:
                    self.reached_target_ = True
                    break
                if self.max_seconds is not None and time.perf_counter() - t0 > self.max_seconds:
                    break
        self.fit_seconds_ = time.perf_counter() - t0
        self._params = {k: v.detach() for k, v in params.items()}
        self.W_enc_ = self._params["W_enc"].numpy()
        self.W_dec_ = self._params["W_dec"].numpy()
        self.b_enc_ = self._params["b_enc"].numpy()
        self.b_dec_ = self._params["b_dec"].numpy()
        self.history_ = np.array(history)
        self.val_history_ = np.array(val_history)
        self.error_ = float(history[-1])
        self.epochs_ = len(history)
        self.steps_ = steps
        return self

    def reconstruct(self, x: Any) -> np.ndarray:
        """x_hat for the rows of ``x`` [n, d]."""
        if not hasattr(self, "_params"):
            raise InputError("this SparseAutoencoder is not trained yet; call fit() first.")
        with torch.no_grad():
            return self._forward(self._params, torch.as_tensor(np.asarray(x, dtype=np.float32))).numpy()


def _stack_chunks(activations: Any, site: str, layer: int | None, min_pos: int = 0) -> np.ndarray:
    return np.concatenate([c["x"] for c in activation_chunks(activations, site=site, layer=layer,
                                                             min_pos=min_pos)])


def _error_and_fve(x: np.ndarray, xhat: np.ndarray) -> tuple[float, float]:
    x64, xh = x.astype(np.float64), xhat.astype(np.float64)
    res = ((x64 - xh) ** 2).sum(1)
    rel = float((res / np.maximum((x64 ** 2).sum(1), 1e-30)).mean())
    fve = 1.0 - res.sum() / ((x64 - x64.mean(0)) ** 2).sum()
    return rel, float(fve)


def itda_vs_sae(activations: Any, *, tau: float = 0.3, l0: int = 8, method: str = "mp",
                site: str = "resid_post", layer: int | None = None, n_latents: int | None = None,
                lr: float = 1e-3, max_epochs: int = 200, max_seconds: float = 600.0,
                eval_activations: Any = None, min_pos: int = 0, seed: int = 0) -> xr.Dataset:
    """ITDA versus a TopK SAE trained on the same activations to a comparable error.

    The ITDA dictionary is built first; the SAE (k = l0 active latents, as many latents as
    the dictionary has atoms unless ``n_latents`` is given) then trains until its mean
    relative error reaches the dictionary's, or until ``max_epochs`` / ``max_seconds``.
    The errors compared are on ``eval_activations`` when given (held-out tokens: ITDA's
    error on its own training tokens is low because many of them are atoms), else on the
    training activations. Both are then measured on the same evaluation tokens. The time ratio is ITDA seconds / SAE seconds; when
    the SAE never reaches the target, its time is a lower bound and the ratio an upper one.

    Returns
    -------
    xarray.Dataset
        Over ``model_kind`` ("itda", "sae"): ``fit_seconds``, ``mean_error``, ``fve``,
        ``size`` (atoms / latents), ``l0``. Scalars ``time_ratio`` and ``sae_reached_target``.
    """
    _check_data(activations)
    check_int("seed", seed)
    itda = ITDA(tau=tau, l0=l0, method=method).fit(activations, site=site, layer=layer, min_pos=min_pos)
    x_train = _stack_chunks(activations, site, layer, min_pos)
    x_eval = x_train if eval_activations is None else _stack_chunks(eval_activations, site, layer, min_pos)
    target, _ = _error_and_fve(x_eval, itda.reconstruct(x_eval))
    size = itda.n_atoms if n_latents is None else check_int("n_latents", n_latents, low=1)
    size = max(size, l0)
    sae = SparseAutoencoder(size, k=l0, lr=lr, max_epochs=max_epochs, max_seconds=max_seconds,
                            target_error=target, seed=seed).fit(
        x_train, x_val=None if eval_activations is None else x_eval)
    itda_err, itda_fve = _error_and_fve(x_eval, itda.reconstruct(x_eval))
    sae_err, sae_fve = _error_and_fve(x_eval, sae.reconstruct(x_eval))
    rec = itda_reconstruction(itda, x_eval)
    ratio = itda.fit_seconds_ / sae.fit_seconds_ if sae.fit_seconds_ > 0 else float("nan")
    return xr.Dataset(
        {"fit_seconds": ("model_kind", [itda.fit_seconds_, sae.fit_seconds_]),
         "mean_error": ("model_kind", [itda_err, sae_err]),
         "fve": ("model_kind", [itda_fve, sae_fve]),
         "size": ("model_kind", [itda.n_atoms, size]),
         "l0": ("model_kind", [float(rec["mean_l0"]), float(l0)]),
         "time_ratio": ratio, "sae_reached_target": bool(sae.reached_target_),
         "sae_epochs": sae.epochs_, "target_error": target},
        coords={"model_kind": ["itda", "sae"]},
        attrs={"method": "itda_vs_sae", "site": site, "layer": -1 if layer is None else int(layer),
               "n_tokens": int(x_train.shape[0]),
               "params": {"tau": tau, "l0": l0, "encoder": method, "lr": lr, "max_epochs": max_epochs,
                          "max_seconds": max_seconds, "seed": seed, "min_pos": min_pos},
               "citation": CITATION + "; Gao et al. 2024 (TopK SAE)"})
