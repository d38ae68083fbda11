"""The one-layer multi-head softmax-attention model of He et al. (ICML 2025), its setting
(`DEFAULTS`) and its prompts (noisy linear regressions)."""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from explorer._checks import InputError, check_float, check_int

__all__ = [
    'CITATION', 'DEFAULTS', 'TEST_LENGTHS', 'ProgressCallback', 'ICLAttention',
    'sample_regression_prompts',
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

    A dict of tensors: one training step's batch of differently shaped arrays, read by name
    by the training loop and the losses.
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
