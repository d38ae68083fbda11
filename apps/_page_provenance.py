"""The shown result's record on the pages that recompute on their own when their inputs
change (Logit lens, Attention, Saturation), and the words they write from it.

Such a page keeps a `Provenance` beside its shown result, made from the inputs the
computation used as the result lands (`ShownRecord.shown_record`). Its heading names that
record's prompt and edits (`result_heading`); a note under it (`ShownRecord.stale_box`) says
what the shown result was computed on once the inputs the page would run on now differ from
it (`auto_stale_text`): while the recompute runs, when it failed, and, in the gallery, on a
page that is not in view (the gallery recomputes only the page in view; the page's inputs
are then the workspace's, `ShownRecord.follow_workspace`). Selected positions are not inputs
of these computations: they choose what is outlined, which is drawn from the selection at
once, so the shown record carries the positions drawn and a new selection marks nothing
stale. `CheckedRecompute` writes the note of the pages that keep the record in their shown
result and check some inputs before computing (Logit attribution, Activation patching);
`outdated_markdown` is a note as the pages show it in Markdown.
"""
from __future__ import annotations

import dataclasses
import html
from collections.abc import Callable, Sequence
from typing import Any

import panel as pn
import param
import xarray as xr

from apps._provenance import INPUT_NAMES, Provenance, changed_inputs, computed_at_now, one_line
from explorer.interventions import Edit

__all__ = ["ShownRecord", "CheckedRecompute", "outdated_markdown", "auto_stale_text",
           "stale_inputs", "result_heading", "edits_words",
           "STALE_STYLE", "INPUT_WORDS", "recompute_state", "auto_recompute_state"]


INPUT_WORDS = {**INPUT_NAMES, "method": "the method", "alpha": "the steering strength",
               "steer_layer": "the steering layer", "contrast_a": "the contrast prompts A",
               "contrast_b": "the contrast prompts B", "top_k": "the top-k",
               "weights": "the weights"}
"""How a stale note names each input of these pages."""

_ORDER = ("model", "prompts", "edits")

STALE_STYLE = {"background": "#fff4e5", "border-left": "4px solid #e65100", "padding": "4px 10px",
               "color": "#3e2723", "font-size": "0.9em"}
"""The stale note's box: the same amber on every page that has one."""


def stale_inputs(shown: Provenance, wanted: Provenance) -> list[str]:
    """The inputs in which ``wanted`` differs from ``shown``, by name: model, prompt, edits
    first, then the method and the page's own inputs (its ``request``)."""
    changed = changed_inputs(shown, wanted)
    if shown.edits != wanted.edits:
        changed.append("edits")
    return [n for n in _ORDER if n in changed] + [n for n in changed if n not in _ORDER]


def edits_words(n: int) -> str:
    """``1 workspace edit`` / ``3 workspace edits``."""
    return f"{n} workspace edit{'s' if n != 1 else ''}"


def auto_stale_text(shown: Provenance, wanted: Provenance, *, state: str = "") -> str:
    """Empty when ``shown`` is of the inputs ``wanted``; else what the shown result was
    computed on (prompt, edits, time), what changed since, and ``state`` (what the page is
    doing about it)."""
    changed = stale_inputs(shown, wanted)
    if not changed:
        return ""
    on = one_line(shown.prompts[0]) if shown.prompts else "''"
    edits = f" with {edits_words(len(shown.edits))}" if shown.edits else " without edits"
    what = ", ".join(INPUT_WORDS.get(c, c) for c in changed)
    return (f"Shown: computed on {on}{edits} at {shown.computed_at[11:16]} UTC; {what} "
            f"changed since" + (f": {state}" if state else "."))


def result_heading(what: str, prov: Provenance, *, detail: str = "", clean: bool = True) -> str:
    """One line over a page's result: ``what`` of the record's prompt, its model (and
    ``detail``), and its workspace edits: ``Logit lens of 'The cat' (tiny-llama), clean and
    with 1 workspace edit`` (``clean``: the page shows the unedited result too)."""
    on = one_line(prov.prompts[0]) if prov.prompts else "''"
    model = prov.model + (f", {detail}" if detail else "")
    edits = (f", {'clean and ' if clean else ''}with {edits_words(len(prov.edits))}"
             if prov.edits else "")
    return f"{what} of {on} ({model}){edits}"


def recompute_state(*, running: bool = False, refused: bool = False, failed: bool = False,
                    action: str = "Enter") -> str:
    """The end of the stale note of a page that recomputes as each input changes (Logit
    attribution, Activation patching): what it is doing about the newer inputs. Recomputing;
    refused (an input checked before computing did not fit); failed (the computation
    raised); else pressing ``action`` updates it (`ShownRecord.stale_states`' words)."""
    states = ShownRecord.stale_states
    if running:
        return states["running"]
    if refused:
        return states["refused"]
    if failed:
        return states["failed"]
    return f"press {action} to update."


def auto_recompute_state(*, running: bool, failed: bool) -> str:
    """The end of the stale note of a page that recomputes as soon as its inputs change:
    recomputing; its recompute failed; else (out of view in the gallery, or not loaded yet)
    it recomputes when opened (`ShownRecord.stale_states`' words)."""
    states = ShownRecord.stale_states
    return states["running"] if running else states["failed"] if failed else states["waiting"]


def outdated_markdown(note: str, tail: str = "") -> str:
    """A stale note as the pages show it in Markdown: bold *Outdated*, the note (``&`` and
    ``<`` escaped; Markdown keeps '->'), then ``tail``; '' for no note."""
    if not note:
        return ""
    return f"**Outdated**. {note.replace('&', '&amp;').replace('<', '&lt;')}{tail}"


class CheckedRecompute:
    """The stale note of a page that recomputes as each input changes and checks some inputs
    before computing (Logit attribution, Activation patching), from the record in its shown
    result: a base before `apps._view.View`. The page sets ``_refused`` when it refused the
    last input (its message shows) and gives `outdated_words`, the Markdown it shows a stale
    text in (its own words after the note)."""

    _refused = False
    outdated_words: Callable[[str, Provenance], str]

    def waiting_state(self) -> str:
        """What the page does about inputs newer than the shown result (`recompute_state`),
        the end of its stale note (`ShownResult.stale_note`)."""
        return recompute_state(running=self.running, refused=self._refused,
                               failed=bool(self.error), action=self.compute_action)

    def stale_markdown(self, *_: Any) -> str:
        """The stale note as the page shows it ('' while the result is of the inputs)."""
        shown = self.shown_provenance()
        return "" if shown is None else self.outdated_words(self.stale_note(), shown)


class ShownRecord(param.Parameterized):
    """The `Provenance` of a page's shown result, kept beside it (`shown_record`), and the
    page's current inputs, read from the workspace the gallery gives it (else from its own
    parameters).

    A page sets `shown_record` with its result (`stamped` makes it from the inputs the
    computation used), names itself in ``page_slug``, words its result in `heading`, and
    implements `requested_provenance` (often with `record`). `stale_note` compares the
    two."""

    shown_record = param.ClassSelector(class_=Provenance, default=None, allow_None=True,
                                       precedence=-1,
                                       doc="What the shown result was computed on.")

    page_slug = ""
    described: tuple[str, ...] = ()   # the Dataset parameters the shown record is of
    _workspace: Any = None
    stale_states = {"running": "recomputing; the result shown is the old one until then.",
                    "failed": "its recompute failed (the message above says why); the result "
                              "shown is the old one.",
                    "waiting": "the page recomputes when it is opened.",
                    "refused": "the page refused the new input (the message above says why); "
                               "the result shown is the old one."}

    def follow_workspace(self, workspace: Any) -> None:
        """Read the current prompt and edits from ``workspace`` (the gallery's): a page not
        in view keeps its result, on the inputs it was computed on, and says so."""
        self._workspace = workspace

    def current_inputs(self) -> tuple[str, list[Edit]]:
        """(prompt, edits) the page would run on now: the workspace's where it follows one."""
        ws = self._workspace
        if ws is not None:
            return ws.prompt, list(ws.edits)
        return self.prompt, list(self.edits)

    def record(self, method: str, prompt: str, edits: Sequence[Edit], *,
               request: dict[str, Any] | None = None, computed_at: str = "") -> Provenance:
        """This page's record of ``prompt`` with workspace ``edits`` (by label)."""
        from explorer.workspace import edit_label

        return Provenance(page=self.page_slug, model=self.model.spec.name, method=method,
                          prompts=(prompt,), edits=tuple(edit_label(e) for e in edits),
                          request=tuple(sorted((request or {}).items())),
                          computed_at=computed_at)

    @staticmethod
    def stamped(prov: Provenance) -> Provenance:
        """``prov`` with the time now (a result landing)."""
        return dataclasses.replace(prov, computed_at=computed_at_now())

    def drawn_positions(self) -> tuple[int, ...]:
        """The selected positions the page outlines (what the shown record says it draws)."""
        return tuple(int(p) for p in getattr(self, "selected_positions", ()))

    def shown_provenance(self) -> Provenance | None:
        """The shown result's record (`ShownResult.shown_provenance`), with the positions it
        outlines."""
        rec = self.shown_record
        return None if rec is None else dataclasses.replace(rec, positions=self.drawn_positions())

    def recomputing(self) -> bool:
        """Whether a recompute of the shown result is in flight."""
        return bool(self.running)

    def stale_note(self) -> str:
        """Empty while the shown result is of the current inputs; else what it was computed
        on, what changed since and what the page is doing about it (`auto_stale_text`)."""
        shown = self.shown_record
        if shown is None:
            return ""
        wanted = self.requested_provenance()
        if wanted is None:
            return ""
        state = auto_recompute_state(running=self.recomputing(), failed=bool(self.error))
        return auto_stale_text(shown, wanted, state=state)

    def heading_html(self, *_: Any) -> str:
        """The result's heading (`result_heading` of the shown record), as HTML."""
        rec = self.shown_record
        return "" if rec is None else f"<b>{html.escape(self.heading(rec))}</b>"

    def stale_html(self, *_: Any) -> str:
        """The stale note, as HTML ('' while the result is current)."""
        note = self.stale_note()
        return f"<b>Outdated.</b> {html.escape(note)}" if note else ""

    def _record_deps(self, names: Sequence[str]) -> list[Any]:
        deps = [self.param.shown_record, *[self.param[n] for n in names]]
        if self._workspace is not None:
            deps += [self._workspace.param.prompts, self._workspace.param.edits]
        return deps

    def heading_pane(self, css_class: str) -> pn.pane.HTML:
        """The heading, redrawn with the shown record."""
        return pn.pane.HTML(pn.bind(self.heading_html, self.param.shown_record),
                            css_classes=[css_class], sizing_mode="stretch_width", margin=(0, 10))

    def stale_box(self, css_class: str, names: Sequence[str]) -> pn.pane.HTML:
        """The stale note in an amber box, shown while there is one; redrawn when one of the
        parameters ``names`` (inputs, running, error), the shown record or, in the gallery, the
        workspace's prompt or edits change."""
        deps = self._record_deps(names)
        return pn.pane.HTML(pn.bind(self.stale_html, *deps),
                            visible=pn.bind(lambda *_: bool(self.stale_note()), *deps),
                            css_classes=[css_class, "stale-note"], styles=STALE_STYLE,
                            sizing_mode="stretch_width", margin=(2, 10))

    def export_datasets(self) -> dict[str, xr.Dataset]:
        """The page's Datasets (`View.export_datasets`), those the shown record describes
        (``described``) carrying it (JSON) in their attrs' ``page_provenance``."""
        out = dict(super().export_datasets())
        shown = self.shown_provenance()
        if shown is None:
            return out
        for name in self.described:
            if name in out:
                ds = out[name].copy()
                ds.attrs = {**ds.attrs, "page_provenance": shown.to_json()}
                out[name] = ds
        return out
