"""The runs: last-position logits under head edits, the JuICE dual run and the single-run
baseline, greedy answers, and the facts a model answers closed book (cached)."""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from explorer._checks import InputError, check_float, check_int
from explorer.analyses._files import write_json_atomic
from explorer.analyses.conflicts.facts import (Fact, Heads, Progress, _first_token, answer_in,
                                               conflict_prompt, load_facts)
from explorer.interventions import AddHead, Edit, Scale, position_index
from explorer.models import Batch, Model, cache_dir
from explorer.trace import CleanRun, check_edits, clean_run, run_with

__all__ = [
    'JuiceFirstRun', 'juice_first_run', 'juice_logits', 'single_run_logits',
    'answer_probabilities', 'greedy_answers', 'closed_book_facts',
]


def _check_heads(model: Model, heads: Heads, name: str) -> list[tuple[int, int]]:
    out = []
    for i, h in enumerate(heads):
        if not isinstance(h, (tuple, list)) or len(h) != 2:
            raise InputError(f"`{name}[{i}]` must be a (layer, head) pair; got {h!r}.")
        out.append((model.check_layer(h[0], f"{name}[{i}] layer"),
                    model.check_head(h[1], f"{name}[{i}] head")))
    return out


def _as_batch(model: Model, prompts: Sequence[str] | Batch) -> Batch:
    return prompts if isinstance(prompts, Batch) else model.tokenize(list(prompts))


def _last_logits(model: Model, prompts: Sequence[str] | Batch, edits: Sequence[Edit] = (),
                 resume: CleanRun | None = None) -> torch.Tensor:
    batch = _as_batch(model, prompts) if resume is None else resume.batch
    # only the last position is unembedded
    logits = run_with(model, batch, edits, positions=[-1], resume=resume).logits.values
    return torch.from_numpy(logits[:, 0])  # [prompt, vocab]


@dataclass
class JuiceFirstRun:
    """Run 1 of the dual run, kept so run 2 can be repeated for new heads or alphas.

    ``clean`` holds every layer's residual (for resuming at the first edited layer),
    ``attn_z`` every layer's head outputs before ``o_proj`` [prompt, pos, head*d_head]
    and ``logits`` the last position's logits [prompt, vocab]. Run 1 does not depend on
    the heads or the alphas, so a view computes it once per example. ``edits``: the
    interventions run 1 was made under (none: the model as it is); run 2 applies them too.
    """

    clean: CleanRun
    attn_z: list[torch.Tensor]
    logits: torch.Tensor
    edits: tuple[Edit, ...] = ()

    @property
    def batch(self) -> Batch:
        return self.clean.batch


def juice_first_run(model: Model, prompts: Sequence[str] | Batch, *,
                    edits: Sequence[Edit] = ()) -> JuiceFirstRun:
    """Run 1 of the JuICE dual run: a forward keeping every layer's residual and head
    outputs (`JuiceFirstRun`); ``edits`` (intervention records, e.g. a workspace's ablated
    head) run the edited model instead of the clean one, and run 2 keeps them."""
    edits = tuple(check_edits(edits))
    batch = _as_batch(model, prompts)
    clean = clean_run(model, batch, edits=edits, keep=("attn_z",))
    return JuiceFirstRun(clean, clean.kept["attn_z"], clean.logits[:, -1].float(), edits)


def _first_run_for(model: Model, prompts: Sequence[str] | Batch | None,
                   run1: JuiceFirstRun | None, edits: Sequence[Edit] = ()) -> JuiceFirstRun:
    if run1 is None:
        if prompts is None:
            raise InputError("pass `prompts` or `run1`.")
        return juice_first_run(model, prompts, edits=edits)
    if edits and tuple(edits) != tuple(run1.edits):
        raise InputError("`edits` differ from those `run1` was computed with; pass them to "
                         "`juice_first_run` (run 2 applies run 1's edits).")
    if prompts is not None:
        batch = _as_batch(model, prompts)
        ids = run1.batch.input_ids
        if ids.shape != batch.input_ids.shape or not torch.equal(ids, batch.input_ids):
            raise InputError("`run1` was computed for different prompts than `prompts`.")
    return run1


def juice_logits(model: Model, prompts: Sequence[str] | Batch | None, heads_plus: Heads = (),
                 heads_minus: Heads = (), *, alpha_l: float = 1.0, alpha_s: float = 1.0,
                 run1: JuiceFirstRun | None = None, edits: Sequence[Edit] = ()) -> torch.Tensor:
    """Last-position logits [prompt, vocab] of the JuICE dual run (Li et al., ICML 2025).

    Run 1 is a clean forward that caches the heads' ``attn_z`` at every position (pass
    ``run1=juice_first_run(...)`` to reuse it); run 2 adds ``+alpha_l`` times the cache
    for ``heads_plus`` and ``-alpha_s`` times it for ``heads_minus`` (an `AddHead` edit:
    exactly that multiple of run 1's head output, added before ``o_proj``). Run 2 resumes
    from run 1's residual at the first edited layer and keeps only the last position.
    ``edits`` (or those of ``run1``) apply in both runs: the dual run on the edited model.
    """
    alpha_l = check_float("alpha_l", alpha_l)
    alpha_s = check_float("alpha_s", alpha_s)
    plus = _check_heads(model, heads_plus, "heads_plus")
    minus = _check_heads(model, heads_minus, "heads_minus")
    edits = check_edits(edits)
    if run1 is None and not plus + minus:
        return _last_logits(model, prompts, edits)
    run1 = _first_run_for(model, prompts, run1, edits)
    if not plus + minus:
        return run1.logits.clone()
    batch = run1.batch
    rows, cols = position_index(batch.lengths, batch.width, None)
    d = model.spec.d_head
    run2: list[Edit] = list(run1.edits)
    for group, alpha in ((plus, alpha_l), (minus, -alpha_s)):
        for layer, head in group:
            z = run1.attn_z[layer][rows, cols, head * d:(head + 1) * d]  # [n_tokens, d_head]
            run2.append(AddHead(layer, head, z.reshape(-1), alpha=alpha))
    return _last_logits(model, batch, run2, resume=run1.clean)


def single_run_logits(model: Model, prompts: Sequence[str] | Batch | None, heads_plus: Heads = (),
                      heads_minus: Heads = (), *, alpha_l: float = 1.0, alpha_s: float = 1.0,
                      run1: JuiceFirstRun | None = None, edits: Sequence[Edit] = ()) -> torch.Tensor:
    """Last-position logits of the single-run baseline (JuNE): each chosen head's output is
    scaled in place by ``1 + alpha_l`` (plus) or ``1 - alpha_s`` (minus). With ``run1``
    the run resumes from its residual at the first edited layer. ``edits`` (or those of
    ``run1``) apply before the scaling: the baseline on the edited model."""
    alpha_l = check_float("alpha_l", alpha_l)
    alpha_s = check_float("alpha_s", alpha_s)
    scales = [Scale(l, h, 1.0 + alpha_l) for l, h in _check_heads(model, heads_plus, "heads_plus")]
    scales += [Scale(l, h, 1.0 - alpha_s) for l, h in _check_heads(model, heads_minus, "heads_minus")]
    edits = check_edits(edits)
    if run1 is None:
        return _last_logits(model, prompts, [*edits, *scales])
    run1 = _first_run_for(model, prompts, run1, edits)
    if not scales:
        return run1.logits.clone()
    return _last_logits(model, run1.batch, [*run1.edits, *scales], resume=run1.clean)


def answer_probabilities(model: Model, logits: torch.Tensor, facts: Sequence[Fact]) -> np.ndarray:
    """[prompt, 2] probabilities of the first token of the memory and the context answer."""
    probs = torch.softmax(logits.float(), -1)
    mem = [_first_token(model, f.memory) for f in facts]
    ctx = [_first_token(model, f.context) for f in facts]
    idx = torch.arange(len(facts))
    return torch.stack([probs[idx, mem], probs[idx, ctx]], -1).numpy()


def greedy_answers(model: Model, prompts: Sequence[str], *, n_new: int = 5,
                   step: Callable[[Batch], torch.Tensor] | None = None) -> list[str]:
    """Greedy continuations of ``n_new`` tokens (on token ids, no re-tokenisation);
    ``step(batch) -> [prompt, vocab]`` gives the next-token logits (default a plain run),
    so a dual run decodes token by token as in the paper."""
    n_new = check_int("n_new", n_new, low=1)
    ids = model.tokenize(list(prompts)).token_ids
    gen: list[list[int]] = [[] for _ in ids]
    for _ in range(n_new):
        batch = model.batch_from_ids([p + g for p, g in zip(ids, gen)])
        logits = step(batch) if step is not None else _last_logits(model, batch)
        for g, t in zip(gen, logits.argmax(-1).tolist()):
            g.append(t)
    return [model.tokenizer.decode(g) for g in gen]


def _cache_file(model: Model, facts: Sequence[Fact], n_new: int) -> Path:
    key = hashlib.sha256(json.dumps([f.to_dict() for f in facts]).encode()).hexdigest()[:16]
    spec = model.spec
    wh = hashlib.sha256(f"{spec.name}|{spec.weights}".encode()).hexdigest()[:16]
    return cache_dir() / "conflicts" / f"closed_book-{wh}-{key}-n{n_new}.json"


def closed_book_facts(model: Model, facts: Sequence[Fact] | None = None, *, n_new: int = 5,
                      batch_size: int = 16, cache: bool = True, progress: Progress = None,
                      ) -> list[Fact]:
    """The facts the model answers correctly closed book (greedy, answer in the first
    5 words), cached as JSON per model weights and fact list under ``cache_dir()``."""
    facts = load_facts() if facts is None else list(facts)
    if not facts:
        raise InputError("`facts` must hold at least one fact; got an empty list.")
    batch_size = check_int("batch_size", batch_size, low=1)
    path = _cache_file(model, facts, n_new)
    if cache and path.is_file():
        keep = json.loads(path.read_text())["kept"]
        return [facts[i] for i in keep]
    keep = []
    for b0 in range(0, len(facts), batch_size):
        chunk = facts[b0:b0 + batch_size]
        answers = greedy_answers(model, [conflict_prompt(f, "clean") for f in chunk], n_new=n_new)
        keep += [b0 + i for i, (f, a) in enumerate(zip(chunk, answers)) if answer_in(f.memory, a)]
        if progress:
            progress(min(b0 + batch_size, len(facts)), len(facts))
    if cache:
        write_json_atomic(path, {"model": model.spec.name, "n_new": n_new, "kept": keep})
    return [facts[i] for i in keep]
