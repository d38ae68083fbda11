"""Turn the views on in a Jupyter notebook, offline: `extension` is every notebook's one call.

Panel's and HoloViews' notebook extensions load BokehJS, Panel's JavaScript and their styles
from a CDN unless told otherwise; a lab with no network (or behind a firewall) then shows
nothing where a plot or a view should be, and reports no error. `extension` loads them
inline from the installed packages and gives every plot the pages' Bokeh theme
(`theme.bokeh_theme`: the same fonts, ticks that never collide), so a view in a notebook
draws as it does in the gallery.

    from apps import notebook
    notebook.extension()

Then display a view (``LensView(model)``) or a HoloViews element as the last expression of
a cell. Widgets in the output talk to the kernel through Panel's JupyterLab extension
(installed with Panel); what the kernel sends back after a widget's change (a new plot, a
pane's new text) carries its style sheets inline too, where Panel alone would link its CDN.
A notebook exported to HTML (``jupyter nbconvert --to html``) keeps
its plots, drawn from the embedded data, with no network either.

Two things the served pages have stay off here, because Panel loads them from its CDN even
in inline mode: the Fast design's web components (ES modules; the widgets keep Panel's own
look) and the notification toasts (`theme.notify` then only logs).
"""
from __future__ import annotations

from typing import Any

__all__ = ["extension"]


def extension(**panel_options: Any) -> None:
    """Load everything the views and plots need into this notebook, from the installed packages.

    HoloViews with its Bokeh backend and Panel, both with their JavaScript and styles inlined
    (nothing is fetched from outside the notebook server), views stretched to the output
    area's width, and the pages' Bokeh theme. Call it once, before the first view or plot.

    Parameters
    ----------
    **panel_options
        Passed on to `panel.extension`, over the defaults here (``inline=True``,
        ``notifications=False``, ``sizing_mode="stretch_width"``).
    """
    import holoviews as hv
    import panel as pn
    from holoviews.core.dimension import LabelledData

    from apps import theme

    options = {"inline": True, "notifications": False, "sizing_mode": "stretch_width",
               **panel_options}
    # HoloViews first: its notebook hooks (a displayed element renders as a plot) and its
    # Bokeh renderer; inline=False there would publish CDN script tags.
    hv.extension("bokeh", inline=True, logo=False)
    # pages call hv.extension("bokeh") when imported; in this notebook that loads inline too
    hv.extension.inline = True
    # the Head atlas view's table (Tabulator): its script must be in the notebook before a
    # view shows one, as in the gallery's first page
    pn.extension(*EXTENSIONS, **options)
    hv.renderer("bokeh").theme = theme.bokeh_theme()
    # HoloViews' own notebook output links Panel's style sheets on the CDN; shown through
    # Panel they are inlined, as every view's are.
    hv.Store.set_display_hook("html+js", LabelledData, _shown_by_panel)
    _inline_style_sheets_of_updates()
    if not isinstance(hv.extension, _LoadedOnce):
        hv.extension = _LoadedOnce(hv.extension)


class _LoadedOnce:
    """``hv.extension`` once `extension` ran: a page module calls ``hv.extension("bokeh")``
    when imported, and in a notebook each such call would display BokehJS inline again
    (3-4 MB of output per page imported). A backend already loaded is made current and
    nothing is displayed; any other call goes to HoloViews' own extension."""

    def __init__(self, inner: Any) -> None:
        object.__setattr__(self, "_inner", inner)

    def __call__(self, *backends: str, **params: Any) -> Any:
        import holoviews as hv

        if backends and all(b in hv.Store.renderers for b in backends) and not (
                set(params) - {"logo", "inline"}):
            hv.Store.set_current_backend(backends[0])
            return None
        return self._inner(*backends, **params)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)


EXTENSIONS = ("tabulator",)
"""Panel extensions whose scripts `extension` loads (inline) for the views."""


def _inline_style_sheets_of_updates() -> None:
    """Inline the style sheets of every update a widget's change sends to the notebook.

    Panel inlines the style sheets of a view's first output (`config.inline`), but the
    models an update carries (a pane's new text, a view's new plot, a layout's new child)
    get theirs from the component's and the design's style sheet lists, which link Panel's
    CDN (`panel.io.resources.CDN_DIST`) in a notebook. Every update to a notebook's output
    passes `panel.io.model.diff`, which first applies `monkeypatch_events` to the events it
    sends: wrapped here, it also replaces each linked style sheet under ``CDN_DIST`` by its
    copy in the installed package, in the events' new values and on the models they carry.
    """
    from panel.io import model as panel_model

    patch = panel_model.monkeypatch_events
    if getattr(patch, "_inlines_style_sheets", False):
        return

    def monkeypatch_events(events: Any) -> None:
        _inline_events(events)
        patch(events)

    monkeypatch_events._inlines_style_sheets = True
    panel_model.monkeypatch_events = monkeypatch_events


def _inline_events(events: Any) -> None:
    """Replace the CDN style sheets that ``events`` would send by inline copies."""
    from bokeh.document.events import ModelChangedEvent
    from bokeh.model.util import collect_models
    from bokeh.models import UIElement

    for event in events:
        if not isinstance(event, ModelChangedEvent):
            continue
        if event.attr == "stylesheets" and isinstance(event.new, list):
            inlined = _inlined(event.new)
            if inlined != event.new:
                event.new = inlined
                event.model.stylesheets = inlined  # what a later full render sends too
        for model in collect_models(event.new):
            if isinstance(model, UIElement):
                inlined = _inlined(model.stylesheets)
                if inlined != model.stylesheets:
                    model.stylesheets = inlined


def _inlined(stylesheets: list) -> list:
    """``stylesheets`` with each one linked under Panel's CDN replaced by its installed copy
    (`panel.io.notebook.replace_inline_css`, which leaves any other untouched)."""
    from bokeh.models import ImportedStyleSheet
    from panel.io.notebook import replace_inline_css

    return [replace_inline_css(sheet) if isinstance(sheet, ImportedStyleSheet) else sheet
            for sheet in stylesheets]


def _shown_by_panel(obj: Any) -> tuple[dict, dict] | None:
    """A HoloViews object's notebook output, rendered as a Panel pane (inline resources)."""
    import holoviews as hv
    import panel as pn

    if "html" not in hv.Store.display_formats:
        return None
    return pn.panel(obj)._repr_mimebundle_()
