"""Clean/corrupted prompt pairs for circuit discovery: arithmetic, IOI, greater-than.

Each generator returns a `CircuitTask`: pairwise clean and corrupted prompts whose
answers differ, with the target strings of the logit difference (``answer`` is right for
the clean prompt, ``wrong`` is what the corrupted prompt points to). The logit difference
is read at the first token of each target as it continues the prompt, so a tokenizer that
splits numbers into digits (SmolLM2) is scored on the first digit.

The names, objects and templates of the IOI and greater-than tasks are in
``datasets/circuits/`` (see ``datasets/README.md``); the arithmetic problems are generated.

References: Wang et al., "Towards Understanding Fine-Tuning Mechanisms of LLMs via Circuit
Analysis", ICML 2025 (arithmetic prompts); Wang et al., "Interpretability in the Wild", ICLR
2023 (IOI); Hanna et al., "How does GPT-2 compute greater-than?", NeurIPS 2023.
"""
from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xarray as xr

from explorer.defaults import DATASETS_DIR
from explorer._checks import InputError, check_choice, check_int
from explorer.models import Model
from explorer.trace import provenance, run_with

__all__ = ["prompt_task", "TokenReplacement", "token_replacement", "token_spans", "CircuitTask", "BASELINES", "task_generators", "make_task", "TASK_NAMES", "ARITHMETIC_TEMPLATE",
           "CORRUPTIONS", "task_accuracy", "filter_task", "continuation_token", "name_variants"]

#: The instruction prompt of Wang et al. (ICML 2025), ending in "= " so that the next token
#: is the answer's first digit for tokenizers that split numbers into digits.
ARITHMETIC_TEMPLATE = ("Calculate the result of the following arithmetic expression and provide "
                       "only the final answer: {a} {op} {b} = ")


BASELINES = ("counterfactual", "mean")   # what a patched edge carries (`CircuitTask.baseline`)


@dataclass
class CircuitTask:
    """Pairs of clean and corrupted prompts with the targets of the logit difference.

    ``clean[i]`` and ``corrupt[i]`` must tokenise to the same length. ``answer[i]`` is the
    right continuation of ``clean[i]``; ``wrong[i]`` the continuation the corrupted prompt
    points to.

    ``baseline`` says what a patched edge carries: ``"counterfactual"`` (the corrupted
    prompt's activations) or ``"mean"`` (mean ablation: each node's output averaged over the
    positions of its own clean prompt; ``corrupt`` then repeats ``clean`` and is not run).
    """

    clean: list[str]
    corrupt: list[str]
    answer: list[str]
    wrong: list[str]
    name: str = "custom"
    baseline: str = "counterfactual"

    def __post_init__(self) -> None:
        for field in ("clean", "corrupt", "answer", "wrong"):
            value = getattr(self, field)
            if isinstance(value, str) or not isinstance(value, (list, tuple)):
                raise TypeError(f"`{field}` must be a list of strings; got {type(value).__name__}.")
            setattr(self, field, list(value))
            for i, s in enumerate(value):
                if not isinstance(s, str):
                    raise TypeError(f"`{field}[{i}]` must be a string; got {type(s).__name__}.")
        if self.baseline not in BASELINES:
            raise InputError(f"`baseline` must be one of {list(BASELINES)}; got "
                             f"{self.baseline!r}.")
        n = len(self.clean)
        if n == 0:
            raise InputError("a CircuitTask needs at least one prompt pair; `clean` is empty.")
        for field in ("corrupt", "answer", "wrong"):
            if len(getattr(self, field)) != n:
                raise InputError(f"`{field}` has {len(getattr(self, field))} entries but `clean` "
                                 f"has {n}; they must be the same length.")

    def __len__(self) -> int:
        return len(self.clean)

    def subset(self, index: Any) -> CircuitTask:
        """The task restricted to the pairs at ``index`` (a list of ints)."""
        idx = [int(i) for i in index]
        return CircuitTask([self.clean[i] for i in idx], [self.corrupt[i] for i in idx],
                           [self.answer[i] for i in idx], [self.wrong[i] for i in idx], self.name,
                           self.baseline)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "clean": self.clean, "corrupt": self.corrupt,
                "answer": self.answer, "wrong": self.wrong, "baseline": self.baseline}


def _data_dir() -> Path:
    return DATASETS_DIR / "circuits"


def _load(name: str) -> dict[str, Any]:
    return json.loads((_data_dir() / name).read_text())


def _arithmetic_pairs(n: int, rng: random.Random) -> list[tuple[int, int]]:
    """Distinct (a, b), two-digit, with a + b <= 99 and a - b >= 10 (both results two-digit).

    Then a + b and a - b differ by 2b >= 20, so their first digits differ.
    """
    pool = [(a, b) for b in range(10, 45) for a in range(b + 10, 100 - b)]
    if n > len(pool):
        raise InputError(f"`n` must be at most {len(pool)} for the arithmetic tasks; got {n}.")
    return rng.sample(pool, n)


def _add(n: int, rng: random.Random) -> CircuitTask:
    pairs = _arithmetic_pairs(n, rng)
    return CircuitTask(
        clean=[ARITHMETIC_TEMPLATE.format(a=a, op="+", b=b) for a, b in pairs],
        corrupt=[ARITHMETIC_TEMPLATE.format(a=a, op="-", b=b) for a, b in pairs],
        answer=[str(a + b) for a, b in pairs], wrong=[str(a - b) for a, b in pairs], name="add")


def _sub(n: int, rng: random.Random) -> CircuitTask:
    pairs = _arithmetic_pairs(n, rng)
    return CircuitTask(
        clean=[ARITHMETIC_TEMPLATE.format(a=a, op="-", b=b) for a, b in pairs],
        corrupt=[ARITHMETIC_TEMPLATE.format(a=a, op="+", b=b) for a, b in pairs],
        answer=[str(a - b) for a, b in pairs], wrong=[str(a + b) for a, b in pairs], name="sub")


def _ioi(n: int, rng: random.Random) -> CircuitTask:
    """IOI: "When Mary and John went to the store, John gave a drink to" -> " Mary".

    The corrupted prompt replaces the second mention of the subject by a third name (the
    "ABC" distribution of Wang et al. 2023), so nothing points to the indirect object.
    """
    data = _load("ioi.json")
    names, places, objects, templates = data["names"], data["places"], data["objects"], data["templates"]
    clean, corrupt, answer, wrong = [], [], [], []
    for _ in range(n):
        io, s, c = rng.sample(names, 3)
        t = rng.choice(templates)
        place, obj = rng.choice(places), rng.choice(objects)
        first = [io, s] if rng.random() < 0.5 else [s, io]
        fill = dict(A=first[0], B=first[1], PLACE=place, OBJECT=obj)
        clean.append(t.format(S2=s, **fill))
        corrupt.append(t.format(S2=c, **fill))
        answer.append(" " + io)
        wrong.append(" " + s)
    return CircuitTask(clean, corrupt, answer, wrong, name="ioi")


def _greater_than(n: int, rng: random.Random) -> CircuitTask:
    """Greater-than: "The war lasted from the year 1743 to the year 17" -> a later decade.

    With digit tokenizers the next token is the end year's tens digit. ``answer`` is the
    decade after the start year's (tens digit + 1), ``wrong`` the decade before (tens digit
    - 1). The corrupted prompt starts at year ..01 (Hanna et al.), so the start year gives
    no decade to exceed.
    """
    data = _load("greater_than.json")
    nouns, templates = data["nouns"], data["templates"]
    centuries = data["centuries"]
    clean, corrupt, answer, wrong = [], [], [], []
    for _ in range(n):
        tens = rng.randint(2, 8)
        ones = rng.randint(0, 9)
        century = rng.choice(centuries)
        t = rng.choice(templates)
        noun = rng.choice(nouns)
        clean.append(t.format(NOUN=noun, CC=century, YY=f"{tens}{ones}"))
        corrupt.append(t.format(NOUN=noun, CC=century, YY="01"))
        answer.append(str(tens + 1))
        wrong.append(str(tens - 1))
    return CircuitTask(clean, corrupt, answer, wrong, name="greater-than")


def _operand_choices(a: int, b: int, op: str) -> list[int]:
    """Second operands b2 != b (two-digit) whose result is two-digit and starts with another
    digit than the clean result, so the two targets differ in the scored first digit."""
    clean = a + b if op == "+" else a - b
    out = []
    for b2 in range(10, 100):
        r = a + b2 if op == "+" else a - b2
        if b2 != b and 10 <= r <= 99 and str(r)[0] != str(clean)[0]:
            out.append(b2)
    return out


def _operand_task(n: int, rng: random.Random, op: str, name: str) -> CircuitTask:
    """Arithmetic pairs whose corrupted prompt keeps the operator and changes the second
    operand (b -> b2); ``wrong`` is the corrupted prompt's result."""
    pool = [(a, b) for b in range(10, 45) for a in range(b + 10, 100 - b)
            if _operand_choices(a, b, op)]
    if n > len(pool):
        raise InputError(f"`n` must be at most {len(pool)} for the {name!r} task with operand "
                         f"corruption; got {n}.")
    pairs = rng.sample(pool, n)
    second = [rng.choice(_operand_choices(a, b, op)) for a, b in pairs]

    def result(a: int, b: int) -> str:
        return str(a + b if op == "+" else a - b)

    return CircuitTask(
        clean=[ARITHMETIC_TEMPLATE.format(a=a, op=op, b=b) for a, b in pairs],
        corrupt=[ARITHMETIC_TEMPLATE.format(a=a, op=op, b=b2) for (a, _), b2 in zip(pairs, second)],
        answer=[result(a, b) for a, b in pairs],
        wrong=[result(a, b2) for (a, _), b2 in zip(pairs, second)], name=name)


#: Corruptions of the arithmetic tasks: "operator" flips + and - (same operands, the default),
#: "operand" keeps the operator and changes the second operand.
CORRUPTIONS = ("operator", "operand")

#: Task name -> generator(n, rng).
task_generators: dict[str, Callable[[int, random.Random], CircuitTask]] = {
    "add": _add,
    "sub": _sub,
    "ioi": _ioi,
    "greater-than": _greater_than,
}

TASK_NAMES = tuple(task_generators)


def make_task(name: str, n: int, *, seed: int = 0, corruption: str = "operator") -> CircuitTask:
    """``n`` clean/corrupted prompt pairs of the task ``name``, reproducible from ``seed``.

    Parameters
    ----------
    name : {"add", "sub", "ioi", "greater-than"}
    n : int
        Number of pairs (at least 1).
    seed : int, default=0
    corruption : {"operator", "operand"}, default="operator"
        Arithmetic tasks only: the corrupted prompt flips the operator (``67 + 23`` vs
        ``67 - 23``) or keeps it and changes the second operand (``67 + 23`` vs ``67 + 12``,
        a result starting with another digit). IOI and greater-than have their own
        corruption and take only the default.

    Examples
    --------
    >>> make_task("add", 1).clean[0][-10:]
    '67 + 23 = '
    """
    check_choice("task", name, TASK_NAMES)
    n = check_int("n", n, low=1)
    seed = check_int("seed", seed)
    check_choice("corruption", corruption, CORRUPTIONS)
    if corruption == "operand":
        if name not in ("add", "sub"):
            raise InputError(f"corruption='operand' applies to the arithmetic tasks 'add' and "
                             f"'sub'; {name!r} has its own corruption (use the default).")
        return _operand_task(n, random.Random(seed), "+" if name == "add" else "-", name)
    return task_generators[name](n, random.Random(seed))


# -- the targets of the metric, and which pairs the model solves -----------------------------

def _check_task(task: Any) -> CircuitTask:
    if not isinstance(task, CircuitTask):
        raise TypeError(f"`task` must be a CircuitTask (see make_task); got {type(task).__name__}.")
    return task


def _readable_tokens(model: Model, prompt: str, order: Sequence[int], limit: int = 200):
    """The token ids of ``order`` (the first ``limit``) that a target string can name: they
    decode to text whose first token after the prompt is the same id (not a byte fragment)."""
    for t in order[:limit]:
        text = model.tokenizer.decode([int(t)])
        if text and continuation_token(model.tokenizer, prompt, text) == int(t):
            yield int(t)


def continuation_token(tokenizer: Any, prompt: str, target: str) -> int:
    """The first token of ``target`` as it continues ``prompt`` (what the circuit metric
    reads): the token after the prompt's own tokens when ``prompt + target`` starts with them,
    else the first token of ``target`` alone."""
    p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    both = tokenizer(prompt + target, add_special_tokens=False)["input_ids"]
    if both[:len(p_ids)] == p_ids and len(both) > len(p_ids):
        return int(both[len(p_ids)])
    return int(tokenizer(target, add_special_tokens=False)["input_ids"][0])


def _target_ids(model: Model, prompts: Sequence[str], targets: Sequence[str]) -> list[int]:
    """First token of each target as it continues its prompt (`continuation_token`)."""
    out = []
    for prompt, target in zip(prompts, targets):
        if not target:
            raise InputError(f"empty target string for the prompt {prompt[-40:]!r}.")
        out.append(continuation_token(model.tokenizer, prompt, target))
    return out


def _batches(n: int, batch_size: int) -> list[list[int]]:
    return [list(range(i, min(i + batch_size, n))) for i in range(0, n, batch_size)]


def task_accuracy(model: Model, task: CircuitTask, *, batch_size: int = 16) -> xr.Dataset:
    """Per pair: the model's top token on the clean prompt, and whether it is the answer's.

    Returns
    -------
    xr.Dataset
        Over ``prompt``: ``correct`` (argmax == first answer token), ``distinct`` (answer and
        wrong targets start with different tokens), ``same_length`` (clean and corrupted
        prompts tokenise to the same length), ``logit_diff`` (clean run), ``top_token``.
    """
    task = _check_task(task)
    batch_size = check_int("batch_size", batch_size, low=1)

    correct, distinct, same, diff, top = [], [], [], [], []
    for rows in _batches(len(task), batch_size):
        clean_p = [task.clean[i] for i in rows]
        batch = model.tokenize(clean_p)
        lens_c = model.tokenize([task.corrupt[i] for i in rows]).lengths
        ans = torch.tensor(_target_ids(model, clean_p, [task.answer[i] for i in rows]))
        wrong = torch.tensor(_target_ids(model, clean_p, [task.wrong[i] for i in rows]))
        logits = torch.from_numpy(run_with(model, batch, positions=[-1]).logits.values[:, 0])
        am = logits.argmax(-1)
        r = torch.arange(len(rows))
        correct += (am == ans).tolist()
        distinct += (ans != wrong).tolist()
        same += [a == c for a, c in zip(batch.lengths, lens_c)]
        diff += (logits[r, ans] - logits[r, wrong]).tolist()
        top += model.token_strings(am.tolist())
    return xr.Dataset(
        {"correct": ("prompt", np.array(correct, dtype=bool)),
         "distinct": ("prompt", np.array(distinct, dtype=bool)),
         "same_length": ("prompt", np.array(same, dtype=bool)),
         "logit_diff": ("prompt", np.array(diff, dtype=np.float32)),
         "top_token": ("prompt", np.array(top, dtype=object))},
        coords={"prompt": np.arange(len(task))},
        attrs=provenance(model, method="circuit_task_accuracy", task=task.name, n_prompts=len(task)))


def filter_task(model: Model, task: CircuitTask, *, correct_only: bool = True,
                batch_size: int = 16) -> CircuitTask:
    """The pairs usable for ``model``: same token length, distinct first target tokens and
    (with ``correct_only``) the clean prompt answered right. Raises if none is left."""
    acc = task_accuracy(model, task, batch_size=batch_size)
    ok = acc["distinct"].values & acc["same_length"].values
    if correct_only:
        ok &= acc["correct"].values
    if not ok.any():
        raise InputError(f"{model.spec.name} answers none of the {len(task)} {task.name!r} pairs "
                         "usably (right answer, equal lengths, distinct targets).")
    return task.subset(np.nonzero(ok)[0])


@dataclass(frozen=True)
class TokenReplacement:
    """A counterfactual of a prompt: the text ``old`` of characters ``[start, end)``, which
    begins at token ``position``, replaced by ``new``; ``corrupt`` is the prompt after it."""

    position: int
    start: int
    end: int
    old: str
    new: str
    corrupt: str

    def describe(self) -> str:
        """One line a page shows: ``position 9: ' John' -> ' Mary'``."""
        return f"position {self.position}: {self.old!r} -> {self.new!r}"

    def to_dict(self) -> dict[str, Any]:
        return {"position": self.position, "start": self.start, "end": self.end,
                "old": self.old, "new": self.new, "corrupt": self.corrupt}


def token_spans(tokenizer: Any, prompt: str) -> list[tuple[int, int]]:
    """Character span ``[start, end)`` of each token of ``prompt`` (no special tokens): the
    tokenizer's offsets where it has them, else the lengths of the decoded prefixes."""
    try:
        enc = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
        spans = [(int(a), int(b)) for a, b in enc["offset_mapping"]]
    except (NotImplementedError, KeyError, TypeError, ValueError):
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ends = [len(tokenizer.decode(ids[:i + 1])) for i in range(len(ids))]
        spans = list(zip([0, *ends[:-1]], ends))
    # a span that leaves out the leading whitespace its token decodes with (metaspace
    # tokenizers) takes it in, so the replaced text is the token as the strip shows it
    out = []
    for a, b in spans:
        while a > 0 and prompt[a - 1].isspace() and (not out or a - 1 >= out[-1][1]):
            a -= 1
        out.append((a, b))
    return out


def token_replacement(tokenizer: Any, prompt: str, replace: str, by: str, *,
                      position: int | None = None) -> TokenReplacement:
    """Where a counterfactual replaces ``prompt``: by ``position`` (the token there, whose
    text must be ``replace`` when that is given), or by the one whole-word match of
    ``replace``. The replacement keeps the replaced text's leading whitespace (``John`` at
    ``' John'`` becomes ``' Mary'`` for ``Mary``). A word that occurs more than once without a
    position is refused with the positions it occurs at: strings are ambiguous, positions
    are not."""
    import re

    word, new_word = replace.strip(), by.strip()
    if not new_word:
        raise InputError(f"give the replacement of {word or 'the clicked token'!r} (e.g. "
                         f"'{word or 'John'}=Paul'); got {by!r}.")
    spans = token_spans(tokenizer, prompt)
    if position is not None:
        if isinstance(position, bool) or not isinstance(position, (int, np.integer)):
            raise TypeError(f"`position` must be an int; got {type(position).__name__}.")
        position = int(position)
        if not 0 <= position < len(spans):
            raise InputError(f"`position` must be a token position of the prompt in "
                             f"[0, {len(spans) - 1}]; got {position}.")
        start, end = spans[position]
        token = prompt[start:end]
        if not token.strip():
            raise InputError(f"token {position} of the prompt is whitespace ({token!r}); "
                             "pick a word.")
        if word and token.strip() != word:
            raise InputError(f"token {position} of the prompt is {token!r}, not {word!r}.")
        lead = token[:len(token) - len(token.lstrip())]
        new = lead + new_word
        return TokenReplacement(position, start, end, token, new,
                                prompt[:start] + new + prompt[end:])
    if not word:
        raise InputError("give the word of the prompt to replace (e.g. 'John=Paul'), or click "
                         f"its token; got {replace!r}.")
    pattern = r"(?<!\w)" + re.escape(word) + r"(?!\w)"
    matches = list(re.finditer(pattern, prompt))
    if not matches:
        words = sorted(set(re.findall(r"\w+", prompt)))[:12]
        raise InputError(f"the word {word!r} is not in the prompt; its words: "
                         f"{', '.join(words)}.")

    def token_at(char: int) -> int:
        return next(i for i, (a, b) in enumerate(spans) if a <= char < b)

    places = [token_at(m.start()) for m in matches]
    if len(matches) > 1:
        listed = ", ".join(str(p) for p in places[:-1]) + f" and {places[-1]}"
        raise InputError(f"the word {word!r} occurs {len(matches)} times in the prompt, at token "
                         f"positions {listed}; click the one to replace in the token strip, or "
                         f"name it: '{word}@{places[-1]}={new_word}'.")
    p, m = places[0], matches[0]
    start = min(spans[p][0], m.start())
    end = m.end()
    new = prompt[start:m.start()] + new_word
    return TokenReplacement(p, start, end, prompt[start:end], new,
                            prompt[:start] + new + prompt[end:])


def prompt_task(model: Model, prompt: str, replace: str, by: str, *, answer: str = "",
                name: str = "your prompt", position: int | None = None) -> CircuitTask:
    """A one-pair task from a prompt and a counterfactual: the corrupted prompt is ``prompt``
    with the token at ``position`` (its text ``replace``, when given) or the one whole-word
    ``replace`` replaced by ``by`` (`token_replacement`; a word that occurs more than once
    needs its position).

    The token to explain is ``answer`` (its first token as it continues the prompt) or, when
    empty, the model's top next token on the prompt; the wrong target is the model's top next
    token on the corrupted prompt, or, when that is the same token, the clean prompt's
    most likely other one (tokens that decode to no string naming them again, such as byte
    fragments, are passed over). The two prompts must tokenise to the same length.

    With ``replace`` and ``by`` both empty there is no counterfactual: the task's baseline is
    mean ablation (``baseline="mean"``: each node's output averaged over the prompt's
    positions) and the wrong target is the clean prompt's most likely token other than the
    one explained.
    """
    for label, value in (("prompt", prompt), ("replace", replace), ("by", by),
                         ("answer", answer)):
        if not isinstance(value, str):
            raise TypeError(f"`{label}` must be a string; got {type(value).__name__}.")
    if not prompt.strip():
        raise InputError("the prompt is empty: type one in the sidebar.")
    if not replace.strip() and not by.strip() and position is None:
        from explorer.trace import run_with

        last = run_with(model, [prompt], positions=[-1])["logits"].values[0, 0]   # [vocab]
        usable = _readable_tokens(model, prompt, np.argsort(-last, kind="stable"))
        want = continuation_token(model.tokenizer, prompt, answer) if answer else next(usable)
        wrong = next(t for t in usable if t != want)
        decode = model.tokenizer.decode
        return CircuitTask(clean=[prompt], corrupt=[prompt], answer=[answer or decode([want])],
                           wrong=[decode([wrong])], name=name, baseline="mean")
    if (not replace.strip() and position is None) or not by.strip():
        raise InputError("give a counterfactual: a word of the prompt and its replacement "
                         f"(e.g. 'Mary=John'); got {replace!r} -> {by!r}.")
    corrupt = token_replacement(model.tokenizer, prompt, replace, by, position=position).corrupt
    lengths = [len(model.tokenizer(p, add_special_tokens=False)["input_ids"])
               for p in (prompt, corrupt)]
    if lengths[0] != lengths[1]:
        raise InputError(f"the prompt and its counterfactual tokenise to {lengths[0]} and "
                         f"{lengths[1]} tokens; pick a replacement of the same token length "
                         f"({replace.strip()!r} -> {by.strip()!r}: {corrupt!r}).")
    from explorer.trace import run_with

    last = run_with(model, [prompt, corrupt], positions=[-1])["logits"].values[:, 0]  # [prompt, vocab]
    top = np.argsort(-last[0], kind="stable")
    # tokens a target string can name (not byte fragments), most likely first
    want = continuation_token(model.tokenizer, prompt, answer) if answer \
        else next(_readable_tokens(model, prompt, top))
    wrong = next(_readable_tokens(model, prompt, np.argsort(-last[1], kind="stable")))
    if wrong == want:
        wrong = next(t for t in _readable_tokens(model, prompt, top) if t != want)
    decode = model.tokenizer.decode
    return CircuitTask(clean=[prompt], corrupt=[corrupt], answer=[answer or decode([want])],
                       wrong=[decode([wrong])], name=name)


def name_variants(model: Model, task: CircuitTask, n: int = 8, *, seed: int = 0) -> CircuitTask:
    """``task``'s first pair and up to ``n - 1`` more of the same sentence with other names.

    Every name of the IOI list (``datasets/circuits/ioi.json``) that the pair's prompts or
    targets use is replaced, as a whole word and consistently across the four fields, by
    another name of the list that the pair does not use, so the variant asks the same question
    of other people ("When Anna and Tom went ..., Tom gave a drink to" -> " Anna"). A variant
    whose prompts change their token count (or differ from each other in it) is passed over.
    Such pairs give a circuit's recovery a bootstrap interval where one prompt cannot.

    Raises `InputError` when the pair uses no name of the list, or when no variant keeps the
    token counts.
    """
    import re

    n = check_int("n", n, low=2, high=64)
    names = list(_load("ioi.json")["names"])
    fields = [task.clean[0], task.corrupt[0], task.answer[0], task.wrong[0]]
    used = [m for m in names if any(re.search(rf"\b{re.escape(m)}\b", f) for f in fields)]
    if not used:
        raise InputError(f"the pair names none of {names}: there is no other name to put in "
                         "its place; type more pairs under 'Your own prompt pairs'.")
    free = [m for m in names if m not in used]

    def count(text: str) -> int:
        return len(model.tokenizer(text, add_special_tokens=False)["input_ids"])

    def width(name: str) -> tuple[int, int]:
        return count(" " + name), count(name)

    # a name is replaced by one the tokenizer splits alike, so the prompts keep their length
    options = {m: [f for f in free if width(f) == width(m)] for m in used}
    want = (count(fields[0]), count(fields[1]))
    pattern = re.compile(r"\b(" + "|".join(re.escape(m) for m in used) + r")\b")
    rng = random.Random(seed)
    out = [fields]
    seen = {tuple(fields)}
    for _ in range(50 * n):
        if len(out) == n:
            break
        mapping: dict[str, str] = {}
        for m in used:
            left = [f for f in options[m] if f not in mapping.values()]
            if not left:
                break
            mapping[m] = rng.choice(left)
        if len(mapping) < len(used):
            continue
        variant = [pattern.sub(lambda m: mapping[m.group(1)], f) for f in fields]
        if tuple(variant) in seen or (count(variant[0]), count(variant[1])) != want:
            continue
        seen.add(tuple(variant))
        out.append(variant)
    if len(out) < 2:
        raise InputError(f"no other names of the list keep the prompts' token counts (the "
                         f"pair uses {used}).")
    clean, corrupt, answer, wrong = (list(x) for x in zip(*out))
    return CircuitTask(clean, corrupt, answer, wrong, name=task.name, baseline=task.baseline)
