"""Generation under edits: each new token is the next-token choice of an edited forward.

`generate` runs one trace per new token over the whole sequence so far (prompt and the
tokens generated before), with the edits applied as in `run_with`; so an edit at
``positions=(-1,)`` acts on the newest token at each step, and one without positions on
every token. Greedy by default; a temperature samples from the softmax, seeded.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._checks import InputError, check_float, check_int, check_prompts
from .interventions import Edit
from .models import Model
from .trace import TraceRequest, check_edit_rows, check_edits, run_batch

__all__ = ["generate", "Generation"]


@dataclass(frozen=True)
class Generation:
    """What `generate` made of one prompt.

    ``text`` is the generated continuation (the prompt not included; ``full_text`` has both),
    ``token_ids`` its token ids and ``tokens`` their strings as the model sees them; the
    end-of-text token, when it ends the generation, is the last id and is kept out of
    ``text``. ``prompt_ids`` are the prompt's own token ids.
    """

    prompt: str
    text: str
    token_ids: tuple[int, ...]
    tokens: tuple[str, ...]
    prompt_ids: tuple[int, ...]
    full_text: str

    def as_torch(self) -> torch.Tensor:
        """Prompt and generated ids as one [1, pos] LongTensor (TransformerLens' shape)."""
        return torch.tensor([[*self.prompt_ids, *self.token_ids]], dtype=torch.long)


def generate(model: Model, prompt: str | Sequence[str], *, edits: Sequence[Edit] = (),
             max_new_tokens: int = 20, temperature: float = 0.0, seed: int | None = None,
             stop_at_eos: bool = True) -> Generation | list[Generation]:
    """Generate up to ``max_new_tokens`` tokens after ``prompt`` with ``edits`` applied at
    every step.

    Parameters
    ----------
    model : Model
    prompt : str or list of str
        One prompt (a `Generation` back) or several, run as one left-padded batch (a list
        back; an edit's ``prompts`` names rows of that list).
    edits : sequence of Edit
        Applied in every step's forward, over the whole sequence so far; positions count in
        that sequence (-1 is the token being predicted from).
    max_new_tokens : int, default=20
    temperature : float, default=0
        0 takes the most likely token (greedy, as ``model.hf.generate`` without sampling);
        above 0 samples from softmax(logits / temperature).
    seed : int, optional
        Seeds the sampling (a torch.Generator of its own; the global RNG is not touched).
    stop_at_eos : bool, default=True
        A prompt stops after the tokenizer's end-of-text token.

    Returns
    -------
    Generation, or a list of them for a list of prompts
    """
    single = isinstance(prompt, str)
    prompts = check_prompts(prompt)
    edits = check_edits(edits)
    check_int("max_new_tokens", max_new_tokens, low=1)
    temperature = check_float("temperature", temperature, low=0.0)
    check_edit_rows(edits, len(prompts))
    rng = None
    if temperature > 0:
        rng = torch.Generator().manual_seed(0 if seed is None else check_int("seed", seed))
    elif seed is not None:
        raise InputError("`seed` seeds sampling; it needs a `temperature` above 0.")
    ids = [list(row) for row in model.tokenize(prompts).token_ids]
    n_prompt = [len(row) for row in ids]
    limit = model.spec.context_length
    if max(n_prompt) + max_new_tokens > limit:
        raise InputError(f"a prompt of {max(n_prompt)} tokens and {max_new_tokens} new ones "
                         f"exceed {model.spec.name}'s context of {limit} tokens.")
    eos = model.tokenizer.eos_token_id if stop_at_eos else None
    done = [False] * len(ids)
    for _ in range(max_new_tokens):
        batch = model.batch_from_ids(ids)
        out = run_batch(model, batch, edits=edits,
                        readouts=TraceRequest(save_positions=[-1], logits=True))
        logits = out["logits"][:, -1].float()                   # [prompt, vocab]
        if rng is None:
            nxt = logits.argmax(-1)
        else:
            probs = torch.softmax(logits / temperature, -1).cpu()
            nxt = torch.multinomial(probs, 1, generator=rng)[:, 0]
        for i, t in enumerate(nxt.tolist()):
            if not done[i]:
                ids[i].append(t)
                done[i] = t == eos
            else:                 # a finished row keeps its place (edits name rows) unread
                ids[i].append(ids[i][-1])
        if all(done):
            break
    results = []
    for i, p in enumerate(prompts):
        new = ids[i][n_prompt[i]:]
        if eos is not None and eos in new:
            new = new[:new.index(eos) + 1]
        shown = new[:-1] if new and new[-1] == eos else new
        head = ids[i][:n_prompt[i]]
        before, full = model.tokenizer.decode(head), model.tokenizer.decode(head + shown)
        # decoded with the prompt: a tokenizer may spell a token differently at the start
        text = full[len(before):] if full.startswith(before) else model.tokenizer.decode(shown)
        results.append(Generation(
            prompt=p, text=text, token_ids=tuple(new), tokens=tuple(model.token_strings(new)),
            prompt_ids=tuple(head), full_text=full))
    return results[0] if single else results
