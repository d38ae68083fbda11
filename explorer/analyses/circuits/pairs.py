"""Clean/corrupted prompt pairs as batches, the metric at the last position, and what the
score and patching passes share (graph shape, edge mask, frozen weights)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from explorer._checks import InputError
from explorer.analyses.circuit_tasks import CircuitTask, continuation_token
from explorer.analyses.circuits.forward import _Run
from explorer.analyses.circuits.graph import valid_edge_mask
from explorer.heads import HeadEngine, parallel_attn_mlp
from explorer.models import Batch, Model

__all__ = [
    'CITATION', 'METRICS', 'Progress', 'check_task', 'answer_ids', 'row_batches', 'prepare_pairs',
]


CITATION = ("Wang et al., Towards Understanding Fine-Tuning Mechanisms of LLMs via Circuit "
            "Analysis, ICML 2025; Hanna et al., Have Faith in Faithfulness, COLM 2024 (EAP-IG)")


METRICS = ("logit_diff", "kl")


Progress = Callable[[int, int], None] | bool | None


@dataclass
class _Prepared:
    clean: Batch
    corrupt: Batch
    answer: torch.Tensor  # [prompt] token ids
    wrong: torch.Tensor
    mean_baseline: bool = False   # mean ablation (`CircuitTask.baseline`): no corrupted run

    def to(self, device: torch.device) -> _Prepared:
        """The same batch with its tensors on ``device`` (the weights' device)."""
        return _Prepared(self.clean.to(device), self.corrupt.to(device), self.answer.to(device),
                         self.wrong.to(device), self.mean_baseline)


def _position_mean(x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``x`` [..., prompt, pos, d_model] averaged over each prompt's real positions
    (``keys`` [prompt, pos], 1 where a token is), broadcast back to every position."""
    w = keys.to(x.dtype)[..., None]                               # [prompt, pos, 1]
    mean = (x * w).sum(-2, keepdim=True) / w.sum(-2, keepdim=True)  # [..., prompt, 1, d_model]
    return mean.expand_as(x).contiguous()


def _mean_run(ad: HeadEngine, clean: _Run, batch: Batch) -> _Run:
    """The mean-ablation baseline as a corrupted run: every node's output (and so every
    destination's input, their sum) averaged over the positions of its own clean prompt;
    the logits those averaged inputs give at the last position."""
    keys = batch.attention_mask
    outs = _position_mean(clean.outs, keys)                       # [src, prompt, pos, d_model]
    resid_in = [_position_mean(r, keys) for r in clean.resid_in]  # each [prompt, pos, d_model]
    return _Run(outs, [], resid_in, ad.logits(resid_in[-1][:, -1]))


def check_task(task: Any) -> CircuitTask:
    """``task`` when it is a `CircuitTask`; a TypeError naming what it is otherwise."""
    if not isinstance(task, CircuitTask):
        raise TypeError(f"`task` must be a CircuitTask (see make_task); got {type(task).__name__}.")
    return task


def answer_ids(model: Model, prompts: Sequence[str], targets: Sequence[str]) -> list[int]:
    """First token of each (non-empty) target as it continues its prompt
    (`circuit_tasks.continuation_token`): the answer and wrong-answer ids the metric reads."""
    for prompt, target in zip(prompts, targets):
        if not target:
            raise InputError(f"empty target string for the prompt {prompt[-40:]!r}.")
    return [continuation_token(model.tokenizer, p, t) for p, t in zip(prompts, targets)]


def row_batches(n: int, batch_size: int) -> list[list[int]]:
    """The row indices 0..n-1 in consecutive batches of at most ``batch_size``."""
    return [list(range(i, min(i + batch_size, n))) for i in range(0, n, batch_size)]


def prepare_pairs(model: Model, task: CircuitTask, rows: Sequence[int]) -> _Prepared:
    """The clean and corrupted batches of ``task``'s ``rows`` with their answer and wrong
    token ids (``.clean``, ``.corrupt``, ``.answer``, ``.wrong``); pairs must tokenise to
    equal lengths."""
    clean_p = [task.clean[i] for i in rows]
    corrupt_p = [task.corrupt[i] for i in rows]
    clean = model.tokenize(clean_p)
    corrupt = model.tokenize(corrupt_p)
    for i, (a, c) in enumerate(zip(clean.lengths, corrupt.lengths)):
        if a != c:
            raise InputError(
                f"clean and corrupted prompt {rows[i]} tokenise to {a} and {c} tokens; each pair "
                f"must have the same length ({clean_p[i][-40:]!r} vs {corrupt_p[i][-40:]!r}).")
    answer = torch.tensor(answer_ids(model, clean_p, [task.answer[i] for i in rows]))
    wrong = torch.tensor(answer_ids(model, clean_p, [task.wrong[i] for i in rows]))
    return _Prepared(clean, corrupt, answer, wrong, task.baseline == "mean")


def _metric_values(metric: str, logits: torch.Tensor, prep: _Prepared,
                   clean_logits: torch.Tensor | None) -> torch.Tensor:
    """Per-prompt metric at the last position: [prompt]."""
    logits = logits.float()
    if metric == "logit_diff":
        rows = torch.arange(logits.shape[0], device=logits.device)
        return logits[rows, prep.answer] - logits[rows, prep.wrong]
    logp = torch.log_softmax(logits, -1)
    clean_logp = torch.log_softmax(clean_logits.float(), -1)
    return (clean_logp.exp() * (clean_logp - logp)).sum(-1)   # KL(clean || run)


def _graph_shape(model: Model, ad: HeadEngine | None) -> tuple[int, int, bool]:
    """(layers, heads, parallel) of the graph: the engine's, or a remote model's spec and
    config."""
    if ad is None:
        return model.n_layers, model.spec.n_heads, parallel_attn_mlp(model)
    return ad.n_layers, ad.n_heads, getattr(ad, "parallel", False)


def _ad_valid(ad: HeadEngine, split_qkv: bool = False) -> np.ndarray:
    """The [src, dst] edge mask of the engine's graph."""
    return valid_edge_mask(ad.n_layers, ad.n_heads, getattr(ad, "parallel", False), split_qkv)


def _frozen(model: Model):
    """Weights do not require grad while the circuit runs (gradients are w.r.t. activations)."""
    class _Ctx:
        def __enter__(self):
            self.flags = [(p, p.requires_grad) for p in model.hf.parameters()]
            for prm, _ in self.flags:
                prm.requires_grad_(False)

        def __exit__(self, *exc):
            for prm, flag in self.flags:
                prm.requires_grad_(flag)
    return _Ctx()
