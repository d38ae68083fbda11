"""The facts of mechanistic unlearning and how a model answers them: `AttributeFact` and the
shipped athlete -> sport file (`facts_path`, `load_attribute_facts`), the prompt of a fact in
the trained or the multiple-choice format (`fact_prompt`), the answer tokens and subject
positions, accuracy among the candidate answers (`format_accuracy`), the facts a model
knows (`known_facts`, cached per model weights) and the forget / retain split
(`split_facts`). Also the option lists (`FORMATS`, `METHODS`, `OBJECTIVES`), `CITATION` and
`UnlearningCancelled`.
"""
from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from explorer.defaults import DATASETS_DIR
from explorer._checks import ExplorerError, InputError, check_choice, check_int
from explorer.analyses._files import write_json_atomic
from explorer.lora import WeightDeltas, remove_hooks
from explorer.models import Model, cache_dir
from explorer.trace import run_on_weights, run_with

__all__ = [
    "FORMATS",
    "METHODS",
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
]


FORMATS = ("trained", "mc")
METHODS = ("fact_lookup", "causal_tracing", "attribution_patching", "causal_tracing_mlp",
           "attribution_patching_mlp", "random", "all")
OBJECTIVES = ("unlearn", "edit")
CITATION = ("Guo, Syed, Sheshadri, Ewart & Dziugaite, Mechanistic Unlearning: Robust "
            "Knowledge Unlearning and Editing via Mechanistic Localization, ICML 2025")

Progress = Callable[[int, int], None] | None
ShouldStop = Callable[[], bool] | None


class UnlearningCancelled(ExplorerError):
    """A training run was stopped by its ``should_stop`` callback."""


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
    return DATASETS_DIR / "unlearning" / "athlete_sport.json"


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
    weights are, with the updates hooked; only the candidates' logits come back).

    A tuple: two arrays over the same facts, read together.
    """
    facts = list(facts)
    if not facts:
        return np.zeros(0, bool), np.zeros(0)
    prompts = [fact_prompt(f, fmt) for f in facts]
    ids = attribute_token_ids(model, facts[0].attributes)
    target = np.array([f.attributes.index(f.attribute) for f in facts])
    with torch.no_grad():
        if hf is None:
            logits = torch.from_numpy(run_with(model, prompts, positions=[-1]).logits.values[:, 0])
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
        write_json_atomic(path, {"model": model.spec.name, "formats": formats, "kept": keep})
    return [facts[i] for i in keep]


def split_facts(facts: Sequence[AttributeFact], n_forget: int, n_retain: int, *,
                seed: int = 0) -> tuple[list[AttributeFact], list[AttributeFact]]:
    """A seeded random forget set and a disjoint retain set.

    A tuple: the two sides of one split, always used as a pair.
    """
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
