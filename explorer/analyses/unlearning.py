"""Mechanistic unlearning: localize where a fact is looked up, then unlearn only there.

Guo, Syed, Sheshadri, Ewart & Dziugaite, "Mechanistic Unlearning: Robust Knowledge
Unlearning and Editing via Mechanistic Localization" (ICML 2025).
Facts are athlete -> sport (``datasets/unlearning/athlete_sport.json``), asked in the
trained format ("Fact: ... plays the sport of") and an unseen multiple-choice format.

- `attribute_probe_curve`: a logistic-regression probe for the sport on the last subject
  token after each layer (cross-validated); `fact_lookup_layers` takes the window of MLP
  layers where the probe accuracy rises most (fact lookup, FLU).
- `causal_trace`: noise the subject embeddings, restore one layer's clean state (residual
  at one position, or the MLP output at every position) and read p(answer).
- `attribution_patching`: the gradient of p(answer) in the corrupted run times the clean
  minus corrupted MLP output, a linear estimate of the MLP restore effect.
- `localized_finetune`: gradient steps on a copy of the model restricted to the chosen MLP
  layers (forget loss plus a retain term); `unlearning_comparison` runs it for each
  localization with the same parameter budget and evaluates forget / multiple-choice /
  retain accuracy and a relearning attack.
"""
from __future__ import annotations

import copy
import hashlib
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xarray as xr

from explorer._checks import (
    ExplorerError,
    InputError,
    check_choice,
    check_float,
    check_int,
)
from explorer.lora import WeightDeltas, adamw, adamw_step, remove_hooks
from explorer.models import Model, cache_dir
from explorer.trace import provenance, run_batch, run_on_weights

__all__ = [
    "FORMATS",
    "METHODS",
    "METRICS",
    "OBJECTIVES",
    "AttributeFact",
    "UnlearningCancelled",
    "facts_path",
    "load_attribute_facts",
    "fact_prompt",
    "attribute_token_ids",
    "subject_positions",
    "candidate_predictions",
    "format_accuracy",
    "known_facts",
    "split_facts",
    "probe_accuracy",
    "attribute_probe_curve",
    "fact_lookup_layers",
    "causal_trace",
    "attribution_patching",
    "top_layers",
    "localized_layers",
    "component_parameters",
    "localized_finetune",
    "relearn_halves",
    "relearn",
    "unlearning_comparison",
]

FORMATS = ("trained", "mc")
METHODS = ("fact_lookup", "causal_tracing", "attribution_patching", "random", "all")
OBJECTIVES = ("unlearn", "edit")
CITATION = ("Guo, Syed, Sheshadri, Ewart & Dziugaite, Mechanistic Unlearning: Robust "
            "Knowledge Unlearning and Editing via Mechanistic Localization, ICML 2025")

Progress = Callable[[int, int], None] | None
ShouldStop = Callable[[], bool] | None


class UnlearningCancelled(ExplorerError):
    """A training run was stopped by its ``should_stop`` callback."""


# -- data ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class AttributeFact:
    """One subject with its attribute and the prompt templates of its relation."""

    subject: str
    attribute: str
    attributes: tuple[str, ...]
    trained: str
    mc: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def facts_path() -> Path:
    """The shipped fact file, ``datasets/unlearning/athlete_sport.json``."""
    return Path(__file__).resolve().parents[2] / "datasets" / "unlearning" / "athlete_sport.json"


def load_attribute_facts(path: str | Path | None = None) -> list[AttributeFact]:
    """Every fact of the file (default the shipped athlete -> sport facts)."""
    path = Path(path) if path is not None else facts_path()
    if not path.is_file():
        raise InputError(f"fact file {str(path)!r} does not exist.")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"fact file {str(path)!r} is not valid JSON: {e}.") from None
    templates = data.get("templates") if isinstance(data, dict) else None
    missing = [k for k in ("attributes", "facts") if not isinstance(data, dict) or k not in data]
    missing += [f"templates.{k}" for k in ("trained", "mc")
                if not isinstance(templates, dict) or k not in templates]
    if missing:
        raise InputError(f"fact file {str(path)!r} lacks {', '.join(missing)}; it needs "
                         "'attributes', 'facts' ([subject, attribute] pairs) and 'templates' "
                         "with 'trained' and 'mc'.")
    attrs = tuple(data["attributes"])
    out = []
    for i, (subject, attribute) in enumerate(data["facts"]):
        if attribute not in attrs:
            raise InputError(f"fact {i} ({subject!r}) has attribute {attribute!r}; the file "
                             f"allows {', '.join(attrs)}.")
        out.append(AttributeFact(subject, attribute, attrs, data["templates"]["trained"],
                                 data["templates"]["mc"]))
    return out


def fact_prompt(fact: AttributeFact, fmt: str = "trained") -> str:
    """The prompt of a fact in the trained format or the multiple-choice format (the
    options are every attribute of the relation, in the file's order)."""
    check_choice("format", fmt, FORMATS)
    if fmt == "trained":
        return fact.trained.format(subject=fact.subject)
    return fact.mc.format(subject=fact.subject, options=", ".join(fact.attributes))


def attribute_token_ids(model: Model, attributes: Sequence[str]) -> list[int]:
    """First token of `` attribute`` for each attribute; they must differ."""
    ids = [model.tokenizer(" " + a, add_special_tokens=False)["input_ids"][0] for a in attributes]
    if len(set(ids)) != len(ids):
        raise InputError(f"the attributes {list(attributes)} do not start with distinct tokens "
                         "for this tokenizer; answers could not be told apart.")
    return ids


def subject_positions(model: Model, fact: AttributeFact) -> list[int]:
    """Token positions of the subject in the trained prompt (its first token carries the
    space before it)."""
    prompt = fact_prompt(fact, "trained")
    prefix = fact.trained.split("{subject}")[0]
    tok = model.tokenizer
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    head = prefix.rstrip(" ")
    before = len(tok(head, add_special_tokens=False)["input_ids"]) if head else 0
    upto = tok(prompt[:len(prefix) + len(fact.subject)], add_special_tokens=False)["input_ids"]
    if ids[:len(upto)] != upto or len(upto) <= before:
        raise InputError(f"the subject {fact.subject!r} does not tokenise on its own in its "
                         "prompt; positions cannot be found.")
    return list(range(before, len(upto)))


def candidate_predictions(logits: torch.Tensor, candidate_ids: Sequence[int]) -> np.ndarray:
    """Index of the highest-scoring candidate for each row of ``logits`` [prompt, vocab]:
    the answer of a multiple-choice (or closed-set) question scored by its first token."""
    if logits.ndim != 2:
        raise InputError(f"`logits` must be [prompt, vocab]; got shape {tuple(logits.shape)}.")
    ids = torch.as_tensor(list(candidate_ids), dtype=torch.long)
    return logits[:, ids].argmax(-1).numpy()


def _last_logits_hf(hf: torch.nn.Module, model: Model, prompts: Sequence[str],
                    batch_size: int = 32) -> torch.Tensor:
    """Last-position logits [prompt, vocab] of a plain forward of ``hf`` (a trained copy)."""
    out = []
    for b0 in range(0, len(prompts), batch_size):
        batch = model.tokenize(list(prompts[b0:b0 + batch_size]))
        out.append(hf(**batch.model_inputs()).logits[:, -1].float())
    return torch.cat(out)


def format_accuracy(model: Model, facts: Sequence[AttributeFact], fmt: str = "trained", *,
                    hf: torch.nn.Module | WeightDeltas | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(correct [fact] bool, p(answer) among the candidates [fact]) for the facts asked in
    ``fmt``; ``hf`` is a trained copy to evaluate instead of the model's own weights, or
    the `WeightDeltas` a remote model's `localized_finetune` returns (evaluated where the
    weights are, with the updates hooked; only the candidates' logits come back)."""
    facts = list(facts)
    if not facts:
        return np.zeros(0, bool), np.zeros(0)
    prompts = [fact_prompt(f, fmt) for f in facts]
    ids = attribute_token_ids(model, facts[0].attributes)
    target = np.array([f.attributes.index(f.attribute) for f in facts])
    with torch.no_grad():
        if hf is None:
            logits = run_batch(model, model.tokenize(prompts), save_positions=[-1])["logits"][:, 0].float()
        elif isinstance(hf, WeightDeltas):
            batches = [model.tokenize(list(prompts[b0:b0 + 32])) for b0 in range(0, len(prompts), 32)]
            with model.lock:
                cand = run_on_weights(model, _candidate_logits, batches, hf, list(ids))
            return _candidate_accuracy(cand, target)
        else:
            logits = _last_logits_hf(hf, model, prompts)
    return _candidate_accuracy(logits[:, torch.as_tensor(list(ids), dtype=torch.long)], target)


def _candidate_accuracy(cand: torch.Tensor, target: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(argmax candidate == target, p(target) among the candidates) from the candidates'
    logits [prompt, candidate] (`candidate_predictions` on the full logits)."""
    pred = cand.argmax(-1).numpy()
    p = torch.softmax(cand, -1).numpy()[np.arange(len(target)), target]
    return pred == target, p


def _candidate_logits(weights: Model, batches: list, deltas: WeightDeltas,
                      ids: list[int]) -> torch.Tensor:
    """Last-position logits of the candidate tokens [prompt, candidate] with ``deltas``
    hooked (one job where the weights are)."""
    device = weights.hf.device
    handles = deltas.to(device).hooks(weights)
    cols = torch.tensor(ids, device=device)
    out = []
    try:
        with torch.no_grad():
            for batch in batches:
                logits = weights.hf(**batch.to(device).model_inputs()).logits[:, -1].float()
                out.append(logits[:, cols])
    finally:
        remove_hooks(handles)
    return torch.cat(out)


def _cache_file(model: Model, facts: Sequence[AttributeFact], formats: Sequence[str]) -> Path:
    key = hashlib.sha256(json.dumps([f.to_dict() for f in facts] + list(formats)).encode()).hexdigest()[:16]
    wh = hashlib.sha256(f"{model.spec.name}|{model.spec.weights}".encode()).hexdigest()[:16]
    return cache_dir() / "unlearning" / f"known-{wh}-{key}.json"


def known_facts(model: Model, facts: Sequence[AttributeFact] | None = None, *,
                formats: Sequence[str] = ("trained",), cache: bool = True) -> list[AttributeFact]:
    """The facts the model answers correctly (top candidate among the attributes) in every
    one of ``formats`` (default the trained format only), cached as JSON per model weights
    and fact list under ``cache_dir()``."""
    facts = load_attribute_facts() if facts is None else list(facts)
    if not facts:
        raise InputError("`facts` must hold at least one fact; got an empty list.")
    formats = [check_choice("format", f, FORMATS) for f in formats]
    path = _cache_file(model, facts, formats)
    if cache and path.is_file():
        return [facts[i] for i in json.loads(path.read_text())["kept"]]
    ok = np.ones(len(facts), bool)
    for fmt in formats:
        ok &= format_accuracy(model, facts, fmt)[0]
    keep = [int(i) for i in np.flatnonzero(ok)]
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"model": model.spec.name, "formats": formats, "kept": keep}))
        tmp.replace(path)
    return [facts[i] for i in keep]


def split_facts(facts: Sequence[AttributeFact], n_forget: int, n_retain: int, *,
                seed: int = 0) -> tuple[list[AttributeFact], list[AttributeFact]]:
    """A seeded random forget set and a disjoint retain set."""
    facts = list(facts)
    n_forget = check_int("n_forget", n_forget, low=2)
    n_retain = check_int("n_retain", n_retain, low=1)
    if n_forget + n_retain > len(facts):
        raise InputError(f"`n_forget` + `n_retain` must be at most the {len(facts)} facts "
                         f"available; got {n_forget} + {n_retain}.")
    order = list(range(len(facts)))
    random.Random(seed).shuffle(order)
    return ([facts[i] for i in order[:n_forget]],
            [facts[i] for i in order[n_forget:n_forget + n_retain]])


# -- fact lookup: the probe ---------------------------------------------------------------

def probe_accuracy(features: np.ndarray, labels: np.ndarray, *, n_folds: int = 4,
                   seed: int = 0) -> float:
    """Cross-validated accuracy of a multinomial logistic-regression probe
    (standardised features, L2 penalty, stratified ``n_folds``-fold split)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold, cross_val_score
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    features = np.asarray(features, dtype=np.float64)
    labels = np.asarray(labels)
    if features.ndim != 2 or len(features) != len(labels):
        raise InputError(f"`features` must be [example, feature] with one label per row; got "
                         f"{features.shape} and {labels.shape}.")
    n_folds = check_int("n_folds", n_folds, low=2)
    _, counts = np.unique(labels, return_counts=True)
    if len(counts) < 2:
        raise InputError(f"a probe needs labels of at least 2 classes; got {len(counts)}.")
    if counts.min() < n_folds:
        raise InputError(f"every class needs at least `n_folds`={n_folds} examples; the "
                         f"smallest has {counts.min()}.")
    probe = make_pipeline(StandardScaler(), LogisticRegression(C=0.1, max_iter=2000))
    folds = StratifiedKFold(n_folds, shuffle=True, random_state=seed)
    return float(cross_val_score(probe, features, labels, cv=folds).mean())


def attribute_probe_curve(model: Model, facts: Sequence[AttributeFact], *, n_folds: int = 4,
                          seed: int = 0, batch_size: int = 32, progress: Progress = None,
                          ) -> xr.Dataset:
    """Probe accuracy for the attribute on the last subject token, per layer.

    Reads ``resid_post`` of every layer (after its MLP) and ``resid_pre`` of layer 0 (the
    embedding) at the last subject token of each trained-format prompt.

    Returns
    -------
    xr.Dataset
        ``probe_accuracy`` (layer), ``embed_accuracy`` scalar, ``chance`` scalar (the
        largest class share).
    """
    facts = list(facts)
    if len(facts) < 2:
        raise InputError(f"`facts` must hold at least 2 facts; got {len(facts)}.")
    L = model.n_layers
    labels = np.array([f.attribute for f in facts])
    feats = [[] for _ in range(L + 1)]  # embed, then layer 0..L-1
    save = {(0, "resid_pre")} | {(layer, "resid_post") for layer in range(L)}
    for b0 in range(0, len(facts), batch_size):
        chunk = facts[b0:b0 + batch_size]
        batch = model.tokenize([fact_prompt(f, "trained") for f in chunk])
        out = run_batch(model, batch, save=save, logits=False)
        rows = torch.arange(len(chunk))
        cols = torch.tensor([batch.width - n + subject_positions(model, f)[-1]
                             for f, n in zip(chunk, batch.lengths)])
        feats[0].append(out[(0, "resid_pre")][rows, cols].float().numpy())
        for layer in range(L):
            feats[layer + 1].append(out[(layer, "resid_post")][rows, cols].float().numpy())
        if progress:
            progress(min(b0 + batch_size, len(facts)), len(facts) + L + 1)
    accs = []
    for i, f in enumerate(feats):
        accs.append(probe_accuracy(np.concatenate(f), labels, n_folds=n_folds, seed=seed))
        if progress:
            progress(len(facts) + i + 1, len(facts) + L + 1)
    _, counts = np.unique(labels, return_counts=True)
    ds = xr.Dataset({"probe_accuracy": ("layer", np.array(accs[1:])),
                     "embed_accuracy": accs[0], "chance": counts.max() / counts.sum()},
                    coords={"layer": np.arange(L)},
                    attrs=provenance(model, method="attribute_probe_curve", n_folds=n_folds,
                                     seed=seed, n_facts=len(facts)))
    ds.attrs["citation"] = CITATION
    return ds


def fact_lookup_layers(probe: xr.Dataset, n_layers: int) -> list[int]:
    """The ``n_layers`` consecutive layers over which the probe accuracy rises most
    (accuracy after the window minus accuracy before it, the embedding before layer 0)."""
    acc = np.concatenate([[float(probe.embed_accuracy)], probe.probe_accuracy.values])
    L = len(acc) - 1
    n_layers = check_int("n_layers", n_layers, low=1, high=L)
    gains = [acc[s + n_layers] - acc[s] for s in range(L - n_layers + 1)]
    start = int(np.argmax(gains))  # first window on ties: lookup happens early
    return list(range(start, start + n_layers))


# -- causal tracing and attribution patching ---------------------------------------------

def _layer_modules(model: Model) -> list[torch.nn.Module]:
    return [model.hf_layer(layer) for layer in range(model.n_layers)]


def _mlp_module(model: Model, layer: int) -> torch.nn.Module:
    block = model.hf_layer(layer)
    if not hasattr(block, "mlp"):
        raise InputError(f"{model.spec.family} layers have no `mlp` module; unlearning needs one.")
    return block.mlp


def _noise_std(model: Model) -> float:
    """Standard deviation of the token embedding entries (the noise unit of ROME); read on
    the server for a remote model."""
    return float(run_on_weights(model, _embedding_std))


def _embedding_std(weights: Model) -> float:
    return float(weights.hf.get_input_embeddings().weight.float().std())


def _fact_noise(model: Model, facts: Sequence[AttributeFact], noise_scale: float,
                seed: int) -> list[torch.Tensor]:
    """Gaussian noise per fact, [n_subject_tokens, d_model]: one generator seeded with
    ``seed`` draws each fact's block in order, scaled by noise_scale * embedding std."""
    g = torch.Generator().manual_seed(seed)
    std = _noise_std(model)
    return [torch.randn(len(subject_positions(model, f)), model.spec.d_model, generator=g)
            * noise_scale * std for f in facts]


def _replace_output(output: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to a module output that is a tensor or a tuple led by one."""
    if isinstance(output, tuple):
        return (fn(output[0]), *output[1:])
    return fn(output)


def _clean_states(model: Model, prompt: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Clean resid_post and mlp_out per layer, each [pos, d_model], from one core trace."""
    L = model.n_layers
    out = run_batch(model, model.tokenize([prompt]), logits=False,
                    save={(x, s) for x in range(L) for s in ("resid_post", "mlp_out")})
    return ([out[(x, "resid_post")][0].clone() for x in range(L)],
            [out[(x, "mlp_out")][0].clone() for x in range(L)])


def _corrupted_probs(model: Model, ids: torch.Tensor, subj: list[int], noise: torch.Tensor,
                     target: int, restores: Sequence[tuple[str, int, int | None]],
                     resid: list[torch.Tensor], mlp: list[torch.Tensor]) -> torch.Tensor:
    """p(target) at the last position for one corrupted run per restore.

    ``restores`` rows are ("resid", layer, pos): that layer's output at pos set to its
    clean value; ("mlp", layer, None): that MLP's output at every position set clean;
    ("none", -1, None): corrupted only. ``ids`` [pos]; the subject embeddings get ``noise``.
    The runs are plain forwards with torch hooks, where the weights are (on the server for
    a remote model: `run_on_weights`).
    """
    with model.lock:
        return run_on_weights(model, _corrupted_probs_here, ids, subj, noise, target,
                              list(restores), resid, mlp)


def _corrupted_probs_here(model: Model, ids: torch.Tensor, subj: list[int], noise: torch.Tensor,
                          target: int, restores: Sequence[tuple[str, int, int | None]],
                          resid: list[torch.Tensor], mlp: list[torch.Tensor]) -> torch.Tensor:
    """`_corrupted_probs` on ``model``'s own weights (local, or the server's module tree)."""
    device = model.hf.device
    ids, noise = ids.to(device), noise.to(device)
    resid = [x.to(device) for x in resid]
    mlp = [x.to(device) for x in mlp]
    R = len(restores)
    handles = []
    subj_t = torch.tensor(subj)

    def add_noise(_m, _inp, out):
        out = out.clone()
        out[:, subj_t] += noise.to(out.dtype)
        return out

    handles.append(model.hf.get_input_embeddings().register_forward_hook(add_noise))
    for layer in range(model.n_layers):
        rows_r = [(i, p) for i, (k, x, p) in enumerate(restores) if k == "resid" and x == layer]
        rows_m = [i for i, (k, x, _) in enumerate(restores) if k == "mlp" and x == layer]
        if rows_r:
            ri = torch.tensor([i for i, _ in rows_r])
            pi = torch.tensor([p for _, p in rows_r])

            def restore_resid(_m, _inp, out, ri=ri, pi=pi, clean=resid[layer]):
                def fn(h):
                    h = h.clone()
                    h[ri, pi] = clean[pi].to(h.dtype)
                    return h
                return _replace_output(out, fn)
            handles.append(model.hf_layer(layer).register_forward_hook(restore_resid))
        if rows_m:
            mi = torch.tensor(rows_m)

            def restore_mlp(_m, _inp, out, mi=mi, clean=mlp[layer]):
                def fn(h):
                    h = h.clone()
                    h[mi] = clean.to(h.dtype)
                    return h
                return _replace_output(out, fn)
            handles.append(_mlp_module(model, layer).register_forward_hook(restore_mlp))
    try:
        with torch.no_grad():
            logits = model.hf(input_ids=ids[None].expand(R, -1)).logits[:, -1].float()
    finally:
        remove_hooks(handles)
    return torch.softmax(logits, -1)[:, target]


def causal_trace(model: Model, facts: Sequence[AttributeFact], *, noise_scale: float = 3.0,
                 seed: int = 0, positions: bool | Sequence[int] = True, batch_size: int = 64,
                 progress: Progress = None) -> xr.Dataset:
    """Causal tracing (Meng et al. 2022, as used by Guo et al., ICML 2025).

    The subject embeddings get Gaussian noise (``noise_scale`` times the embedding std;
    see `_fact_noise`); one layer's clean state is restored at a time and p(answer) at the
    last position is read. ``restore_resid`` restores a layer's output (resid_post) at one
    position (the layer x position heatmap: every position when ``positions`` is True,
    the listed per-prompt positions (negative from the end) when a list, none when False);
    ``restore_mlp`` restores one MLP's output at every position (the MLP localization).

    Returns
    -------
    xr.Dataset
        ``restore_resid`` (fact, layer, pos) NaN past a prompt's end; ``restore_mlp``
        (fact, layer); ``p_clean``, ``p_corrupt`` (fact); coord ``token`` (fact, pos).
    """
    facts = list(facts)
    if not facts:
        raise InputError("`facts` must hold at least one fact; got an empty list.")
    noise_scale = check_float("noise_scale", noise_scale, low=0.0)
    batch_size = check_int("batch_size", batch_size, low=1)
    L = model.n_layers
    noises = _fact_noise(model, facts, noise_scale, seed)
    prompts = [fact_prompt(f, "trained") for f in facts]
    tok_ids = [model.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    T = max(len(t) for t in tok_ids)
    resid_map = np.full((len(facts), L, T), np.nan)
    mlp_map = np.zeros((len(facts), L))
    p_clean = np.zeros(len(facts))
    p_corrupt = np.zeros(len(facts))
    tokens = np.full((len(facts), T), "", dtype=object)
    ans = attribute_token_ids(model, facts[0].attributes)
    for fi, (f, ids, noise) in enumerate(zip(facts, tok_ids, noises)):
        n = len(ids)
        target = ans[f.attributes.index(f.attribute)]
        subj = subject_positions(model, f)
        resid, mlp = _clean_states(model, prompts[fi])
        restores: list[tuple[str, int, int | None]] = [("none", -1, None)]
        restores += [("mlp", x, None) for x in range(L)]
        if positions is True:
            pos = list(range(n))
        elif positions is False:
            pos = []
        else:
            pos = sorted({p + n if p < 0 else p for p in positions if -n <= p < n})
        restores += [("resid", x, p) for x in range(L) for p in pos]
        ids_t = torch.tensor(ids)
        probs = torch.cat([_corrupted_probs(model, ids_t, subj, noise, target,
                                            restores[r0:r0 + batch_size], resid, mlp)
                           for r0 in range(0, len(restores), batch_size)]).numpy()
        with torch.no_grad():
            lg = run_batch(model, model.tokenize([prompts[fi]]), save_positions=[-1])["logits"]
        p_clean[fi] = float(torch.softmax(lg[0, 0].float(), -1)[target])
        p_corrupt[fi] = probs[0]
        mlp_map[fi] = probs[1:L + 1]
        if pos:
            resid_map[fi][:, pos] = probs[L + 1:].reshape(L, len(pos))
        tokens[fi, :n] = model.token_strings(ids)
        if progress:
            progress(fi + 1, len(facts))
    ds = xr.Dataset(
        {"restore_resid": (("fact", "layer", "pos"), resid_map),
         "restore_mlp": (("fact", "layer"), mlp_map),
         "p_clean": ("fact", p_clean), "p_corrupt": ("fact", p_corrupt)},
        coords={"fact": np.arange(len(facts)), "layer": np.arange(L), "pos": np.arange(T),
                "subject": ("fact", [f.subject for f in facts]),
                "token": (("fact", "pos"), tokens.astype(str))},
        attrs=provenance(model, method="causal_trace", noise_scale=noise_scale, seed=seed,
                         noise_std=_noise_std(model)),
    )
    ds.attrs["citation"] = CITATION
    return ds


def attribution_patching(model: Model, facts: Sequence[AttributeFact], *,
                         noise_scale: float = 3.0, seed: int = 0,
                         progress: Progress = None) -> xr.Dataset:
    """Attribution patching of each MLP (Nanda 2023; Syed et al. 2023; used by Guo et al.).

    In the corrupted run (the same noise as `causal_trace` with the same seed) the score of
    MLP l is sum over positions of grad_{mlp_out l} p(answer) . (clean - corrupted mlp_out l),
    the first-order estimate of ``restore_mlp - p_corrupt``.

    Returns
    -------
    xr.Dataset
        ``ap_mlp`` (fact, layer).
    """
    facts = list(facts)
    if not facts:
        raise InputError("`facts` must hold at least one fact; got an empty list.")
    noise_scale = check_float("noise_scale", noise_scale, low=0.0)
    L = model.n_layers
    noises = _fact_noise(model, facts, noise_scale, seed)
    ans = attribute_token_ids(model, facts[0].attributes)
    scores = np.zeros((len(facts), L))
    for fi, (f, noise) in enumerate(zip(facts, noises)):
        prompt = fact_prompt(f, "trained")
        target = ans[f.attributes.index(f.attribute)]
        subj = torch.tensor(subject_positions(model, f))
        _, clean = _clean_states(model, prompt)
        ids = torch.tensor(model.tokenizer(prompt, add_special_tokens=False)["input_ids"])[None]
        with model.lock:
            scores[fi] = run_on_weights(model, _mlp_attribution, ids, subj, noise, target,
                                        clean).numpy()
        if progress:
            progress(fi + 1, len(facts))
    ds = xr.Dataset({"ap_mlp": (("fact", "layer"), scores)},
                    coords={"fact": np.arange(len(facts)), "layer": np.arange(L),
                            "subject": ("fact", [f.subject for f in facts])},
                    attrs=provenance(model, method="attribution_patching",
                                     noise_scale=noise_scale, seed=seed))
    ds.attrs["citation"] = CITATION
    return ds


def _mlp_attribution(model: Model, ids: torch.Tensor, subj: torch.Tensor, noise: torch.Tensor,
                     target: int, clean: list[torch.Tensor]) -> torch.Tensor:
    """[layer]: grad_{mlp_out l} p(target) . (clean - corrupted mlp_out l) in one corrupted
    forward and backward with torch hooks, where the weights are (`run_on_weights`)."""
    device = model.hf.device
    ids, noise, clean = ids.to(device), noise.to(device), [x.to(device) for x in clean]
    L = model.n_layers
    acts: list[torch.Tensor | None] = [None] * L
    handles = []

    def add_noise(_m, _inp, out):
        # a leaf that needs grad: the weights may have requires_grad off
        out = out.detach().clone().requires_grad_(True)
        noisy = out.clone()
        noisy[:, subj] += noise.to(out.dtype)
        return noisy

    def keep(layer):
        def hook(_m, _inp, out):
            acts[layer] = out[0] if isinstance(out, tuple) else out
        return hook

    handles.append(model.hf.get_input_embeddings().register_forward_hook(add_noise))
    handles += [_mlp_module(model, x).register_forward_hook(keep(x)) for x in range(L)]
    try:
        with torch.enable_grad():
            logits = model.hf(input_ids=ids).logits[0, -1].float()
            p = torch.softmax(logits, -1)[target]
            grads = torch.autograd.grad(p, acts)  # each [1, pos, d_model]
    finally:
        remove_hooks(handles)
    scores = torch.zeros(L, dtype=torch.float64)
    for x in range(L):
        delta = clean[x].float() - acts[x][0].detach().float()   # [pos, d_model]
        scores[x] = float((grads[x][0].float() * delta).sum())
    return scores


def top_layers(scores: Sequence[float], n_layers: int) -> list[int]:
    """The ``n_layers`` layers with the highest scores, in layer order."""
    scores = np.asarray(scores, dtype=float)
    n_layers = check_int("n_layers", n_layers, low=1, high=len(scores))
    return sorted(int(i) for i in np.argsort(-scores, kind="stable")[:n_layers])


def localized_layers(model: Model, method: str, n_layers: int, *, probe: xr.Dataset | None = None,
                     trace: xr.Dataset | None = None, attribution: xr.Dataset | None = None,
                     seed: int = 0) -> list[int]:
    """The MLP layers a localization method picks for a budget of ``n_layers`` MLPs.

    ``fact_lookup`` needs ``probe``, ``causal_tracing`` ``trace`` (mean restore_mlp over
    facts), ``attribution_patching`` ``attribution`` (mean ap_mlp); ``random`` draws
    seeded layers; ``all`` returns every layer (it trains every parameter).
    """
    check_choice("method", method, METHODS)
    L = model.n_layers
    n_layers = check_int("n_layers", n_layers, low=1, high=L)
    needs = {"fact_lookup": probe, "causal_tracing": trace, "attribution_patching": attribution}
    if method in needs and needs[method] is None:
        arg = {"fact_lookup": "probe", "causal_tracing": "trace",
               "attribution_patching": "attribution"}[method]
        raise InputError(f"method {method!r} needs the `{arg}` dataset.")
    if method == "fact_lookup":
        return fact_lookup_layers(probe, n_layers)
    if method == "causal_tracing":
        return top_layers(trace.restore_mlp.mean("fact").values, n_layers)
    if method == "attribution_patching":
        return top_layers(attribution.ap_mlp.mean("fact").values, n_layers)
    if method == "random":
        return sorted(random.Random(seed).sample(range(L), n_layers))
    return list(range(L))


# -- localized training ------------------------------------------------------------------

def component_parameters(model: Model, method: str, layers: Sequence[int]) -> list[str]:
    """Names of the parameters a localization trains: every weight of the chosen MLP
    layers (whole matrices), or every parameter of the model for ``all``."""
    check_choice("method", method, METHODS)
    if method == "all":
        return [n for n, _ in model.hf.named_parameters()]
    names = []
    for layer in layers:
        layer = model.check_layer(layer)
        mlp = _mlp_module(model, layer)
        ids = {id(p) for p in mlp.parameters()}
        names += [n for n, p in model.hf.named_parameters() if id(p) in ids]
    return names


def _answer_batch(model: Model, facts: Sequence[AttributeFact], targets: Sequence[str]):
    batch = model.tokenize([fact_prompt(f, "trained") for f in facts])
    ids = torch.tensor([model.tokenizer(" " + t, add_special_tokens=False)["input_ids"][0]
                        for t in targets])
    return batch, ids


def _edit_targets(facts: Sequence[AttributeFact]) -> list[str]:
    """The edit label of each fact: the next attribute of the relation (a fixed rotation)."""
    return [f.attributes[(f.attributes.index(f.attribute) + 1) % len(f.attributes)] for f in facts]


def localized_finetune(model: Model, forget: Sequence[AttributeFact],
                       retain: Sequence[AttributeFact], parameters: Sequence[str], *,
                       objective: str = "unlearn", steps: int = 8, lr: float = 2e-4,
                       retain_weight: float = 1.0, clip: float = 1.0,
                       hf: torch.nn.Module | None = None, progress: Progress = None,
                       should_stop: ShouldStop = None) -> tuple[torch.nn.Module, list[float]]:
    """Train a copy of the model on the forget facts, updating only ``parameters``.

    Loss per step (full batch) = L_forget + retain_weight * CE(retain answers), with
    L_forget = -log(1 - p(answer)) for ``unlearn`` (p among the relation's attributes, the
    quantity the accuracy reads) and CE toward the next attribute for ``edit`` (Guo et
    al., ICML 2025). AdamW, gradient clipping at ``clip``. The model's own
    weights are never touched: training runs on ``copy.deepcopy(model.hf)`` (or on ``hf``).

    A remote model trains on the server instead, where its weights cannot be copied: the
    updates of ``parameters`` are `explorer.lora.WeightDeltas` held in the jobs and added
    by hooks (the model computes as if each weight were W + dW), up to
    `explorer.lora.STEPS_PER_JOB` steps per job, the updates and AdamW's state carried
    between jobs. The same optimiser on dW from zero gives W + dW the steps AdamW gives W,
    up to float rounding. Only linear maps inside layers can be updated this way (the MLP
    localizations; not ``"all"``).

    Returns (trained module, loss per step); for a remote model (WeightDeltas, loss per
    step), which `format_accuracy`'s ``hf`` takes.
    """
    check_choice("objective", objective, OBJECTIVES)
    steps = check_int("steps", steps, low=1)
    lr = check_float("lr", lr, low=0.0)
    retain_weight = check_float("retain_weight", retain_weight, low=0.0)
    forget, retain = list(forget), list(retain)
    if not forget:
        raise InputError("`forget` must hold at least one fact; got an empty list.")
    names = set(parameters)
    if not names:
        raise InputError("`parameters` must name at least one parameter to train.")
    bad = sorted(names - {n for n, _ in (model.hf if hf is None else hf).named_parameters()})
    if bad:
        raise InputError(f"unknown parameter name {bad[0]!r}; names come from "
                         "`component_parameters`.")
    if hf is None and model.remote:
        return _finetune_by_deltas(model, forget, retain, sorted(names), objective=objective,
                                   steps=steps, lr=lr, retain_weight=retain_weight, clip=clip,
                                   progress=progress, should_stop=should_stop)
    if hf is None:
        with model.lock:
            hf = copy.deepcopy(model.hf)
    known = dict(hf.named_parameters())
    for n, p in known.items():
        p.requires_grad_(n in names)
    trainable = [known[n] for n in sorted(names)]
    opt = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    data = _training_batch(model, forget, retain, objective)
    losses = []
    hf.train(False)
    with torch.enable_grad():
        for step in range(steps):
            if should_stop is not None and should_stop():
                raise UnlearningCancelled(f"training stopped after {step} of {steps} steps.")
            logits = hf(**data["batch"].model_inputs()).logits[:, -1].float()  # [fact, vocab]
            loss = _unlearning_loss(logits, data, objective, retain_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, clip)
            opt.step()
            losses.append(float(loss.detach()))
            if progress:
                progress(step + 1, steps)
    for p in hf.parameters():
        p.requires_grad_(False)
    return hf, losses


def _training_batch(model: Model, forget: list[AttributeFact], retain: list[AttributeFact],
                    objective: str) -> dict[str, Any]:
    """What every training step scores: the forget and retain prompts in one batch
    ([forget..., retain...], trained format), each row's target token, the attributes'
    tokens and each forget fact's answer among them."""
    f_targets = [f.attribute for f in forget] if objective == "unlearn" else _edit_targets(forget)
    batch, ids = _answer_batch(model, forget + retain, f_targets + [f.attribute for f in retain])
    return {"batch": batch, "ids": ids,
            "cand": torch.tensor(attribute_token_ids(model, forget[0].attributes)),
            "f_pos": torch.tensor([f.attributes.index(f.attribute) for f in forget]),
            "nf": len(forget), "n_retain": len(retain)}


def _unlearning_loss(logits: torch.Tensor, data: dict[str, Any], objective: str,
                     retain_weight: float) -> torch.Tensor:
    """L_forget + retain_weight * CE(retain answers) from the last-position logits
    [fact, vocab] of `_training_batch`'s prompts (see `localized_finetune`)."""
    device = logits.device
    nf, ids = data["nf"], data["ids"].to(device)
    lp = torch.log_softmax(logits, -1)[torch.arange(len(ids), device=device), ids]  # [fact]
    if objective == "unlearn":
        # p(answer) among the attributes, the quantity the accuracy reads
        pc = torch.softmax(logits[:nf][:, data["cand"].to(device)], -1)[
            torch.arange(nf, device=device), data["f_pos"].to(device)]
        loss = -torch.log1p(-pc.clamp(max=1 - 1e-6)).mean()
    else:
        loss = -lp[:nf].mean()
    if data["n_retain"] and retain_weight > 0:
        loss = loss - retain_weight * lp[nf:].mean()
    return loss


def _finetune_by_deltas(model: Model, forget: list[AttributeFact], retain: list[AttributeFact],
                        names: list[str], *, objective: str, steps: int, lr: float,
                        retain_weight: float, clip: float, progress: Progress,
                        should_stop: ShouldStop) -> tuple[WeightDeltas, list[float]]:
    """`localized_finetune` with the updates held apart (`WeightDeltas`), in jobs where the
    weights are."""
    from explorer import lora as lora_jobs

    deltas = WeightDeltas.zeros(model, names)
    setup = {"data": _training_batch(model, forget, retain, objective), "objective": objective,
             "retain_weight": retain_weight, "clip": clip, "lr": lr}
    losses: list[float] = []
    opt_state = None
    done = 0
    while done < steps:
        if should_stop is not None and should_stop():
            raise UnlearningCancelled(f"training stopped after {done} of {steps} steps.")
        n = min(lora_jobs.STEPS_PER_JOB, steps - done)
        with model.lock:
            out = run_on_weights(model, _delta_steps, deltas, opt_state, setup, n)
        deltas = WeightDeltas(out["deltas"], deltas.transposed)
        opt_state = out["opt"]
        losses += out["loss"]
        done += n
        if progress:
            for k in range(done - n + 1, done + 1):
                progress(k, steps)
    return deltas, losses


def _delta_steps(weights: Model, deltas: WeightDeltas, opt_state: dict | None,
                 setup: dict[str, Any], n_steps: int) -> dict[str, Any]:
    """``n_steps`` steps of `localized_finetune`'s loss on hook-applied updates (one job).
    Gradients are taken with respect to the updates only: the served weights, shared by
    every request, are neither written nor given a ``.grad``."""
    device = weights.hf.device
    deltas = deltas.to(device).trainable()
    params = deltas.parameters()
    opt = adamw(params, setup["lr"], opt_state)
    data = setup["data"]
    batch = data["batch"].to(device)
    losses = []
    handles = deltas.hooks(weights)
    try:
        with torch.enable_grad():
            for _ in range(n_steps):
                logits = weights.hf(**batch.model_inputs()).logits[:, -1].float()
                loss = _unlearning_loss(logits, data, setup["objective"], setup["retain_weight"])
                adamw_step(loss, params, opt, clip=setup["clip"])
                losses.append(float(loss.detach()))
    finally:
        remove_hooks(handles)
    return {"deltas": {k: v.detach() for k, v in deltas.deltas.items()},
            "opt": opt.state_dict(), "loss": losses}


def relearn_halves(facts: Sequence[AttributeFact]) -> tuple[list[AttributeFact],
                                                          list[AttributeFact]]:
    """Split a forget set into the half a relearning attack trains on and the half it is
    judged on, stratified by attribute: facts of each attribute (in the order given) go
    to the two halves in turn, with one alternation running across attributes, so both
    halves hold the same mix of answers (within one fact per attribute). A training half
    with another mix would shift the answer prior and move the held-out answers for
    that reason alone."""
    learn: list[AttributeFact] = []
    heldout: list[AttributeFact] = []
    turn = 0
    for attr in dict.fromkeys(f.attribute for f in facts):
        for f in facts:
            if f.attribute == attr:
                (learn if turn % 2 == 0 else heldout).append(f)
                turn += 1
    return learn, heldout


def relearn(model: Model, hf: torch.nn.Module, facts: Sequence[AttributeFact], *, steps: int,
            lr: float, should_stop: ShouldStop = None,
            on_step: Callable[[int, torch.nn.Module], None] | None = None) -> list[float]:
    """Relearning attack: fine-tune every parameter of ``hf`` in place toward the true
    answers of ``facts`` (trained format, cross-entropy over the vocabulary as in
    training, full batch, AdamW without weight decay, gradient clipping at 1). ``on_step``
    is called after each step with (steps done, hf). Returns the loss per step."""
    steps = check_int("steps", steps, low=0)
    lr = check_float("lr", lr, low=0.0)
    facts = list(facts)
    for p in hf.parameters():
        p.requires_grad_(True)
    opt = torch.optim.AdamW(list(hf.parameters()), lr=lr, weight_decay=0.0)
    batch, ids = _answer_batch(model, facts, [f.attribute for f in facts])
    losses = []
    try:
        with torch.enable_grad():
            for step in range(steps):
                if should_stop is not None and should_stop():
                    raise UnlearningCancelled(f"relearning stopped after {step} of {steps} steps.")
                logp = torch.log_softmax(hf(**batch.model_inputs()).logits[:, -1].float(), -1)
                loss = -logp[torch.arange(len(facts)), ids].mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(list(hf.parameters()), 1.0)
                opt.step()
                losses.append(float(loss.detach()))
                if on_step is not None:
                    with torch.no_grad():
                        on_step(step + 1, hf)
    finally:
        for p in hf.parameters():
            p.requires_grad_(False)
    return losses


def _layer_label(method: str, layers: Sequence[int]) -> str:
    return "all" if method == "all" else ",".join(map(str, layers))


METRICS = ("forget", "forget_mc", "forget_mc_known", "retain", "retain_mc",
           "relearn_heldout_before", "relearn_heldout", "relearn_learned")


def unlearning_comparison(model: Model, forget: Sequence[AttributeFact],
                          retain: Sequence[AttributeFact], *, methods: Sequence[str] = METHODS,
                          n_layers: int = 4, objective: str = "unlearn", steps: int = 8,
                          lr: float = 2e-4, retain_weight: float = 1.0, relearn_steps: int = 3,
                          relearn_lr: float = 3e-5, probe: xr.Dataset | None = None,
                          trace: xr.Dataset | None = None, attribution: xr.Dataset | None = None,
                          seed: int = 0, original: bool = True, progress: Progress = None,
                          should_stop: ShouldStop = None) -> xr.Dataset:
    """Localize, train and evaluate each method with the same MLP budget (Guo et al., ICML 2025).

    For each method: the layers it picks (`localized_layers`; ``all`` trains every
    parameter), `localized_finetune` on a copy, then accuracy (top candidate among the
    attributes) on the forget set in the trained format (``forget``) and the
    multiple-choice format (``forget_mc``; ``forget_mc_known`` over only the forget facts
    the original model answers right in multiple choice, so the original row reads 1),
    on the retain set (``retain``, ``retain_mc``), and a relearning attack (`relearn`):
    every parameter is fine-tuned toward the true answers of one half of the forget set
    (`relearn_halves`, stratified by attribute) for ``relearn_steps``; accuracy on the
    other half is read before (``relearn_heldout_before``) and after
    (``relearn_heldout``), and on the trained half after (``relearn_learned``, whether
    the attack learned what it was shown). Row ``original`` is the model before any
    training; its relearn rows are the same attack on the original model, the control
    that the attack itself does not move held-out answers. ``original=False`` leaves that
    row out (to split one comparison over several calls).

    A remote model trains each method on the server with its updates held apart
    (`localized_finetune`); there ``relearn_steps`` must be 0 and ``"all"`` is refused,
    since both train every parameter and would need a second copy of the weights on the
    server. The relearn rows then read the same facts untouched by any attack.

    Returns
    -------
    xr.Dataset
        ``accuracy`` (localization, metric); ``loss`` (localization, step); ``n_params``,
        ``seconds_per_step`` (localization); coord ``trained_layers`` (localization), a string.
    """
    forget, retain = list(forget), list(retain)
    if len(forget) < 2:
        raise InputError(f"`forget` must hold at least 2 facts (half are relearned); got {len(forget)}.")
    methods = [check_choice("method", m, METHODS) for m in methods]
    if not methods:
        raise InputError(f"`methods` must name at least one of {', '.join(METHODS)}.")
    steps = check_int("steps", steps, low=1)
    relearn_steps = check_int("relearn_steps", relearn_steps, low=0)
    if model.remote:  # training runs on the server with updates held apart (WeightDeltas)
        if relearn_steps:
            raise InputError(
                "the relearning attack fine-tunes every parameter; on a remote (NDIF) model "
                "that needs a second copy of all the weights (and its optimiser state) on "
                "the server, so it does not run there: pass relearn_steps=0 (--relearn-steps 0).")
        if "all" in methods:
            raise InputError(
                "method 'all' trains every parameter; on a remote (NDIF) model that needs a "
                "second copy of all the weights on the server. The MLP localizations "
                f"({', '.join(m for m in METHODS if m != 'all')}) train there (--methods).")
    chosen = {m: localized_layers(model, m, n_layers, probe=probe, trace=trace,
                                  attribution=attribution, seed=seed) for m in methods}
    learn, heldout = relearn_halves(forget)
    mc_known = format_accuracy(model, forget, "mc")[0]
    rows = ["original", *methods] if original else list(methods)
    acc = np.full((len(rows), len(METRICS)), np.nan)
    loss = np.full((len(rows), steps), np.nan)
    n_params = np.zeros(len(rows), dtype=np.int64)
    per_step = np.full(len(rows), np.nan)
    total = len(methods) * (steps + relearn_steps) + (relearn_steps if original else 0)
    done = [0]

    def tick(k=1):
        done[0] += k
        if progress:
            progress(done[0], total)

    def evaluate(hf, i):
        col = {k: j for j, k in enumerate(METRICS)}
        acc[i, col["forget"]] = format_accuracy(model, forget, "trained", hf=hf)[0].mean()
        mc = format_accuracy(model, forget, "mc", hf=hf)[0]
        acc[i, col["forget_mc"]] = mc.mean()
        acc[i, col["forget_mc_known"]] = mc[mc_known].mean() if mc_known.any() else np.nan
        if retain:
            acc[i, col["retain"]] = format_accuracy(model, retain, "trained", hf=hf)[0].mean()
            acc[i, col["retain_mc"]] = format_accuracy(model, retain, "mc", hf=hf)[0].mean()
        acc[i, col["relearn_heldout_before"]] = format_accuracy(model, heldout, "trained", hf=hf)[0].mean()
        if relearn_steps:
            relearn(model, hf, learn, steps=relearn_steps, lr=relearn_lr, should_stop=should_stop)
            tick(relearn_steps)
        acc[i, col["relearn_heldout"]] = format_accuracy(model, heldout, "trained", hf=hf)[0].mean()
        acc[i, col["relearn_learned"]] = format_accuracy(model, learn, "trained", hf=hf)[0].mean()

    torch.manual_seed(seed)
    if original and model.remote:  # the served weights as they are (nothing to relearn)
        evaluate(None, 0)
    elif original:
        with model.lock:
            base = copy.deepcopy(model.hf)
        evaluate(base, 0)
        del base
    for i, m in enumerate(methods, start=1 if original else 0):
        names = component_parameters(model, m, chosen[m])
        n_params[i] = sum(p.numel() for n, p in model.hf.named_parameters() if n in set(names))
        t0 = time.perf_counter()
        hf, losses = localized_finetune(
            model, forget, retain, names, objective=objective, steps=steps, lr=lr,
            retain_weight=retain_weight, should_stop=should_stop,
            progress=lambda d, t: tick())
        per_step[i] = (time.perf_counter() - t0) / steps
        loss[i] = losses
        evaluate(hf, i)
        del hf
    ds = xr.Dataset(
        {"accuracy": (("localization", "metric"), acc), "loss": (("localization", "step"), loss),
         "n_params": ("localization", n_params), "seconds_per_step": ("localization", per_step)},
        coords={"localization": rows, "metric": list(METRICS), "step": np.arange(steps),
                "trained_layers": ("localization", ["-"] * original + [
                    _layer_label(m, chosen[m]) for m in methods])},
        attrs=provenance(model, method="unlearning_comparison", methods=methods,
                         n_layers=n_layers, objective=objective, steps=steps, lr=lr,
                         retain_weight=retain_weight, relearn_steps=relearn_steps,
                         relearn_lr=relearn_lr, seed=seed, original=original, n_forget=len(forget),
                         n_retain=len(retain),
                         forget=[f.subject for f in forget], retain=[f.subject for f in retain],
                         relearn_on=[f.subject for f in learn],
                         relearn_heldout=[f.subject for f in heldout]),
    )
    ds.attrs["citation"] = CITATION
    return ds
