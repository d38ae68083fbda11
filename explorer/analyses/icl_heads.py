"""In-context learning heads: induction heads vs function-vector (FV) heads.

Yin & Steinhardt, "Which Attention Heads Matter for In-Context Learning?" (ICML 2025), with
the FV score of Todd et al., "Function Vectors in Large Language Models" (ICLR 2024):

- `induction_scores`: attention to the token after the previous occurrence on repeated
  random-token sequences.
- `fv_scores`: causal indirect effect of writing a head's task-mean output at the last token
  into shuffled-label few-shot prompts, averaged over tasks.
- `ablation_curves`: few-shot accuracy and token-loss difference when the top p% heads by
  each score (optionally excluding the other score's top heads, or random heads) are
  mean-ablated.

Every function returns an ``xr.Dataset`` whose attrs come from `explorer.trace.provenance`.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xarray as xr

from explorer.defaults import DATASETS_DIR
from explorer._checks import InputError, check_choice, check_float, check_int, check_local_weights
from explorer.interventions import Ablate
from explorer.models import Model
from explorer.trace import (
    KeyValuePrefix,
    Readouts,
    clean_run,
    key_value_prefix,
    provenance,
    run_batch,
    run_with,
    runs_over_prefix,
    trace,
)

__all__ = [
    "ICL_DIR",
    "ICLTask",
    "icl_task_names",
    "load_icl_task",
    "icl_prompts",
    "answer_token_ids",
    "induction_pattern",
    "induction_score_from_patterns",
    "induction_scores",
    "head_attention",
    "task_mean_z",
    "fv_patched_probs",
    "last_token_problem",
    "LAST_TOKEN_FAMILIES",
    "last_token_cache",
    "fv_last_token_probs",
    "fv_scores",
    "top_heads",
    "ranked_head_sets",
    "check_head_scores",
    "check_rankings",
    "ablation_edits",
    "corpus_token_ids",
    "few_shot_accuracy",
    "token_loss_difference",
    "ablation_curves",
    "MEAN_SOURCES",
    "ABLATION_METHODS",
    "cross_task_mean_z",
    "ablated_last_token",
    "chance_accuracy",
    "task_screen",
]

CITATION = ("K. Yin, J. Steinhardt, \"Which Attention Heads Matter for In-Context Learning?\", "
            "ICML 2025; E. Todd et al., \"Function Vectors in Large Language Models\", ICLR 2024.")

#: The shipped ICL tasks (see datasets/README.md).
ICL_DIR = DATASETS_DIR / "icl"
_CORPUS_DIR = DATASETS_DIR / "corpus"

RANKINGS = ("fv", "induction", "fv_excl_induction", "induction_excl_fv", "random")
FV_METHODS = ("auto", "last_token", "resume")


# -- tasks and prompts ---------------------------------------------------------------------

@dataclass(frozen=True)
class ICLTask:
    """One ICL task: a name and its (input, output) pairs."""

    name: str
    pairs: tuple[tuple[str, str], ...]
    description: str = ""


def icl_task_names(folder: str | Path | None = None) -> list[str]:
    """Names of the tasks in ``folder`` (default the shipped `ICL_DIR`), sorted."""
    folder = Path(folder) if folder is not None else ICL_DIR
    return sorted(p.stem for p in folder.glob("*.json"))


def load_icl_task(name: str, folder: str | Path | None = None) -> ICLTask:
    """Load one task file ``<folder>/<name>.json``; unknown names raise InputError."""
    folder = Path(folder) if folder is not None else ICL_DIR
    check_choice("task", name, icl_task_names(folder))
    data = json.loads((folder / f"{name}.json").read_text(encoding="utf-8"))
    pairs = tuple((str(p["input"]), str(p["output"])) for p in data["pairs"])
    return ICLTask(name, pairs, data.get("description", ""))


def _task(t: ICLTask | str) -> ICLTask:
    return t if isinstance(t, ICLTask) else load_icl_task(t)


def icl_prompts(task: ICLTask | str, *, n_prompts: int = 8, n_shots: int = 5, seed: int = 0,
                shuffle_labels: bool = False) -> tuple[list[str], list[str]]:
    """Few-shot prompts ``"Q: x\\nA: y\\n\\n" * n_shots + "Q: x_q\\nA:"`` and their answers.

    ``shuffle_labels`` permutes the demonstrations' outputs among themselves (the corrupted
    prompts of Todd et al.); the query and its answer are unchanged. ``n_shots=0`` gives
    zero-shot prompts.
    """
    task = _task(task)
    n_prompts = check_int("n_prompts", n_prompts, low=1)
    n_shots = check_int("n_shots", n_shots, low=0, high=len(task.pairs) - 1)
    rng = np.random.default_rng(seed)
    picks = [rng.choice(len(task.pairs), size=n_shots + 1, replace=False) for _ in range(n_prompts)]
    rng = np.random.default_rng([seed, 1])  # the label shuffle: same demos with or without
    prompts, answers = [], []
    for idx in picks:
        demos = [task.pairs[i] for i in idx[:-1]]
        if shuffle_labels and n_shots > 1:
            outs = [y for _, y in demos]
            perm = rng.permutation(n_shots)
            while np.all(perm == np.arange(n_shots)):
                perm = rng.permutation(n_shots)
            demos = [(x, outs[j]) for (x, _), j in zip(demos, perm)]
        q, a = task.pairs[idx[-1]]
        prompts.append("".join(f"Q: {x}\nA: {y}\n\n" for x, y in demos) + f"Q: {q}\nA:")
        answers.append(a)
    return prompts, answers


def answer_token_ids(model: Model, answers: Sequence[str]) -> list[int]:
    """The first token of ``" " + answer`` for each answer (the token scored after ``A:``)."""
    return [model.tokenizer(" " + a, add_special_tokens=False)["input_ids"][0] for a in answers]


def last_token_probs(model: Model, batch: Any, edits=(), resume=None) -> torch.Tensor:
    """Next-token probabilities at each prompt's last token: [prompt, vocab]."""
    logits = run_with(model, batch, edits, positions=[-1], resume=resume).logits
    return torch.softmax(torch.from_numpy(logits.values[:, -1]), dim=-1)


# -- induction score -----------------------------------------------------------------------

def induction_pattern(ids: np.ndarray) -> np.ndarray:
    """P[i, j] = 1 iff token[j-1] == token[i] and 1 <= j <= i (the induction target)."""
    ids = np.asarray(ids)
    n = len(ids)
    p = np.zeros((n, n))
    for i in range(n):
        for j in range(1, i + 1):
            if ids[j - 1] == ids[i]:
                p[i, j] = 1.0
    return p


def induction_score_from_patterns(patterns: np.ndarray, ids: np.ndarray,
                                  measure: str = "abs") -> np.ndarray:
    """Induction score per head from attention weights.

    Parameters
    ----------
    patterns : array [sequence, layer, head, dst, src]
    ids : array [sequence, pos]
    measure : {"abs", "mul"}, default="abs"
        ``mul``: sum(A * P) / sum(A), the attention mass on induction targets.
        ``abs``: 1 - (1/n) sum_i ||A_i - P_i||_1 (TransformerLens ``detect_head``,
        ``error_measure="abs"``, as used by Yin & Steinhardt).

    Returns
    -------
    array [layer, head], averaged over sequences.
    """
    check_choice("measure", measure, ("mul", "abs"))
    scores = []
    for a, row in zip(patterns, ids):
        p = induction_pattern(row)                   # [dst, src]
        a = np.nan_to_num(a.astype(np.float64))      # [layer, head, dst, src]
        if measure == "mul":
            s = (a * p).sum((-2, -1)) / a.sum((-2, -1))
        else:
            s = 1.0 - np.abs(a - p).sum(-1).mean(-1)
        scores.append(s)
    return np.mean(scores, axis=0)


def _random_repeat_ids(model: Model, n_sequences: int, half_len: int, seed: int) -> np.ndarray:
    """[BOS?, r_1..r_n, r_1..r_n] with r_i uniform over the non-special vocabulary."""
    special = set(model.tokenizer.all_special_ids)
    allowed = np.array([i for i in range(model.spec.vocab_size) if i not in special])
    rng = np.random.default_rng(seed)
    r = rng.choice(allowed, size=(n_sequences, half_len))
    ids = np.concatenate([r, r], axis=1)
    bos = model.tokenizer.bos_token_id
    if bos is not None:
        ids = np.concatenate([np.full((n_sequences, 1), bos), ids], axis=1)
    return ids


def induction_scores(model: Model, *, n_sequences: int = 16, half_len: int = 50, seed: int = 42,
                     measure: str = "abs", batch_size: int = 8, edits=()) -> xr.Dataset:
    """Induction score of every head on repeated random-token sequences.

    Yin & Steinhardt (ICML 2025) score heads with TransformerLens ``detect_head`` on
    ``[BOS, r_1..r_50, r_1..r_50]`` with ``error_measure="abs"``; those are the defaults here
    (``half_len=50``, ``measure="abs"``, seed 42). The paper averages 1,000 sequences; the default
    16 is a CPU-sized sample (``n_sequences=1000`` is the paper's; the patterns are read one
    batch at a time, so memory does not grow with it). ``measure="mul"`` is the attention
    mass on the induction target (see `induction_score_from_patterns`).
    ``edits`` (intervention records) apply to every run: the scores of the edited model.

    Returns
    -------
    xr.Dataset with ``induction_score`` (layer, head) and ``sequence_ids`` (sequence, pos).
    """
    n_sequences = check_int("n_sequences", n_sequences, low=1)
    half_len = check_int("half_len", half_len, low=2)
    batch_size = check_int("batch_size", batch_size, low=1)
    check_choice("measure", measure, ("mul", "abs"))
    ids = _random_repeat_ids(model, n_sequences, half_len, seed)
    layers = range(model.spec.n_layers)
    parts = []
    for start in range(0, n_sequences, batch_size):     # one batch's patterns at a time
        chunk = ids[start:start + batch_size]
        patterns = trace(model, chunk.tolist(), sites="attn_pattern", edits=edits,
                         batch_size=batch_size, progress=False).attn_pattern.values
        parts.append(induction_score_from_patterns(patterns, chunk, measure) * len(chunk))
    score = np.sum(parts, axis=0) / n_sequences
    return xr.Dataset(
        {"induction_score": (("layer", "head"), score),
         "sequence_ids": (("sequence", "pos"), ids)},
        coords={"layer": list(layers), "head": list(range(model.spec.n_heads))},
        attrs=provenance(model, method="induction_scores", n_sequences=n_sequences,
                         half_len=half_len, seed=seed, measure=measure, edits=list(edits),
                         citation=CITATION))


def head_attention(model: Model, layer: int, head: int, *, task: ICLTask | str = "antonym",
                   half_len: int = 10, n_shots: int = 3, seed: int = 42,
                   edits=()) -> dict[str, xr.Dataset]:
    """One head's attention on a repeated random-token sequence and on an ICL prompt.

    Returns ``{"repeat": ds, "icl": ds}``, each with ``attention`` (dst_pos, src_pos) and
    ``token`` (pos) coordinates, for the view's query x key heatmaps.
    """
    layer, head = model.check_layer(layer), model.check_head(head)
    repeat = _random_repeat_ids(model, 1, half_len, seed)[0].tolist()
    prompt, _ = icl_prompts(task, n_prompts=1, n_shots=n_shots, seed=seed)
    icl = model.tokenizer(prompt[0], add_special_tokens=False)["input_ids"]
    out = {}
    for name, ids in (("repeat", repeat), ("icl", icl)):
        read = trace(model, [ids], sites="attn_pattern", layers=[layer], edits=edits)
        att = read.attn_pattern.values[0, 0, head]                    # [dst, src]
        tokens = list(read.token.values[0])
        out[name] = xr.Dataset(
            {"attention": (("dst_pos", "src_pos"), att)},
            coords={"dst_pos": range(len(ids)), "src_pos": range(len(ids)),
                    "token": ("pos", tokens), "pos": range(len(ids))},
            attrs=provenance(model, method="head_attention", layer=layer, head=head,
                             example=name, seed=seed, edits=list(edits)))
    return out


# -- FV score ------------------------------------------------------------------------------

def task_mean_z(model: Model, prompts: Sequence[str], edits=()) -> np.ndarray:
    """Mean over prompts of every head's output (the ``attn_z`` slice) at the last token
    (of the model under ``edits``, if any).

    Returns an array [layer, head, d_head] (the ā of Todd et al.).
    """
    z = trace(model, list(prompts), sites="attn_z", positions=[-1], edits=edits,
              batch_size=len(prompts), progress=False).attn_z.values   # [prompt, 1, layer, head, d_head]
    return z[:, 0].mean(0)


def heads_of_layers(model: Model, layers: Sequence[int] | None) -> list[tuple[int, int]]:
    """Every ``(layer, head)`` of ``layers`` (all layers when ``None``), layer-major."""
    layers = range(model.spec.n_layers) if layers is None else [model.check_layer(l) for l in layers]
    return [(l, h) for l in layers for h in range(model.spec.n_heads)]


def head_chunks(heads: Sequence[tuple[int, int]], size: int) -> list[list[tuple[int, int]]]:
    """Heads (layer-major) in chunks of at most ``size``, whole layers together where they fit.

    A chunk's trace resumes at its lowest layer, so chunks of whole neighbouring layers
    waste the least; a layer with more than ``size`` heads is split.
    """
    by_layer: dict[int, list[tuple[int, int]]] = {}
    for layer, head in heads:
        by_layer.setdefault(layer, []).append((layer, head))
    chunks: list[list[tuple[int, int]]] = []
    current: list[tuple[int, int]] = []
    for group in by_layer.values():
        if current and len(current) + len(group) > size:
            chunks.append(current)
            current = []
        while len(group) > size:
            chunks.append(group[:size])
            group = group[size:]
        current = current + group
    if current:
        chunks.append(current)
    return chunks


def fv_patched_probs(model: Model, cache: Any, heads: Sequence[tuple[int, int]],
                     mean_z: np.ndarray, target: torch.Tensor) -> torch.Tensor:
    """Answer-token probability with each head's last-token output set to its mean: [head, prompt].

    One trace for all ``heads``: the batch of ``cache`` (a `CleanRun`) is repeated once per
    head (`CleanRun.repeat`), head j's ``Ablate`` acts on the j-th copy only (its
    ``prompts``), and the run resumes at the lowest layer among the heads. ``mean_z`` is
    [layer, head, d_head]; ``target`` holds one token id per prompt.
    """
    n, k = len(cache.batch.lengths), len(heads)
    big = cache.repeat(k) if k > 1 else cache
    edits = [Ablate(layer, head, mode="mean", value=mean_z[layer, head], positions=(-1,),
                    prompts=tuple(range(j * n, (j + 1) * n)) if k > 1 else None)
             for j, (layer, head) in enumerate(heads)]
    p = last_token_probs(model, big.batch, edits, resume=big)          # [head * prompt, vocab]
    return p[torch.arange(k * n), target.repeat(k)].reshape(k, n)


# The last-token path: only the last position changes when a head is patched there (earlier
# positions cannot attend to it), so the patched runs process that one token, attending over
# the keys and values of the earlier positions computed once per task.

LAST_TOKEN_FAMILIES = ("llama", "gpt2", "gpt_neox", "gemma2")
"""Model families whose cached last-token run equals the full forward (tested on each, with
sliding attention windows narrower than the prompts: Gemma 2, Mistral, Qwen2)."""


def last_token_problem(model: Model) -> str | None:
    """Why `last_token_cache` cannot serve ``model`` (None when it can).

    The last-token path runs the trace over a key/value prefix (`explorer.trace.
    KeyValuePrefix`; a remote model's runs of a task are one session on the server,
    `explorer.trace.runs_over_prefix`). The families checked to give the full forward's
    logits are `LAST_TOKEN_FAMILIES` (Llama, Qwen2/3, Mistral; GPT-2; GPT-NeoX / Pythia;
    Gemma 2, whose family entry Gemma 3 shares untested), sliding-window layers included:
    the prefix keeps the model's own cache layers, whose count of the tokens seen places
    the window.
    """
    if model.arch.family not in LAST_TOKEN_FAMILIES:
        return (f"the last-token path handles the {', '.join(LAST_TOKEN_FAMILIES)} families; "
                f"{model.spec.name} is {model.arch.family}")
    return None


def last_token_cache(model: Model, batch: Any) -> KeyValuePrefix:
    """Run ``batch`` without its last column once, keeping every layer's keys and values
    (`explorer.trace.key_value_prefix`), for the last-token runs of this model family."""
    problem = last_token_problem(model)
    if problem:
        raise InputError(f"fv_scores(method='last_token') cannot run: {problem}.")
    check_local_weights(model, "the last-token cache (fv_scores runs it on the server)")
    if batch.width < 2:
        raise InputError("the last-token path needs prompts of at least 2 tokens.")
    return key_value_prefix(model, batch)


def _last_token_edits(by_layer: dict[int, list[tuple[int, int]]], mean_z: Any, n: int,
                      k: int) -> list[Ablate]:
    """In copy j of ``k`` (rows j*n to (j+1)*n), head ``head`` of ``layer`` (each ``(j,
    head)`` of ``by_layer[layer]``) set to ``mean_z[layer, head]`` at the last token."""
    return [Ablate(layer, head, mode="mean", value=np.asarray(mean_z[layer, head]),
                   positions=(-1,), prompts=tuple(range(j * n, (j + 1) * n)) if k > 1 else None)
            for layer in sorted(by_layer) for j, head in by_layer[layer]]


def fv_last_token_probs(model: Model, prefix: KeyValuePrefix, heads: Sequence[tuple[int, int]],
                        mean_z: np.ndarray | None, target: torch.Tensor) -> torch.Tensor:
    """Answer-token probability with each head's last-token output set to its mean: [head, prompt].

    Same result as `fv_patched_probs`, computing only the last token: one trace over ``k``
    copies of the prompts runs the last column over the cached keys and values of the
    earlier positions (``prefix.repeat(k)``), with head j's slice of the ``o_proj`` input
    set to ``mean_z[layer, head]`` in copy j (an ``Ablate`` record on copy j's rows). With
    no ``heads`` (and ``mean_z`` None) it returns the unpatched probabilities, [1, prompt].
    """
    check_local_weights(model, "the last-token run (fv_scores runs it on the server)")
    n = len(prefix.batch.lengths)
    k, edits = _chunk_edits(heads, mean_z, n)
    big = prefix.repeat(k)
    out = run_batch(model, big.batch, edits=edits, prefix=big,
                    readouts=_answer_readout(target, k))
    return out["prob"].reshape(k, n)


def _chunk_edits(heads: Sequence[tuple[int, int]], mean_z: Any, n: int
                 ) -> tuple[int, list[Ablate]]:
    """(copies, edits) of a chunk of ``heads``: head j set to its mean in copy j (one
    unedited copy when there are none)."""
    by_layer: dict[int, list[tuple[int, int]]] = {}
    for j, (layer, head) in enumerate(heads):
        by_layer.setdefault(layer, []).append((j, head))
    k = max(1, len(heads))
    return k, _last_token_edits(by_layer, mean_z, n, k)


def _answer_readout(target: torch.Tensor, k: int) -> Readouts:
    """The probability of each prompt's ``target`` token at the last position, in ``k``
    copies of the prompts, and nothing else (no logits cross the network)."""
    return Readouts(save_positions=[-1], logits=False, prob_ids=target.repeat(k))


def _last_token_logits(model: Model, prefix: KeyValuePrefix,
                       by_layer: dict[int, list[tuple[int, int]]], mean_z: Any,
                       k: int) -> torch.Tensor:
    """Logits of the batch's last token run in ``k`` copies over the cached keys and values
    of the earlier positions, with `_last_token_edits`: [k * prompt, vocab], copy-major."""
    big = prefix.repeat(k)
    edits = _last_token_edits(by_layer, mean_z, len(prefix.batch.lengths), k)
    out = run_batch(model, big.batch, edits=edits, prefix=big,
                    readouts=Readouts(save_positions=[-1]))
    return out["logits"][:, -1].float()


def ablated_last_token(model: Model, prefix: KeyValuePrefix,
                       head_sets: Sequence[Sequence[tuple[int, int]]], mean_z: np.ndarray,
                       target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean ablation at the last token, one copy of the prompts per head set.

    Copy j runs the batch's last token over the cached keys and values of the earlier
    positions (`last_token_cache`) with every head ``(layer, head)`` of ``head_sets[j]``
    writing ``mean_z[layer, head]`` into its slice of the ``o_proj`` input (``Ablate``
    records on copy j's rows): the ablation of Yin & Steinhardt, which replaces the heads'
    output at the last token only, so no earlier position changes. An empty set is the
    unablated run.

    Returns
    -------
    (correct, prob): [set, prompt] tensors: whether the argmax next token is ``target``,
    and the probability of ``target``.
    """
    check_local_weights(model, "the last-token ablation")
    n, k = len(prefix.batch.lengths), len(head_sets)
    if k == 0:
        raise InputError("`head_sets` must hold at least one set of heads.")
    by_layer: dict[int, list[tuple[int, int]]] = {}
    for j, heads in enumerate(head_sets):
        for layer, head in heads:
            by_layer.setdefault(int(layer), []).append((j, int(head)))

    logits = _last_token_logits(model, prefix, by_layer, mean_z, k)     # [set * prompt, vocab]
    rows = torch.arange(k * n, device=logits.device)
    tgt = target.to(logits.device).repeat(k)
    prob = torch.softmax(logits, dim=-1)[rows, tgt].reshape(k, n)
    correct = (logits.argmax(-1) == tgt).reshape(k, n)
    return correct.cpu(), prob.cpu()


def _remote_last_token_probs(model: Model, prompts: list[str],
                             chunks: list[list[tuple[int, int]]], mean_z: np.ndarray,
                             target: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A remote model's last-token runs of one task, in one session on the server
    (`explorer.trace.runs_over_prefix`): the unpatched probabilities [prompt] and, per chunk
    of heads, the patched ones [head, prompt]."""
    n = len(prompts)
    runs = [(k, edits, _answer_readout(target, k)) for k, edits in
            [(1, [])] + [_chunk_edits(chunk, mean_z, n) for chunk in chunks]]
    outs = runs_over_prefix(model, model.tokenize(prompts), runs)
    probs = [out["prob"].reshape(k, n) for (k, _, _), out in zip(runs, outs)]
    return probs[0][0], probs[1:]


def fv_scores(model: Model, tasks: Sequence[ICLTask | str], *, n_prompts: int = 8,
              n_shots: int = 5, seed: int = 0, layers: Sequence[int] | None = None,
              progress: Any = None, max_rows: int = 256, method: str = "auto") -> xr.Dataset:
    """Function-vector score of every head: the causal indirect effect (Todd et al. 2024).

    For each task, ā_{l,h} is the head's mean output at the last token over clean
    ``n_shots``-shot prompts. The same prompts with shuffled demonstration labels are run
    with head (l, h)'s last-token output replaced by ā_{l,h}; the indirect effect is the
    gain in the probability of the answer's first token. The FV score is its mean over tasks.

    Heads are patched in batches (`fv_patched_probs`): one trace scores a chunk of heads
    by repeating the corrupted prompts once per head (at most ``max_rows`` rows, whole
    neighbouring layers together) and patching head j in the j-th copy only, resuming at
    the chunk's lowest layer from a cached clean run of the corrupted prompts. Each copy is
    computed exactly as a run with only its head patched. ``progress(done, total)`` is
    called after each chunk, counting head-task pairs.

    ``method``: ``"last_token"`` runs only the last token of each patched copy
    (`fv_last_token_probs`), over keys and values of the earlier positions computed once
    per task (`last_token_cache`): the patch is at the last token, which no earlier
    position sees. ``"resume"`` recomputes every position from the chunk's lowest layer
    (`fv_patched_probs`). ``"auto"`` (default) is ``"last_token"`` where
    `last_token_problem` finds none, else ``"resume"``; an explicit ``"last_token"`` on a
    model it cannot serve raises InputError. ``attrs["params"]["fv_method"]`` records the
    one used.

    Returns
    -------
    xr.Dataset: ``fv_score`` (layer, head), ``indirect_effect`` (task, layer, head),
    ``mean_z`` (task, layer, head, d_head), ``corrupted_prob``/``clean_prob`` (task).
    """
    tasks = [_task(t) for t in tasks]
    if not tasks:
        raise InputError("`tasks` must name at least one task; got an empty list.")
    max_rows = check_int("max_rows", max_rows, low=1)
    method = check_choice("method", method, FV_METHODS)
    if method == "auto":
        method = "resume" if last_token_problem(model) else "last_token"
    spec = model.spec
    heads = heads_of_layers(model, layers)
    ie = np.full((len(tasks), spec.n_layers, spec.n_heads), np.nan)
    mean_z = np.zeros((len(tasks), spec.n_layers, spec.n_heads, spec.d_head))
    p_clean, p_corr = np.zeros(len(tasks)), np.zeros(len(tasks))
    total, done = len(tasks) * len(heads), 0
    for t, task in enumerate(tasks):
        clean, answers = icl_prompts(task, n_prompts=n_prompts, n_shots=n_shots, seed=seed)
        corrupted, _ = icl_prompts(task, n_prompts=n_prompts, n_shots=n_shots, seed=seed,
                                   shuffle_labels=True)
        target = torch.tensor(answer_token_ids(model, answers))
        rows = torch.arange(len(target))
        mean_z[t] = task_mean_z(model, clean)
        p_clean[t] = float(last_token_probs(model, model.tokenize(clean))[rows, target].mean())
        chunks = list(head_chunks(heads, max(1, max_rows // len(target))))
        remote_p = None
        if method == "last_token" and model.remote:  # the task's runs as one NDIF session
            base, remote_p = _remote_last_token_probs(model, corrupted, chunks, mean_z[t],
                                                      target)
        elif method == "last_token":
            prefix = last_token_cache(model, model.tokenize(corrupted))
            base = fv_last_token_probs(model, prefix, [], None, target)[0]     # [prompt]
        else:
            cache = clean_run(model, corrupted)
            base = torch.softmax(cache.logits[:, -1].float(), -1)[rows, target]
        p_corr[t] = float(base.mean())
        for i, chunk in enumerate(chunks):
            if remote_p is not None:
                p = remote_p[i]
            elif method == "last_token":
                p = fv_last_token_probs(model, prefix, chunk, mean_z[t], target)
            else:
                p = fv_patched_probs(model, cache, chunk, mean_z[t], target)  # [head, prompt]
            gain = (p - base).mean(1)
            for (layer, head), g in zip(chunk, gain.tolist()):
                ie[t, layer, head] = g
            done += len(chunk)
            if callable(progress):
                progress(done, total)
    return xr.Dataset(
        {"fv_score": (("layer", "head"), ie.mean(0)),
         "indirect_effect": (("task", "layer", "head"), ie),
         "mean_z": (("task", "layer", "head", "d_head"), mean_z),
         "clean_prob": (("task",), p_clean),
         "corrupted_prob": (("task",), p_corr)},
        coords={"task": [t.name for t in tasks], "layer": list(range(spec.n_layers)),
                "head": list(range(spec.n_heads))},
        attrs=provenance(model, method="fv_scores", n_prompts=n_prompts, n_shots=n_shots,
                         seed=seed, layers=None if layers is None else list(layers),
                         fv_method=method, citation=CITATION))


# -- which tasks the model does ---------------------------------------------------------------

def chance_accuracy(task: ICLTask | str) -> float:
    """The first-token accuracy of guessing without reading the demonstrations.

    Where every answer is one of the query's comma-separated items (choose-first-of-3,
    animal-v-object-3), a uniform pick among the items: 1 / items. Otherwise the best
    constant answer: the share of the task's pairs whose answer is its most common one.
    """
    task = _task(task)
    items = [[w.strip() for w in x.split(",")] for x, _ in task.pairs]
    if all(len(i) > 1 and y.strip() in i for i, (_, y) in zip(items, task.pairs)):
        return float(np.mean([1.0 / len(i) for i in items]))
    outputs = [y for _, y in task.pairs]
    return max(outputs.count(y) for y in set(outputs)) / len(outputs)


def _wilson(k: float, n: int, level: float) -> tuple[float, float]:
    """Wilson score interval of a proportion k / n."""
    from scipy.stats import norm

    z = float(norm.ppf(0.5 + level / 2))
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return float(max(0.0, centre - half)), float(min(1.0, centre + half))


def task_screen(model: Model, tasks: Sequence[ICLTask | str] | None = None, *,
                n_prompts: int = 32, n_shots: int = 5, seed: int = 100,
                confidence_level: float = 0.95, edits=()) -> xr.Dataset:
    """Few-shot first-token accuracy of each task against its chance level.

    A task is ``above_chance`` when the lower end of the Wilson interval of its accuracy
    over ``n_prompts`` prompts exceeds `chance_accuracy`. Use a ``seed`` other than the
    evaluation's, so that the tasks are picked on other prompts than they are scored on.

    Returns
    -------
    xr.Dataset over ``task``: ``accuracy``, ``accuracy_low`` / ``accuracy_high`` (Wilson),
    ``chance``, ``above_chance`` (bool).
    """
    tasks = [_task(t) for t in (icl_task_names() if tasks is None else tasks)]
    if not tasks:
        raise InputError("`tasks` must name at least one task; got an empty list.")
    n_prompts = check_int("n_prompts", n_prompts, low=1)
    level = check_float("confidence_level", confidence_level, low=0.5, high=0.999)
    acc, low, high, chance = [], [], [], []
    for task in tasks:
        prompts, answers = icl_prompts(task, n_prompts=n_prompts, n_shots=n_shots, seed=seed)
        hits, _ = _correct_and_answer_prob(model, prompts, answers, edits)
        lo, hi = _wilson(float(hits.sum()), n_prompts, level)
        acc.append(float(hits.mean()))
        low.append(lo)
        high.append(hi)
        chance.append(chance_accuracy(task))
    return xr.Dataset(
        {"accuracy": (("task",), acc), "accuracy_low": (("task",), low),
         "accuracy_high": (("task",), high), "chance": (("task",), chance),
         "above_chance": (("task",), np.array(low) > np.array(chance))},
        coords={"task": [t.name for t in tasks]},
        attrs=provenance(model, method="task_screen", n_prompts=n_prompts, n_shots=n_shots,
                         seed=seed, confidence_level=level, edits=list(edits),
                         citation=CITATION))


# -- ablations -----------------------------------------------------------------------------

def top_heads(score: np.ndarray, fraction: float, *,
              exclude: Sequence[tuple[int, int]] = ()) -> list[tuple[int, int]]:
    """The top ``fraction`` of all heads by ``score`` [layer, head], skipping ``exclude``.

    The count is ``round(fraction * n_heads)`` (at least one when ``fraction > 0``), as a
    fraction of *all* heads; ties are broken by (layer, head) order.
    """
    fraction = check_float("fraction", fraction, low=0.0, high=1.0)
    score = np.asarray(score, dtype=float)
    n = score.size
    k = 0 if fraction == 0 else max(1, int(round(fraction * n)))
    if k == 0:
        return []
    excluded = set(map(tuple, exclude))
    order = np.argsort(-np.nan_to_num(score, nan=-np.inf).ravel(), kind="stable")
    picked = []
    for flat in order:
        lh = tuple(int(v) for v in np.unravel_index(flat, score.shape))
        if lh not in excluded:
            picked.append(lh)
        if len(picked) == k:
            break
    return picked


def check_head_scores(model: Model, induction: Any, fv: Any) -> tuple[np.ndarray, np.ndarray]:
    """The induction and FV scores as float arrays, both [layer, head] of ``model``."""
    induction, fv = np.asarray(induction, float), np.asarray(fv, float)
    shape = (model.spec.n_layers, model.spec.n_heads)
    if induction.shape != shape or fv.shape != induction.shape:
        raise InputError(f"scores must be [layer, head] = {shape}; "
                         f"got {induction.shape} and {fv.shape}.")
    return induction, fv


def check_rankings(rankings: Any) -> list[str]:
    """A non-empty list of `RANKINGS` names (a bare string is refused)."""
    if isinstance(rankings, str) or not rankings:
        raise InputError(f"`rankings` must be a non-empty list of {list(RANKINGS)}; "
                         f"got {rankings!r}.")
    return [check_choice("ranking", r, RANKINGS) for r in rankings]


def ranked_head_sets(induction: np.ndarray, fv: np.ndarray, percents: Sequence[float], *,
                     rankings: Sequence[str] = RANKINGS, exclude_fraction: float = 0.02,
                     seed: int = 0) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """The heads ablated at each (ranking, percent) of Yin & Steinhardt's curves.

    Rankings: by FV score, by induction score, each after removing the other score's top
    ``exclude_fraction`` heads, and a random ranking (uniform scores from ``seed``). Keys
    are (index in ``rankings``, index in ``percents``); values `top_heads` lists.
    """
    induction, fv = np.asarray(induction, float), np.asarray(fv, float)
    random_score = np.random.default_rng(seed).random(induction.shape)
    excl_ind = top_heads(induction, exclude_fraction)
    excl_fv = top_heads(fv, exclude_fraction)
    every = {"fv": (fv, ()), "induction": (induction, ()),
             "fv_excl_induction": (fv, excl_ind), "induction_excl_fv": (induction, excl_fv),
             "random": (random_score, ())}
    chosen = [every[check_choice("ranking", r, RANKINGS)] for r in rankings]
    return {(r, j): top_heads(score, p / 100.0, exclude=exclude)
            for r, (score, exclude) in enumerate(chosen) for j, p in enumerate(percents)}


def ablation_edits(heads: Sequence[tuple[int, int]], mean_z: np.ndarray | None, *,
                   positions: Sequence[int] | None = (-1,)) -> list[Ablate]:
    """Mean-ablation records: each head's output := ``mean_z[layer, head]`` at ``positions``.

    With ``mean_z`` None the heads are mean-ablated over the run's own real tokens at
    every position (``positions`` must then be None).
    """
    if mean_z is None:
        if positions is not None:
            raise InputError("`positions` needs `mean_z`; pass positions=None for a run mean.")
        return [Ablate(l, h, mode="mean") for l, h in heads]
    pos = None if positions is None else tuple(positions)
    return [Ablate(l, h, mode="mean", value=mean_z[l, h], positions=pos) for l, h in heads]


def few_shot_accuracy(model: Model, prompts: Sequence[str], answers: Sequence[str],
                      edits=()) -> float:
    """Fraction of prompts whose argmax next token is the answer's first token."""
    return _accuracy_and_answer_prob(model, prompts, answers, edits)[0]


def _accuracy_and_answer_prob(model: Model, prompts: Sequence[str], answers: Sequence[str],
                              edits=()) -> tuple[float, float]:
    """Argmax accuracy and mean probability of the answer's first token, one batched run."""
    correct, prob = _correct_and_answer_prob(model, prompts, answers, edits)
    return float(correct.mean()), float(prob.mean())


def _correct_and_answer_prob(model: Model, prompts: Sequence[str], answers: Sequence[str],
                             edits=()) -> tuple[np.ndarray, np.ndarray]:
    """Per prompt: whether the argmax next token is the answer's first token, and its probability."""
    batch = model.tokenize(list(prompts))
    probs = last_token_probs(model, batch, edits)                     # [prompt, vocab]
    target = torch.tensor(answer_token_ids(model, answers))
    rows = torch.arange(len(target))
    return ((probs.argmax(-1) == target).numpy().astype(float),
            probs[rows, target].float().numpy())


#: Where a mean-ablated head's replacement comes from (`ablation_curves`' ``mean_source``).
MEAN_SOURCES = ("cross-task", "per-task", "zero")
#: How `ablation_curves` runs the ablated prompts: ``last_token`` only the last token over a
#: cache of the earlier positions (`ablated_last_token`), ``full`` every position.
ABLATION_METHODS = ("auto", "last_token", "full")


def cross_task_mean_z(model: Model, tasks: Sequence[ICLTask | str], *, n_prompts: int = 8,
                      n_shots: int = 5, seed: int = 0, edits=()) -> np.ndarray:
    """Every head's last-token output averaged over the per-task means of ``tasks``.

    This is the ablation value of Yin & Steinhardt (2025): one mean per head, the average
    of the task means ā^t over the tasks the FV scores come from (their
    ``mean_head_activations.pt``), so that ablating a head removes what it carries for
    the evaluated task instead of replaying that task's own mean. Returns [layer, head, d_head].
    """
    tasks = [_task(t) for t in tasks]
    if not tasks:
        raise InputError("`mean_tasks` must name at least one task.")
    means = [task_mean_z(model, icl_prompts(t, n_prompts=n_prompts, n_shots=n_shots,
                                            seed=seed)[0], edits) for t in tasks]
    return np.mean(means, axis=0)


def _bootstrap_mean_accuracy(correct: np.ndarray, *, n_boot: int, level: float,
                             seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Percentile interval of the task-averaged accuracy, resampling prompts within each task.

    ``correct`` is [ranking, percent, task, prompt]; the same resampled prompts are used for
    every (ranking, percent), so differences between curves are paired.
    """
    rng = np.random.default_rng(seed)
    n_prompt = correct.shape[-1]
    idx = rng.integers(0, n_prompt, size=(n_boot, correct.shape[2], n_prompt))  # [boot, task, prompt]
    tasks = np.arange(correct.shape[2])[None, :, None]
    # [ranking, percent, boot, task, prompt] -> mean over prompts, then tasks
    resampled = correct[:, :, tasks, idx].mean(-1).mean(-1)
    tail = (1.0 - level) / 2.0
    return np.quantile(resampled, tail, axis=-1), np.quantile(resampled, 1.0 - tail, axis=-1)


def corpus_token_ids(model: Model, n_sequences: int, n_tokens: int) -> list[list[int]]:
    """Up to ``n_sequences`` consecutive, non-overlapping windows of ``n_tokens`` tokens of
    the shipped prose corpus (`datasets/corpus`, its files in name order joined by blank
    lines), tokenized without special tokens."""
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in sorted(_CORPUS_DIR.glob("*.txt")))
    ids = model.tokenizer(text, add_special_tokens=False)["input_ids"]
    seqs = [ids[i:i + n_tokens] for i in range(0, len(ids) - n_tokens + 1, n_tokens)]
    if not seqs:
        raise InputError(f"the corpus has fewer than n_tokens={n_tokens} tokens.")
    return seqs[:n_sequences]


def token_loss_difference(model: Model, token_ids: Sequence[Sequence[int]], edits=(), *,
                          early: int = 10, window: int = 5) -> float:
    """Mean loss at tokens [early, early+window) minus mean loss over the last ``window``.

    Positive values mean later tokens are predicted better: in-context learning in the
    sense of Olsson et al. (2022), the "loss(token 50) - loss(token 500)" of Yin & Steinhardt.
    """
    batch = model.batch_from_ids([list(r) for r in token_ids])
    n = min(batch.lengths)
    if early + window > n - window:
        raise InputError(f"sequences of {n} tokens are too short for early={early}, "
                         f"window={window}.")
    logits = torch.from_numpy(run_with(model, batch, edits).logits.values)  # [seq, pos, vocab]
    ids = batch.input_ids
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    loss = -logp                                                       # [seq, pos-1]
    # loss[:, i] predicts token i+1; all sequences have the same length (no padding)
    early_loss = loss[:, early - 1:early - 1 + window].mean()
    late_loss = loss[:, -window:].mean()
    return float(early_loss - late_loss)


def ablation_curves(model: Model, tasks: Sequence[ICLTask | str], induction: np.ndarray,
                    fv: np.ndarray, *, percents: Sequence[float] = (0, 1, 3, 5, 10, 20),
                    exclude_fraction: float = 0.02, n_prompts: int = 8, n_shots: int = 5,
                    loss_sequences: int = 4, loss_tokens: int = 96, seed: int = 0,
                    rankings: Sequence[str] = RANKINGS, mean_source: str = "cross-task",
                    mean_tasks: Sequence[ICLTask | str] | None = None, n_boot: int = 1000,
                    confidence_level: float = 0.95, method: str = "auto", max_rows: int = 512,
                    edits=(), progress: Any = None) -> xr.Dataset:
    """Few-shot accuracy and token-loss difference with the top p% heads mean-ablated.

    Rankings (Yin & Steinhardt 2025): by FV score, by induction score, each after removing
    the other score's top ``exclude_fraction`` heads, and a random ranking (seeded). For
    the ICL accuracy a head's output at the last token (the one predicting the answer;
    their ``ablate.py`` replaces it there and at every generated token, and only the first
    answer token is scored here) is replaced according to ``mean_source``:

    - ``"cross-task"`` (the paper's ablation, default): one mean per head, the average of
      the per-task last-token means over ``mean_tasks``, from separate clean prompts
      (`cross_task_mean_z`). The paper averages over its FV-scoring tasks, which are
      disjoint from its evaluation tasks; the default ``mean_tasks`` (None) is likewise
      every shipped task that is not among ``tasks``;
    - ``"per-task"``: the mean over clean prompts of the task being evaluated. A
      function-vector head's task mean is its contribution to the function vector, so this
      ablation keeps much of what the paper removes;
    - ``"zero"``: zero.

    ``method``: ``"last_token"`` runs only the last token of each ablated copy over keys and
    values of the earlier positions cached once per task (`ablated_last_token`; every
    (ranking, percent) is one copy, at most ``max_rows`` rows a run), ``"full"`` runs every
    position through `explorer.trace.run_with` with `Ablate` records; ``"auto"`` picks
    ``"last_token"`` where `last_token_problem` finds none. Both give the same numbers.
    ``edits`` (the workspace's intervention records) apply to every run, the means
    included: the curves of the edited model; they need ``method="full"`` (``"auto"``
    picks it).

    For the token-loss difference (on the shipped corpus) a head is replaced by its mean
    over the run's own tokens, at every position. ``rankings`` picks a subset of
    `RANKINGS`; the 0% point (nothing ablated) is run once and shared by every ranking.
    The interval on ``mean_accuracy`` is a percentile bootstrap over prompts (resampled
    within each task, ``n_boot`` draws, paired across rankings and percents).

    Returns
    -------
    xr.Dataset: ``accuracy`` and ``answer_prob`` (ranking, percent, task: argmax accuracy
    and mean probability of the answer's first token), ``mean_accuracy`` and
    ``mean_answer_prob`` (ranking, percent), ``mean_accuracy_low`` / ``mean_accuracy_high``
    (ranking, percent: the bootstrap interval), ``correct`` (ranking, percent, task,
    prompt: 0/1 per prompt), ``token_loss_difference`` (ranking, percent), ``ablated``
    (ranking, percent): JSON list of the ablated (layer, head).
    """
    tasks = [_task(t) for t in tasks]
    if not tasks:
        raise InputError("`tasks` must name at least one evaluation task; got an empty list.")
    induction, fv = check_head_scores(model, induction, fv)
    spec = model.spec
    percents = [check_float("percent", p, low=0.0, high=100.0) for p in percents]
    names = check_rankings(rankings)
    mean_source = check_choice("mean_source", mean_source, MEAN_SOURCES)
    method = check_choice("method", method, ABLATION_METHODS)
    max_rows = check_int("max_rows", max_rows, low=1)
    n_boot = check_int("n_boot", n_boot, low=10)
    confidence_level = check_float("confidence_level", confidence_level, low=0.5, high=0.999)
    n_prompts = check_int("n_prompts", n_prompts, low=1)
    edits = list(edits)
    if method == "auto":
        method = ("full" if last_token_problem(model) or model.remote or edits
                  else "last_token")
    elif method == "last_token" and edits:
        raise InputError("ablation_curves(method='last_token') runs the unedited model; "
                         "with `edits` use method='full' or 'auto'.")
    elif method == "last_token" and last_token_problem(model):
        raise InputError(f"ablation_curves(method='last_token') cannot run: "
                         f"{last_token_problem(model)}.")
    heads_at = ranked_head_sets(induction, fv, percents, rankings=names,
                                exclude_fraction=exclude_fraction, seed=seed)
    pool: list[Any] = []
    if mean_source == "cross-task":
        evaluated = {t.name for t in tasks}
        pool = ([n for n in icl_task_names() if n not in evaluated] if mean_tasks is None
                else list(mean_tasks))
        shared = cross_task_mean_z(model, pool, n_prompts=n_prompts, n_shots=n_shots,
                                   seed=seed + 2, edits=edits)
    elif mean_source == "zero":
        shared = np.zeros((spec.n_layers, spec.n_heads, spec.d_head))
    # the empty set (0 %) is run once per task
    sets = sorted({tuple(h) for h in heads_at.values()}, key=lambda h: (len(h), h))
    acc = np.zeros((len(names), len(percents), len(tasks)))
    prob = np.zeros_like(acc)
    correct = np.zeros((len(names), len(percents), len(tasks), n_prompts))
    total, done = len(tasks) * len(sets), 0
    for t, task in enumerate(tasks):
        prompts, answers = icl_prompts(task, n_prompts=n_prompts, n_shots=n_shots, seed=seed + 1)
        if mean_source == "per-task":
            means_from, _ = icl_prompts(task, n_prompts=n_prompts, n_shots=n_shots, seed=seed + 2)
            mz = task_mean_z(model, means_from, edits)
        else:
            mz = shared
        result: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        if method == "last_token":
            batch = model.tokenize(list(prompts))
            prefix = last_token_cache(model, batch)
            target = torch.tensor(answer_token_ids(model, answers))
            per_run = max(1, max_rows // n_prompts)
            for start in range(0, len(sets), per_run):
                chunk = sets[start:start + per_run]
                hits, probs = ablated_last_token(model, prefix, chunk, mz, target)
                for i, hs in enumerate(chunk):
                    result[hs] = (hits[i].numpy().astype(float), probs[i].numpy())
                done += len(chunk)
                if callable(progress):
                    progress(done, total)
        else:
            for hs in sets:
                result[hs] = _correct_and_answer_prob(model, prompts, answers,
                                                      [*edits, *ablation_edits(list(hs), mz)])
                done += 1
                if callable(progress):
                    progress(done, total)
        for (r, j), heads in heads_at.items():
            hits, probs = result[tuple(heads)]
            correct[r, j, t] = hits
            acc[r, j, t], prob[r, j, t] = hits.mean(), probs.mean()
    loss_ids = corpus_token_ids(model, loss_sequences, loss_tokens)
    tld = np.zeros((len(names), len(percents)))
    ablated = np.empty((len(names), len(percents)), dtype=object)
    losses: dict[tuple, float] = {}
    for (r, j), heads in heads_at.items():
        ablated[r, j] = json.dumps(heads)
        key = tuple(heads)
        if key not in losses:
            losses[key] = token_loss_difference(
                model, loss_ids, [*edits, *ablation_edits(heads, None, positions=None)])
        tld[r, j] = losses[key]
    low, high = _bootstrap_mean_accuracy(correct, n_boot=n_boot, level=confidence_level,
                                         seed=seed)
    return xr.Dataset(
        {"accuracy": (("ranking", "percent", "task"), acc),
         "mean_accuracy": (("ranking", "percent"), acc.mean(-1)),
         "mean_accuracy_low": (("ranking", "percent"), low),
         "mean_accuracy_high": (("ranking", "percent"), high),
         "correct": (("ranking", "percent", "task", "prompt"), correct),
         "answer_prob": (("ranking", "percent", "task"), prob),
         "mean_answer_prob": (("ranking", "percent"), prob.mean(-1)),
         "token_loss_difference": (("ranking", "percent"), tld),
         "ablated": (("ranking", "percent"), ablated.astype(str))},
        coords={"ranking": list(rankings), "percent": percents, "task": [t.name for t in tasks]},
        attrs=provenance(model, method="ablation_curves", percents=percents,
                         exclude_fraction=exclude_fraction, n_prompts=n_prompts,
                         n_shots=n_shots, loss_sequences=loss_sequences,
                         loss_tokens=loss_tokens, seed=seed, rankings=names,
                         mean_source=mean_source,
                         mean_tasks=None if mean_source != "cross-task" else
                         [_task(t).name for t in pool], n_boot=n_boot, ablation_method=method,
                         confidence_level=confidence_level, edits=edits, citation=CITATION))
