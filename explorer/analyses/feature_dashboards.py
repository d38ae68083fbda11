"""Feature dashboards for a dictionary of residual-stream features (ITDA atoms or a TopK SAE's
latents): where each feature fires over a corpus, how strongly, on your prompt, and which
tokens its decoder direction promotes through the unembedding.

A *feature index* (`feature_index`) is one Dataset holding a dictionary and its codes over a
corpus: the dictionary's parameters (ITDA atoms, or the SAE's encoder and decoder), every
corpus token (prompt, position, id, text) and the nonzero feature activations of each token
as (token, feature, activation) entries. It is what the page caches in the store; the
dashboards read it:

* `top_activating_contexts`: a feature's strongest tokens with the tokens around them;
* `feature_histogram`: the distribution of its nonzero activations;
* `feature_on_prompt`: its activation on each token of a prompt;
* `feature_logit_effects`: the decoder direction through the unembedding, W_U d, top
  promoted and suppressed tokens;
* `search_features`: features by a token they fire on or promote;
* `feature_steering_edit`: the feature's decoder direction as a `Steer` edit.

An ITDA feature's activation is its matching-pursuit coefficient (Leask et al., ICML 2025);
an SAE latent's is its TopK ReLU activation (Gao et al., 2024). The dashboard layout follows
Neuronpedia's feature pages and Bricken et al., "Towards Monosemanticity" (2023).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xarray as xr

from explorer._checks import InputError, check_choice, check_float, check_int, check_prompts
from explorer.analyses.itda import ITDA, SparseAutoencoder
from explorer.interventions import Steer
from explorer.models import Model
from explorer.trace import provenance, trace

__all__ = ["KINDS", "FeatureDictionary", "feature_index", "cached_feature_index",
           "index_dictionary",
           "top_activating_contexts", "feature_histogram", "feature_on_prompt",
           "feature_logit_effects", "search_features", "feature_steering_edit"]

KINDS = ("itda", "sae")
"""Dictionary kinds: ITDA (atoms of real activations) and the TopK SAE baseline."""


@dataclass
class FeatureDictionary:
    """A trained dictionary as features: decoder rows and an encoder, at one layer's site.

    ``decoder`` [feature, d_model]; ``encode(x)`` maps rows [n, d_model] to dense
    activations [n, feature]. Build one with `index_dictionary` (from a feature index) or
    from an `ITDA` / `SparseAutoencoder` with `FeatureDictionary.of`.
    """

    kind: str
    layer: int
    site: str
    decoder: np.ndarray
    params: dict[str, np.ndarray]
    settings: dict[str, Any]

    @classmethod
    def of(cls, dictionary: ITDA | SparseAutoencoder, *, layer: int,
           site: str = "resid_post") -> FeatureDictionary:
        """The features of a fitted `ITDA` or `SparseAutoencoder`."""
        if isinstance(dictionary, ITDA):
            atoms = np.asarray(dictionary.atoms_, dtype=np.float32)
            return cls("itda", int(layer), site, atoms, {"atoms": atoms},
                       {"tau": dictionary.tau, "l0": dictionary.l0, "encoder": dictionary.method})
        if isinstance(dictionary, SparseAutoencoder):
            params = {"W_enc": dictionary.W_enc_, "W_dec": dictionary.W_dec_,
                      "b_enc": dictionary.b_enc_, "b_dec": dictionary.b_dec_}
            return cls("sae", int(layer), site, np.asarray(dictionary.W_dec_, np.float32),
                       {k: np.asarray(v, np.float32) for k, v in params.items()},
                       {"n_latents": dictionary.n_latents, "k": dictionary.k})
        raise TypeError(f"a dictionary is an ITDA or a SparseAutoencoder; got "
                        f"{type(dictionary).__name__}.")

    @property
    def n_features(self) -> int:
        return int(self.decoder.shape[0])

    def encode(self, x: Any) -> np.ndarray:
        """Dense activations [n, feature] of the rows of ``x`` [n, d_model]."""
        x = np.asarray(x, dtype=np.float32)
        if self.kind == "itda":
            itda = ITDA.from_dataset(xr.Dataset(
                {"atoms": (("atom", "d_model"), self.params["atoms"])},
                coords={"atom_prompt": ("atom", np.zeros(self.n_features, int)),
                        "atom_pos": ("atom", np.zeros(self.n_features, int)),
                        "atom_token": ("atom", np.full(self.n_features, "")),
                        "atom_token_id": ("atom", np.zeros(self.n_features, int))},
                attrs={"params": {"tau": float(self.settings["tau"]),
                                  "l0": int(self.settings["l0"]),
                                  "encoder": str(self.settings["encoder"])}}))
            return itda.dense_codes(x)
        p = {k: torch.from_numpy(v) for k, v in self.params.items()}
        xt = torch.from_numpy(x)
        pre = (xt - p["b_dec"]) @ p["W_enc"].T + p["b_enc"]              # [n, latents]
        top = pre.topk(int(self.settings["k"]), dim=1)
        return torch.zeros_like(pre).scatter(1, top.indices, torch.relu(top.values)).numpy()


def _activations(model: Model, texts: Sequence[str], layer: int, site: str, min_pos: int,
                 batch_size: int, progress: Any) -> tuple[np.ndarray, np.ndarray,
                                                          dict[str, np.ndarray]]:
    """The corpus' activations [token, d_model] at (site, layer) of every real token, which
    of them are encoded (all but each text's first ``min_pos``), and the tokens' labels."""
    ds = trace(model, list(texts), sites=(site,), layers=[layer], batch_size=batch_size,
               progress=progress)
    a = ds[site].sel(layer=layer).values                                  # [prompt, pos, d]
    prompt, pos = np.nonzero(ds.mask.values)
    labels = {"token_prompt": prompt, "token_pos": pos,
              "token_id": ds.token_id.values[prompt, pos],
              "token_text": ds.token.values[prompt, pos].astype(str)}
    return a[prompt, pos].astype(np.float32), pos >= min_pos, labels


def _sparse(dense: np.ndarray, offset: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows, feats = np.nonzero(dense)
    return rows + offset, feats, dense[rows, feats]


def feature_index(model: Model, texts: Sequence[str], *, kind: str = "itda", layer: int,
                  site: str = "resid_post", tau: float = 0.3, l0: int = 8,
                  n_latents: int = 512, k: int = 8, max_epochs: int = 20,
                  min_pos: int = 1, batch_size: int = 8, seed: int = 0,
                  progress: Callable[[int, int], None] | None = None) -> xr.Dataset:
    """Train a dictionary on ``texts`` at (``site``, ``layer``) and encode every token.

    Parameters
    ----------
    model : Model
    texts : sequence of str
        The corpus (e.g. the shipped one cut by
        `explorer.analyses.saturation.corpus_chunks`).
    kind : {"itda", "sae"}, default="itda"
    layer : int
    site : str, default="resid_post"
    tau, l0 : ITDA's settings (`ITDA`).
    n_latents, k, max_epochs, seed : the SAE's settings (`SparseAutoencoder`).
    min_pos : int, default=1
        Leading positions of each text not encoded (the first token is an attention sink);
        they stay in the token table as context.
    progress : callable(done, total), optional

    Returns
    -------
    xarray.Dataset
        ``decoder`` (feature, d_model: ITDA's atoms, or the SAE's decoder) and the SAE
        encoder's ``W_enc``, ``b_enc``, ``b_dec``; the corpus tokens over ``token``
        (``token_prompt``, ``token_pos``, ``token_id``, ``token_text``, ``token_encoded``);
        the nonzero
        activations over ``entry`` (``entry_token``, ``entry_feature``,
        ``entry_activation``); per feature ``max_activation`` and ``frequency`` (fraction of
        the encoded tokens where it is nonzero). Attrs: provenance, the texts and settings.
    """
    kind = check_choice("kind", kind, KINDS)
    layer = model.check_layer(layer)
    texts = check_prompts(list(texts))
    min_pos = check_int("min_pos", min_pos, low=0)
    t0 = time.perf_counter()
    x_all, encoded, labels = _activations(model, texts, layer, site, min_pos, batch_size,
                                          progress)
    rows_encoded = np.nonzero(encoded)[0]
    x = x_all[rows_encoded]
    if x.shape[0] < 2:
        raise InputError(f"the texts hold {x.shape[0]} tokens past position {min_pos}; a "
                         "dictionary needs at least 2.")
    if kind == "itda":
        fitted: ITDA | SparseAutoencoder = ITDA(tau=check_float("tau", tau, low=0.0, high=1.0),
                                                l0=l0).fit(x)
    else:
        n_latents = check_int("n_latents", n_latents, low=1)
        fitted = SparseAutoencoder(n_latents, k=check_int("k", k, low=1, high=n_latents),
                                   max_epochs=max_epochs, seed=seed).fit(x)
    features = FeatureDictionary.of(fitted, layer=layer, site=site)
    trained = time.perf_counter() - t0
    rows, feats, vals = [], [], []
    for s in range(0, x.shape[0], 1024):
        r, f, v = _sparse(features.encode(x[s:s + 1024]), s)
        rows.append(r), feats.append(f), vals.append(v)
    n = x.shape[0]
    entry_token = rows_encoded[np.concatenate(rows)]          # rows of the token table
    entry_feature = np.concatenate(feats)
    entry_activation = np.concatenate(vals).astype(np.float32)
    max_act = np.zeros(features.n_features, np.float32)
    np.maximum.at(max_act, entry_feature, entry_activation)
    freq = np.bincount(entry_feature, minlength=features.n_features) / n
    data = {
        "decoder": (("feature", "d_model"), features.decoder),
        "entry_token": ("entry", entry_token.astype(np.int64)),
        "token_encoded": ("token", encoded),
        "entry_feature": ("entry", entry_feature.astype(np.int64)),
        "entry_activation": ("entry", entry_activation),
        "max_activation": ("feature", max_act),
        "frequency": ("feature", freq.astype(np.float64)),
        **{name: ("token", values) for name, values in labels.items()},
    }
    for name, value in features.params.items():
        if name not in ("W_dec", "atoms"):          # the decoder: stored once
            data[name] = ((("feature", "d_model") if value.ndim == 2 else
                           ("feature",) if name == "b_enc" else ("d_model",)), value)
    attrs = provenance(model, method="feature_index", kind=kind, layer=layer, site=site,
                       min_pos=min_pos, **features.settings,
                       **({"max_epochs": max_epochs, "seed": seed} if kind == "sae" else {}))
    attrs.update(kind=kind, layer=layer, site=site, texts=list(texts),
                 settings=dict(features.settings), n_tokens=int(n),
                 seconds=round(time.perf_counter() - t0, 3), train_seconds=round(trained, 3))
    return xr.Dataset(data, coords={"feature": np.arange(features.n_features)}, attrs=attrs)


def cached_feature_index(model: Model, texts: Sequence[str], *, store: Any = None,
                         **settings: Any) -> tuple[xr.Dataset, bool]:
    """`feature_index` kept in the activation store: (the index, loaded into memory, and
    whether it came from the store). The key covers the model's provenance, the texts and
    every setting, so the first call trains and later calls (any session) read it back.

    A tuple: the index and a flag about where it came from are different kinds of value.
    """
    from explorer.store import ActivationStore

    store = ActivationStore() if store is None else store
    model_parts = model.spec.provenance()
    model_parts.pop("versions", None)
    progress = settings.pop("progress", None)
    parts = {"model": model_parts, "method": "feature_index", "texts": list(texts),
             "settings": {k: settings[k] for k in sorted(settings)}}
    computed = []

    def compute() -> xr.Dataset:
        computed.append(True)
        return feature_index(model, texts, progress=progress, **settings)

    index = store.get_or_compute(parts, compute).load()
    return index, not computed


def index_dictionary(index: xr.Dataset) -> FeatureDictionary:
    """The `FeatureDictionary` a feature index holds."""
    kind = str(index.attrs["kind"])
    settings = dict(index.attrs["settings"])
    decoder = np.asarray(index["decoder"].values, dtype=np.float32)
    if kind == "itda":
        params = {"atoms": decoder}
    else:
        params = {"W_enc": np.asarray(index["W_enc"].values, np.float32), "W_dec": decoder,
                  "b_enc": np.asarray(index["b_enc"].values, np.float32),
                  "b_dec": np.asarray(index["b_dec"].values, np.float32)}
    return FeatureDictionary(kind, int(index.attrs["layer"]), str(index.attrs["site"]), decoder,
                             params, settings)


def _check_feature(index: xr.Dataset, feature: Any) -> int:
    return check_int("feature", feature, low=0, high=index.sizes["feature"] - 1)


def _feature_entries(index: xr.Dataset, feature: int) -> tuple[np.ndarray, np.ndarray]:
    """(token rows, activations) where ``feature`` is nonzero."""
    f = index["entry_feature"].values
    keep = f == feature
    return index["entry_token"].values[keep], index["entry_activation"].values[keep]


def _attrs(index: xr.Dataset, method: str, **params: Any) -> dict[str, Any]:
    out = {k: index.attrs[k] for k in ("model", "model_spec", "versions", "kind", "layer",
                                       "site", "settings") if k in index.attrs}
    out.update(method=method, params={**params, "index": index.attrs.get("params", {})},
               edits=[])
    return out


def top_activating_contexts(index: xr.Dataset, feature: int, *, k: int = 10,
                            before: int = 8, after: int = 3) -> xr.Dataset:
    """The ``k`` corpus tokens where ``feature`` is strongest, each with its context.

    Returns
    -------
    xarray.Dataset
        Over (rank, offset), offset -before..after around the activating token (offset 0):
        ``context_token`` (text, '' outside the text), ``context_activation`` (the
        feature's activation on each context token, NaN outside); over rank:
        ``activation``, ``token_prompt``, ``token_pos``, ``token_row`` (the token's row in
        the index). Ties keep corpus order.
    """
    feature = _check_feature(index, feature)
    k = check_int("k", k, low=1)
    rows, acts = _feature_entries(index, feature)
    order = np.argsort(-acts, kind="stable")[:k]
    rows, acts = rows[order], acts[order]
    prompt, pos = index["token_prompt"].values, index["token_pos"].values
    text = index["token_text"].values
    n_rows = len(prompt)
    act_of_row = np.full(n_rows, 0.0, dtype=np.float32)
    all_rows, all_acts = _feature_entries(index, feature)
    act_of_row[all_rows] = all_acts
    offsets = np.arange(-before, after + 1)
    ctx_tok = np.full((len(rows), len(offsets)), "", dtype=object)
    ctx_act = np.full((len(rows), len(offsets)), np.nan)
    for i, r in enumerate(rows):
        for j, o in enumerate(offsets):
            q = r + o
            if 0 <= q < n_rows and prompt[q] == prompt[r] and pos[q] - pos[r] == o:
                ctx_tok[i, j] = text[q]
                ctx_act[i, j] = act_of_row[q]
    return xr.Dataset(
        {"context_token": (("rank", "offset"), ctx_tok.astype(str)),
         "context_activation": (("rank", "offset"), ctx_act),
         "activation": ("rank", acts.astype(np.float64)),
         "token_prompt": ("rank", prompt[rows]), "token_pos": ("rank", pos[rows]),
         "token_row": ("rank", rows)},
        coords={"rank": np.arange(len(rows)), "offset": offsets},
        attrs=_attrs(index, "top_activating_contexts", feature=feature, k=k, before=before,
                     after=after) | {"feature": feature})


def feature_histogram(index: xr.Dataset, feature: int, *, bins: int = 24) -> xr.Dataset:
    """Histogram of ``feature``'s nonzero activations over the corpus tokens.

    Returns ``token_count`` over ``bin`` with coords ``left`` / ``right`` (the bin edges); attrs
    ``n_tokens`` (corpus tokens), ``n_active`` (tokens where it is nonzero), ``feature``.
    """
    feature = _check_feature(index, feature)
    bins = check_int("bins", bins, low=1)
    _, acts = _feature_entries(index, feature)
    if acts.size:
        counts, edges = np.histogram(acts.astype(np.float64), bins=bins)
    else:
        counts, edges = np.zeros(bins, int), np.linspace(0.0, 1.0, bins + 1)
    return xr.Dataset({"token_count": ("bin", counts)},
                      coords={"bin": np.arange(bins), "left": ("bin", edges[:-1]),
                              "right": ("bin", edges[1:])},
                      attrs=_attrs(index, "feature_histogram", feature=feature, bins=bins)
                      | {"feature": feature, "n_tokens": int(index["token_encoded"].sum()),
                         "n_active": int(acts.size)})


def feature_on_prompt(model: Model, index: xr.Dataset, prompt: str,
                      features: Sequence[int] | int) -> xr.Dataset:
    """Activation of ``features`` on every token of ``prompt`` (the index's layer and site).

    Returns ``activation`` over (feature, pos) with coords ``token`` and ``token_id``.
    """
    prompt = check_prompts(prompt)[0] if isinstance(prompt, str) else check_prompts(prompt)[0]
    feats = [features] if isinstance(features, (int, np.integer)) else list(features)
    feats = [_check_feature(index, f) for f in feats]
    d = index_dictionary(index)
    ds = trace(model, [prompt], sites=(d.site,), layers=[d.layer], progress=False)
    n = int(ds.mask.values[0].sum())
    x = ds[d.site].sel(layer=d.layer).values[0, :n]                    # [pos, d_model]
    dense = d.encode(x)                                                # [pos, feature]
    return xr.Dataset(
        {"activation": (("feature", "pos"), dense[:, feats].T.astype(np.float64))},
        coords={"feature": feats, "pos": np.arange(n),
                "token": ("pos", ds.token.values[0, :n].astype(str)),
                "token_id": ("pos", ds.token_id.values[0, :n])},
        attrs=_attrs(index, "feature_on_prompt", prompt=prompt, features=feats)
        | {"prompt": prompt, "feature": feats[0] if len(feats) == 1 else feats})


def feature_logit_effects(model: Model, index: xr.Dataset, feature: int, *,
                          k: int = 10) -> xr.Dataset:
    """The feature's decoder direction through the unembedding: W_U d, its ``k`` most
    promoted and most suppressed tokens.

    Returns over ``rank``: ``promoted_id`` / ``promoted_token`` / ``promoted_logit``
    (largest first) and ``suppressed_*`` (most negative first)."""
    feature = _check_feature(index, feature)
    k = check_int("k", k, low=1, high=model.vocab_size)
    d = torch.from_numpy(np.asarray(index["decoder"].values[feature], dtype=np.float32))
    w_u = model.unembed_module.weight.detach().float()                 # [vocab, d_model]
    effect = w_u @ d.to(w_u.device)                                    # [vocab]
    up, down = effect.topk(k), (-effect).topk(k)
    up_ids, down_ids = up.indices.tolist(), down.indices.tolist()
    return xr.Dataset(
        {"promoted_id": ("rank", np.array(up_ids)),
         "promoted_token": ("rank", np.array(model.token_strings(up_ids), dtype=str)),
         "promoted_logit": ("rank", up.values.double().cpu().numpy()),
         "suppressed_id": ("rank", np.array(down_ids)),
         "suppressed_token": ("rank", np.array(model.token_strings(down_ids), dtype=str)),
         "suppressed_logit": ("rank", (-down.values).double().cpu().numpy())},
        coords={"rank": np.arange(k)},
        attrs=_attrs(index, "feature_logit_effects", feature=feature, k=k)
        | {"feature": feature})


def search_features(model: Model, index: xr.Dataset, query: str, *, k: int = 10) -> xr.Dataset:
    """Features by a token: those that fire most on corpus tokens spelled ``query`` (leading
    and trailing spaces ignored, case-sensitive) and those whose decoder direction most
    promotes it (W_U[t] . d, the best over the tokens spelled ``query`` with or without a
    leading space).

    Returns over (how, rank), how in ("fires on", "promotes"): ``feature`` (-1 where fewer
    than ``rank`` + 1 were found) and ``score`` (max activation, or logit effect)."""
    if not isinstance(query, str) or not query.strip():
        raise InputError(f"`query` must be a token's text, e.g. ' Paris'; got {query!r}.")
    k = check_int("k", k, low=1)
    word = query.strip()
    feats = np.full((2, k), -1, dtype=np.int64)
    scores = np.full((2, k), np.nan)
    text = np.char.strip(index["token_text"].values.astype(str))
    rows = np.nonzero(text == word)[0]
    if rows.size:
        f, t, a = (index["entry_feature"].values, index["entry_token"].values,
                   index["entry_activation"].values)
        keep = np.isin(t, rows)
        best = np.full(index.sizes["feature"], -np.inf)
        np.maximum.at(best, f[keep], a[keep])
        order = [i for i in np.argsort(-best, kind="stable")[:k] if np.isfinite(best[i])]
        feats[0, :len(order)] = order
        scores[0, :len(order)] = best[order]
    ids = set()
    for spelling in (word, " " + word):
        pieces = model.tokenizer(spelling, add_special_tokens=False)["input_ids"]
        if len(pieces) == 1:
            ids.add(int(pieces[0]))
    ids = sorted(ids)
    if ids:
        w_u = model.unembed_module.weight.detach().float()[ids]           # [t, d_model]
        dec = torch.from_numpy(np.asarray(index["decoder"].values, dtype=np.float32))
        effect = (dec @ w_u.T.to(dec.device)).max(-1).values             # [feature]
        top = effect.topk(min(k, effect.shape[0]))
        feats[1, :len(top.indices)] = top.indices.numpy()
        scores[1, :len(top.indices)] = top.values.double().numpy()
    return xr.Dataset({"feature": (("how", "rank"), feats), "score": (("how", "rank"), scores)},
                      coords={"how": ["fires on", "promotes"], "rank": np.arange(k)},
                      attrs=_attrs(index, "search_features", query=query, k=k)
                      | {"query": query, "token_ids": ids})


def feature_steering_edit(index: xr.Dataset, feature: int, *, alpha: float | None = None,
                          positions: Sequence[int] | None = None) -> Steer:
    """The feature's decoder direction as a `Steer` edit at the index's layer (resid_post),
    scaled by ``alpha`` (default: the feature's largest activation over the corpus)."""
    feature = _check_feature(index, feature)
    site = str(index.attrs["site"])
    if site != "resid_post":
        raise InputError(f"a steering edit adds to resid_post; this dictionary reads {site!r}.")
    if alpha is None:
        alpha = float(index["max_activation"].values[feature]) or 1.0
    row = np.asarray(index["decoder"].values[feature], dtype=np.float64)
    return Steer(layer=int(index.attrs["layer"]), vector=tuple(float(v) for v in row),
                 alpha=check_float("alpha", alpha),
                 positions=None if positions is None else tuple(int(p) for p in positions))
