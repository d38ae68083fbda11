"""How long the ICL heads page's *Compute scores* takes: every forward it runs, counted from
the page's settings, times a cost per run and per token measured on the model itself.

The button runs the head scores (`induction_scores` on repeated random sequences, then
`fv_scores` on the FV tasks' prompts), then the function vector of the selected task and
the selected head's attention, and, the first time, the task encoding (`task_decodability`).
`score_work` counts their forwards (runs and token positions, as the analyses batch them)
and the induction patterns scored in numpy; `measured_forward_cost` times two forwards of the
model (and one pattern scoring) on this machine; `estimated_score_seconds` is the sum.
"""
from __future__ import annotations

import math
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

import explorer
from explorer.analyses import icl_heads as ih
from explorer.analyses import task_vectors as tv
from explorer.trace import trace

__all__ = ["Forwards", "ScoreWork", "ForwardCost", "score_work", "measured_forward_cost",
           "reference_cost", "estimated_score_seconds", "seconds_text"]


@dataclass(frozen=True)
class Forwards:
    """``calls`` runs of the model over ``tokens`` token positions in all (padding
    included; a last-token run over cached keys and values counts its one position per
    row); ``part`` says what they compute."""

    part: str
    calls: int
    tokens: int


@dataclass(frozen=True)
class ScoreWork:
    """What *Compute scores* runs: its forwards, and the induction sequences whose
    attention patterns are scored in numpy (``n_sequences`` of ``seq_len`` tokens)."""

    forwards: tuple[Forwards, ...]
    n_sequences: int
    seq_len: int

    @property
    def calls(self) -> int:
        return sum(f.calls for f in self.forwards)

    @property
    def tokens(self) -> int:
        return sum(f.tokens for f in self.forwards)


@dataclass(frozen=True)
class ForwardCost:
    """Seconds of one model's runs on this machine: ``call_s`` per run (tracing, hooks,
    Python), ``token_s`` per token position, ``cell_s`` per cell of one head's attention
    pattern scored for induction (per layer, head, query and key)."""

    call_s: float
    token_s: float
    cell_s: float


def _width(model: explorer.Model, prompts: Sequence[str]) -> int:
    """Tokens per row of ``prompts`` run as one batch (left-padded to the longest)."""
    return int(model.tokenize(list(prompts)).width)


def _batched(part: str, rows: int, width: int, batch_size: int) -> Forwards:
    return Forwards(part, math.ceil(rows / batch_size), rows * width)


def score_work(model: explorer.Model, *, fv_tasks: Sequence[ih.ICLTask | str],
               td_tasks: Sequence[ih.ICLTask | str], task: ih.ICLTask | str, n_prompts: int,
               n_shots: int, n_sequences: int, half_len: int,
               induction_batch: int = 8, fv_max_rows: int = 256) -> ScoreWork:
    """The forwards *Compute scores* runs with these settings, as the analyses batch them:
    induction on ``n_sequences`` repeated random sequences of ``2 * half_len`` tokens (and
    BOS); per FV task the clean prompts' mean head outputs and probabilities, the corrupted
    prompts' cache and the patched runs (``fv_max_rows`` rows a run); the function vector
    of ``task``; the selected head's attention; the task encoding of ``td_tasks`` (none
    when it is already computed)."""
    seq_len = 2 * half_len + (model.tokenizer.bos_token_id is not None)
    out = [_batched("induction sequences", n_sequences, seq_len, induction_batch)]
    heads = ih.heads_of_layers(model, None)
    last_token = ih.last_token_problem(model) is None
    for t in fv_tasks:
        clean, _ = ih.icl_prompts(t, n_prompts=n_prompts, n_shots=n_shots)
        corrupted, _ = ih.icl_prompts(t, n_prompts=n_prompts, n_shots=n_shots,
                                      shuffle_labels=True)
        w, wc = _width(model, clean), _width(model, corrupted)
        chunks = ih.head_chunks(heads, max(1, fv_max_rows // n_prompts))
        rows = n_prompts * len(heads)
        out.append(Forwards("FV: clean prompts", 2, 2 * n_prompts * w))
        if last_token:    # the prefix once, then one position per patched row
            out.append(Forwards("FV: corrupted prompts", 2, n_prompts * wc))
            out.append(Forwards("FV: patched runs", len(chunks), rows))
        else:             # every position of every patched row, from the chunk's lowest layer
            out.append(Forwards("FV: corrupted prompts", 1, n_prompts * wc))
            out.append(Forwards("FV: patched runs", len(chunks), rows * wc))
    clean, _ = ih.icl_prompts(task, n_prompts=n_prompts, n_shots=n_shots)
    zero, _ = ih.icl_prompts(task, n_prompts=n_prompts, n_shots=0, seed=1)
    w = _width(model, clean)
    out.append(Forwards("function vector", 4,
                        2 * n_prompts * w + 2 * n_prompts * _width(model, zero)))
    icl, _ = ih.icl_prompts(task, n_prompts=1, n_shots=3, seed=42)
    out.append(Forwards("selected head's attention", 2, 21 + _width(model, icl)))
    if td_tasks:
        tasks = [ih.as_icl_task(t) for t in td_tasks]
        widths = [_width(model, ih.icl_prompts(t, n_prompts=n_prompts, n_shots=n_shots)[0])
                  for t in [*tasks, tv.null_task(tasks)]]
        out.append(Forwards("task encoding: accuracy", len(tasks),
                            n_prompts * sum(widths[:-1])))
        out.append(_batched("task encoding: residuals", len(widths) * n_prompts, max(widths),
                            16))
    return ScoreWork(tuple(out), int(n_sequences), int(seq_len))


_MEASURED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""`measured_forward_cost` of each model of this process (measured once)."""

_REFERENCE = ForwardCost(call_s=0.05, token_s=0.0036, cell_s=1e-8)
"""SmolLM2-135M's costs on a 2-core CPU: its paper's setting (173 runs over 111,410 token
positions and 1,000 sequences of 101 tokens scored) took 437 s there. `reference_cost`
scales it to another model."""
_REFERENCE_MACS = 12 * 30 * 576 ** 2 + 576 * 49152


def _token_macs(spec: explorer.ModelSpec) -> int:
    """Multiply-adds of one token position: attention and MLP weights, and the unembedding."""
    return 12 * spec.n_layers * spec.d_model ** 2 + spec.d_model * spec.vocab_size


def reference_cost(spec: explorer.ModelSpec) -> ForwardCost:
    """SmolLM2's costs on a 2-core CPU with the per-token cost scaled by the model's
    multiply-adds per token: the same for every machine and load (whether the page scores
    as it opens; a model whose forwards run elsewhere)."""
    r = _REFERENCE
    return ForwardCost(call_s=r.call_s, token_s=r.token_s * _token_macs(spec) / _REFERENCE_MACS,
                       cell_s=r.cell_s)


def measured_forward_cost(model: explorer.Model, *, seconds_long: float = 0.25,
                          repeats: int = 3, again: bool = False) -> ForwardCost:
    """Time forwards of ``model`` reading every attention pattern (the induction score's
    run): one of 1 x 8 tokens and one long enough to take about ``seconds_long`` at
    `reference_cost` (so the per-token cost stands out of the noise on a small model too),
    interleaved, the fastest of ``repeats`` each, after a warm-up run; and the induction
    scoring of one sequence's patterns (the fastest of ``repeats``). The per-run, per-token
    and per-cell seconds they give on this machine now. Measured once per model in this
    process (``again``: measure anew). A remote model (NDIF) is not timed: its costs are
    `reference_cost`."""
    if model in _MEASURED and not again:
        return _MEASURED[model]
    spec = model.spec
    if model.remote:
        return reference_cost(spec)
    tokens = int(min(2048, max(64, seconds_long / reference_cost(spec).token_s)))
    width = min(128, spec.context_length)
    rows = min(16, -(-tokens // width))
    width = min(width, -(-tokens // rows))
    ids = np.random.default_rng(0).integers(0, spec.vocab_size, size=(rows, width)).tolist()

    def seconds(batch: list[list[int]]) -> float:
        start = time.perf_counter()
        trace(model, batch, sites="attn_pattern", batch_size=len(batch), progress=False)
        return time.perf_counter() - start

    seconds([ids[0][:8]])                                                # warm-up
    # interleaved, so a burst of other work on the machine slows both or neither
    pairs = [(seconds([ids[0][:8]]), seconds(ids)) for _ in range(repeats)]
    short, long = min(p[0] for p in pairs), min(p[1] for p in pairs)
    token_s = max(0.0, (long - short) / (rows * width - 8))
    n = 33                                                   # one sequence of 33 tokens
    patterns = np.zeros((1, spec.n_layers, spec.n_heads, n, n), np.float32)

    def scoring() -> float:
        start = time.perf_counter()
        ih.induction_score_from_patterns(patterns, np.arange(n)[None] % 16, "abs")
        return time.perf_counter() - start

    cell_s = min(scoring() for _ in range(repeats)) / (spec.n_layers * spec.n_heads * n * n)
    cost = ForwardCost(call_s=max(0.0, short - 8 * token_s), token_s=token_s, cell_s=cell_s)
    _MEASURED[model] = cost
    return cost


def estimated_score_seconds(work: ScoreWork, cost: ForwardCost, *, n_layers: int,
                            n_heads: int) -> float:
    """Seconds ``work`` takes at ``cost``: a run's fixed cost per run, the per-token cost
    per token position, and the pattern cells of the induction sequences."""
    cells = work.n_sequences * n_layers * n_heads * work.seq_len ** 2
    return work.calls * cost.call_s + work.tokens * cost.token_s + cells * cost.cell_s


def seconds_text(seconds: float) -> str:
    """``about 40 s`` / ``about 7 min`` (whole seconds under two minutes)."""
    if seconds < 120:
        return f"about {max(1, round(seconds)):d} s"
    return f"about {round(seconds / 60):d} min"
