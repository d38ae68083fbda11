"""Generation under edits: each new token is the next-token choice of an edited forward.

`generate` runs one trace per new token over the whole sequence so far (prompt and the
tokens generated before), with the edits applied as in `run_with`; so an edit at
``positions=(-1,)`` acts on the newest token at each step, and one without positions on
every token. Edits that change from step to step (``step_edits``, a function of the step)
join them: the ICL heads' mean ablation of the last prompt token and every generated token
is one. Greedy by default; a temperature samples from the softmax, seeded. The first
step's logits can come back with the text (``first_logits``).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ._checks import InputError, check_choice, check_float, check_int, check_prompts
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
    ``text``. ``prompt_ids`` are the prompt's own token ids. ``first_logits`` (with
    ``generate(..., first_logits=True)``, else None) are the first step's next-token logits
    under the edits, a float32 [vocab] tensor: the distribution the first new token was
    chosen from (before any temperature). Generations compare without it.
    """

    prompt: str
    text: str
    token_ids: tuple[int, ...]
    tokens: tuple[str, ...]
    prompt_ids: tuple[int, ...]
    full_text: str
    first_logits: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def as_torch(self) -> torch.Tensor:
        """Prompt and generated ids as one [1, pos] LongTensor (TransformerLens' shape)."""
        return torch.tensor([[*self.prompt_ids, *self.token_ids]], dtype=torch.long)


_DECODINGS = ("with_prompt", "alone")       # how `generate` decodes ``text``


def generate(model: Model, prompt: str | Sequence[str], *, edits: Sequence[Edit] = (),
             step_edits: Callable[[int], Sequence[Edit]] | None = None,
             max_new_tokens: int = 20, temperature: float = 0.0, seed: int | None = None,
             stop_at_eos: bool = True, decode: str = "with_prompt",
             first_logits: bool = False) -> Generation | list[Generation]:
    """Generate up to ``max_new_tokens`` tokens after ``prompt`` with ``edits`` applied at
    every step (and ``step_edits(step)`` at step ``step``).

    Parameters
    ----------
    model : Model
    prompt : str or list of str
        One prompt (a `Generation` back) or several, run as one left-padded batch (a list
        back; an edit's ``prompts`` names rows of that list).
    edits : sequence of Edit
        Applied in every step's forward, over the whole sequence so far; positions count in
        that sequence (-1 is the token being predicted from).
    step_edits : callable, optional
        ``step_edits(step)`` gives the edit records of step ``step`` (0 for the first new
        token, 1 for the second, ...), applied after ``edits`` in that step's forward. At step
        s the sequence holds the prompt and the s tokens generated so far, so
        ``positions=tuple(range(-(s + 1), 0))`` names the last prompt token and every
        generated token. Its records are checked as ``edits`` are, at each step.
    max_new_tokens : int, default=20
    temperature : float, default=0
        0 takes the most likely token (greedy, as ``model.hf.generate`` without sampling);
        above 0 samples from softmax(logits / temperature).
    seed : int, optional
        Seeds the sampling (a torch.Generator of its own; the global RNG is not touched).
    stop_at_eos : bool, default=True
        A prompt stops after the tokenizer's end-of-text token.
    decode : {"with_prompt", "alone"}, default="with_prompt"
        How ``text`` is decoded from the new tokens (the end-of-text token left out).
        "with_prompt": the decoded prompt and continuation less the decoded prompt, so a
        token reads as it does after the prompt (a tokenizer may spell a token differently at
        the start of a text, e.g. without its leading space); where the decoded prompt is not
        the start of that text, the new tokens decoded alone. "alone":
        ``tokenizer.decode`` of the new tokens by themselves, as a script does with the ids
        that ``model.hf.generate`` added. ``full_text`` is the same either way.
    first_logits : bool, default=False
        Keep the first step's next-token logits on each Generation (``first_logits``).

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
    if step_edits is not None and not callable(step_edits):
        raise TypeError("`step_edits` must be a function of the step (0, 1, ...) that returns "
                        f"edit records; got {type(step_edits).__name__}.")
    check_choice("decode", decode, _DECODINGS)
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
    first = None
    for step in range(max_new_tokens):
        batch = model.batch_from_ids(ids)
        now = edits if step_edits is None else [
            *edits, *_edits_of_step(step_edits, step, len(prompts))]
        out = run_batch(model, batch, edits=now,
                        readouts=TraceRequest(save_positions=[-1], logits=True))
        logits = out["logits"][:, -1].float()                   # [prompt, vocab]
        if step == 0 and first_logits:
            first = logits.cpu()
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
        if decode == "with_prompt" and full.startswith(before):
            text = full[len(before):]
        else:
            text = model.tokenizer.decode(shown)
        results.append(Generation(
            prompt=p, text=text, token_ids=tuple(new), tokens=tuple(model.token_strings(new)),
            prompt_ids=tuple(head), full_text=full,
            first_logits=None if first is None else first[i]))
    return results[0] if single else results


def _edits_of_step(step_edits: Callable[[int], Sequence[Edit]], step: int,
                   n_prompts: int) -> list[Edit]:
    """``step_edits(step)`` as checked edit records (a TypeError names the step)."""
    got = step_edits(step)
    try:
        extra = check_edits(got)
    except TypeError as err:
        raise TypeError(f"`step_edits({step})` must return edit records: {err}") from None
    check_edit_rows(extra, n_prompts)
    return extra
