"""The Logit lens page's words about its shown result, from the result's record
(`apps._provenance.Provenance`), never from the current widgets: the heading over the
heatmaps. Pure functions: the tests call them on a hand-built record."""
from __future__ import annotations

from typing import Any

from apps._page_provenance import result_heading
from apps._provenance import Provenance

__all__ = ["lens_request", "lens_heading"]


def lens_request(p: dict[str, Any]) -> dict[str, Any]:
    """The page's own inputs of a lens run at parameters ``p`` (what a change of makes the
    shown lens stale), as text and numbers (a record read back from JSON equals it): the
    steering (``none`` at strength 0, where the contrast prompts and layer change nothing)
    and the top-k."""
    steering = "none"
    if p["alpha"] != 0:
        steering = (f"alpha {float(p['alpha'])!r} at layer {int(p['steer_layer'])}, contrast "
                    f"A {str(p['contrast_a'])!r} - B {str(p['contrast_b'])!r}")
    return {"steering": steering, "top_k": int(p["k"])}


def lens_heading(prov: Provenance) -> str:
    """The line over the heatmaps: the shown lens's prompt, model and workspace edits
    (``Logit lens of 'The cat' (tiny-llama), clean and with 1 workspace edit``). The
    steering is the heatmap title's (it names a preview's strength as the slider moves)."""
    return result_heading("Logit lens", prov)
