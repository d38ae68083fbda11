"""The per-token loss of the model under edits and the token-loss difference (loss early in a
sequence minus loss late in it) over windows of the shipped prose corpus."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from explorer._checks import InputError, check_int
from explorer.defaults import DATASETS_DIR
from explorer.models import Model
from explorer.trace import run_with

__all__ = ['corpus_token_ids', 'token_losses', 'token_loss_difference']


_CORPUS_DIR = DATASETS_DIR / "corpus"


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


def token_losses(model: Model, sequences: Sequence[Sequence[int]], positions: Sequence[int],
                 edits=(), *, batch_size: int = 4) -> np.ndarray:
    """Per-token loss [sequence, position]: at index i, -log p(token i + 1 | tokens 0..i),
    of the model under ``edits``. The sequences must have one length (no padding)."""
    sequences = [list(map(int, s)) for s in sequences]
    n = {len(s) for s in sequences}
    if len(n) != 1:
        raise InputError(f"token_losses needs sequences of one length; got lengths {sorted(n)}.")
    length = n.pop()
    positions = [check_int("position", p, low=0, high=length - 2) for p in positions]
    batch_size = check_int("batch_size", batch_size, low=1)
    rows = []
    for i in range(0, len(sequences), batch_size):
        chunk = sequences[i:i + batch_size]
        logits = run_with(model, chunk, edits, positions=positions).logits.values
        logp = torch.log_softmax(torch.from_numpy(logits), -1)        # [seq, position, vocab]
        nxt = torch.tensor([[s[p + 1] for p in positions] for s in chunk])
        rows.append((-logp.gather(-1, nxt[..., None])[..., 0]).numpy())
    return np.concatenate(rows)


def token_loss_difference(model: Model, token_ids: Sequence[Sequence[int]], edits=(), *,
                          early: int = 10, window: int = 5) -> float:
    """Mean loss at tokens [early, early+window) minus mean loss over the last ``window``
    (`token_losses`, all sequences in one batch, so a mean ablation averages over them all).

    Positive values mean later tokens are predicted better: in-context learning in the
    sense of Olsson et al. (2022), the "loss(token 50) - loss(token 500)" of Yin & Steinhardt.
    """
    n = min(len(s) for s in token_ids)
    if early + window > n - window:
        raise InputError(f"sequences of {n} tokens are too short for early={early}, "
                         f"window={window}.")
    # loss index i predicts token i + 1: tokens [early, early + window) and the last window
    positions = [*range(early - 1, early - 1 + window), *range(n - 1 - window, n - 1)]
    loss = token_losses(model, token_ids, positions, edits, batch_size=len(token_ids))
    return float(loss[:, :window].mean() - loss[:, window:].mean())
