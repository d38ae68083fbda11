"""Inference-Time Decomposition of Activations (ITDA): dictionaries of real activations.

An ITDA dictionary is a set of unit-norm activations ("atoms") taken from the data itself.
An activation x is encoded by matching pursuit (MP) over the atoms with at most ``l0``
steps; while the dictionary is built, x is added as a new atom x/||x|| whenever its
relative reconstruction error ||x - x_hat||^2 / ||x||^2 exceeds ``tau`` (Leask et al.,
2025, Algorithm 1). Each atom keeps the label of the token it came from (prompt, position,
token), so two dictionaries built on the same token stream can be compared by their
labels alone (`explorer.analyses.similarity.jaccard_index`).

Building needs no gradient steps: one pass over the activations, one matrix product per MP
step per batch. `ITDA.fit` streams over an activation Dataset chunk by chunk (the lazy,
dask-backed Datasets of `explorer.store.ActivationStore` included), so the dictionary,
not the data, bounds the memory.

Also here: the measures of a dictionary (error, L0, size, fraction of variance explained,
downstream loss with the decoded activation spliced into the model) and a plain TopK
sparse autoencoder (`SparseAutoencoder`) trained on the same activations for a time and
quality comparison (`itda_vs_sae`).

References
----------
P. Leask, N. Nanda, N. Al Moubayed, "Inference-Time Decomposition of Activations (ITDA):
A Scalable Approach to Interpreting Large Language Models", ICML 2025.

S. Mallat, Z. Zhang, "Matching pursuits with time-frequency dictionaries", IEEE Trans.
Signal Processing, 1993 (MP); Y. Pati, R. Rezaiifar, P. Krishnaprasad, "Orthogonal
matching pursuit", Asilomar 1993 (OMP).

L. Gao et al., "Scaling and evaluating sparse autoencoders", 2024 (TopK SAE).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import xarray as xr

from explorer._checks import InputError, check_choice, check_float, check_int

__all__ = [
    "ITDA",
    "ENCODERS",
    "matching_pursuit",
    "activation_chunks",
    "cached_activations",
    "itda_reconstruction",
    "itda_tau_sweep",
    "itda_atom_examples",
    "itda_downstream_loss",
    "downstream_loss",
    "SparseAutoencoder",
    "itda_vs_sae",
]

CITATION = ("Leask, Nanda, Al Moubayed, 'Inference-Time Decomposition of Activations (ITDA)', "
            "ICML 2025")

#: Encoders: matching pursuit (the paper's text and default) or orthogonal MP (its Algorithm 1).
ENCODERS = ("mp", "omp")

_ZERO = 1e-12  # a residual this small (relative) counts as an exact reconstruction


# -- matching pursuit -------------------------------------------------------------------

def matching_pursuit(x: torch.Tensor, atoms: torch.Tensor, l0: int, *, method: str = "mp"
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse codes of ``x`` over unit-norm ``atoms`` with at most ``l0`` steps.

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


# -- reading activations ----------------------------------------------------------------

def _select_site(data: xr.Dataset | xr.DataArray, site: str, layer: int | None) -> xr.DataArray:
    """The (prompt, pos, d_model) DataArray of ``site`` at ``layer``."""
    if isinstance(data, xr.Dataset):
        if site not in data:
            raise InputError(f"the activations have no variable {site!r}; they have "
                             f"{', '.join(map(str, data.data_vars))}.")
        var = data[site]
        if "mask" in data and "mask" not in var.coords:
            var = var.assign_coords(mask=data["mask"])
    elif isinstance(data, xr.DataArray):
        var = data
    else:  # pragma: no cover - callers check first
        raise TypeError(type(data).__name__)
    if "layer" in var.dims:
        layers = [int(v) for v in var["layer"].values]
        if layer is None:
            if len(layers) != 1:
                raise InputError(f"the activations hold layers {layers}; pass `layer` to pick one.")
            layer = layers[0]
        if layer not in layers:
            raise InputError(f"`layer` must be one of the traced layers {layers}; got {layer}.")
        var = var.sel(layer=layer)
    missing = {"prompt", "pos"} - set(var.dims)
    if missing or var.ndim != 3:
        raise InputError(f"activations must have dims (prompt, pos, d_model); got {var.dims}.")
    return var.transpose("prompt", "pos", ...)


def activation_chunks(data: Any, *, site: str = "resid_post", layer: int | None = None,
                      chunk_prompts: int = 64, labels: Any = None, tokens: Any = None,
                      min_pos: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """Yield the real tokens' activations chunk by chunk, with their labels.

    ``data`` is a Dataset from `trace` or the store (prompt, pos, layer, d_model plus
    ``mask``; a dask-backed one is read one stored chunk at a time), a DataArray
    (prompt, pos, d_model), or an array [n, d] (then ``labels`` [n, 2] give (prompt, pos)
    per row, default (0, row), and ``tokens`` [n] their strings). Tokens at positions below
    ``min_pos`` are left out: ``min_pos=1`` drops each prompt's first token, which in many
    models (SmolLM2 included) carries an attention-sink norm a hundred times the others'.

    A list of Datasets (as `cached_activations` returns with ``chunk_prompts``) is read one
    after the other.

    Yields
    ------
    dict with ``x`` [n, d] float32, ``prompt`` [n], ``pos`` [n], ``token`` [n] (str) and
    ``token_id`` [n] (-1 when unknown).
    """
    check_int("min_pos", min_pos, low=0)
    if isinstance(data, (list, tuple)) and data and all(isinstance(d, xr.Dataset) for d in data):
        for part in data:
            yield from activation_chunks(part, site=site, layer=layer, chunk_prompts=chunk_prompts,
                                         min_pos=min_pos)
        return
    if isinstance(data, (xr.Dataset, xr.DataArray)):
        var = _select_site(data, site, layer)
        chunks = var.chunks
        if chunks is not None:
            sizes = list(chunks[0])                      # dask: one stored chunk at a time
        else:
            n_prompts = var.sizes["prompt"]
            sizes = [min(chunk_prompts, n_prompts - s) for s in range(0, n_prompts, chunk_prompts)]
        prompt_ids = np.asarray(var["prompt"].values)
        pos_ids = np.asarray(var["pos"].values)
        start = 0
        for size in sizes:
            part = var.isel(prompt=slice(start, start + size))
            x = np.asarray(part.values, dtype=np.float32)                  # [p, pos, d]
            if "mask" in part.coords:
                mask = np.asarray(part["mask"].values, dtype=bool)
            else:
                mask = np.isfinite(x).all(-1)
            mask = mask & (pos_ids >= min_pos)[None, :]
            pi, qi = np.nonzero(mask)
            tok = (np.asarray(part["token"].values)[pi, qi].astype(str) if "token" in part.coords
                   else np.full(len(pi), "", dtype=object).astype(str))
            tid = (np.asarray(part["token_id"].values)[pi, qi] if "token_id" in part.coords
                   else np.full(len(pi), -1))
            yield {"x": x[pi, qi], "prompt": prompt_ids[start + pi], "pos": pos_ids[qi],
                   "token": tok, "token_id": np.asarray(tid, dtype=np.int64)}
            start += size
        return
    x = data.detach().cpu().numpy() if isinstance(data, torch.Tensor) else np.asarray(data)
    if x.ndim != 2:
        raise InputError(f"an activation array must be 2-d [token, d_model]; got shape {x.shape}.")
    n = x.shape[0]
    if labels is None:
        lab = np.stack([np.zeros(n, dtype=np.int64), np.arange(n)], axis=1)
    else:
        lab = np.asarray(labels, dtype=np.int64)
        if lab.shape != (n, 2):
            raise InputError(f"`labels` must have shape ({n}, 2) (prompt, pos per row); got {lab.shape}.")
    tok = np.asarray(tokens).astype(str) if tokens is not None else np.full(n, "").astype(str)
    if tok.shape != (n,):
        raise InputError(f"`tokens` must have one string per row ({n}); got shape {tok.shape}.")
    keep = lab[:, 1] >= min_pos
    x, lab, tok = x[keep], lab[keep], tok[keep]
    n = x.shape[0]
    step = max(1, chunk_prompts) * 64
    for s in range(0, n, step):
        yield {"x": np.asarray(x[s:s + step], dtype=np.float32), "prompt": lab[s:s + step, 0],
               "pos": lab[s:s + step, 1], "token": tok[s:s + step],
               "token_id": np.full(min(step, n - s), -1, dtype=np.int64)}


def _check_data(data: Any, name: str = "activations") -> None:
    if isinstance(data, (list, tuple)) and data and all(isinstance(d, xr.Dataset) for d in data):
        return
    if not isinstance(data, (xr.Dataset, xr.DataArray, np.ndarray, torch.Tensor)):
        raise TypeError(f"`{name}` must be an xarray Dataset/DataArray of activations, a list of "
                        f"Datasets (`cached_activations(..., chunk_prompts=N)`), or an array "
                        f"[token, d_model]; got {type(data).__name__}.")


def cached_activations(model: Any, prompts: Sequence[str], *, site: str = "resid_post",
                       layers: Any = None, store: Any = None, batch_size: int = 8,
                       chunk_prompts: int | None = None, progress: Any = None
                       ) -> xr.Dataset | list[xr.Dataset]:
    """Trace ``prompts`` once and keep the activations in the store (lazy on later reads).

    The store key covers the model provenance, the prompts, the site and the layers, so a
    second call with the same inputs reads the stored zarr chunk by chunk instead of
    running the model.

    Parameters
    ----------
    model : Model
    prompts : sequence of str
    site : str, default="resid_post"
    layers : int or sequence of int, optional (default all)
    store : ActivationStore, optional
        Default: ``ActivationStore()`` (``$EXPLORER_CACHE``).
    chunk_prompts : int, optional
        Trace and store this many prompts at a time, one store entry each, and return the
        list of lazy Datasets (prompt coords numbered globally): memory then stays bounded
        while tracing too. Every ITDA function reads such a list as one stream.

    Returns
    -------
    xarray.Dataset, or a list of them with ``chunk_prompts``
    """
    from explorer.store import ActivationStore
    from explorer.trace import check_layers, check_sites, trace

    check_sites((site,))
    layer_list = check_layers(model, layers)
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    store = ActivationStore() if store is None else store
    model_parts = model.spec.provenance()
    model_parts.pop("versions", None)

    def one(part: list[str], start: int) -> xr.Dataset:
        parts = {"model": model_parts, "method": "trace", "prompts": part, "sites": [site],
                 "layers": layer_list, "dtype": "float32"}
        ds = store.get_or_compute(parts, lambda: trace(model, part, sites=(site,), layers=layer_list,
                                                       batch_size=batch_size, progress=progress))
        return ds.assign_coords(prompt=np.arange(start, start + len(part))) if start else ds

    if chunk_prompts is None:
        return one(prompts, 0)
    check_int("chunk_prompts", chunk_prompts, low=1)
    return [one(prompts[s: s + chunk_prompts], s) for s in range(0, len(prompts), chunk_prompts)]


# -- the dictionary ---------------------------------------------------------------------

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


# -- measures -----------------------------------------------------------------------------

def _reconstruction_sums(itda: ITDA, activations: Any, *, site: str, layer: int | None, min_pos: int):
    """Per-token error and L0 plus the sums FVE needs, streamed."""
    per_tok = []
    sse = 0.0
    n = 0
    s1 = None
    s2 = 0.0
    for chunk in activation_chunks(activations, site=site, layer=layer, min_pos=min_pos):
        x = torch.as_tensor(chunk["x"])
        if x.shape[0] == 0:
            continue
        idx, coef = matching_pursuit(x, itda._atoms[: itda.n_atoms], itda.l0, method=itda.method)
        xhat = _decode(idx, coef, itda._atoms[: itda.n_atoms])
        res = ((x - xhat) ** 2).sum(1).double()
        norm2 = (x.double() ** 2).sum(1)
        l0 = _distinct_nonzero(idx, coef, norm2.sqrt())
        per_tok.append((chunk["prompt"], chunk["pos"], (res / norm2.clamp_min(1e-30)).numpy(), l0.numpy()))
        sse += float(res.sum())
        xs = x.double()
        s1 = xs.sum(0) if s1 is None else s1 + xs.sum(0)
        s2 += float((xs ** 2).sum())
        n += x.shape[0]
    if n == 0:
        raise InputError("the activations hold no real tokens.")
    total_var = s2 - float((s1 ** 2).sum()) / n                 # sum ||x - mean||^2
    return per_tok, sse, total_var, n


def itda_reconstruction(itda: ITDA, activations: Any, *, site: str = "resid_post",
                        layer: int | None = None, min_pos: int = 0) -> xr.Dataset:
    """How well a dictionary reconstructs ``activations``: per token and overall.

    Returns
    -------
    xarray.Dataset
        ``error`` (token): relative squared error ||x - x_hat||^2 / ||x||^2; ``l0`` (token):
        distinct atoms used; coords ``prompt``/``pos`` (token). Scalars ``mean_error``,
        ``mean_l0``, ``fve`` (fraction of variance explained, 1 - SSE / sum ||x - mean||^2)
        and ``n_atoms``.
    """
    _check_data(activations)
    itda._check_fitted()
    per_tok, sse, total_var, n = _reconstruction_sums(itda, activations, site=site, layer=layer,
                                                       min_pos=min_pos)
    prompt = np.concatenate([p[0] for p in per_tok])
    pos = np.concatenate([p[1] for p in per_tok])
    err = np.concatenate([p[2] for p in per_tok])
    l0 = np.concatenate([p[3] for p in per_tok])
    return xr.Dataset(
        {"error": ("token", err), "l0": ("token", l0),
         "mean_error": float(err.mean()), "mean_l0": float(l0.mean()),
         "fve": 1.0 - sse / total_var if total_var > 0 else float("nan"),
         "n_atoms": itda.n_atoms},
        coords={"prompt": ("token", prompt), "pos": ("token", pos)},
        attrs={"method": "itda_reconstruction", "site": site, "layer": -1 if layer is None else int(layer),
               "params": {"tau": itda.tau, "l0": itda.l0, "encoder": itda.method, "min_pos": min_pos},
               "citation": CITATION})


def itda_tau_sweep(activations: Any, *, taus: Sequence[float] = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7),
                   l0: int = 8, method: str = "mp", site: str = "resid_post", layer: int | None = None,
                   batch_size: int = 256, eval_activations: Any = None, min_pos: int = 0,
                   progress: Callable[[int, int], None] | None = None) -> xr.Dataset:
    """Dictionary size, reconstruction error, L0 and FVE as functions of ``tau``.

    One dictionary per tau, built on ``activations`` and measured on ``eval_activations``
    (default: the same activations).

    Returns
    -------
    xarray.Dataset
        Over ``tau``: ``n_atoms``, ``mean_error``, ``mean_l0``, ``fve``, ``fit_seconds``.
    """
    _check_data(activations)
    taus = [check_float("tau", t, low=0.0, high=1.0) for t in taus]
    if not taus:
        raise InputError("`taus` must hold at least one value.")
    check_int("l0", l0, low=1)
    check_choice("method", method, ENCODERS)
    evals = activations if eval_activations is None else eval_activations
    rows = []
    for i, tau in enumerate(taus):
        itda = ITDA(tau=tau, l0=l0, method=method, batch_size=batch_size).fit(
            activations, site=site, layer=layer, min_pos=min_pos)
        rec = itda_reconstruction(itda, evals, site=site, layer=layer, min_pos=min_pos)
        rows.append((itda.n_atoms, float(rec["mean_error"]), float(rec["mean_l0"]), float(rec["fve"]),
                     itda.fit_seconds_))
        if progress is not None:
            progress(i + 1, len(taus))
    arr = np.array(rows, dtype=np.float64)
    return xr.Dataset(
        {"n_atoms": ("tau", arr[:, 0].astype(np.int64)), "mean_error": ("tau", arr[:, 1]),
         "mean_l0": ("tau", arr[:, 2]), "fve": ("tau", arr[:, 3]), "fit_seconds": ("tau", arr[:, 4])},
        coords={"tau": np.array(taus)},
        attrs={"method": "itda_tau_sweep", "site": site, "layer": -1 if layer is None else int(layer),
               "params": {"l0": l0, "encoder": method, "batch_size": batch_size, "min_pos": min_pos},
               "citation": CITATION})


def itda_atom_examples(itda: ITDA, activations: xr.Dataset, *, k: int = 5, atoms: Sequence[int] | None = None,
                       site: str = "resid_post", layer: int | None = None, min_pos: int = 0) -> xr.Dataset:
    """Top examples of each atom: the tokens whose codes give it the largest coefficients.

    Parameters
    ----------
    itda : ITDA
    activations : xarray.Dataset
        Traced activations with ``token`` coords (the probing set).
    k : int, default=5
        Examples per atom.
    atoms : sequence of int, optional
        Atoms to report (default all).

    Returns
    -------
    xarray.Dataset
        Over (atom, rank): ``coefficient`` (NaN where the atom has fewer than k uses),
        ``prompt``, ``pos``, ``token``. Over atom: ``source_prompt``, ``source_pos``,
        ``source_token``, ``n_uses`` (tokens whose code uses the atom).
    """
    itda._check_fitted()
    check_int("k", k, low=1)
    atom_ids = np.arange(itda.n_atoms) if atoms is None else np.array(
        [check_int("atom", a, low=0, high=itda.n_atoms - 1) for a in atoms], dtype=np.int64)
    n_atoms = len(atom_ids)
    best_c = np.full((n_atoms, k), -np.inf)
    best_p = np.full((n_atoms, k), -1, dtype=np.int64)
    best_q = np.full((n_atoms, k), -1, dtype=np.int64)
    best_t = np.full((n_atoms, k), "", dtype=object)
    uses = np.zeros(n_atoms, dtype=np.int64)
    for chunk in activation_chunks(activations, site=site, layer=layer, min_pos=min_pos):
        if chunk["x"].shape[0] == 0:
            continue
        dense = itda.dense_codes(chunk["x"])[:, atom_ids]      # [n, atoms]
        uses += (dense != 0).sum(0)
        for a in range(n_atoms):
            col = dense[:, a]
            nz = np.flatnonzero(col != 0)
            if nz.size == 0:
                continue
            top = nz[np.argsort(-col[nz], kind="stable")[:k]]
            cand_c = np.concatenate([best_c[a], col[top]])
            cand_p = np.concatenate([best_p[a], chunk["prompt"][top]])
            cand_q = np.concatenate([best_q[a], chunk["pos"][top]])
            cand_t = np.concatenate([best_t[a], chunk["token"][top].astype(object)])
            order = np.argsort(-cand_c, kind="stable")[:k]
            best_c[a], best_p[a], best_q[a], best_t[a] = (cand_c[order], cand_p[order],
                                                          cand_q[order], cand_t[order])
    best_c[~np.isfinite(best_c)] = np.nan
    return xr.Dataset(
        {"coefficient": (("atom", "rank"), best_c), "prompt": (("atom", "rank"), best_p),
         "pos": (("atom", "rank"), best_q), "token": (("atom", "rank"), best_t.astype(str)),
         "source_prompt": ("atom", itda.atom_prompt_[atom_ids]),
         "source_pos": ("atom", itda.atom_pos_[atom_ids]),
         "source_token": ("atom", itda.atom_token_[atom_ids]), "n_uses": ("atom", uses)},
        coords={"atom": atom_ids, "rank": np.arange(k)},
        attrs={"method": "itda_atom_examples", "site": site, "k": k, "citation": CITATION})


def _next_token_loss(logits: np.ndarray, ids: Sequence[int]) -> float:
    """Mean cross-entropy of predicting ids[1:] from logits[:-1] ([n_pos, vocab])."""
    lg = torch.as_tensor(logits[: len(ids) - 1], dtype=torch.float64)
    return float(torch.nn.functional.cross_entropy(lg, torch.as_tensor(ids[1:])))


def downstream_loss(model: Any, prompts: Sequence[str], reconstruct: Callable[[np.ndarray], np.ndarray],
                    *, layer: int, site: str = "resid_post", min_pos: int = 0,
                    method: str = "downstream_loss", progress: Callable[[int, int], None] | None = None,
                    **params: Any) -> xr.Dataset:
    """Next-token loss when ``reconstruct(x)`` replaces the real activation x at ``layer``.

    For each prompt: the clean loss H_orig, the loss H* with every position's residual
    replaced by its reconstruction, and H_0 with it zero-ablated; the CE loss score
    (H* - H_0) / (H_orig - H_0) is 1 for a perfect reconstruction and 0 for one no better
    than zeros (Leask et al., 2025, via SAEBench). Works for any reconstruction: an ITDA
    dictionary (`itda_downstream_loss`), an SAE, a projection.

    The replacement is applied with `explorer.interventions.Steer` records, one per
    position, adding (x_hat - x) at resid_post; one run per prompt, resumed from a cached
    clean run so layers before ``layer`` are not recomputed.

    Parameters
    ----------
    model : Model
    prompts : sequence of str
        Each needs at least 2 tokens.
    reconstruct : callable([n, d_model] array) -> [n, d_model] array
    layer : int
    site : {"resid_post", "resid_pre"}, default="resid_post"
        ``resid_pre`` of layer l (l >= 1) is resid_post of layer l - 1.
    min_pos : int, default=0
        Positions below this keep their real activation in both edited runs (``1`` leaves
        the attention-sink first token alone, as SAE evaluations leave BOS alone).

    Returns
    -------
    xarray.Dataset
        Over prompt: ``loss_clean``, ``loss_reconstructed``, ``loss_zero``; scalars
        ``ce_loss_score`` (from the prompt-mean losses) and ``mean_error`` (relative, over
        the replaced positions).
    """
    from explorer.interventions import Steer
    from explorer.trace import clean_run, provenance, run_with, trace

    check_choice("site", site, ("resid_post", "resid_pre"))
    layer = model.check_layer(layer)
    check_int("min_pos", min_pos, low=0)
    steer_layer = layer
    if site == "resid_pre":
        if layer == 0:
            raise InputError("`site` 'resid_pre' needs `layer` >= 1 (it is resid_post of layer - 1); got 0.")
        steer_layer = layer - 1
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    batch = model.tokenize(prompts)                          # validates every prompt up front
    short = [i for i, n in enumerate(batch.lengths) if n < max(2, min_pos + 1)]
    if short:
        raise InputError(f"`prompts[{short[0]}]` has {batch.lengths[short[0]]} token(s); the loss needs "
                         f"at least 2 and one at or after `min_pos`={min_pos}.")
    rows, errs = [], []
    for i, prompt in enumerate(prompts):
        ids = batch.token_ids[i]
        n = len(ids)
        ds = trace(model, [prompt], sites=("resid_post",), layers=[steer_layer], progress=False)
        x = ds["resid_post"].sel(layer=steer_layer).values[0, :n]          # [pos, d]
        xhat = np.asarray(reconstruct(x), dtype=np.float32)
        if xhat.shape != x.shape:
            raise InputError(f"`reconstruct` returned shape {xhat.shape} for input {x.shape}.")
        replaced = range(min_pos, n)
        errs.extend((((x - xhat) ** 2).sum(1) / np.maximum((x ** 2).sum(1), 1e-30))[min_pos:].tolist())
        cr = clean_run(model, [prompt])
        clean = _next_token_loss(cr.logits[0].float().numpy(), ids)
        recon_edits = [Steer(layer=steer_layer, vector=xhat[p] - x[p], positions=(p,)) for p in replaced]
        zero_edits = [Steer(layer=steer_layer, vector=-x[p], positions=(p,)) for p in replaced]
        recon = _next_token_loss(run_with(model, [prompt], recon_edits, resume=cr)["logits"].values[0], ids)
        zero = _next_token_loss(run_with(model, [prompt], zero_edits, resume=cr)["logits"].values[0], ids)
        rows.append((clean, recon, zero))
        if progress is not None:
            progress(i + 1, len(prompts))
    arr = np.array(rows)
    h_orig, h_star, h_zero = arr.mean(0)
    score = (h_star - h_zero) / (h_orig - h_zero) if h_orig != h_zero else float("nan")
    return xr.Dataset(
        {"loss_clean": ("prompt", arr[:, 0]), "loss_reconstructed": ("prompt", arr[:, 1]),
         "loss_zero": ("prompt", arr[:, 2]), "ce_loss_score": float(score),
         "mean_error": float(np.mean(errs))},
        coords={"prompt": np.arange(len(prompts))},
        attrs=provenance(model, method=method, layer=layer, site=site, prompts=prompts,
                         min_pos=min_pos, citation=CITATION, **params))


def itda_downstream_loss(model: Any, prompts: Sequence[str], itda: ITDA, *, layer: int,
                         site: str = "resid_post", min_pos: int = 0,
                         progress: Callable[[int, int], None] | None = None) -> xr.Dataset:
    """Next-token loss with the ITDA reconstruction spliced in at ``layer`` (see `downstream_loss`)."""
    itda._check_fitted()
    if itda._d != model.spec.d_model:
        raise InputError(f"the dictionary has d_model={itda._d}; {model.spec.name} has {model.spec.d_model}.")
    return downstream_loss(model, prompts, itda.reconstruct, layer=layer, site=site, min_pos=min_pos,
                           method="itda_downstream_loss", progress=progress, tau=itda.tau, l0=itda.l0,
                           encoder=itda.method, n_atoms=itda.n_atoms)


# -- the SAE baseline ---------------------------------------------------------------------

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
