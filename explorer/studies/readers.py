"""Simulated participants who read what the page shows them.

`simulated_responses` draws answers with accuracies given in advance, which checks the
pipeline but says nothing about an explanation. A *reader* answers from the trial's display
(what `StudyRun.trial_display` gives the participant app, never the answer key), so its
accuracy under each condition measures how much the shown explanation points at the right
choice:

- with probability ``reliance`` it follows the explanation: for the logit lens, the choice
  ranked highest in the deepest shown layer that lists any of the choices (ties by
  probability); for head attributions, the candidate head with the largest direct effect;
- otherwise, and whenever the explanation names none of the choices (or there is none, as
  in a baseline), it guesses uniformly among the choices;
- on an attention check it picks the word the question names.

A placebo is read by the same rule, so a reader's placebo accuracy is what the form of the
explanation alone gives a literal reader.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from explorer._checks import check_float

__all__ = ["reader_choice", "explanation_pick"]

_HEAD = re.compile(r"^L(\d+) H(\d+)$")
_CHECK_WORD = re.compile(r"choose the option '([^']+)'")


def explanation_pick(display: Mapping[str, Any]) -> int | None:
    """The choice an explanation points at, or None when it names none of the choices.

    Parameters
    ----------
    display : mapping
        A trial's display (`StudyRun.trial_display`): ``choices`` and ``explanation``.
    """
    e = display.get("explanation")
    choices = list(display["choices"])
    if e is None:
        return None
    if e["kind"] == "logit_lens":
        for tokens, probs in zip(reversed(e["tokens"]), reversed(e["probs"])):
            shown = [(p, -choices.index(t)) for t, p in zip(tokens, probs) if t in choices]
            if shown:
                return -max(shown)[1]
        return None
    if e["kind"] == "head_attribution":
        scores = e["scores"]
        best, pick = None, None
        for i, label in enumerate(choices):
            m = _HEAD.match(label)
            if m is None:
                continue
            value = scores[int(m.group(1))][int(m.group(2))]
            if best is None or value > best:
                best, pick = value, i
        return pick
    raise ValueError(f"unknown explanation kind {e['kind']!r}; readers know 'logit_lens' and "
                     f"'head_attribution'.")


def reader_choice(display: Mapping[str, Any], rng: np.random.Generator, *,
                  reliance: float = 1.0) -> int:
    """The answer a reader gives to one trial (an index into ``display["choices"]``).

    Parameters
    ----------
    display : mapping
        A trial's display (`StudyRun.trial_display`).
    rng : numpy.random.Generator
        The reader's random stream (one draw for reliance, one for a guess).
    reliance : float, default=1.0
        Probability in [0, 1] of following the explanation when there is one.
    """
    reliance = check_float("reliance", reliance, low=0.0, high=1.0)
    n = len(display["choices"])
    if display.get("attention_check"):
        m = _CHECK_WORD.search(display["question"])
        if m is not None and m.group(1) in display["choices"]:
            return list(display["choices"]).index(m.group(1))
    reads = rng.random() < reliance
    pick = explanation_pick(display) if reads else None
    guess = int(rng.integers(n))
    return guess if pick is None else pick
