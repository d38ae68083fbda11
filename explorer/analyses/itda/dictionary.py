"""The ITDA dictionary (`ITDA`): unit-norm real activations, labelled with their source
token, grown by matching pursuit in one pass over streamed activations (Leask et al., 2025,
Algorithm 1); encode, decode, dense codes, and a storable Dataset form.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import xarray as xr

from explorer._checks import InputError, check_choice, check_float, check_int
from explorer.analyses.itda.activations import _check_data, activation_chunks
from explorer.analyses.itda.pursuit import ENCODERS, _decode, _pursuit, matching_pursuit

__all__ = ["CITATION", "ITDA"]

CITATION = ("Leask, Nanda, Al Moubayed, 'Inference-Time Decomposition of Activations (ITDA)', "
            "ICML 2025")


class ITDA:
    """An ITDA dictionary: unit-norm real activations, labelled, grown by matching pursuit.

    Parameters
    ----------
    tau : float, default=0.3
        An activation whose relative reconstruction error ||x - x_hat||^2 / ||x||^2 exceeds
        ``tau`` becomes a new atom. Lower tau: more atoms, lower error.
    l0 : int, default=8
        Maximum matching-pursuit steps per activation (the paper uses 40 for Llama-70B).
    method : {"mp", "omp"}, default="mp"
        Matching pursuit (default) or orthogonal matching pursuit.
    batch_size : int, default=256
        Activations encoded together against the dictionary as it was before the batch.
        Those whose error exceeds ``tau`` are then taken one by one, each re-encoded
        against the dictionary grown so far in the batch, so no two atoms added in one
        batch reconstruct each other within ``tau`` (the paper's duplicate removal).
    max_atoms : int, optional
        Stop adding atoms at this size.
    progress : callable(tokens_seen, n_atoms), optional
        Called after each batch.

    Attributes
    ----------
    atoms_ : numpy.ndarray, shape (n_atoms, d_model)
        Unit-norm atoms, in the order they were added.
    atom_prompt_, atom_pos_ : numpy.ndarray of int, shape (n_atoms,)
        Label of each atom: the prompt id and position of its source token.
    atom_token_ : numpy.ndarray of str, shape (n_atoms,)
    atom_token_id_ : numpy.ndarray of int, shape (n_atoms,)
    n_tokens_seen_ : int
    growth_ : numpy.ndarray, shape (n_batches, 2)
        (tokens seen, dictionary size) after each batch.
    fit_seconds_ : float
        Wall time spent in `fit`/`partial_fit`.

    References
    ----------
    Leask, Nanda, Al Moubayed, "Inference-Time Decomposition of Activations (ITDA)", ICML 2025.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(200, 16)).astype(np.float32)
    >>> itda = ITDA(tau=0.5, l0=4).fit(x)
    >>> bool(np.allclose(itda.reconstruct(itda.atoms_), itda.atoms_, atol=1e-5))
    True
    """

    def __init__(self, *, tau: float = 0.3, l0: int = 8, method: str = "mp", batch_size: int = 256,
                 max_atoms: int | None = None, progress: Callable[[int, int], None] | None = None):
        self.tau = check_float("tau", tau, low=0.0, high=1.0)
        self.l0 = check_int("l0", l0, low=1)
        self.method = check_choice("method", method, ENCODERS)
        self.batch_size = check_int("batch_size", batch_size, low=1)
        self.max_atoms = None if max_atoms is None else check_int("max_atoms", max_atoms, low=1)
        self.progress = progress
        self._reset()

    def __repr__(self) -> str:
        size = f", n_atoms={self.n_atoms}" if self._d is not None else ""
        return f"ITDA(tau={self.tau}, l0={self.l0}, method={self.method!r}{size})"

    def _reset(self) -> None:
        self._d: int | None = None
        self._atoms = torch.zeros((0, 0))
        self._n = 0
        self._labels: list[np.ndarray] = []
        self.n_tokens_seen_ = 0
        self.fit_seconds_ = 0.0
        self._growth: list[tuple[int, int]] = []

    # -- learned attributes -------------------------------------------------------------
    @property
    def n_atoms(self) -> int:
        return self._n

    @property
    def atoms_(self) -> np.ndarray:
        self._check_fitted()
        return self._atoms[: self._n].numpy().copy()

    def _label_column(self, k: int) -> np.ndarray:
        self._check_fitted()
        if not self._labels:
            return np.zeros(0, dtype=object)
        return np.concatenate([lab[k] for lab in self._labels])

    @property
    def atom_prompt_(self) -> np.ndarray:
        return self._label_column(0).astype(np.int64)

    @property
    def atom_pos_(self) -> np.ndarray:
        return self._label_column(1).astype(np.int64)

    @property
    def atom_token_(self) -> np.ndarray:
        return self._label_column(2).astype(str)

    @property
    def atom_token_id_(self) -> np.ndarray:
        return self._label_column(3).astype(np.int64)

    @property
    def growth_(self) -> np.ndarray:
        self._check_fitted()
        return np.array(self._growth, dtype=np.int64).reshape(-1, 2)

    def atom_labels(self) -> set[tuple[int, int]]:
        """The atoms' (prompt, pos) labels as a set, for `similarity.jaccard_index`."""
        return set(zip(self.atom_prompt_.tolist(), self.atom_pos_.tolist()))

    def _check_fitted(self) -> None:
        if self._d is None:
            raise InputError("this ITDA has no dictionary yet; call fit() first.")

    # -- building -----------------------------------------------------------------------
    def fit(self, activations: Any, *, site: str = "resid_post", layer: int | None = None,
            labels: Any = None, tokens: Any = None, chunk_prompts: int = 64, min_pos: int = 0) -> ITDA:
        """Build the dictionary from scratch over ``activations`` (streamed; see `activation_chunks`)."""
        _check_data(activations)
        self._reset()
        for chunk in activation_chunks(activations, site=site, layer=layer, labels=labels,
                                       tokens=tokens, chunk_prompts=chunk_prompts, min_pos=min_pos):
            self.partial_fit(chunk["x"], labels=np.stack([chunk["prompt"], chunk["pos"]], 1),
                             tokens=chunk["token"], token_ids=chunk["token_id"])
        self._check_fitted()
        return self

    def partial_fit(self, x: Any, *, labels: Any = None, tokens: Any = None,
                    token_ids: Any = None) -> ITDA:
        """Grow the dictionary with the rows of ``x`` [n, d] (labels [n, 2] as (prompt, pos))."""
        t0 = time.perf_counter()
        x = torch.as_tensor(np.asarray(x, dtype=np.float32))
        if x.ndim != 2 or x.shape[0] == 0:
            raise InputError(f"`x` must be a non-empty 2-d array [token, d_model]; got shape {tuple(x.shape)}.")
        if not torch.isfinite(x).all():
            raise InputError("`x` holds NaN or inf; drop padding tokens first.")
        n, d = x.shape
        if self._d is None:
            self._d = d
            self._atoms = torch.zeros((max(64, self.batch_size), d))
        elif d != self._d:
            raise InputError(f"`x` has d_model={d}, the dictionary has {self._d}.")
        lab = (np.stack([np.zeros(n, dtype=np.int64), self.n_tokens_seen_ + np.arange(n)], 1)
               if labels is None else np.asarray(labels, dtype=np.int64))
        tok = np.full(n, "").astype(str) if tokens is None else np.asarray(tokens).astype(str)
        tid = np.full(n, -1, dtype=np.int64) if token_ids is None else np.asarray(token_ids, dtype=np.int64)
        for s in range(0, n, self.batch_size):
            sl = slice(s, s + self.batch_size)
            self._add_batch(x[sl], lab[sl], tok[sl], tid[sl])
            self.n_tokens_seen_ += int(x[sl].shape[0])
            self._growth.append((self.n_tokens_seen_, self._n))
            if self.progress is not None:
                self.progress(self.n_tokens_seen_, self._n)
        self.fit_seconds_ += time.perf_counter() - t0
        return self

    def _add_batch(self, xb: torch.Tensor, lab: np.ndarray, tok: np.ndarray, tid: np.ndarray) -> None:
        norms = xb.norm(dim=1)                                  # [b]
        n_before = self._n
        atoms = self._atoms[:n_before]
        idx, coef, resid, picked = _pursuit(xb, atoms, self.l0, method=self.method, path=True)
        err = ((xb - _decode(idx, coef, atoms)) ** 2).sum(1) / norms.clamp_min(1e-30) ** 2
        candidates = torch.nonzero((norms > 0) & (err > self.tau)).flatten().tolist()
        rows: list[int] = []
        for i in candidates:
            if self.max_atoms is not None and self._n >= self.max_atoms:
                break
            if rows and not self._same_path(i, idx, resid, picked, n_before):
                # an atom added in this batch would change this token's pursuit: re-encode it
                xi = xb[i: i + 1]
                grown = self._atoms[: self._n]
                j, c = matching_pursuit(xi, grown, self.l0, method=self.method)
                e = float(((xi - _decode(j, c, grown)) ** 2).sum()) / float(norms[i]) ** 2
                if e <= self.tau:
                    continue
            if self._n == self._atoms.shape[0]:                   # grow the buffer geometrically
                grown_buf = torch.zeros((2 * self._atoms.shape[0], self._d))
                grown_buf[: self._n] = self._atoms[: self._n]
                self._atoms = grown_buf
            self._atoms[self._n] = xb[i] / norms[i]
            self._n += 1
            rows.append(i)
        if rows:
            r = np.array(rows)
            self._labels.append(np.array([lab[r, 0], lab[r, 1], tok[r], tid[r]], dtype=object))

    def _same_path(self, i: int, idx: torch.Tensor, resid: torch.Tensor, picked: torch.Tensor,
                   n_before: int) -> bool:
        """Whether token i's pursuit over the grown dictionary is the one it had before the batch.

        At every step the atom picked had the largest |score|; if no atom added since beats
        it (ties go to the older, lower index), every step, and so the error, is unchanged.
        """
        if n_before == 0:
            return False
        taken = idx[i] >= 0                                     # [l0]
        new = self._atoms[n_before: self._n]                    # [k, d]
        scores = (resid[i][taken] @ new.T).abs()                # [steps, k]
        return bool((scores.max(1).values <= picked[i][taken].abs()).all())

    # -- using ----------------------------------------------------------------------------
    def encode(self, x: Any) -> tuple[np.ndarray, np.ndarray]:
        """Sparse codes of the rows of ``x`` [n, d]: (atom indices [n, l0], coefficients [n, l0]).

        Index -1 marks a step not taken (the row was already reconstructed exactly).
        """
        self._check_fitted()
        xt = self._as_tensor(x)
        idx, coef = matching_pursuit(xt, self._atoms[: self._n], self.l0, method=self.method)
        return idx.numpy(), coef.numpy()

    def decode(self, indices: Any, coefficients: Any) -> np.ndarray:
        """Reconstructions [n, d] from codes as returned by `encode`."""
        self._check_fitted()
        idx = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        coef = torch.as_tensor(np.asarray(coefficients, dtype=np.float32))
        if idx.shape != coef.shape or idx.ndim != 2:
            raise InputError(f"`indices` and `coefficients` must both be [n, l0]; got "
                             f"{tuple(idx.shape)} and {tuple(coef.shape)}.")
        if idx.numel() and int(idx.max()) >= self._n:
            raise InputError(f"atom index {int(idx.max())} is out of range for {self._n} atoms.")
        return _decode(idx, coef, self._atoms[: self._n]).numpy()

    def reconstruct(self, x: Any) -> np.ndarray:
        """Encode then decode the rows of ``x`` [n, d]."""
        return self.decode(*self.encode(x))

    def dense_codes(self, x: Any) -> np.ndarray:
        """Codes as a dense [n, n_atoms] matrix (coefficients of repeated atoms summed)."""
        idx, coef = self.encode(x)
        out = np.zeros((idx.shape[0], self._n), dtype=np.float32)
        rows = np.repeat(np.arange(idx.shape[0]), idx.shape[1])
        flat_idx, flat_coef = idx.ravel(), coef.ravel()
        ok = flat_idx >= 0
        np.add.at(out, (rows[ok], flat_idx[ok]), flat_coef[ok])
        return out

    def _as_tensor(self, x: Any) -> torch.Tensor:
        xt = torch.as_tensor(np.asarray(x, dtype=np.float32))
        if xt.ndim != 2 or xt.shape[1] != self._d:
            raise InputError(f"`x` must be [n, {self._d}]; got shape {tuple(xt.shape)}.")
        return xt

    def to_dataset(self) -> xr.Dataset:
        """The dictionary as a Dataset: ``atoms`` (atom, d_model) with label coords (storable)."""
        self._check_fitted()
        return xr.Dataset(
            {"atoms": (("atom", "d_model"), self.atoms_)},
            coords={"atom": np.arange(self._n), "atom_prompt": ("atom", self.atom_prompt_),
                    "atom_pos": ("atom", self.atom_pos_), "atom_token": ("atom", self.atom_token_),
                    "atom_token_id": ("atom", self.atom_token_id_)},
            attrs={"method": "itda", "params": {"tau": self.tau, "l0": self.l0, "encoder": self.method,
                                                "batch_size": self.batch_size},
                   "n_tokens_seen": int(self.n_tokens_seen_), "fit_seconds": float(self.fit_seconds_),
                   "citation": CITATION})

    @classmethod
    def from_dataset(cls, ds: xr.Dataset) -> ITDA:
        """Rebuild a dictionary saved with `to_dataset`."""
        p = ds.attrs.get("params", {})
        itda = cls(tau=p.get("tau", 0.3), l0=p.get("l0", 8), method=p.get("encoder", "mp"),
                   batch_size=p.get("batch_size", 256))
        atoms = torch.as_tensor(np.asarray(ds["atoms"].values, dtype=np.float32))
        itda._d = int(atoms.shape[1])
        itda._atoms = atoms.clone()
        itda._n = int(atoms.shape[0])
        itda._labels = [np.array([ds["atom_prompt"].values, ds["atom_pos"].values,
                                  ds["atom_token"].values.astype(str), ds["atom_token_id"].values],
                                 dtype=object)]
        itda.n_tokens_seen_ = int(ds.attrs.get("n_tokens_seen", 0))
        itda.fit_seconds_ = float(ds.attrs.get("fit_seconds", 0.0))
        return itda
