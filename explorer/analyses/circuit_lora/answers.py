"""Scoring answers: (prompt, answer) pairs as tokens, the logits at the answer positions, and
`answer_accuracy` (exact match of the greedy answer, answer-token accuracy, loss), locally
or where a remote model's weights are.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import xarray as xr

from explorer._checks import InputError, check_int
from explorer.lora import LoRAWeights, fast_unembed, logits_at, remove_hooks
from explorer.models import Model
from explorer.trace import provenance, run_on_weights

__all__ = ["answer_accuracy"]


def encode_answers(model: Model, prompts: Sequence[str], answers: Sequence[str]
                   ) -> list[tuple[list[int], list[int]]]:
    """Each problem's prompt and answer token ids, without special tokens; a clear error for
    unequal lengths, no problems, or a prompt or answer that tokenises to nothing."""
    if len(prompts) != len(answers):
        raise InputError(f"`prompts` and `answers` must have the same length; got {len(prompts)} "
                         f"and {len(answers)}.")
    if not prompts:
        raise InputError("`prompts` must hold at least one problem; got none.")
    tok = model.tokenizer
    out = []
    for i, (p, a) in enumerate(zip(prompts, answers)):
        p_ids = tok(p, add_special_tokens=False)["input_ids"]
        a_ids = tok(a, add_special_tokens=False)["input_ids"]
        if not p_ids or not a_ids:
            raise InputError(f"problem {i} ({p!r} -> {a!r}) tokenises to an empty prompt or answer.")
        out.append((p_ids, a_ids))
    return out


def _answer_positions(model: Model, pairs: Sequence[tuple[list[int], list[int]]]
                      ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch of ``pairs`` (prompt + answer) and, per answer token, the (row, column)
    whose next-token prediction it is and the token: (batch, rows, cols, targets)."""
    batch = model.batch_from_ids([p + a for p, a in pairs])
    w = batch.width
    rows, cols, targets = [], [], []
    for i, (p, a) in enumerate(pairs):
        start = w - len(a) - 1  # the position whose next-token prediction is a[0]
        for j, t in enumerate(a):
            rows.append(i)
            cols.append(start + j)
            targets.append(t)
    return batch, torch.tensor(rows), torch.tensor(cols), torch.tensor(targets)


def _answer_logits(hf: torch.nn.Module, model: Model, pairs: Sequence[tuple[list[int], list[int]]]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits predicting each answer token: ([n_ans_total, vocab], targets, row of each)."""
    batch, rows, cols, targets = _answer_positions(model, pairs)
    fast = fast_unembed(model) and hasattr(hf, "lm_head")
    return logits_at(hf, fast, batch, rows, cols), targets, rows


def _base_hf(peft_or_hf: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a peft wrapper (module tree with LoRA layers injected)."""
    return peft_or_hf.get_base_model() if hasattr(peft_or_hf, "get_base_model") else peft_or_hf


def answer_accuracy(model: Model, prompts: Sequence[str], answers: Sequence[str], *,
                    hf: torch.nn.Module | LoRAWeights | None = None,
                    batch_size: int = 32) -> xr.Dataset:
    """Exact-match accuracy of the greedy answer, per-token accuracy and answer loss.

    The greedy continuation equals the answer exactly when the argmax at every answer
    position (given the right prefix) is the answer token, so one forward pass decides it.
    ``hf`` evaluates another module with the same tokenizer (a peft LoRA model), or
    ``model`` with `LoRAWeights` applied by hooks (what `finetune_lora` returns for a remote
    model); default ``model`` itself. A remote model is evaluated on the server
    (`explorer.trace.run_on_weights`, one job), and only the per-token results come back.

    Returns
    -------
    xr.Dataset
        ``correct`` (prompt, bool), ``answer_loss`` (prompt, mean NLL of the answer tokens);
        attrs ``accuracy``, ``token_accuracy``, ``loss``.
    """
    check_int("batch_size", batch_size, low=1)
    pairs = encode_answers(model, prompts, answers)
    chunks = [_answer_positions(model, pairs[s:s + batch_size])
              for s in range(0, len(pairs), batch_size)]
    fast = fast_unembed(model)
    if isinstance(hf, LoRAWeights) or (hf is None and model.remote):
        lora = hf if isinstance(hf, LoRAWeights) else None
        with model.lock:  # hooks on a local model's shared modules, for this call only
            scored = run_on_weights(model, _score_answers, None, chunks, fast, lora)
    else:
        module = _base_hf(hf if hf is not None else model.hf)
        scored = _score_answers(model, module, chunks, fast and hasattr(module, "lm_head"), None)
    correct, losses, tok_ok, n_tok = [], [], 0, 0
    for (_, rows, _, _), (ok, nll) in zip(chunks, scored):
        for i in range(int(rows.max()) + 1):
            sel = rows == i
            correct.append(bool(ok[sel].all()))
            losses.append(float(nll[sel].mean()))
        tok_ok += int(ok.sum())
        n_tok += int(ok.numel())
    correct_a = np.array(correct)
    return xr.Dataset(
        {"correct": ("prompt", correct_a), "answer_loss": ("prompt", np.array(losses))},
        coords={"prompt_text": ("prompt", list(prompts)), "answer": ("prompt", list(answers))},
        attrs={**provenance(model, method="answer-accuracy"),
               "accuracy": float(correct_a.mean()), "token_accuracy": tok_ok / max(n_tok, 1),
               "loss": float(np.mean(losses))})


def _score_answers(weights: Model, hf: Any, chunks: list, fast: bool,
                   lora: LoRAWeights | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per chunk, (argmax == answer, NLL) of every answer token; runs where the weights are.

    ``hf`` is the module to run (None: ``weights.hf``, the only choice on the server);
    ``lora`` adds adapters by hooks for this call.
    """
    hf = weights.hf if hf is None else hf
    device = hf.device
    handles = [] if lora is None else lora.to(device).hooks(weights)
    out = []
    try:
        with torch.no_grad():
            for batch, rows, cols, targets in chunks:
                logits = logits_at(hf, fast, batch.to(device), rows.to(device), cols.to(device))
                targets = targets.to(device)
                nll = torch.nn.functional.cross_entropy(logits.float(), targets, reduction="none")
                out.append((logits.argmax(-1) == targets, nll))
    finally:
        remove_hooks(handles)
    return out
