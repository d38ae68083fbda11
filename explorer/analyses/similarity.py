"""Representation similarity across layers and models: linear CKA, SVCCA, ITDA-Jaccard.

Three ways to say how alike two sets of activations over the *same* tokens are:

* linear CKA (Kornblith et al., 2019): centred kernel alignment with linear kernels;
  invariant to orthogonal transforms and isotropic scaling.
* SVCCA (Raghu et al., 2017): keep the top singular directions of each representation
  (99% of the variance by default), then average the canonical correlations between them.
* ITDA-Jaccard (Leask et al., ICML 2025): fit an ITDA dictionary to each representation on
  the same token stream and take the Jaccard index of the dictionaries' atom *labels*
  (prompt, position), not their vectors.

`layer_similarity` fills a layer x layer matrix for two models; `layer_matching` runs the
layer-matching benchmark (Kornblith et al., 2019) over several models: the fraction of
layers whose most similar layer in another model is the layer with the same index.

References
----------
P. Leask, N. Nanda, N. Al Moubayed, "Inference-Time Decomposition of Activations (ITDA):
A Scalable Approach to Interpreting Large Language Models", ICML 2025.

S. Kornblith, M. Norouzi, H. Lee, G. Hinton, "Similarity of Neural Network Representations
Revisited", ICML 2019.

M. Raghu, J. Gilmer, J. Yosinski, J. Sohl-Dickstein, "SVCCA: Singular Vector Canonical
Correlation Analysis for Deep Learning Dynamics and Interpretability", NeurIPS 2017.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

from explorer._checks import InputError, check_choice, check_float, check_int, check_local_weights
from explorer.models import Model

__all__ = [
    "linear_cka",
    "svcca",
    "canonical_correlations",
    "jaccard_index",
    "SIMILARITY_METHODS",
    "layer_similarity",
    "layer_matching",
    "layer_matching_accuracy",
    "perturbed_copy",
]

#: Methods `layer_similarity` and `layer_matching` know.
SIMILARITY_METHODS = ("itda", "cka", "svcca")


# -- the measures -----------------------------------------------------------------------

def _as_matrix(name: str, x: Any) -> np.ndarray:
    """``x`` as a finite float64 [n, d] array; InputError otherwise."""
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim != 2:
        raise InputError(f"`{name}` must be a 2-d array [token, feature]; got shape {arr.shape}.")
    if arr.shape[0] < 2:
        raise InputError(f"`{name}` needs at least 2 rows (tokens); got {arr.shape[0]}.")
    if not np.isfinite(arr).all():
        raise InputError(f"`{name}` holds NaN or inf; drop padding tokens first.")
    return arr


def _check_same_rows(x: np.ndarray, y: np.ndarray) -> None:
    if x.shape[0] != y.shape[0]:
        raise InputError(f"`x` and `y` must have the same tokens (rows); got {x.shape[0]} and "
                         f"{y.shape[0]}.")


def _check_pair(x: Any, y: Any) -> tuple[np.ndarray, np.ndarray]:
    x, y = _as_matrix("x", x), _as_matrix("y", y)
    _check_same_rows(x, y)
    return x, y


def _check_svcca_options(variance_kept: float, n_components: int | None) -> None:
    check_float("variance_kept", variance_kept, low=1e-6, high=1.0)
    if n_components is not None:
        check_int("n_components", n_components, low=1)


# Each measure in two steps: what depends on one representation alone (done once per matrix
# when a layer is compared with many), then the pair's score from the two.

def _cka_part(x: np.ndarray) -> tuple[np.ndarray, float]:
    """The column-centred x and ``||Xc^T Xc||_F``."""
    xc = x - x.mean(0)
    return xc, float(np.linalg.norm(xc.T @ xc))


def _cka_of_parts(px: tuple[np.ndarray, float], py: tuple[np.ndarray, float]) -> float:
    (xc, norm_x), (yc, norm_y) = px, py
    if norm_x == 0 or norm_y == 0:
        return float("nan")
    # feature-space form: d x d products, cheaper than n x n Gram matrices for many tokens
    return float(np.linalg.norm(yc.T @ xc) ** 2 / (norm_x * norm_y))


def _svcca_part(x: np.ndarray, variance_kept: float, n_components: int | None) -> np.ndarray:
    """Orthonormal basis [n, k] of the centred x's kept singular directions."""
    return _top_directions(x - x.mean(0), variance_kept, n_components)


def _correlations_of_parts(ux: np.ndarray, uy: np.ndarray) -> np.ndarray:
    """The canonical correlations of two orthonormal bases, largest first."""
    if ux.shape[1] == 0 or uy.shape[1] == 0:
        return np.zeros(0)
    return np.clip(np.linalg.svd(ux.T @ uy, compute_uv=False), 0.0, 1.0)


def linear_cka(x: Any, y: Any) -> float:
    """Linear centred kernel alignment between two representations of the same inputs.

    ``CKA = ||Yc^T Xc||_F^2 / (||Xc^T Xc||_F ||Yc^T Yc||_F)`` with column-centred Xc, Yc
    (Kornblith et al., 2019, eq. 5). 1 for representations equal up to an orthogonal
    transform and a scale; 0 for orthogonal (uncorrelated) ones.

    Parameters
    ----------
    x : array-like, shape (n, d1)
    y : array-like, shape (n, d2)
        The same n inputs (tokens) in both.

    Returns
    -------
    float
        In [0, 1]; NaN when either representation is constant.

    References
    ----------
    Kornblith et al., "Similarity of Neural Network Representations Revisited", ICML 2019.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(50, 4))
    >>> round(linear_cka(x, 3 * x), 6)
    1.0
    """
    x, y = _check_pair(x, y)
    return _cka_of_parts(_cka_part(x), _cka_part(y))


def _top_directions(x: np.ndarray, variance_kept: float, n_components: int | None) -> np.ndarray:
    """Orthonormal basis [n, k] of the centred data's top singular directions."""
    u, s, _ = np.linalg.svd(x, full_matrices=False)
    var = s ** 2
    if var.sum() == 0:
        return u[:, :0]
    if n_components is not None:
        k = min(n_components, int((s > s[0] * 1e-10).sum()))
    else:
        frac = np.cumsum(var) / var.sum()
        k = int(np.searchsorted(frac, variance_kept - 1e-12) + 1)
        k = min(k, int((s > s[0] * 1e-10).sum()))
    return u[:, :k]


def canonical_correlations(x: Any, y: Any, *, variance_kept: float = 0.99,
                           n_components: int | None = None) -> np.ndarray:
    """Canonical correlations between the top singular subspaces of ``x`` and ``y``.

    Each representation is centred and reduced to the singular directions that keep
    ``variance_kept`` of its variance (or exactly ``n_components`` of them); the canonical
    correlations are the singular values of ``Ux^T Uy`` for the orthonormal bases Ux, Uy
    (Björck & Golub's QR/SVD form of CCA).

    Parameters
    ----------
    x : array-like, shape (n, d1)
    y : array-like, shape (n, d2)
    variance_kept : float, default=0.99
        Fraction of each representation's variance its kept singular directions explain
        (Raghu et al. keep 99%).
    n_components : int, optional
        Keep exactly this many directions instead.

    Returns
    -------
    numpy.ndarray, shape (min(kx, ky),)
        Sorted from largest to smallest, each in [0, 1].
    """
    x, y = _check_pair(x, y)
    _check_svcca_options(variance_kept, n_components)
    return _correlations_of_parts(_svcca_part(x, variance_kept, n_components),
                                  _svcca_part(y, variance_kept, n_components))


def svcca(x: Any, y: Any, *, variance_kept: float = 0.99, n_components: int | None = None) -> float:
    """SVCCA similarity: the mean canonical correlation after an SVD reduction.

    The arguments are those of `canonical_correlations`; the result is the mean of its
    correlations, in [0, 1], or NaN when either representation keeps no direction (a
    constant one).

    References
    ----------
    Raghu et al., "SVCCA: Singular Vector Canonical Correlation Analysis for Deep Learning
    Dynamics and Interpretability", NeurIPS 2017.
    """
    rho = canonical_correlations(x, y, variance_kept=variance_kept, n_components=n_components)
    return float(rho.mean()) if rho.size else float("nan")


def jaccard_index(labels_a: Iterable[Hashable], labels_b: Iterable[Hashable]) -> float:
    """``|A ∩ B| / |A ∪ B|`` of two label sets (ITDA atom labels, Leask et al., 2025).

    Labels are any hashables, e.g. ``(prompt, pos)`` tuples; duplicates count once.
    Two empty sets give NaN.

    >>> jaccard_index([(0, 1), (0, 2), (1, 0)], [(0, 2), (1, 0), (2, 2)])
    0.5
    """
    a, b = set(labels_a), set(labels_b)
    union = a | b
    if not union:
        return float("nan")
    return len(a & b) / len(union)


# -- across layers and models -----------------------------------------------------------

def _layer_matrices(ds: xr.Dataset, site: str, name: str, min_pos: int = 0
                    ) -> tuple[list[int], list[np.ndarray], np.ndarray]:
    """Per layer [n_tokens, d] matrices of the real tokens, plus their (prompt, pos) labels."""
    if not isinstance(ds, xr.Dataset):
        raise TypeError(f"`{name}` must be an xarray.Dataset from `trace`; got {type(ds).__name__}.")
    if site not in ds:
        raise InputError(f"`{name}` has no variable {site!r}; it has {', '.join(map(str, ds.data_vars))}.")
    var = ds[site]
    if "layer" not in var.dims:
        raise InputError(f"`{name}[{site!r}]` has no layer dimension; got dims {var.dims}.")
    check_int("min_pos", min_pos, low=0)
    if "mask" in ds:
        mask = np.asarray(ds["mask"].transpose("prompt", "pos").values, dtype=bool)
    else:
        mask = np.ones((var.sizes["prompt"], var.sizes["pos"]), dtype=bool)
    mask = mask & (np.asarray(var["pos"].values) >= min_pos)[None, :]
    layers = [int(v) for v in var["layer"].values]
    mats = [np.asarray(var.sel(layer=layer).transpose("prompt", "pos", ...).values)[mask] for layer in layers]
    prompt_idx, pos_idx = np.nonzero(mask)
    labels = np.stack([prompt_idx, pos_idx], axis=1)
    return layers, mats, labels


def _same_tokens(ds_a: xr.Dataset, ds_b: xr.Dataset) -> None:
    """InputError unless both Datasets hold the same token stream."""
    if "token_id" in ds_a.coords and "token_id" in ds_b.coords:
        a, b = ds_a["token_id"].values, ds_b["token_id"].values
        if a.shape != b.shape or not np.array_equal(a, b):
            raise InputError("the two activation sets must come from the same token stream (same "
                             "prompts, same tokenizer); their token ids differ.")
    elif ds_a[list(ds_a.data_vars)[0]].sizes.get("prompt") != ds_b[list(ds_b.data_vars)[0]].sizes.get("prompt"):
        raise InputError("the two activation sets have different numbers of prompts.")


class _PreparedMeasure:
    """CKA or SVCCA with the per-layer work (centring, norms, SVDs) done once per matrix."""

    def __init__(self, method: str, *, variance_kept: float, n_components: int | None):
        self.method = method
        self.variance_kept = variance_kept
        self.n_components = n_components
        self._prepared: dict[int, Any] = {}

    def prepare(self, x: np.ndarray) -> Any:
        key = id(x)
        if key not in self._prepared:
            arr = _as_matrix("x", x)
            part = (_cka_part(arr) if self.method == "cka"
                    else _svcca_part(arr, self.variance_kept, self.n_components))
            self._prepared[key] = (x, part)   # keep x alive so its id stays unique
        return self._prepared[key][1]

    def __call__(self, x: np.ndarray, y: np.ndarray) -> float:
        _check_same_rows(x, y)
        px, py = self.prepare(x), self.prepare(y)
        if self.method == "cka":
            return _cka_of_parts(px, py)
        rho = _correlations_of_parts(px, py)
        return float(rho.mean()) if rho.size else float("nan")


def _matrix_measure(method: str, *, variance_kept: float, n_components: int | None
                    ) -> Callable[[np.ndarray, np.ndarray], float]:
    _check_svcca_options(variance_kept, n_components)
    return _PreparedMeasure(method, variance_kept=variance_kept, n_components=n_components)


def _itda_label_sets(mats: Sequence[np.ndarray], labels: np.ndarray, *, tau: float, l0: int,
                     batch_size: int) -> list[set[tuple[int, int]]]:
    from .itda import ITDA

    sets = []
    for x in mats:
        itda = ITDA(tau=tau, l0=l0, batch_size=batch_size).fit(x, labels=labels)
        sets.append(set(zip(itda.atom_prompt_.tolist(), itda.atom_pos_.tolist())))
    return sets


def _layer_representations(method: str, mats: Mapping[str, Sequence[np.ndarray]],
                           labels: np.ndarray, *, tau: float, l0: int, batch_size: int,
                           variance_kept: float, n_components: int | None
                           ) -> tuple[Mapping[str, Sequence[Any]], Callable[[Any, Any], float]]:
    """Per model, what ``method`` compares of each layer (the ITDA dictionary's atom labels,
    or the activation matrix itself), and the score of two layers' (symmetric in its two
    arguments for every method)."""
    if method == "itda":
        sets = {name: _itda_label_sets(m, labels, tau=tau, l0=l0, batch_size=batch_size)
                for name, m in mats.items()}
        return sets, jaccard_index
    return mats, _matrix_measure(method, variance_kept=variance_kept, n_components=n_components)


def _layer_by_layer(score: Callable[[Any, Any], float], layers_a: Sequence[Any],
                    layers_b: Sequence[Any]) -> np.ndarray:
    """[layer_a, layer_b] matrix of ``score`` between every layer of a and every layer of b."""
    sim = np.zeros((len(layers_a), len(layers_b)))
    for i, xa in enumerate(layers_a):
        for j, xb in enumerate(layers_b):
            sim[i, j] = score(xa, xb)
    return sim


def _model_name(ds: xr.Dataset, default: str) -> str:
    return str(ds.attrs.get("model", default))


def layer_similarity(activations_a: xr.Dataset, activations_b: xr.Dataset, *,
                     method: str = "cka", site: str = "resid_post", tau: float = 0.3,
                     l0: int = 8, batch_size: int = 256, variance_kept: float = 0.99,
                     n_components: int | None = None, min_pos: int = 0) -> xr.Dataset:
    """Similarity of every layer of one model with every layer of another, on the same tokens.

    Parameters
    ----------
    activations_a, activations_b : xarray.Dataset
        Outputs of `explorer.trace.trace` (or the store) for the same prompts, with the
        variable ``site`` (prompt, pos, layer, d_model) and ``mask``.
    method : {"itda", "cka", "svcca"}, default="cka"
        ITDA-Jaccard of atom labels, linear CKA, or SVCCA.
    site : str, default="resid_post"
    tau, l0, batch_size : ITDA options (``method="itda"``), see `explorer.analyses.itda.ITDA`.
    variance_kept, n_components : SVCCA options.
    min_pos : int, default=0
        Leave out positions below this (1: each prompt's attention-sink first token).

    Returns
    -------
    xarray.Dataset
        ``similarity`` (layer_a, layer_b); ``matched_layer`` (layer_a): the layer of b most
        similar to each layer of a; ``matched`` (layer_a): whether that is the same index.

    References
    ----------
    Leask et al., ICML 2025 (ITDA); Kornblith et al., ICML 2019 (CKA, layer matching);
    Raghu et al., NeurIPS 2017 (SVCCA).
    """
    check_choice("method", method, SIMILARITY_METHODS)
    if method == "itda":
        check_float("tau", tau, low=0.0, high=1.0)
        check_int("l0", l0, low=1)
    _same_tokens(activations_a, activations_b)
    layers_a, mats_a, labels = _layer_matrices(activations_a, site, "activations_a", min_pos)
    layers_b, mats_b, _ = _layer_matrices(activations_b, site, "activations_b", min_pos)
    reps, score = _layer_representations(method, {"a": mats_a, "b": mats_b}, labels, tau=tau,
                                         l0=l0, batch_size=batch_size,
                                         variance_kept=variance_kept, n_components=n_components)
    sim = _layer_by_layer(score, reps["a"], reps["b"])
    matched = np.array([layers_b[int(np.nanargmax(row))] if np.isfinite(row).any() else -1
                        for row in sim])
    return xr.Dataset(
        {"similarity": (("layer_a", "layer_b"), sim),
         "matched_layer": (("layer_a",), matched),
         "matched": (("layer_a",), matched == np.array(layers_a))},
        coords={"layer_a": layers_a, "layer_b": layers_b},
        attrs={"method": method, "site": site,
               "model_a": _model_name(activations_a, "a"), "model_b": _model_name(activations_b, "b"),
               "params": {"tau": tau, "l0": l0, "batch_size": batch_size, "min_pos": min_pos,
                          "variance_kept": variance_kept, "n_components": n_components},
               "n_tokens": int(labels.shape[0]),
               "citation": "Leask et al., ICML 2025; Kornblith et al., ICML 2019; "
                           "Raghu et al., NeurIPS 2017"},
    )


def layer_matching_accuracy(similarity: Any) -> float:
    """Fraction of layers whose most similar layer in the other model has the same index.

    ``similarity`` is a square [layer_a, layer_b] matrix, or a stack [..., layer_a, layer_b]
    of them (one per ordered model pair); the result averages over all of them. A tie for
    the maximum counts as 1/(number of tied layers) when the same-index layer is among them.
    This is the layer-matching score of Kornblith et al. (2019) as used by Leask et al. (2025).
    """
    s = np.asarray(similarity, dtype=np.float64)
    if s.ndim < 2 or s.shape[-1] != s.shape[-2]:
        raise InputError(f"`similarity` must end in a square [layer_a, layer_b] matrix; got shape {s.shape}.")
    s = s.reshape(-1, s.shape[-2], s.shape[-1])
    hits = []
    for mat in s:
        for i, row in enumerate(mat):
            if not np.isfinite(row).any():
                hits.append(0.0)
                continue
            top = np.flatnonzero(np.isclose(row, np.nanmax(row), rtol=0, atol=1e-12))
            hits.append(1.0 / len(top) if i in top else 0.0)
    return float(np.mean(hits))


def layer_matching(activations: Mapping[str, xr.Dataset], *,
                   methods: Sequence[str] = SIMILARITY_METHODS, site: str = "resid_post",
                   tau: float = 0.3, l0: int = 8, batch_size: int = 256,
                   variance_kept: float = 0.99, n_components: int | None = None, min_pos: int = 0,
                   progress: Callable[[int, int], None] | None = None) -> xr.Dataset:
    """Layer-matching benchmark: for each method, how often layer i of one model is most
    similar to layer i of another (Kornblith et al., 2019; Leask et al., 2025, sec. 5).

    Parameters
    ----------
    activations : mapping of name -> xarray.Dataset
        At least two models' activations (same prompts, same tokenizer, same layer count),
        e.g. two seeds of a small model or a model and a fine-tuned copy.
    methods : sequence of {"itda", "cka", "svcca"}
    site, tau, l0, batch_size, variance_kept, n_components, min_pos
        As in `layer_similarity`.
    progress : callable(done, total), optional

    Returns
    -------
    xarray.Dataset
        ``similarity`` (measure, model_a, model_b, layer_a, layer_b) for every ordered pair
        of distinct models (NaN on the diagonal pairs); ``accuracy`` (measure): the mean over
        ordered pairs and layers of 1[argmax_j S(a_i, b_j) = i]. (The dimension is called
        ``measure``, not ``method``, because ``method`` is a keyword of ``Dataset.sel``.)
    """
    names = list(activations)
    if len(names) < 2:
        raise InputError(f"`activations` must hold at least two models; got {len(names)}.")
    methods = [check_choice("method", m, SIMILARITY_METHODS) for m in methods]
    if not methods:
        raise InputError(f"`methods` must name at least one of {', '.join(SIMILARITY_METHODS)}.")
    first = activations[names[0]]
    for name in names[1:]:
        _same_tokens(first, activations[name])
    mats, layers = {}, None
    for name in names:
        lay, m, labels = _layer_matrices(activations[name], site, f"activations[{name!r}]", min_pos)
        if layers is not None and lay != layers:
            raise InputError(f"every model must have the same layers; {name!r} has {lay}, "
                             f"{names[0]!r} has {layers}.")
        layers, mats[name] = lay, m
    n_layers = len(layers)
    sim = np.full((len(methods), len(names), len(names), n_layers, n_layers), np.nan)
    pairs = [(a, b) for a in range(len(names)) for b in range(len(names)) if a != b]
    total = len(methods) * len(pairs)
    done = 0
    for k, method in enumerate(methods):
        reps, score = _layer_representations(method, mats, labels, tau=tau, l0=l0,
                                             batch_size=batch_size, variance_kept=variance_kept,
                                             n_components=n_components)
        for a, b in pairs:
            if b < a:  # every measure is symmetric: reuse the transpose
                sim[k, a, b] = sim[k, b, a].T
            else:
                sim[k, a, b] = _layer_by_layer(score, reps[names[a]], reps[names[b]])
            done += 1
            if progress:
                progress(done, total)
    acc = [layer_matching_accuracy(np.stack([sim[k, a, b] for a, b in pairs]))
           for k in range(len(methods))]
    return xr.Dataset(
        {"similarity": (("measure", "model_a", "model_b", "layer_a", "layer_b"), sim),
         "accuracy": (("measure",), np.array(acc))},
        coords={"measure": list(methods), "model_a": names, "model_b": names,
                "layer_a": layers, "layer_b": layers},
        attrs={"method_name": "layer_matching", "site": site,
               "params": {"tau": tau, "l0": l0, "batch_size": batch_size, "min_pos": min_pos,
                          "variance_kept": variance_kept, "n_components": n_components},
               "n_tokens": int(labels.shape[0]),
               "citation": "Kornblith et al., ICML 2019; Leask et al., ICML 2025"},
    )


def perturbed_copy(model: Model, *, scale: float = 0.02, seed: int = 0) -> Any:
    """A copy of ``model`` whose weights get relative Gaussian noise (a stand-in "sibling").

    Every weight matrix W becomes ``W + scale * std(W) * N(0, 1)``; norms and biases are
    kept. Same tokenizer, same architecture, so its activations line up token by token with
    the original's. Used as the second model of a similarity view when no trained sibling
    (another seed, a fine-tuned copy) is at hand.
    """
    import torch

    from explorer.models import wrap_model

    check_local_weights(model, "a perturbed copy")
    check_float("scale", scale, low=0.0)
    check_int("seed", seed)
    hf = copy.deepcopy(model.hf)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(hf.named_parameters(), key=lambda kv: kv[0]):
            if p.ndim >= 2:
                noise = torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype)
                p.add_(noise * (scale * p.float().std()).to(p.dtype))
    return wrap_model(hf, model.tokenizer, name=f"{model.spec.name}+noise{scale:g}s{seed}",
                      weights=f"{model.spec.weights}+noise(scale={scale:g},seed={seed})")
