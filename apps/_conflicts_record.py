"""What the Knowledge conflicts page's answer bars were computed on, and the words about them.

The bars are the page's shown result: P(memory answer) and P(context answer) before and after
the JuICE (or single-run) intervention, on one fact's prompt of one type, and again on the
edited model when the workspace has edits. Their record (`ConflictsView.shown`, a
`Provenance`) holds what they depend on: the model, the fact's prompt of the chosen type and its
two answers, the head sets, the alphas, the intervention and the workspace's edits; a slider's
preview (`apps._conflicts_preview`) carries the settings ``preview`` and ``precision``. The page
runs on its own facts, never on the sidebar's prompt, so the sidebar's prompt is no part of
the record and changing it leaves the bars current. The bars' captions and the edited bars'
heading are written from the record, and the stale note says when the inputs moved on.
"""
from __future__ import annotations

import dataclasses
import html
import json
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import panel as pn
import param

from apps._conflicts_plots import (bars_caption, edited_bars_caption, edited_title,
                                   plot_answer_bars)
from apps._page_provenance import auto_recompute_state, outdated_markdown
from apps._provenance import Provenance, computed_at_now
from apps._result_cache import Stored, cached_note
from explorer.analyses import conflicts as C
from explorer.interventions import Edit
from explorer.workspace import edit_label

__all__ = ["conflicts_request", "RecordPart"]


def conflicts_request(model: str, fact: C.Fact, kind: str, mode: str, plus: Sequence[str],
                      minus: Sequence[str], alpha_l: float, alpha_s: float,
                      edits: Sequence[Edit]) -> Provenance:
    """The record of the answer bars these inputs give: the fact's prompt of type ``kind``
    (with its memory and context answers), the heads, the alphas, the intervention, the edits."""
    request = {"prompt_type": kind, "intervention": mode,
               "heads": (tuple(plus), tuple(minus)),
               "alphas": (float(alpha_l), float(alpha_s)),
               "edits": tuple(json.dumps(e.to_dict(), sort_keys=True) for e in edits)}
    return Provenance(page="conflicts", model=model, prompts=(C.conflict_prompt(fact, kind),),
                      answer=fact.memory, wrong=fact.context,
                      selection=(*plus, *minus), edits=tuple(edit_label(e) for e in edits),
                      request=tuple(sorted(request.items())))


def _answers(shown: Provenance) -> SimpleNamespace:
    """The shown fact's two answers, as the captions read them."""
    return SimpleNamespace(memory=shown.answer, context=shown.wrong)


class RecordPart(param.Parameterized):
    """The answer bars' record of `apps.conflicts.ConflictsView` and the words it writes."""

    shown = param.ClassSelector(class_=Provenance, default=None, allow_None=True, precedence=-1,
                                doc="What the shown answer bars were computed on.")

    result_note = param.String(default="", precedence=-1,
                               doc="Where the shown answer bars come from when it is the result "
                                   "cache (`apps._result_cache.cached_note`); else ''.")

    # -- the result cache (`apps._result_cache`) ------------------------------------------
    def stored_scores(self, fact: C.Fact, kind: str) -> tuple[dict | None, Stored | None]:
        """(key parts, stored entry or None) of the head scores of ``fact``'s ``kind`` prompt."""
        record = Provenance(page="conflicts", model=self._model.spec.name, method="head scores",
                            prompts=(C.conflict_prompt(fact, kind),),
                            request=(("prompt_type", kind),))
        return self.stored_result("scores", record, {"fact": fact.to_dict()})

    def stored_bars(self, fact: C.Fact, wanted: Provenance) -> tuple[dict | None, Stored | None]:
        """(key parts, stored entry or None) of the answer bars of the request ``wanted``."""
        return self.stored_result("bars", wanted, {"fact": fact.to_dict()})

    def store_bars(self, parts: dict | None, wanted: Provenance, rows: list,
                   edited: list | None) -> Provenance:
        """Keep computed bars in the result cache; ``wanted`` stamped with their time."""
        shown = self._shown_bars(wanted)
        self.store_result(parts, {}, {"rows": rows, "edited": edited},
                          computed_at=shown.computed_at)
        return shown

    def show_stored_bars(self, wanted: Provenance, hit: Stored) -> None:
        """Show answer bars read from the result cache, with the note saying so."""
        def rows(value: list | None) -> list | None:
            return None if value is None else [tuple(r) for r in value]

        self.param.update(bar_rows=rows(hit.values["rows"]), edited_rows=rows(hit.values["edited"]),
                          shown=dataclasses.replace(wanted, computed_at=hit.computed_at),
                          result_note=cached_note(hit.computed_at), status="ready")
        self._warm_preview()

    def request_provenance(self) -> Provenance:
        """The record of the bars the page computes from its current inputs."""
        return conflicts_request(self._model.spec.name, self._fact(), self.kind, self.mode,
                                 self.heads_plus, self.heads_minus, self.alpha_l, self.alpha_s,
                                 list(self.edits))

    def shown_provenance(self) -> Provenance | None:
        """The shown bars' record (`shown`)."""
        return self.shown

    def requested_provenance(self) -> Provenance:
        """`request_provenance`; while the bars show a slider's preview, with the preview's
        alphas (the hand's, which the α Parameters take on release)."""
        wanted = self.request_provenance()
        shown = self.shown
        if shown is not None and shown.setting("preview"):
            request = dict(wanted.request)
            request["alphas"] = dict(shown.request)["alphas"]
            wanted = dataclasses.replace(wanted, request=tuple(sorted(request.items())))
        return wanted

    def _shown_bars(self, wanted: Provenance) -> Provenance:
        """``wanted`` (the request the bars were computed for) with the time they arrived."""
        return dataclasses.replace(wanted, computed_at=computed_at_now())

    def waiting_state(self) -> str:
        """The end of the stale note (`ShownResult.stale_note`): every control and edit
        recomputes the bars at once, so it says recomputing, failed, or (the workspace moved
        while the page was out of view) that the page recomputes when opened."""
        return auto_recompute_state(running=self.running, failed=bool(self.error))

    def stale_markdown(self, *_: Any) -> str:
        """The stale note as the page shows it ('' while the bars are of the inputs)."""
        return outdated_markdown(self.stale_note())

    def bars_words(self, *_: Any) -> str:
        """The clean bars' caption, from the record."""
        shown = self.shown
        if shown is None or self.bar_rows is None:
            return bars_caption(None, None, "")
        r = dict(shown.request)
        return bars_caption(self.bar_rows, _answers(shown), r["intervention"],
                            n_heads=len(shown.selection), alphas=r["alphas"],
                            preview=shown.setting("precision") if shown.setting("preview")
                            else None)

    def _edited_bars(self, rows: list | None) -> pn.viewable.Viewable:
        """The bars on the edited model, their heading and caption (naming the edits they were
        computed with); nothing without workspace edits."""
        shown = self.shown
        if rows is None or shown is None:
            return pn.Column(height=0, margin=0)
        caption = dict(sizing_mode="stretch_width", styles={"font-size": "0.9em", "color": "#444"})
        return pn.Column(
            pn.pane.Markdown(f"**{html.escape(edited_title(list(shown.edits)))}**",
                             margin=(10, 10, 0, 10), sizing_mode="stretch_width",
                             css_classes=["cf-edited-title"]),
            pn.pane.HoloViews(plot_answer_bars(rows, title="P(answer), edited"),
                              linked_axes=False, sizing_mode="stretch_width",
                              css_classes=["cf-bars-edited"]),
            pn.pane.Markdown(edited_bars_caption(rows, self.bar_rows, list(shown.edits),
                                                 _answers(shown)), **caption),
            sizing_mode="stretch_width", margin=0)
