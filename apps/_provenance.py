"""What a shown result was computed on, and the words a page writes about it.

A page keeps, beside each result it shows, a `Provenance`: a frozen, JSON-able record of its
inputs (model, prompts and counterfactual, positions, selection, edits, method, settings,
when computed). Titles, captions and scope lines are pure functions of that record, so what a
page says is what it computed; when the page's current inputs (`Provenance` of what Compute
would run) differ from the shown record's, `stale_text` says so instead of relabelling the old
result with the new inputs.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Provenance", "Counterfactual", "one_line", "counterfactual_text", "changed_inputs",
           "outdated_text", "stale_text", "computed_at_now", "INPUT_NAMES", "ShownResult"]

LINE_CHARS = 90   # a prompt shown on one line: at most this many characters


@dataclass(frozen=True)
class Counterfactual:
    """The corrupted prompt's one change: the text ``old`` at token ``position`` became
    ``new``."""

    position: int
    old: str
    new: str


@dataclass(frozen=True)
class Provenance:
    """The inputs of one shown result (every field JSON-able; tuples for lists).

    ``inputs`` are what the computation read (the fields a change of makes the result stale);
    ``settings`` are how it is shown (sizes, modes), which change without a recompute."""

    page: str
    model: str
    method: str = ""
    task: str = ""
    prompts: tuple[str, ...] = ()
    corrupt: tuple[str, ...] = ()
    counterfactual: Counterfactual | None = None
    baseline: str = ""
    answer: str = ""
    wrong: str = ""
    n_pairs: int = 0
    positions: tuple[int, ...] = ()
    selection: tuple[str, ...] = ()
    edits: tuple[str, ...] = ()
    request: tuple[tuple[str, Any], ...] = ()
    settings: tuple[tuple[str, Any], ...] = ()
    computed_at: str = ""
    metrics: tuple[tuple[str, float], ...] = field(default=())

    def setting(self, name: str, default: Any = None) -> Any:
        return dict(self.settings).get(name, default)

    def metric(self, name: str, default: float | None = None) -> float | None:
        return dict(self.metrics).get(name, default)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for name in ("request", "settings", "metrics"):
            out[name] = dict(getattr(self, name))
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Provenance:
        d = dict(d)
        cf = d.get("counterfactual")
        d["counterfactual"] = None if cf is None else Counterfactual(**cf)
        for name in ("prompts", "corrupt", "positions", "selection", "edits"):
            d[name] = tuple(d.get(name, ()))
        for name in ("request", "settings", "metrics"):
            d[name] = tuple(sorted((k, _tuples(v)) for k, v in dict(d.get(name, {})).items()))
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> Provenance:
        return cls.from_dict(json.loads(text))


def _tuples(value: Any) -> Any:
    """A JSON value with its lists as tuples (how a record holds them), so a record read
    back from JSON equals the one written."""
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value


INPUT_NAMES = {"model": "the model", "method": "the attribution method", "task": "the task",
               "prompts": "the prompt", "counterfactual": "the counterfactual",
               "n_pairs": "the number of pairs", "edits": "the edits",
               "explain": "the token to explain", "own": "your pairs",
               "pickers": "the answer or alternative", "replacement": "the replacement token",
               "corrupt": "the corrupted prompt", "grid": "the grid", "metric": "the metric",
               "direction": "the direction", "dictionary": "the dictionary",
               "feature": "the feature", "example": "the example",
               "prompt_type": "the prompt type", "heads": "the enhanced or suppressed heads",
               "alphas": "the alphas", "intervention": "the intervention",
               "induction": "the induction settings"}


def computed_at_now() -> str:
    """The time of a result, to the second, in UTC (ISO 8601)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def one_line(text: str, limit: int = LINE_CHARS) -> str:
    """``text`` on one readable line: newlines shown as ⏎, and a text longer than ``limit``
    characters cut in the middle, with its length (a long prompt never fills the screen)."""
    flat = text.replace("\r\n", "\n").replace("\n", "⏎")
    if len(flat) <= limit:
        return repr(flat)
    head, tail = flat[:limit * 2 // 3], flat[-(limit // 3):]
    return f"{head!r} … {tail!r} ({len(text):,} characters)"


def counterfactual_text(cf: Counterfactual) -> str:
    """``position 9: ' John' -> ' Mary'``."""
    return f"position {cf.position}: {cf.old!r} -> {cf.new!r}"


def changed_inputs(shown: Provenance, wanted: Provenance) -> list[str]:
    """The inputs in which the page's current request differs from the shown result's, by
    name (`INPUT_NAMES`), in a fixed order."""
    out = []
    for name in ("model", "task", "prompts", "n_pairs", "method"):
        # a request that names no prompts (a generated task, pasted pairs: its task and
        # request identify them) is not compared on the prompts the result found
        if name == "prompts" and not wanted.prompts:
            continue
        if getattr(shown, name) != getattr(wanted, name):
            out.append(name)
    a, b = dict(shown.request), dict(wanted.request)
    out += [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k) and k not in out]
    return out


def outdated_text(shown: Provenance, wanted: Provenance, *, action: str = "Compute",
                  state: str = "") -> str:
    """Empty when the shown result is of the current inputs; else which inputs changed
    since and what updates it (pressing ``action``), or ``state``: what the page is doing
    about them (recomputing, or why it did not)."""
    changed = changed_inputs(shown, wanted)
    if not changed:
        return ""
    what = ", ".join(INPUT_NAMES.get(c, c) for c in changed)
    return f"{what} changed since: {state or f'press {action} to update.'}"


def stale_text(shown: Provenance, wanted: Provenance, *, action: str = "Compute",
               state: str = "") -> str:
    """Empty when the shown result is of the current inputs; else what it was computed on,
    what changed since, and what updates it (`outdated_text`)."""
    changed = outdated_text(shown, wanted, action=action, state=state)
    if not changed:
        return ""
    on = one_line(shown.prompts[0]) if shown.prompts else f"the task {shown.task!r}"
    cf = (f" vs {counterfactual_text(shown.counterfactual)}"
          if shown.counterfactual is not None else "")
    method = f", {shown.method.upper()}" if shown.method else ""
    return f"Shown: computed on {on}{cf}{method} at {shown.computed_at[11:16]} UTC; {changed}"


class ShownResult:
    """What a page says about the result it shows: the base of every `apps._view.View`.

    A page that keeps a `Provenance` beside its shown result overrides `shown_provenance` and
    `requested_provenance` (what it would compute from its current inputs); `stale_note` then
    says what the shown result was computed on once the two differ."""

    compute_action = "Compute"   # the control that recomputes the page (named in stale notes)

    def shown_provenance(self) -> Provenance | None:
        """The record of what the shown result was computed on, or None. Pages that keep one
        override it; their words about the result come from it."""
        return None

    def requested_provenance(self) -> Provenance | None:
        """The record of what the page would compute from its current inputs, or None."""
        return None

    def waiting_state(self) -> str:
        """What the page is doing about inputs newer than the shown result, the end of its
        stale note; '' (the default): pressing `compute_action` updates it."""
        return ""

    def stale_note(self) -> str:
        """Empty while the shown result is of the current inputs (or the page keeps no
        record); else what it was computed on, what changed since (`stale_text`) and
        `waiting_state`."""
        shown = self.shown_provenance()
        wanted = self.requested_provenance() if shown is not None else None
        if shown is None or wanted is None:
            return ""
        return stale_text(shown, wanted, action=self.compute_action, state=self.waiting_state())
