"""The few-shot ICL tasks (datasets/icl) and their prompts, answer ids and last-token
probabilities."""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from explorer._checks import check_choice, check_int
from explorer.defaults import DATASETS_DIR
from explorer.models import Model
from explorer.trace import run_with

__all__ = [
    'CITATION', 'ICL_DIR', 'ICLTask', 'icl_task_names', 'load_icl_task', 'as_icl_task',
    'icl_prompts', 'answer_token_ids', 'last_token_probs',
]


CITATION = ("K. Yin, J. Steinhardt, \"Which Attention Heads Matter for In-Context Learning?\", "
            "ICML 2025; E. Todd et al., \"Function Vectors in Large Language Models\", ICLR 2024.")


#: The shipped ICL tasks (see datasets/README.md).
ICL_DIR = DATASETS_DIR / "icl"


@dataclass(frozen=True)
class ICLTask:
    """One ICL task: a name and its (input, output) pairs."""

    name: str
    pairs: tuple[tuple[str, str], ...]
    description: str = ""


def icl_task_names(folder: str | Path | None = None) -> list[str]:
    """Names of the tasks in ``folder`` (default the shipped `ICL_DIR`), sorted."""
    folder = Path(folder) if folder is not None else ICL_DIR
    return sorted(p.stem for p in folder.glob("*.json"))


def load_icl_task(name: str, folder: str | Path | None = None) -> ICLTask:
    """Load one task file ``<folder>/<name>.json``; unknown names raise InputError."""
    folder = Path(folder) if folder is not None else ICL_DIR
    check_choice("task", name, icl_task_names(folder))
    data = json.loads((folder / f"{name}.json").read_text(encoding="utf-8"))
    pairs = tuple((str(p["input"]), str(p["output"])) for p in data["pairs"])
    return ICLTask(name, pairs, data.get("description", ""))


def as_icl_task(t: ICLTask | str) -> ICLTask:
    """``t`` itself, or the shipped task of that name (`load_icl_task`)."""
    return t if isinstance(t, ICLTask) else load_icl_task(t)


def icl_prompts(task: ICLTask | str, *, n_prompts: int = 8, n_shots: int = 5, seed: int = 0,
                shuffle_labels: bool = False) -> tuple[list[str], list[str]]:
    """Few-shot prompts ``"Q: x\\nA: y\\n\\n" * n_shots + "Q: x_q\\nA:"`` and their answers.

    ``shuffle_labels`` permutes the demonstrations' outputs among themselves (the corrupted
    prompts of Todd et al.); the query and its answer are unchanged. ``n_shots=0`` gives
    zero-shot prompts.

    A pair of lists (prompts, answers): plain strings, which every runner (`explorer.trace`,
    `run_with`, the pages) takes as they are.
    """
    task = as_icl_task(task)
    n_prompts = check_int("n_prompts", n_prompts, low=1)
    n_shots = check_int("n_shots", n_shots, low=0, high=len(task.pairs) - 1)
    rng = np.random.default_rng(seed)
    picks = [rng.choice(len(task.pairs), size=n_shots + 1, replace=False) for _ in range(n_prompts)]
    rng = np.random.default_rng([seed, 1])  # the label shuffle: same demos with or without
    prompts, answers = [], []
    for idx in picks:
        demos = [task.pairs[i] for i in idx[:-1]]
        if shuffle_labels and n_shots > 1:
            outs = [y for _, y in demos]
            perm = rng.permutation(n_shots)
            while np.all(perm == np.arange(n_shots)):
                perm = rng.permutation(n_shots)
            demos = [(x, outs[j]) for (x, _), j in zip(demos, perm)]
        q, a = task.pairs[idx[-1]]
        prompts.append("".join(f"Q: {x}\nA: {y}\n\n" for x, y in demos) + f"Q: {q}\nA:")
        answers.append(a)
    return prompts, answers


def answer_token_ids(model: Model, answers: Sequence[str]) -> list[int]:
    """The first token of ``" " + answer`` for each answer (the token scored after ``A:``)."""
    return [model.tokenizer(" " + a, add_special_tokens=False)["input_ids"][0] for a in answers]


def last_token_probs(model: Model, batch: Any, edits=(), resume=None) -> torch.Tensor:
    """Next-token probabilities at each prompt's last token: [prompt, vocab]."""
    logits = run_with(model, batch, edits, positions=[-1], resume=resume).logits
    return torch.softmax(torch.from_numpy(logits.values[:, -1]), dim=-1)
