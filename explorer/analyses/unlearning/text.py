"""General text for the retain term and the perplexity check of unlearning.

Guo et al. (ICML 2025) add a cross-entropy term on the Pile to the unlearning loss, so that
the localized edit keeps the model's ordinary language modelling, and report side effects
on general text. Here the text is the shipped prose corpus (``datasets/corpus``, CC0;
`explorer.analyses.saturation.corpus.load_corpus`), cut into windows of equal length
(`text_windows`): the documents are split into a training part (the retain term reads
it) and a held-out part (the perplexity is read there), never mixed.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from explorer._checks import InputError, check_choice, check_int
from explorer.models import Model

__all__ = ["TEXT_SPLITS", "text_windows", "text_loss", "text_perplexity"]

TEXT_SPLITS = ("train", "heldout")
_HELDOUT_EVERY = 4  # documents 4, 8, 12, ... (1-based) are held out


def text_windows(model: Model, split: str = "train", *, window: int = 64,
                 max_windows: int | None = None, path: str | Path | None = None) -> torch.Tensor:
    """Token windows [window, n_tokens] of the corpus documents of one split.

    Documents are read in name order; every fourth (the 4th, 8th, 12th, ...) is held out,
    the rest train. Each document is tokenized alone and cut into consecutive windows of
    ``window`` tokens (the remainder is dropped), in document order.
    """
    from explorer.analyses.saturation.corpus import load_corpus

    check_choice("split", split, TEXT_SPLITS)
    window = check_int("window", window, low=2, high=model.spec.context_length)
    docs = load_corpus(path)
    keep = [d for i, d in enumerate(docs, start=1)
            if (i % _HELDOUT_EVERY == 0) == (split == "heldout")]
    rows: list[list[int]] = []
    for doc in keep:
        ids = model.tokenizer(doc, add_special_tokens=False)["input_ids"]
        rows += [ids[i:i + window] for i in range(0, len(ids) - window + 1, window)]
    if max_windows is not None:
        rows = rows[:check_int("max_windows", max_windows, low=1)]
    if not rows:
        raise InputError(f"the corpus has no {split} window of {window} tokens.")
    return torch.tensor(rows, dtype=torch.long)


def text_loss(hf: torch.nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``hf`` over every position of ``windows``
    [window, n_tokens] (each predicts its tokens 1..n-1 from those before)."""
    windows = windows.to(next(hf.parameters()).device)
    logits = hf(input_ids=windows).logits[:, :-1].float()        # [window, n - 1, vocab]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             windows[:, 1:].reshape(-1))


def text_perplexity(model: Model, windows: torch.Tensor, *, hf: torch.nn.Module | None = None,
                    batch_size: int = 8) -> float:
    """exp(mean next-token cross-entropy) over all windows (``hf``: a trained copy; default
    the model's own weights)."""
    hf = model.hf if hf is None else hf
    total, count = 0.0, 0
    with torch.no_grad():
        for b0 in range(0, len(windows), batch_size):
            chunk = windows[b0:b0 + batch_size]
            n = chunk.shape[0] * (chunk.shape[1] - 1)
            total += float(text_loss(hf, chunk)) * n
            count += n
    return math.exp(total / count)


def windows_for_step(windows: torch.Tensor, step: int, batch: int) -> torch.Tensor:
    """The ``batch`` windows a training step reads: consecutive windows, cycling."""
    n = len(windows)
    idx = [(step * batch + i) % n for i in range(min(batch, n))]
    return windows[idx]

