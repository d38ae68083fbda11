"""The Logit lens page's record of its shown result (`apps._provenance.Provenance`) and
the words written from it, never from the current widgets: the heading over the heatmaps.
The functions are pure (the tests call them on a hand-built record); `LensRecordPart` is the
page's side."""
from __future__ import annotations

from typing import Any

from apps._page_provenance import result_heading
from apps._provenance import Provenance
from explorer.interventions import Edit, edit_from_dict

__all__ = ["lens_request", "lens_params", "lens_heading", "LensRecordPart"]


def lens_request(p: dict[str, Any]) -> dict[str, Any]:
    """The page's own inputs of a lens run at parameters ``p`` (what a change of makes the
    shown lens stale), as numbers and text (a record read back from JSON equals it): the
    steering strength, layer and contrast prompts (None at strength 0, where they change
    nothing) and the top-k."""
    steered = p["alpha"] != 0
    return {"alpha": float(p["alpha"]),
            "steer_layer": int(p["steer_layer"]) if steered else None,
            "contrast_a": str(p["contrast_a"]) if steered else None,
            "contrast_b": str(p["contrast_b"]) if steered else None,
            "top_k": int(p["k"])}


def lens_params(prov: Provenance, current: dict[str, Any]) -> dict[str, Any]:
    """The run parameters of the lens ``prov`` records (`lens_request`'s inverse); where it
    ran unsteered, the steering layer and contrast prompts are ``current``'s."""
    r = dict(prov.request)
    p = {**current, "prompt": prov.prompts[0], "alpha": r["alpha"], "k": r["top_k"]}
    if r["alpha"] != 0:
        p.update(steer_layer=r["steer_layer"], contrast_a=r["contrast_a"],
                 contrast_b=r["contrast_b"])
    return p


def lens_heading(prov: Provenance) -> str:
    """The line over the heatmaps: the shown lens's prompt, model and workspace edits
    (``Logit lens of 'The cat' (tiny-llama), clean and with 1 workspace edit``). The
    steering is the heatmap title's (it names a preview's strength as the slider moves)."""
    return result_heading("Logit lens", prov)


class LensRecordPart:
    """The records of `apps.lens.LensView`: what a run, the page's current inputs and the
    shown edited lens were computed on."""

    def lens_record(self, p: dict[str, Any], edits: list[Edit]) -> Provenance:
        """The record of the lens at run parameters ``p`` with workspace ``edits``."""
        return self.record("logit lens", p["prompt"], edits, request=lens_request(p))

    def requested_provenance(self) -> Provenance:
        """What the page would compute now: its steering and top-k, the workspace's (else
        its own) prompt and edits."""
        prompt, edits = self.current_inputs()
        p = {**self._run_params(), "prompt": prompt}
        shown = self.shown_record
        if self.preview is not None and shown is not None and shown.setting("preview"):
            # a preview follows the slider's moves (the exact lens follows on release): its
            # strength is the hand's, not an old input
            p["alpha"] = dict(shown.request)["alpha"]
        return self.lens_record(p, edits)

    def heading(self, prov: Provenance) -> str:
        return lens_heading(prov)

    def _shown_extra_edits(self, p: dict[str, Any]) -> list[Edit]:
        """The workspace edits of the shown edited lens (its records after the steering);
        before any result, the page's."""
        if self.shown_record is None:
            return list(self.edits)
        if self.edited_result is None:
            return []
        records = [edit_from_dict(d) for d in self.edited_result.attrs.get("edits", [])]
        return records[1 if p["alpha"] != 0 else 0:]
