"""The encoders of ITDA: matching pursuit (MP) and orthogonal matching pursuit (OMP) of
activations over unit-norm atoms (`matching_pursuit`), plus the decoding and L0 helpers the
dictionary and its measures share.
"""
from __future__ import annotations

import torch

__all__ = ["ENCODERS", "matching_pursuit"]

#: Encoders: matching pursuit (the paper's text and default) or orthogonal MP (its Algorithm 1).
ENCODERS = ("mp", "omp")

_ZERO = 1e-12  # a residual this small (relative) counts as an exact reconstruction


def matching_pursuit(x: torch.Tensor, atoms: torch.Tensor, l0: int, *, method: str = "mp"
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse codes of ``x`` over unit-norm ``atoms`` with at most ``l0`` steps.

    A tuple: the chosen atoms and their coefficients, step by step, read together.

    MP: residual r = x; each step picks j = argmax |<r, d_j>|, adds <r, d_j> to a_j and
    subtracts <r, d_j> d_j from r. OMP picks the same way but refits all chosen
    coefficients by least squares after each step. A row stops early once its residual
    is zero (relative 1e-12), so an atom reconstructs itself with one step.

    Parameters
    ----------
    x : torch.Tensor, shape (n, d)
    atoms : torch.Tensor, shape (m, d)
        Unit-norm rows.
    l0 : int
        Maximum number of steps (MP may pick one atom twice; OMP never does).
    method : {"mp", "omp"}, default="mp"

    Returns
    -------
    indices : torch.Tensor of int64, shape (n, l0)
        Atom chosen at each step; -1 where a row had stopped.
    coefficients : torch.Tensor, shape (n, l0)
        The coefficient of each step (0 where stopped); x_hat = sum_t c_t atoms[i_t].
    """
    idx, coef, _, _ = _pursuit(x, atoms, l0, method=method, path=False)
    return idx, coef


def _pursuit(x: torch.Tensor, atoms: torch.Tensor, l0: int, *, method: str, path: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`matching_pursuit`, optionally with its path: the residual before each step [n, l0, d]
    and the score of the atom picked at each step [n, l0] (what a new atom must beat)."""
    n, d = x.shape
    m = atoms.shape[0]
    idx = torch.full((n, l0), -1, dtype=torch.long)
    coef = torch.zeros((n, l0), dtype=x.dtype)
    residuals = torch.zeros((n, l0, d), dtype=x.dtype) if path else None    # [n, step, d]
    picked = torch.zeros((n, l0), dtype=x.dtype) if path else None          # [n, step]
    if m == 0 or n == 0:
        return idx, coef, residuals, picked
    r = x.clone()                                        # [n, d]
    sq_norm = (x * x).sum(1).clamp_min(1e-30)            # [n]
    active = torch.ones(n, dtype=torch.bool)
    rows = torch.arange(n)
    for t in range(l0):
        scores = r @ atoms.T                             # [n, m]
        if method == "omp" and t > 0:
            scores[rows[:, None], idx[:, :t].clamp_min(0)] = 0.0  # never re-pick (r is orthogonal anyway)
        j = scores.abs().argmax(1)                       # [n]
        c = scores[rows, j]                              # [n]
        if path:
            residuals[:, t] = r
            picked[:, t] = c
        j = torch.where(active, j, torch.full_like(j, -1))
        idx[:, t] = j
        if method == "mp":
            c = torch.where(active, c, torch.zeros_like(c))
            coef[:, t] = c
            r -= c[:, None] * atoms[j.clamp_min(0)]
        else:
            sel = atoms[idx[:, : t + 1].clamp_min(0)]    # [n, t+1, d]
            keep = (idx[:, : t + 1] >= 0).to(x.dtype)    # [n, t+1]
            sel = sel * keep[..., None]
            gram = sel @ sel.transpose(1, 2)             # [n, t+1, t+1]
            gram = gram + torch.diag_embed(1.0 - keep)   # stopped steps: identity rows, coefficient 0
            rhs = (sel @ x[:, :, None])[..., 0]          # [n, t+1]
            sol = torch.linalg.lstsq(gram, rhs[..., None]).solution[..., 0] * keep
            coef[:, : t + 1] = sol
            r = x - (sol[:, None, :] @ sel)[:, 0, :]
        active &= (r * r).sum(1) > _ZERO * sq_norm
        if not active.any():
            break
    return idx, coef, residuals, picked


def _decode(idx: torch.Tensor, coef: torch.Tensor, atoms: torch.Tensor) -> torch.Tensor:
    """x_hat [n, d] from codes [n, l0] over atoms [m, d]."""
    if atoms.shape[0] == 0:
        return torch.zeros((idx.shape[0], atoms.shape[1]), dtype=coef.dtype)
    picked = atoms[idx.clamp_min(0)]                     # [n, l0, d]
    w = torch.where(idx >= 0, coef, torch.zeros_like(coef))
    return (w[:, :, None] * picked).sum(1)


def _distinct_nonzero(idx: torch.Tensor, coef: torch.Tensor, x_norm: torch.Tensor) -> torch.Tensor:
    """Number of distinct atoms with a non-zero summed coefficient, per row: the code's L0."""
    n, l0 = idx.shape
    counts = torch.zeros(n, dtype=torch.long)
    for i in range(n):
        sums: dict[int, float] = {}
        for j, c in zip(idx[i].tolist(), coef[i].tolist()):
            if j >= 0:
                sums[j] = sums.get(j, 0.0) + c
        tol = 1e-6 * float(x_norm[i])
        counts[i] = sum(1 for v in sums.values() if abs(v) > tol)
    return counts
