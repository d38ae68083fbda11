"""Weak references to the Bokeh models a page's plots rendered (data sources, figures, glyphs),
kept by HoloViews hooks so that the page can change them in place: the logit lens page's
heatmap and the saturation page's detail plots."""
from __future__ import annotations

import weakref
from typing import Any

__all__ = ["keep_drawn", "live_drawn", "live_drawn_by_key", "shown_figures"]


def keep_drawn(refs: list[weakref.ref], obj: Any) -> None:
    """Add a weak reference to ``obj`` (a rendered Bokeh model) to ``refs``, unless ``obj``
    is None or ``refs`` holds one already."""
    if obj is not None and not any(r() is obj for r in refs):
        refs.append(weakref.ref(obj))


def live_drawn(refs: list[weakref.ref]) -> list[Any]:
    """The models of ``refs`` still alive, in order; the references to gone ones are
    dropped from ``refs``."""
    pairs = [(r, r()) for r in refs]
    refs[:] = [r for r, obj in pairs if obj is not None]
    return [obj for _, obj in pairs if obj is not None]


def live_drawn_by_key(refs: dict[str, list[weakref.ref]]) -> dict[str, list[Any]]:
    """`live_drawn` of each list of ``refs`` (e.g. the data sources per glyph)."""
    return {key: live_drawn(values) for key, values in refs.items()}


def shown_figures(panes: list[weakref.ref]) -> set[int]:
    """The ids of the Bokeh figures the HoloViews panes of ``panes`` show now, one per
    rendered root. A figure a hook kept may be one the browser no longer holds (the pane
    drew anew in the same batch of changes); a change to it then names a model the page
    does not know, and BokehJS stops on "reference ... isn't known"."""
    out: set[int] = set()
    for ref in panes:
        pane = ref()
        for plot, _child in (getattr(pane, "_plots", None) or {}).values():
            state = getattr(plot, "state", None)
            if state is not None:
                out.add(id(state))
    return out
