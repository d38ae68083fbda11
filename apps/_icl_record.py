"""What the ICL heads page's head scores were computed on, and the words about them.

The head scores (the scatter and the two heatmaps) are the page's shown result. They run on the
page's own tasks and random sequences, never on the sidebar's prompt, so their record (a
`Provenance` kept in the scores' attrs as ``shown_record``, JSON) holds what they depend on:
the model, the FV tasks and prompts (fixed for the page), the induction settings and the
workspace's edits (which reach the induction scores; the FV scores patch an unedited run). A
rescore of the induction scores (new settings or edits) replaces that part of the record. The
words over the scatter are written from it; the stale note says when the inputs moved on.
"""
from __future__ import annotations

import dataclasses
import html
import json
from collections.abc import Sequence
from typing import Any

import xarray as xr

from apps._page_provenance import outdated_markdown, recompute_state
from apps._provenance import Provenance, computed_at_now
from explorer.interventions import Edit
from explorer.workspace import edit_label

__all__ = ["icl_request", "scores_words", "requested_words", "RecordPart", "RECORD"]

RECORD = "shown_record"
"""The scores' attr holding their record (JSON)."""


def icl_request(model: str, fv_tasks: Sequence[str], n_prompts: int, n_shots: int,
                induction: dict[str, Any], edits: Sequence[Edit]) -> Provenance:
    """The record of the head scores these inputs give."""
    request = {"induction": (int(induction["n_sequences"]), int(induction["half_len"]),
                             str(induction["measure"])),
               "edits": tuple(json.dumps(e.to_dict(), sort_keys=True) for e in edits)}
    return Provenance(page="icl-heads", model=model, task=", ".join(fv_tasks),
                      n_pairs=int(n_prompts), edits=tuple(edit_label(e) for e in edits),
                      request=tuple(sorted(request.items())),
                      settings=(("n_shots", int(n_shots)),))


def scores_words(shown: Provenance | None) -> str:
    """The line over the scatter: what the shown scores were computed on."""
    if shown is None:
        return ""
    n, half, measure = dict(shown.request)["induction"]
    edits = ("; the induction scores under " + _edits_words(shown.edits) if shown.edits
             else "; no edits")
    return (f"Scores of {shown.model}: FV on {shown.task} ({shown.n_pairs} prompts x "
            f"{shown.setting('n_shots')} shots each, unedited run); induction on {n} repeated "
            f"random sequences of {half} tokens ({measure}){edits}.")


def _edits_words(edits: Sequence[str]) -> str:
    return ("the edits " + "; ".join(f"`{html.escape(t)}`" for t in edits) if edits
            else "no edits")


def requested_words(shown: Provenance | None, wanted: Provenance) -> str:
    """What the page's controls ask for where it differs from the shown scores' record
    (the induction settings, the edits); '' when they ask for the shown scores."""
    if shown is None:
        return ""
    a, b = dict(shown.request), dict(wanted.request)
    parts = []
    if a.get("induction") != b.get("induction"):
        n, half, measure = b["induction"]
        parts.append(f"induction on {n} repeated random sequences of {half} tokens ({measure})")
    if a.get("edits") != b.get("edits"):
        parts.append(_edits_words(wanted.edits))
    if not parts:
        return ""
    return "The controls now ask for " + " and ".join(parts) + "."


class RecordPart:
    """The head scores' record of `apps.icl_heads.ICLHeadsView`."""

    def request_provenance(self) -> Provenance:
        """The record of the scores the page computes from its current inputs."""
        return icl_request(self._model.spec.name, self._fv_tasks, self._opts["n_prompts"],
                           self._opts["n_shots"], self._induction_kwargs(), list(self.edits))

    def shown_provenance(self) -> Provenance | None:
        """The shown scores' record (their ``shown_record`` attr)."""
        if self.scores is None or RECORD not in self.scores.attrs:
            return None
        return Provenance.from_json(self.scores.attrs[RECORD])

    def requested_provenance(self) -> Provenance:
        return self.request_provenance()

    @staticmethod
    def with_record(ds: xr.Dataset, wanted: Provenance) -> xr.Dataset:
        """``ds`` with the record ``wanted`` (timed now) in its attrs."""
        ds.attrs[RECORD] = dataclasses.replace(wanted, computed_at=computed_at_now()).to_json()
        return ds

    #: The button a stale note names: the page's own.
    compute_action = "Compute scores"

    def waiting_state(self) -> str:
        """The end of the stale note (`ShownResult.stale_note`): recomputing (a settings
        change or an edit starts the rescore by itself), failed, or the button to press."""
        return recompute_state(running=bool(self.running), failed=bool(self.error),
                               action=self.compute_action)

    def stale_markdown(self, *_: Any) -> str:
        """The stale note as the page shows it ('' while the scores are of the inputs)."""
        return outdated_markdown(self.stale_note())
