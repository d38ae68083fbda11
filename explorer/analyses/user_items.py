"""Parsers for the user's own items on pages with task data.

Each parser reads pasted text and returns the library's own object, the same type the
shipped data loads into, so a page runs its analysis on it by the same path:

- `parse_conflict_example`: one knowledge-conflict example (``field: value`` lines) ->
  `explorer.analyses.conflicts.Fact`;
- `parse_icl_pairs`: ``input -> output`` lines -> `explorer.analyses.icl_heads.ICLTask`;
- `parse_unlearning_fact`: one fact (``subject`` / ``prompt`` / ``answer`` lines) ->
  `explorer.analyses.unlearning.AttributeFact`;
- `parse_circuit_pairs`: ``clean | corrupted | answer | wrong answer`` lines ->
  `explorer.analyses.circuit_tasks.CircuitTask` (checked against the model's tokenizer).

Bad input raises `explorer.InputError` with a one-line message naming the line and what is
wrong. Texts are used literally; ``{subject}`` (and ``{value}`` for conflicts) may be written
as in the shipped templates, and ``\\n`` in a ``field: value`` line stands for a line break.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from explorer._checks import InputError
from explorer.analyses.circuit_tasks import CircuitTask, continuation_token  # re-exported
from explorer.analyses.conflicts import Fact, normalise_answer
from explorer.analyses.icl_heads import ICLTask
from explorer.analyses.unlearning import AttributeFact, load_attribute_facts

__all__ = ["MAX_FIELD_CHARS", "MAX_PAIRS", "CONFLICT_FORMAT", "ICL_FORMAT", "UNLEARNING_FORMAT",
           "CIRCUIT_FORMAT", "parse_conflict_example", "parse_icl_pairs", "parse_unlearning_fact",
           "parse_circuit_pairs", "continuation_token"]

#: Longest value of one field (or one side of a pair), in characters.
MAX_FIELD_CHARS = 400
#: Most input -> output pairs of one pasted ICL task.
MAX_PAIRS = 64
#: Longest answer (memory / context value, ICL output, unlearning answer), in characters.
MAX_ANSWER_CHARS = 60

CONFLICT_FORMAT = ("subject: France\n"
                   "prompt: The capital city of France is\n"
                   "context: The capital city of France is Berlin.\n"
                   "memory: Paris\n"
                   "context answer: Berlin")
ICL_FORMAT = "hot -> cold\nbig -> small\nup -> down\nfast -> slow\nhappy -> sad"
CIRCUIT_FORMAT = (
    "When Mary and Tom went to the store, Tom gave a drink to | When Mary and Tom went to the "
    "store, Kate gave a drink to | Mary | Tom\n"
    "When Anna and Bob went to the park, Anna gave a ball to | When Anna and Bob went to the "
    "park, Jim gave a ball to | Bob | Anna")
UNLEARNING_FORMAT = ("subject: Serena Williams\n"
                     "prompt: Fact: Serena Williams plays the sport of\n"
                     "answer: tennis")

# accepted field names (lower case, spaces or underscores) -> Fact field
_CONFLICT_FIELDS = {
    "relation": "relation", "subject": "subject",
    "memory": "memory", "memory answer": "memory",
    "context answer": "context", "context value": "context",
    "prompt": "clean", "clean": "clean",
    "context": "statement", "statement": "statement", "context sentence": "statement",
    "passage": "passage", "question": "question",
}
_UNLEARNING_FIELDS = {"subject": "subject", "prompt": "trained", "trained": "trained",
                      "relation prompt": "trained", "answer": "attribute",
                      "attribute": "attribute", "mc": "mc"}


def _lines(text: object, what: str) -> list[tuple[int, str]]:
    """The non-blank lines of ``text`` with their 1-based numbers."""
    if not isinstance(text, str):
        raise InputError(f"{what} must be text; got {type(text).__name__}.")
    out = [(i, line.strip()) for i, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not out:
        raise InputError(f"{what} is empty; write it as e.g. "
                         f"{_one_line(_format_for(what))}.")
    return out


def _format_for(what: str) -> str:
    return {"the conflict example": CONFLICT_FORMAT, "the ICL pairs": ICL_FORMAT,
            "the prompt pairs": CIRCUIT_FORMAT}.get(
        what, UNLEARNING_FORMAT)


def _one_line(text: str) -> str:
    return " / ".join(text.splitlines())


def _check_length(n: int, name: str, value: str, limit: int = MAX_FIELD_CHARS) -> None:
    if len(value) > limit:
        raise InputError(f"line {n}: {name} is {len(value)} characters long; at most {limit}.")


def _fields(text: object, what: str, names: dict[str, str]) -> dict[str, tuple[int, str]]:
    """``field: value`` lines -> {field: (line, value)} under the canonical names."""
    out: dict[str, tuple[int, str]] = {}
    for n, line in _lines(text, what):
        key, sep, value = line.partition(":")
        key = " ".join(key.replace("_", " ").lower().split())
        if not sep:
            raise InputError(f"line {n}: {line[:40]!r} has no ':'; write one 'field: value' "
                             f"per line (fields: {', '.join(sorted(set(names)))}).")
        if key not in names:
            raise InputError(f"line {n}: unknown field {key!r}; the fields are "
                             f"{', '.join(sorted(set(names)))}.")
        field, value = names[key], value.strip().replace("\\n", "\n")
        if field in out:
            raise InputError(f"line {n}: {key!r} is given twice (also on line {out[field][0]}).")
        if not value:
            raise InputError(f"line {n}: {key!r} is empty.")
        _check_length(n, key, value)
        out[field] = (n, value)
    return out


def _template(n: int, name: str, text: str, **values: str) -> None:
    """Check that ``text`` formats with ``values`` (literal text or {subject}/{value})."""
    try:
        text.format(**values)
    except (KeyError, IndexError, ValueError) as e:
        raise InputError(f"line {n}: {name} has a brace the templates cannot fill ({e}); "
                         "use only {subject} and {value}, or no braces.") from None


def parse_conflict_example(text: str) -> Fact:
    """One knowledge-conflict example -> `Fact`.

    One ``field: value`` per line: ``prompt`` (the question the model completes),
    ``context`` (the sentence stating the false value), ``memory`` (the true answer) and
    ``context answer`` (the false value the context states); optional ``subject``,
    ``relation`` (default ``"yours"``), ``passage`` (the coherent prompt's passage, default
    the context sentence) and ``question`` (the coherent prompt's question, default the
    prompt). The substitution prompt is ``context + " " + prompt``, as for the shipped facts.
    """
    got = _fields(text, "the conflict example", _CONFLICT_FIELDS)
    for field, key in (("clean", "prompt"), ("statement", "context"), ("memory", "memory"),
                       ("context", "context answer")):
        if field not in got:
            raise InputError(f"the conflict example has no {key!r} line; it needs prompt, "
                             f"context, memory and context answer (e.g. "
                             f"{_one_line(CONFLICT_FORMAT)}).")
    for field in ("memory", "context"):
        n, value = got[field]
        _check_length(n, "the answer", value, MAX_ANSWER_CHARS)
    (_, memory), (nc, context) = got["memory"], got["context"]
    if normalise_answer(memory) == normalise_answer(context):
        raise InputError(f"line {nc}: the context answer {context!r} is the memory answer; a "
                         "conflict needs two different answers.")
    subject = got.get("subject", (0, ""))[1]
    values = dict(subject=subject, value=context)
    for field in ("clean", "statement", "passage", "question"):
        if field in got:
            _template(got[field][0], field, got[field][1], **values)
    statement = got["statement"][1]
    return Fact(relation=got.get("relation", (0, "yours"))[1], subject=subject, memory=memory,
                context=context, clean=got["clean"][1], statement=statement,
                passage=got.get("passage", (0, statement))[1],
                question=got.get("question", got["clean"])[1])


def parse_icl_pairs(text: str, *, name: str = "yours", description: str = "your pairs",
                    min_pairs: int = 3) -> ICLTask:
    """``input -> output`` lines (one pair a line, at least ``min_pairs``) -> `ICLTask`."""
    pairs: list[tuple[str, str]] = []
    seen: dict[str, int] = {}
    for n, line in _lines(text, "the ICL pairs"):
        x, sep, y = line.partition("->")
        if not sep:
            raise InputError(f"line {n}: {line[:40]!r} has no '->'; write one 'input -> "
                             "output' pair per line.")
        x, y = x.strip(), y.strip()
        if not x:
            raise InputError(f"line {n}: the input before '->' is empty.")
        if not y:
            raise InputError(f"line {n}: the output after '->' is empty.")
        if "->" in y:
            raise InputError(f"line {n}: more than one '->'; one pair per line.")
        _check_length(n, "the input", x)
        _check_length(n, "the output", y, MAX_ANSWER_CHARS)
        if x in seen:
            raise InputError(f"line {n}: the input {x!r} is already on line {seen[x]}.")
        seen[x] = n
        pairs.append((x, y))
        if len(pairs) > MAX_PAIRS:
            raise InputError(f"line {n}: more than {MAX_PAIRS} pairs; keep at most {MAX_PAIRS}.")
    if len(pairs) < min_pairs:
        raise InputError(f"{len(pairs)} pair(s); the task needs at least {min_pairs} "
                         "'input -> output' lines.")
    return ICLTask(name, tuple(pairs), description)


def parse_unlearning_fact(text: str, *, attributes: Sequence[str] | None = None,
                          mc: str | None = None) -> AttributeFact:
    """One fact -> `AttributeFact`, in the shipped fact format.

    Lines ``subject: ...``, ``prompt: ...`` (the relation prompt the model completes; it
    contains the subject, or ``{subject}``) and ``answer: ...`` (one of ``attributes``, default
    the shipped relation's); optional ``mc: ...`` (the multiple-choice template, default the
    shipped one). The prompt becomes the fact's ``trained`` template.
    """
    got = _fields(text, "the fact", _UNLEARNING_FIELDS)
    for field, key in (("subject", "subject"), ("trained", "prompt"), ("attribute", "answer")):
        if field not in got:
            raise InputError(f"the fact has no {key!r} line; it needs subject, prompt and answer "
                             f"(e.g. {_one_line(UNLEARNING_FORMAT)}).")
    shipped = None
    if attributes is None or mc is None:
        shipped = load_attribute_facts()[0]
    attributes = tuple(shipped.attributes if attributes is None else attributes)
    (_, subject), (np_, prompt), (na, answer) = got["subject"], got["trained"], got["attribute"]
    _check_length(na, "the answer", answer, MAX_ANSWER_CHARS)
    if answer not in attributes:
        raise InputError(f"line {na}: the answer {answer!r} is not one of the relation's "
                         f"answers ({', '.join(attributes)}).")
    if "{subject}" not in prompt:
        if subject not in prompt:
            raise InputError(f"line {np_}: the prompt does not contain the subject {subject!r}.")
        head, _, tail = prompt.partition(subject)
        prompt = head.replace("{", "{{").replace("}", "}}") + "{subject}" + \
            tail.replace("{", "{{").replace("}", "}}")
    try:
        prompt.format(subject=subject)
    except (KeyError, IndexError, ValueError) as e:
        raise InputError(f"line {np_}: the prompt has a brace it cannot fill ({e}); use only "
                         "{subject}, or no braces.") from None
    mc_template = got["mc"][1] if "mc" in got else (shipped.mc if mc is None else mc)
    return AttributeFact(subject, answer, attributes, prompt, mc_template)


_CIRCUIT_FIELDS = ("the clean prompt", "the corrupted prompt", "the answer", "the wrong answer")


def _unquote(field: str) -> tuple[str, bool]:
    """A field as written between the bars: stripped, or, in double quotes, exactly as quoted."""
    field = field.strip()
    if len(field) >= 2 and field[0] == field[-1] == '"':
        return field[1:-1], True
    return field, False


def parse_circuit_pairs(text: str, model: Any = None, *, name: str = "your pairs",
                        max_pairs: int = MAX_PAIRS) -> CircuitTask:
    """``clean prompt | corrupted prompt | answer | wrong answer`` lines -> `CircuitTask`.

    One pair a line (at most ``max_pairs``). The answer is what the model should say after
    the clean prompt, the wrong answer what the corrupted prompt points to; the circuit's
    metric is their logit difference at the first token of each. Spaces around the bars
    are dropped, and an answer continues its prompt after one space (`` Mary``); a field in
    double quotes is kept exactly, spaces included (``"... = "`` ends a prompt in a space,
    ``"90"`` joins an answer without one).

    With ``model`` (an `explorer.Model`), each pair is checked against its tokenizer: the
    clean and corrupted prompts must have the same number of tokens, the answer and wrong
    answer must start with different known tokens.
    """
    tokenizer = getattr(model, "tokenizer", None)
    unk = getattr(tokenizer, "unk_token_id", None)
    clean, corrupt, answer, wrong = [], [], [], []
    seen: dict[tuple[str, ...], int] = {}
    for n, line in _lines(text, "the prompt pairs"):
        parts = line.split("|")
        if len(parts) != 4:
            raise InputError(f"line {n}: {len(parts)} field(s); write 4 separated by '|': clean "
                             "prompt | corrupted prompt | answer | wrong answer.")
        fields = [_unquote(p) for p in parts]
        for (value, _), what in zip(fields, _CIRCUIT_FIELDS):
            if not value.strip():
                raise InputError(f"line {n}: {what} is empty.")
        (c, _), (k, _) = fields[:2]
        _check_length(n, "the clean prompt", c)
        _check_length(n, "the corrupted prompt", k)
        if c == k:
            raise InputError(f"line {n}: the corrupted prompt is the clean prompt; it must differ "
                             "(e.g. another name or operand) so that the answers differ.")
        targets = []
        for (value, quoted), what, prompt in zip(fields[2:], _CIRCUIT_FIELDS[2:], (c, c)):
            _check_length(n, what, value, MAX_ANSWER_CHARS)
            if not quoted and not value[0].isspace() and not prompt[-1].isspace():
                value = " " + value   # the answer continues the prompt after a space
            targets.append(value)
        a, w = targets
        if a == w:
            raise InputError(f"line {n}: the answer and the wrong answer are both {a.strip()!r}; "
                             "they must differ.")
        key = (c, k, a, w)
        if key in seen:
            raise InputError(f"line {n}: the same pair as line {seen[key]}.")
        seen[key] = n
        if tokenizer is not None:
            lc = len(tokenizer(c, add_special_tokens=False)["input_ids"])
            lk = len(tokenizer(k, add_special_tokens=False)["input_ids"])
            if lc != lk:
                raise InputError(f"line {n}: the clean prompt has {lc} tokens and the corrupted "
                                 f"prompt {lk}; they must have the same number (change words "
                                 "for words of as many tokens).")
            ids = [continuation_token(tokenizer, c, t) for t in (a, w)]
            for t, i, what in zip((a, w), ids, _CIRCUIT_FIELDS[2:]):
                if unk is not None and i == unk and t.strip() != tokenizer.unk_token:
                    raise InputError(f"line {n}: {what} {t!r} is not in the model's vocabulary "
                                     f"(it reads as {tokenizer.unk_token!r}).")
            if ids[0] == ids[1]:
                token = tokenizer.decode([ids[0]])
                raise InputError(
                    f"line {n}: the answer {a!r} and the wrong answer {w!r} both start with the "
                    f"token {token!r}, so their logit difference is always 0; choose answers whose "
                    f"first tokens differ (in quotes a prompt may end in a space, \"... = \", and "
                    f"an answer join it without one, \"90\").")
        clean.append(c), corrupt.append(k), answer.append(a), wrong.append(w)
        if len(clean) > max_pairs:
            raise InputError(f"line {n}: more than {max_pairs} pairs; keep at most {max_pairs}.")
    return CircuitTask(clean, corrupt, answer, wrong, name=name)
