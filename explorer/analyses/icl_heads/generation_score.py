"""The ICL score of Yin & Steinhardt's ablation runs: F1 of a short generated answer.

Their ``src/ablate.py`` generates 5 tokens after each few-shot prompt (with the ablated
heads' output replaced at the newest token of every generation step), keeps the first run
of word characters, dots and spaces of the decoded text (``parse_generation``), and scores
it against the reference with the token-level F1 of ``src/utils/eval_utils.py`` (lower case,
punctuation and articles removed). `ablated_generations` reproduces the generation under
mean ablation and `parsed_f1` the scoring; `ablation_curves(score="f1")` uses both.

Two choices differ from that code and are said where they show: the decoding is greedy
(theirs samples with temperature 0.1 and top-p 0.9, which picks the most likely token unless
two are within a few tenths of a logit), and a generation that ends with the end-of-text
token is scored on the tokens before it (theirs decodes the last 5 tokens of the sequence,
prompt tokens included when generation stopped early).
"""
from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

import numpy as np
import torch

from explorer._checks import InputError, check_int
from explorer.generate import generate
from explorer.interventions import Ablate
from explorer.models import Model

__all__ = ["ANSWER_TOKENS", "normalize_answer", "f1_score", "parse_generation", "parsed_f1",
           "ablated_generations"]

#: Tokens generated per prompt in the paper's ablation runs (``MAX_NEW_TOKENS = 5``).
ANSWER_TOKENS = 5

_ANSWER = re.compile(r"([\w. ]+)[\nQ]*")


def normalize_answer(text: str) -> str:
    """Lower case, without punctuation, the articles a/an/the and repeated whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1_score(prediction: str, reference: str) -> float:
    """Token-level F1 of the normalised words of ``prediction`` against ``reference``."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def parse_generation(text: str) -> str:
    """The first run of word characters, dots and spaces in ``text`` ("" if none)."""
    found = _ANSWER.findall(text)
    return found[0] if found else ""


def parsed_f1(generated: str, reference: str) -> float:
    """F1 of the parsed answer (`parse_generation`) against ``reference``; 0 if none parses."""
    answer = parse_generation(generated)
    return f1_score(answer, reference) if answer else 0.0


def ablated_generations(model: Model, prompts: Sequence[str], heads: Sequence[tuple[int, int]],
                        mean_z: np.ndarray, *, max_new_tokens: int = ANSWER_TOKENS,
                        answer_ids: Sequence[int] | None = None,
                        edits=()) -> tuple[list[str], np.ndarray]:
    """Greedy continuations of ``prompts`` with ``heads`` mean-ablated as the paper generates.

    At step s each head of ``heads`` writes ``mean_z[layer, head]`` into its slice of the
    ``o_proj`` input at the prompt's last token and at the s tokens generated so far. That is
    what the paper's cached generation computes when it replaces the newest token's output at
    every step: the cached keys and values of those tokens were computed ablated, the
    earlier prompt tokens' were not. ``edits`` (the workspace's records) apply at every step
    as given. A row stops after the end-of-text token. The loop is `explorer.generate`'s,
    with the ablation as its ``step_edits``.

    Returns
    -------
    (texts, first_prob): the decoded continuation of each prompt (the end-of-text token left
    out), and the first step's probability of ``answer_ids[i]`` per prompt (NaN without
    ``answer_ids``). A list and an array, not a Dataset: the inner step whose values
    `ablation_curves` gathers into its Dataset.
    """
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, low=1)
    if answer_ids is not None and len(answer_ids) != len(prompts):
        raise InputError(f"`answer_ids` must have one id per prompt ({len(prompts)}); "
                         f"got {len(answer_ids)}.")

    def mean_ablation(step: int) -> list[Ablate]:
        positions = tuple(range(-(step + 1), 0))   # the last prompt token, the generated ones
        return [Ablate(int(l), int(h), mode="mean", value=mean_z[l, h], positions=positions)
                for l, h in heads]

    # decoded alone, as the paper decodes the generated ids
    gens = generate(model, list(prompts), edits=edits, step_edits=mean_ablation,
                    max_new_tokens=max_new_tokens, decode="alone",
                    first_logits=answer_ids is not None)
    first_prob = np.full(len(gens), np.nan)
    if answer_ids is not None:
        probs = torch.softmax(torch.stack([g.first_logits for g in gens]), -1)  # [prompt, vocab]
        first_prob = probs[torch.arange(len(gens)), torch.tensor(list(answer_ids))].numpy()
    return [g.text for g in gens], first_prob
