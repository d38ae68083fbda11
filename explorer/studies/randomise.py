"""Seeded, balanced assignment of conditions and item order to participant slots.

A participant takes the next free *slot*; everything a slot sees is a function of
``(study.seed, slot)`` alone, so the whole schedule can be recomputed from the study file.

- ``between`` design: each slot gets one condition, by permuted blocks (every block of
  ``n_conditions`` consecutive slots holds each condition once), so group sizes never
  differ by more than one at any point of enrolment.
- ``within`` design: each slot sees every item, each under one condition, by a Latin
  square: item ``j`` (in file order) gets condition ``(j + offset) mod n_conditions``,
  with the offsets given out by permuted blocks. Every participant sees each condition
  equally often, and over each block every item is seen once under every condition.

Item order is a fresh uniform permutation per slot; attention-check items (if any) go to
uniform random places after the first item.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from explorer._checks import check_int

from .schema import Study

__all__ = ["Trial", "ATTENTION_CONDITION", "block_permutation", "participant_schedule",
           "study_schedule", "attention_item_id", "task_item_id"]

#: The condition name of attention-check items (not a study condition; never analysed as one).
ATTENTION_CONDITION = "attention_check"

# Stream tags: different purposes draw from independent streams of the same seed.
_BLOCK, _ORDER, _CHECKS = 1, 2, 3


@dataclass(frozen=True)
class Trial:
    """One item as a participant sees it: its place in their sequence and its condition."""

    index: int
    item_id: str
    condition: str


def task_item_id(j: int) -> str:
    """Id of the ``j``-th prompt of the study (0-based): ``item-001``."""
    return f"item-{j + 1:03d}"


def attention_item_id(j: int) -> str:
    """Id of the ``j``-th attention-check item (0-based): ``check-1``."""
    return f"check-{j + 1}"


def _rng(seed: int, *stream: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(seed), *stream]))


def block_permutation(seed: int, slot: int, n: int) -> int:
    """The value in ``0..n-1`` that permuted-block randomisation gives ``slot``.

    Slots ``b*n .. b*n+n-1`` hold a uniform random permutation of ``0..n-1`` drawn from
    ``(seed, b)``, so every complete block is exactly balanced.
    """
    check_int("slot", slot, low=0)
    block, place = divmod(slot, n)
    return int(_rng(seed, _BLOCK, block).permutation(n)[place])


def participant_schedule(study: Study, slot: int) -> list[Trial]:
    """The trials of participant slot ``slot``, in the order they are shown.

    Parameters
    ----------
    study : Study
    slot : int
        0-based enrolment slot, below ``study.participants``.

    Returns
    -------
    list of Trial
        ``len(study.prompts) + study.task.attention_checks`` trials (``index`` 0, 1, ...).
    """
    check_int("slot", slot, low=0, high=study.participants - 1)
    names = study.condition_names
    n_cond, n_items = len(names), len(study.prompts)
    offset = block_permutation(study.seed, slot, n_cond)
    if study.design == "between":
        conditions = [names[offset]] * n_items
    else:
        conditions = [names[(j + offset) % n_cond] for j in range(n_items)]
    order = _rng(study.seed, _ORDER, slot).permutation(n_items)
    sequence = [(task_item_id(int(j)), conditions[int(j)]) for j in order]
    n_checks = study.task.attention_checks
    if n_checks:
        rng = _rng(study.seed, _CHECKS, slot)
        # insertion points among the n_items gaps after the first item
        where = np.sort(rng.choice(np.arange(1, n_items + 1), size=n_checks, replace=True))
        for k, place in enumerate(where[::-1]):
            sequence.insert(int(place), (attention_item_id(n_checks - 1 - k), ATTENTION_CONDITION))
    return [Trial(index=i, item_id=item, condition=cond) for i, (item, cond) in enumerate(sequence)]


def study_schedule(study: Study) -> list[list[Trial]]:
    """`participant_schedule` of every slot, ``0 .. study.participants - 1``."""
    return [participant_schedule(study, slot) for slot in range(study.participants)]
