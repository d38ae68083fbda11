"""The facts (datasets/conflicts), the three ways of asking one (closed book, substitution,
coherent passage) and how an answer is matched."""
from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from explorer._checks import InputError, check_choice
from explorer.defaults import DATASETS_DIR
from explorer.models import Model

__all__ = [
    'PROMPT_KINDS', 'DIRECTIONS', 'METHODS', 'ENHANCE_ALPHAS', 'SUPPRESS_ALPHAS', 'CITATION',
    'Heads', 'Progress', 'Fact', 'facts_path', 'load_facts', 'conflict_prompt', 'normalise_answer',
    'answer_in',
]


PROMPT_KINDS = ("clean", "substitution", "coherent")


DIRECTIONS = ("parametric", "context")


METHODS = ("baseline", "single", "juice")


ENHANCE_ALPHAS = (1.0, 3.0, 5.0, 10.0, 30.0)


SUPPRESS_ALPHAS = (-1.0, -2.0, -5.0)


CITATION = ("Li, Chen & Tong, Taming Knowledge Conflicts in Language Models "
            "(JuICE), ICML 2025")


Heads = Sequence[tuple[int, int]]


Progress = Callable[[int, int], None] | None


@dataclass(frozen=True)
class Fact:
    """One fact with its templates; ``context`` is the false value the context asserts."""

    relation: str
    subject: str
    memory: str
    context: str
    clean: str
    statement: str
    passage: str
    question: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def facts_path() -> Path:
    """The shipped fact file, ``datasets/conflicts/facts.json``."""
    return DATASETS_DIR / "conflicts" / "facts.json"


def load_facts(relations: Sequence[str] | None = None, *, path: str | Path | None = None) -> list[Fact]:
    """Facts of the given relations (all if None); the context value of fact i is the
    memory value of fact i+1 of the same relation (a fixed rotation)."""
    path = Path(path) if path is not None else facts_path()
    if not path.is_file():
        raise InputError(f"fact file {str(path)!r} does not exist.")
    data = json.loads(path.read_text())["relations"]
    names = list(data) if relations is None else list(relations)
    if not names:
        raise InputError("`relations` must name at least one relation; got an empty list.")
    out = []
    for name in names:
        check_choice("relation", name, data)
        rel = data[name]
        pairs = rel["facts"]
        for i, (subject, value) in enumerate(pairs):
            other = pairs[(i + 1) % len(pairs)][1]
            out.append(Fact(name, subject, value, other, rel["clean"], rel["statement"],
                            rel["passage"], rel["question"]))
    return out


def conflict_prompt(fact: Fact, kind: str) -> str:
    """The ``clean`` / ``substitution`` / ``coherent`` prompt of a fact."""
    check_choice("kind", kind, PROMPT_KINDS)
    clean = fact.clean.format(subject=fact.subject)
    if kind == "clean":
        return clean
    if kind == "substitution":
        return fact.statement.format(subject=fact.subject, value=fact.context) + " " + clean
    passage = fact.passage.format(subject=fact.subject, value=fact.context)
    return passage + "\n" + fact.question.format(subject=fact.subject)


def normalise_answer(text: str) -> str:
    """Lower case, accents and punctuation stripped, spaces collapsed (JuICE's metric)."""
    text = unicodedata.normalize("NFKD", text)
    text = "".join(c for c in text if not unicodedata.combining(c)).lower()
    text = re.sub(r"[^\w\s]", " ", text)
    return " ".join(text.split())


def answer_in(answer: str, generated: str, *, n_words: int = 5) -> bool:
    """Whether the normalised answer appears as whole words in the first ``n_words``."""
    words = normalise_answer(generated).split()[:n_words]
    target = normalise_answer(answer).split()
    return any(words[i:i + len(target)] == target for i in range(len(words) - len(target) + 1))


def _first_token(model: Model, answer: str) -> int:
    """Id of the first token of `` answer`` (the answer follows a space in every template)."""
    return model.tokenizer(" " + answer, add_special_tokens=False)["input_ids"][0]
