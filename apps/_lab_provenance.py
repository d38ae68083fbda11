"""The shown result's record on the training-lab pages (Parity, Linear ICL, Task emergence,
Shattering, Unlearning), and the words they write from it.

These pages study small models of their own. A result a page computes in the background
(Parity's state counts over training, Shattering's knowledge edit, Unlearning's localization
and run) keeps beside it a `Provenance`: the model it ran on (``model``: the toy model's kind
and seed, or the language model's name), the controls that shaped it (``request``: a change of
one makes the result stale), how it is shown (``settings``) and when it was computed. The
page's words about that result (captions, the scope line, the export's manifest, "Copy page as
code") are written from the record; once the controls differ from it, `lab_stale_text` says
what the shown result was computed on and what changed since, in the words of
`apps._provenance.stale_text`: ``Shown: computed on <model>, <inputs> at 10:42 UTC; the merge
threshold changed since: press Compute to update.`` A page that recomputes on its own names
what it is doing instead of a button (``state``). Results drawn at once from the controls
(a checkpoint picked by the step slider) have no stale state: their words are of the controls.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import panel as pn

from apps._page_provenance import STALE_STYLE, ShownRecord, outdated_markdown
from apps._provenance import Provenance, changed_inputs, computed_at_now

__all__ = ["LabInput", "plural", "lab_record", "drawn_as", "stamped", "inputs_text", "lab_stale_text",
           "outdated_markdown", "stale_pane", "recompute_state", "RECOMPUTING"]

RECOMPUTING = ShownRecord.stale_states["running"]
"""What a page that recomputes on its own says while it does (the lens pages' words)."""


@dataclasses.dataclass(frozen=True)
class LabInput:
    """How the words name one input of a record: ``name`` in a stale note (``the merge
    threshold``), ``shown`` the value it was computed with (``merge threshold {}``; a callable
    takes the value)."""

    name: str
    shown: str | Callable[[Any], str] = "{}"

    def text(self, value: Any) -> str:
        return self.shown(value) if callable(self.shown) else self.shown.format(value)


def recompute_state(view: Any, runner: str) -> str:
    """What a page that recomputes on its own is doing about a stale result: recomputing
    (its job on ``runner`` in flight), or its last recompute failed (`View.error`)."""
    running = view._runners[runner].running
    return RECOMPUTING if running or not view.error else ShownRecord.stale_states["failed"]


def plural(n: int, word: str) -> str:
    """``1 step`` / ``3 steps``."""
    return f"{n} {word}{'s' if n != 1 else ''}"


def lab_record(page: str, model: str, inputs: Mapping[str, Any], *, method: str = "",
               task: str = "", settings: Mapping[str, Any] | None = None,
               computed_at: str = "") -> Provenance:
    """A lab page's record: ``inputs`` (what a change of makes the result stale) as its
    ``request``; lists become tuples (as a record read back from JSON holds them)."""
    def frozen(v: Any) -> Any:
        return tuple(frozen(x) for x in v) if isinstance(v, (list, tuple)) else v

    return Provenance(page=page, model=model, method=method, task=task,
                      request=tuple(sorted((k, frozen(v)) for k, v in inputs.items())),
                      settings=tuple(sorted((k, frozen(v)) for k, v in (settings or {}).items())),
                      computed_at=computed_at)


def drawn_as(shown: Provenance | None, settings: Mapping[str, Any]) -> Provenance | None:
    """The record of a shown result, ``shown``, with the ``settings`` it is drawn at now (the
    controls that redraw it without recomputing); None while nothing is shown."""
    if shown is None:
        return None
    return lab_record(shown.page, shown.model, dict(shown.request), method=shown.method,
                      task=shown.task, settings=settings, computed_at=shown.computed_at)


def stamped(prov: Provenance) -> Provenance:
    """``prov`` with the time now (a result landing)."""
    return dataclasses.replace(prov, computed_at=computed_at_now())


def inputs_text(prov: Provenance, words: Mapping[str, LabInput],
                names: Sequence[str] | None = None) -> str:
    """The record's inputs in words, in the order of ``words`` (or ``names``): ``merge
    threshold 0.01, strings up to 8 symbols``; an input ``words`` does not name, or words as
    '', is left out."""
    request = dict(prov.request)
    keys = [k for k in (names if names is not None else words) if k in request and k in words]
    return ", ".join(t for k in keys if (t := words[k].text(request[k])))


def lab_stale_text(shown: Provenance | None, wanted: Provenance | None,
                   words: Mapping[str, LabInput], *, action: str = "Compute",
                   state: str = "") -> str:
    """Empty while ``shown`` is of the inputs ``wanted`` (or either is None); else what the
    shown result was computed on (model, inputs, time), which inputs changed since, and what
    updates it: ``press <action> to update.``, or ``state`` (what the page is doing)."""
    if shown is None or wanted is None:
        return ""
    changed = changed_inputs(shown, wanted)   # model, task, method, then the request's keys
    if not changed:
        return ""
    order = list(words)                          # the inputs in the page's order
    changed.sort(key=lambda c: order.index(c) if c in order else -1)
    names = {"model": "the model", "method": "the method"}
    what = ", ".join(words[c].name if c in words else names.get(c, c) for c in changed)
    on = inputs_text(shown, words)
    at = f" at {shown.computed_at[11:16]} UTC" if shown.computed_at else ""
    tail = f": {state}" if state else f": press {action} to update."
    return f"Shown: computed on {shown.model}{', ' + on if on else ''}{at}; {what} changed since{tail}"


def stale_pane(note: Callable[[], str], deps: Sequence[Any], css_class: str) -> pn.pane.Markdown:
    """The stale note (``note()``, redrawn when one of ``deps`` changes) in the amber box every
    page's note has, shown while there is one."""
    return pn.pane.Markdown(pn.bind(lambda *_: outdated_markdown(note()), *deps),
                            visible=pn.bind(lambda *_: bool(note()), *deps),
                            css_classes=[css_class, "stale-note"], styles=STALE_STYLE,
                            sizing_mode="stretch_width", margin=(2, 10))
