"""Knowledge conflicts: per-head context-vs-memory scores and the JuICE dual run.

Li, Chen & Tong, "Taming Knowledge Conflicts in Language Models" (JuICE, ICML 2025).
A fact is asked three ways: closed book (``clean``), after one sentence stating a false
value (``substitution``) and after a short passage supporting the false value
(``coherent``). The true value is the *memory* answer, the false one the *context* answer.

- `head_context_memory_scores`: each head's direct contribution to the memory and the
  context answer logit (its output through the linearised final norm and the unembedding)
  and its causal effect on their difference by zero ablation.
- `juice_head_selection`: score heads by additive scaling (``o_proj.out += alpha * h``)
  and keep the top K consistently helpful across the three prompt types.
- `juice_logits`: the dual run (run 1 caches the chosen heads' outputs; run 2 adds
  ``+alpha_l`` / ``-alpha_s`` times them); `single_run_logits` is the single-run baseline.
- `conflict_accuracy`: greedy answers over a split for baseline / single-run / JuICE.
"""
from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import xarray as xr

from explorer.defaults import DATASETS_DIR
from explorer._checks import InputError, check_choice, check_float, check_int
from explorer.interventions import Ablate, AddHead, Edit, Scale, position_index
from explorer.models import Batch, Model, cache_dir
from explorer.trace import (CleanRun, check_edits, clean_run, logit_attribution, provenance,
                             run_with)

__all__ = [
    "PROMPT_KINDS",
    "DIRECTIONS",
    "METHODS",
    "ENHANCE_ALPHAS",
    "SUPPRESS_ALPHAS",
    "Fact",
    "facts_path",
    "load_facts",
    "conflict_prompt",
    "normalise_answer",
    "answer_in",
    "greedy_answers",
    "closed_book_facts",
    "head_context_memory_scores",
    "juice_head_selection",
    "selected_heads",
    "JuiceFirstRun",
    "juice_first_run",
    "juice_logits",
    "single_run_logits",
    "juice_alpha_search",
    "answer_probabilities",
    "conflict_accuracy",
]

PROMPT_KINDS = ("clean", "substitution", "coherent")
DIRECTIONS = ("parametric", "context")
METHODS = ("baseline", "single", "juice")
ENHANCE_ALPHAS = (1.0, 3.0, 5.0, 10.0, 30.0)
SUPPRESS_ALPHAS = (-1.0, -2.0, -5.0)
CITATION = ("Li, Chen & Tong, Taming Knowledge Conflicts in Language Models "
            "(JuICE), ICML 2025")

Heads = Sequence[tuple[int, int]]
Progress = Callable[[int, int], None] | None


# -- data ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Fact:
    """One fact with its templates; ``context`` is the false value the context asserts."""

    relation: str
    subject: str
    memory: str
    context: str
    clean: str
    statement: str
    passage: str
    question: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def facts_path() -> Path:
    """The shipped fact file, ``datasets/conflicts/facts.json``."""
    return DATASETS_DIR / "conflicts" / "facts.json"


def load_facts(relations: Sequence[str] | None = None, *, path: str | Path | None = None) -> list[Fact]:
    """Facts of the given relations (all if None); the context value of fact i is the
    memory value of fact i+1 of the same relation (a fixed rotation)."""
    path = Path(path) if path is not None else facts_path()
    if not path.is_file():
        raise InputError(f"fact file {str(path)!r} does not exist.")
    data = json.loads(path.read_text())["relations"]
    names = list(data) if relations is None else list(relations)
    if not names:
        raise InputError("`relations` must name at least one relation; got an empty list.")
    out = []
    for name in names:
        check_choice("relation", name, data)
        rel = data[name]
        pairs = rel["facts"]
        for i, (subject, value) in enumerate(pairs):
            other = pairs[(i + 1) % len(pairs)][1]
            out.append(Fact(name, subject, value, other, rel["clean"], rel["statement"],
                            rel["passage"], rel["question"]))
    return out


def conflict_prompt(fact: Fact, kind: str) -> str:
    """The ``clean`` / ``substitution`` / ``coherent`` prompt of a fact."""
    check_choice("kind", kind, PROMPT_KINDS)
    clean = fact.clean.format(subject=fact.subject)
    if kind == "clean":
        return clean
    if kind == "substitution":
        return fact.statement.format(subject=fact.subject, value=fact.context) + " " + clean
    passage = fact.passage.format(subject=fact.subject, value=fact.context)
    return passage + "\n" + fact.question.format(subject=fact.subject)


def normalise_answer(text: str) -> str:
    """Lower case, accents and punctuation stripped, spaces collapsed (JuICE's metric)."""
    text = unicodedata.normalize("NFKD", text)
    text = "".join(c for c in text if not unicodedata.combining(c)).lower()
    text = re.sub(r"[^\w\s]", " ", text)
    return " ".join(text.split())


def answer_in(answer: str, generated: str, *, n_words: int = 5) -> bool:
    """Whether the normalised answer appears as whole words in the first ``n_words``."""
    words = normalise_answer(generated).split()[:n_words]
    target = normalise_answer(answer).split()
    return any(words[i:i + len(target)] == target for i in range(len(words) - len(target) + 1))


def _first_token(model: Model, answer: str) -> int:
    """Id of the first token of `` answer`` (the answer follows a space in every template)."""
    return model.tokenizer(" " + answer, add_special_tokens=False)["input_ids"][0]


# -- runs ---------------------------------------------------------------------------------

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
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"model": model.spec.name, "n_new": n_new, "kept": keep}))
        tmp.replace(path)
    return [facts[i] for i in keep]


# -- direct contributions and ablation ---------------------------------------------------

def head_context_memory_scores(model: Model, facts: Sequence[Fact], *,
                               kinds: Sequence[str] = PROMPT_KINDS, ablation: bool = True,
                               batch_size: int = 16, progress: Progress = None) -> xr.Dataset:
    """Each head's direct and causal effect on memory vs context answer (JuICE, ICML 2025).

    The final residual at the last position is the sum of the embedding, every head's
    output, the attention output biases and every MLP output. Each component goes through
    the final norm linearised at the actual run (its scale fixed to the run's value) and
    the unembedding; the memory minus context answer logit difference splits exactly
    into these terms (plus the norm bias). ``ablation`` also zero-ablates each head in
    turn and records the change in the actual logit difference.

    Parameters
    ----------
    model : Model
    facts : sequence of Fact
    kinds : subset of {"clean", "substitution", "coherent"}
    ablation : bool, default=True
    batch_size : int, default=16
    progress : callable(done, total), optional

    Returns
    -------
    xr.Dataset
        ``direct_memory``, ``direct_context``, ``direct_diff`` (kind, fact, layer, head);
        ``embed_diff``, ``norm_bias_diff``, ``logit_diff`` (kind, fact); ``mlp_diff``,
        ``attn_bias_diff`` (kind, fact, layer); ``ablation_effect`` (kind, fact, layer,
        head): logit difference after ablation minus before; ``memory_score`` and
        ``context_score`` (layer, head): the mean positive part of ``direct_diff`` and of
        its negative. Heads high on both push memory on some prompts and context on
        others (the superposition heads of the paper).

    References
    ----------
    Li, Chen & Tong, "Taming Knowledge Conflicts in Language Models", ICML 2025.
    """
    facts = list(facts)
    if not facts:
        raise InputError("`facts` must hold at least one fact; got an empty list.")
    kinds = [check_choice("kind", k, PROMPT_KINDS) for k in kinds]
    batch_size = check_int("batch_size", batch_size, low=1)
    spec = model.spec
    L, H = spec.n_layers, spec.n_heads
    n = len(facts)
    mem_ids = torch.tensor([_first_token(model, f.memory) for f in facts])
    ctx_ids = torch.tensor([_first_token(model, f.context) for f in facts])
    shape = (len(kinds), n)
    direct = np.zeros((*shape, 2, L, H))
    embed = np.zeros((*shape,))
    nbias = np.zeros(shape)
    logit = np.zeros(shape)
    mlp = np.zeros((*shape, L))
    abias = np.zeros((*shape, L))
    effect = np.full((*shape, L, H), np.nan)
    total = len(kinds) * n * ((L * H) if ablation else 1)
    done = 0

    def mem_minus_ctx(t: torch.Tensor) -> np.ndarray:
        """[prompt, 2, ...] terms (memory, context) -> memory minus context."""
        return (t[:, 0] - t[:, 1]).numpy()

    for ki, kind in enumerate(kinds):
        for b0 in range(0, n, batch_size):
            sl = slice(b0, min(b0 + batch_size, n))
            batch = model.tokenize([conflict_prompt(f, kind) for f in facts[sl]])
            # the split is computed inside the trace (only these scalars leave a remote run)
            ids = torch.stack([mem_ids[sl], ctx_ids[sl]], 1)             # [prompt, 2]
            read = logit_attribution(model, batch, ids)                   # at the last token
            dla = {part: torch.from_numpy(read[part].values[:, 0]) for part in
                   ("embed", "heads", "attn_bias", "mlp", "norm_bias")}   # drop the pos dim
            embed[ki, sl] = mem_minus_ctx(dla["embed"])
            direct[ki, sl] = dla["heads"].permute(0, 3, 1, 2).numpy()     # [prompt, 2, L, H]
            abias[ki, sl] = mem_minus_ctx(dla["attn_bias"].transpose(1, 2))
            mlp[ki, sl] = mem_minus_ctx(dla["mlp"].transpose(1, 2))
            nbias[ki, sl] = mem_minus_ctx(dla["norm_bias"])
            idx = torch.arange(len(ids))
            base = read.logit.values[:, 0, 0] - read.logit.values[:, 0, 1]   # memory - context
            logit[ki, sl] = base
            if ablation:
                for layer in range(L):
                    for head in range(H):
                        lg2 = torch.from_numpy(run_with(
                            model, batch, [Ablate(layer, head)], positions=[-1]
                        ).logits.values[:, 0]).double()
                        effect[ki, sl, layer, head] = (
                            lg2[idx, mem_ids[sl]] - lg2[idx, ctx_ids[sl]]).numpy() - base
                        done += sl.stop - sl.start
                        if progress:
                            progress(done, total)
            else:
                done += sl.stop - sl.start
                if progress:
                    progress(done, total)
    diff = direct[:, :, 0] - direct[:, :, 1]
    dims4 = ("kind", "fact", "layer", "head")
    ds = xr.Dataset(
        {
            "direct_memory": (dims4, direct[:, :, 0]),
            "direct_context": (dims4, direct[:, :, 1]),
            "direct_diff": (dims4, diff),
            "embed_diff": (("kind", "fact"), embed),
            "norm_bias_diff": (("kind", "fact"), nbias),
            "logit_diff": (("kind", "fact"), logit),
            "mlp_diff": (("kind", "fact", "layer"), mlp),
            "attn_bias_diff": (("kind", "fact", "layer"), abias),
            "ablation_effect": (dims4, effect),
            "memory_score": (("layer", "head"), np.clip(diff, 0, None).mean((0, 1))),
            "context_score": (("layer", "head"), np.clip(-diff, 0, None).mean((0, 1))),
        },
        coords={"kind": list(kinds), "fact": np.arange(n), "layer": np.arange(L),
                "head": np.arange(H),
                "subject": ("fact", [f.subject for f in facts]),
                "relation": ("fact", [f.relation for f in facts]),
                "memory_answer": ("fact", [f.memory for f in facts]),
                "context_answer": ("fact", [f.context for f in facts])},
        attrs=provenance(model, method="head_context_memory_scores", kinds=list(kinds),
                         ablation=ablation, n_facts=n),
    )
    ds.attrs["citation"] = CITATION
    return ds


# -- JuICE head selection -----------------------------------------------------------------

def juice_head_selection(model: Model, facts: Sequence[Fact], *, direction: str = "parametric",
                         k: int = 5, enhance_alphas: Sequence[float] = ENHANCE_ALPHAS,
                         suppress_alphas: Sequence[float] = SUPPRESS_ALPHAS,
                         layers: Sequence[int] | None = None, prune: bool = False,
                         progress: Progress = None) -> xr.Dataset:
    """JuICE head scoring by additive scaling on a few examples (Li et al., ICML 2025).

    For each head and prompt type c, Delta+_c is the mean over ``enhance_alphas`` and facts
    of p(target | o_proj.out += alpha * h) - p(target), with p the probability of the
    target answer's first token (the memory answer for ``direction="parametric"``, the
    context answer for ``"context"``); Delta-_c likewise over ``suppress_alphas``. Heads
    with Delta_c > 0 for every c are ranked by the sum over c; the top ``k`` form S+ / S-.

    Each head takes one run per prompt type: the facts are repeated once per alpha in the
    batch and the run resumes from the clean residual at the head's layer, where adding
    ``alpha`` times the clean head output equals scaling the head by ``1 + alpha``.
    ``prune=True`` scores the prompt types in order (clean, substitution, coherent:
    shortest first) and drops a head from the later ones once it has failed the
    consistency test for both S+ and S-; the chosen heads are the same, the skipped
    entries hold NaN.

    Returns
    -------
    xr.Dataset
        ``delta_plus``, ``delta_minus`` (kind, layer, head); ``consistent_plus``,
        ``consistent_minus`` (layer, head) bool; ``plus_layer``, ``plus_head`` (rank) and
        ``minus_layer``, ``minus_head`` (rank): the chosen heads, -1 where fewer qualify.
        Layers not scored (and heads pruned) hold NaN.
    """
    facts = list(facts)
    if not facts:
        raise InputError("`facts` must hold at least one fact; got an empty list.")
    check_choice("direction", direction, DIRECTIONS)
    k = check_int("k", k, low=1, high=model.n_layers * model.spec.n_heads)
    enhance = [check_float("enhance_alphas[]", a) for a in enhance_alphas]
    suppress = [check_float("suppress_alphas[]", a) for a in suppress_alphas]
    if not enhance or not suppress:
        raise InputError("`enhance_alphas` and `suppress_alphas` must each hold at least one value.")
    layers = list(range(model.n_layers)) if layers is None else [model.check_layer(x) for x in layers]
    L, H, d = model.n_layers, model.spec.n_heads, model.spec.d_head
    n = len(facts)
    alphas = enhance + suppress
    n_a = len(alphas)
    target = [_first_token(model, f.memory if direction == "parametric" else f.context)
              for f in facts]
    tgt = torch.tensor(target * n_a)
    idx = torch.arange(n * n_a)
    delta = np.full((2, len(PROMPT_KINDS), L, H), np.nan)
    todo = [(layer, head) for layer in layers for head in range(H)]
    total = len(PROMPT_KINDS) * len(todo)
    done = 0
    for ki, kind in enumerate(PROMPT_KINDS):
        run1 = juice_first_run(model, [conflict_prompt(f, kind) for f in facts])
        p0 = torch.softmax(run1.logits, -1)[torch.arange(n), torch.tensor(target)]  # [fact]
        ids = run1.batch.token_ids
        big = model.batch_from_ids(ids * n_a)                      # alpha-major: [alpha*fact]
        clean = CleanRun(big, [r.repeat(n_a, 1, 1) for r in run1.clean.resid_pre],
                         run1.clean.logits[:0])
        rows, cols = position_index(big.lengths, big.width, None)
        scale = torch.tensor(alphas).repeat_interleave(n)[rows]   # [n_tokens]
        for layer, head in todo:
            z = run1.attn_z[layer].repeat(n_a, 1, 1)[rows, cols, head * d:(head + 1) * d]
            edit = AddHead(layer, head, (scale[:, None] * z).reshape(-1), alpha=1.0)
            lg = _last_logits(model, big, [edit], resume=clean)
            p = torch.softmax(lg, -1)[idx, tgt].reshape(n_a, n)
            gain = (p - p0[None]).mean(1).double()                 # [alpha]
            delta[0, ki, layer, head] = float(gain[:len(enhance)].mean())
            delta[1, ki, layer, head] = float(gain[len(enhance):].mean())
            done += 1
            if progress:
                progress(done, total)
        if prune:
            seen = np.nan_to_num(delta[:, :ki + 1], nan=-1.0) > 0   # [set, kind, layer, head]
            alive = seen.all(1).any(0)                               # [layer, head]
            kept = [(x, h) for x, h in todo if alive[x, h]]
            done += len(todo) - len(kept)
            todo = kept
    chosen = []
    consistent = []
    for si in range(2):
        dd = delta[si]                                        # [kind, layer, head]
        ok = np.all(np.nan_to_num(dd, nan=-1.0) > 0, axis=0)  # [layer, head]
        score = np.where(ok, np.nan_to_num(dd).sum(0), -np.inf)
        order = [int(i) for i in np.argsort(-score, axis=None, kind="stable") if ok.flat[i]][:k]
        heads = [divmod(i, H) for i in order] + [(-1, -1)] * (k - len(order))
        chosen.append(np.array(heads, dtype=int))
        consistent.append(ok)
    ds = xr.Dataset(
        {
            "delta_plus": (("kind", "layer", "head"), delta[0]),
            "delta_minus": (("kind", "layer", "head"), delta[1]),
            "consistent_plus": (("layer", "head"), consistent[0]),
            "consistent_minus": (("layer", "head"), consistent[1]),
            "plus_layer": ("rank", chosen[0][:, 0]),
            "plus_head": ("rank", chosen[0][:, 1]),
            "minus_layer": ("rank", chosen[1][:, 0]),
            "minus_head": ("rank", chosen[1][:, 1]),
        },
        coords={"kind": list(PROMPT_KINDS), "layer": np.arange(L), "head": np.arange(H),
                "rank": np.arange(k)},
        attrs=provenance(model, method="juice_head_selection", direction=direction, k=k,
                         enhance_alphas=enhance, suppress_alphas=suppress, layers=layers,
                         prune=prune, n_facts=n),
    )
    ds.attrs["citation"] = CITATION
    return ds


def selected_heads(selection: xr.Dataset) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(S+, S-) as lists of (layer, head) from a `juice_head_selection` Dataset."""
    out = []
    for s in ("plus", "minus"):
        pairs = zip(selection[f"{s}_layer"].values.tolist(), selection[f"{s}_head"].values.tolist())
        out.append([(int(a), int(b)) for a, b in pairs if a >= 0])
    return out[0], out[1]


def juice_alpha_search(model: Model, facts: Sequence[Fact], heads_plus: Heads = (),
                       heads_minus: Heads = (), *, direction: str = "parametric",
                       alpha_s_grid: Sequence[float] = (0.0, 1.0, 2.0, 3.0),
                       alpha_l_grid: Sequence[float] = (0.0, 1.0, 2.0, 3.0, 4.0, 5.0),
                       kinds: Sequence[str] = ("substitution", "coherent"),
                       method: str = "juice", progress: Progress = None) -> xr.Dataset:
    """Pick alpha_s and alpha_l on held-out facts, as JuICE does on its validation split.

    For every (alpha_s, alpha_l) of the grid (the paper's: alpha_s in 0..3, alpha_l in
    0..5) the intervention (``method`` "juice": the dual run, or "single") runs on every
    fact and prompt type; ``accuracy`` is the share whose top next token is the first
    token of the target answer (memory for ``direction="parametric"``, context for
    ``"context"``) and ``target_prob`` its mean probability. The best pair maximises
    accuracy, then probability (attrs ``best_alpha_s``, ``best_alpha_l``). Run 1 is
    computed once per prompt type; every grid point resumes from it.

    Returns
    -------
    xr.Dataset
        ``accuracy``, ``target_prob`` (alpha_s, alpha_l).
    """
    facts = list(facts)
    if not facts:
        raise InputError("`facts` must hold at least one fact; got an empty list.")
    check_choice("direction", direction, DIRECTIONS)
    check_choice("method", method, ("juice", "single"))
    kinds = [check_choice("kind", x, PROMPT_KINDS) for x in kinds]
    if not kinds:
        raise InputError("`kinds` must name at least one prompt type.")
    grid_s = [check_float("alpha_s_grid[]", x) for x in alpha_s_grid]
    grid_l = [check_float("alpha_l_grid[]", x) for x in alpha_l_grid]
    if not grid_s or not grid_l:
        raise InputError("`alpha_s_grid` and `alpha_l_grid` must each hold at least one value.")
    plus = _check_heads(model, heads_plus, "heads_plus")
    minus = _check_heads(model, heads_minus, "heads_minus")
    run = juice_logits if method == "juice" else single_run_logits
    tgt = torch.tensor([_first_token(model, f.memory if direction == "parametric" else f.context)
                        for f in facts])
    idx = torch.arange(len(facts))
    acc = np.zeros((len(grid_s), len(grid_l)))
    prob = np.zeros_like(acc)
    total, done = len(kinds) * acc.size, 0
    for kind in kinds:
        run1 = juice_first_run(model, [conflict_prompt(f, kind) for f in facts])
        for i, a_s in enumerate(grid_s):
            for j, a_l in enumerate(grid_l):
                lg = run(model, None, plus, minus, alpha_l=a_l, alpha_s=a_s, run1=run1)
                acc[i, j] += float((lg.argmax(-1) == tgt).float().mean()) / len(kinds)
                prob[i, j] += float(torch.softmax(lg, -1)[idx, tgt].mean()) / len(kinds)
                done += 1
                if progress:
                    progress(done, total)
    best = max(((acc[i, j], prob[i, j], -i - j, i, j) for i in range(len(grid_s))
                for j in range(len(grid_l))))
    ds = xr.Dataset({"accuracy": (("alpha_s", "alpha_l"), acc),
                     "target_prob": (("alpha_s", "alpha_l"), prob)},
                    coords={"alpha_s": grid_s, "alpha_l": grid_l},
                    attrs=provenance(model, method="juice_alpha_search", direction=direction,
                                     intervention=method, heads_plus=plus, heads_minus=minus,
                                     kinds=kinds, n_facts=len(facts)))
    ds.attrs["best_alpha_s"] = grid_s[best[3]]
    ds.attrs["best_alpha_l"] = grid_l[best[4]]
    ds.attrs["citation"] = CITATION
    return ds


# -- accuracy over a split ----------------------------------------------------------------

def conflict_accuracy(model: Model, facts: Sequence[Fact], heads_plus: Heads = (),
                      heads_minus: Heads = (), *, alpha_l: float = 1.0, alpha_s: float = 1.0,
                      kinds: Sequence[str] = ("substitution", "coherent"),
                      methods: Sequence[str] = METHODS, n_new: int = 5, batch_size: int = 8,
                      progress: Progress = None) -> xr.Dataset:
    """Greedy answers for baseline / single-run scaling / JuICE dual run over a split.

    Returns
    -------
    xr.Dataset
        ``to_memory``, ``to_context`` (intervention, kind, fact) bool: the normalised
        memory / context answer is in the first five generated words; ``memory_accuracy``,
        ``context_accuracy`` (intervention, kind) their means; ``answer`` (intervention,
        kind, fact) the generated text. ``intervention`` holds the ``methods`` asked for.
    """
    facts = list(facts)
    if not facts:
        raise InputError("`facts` must hold at least one fact; got an empty list.")
    kinds = [check_choice("kind", x, PROMPT_KINDS) for x in kinds]
    methods = [check_choice("method", x, METHODS) for x in methods]
    batch_size = check_int("batch_size", batch_size, low=1)
    plus = _check_heads(model, heads_plus, "heads_plus")
    minus = _check_heads(model, heads_minus, "heads_minus")
    steps = {
        "baseline": lambda ps: _last_logits(model, ps),
        "single": lambda ps: single_run_logits(model, ps, plus, minus, alpha_l=alpha_l, alpha_s=alpha_s),
        "juice": lambda ps: juice_logits(model, ps, plus, minus, alpha_l=alpha_l, alpha_s=alpha_s),
    }
    shape = (len(methods), len(kinds), len(facts))
    answers = np.empty(shape, dtype=object)
    total = int(np.prod(shape))
    done = 0
    for mi, m in enumerate(methods):
        for ki, kind in enumerate(kinds):
            for b0 in range(0, len(facts), batch_size):
                chunk = facts[b0:b0 + batch_size]
                got = greedy_answers(model, [conflict_prompt(f, kind) for f in chunk],
                                     n_new=n_new, step=steps[m])
                answers[mi, ki, b0:b0 + len(chunk)] = got
                done += len(chunk)
                if progress:
                    progress(done, total)
    to_mem = np.vectorize(lambda a, f: answer_in(f.memory, a), otypes=[bool])(
        answers, np.array(facts, dtype=object)[None, None])
    to_ctx = np.vectorize(lambda a, f: answer_in(f.context, a), otypes=[bool])(
        answers, np.array(facts, dtype=object)[None, None])
    dims = ("intervention", "kind", "fact")
    ds = xr.Dataset(
        {"to_memory": (dims, to_mem), "to_context": (dims, to_ctx),
         "memory_accuracy": (dims[:2], to_mem.mean(-1)),
         "context_accuracy": (dims[:2], to_ctx.mean(-1)),
         "answer": (dims, answers.astype(str))},
        coords={"intervention": methods, "kind": kinds, "fact": np.arange(len(facts)),
                "subject": ("fact", [f.subject for f in facts])},
        attrs=provenance(model, method="conflict_accuracy", heads_plus=plus, heads_minus=minus,
                         alpha_l=alpha_l, alpha_s=alpha_s, n_new=n_new),
    )
    ds.attrs["citation"] = CITATION
    return ds
