"""The shown result's record on the pages that build an ITDA dictionary of their own probing
prompts (ITDA, Neuron explanations), and the words those pages write from it.

These pages recompute as a control moves; their inputs are the probing prompts and the
page's controls (layer, tau, L0, the atom or unit, ...), never the workspace prompt or edits.
A result lands with its `Provenance` (`dictionary_record`): the probing prompts, the
dictionary's settings and the page's other inputs in its ``request``. Headings and captions
are written from that record (`dictionary_words`); while the inputs the page would run on now
differ from it (a recompute in flight, a refused input, a failed recompute),
`dictionary_stale_text` says what the shown result was computed on, what changed since and
what the page is doing about it (`stale_state`, in the words of every page's note).
"""
from __future__ import annotations

import html
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import panel as pn
import xarray as xr

from apps._page_provenance import INPUT_WORDS, STALE_STYLE, ShownRecord
from apps._provenance import Provenance, changed_inputs

__all__ = ["dictionary_record", "dictionary_words", "dictionary_stale_text", "stale_state",
           "stale_note_html", "stale_box", "with_records", "WORDS"]

WORDS = {**INPUT_WORDS, "prompts": "the probing prompts", "layer": "the layer", "tau": "tau",
         "l0": "the L0", "atom": "the atom", "unit": "the unit", "concept": "the concept",
         "binarize": "the binarisation", "alpha": "alpha", "threshold": "the threshold",
         "seed": "the seed", "noise": "the weight noise", "other": "the second model",
         "method": "the similarity measure"}
"""How a stale note of these pages names each input."""

_ORDER = ("model", "prompts", "layer", "tau", "l0", "atom", "unit", "concept", "binarize",
          "alpha", "threshold", "seed", "method", "other", "noise")
"""The order a stale note names the inputs in (the controls' order on the pages)."""

STATES = {k: ShownRecord.stale_states[k] for k in ("running", "refused", "failed")}
"""The endings of the stale note (`ShownRecord.stale_states`' words)."""


def dictionary_record(page: str, model: str, prompts: Sequence[str], *, method: str,
                      request: dict[str, Any], computed_at: str = "") -> Provenance:
    """The record of a result of ``page`` on the probing ``prompts`` with the inputs
    ``request`` (layer, tau, L0 and the page's own); no edits: these pages read the
    unedited model."""
    return Provenance(page=page, model=model, method=method, prompts=tuple(prompts),
                      request=tuple(sorted(request.items())), computed_at=computed_at)


def dictionary_words(rec: Provenance) -> str:
    """``the 8 probing prompts at layer 2 (tau 0.30, L0 8; tiny-llama)``: what the record's
    dictionary was built on."""
    r = dict(rec.request)
    n = len(rec.prompts)
    settings = [f"tau {float(r['tau']):.2f}"] if "tau" in r else []
    settings += [f"L0 {int(r['l0'])}"] if "l0" in r else []
    how = f"{', '.join(settings)}; {rec.model}" if settings else rec.model
    at = f" at layer {r['layer']}" if "layer" in r else ""
    return f"the {n} probing prompt{'s' if n != 1 else ''}{at} ({how})"


def stale_state(running: bool, error: str, *, refused: bool = False) -> str:
    """What the page is doing about an outdated result: recomputing, refused the new input
    before computing (``refused``: its message shows), or its recompute failed (else '')."""
    if running:
        return STATES["running"]
    return STATES["refused"] if refused else STATES["failed"] if error else ""


def dictionary_stale_text(shown: Provenance, wanted: Provenance, *, state: str = "",
                          on: str = "") -> str:
    """Empty when ``shown`` is of the inputs ``wanted``; else what the shown result was
    computed on (``on``, default `dictionary_words`), at what time, which inputs changed
    since, and ``state``."""
    changed = changed_inputs(shown, wanted)
    if not changed:
        return ""
    changed.sort(key=lambda c: _ORDER.index(c) if c in _ORDER else len(_ORDER))
    what = ", ".join(WORDS.get(c, c) for c in changed)
    return (f"Shown: computed on {on or dictionary_words(shown)} at {shown.computed_at[11:16]} UTC; "
            f"{what} changed since" + (f": {state}" if state else "."))


def stale_note_html(note: str) -> str:
    """The stale note as the amber box's HTML ('' when there is none)."""
    return f"<b>Outdated.</b> {html.escape(note)}" if note else ""


def stale_box(css_class: str, note: Callable[[], str], deps: Sequence[Any]) -> pn.pane.HTML:
    """The note ``note()`` in the amber box (`STALE_STYLE`), shown while there is one and
    redrawn when one of the parameters ``deps`` changes."""
    return pn.pane.HTML(pn.bind(lambda *_: stale_note_html(note()), *deps),
                        visible=pn.bind(lambda *_: bool(note()), *deps),
                        css_classes=[css_class, "stale-note"], styles=STALE_STYLE,
                        sizing_mode="stretch_width", margin=(2, 10))


def with_records(datasets: Mapping[str, xr.Dataset],
                 records: Mapping[str, Provenance | None]) -> dict[str, xr.Dataset]:
    """``datasets`` (a page's export), each one named in ``records`` carrying its record
    (JSON, in its attrs' ``page_provenance``); the others as they are."""
    out = dict(datasets)
    for name, rec in records.items():
        if name in out and rec is not None:
            out[name] = out[name].assign_attrs(page_provenance=rec.to_json())
    return out
