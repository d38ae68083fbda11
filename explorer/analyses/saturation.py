"""Saturation events: the layer at which each of a model's top-k tokens is fixed.

Lioubashevski et al. (ICML 2025) read every layer through the logit lens and find that a
transformer settles its top-1 token first, then the rank-2 token, then rank 3, and so on:
the *saturation layers* s_1 < s_2 < ... tend to come in rank order. This module measures
that over a text corpus and runs the paper's four follow-ups:

* `saturation_layers`: one trace + a chunked logit lens per batch of texts; per position
  the saturation layer of each of the final top-k tokens (cached in the activation store).
* `order_test`: strict Kendall tau (ties count as discordant) between rank and saturation
  layer per position, averaged, with a seeded permutation test.
* `task_probe`: logistic regression predicting the *task* (how many of the top tokens are
  already decided) from the hidden state, 5-fold CV, balanced accuracy per layer, against
  Gaussian random features and chance.
* `inject_residual`: write the residual of an early-saturating position into a
  late-saturating one at one layer; the new s_1 and whether the prediction changed.
* `early_exit`: exit at the first layer where the probe says "top-1 decided", vs softmax
  margin (p1 - p2 >= theta), vs consecutive-layer cosine (>= theta), vs the oracle s_1.

`saturation_analysis` runs all of it and returns one Dataset.

Conventions
-----------
* Layers are numbered 0..L-1: layer l is the residual stream after block l
  (``resid_post``), read through the final norm and unembedding. The last layer's lens
  *is* the model's output, so the "final" top-k tokens are the lens top-k at layer L-1.
* Ranks count from 0 and are *strict*: the rank of a token is the number of vocabulary
  tokens with a strictly larger logit. Two tied tokens share a rank, so under a tie the
  token that should be one place lower is not "at its rank".
* The saturation layer of rank j, ``s_j``, is the smallest layer l such that the final
  rank-j token t_j has rank exactly j at every layer from l to L-1.
  A token at its final rank at every layer has ``s_j = 0`` (the paper's top-k helper
  returns L there; its top-1 helper returns 0; we use 0 throughout). A token that is not
  at rank j even at the last layer (possible only under a tie) has ``s_j = -1``: never.
* Position filter: keep positions whose top-1 saturates within the first ``max_ratio``
  of the layers, i.e. ``s_1 + 1 <= max_ratio * L`` (the paper's s_1 <= 0.85 L with layers
  counted from 1).
* Order test: per position take (s_1..s_k), cut it before the first rank that saturates
  only at the last layer (s = L-1) or never; keep the position if at least ``min_ranks``
  (3) ranks remain.

References
----------
D. Lioubashevski, T. Schlank, G. Stanovsky, A. Goldstein, "Looking Beyond the Top-1:
Transformers Determine Top Tokens in Order", ICML 2025.
"""
from __future__ import annotations

import copy
import json
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xarray as xr

from explorer._checks import InputError, check_choice, check_float, check_int, check_prompts

__all__ = [
    "CITATION",
    "NEVER",
    "CORPUS_DIR",
    "load_corpus",
    "corpus_chunks",
    "saturation_from_ranks",
    "kept_positions",
    "strict_kendall_tau",
    "order_test",
    "task_labels",
    "task_probe",
    "exit_layers",
    "exit_metrics",
    "early_exit",
    "EXIT_ACCURACY_TARGETS",
    "speedup_at_accuracy",
    "saturation_layers",
    "cache_saturation_parts",
    "intervention_pairs",
    "inject_residual",
    "saturation_analysis",
    "saturation_summary",
    "saturation_over_store",
    "tau_per_position",
    "random_init_twin",
]

CITATION = ("D. Lioubashevski, T. Schlank, G. Stanovsky, A. Goldstein, \"Looking Beyond the "
            "Top-1: Transformers Determine Top Tokens in Order\", ICML 2025.")

#: ``s_j`` of a token that is not at its final rank even at the last layer (ties only).
NEVER = -1

#: The shipped corpus: plain-text documents written for the project (see datasets/README.md).
CORPUS_DIR = Path(__file__).resolve().parents[2] / "datasets" / "corpus"

_MARGIN_THETAS = tuple(np.round(np.arange(0.0, 1.0001, 0.02), 2).tolist())
_COSINE_THETAS = tuple(np.round(np.concatenate([
    np.arange(0.50, 0.95, 0.05), 1.0 - np.logspace(np.log10(0.05), -4, 22)]), 6).tolist())


# -- the corpus --------------------------------------------------------------------------

def load_corpus(path: str | Path | None = None) -> list[str]:
    """The documents of a corpus folder (``*.txt``, sorted by name), or of one text file.

    Parameters
    ----------
    path : str or Path, optional
        A folder of ``.txt`` files or one file; default the shipped corpus `CORPUS_DIR`.

    Returns
    -------
    list of str
        One string per document; paragraphs are separated by blank lines.
    """
    folder = Path(path) if path is not None else CORPUS_DIR
    if folder.is_file():
        files = [folder]
    elif folder.is_dir():
        files = sorted(folder.glob("*.txt"))
    else:
        raise InputError(f"corpus path {str(folder)!r} is neither a folder nor a file.")
    docs = [f.read_text(encoding="utf-8").strip() for f in files]
    docs = [d for d in docs if d]
    if not docs:
        raise InputError(f"corpus path {str(folder)!r} holds no non-empty .txt document.")
    return docs


def _paragraphs(doc: str) -> list[str]:
    return [p.strip() for p in re.split(r"\n\s*\n", doc) if p.strip()]


def _sentences(paragraph: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?;:])\s+", paragraph) if s]


def corpus_chunks(model: Any, documents: Sequence[str], *, chunk_tokens: int = 256,
                  max_tokens: int | None = None) -> list[str]:
    """Cut documents into prompts of at most ``chunk_tokens`` tokens at paragraph breaks.

    Paragraphs are joined with a blank line while they fit; a paragraph longer than
    ``chunk_tokens`` is cut at sentence ends (a sentence longer still, at words). Chunks
    never cross a document boundary. With ``max_tokens`` the list stops once that many
    tokens are collected (the last chunk may be cut to fit).
    """
    check_prompts(list(documents))
    chunk_tokens = check_int("chunk_tokens", chunk_tokens, low=8, high=model.spec.context_length)
    if max_tokens is not None:
        max_tokens = check_int("max_tokens", max_tokens, low=1)

    def n_tok(text: str) -> int:
        return len(model.tokenizer(text, add_special_tokens=False)["input_ids"])

    def pieces(par: str) -> list[str]:
        if n_tok(par) <= chunk_tokens:
            return [par]
        out = []
        for sent in _sentences(par):
            if n_tok(sent) <= chunk_tokens:
                out.append(sent)
                continue
            words, cur = sent.split(" "), []
            for w in words:
                if cur and n_tok(" ".join([*cur, w])) > chunk_tokens:
                    out.append(" ".join(cur))
                    cur = []
                cur.append(w)
            if cur:
                out.append(" ".join(cur))
        return out

    chunks: list[str] = []
    total = 0
    for doc in documents:
        cur = ""
        units = [(p, "\n\n") for par in _paragraphs(doc) for p in pieces(par)]
        for unit, sep in units:
            trial = unit if not cur else cur + sep + unit
            if cur and n_tok(trial) > chunk_tokens:
                chunks.append(cur)
                cur = unit
            else:
                cur = trial
        if cur:
            chunks.append(cur)
    if max_tokens is None:
        return chunks
    kept = []
    for c in chunks:
        n = n_tok(c)
        if total + n > max_tokens:
            room = max_tokens - total
            if room >= 8:
                ids = model.tokenizer(c, add_special_tokens=False)["input_ids"][:room]
                text = model.tokenizer.decode(ids).strip()
                if text:
                    kept.append(text)
            break
        kept.append(c)
        total += n
    if not kept:
        raise InputError(f"`max_tokens`={max_tokens} leaves no text; pass at least 8.")
    return kept


# -- saturation layers (pure) ------------------------------------------------------------

def saturation_from_ranks(ranks: Any) -> np.ndarray:
    """Saturation layer of each rank from the lens ranks of the final top-k tokens.

    Parameters
    ----------
    ranks : array-like of int, shape [..., layer, rank]
        ``ranks[..., l, j]``: rank (0 = top, strict) at layer l of the token that is
        rank j at the last layer.

    Returns
    -------
    numpy.ndarray of int64, shape [..., rank]
        ``s_j``: the smallest layer from which that token is at rank j at every later
        layer; 0 if it is there at every layer; `NEVER` (-1) if not even at the last layer.

    Examples
    --------
    >>> saturation_from_ranks([[3, 0], [0, 4], [0, 1], [0, 1]]).tolist()
    [1, 2]
    """
    r = np.asarray(ranks)
    if r.ndim < 2:
        raise InputError(f"`ranks` must have at least 2 dims [..., layer, rank]; got shape {r.shape}.")
    n_layers, k = r.shape[-2:]
    held = r == np.arange(k)                                  # [..., layer, rank]
    # layers from the end on which the token has held its rank without a break
    tail = np.cumprod(held[..., ::-1, :], axis=-2).sum(axis=-2)   # [..., rank]
    s = n_layers - tail
    return np.where(tail == 0, NEVER, s).astype(np.int64)


def kept_positions(sat_layer: Any, n_layers: int, *, max_ratio: float = 0.85) -> np.ndarray:
    """Positions whose top-1 saturates within the first ``max_ratio`` of the layers.

    True where ``0 <= s_1`` and ``s_1 + 1 <= max_ratio * n_layers`` (layers counted from 1,
    as in the paper's s_1 <= 0.85 L). ``sat_layer`` is [..., rank]; returns [...] bool.
    """
    max_ratio = check_float("max_ratio", max_ratio, low=0.0, high=1.0)
    s1 = np.asarray(sat_layer)[..., 0]
    return (s1 >= 0) & (s1 + 1 <= max_ratio * n_layers + 1e-9)


# -- order test --------------------------------------------------------------------------

def strict_kendall_tau(sat: Any) -> np.ndarray:
    """Strict Kendall tau between rank (0, 1, 2, ...) and saturation layers, per row.

    ``tau = (concordant - discordant) / pairs`` over rank pairs i < j, where a pair is
    concordant if ``s_i < s_j`` and discordant otherwise: ties count as discordant, so a
    row of equal layers scores -1 (Lioubashevski et al., ICML 2025).

    Parameters
    ----------
    sat : array-like, shape [..., m]
        Saturation layers of ranks 0..m-1 (m >= 2).

    Returns
    -------
    numpy.ndarray of float, shape [...]

    Examples
    --------
    >>> strict_kendall_tau([[1, 2, 3], [3, 2, 1], [2, 2, 2]]).tolist()
    [1.0, -1.0, -1.0]
    """
    s = np.asarray(sat)
    m = s.shape[-1]
    if m < 2:
        raise InputError(f"strict Kendall tau needs at least 2 ranks per row; got {m}.")
    i, j = np.triu_indices(m, 1)
    conc = (s[..., j] > s[..., i]).sum(-1)
    pairs = len(i)
    return (2 * conc - pairs) / pairs


def _tau_prefix_lengths(sat: np.ndarray, n_layers: int) -> np.ndarray:
    """Length of the prefix of ranks that saturate before the last layer."""
    valid = (sat >= 0) & (sat < n_layers - 1)
    return np.cumprod(valid, axis=-1).sum(-1)


def order_test(sat_layer: Any, n_layers: int, *, k: int = 5, min_ranks: int = 3,
               n_permutations: int = 1000, seed: int = 0) -> dict[str, Any]:
    """Do the top-k tokens saturate in rank order? Mean strict Kendall tau + permutation test.

    Per position the list (s_1..s_k) is cut before the first rank that saturates only at
    the last layer or never; positions with fewer than ``min_ranks`` ranks left are not
    counted. The null shuffles each position's list independently (``n_permutations``
    times, seeded); ``p = (1 + #{null mean >= observed mean}) / (1 + n_permutations)``.

    Parameters
    ----------
    sat_layer : array-like of int, shape [position, rank]
    n_layers : int
    k : int, default=5
        Ranks considered (at most ``sat_layer.shape[-1]``).
    min_ranks : int, default=3
    n_permutations : int, default=1000
    seed : int, default=0

    Returns
    -------
    dict
        ``tau`` [position] (NaN where not counted), ``tau_shuffled`` [position] (one
        shuffle of each counted position: the null shape for a histogram), ``mean_tau``,
        ``p_value``, ``null_mean_tau`` [n_permutations], ``n_positions`` (counted).

    References
    ----------
    Lioubashevski et al., ICML 2025 (strict tau, 1,000 permutations).
    """
    s = np.asarray(sat_layer)
    if s.ndim != 2:
        raise InputError(f"`sat_layer` must be [position, rank]; got shape {s.shape}.")
    k = check_int("k", k, low=2, high=s.shape[1])
    min_ranks = check_int("min_ranks", min_ranks, low=2, high=k)
    n_permutations = check_int("n_permutations", n_permutations, low=1)
    s = s[:, :k]
    m = _tau_prefix_lengths(s, n_layers)
    use = m >= min_ranks
    n = s.shape[0]
    tau = np.full(n, np.nan)
    shuffled = np.full(n, np.nan)
    null_sum = np.zeros(n_permutations)
    rng = np.random.default_rng(seed)
    for mm in np.unique(m[use]):
        idx = np.flatnonzero(m == mm)
        rows = s[idx, :mm]                                   # [n_g, mm]
        tau[idx] = strict_kendall_tau(rows)
        step = max(1, 4_000_000 // (len(idx) * mm))
        for b0 in range(0, n_permutations, step):
            nb = min(step, n_permutations - b0)
            order = rng.random((nb, len(idx), mm)).argsort(-1)   # [nb, n_g, mm]
            perm = np.take_along_axis(np.broadcast_to(rows, order.shape), order, -1)
            t = strict_kendall_tau(perm)                          # [nb, n_g]
            null_sum[b0:b0 + nb] += t.sum(1)
            if b0 == 0:
                shuffled[idx] = t[0]
    n_used = int(use.sum())
    if n_used == 0:
        return {"tau": tau, "tau_shuffled": shuffled, "mean_tau": float("nan"),
                "p_value": float("nan"), "null_mean_tau": np.full(n_permutations, np.nan),
                "n_positions": 0}
    mean = float(np.nanmean(tau))
    null_mean = null_sum / n_used
    p = (1 + int((null_mean >= mean - 1e-12).sum())) / (1 + n_permutations)
    return {"tau": tau, "tau_shuffled": shuffled, "mean_tau": mean, "p_value": float(p),
            "null_mean_tau": null_mean, "n_positions": n_used}


# -- task probe --------------------------------------------------------------------------

def task_labels(sat_layer: Any, n_layers: int, *, n_tasks: int = 4) -> np.ndarray:
    """Task index per layer: how many of the top tokens are already decided there.

    At layer l the label is the number m of leading ranks whose saturation layer is at
    most l (ranks 1..m all fixed), capped at ``n_tasks - 1``. Label 0: the top-1 is still
    open; 1: the top-1 is fixed and rank 2 is open; and so on. (The paper numbers tasks
    from 1 and starts task i+1 one layer after s_i; here a layer at s_i already counts
    rank i as decided, which makes "label >= 1" exactly the oracle exit layer s_1.)

    Parameters
    ----------
    sat_layer : array-like of int, shape [position, rank]
    n_layers : int
    n_tasks : int, default=4

    Returns
    -------
    numpy.ndarray of int64, shape [position, layer]

    Examples
    --------
    >>> task_labels([[1, 2, 0]], 4, n_tasks=4).tolist()
    [[0, 1, 3, 3]]
    """
    s = np.asarray(sat_layer)
    n_tasks = check_int("n_tasks", n_tasks, low=2, high=s.shape[-1] + 1)
    s = s[:, :n_tasks - 1]
    layers = np.arange(n_layers)
    decided = (s[:, None, :] >= 0) & (s[:, None, :] <= layers[None, :, None])  # [pos, layer, rank]
    return np.cumprod(decided, axis=-1).sum(-1).astype(np.int64)


def _balanced_accuracy(y_true: np.ndarray, y_pred: np.ndarray, classes: Sequence[int]) -> float:
    """Mean recall over the classes present in ``y_true`` (NaN if none)."""
    recalls = [np.mean(y_pred[y_true == c] == c) for c in classes if np.any(y_true == c)]
    return float(np.mean(recalls)) if recalls else float("nan")


def _cv_probe(x: np.ndarray, y: np.ndarray, folds: np.ndarray, train_mask: np.ndarray,
              eval_mask: np.ndarray, classes: list[int], min_layer: int, max_per_class: int,
              rng: np.random.Generator) -> np.ndarray:
    """Out-of-fold predictions [position, layer] of a scaled logistic regression."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    n, n_layers, d = x.shape
    pred = np.full((n, n_layers), -1, dtype=np.int64)
    layer_ok = np.arange(n_layers) >= min_layer
    for f in np.unique(folds):
        train = (folds != f) & train_mask
        sample_ok = train[:, None] & layer_ok[None, :] & np.isin(y, classes)   # [pos, layer]
        pos_i, lay_i = np.nonzero(sample_ok)
        labels = y[pos_i, lay_i]
        counts = [int((labels == c).sum()) for c in classes]
        per_class = min(min(counts), max_per_class)
        pick = np.concatenate([rng.choice(np.flatnonzero(labels == c), per_class, replace=False)
                               for c in classes])
        clf = make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000))
        clf.fit(x[pos_i[pick], lay_i[pick]], labels[pick])
        test = np.flatnonzero(folds == f)
        pred[test] = clf.predict(x[test].reshape(-1, d)).reshape(len(test), n_layers)
    return pred


def task_probe(features: Any, labels: Any, *, train_mask: Any = None, n_splits: int = 5,
               min_layer: int = 0, max_per_class: int = 1000, min_per_class: int = 5,
               control: bool = True, seed: int = 0) -> xr.Dataset:
    """Cross-validated task probe: which task (`task_labels`) is a hidden state on?

    Scikit-learn ``StandardScaler`` + ``LogisticRegression`` (multinomial, max_iter=1000)
    on hidden states of all layers pooled, with classes balanced by subsampling in each
    training fold. Folds split *positions* (all layers of a position are in one fold), so
    no token is seen in training and test. A control fits the same on Gaussian random
    features with the real features' per-dimension mean and std (expected: chance).

    Parameters
    ----------
    features : array-like of float, shape [position, layer, d_model]
    labels : array-like of int, shape [position, layer]
        Task index per layer; negative values are unlabelled and skipped.
    train_mask : array-like of bool, shape [position], optional
        Positions that may be trained on and scored (e.g. `kept_positions`); all others
        still get out-of-fold predictions (for early exit). Default: all.
    n_splits : int, default=5
    min_layer : int, default=0
        Layers below it are neither trained on nor scored (the paper's MIN_LAYER_FOR_PROBING).
    max_per_class : int, default=1000
        Cap on training samples per class and fold.
    min_per_class : int, default=5
        Classes with fewer training samples in any fold are left out.
    control : bool, default=True
    seed : int, default=0

    Returns
    -------
    xarray.Dataset
        ``probe_task`` (sample, layer): out-of-fold predicted task; ``probe_layer_accuracy``
        and ``control_layer_accuracy`` (layer): balanced accuracy per layer;
        ``probe_class_recall`` (layer, task); attrs ``balanced_accuracy``,
        ``control_balanced_accuracy``, ``chance`` (1 / number of classes), ``classes``.

    References
    ----------
    Lioubashevski et al., ICML 2025, "task transition" probing.
    """
    x = np.asarray(features, dtype=np.float32)
    y = np.asarray(labels, dtype=np.int64)
    if x.ndim != 3 or y.shape != x.shape[:2]:
        raise InputError(f"`features` must be [position, layer, d_model] and `labels` "
                         f"[position, layer]; got {x.shape} and {y.shape}.")
    n, n_layers, _ = x.shape
    n_splits = check_int("n_splits", n_splits, low=2, high=max(2, n))
    min_layer = check_int("min_layer", min_layer, low=0, high=n_layers - 1)
    max_per_class = check_int("max_per_class", max_per_class, low=1)
    min_per_class = check_int("min_per_class", min_per_class, low=1)
    train_mask = np.ones(n, bool) if train_mask is None else np.asarray(train_mask, bool)
    if n < n_splits:
        raise InputError(f"the probe needs at least n_splits={n_splits} positions; got {n}.")
    rng = np.random.default_rng(seed)
    folds = np.empty(n, dtype=np.int64)
    folds[rng.permutation(n)] = np.arange(n) % n_splits
    layer_ok = np.arange(n_layers) >= min_layer
    classes = []
    for c in np.unique(y[y >= 0]):
        per_fold = [int(((y == c) & ((folds != f) & train_mask)[:, None] & layer_ok).sum())
                    for f in range(n_splits)]
        if min(per_fold) >= min_per_class:
            classes.append(int(c))
    if len(classes) < 2:
        raise InputError(
            f"the probe needs at least 2 tasks with >= {min_per_class} training samples in "
            f"every fold; got {len(classes)} (labels {np.unique(y[y >= 0]).tolist()}). Use more "
            "text or positions.")

    scored = train_mask[:, None] & layer_ok[None, :] & np.isin(y, classes)   # [pos, layer]

    def evaluate(pred):
        overall = _balanced_accuracy(y[scored], pred[scored], classes)
        per_layer = np.array([_balanced_accuracy(y[scored[:, l], l], pred[scored[:, l], l], classes)
                              for l in range(n_layers)])
        recall = np.full((n_layers, len(classes)), np.nan)
        for l in range(n_layers):
            for ci, c in enumerate(classes):
                sel = scored[:, l] & (y[:, l] == c)
                if sel.any():
                    recall[l, ci] = np.mean(pred[sel, l] == c)
        return overall, per_layer, recall

    pred = _cv_probe(x, y, folds, train_mask, scored, classes, min_layer, max_per_class, rng)
    acc, layer_acc, recall = evaluate(pred)
    data = {
        "probe_task": (("sample", "layer"), pred),
        "probe_layer_accuracy": (("layer",), layer_acc),
        "probe_class_recall": (("layer", "task"), recall),
    }
    attrs = {"balanced_accuracy": acc, "chance": 1.0 / len(classes), "classes": classes,
             "n_splits": n_splits, "min_layer": min_layer}
    if control:
        flat = x.reshape(-1, x.shape[-1])
        mu, sd = flat.mean(0), flat.std(0)
        noise = rng.standard_normal(x.shape, dtype=np.float32) * sd + mu
        cpred = _cv_probe(noise, y, folds, train_mask, scored, classes, min_layer, max_per_class, rng)
        cacc, clayer, _ = evaluate(cpred)
        data["control_layer_accuracy"] = (("layer",), clayer)
        attrs["control_balanced_accuracy"] = cacc
    return xr.Dataset(data, coords={"layer": np.arange(n_layers), "task": np.array(classes)},
                      attrs=attrs)


# -- early exit --------------------------------------------------------------------------

def exit_layers(score: Any, theta: float) -> np.ndarray:
    """First layer whose score reaches ``theta`` (``score >= theta``), else the last layer.

    ``score`` is [position, layer]; NaN never reaches. Returns [position] int64.
    """
    sc = np.asarray(score, dtype=np.float64)
    hit = sc >= theta
    first = hit.argmax(-1)
    return np.where(hit.any(-1), first, sc.shape[-1] - 1).astype(np.int64)


def exit_metrics(exit_layer: Any, layer_top1: Any, final_top1: Any, next_token: Any,
                 n_layers: int) -> dict[str, float]:
    """Accuracy and speed-up of an early-exit rule.

    Exiting at layer e (0-based) means running e + 1 layers and emitting the lens top-1 of
    layer e. ``speedup = L * N / sum(e + 1)`` (Lioubashevski et al., ICML 2025).

    Parameters
    ----------
    exit_layer : array-like of int, shape [position]
    layer_top1 : array-like of int, shape [position, layer]
        Lens top-1 token id per layer.
    final_top1 : array-like of int, shape [position]
        The full model's next-token prediction.
    next_token : array-like of int, shape [position]
        The true next token (negative where there is none; left out of ``accuracy_true``).
    n_layers : int

    Returns
    -------
    dict
        ``accuracy`` (agreement with the full model), ``accuracy_true`` (with the true next
        token), ``speedup``, ``mean_exit_layer``.
    """
    e = np.asarray(exit_layer, dtype=np.int64)
    top = np.asarray(layer_top1)
    chosen = np.take_along_axis(top, e[:, None], axis=1)[:, 0]
    final = np.asarray(final_top1)
    nxt = np.asarray(next_token)
    has = nxt >= 0
    return {
        "accuracy": float(np.mean(chosen == final)),
        "accuracy_true": float(np.mean(chosen[has] == nxt[has])) if has.any() else float("nan"),
        "speedup": float(n_layers * len(e) / np.sum(e + 1)),
        "mean_exit_layer": float(np.mean(e)),
    }


def early_exit(layer_top1: Any, top_prob: Any, cosine: Any, sat_top1: Any, probe_task: Any,
               next_token: Any, *, margin_thetas: Sequence[float] = _MARGIN_THETAS,
               cosine_thetas: Sequence[float] = _COSINE_THETAS) -> xr.Dataset:
    """Token-level early exit: probe vs softmax margin vs state cosine vs oracle.

    * probe: exit at the first layer the probe says the top-1 is decided (task >= 1);
    * margin: first layer with ``p1 - p2 >= theta`` (softmax response);
    * cosine: first layer with ``cos(h_l, h_{l-1}) >= theta`` (state saturation);
    * oracle: exit at the true s_1 (agrees with the full model by construction).

    Parameters
    ----------
    layer_top1 : [position, layer] int
    top_prob : [position, layer, rank>=2] float
        Lens probabilities of the top-2 tokens per layer.
    cosine : [position, layer] float
        Cosine between consecutive layers' residuals (NaN at layer 0).
    sat_top1 : [position] int
        s_1 (`NEVER` exits at the last layer).
    probe_task : [position, layer] int
    next_token : [position] int
    margin_thetas, cosine_thetas : sequence of float

    Returns
    -------
    xarray.Dataset
        ``margin_accuracy``, ``margin_accuracy_true``, ``margin_speedup`` (theta_margin);
        ``cosine_*`` likewise (theta_cosine); attrs ``probe`` and ``oracle`` (dicts of
        `exit_metrics`) and ``equal_accuracy``: each baseline's best speed-up at an
        accuracy at least the probe's.
    """
    top1 = np.asarray(layer_top1)
    n, n_layers = top1.shape
    final = top1[:, -1]
    p = np.asarray(top_prob, dtype=np.float64)
    margin = p[..., 0] - p[..., 1]
    cos = np.asarray(cosine, dtype=np.float64)
    s1 = np.asarray(sat_top1)
    nxt = np.asarray(next_token)

    def curve(score, thetas):
        rows = [exit_metrics(exit_layers(score, t), top1, final, nxt, n_layers) for t in thetas]
        return {key: np.array([r[key] for r in rows]) for key in ("accuracy", "accuracy_true", "speedup")}

    m = curve(margin, margin_thetas)
    c = curve(cos, cosine_thetas)
    probe_exit = exit_layers(np.asarray(probe_task) >= 1, 0.5)
    oracle_exit = np.where(s1 >= 0, s1, n_layers - 1)
    probe = exit_metrics(probe_exit, top1, final, nxt, n_layers)
    oracle = exit_metrics(oracle_exit, top1, final, nxt, n_layers)

    def at_accuracy(cv, target):
        ok = cv["accuracy"] >= target - 1e-12
        return float(cv["speedup"][ok].max()) if ok.any() else float("nan")

    equal = {"target_accuracy": probe["accuracy"], "probe": probe["speedup"],
             "margin": at_accuracy(m, probe["accuracy"]), "cosine": at_accuracy(c, probe["accuracy"]),
             "oracle": oracle["speedup"]}
    return xr.Dataset(
        {
            "margin_accuracy": (("theta_margin",), m["accuracy"]),
            "margin_accuracy_true": (("theta_margin",), m["accuracy_true"]),
            "margin_speedup": (("theta_margin",), m["speedup"]),
            "cosine_accuracy": (("theta_cosine",), c["accuracy"]),
            "cosine_accuracy_true": (("theta_cosine",), c["accuracy_true"]),
            "cosine_speedup": (("theta_cosine",), c["speedup"]),
        },
        coords={"theta_margin": np.asarray(margin_thetas, float),
                "theta_cosine": np.asarray(cosine_thetas, float)},
        attrs={"probe": probe, "oracle": oracle, "equal_accuracy": equal, "n_positions": n},
    )


#: Accuracy targets of `speedup_at_accuracy`.
EXIT_ACCURACY_TARGETS = (0.8, 0.9, 0.95, 0.99)


def speedup_at_accuracy(ds: xr.Dataset, targets: Sequence[float] = EXIT_ACCURACY_TARGETS, *,
                        against: str = "full model") -> dict[str, Any]:
    """Each early-exit rule's speed-up at fixed accuracy targets, read from stored curves.

    Parameters
    ----------
    ds : xarray.Dataset
        A `saturation_analysis` result (its early-exit curves and ``early_exit_summary``).
    targets : sequence of float
        Accuracy targets in (0, 1].
    against : {"full model", "true next token"}
        ``"full model"``: the target is the agreement with the full model's token.
        ``"true next token"``: the target is a *fraction of the full model's own*
        true-token accuracy (0.9: at least 90 % of what running every layer gets), since
        that accuracy is far below 0.8 for a small model.

    Returns
    -------
    dict
        ``against``, ``full_model_accuracy`` (1 against the full model; against the true
        token the oracle's, which emits the full model's token at every position),
        ``targets``, ``required_accuracy`` (the absolute accuracy each target asks for)
        and per rule (``margin``, ``cosine``, ``probe``, ``oracle``) lists over the
        targets: ``speedup``, ``accuracy`` and, for the threshold rules, ``theta``. A
        threshold rule takes its fastest theta whose accuracy reaches the target; the probe
        and the oracle have one operating point each, so their speed-up is that point's
        if it reaches the target. NaN where the target is not reached.
    """
    against = check_choice("against", against, ("full model", "true next token"))
    targets = [check_float("target", t, low=0.0, high=1.0) for t in targets]
    if "early_exit_summary" not in ds:
        raise InputError("this result has no early-exit curves (sample_positions was 0)")
    info = json.loads(str(ds.early_exit_summary.values))
    suffix = "" if against == "full model" else "_true"
    key = "accuracy" + suffix
    full = 1.0 if against == "full model" else float(info["oracle"]["accuracy_true"])
    required = [t * full for t in targets]
    out: dict[str, Any] = {"against": against, "full_model_accuracy": full,
                           "targets": targets, "required_accuracy": required}
    for rule in ("margin", "cosine"):
        acc = np.asarray(ds[f"{rule}_accuracy{suffix}"].values, float)
        speed = np.asarray(ds[f"{rule}_speedup"].values, float)
        theta = np.asarray(ds[f"theta_{rule}"].values, float)
        row: dict[str, list[float]] = {"speedup": [], "accuracy": [], "theta": []}
        for need in required:
            ok = np.flatnonzero(acc >= need - 1e-12)
            i = int(ok[np.argmax(speed[ok])]) if len(ok) else -1
            row["speedup"].append(float(speed[i]) if i >= 0 else float("nan"))
            row["accuracy"].append(float(acc[i]) if i >= 0 else float("nan"))
            row["theta"].append(float(theta[i]) if i >= 0 else float("nan"))
        out[rule] = row
    for rule in ("probe", "oracle"):
        point = info[rule]
        reached = [point[key] >= need - 1e-12 for need in required]
        out[rule] = {"speedup": [float(point["speedup"]) if r else float("nan") for r in reached],
                     "accuracy": [float(point[key]) if r else float("nan") for r in reached]}
    return out


# -- the lens pass (model) ---------------------------------------------------------------

def _strict_ranks(top_id: torch.Tensor, top_prob: torch.Tensor, targets: torch.Tensor,
                  cap: int) -> torch.Tensor:
    """Strict ranks of ``targets`` [R, k] among the top-``cap`` lists [L, R, cap]; >= cap -> cap."""
    hit = top_id.unsqueeze(2) == targets[None, :, :, None]              # [L, R, k, cap]
    found = hit.any(-1)                                                   # [L, R, k]
    p_t = (top_prob.unsqueeze(2) * hit).sum(-1)                           # [L, R, k]
    rank = (top_prob.unsqueeze(2) > p_t.unsqueeze(-1)).sum(-1)            # [L, R, k]
    return torch.where(found, rank, torch.full_like(rank, cap))


def _sample_positions(lengths: Sequence[int], n_sample: int, seed: int) -> np.ndarray:
    """Seeded (prompt, pos) pairs with a next token, sorted; at most ``n_sample``."""
    cand = np.array([(p, i) for p, n in enumerate(lengths) for i in range(n - 1)], dtype=np.int64)
    if len(cand) == 0 or n_sample == 0:
        return np.zeros((0, 2), dtype=np.int64)
    rng = np.random.default_rng(seed)
    pick = rng.choice(len(cand), min(n_sample, len(cand)), replace=False)
    out = cand[np.sort(pick)]
    return out


def saturation_layers(model: Any, texts: Any, *, k: int = 10, rank_cap: int = 50,
                      sample_positions: int = 1000, batch_size: int = 4, seed: int = 0,
                      unembed_dtype: str = "float32", part_texts: int | None = None,
                      store: Any = None, progress: Any = None) -> xr.Dataset:
    """Logit-lens ranks and saturation layers of the final top-k tokens at every position.

    One trace per batch of texts reads ``resid_post`` at every layer; the lens
    (`explorer.lens.lens_readout`) then runs in chunks of rows, so the [layer, pos, vocab]
    logits never sit in memory whole. See the module docstring for the conventions.

    Parameters
    ----------
    model : Model
    texts : str or list of str
        One prompt per text (see `corpus_chunks`).
    k : int, default=10
        Ranks tracked (the view's k slider goes up to it).
    rank_cap : int, default=50
        Ranks are exact below it; a token further down reads as ``rank_cap``.
    sample_positions : int, default=1000
        Positions (seeded, each with a next token) whose hidden states at every layer are
        kept as ``resid_sample`` for the task probe.
    batch_size : int, default=4
    seed : int, default=0
    unembed_dtype : {"float32", "bfloat16"}, default="float32"
        The lens's unembedding (`explorer.lens.lens_readout`): exact float32, or a bfloat16
        screen with the top ``rank_cap + 16`` candidates recomputed in float32 (the same
        ids and ranks below ``rank_cap`` unless the screen misplaces a token by more than
        16 places; probabilities differ by about 1e-3). Part of the cache key.
    part_texts : int, optional
        With ``store``: run and cache the lens pass in parts of this many texts (see
        `cache_saturation_parts`), so a long corpus can be computed over several sessions;
        the result is the same as in one pass.
    store : ActivationStore, optional
        Cache: a repeated call with the same model, texts and parameters is served from it.
    progress : bool or callable(done, total), optional

    Returns
    -------
    xarray.Dataset
        ``sat_layer`` (prompt, pos, rank); ``final_rank`` (prompt, pos, layer, rank):
        strict rank at each layer of the final rank-r token (capped); ``top_token_id``,
        ``top_prob`` (prompt, pos, layer, rank): the lens top-k; ``cosine`` (prompt, pos,
        layer): cos(h_l, h_{l-1}), NaN at layer 0; ``mask`` (prompt, pos);
        ``resid_sample`` (sample, layer, d_model) with coords ``sample_prompt``,
        ``sample_pos``. Coords ``token_id``, ``token``, ``next_token_id`` (prompt, pos),
        ``final_token_id`` (prompt, pos, rank).

    References
    ----------
    Lioubashevski et al., ICML 2025.
    """
    from explorer.trace import provenance

    texts = check_prompts(texts)
    params = _lens_params(model, k=k, rank_cap=rank_cap, sample_positions=sample_positions,
                          seed=seed, unembed_dtype=unembed_dtype)
    batch_size = check_int("batch_size", batch_size, low=1)
    if part_texts is not None:
        part_texts = check_int("part_texts", part_texts, low=1)
        _check_part_texts(part_texts, batch_size)

    def compute() -> xr.Dataset:
        sample = _sample_positions(model.tokenize(texts).lengths, sample_positions, seed)
        if part_texts is None or store is None or part_texts >= len(texts):
            ds = _saturation_pass(model, texts, sample=sample, batch_size=batch_size,
                                  progress=progress, **_pass_params(params))
        else:
            cache_saturation_parts(model, texts, store=store, part_texts=part_texts,
                                   batch_size=batch_size, progress=progress, **params)
            ds = _join_parts(model, texts, store, part_texts, sample, params)
        ds.attrs.update(provenance(model, method="saturation_layers", citation=CITATION,
                                   n_texts=len(texts), **params))
        return ds

    if store is None:
        return compute()
    return store.get_or_compute(_lens_key_parts(model, texts, params), compute)


def _lens_params(model: Any, *, k: int, rank_cap: int, sample_positions: int, seed: int,
                 unembed_dtype: str) -> dict[str, Any]:
    """The lens pass's parameters, validated; they (and the texts) make its cache key."""
    from explorer._checks import check_choice

    k = check_int("k", k, low=1, high=min(model.vocab_size, 64))
    rank_cap = check_int("rank_cap", rank_cap, low=k, high=model.vocab_size)
    sample_positions = check_int("sample_positions", sample_positions, low=0)
    seed = check_int("seed", seed, low=0)
    unembed_dtype = check_choice("unembed_dtype", unembed_dtype, ("float32", "bfloat16"))
    params = dict(k=k, rank_cap=rank_cap, sample_positions=sample_positions, seed=seed)
    if unembed_dtype != "float32":     # float32 keys stay those of earlier cached results
        params["unembed_dtype"] = unembed_dtype
    return params


def _check_part_texts(part_texts: int, batch_size: int) -> None:
    """Parts must hold whole batches, so every text is traced in the same batch as in one pass."""
    if part_texts % batch_size:
        raise InputError(f"`part_texts` must be a multiple of `batch_size`={batch_size}; "
                         f"got {part_texts}.")


def _pass_params(params: dict[str, Any]) -> dict[str, Any]:
    return dict(k=params["k"], rank_cap=params["rank_cap"],
                unembed_dtype=params.get("unembed_dtype", "float32"))


def _lens_key_parts(model: Any, texts: list[str], params: dict[str, Any]) -> dict[str, Any]:
    return {"model": model.spec.provenance(), "method": "saturation_layers", "texts": texts,
            "params": params}


def _part_key_parts(model: Any, texts: list[str], a: int, b: int, sample: np.ndarray,
                    params: dict[str, Any]) -> dict[str, Any]:
    """Cache key of texts[a:b]'s lens pass: its texts, parameters and sampled positions."""
    rows = sample[(sample[:, 0] >= a) & (sample[:, 0] < b)] - [a, 0]
    return {"model": model.spec.provenance(), "method": "saturation_layers_part",
            "texts": texts[a:b], "params": {**params, "sample": rows.tolist()}}


def cache_saturation_parts(model: Any, texts: Any, *, store: Any, part_texts: int = 16,
                           k: int = 10, rank_cap: int = 50, sample_positions: int = 1000,
                           seed: int = 0, unembed_dtype: str = "float32", batch_size: int = 4,
                           time_budget_s: float | None = None, reverse: bool = False,
                           progress: Any = None) -> dict[str, int]:
    """Run the lens pass of `saturation_layers` part by part into the store.

    Texts are cut into consecutive parts of ``part_texts``; each part not yet in the store
    is computed and stored. With ``time_budget_s`` no new part starts once that many
    seconds have passed (one part always runs), so a long corpus can be filled in several
    short runs (``reverse`` goes from the last part, so two runs can share the work); then
    `saturation_layers` with the same ``part_texts`` joins the parts. The positions
    sampled for the probe are drawn over the whole corpus (as in one pass).

    Returns
    -------
    dict
        ``parts`` (total), ``cached`` (in the store now, all of them if the whole pass
        is stored already), ``computed`` (by this call).
    """
    texts = check_prompts(texts)
    params = _lens_params(model, k=k, rank_cap=rank_cap, sample_positions=sample_positions,
                          seed=seed, unembed_dtype=unembed_dtype)
    part_texts = check_int("part_texts", part_texts, low=1)
    batch_size = check_int("batch_size", batch_size, low=1)
    _check_part_texts(part_texts, batch_size)
    if time_budget_s is not None:
        time_budget_s = check_float("time_budget_s", time_budget_s, low=0.0)
    sample = _sample_positions(model.tokenize(texts).lengths, sample_positions, seed)
    t0 = time.perf_counter()
    bounds = [(a, min(a + part_texts, len(texts))) for a in range(0, len(texts), part_texts)]
    if store.get(store.key(_lens_key_parts(model, texts, params)), verify=False) is not None:
        return {"parts": len(bounds), "cached": len(bounds), "computed": 0}  # the whole pass
    cached = computed = 0
    for a, b in (bounds[::-1] if reverse else bounds):
        parts = _part_key_parts(model, texts, a, b, sample, params)
        key = store.key(parts)
        if store.get(key, verify=False) is not None:
            cached += 1
            continue
        if computed and time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
            continue
        rows = np.asarray(parts["params"]["sample"], dtype=np.int64).reshape(-1, 2)

        def compute(a=a, b=b, rows=rows) -> xr.Dataset:
            return _saturation_pass(model, texts[a:b], sample=rows, batch_size=batch_size,
                                    progress=progress, **_pass_params(params))

        store.get_or_compute(parts, compute)
        cached += 1
        computed += 1
    return {"parts": len(bounds), "cached": cached, "computed": computed}


def _join_parts(model: Any, texts: list[str], store: Any, part_texts: int, sample: np.ndarray,
                params: dict[str, Any]) -> xr.Dataset:
    """The one-pass Dataset of `saturation_layers` assembled from its cached parts."""
    n, k, cap = len(texts), params["k"], params["rank_cap"]
    n_pos, n_layers, d = max(model.tokenize(texts).lengths), model.n_layers, model.spec.d_model
    sat = np.full((n, n_pos, k), NEVER, dtype=np.int16)
    final_rank = np.full((n, n_pos, n_layers, k), cap, dtype=np.int16)
    top_id = np.full((n, n_pos, n_layers, k), -1, dtype=np.int32)
    top_prob = np.full((n, n_pos, n_layers, k), np.nan, dtype=np.float32)
    cosine = np.full((n, n_pos, n_layers), np.nan, dtype=np.float32)
    resid_sample = np.zeros((len(sample), n_layers, d), dtype=np.float32)
    for a in range(0, n, part_texts):
        b = min(a + part_texts, n)
        part = store.get(store.key(_part_key_parts(model, texts, a, b, sample, params)))
        if part is None:
            raise InputError(f"part {a}:{b} of the saturation lens pass is not in the store; "
                             "run cache_saturation_parts to completion first.")
        w = part.sizes["pos"]
        sat[a:b, :w] = part.sat_layer.values
        final_rank[a:b, :w] = part.final_rank.values
        top_id[a:b, :w] = part.top_token_id.values
        top_prob[a:b, :w] = part.top_prob.values
        cosine[a:b, :w] = part.cosine.values
        in_part = (sample[:, 0] >= a) & (sample[:, 0] < b)
        resid_sample[in_part] = part.resid_sample.values
    return _lens_dataset(model, texts, sat, final_rank, top_id, top_prob, cosine,
                         resid_sample, sample)


def _saturation_pass(model: Any, texts: list[str], *, k: int, rank_cap: int,
                     sample: np.ndarray, batch_size: int, unembed_dtype: str,
                     progress: Any) -> xr.Dataset:
    """The lens pass over ``texts``; ``sample`` [S, 2] are the (prompt, pos) kept whole."""
    from explorer.lens import lens_readout
    from explorer.trace import progress_steps, trace

    batch_all = model.tokenize(texts)
    lengths = batch_all.lengths
    n, n_pos, n_layers, d = len(texts), max(lengths), model.n_layers, model.spec.d_model
    sample = np.asarray(sample, dtype=np.int64).reshape(-1, 2)          # [S, 2]
    sat = np.full((n, n_pos, k), NEVER, dtype=np.int16)
    final_rank = np.full((n, n_pos, n_layers, k), rank_cap, dtype=np.int16)
    top_id = np.full((n, n_pos, n_layers, k), -1, dtype=np.int32)
    top_prob = np.full((n, n_pos, n_layers, k), np.nan, dtype=np.float32)
    cosine = np.full((n, n_pos, n_layers), np.nan, dtype=np.float32)
    resid_sample = np.zeros((len(sample), n_layers, d), dtype=np.float32)
    step = progress_steps(sum(lengths), progress if progress is not None else len(texts) > batch_size,
                          unit="token", desc="saturation")

    for b0 in range(0, n, batch_size):
        rows = list(range(b0, min(b0 + batch_size, n)))
        if model.remote:
            batch = model.tokenize([texts[i] for i in rows])
            _remote_saturation_batch(model, batch, rows, k=k, rank_cap=rank_cap, sample=sample,
                                     out=(sat, final_rank, top_id, top_prob, cosine,
                                          resid_sample))
            step(sum(lengths[i] for i in rows))
            continue
        tr = trace(model, [texts[i] for i in rows], sites=("resid_post",), batch_size=len(rows),
                   progress=False)
        resid = tr.resid_post.values                                   # [b, P, L, d] NaN pad
        real = tr.mask.values                                          # [b, P]
        bi, pi = np.nonzero(real)
        h = torch.from_numpy(np.ascontiguousarray(resid[bi, pi]))     # [R, L, d]
        R = h.shape[0]
        with torch.no_grad():
            cos = torch.nn.functional.cosine_similarity(h[:, 1:], h[:, :-1], dim=-1)  # [R, L-1]
            flat = h.transpose(0, 1).reshape(n_layers * R, d)          # [L*R, d]
            out = lens_readout(model, flat, k=rank_cap, unembed_dtype=unembed_dtype)
            ids = out["top_id"].reshape(n_layers, R, rank_cap)         # [L, R, cap]
            probs = out["top_prob"].reshape(n_layers, R, rank_cap)
            targets = ids[-1, :, :k]                                   # [R, k] final top-k
            ranks = _strict_ranks(ids, probs, targets, rank_cap)       # [L, R, k]
        ranks_np = ranks.permute(1, 0, 2).numpy()                      # [R, L, k]
        g = np.asarray(rows)[bi]
        final_rank[g, pi] = ranks_np
        sat[g, pi] = saturation_from_ranks(ranks_np)
        top_id[g, pi] = ids[:, :, :k].permute(1, 0, 2).numpy()
        top_prob[g, pi] = probs[:, :, :k].permute(1, 0, 2).numpy()
        cosine[g, pi, 1:] = cos.numpy()
        for si in np.flatnonzero((sample[:, 0] >= b0) & (sample[:, 0] < b0 + len(rows))):
            p, q = sample[si]
            resid_sample[si] = resid[p - b0, q]
        step(int(real.sum()))

    return _lens_dataset(model, texts, sat, final_rank, top_id, top_prob, cosine,
                         resid_sample, sample)


def _remote_saturation_batch(model: Any, batch: Any, rows: list[int], *, k: int,
                             rank_cap: int, sample: np.ndarray,
                             out: tuple[np.ndarray, ...]) -> None:
    """One batch (tokenised ``batch`` of texts ``rows``) of the lens pass on a remote model,
    reduced inside its trace.

    The lens top-``rank_cap`` lists, the ranks of the output's top-k tokens, the cosines
    of consecutive layers and the sampled positions' residuals are computed on the
    server; nothing of size [layer, pos, vocab] or [layer, pos, d_model] comes back.
    Ranks are exact counts there, so a token at rank >= ``rank_cap`` reads as
    ``rank_cap``, as in the local pass.
    """
    from explorer.trace import run_batch

    sat, final_rank, top_id, top_prob, cosine, resid_sample = out
    n_layers = model.n_layers
    in_batch = np.flatnonzero((sample[:, 0] >= rows[0]) & (sample[:, 0] <= rows[-1]))
    s_rows = sample[in_batch, 0] - rows[0]
    s_cols = np.array([batch.width - batch.lengths[r] + q
                       for r, q in zip(s_rows, sample[in_batch, 1])], dtype=np.int64)
    saves = {(layer, "resid_post") for layer in range(n_layers)} if len(in_batch) else set()
    got = run_batch(model, batch, save=saves, logits=False, lens_k=rank_cap,
                    lens_layers=range(n_layers), lens_ranked=k, lens_cosine=True,
                    save_points=(torch.from_numpy(s_rows), torch.from_numpy(s_cols)))
    lens = [got[("lens", layer)] for layer in range(n_layers)]       # (ids, logp, rank, _)
    ids = torch.stack([x[0][..., :k] for x in lens], 2).numpy()          # [b, width, L, k]
    prob = torch.stack([x[1][..., :k] for x in lens], 2).exp().numpy()
    ranks = torch.stack([x[2] for x in lens], 2).clamp(max=rank_cap).numpy().astype(np.int16)
    cos = (torch.stack([got[("lens_cos", layer)] for layer in range(1, n_layers)], 2).numpy()
           if n_layers > 1 else None)                                  # [b, width, L-1]
    for i, length in enumerate(batch.lengths):
        cols = slice(batch.width - length, batch.width)            # real tokens of row i
        g = rows[i]
        final_rank[g, :length] = ranks[i, cols]
        sat[g, :length] = saturation_from_ranks(ranks[i, cols])
        top_id[g, :length] = ids[i, cols]
        top_prob[g, :length] = prob[i, cols]
        if cos is not None:
            cosine[g, :length, 1:] = cos[i, cols]
    for j, si in enumerate(in_batch):
        resid_sample[si] = np.stack([got[(layer, "resid_post")][j].float().numpy()
                                     for layer in range(n_layers)])


def _lens_dataset(model: Any, texts: list[str], sat: np.ndarray, final_rank: np.ndarray,
                  top_id: np.ndarray, top_prob: np.ndarray, cosine: np.ndarray,
                  resid_sample: np.ndarray, sample: np.ndarray) -> xr.Dataset:
    """The Dataset of `saturation_layers` from its arrays (token coords from the texts)."""
    batch_all = model.tokenize(texts)
    n, n_pos, n_layers, k = top_id.shape
    token_id = np.full((n, n_pos), -1, dtype=np.int64)
    token = np.full((n, n_pos), "", dtype=object)
    next_id = np.full((n, n_pos), -1, dtype=np.int64)
    for i, length in enumerate(batch_all.lengths):
        token_id[i, :length] = batch_all.token_ids[i]
        token[i, :length] = batch_all.tokens[i]
        next_id[i, :length - 1] = batch_all.token_ids[i][1:]
    mask = token_id >= 0
    final_id = np.where(mask[..., None], top_id[:, :, -1, :], -1)
    return xr.Dataset(
        {
            "sat_layer": (("prompt", "pos", "rank"), sat),
            "final_rank": (("prompt", "pos", "layer", "rank"), final_rank),
            "top_token_id": (("prompt", "pos", "layer", "rank"), top_id),
            "top_prob": (("prompt", "pos", "layer", "rank"), top_prob),
            "cosine": (("prompt", "pos", "layer"), cosine),
            "mask": (("prompt", "pos"), mask),
            "resid_sample": (("sample", "layer", "d_model"), resid_sample),
        },
        coords={
            "prompt": np.arange(n), "pos": np.arange(n_pos), "layer": np.arange(n_layers),
            "rank": np.arange(k), "sample": np.arange(len(sample)),
            "sample_prompt": ("sample", sample[:, 0]), "sample_pos": ("sample", sample[:, 1]),
            "token_id": (("prompt", "pos"), token_id),
            "token": (("prompt", "pos"), token.astype(str)),
            "next_token_id": (("prompt", "pos"), next_id),
            "final_token_id": (("prompt", "pos", "rank"), final_id.astype(np.int64)),
        },
    )


# -- out of core over the store ----------------------------------------------------------

def tau_per_position(sat_layer: Any, n_layers: int, *, k: int = 5, min_ranks: int = 3) -> np.ndarray:
    """Strict Kendall tau of each position's (s_1..s_k), cut as in `order_test`.

    ``sat_layer`` is [..., rank]; returns [...] float64, NaN where fewer than
    ``min_ranks`` ranks saturate before the last layer.
    """
    s = np.asarray(sat_layer)[..., :k]
    m = _tau_prefix_lengths(s, n_layers)
    tau = np.full(m.shape, np.nan)
    for mm in np.unique(m[m >= min_ranks]):
        sel = m == mm
        tau[sel] = strict_kendall_tau(s[sel][:, :mm])
    return tau


def _per_position_block(ranks: np.ndarray, mask: np.ndarray, *, n_layers: int, max_ratio: float,
                        k_orders: Sequence[int], min_ranks: int) -> np.ndarray:
    """One block [p, q, layer, rank] -> [p, q, rank + 1 + len(k_orders)]: s, kept, taus."""
    sat = saturation_from_ranks(ranks)                                 # [p, q, rank]
    kept = kept_positions(sat, n_layers, max_ratio=max_ratio) & mask[:, :, 0, 0]
    taus = [np.where(kept, tau_per_position(sat, n_layers, k=kk, min_ranks=min(min_ranks, kk)),
                     np.nan) for kk in k_orders]
    return np.concatenate([sat.astype(np.float64), kept[..., None].astype(np.float64),
                           np.stack(taus, -1) if taus else np.zeros((*kept.shape, 0))], -1)


def saturation_over_store(lens: xr.Dataset, *, n_layers: int | None = None,
                          max_ratio: float = 0.85, k_orders: Sequence[int] = (3, 4, 5),
                          min_ranks: int = 3, scheduler: str = "threads", pos_chunk: int = 64,
                          scheduler_options: dict[str, Any] | None = None) -> xr.Dataset:
    """Saturation layers, position filter and tau per position, out of core with dask.

    Reads only ``final_rank`` and ``mask`` of a `saturation_layers` result, as dask arrays
    chunked by prompt (as the store writes them) and by ``pos_chunk`` positions; each
    chunk is reduced to s_j, kept and tau by one task, so memory holds a few chunks of the
    lens ranks, never the cache. Open the entry lazily (`explorer.store.ActivationStore.get`,
    `explorer.distributed.open_entry`); an in-memory Dataset works too.

    Parameters
    ----------
    lens : xarray.Dataset
        A `saturation_layers` result, lazy or in memory.
    n_layers : int, optional
        Default: the size of its ``layer`` dim.
    max_ratio : float, default=0.85
    k_orders : sequence of int, default=(3, 4, 5)
        The k of each tau (as the ``k_order`` of `saturation_analysis`).
    min_ranks : int, default=3
    scheduler : str, default="threads"
        ``"threads"``, ``"synchronous"``, ``"local"`` (a LocalCluster) or a scheduler
        address; see `explorer.distributed.dask_scheduler`.
    pos_chunk : int, default=64
    scheduler_options : dict, optional
        Passed to `explorer.distributed.dask_scheduler` (e.g. ``n_workers``, ``processes``).

    Returns
    -------
    xarray.Dataset
        ``sat_layer`` (prompt, pos, rank) int64, ``kept`` (prompt, pos) bool, ``tau``
        (k_order, prompt, pos) float64 (NaN where not counted) - the same numbers as
        `saturation_analysis` computes in memory.
    """
    import dask.array as da

    from explorer.distributed import check_scheduler, dask_scheduler

    for name in ("final_rank", "mask"):
        if name not in lens.variables:
            raise InputError(f"`lens` has no {name!r}; pass a saturation_layers result "
                             f"(it has {', '.join(map(str, lens.data_vars))}).")
    scheduler = check_scheduler(scheduler)
    n_layers = lens.sizes["layer"] if n_layers is None else check_int("n_layers", n_layers, low=1)
    max_ratio = check_float("max_ratio", max_ratio, low=0.0, high=1.0)
    k_rank = lens.sizes["rank"]
    k_orders = [check_int("k_orders", kk, low=2, high=k_rank) for kk in k_orders]
    min_ranks = check_int("min_ranks", min_ranks, low=2)
    pos_chunk = check_int("pos_chunk", pos_chunk, low=1)
    ranks = lens.final_rank.transpose("prompt", "pos", "layer", "rank").data
    mask = lens.mask.transpose("prompt", "pos").data
    if not isinstance(ranks, da.Array):
        ranks = da.from_array(ranks, chunks=(1, pos_chunk, -1, -1))
    if not isinstance(mask, da.Array):
        mask = da.from_array(mask, chunks=(1, pos_chunk))
    ranks = ranks.rechunk({1: pos_chunk, 2: -1, 3: -1})                 # [prompt, pos, L, k]
    mask4 = mask.rechunk((ranks.chunks[0], ranks.chunks[1]))[:, :, None, None]
    width = k_rank + 1 + len(k_orders)
    out = da.map_blocks(_per_position_block, ranks, mask4, n_layers=n_layers,
                        max_ratio=max_ratio, k_orders=tuple(k_orders), min_ranks=min_ranks,
                        drop_axis=[2, 3], new_axis=[2],
                        chunks=(ranks.chunks[0], ranks.chunks[1], (width,)), dtype=np.float64)
    with dask_scheduler(scheduler, **(scheduler_options or {})):
        res = out.compute()                                            # [prompt, pos, width]
    coords = {c: lens[c] for c in ("prompt", "pos", "rank") if c in lens.coords}
    return xr.Dataset(
        {"sat_layer": (("prompt", "pos", "rank"), res[..., :k_rank].astype(np.int64)),
         "kept": (("prompt", "pos"), res[..., k_rank] > 0.5),
         "tau": (("k_order", "prompt", "pos"), np.moveaxis(res[..., k_rank + 1:], -1, 0))},
        coords={**coords, "k_order": np.asarray(k_orders, dtype=np.int64)},
        attrs={"method": "saturation_over_store", "scheduler": scheduler,
               "max_ratio": max_ratio, "min_ranks": min_ranks, "citation": CITATION})


# -- intervention ------------------------------------------------------------------------

def intervention_pairs(sat_layer: Any, final_top1: Any, mask: Any, n_layers: int, *,
                       min_gap: int | None = None, min_sat_layer: int | None = None,
                       max_distance: int = 30, n_pairs: int = 8, seed: int = 0) -> np.ndarray:
    """Pairs of positions in one text with the same prediction and far-apart s_1.

    Candidates: positions i (early) and j (late) of the same prompt, both with a
    saturated top-1, the same final top-1 token, ``s_1(j) - s_1(i) >= min_gap``, both
    ``s_1 >= min_sat_layer`` and ``|i - j| <= max_distance``. The paper's GPT-2 settings
    were a gap of 10 of 48 layers, both saturation layers at least 10 (so the early token
    has a settled state to give, not one fixed from the embedding on, and the injection
    window below it exists) and a distance of 30; ``min_gap`` and ``min_sat_layer``
    default to that 10 scaled to the model, ``max(1, round(10 * L / 48))``.

    Returns
    -------
    numpy.ndarray of int64, shape [pair, 3]
        (prompt, early position, late position), seeded sample of at most ``n_pairs``,
        at most one pair per late position, the largest gaps first.
    """
    s1 = np.asarray(sat_layer)[..., 0]
    top1 = np.asarray(final_top1)
    min_gap, min_sat_layer = _pair_defaults(n_layers, min_gap, min_sat_layer)
    ok = np.asarray(mask, bool) & (s1 >= 0) & (s1 >= min_sat_layer)
    max_distance = check_int("max_distance", max_distance, low=1)
    n_pairs = check_int("n_pairs", n_pairs, low=0)
    rng = np.random.default_rng(seed)
    found = []
    for p in range(s1.shape[0]):
        pos = np.flatnonzero(ok[p])
        for j in pos:
            near = pos[(np.abs(pos - j) <= max_distance) & (pos != j)]
            cand = near[(top1[p, near] == top1[p, j]) & (s1[p, j] - s1[p, near] >= min_gap)]
            if len(cand):
                i = cand[rng.integers(len(cand))]
                found.append((p, int(i), int(j), int(s1[p, j] - s1[p, i])))
    if not found:
        return np.zeros((0, 3), dtype=np.int64)
    found = np.array(found, dtype=np.int64)
    order = rng.permutation(len(found))
    found = found[order][np.argsort(-found[order, 3], kind="stable")]
    return found[:n_pairs, :3]


def inject_residual(model: Any, text: str, *, source_pos: int, target_pos: int, layer: int,
                    clean: Any = None, baseline: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``source_pos``'s residual into ``target_pos`` after block ``layer``; re-run.

    The target's ``resid_post`` at ``layer`` becomes the source's (an `explorer.Steer`
    that adds their difference), the rest of the forward pass runs as usual, and the
    target's lens is read again. Layers before ``layer`` are not re-run when ``clean``
    (an `explorer.trace.clean_run` of ``text``) is given.

    Parameters
    ----------
    model : Model
    text : str
    source_pos, target_pos : int
        Positions in ``text``'s tokens: the early- and the late-saturating token.
    layer : int
        Block whose output is overwritten at ``target_pos`` (0..L-2).
    clean : CleanRun, optional
        Clean residuals of ``text``; computed if not given.
    baseline : dict, optional
        ``{"rank": [...], "top1": id}`` of the unedited target (saves one forward).

    Returns
    -------
    dict
        ``s1_before``, ``s1_after`` (top-1 saturation layer of the target, each against
        its own run's prediction), ``top1_before``, ``top1_after`` (token ids),
        ``prediction_changed``, ``rank_before``, ``rank_after`` (per layer, rank of each
        run's final top-1), ``layer``.

    References
    ----------
    Lioubashevski et al., ICML 2025, causal intervention.
    """
    from explorer.interventions import Steer
    from explorer.lens import logit_lens
    from explorer.trace import clean_run

    n_tok = model.tokenize([text]).lengths[0]
    for name, v in (("source_pos", source_pos), ("target_pos", target_pos)):
        check_int(name, v, low=0, high=n_tok - 1)
    layer = check_int("layer", layer, low=0, high=model.n_layers - 2)
    if model.remote:
        # no clean run to resume from: only the two residuals come back, every lens below
        # is reduced inside its own remote trace
        from explorer.trace import trace

        two = trace(model, [text], sites=("resid_post",), layers=[layer],
                    positions=[source_pos, target_pos], progress=False)
        src, tgt = two.resid_post.values[0, :, 0].astype(np.float32)  # [d_model] each
        clean = None
    else:
        if clean is None:
            clean = clean_run(model, [text])
        # resid_post of block `layer` is resid_pre of block `layer + 1`; one prompt: no padding
        h = clean.resid_pre[layer + 1][0].float().numpy()             # [pos, d_model]
        src, tgt = h[source_pos], h[target_pos]
    edit = Steer(layer=layer, vector=src - tgt, alpha=1.0, positions=(target_pos,))
    if baseline is None:
        before = logit_lens(model, [text], k=1, positions=[target_pos], resume=clean)
        baseline = {"rank": before.final_rank.values[0, 0, :, 0].astype(int).tolist(),
                    "top1": int(before.final_token_id.values[0, 0, 0])}
    after = logit_lens(model, [text], k=1, positions=[target_pos], edits=[edit], resume=clean)
    rb = np.asarray(baseline["rank"])
    ra = after.final_rank.values[0, 0, :, 0]                           # [layer]
    t_after = int(after.final_token_id.values[0, 0, 0])
    return {
        "layer": layer,
        "s1_before": int(saturation_from_ranks(rb[:, None])[0]),
        "s1_after": int(saturation_from_ranks(ra[:, None])[0]),
        "top1_before": int(baseline["top1"]),
        "top1_after": t_after,
        "prediction_changed": int(baseline["top1"]) != t_after,
        "rank_before": rb.astype(int).tolist(),
        "rank_after": ra.astype(int).tolist(),
    }


# -- the whole analysis ------------------------------------------------------------------

def saturation_analysis(model: Any, texts: Any, *, k: int = 10, max_ratio: float = 0.85,
                        min_ranks: int = 3, n_permutations: int = 1000, n_tasks: int = 4,
                        sample_positions: int = 1000, probe_min_layer: int = 0,
                        n_pairs: int = 8, min_gap: int | None = None,
                        min_sat_layer: int | None = None, window: int | None = None,
                        rank_cap: int = 50, unembed_dtype: str = "float32",
                        part_texts: int | None = None, batch_size: int = 4, seed: int = 0,
                        scheduler: str | None = None, store: Any = None,
                        progress: Any = None) -> xr.Dataset:
    """Saturation layers, order test, task probe, early exit and intervention over texts.

    Parameters
    ----------
    model : Model
    texts : str or list of str
        Prompts, e.g. ``corpus_chunks(model, load_corpus())``.
    k : int, default=10
        Ranks tracked; the order test is run for every k' in 3..k.
    max_ratio : float, default=0.85
        Position filter: s_1 + 1 <= max_ratio * L (order test and probe training).
    min_ranks : int, default=3
    n_permutations : int, default=1000
    n_tasks : int, default=4
        Probe classes: 0..n_tasks-1 leading ranks decided (the last class: that many or more).
    sample_positions : int, default=1000
        Positions used by the probe and the early-exit comparison.
    probe_min_layer : int, default=0
    n_pairs : int, default=8
        Intervention pairs (see `intervention_pairs`); 0 skips the intervention.
    min_gap, min_sat_layer : int, optional
        Pair selection (see `intervention_pairs`): s_1(late) - s_1(early) >= ``min_gap``
        and both s_1 >= ``min_sat_layer``; defaults the paper's 10 of GPT-2's 48 layers,
        scaled: ``max(1, round(10 * L / 48))`` each.
    window : int, optional
        Injection layers s_early - window .. s_early + window; default
        ``max(1, round(5 * L / 48))`` (the paper's 5 of GPT-2's 48 layers).
    rank_cap, unembed_dtype, part_texts, batch_size, seed, store, progress
        As in `saturation_layers`; with ``store`` the whole result is cached as well.
    scheduler : str, optional
        With ``store``: compute saturation layers, the position filter and tau per position
        out of core with dask over the cached lens ranks (`saturation_over_store`), on
        this scheduler (see `explorer.distributed.dask_scheduler`). The result is the same.

    Returns
    -------
    xarray.Dataset
        Everything of `saturation_layers` but ``resid_sample``, plus: ``kept`` (prompt,
        pos); ``tau``, ``tau_shuffled`` (k_order, prompt, pos), ``mean_tau``, ``p_value``,
        ``n_order_positions`` (k_order), ``null_mean_tau`` (k_order, permutation); the
        probe (`task_probe`, prefixed ``probe_``/``control_``); ``task_label``
        (sample, layer); early-exit curves (`early_exit`); intervention results
        ``pair_prompt``, ``pair_early``, ``pair_late`` (pair), ``inj_layer``,
        ``inj_s1_after``, ``inj_changed`` (pair, offset). ``attrs["summary"]`` holds the
        headline numbers (see `saturation_summary`).

    References
    ----------
    Lioubashevski et al., ICML 2025.
    """
    from explorer.trace import provenance

    texts = check_prompts(texts)
    max_ratio = check_float("max_ratio", max_ratio, low=0.0, high=1.0)
    k = check_int("k", k, low=1, high=64)
    min_ranks = check_int("min_ranks", min_ranks, low=2, high=max(2, k))
    n_permutations = check_int("n_permutations", n_permutations, low=1)
    n_tasks = check_int("n_tasks", n_tasks, low=2, high=k + 1)
    n_pairs = check_int("n_pairs", n_pairs, low=0)
    n_layers = model.n_layers
    probe_min_layer = check_int("probe_min_layer", probe_min_layer, low=0, high=n_layers - 1)
    if window is None:
        window = max(1, round(5 * n_layers / 48))
    window = check_int("window", window, low=0, high=n_layers)
    min_gap, min_sat_layer = _pair_defaults(n_layers, min_gap, min_sat_layer)
    if scheduler is not None:
        from explorer.distributed import check_scheduler

        scheduler = check_scheduler(scheduler)
    lens_params = _lens_params(model, k=k, rank_cap=rank_cap, sample_positions=sample_positions,
                               seed=seed, unembed_dtype=unembed_dtype)
    params = dict(k=k, max_ratio=max_ratio, min_ranks=min_ranks, n_permutations=n_permutations,
                  n_tasks=n_tasks, sample_positions=sample_positions,
                  probe_min_layer=probe_min_layer, n_pairs=n_pairs, min_gap=min_gap,
                  min_sat_layer=min_sat_layer, window=window, rank_cap=rank_cap, seed=seed)
    if "unembed_dtype" in lens_params:
        params["unembed_dtype"] = lens_params["unembed_dtype"]

    def compute() -> xr.Dataset:
        lens = saturation_layers(model, texts, k=k, rank_cap=rank_cap,
                                 sample_positions=sample_positions, batch_size=batch_size,
                                 seed=seed, unembed_dtype=unembed_dtype, part_texts=part_texts,
                                 store=store, progress=progress)
        per_position = None
        if scheduler is not None and store is not None:
            per_position = saturation_over_store(
                lens, n_layers=n_layers, max_ratio=max_ratio, k_orders=_order_ks(k, min_ranks),
                min_ranks=min_ranks, scheduler=scheduler)
        ds = _analyse(model, texts, lens.load(), per_position=per_position,
                      **{key: v for key, v in params.items() if key != "unembed_dtype"})
        ds.attrs = provenance(model, method="saturation", citation=CITATION,
                              n_texts=len(texts), **params)
        ds.attrs["summary"] = saturation_summary(ds)
        return ds

    if store is None:
        return compute()
    parts = {"model": model.spec.provenance(), "method": "saturation", "texts": texts,
             "params": params}
    return store.get_or_compute(parts, compute)


def _order_ks(k: int, min_ranks: int) -> list[int]:
    """The k' of the order tests: 3..k (from min_ranks if larger)."""
    return list(range(max(3, min_ranks), k + 1))


def _pair_defaults(n_layers: int, min_gap: int | None,
                   min_sat_layer: int | None) -> tuple[int, int]:
    """Pair selection thresholds: the paper's 10 of GPT-2's 48 layers, scaled to the model."""
    scaled = max(1, round(10 * n_layers / 48))
    min_gap = scaled if min_gap is None else min_gap
    min_sat_layer = scaled if min_sat_layer is None else min_sat_layer
    min_gap = check_int("min_gap", min_gap, low=1, high=n_layers)
    min_sat_layer = check_int("min_sat_layer", min_sat_layer, low=0, high=n_layers - 1)
    return min_gap, min_sat_layer


def _analyse(model: Any, texts: list[str], lens: xr.Dataset, *, k: int, max_ratio: float,
             min_ranks: int, n_permutations: int, n_tasks: int, sample_positions: int,
             probe_min_layer: int, n_pairs: int, min_gap: int, min_sat_layer: int, window: int,
             rank_cap: int, seed: int, per_position: xr.Dataset | None = None) -> xr.Dataset:
    n_layers = model.n_layers
    ds = lens.drop_vars(["resid_sample"])
    mask = lens.mask.values
    if per_position is None:
        sat = lens.sat_layer.values.astype(np.int64)                   # [prompt, pos, rank]
        kept = kept_positions(sat, n_layers, max_ratio=max_ratio) & mask
    else:
        sat = per_position.sat_layer.values.astype(np.int64)
        kept = per_position.kept.values
    ds["kept"] = (("prompt", "pos"), kept)

    # order test for every k' in 3..k
    ks = _order_ks(k, min_ranks)
    flat = sat[kept]                                                   # [n_kept, rank]
    n_pos_shape = mask.shape
    tau = np.full((len(ks), *n_pos_shape), np.nan)
    tau_sh = np.full((len(ks), *n_pos_shape), np.nan)
    null = np.full((len(ks), n_permutations), np.nan)
    mean_tau, p_val, n_ord = (np.full(len(ks), np.nan) for _ in range(3))
    for i, kk in enumerate(ks):
        if len(flat) == 0:
            break
        res = order_test(flat, n_layers, k=kk, min_ranks=min(min_ranks, kk),
                         n_permutations=n_permutations, seed=seed)
        tau[i][kept] = res["tau"]
        if per_position is not None:         # computed out of core: the same numbers
            tau[i] = per_position.tau.sel(k_order=kk).values
        tau_sh[i][kept] = res["tau_shuffled"]
        null[i] = res["null_mean_tau"]
        mean_tau[i], p_val[i], n_ord[i] = res["mean_tau"], res["p_value"], res["n_positions"]
    ds = ds.assign_coords(k_order=np.array(ks, dtype=np.int64), permutation=np.arange(n_permutations))
    ds["tau"] = (("k_order", "prompt", "pos"), tau.astype(np.float32))
    ds["tau_shuffled"] = (("k_order", "prompt", "pos"), tau_sh.astype(np.float32))
    ds["mean_tau"] = (("k_order",), mean_tau)
    ds["p_value"] = (("k_order",), p_val)
    ds["n_order_positions"] = (("k_order",), n_ord)
    ds["null_mean_tau"] = (("k_order", "permutation"), null)

    # task probe on the sampled positions, early exit on the same positions
    sp, sq = lens.sample_prompt.values, lens.sample_pos.values
    if len(sp) >= 10:
        s_sat = sat[sp, sq]                                            # [S, rank]
        labels = task_labels(s_sat, n_layers, n_tasks=n_tasks)         # [S, layer]
        ds["task_label"] = (("sample", "layer"), labels)
        try:
            probe = task_probe(lens.resid_sample.values, labels, train_mask=kept[sp, sq],
                               min_layer=probe_min_layer, seed=seed)
        except InputError as err:
            ds.attrs["probe_error"] = str(err)
            probe = None
        if probe is not None:
            ds["probe_task"] = probe.probe_task
            ds["probe_layer_accuracy"] = probe.probe_layer_accuracy
            ds["control_layer_accuracy"] = probe.control_layer_accuracy
            ds = ds.assign_coords(task=probe.task.values)
            ds["probe_class_recall"] = probe.probe_class_recall
            ds["probe_summary"] = ((), json.dumps({key: probe.attrs[key] for key in (
                "balanced_accuracy", "control_balanced_accuracy", "chance", "classes")}))
            ee = early_exit(lens.top_token_id.values[sp, sq, :, 0], lens.top_prob.values[sp, sq],
                            lens.cosine.values[sp, sq], s_sat[:, 0], probe.probe_task.values,
                            lens.next_token_id.values[sp, sq])
            for name in ee.data_vars:
                ds[name] = ee[name]
            ds["early_exit_summary"] = ((), json.dumps({key: ee.attrs[key] for key in (
                "probe", "oracle", "equal_accuracy", "n_positions")}))

    # intervention
    pairs = intervention_pairs(sat, lens.final_token_id.values[..., 0], kept, n_layers,
                               min_gap=min_gap, min_sat_layer=min_sat_layer, n_pairs=n_pairs,
                               seed=seed) if n_pairs else np.zeros((0, 3), int)
    offsets = np.arange(-window, window + 1)
    inj_layer = np.full((len(pairs), len(offsets)), -1, dtype=np.int64)
    inj_s1 = np.full((len(pairs), len(offsets)), NEVER - 1, dtype=np.int64)
    inj_changed = np.zeros((len(pairs), len(offsets)), dtype=bool)
    if len(pairs):
        from explorer.trace import clean_run
        for pi, (p, early, late) in enumerate(pairs):
            clean = None if model.remote else clean_run(model, [texts[p]])
            s_early = int(sat[p, early, 0])
            base = {"rank": lens.final_rank.values[p, late, :, 0].astype(int).tolist(),
                    "top1": int(lens.final_token_id.values[p, late, 0])}
            for oi, off in enumerate(offsets):
                layer = s_early + int(off)
                if not 0 <= layer <= n_layers - 2:
                    continue
                r = inject_residual(model, texts[p], source_pos=int(early), target_pos=int(late),
                                    layer=layer, clean=clean, baseline=base)
                inj_layer[pi, oi], inj_s1[pi, oi] = layer, r["s1_after"]
                inj_changed[pi, oi] = r["prediction_changed"]
    ds = ds.assign_coords(pair=np.arange(len(pairs)), offset=offsets)
    ds["pair_prompt"] = (("pair",), pairs[:, 0].astype(np.int64))
    ds["pair_early"] = (("pair",), pairs[:, 1].astype(np.int64))
    ds["pair_late"] = (("pair",), pairs[:, 2].astype(np.int64))
    ds["inj_layer"] = (("pair", "offset"), inj_layer)
    ds["inj_s1_after"] = (("pair", "offset"), inj_s1)
    ds["inj_changed"] = (("pair", "offset"), inj_changed)
    return ds


def saturation_summary(ds: xr.Dataset, *, k: int | None = None) -> dict[str, Any]:
    """Headline numbers of a `saturation_analysis` result (JSON-able).

    ``k`` picks the order test (default 5 if computed, else the largest); the dict holds
    ``n_tokens``, ``kept_fraction``, ``mean_tau``, ``p_value``, ``n_order_positions``,
    ``probe`` (balanced accuracy, control, chance), ``early_exit`` (speed-ups at the
    probe's accuracy, oracle) and ``intervention`` (pairs, mean s_1 change at the early
    token's saturation layer, fraction of predictions changed).
    """
    n_tokens = int(ds.mask.values.sum())
    out: dict[str, Any] = {"n_tokens": n_tokens, "n_texts": int(ds.sizes["prompt"]),
                           "n_layers": int(ds.sizes["layer"]),
                           "kept_fraction": float(ds.kept.values.sum() / max(1, n_tokens))}
    ks = ds.k_order.values.tolist()
    if ks:
        kk = k if k in ks else (5 if 5 in ks else ks[-1])
        sel = ds.sel(k_order=kk)
        out.update(order_k=int(kk), mean_tau=float(sel.mean_tau), p_value=float(sel.p_value),
                   n_order_positions=int(sel.n_order_positions),
                   null_mean_tau_mean=float(np.nanmean(sel.null_mean_tau.values)),
                   mean_tau_by_k={str(x): float(ds.mean_tau.sel(k_order=x)) for x in ks})
    if "probe_summary" in ds:
        out["probe"] = json.loads(str(ds.probe_summary.values))
    if "early_exit_summary" in ds:
        out["early_exit"] = json.loads(str(ds.early_exit_summary.values))
    if ds.sizes.get("pair", 0):
        w = ds.sizes["offset"] // 2
        at = ds.isel(offset=w)                                   # inject at s_early
        valid = at.inj_layer.values >= 0
        late = ds.sat_layer.values[ds.pair_prompt.values, ds.pair_late.values, 0]
        delta = (at.inj_s1_after.values - late)[valid]
        allv = ds.inj_layer.values >= 0
        out["intervention"] = {
            "n_pairs": int(ds.sizes["pair"]),
            "mean_s1_change_at_s_early": float(delta.mean()) if valid.any() else float("nan"),
            "fraction_earlier_at_s_early": float((delta < 0).mean()) if valid.any() else float("nan"),
            "prediction_changed_fraction": float(ds.inj_changed.values[allv].mean())
            if allv.any() else float("nan"),
        }
    return out


# -- the random-init twin ----------------------------------------------------------------

def random_init_twin(model: Any, *, seed: int = 0) -> Any:
    """The same architecture with freshly initialised weights (Hugging Face's own init).

    The paper reports ordered saturation even in untrained transformers; this builds the
    control from ``model.hf.config``, seeded, and wraps it like any loaded model.
    """
    from transformers import AutoModelForCausalLM

    from explorer.models import wrap_model

    seed = check_int("seed", seed, low=0)
    config = copy.deepcopy(model.hf.config)
    dtype = next(model.hf.parameters()).dtype
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hf = AutoModelForCausalLM.from_config(config)
    hf.to(dtype)
    return wrap_model(hf, model.tokenizer, name=f"{model.spec.name}-random-init",
                      weights=f"random-init:seed={seed}")
